"""`ftjax simulate --from-run RUN`: measure an `ftjax launch` run, simulate it, compare the ETTR.

The run directory is read with the summary's own readers (ftjax.runs.summary, ftjax.runs.lifecycle),
over the window the summary's ETTR uses: from warm-up to the job's last committed step. Each
replica's time there is *productive* (training, and one median step of each stalled gap) or not,
exactly as in the summary. Measured, per replica death (`replica_down`):

- **failure time** ``t_fail``: when the dying replica stopped being productive (its last step plus
  the median step it is credited for; the death itself if it was training);
- **back** ``t_back``: its first step with its own batch after the death (restart delay, process
  start and compile, catch-up), or its next death if that comes first: ``out_s = t_back - t_fail``,
  split at ``catchup_started`` into ``restart_s`` and ``catchup_s``;
- **stall per failure** ``stall_s``: the unproductive time of the *other* replicas in
  ``[t_fail, t_back + 5 median steps]`` (the quorum change at the death and at the rejoin, and any
  slowdown while the restarted replica compiles, and its ordinary pauses), per other replica.

Outside those windows: ``pause_fraction``, the unproductive share of every replica's time (gaps
beyond the stall rule, a replica done before the last step), and the job's mean step time. The
simulation charges pauses only while no replica is out, since inside a window the stall holds
all of the others' losses (on one shared machine a replica alone pauses less: it contends with
nobody). While replicas are out: the job's steps per second of out time less stall, as
``step_scaling`` (a replica alone steps faster here).

The simulation is one ft-hsdp job of R replicas trained for the window's steps
(``--train-for steps``: a step counts whole however many replicas take part, as in ftjax), at the
failure-free step time (mean step outside the windows, less its pauses), hit by the measured
failures at their measured times (a --failure-trace; a random kill no earlier than the previous
killed replica is back with the mean out time, as the launcher fires them only while every replica
trains), each stalling everyone ``stall_s`` (mean) and keeping its replica out ``out_s - stall_s``
(mean) more. With ``costs_from`` the costs (step time,
stall, out time, pauses) come from another run and only the failure times and the step count from
RUN: a prediction across runs.
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ftjax.runs.events import EVENT, REPLICA, TIME, LauncherEvent, ReplicaEvent, StepField
from ftjax.runs.lifecycle import Phase
from ftjax.runs.summary import Run, ettr, load_run, median_step, timeline, warm_time
from ftjax.sim.config import SimConfig
from ftjax.sim.failures import Failure, write_trace
from ftjax.sim.presets import NEUTRAL
from ftjax.sim.run import simulate

MARGIN_STEPS = 5  # a failure's window reaches this many median steps past the rejoin


class RunError(ValueError):
    """The run directory cannot be measured; the message says why."""


@dataclass
class FailureCost:
    replica: int
    t_fail_s: float  # from warm-up
    out_s: float  # t_back - t_fail
    restart_s: float  # t_fail to catchup_started
    catchup_s: float  # catchup_started to t_back
    stall_s: float  # unproductive time of each other replica in the failure's window
    window_s: float  # the time of each other replica in that window
    random_kill: bool  # an `--mtbf-s` kill: the launcher fires one only while every replica trains


@dataclass
class Measured:
    """What one run measured (seconds unless named otherwise)."""

    run: str
    replicas: int
    gpus_per_replica: int
    gpus_per_host: int
    window_s: float  # warm-up to the last committed step
    steps: int  # job steps committed in the window
    median_step_s: float
    mean_step_s: float  # job step time outside the failure windows, pauses included
    pause_fraction: float  # unproductive share of replica time outside the failure windows
    ettr: float  # the summary's ETTR over the window
    step_scaling: tuple[tuple[float, float], ...]  # ((R - 1) / R, step time with one replica out / step_s)
    failures: list[FailureCost] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)

    @property
    def step_s(self) -> float:
        """Failure-free step time without pauses (the simulation adds them back)."""
        return self.mean_step_s * (1.0 - self.pause_fraction)

    def mean(self, key: str) -> float:
        values = [getattr(f, key) for f in self.failures]
        return statistics.fmean(values) if values else 0.0


def _productive(state: str, a: float, b: float, median: float) -> float:
    if state == Phase.TRAINING.value:
        return b - a
    if state == Phase.STALLED.value:
        return min(median, b - a)
    return 0.0


def _merge(windows: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(windows):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _inside(t: float, windows: list[tuple[float, float]]) -> bool:
    return any(a <= t <= b for a, b in windows)


def _load(path: Path) -> Run:
    """The run directory, read (RunError: it is not one of `ftjax launch`)."""
    if not (path / "launcher.jsonl").exists():
        raise RunError(f"--from-run: {path} has no launcher.jsonl: not a run directory of `ftjax launch`")
    try:
        return load_run(path)
    except ValueError as e:
        raise RunError(f"--from-run: {e}") from e


def measure(run_dir: str | Path) -> Measured:
    """The costs and failures of an `ftjax launch` run directory (see the module docstring)."""
    path = Path(run_dir)
    run = _load(path)
    t_warm = warm_time(run)
    median, _ = median_step(run, t_warm)
    if t_warm is None or not median:
        raise RunError(f"--from-run: {path}: no warm-up or no step gap: the run trained no step on every replica")
    commits: dict[int, float] = {}
    for r in range(run.replicas):
        for s in run.metrics[r]:
            if s.get(StepField.COMMITTED) and StepField.STEP in s:
                commits[s[StepField.STEP]] = min(commits.get(s[StepField.STEP], s[TIME]), s[TIME])
    t_end = max(
        s[TIME]
        for r in range(run.replicas)
        for s in run.metrics[r]
        if s.get(StepField.COMMITTED) and StepField.STEP in s
    )
    segs = timeline(run, median)
    measured_ettr = ettr(run, segs, t_warm, t_end, median)
    assert measured_ettr is not None  # (a step gap after the warm-up: a commit after it, t_end > t_warm)
    clipped = {
        r: [(max(a, t_warm), min(b, t_end), st) for a, b, st in ss if min(b, t_end) > max(a, t_warm)]
        for r, ss in segs.items()
    }

    costs, windows, ignored = _failures(run, segs, clipped, median, t_warm, t_end)
    merged = _merge([(max(a, t_warm), min(b, t_end)) for a, b in windows])
    outside_s = (t_end - t_warm) - sum(b - a for a, b in merged)
    lost_outside = sum(
        (b - a) - _productive(st, a, b, median)
        for ss in clipped.values()
        for a, b, st in ss
        if not _inside((a + b) / 2, merged)
    )
    pause = lost_outside / (run.replicas * outside_s) if outside_s > 0 else 0.0
    warm_step = max((s for s, t in commits.items() if t <= t_warm), default=0)
    steps_in = sorted(t for s, t in commits.items() if s > warm_step)
    steps_out = sum(1 for t in steps_in if not _inside(t, merged))
    mean_step = outside_s / steps_out if steps_out and outside_s > 0 else median
    scaling = _step_scaling(run.replicas, costs, steps_in, t_warm, mean_step * (1.0 - pause))
    hosts = int(run.launch.get("hosts") or 1)
    devices = int(run.launch.get("devices") or 1)
    return Measured(
        run=str(path),
        replicas=run.replicas,
        gpus_per_replica=hosts * devices,
        gpus_per_host=devices,
        window_s=t_end - t_warm,
        steps=len(steps_in),
        median_step_s=median,
        mean_step_s=mean_step,
        pause_fraction=pause,
        ettr=measured_ettr,
        step_scaling=scaling,
        failures=costs,
        ignored=ignored,
    )


def _step_scaling(
    replicas: int, costs: list[FailureCost], steps_in: list[float], t_warm: float, step_s: float
) -> tuple[tuple[float, float], ...]:
    """The step time while a replica is out, relative to ``step_s`` (all of them in, pauses left
    out): what the simulation needs to step through the out time (less the stall) as the run did.
    One point at (R - 1) / R: the launcher's random kills take one replica at a time."""
    outs = _merge([(t_warm + c.t_fail_s, t_warm + c.t_fail_s + c.out_s) for c in costs])
    steps = sum(1 for t in steps_in if _inside(t, outs))
    moving = sum(b - a for a, b in outs) - sum(c.stall_s for c in costs)
    if replicas < 2 or not steps or moving <= 0:
        return ((1.0, 1.0),)
    return (((replicas - 1) / replicas, round(moving / (steps * step_s), 4)), (1.0, 1.0))


