#!/usr/bin/env bash
# The GPU check of issue 59 on a machine of one GPU (README "On a GPU"), in stages that always tell why.
# Usage: bash scripts/gpu_check.sh OUT
# Each stage runs under its own time limit (`timeout`, its processes' whole group) and, as soon as it
# ends, appends one JSON line to OUT/stages.jsonl (stage, ok, reason, rc, seconds, result) and writes
# OUT/STAGE.tail.txt: its output's tail and the tails of its processes' logs. Run directories stay in
# a scratch folder (WORK), never in OUT: they are too deep to come back from the device.
# Stages (STAGES, in order; limits T_<STAGE> in seconds, the whole check under T_TOTAL = 470 s):
#   install   the wheels the image lacks (WHEELS, default wheels/) and ftjax with --no-deps
#   alone     the 1B alone: MFU (median after the first steps)
#   bench150  bench1b: `ftjax bench step`, 2 FT replicas sharing the GPU against both standalone
#   kill150   kill1b: a 2-replica FT job, replica 1 killed mid-FTAR: digests equal, exactly once
#   probe     raw d2h/h2d copies of the 1B's update bytes, pageable and pinned, against the FT phases
#   wire      the 150M's FT job with ft.wire_dtype=bfloat16 against bench150's float32 wire
#   profile   (only when named) scripts/mfu_profile.py on the 1B: VARIANTS, SCAN=1 for --scan-layers
# DRY_RUN=1: the same stages and code path on CPU (platform=cpu, llama_tiny, tiny sizes and limits).
set -u
OUT=${1:?out dir}; mkdir -p "$OUT"; : > "$OUT/stages.jsonl"
PY=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # ftjax from this checkout, run as `python -m ftjax`
WORK=${WORK:-$(mktemp -d)}; mkdir -p "$WORK"
export JAX_COMPILATION_CACHE_DIR="$WORK/xla"  # the 1B's stages share its shapes: one compile each
if [ "${DRY_RUN:-0}" = 1 ]; then
  BIG=llama_tiny; MID=llama_tiny; SKIP_INSTALL=1; T_TOTAL=${T_TOTAL:-900}  # a busy 2-core CI machine
  SHAPE=(platform=cpu data.batch_size=4 model.seq_len=32); STEPS=4; KILL_STEPS=8; LIM=240; PROBE_BYTES=$((2 ** 20))
else
  BIG=llama_1b; MID=llama_150m
  # (remat full: two replicas of the 1B in 45% of an H100 each)
  SHAPE=(data.batch_size=4 model.seq_len=2048 model.remat=full); STEPS=6; KILL_STEPS=14; LIM=0; PROBE_BYTES=$((2 ** 30))
fi
SYN=(task=ftjax.program.tasks:language_model 'task_args={}' data.source=synthetic checkpoint.every=0
     mesh.devices_per_host=1 data.micro_batches=1)
