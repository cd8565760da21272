"""`ftjax launch ... --emit slurm|k8s DIR`: the same job as cluster job files.

One job per replica (its H hosts are the job's H tasks/pods) and the coordinator as a job of its
own, so that the cluster's scheduler plays the launcher's supervisor: a replica whose host dies is
restarted as a whole, and only that replica. Every name derives from the job's name (`--name`,
default `ftjax-<config>-<4 hex digits>`), so that two jobs share a Slurm account or a Kubernetes
namespace. The coordinator is told how many replicas to wait for at job start
(`--expected-replicas`), and ends with the job: it exits 0 once every replica has reached the last
step and left, and 3 when no replica has been alive for `--idle-exit-s` (ftjax/coordinator/lifetime.py).

- **slurm** (see `_slurm`): `DIR/submit.sh` submits `coordinator.sbatch`, one `replica-R.sbatch`
  per replica (started once the coordinator runs: `--dependency=after`), and `finish.sbatch` (once
  every replica ended: `afterany`). No fixed port: the coordinator and each replica's
  `jax.distributed` service take free ports and publish them. Jobs are `--requeue`able (a dead node
  sends the job back to the queue; the requeued script records the requeue as a failure) and
  restart their replica whole after a failed step, up to --max-restarts times in all. With
  `ft.on_host_loss: reduce` a replica's job is `--no-kill` and, when Slurm reports a node of its
  allocation lost, restarts at once on the nodes up, at reduced degree, and whole once they all are
  (`_SLURM_REDUCE`). DIR must be on a filesystem the nodes share; the run directory is
  `DIR/run`, laid out like `ftjax launch`'s, so `ftjax.runs.summary` reads it (finish.sbatch
  writes `run/launcher.jsonl` and `run/summary.json`).
- **k8s** (see `_k8s`): `DIR/token.yaml` (the token Secret, mode 600), `DIR/coordinator.yaml` (the
  config ConfigMap, optionally the PersistentVolumeClaim for the outputs, the coordinator's Job and
  Service) and one JobSet per
  replica in `DIR/replica-R.yaml` (the JobSet controller, kubernetes-sigs/jobset, must be
  installed): a failed pod fails its Job, and the JobSet recreates that replica's pods, all of them,
  up to --max-restarts times (also with `ft.on_host_loss: reduce`: a JobSet cannot shrink a
  replica, docs/design/operations.md "Cluster launch"). The coordinator serves `grpc.health.v1` for its readiness and
  liveness probes. Apply with `kubectl apply -f DIR/`, remove with `kubectl delete -f DIR/`.

The replica command is `ftjax train` exactly as `LocalJob` runs it, with the config resolved (every
override applied) so the cluster runs what was validated here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import secrets
import shlex
from dataclasses import dataclass
from pathlib import Path

import yaml

from ftjax.base.env import TOKEN_ENV
from ftjax.config import Config, load_config
from ftjax.launch.supervisor import reduced_degree
from ftjax.runtime.args import option

# Kubernetes: a pod has the node's ports to itself, so the ports are fixed there. Slurm: none is.
COORDINATOR_PORT = 29400
HTTP_PORT = 29401
DIST_PORT = 29500  # each replica's own jax.distributed service, on its host 0
RUN_DIR = "/ftjax-run"  # k8s: where replicas write their outputs (a PVC with --pvc, else an emptyDir)
MAX_NAME = 30  # a JobSet's pod hostnames, <name>-replica-R-host-0-H, must fit in 63 characters
IDLE_EXIT_S = 900.0  # the coordinator ends when no replica has been alive this long
FS_GROUP = 1000  # k8s: volumes writable by the image's user (the Dockerfile's ftjax, uid and gid 1000)


class EmitError(ValueError):
    """Files that cannot be written (unknown kind, DIR not empty, a bad option); nothing was written."""


class Shell(str):
    """An argument that is shell text (a variable expansion), not a literal to quote."""


def shell_join(args: list[str]) -> str:
    return " ".join(a if isinstance(a, Shell) else shlex.quote(a) for a in args)


# --- options ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EmitOptions:
    """What the cluster files ask of the cluster. Slurm-only: time, partition, account, exclusive.
    Kubernetes-only: image, gpu_resource, pvc, pvc_size, storage_class."""

    name: str | None = None  # default: ftjax-<config stem>-<4 hex digits>
    image: str = "ftjax:latest"
    max_restarts: int = 10
    restart_delay_s: float = 1.0
    gpus_per_host: int = 0
    gpu_resource: str = "nvidia.com/gpu"
    cpus_per_host: int | None = None
    mem_per_host_gib: float | None = None
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    exclusive: bool = False
    pvc: str | None = None
    pvc_size: str | None = None
    storage_class: str | None = None
    idle_exit_s: float = IDLE_EXIT_S


_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
_QUANTITY = re.compile(r"\d+(\.\d+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")
_SLURM_TIME = re.compile(r"\d+(-\d+)?(:\d+){0,2}")  # minutes, m:s, h:m:s, d-h, d-h:m, d-h:m:s
_SLURM_WORD = re.compile(r"[A-Za-z0-9_.,-]+")
_RESOURCE = re.compile(r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[a-z0-9]([-a-z0-9._]*[a-z0-9])?")


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """The options of `ftjax launch --emit` (besides --max-restarts and --restart-delay-s)."""
    _add_job_arguments(group)
    _add_host_arguments(group)
    _add_slurm_arguments(group)
    _add_claim_arguments(group)
    group.add_argument(
        "--idle-exit-s",
        type=float,
        default=IDLE_EXIT_S,
        metavar="S",
        help=f"the coordinator ends when no replica has been alive this long ({IDLE_EXIT_S:g})",
    )


def _add_job_arguments(group: argparse._ArgumentGroup) -> None:
    """--name and --image."""
    group.add_argument(
        "--name",
        default=None,
        help=f"the job's name: every job, resource and file name derives from it (a DNS label of "
        f"at most {MAX_NAME} characters; default: ftjax-<config>-<4 hex digits>)",
    )
    group.add_argument("--image", default="ftjax:latest", help="container image (k8s; see the Dockerfile)")


def _add_host_arguments(group: argparse._ArgumentGroup) -> None:
    """What each replica host asks for: GPUs, CPUs, memory."""
    group.add_argument(
        "--gpus-per-host",
        type=int,
        default=0,
        metavar="G",
        help="GPUs of each replica host (slurm: --gpus-per-node; k8s: a limit of --gpu-resource)",
    )
    group.add_argument("--gpu-resource", default="nvidia.com/gpu", help="k8s: the GPUs' resource name")
    option(
        group,
        "--cpus-per-host",
        "C",
        type=int,
        help="CPUs of each replica host (slurm: --cpus-per-task; k8s: a request)",
    )
    option(
        group,
        "--mem-per-host-gib",
        "GIB",
        type=float,
        help="memory of each replica host (slurm: --mem; k8s: a request and a limit)",
    )


def _add_slurm_arguments(group: argparse._ArgumentGroup) -> None:
    """The sbatch-only options: time, partition, account, exclusive."""
    option(group, "--slurm-time", "TIME", help="slurm: each job's time limit (sbatch --time: MINUTES, H:M:S, D-H:M:S)")
    group.add_argument(
        "--slurm-partition", default=None, metavar="P", help="slurm: the partition(s) (sbatch --partition)"
    )
    group.add_argument(
        "--slurm-account", default=None, metavar="A", help="slurm: the account to charge (sbatch --account)"
    )
    group.add_argument("--slurm-exclusive", action="store_true", help="slurm: replica jobs take their nodes whole")


def _add_claim_arguments(group: argparse._ArgumentGroup) -> None:
    """The k8s outputs' PersistentVolumeClaim: --pvc, --pvc-size, --storage-class."""
    option(
        group,
        "--pvc",
        "CLAIM",
        help="k8s: write the outputs (metrics, checkpoints) to this PersistentVolumeClaim "
        "(ReadWriteMany), under <name>/; default: an emptyDir, lost with the pod",
    )
    group.add_argument(
        "--pvc-size", default=None, metavar="SIZE", help="k8s: also create the --pvc claim, of this size (e.g. 100Gi)"
    )
    group.add_argument("--storage-class", default=None, help="k8s: the storage class of the claim --pvc-size creates")