def _deaths(
    run: Run, segs: dict[int, list[tuple[float, float, str]]], median: float, t_warm: float, t_end: float
) -> tuple[list[tuple[int, float, float, float, bool]], list[str]]:
    """The replica deaths in the window, each as (replica, t_fail, t_catchup, t_back, random kill),
    and what was left out."""
    found: list[tuple[int, float, float, float, bool]] = []  # (replica, t_fail, t_catchup, t_back, random)
    ignored = []
    for e in run.events:
        if e[EVENT] == LauncherEvent.COORDINATOR_DOWN:
            ignored.append(f"coordinator loss at {e[TIME] - run.start:.1f} s (not modelled)")
        if e[EVENT] != LauncherEvent.REPLICA_DOWN:
            continue
        r, t_down = e[REPLICA], e[TIME]
        t_fail = t_down
        before = [(a, b, st) for a, b, st in segs[r] if b <= t_down + 1e-6]
        if before and before[-1][2] == Phase.STALLED.value:
            a, b, _ = before[-1]
            t_fail = min(t_down, a + min(median, b - a))
        if not t_warm <= t_fail <= t_end:
            ignored.append(f"replica {r} death at {t_down - run.start:.1f} s (outside the window)")
            continue
        # back at its first step with its own batch, or at its next death (a second failure before it
        # was back is a failure of its own, out from then)
        next_down = next(
            (
                d[TIME]
                for d in run.events
                if d[EVENT] == LauncherEvent.REPLICA_DOWN and d.get(REPLICA) == r and d[TIME] > t_down
            ),
            t_end,
        )
        t_back = next((a for a, _, st in segs[r] if a > t_down and st == Phase.TRAINING.value), t_end)
        t_back = min(t_back, next_down)
        t_catch = next(
            (
                m[TIME]
                for m in run.metrics[r]
                if m.get(EVENT) == ReplicaEvent.CATCHUP_STARTED and t_down < m[TIME] <= t_back
            ),
            t_back,
        )
        random_kill = e.get("cause") == "random_kill"
        found.append((r, t_fail, t_catch, min(t_back, t_end), random_kill))
    return found, ignored


