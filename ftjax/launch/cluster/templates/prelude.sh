set -euo pipefail
JOB_DIR=${FTJAX_JOB_DIR:-$SLURM_SUBMIT_DIR}
RUN_DIR="$JOB_DIR/run"
mkdir -p "$RUN_DIR"
now() { date +%s.%N; }
