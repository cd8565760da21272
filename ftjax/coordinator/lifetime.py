"""When a coordinator may end by itself: the job it serves is over.

On a cluster the coordinator is one more job (a Slurm job, a Kubernetes Job) and must not outlive
the replicas it serves. `ftjax coordinator --final-step N --expected-replicas R` exits 0 once R
replicas have each reached step N and none is alive any more (every replica finished, and each
stayed until its peers held the final state: `ft.drain_timeout_s`). `--idle-exit-s S` makes it
exit 3 when, after some replica joined, none has been alive for S seconds: the replicas are gone
for good (out of restarts, cancelled), and nothing would ever ask it for a quorum again.

`JobEnd.observe` is a pure function of the coordinator's status snapshots (`CoordinatorState.snapshot`),
so that the rule is tested on tables; `watch` runs it in a thread of the coordinator process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

EXIT_DONE = 0  # every expected replica reached the final step and left
EXIT_IDLE = 3  # no replica alive for idle_s: the job is gone


@dataclass
class JobEnd:
    expected: int  # replicas in the job (0: unknown, so never "done")
    final_step: int | None = None  # the job's last step (None: never "done")
    idle_s: float | None = None  # None: never "idle"
    finished: set[str] = field(default_factory=set)  # replicas seen at the final step
    seen: bool = False  # some replica has joined
    idle_since: float | None = None

    def observe(self, snapshot: dict, now: float) -> int | None:
        """The exit code once the job is over, else None. `snapshot` is the coordinator's status."""
        rows = snapshot.get("replicas") or []
        alive = sum(1 for r in rows if r.get("alive"))
        self.seen = self.seen or bool(rows)
        if self.final_step is not None:
            self.finished.update(str(r["replica_id"]) for r in rows if int(r.get("step") or 0) >= self.final_step)
        if alive:
            self.idle_since = None
            return None
        if self.expected > 0 and self.final_step is not None and len(self.finished) >= self.expected:
            return EXIT_DONE
        if not self.seen or self.idle_s is None:
            return None
        if self.idle_since is None:
            self.idle_since = now
        return EXIT_IDLE if now - self.idle_since >= self.idle_s else None

    def why(self, code: int) -> str:
        if code == EXIT_DONE:
            return f"the job is over: all {self.expected} replicas reached step {self.final_step} and left"
        return (
            f"no replica alive for {self.idle_s:g} s (finished: {len(self.finished)} of {self.expected}): "
            "the job is gone"
        )


def watch(
    end: JobEnd,
    snapshot: Callable[[float], dict],
    on_end: Callable[[int, str], None],
    *,
    stop: threading.Event,
    every_s: float = 1.0,
) -> threading.Thread:
    """Observe `snapshot(now)` every `every_s` until the job is over (then `on_end(code, why)`) or
    `stop` is set."""

    def run() -> None:
        while not stop.wait(every_s):
            now = time.monotonic()
            code = end.observe(snapshot(now), now)
            if code is not None:
                on_end(code, end.why(code))
                return

    thread = threading.Thread(target=run, name="coordinator-lifetime", daemon=True)
    thread.start()
    return thread