def _failures(
    run: Run,
    segs: dict[int, list[tuple[float, float, str]]],
    clipped: dict[int, list[tuple[float, float, str]]],
    median: float,
    t_warm: float,
    t_end: float,
) -> tuple[list[FailureCost], list[tuple[float, float]], list[str]]:
    found, ignored = _deaths(run, segs, median, t_warm, t_end)
    windows = [(t_fail, t_back + MARGIN_STEPS * median) for _, t_fail, _, t_back, _ in found]
    own = {r: [(t_fail, t_back) for rr, t_fail, _, t_back, _ in found if rr == r] for r in range(run.replicas)}
    costs = []
    for i, (r, t_fail, t_catch, t_back, random_kill) in enumerate(found):
        lo, hi = windows[i]
        lost, span = 0.0, 0.0
        for h in range(run.replicas):
            if h == r:
                continue
            for a, b, st in clipped[h]:
                mid = (a + b) / 2
                earlier = any(wa <= mid <= wb for wa, wb in windows[:i])
                if lo <= mid <= hi and not earlier and not _inside(mid, own[h]):
                    lost += (b - a) - _productive(st, a, b, median)
                    span += b - a
        others = max(1, run.replicas - 1)
        costs.append(
            FailureCost(
                replica=r,
                t_fail_s=t_fail - t_warm,
                out_s=t_back - t_fail,
                restart_s=t_catch - t_fail,
                catchup_s=t_back - t_catch,
                stall_s=lost / others,
                window_s=span / others,
                random_kill=random_kill,
            )
        )
    return costs, windows, ignored