def options_from_args(args: argparse.Namespace) -> EmitOptions:
    """EmitOptions from `ftjax launch`'s arguments; EmitError naming the option if one is bad."""
    options = EmitOptions(
        name=args.name,
        image=args.image,
        max_restarts=args.max_restarts,
        restart_delay_s=args.restart_delay_s,
        gpus_per_host=args.gpus_per_host,
        gpu_resource=args.gpu_resource,
        cpus_per_host=args.cpus_per_host,
        mem_per_host_gib=args.mem_per_host_gib,
        time=args.slurm_time,
        partition=args.slurm_partition,
        account=args.slurm_account,
        exclusive=args.slurm_exclusive,
        pvc=args.pvc,
        pvc_size=args.pvc_size,
        storage_class=args.storage_class,
        idle_exit_s=args.idle_exit_s,
    )
    check_options(options)
    return options


def check_options(o: EmitOptions) -> None:
    def bad(flag: str, value, why: str) -> EmitError:
        return EmitError(f"{flag}: {why} (got {value!r})")

    if o.name is not None and (len(o.name) > MAX_NAME or not _DNS_LABEL.fullmatch(o.name)):
        raise bad(
            "--name",
            o.name,
            f"must be a DNS label of at most {MAX_NAME} characters "
            "(lower-case letters, digits and '-', starting with a letter)",
        )
    if not o.image or any(c.isspace() for c in o.image):
        raise bad("--image", o.image, "must be an image name")
    if o.gpus_per_host < 0:
        raise bad("--gpus-per-host", o.gpus_per_host, "must be >= 0")
    if not _RESOURCE.fullmatch(o.gpu_resource):
        raise bad("--gpu-resource", o.gpu_resource, "must be a resource name like nvidia.com/gpu")
    if o.cpus_per_host is not None and o.cpus_per_host < 1:
        raise bad("--cpus-per-host", o.cpus_per_host, "must be >= 1")
    if o.mem_per_host_gib is not None and not (0 < o.mem_per_host_gib < float("inf")):
        raise bad("--mem-per-host-gib", o.mem_per_host_gib, "must be > 0")
    if o.time is not None and not _SLURM_TIME.fullmatch(o.time):
        raise bad("--slurm-time", o.time, "must be a Slurm time: MINUTES, H:M:S or D-H:M:S")
    for flag, value in (("--slurm-partition", o.partition), ("--slurm-account", o.account)):
        if value is not None and not _SLURM_WORD.fullmatch(value):
            raise bad(flag, value, "must be a Slurm name")
    for flag, value in (("--pvc", o.pvc), ("--storage-class", o.storage_class)):
        if value is not None and (len(value) > 253 or not _DNS_SUBDOMAIN.fullmatch(value)):
            raise bad(flag, value, "must be a Kubernetes object name")
    if o.pvc_size is not None:
        if o.pvc is None:
            raise bad("--pvc-size", o.pvc_size, "needs --pvc, the claim's name")
        if not _QUANTITY.fullmatch(o.pvc_size):
            raise bad("--pvc-size", o.pvc_size, "must be a Kubernetes quantity like 100Gi")
    if o.storage_class is not None and o.pvc_size is None:
        raise bad("--storage-class", o.storage_class, "applies to the claim --pvc-size creates")
    if not (0 < o.idle_exit_s < float("inf")):
        raise bad("--idle-exit-s", o.idle_exit_s, "must be > 0")


def default_name(config: str) -> str:
    stem = re.sub(r"[^a-z0-9]+", "-", Path(config).stem.lower()).strip("-") or "job"
    suffix = secrets.token_hex(2)
    return f"ftjax-{stem[: MAX_NAME - len('ftjax--') - len(suffix)].strip('-')}-{suffix}"


