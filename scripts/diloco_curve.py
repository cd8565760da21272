"""DiLoCo against every-step sync at equal tokens: two jobs, one JSON line, a plot.

    python scripts/diloco_curve.py [CONFIG] [--steps 300] [--inner 20] [--warmup 0] [--seeds 0,1,2,3] \\
        [--plot docs/diloco_vs_every_step.png]

For each seed (`seed=S`: the initial parameters and the data order), runs `ftjax launch CONFIG
--replicas R` twice with the same tokens: `ft.sync=every_step` for `--steps` steps, then
`ft.sync=diloco` (`--sync streaming_diloco`) for steps / inner rounds of `--inner` inner steps
(with `--warmup W`: W synchronous steps, `ft.sync_warmup_steps=W`, then (steps - W) / inner rounds).
`--floor` adds a third job in the same run: `ft.sync=diloco` with one inner step per round and plain
averaging (outer lr 1, no momentum), i.e. every replica's own AdamW step, then the parameters
averaged, every step: what DiLoCo's per-replica inner optimizer costs with no sync interval at all.
Prints the loss of each job's final parameters (DiLoCo's: the global ones) on the same held-out
batches (far beyond any batch trained), their relative difference per seed and its mean over the
seeds (one seed's difference moves by a percent with the seed alone); plots the training losses,
averaged over the seeds, against inner steps (equal tokens).
`--set key=value` adds overrides to the DiLoCo job only (e.g. ft.outer_lr=0.5), `--both` to both.
docs/design/replicas.md, "Training across slow links", cites the figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path


def job(config: str, overrides: list[str], replicas: int, out: Path) -> dict[int, float]:
    """Run one job; step -> the mean training loss over the replicas that committed it."""
    cmd = [sys.executable, "-m", "ftjax", "launch", config, "--replicas", str(replicas), *overrides, "--no-plots"]
    done = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}{done.stderr[-2000:]}")
    by_step: dict[int, list[float]] = defaultdict(list)
    for r in range(replicas):
        for line in (out / f"replica-{r}" / "metrics.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if rec.get("committed") and rec.get("loss") is not None:
                by_step[rec["step"]].append(rec["loss"])
    return {s: sum(v) / len(v) for s, v in by_step.items()}


def held_out(config: str, overrides: list[str], run: Path, batches: int) -> float:
    """The mean loss of replica 0's final parameters (the job's: replicas end bitwise equal) on
    `batches` batches far beyond any the job trained (the same for both jobs)."""
    import numpy as np

    from ftjax.config import load_config
    from ftjax.program.data import make_stream
    from ftjax.program.step import build_program, device_batch, where
    from ftjax.runtime.checkpoint import load_init

    cfg = load_config(config, overrides)
    program = build_program(cfg)
    last = max((run / "replica-0" / "checkpoints").iterdir(), key=lambda d: int(d.name) if d.name.isdigit() else -1)
    params = load_init(last / "state", program.abstract_state(), opt=False)["params"]
    stream = make_stream(cfg, replica=0)
    losses = [
        program.grads(params, {}, device_batch(program, stream.batch(100_000 + i)), where(0, 0, 0))[0]
        for i in range(batches)
    ]
    return float(np.mean([float(x) for x in losses]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", default="llama_tiny")
    p.add_argument("--steps", type=int, default=300, help="inner steps of each job")
    p.add_argument("--inner", type=int, default=20)
    p.add_argument("--warmup", type=int, default=0, help="DiLoCo's synchronous warm-up steps (ft.sync_warmup_steps)")
    p.add_argument("--sync", choices=["diloco", "streaming_diloco"], default="diloco")
    p.add_argument("--fragments", type=int, default=4)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--held-out", type=int, default=16, help="held-out batches the final parameters are scored on")
    p.add_argument("--set", action="append", default=[], help="an override of the DiLoCo job (repeatable)")
    p.add_argument("--both", action="append", default=[], help="an override of both jobs (repeatable)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds; the figures are their mean")
    p.add_argument("--plot", default=None, help="write both curves here (PNG)")
    p.add_argument("--floor", action="store_true", help="also run H = 1 with plain averaging (see above)")
    a = p.parse_args()
    per_round = a.inner // (a.fragments if a.sync == "streaming_diloco" else 1)
    n = a.warmup + (a.steps - a.warmup) // per_round
    every = ["ft.digest_every=0", *a.both, f"steps={a.steps}", f"checkpoint.every={a.steps}"]
    rounds = ["ft.digest_every=0", *a.both, f"steps={n}", f"checkpoint.every={n}", f"ft.sync={a.sync}"]
    rounds += [f"ft.inner_steps={a.inner}", f"ft.fragments={a.fragments}", *a.set]
    rounds += [f"ft.sync_warmup_steps={a.warmup}"] if a.warmup else []
    floor = [*every, "ft.sync=diloco", "ft.inner_steps=1", "ft.outer_lr=1.0", "ft.outer_momentum=0.0"]
    finals, base, dl = {}, defaultdict(list), defaultdict(list)
    for seed in [int(x) for x in a.seeds.split(",")]:
        e, d, f = [*every, f"seed={seed}"], [*rounds, f"seed={seed}"], [*floor, f"seed={seed}"]
        with tempfile.TemporaryDirectory() as tmp:
            for step, loss in job(a.config, e, a.replicas, Path(tmp) / "every_step").items():
                base[step].append(loss)
            for step, loss in job(a.config, d, a.replicas, Path(tmp) / a.sync).items():
                dl[step].append(loss)
            finals[seed] = {
                "every_step": held_out(a.config, e, Path(tmp) / "every_step", a.held_out),
                a.sync: held_out(a.config, d, Path(tmp) / a.sync, a.held_out),
            }
            if a.floor:
                job(a.config, f, a.replicas, Path(tmp) / "floor")
                finals[seed]["floor"] = held_out(a.config, f, Path(tmp) / "floor", a.held_out)
    # the x axis: inner steps of one replica (equal tokens: every replica trains one batch per inner
    # step); a DiLoCo round's loss is its inner steps' mean, at the round's middle (a warm-up step's: its own)
    mean = lambda v: sum(v) / len(v)
    at = lambda s: s if s <= a.warmup else a.warmup + (s - a.warmup - 0.5) * per_round
    curves = {"every_step": {s: mean(v) for s, v in base.items()}, a.sync: {at(s): mean(v) for s, v in dl.items()}}
    rel = {seed: (f[a.sync] - f["every_step"]) / f["every_step"] for seed, f in finals.items()}
    final = {name: mean([f[name] for f in finals.values()]) for name in ("every_step", a.sync)}
    record = {"config": a.config, "replicas": a.replicas, "steps": a.steps, "inner_steps": a.inner, "warmup": a.warmup}
    record.update({"both": a.both, "set": a.set, "sync": a.sync, "held_out_loss": finals})
    record["relative_difference"] = {seed: round(r, 4) for seed, r in rel.items()}
    record["mean_relative_difference"] = round(mean(list(rel.values())), 4)
    if a.floor:
        rel_floor = [(f["floor"] - f["every_step"]) / f["every_step"] for f in finals.values()]
        record["floor_mean_relative_difference"] = round(mean(rel_floor), 4)
    print(json.dumps(record))
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.6))
        for name, c in curves.items():
            xs = sorted(c)
            label = f"{name} (held-out loss at the end {final[name]:.3f})"  # (the seeds' mean)
            ax.plot(xs, [c[x] for x in xs], lw=1, label=label)
        ax.set_xlabel("inner steps per replica (equal tokens)")
        ax.set_ylabel("training loss (mean over replicas)")
        outer = " ".join(x.removeprefix("ft.") for x in a.set)
        seeds = f"{len(finals)} seeds" if len(finals) > 1 else f"seed {a.seeds}"
        warm = f" after {a.warmup} synchronous steps" if a.warmup else ""
        title = f"{a.config}: {a.replicas} replicas, {a.sync} H={a.inner}{warm}\n{outer} against every step ({seeds})"
        ax.set_title(title, fontsize=9)
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
