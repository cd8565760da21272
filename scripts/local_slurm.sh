#!/usr/bin/env bash
# A Slurm cluster of several nodes on this one machine, to try `ftjax launch --emit slurm` for real.
#
#   scripts/local_slurm.sh up       # install slurm + munge if missing (apt, as root), start the daemons
#   scripts/local_slurm.sh status   # sinfo of the cluster
#   scripts/local_slurm.sh env      # the line to eval so that sbatch, srun, squeue find this cluster
#   scripts/local_slurm.sh down     # stop the daemons this script started (and their jobs)
#
# One slurmctld and N slurmd daemons (`slurmd -N nK`), each a node of its own: NodeName=n1..nN, all
# at NodeAddr=127.0.0.1, one port per node. Authentication is munge (one munged). Every file lives
# under $FTJAX_SLURM_DIR (default /tmp/ftjax-slurm): slurm.conf, logs, spool, state, pid files. The
# commands need SLURM_CONF=$FTJAX_SLURM_DIR/slurm.conf (`eval "$(scripts/local_slurm.sh env)"`).
# Both `up` and `down` are idempotent: `up` on a running cluster checks it and returns.
#
# Settings (environment): FTJAX_SLURM_DIR, FTJAX_SLURM_NODES (4), FTJAX_SLURM_CPUS (CPUs per node,
# 4: more than this machine has is fine, Slurm only counts them), FTJAX_SLURM_PORT (16817: the
# controller's; node K listens on PORT+K).
set -euo pipefail

STATE=${FTJAX_SLURM_DIR:-/tmp/ftjax-slurm}
NODES=${FTJAX_SLURM_NODES:-4}
CPUS=${FTJAX_SLURM_CPUS:-4}
PORT=${FTJAX_SLURM_PORT:-16817}
CONF="$STATE/slurm.conf"
MUNGE_SOCKET=/run/munge/munge.socket.2
export SLURM_CONF="$CONF"

log() { echo "local_slurm: $*" >&2; }
die() { log "error: $*"; exit 1; }

alive() {  # alive PIDFILE: the process of the pid file runs
  local pid
  [ -s "$1" ] || return 1
  pid=$(cat "$1") || return 1
  kill -0 "$pid" 2>/dev/null
}

install_packages() {
  local missing=()
  command -v slurmctld >/dev/null || missing+=(slurmctld)
  command -v slurmd >/dev/null || missing+=(slurmd)
  command -v sbatch >/dev/null || missing+=(slurm-client)
  command -v munged >/dev/null || missing+=(munge)
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$(id -u)" -eq 0 ] || die "missing ${missing[*]}: run as root, or install them (apt-get install ${missing[*]})"
  log "installing ${missing[*]} (apt-get; output in $STATE/apt.log)"
  mkdir -p "$STATE"
  export DEBIAN_FRONTEND=noninteractive
  if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >"$STATE/apt.log" 2>&1; then
    tail -n 20 "$STATE/apt.log" >&2
    die "could not install ${missing[*]}"
  fi
}

write_conf() {
  local host k
  host=$(hostname -s)
  mkdir -p "$STATE/ctld" "$STATE/log" "$STATE/run"
  {
    echo "# written by scripts/local_slurm.sh: $NODES nodes on this machine"
    echo "ClusterName=ftjax-local"
    echo "SlurmctldHost=$host(127.0.0.1)"
    echo "SlurmctldPort=$PORT"
    echo "SlurmUser=root"
    echo "SlurmdUser=root"
    echo "AuthType=auth/munge"
    echo "CryptoType=crypto/munge"
    echo "StateSaveLocation=$STATE/ctld"
    echo "SlurmdSpoolDir=$STATE/spool/%n"
    echo "SlurmctldPidFile=$STATE/run/slurmctld.pid"
    echo "SlurmdPidFile=$STATE/run/slurmd-%n.pid"
    echo "SlurmctldLogFile=$STATE/log/slurmctld.log"
    echo "SlurmdLogFile=$STATE/log/slurmd-%n.log"
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "SwitchType=switch/none"
    echo "MpiDefault=none"
    echo "ReturnToService=2"
    echo "SlurmdTimeout=30"
    echo "InactiveLimit=0"
    echo "KillWait=5"
    echo "MinJobAge=600"
    echo "SchedulerType=sched/backfill"
    echo "SchedulerParameters=sched_interval=1,bf_interval=1"  # start a job as soon as its dependency is met
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_Core"
    echo "SlurmdParameters=config_overrides"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "AccountingStorageType=accounting_storage/none"
    echo "JobCompType=jobcomp/none"
    for k in $(seq 1 "$NODES"); do
      echo "NodeName=n$k NodeAddr=127.0.0.1 NodeHostname=$host Port=$((PORT + k)) CPUs=$CPUS State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=n[1-$NODES] Default=YES MaxTime=INFINITE State=UP"
  } > "$CONF.tmp"
  mv "$CONF.tmp" "$CONF"
}