# --- the commands --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainCommand:
    """`ftjax train` as the hosts of a job's replicas run it (the same as LocalJob.start_replica):
    what every host's command shares; `args` adds one host's own."""

    config: str
    coordinator: str
    hosts: int
    overrides: tuple[str, ...] = ()

    def args(self, replica: int, out: str, process_id: str | None = None, dist: str | None = None) -> list[str]:
        """The arguments of a host of replica `replica` (`process_id` None: appended later, per task)."""
        args = ["ftjax", "train", self.config, *self.overrides, "--out", out, "--replica-id", str(replica)]
        args += ["--coordinator", self.coordinator, "--num-processes", str(self.hosts)]
        args += ["--process-id", process_id] if process_id is not None else []
        return args + (["--dist-address", dist] if dist else [])


def coordinator_args(
    cfg: Config, *, port: int | str, http_port: int | str, idle_exit_s: float, token_file: str | None = None
) -> list[str]:
    """`ftjax coordinator` arguments: the config's `coordinator:` settings, the replicas to wait for
    at job start, the job's last step (it ends with the job). It binds every interface (IPv6 and
    IPv4); replicas dial it by its node's address (Slurm) or its Service's name (k8s)."""
    port, http_port = (p if isinstance(p, str) else str(p) for p in (port, http_port))  # keep a Shell a Shell
    args = [
        "ftjax",
        "coordinator",
        "--port",
        port,
        "--http-port",
        http_port,
        *cfg.coordinator.flags(),
        "--expected-replicas",
        str(cfg.ft.replicas),
        "--final-step",
        str(cfg.steps),
        "--idle-exit-s",
        f"{idle_exit_s:g}",
    ]
    return args + (["--token-file", token_file] if token_file else [])


def emit(
    kind: str, out_dir: str | Path, config: str, overrides: list[str], *, options: EmitOptions | None = None
) -> list[Path]:
    """Write the job files of `kind` (slurm | k8s) into `out_dir`; returns the paths written."""
    if kind not in ("slurm", "k8s"):
        raise EmitError(f"--emit: unknown kind {kind!r}; choose slurm or k8s")
    options = options or EmitOptions()
    check_options(options)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise EmitError(f"--emit: {out} is not empty")
    cfg = load_config(config, overrides)
    if options.gpus_per_host and options.gpus_per_host < cfg.mesh.devices_per_host:
        raise EmitError(
            f"--gpus-per-host {options.gpus_per_host}: fewer than mesh.devices_per_host "
            f"({cfg.mesh.devices_per_host}), the devices each host trains on"
        )
    name = options.name or default_name(config)
    files = (_slurm if kind == "slurm" else _k8s)(cfg, name, options)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for file, (text, mode) in files.items():
        path = out / file
        # created with its mode (a token file is never readable by others, not even for a moment)
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "w") as f:
            os.fchmod(f.fileno(), mode)  # (not narrowed by the umask)
            f.write(text)
        written.append(path)
    return written


class _Dumper(yaml.SafeDumper):
    """YAML without anchors and aliases (`&id001`): a shared dict is written out each time."""

    def ignore_aliases(self, data) -> bool:
        return True


def _yaml(*docs: dict) -> str:
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False)


def _config_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(), sort_keys=False)


def _fill(template: str, **values) -> str:
    """`template` with each @KEY@ replaced (bash keeps its own braces and percent signs)."""
    for key, value in values.items():
        template = template.replace(f"@{key.upper()}@", str(value))
    left = re.search(r"@[A-Z_]+@", template)
    assert left is None, f"placeholder {left.group()} not filled"
    return template


# --- SLURM ------------------------------------------------------------------------------------------
_SLURM_PRELUDE = """set -euo pipefail
JOB_DIR=${FTJAX_JOB_DIR:-$SLURM_SUBMIT_DIR}
RUN_DIR="$JOB_DIR/run"
mkdir -p "$RUN_DIR"
now() { date +%s.%N; }
"""

_NODE_ADDRESS = """# the address Slurm reaches a node at (its NodeAddr; the node's name when they are the same)
node_address() {
  local addr
  addr=$(sinfo -h -N -n "$1" -o %o 2>/dev/null | head -n 1)
  addr=${addr:-$1}
  case $addr in *:*) echo "[$addr]" ;; *) echo "$addr" ;; esac
}
"""

_SLURM_COORDINATOR = """#!/bin/bash
@SBATCH@
# The coordinator of job @NAME@. Its state is soft: if it dies it is started again here, on the
# same ports; if its node dies, Slurm requeues this job and it publishes its new address. It ends
# with the job: 0 once every replica reached the last step and left, 3 once no replica has been
# alive for @IDLE@ s (finish.sbatch cancels it too).
@PRELUDE@
@NODE_ADDRESS@READY="$RUN_DIR/coordinator.json"
ADDRESS="$RUN_DIR/coordinator.address"
if [ ! -s "$JOB_DIR/token" ]; then
  echo "ftjax: no job token in $JOB_DIR/token" >&2
  exit 2
fi
HOST=$(node_address "$SLURMD_NODENAME")
rm -f "$ADDRESS" "$READY"
port=0
http_port=0
for attempt in $(seq 0 @MAX_RESTARTS@); do
  @COMMAND@ --advertise-host "$HOST" --ready-file "$READY" &
  pid=$!
  while [ ! -s "$READY" ] && kill -0 "$pid" 2>/dev/null; do sleep 0.2; done
  if [ -s "$READY" ]; then
    grpc=$(sed -n 's/.*"grpc": *"\\([^"]*\\)".*/\\1/p' "$READY")
    http=$(sed -n 's/.*"http": *"\\([^"]*\\)".*/\\1/p' "$READY")
    port=${grpc##*:}
    http_port=${http##*:}
    echo "$grpc" > "$ADDRESS.tmp" && mv "$ADDRESS.tmp" "$ADDRESS"
    printf '{"time": %s, "event": "coordinator_started", "grpc": "%s", "http": "%s", "slurm_job": "%s"}\\n' \\
      "$(now)" "$grpc" "$http" "$SLURM_JOB_ID" >> "$RUN_DIR/coordinator-events.jsonl"
    echo "coordinator of @NAME@ at $grpc (attempt $attempt); status page http://$http/" >&2
  fi
  code=0
  wait "$pid" || code=$?
  case $code in
    0) exit 0 ;;  # every replica finished
    2 | 3) exit "$code" ;;  # a bad option or token; or the job is gone
  esac
  printf '{"time": %s, "event": "coordinator_down", "cause": "exit %s"}\\n' "$(now)" "$code" \\
    >> "$RUN_DIR/coordinator-events.jsonl"
  echo "coordinator exited with $code; restarting it on port $port" >&2
  rm -f "$READY"
  sleep 1
done
exit 1
"""

