"""The checkpoint interval: given, or chosen from the cost of a save and the time between rollbacks.

``M`` is the mean time between whole-job restarts that roll back to the last checkpoint (the
strategy's, see ftjax.sim.strategies), ``C`` the blocking cost of one save.

- **young**: sqrt(2 C M) (Young, 1974): first order in C / M.
- **daly**: sqrt(2 C M) (1 + sqrt(C / 2M) / 3 + C / 18M) - C for C < 2M, else M (Daly, 2006).
- **optimal**: the interval that maximises the durable fraction of training between two rollbacks
  under Poisson rollbacks (:func:`checkpoint_factor`): the availability optimum of this model,
  exact where Young and Daly are approximations.
"""

from __future__ import annotations

import math

INTERVAL_RULES = ("young", "daly", "optimal")


def checkpoint_factor(lam: float, interval: float, cost: float) -> float:
    """Durable fraction of the training time between two whole-job restarts.

    The time to the next failure is Exp(lam) (memoryless); saves complete at n*(interval + cost), so
    the durable work is interval * E[floor(T / c)] = interval * e^{-lam c} / (1 - e^{-lam c}) with
    c = interval + cost, out of an expected 1/lam. ``interval = 0`` means no checkpoints (factor 1).
    """
    if interval == 0 or lam == 0:
        return 1.0
    if math.isinf(interval):
        return 0.0
    c = interval + cost
    return lam * interval * math.exp(-lam * c) / -math.expm1(-lam * c)


def young(cost: float, mtbf: float) -> float:
    return math.sqrt(2.0 * cost * mtbf)


def daly(cost: float, mtbf: float) -> float:
    if cost >= 2.0 * mtbf:
        return mtbf
    r = cost / (2.0 * mtbf)
    return math.sqrt(2.0 * cost * mtbf) * (1.0 + math.sqrt(r) / 3.0 + r / 9.0) - cost


def optimal(cost: float, mtbf: float) -> float:
    """argmax over the interval of checkpoint_factor(1/mtbf, interval, cost): golden-section search on
    log(interval), which is unimodal there."""
    lam = 1.0 / mtbf
    lo, hi = math.log(young(cost, mtbf) / 100.0), math.log(young(cost, mtbf) * 100.0)
    g = (math.sqrt(5.0) - 1.0) / 2.0
    f = lambda x: checkpoint_factor(lam, math.exp(x), cost)
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = f(a), f(b)
    for _ in range(100):
        if fa < fb:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = f(b)
        else:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = f(a)
    return math.exp((lo + hi) / 2.0)


def interval(setting: float | str, cost: float, rollback_mtbf: float) -> float:
    """Minutes of training between saves (math.inf: never) for ``--checkpoint-interval-min``."""
    if not isinstance(setting, str):
        return setting if setting > 0 else math.inf
    if math.isinf(rollback_mtbf):
        return math.inf  # nothing ever rolls back: a checkpoint saves nothing
    if cost <= 0:
        raise ValueError(
            f"--checkpoint-interval-min {setting} needs --checkpoint-cost-min > 0 "
            "(free saves would be taken continuously)"
        )
    return {"young": young, "daly": daly, "optimal": optimal}[setting](cost, rollback_mtbf)
