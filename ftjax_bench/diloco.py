"""`ftjax bench diloco CONFIG [key=value ...]`: DiLoCo against every-step sync over a slow link.

Two jobs of `--replicas` replicas, one after the other, with the same config and the same tokens:
(a) `ft.sync=every_step` for `--steps` steps, (b) `ft.sync=diloco` (or `--sync streaming_diloco`)
with `--inner` inner steps per round for steps / inner rounds (streaming: steps x fragments /
inner). With `--virtual-cluster` every replica runs on a host of its own and `--bandwidth-mbit`
caps every host's link (`ftjax launch --bandwidth-mbit all=MBIT`): the inter-replica network is
the slow one of a job across buildings. Without it the replicas share this machine's loopback
(then the ratio shows the compute saved, not the network).

Prints one JSON line: each job's tokens/s (all replicas' tokens of the steps after the first
`--warmup` ones, over the time they took), `speedup` = (b) / (a), and each job's bytes per token:
`averaged_bytes_per_token`, float32 bytes of the averaged update per token trained (each replica
averages the update of its own tokens), and `wire_bytes_per_token` = that x 2 (R - 1) / R, what
each replica sends around the FTAR ring (x 0.5 with ft.wire_dtype=bfloat16); `peak_round_share`,
the most bytes one round of (b) averaged against a whole update (1 for DiLoCo, 1/fragments to one
element when streaming); and the final losses.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from ftjax.runs.jsonl import read_jsonl
from ftjax_bench import common


def job_arguments(p: argparse.ArgumentParser) -> None:
    """The flags `_job` reads besides --replicas (ftjax bench diloco's and ftjax bench overlap's)."""
    p.add_argument("--virtual-cluster", action="store_true", help="each replica on a virtual host of its own")
    p.add_argument("--bandwidth-mbit", type=float, default=100.0, help="with --virtual-cluster: every link's cap")
    p.add_argument("--timeout", type=float, default=900, help="seconds, limit for each job")
    p.add_argument("--out", default=None, help="keep the runs here")


def _job(config: str, overrides: list[str], out: Path, args, timeout: float) -> list[list[dict]]:
    """Run one job with `ftjax launch`; each replica's committed step records."""
    cmd = [sys.executable, "-m", "ftjax", "launch", config, *overrides, "--replicas", str(args.replicas)]
    cmd += ["--out", str(out), "--overwrite", "--timeout-s", str(int(timeout)), "--no-plots"]
    if args.virtual_cluster:
        cmd += ["--virtual-cluster", "--bandwidth-mbit", f"all={args.bandwidth_mbit:g}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 60)
    if done.returncode != 0:
        raise RuntimeError(
            f"{out.name}: ftjax launch exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    return [
        [m for m in read_jsonl(out / f"replica-{r}" / "metrics.jsonl") if m.get("committed") and "step" in m]
        for r in range(args.replicas)
    ]


def _figures(records: list[list[dict]], warmup: int, replicas: int, param_bytes: int) -> dict:
    """Tokens/s after the warm-up steps (all replicas, over the span of replica 0's steps after it),
    and bytes per token."""
    first = [m for m in records[0] if m["step"] == warmup]
    rest = [[m for m in recs if m["step"] > warmup] for recs in records]
    if not first or not rest[0]:
        raise RuntimeError(f"too few steps after the {warmup} warm-up steps")
    t0, t1 = first[0]["time"], rest[0][-1]["time"]
    tokens = sum(m["tokens"] for recs in rest for m in recs if m["time"] <= t1)
    per_replica_tokens = sum(m["tokens"] for m in rest[0])
    averaged = sum(m.get("sync_bytes", param_bytes) for m in rest[0])
    per_token = averaged / per_replica_tokens
    return {
        "tokens_per_s": round(tokens / (t1 - t0), 1),
        "steps_timed": len(rest[0]),
        "averaged_bytes_per_token": round(per_token, 2),
        "peak_bytes_per_round": max(m.get("sync_bytes", param_bytes) for m in rest[0]),
        "wire_bytes_per_token": round(per_token * 2 * (replicas - 1) / replicas, 2),
        "final_loss": round(records[0][-1]["loss"], 4),
    }


def main(argv: list[str]) -> int:
    p = common.parser("diloco", __doc__, config_default="llama_tiny")
    p.add_argument("overrides", nargs="*", help="config overrides, key.sub=value")
    p.add_argument("--replicas", type=int, default=2, help="replicas in each job")
    p.add_argument("--steps", type=int, default=200, help="inner steps of each job (every-step: its steps)")
    p.add_argument("--inner", type=int, default=20, help="DiLoCo's inner steps per round (ft.inner_steps)")
    p.add_argument(
        "--sync",
        choices=["diloco", "streaming_diloco"],
        default="diloco",
        help="the DiLoCo mode against every-step sync",
    )
    p.add_argument("--fragments", type=int, default=4, help="streaming_diloco's fragments")
    p.add_argument("--warmup", type=int, default=1, help="steps (rounds) of each job not timed (compiles)")
    job_arguments(p)
    a = p.parse_args(argv)
    per_round = a.inner // (a.fragments if a.sync == "streaming_diloco" else 1)
    if a.steps % per_round or a.steps // per_round <= a.warmup:
        p.error(f"--steps ({a.steps}) must be a multiple of the {per_round} inner steps of a round, past --warmup")
    base = [*a.overrides, f"steps={a.steps}", "ft.sync=every_step"]
    rounds = [*a.overrides, f"steps={a.steps // per_round}", f"ft.sync={a.sync}", f"ft.inner_steps={a.inner}"]
    rounds += [f"ft.fragments={a.fragments}"]
    if (cfg := common.load("diloco", a.config, rounds)) is None or common.load("diloco", a.config, base) is None:
        return 2
    import jax  # (after the config check: JAX starts here)

    from ftjax.program.step import build_program

    program = build_program(cfg)
    param_bytes = sum(x.size * 4 for x in jax.tree.leaves(program.abstract_state()["params"]))
    with common.run_directory("diloco", a.out) as out:
        every = _figures(_job(a.config, base, out / "every_step", a, a.timeout), a.warmup, a.replicas, param_bytes)
        dl = _figures(_job(a.config, rounds, out / a.sync, a, a.timeout), a.warmup, a.replicas, param_bytes)
    print(
        json.dumps(
            {
                "bench": "diloco",
                "config": a.config,
                "sync": a.sync,
                "replicas": a.replicas,
                "inner_steps": a.inner,
                "fragments": a.fragments if a.sync == "streaming_diloco" else 1,
                "steps": a.steps,
                "virtual_cluster": a.virtual_cluster,
                "bandwidth_mbit": a.bandwidth_mbit if a.virtual_cluster else None,
                "param_bytes": param_bytes,
                "every_step": every,
                a.sync: dl,
                "speedup": round(dl["tokens_per_s"] / every["tokens_per_s"], 3),
                "bytes_ratio": round(every["averaged_bytes_per_token"] / dl["averaged_bytes_per_token"], 2),
                # the most one round averages against a whole update (streaming: 1/fragments to one element)
                "peak_round_share": round(dl["peak_bytes_per_round"] / param_bytes, 4),
            }
        )
    )
    return 0
