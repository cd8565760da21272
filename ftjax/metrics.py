"""Per-step metrics: `RUN_DIR/metrics.jsonl` (one JSON object per step), a rich progress line when
attached to a terminal, and `RUN_DIR/summary.json` at the end of a run."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from ftjax.jsonl import read_jsonl


class MetricsLog:
    """Only one process of a replica writes (its leader); the others pass `enabled=False`."""

    def __init__(self, run_dir: str | Path, *, enabled: bool = True, filename: str = "metrics.jsonl",
                 total_steps: int | None = None, label: str = "train"):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.records: list[dict[str, Any]] = []
        self._file = None
        self._progress = None
        if enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(self.run_dir / filename, "a", buffering=1)
            if sys.stderr.isatty():
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

                self._progress = Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(),
                                          TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                                          transient=False)
                self._task = self._progress.add_task(label, total=total_steps, info="")
                self._progress.start()

    def log(self, record: dict[str, Any]) -> None:
        record = {"time": round(time.time(), 6), **record}
        self.records.append(record)
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        if self._progress is not None:
            info = f"loss {record.get('loss', float('nan')):.4f}  {record.get('step_time_s', 0) * 1e3:.0f} ms/step"
            self._progress.update(self._task, completed=record.get("step", 0), info=info)

    def event(self, kind: str, **fields: Any) -> None:
        """A non-step record (restore, failure, ...): same file, `event` instead of `step`."""
        if self.enabled:
            self._file.write(json.dumps({"time": round(time.time(), 6), "event": kind, **fields}) + "\n")

    def summary(self, **extra: Any) -> dict[str, Any]:
        steps = [r for r in self.records if "step" in r]
        times = [r["step_time_s"] for r in steps[1:] if "step_time_s" in r]  # step 1 compiles
        out = {
            "steps": len(steps),
            "final_step": steps[-1]["step"] if steps else 0,
            "first_loss": steps[0].get("loss") if steps else None,
            "final_loss": steps[-1].get("loss") if steps else None,
            "median_step_s": statistics.median(times) if times else None,
            **extra,
        }
        if self.enabled:
            (self.run_dir / "summary.json").write_text(json.dumps(out, indent=2) + "\n")
        return out

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The step records of a metrics.jsonl file (events skipped)."""
    return [r for r in read_jsonl(path) if "event" not in r]
