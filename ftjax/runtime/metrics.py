"""Per-step metrics: `RUN_DIR/metrics.jsonl` (one JSON object per step), a rich progress line when
attached to a terminal, plain lines on stdout when it is not one (a file, a pipe, a job's log), and
`RUN_DIR/summary.json` at the end of a run. A step record carries its model FLOPs and, where the
devices' peak is known, its MFU (`ModelFlops`: both fixed once the step is compiled)."""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ftjax.runs.jsonl import read_jsonl
from ftjax.runs.summary import last_eval_loss, median_mfu

LINES_PER_RUN = 20  # plain output: about this many step lines per run, besides every event


@dataclass(frozen=True)
class ModelFlops:
    """The model FLOPs of the replica's steps and the peak of its devices, known once its gradient
    step is compiled (ftjax/program/plan.py): a step record's `model_flops_per_step` and `mfu` are
    two multiplications away, nothing is measured on the hot path."""

    per_row: float  # FLOPs of one example's forward and backward pass (the compiled step's / its rows)
    devices: int  # the replica's devices
    peak_per_device: float | None = None  # dense FLOP/s; None: no MFU (CPU without hardware.peak_flops_per_device)

    def fields(self, rows: int, step_time_s: float) -> dict[str, float]:
        """`model_flops_per_step` of a step that computed `rows` examples in `step_time_s`, and its
        `mfu` (model FLOPs / (step time x devices x peak)) when the peak is known and rows were computed."""
        flops = self.per_row * rows
        out = {"model_flops_per_step": flops}
        if self.peak_per_device and rows and step_time_s > 0:
            out["mfu"] = round(flops / (step_time_s * self.devices * self.peak_per_device), 6)
        return out


