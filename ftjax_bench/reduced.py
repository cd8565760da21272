"""`ftjax bench reduced CONFIG`: the step rate of a reduced-degree replica against the same replica
at full degree, same machine, same rows per step (docs/design/replicas.md, "Reduced-degree replicas").

Three one-replica jobs with a constant global batch, one after the other, the same rows per step:
(a) the replica on all its `--hosts` hosts; (b) the same replica on `--live` of them
(`mesh.live_hosts`, as the launcher restarts it after a host loss), each live host serving
hosts/live gradient lanes; (c) a replica built for `--live` hosts from the start (`mesh.hosts=live`:
one lane per host, its own batch through `grads`), on the same hardware as (b). A one-replica job
has no peer to hand rows to: (b) computes the whole batch on fewer devices.

Prints one JSON line: the three median steps; `fraction` F = live/hosts; `throughput` T = (a) / (b),
the reduced replica's step rate as a fraction of the full one's on this machine; and
`mode_efficiency` = (c) / (b), what the reduced mode itself costs against a replica of that size
(more lanes per host, the batch in chunks through `accumulate`), which carries over to other
hardware. T does not: it also holds how the full replica's step scales with its hosts here, and on
CPU the collectives between a replica's processes (gloo, inside every layer of an FSDP step) cost
more than the compute they split, so T exceeds F. `curve` "F:X" for `ftjax simulate
--reduced-curve` is X = F x min(1, mode_efficiency): linear in the devices alive, as FSDP compute
scales on accelerators, times the measured cost of the mode.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

from ftjax.base.procs import ProcessGroup
from ftjax.launch.job import LocalJob
from ftjax.runtime.metrics import read_metrics
from ftjax_bench import common


def run(config: str, overrides: list[str], out: Path, live: int | None, timeout: float, warmup: int) -> float:
    """Median step time of one one-replica job, on `live` of its hosts (None: all of them)."""
    with ProcessGroup() as procs:
        job = LocalJob(config, overrides, out, replicas=1, procs=procs)
        job.start_coordinator()
        job.start_replica(0, on_hosts=None if live is None else list(range(live)))
        codes = job.wait(timeout=timeout)
        if any(c != 0 for cs in codes.values() for c in cs):
            raise RuntimeError(f"{out.name} run failed {codes}:\n{job.log_tail(0)}")
    times = [
        r["step_time_s"]
        for r in read_metrics(job.replica_dir(0) / "metrics.jsonl")
        if r.get("committed") and r["step"] > warmup
    ]
    if len(times) < 3:
        raise RuntimeError(f"{out}: too few steps after the {warmup} warm-up steps")
    return statistics.median(times)


def main(argv: list[str]) -> int:
    p = common.parser("reduced", __doc__)
    p.add_argument("overrides", nargs="*", help="config overrides, key.sub=value")
    p.add_argument("--hosts", type=int, default=2, help="hosts of the full replica (2)")
    p.add_argument("--live", type=int, default=None, help="hosts of the reduced one (default: hosts / 2)")
    p.add_argument("--steps", type=int, default=30, help="steps timed")
    p.add_argument("--warmup", type=int, default=5, help="steps before timing")
    p.add_argument("--out", default=None, help="keep the runs here (default: a temporary directory)")
    p.add_argument("--timeout", type=float, default=540.0, help="seconds, limit for each run")
    args = p.parse_intermixed_args(argv)
    live = args.live if args.live is not None else args.hosts // 2
    if args.steps <= args.warmup + 3:
        p.error("--steps must exceed --warmup + 3")
    overrides = [
        *args.overrides,
        f"steps={args.steps}",
        f"mesh.hosts={args.hosts}",
        "ft.global_batch=constant",
        "ft.digest_every=0",
        "checkpoint.every=0",
    ]
    if common.load("reduced", args.config, [*overrides, "ft.replicas=1", f"mesh.live_hosts={live}"]) is None:
        return 2
    with common.run_directory("reduced", args.out) as out:
        full = run(args.config, overrides, out / "full", None, args.timeout, args.warmup)
        reduced = run(args.config, overrides, out / "reduced", live, args.timeout, args.warmup)
        alike = run(args.config, [*overrides, f"mesh.hosts={live}"], out / "same-size", None, args.timeout, args.warmup)
    fraction, throughput, mode = live / args.hosts, full / reduced, alike / reduced
    print(
        json.dumps(
            {
                "bench": "reduced",
                "config": args.config,
                "overrides": args.overrides,
                "hosts": args.hosts,
                "live_hosts": live,
                "cores": os.cpu_count(),
                "steps": args.steps,
                "warmup": args.warmup,
                "full_step_s": round(full, 5),
                "reduced_step_s": round(reduced, 5),
                "same_size_step_s": round(alike, 5),
                "fraction": fraction,
                "throughput": round(throughput, 4),
                "mode_efficiency": round(mode, 4),
                "curve": f"{fraction:g}:{fraction * min(1.0, mode):.3f}",
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