_SLURM_REPLICA = """#!/bin/bash
@SBATCH@
# Replica @REPLICA@ of job @NAME@: @HOSTS@ host(s), one task each. One dead host ends the srun step
# (--kill-on-bad-exit) and the loop starts the replica again, which catches up from a live peer:
@POLICY@
# Only this replica restarts; @MAX_RESTARTS@ restarts in all, requeues included. host-P.log is
# process P's output (process P runs on host P of a whole replica).
@PRELUDE@
REPLICA=@REPLICA@
OUT="$RUN_DIR/replica-$REPLICA"
mkdir -p "$OUT"
if ! FTJAX_TOKEN=$(cat "$JOB_DIR/token") || [ -z "$FTJAX_TOKEN" ]; then
  echo "ftjax: no job token in $JOB_DIR/token" >&2
  exit 2
fi
export FTJAX_TOKEN
event() {  # event NAME [FIELDS]: a record of ftjax's run directory (run/launcher.jsonl, by finish.sbatch)
  printf '{"time": %s, "event": "%s", "replica": %d%s}\\n' "$(now)" "$1" "$REPLICA" "${2:+, $2}" \\
    >> "$OUT/slurm-events.jsonl"
}
lifecycle() {  # lifecycle FILE: a replica's last start or end record
  grep -E '"event": "(replica_started|replica_down|replica_done|not_restarted|abandoned)"' "$1" 2>/dev/null \\
    | tail -n 1 || true
}
restarts() {  # the restarts so far: every end but a leave to come back whole
  grep '"event": "replica_down"' "$OUT/slurm-events.jsonl" 2>/dev/null | grep -vc '"cause": "left"' || true
}
# shellcheck disable=SC2317  # run by the trap
requeued() {  # Slurm has requeued this job since it started (its restart count went up)
  local count
  count=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/.*Restarts=\\([0-9]*\\).*/\\1/p' | head -n 1)
  [ "${count:-0}" -gt "${SLURM_RESTART_COUNT:-0}" ]
}
running=0
# shellcheck disable=SC2317  # run by the trap
on_term() {  # Slurm stops the job: scancel, the time limit, or a requeue (`scontrol requeue`, a lost node)
  if [ "$running" -eq 1 ]; then
    if requeued; then
      event replica_down '"cause": "requeue", "codes": [143]'
    else
      event replica_down '"cause": "slurm", "codes": [143]'
    fi
  fi
  exit 143
}
trap on_term TERM
if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then
  case $(lifecycle "$OUT/slurm-events.jsonl") in
    *'"event": "replica_started"'*)  # it ran when its job was requeued (its node died): nobody recorded the end
      event replica_down "\\"cause\\": \\"requeue\\", \\"slurm_restart_count\\": $SLURM_RESTART_COUNT" ;;
  esac
fi
# The coordinator's address, which coordinator.sbatch publishes once it serves (this job starts
# after the coordinator's job started; a requeued coordinator publishes a new one).
coordinator_address() {
  local waited=0
  until [ -s "$RUN_DIR/coordinator.address" ]; do
    if [ -n "${FTJAX_COORDINATOR_JOB:-}" ] && [ -z "$(squeue -h -j "$FTJAX_COORDINATOR_JOB" -o %i 2>/dev/null)" ]; then
      echo "ftjax: the coordinator's job $FTJAX_COORDINATOR_JOB has ended; no coordinator to join" >&2
      return 1
    fi
    if [ "$waited" -ge @WAIT_S@ ]; then
      echo "ftjax: no coordinator address in $RUN_DIR/coordinator.address after @WAIT_S@ s" >&2
      return 1
    fi
    sleep 1
    waited=$((waited + 1))
  done
  cat "$RUN_DIR/coordinator.address"
}
@LEADER@# A peer finished and no other one runs: nobody holds the job's state any more, and this replica
# would only start the job over (`ftjax launch` does not restart it either).
job_over() {
  local f last finished=0 others=0
  for f in "$RUN_DIR"/replica-*/slurm-events.jsonl; do
    if [ "$f" = "$OUT/slurm-events.jsonl" ] || [ ! -s "$f" ]; then continue; fi
    last=$(lifecycle "$f")
    case $last in
      *'"event": "replica_done"'*) finished=1 ;;
      *'"event": "replica_started"'*) others=1 ;;
    esac
  done
  [ "$finished" -eq 1 ] && [ "$others" -eq 0 ]
}
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")  # host h runs on NODES[h]
@PLACEMENT@attempt=$(cat "$OUT/slurm-attempts" 2>/dev/null || echo 0)
while [ "$(restarts)" -le @MAX_RESTARTS@ ]; do
  if [ "$attempt" -gt 0 ] && job_over; then  # a restart, or this job requeued
    event not_restarted '"cause": "job_over"'
    echo "replica $REPLICA: not restarted: the job has finished, and no live peer holds its state" >&2
    exit 1
  fi
  attempt=$((attempt + 1))
  echo "$attempt" > "$OUT/slurm-attempts"
  COORDINATOR=$(coordinator_address) || exit 1
  place  # ON: the hosts of this attempt; LIVE: how many
  NODELIST=$(for h in "${ON[@]}"; do echo "${NODES[$h]}"; done | paste -sd, -)
  REDUCED=()
  if [ "$LIVE" -lt @HOSTS@ ]; then REDUCED=("mesh.live_hosts=$LIVE"); fi
@DIST@  for p in "${!ON[@]}"; do
    echo "--- attempt $attempt of replica $REPLICA (Slurm job $SLURM_JOB_ID): process $p on host ${ON[$p]}" \\
      "(${NODES[${ON[$p]}]}) at $(date)" >> "$OUT/host-$p.log"
  done
  reduced=false
  if [ "$LIVE" -lt @HOSTS@ ]; then reduced=true; fi
  event replica_started "\\"incarnation\\": $attempt, \\"slurm_job\\": \\"$SLURM_JOB_ID\\", \\"nodes\\": \\"$NODELIST\\", \\"hosts\\": [$(IFS=,; echo "${ON[*]}")], \\"reduced\\": $reduced"
  code=0
  leaving=0
  running=1
  # shellcheck disable=SC2016  # $@ and $SLURM_PROCID are the task's own, expanded by its bash
  srun --kill-on-bad-exit=1 --nodes="$LIVE" --ntasks="$LIVE" --ntasks-per-node=1 --nodelist="$NODELIST"@SRUN@ \\
    --output="$OUT/host-%t.log" --open-mode=append \\
    bash -c 'exec "$@" --process-id "$SLURM_PROCID"' ftjax-host \\
    @COMMAND@ &
  step=$!  # in the background: the TERM trap runs at once
  watch_step "$step"
  wait "$step" || code=$?
  running=0
  if [ "$code" -eq 0 ]; then
    event replica_done
    exit 0
  fi
  if [ "$leaving" -eq 1 ]; then  # asked to leave: its hosts are back, it restarts whole at once
    event replica_down "\\"cause\\": \\"left\\", \\"codes\\": [$code]"
    continue
  fi
  lost=$(lost_host)
  event replica_down "\\"cause\\": \\"exit\\", \\"codes\\": [$code]${lost:+, \\"host\\": $lost}"
  if [ -n "$lost" ]; then
    echo "replica $REPLICA: attempt $attempt ended with $code, host $lost (${NODES[$lost]}) is down;" \\
      "restarting on the hosts that are up" >&2
    continue
  fi
  echo "replica $REPLICA: attempt $attempt ended with $code; restarting the whole replica in @DELAY@ s" >&2
  sleep @DELAY@
done
event abandoned "\\"cause\\": \\"max_restarts\\""
echo "replica $REPLICA: out of restarts (@MAX_RESTARTS@)" >&2
exit 1
"""