class PlainLines:
    """One plain line per `every` steps (and the first, the last and each evaluation), one per event,
    and the end of the run, flushed as written: what `ftjax train ... > log` leaves in the log."""

    def __init__(self, out: IO[str], label: str, total_steps: int | None, every: int | None = None) -> None:
        self.out, self.label, self.total = out, label, total_steps
        self.every = every or max(1, (total_steps or 0) // LINES_PER_RUN)
        self.t0 = time.monotonic()
        self._last_tokens: tuple[float, int] | None = None
        self._tokens = 0

    def _print(self, text: str) -> None:
        try:
            self.out.write(f"[{time.monotonic() - self.t0:8.1f}s] {self.label}: {text}\n")
            self.out.flush()
        except (OSError, ValueError):  # a closed pipe: the log is the reader's loss, not the run's
            pass

    def step(self, r: dict[str, Any]) -> None:
        step = r.get("step", 0)
        self._tokens += int(r.get("tokens") or 0)
        first = self._last_tokens is None
        if not (first or step % self.every == 0 or step == self.total or "eval_loss" in r):
            return
        now = time.monotonic()
        rate = ""
        if self._last_tokens is not None and now > self._last_tokens[0] and self._tokens:  # (none: not a token task)
            rate = f"  {(self._tokens - self._last_tokens[1]) / (now - self._last_tokens[0]):,.0f} tokens/s"
        self._last_tokens = (now, self._tokens)
        loss = r.get("loss")
        parts = [
            f"step {step}/{self.total}" if self.total else f"step {step}",
            f"loss {loss:.4f}" if loss is not None else "no loss (healing: relays zeros)",
            f"{r.get('step_time_s', 0) * 1e3:.0f} ms/step" + rate,
        ]
        if "participants" in r and r["participants"] != 1:
            parts.append(f"quorum {r.get('contributors')}/{r['participants']} contributing")
        if r.get("mfu") is not None:
            parts.append(f"MFU {r['mfu']:.1%}")
        if r.get("eval_loss") is not None:
            parts.append(f"eval loss {r['eval_loss']:.4f}")
        if not r.get("committed", True):
            parts.append("not committed")
        self._print("  ".join(parts))

    def event(self, kind: str, fields: dict[str, Any]) -> None:
        shown = []
        for k, v in fields.items():
            if isinstance(v, (list, tuple)) and len(v) > 4:
                v = f"[{len(v)} items]"
            elif isinstance(v, float):
                v = f"{v:.3g}"
            text = str(v)
            shown.append(f"{k}={text if len(text) <= 120 else text[:117] + '...'}")
        self._print(f"event {kind}" + (f": {' '.join(shown)}" if shown else ""))

    def end(self, summary: dict[str, Any], path: Path) -> None:
        loss = summary.get("final_loss")
        first = summary.get("first_loss")
        median = summary.get("median_step_s")
        ran, final = summary.get("steps"), summary.get("final_step")
        self._print(
            (f"done: {final} steps" if ran == final else f"done at step {final} ({ran} steps run here)")
            + ", final loss "
            + (f"{loss:.4f}" if loss is not None else "none")
            + (f" (first {first:.4f})" if first is not None else "")
            + (f", median step {median * 1e3:.0f} ms" if median else "")
            + f"; summary in {path}"
        )


class RecordsWriteError(RuntimeError):
    """The run's records cannot be written (a full disk, a file size limit): one line naming the file."""


class MetricsLog:
    """Only one process of a replica writes (its leader); the others pass `enabled=False`."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        enabled: bool = True,
        filename: str = "metrics.jsonl",
        total_steps: int | None = None,
        label: str = "train",
        log_every: int | None = None,
        tensorboard: str | Path | None = None,
        wandb: dict[str, Any] | None = None,
    ):
        """`tensorboard`: a directory for TensorBoard event files of the same records (None: none);
        `wandb`: wandb.init's arguments for a W&B run of the same scalars (None: none)."""
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.records: list[dict[str, Any]] = []
        self.listeners: list[Callable[[dict[str, Any]], None]] = []  # each record (steps and events), as logged
        self._file = None
        self._failed = False
        self._progress = None
        self._plain: PlainLines | None = None
        self._tensorboard = None
        if enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if tensorboard is not None or wandb is not None:
                from ftjax.runtime.tensorboard import TensorBoardWriter

                self._tensorboard = TensorBoardWriter(tensorboard, wandb=wandb)
            self._path = self.run_dir / filename
            self._file = open(self._path, "a", buffering=1)
            if not _isatty(sys.stdout):
                self._plain = PlainLines(sys.stdout, label, total_steps, log_every)
            if sys.stderr.isatty():
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

                self._progress = Progress(
                    TextColumn(f"[bold]{label}"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TextColumn("{task.fields[info]}"),
                    TimeRemainingColumn(),
                    transient=False,
                )
                self._task = self._progress.add_task(label, total=total_steps, info="")
                self._progress.start()

    def log(self, record: dict[str, Any]) -> None:
        record = {"time": round(time.time(), 6), **record}
        self.records.append(record)
        if not self.enabled:
            return
        if self._tensorboard is not None:  # first: an evaluation in metrics.jsonl is in the event files
            self._tensorboard.step(record)
        self._write(record)
        for listener in self.listeners:
            listener(record)
        if self._plain is not None:
            self._plain.step(record)
        if self._progress is not None:
            loss = record.get("loss")
            loss = loss if loss is not None else float("nan")
            info = f"loss {loss:.4f}  {record.get('step_time_s', 0) * 1e3:.0f} ms/step"
            self._progress.update(self._task, completed=record.get("step", 0), info=info)

    def event(self, kind: str, **fields: Any) -> None:
        """A non-step record (restore, failure, ...): same file, `event` instead of `step`."""
        if self.enabled:
            record = {"time": round(time.time(), 6), "event": kind, **fields}
            self._write(record)
            for listener in self.listeners:
                listener(record)
            if self._tensorboard is not None:
                self._tensorboard.event(kind, fields)
            if self._plain is not None:
                self._plain.event(kind, fields)

    def _write(self, record: dict[str, Any]) -> None:
        assert self._file is not None  # (records are written only when enabled: the file is open)
        try:
            self._file.write(json.dumps(record) + "\n")
        except OSError as e:
            self._failed = True
            raise RecordsWriteError(
                f"cannot write the run's records to {self._path} (--out {self.run_dir}): {e.strerror or e}"
            ) from None

    def summary(self, **extra: Any) -> dict[str, Any]:
        steps = [r for r in self.records if "step" in r]
        times = [r["step_time_s"] for r in steps[1:] if "step_time_s" in r]  # step 1 compiles
        out = {
            "steps": len(steps),
            "final_step": steps[-1]["step"] if steps else 0,
            "first_loss": steps[0].get("loss") if steps else None,
            "final_loss": steps[-1].get("loss") if steps else None,
            "median_step_s": statistics.median(times) if times else None,
            "median_mfu": median_mfu(steps[1:]),
            "last_eval_loss": last_eval_loss(steps),
            **extra,
        }
        if self.enabled:
            (self.run_dir / "summary.json").write_text(json.dumps(out, indent=2) + "\n")
            if self._plain is not None:
                self._plain.end(out, self.run_dir / "summary.json")
        return out

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._file is not None:
            # (after a failed write the line still buffered fails again: the first failure is reported)
            with contextlib.suppress(OSError) if self._failed else contextlib.nullcontext():
                self._file.close()
            self._file = None


def _isatty(stream: IO[str] | None) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):
        return False


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The step records of a metrics.jsonl file (events skipped)."""
    return [r for r in read_jsonl(path) if "event" not in r]
