"""Analytic means of the model in ftjax.sim.strategies, for exponential (Poisson) failures.

Used as cross-checks of the simulation (tests, and the `analytic` column of `ftjax simulate`).
Notation: job failure rate ``lam = 1/mtbf``; a global stall ``S``; a unit restart ``D`` after it;
``U`` units, each failing at ``mu = lam/U``; a unit is out for ``L = S + D`` after its last failure.

Inter-replica communication (--link-gbps) scales every rate while training by the same
compute / (compute + communication) (:func:`comm_factor`) and leaves the stalls, which are wall
time, as they are: a closed form without it times that factor, where rollbacks lose no work.
"""

from __future__ import annotations

import functools
import math

from ftjax.sim.checkpoints import checkpoint_factor
from ftjax.sim.config import SimConfig

__all__ = [
    "analytic_ettr",
    "checkpoint_factor",
    "comm_factor",
    "left_out_straggler_ettr",
    "lockstep_straggler_ettr",
    "masked_failures_exact",
    "masked_failures_spare",
    "spare_useful",
    "sync_availability",
    "sync_ettr",
    "units_out_ettr_restart",
    "units_out_stall_fraction",
]


def sync_ettr(
    mtbf: float, stall: float, policy: str, interval: float = 0.0, cost: float = 0.0, repair: float = 0.0
) -> float:
    """Sync: renewal-reward over (restart phase, training phase until the next failure); ``repair``
    is a wait for hardware before each restart (every failure hardware, no spare).

    queue: the restart phase is an M/D/1 busy period, mean S / (1 - lam S), so ETTR = (1 - lam S) * f;
    restart: it ends at the first gap of S without failure, mean (e^{lam S} - 1) / lam, so
    ETTR = e^{-lam S} * f; absorb: it lasts S whatever fails, ETTR = f / (1 + lam S).
    f is :func:`checkpoint_factor`. A repair wait adds to S in every case (queue and restart only
    with ``repair = 0``: the wait would change the overlaps).
    """
    lam = 1.0 / mtbf
    f = checkpoint_factor(lam, interval, cost)
    if policy == "absorb":
        return f / (1.0 + lam * (stall + repair))
    if repair:
        raise ValueError("repair waits have a closed form under --restart-policy absorb only")
    if policy == "queue":
        return max(0.0, 1.0 - lam * stall) * f
    return math.exp(-lam * stall) * f


def sync_availability(mtbf: float, stall: float, policy: str) -> float:
    """Fraction of wall time a sync job is not restarting (no checkpoint cost)."""
    lam = 1.0 / mtbf
    return {
        "absorb": 1.0 / (1.0 + lam * stall),
        "queue": max(0.0, 1.0 - lam * stall),
        "restart": math.exp(-lam * stall),
    }[policy]


def units_out_ettr_restart(mtbf: float, stall: float, restart: float, units: int) -> float:
    """FT-HSDP (units = replicas) or reduced-degree with a linear curve (units = failure domains),
    overlap="restart", no rejoin stall, no checkpoints.

    A unit's failure stalls everyone only if the unit was in, i.e. had no failure in the previous L.
    Such stalling failures of one unit are more than L >= S apart, so at most one falls in any window
    of length S: P(no stall caused by unit u in (t-S, t]) = 1 - mu S e^{-mu L} (rate times length).
    Units fail independently, and unit u is in at t iff it had no failure in (t-L, t], which also
    rules out a stall it caused. Hence
    ETTR = sum_u P(u in, nobody stalling) / U = e^{-mu L} (1 - mu S e^{-mu L})^(U-1).
    """
    mu = 1.0 / (mtbf * units)
    in_prob = math.exp(-mu * (stall + restart))
    return in_prob * (1.0 - mu * stall * in_prob) ** (units - 1)


def units_out_stall_fraction(mtbf: float, stall: float, restart: float, units: int, overlap: str) -> float:
    """Fraction of time everyone is stalled by failures (FT strategies, no rejoin stall).

    Stalling failures arrive at rate lam e^{-mu L} (a failure stalls only if its unit was in).
    queue: by the utilisation law the busy fraction is that rate times S (for any arrival process);
    restart: 1 - (1 - mu S e^{-mu L})^U, see :func:`units_out_ettr_restart`.
    """
    lam, mu = 1.0 / mtbf, 1.0 / (mtbf * units)
    in_prob = math.exp(-mu * (stall + restart))
    if overlap == "queue":
        return min(1.0, lam * stall * in_prob)
    return 1.0 - (1.0 - mu * stall * in_prob) ** units


def lockstep_straggler_ettr(mtbs: float, length: float, slowdown: float) -> float:
    """Everyone steps together (sync): the job runs at 1/slowdown whenever any replica is slow.
    Episodes start as a Poisson process of rate 1/mtbs and last ``length``; the job is slow at t iff
    one started in (t - length, t]: probability 1 - e^{-length/mtbs}."""
    p_slow = -math.expm1(-length / mtbs)
    return 1.0 - p_slow + p_slow / slowdown


