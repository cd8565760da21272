"""How each recovery strategy turns failures into stalls, lost work and reduced throughput.

The shared mechanics (stalls, whole-job restarts and their policy, checkpoints, units out, spares,
slow replicas) are in ftjax.sim.recovery; each strategy here says what one failure does to it and
what it trains at meanwhile.

Every strategy but DiLoCo all-reduces the gradients across its replicas every step; with
--link-gbps and --params a step then takes --step-s of compute plus that all-reduce
(ftjax.sim.recovery, "Communication"). DiLoCo (:class:`Diloco`) averages once per --inner-steps.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import cast

from ftjax.sim import closed_form, reduced
from ftjax.sim.config import SimConfig
from ftjax.sim.failures import Failure
from ftjax.sim.recovery import Recovery, Running


class Sync(Recovery):
    """Synchronous training with checkpoint/restart: every failure restarts the whole job, which waits
    for its hardware (a spare, or the repair), restarts, and resumes from its last checkpoint. A slow
    replica slows everyone."""

    name = "sync"

    def __init__(self, cfg: SimConfig) -> None:
        super().__init__(cfg, cfg.replicas, cfg.gpus_per_replica, rollback_mtbf=cfg.mtbf_min)

    def _apply(self, t: float, failure: Failure, work: float, during_restart: bool) -> float:
        ready = self._ready(t, failure)
        if during_restart:
            self._restart_over(t, ready)
            return 0.0
        return self._job_restart(t, work, ready)

    def _running(self) -> Running:
        return self._lockstep(1.0, (), 1.0)


class _Groups(Recovery):
    """The unit of failure is a replica (a group): a failure takes out every group its GPUs are in.
    A failure stalls everyone for --ft-stall-min unless the strategy finds it fatal (a whole-job
    restart); the failed groups are out until back."""

    def __init__(self, cfg: SimConfig, rollback_mtbf: float) -> None:
        super().__init__(cfg, cfg.replicas, cfg.gpus_per_replica, rollback_mtbf)
        self._ready_at: dict[object, float] = {}

    masked = "ridden through"  # the count of failures the strategy survives without a restart

    def _fatal(self, new_units: list[int], out: set[object]) -> bool:
        return False

    def _apply(self, t: float, failure: Failure, work: float, during_restart: bool) -> float:
        ready = self._ready(t, failure)
        g = self.unit_gpus
        units = list(range(failure.first_gpu // g, (failure.first_gpu + failure.gpus - 1) // g + 1))
        new = [u for u in units if u not in self._back]
        for u in units:
            self._ready_at[u] = ready
            self._take_out(t, u, ready)
        if not new:
            self._count("failures of units already out")
            return 0.0
        # Units the restart under way brings back are not out for the fatal rule.
        out = {u for u, back in self._back.items() if not (during_restart and back <= self._restart_end)}
        if self._fatal(new, out):
            self._count("fatal")
            if during_restart:
                self._restart_over(t, ready)
                return 0.0
            return self._job_restart(t, work, ready)
        self._count(self.masked)
        if not during_restart:  # else the groups are out when the job comes back
            self._failure_stall(t, work)
        return 0.0

    def _after_job_restart(self, end: float) -> None:
        # The restart brings back every group whose hardware is there by its end.
        for unit, back in list(self._back.items()):
            if back > end and self._ready_at.get(unit, -math.inf) <= end:
                self._back[unit] = end
                heapq.heappush(self._heap, (end, unit))


class FtHsdp(_Groups):
    """FT-HSDP: the unit of failure is a replica; the job trains at (R - out) / R meanwhile, and at 0
    when every replica is out (a whole-job restart from checkpoint is not modelled). A replica slow
    for --straggler-detect-min is left out of the quorum (it catches up when it is fast again); until
    then everyone waits for it."""

    name = "ft-hsdp"

    def __init__(self, cfg: SimConfig) -> None:
        super().__init__(cfg, rollback_mtbf=math.inf)

    def _running(self) -> Running:
        out = len(self._back) / self.units
        # A constant global batch trains every step whole, at R/k the step time: a step's progress is
        # its tokens' (the shared-machine --step-scaling does not apply: the survivors do all the work)
        steps = self._steps_whole()
        if not self._slow:
            live = 1.0 - out
            return (
                live,
                (("units out", out),),
                ((1.0 / self.cfg.step_ratio(live) if live > 0 else 0.0) if steps else live),
            )
        left_out = len(self._slow_units(detected=True)) / self.units
        live = 1.0 - out - left_out
        s = self.cfg.straggler_slowdown if self._slow_units(detected=False) else 1.0
        useful = live / s
        losses = (("units out", out), ("straggler", left_out + live - useful))
        return useful, losses, ((1.0 / (s * self.cfg.step_ratio(live)) if live > 0 else 0.0) if steps else useful)

    def _steps_whole(self) -> bool:
        """Whether a step counts whole however many replicas took part (see --global-batch)."""
        return self.cfg.train_for == "steps" and self.cfg.global_batch == "elastic"


class Diloco(FtHsdp):
    """DiLoCo (ftjax's ft.sync diloco): each replica takes --inner-steps (H) steps alone, then the
    replicas average their parameter deltas (one all-reduce of a gradient's bytes), so a step costs
    1/H of an all-reduce on average. Failures as for ft-hsdp (a stall of everyone, the replica out
    until back), and a failed replica also loses its inner steps since its last average, or since it
    rejoined if later: its 1/R share of the work of those steps (up to H steps of one replica),
    trained again (--train-for tokens) or lost to the model (--train-for steps, see data_trained; the
    survivors' steps count). The job's steps are counted as they are taken (a stall takes none, a
    step with replicas out is a whole step), so the rounds keep their H steps whatever is out.
    --global-batch is elastic whatever it says: nobody computes another replica's batches between two
    averages."""

    name = "diloco"
    fragments = 1

    def __init__(self, cfg: SimConfig) -> None:
        super().__init__(cfg)
        self._steps = 0.0  # steps the job has taken, up to self._t
        self._t = 0.0
        self._step_rate = 0.0  # steps per minute until the next event (set by next_change)
        self._joined: dict[object, float] = {}  # replica -> the job's steps when it last rejoined

    def sync_plan(self) -> tuple[float, float]:
        return 1.0, float(self.cfg.inner_steps)

    def _steps_whole(self) -> bool:
        return self.cfg.train_for == "steps"

    def _advance(self, t: float) -> None:
        self._steps += self._step_rate * (t - self._t)
        self._t = t

    def next_change(self, t: float, work: float, progress: float) -> float:
        # Called before every stretch of constant rates, with its progress: work per minute, which
        # is steps x a step's work when steps count whole, else only the live replicas' share of it.
        self._advance(t)
        step = self.cfg.step_s / 60.0
        live = 1.0 - (len(self._back) + len(self._slow_units(detected=True))) / self.units
        self._step_rate = progress / step / (1.0 if self._steps_whole() else live) if progress > 0 else 0.0
        return super().next_change(t, work, progress)

    def on_change(self, t: float, work: float) -> None:
        self._advance(t)
        super().on_change(t, work)

    def _unit_back(self, unit: object) -> None:
        self._joined[unit] = self._steps

    def _apply(self, t: float, failure: Failure, work: float, during_restart: bool) -> float:
        self._advance(t)
        g = self.unit_gpus
        units = range(failure.first_gpu // g, (failure.first_gpu + failure.gpus - 1) // g + 1)
        # A replica already out has no inner work to lose.
        ages = [self.inner_age(self._steps, self._joined.get(u, 0.0)) for u in units if u not in self._back]
        super()._apply(t, failure, work, during_restart)
        lost = min(work, sum(ages) / self.units * self.cfg.step_s / 60.0)
        if self._steps_whole():
            self.dropped += lost
            return 0.0
        return lost

    def inner_age(self, steps: float, since: float = 0.0) -> float:
        """Steps of a replica's own not yet averaged, ``steps`` steps into the job, the replica in
        since step ``since``: for F fragments averaged in turn every H/F steps, the mean over the
        fragments of the steps since each was averaged (the newest p steps ago, the others p + H/F,
        p + 2H/F, ...), none of them before ``since``."""
        every = self.cfg.inner_steps / self.fragments
        p = steps % every
        if every - p < 1e-9 * max(1.0, steps):  # float noise just short of a round's end
            p = 0.0
        return sum(min(steps - since, p + j * every) for j in range(self.fragments)) / self.fragments


class StreamingDiloco(Diloco):
    """Streaming DiLoCo (ft.sync streaming_diloco): the parameters in --fragments (F) parts, one
    averaged every H/F steps. The same bytes per H steps as DiLoCo, but a round moves 1/F of them (the
    peak a link must carry, ftjax.sim.run.StrategyResult.comm), and a failed replica loses the mean
    age of its fragments: the steps since each fragment's last average, H/2 on average as for DiLoCo.
    With --fragment-sync-delay tau a round's all-reduce runs while its last tau steps compute (ftjax's
    overlap): only what exceeds tau x --step-s of it is waited for (`comm_s`)."""

    name = "streaming-diloco"

    def __init__(self, cfg: SimConfig) -> None:
        super().__init__(cfg)
        self.fragments = cfg.fragments

    def sync_plan(self) -> tuple[float, float]:
        return 1.0 / self.cfg.fragments, self.cfg.inner_steps / self.cfg.fragments

    def comm_s(self) -> float:
        """Seconds waited for communication per step: a round's all-reduce less the tau steps of
        compute it overlaps, over the round's H/F steps."""
        share, every = self.sync_plan()
        hidden = self.cfg.fragment_sync_delay * self.cfg.step_s
        return max(0.0, self.cfg.allreduce_s() * share - hidden) / every


def _rollback_mtbf_shards(cfg: SimConfig) -> float:
    """Mean time between fatal failures of a sharded strategy without repair (a lower bound with
    repair): one failure in (1 + masked) is fatal."""
    return cfg.mtbf_min * (1.0 + closed_form.masked_failures_exact(cfg.replicas, cfg.redundancy))


class _Shards(_Groups):
    """N groups; shard i is held by groups i, i+1, ..., i+r-1 (mod N). A failure is masked as long as
    every shard keeps a live copy (no r cyclically consecutive groups out); one that leaves a shard
    with no copy restarts the whole job from its checkpoint (after which every group whose hardware
    is there is back). ``counts`` has ``masked`` and ``fatal``: with --replica-restart-min inf (no
    repair until a restart) masked/fatal is the mean number of failures masked before a shard is
    lost. A slow group's shards are taken from their other copies (the group counts as out)."""

    def __init__(self, cfg: SimConfig) -> None:
        super().__init__(cfg, rollback_mtbf=_rollback_mtbf_shards(cfg))
        self.r = cfg.redundancy

    masked = "masked"

    def _fatal(self, new_units: list[int], out: set[object]) -> bool:
        n = self.units
        for unit in new_units:
            run = 1
            for step in (-1, 1):
                k = 1
                while run < self.r and k < n and (unit + step * k) % n in out:
                    run, k = run + 1, k + 1
            if run >= self.r:
                return True
        return False

    def _out_and_slow(self) -> tuple[float, float]:
        return len(self._back) / self.units, len(self._slow_units()) / self.units


class Replication(_Shards):
    """Plain replication, the baseline SPARe compares against: every shard is computed r times every
    step, so the job trains at 1/r of its GPUs' throughput whatever fails."""

    name = "replication"

    def _running(self) -> Running:
        out, slow = self._out_and_slow()
        useful = min(1.0 / self.r, 1.0 - out - slow)
        losses = (("units out", out), ("straggler", slow), ("redundant compute", 1.0 - useful - out - slow))
        return useful, losses, useful


class Spare(_Shards):
    """SPARe (arXiv 2603.00357): shards stacked on r groups as for replication, but each group
    computes its own shard first and the all-reduce starts as soon as every shard has one copy
    (early all-reduce). With k groups out the live groups compute the N shards in
    ceil(N / (N - k)) rounds: the job trains at 1 / ceil(N / (N - k)) (1 with no group out, 1/2 with
    up to N/2 out), whatever r is."""

    name = "spare"

    def _running(self) -> Running:
        out, slow = self._out_and_slow()
        n, k = self.units, len(self._back) + len(self._slow_units())
        useful = 1.0 / math.ceil(n / (n - k)) if k < n else 0.0
        losses = (("units out", out), ("straggler", slow), ("redundant compute", 1.0 - useful - out - slow))
        return useful, losses, useful


class ReducedDegree(Recovery):
    """Reduced-degree replicas (after NTP, arXiv 2504.06095): a replica that lost GPUs keeps running
    on those it has left, at ``--reduced-curve`` of a full replica's throughput (boosted by
    --power-boost), its batch share cut to match; with --packing the failed GPUs are gathered into as
    few replicas as possible (ftjax.sim.reduced). With ``--reduced-recovery job-restart`` (NTP) every
    failure restarts the whole job from its checkpoint into the new configuration; a software
    failure is then fixed by the restart and a hardware one leaves its domain out until repaired.
    With ``ft-stall`` a failure stalls everyone like an ft-hsdp failure and its domain is out until
    restarted. A slow replica slows everyone (the replicas step together)."""

    name = "reduced-degree"

    def __init__(self, cfg: SimConfig) -> None:
        restarts = cfg.reduced_recovery == "job-restart"
        super().__init__(cfg, cfg.hosts, cfg.blast_gpus, rollback_mtbf=cfg.mtbf_min if restarts else math.inf)
        self._missing: dict[int, int] = {}  # replica -> failed GPUs
        self._counted: set[object] = set()

    def _apply(self, t: float, failure: Failure, work: float, during_restart: bool) -> float:
        restarts = self.cfg.reduced_recovery == "job-restart"
        unit = (failure.first_gpu, failure.gpus)
        if restarts and not failure.hardware:  # the restart fixes it
            if during_restart:
                self._restart_over(t, t)
                return 0.0
            return self._job_restart(t, work, t)
        ready = self._ready(t, failure)
        already = unit in self._back
        self._take_out(t, unit, ready)
        if already:
            self._count("failures of units already out")
            return 0.0
        if restarts:
            if during_restart:
                self._restart_over(t, t)
                return 0.0
            return self._job_restart(t, work, t)  # it restarts without the failed GPUs
        if not during_restart:
            self._failure_stall(t, work)
        return 0.0

    def _spans(self, unit: object) -> list[tuple[int, int]]:
        first, gpus = cast("tuple[int, int]", unit)  # (this strategy's units: (first GPU, GPU count))
        g = self.cfg.gpus_per_replica
        out = []
        while gpus > 0:
            r, offset = divmod(first, g)
            take = min(gpus, g - offset)
            out.append((r, take))
            first, gpus = first + take, gpus - take
        return out

    def _unit_out(self, unit: object) -> None:
        if unit not in self._counted:
            self._counted.add(unit)
            for r, n in self._spans(unit):
                self._missing[r] = self._missing.get(r, 0) + n

    def _unit_back(self, unit: object) -> None:
        self._counted.discard(unit)
        for r, n in self._spans(unit):
            left = self._missing[r] - n
            if left > 0:
                self._missing[r] = left
            else:
                del self._missing[r]

    def _running(self) -> Running:
        c = self.cfg
        useful, out, degraded = reduced.job_rates(
            self._missing, c.gpus_per_replica, c.replicas, c.reduced_curve, c.power_boost, c.min_degree, c.packing
        )
        progress = (1.0 if useful > 0 else 0.0) if c.train_for == "steps" else useful
        return self._lockstep(useful, (("units out", out), ("degraded", degraded)), progress)


STRATEGIES: dict[str, Callable[[SimConfig], Recovery]] = {
    s.name: s for s in (Sync, FtHsdp, ReducedDegree, Replication, Spare, Diloco, StreamingDiloco)
}
