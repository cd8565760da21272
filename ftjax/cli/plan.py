"""`ftjax plan CONFIG [key=value ...]`: what a config asks of each device of a replica, without an
accelerator: parameters, state bytes per device (exact, from shapes, dtypes and shardings), the
gradient step's batch, gradients, activations and temporaries (XLA's memory analysis of the step,
compiled for as many simulated CPU devices as the replica has), what its backward pass keeps (JAX's
residuals of a micro-batch: the same on any platform), FLOPs per step and per token (XLA's
cost analysis, and 6N + attention for the built-in transformers), and with a device
(`--device-kind`, `--device-memory-gib`) whether it fits: exit 2 if it does not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ftjax.base.accelerators import GIB, Accelerator, known_names, lookup
from ftjax.base.env import configure_process
from ftjax.config import Config, ConfigError, load_config

if TYPE_CHECKING:  # (imported where it runs: it imports JAX)
    from ftjax.program.plan import Plan


def _positive(kind: type, what: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ftjax plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("config", help="YAML config: a path, or a built-in name (tiny, gpt_small)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. data.batch_size=16")
    device = p.add_argument_group("the device (for the verdict; without one, the numbers alone)")
    device.add_argument(
        "--device-kind",
        metavar="KIND",
        help='a known device, by JAX device kind or short name: "NVIDIA H100 80GB HBM3", H100, H200, A100, '
        "v5e, v5p, v4 (its memory and peak FLOP/s from ftjax/base/accelerators.py)",
    )
    device.add_argument(
        "--device-memory-gib",
        type=_positive(float, "a positive number of GiB"),
        metavar="N",
        help="the memory one device has for this job, in GiB (wins over the device kind's)",
    )
    mesh = p.add_argument_group("the replica's mesh (default: the config's mesh section)")
    mesh.add_argument("--hosts", type=_positive(int, "a positive integer"), metavar="H", help="sets mesh.hosts")
    mesh.add_argument(
        "--devices-per-host", type=_positive(int, "a positive integer"), metavar="D", help="sets mesh.devices_per_host"
    )
    p.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    return p


def _fail(text: str) -> int:
    print(f"ftjax plan: error: {text}", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    args = build_parser().parse_intermixed_args(argv)
    accelerator = lookup(args.device_kind) if args.device_kind else None
    if args.device_kind and accelerator is None:
        return _fail(
            f"--device-kind: {args.device_kind!r} is not a known device (known: {known_names()}); "
            "give its memory with --device-memory-gib instead"
        )
    given = {"hosts": args.hosts, "devices_per_host": args.devices_per_host}
    mesh = [f"mesh.{key}={value}" for key, value in given.items() if value is not None]
    try:
        cfg = load_config(args.config, [*args.overrides, *mesh])
    except ConfigError as e:
        hint = " (--hosts and --devices-per-host set mesh.hosts and mesh.devices_per_host)" if mesh else ""
        return _fail(f"config error: {e}{hint}")
    # CPU devices stand in for the replica's accelerators (before JAX is imported)
    configure_process(device_count=cfg.mesh.live_devices)
    os.environ["JAX_PLATFORMS"] = "cpu"
    from ftjax.program.plan import plan_program
    from ftjax.program.step import build_program
    from ftjax.program.task import TaskError

    try:
        cfg, note = _plannable(cfg)
        plan = plan_program(build_program(cfg), backward=True)
    except TaskError as e:
        return _fail(str(e))
    report = _report(args, cfg, plan, accelerator)
    report["notes"] = [n for n in (note, _remat_note(cfg), _bfloat16_note(cfg)) if n]
    print(json.dumps(report) if args.json else _table(report))
    if report["fits"] is False:
        return _fail(f"{args.config}: {report['verdict']}")
    return 0


def _remat_note(cfg: Config) -> str | None:
    """What the temporaries of an unrolled model under remat are on CPU (docs/design/index.md, "Memory,
    FLOPs and MFU"): XLA:CPU keeps a block's activations whatever jax.checkpoint says."""
    model = cfg.model
    if model.kind not in ("llama", "gpt") or model.remat == "none" or model.scan_layers:
        return None
    remedy = "; model.scan_layers=true makes the CPU compile show it" if model.kind == "llama" else ""
    return (
        f"model.remat={model.remat}: the CPU compile of unrolled blocks keeps their activations, so the "
        f'temporaries above are remat none\'s, an upper bound{remedy} (docs/design/model.md, "Scanned layers")'
    )


def _bfloat16_note(cfg: Config) -> str | None:
    """What XLA:CPU does with bfloat16 activations (docs/design/model.md, "What the backward pass keeps"):
    it has no bfloat16 matmul, and converts what the backward pass keeps to float32 as well."""
    if cfg.model.compute_dtype != "bfloat16":
        return None
    return (
        "model.compute_dtype=bfloat16: XLA:CPU keeps a bfloat16 activation saved for the backward pass "
        "also as float32 (it computes matmuls in float32), so the temporaries above count it up to three "
        "times; an accelerator keeps it once (the kept-for-backward row)"
    )


def _plannable(cfg: Config) -> tuple[Config, str | None]:
    """The config to plan: itself, or, when it trains the built-in model on token files that are
    not on this machine (planned before `ftjax data prepare`, or elsewhere), the same model on the
    built-in corpus: the shapes, and so every figure, are the same."""
    from ftjax.program.tokens import INDEX

    index = Path(str(cfg.task_args.get("dir", ""))) / INDEX
    if cfg.task != "ftjax.program.tasks:token_lm" or index.exists():
        return cfg, None  # (token_lm itself names anything else wrong with its files)
    planned = cfg.model_copy(update={"task": "ftjax.program.tasks:language_model", "task_args": {}})
    return planned, f"planned on the built-in corpus (same shapes): {index}: no such file"


# model settings that put part of a step in a loop, and what XLA's FLOPs then count of it (one trip)
_LOOPED = {
    "attention_chunk": "one chunk of model.attention_chunk's attention",
    "logits_chunk": "one chunk of model.logits_chunk's output projection",
    "scan_layers": "one of model.scan_layers' blocks",
}


def _report(args: argparse.Namespace, cfg: Config, plan: Plan, accelerator: Accelerator | None) -> dict[str, Any]:
    """Everything `ftjax plan` prints, as one JSON object."""
    from ftjax.program.plan import verdict

    memory = int(args.device_memory_gib * GIB) if args.device_memory_gib else None
    if memory is None and accelerator is not None:
        memory = accelerator.memory_bytes
    name = accelerator.name if accelerator is not None else "a device"
    fits, text = verdict(plan, name, memory) if memory is not None else (None, None)
    device: dict[str, Any] | None = None
    if memory is not None:
        device = {
            "name": name,
            "memory_bytes": memory,
            "peak_bf16_flops": accelerator.peak_bf16_flops if accelerator else None,
            "peak_fp32_flops": accelerator.peak_fp32_flops if accelerator else None,
        }
    peak = device["peak_bf16_flops"] if device else None
    work = plan.closed_form_flops_per_step or plan.flops_per_step  # (what MFU counts, where known)
    ideal = work / (plan.devices * peak) if peak and work else None
    return {
        "config": args.config,
        "overrides": args.overrides,
        "hosts": cfg.mesh.live,
        "devices_per_host": cfg.mesh.devices_per_host,
        **{name: getattr(cfg.model, name) for name in _LOOPED},
        **plan.as_dict(),
        "device": device,
        "step_s_at_peak": ideal,
        "fits": fits,
        "verdict": text,
    }


def ideal_work(r: dict[str, Any]) -> str:
    """What the step time at 100% MFU divides by the peak (`_report`: Plan.closed_form_flops_per_step,
    else XLA's)."""
    return "6N + 12 L d T" if r["closed_form_flops_per_token"] and r["tokens_per_step"] else "XLA's FLOPs"


def human_flops(n: float | None) -> str:
    if n is None:
        return "not reported"
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} FLOP"


