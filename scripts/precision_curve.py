"""A bfloat16 setting against float32: the same config trained twice, one JSON line, a plot.

    python scripts/precision_curve.py [CONFIG] [--steps 300] [--plot docs/bf16_vs_fp32.png]
    python scripts/precision_curve.py llama_tiny --setting ft.wire_dtype --replicas 2

Runs `ftjax train CONFIG SETTING=float32|bfloat16 steps=N` (default setting: model.compute_dtype;
on this machine's CPU bf16 matmuls are emulated: slow, but the same numerics as a GPU's bf16
inputs with float32 accumulation), or with `--replicas R` (R > 1) `ftjax launch CONFIG --replicas R`
(FTAR between them: what ft.wire_dtype changes), and prints the final loss of each (replica 0's,
the mean of the last 10 steps: one step's loss is one batch's) and their relative difference.
docs/design/model.md "Precision" and "One step" cite the figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def train(config: str, setting: str, dtype: str, steps: int, replicas: int, out: Path) -> list[float]:
    how = ["train"] if replicas == 1 else ["launch", "--replicas", str(replicas)]
    cmd = [sys.executable, "-m", "ftjax", *how, config, f"steps={steps}", f"{setting}={dtype}"]
    subprocess.run([*cmd, "ft.digest_every=0", "--out", str(out)], check=True, capture_output=True, text=True)
    metrics = out / "metrics.jsonl" if replicas == 1 else out / "replica-0" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "event" not in r and r.get("loss") is not None]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", default="llama_tiny")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--plot", default=None, help="write both loss curves here (PNG)")
    p.add_argument("--setting", default="model.compute_dtype", help="the setting set to float32, then bfloat16")
    p.add_argument("--replicas", type=int, default=1, help="more than 1: a fault-tolerant job of that many")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        curves = {
            d: train(args.config, args.setting, d, args.steps, args.replicas, Path(tmp) / d)
            for d in ("float32", "bfloat16")
        }
    final = {d: sum(c[-10:]) / len(c[-10:]) for d, c in curves.items()}
    rel = abs(final["bfloat16"] - final["float32"]) / final["float32"]
    record = {"config": args.config, "setting": args.setting, "replicas": args.replicas, "steps": args.steps}
    print(json.dumps({**record, "final_loss": final, "relative_difference": rel}))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for d, c in curves.items():
            ax.plot(range(1, len(c) + 1), c, label=f"{args.setting}={d} (final {final[d]:.4f})", lw=1)
        ax.set(xlabel="step", ylabel="loss", title=f"{args.config}: {args.setting} bf16 vs float32")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
