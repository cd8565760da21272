"""Analytic means of the model in ftjax.sim.strategies, for exponential (Poisson) failures.

Used as cross-checks of the simulation (tests, and the `analytic` column of `ftjax simulate`).
Notation: job failure rate ``lam = 1/mtbf``; a global stall ``S``; a unit restart ``D`` after it;
``U`` units, each failing at ``mu = lam/U``; a unit is out for ``L = S + D`` after its last failure.
"""

from __future__ import annotations

import math

from ftjax.sim.model import SimConfig


def checkpoint_factor(lam: float, interval: float, cost: float) -> float:
    """Durable fraction of the training time between two whole-job restarts.

    The time to the next failure is Exp(lam) (memoryless); saves complete at n*(interval + cost), so
    the durable work is interval * E[floor(T / c)] = interval * e^{-lam c} / (1 - e^{-lam c}) with
    c = interval + cost, out of an expected 1/lam. ``interval = 0`` means no checkpoints (factor 1).
    """
    if interval == 0:
        return 1.0
    c = interval + cost
    return lam * interval * math.exp(-lam * c) / -math.expm1(-lam * c)


def sync_ettr(mtbf: float, stall: float, overlap: str, interval: float = 0.0, cost: float = 0.0) -> float:
    """Sync: renewal-reward over (restart phase, training phase until the next failure).

    queue: the restart phase is an M/D/1 busy period, mean S / (1 - lam S), so ETTR = (1 - lam S) * f;
    restart: it ends at the first gap of S without failure, mean (e^{lam S} - 1) / lam, so
    ETTR = e^{-lam S} * f; f is :func:`checkpoint_factor`.
    """
    lam = 1.0 / mtbf
    f = checkpoint_factor(lam, interval, cost)
    if overlap == "queue":
        return max(0.0, 1.0 - lam * stall) * f
    return math.exp(-lam * stall) * f


def units_out_ettr_restart(mtbf: float, stall: float, restart: float, units: int) -> float:
    """FT-HSDP (units = replicas) or reduced-degree (units = hosts), overlap="restart", no rejoin
    stall, no checkpoints.

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


def masked_failures_spare(groups: int, r: int) -> float:
    """SPARe's asymptotic mean number of failures masked before a shard loses all r copies:
    Gamma(1/r) * N^(1 - 1/r) / r (accurate for large N: within 1% at N = 4096, r = 2)."""
    return math.gamma(1.0 / r) * groups ** (1.0 - 1.0 / r) / r


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
        gaps = sum((-1) ** j * math.comb(m, j) * math.comb(k - j * r + m - 1, m - 1)
                   for j in range(min(m, k // r) + 1))
        p = (n * gaps // m) / math.comb(n, k)
        if p < 1e-16:
            break
        total += p
    return total


def analytic_ettr(cfg: SimConfig, strategy: str) -> float | None:
    """The exact mean ETTR of ``strategy`` under ``cfg`` where this module has one, else None.

    Exact only with exponential failures, no rejoin stall, and for the FT strategies overlap="restart"
    without checkpoints; time-to-train effects at the start and end of a job are ignored.
    """
    if cfg.failure_dist != "exponential":
        return None
    if strategy == "sync":
        return sync_ettr(cfg.mtbf_min, cfg.sync_stall_min, cfg.overlap,
                         cfg.checkpoint_interval_min, cfg.checkpoint_cost_min)
    if (strategy in ("ft-hsdp", "reduced-degree") and cfg.overlap == "restart"
            and cfg.rejoin_stall_min == 0 and cfg.checkpoint_interval_min == 0):
        units = cfg.replicas if strategy == "ft-hsdp" else cfg.hosts
        return units_out_ettr_restart(cfg.mtbf_min, cfg.ft_stall_min, cfg.replica_restart_min, units)
    return None
