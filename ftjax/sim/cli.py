"""`ftjax simulate`: goodput of fault-tolerant training at scale (see ftjax.sim).

Every input of ftjax.sim.model.SimConfig is an option (``--field-name``) that overrides the preset.
Output: a table, or with ``--json`` one JSON object keyed by strategy; ``--sweep PATH.png`` plots
effective training time against GPU count (1K to 200K) instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import typing
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from ftjax.sim.model import CATEGORIES, SimConfig
from ftjax.sim.presets import PAPER_100K, PAPER_100K_ETTR, PRESETS, PresetError, preset_inputs
from ftjax.sim.run import StrategyResult, simulate, sweep, sweep_gpu_counts


class UsageError(Exception):
    """A bad option or input; the message names it. Exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        raise UsageError(message)


def _option(field: str) -> str:
    return "--" + field.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ftjax simulate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="ft-hsdp-100k", choices=list(PRESETS),
                        help="named inputs (ftjax.sim.presets; default ft-hsdp-100k)")
    parser.add_argument("--summary", help="summary.json of an `ftjax launch` run (for --preset launch)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--sweep", metavar="PATH.png", help="write a plot of ETTR vs GPU count (1K-200K)")
    for name, info in SimConfig.model_fields.items():
        # default None: an option overrides the preset only when given.
        kwargs: dict[str, Any] = {"dest": name, "default": None,
                                  "help": f"{info.description} (ft-hsdp-100k: {PAPER_100K[name]})"}
        if typing.get_origin(info.annotation) is typing.Literal:
            kwargs["choices"] = list(typing.get_args(info.annotation))
        else:
            kwargs["type"] = info.annotation
            kwargs["metavar"] = "N" if info.annotation is int else "X"
        parser.add_argument(_option(name), **kwargs)
    return parser


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """The validated inputs: the preset's, overridden by the options given."""
    overrides = {k: getattr(args, k) for k in SimConfig.model_fields if getattr(args, k) is not None}
    try:
        return SimConfig.model_validate(preset_inputs(args.preset, overrides, args.summary))
    except PresetError as e:
        raise UsageError(str(e)) from e
    except ValidationError as e:
        problems = []
        for err in e.errors():
            msg = err["msg"].removeprefix("Value error, ")
            problems.append(f"{_option(str(err['loc'][0]))}: {msg}" if err["loc"] else msg)
        raise UsageError("; ".join(problems)) from e


def _title(cfg: SimConfig, preset: str) -> str:
    return (f"{preset}: {cfg.gpus:,} GPUs = {cfg.replicas} replicas x {cfg.gpus // cfg.replicas:,}, "
            f"MTBF {cfg.mtbf_min:.3g} min ({cfg.failure_dist}), sync stall {cfg.sync_stall_min:.3g} min, "
            f"FT stall {cfg.ft_stall_min:.3g} + {cfg.replica_restart_min:.3g} min out, "
            f"overlap={cfg.overlap}, {cfg.seeds} seeds")


def _tables(cfg: SimConfig, preset: str, results: dict[str, StrategyResult]) -> list[Table]:
    """The summary per strategy, and where the GPU-time goes (one column per strategy)."""
    summary = Table(title=_title(cfg, preset), title_justify="left")
    for col in ("strategy", "ETTR", "analytic", f"time to train {cfg.steps:,} steps", "failures"):
        summary.add_column(col, justify="left" if col == "strategy" else "right")
    for name, r in results.items():
        ttt = f"{r.time_to_train_h / 24:.1f} days" if r.time_to_train_h is not None else \
            f"not done ({r.finished}/{r.seeds})"
        summary.add_row(name, f"{r.ettr:.3f} ± {r.ettr_std:.3f}",
                        "-" if r.ettr_analytic is None else f"{r.ettr_analytic:.3f}", ttt, f"{r.failures:.0f}")
    breakdown = Table(title="GPU-time breakdown", title_justify="left")
    breakdown.add_column("")
    for name in results:
        breakdown.add_column(name, justify="right")
    for c in CATEGORIES:
        if any(r.breakdown[c] > 5e-5 for r in results.values()):
            breakdown.add_row(c, *(f"{100 * r.breakdown[c]:.1f}%" for r in results.values()))
    return [summary, breakdown]


def main(argv: list[str]) -> int:
    """Entry point of `ftjax simulate`; returns the exit code (2 for bad options)."""
    try:
        args = build_parser().parse_args(argv)
        cfg = config_from_args(args)
    except UsageError as e:
        print(f"ftjax simulate: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)

    if args.sweep:
        if not Path(args.sweep).resolve().parent.is_dir():
            print(f"ftjax simulate: error: --sweep: no directory for {args.sweep}", file=sys.stderr)
            return 2
        from ftjax.sim.plot import write_sweep  # matplotlib is only needed here

        counts = sweep_gpu_counts(cfg)
        series = sweep(cfg, counts)
        reference = PAPER_100K_ETTR if args.preset == "ft-hsdp-100k" else None
        write_sweep(args.sweep, counts, series, title=_title(cfg, args.preset), reference=reference,
                    reference_gpus=PRESETS["ft-hsdp-100k"]["gpus"])
        if args.json:
            print(json.dumps({"png": args.sweep, "gpus": counts,
                              "ettr": {k: [round(v, 4) for v in vs] for k, vs in series.items()}}))
        else:
            table = Table(title=f"ETTR vs GPUs ({args.sweep})", title_justify="left")
            table.add_column("GPUs", justify="right")
            for name in series:
                table.add_column(name, justify="right")
            for i, gpus in enumerate(counts):
                table.add_row(f"{gpus:,}", *(f"{vs[i]:.3f}" for vs in series.values()))
            Console().print(table)
        return 0

    results = simulate(cfg)
    if args.json:
        print(json.dumps({name: r.to_json() for name, r in results.items()}))
    else:
        console = Console()
        for table in _tables(cfg, args.preset, results):
            console.print(table)
    return 0
