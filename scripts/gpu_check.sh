#!/usr/bin/env bash
# The GPU checks of issues 28 and 30, in one run on a machine of one GPU (README "On a GPU").
# Usage: bash scripts/gpu_check.sh OUT [CONFIG]   (CONFIG: llama_1b; llama_tiny to try it on CPU)
# Env: STAGES (default "bench probe"; also alone, profile, kill), SERIAL=1, T_BENCH (420 s), BENCH_STEPS (5),
#      VARIANTS and SCAN=1 (profile: scripts/mfu_profile.py's --variants, --scan-layers).
# Wheels the machine lacks are in .whl/ (pip download --python-version 3.12 --only-binary=:all:).
set -u
OUT=${1:?out dir}; CONFIG=${2:-llama_1b}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # ftjax from this checkout, run as `python -m ftjax`
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  # (grpcio too: the generated stubs need grpcio >= 1.85.1, the image had 1.84.0 on 2026-11-27)
  $PY -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -3
  $PY -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
fi
$PY -c "import jax; print(jax.devices(), jax.__version__)" 2>&1 | tail -1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"
SYN=(task=ftjax.program.tasks:language_model 'task_args={}' data.source=synthetic checkpoint.every=0 ft.digest_every=0
     mesh.devices_per_host=1 data.micro_batches=1)
# STAGES: what runs, in order. The FT step against standalone (issue 30's missing figure) first,
# then the raw copies of the same bytes; `alone` (issue 28's MFU) and `kill` were measured on
# 2026-11-26/27 (README "On a GPU") and run only when named.
STAGES=${STAGES:-bench probe}
has() { [[ " $STAGES " == *" $1 "* ]]; }
if has alone; then
  # issue 28: the 1B Llama in bf16 alone on the GPU: MFU per step (metrics.jsonl), with cuDNN's fused
  # attention (model.attention auto): ALONE lists runs as BATCH:REMAT:MICRO_BATCHES
  for run in ${ALONE:-16:save_dots:2 8:save_dots:1}; do
    IFS=: read -r B R MB <<< "$run"
    XLA_PYTHON_CLIENT_MEM_FRACTION=${ALONE_MEM:-0.9} timeout "${T_TRAIN:-150}" "$PY" -m ftjax train "$CONFIG" \
      --out "$OUT/alone_$B" "${SYN[@]}" steps="${STEPS:-8}" data.batch_size="$B" data.micro_batches="$MB" \
      model.seq_len="${SEQ:-2048}" model.remat="$R" > "$OUT/alone_$B.log" 2>&1; tail -1 "$OUT/alone_$B.log"
    $PY - "$OUT/alone_$B/metrics.jsonl" "$B" "$R" <<'PY' | tee -a "$OUT/mfu.json"
import json, statistics, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if '"step_time_s"' in l][3:]
out = {k: statistics.median(r[k] for r in recs) for k in ("step_time_s", "mfu", "tokens_per_s") if recs and k in recs[0]}
print(json.dumps({"batch": int(sys.argv[2]), "remat": sys.argv[3], "steps": len(recs), **out}))
PY
  done
fi
if has profile; then
  scan=(); if [ -n "${SCAN:-}" ]; then scan=(--scan-layers); fi  # SCAN=1: the model's blocks as one lax.scan
  # the 1B's forward and backward with the logits whole and in chunks (model.logits_chunk): time,
  # MFU and XLA's temporaries of each (scripts/mfu_profile.py), one JSON line per variant
  timeout "${T_PROFILE:-180}" "$PY" scripts/mfu_profile.py "$CONFIG" --batch 8 --micro-batches 2 --seq "${SEQ:-2048}" \
    --variants "${VARIANTS:-cudnn:save_dots,cudnn:save_dots:512,cudnn:save_dots:2048}" --reps 3 "${scan[@]}" \
    > "$OUT/profile.json" 2> "$OUT/profile.err"; cat "$OUT/profile.json"; tail -3 "$OUT/profile.err"
fi
if has bench; then
  # issue 30: two replicas sharing the GPU: FT (ft.grad_path auto: pinned on a GPU) against both
  # training alone at the same time; SERIAL=1 adds the serial path (a third pair of 1B runs)
  EXTRA=(); read -ra EXTRA <<< "${BENCH_ARGS:-}"; [ "${SERIAL:-0}" = 1 ] || EXTRA+=(--no-serial)
  T=${T_BENCH:-420}
  XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout "$T" "$PY" -m ftjax bench step \
    "$CONFIG" --devices 1 --no-sync --steps "${BENCH_STEPS:-5}" --warmup 2 --timeout $((T - 20)) --out "$OUT/bench" \
    "${SYN[@]}" data.batch_size=4 model.seq_len=2048 model.remat=full "${EXTRA[@]}" \
    > "$OUT/bench_step.json" 2> "$OUT/bench_step.err"
  cat "$OUT/bench_step.json"; tail -3 "$OUT/bench_step.err"
  # (the run directories are too deep to come back from the device: their logs' tails, one file)
  find "$OUT/bench" -name "*.log" -size -4M | sort | while read -r f; do echo "== $f"; tail -n 25 "$f"; done > "$OUT/bench_logs.txt"
fi
if has probe; then
  # raw device <-> host copies of the update's bytes on one replica's host (pageable and pinned),
  # in this same run: the yardstick of the step's d2h_gbps and h2d_gbps
  NBYTES=$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['phases']['grad_bytes'])" \
    "$OUT/bench_step.json" 2>/dev/null || echo $((2 ** 30)))
  timeout 120 "$PY" scripts/copy_probe.py --bytes "$NBYTES" > "$OUT/probe.json" 2> "$OUT/probe.err"; cat "$OUT/probe.json"
  $PY - "$OUT/bench_step.json" "$OUT/probe.json" <<'PY' | tee "$OUT/gradient_path.json"
import json, sys
try:
    step = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    step = {}
probe, phases = json.load(open(sys.argv[2])), step.get("phases") or {}
ratio = lambda a, b: round(a / b, 3) if a and b else None
print(json.dumps({
    "ft_vs_standalone": step.get("ft_vs_standalone"), "grad_bytes": phases.get("grad_bytes"),
    "probe_bytes": probe.get("bytes"), "d2h_gbps": phases.get("d2h_gbps"), "h2d_gbps": phases.get("h2d_gbps"),
    "d2h_vs_raw_pinned": ratio(phases.get("d2h_gbps"), probe.get("d2pinned_gbps")),
    "d2h_vs_raw_pageable": ratio(phases.get("d2h_gbps"), probe.get("d2h_gbps")),
    "h2d_vs_raw_pageable": ratio(phases.get("h2d_gbps"), probe.get("h2d_gbps")),
    "h2d_vs_raw_pinned": ratio(phases.get("h2d_gbps"), probe.get("pinned2d_gbps")),
}))
PY
fi
has kill || exit 0
# the fault tolerance on the accelerator: 2 replicas of the tiny Llama share the GPU, one killed in FTAR
XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 timeout "${T_KILL:-100}" "$PY" -m ftjax launch llama_tiny --replicas 2 --kill 1@10:ftar steps=40 --timeout-s 90 \
  --out "$OUT/kill" "${SYN[@]}" > "$OUT/kill.log" 2>&1
$PY -c "import json,sys; s=json.load(open(sys.argv[1])); print(json.dumps({k: s.get(k) for k in ('ok','digests_equal','exactly_once','committed_steps')}))" "$OUT/kill/summary.json" | tee "$OUT/kill.json"