# ft.on_host_loss: restart. Every attempt runs on every host.
_SLURM_WHOLE = """place() { ON=(@ALL_HOSTS@); LIVE=@HOSTS@; }
lost_host() { :; }
watch_step() {  # watch_step PID: until the step ends
  while kill -0 "$1" 2>/dev/null; do sleep 1; done
}
"""

# ft.on_host_loss: reduce (docs/design/operations.md, "Cluster launch"). The job is --no-kill: a failed node
# leaves the allocation and the batch script goes on. A host is up while its node is in the job's
# allocation and Slurm reports the node up (not down, drained or draining, failing, not responding).
_SLURM_REDUCE = """# The hosts a replica runs on when N of its @HOSTS@ are up (index N): the largest divisor of @HOSTS@ they
# cover, if at least ft.reduced_min_fraction (@MIN_FRACTION@) of it; 0: too few
DEGREE=(@DEGREES@)
allocated() {  # the nodes of this job's allocation now (a failed node leaves it)
  local nodes
  nodes=$(squeue -h -j "$SLURM_JOB_ID" -o %N 2>/dev/null | head -n 1)
  if [ -z "$nodes" ]; then printf '%s\\n' "${NODES[@]}"; return; fi  # no answer: no news
  scontrol show hostnames "$nodes"
}
hosts_up() {  # the hosts up, in order
  local h state here
  here=" $(allocated | paste -sd ' ' -) "
  for h in "${!NODES[@]}"; do
    case $here in *" ${NODES[$h]} "*) ;; *) continue ;; esac
    state=$(sinfo -h -N -n "${NODES[$h]}" -o %t 2>/dev/null | head -n 1)
    case $state in "" | alloc | mix | idle | comp | resv | plnd) echo "$h" ;; esac
  done
}
place() {  # ON: the hosts of the next attempt: every one, or the largest reduced degree of those up;
  # with too few up, every one again (as ft.on_host_loss: restart), or a new allocation if this
  # one has lost nodes
  local up
  mapfile -t up < <(hosts_up)
  LIVE=${DEGREE[${#up[@]}]}
  if [ "$LIVE" -gt 0 ]; then ON=("${up[@]:0:$LIVE}"); return; fi
  if [ "$(allocated | wc -l)" -lt @HOSTS@ ]; then
    echo "replica $REPLICA: too few hosts up, and only $(allocated | paste -sd, -) left in the allocation;" \\
      "requeueing the job" >&2
    scontrol requeue "$SLURM_JOB_ID"
    sleep 600 & wait $!  # until Slurm ends this script (the TERM trap)
  fi
  ON=(@ALL_HOSTS@)
  LIVE=@HOSTS@
}
lost_host() {  # the first host of the attempt that is down now (none: it was not a host's loss)
  local h up
  up=" $(hosts_up | paste -sd ' ' -) "
  for h in "${ON[@]}"; do
    case $up in *" $h "*) ;; *) echo "$h"; return ;; esac
  done
}
watch_step() {  # watch_step PID: until the step ends. Once every host of a reduced replica is up
  # again, ask it to leave (SIGTERM: it exits at a step boundary) and come back whole; end the
  # step if it has not left after ft.progress_timeout_s (@LEAVE_S@ s).
  local n=0 since=0
  while kill -0 "$1" 2>/dev/null; do
    sleep 1
    n=$((n + 1))
    if [ "$leaving" -eq 0 ] && [ "$LIVE" -lt @HOSTS@ ] && [ $((n % 3)) -eq 0 ] \\
        && [ "$(hosts_up | wc -l)" -eq @HOSTS@ ]; then
      leaving=1
      since=$n
      event back_to_full_degree "\\"hosts\\": [$(IFS=,; echo "${ON[*]}")]"
      scancel --signal=TERM "$SLURM_JOB_ID"  # every step's tasks, not this script
    elif [ "$leaving" -eq 1 ] && [ $((n - since)) -gt @LEAVE_S@ ]; then
      kill -TERM "$1" 2>/dev/null || true  # srun ends its step
    fi
  done
}
"""

_SLURM_LEADER = (
    _NODE_ADDRESS
    + """# process 0 (host 0 of a whole replica: the first node, where this script runs) serves the
# replica's jax.distributed cluster, on a port free here
FTJAX_PY=$(sed -n '1s/^#! *//p' "$(command -v ftjax)" 2>/dev/null || true)
FTJAX_PY=${FTJAX_PY%% *}
free_port() {
  "${FTJAX_PY:-python3}" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])' \\
    2>/dev/null || echo $((20000 + RANDOM % 20000))
}
"""
)

