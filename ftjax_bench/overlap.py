"""`ftjax bench overlap CONFIG [key=value ...]`: streaming DiLoCo's overlap over a capped link.

Three streaming DiLoCo jobs of `--replicas` replicas, one after the other, with the same config and
the same tokens (`--rounds` rounds of `--inner` / `--fragments` inner steps): (a) tau = 0
(`ft.fragment_sync_delay`: the exchange after the round's last inner step) and (b) tau = `--tau`
(the exchange while the round's last tau inner steps compute), both with `ft.wire_dtype=bfloat16`;
(c) as (b) with `ft.wire_dtype=int8`. With `--virtual-cluster` every replica runs on a host of
its own and `--bandwidth-mbit` caps every host's link (`ftjax bench diloco` does the same).

Prints one JSON line: each job's tokens/s (ftjax_bench.diloco's figures), `overlap_speedup` = (b)
/ (a), `int8_speedup` = (c) / (b), and why the overlap gains what it gains, from job (a)'s rounds
(medians): `exchange_s` (quorum answered to FTAR done, the time the overlap can hide),
`inner_step_s` (one inner step), `hidden_share` = min(1, tau x inner_step_s / exchange_s) and
`expected_speedup` = (n x inner_step_s + exchange_s) / (n x inner_step_s + exchange_s - hidden), n
the round's inner steps; (b)'s `overlap_s`, the seconds the exchange actually ran beside them, and
`overlapped_step_s`, one inner step's time beside the exchange (against `inner_step_s` alone: on a
machine whose CPUs the exchange's threads share, what the overlap costs the steps); and `round_s`,
each job's median round time.
"""

from __future__ import annotations

import json
import statistics

from ftjax_bench import common
from ftjax_bench.diloco import _figures, _job, job_arguments


def _why(records: list[dict], n: int, tau: int) -> dict:
    """Job (a)'s rounds: what one exchange and one inner step take, and what tau steps can hide."""
    exchange = statistics.median(m["ftar_s"] for m in records)
    step = statistics.median(m["compute_s"] for m in records) / n
    hidden = min(exchange, tau * step)
    return {
        "exchange_s": round(exchange, 4),
        "inner_step_s": round(step, 4),
        "hidden_share": round(hidden / exchange, 3) if exchange > 0 else 1.0,
        "expected_speedup": round((n * step + exchange) / (n * step + exchange - hidden), 3),
    }


def main(argv: list[str]) -> int:
    p = common.parser("overlap", __doc__, config_default="llama_tiny")
    p.add_argument("overrides", nargs="*", help="config overrides, key.sub=value")
    p.add_argument("--replicas", type=int, default=2, help="replicas in each job")
    p.add_argument("--rounds", type=int, default=40, help="rounds of each job")
    p.add_argument("--inner", type=int, default=8, help="inner steps per fragment cycle (ft.inner_steps)")
    p.add_argument("--fragments", type=int, default=4, help="streaming fragments (ft.fragments)")
    p.add_argument("--tau", type=int, default=1, help="ft.fragment_sync_delay of jobs (b) and (c)")
    p.add_argument("--warmup", type=int, default=2, help="rounds of each job not timed (compiles)")
    job_arguments(p)
    a = p.parse_args(argv)
    n = a.inner // a.fragments
    if a.rounds <= a.warmup or not 1 <= a.tau < n:
        p.error(f"--rounds must exceed --warmup, and --tau lie in 1..{n - 1} (a round's inner steps - 1)")
    base = [*a.overrides, f"steps={a.rounds}", "ft.sync=streaming_diloco", f"ft.inner_steps={a.inner}"]
    base += [f"ft.fragments={a.fragments}"]
    jobs = {
        "tau0": [*base, "ft.fragment_sync_delay=0", "ft.wire_dtype=bfloat16"],
        f"tau{a.tau}": [*base, f"ft.fragment_sync_delay={a.tau}", "ft.wire_dtype=bfloat16"],
        f"tau{a.tau}_int8": [*base, f"ft.fragment_sync_delay={a.tau}", "ft.wire_dtype=int8"],
    }
    if any(common.load("overlap", a.config, over) is None for over in jobs.values()):
        return 2
    param_bytes = 0  # (every record carries its round's sync_bytes)
    figures, records = {}, {}
    with common.run_directory("overlap", a.out) as out:
        for name, over in jobs.items():
            records[name] = _job(a.config, over, out / name, a, a.timeout)
            figures[name] = _figures(records[name], a.warmup, a.replicas, param_bytes)
    timed = lambda name: [m for m in records[name][0] if m["step"] > a.warmup and not m["reused_inner"]]
    overlapped, int8 = figures[f"tau{a.tau}"], figures[f"tau{a.tau}_int8"]
    print(
        json.dumps(
            {
                "bench": "overlap",
                "config": a.config,
                "replicas": a.replicas,
                "inner_steps": a.inner,
                "fragments": a.fragments,
                "round_inner_steps": n,
                "tau": a.tau,
                "rounds": a.rounds,
                "virtual_cluster": a.virtual_cluster,
                "bandwidth_mbit": a.bandwidth_mbit if a.virtual_cluster else None,
                **figures,
                "overlap_speedup": round(overlapped["tokens_per_s"] / figures["tau0"]["tokens_per_s"], 3),
                "int8_speedup": round(int8["tokens_per_s"] / overlapped["tokens_per_s"], 3),
                "why": {
                    **_why(timed("tau0"), n, a.tau),
                    "overlap_s": round(statistics.median(m["overlap_s"] for m in timed(f"tau{a.tau}")), 4),
                    # one inner step beside the exchange (job b), against inner_step_s alone (job a)
                    "overlapped_step_s": round(statistics.median(m["rest_s"] for m in timed(f"tau{a.tau}")) / a.tau, 4),
                    # a round's median time in each job: what the overlap actually saved
                    "round_s": {k: round(statistics.median(m["step_time_s"] for m in timed(k)), 4) for k in jobs},
                },
            }
        )
    )
    return 0
