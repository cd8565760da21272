"""Run every strategy on ``cfg.seeds`` failure traces and average; sweep any input."""

from __future__ import annotations

import math
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ftjax.sim import closed_form
from ftjax.sim.config import SimConfig
from ftjax.sim.failures import events
from ftjax.sim.model import CATEGORIES, Outcome, run
from ftjax.sim.recovery import Recovery
from ftjax.sim.strategies import STRATEGIES


def _r(x: float | None, digits: int = 5) -> float | None:
    return None if x is None or math.isinf(x) else round(x, digits)


@dataclass
class StrategyResult:
    """One strategy, averaged over seeds."""

    name: str
    ettr: float  # mean over seeds of productive GPU-time / total GPU-time
    ettr_std: float  # standard deviation over seeds
    ettr_analytic: float | None  # closed form where one is exact (ftjax.sim.closed_form)
    availability: float  # mean fraction of wall time the job trained (not stalled or restarting)
    ttt_ratio: float  # mean time to train / failure-free time (a lower bound if not finished)
    effective_mtbf_min: float  # wall time per interruption (failures that stalled or restarted the job)
    data_trained: float | None  # mean fraction of the planned batches in the model (None if not finished)
    time_to_train_h: float | None  # mean wall time for cfg.steps; None if a seed did not finish
    finished: int  # seeds that trained every step within the horizon
    seeds: int
    failures: float  # mean failures per seed during the job
    breakdown: dict[str, float]  # mean fraction of GPU-time per category; sums to 1
    counts: dict[str, float] = field(default_factory=dict)  # mean per seed, by cause
    checkpoint_interval_min: float | None = None  # the interval used (None: no checkpoints)
    note: str | None = None  # why a seed did not finish, when it is known
    comm: dict[str, float] | None = None  # the inter-replica averages (see comm_plan); None: not modelled

    def to_json(self) -> dict[str, Any]:
        return {
            "ettr": _r(self.ettr),
            "ettr_std": _r(self.ettr_std),
            "ettr_analytic": _r(self.ettr_analytic),
            "availability": _r(self.availability),
            "ttt_ratio": _r(self.ttt_ratio, 4),
            "effective_mtbf_min": _r(self.effective_mtbf_min, 3),
            "data_trained": _r(self.data_trained, 4),
            "time_to_train_h": _r(self.time_to_train_h, 3),
            "finished": self.finished,
            "seeds": self.seeds,
            "failures": round(self.failures, 2),
            "checkpoint_interval_min": _r(self.checkpoint_interval_min, 3),
            "breakdown": {k: round(v, 5) for k, v in self.breakdown.items()},
            "counts": {k: round(v, 4) for k, v in self.counts.items()},
            **({"note": self.note} if self.note else {}),
            **({"comm": {k: _r(v, 6) for k, v in self.comm.items()}} if self.comm else {}),
        }


def comm_plan(cfg: SimConfig, strategy: Recovery) -> dict[str, float] | None:
    """What ``strategy`` sends between replicas, failure-free (None without --link-gbps): the bytes of
    one average (a gradient's, or a streaming fragment's: the peak a link carries in one round), the
    steps between two averages, one average's ring all-reduce time, its mean per step, and that mean's
    share of a step's time."""
    if cfg.link_gbps is None or cfg.params is None:
        return None
    share, every = strategy.sync_plan()
    per_step = strategy.comm_s()
    return {
        "bytes_per_sync": cfg.params * cfg.bytes_per_param * share,
        "steps_per_sync": every,
        "sync_s": cfg.allreduce_s() * share,
        "comm_s_per_step": per_step,
        "comm_share": per_step / (cfg.step_s + per_step),
    }


def _note(cfg: SimConfig, name: str, outcomes: list[Outcome]) -> str | None:
    if all(o.finished for o in outcomes):
        return None
    load = cfg.job_restart_min() / cfg.mtbf_min
    if name == "sync" and cfg.restart_policy == "queue" and load >= 1:
        return f"restart {cfg.job_restart_min():.3g} min >= MTBF {cfg.mtbf_min:.3g} min: queued restarts never end"
    if name == "sync" and cfg.restart_policy == "restart" and load > 3:
        return (
            f"restart {cfg.job_restart_min():.3g} min = {load:.3g} x MTBF: a restart completes once in "
            f"~e^{load:.3g} tries"
        )
    return f"not done after --max-slowdown {cfg.max_slowdown:g} x its failure-free time"


