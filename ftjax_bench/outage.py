"""`ftjax bench outage CONFIG`: the step time during an outage against the healthy one, in the
elastic and the constant global-batch modes, same run.

For each mode, one `ftjax launch` job of R replicas (default 2): after warm-up, replica R-1 dies at
step `--kill-at` and is not restarted. The healthy step time is the median step of the other
replicas before the death; the outage step time is their median step after it (from a few steps
later on). Expected: constant about R / C (C = R - 1 contributors compute R batches), elastic about
1 (each computes its own batch). Prints one JSON line with both ratios and R / C. A step of a small
model is mostly fixed cost (quorum, FTAR, Python), so use a config whose compute dominates (the
default overrides raise tiny's batch) for the ratio to approach R / C. Each replica needs cores of
its own: replicas that share cores speed up when one of them dies (2 replicas on a 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ftjax.jsonl import read_jsonl

DEFAULT_OVERRIDES = ["data.batch_size=64", "steps=80"]


def _ratio(run: Path, replicas: int, skip: int) -> tuple[float, float, int]:
    """(healthy median step s, outage median step s, outage steps measured) of the live replicas."""
    down = next(e["time"] for e in read_jsonl(run / "launcher.jsonl") if e["event"] == "replica_down")
    before, after = [], []
    for r in range(replicas - 1):
        steps = [s for s in read_jsonl(run / f"replica-{r}" / "metrics.jsonl")
                 if "event" not in s and s.get("committed") and s["step"] > skip]
        before += [s["step_time_s"] for s in steps if s["time"] < down]
        late = [s for s in steps if s["time"] > down]
        after += [s["step_time_s"] for s in late[skip:]]  # past the failed attempt and its retry
    if len(before) < 3 or len(after) < 3:
        raise RuntimeError(f"{run}: too few steps to compare ({len(before)} before the death, {len(after)} after)")
    return statistics.median(before), statistics.median(after), len(after)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ftjax bench outage", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", default="tiny")
    p.add_argument("overrides", nargs="*", help=f"config overrides (default: {' '.join(DEFAULT_OVERRIDES)})")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--kill-at", type=int, default=20, help="step at which the last replica dies (20)")
    args = p.parse_intermixed_args(argv)
    if args.replicas < 2:
        p.error("--replicas: at least 2 (one must live through the outage)")
    overrides = args.overrides or DEFAULT_OVERRIDES
    out: dict = {"bench": "outage", "config": args.config, "overrides": overrides, "replicas": args.replicas,
                 "expected_constant": round(args.replicas / (args.replicas - 1), 3)}
    with tempfile.TemporaryDirectory(prefix="ftjax-bench-outage-") as tmp:
        for mode in ("elastic", "constant"):
            run = Path(tmp) / mode
            cmd = [sys.executable, "-m", "ftjax", "launch", args.config, *overrides, f"ft.global_batch={mode}",
                   "--replicas", str(args.replicas), "--kill", f"{args.replicas - 1}@{args.kill_at}",
                   "--restart-delay-s", "3600", "ft.drain_timeout_s=0", "--timeout-s", "600", "--out", str(run)]
            done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if not (run / "launcher.jsonl").exists():
                print(f"ftjax bench outage: {mode} run failed:\n{done.stderr[-2000:]}", file=sys.stderr)
                return 1
            healthy, outage, n = _ratio(run, args.replicas, skip=3)
            out[mode] = {"healthy_step_s": round(healthy, 4), "outage_step_s": round(outage, 4),
                         "ratio": round(outage / healthy, 3), "outage_steps": n}
    print(json.dumps(out))
    return 0
