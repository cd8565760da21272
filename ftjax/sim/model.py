"""The event loop that integrates a strategy's rates between events, and what one run yields.

Units: time in minutes. *Work* is measured in minutes of failure-free training of the whole job, so
a job of ``steps`` steps of ``step_s`` seconds needs ``steps * step_s / 60`` minutes of work. A
strategy in a given state has a *useful rate* ``u`` (the fraction of the failure-free throughput of
all GPUs it achieves: productive GPU-time per GPU-time) and a *progress rate* (work per minute):
the same with ``--train-for tokens``; with ``--train-for steps`` a step counts whole however many
replicas took part. The inputs are ftjax.sim.config.SimConfig; the failures ftjax.sim.failures.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from ftjax.sim.failures import Failure, Straggle

# Breakdown of GPU-time; the fractions of one run sum to 1.
CATEGORIES = (
    "productive",  # work that ends up in the trained model
    "job restart",  # whole-job restarts (sync after any failure; others after a fatal one)
    "repair wait",  # the job waits for hardware (no spare) before it can restart
    "failure stall",  # everyone waits: detection + reconfiguration + step retry (FT strategies)
    "rejoin stall",  # everyone waits while a repaired unit rejoins (zero for non-blocking catch-up)
    "checkpoint",  # blocking part of checkpoint saves
    "lost work",  # work trained since the last checkpoint, thrown away by a whole-job restart
    "units out",  # GPUs of failed units (replicas, domains, groups) until they are back
    "degraded",  # reduced-degree replicas' throughput below their share of live GPUs
    "redundant compute",  # extra copies of data shards (redundancy, spare)
    "straggler",  # waiting for, or leaving out, a slow replica
    "pauses",  # failure-free pauses (--pause-fraction)
    "communication",  # waiting for the inter-replica all-reduce (--link-gbps; every step, or per DiLoCo round)
)

_EPS = 1e-9


class Rates(NamedTuple):
    """A strategy's rates until its next event; ``useful`` + the loss rates sum to 1."""

    useful: float
    losses: tuple[tuple[str, float], ...]
    progress: float  # work per minute
    up: bool  # the job is training (not stalled or restarting as a whole)


class Strategy(Protocol):
    """What the event loop needs from a strategy (see ftjax.sim.strategies)."""

    counts: dict[str, int]
    # Productive GPU-time thrown away without rolling the work back: trained data the model lost but
    # that is not trained again (DiLoCo's inner steps of a failed replica when steps count whole).
    # run() moves it to "lost work" after each failure and resets it.
    dropped: float

    def rates(self) -> Rates: ...

    def next_change(self, t: float, work: float, progress: float) -> float:
        """Time of the next state change that is not a failure (math.inf if none), given the progress
        rate of ``rates()``."""

    def on_change(self, t: float, work: float) -> None:
        """Apply every state change due at time t."""

    def on_failure(self, t: float, failure: Failure, work: float) -> float:
        """Apply a failure at time t; return the work it throws away."""

    def on_straggle(self, t: float, episode: Straggle) -> None:
        """A replica turns slow at time t."""


@dataclass
class Outcome:
    """One strategy on one failure trace."""

    wall_min: float  # time to train, or the horizon if not finished
    finished: bool
    minutes: dict[str, float]  # GPU-time / GPUs by category; sums to wall_min
    failures: int
    up_min: float  # wall time during which the job trained
    work_min: float  # the job's failure-free duration
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def ettr(self) -> float:
        """Effective training time ratio: productive GPU-time / total GPU-time."""
        return self.minutes["productive"] / self.wall_min

    @property
    def data_trained(self) -> float:
        """Fraction of the job's planned batches in the trained model: below 1 when steps count whole
        with replicas missing (elastic global batch, --train-for steps)."""
        return min(1.0, self.minutes["productive"] / self.work_min) if self.finished else math.nan

    @property
    def availability(self) -> float:
        """Fraction of wall time the job trained (was not stalled or restarting as a whole)."""
        return self.up_min / self.wall_min

    @property
    def ttt_ratio(self) -> float:
        """Time to train / failure-free time to train (the horizon's if not finished)."""
        return self.wall_min / self.work_min

    @property
    def effective_mtbf_min(self) -> float:
        """Wall time per interruption (a failure that stalled or restarted the whole job)."""
        n = self.counts.get("interruptions", 0)
        return self.wall_min / n if n else math.inf


class _Ledger:
    """Productive GPU-time as a function of work since the last rollback, so that a rollback takes
    back exactly the productive time of the work it throws away (they differ when progress is
    counted in steps)."""

    def __init__(self) -> None:
        self.work: list[float] = [0.0]
        self.productive: list[float] = [0.0]

    def add(self, work: float, productive: float) -> None:
        if work > self.work[-1]:
            self.work.append(work)
            self.productive.append(productive)
        else:
            self.productive[-1] = productive

    def rollback(self, to_work: float) -> float:
        """Drop everything past ``to_work``; return the productive GPU-time there."""
        i = bisect.bisect_right(self.work, to_work)
        w0, p0 = self.work[i - 1], self.productive[i - 1]
        if i < len(self.work):
            w1, p1 = self.work[i], self.productive[i]
            p0 += (p1 - p0) * (to_work - w0) / (w1 - w0)
        del self.work[i:], self.productive[i:]
        self.add(to_work, p0)
        return p0


def run(strategy: Strategy, trace: Iterator[Failure | Straggle], work_min: float, max_slowdown: float) -> Outcome:
    """Advance ``strategy`` through ``trace`` until ``work_min`` of work is trained, or for
    ``max_slowdown * work_min`` minutes (then not finished)."""
    horizon = max_slowdown * work_min
    acc = dict.fromkeys(CATEGORIES, 0.0)
    ledger = _Ledger()
    t = work = up = 0.0
    n_fail = 0
    event = next(trace, None)
    while True:
        r = strategy.rates()
        t_change = strategy.next_change(t, work, r.progress)
        t_event = event.t if event is not None else math.inf
        dt = min(t_event, t_change, horizon) - t
        finished = r.progress > 0 and work + r.progress * dt >= work_min
        if finished:
            dt = (work_min - work) / r.progress
        acc["productive"] += r.useful * dt
        for category, rate in r.losses:
            acc[category] += rate * dt
        up += dt if r.up else 0.0
        work += r.progress * dt
        t += dt
        ledger.add(work, acc["productive"])
        if finished or t >= horizon:
            return Outcome(t, finished, acc, n_fail, up, work_min, dict(strategy.counts))
        if t_event <= t_change:
            if isinstance(event, Failure):
                lost = strategy.on_failure(t, event, work)
                if lost > 0:
                    work -= lost
                    kept = ledger.rollback(work)
                    acc["lost work"] += acc["productive"] - kept
                    acc["productive"] = kept
                if strategy.dropped > 0:
                    dropped = min(strategy.dropped, acc["productive"])
                    acc["lost work"] += dropped
                    acc["productive"] -= dropped
                    strategy.dropped = 0.0
                    ledger.add(work, acc["productive"])
                n_fail += 1
            else:
                assert event is not None  # (t_event is finite: an event is due)
                strategy.on_straggle(t, event)
            event = next(trace, None)
        else:
            strategy.on_change(t, work)


def due(t_event: float, t: float) -> bool:
    """Whether an event scheduled at ``t_event`` is due at time ``t`` (float tolerance)."""
    return t_event <= t + _EPS * max(1.0, abs(t))
