"""The job, its failure process, and the event loop that integrates a strategy's throughput.

Units: time in minutes. *Work* is measured in minutes of failure-free training of the whole job, so
a job of ``steps`` steps of ``step_s`` seconds needs ``steps * step_s / 60`` minutes of work, and a
strategy that trains at useful rate ``u`` (a fraction of the failure-free throughput of all GPUs)
gains ``u * dt`` work in ``dt`` minutes.

Failures are drawn per host. With exponential lifetimes every host fails at rate
``1 / (mtbf_min * hosts)``, which is a Poisson process of rate ``1 / mtbf_min`` at job level with
the failed host uniform over all hosts. With Weibull lifetimes each host is a renewal process in
steady state: the job starts on hosts of random age (the first failure of each is drawn from the
stationary forward-recurrence distribution), so the job-level failure rate is 1 / mtbf_min from the
start, as for exponential lifetimes; a failed host is swapped for a spare whose lifetime starts at
the failure (the time to bring the spare in is the strategy's repair time, not part of the failure
clock). Many hosts of long mean life together fail almost as a Poisson process; the shape shows
with few hosts or short lives (shape < 1: a host that just failed is likely to fail again soon). The
failure trace does not depend on the strategy, so for a given seed every strategy sees the same
failures (common random numbers: differences between strategies are not sampling noise).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

# Breakdown of GPU-time; the fractions of one run sum to 1.
CATEGORIES = (
    "productive",         # work that ends up in the trained model
    "job restart",        # whole-job restart: sync after any failure, redundancy after a lost shard
    "failure stall",      # everyone waits: detection + reconfiguration + step retry (FT strategies)
    "rejoin stall",       # everyone waits while a repaired unit rejoins (zero for non-blocking catch-up)
    "checkpoint",         # blocking part of checkpoint saves
    "lost work",          # work trained since the last checkpoint, thrown away by a whole-job restart
    "units out",          # GPUs of failed units (replicas, hosts, groups) while they are restarted
    "redundant compute",  # the extra copies of each data shard (redundancy)
)

# A job that has not finished after this many times its failure-free duration is reported as not
# finished: its effective training time is below 1/MAX_SLOWDOWN and its time-to-train is unbounded
# for practical purposes (e.g. sync with queued restarts once the stall exceeds the MTBF).
MAX_SLOWDOWN = 20.0

_EPS = 1e-9


class SimConfig(BaseModel):
    """Every input of one simulation. Each field is a `ftjax simulate --field-name` option."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpus: int = Field(gt=0, description="GPUs in the job")
    gpus_per_host: int = Field(gt=0, description="GPUs per host (server); failures are drawn per host")
    replicas: int = Field(gt=0, description="data-parallel replicas (FT-HSDP) = groups (redundancy)")
    mtbf_min: float = Field(gt=0, description="job-level mean time between failures at --gpus, minutes")
    failure_dist: Literal["exponential", "weibull"] = Field(description="per-host lifetime distribution")
    weibull_shape: float = Field(gt=0, description="Weibull shape k (k<1: infant mortality)")
    sync_stall_min: float = Field(ge=0, description="whole-job restart per failure, minutes (sync)")
    ft_stall_min: float = Field(ge=0, description="stall of everyone per failure: detection + "
                                                  "reconfiguration + step retry, minutes")
    replica_restart_min: float = Field(ge=0, description="minutes a failed unit stays out after the "
                                                         "stall: restart + catch-up (inf: never repaired)")
    rejoin_stall_min: float = Field(ge=0, description="stall of everyone when a unit rejoins, minutes "
                                                      "(0: non-blocking catch-up)")
    checkpoint_interval_min: float = Field(ge=0, description="minutes of training between durable "
                                                             "checkpoints (0: lost work is part of "
                                                             "--sync-stall-min)")
    checkpoint_cost_min: float = Field(ge=0, description="blocking minutes per checkpoint save")
    redundancy: int = Field(ge=1, description="copies of each data shard (redundancy strategy)")
    overlap: Literal["queue", "restart"] = Field(
        description="a failure during a stall: queue its full stall after the current one, or restart "
                    "the stall clock")
    steps: int = Field(gt=0, description="training steps to time-to-train")
    step_s: float = Field(gt=0, description="failure-free step time, seconds")
    seeds: int = Field(ge=1, description="independent failure traces to average over")
    seed: int = Field(ge=0, description="base random seed")

    @model_validator(mode="after")
    def _shape(self) -> SimConfig:
        unit = self.replicas * self.gpus_per_host
        if self.gpus % unit:
            raise ValueError(
                f"--gpus ({self.gpus}) must be a multiple of --replicas x --gpus-per-host ({unit}): "
                "every replica has the same whole number of hosts")
        if self.redundancy > self.replicas:
            raise ValueError(f"--redundancy ({self.redundancy}) cannot exceed --replicas ({self.replicas})")
        return self

    @property
    def hosts(self) -> int:
        return self.gpus // self.gpus_per_host

    @property
    def hosts_per_replica(self) -> int:
        return self.hosts // self.replicas

    @property
    def work_min(self) -> float:
        """Failure-free duration of the job (minutes of work to train)."""
        return self.steps * self.step_s / 60.0

    def at_gpus(self, gpus: int) -> SimConfig:
        """The same job at another GPU count; the job-level MTBF scales inversely with GPU count."""
        return SimConfig.model_validate(
            {**self.model_dump(), "gpus": gpus, "mtbf_min": self.mtbf_min * self.gpus / gpus})


