"""`ftjax bench outage CONFIG`: the step time during an outage against the healthy one, in the
elastic and the constant global-batch modes, same run.

For each mode, one `ftjax launch` job of R replicas (default 2): after warm-up, replica R-1 dies at
step `--kill-at` and is not restarted. The healthy step time is the median step of the other
replicas before the death; the outage step time is their median step after it (from a few steps
later on). Expected: constant about R / C (C = R - 1 contributors compute R batches), elastic about
1 (each computes its own batch). Prints one JSON line with both ratios and R / C, for the whole step
(`ratio`) and for its forward and backward part alone (`compute_ratio`, `compute_s` in the
metrics). A step of a small model has a fixed cost (quorum, FTAR, Python) that an outage does not
grow, and a quorum of one has no FTAR at all, so the step ratio stays below R / C unless compute
dominates (the default overrides raise tiny's batch); the compute ratio is the cost the policy
itself adds. On a machine where the replicas share cores (2 replicas on 2 cores), the survivor also
speeds up when its peer dies, so both ratios stay low; `outage_constant_vs_elastic` compares the two
modes' outage steps, same machine state, and is the R / C figure there.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ftjax.runs.jsonl import read_jsonl
from ftjax_bench import common

DEFAULT_OVERRIDES = ["data.batch_size=256", "steps=80"]


def _medians(run: Path, replicas: int, skip: int, field: str) -> tuple[float, float, int]:
    """(healthy median, outage median, outage steps measured) of `field` over the live replicas' steps."""
    down = next(e["time"] for e in read_jsonl(run / "launcher.jsonl") if e["event"] == "replica_down")
    before, after = [], []
    for r in range(replicas - 1):
        steps = [
            s
            for s in read_jsonl(run / f"replica-{r}" / "metrics.jsonl")
            if "event" not in s and s.get("committed") and s["step"] > skip
        ]
        before += [s[field] for s in steps if s["time"] < down]
        late = [s for s in steps if s["time"] > down]
        after += [s[field] for s in late[skip:]]  # past the failed attempt and its retry
    if len(before) < 3 or len(after) < 3:
        raise RuntimeError(f"{run}: too few steps to compare ({len(before)} before the death, {len(after)} after)")
    return statistics.median(before), statistics.median(after), len(after)


def main(argv: list[str]) -> int:
    p = common.parser("outage", __doc__)
    p.add_argument("overrides", nargs="*", help=f"config overrides (default: {' '.join(DEFAULT_OVERRIDES)})")
    p.add_argument("--replicas", type=int, default=2, help="replicas in the job; one is killed and not restarted")
    p.add_argument("--kill-at", type=int, default=20, help="step at which the last replica dies (20)")
    args = p.parse_intermixed_args(argv)
    if args.replicas < 2:
        p.error("--replicas: at least 2 (one must live through the outage)")
    overrides = args.overrides or DEFAULT_OVERRIDES
    out: dict = {
        "bench": "outage",
        "config": args.config,
        "overrides": overrides,
        "replicas": args.replicas,
        "expected_constant": round(args.replicas / (args.replicas - 1), 3),
    }
    with tempfile.TemporaryDirectory(prefix="ftjax-bench-outage-") as tmp:
        for mode in ("elastic", "constant"):
            run = Path(tmp) / mode
            cmd = [
                sys.executable,
                "-m",
                "ftjax",
                "launch",
                args.config,
                *overrides,
                f"ft.global_batch={mode}",
                "--replicas",
                str(args.replicas),
                "--kill",
                f"{args.replicas - 1}@{args.kill_at}",
                "--restart-delay-s",
                "3600",
                "ft.drain_timeout_s=0",
                "--timeout-s",
                "600",
                "--no-plots",
                "--out",
                str(run),
            ]
            done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if not (run / "launcher.jsonl").exists():
                print(f"ftjax bench outage: {mode} run failed:\n{done.stderr[-2000:]}", file=sys.stderr)
                return 1
            healthy, outage, n = _medians(run, args.replicas, 3, "step_time_s")
            c_healthy, c_outage, _ = _medians(run, args.replicas, 3, "compute_s")
            out[mode] = {
                "healthy_step_s": round(healthy, 4),
                "outage_step_s": round(outage, 4),
                "ratio": round(outage / healthy, 3),
                "outage_steps": n,
                "healthy_compute_s": round(c_healthy, 4),
                "outage_compute_s": round(c_outage, 4),
                "compute_ratio": round(c_outage / c_healthy, 3),
            }
    # The same outage in both modes: what the constant policy itself costs while a replica is away,
    # free of what the healthy step shares with the dead replica (its cores, FTAR, the quorum).
    out["outage_constant_vs_elastic"] = {
        "step": round(out["constant"]["outage_step_s"] / out["elastic"]["outage_step_s"], 3),
        "compute": round(out["constant"]["outage_compute_s"] / out["elastic"]["outage_compute_s"], 3),
    }
    print(json.dumps(out))
    return 0
