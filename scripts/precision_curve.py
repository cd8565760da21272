"""The bf16 compute policy against float32: the same config trained twice, one JSON line, a plot.

    python scripts/precision_curve.py [CONFIG] [--steps 300] [--plot docs/bf16_vs_fp32.png]

Runs `ftjax train CONFIG model.compute_dtype=float32|bfloat16 steps=N` (on this machine's CPU,
where bf16 matmuls are emulated: slow, but the same numerics as a GPU's bf16 inputs with float32
accumulation), and prints the final loss of each (the mean of the last 10 steps: one step's loss
is one batch's) and their relative difference. docs/design.md "Precision" cites the figure.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def train(config: str, dtype: str, steps: int, out: Path) -> list[float]:
    cmd = [sys.executable, "-m", "ftjax", "train", config, f"steps={steps}", f"model.compute_dtype={dtype}"]
    subprocess.run([*cmd, "ft.digest_every=0", "--out", str(out)], check=True, capture_output=True, text=True)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "event" not in r and r.get("loss") is not None]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", default="llama_tiny")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--plot", default=None, help="write both loss curves here (PNG)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        curves = {d: train(args.config, d, args.steps, Path(tmp) / d) for d in ("float32", "bfloat16")}
    final = {d: sum(c[-10:]) / len(c[-10:]) for d, c in curves.items()}
    rel = abs(final["bfloat16"] - final["float32"]) / final["float32"]
    print(json.dumps({"config": args.config, "steps": args.steps, "final_loss": final, "relative_difference": rel}))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for d, c in curves.items():
            ax.plot(range(1, len(c) + 1), c, label=f"{d} compute (final {final[d]:.4f})", lw=1)
        ax.set(xlabel="step", ylabel="loss", title=f"{args.config}: bf16 vs float32 compute (float32 master weights)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