start_munge() {
  if munge -n -S "$MUNGE_SOCKET" >/dev/null 2>&1; then
    return 0  # a munged answers already (ours, or the machine's)
  fi
  [ -s /etc/munge/munge.key ] || { log "creating /etc/munge/munge.key"; mungekey --create --keyfile=/etc/munge/munge.key; }
  chown munge:munge /etc/munge/munge.key && chmod 600 /etc/munge/munge.key
  mkdir -p /run/munge "$STATE/munge"
  chown munge:munge /run/munge "$STATE/munge"
  chmod 755 /run/munge
  chmod 700 "$STATE/munge"
  runuser -u munge -- munged --socket="$MUNGE_SOCKET" --pid-file="$STATE/munge/munged.pid" \
    --log-file="$STATE/munge/munged.log" --seed-file="$STATE/munge/munged.seed"
  for _ in $(seq 50); do
    if munge -n -S "$MUNGE_SOCKET" >/dev/null 2>&1; then
      cp "$STATE/munge/munged.pid" "$STATE/run/munged.pid"  # ours: `down` stops it
      return 0
    fi
    sleep 0.1
  done
  die "munged did not start; see $STATE/munge/munged.log"
}

nodes_idle() {  # every node is up (idle, mixed or allocated)
  local states
  states=$(sinfo -h -N -o '%T' 2>/dev/null) || return 1
  [ "$(echo "$states" | grep -c -E '^(idle|mixed|allocated|completing)$')" -eq "$NODES" ]
}

up() {
  [ "$(id -u)" -eq 0 ] || die "run as root (slurmd starts jobs as their users)"
  install_packages
  mkdir -p "$STATE"
  if alive "$STATE/run/slurmctld.pid" && nodes_idle; then
    log "already up: $NODES nodes (SLURM_CONF=$CONF)"
    return 0
  fi
  down quiet
  write_conf
  start_munge
  local k
  for k in $(seq 1 "$NODES"); do mkdir -p "$STATE/spool/n$k"; done
  slurmctld -f "$CONF" -i  # -i: ignore (clear) state left by an earlier cluster in this directory
  for k in $(seq 1 "$NODES"); do
    slurmd -f "$CONF" -N "n$k"
  done
  for _ in $(seq 150); do
    if nodes_idle; then
      log "up: $NODES nodes n[1-$NODES] (SLURM_CONF=$CONF)"
      sinfo >&2
      return 0
    fi
    sleep 0.2
  done
  sinfo -N >&2 || true
  tail -n 20 "$STATE/log/slurmctld.log" >&2 || true
  die "the nodes did not come up in 30 s; logs in $STATE/log"
}

stop_pidfile() {  # stop_pidfile FILE: SIGTERM the process, SIGKILL after 5 s
  local pid
  alive "$1" || { rm -f "$1"; return 0; }
  pid=$(cat "$1")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 50); do
    kill -0 "$pid" 2>/dev/null || { rm -f "$1"; return 0; }
    sleep 0.1
  done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$1"
}

down() {
  local quiet=${1:-}
  [ -d "$STATE/run" ] || { [ -n "$quiet" ] || log "not up (no $STATE/run)"; return 0; }
  if [ -f "$CONF" ] && alive "$STATE/run/slurmctld.pid"; then
    scancel --full --quiet --user="$(id -un)" 2>/dev/null || true  # the jobs first: their steps end cleanly
    for _ in $(seq 150); do  # up to 30 s: every step's processes end with its job
      [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
      sleep 0.2
    done
  fi
  local f
  for f in "$STATE"/run/slurmd-*.pid; do
    [ -e "$f" ] && stop_pidfile "$f"
  done
  stop_pidfile "$STATE/run/slurmctld.pid"
  stop_pidfile "$STATE/run/munged.pid"
  [ -n "$quiet" ] || log "down"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) sinfo -N -l ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 up|down|status|env" >&2; exit 2 ;;
esac