_SLURM_FINISH = """#!/bin/bash
@SBATCH@
# After every replica job of @NAME@ ended (afterany): stop the coordinator if it still runs, and
# write run/launcher.jsonl (the replicas' and the coordinator's records, in time order) and
# run/summary.json, as `ftjax launch` does for a local run.
@PRELUDE@
if [ -n "${FTJAX_COORDINATOR_JOB:-}" ]; then
  scancel "$FTJAX_COORDINATOR_JOB" 2>/dev/null || true
fi
ok=true
for r in $(seq 0 @LAST@); do
  grep -q '"event": "replica_done"' "$RUN_DIR/replica-$r/slurm-events.jsonl" 2>/dev/null || ok=false
done
{
  cat "$RUN_DIR/launch.jsonl"
  cat "$RUN_DIR"/replica-*/slurm-events.jsonl "$RUN_DIR/coordinator-events.jsonl" 2>/dev/null | sort -t ' ' -k 2,2n || true
  printf '{"time": %s, "event": "end", "ok": %s}\\n' "$(now)" "$ok"
} > "$RUN_DIR/launcher.jsonl.tmp"
mv "$RUN_DIR/launcher.jsonl.tmp" "$RUN_DIR/launcher.jsonl"
FTJAX_PY=$(sed -n '1s/^#! *//p' "$(command -v ftjax)" 2>/dev/null || true)
FTJAX_PY=${FTJAX_PY%% *}
"${FTJAX_PY:-python3}" -c 'import sys; from ftjax.runs.summary import write_summary; write_summary(sys.argv[1])' \\
  "$RUN_DIR" || echo "ftjax: no summary of $RUN_DIR" >&2
echo "job @NAME@ ended (ok: $ok); see $RUN_DIR/summary.json" >&2
"""

_SLURM_SUBMIT = """#!/bin/bash
# Submit job @NAME@: its coordinator, @REPLICAS@ replica(s) once the coordinator runs, and
# finish.sbatch once every replica has ended. This directory must be on a filesystem the nodes
# share; the nodes run the `ftjax` on PATH, with this environment (sbatch passes it on).
set -euo pipefail
cd "$(dirname "$0")"
JOB_DIR=$(pwd -P)
if [ -e run/launch.jsonl ]; then
  echo "submit.sh: $JOB_DIR/run holds an earlier submission; move it away first" >&2
  exit 2
fi
if [ ! -s token ]; then
  echo "submit.sh: no job token in $JOB_DIR/token" >&2
  exit 2
fi
mkdir -p run
printf '{"time": %s, %s}\\n' "$(date +%s.%N)" '@LAUNCH@' > run/launch.jsonl
export FTJAX_JOB_DIR="$JOB_DIR"
coordinator=$(sbatch --parsable coordinator.sbatch)
coordinator=${coordinator%%;*}
export FTJAX_COORDINATOR_JOB="$coordinator"
replicas=""
for r in $(seq 0 @LAST@); do
  id=$(sbatch --parsable --dependency="after:$coordinator" --kill-on-invalid-dep=yes "replica-$r.sbatch")
  replicas="$replicas:${id%%;*}"
done
finish=$(sbatch --parsable --dependency="afterany$replicas" finish.sbatch)
echo "job @NAME@: coordinator $coordinator, replicas ${replicas#:}, finish ${finish%%;*}"
echo "run directory: $JOB_DIR/run (the coordinator's address: run/coordinator.address)"
"""


def _sbatch(name: str, o: EmitOptions, *lines: str) -> str:
    lines = (
        f"--job-name={name}",
        *lines,
        *([f"--time={o.time}"] if o.time else []),
        *([f"--partition={o.partition}"] if o.partition else []),
        *([f"--account={o.account}"] if o.account else []),
        "--requeue",
        "--open-mode=append",
        "--output=slurm-%x-%j.out",
    )
    return "\n".join(f"#SBATCH {line}" for line in lines)


_SLURM_DIST = (
    '  DIST="$(node_address "${NODES[${ON[0]}]}"):$(free_port)"  # a new jax.distributed service each attempt\n'
)


def _slurm_placement(cfg: Config, o: EmitOptions) -> tuple[str, str]:
    """The replica script's `place`, `lost_host` and `watch_step` for `ft.on_host_loss`, and the
    policy its header states."""
    hosts = cfg.mesh.hosts
    if cfg.ft.on_host_loss != "reduce":
        return (
            _fill(_SLURM_WHOLE, hosts=hosts, all_hosts=" ".join(map(str, range(hosts)))),
            f"# the whole replica, after {o.restart_delay_s:g} s. A dead node ends the allocation: Slurm requeues\n"
            "# the job (--requeue) and it starts over here.",
        )
    degrees = [reduced_degree(hosts, up, cfg.ft.reduced_min_fraction) or 0 for up in range(hosts)] + [hosts]
    return (
        _fill(
            _SLURM_REDUCE,
            hosts=hosts,
            min_fraction=f"{cfg.ft.reduced_min_fraction:g}",
            degrees=" ".join(map(str, degrees)),
            all_hosts=" ".join(map(str, range(hosts))),
            leave_s=f"{math.ceil(cfg.ft.progress_timeout_s)}",
        ),
        "# when Slurm reports a node of the allocation lost (down, drained, not responding, or gone from\n"
        "# this --no-kill allocation), at once on the hosts up, at reduced degree (ft.on_host_loss:\n"
        f"# reduce), and whole again once they all are; else whole, after {o.restart_delay_s:g} s.\n"
        "# A lost batch node (host 0's) ends the allocation: Slurm requeues the job (--requeue) and it\n"
        "# starts over here.",
    )


def _slurm(cfg: Config, name: str, o: EmitOptions) -> dict[str, tuple[str, int]]:
    common = {
        "name": name,
        "prelude": _SLURM_PRELUDE.rstrip("\n"),
        "max_restarts": o.max_restarts,
        "last": cfg.ft.replicas - 1,
    }
    return {**_slurm_job_files(cfg, name, o, common), **_slurm_replica_files(cfg, name, o, common)}


