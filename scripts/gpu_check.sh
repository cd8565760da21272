#!/usr/bin/env bash
# ftjax on one GPU: a standalone run of gpt_small, then a 2-replica fault-tolerant job sharing the
# GPU (XLA_PYTHON_CLIENT_MEM_FRACTION) with a replica killed mid-FTAR. Prints one JSON line per run; writes the runs under $1 (default /tmp/gpu).
# Usage: bash scripts/gpu_check.sh [OUT_DIR] [PLATFORM]   (PLATFORM: gpu, or cpu to try it here)
set -uo pipefail
out=${1:-/tmp/gpu}
platform=${2:-gpu}
mkdir -p "$out"
py=${PYTHON:-python3}
common=(configs/gpt_small.yaml "platform=$platform" data.batch_size=32 ft.digest_every=10)

"$py" - <<'EOF'
import jax, json
print(json.dumps({"jax": jax.__version__, "devices": [str(d) for d in jax.devices()]}))
EOF

summary() {  # the median step after warm-up of a run directory's replica 0
  "$py" - "$1" "$2" <<'EOF'
import json, statistics, sys
from pathlib import Path
run, label = Path(sys.argv[1]), sys.argv[2]
m = run / "metrics.jsonl" if (run / "metrics.jsonl").exists() else run / "replica-0" / "metrics.jsonl"
steps = [json.loads(l) for l in m.read_text().splitlines()]
steps = [s for s in steps if "event" not in s and s.get("committed")]
out = {"run": label, "steps": len(steps),
       "median_step_s": round(statistics.median(s["step_time_s"] for s in steps[10:]), 5),
       "final_loss": round(steps[-1]["loss"], 4)}
summ = run / "summary.json"
if summ.exists():
    s = json.loads(summ.read_text())
    out.update({k: s.get(k) for k in ("digests_equal", "exactly_once", "ok")})
print(json.dumps(out))
EOF
}

"$py" -m ftjax train "${common[@]}" steps=60 --out "$out/alone" >"$out/alone.log" 2>&1 \
  && summary "$out/alone" "standalone-$platform" || tail -30 "$out/alone.log"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 "$py" -m ftjax launch "${common[@]}" steps=80 --replicas 2 \
  --kill 1@30:ftar --timeout-s 400 --out "$out/ft" >"$out/ft.log" 2>&1 \
  && summary "$out/ft" "ft-2-replicas-kill-$platform" || tail -30 "$out/ft.log"
