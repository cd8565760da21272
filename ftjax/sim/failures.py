"""The failure process: what fails, when, how much of the job it takes down, and for how long.

A failure hits one **failure domain** (``--blast-radius``: a GPU, a host, or a rack of hosts) and is
a *hardware* failure with probability ``--hardware-share`` (it needs a repair; otherwise a restart
fixes it). Three sources of failure times:

- ``--failure-level domain`` (default): every domain is a renewal process of its own. With
  exponential lifetimes every domain fails at rate ``1 / (mtbf_min * domains)``: a Poisson process of
  rate ``1 / mtbf_min`` at job level with the failed domain uniform. With Weibull lifetimes each
  domain starts at a random age (the first failure of each is drawn from the stationary
  forward-recurrence distribution), so the job-level rate is 1 / mtbf_min from the start; a failed
  domain is swapped for a fresh one whose lifetime starts at the failure. Many domains of long mean
  life together fail almost as a Poisson process: at 75,000 hosts the shape has no visible effect.
- ``--failure-level job``: one job-level renewal process, times between failures Weibull (or
  exponential) of mean mtbf_min, each failure in a uniformly random domain. Here the shape shows at
  any scale (shape < 1: failures come in bursts).
- ``--failure-trace CSV``: the failures of a real job (or `ftjax simulate --from-run`); see
  :func:`read_trace`. No failure after its last row.

Slow-replica episodes (stragglers) are a Poisson process of mean gap ``--straggler-mtbs-min``, each
in a uniformly random replica.

The trace does not depend on the strategy, so for a given seed every strategy sees the same
failures (common random numbers: differences between strategies are not sampling noise); the
hardware draws and the straggler episodes come from streams of their own, so changing
``--hardware-share`` does not move the failure times.
"""

from __future__ import annotations

import csv
import heapq
import math
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ftjax.sim.config import SimConfig

_CHUNK = 4096


class Failure(NamedTuple):
    t: float  # minutes
    first_gpu: int  # GPUs first_gpu .. first_gpu + gpus - 1 are down
    gpus: int
    hardware: bool  # needs a repair (else a restart fixes it)


class Straggle(NamedTuple):
    t: float  # minutes
    unit: int  # the replica that runs slow for --straggler-min


class TraceError(ValueError):
    """A failure trace could not be read; the message names the file, line and column."""


def events(cfg: SimConfig, seed_index: int) -> Iterator[Failure | Straggle]:
    """Time-ordered failures and straggler episodes of trace ``seed_index`` of ``cfg`` (endless,
    unless the failures come from a finite --failure-trace and there are no stragglers)."""
    streams = [np.random.default_rng(np.random.SeedSequence(cfg.seed, spawn_key=(seed_index, k))) for k in range(4)]
    fail = failures(cfg, streams[0], streams[1], streams[2])
    if math.isinf(cfg.straggler_mtbs_min):
        return fail
    return heapq.merge(fail, _stragglers(streams[3], cfg.straggler_mtbs_min, cfg.replicas), key=lambda e: e.t)


def failures(
    cfg: SimConfig, times_rng: np.random.Generator, where_rng: np.random.Generator, kind_rng: np.random.Generator
) -> Iterator[Failure]:
    size = cfg.blast_gpus
    domains = cfg.gpus // size
    if cfg.failure_trace is not None:
        yield from read_trace(cfg.failure_trace, cfg, where_rng, kind_rng)
        return
    if cfg.failure_level == "job" or cfg.failure_dist == "exponential":
        shape = cfg.weibull_shape if cfg.failure_dist == "weibull" else 1.0
        hits: Iterator[tuple[float, int]] = zip(_renewal(times_rng, cfg.mtbf_min, shape), _uniform(where_rng, domains))
    else:
        hits = _per_domain_weibull(times_rng, cfg.mtbf_min * domains, cfg.weibull_shape, domains)
    for (t, d), hw in zip(hits, _bernoulli(kind_rng, cfg.hardware_share)):
        yield Failure(t, d * size, size, hw)


def _renewal(rng: np.random.Generator, mean: float, shape: float) -> Iterator[float]:
    """Renewal times with Weibull(shape) gaps of the given mean (shape 1: Poisson). Drawn in chunks:
    vectorised, and the same seed yields the same trace however far it is read."""
    scale = mean / math.gamma(1.0 + 1.0 / shape)
    t = 0.0
    first = True
    while True:
        gaps = scale * rng.weibull(shape, _CHUNK)
        if first and shape != 1.0:
            # Stationary start: the job starts inside a gap drawn length-biased, at a uniform point.
            gaps[0] = rng.uniform() * scale * rng.gamma(1.0 + 1.0 / shape) ** (1.0 / shape)
        first = False
        times = t + np.cumsum(gaps)
        yield from times.tolist()
        t = float(times[-1])


