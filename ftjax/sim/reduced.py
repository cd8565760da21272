"""Throughput of reduced-degree replicas (after NTP, arXiv 2504.06095), as pure functions.

A replica of G GPUs with m of them failed runs at reduced degree on the fraction f = 1 - m/G alive
and contributes ``curve(f)`` of a full replica's throughput (piecewise linear through the curve's
points), times ``1 + power_boost`` up to 1. Below ``min_degree`` it cannot run and is out.

With **packing** the failed GPUs of the whole job are gathered into as few replicas as possible
(NTP places failed domains together at each restart): every reduced replica takes as many failures
as it can while still running (see :func:`pack`), so fewer replicas run reduced; it helps when the
curve is below the linear share.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable


def curve_at(curve: tuple[tuple[float, float], ...], f: float) -> float:
    """Piecewise-linear interpolation of ``curve`` (sorted points covering 0..1) at ``f``."""
    xs = [p[0] for p in curve]
    i = bisect.bisect_left(xs, f)
    if i < len(xs) and xs[i] == f:
        return curve[i][1]
    (x0, y0), (x1, y1) = curve[i - 1], curve[i]
    return y0 + (y1 - y0) * (f - x0) / (x1 - x0)


def replica_loss(
    missing: int, gpus: int, curve: tuple[tuple[float, float], ...], power_boost: float, min_degree: float
) -> tuple[float, float, float]:
    """(useful, out, degraded) of one replica, as fractions of one replica's GPU-time: ``out`` is
    the share of its failed GPUs (all of it when the replica cannot run), ``degraded`` what its live
    GPUs lose below their share; a power boost can win back part of ``out``."""
    if missing <= 0:
        return 1.0, 0.0, 0.0
    f = max(0.0, 1.0 - missing / gpus)
    if f < min_degree or f == 0.0:
        return 0.0, 1.0, 0.0
    useful = min(1.0, curve_at(curve, f) * (1.0 + power_boost))
    out = min(1.0 - f, 1.0 - useful)
    return useful, out, 1.0 - useful - out


def pack(missing: Iterable[int], gpus: int, replicas: int, min_degree: float) -> list[int]:
    """The failed GPUs per replica after packing them into as few replicas as possible.

    A running replica can hold up to h = floor(G * (1 - min_degree)) failed GPUs; failures are
    packed h to a replica (when h = 0, any failure stops its replica: they are packed G to a
    replica, which is then out). Never more failures than the job has GPUs.
    """
    total = min(sum(missing), gpus * replicas)
    per = math.floor(gpus * (1.0 - min_degree) + 1e-9) or gpus
    full, rest = divmod(total, per)
    packed = [per] * full + ([rest] if rest else [])
    if len(packed) > replicas:  # more failures than running replicas can hold: the rest are out whole
        over = sum(packed[replicas - 1 :])
        packed = packed[: replicas - 1] + [min(over, gpus)]
    return packed


def job_rates(
    missing: dict[int, int],
    gpus: int,
    replicas: int,
    curve: tuple[tuple[float, float], ...],
    power_boost: float,
    min_degree: float,
    packing: bool,
) -> tuple[float, float, float]:
    """(useful, out, degraded) of the job, fractions of its GPU-time, given the failed GPUs of each
    replica that has any (``missing``: replica -> count)."""
    counts = pack(missing.values(), gpus, replicas, min_degree) if packing else list(missing.values())
    useful, out, degraded = float(replicas - len(counts)), 0.0, 0.0
    for m in counts:
        u, o, d = replica_loss(m, gpus, curve, power_boost, min_degree)
        useful, out, degraded = useful + u, out + o, degraded + d
    return useful / replicas, out / replicas, degraded / replicas