def _slurm_job_files(cfg: Config, name: str, o: EmitOptions, common: dict) -> dict[str, tuple[str, int]]:
    """Every file but the replicas' scripts: config, token, coordinator.sbatch, finish.sbatch, submit.sh."""
    coordinator = shell_join(
        coordinator_args(
            cfg,
            port=Shell('"$port"'),
            http_port=Shell('"$http_port"'),
            idle_exit_s=o.idle_exit_s,
            token_file=Shell('"$JOB_DIR/token"'),
        )
    )
    launch = _slurm_launch_event(cfg, name, o)
    return {
        "config.yaml": (_config_yaml(cfg), 0o644),
        "token": (secrets.token_hex(16) + "\n", 0o600),
        "coordinator.sbatch": (
            _fill(
                _SLURM_COORDINATOR,
                **common,
                idle=f"{o.idle_exit_s:g}",
                command=coordinator,
                node_address=_NODE_ADDRESS,
                sbatch=_sbatch(f"{name}-coordinator", o, "--nodes=1", "--ntasks=1"),
            ),
            0o755,
        ),
        "finish.sbatch": (
            _fill(_SLURM_FINISH, **common, sbatch=_sbatch(f"{name}-finish", o, "--nodes=1", "--ntasks=1")),
            0o755,
        ),
        "submit.sh": (_fill(_SLURM_SUBMIT, **common, replicas=cfg.ft.replicas, launch=json.dumps(launch)[1:-1]), 0o755),
    }


def _slurm_launch_event(cfg: Config, name: str, o: EmitOptions) -> dict:
    """The `launch` event submit.sh writes to run/launch.jsonl."""
    return {
        "event": "launch",
        "config": "config.yaml",
        "overrides": [],
        "out": "run",
        "replicas": cfg.ft.replicas,
        "hosts": cfg.mesh.hosts,
        "devices": cfg.mesh.devices_per_host,
        "steps": cfg.steps,
        "scheduler": "slurm",
        "name": name,
        "max_restarts": o.max_restarts,
        "restart_delay_s": o.restart_delay_s,
    }


def _slurm_resources(o: EmitOptions) -> tuple[list[str], str]:
    """A replica host's resources: as sbatch options, and as srun's options."""
    resources, srun = [], ""
    if o.cpus_per_host:
        resources.append(f"--cpus-per-task={o.cpus_per_host}")
        srun += f" --cpus-per-task={o.cpus_per_host}"  # srun does not inherit it from sbatch
    if o.mem_per_host_gib:
        resources.append(f"--mem={max(1, round(o.mem_per_host_gib * 1024))}M")
    if o.gpus_per_host:
        resources.append(f"--gpus-per-node={o.gpus_per_host}")
    if o.exclusive:
        resources.append("--exclusive")
    return resources, srun


def _slurm_replica_files(cfg: Config, name: str, o: EmitOptions, common: dict) -> dict[str, tuple[str, int]]:
    """replica-R.sbatch of every replica."""
    hosts = cfg.mesh.hosts
    resources, srun = _slurm_resources(o)
    reduce = cfg.ft.on_host_loss == "reduce"
    placement, policy = _slurm_placement(cfg, o)
    files = {}
    for r in range(cfg.ft.replicas):
        files[f"replica-{r}.sbatch"] = (
            _fill(
                _SLURM_REPLICA,
                **common,
                replica=r,
                hosts=hosts,
                last_host=hosts - 1,
                delay=f"{o.restart_delay_s:g}",
                command=_slurm_train_command(r, hosts),
                srun=srun,
                wait_s=600,
                leader=_SLURM_LEADER if hosts > 1 else "",
                dist=_SLURM_DIST if hosts > 1 else "",
                placement=placement,
                policy=policy,
                sbatch=_sbatch(
                    f"{name}-replica-{r}",
                    o,
                    f"--nodes={hosts}",
                    "--ntasks-per-node=1",
                    *resources,
                    *(["--no-kill"] if reduce else []),
                ),
            ),
            0o755,
        )
    return files


def _slurm_train_command(r: int, hosts: int) -> str:
    """Replica r's `ftjax train` command in its script."""
    # the process id is appended per task (the `bash -c` above): only srun knows it
    command = TrainCommand(Shell('"$JOB_DIR/config.yaml"'), Shell('"$COORDINATOR"'), hosts, (Shell('"${REDUCED[@]}"'),))
    return shell_join(command.args(r, Shell('"$OUT"'), dist=Shell('"$DIST"') if hosts > 1 else None))


# --- Kubernetes -------------------------------------------------------------------------------------
def _labels(name: str, component: str, **extra: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "ftjax",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": component,
        **extra,
    }


def _k8s(cfg: Config, name: str, o: EmitOptions) -> dict[str, tuple[str, int]]:
    objects = [_config_map(cfg, name)]
    if o.pvc_size:
        objects.append(_outputs_claim(name, o))
    objects += [_coordinator_job(cfg, name, o), _coordinator_service(name)]
    files = {"coordinator.yaml": (_yaml(*objects), 0o644)}
    for r in range(cfg.ft.replicas):
        files[f"replica-{r}.yaml"] = (_yaml(_replica_jobset(cfg, name, o, r)), 0o644)
    files["token.yaml"] = (_yaml(_token_secret(name)), 0o600)
    return files


def _token_env(name: str) -> dict:
    """The environment variable that gives a container the token, from its Secret."""
    return {"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": f"{name}-token", "key": "token"}}}


def _token_secret(name: str) -> dict:
    # The token's Secret has a file of its own, readable by its owner only; the pods read it
    # through secretKeyRef, and every other manifest may be shared.
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": f"{name}-token", "labels": _labels(name, "token")},
        "type": "Opaque",
        "stringData": {"token": secrets.token_hex(16)},
    }


def _config_map(cfg: Config, name: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-config", "labels": _labels(name, "config")},
        "data": {"config.yaml": _config_yaml(cfg)},
    }