def _uniform(rng: np.random.Generator, n: int) -> Iterator[int]:
    while True:
        yield from rng.integers(0, n, _CHUNK).tolist()


def _bernoulli(rng: np.random.Generator, p: float) -> Iterator[bool]:
    while True:
        yield from (rng.random(_CHUNK) < p).tolist()


def _per_domain_weibull(
    rng: np.random.Generator, mean_life: float, shape: float, domains: int
) -> Iterator[tuple[float, int]]:
    scale = mean_life / math.gamma(1.0 + 1.0 / shape)
    # Stationary start: each domain is inside a lifetime drawn length-biased (density x f(x) / mean;
    # for a Weibull, (x / scale)^shape ~ Gamma(1 + 1/shape)), at a uniform point of it.
    biased = scale * rng.gamma(1.0 + 1.0 / shape, 1.0, domains) ** (1.0 / shape)
    heap = list(zip((rng.uniform(0.0, 1.0, domains) * biased).tolist(), range(domains)))
    heapq.heapify(heap)
    while True:
        for life in (scale * rng.weibull(shape, _CHUNK)).tolist():
            t, d = heap[0]
            heapq.heapreplace(heap, (t + life, d))
            yield t, d


def _stragglers(rng: np.random.Generator, mean_gap: float, units: int) -> Iterator[Straggle]:
    t = 0.0
    while True:
        times = t + np.cumsum(rng.exponential(mean_gap, _CHUNK))
        for ti, u in zip(times.tolist(), rng.integers(0, units, _CHUNK).tolist()):
            yield Straggle(ti, u)
        t = float(times[-1])


# --- traces ---------------------------------------------------------------------------------------
TRACE_COLUMNS = ("time_min", "gpus", "first_gpu", "hardware")


def read_trace(
    path: str | Path,
    cfg: SimConfig,
    where_rng: np.random.Generator | None = None,
    kind_rng: np.random.Generator | None = None,
) -> list[Failure]:
    """The failures of a CSV file with a header row naming its columns:

    - ``time_min`` (required): minutes from the start of the job, non-decreasing;
    - ``gpus``: GPUs the failure takes down (default: the --blast-radius domain);
    - ``first_gpu``: the first of them (default: a uniformly random domain of that size);
    - ``hardware``: 1 if it needs a repair, 0 if a restart fixes it (default: drawn with
      --hardware-share).

    A header alone is a job without failure.
    """
    where_rng = where_rng or np.random.default_rng(cfg.seed)
    kind_rng = kind_rng or np.random.default_rng(cfg.seed + 1)
    name = str(path)
    rows = _read_rows(path, name)
    out: list[Failure] = []
    last = 0.0
    for line, row in enumerate(rows, start=2):

        def number(col: str, default: float | None, lo: float = 0.0, hi: float = math.inf, row=row, line=line) -> float:
            text = (row.get(col) or "").strip()
            if not text:
                if default is None:
                    raise TraceError(f"{name}:{line}: {col}: missing")
                return default
            try:
                value = float(text)
            except ValueError:
                raise TraceError(f"{name}:{line}: {col}: not a number: {text!r}") from None
            if not lo <= value <= hi or math.isnan(value):
                raise TraceError(f"{name}:{line}: {col}: {text} is outside [{lo:g}, {hi:g}]")
            return value

        t = number("time_min", None)
        if t < last:
            raise TraceError(f"{name}:{line}: time_min: {t:g} is before the previous row's {last:g}")
        last = t
        gpus = int(number("gpus", cfg.blast_gpus, 1, cfg.gpus))
        first = number("first_gpu", -1.0, 0, cfg.gpus - gpus)
        if first < 0:
            first = int(where_rng.integers(0, cfg.gpus // gpus)) * gpus
        hw = number("hardware", -1.0, 0, 1)
        hardware = bool(kind_rng.random() < cfg.hardware_share) if hw < 0 else hw == 1
        out.append(Failure(t, int(first), gpus, hardware))
    return out


def _read_rows(path: str | Path, name: str) -> list[dict[str, str]]:
    """The rows of a trace file, once its header names the columns of TRACE_COLUMNS only."""
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            header = reader.fieldnames or []
    except OSError as e:
        raise TraceError(f"--failure-trace: cannot read {name}: {e.strerror}") from e
    if not header:
        raise TraceError(f"{name}: no header row (time_min[, gpus, first_gpu, hardware])")
    unknown = [c for c in header if c not in TRACE_COLUMNS]
    if unknown or "time_min" not in header:
        raise TraceError(f"{name}: columns must be time_min[, gpus, first_gpu, hardware]; got {list(header)}")
    return rows


def write_trace(path: str | Path, trace: list[Failure]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(TRACE_COLUMNS)
        for e in trace:
            w.writerow([repr(e.t), e.gpus, e.first_gpu, int(e.hardware)])
