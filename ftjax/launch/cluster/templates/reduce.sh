# The hosts a replica runs on when N of its ${TPL_HOSTS} are up (index N): the largest divisor of ${TPL_HOSTS} they
# cover, if at least ft.reduced_min_fraction (${TPL_MIN_FRACTION}) of it; 0: too few
DEGREE=(${TPL_DEGREES})
allocated() {  # the nodes of this job's allocation now (a failed node leaves it)
  local nodes
  nodes=$(squeue -h -j "$SLURM_JOB_ID" -o %N 2>/dev/null | head -n 1)
  if [ -z "$nodes" ]; then printf '%s\n' "${NODES[@]}"; return; fi  # no answer: no news
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
  if [ "$(allocated | wc -l)" -lt ${TPL_HOSTS} ]; then
    echo "replica $REPLICA: too few hosts up, and only $(allocated | paste -sd, -) left in the allocation;" \
      "requeueing the job" >&2
    scontrol requeue "$SLURM_JOB_ID"
    sleep 600 & wait $!  # until Slurm ends this script (the TERM trap)
  fi
  ON=(${TPL_ALL_HOSTS})
  LIVE=${TPL_HOSTS}
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
  # step if it has not left after ft.progress_timeout_s (${TPL_LEAVE_S} s).
  local n=0 since=0
  while kill -0 "$1" 2>/dev/null; do
    sleep 1
    n=$((n + 1))
    if [ "$leaving" -eq 0 ] && [ "$LIVE" -lt ${TPL_HOSTS} ] && [ $((n % 3)) -eq 0 ] \
        && [ "$(hosts_up | wc -l)" -eq ${TPL_HOSTS} ]; then
      leaving=1
      since=$n
      event back_to_full_degree "\"hosts\": [$(IFS=,; echo "${ON[*]}")]"
      scancel --signal=TERM "$SLURM_JOB_ID"  # every step's tasks, not this script
    elif [ "$leaving" -eq 1 ] && [ $((n - since)) -gt ${TPL_LEAVE_S} ]; then
      kill -TERM "$1" 2>/dev/null || true  # srun ends its step
    fi
  done
}