def _outputs_claim(name: str, o: EmitOptions) -> dict:
    """The PersistentVolumeClaim --pvc-size creates."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": o.pvc, "labels": _labels(name, "outputs")},
        "spec": {
            "accessModes": ["ReadWriteMany"],
            "resources": {"requests": {"storage": o.pvc_size}},
            **({"storageClassName": o.storage_class} if o.storage_class else {}),
        },
    }


def _coordinator_pod(cfg: Config, name: str, o: EmitOptions) -> dict:
    """The coordinator Job's pod template."""
    health = {"grpc": {"port": COORDINATOR_PORT}}
    return {
        "metadata": {"labels": _labels(name, "coordinator")},
        "spec": {
            "restartPolicy": "Never",  # a failed pod is replaced by the Job (its state is soft)
            "securityContext": {"fsGroup": FS_GROUP},
            "containers": [
                {
                    "name": "coordinator",
                    "image": o.image,
                    "env": [_token_env(name)],
                    "command": coordinator_args(
                        cfg, port=COORDINATOR_PORT, http_port=HTTP_PORT, idle_exit_s=o.idle_exit_s
                    ),
                    "ports": [
                        {"name": "grpc", "containerPort": COORDINATOR_PORT},
                        {"name": "http", "containerPort": HTTP_PORT},
                    ],
                    "readinessProbe": {**health, "periodSeconds": 5},
                    "livenessProbe": {**health, "initialDelaySeconds": 10, "periodSeconds": 10, "failureThreshold": 6},
                    "resources": {"requests": {"cpu": "1", "memory": "512Mi"}, "limits": {"memory": "4Gi"}},
                }
            ],
        },
    }


def _coordinator_job(cfg: Config, name: str, o: EmitOptions) -> dict:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": f"{name}-coordinator", "labels": _labels(name, "coordinator")},
        "spec": {
            # A failed pod is replaced; it ends with the job: 0 once every replica finished (the Job
            # completes), 3 once no replica has been alive for --idle-exit-s, 2 on a bad option or
            # token (the Job fails). An evicted or preempted pod does not count as a failure.
            "backoffLimit": max(o.max_restarts, 1),
            "podFailurePolicy": {
                "rules": [
                    {
                        "action": "FailJob",
                        "onExitCodes": {"containerName": "coordinator", "operator": "In", "values": [2, 3]},
                    },
                    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                ]
            },
            "template": _coordinator_pod(cfg, name, o),
        },
    }


def _coordinator_service(name: str) -> dict:
    labels = _labels(name, "coordinator")
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": f"{name}-coordinator", "labels": labels},
        "spec": {
            "selector": labels,
            "ports": [
                {"name": "grpc", "port": COORDINATOR_PORT, "targetPort": "grpc"},
                {"name": "http", "port": HTTP_PORT, "targetPort": "http"},
            ],
        },
    }


def _replica_resources(o: EmitOptions) -> dict:
    """A replica container's resources: its requests, and its limits if any."""
    requests: dict[str, str] = {"cpu": str(o.cpus_per_host or 1), "memory": "2Gi"}
    limits: dict[str, str] = {}
    if o.mem_per_host_gib:
        requests["memory"] = limits["memory"] = f"{max(1, round(o.mem_per_host_gib * 1024))}Mi"
    if o.gpus_per_host:
        limits[o.gpu_resource] = str(o.gpus_per_host)
    return {"requests": requests, **({"limits": limits} if limits else {})}


def _replica_container(cfg: Config, name: str, o: EmitOptions, r: int) -> dict:
    """The `train` container of replica r's pods."""
    jobset = f"{name}-replica-{r}"
    hosts = cfg.mesh.hosts
    # JobSet pod hostnames: <jobset>-<replicatedJob>-<job index>-<pod index>.<subdomain = jobset>
    dist = f"{jobset}-host-0-0.{jobset}:{DIST_PORT}" if hosts > 1 else None
    command = TrainCommand("/config/config.yaml", f"{name}-coordinator:{COORDINATOR_PORT}", hosts)
    args = command.args(r, f"{RUN_DIR}/replica-{r}", Shell('"$JOB_COMPLETION_INDEX"'), dist)
    # each pod advertises its own IP to its peers (ftjax/base/net.py): the route to the coordinator's
    # Service would name the same address, this is explicit
    pod_ip_env = {"name": "FTJAX_ADVERTISE_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    return {
        "name": "train",
        "image": o.image,
        "command": ["/bin/sh", "-c", "exec " + shell_join(args)],
        "env": [_token_env(name), pod_ip_env],
        "resources": _replica_resources(o),
        "volumeMounts": [
            {"name": "config", "mountPath": "/config", "readOnly": True},
            # on a shared claim, each job writes under its own name
            {"name": "run", "mountPath": RUN_DIR, "subPath": name},
            # a memory-backed /dev/shm, larger than the container default of 64 MiB
            # (shared memory of the accelerator libraries)
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }


def _replica_jobset(cfg: Config, name: str, o: EmitOptions, r: int) -> dict:
    """Replica r's JobSet: one Job of H indexed pods, one per host."""
    hosts = cfg.mesh.hosts
    labels = _labels(name, "replica", **{"ftjax-replica": str(r)})
    outputs = (
        {"name": "run", "persistentVolumeClaim": {"claimName": o.pvc}} if o.pvc else {"name": "run", "emptyDir": {}}
    )
    pod = {
        "metadata": {"labels": labels},
        "spec": {
            "restartPolicy": "Never",
            "securityContext": {"fsGroup": FS_GROUP},
            "containers": [_replica_container(cfg, name, o, r)],
            "volumes": [
                {"name": "config", "configMap": {"name": f"{name}-config"}},
                outputs,
                {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            ],
        },
    }
    job = {
        "metadata": {"labels": labels},
        "spec": {
            "completionMode": "Indexed",
            "completions": hosts,
            "parallelism": hosts,
            "backoffLimit": 0,
            "template": pod,
        },
    }
    spec = {
        # any failed pod fails its Job (backoffLimit 0), and the JobSet recreates the Job: the
        # whole replica restarts, and catches up from a live peer; the other replicas go on
        "failurePolicy": {"maxRestarts": o.max_restarts},
        "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
        "replicatedJobs": [{"name": "host", "replicas": 1, "template": job}],
    }
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": f"{name}-replica-{r}", "labels": labels},
        "spec": spec,
    }
