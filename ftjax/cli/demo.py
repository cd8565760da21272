"""`ftjax demo` (what `make demo` runs): a fault-tolerant job that survives a replica killed mid-FTAR.

Three replicas of the built-in config `tiny` (ftjax/configs/tiny.yaml) train on this machine;
replica 1 SIGKILLs itself in the middle of the gradient all-reduce of step --kill-step. The two
others finish that step without it and keep training; the launcher restarts replica 1, which catches
up from a live peer while the job goes on. At the end: the summary (every replica's digest equal,
every batch trained exactly once), and the paths of loss.png and timeline.png.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ftjax.config import resolve_config_path
from ftjax.launch.cli import main as launch


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="ftjax demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="runs/demo", help="run directory (an earlier demo there is replaced)")
    p.add_argument("--steps", type=int, default=300, help="steps of the demo job")
    p.add_argument("--kill-step", type=int, default=20, help="the step in whose FTAR replica 1 dies")
    args = p.parse_args(argv)
    if not 1 <= args.kill_step <= args.steps:
        p.error(f"--kill-step: must be in [1, --steps={args.steps}]")
    out = Path(args.out)
    overwrite = ["--overwrite"] if (out / "launcher.jsonl").exists() else []
    tiny = str(resolve_config_path("tiny"))
    return launch(
        [
            tiny,
            "--replicas",
            "3",
            "--kill",
            f"1@{args.kill_step}:ftar",
            "--out",
            str(out),
            *overwrite,
            f"steps={args.steps}",
        ]
    )