def left_out_straggler_ettr(mtbs: float, length: float, units: int) -> float:
    """FT-HSDP with --straggler-detect-min 0: a slow replica is left out at once, so the job trains at
    (R - slow) / R; replica u is slow at t iff one of its episodes (rate 1/(mtbs R)) started in
    (t - length, t]."""
    return math.exp(-length / (mtbs * units))


def spare_useful(groups: int, out: int) -> float:
    """SPARe's early all-reduce with ``out`` of ``groups`` groups down: 1 / ceil(N / (N - k))."""
    return 1.0 / math.ceil(groups / (groups - out)) if out < groups else 0.0


def masked_failures_spare(groups: int, r: int) -> float:
    """SPARe's asymptotic mean number of failures masked before a shard loses all r copies:
    Gamma(1/r) * N^(1 - 1/r) / r (accurate for large N: within 1% at N = 4096, r = 2)."""
    return math.gamma(1.0 / r) * groups ** (1.0 - 1.0 / r) / r


@functools.lru_cache(maxsize=64)
def masked_failures_exact(groups: int, r: int) -> float:
    """Exact mean number of failures masked before a shard is lost, groups failing in uniformly
    random order without repair, shards placed cyclically (r consecutive groups per shard).

    Masked = sum_{k>=1} P(k failed groups contain no r cyclically consecutive ones). The number of
    such k-subsets of an N-cycle is N / (N - k) * C(N - k, k), where C(m, k) counts the compositions
    of k into m gaps of at most r - 1 (the gaps between the N - k live groups). Exact integer
    arithmetic: fast for r = 2 or N up to a few thousand (0.7 s at N = 4096, r = 2).
    """
    n, total = groups, 0.0
    for k in range(1, n):
        m = n - k
        gaps = sum((-1) ** j * math.comb(m, j) * math.comb(k - j * r + m - 1, m - 1) for j in range(min(m, k // r) + 1))
        p = (n * gaps // m) / math.comb(n, k)
        if p < 1e-16:
            break
        total += p
    return total


def comm_factor(compute_s: float, comm_s: float) -> float:
    """Share of a step's time spent computing when it also waits ``comm_s`` for the other replicas:
    every step ``comm_s`` is a ring all-reduce, 2 (R - 1) / R x bytes / bandwidth
    (SimConfig.allreduce_s); with DiLoCo, 1/H of one."""
    return compute_s / (compute_s + comm_s)


def analytic_ettr(cfg: SimConfig, strategy: str) -> float | None:
    """The exact mean ETTR of ``strategy`` under ``cfg`` where this module has one, else None.

    Exact only with Poisson failures (exponential, drawn), software failures only (or infinite
    spares), no slow replicas or pauses, no rejoin stall, and for the FT strategies
    overlap="restart" without checkpoints; time-to-train effects at the start and end of a job are
    ignored. With --link-gbps, the same times :func:`comm_factor` (sync without checkpoints only:
    the work a rollback loses would take longer to train).
    """
    ettr = _analytic_ettr(cfg, strategy)
    comm = cfg.allreduce_s()
    if ettr is None or not comm:
        return ettr
    if strategy == "sync" and cfg.checkpoint_interval_min:
        return None
    return ettr * comm_factor(cfg.step_s, comm)


def _analytic_ettr(cfg: SimConfig, strategy: str) -> float | None:
    if (
        cfg.failure_dist != "exponential"
        or cfg.failure_trace is not None
        or not math.isinf(cfg.straggler_mtbs_min)
        or cfg.pause_fraction
        or (cfg.hardware_share and not math.isinf(cfg.spare_hosts))
        or isinstance(cfg.checkpoint_interval_min, str)
    ):
        return None
    stall = cfg.job_restart_min()
    if strategy == "sync":
        return sync_ettr(cfg.mtbf_min, stall, cfg.restart_policy, cfg.checkpoint_interval_min, cfg.checkpoint_cost_min)
    if cfg.overlap != "restart" or cfg.rejoin_stall_min or cfg.checkpoint_interval_min:
        return None
    if strategy == "ft-hsdp" and cfg.gpus_per_replica % cfg.blast_gpus == 0:
        return units_out_ettr_restart(
            cfg.mtbf_min, cfg.ft_stall_min, cfg.unit_restart_min(cfg.gpus_per_replica), cfg.replicas
        )
    linear = all(abs(f - t) < 1e-12 for f, t in cfg.reduced_curve)
    if (
        strategy == "reduced-degree"
        and cfg.reduced_recovery == "ft-stall"
        and linear
        and not cfg.power_boost
        and cfg.min_degree == 0
        and cfg.gpus_per_replica % cfg.blast_gpus == 0
    ):
        return units_out_ettr_restart(
            cfg.mtbf_min, cfg.ft_stall_min, cfg.unit_restart_min(cfg.blast_gpus), cfg.gpus // cfg.blast_gpus
        )
    return None
