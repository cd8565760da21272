"""TensorBoard event files of a replica's records: every step record and event that goes to
`metrics.jsonl` goes here too (ftjax/runtime/metrics.py `MetricsLog`), as scalars and text markers.

The step never waits for it: records go into an unbounded queue that one daemon thread writes with
tensorboardX, flushing every `flush_s` seconds and at the end. Without tensorboardX the run goes on
without event files (one line on stderr says so).
"""

from __future__ import annotations

import json
import queue
import sys
import threading
from pathlib import Path
from typing import Any

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


class TensorBoardWriter:
    """One replica leader's event files under `directory`, written off the training thread."""

    def __init__(self, directory: str | Path, flush_s: float = 5.0) -> None:
        self.directory = Path(directory)
        self.flush_s = flush_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._step = 0  # the latest step record's: where an event is marked
        self._thread = threading.Thread(target=self._run, name="ftjax-tensorboard", daemon=True)
        self._thread.start()

    def step(self, record: dict[str, Any]) -> None:
        self._step = int(record.get("step") or self._step)
        self._queue.put(("step", self._step, scalars(record)))

    def event(self, kind: str, fields: dict[str, Any]) -> None:
        """An event: a text marker `events/KIND` (its fields) and the scalar `events/KIND` = 1."""
        self._queue.put(("event", self._step, (str(kind), json.dumps(fields, default=str, sort_keys=True))))

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued, flush and close the files (waits at most `timeout_s`)."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            from tensorboardX import SummaryWriter
        except ImportError as e:
            print(f"ftjax: no TensorBoard event files ({e}; log.tensorboard=false to not ask)", file=sys.stderr)
            return
        writer = SummaryWriter(str(self.directory), flush_secs=self.flush_s)
        try:
            while True:
                try:
                    item = self._queue.get(timeout=self.flush_s)
                except queue.Empty:
                    writer.flush()
                    continue
                if item is None:
                    break
                self._write(writer, *item)
        finally:
            writer.flush()
            writer.close()

    @staticmethod
    def _write(writer: Any, what: str, step: int, payload: Any) -> None:
        if what == "step":
            for tag, value in payload.items():
                writer.add_scalar(tag, value, step)
        else:
            kind, text = payload
            writer.add_scalar(f"events/{kind}", 1.0, step)
            writer.add_text(f"events/{kind}", text, step)
