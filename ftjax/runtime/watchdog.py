"""Progress, not heartbeats, decides whether a replica process is alive (docs/design/recovery.md, "Liveness").

A replica's leader heartbeats from a thread of its own, so a process whose training loop is stuck
(a hung host of its replica that it waits for in the commit vote, a training thread blocked in a
driver call) still looks alive to the coordinator, and the coordinator keeps waiting for it as a
member of the previous quorum: every healthy replica stalls until something else kills it.

So each process runs a `ProgressWatchdog`: the training loop calls `beat(phase)` as it moves on,
and wraps in `exempt()` what the deadline does not bound: the waits that depend on others, not on
itself (the quorum), and one-off work whose length depends on the model (the first init and its
compile, restoring a checkpoint or a snapshot, saving a checkpoint). It is armed only once the process has completed a
step (`arm()`): before that it is starting, and first executions take as long as they take. If no beat
comes within `deadline_s` outside such a wait, `on_timeout(phase, silent_s)` runs on the watchdog's
thread; the replica runtime makes it leave the job and end the process, so its peers go on without
it and the launcher (or the cluster's scheduler) restarts it.

The deadline is the larger of `deadline_s` and twice the previous step's own time (`arm(step_s)`):
a model whose step takes longer than ft.progress_timeout_s (a large one on CPU), or a step that
compiles again (a first execution after the first step), is not taken for a hang, and a process
stuck in a step of a fast model is still named within `deadline_s`. The deadline must exceed the FTAR
timeout: a healthy replica legitimately waits that long for a hung peer before it reports it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class ProgressWatchdog:
    def __init__(self, deadline_s: float, on_timeout: Callable[[str, float], None], *, clock=time.monotonic):
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.deadline_s = self._limit = deadline_s
        self._on_timeout = on_timeout
        self._clock = clock
        self._cv = threading.Condition()
        self._phase, self._since = "start", clock()
        self._waiting = 0
        self._armed = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ftjax-progress-watchdog", daemon=True)
        self._thread.start()

    def arm(self, step_s: float = 0.0) -> None:
        """From now on silence counts (call it once a step is done, with its own time, waits on
        others aside: the next step may be silent for twice that, or `deadline_s` if longer)."""
        with self._cv:
            self._limit = max(self.deadline_s, 2.0 * step_s)
            if not self._armed:
                self._armed, self._since = True, self._clock()
            self._cv.notify()

    def beat(self, phase: str) -> None:
        """The training loop moved on, into `phase`."""
        with self._cv:
            self._phase, self._since = phase, self._clock()

    @contextmanager
    def exempt(self, phase: str) -> Iterator[None]:
        """A wait on others (the quorum), or one-off work of unbounded length (init, a restore)."""
        with self._cv:
            self._waiting += 1
            self._phase = phase
        try:
            yield
        finally:
            with self._cv:
                self._waiting -= 1
                self._phase, self._since = f"after {phase}", self._clock()
                self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        with self._cv:
            while not self._closed:
                if self._waiting or not self._armed:
                    self._cv.wait()
                    continue
                left = self._since + self._limit - self._clock()
                if left > 0:
                    self._cv.wait(left)
                    continue
                phase, silent = self._phase, self._clock() - self._since
                break
            else:
                return
        self._on_timeout(phase, silent)


class NoWatchdog:
    """For a process with no peers to keep waiting (a standalone run), and for tests."""

    def beat(self, phase: str) -> None:
        pass

    def arm(self, step_s: float = 0.0) -> None:
        pass

    @contextmanager
    def exempt(self, phase: str) -> Iterator[None]:
        yield

    def close(self) -> None:
        pass
