"""Run every strategy on ``cfg.seeds`` failure traces and average; sweep the GPU count."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ftjax.sim import closed_form
from ftjax.sim.model import CATEGORIES, Outcome, SimConfig, failures, run
from ftjax.sim.strategies import STRATEGIES


@dataclass
class StrategyResult:
    """One strategy, averaged over seeds."""

    name: str
    ettr: float                       # mean over seeds of productive GPU-time / total GPU-time
    ettr_std: float                   # standard deviation over seeds
    ettr_analytic: float | None       # closed form where one is exact (ftjax.sim.closed_form)
    time_to_train_h: float | None     # mean wall time for cfg.steps; None if a seed did not finish
    finished: int                     # seeds that trained every step within the horizon
    seeds: int
    failures: float                   # mean failures per seed during the job
    breakdown: dict[str, float]       # mean fraction of GPU-time per category; sums to 1
    counts: dict[str, float] = field(default_factory=dict)  # strategy counters, summed over seeds

    def to_json(self) -> dict[str, Any]:
        return {
            "ettr": round(self.ettr, 5),
            "ettr_std": round(self.ettr_std, 5),
            "ettr_analytic": None if self.ettr_analytic is None else round(self.ettr_analytic, 5),
            "time_to_train_h": None if self.time_to_train_h is None else round(self.time_to_train_h, 3),
            "finished": self.finished,
            "seeds": self.seeds,
            "failures": round(self.failures, 2),
            "breakdown": {k: round(v, 5) for k, v in self.breakdown.items()},
            "counts": {k: round(v, 4) if isinstance(v, float) else v for k, v in self.counts.items()},
        }


def _aggregate(cfg: SimConfig, name: str, outcomes: list[Outcome]) -> StrategyResult:
    ettrs = np.array([o.ettr for o in outcomes])
    breakdown = {c: float(np.mean([o.minutes[c] / o.wall_min for o in outcomes])) for c in CATEGORIES}
    counts: dict[str, float] = {}
    for o in outcomes:
        for k, v in o.counts.items():
            counts[k] = counts.get(k, 0) + v
    if name == "redundancy" and counts.get("fatal"):
        counts["masked_per_fatal"] = counts.get("masked", 0) / counts["fatal"]
        if math.isinf(cfg.replica_restart_min):  # the SPARe closed form assumes no repair (asymptotic in N)
            counts["masked_per_fatal_spare"] = closed_form.masked_failures_spare(cfg.replicas, cfg.redundancy)
    done = [o for o in outcomes if o.finished]
    return StrategyResult(
        name=name,
        ettr=float(ettrs.mean()),
        ettr_std=float(ettrs.std()),
        ettr_analytic=closed_form.analytic_ettr(cfg, name),
        time_to_train_h=float(np.mean([o.wall_min for o in done])) / 60 if len(done) == len(outcomes) else None,
        finished=len(done),
        seeds=len(outcomes),
        failures=float(np.mean([o.failures for o in outcomes])),
        breakdown=breakdown,
        counts=counts,
    )


def simulate(cfg: SimConfig, strategies: Iterable[str] = tuple(STRATEGIES)) -> dict[str, StrategyResult]:
    """Every strategy in ``strategies`` on the same ``cfg.seeds`` failure traces."""
    results = {}
    for name in strategies:
        outcomes = [run(STRATEGIES[name](cfg), failures(cfg, i), cfg.work_min) for i in range(cfg.seeds)]
        results[name] = _aggregate(cfg, name, outcomes)
    return results


def sweep_gpu_counts(cfg: SimConfig, lo: int = 1_000, hi: int = 200_000, points: int = 12) -> list[int]:
    """``cfg.gpus`` and about ``points`` log-spaced GPU counts in [lo, hi], each a whole number of
    hosts in every replica."""
    unit = cfg.replicas * cfg.gpus_per_host
    first, last = unit * max(1, math.ceil(lo / unit)), unit * max(1, hi // unit)
    counts = {min(last, max(first, unit * round(g / unit))) for g in np.geomspace(lo, hi, points)}
    return sorted(counts | {cfg.gpus})


def sweep(cfg: SimConfig, gpu_counts: list[int]) -> dict[str, list[float]]:
    """Mean ETTR per strategy at each GPU count (MTBF scaled inversely from cfg's GPU count)."""
    series: dict[str, list[float]] = {name: [] for name in STRATEGIES}
    for gpus in gpu_counts:
        for name, res in simulate(cfg.at_gpus(gpus)).items():
            series[name].append(res.ettr)
    return series