def human_seconds(s: float) -> str:
    return f"{s * 1e3:,.2f} ms" if s >= 1e-3 else f"{s * 1e6:,.2f} us"


def _table(r: dict[str, Any]) -> str:
    """The report as a readable table."""
    from ftjax.program.plan import human_bytes

    rows = [
        ("task", r["task"]),
        ("mesh", f"{r['hosts']} host(s) x {r['devices_per_host']} device(s) = {r['devices']} per replica"),
        ("parameters", f"{r['params']:,}"),
        ("state per device", human_bytes(r["state_bytes"]) + " (exact: shapes, dtypes, shardings)"),
        ("  parameters", human_bytes(r["param_bytes"])),
        ("  optimizer state", human_bytes(r["optimizer_bytes"])),
        ("  step, model state", human_bytes(r["other_state_bytes"])),
        ("batch per device", human_bytes(r["batch_bytes"])),
        ("gradients per device", human_bytes(r["update_bytes"]) + " (the step's outputs: float32 update, loss)"),
        ("activations, temporaries", human_bytes(r["temp_bytes"]) + " (XLA memory_analysis, compiled for CPU)"),
        ("  kept for backward", human_bytes(r["backward_bytes"]) + " (JAX's residuals of a micro-batch: any platform)"),
        ("total per device", human_bytes(r["total_bytes"])),
        ("FLOPs per step", human_flops(r["flops_per_step"]) + f" ({r['rows_per_step']} rows; XLA cost_analysis)"),
    ]
    if r["tokens_per_step"]:
        closed = r["closed_form_flops_per_token"]
        check = ""
        if closed and r["flops_per_token"]:
            check = f"; 6N + 12 L d T: {human_flops(closed)} (XLA / closed form {r['flops_per_token'] / closed:.3f})"
        for name, counted in _LOOPED.items():  # (a while loop's body is counted once, whatever its trip count)
            if r[name]:
                check += f"; XLA counts {counted}"
        rows.append(("FLOPs per token", human_flops(r["flops_per_token"]) + check))
    d = r["device"]
    if d is not None:
        peaks = f", peak {d['peak_bf16_flops'] / 1e12:,.1f} TFLOP/s bf16" if d["peak_bf16_flops"] else ""
        if d["peak_fp32_flops"]:
            peaks += f", {d['peak_fp32_flops'] / 1e12:,.1f} fp32"
        rows.append(("device", f"{d['name']}: {human_bytes(d['memory_bytes'])}{peaks}"))
        if r["step_s_at_peak"]:
            rows.append(
                ("step time at 100% MFU", f"{human_seconds(r['step_s_at_peak'])} ({ideal_work(r)} at the bf16 peak)")
            )
        rows.append(("verdict", r["verdict"]))
    rows += [("note", note) for note in r.get("notes", [])]
    width = max(len(k) for k, _ in rows) + 2
    return "\n".join(f"{k:<{width}}{v}" for k, v in rows)
