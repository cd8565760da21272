"""`ftjax simulate`: goodput of fault-tolerant training at scale (see ftjax.sim).

Every input of ftjax.sim.config.SimConfig is an option (``--field-name``) that overrides the preset.
Output: a table, or with ``--json`` one JSON object keyed by strategy. ``--sweep PATH.png`` plots
ETTR and time-to-train against one input instead (``--sweep-over``, GPU count by default).
``--from-run RUN`` measures an `ftjax launch` run and predicts its ETTR.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import typing
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from ftjax.sim.config import SimConfig
from ftjax.sim.failures import TraceError
from ftjax.sim.model import CATEGORIES
from ftjax.sim.presets import PAPER_100K, PAPER_100K_ETTR, PRESET_STRATEGIES, PRESETS, PresetError, preset_inputs
from ftjax.sim.run import at_value, simulate, sweep, sweep_values
from ftjax.sim.strategies import STRATEGIES


class UsageError(Exception):
    """A bad option or input; the message names it. Exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        raise UsageError(message)


def _option(field: str) -> str:
    return "--" + field.replace("_", "-")


# -- parsers of option values whose type argparse cannot take as it is --


def _interval(text: str) -> float | str:
    if text in ("young", "daly", "optimal"):
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number nor young | daly | optimal: {text!r}") from None


def _curve(text: str) -> tuple[tuple[float, float], ...]:
    try:
        return tuple((float(f), float(t)) for f, t in (p.split(":") for p in text.split(",")))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected points F:Y,F:Y,... (e.g. 0:0,0.5:0.4,1:1), got {text!r}") from None


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _type_of(name: str) -> tuple[Any, str]:
    """(argparse type, metavar) of SimConfig field ``name``."""
    special = {
        "checkpoint_interval_min": (_interval, "X|young|daly|optimal"),
        "reduced_curve": (_curve, "F:T,..."),
        "step_scaling": (_curve, "F:X,..."),
        "packing": (_bool, "true|false"),
        "failure_trace": (str, "CSV"),
        "link_gbps": (float, "GBIT/S"),
        "params": (float, "N"),
    }
    if name in special:
        return special[name]
    annotation = SimConfig.model_fields[name].annotation
    return annotation, "N" if annotation is int else "X"


def _show(value: object) -> str:
    if isinstance(value, tuple):
        return ",".join(f"{f:g}:{t:g}" for f, t in value)
    return str(value)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ftjax simulate", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--preset",
        default="ft-hsdp-100k",
        choices=list(PRESETS),
        help="named inputs (ftjax.sim.presets; default ft-hsdp-100k)",
    )
    parser.add_argument("--summary", help="summary.json of an `ftjax launch` run (for --preset launch)")
    parser.add_argument("--strategies", help=f"comma-separated, from {', '.join(STRATEGIES)} (default: the preset's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--sweep", metavar="PATH.png", help="write a plot of ETTR and time-to-train vs --sweep-over")
    parser.add_argument(
        "--sweep-over",
        default="gpus",
        metavar="FIELD",
        help="the input to sweep (a field name, e.g. mtbf_min; default gpus: 1K-200K)",
    )
    parser.add_argument(
        "--sweep-values", metavar="V,V,...", help="its values (default: see ftjax.sim.run.sweep_values)"
    )
    parser.add_argument(
        "--from-run", metavar="RUN", help="measure an `ftjax launch` run directory and predict its ETTR"
    )
    parser.add_argument("--costs-from", metavar="RUN", help="with --from-run: take the costs from this other run")
    for name, info in SimConfig.model_fields.items():
        # default None: an option overrides the preset only when given.
        kwargs: dict[str, Any] = {
            "dest": name,
            "default": None,
            "help": f"{info.description} (ft-hsdp-100k: {_show(PAPER_100K[name])})",
        }
        if typing.get_origin(info.annotation) is typing.Literal:
            kwargs["choices"] = list(typing.get_args(info.annotation))
        else:
            kwargs["type"], kwargs["metavar"] = _type_of(name)
        parser.add_argument(_option(name), **kwargs)
    return parser


def _validation_message(e: ValidationError) -> str:
    problems = []
    for err in e.errors():
        msg = err["msg"].removeprefix("Value error, ")
        problems.append(f"{_option(str(err['loc'][0]))}: {msg}" if err["loc"] else msg)
    return "; ".join(problems)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """The validated inputs: the preset's, overridden by the options given."""
    overrides = {k: getattr(args, k) for k in SimConfig.model_fields if getattr(args, k) is not None}
    try:
        return SimConfig.model_validate(preset_inputs(args.preset, overrides, args.summary))
    except PresetError as e:
        raise UsageError(str(e)) from e
    except ValidationError as e:
        raise UsageError(_validation_message(e)) from e


def strategies_from_args(args: argparse.Namespace) -> list[str]:
    if args.strategies is None:
        return list(PRESET_STRATEGIES.get(args.preset, STRATEGIES))
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown or not names:
        raise UsageError(
            f"--strategies: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(STRATEGIES)}"
        )
    return names


