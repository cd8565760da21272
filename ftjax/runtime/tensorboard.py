"""TensorBoard event files (and, with `log.wandb`, a W&B run) of a replica's records: every step
record and event that goes to `metrics.jsonl` goes here too (ftjax/runtime/metrics.py `MetricsLog`),
as scalars and text markers.

The step never waits for it, but at an evaluation (its scalars are on disk before metrics.jsonl's
line is written): ftjax/runs/scalars.py's ScalarWriter queues the records for one daemon thread
that writes every sink, and flushes whenever it has caught up. W&B shares that thread rather than
getting its own: both sinks get the same scalars at the same steps, and a slow W&B upload can only
delay the event files, never a step (the queue is unbounded). Without tensorboardX the run goes on
without event files (one line on stderr says so).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ftjax.runs.scalars import ScalarWriter, tensorboard_sink

# step record field -> scalar tag
SCALARS = {
    "loss": "train/loss",
    "eval_loss": "eval/loss",
    "eval_perplexity": "eval/perplexity",
    "lr": "lr",
    "lr_scale": "lr_scale",
    "tokens_per_s": "tokens_per_s",
    "mfu": "mfu",
    "participants": "quorum/participants",
    "contributors": "quorum/contributors",
    "step_time_s": "time/step_s",
    "commit_failures": "events/commit_failures",
}


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The scalars of a step record, by tag (a field that is absent or null is left out; tokens/s
    is the record's, else its tokens over its step time)."""
    out = {tag: float(record[k]) for k, tag in SCALARS.items() if isinstance(record.get(k), (int, float))}
    if "tokens_per_s" not in out and record.get("tokens") and record.get("step_time_s"):
        out["tokens_per_s"] = record["tokens"] / record["step_time_s"]
    return out


class WandbSink:
    """A W&B run (`wandb.init(**init)`): the same scalars as the event files, at the same steps."""

    def __init__(self, init: dict[str, Any]) -> None:
        import wandb  # checked at startup (ftjax/config.py LogConfig): here it only fails if it broke since

        self.run = wandb.init(**init)

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def text(self, tag: str, text: str, step: int) -> None:
        pass  # the event's scalar (events/KIND = 1) marks it in W&B; its fields stay in metrics.jsonl

    def flush(self) -> None:
        pass  # W&B uploads on its own schedule

    def close(self) -> None:
        self.run.finish()


def wandb_init(project: str, run_dir: Path, replica_id: int) -> dict[str, Any]:
    """wandb.init's arguments for a replica of the run in `run_dir`: one W&B run per replica, grouped
    by the run directory's name, its files in that directory; WANDB_MODE (offline, disabled) holds."""
    return {
        "project": project,
        "name": f"{run_dir.name}-replica-{replica_id}",
        "group": run_dir.name,
        "dir": str(run_dir),
        "mode": os.environ.get("WANDB_MODE") or None,
    }


EVAL_FLUSH_S = 5.0  # the longest a step with an evaluation waits for its scalars to be on disk


class TensorBoardWriter:
    """One replica leader's event files under `directory` (None: none) and its W&B run (`wandb`:
    wandb.init's arguments; None: none), written off the training thread."""

    def __init__(self, directory: str | Path | None, flush_s: float = 5.0, wandb: dict[str, Any] | None = None) -> None:
        self.directory = Path(directory) if directory is not None else None
        sinks = [tensorboard_sink(directory, flush_s)] if directory is not None else []
        if wandb is not None:
            sinks.append(lambda: WandbSink(wandb))
        self._writer = ScalarWriter(sinks, flush_s, name="ftjax-tensorboard")
        self._step = 0  # the latest step record's: where an event is marked

    def step(self, record: dict[str, Any]) -> None:
        """A step record's scalars. An evaluation's are on disk when this returns (it waits for the
        writer, at most `EVAL_FLUSH_S`): evaluations are rare and each is worth keeping, however
        the process ends right after (`MetricsLog` writes metrics.jsonl's line after this)."""
        self._step = int(record.get("step") or self._step)
        self._writer.scalars(scalars(record), self._step)
        if record.get("eval_loss") is not None:
            self._writer.flush(EVAL_FLUSH_S)

    def event(self, kind: str, fields: dict[str, Any]) -> None:
        """An event: a text marker `events/KIND` (its fields) and the scalar `events/KIND` = 1."""
        self._writer.scalars({f"events/{kind}": 1.0}, self._step)
        self._writer.text(f"events/{kind}", json.dumps(fields, default=str, sort_keys=True), self._step)

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued, flush and close the files and the W&B run (waits at most `timeout_s`)."""
        self._writer.close(timeout_s)