def sim_inputs(target: Measured, costs: Measured, trace_path: str) -> dict[str, Any]:
    """SimConfig inputs that replay ``target``'s failures with ``costs``' measured costs."""
    stall = costs.mean("stall_s")
    out = costs.mean("out_s")
    work_s = target.steps * costs.step_s
    return {
        **NEUTRAL,
        "gpus": target.replicas * target.gpus_per_replica,
        "gpus_per_host": target.gpus_per_host,
        "replicas": target.replicas,
        "steps": target.steps,
        "step_s": costs.step_s,
        "train_for": "steps",
        "step_scaling": costs.step_scaling,
        "pause_fraction": costs.pause_fraction,
        "mtbf_min": work_s / 60 / max(1, len(target.failures)),
        "failure_trace": trace_path,
        "blast_radius": "host",
        "sync_stall_min": 0.0,
        "restart_policy": "queue",
        "ft_stall_min": stall / 60,
        "replica_restart_min": max(0.0, out - stall) / 60,
        "overlap": "queue",
        "checkpoint_interval_min": 0.0,
        "checkpoint_cost_min": 0.0,
        "redundancy": 1,
        "seeds": 1,
        "seed": 0,
    }


def replay_times(failures: list[FailureCost], out_s: float) -> list[float]:
    """The failure times to replay (seconds from warm-up). The launcher fires a random kill only while
    every replica trains, so with the mean out time a random kill falls no earlier than the
    previous failed replica is back; any other failure keeps its measured time."""
    times: list[float] = []
    free = 0.0  # when the last replicated failure's replica is back
    for f in failures:
        t = max(f.t_fail_s, free) if f.random_kill else f.t_fail_s
        times.append(t)
        free = max(free, t + out_s)
    return times


def predict(run_dir: str | Path, costs_from: str | Path | None = None) -> dict[str, Any]:
    """Measure ``run_dir`` (and ``costs_from``), simulate it as ft-hsdp, and compare the ETTRs."""
    target = measure(run_dir)
    costs = measure(costs_from) if costs_from is not None else target
    if not costs.failures and target.failures:
        raise RunError(f"--costs-from: {costs.run} has no replica failure, so it measured no failure cost")
    times = replay_times(target.failures, costs.mean("out_s"))
    with tempfile.TemporaryDirectory(prefix="ftjax-sim-") as tmp:
        trace = str(Path(tmp) / "trace.csv")
        write_trace(
            trace,
            [
                Failure(t / 60, f.replica * target.gpus_per_replica, target.gpus_per_replica, False)
                for t, f in zip(times, target.failures)
            ],
        )
        inputs = sim_inputs(target, costs, trace)
        result = simulate(SimConfig.model_validate(inputs), ["ft-hsdp"])["ft-hsdp"]
    inputs["failure_trace"] = [[round(t, 3), f.replica] for t, f in zip(times, target.failures)]
    return {
        "run": target.run,
        "costs_from": costs.run,
        "measured_ettr": round(target.ettr, 4),
        "predicted_ettr": round(result.ettr, 4),
        "error": round(result.ettr - target.ettr, 4),
        "window_s": round(target.window_s, 3),
        "predicted_window_s": round(result.time_to_train_h * 3600, 3) if result.time_to_train_h else None,
        "failures": len(target.failures),
        "costs": {
            "step_s": round(costs.step_s, 5),
            "median_step_s": round(costs.median_step_s, 5),
            "mean_step_s": round(costs.mean_step_s, 5),
            "pause_fraction": round(costs.pause_fraction, 4),
            "stall_s": round(costs.mean("stall_s"), 3),
            "out_s": round(costs.mean("out_s"), 3),
            "restart_s": round(costs.mean("restart_s"), 3),
            "catchup_s": round(costs.mean("catchup_s"), 3),
            "step_scaling": [list(p) for p in costs.step_scaling],
        },
        "per_failure": [
            {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(f).items()} for f in target.failures
        ],
        "breakdown": {k: round(v, 4) for k, v in result.breakdown.items() if v},
        "ignored": target.ignored,
        "inputs": {
            k: v for k, v in inputs.items() if k not in NEUTRAL or k in ("train_for", "pause_fraction", "step_scaling")
        },
    }