def sweep_from_args(args: argparse.Namespace, cfg: SimConfig) -> tuple[str, list[Any]]:
    knob = args.sweep_over.replace("-", "_").removeprefix("__")
    if knob not in SimConfig.model_fields:
        raise UsageError(f"--sweep-over: unknown input {args.sweep_over!r} (a field name, e.g. mtbf_min)")
    if args.sweep_values is None:
        try:
            return knob, sweep_values(cfg, knob)
        except ValueError as e:
            raise UsageError(str(e)) from e
    annotation = SimConfig.model_fields[knob].annotation
    parse, _ = (str, "") if typing.get_origin(annotation) is typing.Literal else _type_of(knob)
    values = []
    for text in args.sweep_values.split(";" if knob in ("reduced_curve", "step_scaling") else ","):
        try:
            values.append(parse(text.strip()))
        except (ValueError, argparse.ArgumentTypeError) as e:
            raise UsageError(f"--sweep-values: {text!r} is not a value of {_option(knob)}: {e}") from None
    for v in values:
        try:
            at_value(cfg, knob, v)
        except ValidationError as e:
            raise UsageError(f"--sweep-values: {v!r}: {_validation_message(e)}") from None
    return knob, values


def _title(cfg: SimConfig, preset: str) -> str:
    link = (
        f", {cfg.params:.3g} params x {cfg.bytes_per_param:g} B over {cfg.link_gbps:g} Gbit/s "
        f"(all-reduce {cfg.allreduce_s():.3g} s, step {cfg.step_s:g} s)"
        if cfg.link_gbps is not None and cfg.params is not None
        else ""
    )
    return (
        f"{preset}: {cfg.gpus:,} GPUs = {cfg.replicas} replicas x {cfg.gpus // cfg.replicas:,}, "
        f"MTBF {cfg.mtbf_min:.3g} min ({cfg.failure_level} {cfg.failure_dist}, {cfg.blast_radius}), "
        f"restart {cfg.job_restart_min():.3g} min ({cfg.restart_policy}), "
        f"FT stall {cfg.ft_stall_min:.3g} + {cfg.replica_restart_min:.3g} min out, {cfg.seeds} seeds{link}"
    )


def _fmt(x: float | None, spec: str = ".3f") -> str:
    if x is None:
        return "-"
    return "inf" if math.isinf(x) else format(x, spec)


def _tables(cfg: SimConfig, preset: str, results: dict) -> list[Table]:
    """The summary per strategy, where the GPU-time goes, and the events by cause."""
    summary = Table(title=_title(cfg, preset), title_justify="left")
    cols = (
        "strategy",
        "ETTR",
        "analytic",
        "availability",
        "time-to-train ratio",
        f"time to train {cfg.steps:,} steps",
        "data trained",
        "effective MTBF",
        "failures",
    )
    for col in cols:
        summary.add_column(col, justify="left" if col == "strategy" else "right")
    for name, r in results.items():
        done = r.finished == r.seeds
        ttt = f"{r.time_to_train_h / 24:.1f} days" if done else f"not done ({r.finished}/{r.seeds})"
        ratio = _fmt(r.ttt_ratio, ".2f") if done else f"> {r.ttt_ratio:.3g}"
        summary.add_row(
            name,
            f"{r.ettr:.3f} ± {r.ettr_std:.3f}",
            _fmt(r.ettr_analytic),
            _fmt(r.availability),
            ratio,
            ttt,
            _fmt(r.data_trained),
            _fmt(r.effective_mtbf_min, ".3g") + " min",
            f"{r.failures:.0f}",
        )
    breakdown = Table(title="GPU-time breakdown", title_justify="left")
    breakdown.add_column("")
    for name in results:
        breakdown.add_column(name, justify="right")
    for c in CATEGORIES:
        if any(r.breakdown[c] > 5e-5 for r in results.values()):
            breakdown.add_row(c, *(f"{100 * r.breakdown[c]:.1f}%" for r in results.values()))
    counts = Table(title="events per run, by cause (mean over seeds)", title_justify="left")
    counts.add_column("")
    for name in results:
        counts.add_column(name, justify="right")
    keys = sorted({k for r in results.values() for k in r.counts})
    for k in keys:
        counts.add_row(k, *(f"{r.counts[k]:.4g}" if k in r.counts else "-" for r in results.values()))
    tables = [summary, breakdown, counts, *([_comm_table(results)] if any(r.comm for r in results.values()) else [])]
    notes = [f"{n}: {r.note}" for n, r in results.items() if r.note]
    intervals = [
        f"{n}: {r.checkpoint_interval_min:.3g} min" for n, r in results.items() if r.checkpoint_interval_min is not None
    ]
    if notes or intervals:
        extra = Table(show_header=False, box=None)
        extra.add_column()
        if intervals:
            extra.add_row("checkpoint interval: " + "; ".join(intervals))
        for note in notes:
            extra.add_row("not finished: " + note)
        tables.append(extra)
    return tables