def _aggregate(
    cfg: SimConfig, name: str, outcomes: list[Outcome], interval: float, comm: dict[str, float] | None = None
) -> StrategyResult:
    ettrs = np.array([o.ettr for o in outcomes])
    breakdown = {c: float(np.mean([o.minutes[c] / o.wall_min for o in outcomes])) for c in CATEGORIES}
    counts: dict[str, float] = {}
    for o in outcomes:
        for k, v in o.counts.items():
            counts[k] = counts.get(k, 0) + v / len(outcomes)
    if name in ("replication", "spare") and counts.get("fatal"):
        counts["masked_per_fatal"] = counts.get("masked", 0) / counts["fatal"]
        if math.isinf(cfg.replica_restart_min):  # the SPARe closed form assumes no repair (asymptotic in N)
            counts["masked_per_fatal_spare"] = closed_form.masked_failures_spare(cfg.replicas, cfg.redundancy)
    done = [o for o in outcomes if o.finished]
    interruptions = sum(o.counts.get("interruptions", 0) for o in outcomes)
    return StrategyResult(
        name=name,
        ettr=float(ettrs.mean()),
        ettr_std=float(ettrs.std()),
        ettr_analytic=closed_form.analytic_ettr(cfg, name),
        availability=float(np.mean([o.availability for o in outcomes])),
        ttt_ratio=float(np.mean([o.ttt_ratio for o in outcomes])),
        effective_mtbf_min=sum(o.wall_min for o in outcomes) / interruptions if interruptions else math.inf,
        data_trained=float(np.mean([o.data_trained for o in done])) if len(done) == len(outcomes) else None,
        time_to_train_h=float(np.mean([o.wall_min for o in done])) / 60 if len(done) == len(outcomes) else None,
        finished=len(done),
        seeds=len(outcomes),
        failures=float(np.mean([o.failures for o in outcomes])),
        breakdown=breakdown,
        counts=counts,
        checkpoint_interval_min=None if math.isinf(interval) else interval,
        note=_note(cfg, name, outcomes),
        comm=comm,
    )


def simulate(cfg: SimConfig, strategies: Iterable[str] = tuple(STRATEGIES)) -> dict[str, StrategyResult]:
    """Every strategy in ``strategies`` on the same ``cfg.seeds`` failure traces."""
    results = {}
    for name in strategies:
        outcomes, interval, comm = [], math.inf, None
        for i in range(cfg.seeds):
            strategy = STRATEGIES[name](cfg)
            interval, comm = strategy.interval, comm_plan(cfg, strategy)
            outcomes.append(run(strategy, events(cfg, i), cfg.work_min, cfg.max_slowdown))
        results[name] = _aggregate(cfg, name, outcomes, interval, comm)
    return results


def sweep_gpu_counts(cfg: SimConfig, lo: int = 1_000, hi: int = 200_000, points: int = 12) -> list[int]:
    """``cfg.gpus`` and about ``points`` log-spaced GPU counts in [lo, hi], each a whole number of
    hosts in every replica (and of racks, with --blast-radius rack)."""
    unit = cfg.replicas * cfg.gpus_per_host
    if cfg.blast_radius == "rack":
        unit = math.lcm(unit, cfg.gpus_per_host * cfg.hosts_per_rack)
    first, last = unit * max(1, math.ceil(lo / unit)), unit * max(1, hi // unit)
    counts = {min(last, max(first, unit * round(g / unit))) for g in np.geomspace(lo, hi, points)}
    return sorted(counts | {cfg.gpus})


def sweep_values(cfg: SimConfig, knob: str) -> list[Any]:
    """Default values to sweep ``knob`` over: GPU counts from 1K to 200K; every choice of a choice;
    else 1/4x to 4x the current value (0 to 1 for a fraction at 0, 1 to 16 for a count)."""
    if knob == "gpus":
        return sweep_gpu_counts(cfg)
    annotation = SimConfig.model_fields[knob].annotation
    if typing.get_origin(annotation) is typing.Literal:
        return list(typing.get_args(annotation))
    if annotation is bool:
        return [False, True]
    value = getattr(cfg, knob)
    if not isinstance(value, (int, float)) or math.isinf(value):
        raise ValueError(f"--sweep-over {knob}: give --sweep-values (its value is {value!r})")
    if annotation is int:
        base = value or 1
        return sorted({max(1, round(base * f)) for f in (0.25, 0.5, 1, 2, 4)})
    if value == 0:
        return [0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9]
    return [round(value * f, 6) for f in (0.25, 0.5, 1, 2, 4)]


def at_value(cfg: SimConfig, knob: str, value: float | str) -> SimConfig:
    """``cfg`` with ``knob`` set to ``value`` (GPU counts scale the MTBF and init, see at_gpus)."""
    if knob == "gpus":
        return cfg.at_gpus(int(value))
    return cfg.with_values(**{knob: value})


def sweep(
    cfg: SimConfig, knob: str, values: list[Any], strategies: Iterable[str] = tuple(STRATEGIES)
) -> dict[str, dict[str, list[float | None]]]:
    """``{"ettr": {strategy: [...]}, "ttt_ratio": {...}, "availability": {...}}`` at each value."""
    names = list(strategies)
    out: dict[str, dict[str, list[float | None]]] = {
        m: {n: [] for n in names} for m in ("ettr", "ttt_ratio", "availability")
    }
    for value in values:
        for name, res in simulate(at_value(cfg, knob, value), names).items():
            out["ettr"][name].append(res.ettr)
            out["ttt_ratio"][name].append(res.ttt_ratio if res.finished == res.seeds else None)
            out["availability"][name].append(res.availability)
    return out
