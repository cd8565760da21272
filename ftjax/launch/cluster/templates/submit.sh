#!/bin/bash
# Submit job ${TPL_NAME}: its coordinator, ${TPL_REPLICAS} replica(s) once the coordinator runs, and
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
printf '{"time": %s, %s}\n' "$(date +%s.%N)" '${TPL_LAUNCH}' > run/launch.jsonl
export FTJAX_JOB_DIR="$JOB_DIR"
coordinator=$(sbatch --parsable coordinator.sbatch)
coordinator=${coordinator%%;*}
export FTJAX_COORDINATOR_JOB="$coordinator"
replicas=""
for r in $(seq 0 ${TPL_LAST}); do
  id=$(sbatch --parsable --dependency="after:$coordinator" --kill-on-invalid-dep=yes "replica-$r.sbatch")
  replicas="$replicas:${id%%;*}"
done
finish=$(sbatch --parsable --dependency="afterany$replicas" finish.sbatch)
echo "job ${TPL_NAME}: coordinator $coordinator, replicas ${replicas#:}, finish ${finish%%;*}"
echo "run directory: $JOB_DIR/run (the coordinator's address: run/coordinator.address)"
