"""The mechanics every strategy shares: global stalls, whole-job restarts, checkpoints, units out,
hardware repair and spares, and slow replicas. Each choice is an input (ftjax.sim.config):

- **Global stalls** (FT failure stalls, rejoin stalls, checkpoint saves) stop everyone. A failure
  that stalls everyone while such a stall is under way either *queues* its full stall after the
  current one (``--overlap queue``: every failure costs its whole stall, the FT-HSDP paper's
  accounting) or *restarts the stall clock* (``--overlap restart``).
- **Whole-job restarts** (sync after any failure, reduced-degree after any failure with
  ``--reduced-recovery job-restart``, redundancy and spare when a shard loses every copy) roll back
  to the last durable checkpoint, supersede any stall under way, wait for hardware if the failed
  hosts have no spare (``repair wait``), then take ``--sync-stall-min + --init-min``. A failure during
  one (``--restart-policy``): **absorb** (the restart's fresh allocation replaces what failed; it
  costs nothing), **queue** (it is handled when the restart ends, as if it happened then: for sync
  another full restart, an M/D/1 busy period that never ends once restart x rate >= 1), or
  **restart** (it is handled at once: a unit it takes down is out when the job comes back; if it is
  fatal by the strategy's rule, the restart starts over, which never ends when a restart is much
  longer than the MTBF).
- **Units out.** A failed unit (replica, failure domain, group) is out from the failure until
  ``max(failure + --ft-stall-min, hardware ready) + unit restart`` (its restart begins when the
  failure is detected, concurrently with everyone's stall; the unit restart is
  ``--replica-restart-min`` plus communicator init at the unit's size). A further failure of a unit
  that is out extends its time out and does not stall the others.
- **Hardware.** A hardware failure needs each failed host replaced: by a spare if the pool
  (``--spare-hosts``) has one (the failed host, once repaired ``--repair-min`` later, joins the
  pool), else by the first spare back from repair or its own repair, whichever comes first.
- **Checkpoints.** Every strategy saves every ``interval`` minutes of training (given, or chosen by
  ftjax.sim.checkpoints from its mean time between rollbacks), blocking ``--checkpoint-cost-min``. A
  failure that stalls everyone aborts a save in progress; it is retried when training resumes.
- **Slow replicas** (``--straggler-*``): a strategy says what a slow replica costs it.
- **Communication** (``--link-gbps``, ``--params``): while training, a step takes its compute
  (``--step-s``) plus the strategy's share of a ring all-reduce over the R replicas
  (:meth:`Recovery.comm_s`: all of it every step, 1/H of it for DiLoCo, whose rounds move
  1/F of the bytes every H/F steps when streaming), so useful and progress rates
  are scaled by compute / (compute + communication) and the rest is charged to ``communication``.
  The ring is always over all R replicas (with k < R in, 2 (k - 1) / k is a little less: an upper
  bound), and the all-reduce is not overlapped with compute, but for streaming DiLoCo's with
  ``--fragment-sync-delay`` tau: hidden up to tau steps of compute a round.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

from ftjax.sim import checkpoints
from ftjax.sim.config import SimConfig
from ftjax.sim.failures import Failure, Straggle
from ftjax.sim.model import Rates, due

Running = tuple[float, tuple[tuple[str, float], ...], float]  # (useful, losses, progress) while running


class Recovery:
    """Base of every strategy (ftjax.sim.strategies): the event-loop interface and the mechanics."""

    name = ""

    def __init__(self, cfg: SimConfig, units: int, unit_gpus: int, rollback_mtbf: float) -> None:
        self.cfg = cfg
        self.units, self.unit_gpus = units, unit_gpus
        self.counts: dict[str, int] = {}
        self._stalls: deque[tuple[float, str]] = deque()  # (end time, category), in time order
        self._restart_end = -math.inf  # end of the whole-job restart under way, if any
        self._queued: deque[Failure] = deque()  # failures waiting for the restart to end (policy queue)
        # checkpoints
        self.interval = checkpoints.interval(cfg.checkpoint_interval_min, cfg.checkpoint_cost_min, rollback_mtbf)
        self._durable = 0.0  # work saved by the last completed checkpoint
        self._next_save = self.interval
        self._saving: float | None = None  # work covered by the save in progress
        # units out
        self._back: dict[object, float] = {}  # unit -> time it rejoins
        self._heap: list[tuple[float, object]] = []  # (time, unit); stale entries are skipped
        # spares: hosts in the pool now, and times repaired hosts rejoin it
        self._spares = cfg.spare_hosts
        self._returns: list[float] = []
        # slow replicas: unit -> (start of its slow stretch, its end, slow for --straggler-detect-min)
        self._slow: dict[int, tuple[float, float, bool]] = {}
        self.dropped = 0.0  # see ftjax.sim.model.Strategy
        comm = self.comm_s()
        self._comm_share = comm / (cfg.step_s + comm)  # of a running step's time

    def sync_plan(self) -> tuple[float, float]:
        """(share of a gradient's bytes averaged at a time, steps between two averages): all of them
        every step."""
        return 1.0, 1.0

    def comm_s(self) -> float:
        """Seconds of inter-replica communication per step, on average."""
        share, every = self.sync_plan()
        return self.cfg.allreduce_s() * share / every

    # -- the event-loop interface (ftjax.sim.model.Strategy) --

    def rates(self) -> Rates:
        if self._stalls:
            return Rates(0.0, ((self._stalls[0][1], 1.0),), 0.0, False)
        useful, losses, progress = self._running()
        pause = self.cfg.pause_fraction
        if pause and useful > 0 and not self._back:  # (with units out, see --pause-fraction)
            losses = (*losses, ("pauses", useful * pause))
            useful, progress = useful * (1 - pause), progress * (1 - pause)
        if self._comm_share and useful > 0:
            # After the pauses: --pause-fraction stays a fraction of wall time.
            c = self._comm_share
            useful, losses, progress = useful * (1 - c), (*losses, ("communication", useful * c)), progress * (1 - c)
        return Rates(useful, losses, progress, True)

    def next_change(self, t: float, work: float, progress: float) -> float:
        nxt = self._heap[0][0] if self._heap else math.inf
        if self._slow:
            nxt = min(nxt, self._next_slow_change())
        if self._stalls:
            return min(nxt, self._stalls[0][0])
        if progress > 0 and self._saving is None and self._next_save < math.inf:
            nxt = min(nxt, t + max(0.0, self._next_save - work) / progress)
        return nxt

    def on_change(self, t: float, work: float) -> None:
        while self._stalls and due(self._stalls[0][0], t):
            _, category = self._stalls.popleft()
            if category == "checkpoint":
                assert self._saving is not None  # (a checkpoint stall is queued with its save)
                self._durable, self._saving = self._saving, None
        self._units_due(t)
        if self._slow:
            self._slow_due(t)
        # Queued failures, as if they happened now (nothing trained since the restart: nothing lost),
        # until one restarts the job again; the rest wait for that restart.
        while self._queued and not self._restarting(t):
            self._apply(t, self._queued.popleft(), work, during_restart=False)
        if not self._stalls and self._saving is None and work >= self._next_save - 1e-9 * max(1.0, work):
            self._next_save = work + self.interval
            if self.cfg.checkpoint_cost_min > 0:
                self._saving = work
                self._stall(t, self.cfg.checkpoint_cost_min, "checkpoint")
            else:
                self._durable = work

    def on_failure(self, t: float, failure: Failure, work: float) -> float:
        self._count("hardware failures" if failure.hardware else "software failures")
        return self._route(t, failure, work)

    def _route(self, t: float, failure: Failure, work: float) -> float:
        """A failure during a whole-job restart goes by --restart-policy; any other to the strategy."""
        if self._restarting(t):
            policy = self.cfg.restart_policy
            if policy == "absorb":
                self._count("absorbed by a restart")
                return 0.0
            if policy == "queue":
                self._count("queued behind a restart")
                self._queued.append(failure)
                return 0.0
            self._count("during a restart")
            return self._apply(t, failure, work, during_restart=True)
        return self._apply(t, failure, work, during_restart=False)

    def on_straggle(self, t: float, episode: Straggle) -> None:
        self._count("slow episodes")
        start, end, seen = self._slow.get(episode.unit, (t, t, self.cfg.straggler_detect_min == 0))
        self._slow[episode.unit] = (start, max(end, t + self.cfg.straggler_min), seen)

    # -- for the strategies --

    def _apply(self, t: float, failure: Failure, work: float, during_restart: bool) -> float:
        """What ``failure`` does to this strategy; returns the work lost."""
        raise NotImplementedError

    def _running(self) -> Running:
        """(useful, losses, progress) while no global stall is under way."""
        raise NotImplementedError

    def _count(self, key: str, n: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n

    def _restarting(self, t: float) -> bool:
        return t < self._restart_end and not due(self._restart_end, t)

    def _stall(self, t: float, length: float, category: str) -> float:
        """Stall everyone for ``length`` from ``t`` (see the module doc for overlaps); return its end."""
        if length <= 0:
            return t
        if not self._stalls:
            end = t + length
        elif self.cfg.overlap == "queue":
            end = self._stalls[-1][0] + length
        else:
            end = max(t + length, self._stalls[-1][0])
            if end == self._stalls[-1][0]:
                return end
        self._stalls.append((end, category))
        return end

    def _abort_save(self, work: float) -> None:
        """A failure that stalls everyone interrupts the checkpoint being saved (if any)."""
        if self._saving is not None:
            self._stalls = deque(s for s in self._stalls if s[1] != "checkpoint")
            self._saving = None
            self._next_save = work  # save again as soon as training resumes

    def _failure_stall(self, t: float, work: float) -> None:
        """One failure stalls everyone for --ft-stall-min (an interruption)."""
        self._count("interruptions")
        self._abort_save(work)
        self._stall(t, self.cfg.ft_stall_min, "failure stall")

    def _job_restart(self, t: float, work: float, ready: float) -> float:
        """Restart the whole job from its last checkpoint once the hardware is ``ready``; return the
        work lost."""
        self._count("interruptions")
        self._count("job restarts")
        lost = self._rollback(work)
        self._stalls.clear()  # the restart supersedes any stall or save under way
        begin = max(t, ready)
        if begin > t:
            self._count("restarts waiting for repair")
            self._stalls.append((begin, "repair wait"))
        self._restart_end = begin + self.cfg.job_restart_min()
        if self._restart_end > begin:
            self._stalls.append((self._restart_end, "job restart"))
        self._after_job_restart(self._restart_end)
        return lost

    def _restart_over(self, t: float, ready: float) -> None:
        """A fatal failure during a restart (policy restart): the restart starts over from now."""
        self._count("restarts started over")
        end = max(t, ready) + self.cfg.job_restart_min()
        if end <= self._restart_end:
            return
        if max(t, ready) > t and (not self._stalls or self._stalls[-1][1] != "repair wait"):
            self._stalls.append((max(t, ready), "repair wait"))
        if self._stalls and self._stalls[-1][1] == "job restart":
            self._stalls.pop()
        self._stalls.append((end, "job restart"))
        self._restart_end = end
        self._after_job_restart(end)

    def _after_job_restart(self, end: float) -> None:
        """What a whole-job restart ending at ``end`` does to the units out (strategy-specific)."""

    def _rollback(self, work: float) -> float:
        """Whole-job restart from the last durable checkpoint; return the work lost."""
        self._abort_save(work)
        if self.interval == math.inf:
            return 0.0  # no checkpoints: lost work is counted in sync_stall_min
        self._next_save = self._durable + self.interval
        return work - self._durable

    # hardware

    def _hosts(self, failure: Failure) -> int:
        per = self.cfg.gpus_per_host
        return (failure.first_gpu + failure.gpus - 1) // per - failure.first_gpu // per + 1

    def _ready(self, t: float, failure: Failure) -> float:
        """When the failed hosts are replaced (t for a software failure)."""
        if not failure.hardware:
            return t
        hosts = self._hosts(failure)
        if math.isinf(self._spares):
            self._count("spare swaps", hosts)
            return t
        while self._returns and self._returns[0] <= t:
            heapq.heappop(self._returns)
            self._spares += 1
        ready, repaired = t, t + self.cfg.repair_min
        for _ in range(hosts):
            if self._spares >= 1:
                self._spares -= 1
                self._count("spare swaps")
                heapq.heappush(self._returns, repaired)
            elif self._returns and self._returns[0] < repaired:
                ready = max(ready, heapq.heappop(self._returns))  # the first spare back from repair
                self._count("waits for a spare")
                heapq.heappush(self._returns, repaired)
            else:
                ready = repaired  # repaired in place
                self._count("waits for a repair")
        return ready

    # units out

    def _take_out(self, t: float, unit: object, ready: float) -> None:
        back = max(t + self.cfg.ft_stall_min, ready) + self.cfg.unit_restart_min(self.unit_gpus)
        back = max(back, self._back.get(unit, -math.inf))
        self._back[unit] = back
        if back < math.inf:
            heapq.heappush(self._heap, (back, unit))
        self._unit_out(unit)

    def _unit_out(self, unit: object) -> None:
        """Hook: ``unit`` has just gone out (or had its time out extended)."""

    def _unit_back(self, unit: object) -> None:
        """Hook: ``unit`` has just rejoined."""

    def _units_due(self, t: float) -> None:
        while self._heap and due(self._heap[0][0], t):
            back, unit = heapq.heappop(self._heap)
            if self._back.get(unit) == back:
                del self._back[unit]
                self._unit_back(unit)
                self._count("rejoins")
                self._stall(t, self.cfg.rejoin_stall_min, "rejoin stall")

    # slow replicas

    def _next_slow_change(self) -> float:
        if not self._slow:
            return math.inf
        detect = self.cfg.straggler_detect_min
        return min(min(end, math.inf if seen else start + detect) for start, end, seen in self._slow.values())

    def _slow_due(self, t: float) -> None:
        for unit, (start, end, seen) in list(self._slow.items()):
            if due(end, t):
                del self._slow[unit]
            elif not seen and due(start + self.cfg.straggler_detect_min, t):
                self._slow[unit] = (start, end, True)
                self._count("slow replicas left out")

    def _slow_units(self, detected: bool | None = None) -> list[int]:
        """Slow units that are not out; ``detected``: only those slow for --straggler-detect-min
        already (True) or not yet (False)."""
        if not self._slow:
            return []
        return [
            u
            for u, (_, _, seen) in self._slow.items()
            if u not in self._back and (detected is None or seen == detected)
        ]

    def _lockstep(self, useful: float, losses: tuple[tuple[str, float], ...], progress: float) -> Running:
        """Everyone steps together: a slow replica slows the whole job (sync, reduced-degree)."""
        if not self._slow_units():
            return useful, losses, progress
        s = self.cfg.straggler_slowdown
        return useful / s, (*losses, ("straggler", useful * (1 - 1 / s))), progress / s