def _comm_table(results: dict) -> Table:
    """What the inter-replica averages cost each strategy (--link-gbps, --params)."""
    comm = Table(title="inter-replica averages (failure-free)", title_justify="left")
    for col in ("strategy", "bytes per average", "every (steps)", "all-reduce s", "per step s", "share of a step"):
        comm.add_column(col, justify="left" if col == "strategy" else "right")
    for name, r in results.items():
        if r.comm:
            c = r.comm
            comm.add_row(
                name,
                f"{c['bytes_per_sync']:.4g}",
                f"{c['steps_per_sync']:g}",
                f"{c['sync_s']:.4g}",
                f"{c['comm_s_per_step']:.4g}",
                f"{100 * c['comm_share']:.1f}%",
            )
    return comm


def _console() -> Console:
    """A terminal's width, or 160 columns in a pipe (rich's 80 would cut the column names)."""
    return Console() if sys.stdout.isatty() else Console(width=160)


def _error(message: str) -> int:
    print(f"ftjax simulate: error: {message}", file=sys.stderr)
    return 2


def _from_run(args: argparse.Namespace) -> int:
    from ftjax.sim.from_run import RunError, predict

    try:
        out = predict(args.from_run, args.costs_from)
    except RunError as e:
        return _error(str(e))
    if args.json:
        print(json.dumps(out))
        return 0
    table = Table(
        title=f"{out['run']}: ETTR measured vs predicted (costs from {out['costs_from']})", title_justify="left"
    )
    for col in ("failures", "measured ETTR", "predicted ETTR", "error", "window s (measured / simulated)"):
        table.add_column(col, justify="right")
    table.add_row(
        str(out["failures"]),
        f"{out['measured_ettr']:.3f}",
        f"{out['predicted_ettr']:.3f}",
        f"{out['error']:+.3f}",
        f"{out['window_s']:.1f} / {_fmt(out['predicted_window_s'], '.1f')}",
    )
    costs = Table(title="measured costs (seconds)", title_justify="left")
    for k in out["costs"]:
        costs.add_column(k, justify="right")
    costs.add_row(
        *(
            f"{v:.4g}" if isinstance(v, float) else " ".join(f"{f:g}:{x:.3g}" for f, x in v)
            for v in out["costs"].values()
        )
    )
    console = _console()
    console.print(table)
    console.print(costs)
    for note in out["ignored"]:
        console.print(f"ignored: {note}")
    return 0


def main(argv: list[str]) -> int:
    """Entry point of `ftjax simulate`; returns the exit code (2 for bad options)."""
    try:
        args = build_parser().parse_args(argv)
        if args.costs_from and not args.from_run:
            raise UsageError("--costs-from needs --from-run")
        if args.from_run:
            return _from_run(args)
        cfg = config_from_args(args)
        names = strategies_from_args(args)
        sweep_spec = sweep_from_args(args, cfg) if args.sweep else None
    except UsageError as e:
        return _error(str(e))
    except SystemExit as e:  # --help
        return int(e.code or 0)

    try:
        if sweep_spec is not None:
            if not Path(args.sweep).resolve().parent.is_dir():
                return _error(f"--sweep: no directory for {args.sweep}")
            return _sweep(args, cfg, names, *sweep_spec)
        results = simulate(cfg, names)
    except TraceError as e:
        return _error(str(e))
    if args.json:
        print(json.dumps({name: r.to_json() for name, r in results.items()}))
    else:
        console = _console()
        for table in _tables(cfg, args.preset, results):
            console.print(table)
    return 0


def _sweep(args: argparse.Namespace, cfg: SimConfig, names: list[str], knob: str, values: list[Any]) -> int:
    from ftjax.sim.plot import write_sweep  # matplotlib is only needed here

    series = sweep(cfg, knob, values, names)
    reference = PAPER_100K_ETTR if args.preset == "ft-hsdp-100k" and knob == "gpus" else None
    write_sweep(
        args.sweep,
        knob,
        values,
        series,
        title=_title(cfg, args.preset),
        reference=reference,
        reference_at=PRESETS["ft-hsdp-100k"]["gpus"],
    )
    shown = [v if isinstance(v, (bool, int, float, str)) else _show(v) for v in values]
    if args.json:
        print(
            json.dumps(
                {
                    "png": args.sweep,
                    "over": knob,
                    "values": shown,
                    **{
                        metric: {k: [None if v is None else round(v, 4) for v in vs] for k, vs in by.items()}
                        for metric, by in series.items()
                    },
                }
            )
        )
        return 0
    table = Table(title=f"ETTR (time-to-train ratio) vs {knob} ({args.sweep})", title_justify="left")
    table.add_column(knob, justify="right")
    for name in names:
        table.add_column(name, justify="right")
    for i, v in enumerate(shown):
        table.add_row(
            _show(v), *(f"{series['ettr'][n][i]:.3f} ({_fmt(series['ttt_ratio'][n][i], '.2f')})" for n in names)
        )
    _console().print(table)
    return 0