START=$SECONDS; T_TOTAL=${T_TOTAL:-470}
d() { [ "$LIM" -gt 0 ] && echo "$LIM" || echo "$1"; }  # a stage's default limit: LIM in a dry run
# A job's own timeout inside its stage (bench --timeout, launch --timeout-s): the GPU figure, or in a dry
# run LIM less a margin, so that a loaded CPU is held to the stage's limit and not to a GPU's job time
# (a kill job's warm-up alone took 31 s of its GPU 45 with both cores hogged).
j() { [ "$LIM" -gt 0 ] && echo $((LIM - 20)) || echo "$1"; }
limit() {  # a stage's limit, never past the whole check's
  local own=${1}
  local left=$((T_TOTAL - (SECONDS - START))); [ "$own" -lt "$left" ] && echo "$own" || echo "$left"
}
# stage NAME LIMIT CMD...: runs CMD (a function below) under LIMIT, then records what came of it
stage() {
  local name=$1 lim; lim=$(limit "$2"); shift 2
  [[ " ${STAGES:-install alone bench150 bench1b kill150 kill1b probe wire} " == *" $name "* ]] || return 0
  local t0=$SECONDS rc
  if [ "$lim" -lt 5 ]; then rc=-1; echo "no time left" > "$OUT/$name.log"
  else  # the stage's functions in a shell of its own, so that timeout limits (and kills) all it started
    timeout -k 10 "$lim" bash -c "$(declare -p SYN SHAPE); $(declare -f $FUNCS); \"\$@\"" _ "$@" \
      > "$OUT/$name.log" 2>&1; rc=$?
  fi
  $PY "$HERE/gpu_stage.py" --reap "$WORK/$name/" >> "$OUT/$name.log" 2>&1
  { tail -n 40 "$OUT/$name.log"
    find "$WORK/$name" -name "*.log" 2>/dev/null | sort | while read -r f; do echo "== ${f#"$WORK"/}"; tail -n 25 "$f"; done
  } > "$OUT/$name.tail.txt"
  $PY "$HERE/gpu_stage.py" "$name" "$rc" "$lim" $((SECONDS - t0)) "$OUT/$name.log" | tee -a "$OUT/stages.jsonl"
}
install() {
  # (grpcio too: the generated stubs need grpcio >= 1.85.1, the image had 1.84.0 on 2026-11-27)
  $PY -m pip install -q --no-deps --no-index "${WHEELS:-wheels}"/*.whl && $PY -m pip install -q --no-deps --no-build-isolation -e .
  $PY -c "import jax, json; print(json.dumps({'devices': str(jax.devices()), 'jax': jax.__version__}))"
}
alone() {  # the 1B alone on the GPU, bf16 compute, cuDNN attention, 16 x 2048 tokens in 2 micro-batches
  local b=${ALONE_BATCH:-16}; [ "${DRY_RUN:-0}" = 1 ] && b=4
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 $PY -m ftjax train "$BIG" --out "$WORK/alone/run" "${SYN[@]}" "${SHAPE[@]}" \
    steps=$((STEPS + 2)) data.batch_size="$b" data.micro_batches=2 model.remat=save_dots && $PY "$HERE/gpu_stage.py" --mfu "$WORK/alone/run"
}
bench() {  # CONFIG NAME: FT step against standalone (pinned gradient path, float32 wire)
  XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 $PY -m ftjax bench step "$1" --devices 1 \
    --no-sync --no-serial --steps "$STEPS" --warmup 2 --timeout "$3" --out "$WORK/$2" "${SYN[@]}" "${SHAPE[@]}"
}
kill_job() {  # CONFIG NAME JOB_TIMEOUT: 2 replicas, replica 1 killed mid-FTAR at step 4
  local cfg=$1 name=$2 t=$3
  XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 $PY -m ftjax launch "$cfg" --replicas 2 \
    --kill 1@4:ftar --timeout-s "$t" --out "$WORK/$name/job" "${SYN[@]}" "${SHAPE[@]}" steps="$KILL_STEPS"
  $PY "$HERE/gpu_stage.py" --summary "$WORK/$name/job"
}
wire() {  # JOB_TIMEOUT: the 150M's 2 replicas with the bf16 wire (no kill): FTAR's ring against bench150's float32 ring
  XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 $PY -m ftjax launch "$MID" --replicas 2 \
    --timeout-s "$1" --out "$WORK/wire/job" "${SYN[@]}" "${SHAPE[@]}" steps="$STEPS" ft.wire_dtype=bfloat16
  $PY "$HERE/gpu_stage.py" --wire "$WORK/wire/job" "$OUT/stages.jsonl"
}
probe() {  # raw copies of the bytes of the 1B's update (bench1b's grad_bytes), pageable and pinned
  local n; n=$($PY "$HERE/gpu_stage.py" --field "$OUT/stages.jsonl" bench1b phases.grad_bytes) || n=$PROBE_BYTES
  $PY "$HERE/copy_probe.py" --bytes "$n" > "$WORK/probe.json" && $PY "$HERE/gpu_stage.py" --probe "$WORK/probe.json" "$OUT/stages.jsonl"
}
profile() {  # the 1B's forward and backward, logits whole and in chunks: time, MFU, XLA's temporaries
  local scan=(); [ -n "${SCAN:-}" ] && scan=(--scan-layers)
  $PY "$HERE/mfu_profile.py" "$BIG" --batch 8 --micro-batches 2 --seq "${SEQ:-2048}" --reps 3 "${scan[@]}" \
    --variants "${VARIANTS:-cudnn:save_dots,cudnn:save_dots:512,cudnn:save_dots:2048}"
}
export OUT PY HERE WORK BIG MID STEPS KILL_STEPS DRY_RUN WHEELS PROBE_BYTES SEQ SCAN VARIANTS
FUNCS="install alone bench kill_job wire probe profile"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
[ "${SKIP_INSTALL:-0}" = 1 ] || stage install "${T_INSTALL:-$(d 40)}" install
stage alone "${T_ALONE:-$(d 70)}" alone
stage bench150 "${T_BENCH150:-$(d 70)}" bench "$MID" bench150 "$(j 60)"
stage bench1b "${T_BENCH1B:-$(d 110)}" bench "$BIG" bench1b "$(j 100)"
stage kill150 "${T_KILL150:-$(d 50)}" kill_job "$MID" kill150 "$(j 45)"
stage kill1b "${T_KILL1B:-$(d 90)}" kill_job "$BIG" kill1b "$(j 80)"
stage probe "${T_PROBE:-$(d 25)}" probe
stage wire "${T_WIRE:-$(d 40)}" wire "$(j 35)"
stage profile "${T_PROFILE:-$(d 150)}" profile
echo "gpu_check: $((SECONDS - START)) s; $(grep -c '"ok": true' "$OUT/stages.jsonl") of $(wc -l < "$OUT/stages.jsonl") stages ok"