def failures(cfg: SimConfig, seed_index: int) -> Iterator[tuple[float, int]]:
    """Endless time-ordered (time_min, host) failures of trace ``seed_index`` of ``cfg``."""
    rng = np.random.default_rng(np.random.SeedSequence(cfg.seed, spawn_key=(seed_index,)))
    if cfg.failure_dist == "exponential":
        return _poisson_failures(rng, cfg.mtbf_min, cfg.hosts)
    return _weibull_failures(rng, cfg.mtbf_min * cfg.hosts, cfg.weibull_shape, cfg.hosts)


def _poisson_failures(rng: np.random.Generator, mtbf: float, hosts: int) -> Iterator[tuple[float, int]]:
    # Drawn in chunks: vectorised, and the same seed yields the same trace however far it is read.
    t, chunk = 0.0, 4096
    while True:
        times = t + np.cumsum(rng.exponential(mtbf, chunk))
        who = rng.integers(0, hosts, chunk)
        yield from zip(times.tolist(), who.tolist())
        t = float(times[-1])


def _weibull_failures(rng: np.random.Generator, mean_life: float, shape: float,
                      hosts: int) -> Iterator[tuple[float, int]]:
    scale = mean_life / math.gamma(1.0 + 1.0 / shape)
    # Stationary start: each host is inside a lifetime drawn length-biased (density x f(x) / mean;
    # for a Weibull, (x / scale)^shape ~ Gamma(1 + 1/shape)), at a uniform point of it.
    biased = scale * rng.gamma(1.0 + 1.0 / shape, 1.0, hosts) ** (1.0 / shape)
    heap = list(zip((rng.uniform(0.0, 1.0, hosts) * biased).tolist(), range(hosts)))
    heapq.heapify(heap)
    while True:
        lives = (scale * rng.weibull(shape, 4096)).tolist()
        for life in lives:
            t, host = heap[0]
            heapq.heapreplace(heap, (t + life, host))
            yield t, host


class Strategy(Protocol):
    """What the event loop needs from a strategy (see ftjax.sim.strategies)."""

    counts: dict[str, int]

    def rates(self) -> tuple[float, tuple[tuple[str, float], ...]]:
        """(useful rate, ((category, rate), ...)) until the next event; they sum to 1."""

    def next_change(self, t: float, work: float) -> float:
        """Time of the next state change that is not a failure (math.inf if none)."""

    def on_change(self, t: float, work: float) -> None:
        """Apply every state change due at time t."""

    def on_failure(self, t: float, host: int, work: float) -> float:
        """Apply a failure of ``host`` at time t; return the work it throws away."""


@dataclass
class Outcome:
    """One strategy on one failure trace."""

    wall_min: float                      # time to train, or the horizon if not finished
    finished: bool
    minutes: dict[str, float]            # GPU-time / GPUs by category; sums to wall_min
    failures: int
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def ettr(self) -> float:
        """Effective training time ratio: productive GPU-time / total GPU-time."""
        return self.minutes["productive"] / self.wall_min


def run(strategy: Strategy, trace: Iterator[tuple[float, int]], work_min: float) -> Outcome:
    """Advance ``strategy`` through ``trace`` until ``work_min`` of work is trained (or the horizon)."""
    horizon = MAX_SLOWDOWN * work_min
    acc = dict.fromkeys(CATEGORIES, 0.0)
    t = work = 0.0
    n_fail = 0
    fail_t, fail_host = next(trace)
    while True:
        useful, losses = strategy.rates()
        t_change = strategy.next_change(t, work)
        t_next = min(fail_t, t_change, horizon)
        dt = t_next - t
        finished = useful > 0 and work + useful * dt >= work_min
        if finished:
            dt = (work_min - work) / useful
        acc["productive"] += useful * dt
        for category, rate in losses:
            acc[category] += rate * dt
        work += useful * dt
        t += dt
        if finished or t >= horizon:
            return Outcome(t, finished, acc, n_fail, dict(strategy.counts))
        if fail_t <= t_change:
            lost = strategy.on_failure(t, fail_host, work)
            work -= lost
            acc["productive"] -= lost
            acc["lost work"] += lost
            n_fail += 1
            fail_t, fail_host = next(trace)
        else:
            strategy.on_change(t, work)


def due(t_event: float, t: float) -> bool:
    """Whether an event scheduled at ``t_event`` is due at time ``t`` (float tolerance)."""
    return t_event <= t + _EPS * max(1.0, abs(t))
