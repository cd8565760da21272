"""Scalars by step (and text markers) written off the caller's thread to sinks: TensorBoard event
files (tensorboardX), a W&B run. A replica's records (ftjax/runtime/tensorboard.py) and the
coordinator's job view (ftjax/coordinator/jobview.py) both go through it, so it sits low enough for
both to import.

The caller never waits (unless it asks to, `flush`): items go into an unbounded queue that one
daemon thread hands to every sink, flushing them whenever it has caught up with the queue, every
`flush_s` seconds and at the end. A sink is opened on that thread too (a W&B run
can take seconds to start), from a factory; one that cannot be opened, or that fails later, is left
out with one line on stderr, and the others go on.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol


class Sink(Protocol):
    def scalars(self, values: dict[str, float], step: int) -> None: ...
    def text(self, tag: str, text: str, step: int) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class TensorBoardSink:
    """TensorBoard event files under `directory` (tensorboardX: no TensorFlow), written on the
    caller's thread (ScalarWriter's). Not through tensorboardX's SummaryWriter: it hands events to a
    queue of its own, written every `flush_secs`, and its flush() does not drain that queue, so what
    a process wrote in its last seconds was lost when it ended (a replica's file held its first
    evaluation only). EventsWriter writes each event to the file at once; flush() puts it on disk.
    (`flush_s`: kept for the factory's signature; ScalarWriter decides when to flush.)"""

    def __init__(self, directory: str | Path, flush_s: float = 5.0) -> None:
        from tensorboardX.event_file_writer import EventsWriter

        Path(directory).mkdir(parents=True, exist_ok=True)
        self.events = EventsWriter(str(Path(directory) / "events"))

    def _write(self, summary: Any, step: int) -> None:
        from tensorboardX.proto import event_pb2

        self.events.write_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def scalars(self, values: dict[str, float], step: int) -> None:
        from tensorboardX.summary import scalar

        for tag, value in values.items():
            self._write(scalar(tag, value), step)

    def text(self, tag: str, text: str, step: int) -> None:
        from tensorboardX.summary import text as text_summary

        self._write(text_summary(tag, text), step)

    def flush(self) -> None:
        self.events.flush()

    def close(self) -> None:
        self.events.close()


def tensorboard_sink(directory: str | Path, flush_s: float = 5.0) -> Callable[[], Sink]:
    """A factory of a TensorBoardSink, for ScalarWriter (opened on its thread)."""
    return lambda: TensorBoardSink(directory, flush_s)


class ScalarWriter:
    """Scalars and text by step to the sinks `factories` open, written by one daemon thread."""

    def __init__(self, factories: list[Callable[[], Sink]], flush_s: float = 5.0, name: str = "ftjax-scalars") -> None:
        self.flush_s = flush_s
        self._factories = list(factories)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def scalars(self, values: dict[str, float], step: int) -> None:
        self._queue.put(("scalars", (dict(values), int(step))))

    def text(self, tag: str, text: str, step: int) -> None:
        self._queue.put(("text", (tag, text, int(step))))

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Write what is queued and flush every sink; wait for it at most `timeout_s` (False: not
        done by then, or the writer has stopped)."""
        done = threading.Event()
        self._queue.put(("sync", done))
        deadline = time.monotonic() + timeout_s
        while not done.wait(0.05):
            if not self._thread.is_alive() or time.monotonic() > deadline:
                return False
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued, flush and close the sinks (waits at most `timeout_s`)."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        sinks = [s for s in map(_open, self._factories) if s is not None]
        try:
            while sinks:
                try:
                    item = self._queue.get(timeout=self.flush_s)
                except queue.Empty:
                    sinks = _each(sinks, "flush")
                    continue
                if item is None:
                    break
                if item[0] == "sync":
                    sinks = _each(sinks, "flush")
                    item[1].set()
                    continue
                sinks = _each(sinks, item[0], *item[1])
                if self._queue.empty():  # caught up: on disk, what a process that dies next handed over
                    sinks = _each(sinks, "flush")
        finally:
            _each(sinks, "close")


def _open(factory: Callable[[], Sink]) -> Sink | None:
    try:
        return factory()
    except Exception as e:  # (ImportError, a W&B login missing, ...): the run goes on without it
        print(f"ftjax: a scalar sink could not open ({type(e).__name__}: {e}); going on without it", file=sys.stderr)
        return None


def _each(sinks: list[Sink], method: str, *args: object) -> list[Sink]:
    """Call `method` on every sink; the sinks that did not fail (one that fails is closed and left out)."""
    kept = []
    for sink in sinks:
        try:
            getattr(sink, method)(*args)
            kept.append(sink)
        except Exception as e:
            print(f"ftjax: {type(sink).__name__} failed ({type(e).__name__}: {e}); left out", file=sys.stderr)
    return kept
