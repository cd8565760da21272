"""How each recovery strategy turns failures into stalls, lost work and reduced throughput.

Choices common to all strategies (each one changes the numbers; all are inputs, not hidden):

- **Global stalls and overlapping failures.** A failure that stalls everyone while a stall is already
  under way either *queues* its full stall after the current one (``overlap="queue"``: every
  failure costs the job its whole recovery time, which is how the FT-HSDP paper counts,
  ETTR = 1 - stall/MTBF for sync) or *restarts the stall clock* (``overlap="restart"``: the recovery
  in progress is abandoned and a new one starts, so a burst of failures costs less than the sum of
  their stalls; sync ETTR = exp(-stall/MTBF)).
- **Units out.** A failed unit (a replica for ft-hsdp, a host for reduced-degree, a group for
  redundancy) is out from the failure until ``ft_stall_min + replica_restart_min`` later: its
  restart begins when the failure is detected, concurrently with everyone's stall. A further failure
  in a unit that is already out restarts that unit's clock and does not stall the others (they have
  already excluded it). So several units can be out at once; ft-hsdp then trains at (R - out) / R,
  and at 0 when every replica is out (a whole-job restart from checkpoint is not modelled there:
  with 12 replicas it needs 12 overlapping 10-minute restarts).
- **Checkpoints.** Every strategy saves a durable checkpoint every ``checkpoint_interval_min`` of
  training, blocking for ``checkpoint_cost_min``. Only a whole-job restart (sync; redundancy when a
  shard loses every copy) rolls back to the last checkpoint and loses the work since. A failure that
  stalls everyone during a save aborts the save; the FT strategies retry it when training resumes.
  ``checkpoint_interval_min = 0`` turns checkpoints off and means the lost work is already counted
  in ``sync_stall_min`` (the reading used by the ft-hsdp-100k preset).
"""

from __future__ import annotations

import heapq
import math
from collections import deque

from ftjax.sim.model import SimConfig, due


class _Base:
    """Global stall queue and checkpoints, shared by every strategy."""

    name = ""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.counts: dict[str, int] = {}
        self._stalls: deque[tuple[float, str]] = deque()  # (end time, category), in time order
        self._interval = cfg.checkpoint_interval_min or math.inf
        self._durable = 0.0           # work saved by the last completed checkpoint
        self._next_save = self._interval
        self._saving: float | None = None  # work covered by the save in progress

    # -- the event-loop interface (ftjax.sim.model.Strategy) --

    def rates(self) -> tuple[float, tuple[tuple[str, float], ...]]:
        if self._stalls:
            return 0.0, ((self._stalls[0][1], 1.0),)
        return self._running_rates()

    def next_change(self, t: float, work: float) -> float:
        nxt = self._next_unit_change()
        if self._stalls:
            return min(nxt, self._stalls[0][0])
        useful = self._running_rates()[0]
        if useful > 0 and self._saving is None and self._next_save < math.inf:
            nxt = min(nxt, t + max(0.0, self._next_save - work) / useful)
        return nxt

    def on_change(self, t: float, work: float) -> None:
        while self._stalls and due(self._stalls[0][0], t):
            _, category = self._stalls.popleft()
            if category == "checkpoint":
                self._durable, self._saving = self._saving, None
        self._units_due(t)
        if not self._stalls and self._saving is None and work >= self._next_save - 1e-9 * max(1.0, work):
            self._next_save = work + self._interval
            if self.cfg.checkpoint_cost_min > 0:
                self._saving = work
                self._stall(t, self.cfg.checkpoint_cost_min, "checkpoint")
            else:
                self._durable = work

    def on_failure(self, t: float, host: int, work: float) -> float:
        raise NotImplementedError

    # -- for the strategies --

    def _running_rates(self) -> tuple[float, tuple[tuple[str, float], ...]]:
        raise NotImplementedError

    def _next_unit_change(self) -> float:
        return math.inf

    def _units_due(self, t: float) -> None:
        """Return repaired units whose time has come."""

    def _count(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

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
            if self._stalls and self._stalls[0][1] == "checkpoint":
                self._stalls.popleft()
            self._saving = None
            self._next_save = work  # save again as soon as training resumes

    def _rollback(self, work: float) -> float:
        """Whole-job restart from the last durable checkpoint; return the work lost."""
        self._abort_save(work)
        if self._interval == math.inf:
            return 0.0  # lost work is counted in sync_stall_min
        self._next_save = self._durable + self._interval
        return work - self._durable


class Sync(_Base):
    """Synchronous training with checkpoint/restart: every failure restarts the whole job, which
    stalls for ``sync_stall_min`` and resumes from its last checkpoint."""

    name = "sync"

    def on_failure(self, t: float, host: int, work: float) -> float:
        lost = self._rollback(work)
        self._stall(t, self.cfg.sync_stall_min, "job restart")
        return lost

    def _running_rates(self) -> tuple[float, tuple[tuple[str, float], ...]]:
        return 1.0, ()


class _UnitsOut(_Base):
    """A failure stalls everyone for ``ft_stall_min``; the failed unit is then out until repaired
    while the others keep training; an optional ``rejoin_stall_min`` stalls everyone when it rejoins."""

    def __init__(self, cfg: SimConfig, units: int) -> None:
        super().__init__(cfg)
        self.units = units
        self._back: dict[int, float] = {}      # unit -> time it rejoins
        self._heap: list[tuple[float, int]] = []  # (time, unit); stale entries are skipped

    def _unit_of(self, host: int) -> int:
        raise NotImplementedError

    def _take_out(self, t: float, unit: int) -> None:
        back = t + self.cfg.ft_stall_min + self.cfg.replica_restart_min
        self._back[unit] = back
        if back < math.inf:
            heapq.heappush(self._heap, (back, unit))

    def _next_unit_change(self) -> float:
        return self._heap[0][0] if self._heap else math.inf

    def _units_due(self, t: float) -> None:
        while self._heap and due(self._heap[0][0], t):
            back, unit = heapq.heappop(self._heap)
            if self._back.get(unit) == back:
                del self._back[unit]
                self._count("rejoins")
                self._stall(t, self.cfg.rejoin_stall_min, "rejoin stall")

    def on_failure(self, t: float, host: int, work: float) -> float:
        unit = self._unit_of(host)
        if unit in self._back:
            self._count("failures of units already out")
            self._take_out(t, unit)
            return 0.0
        return self._ride_through(t, unit, work)

    def _ride_through(self, t: float, unit: int, work: float) -> float:
        """The others go on after one failure stall, without the failed unit; no work is lost."""
        self._abort_save(work)
        self._stall(t, self.cfg.ft_stall_min, "failure stall")
        self._take_out(t, unit)
        return 0.0

    @property
    def _out(self) -> float:
        return len(self._back) / self.units

    def _running_rates(self) -> tuple[float, tuple[tuple[str, float], ...]]:
        return 1.0 - self._out, (("units out", self._out),)


class FtHsdp(_UnitsOut):
    """FT-HSDP: the unit of failure is a replica; the job trains at (R - out) / R meanwhile."""

    name = "ft-hsdp"

    def __init__(self, cfg: SimConfig) -> None:
        super().__init__(cfg, cfg.replicas)

    def _unit_of(self, host: int) -> int:
        return host // self.cfg.hosts_per_replica


class ReducedDegree(_UnitsOut):
    """Reduced-degree replicas (after NTP): a replica that lost a host keeps running at the fraction
    of its GPUs still alive, its batch rebalanced, so the job loses only the failed hosts' share. The
    reconfiguration stalls everyone like an FT-HSDP failure; the host's replacement rejoins after
    ``replica_restart_min``."""

    name = "reduced-degree"

    def __init__(self, cfg: SimConfig) -> None:
        super().__init__(cfg, cfg.hosts)

    def _unit_of(self, host: int) -> int:
        return host


class Redundancy(_UnitsOut):
    """Redundant computation (after SPARe): the replicas are N groups; shard i is computed by groups
    i, i+1, ..., i+r-1 (mod N), so every step costs r times the compute (useful rate 1/r). A failed
    group is masked (stall of everyone for ``ft_stall_min``, group out until repaired) as long as
    every shard keeps a live copy, i.e. no r cyclically consecutive groups are out. A failure that
    leaves a shard with no copy restarts the whole job like sync (``sync_stall_min``, rollback to the
    checkpoint), after which every group is fresh. A failure during that restart is handled as a sync
    failure. ``counts`` has ``masked`` and ``fatal``: with ``replica_restart_min = inf`` (no repair)
    masked/fatal is the SPARe mean number of failures masked before a shard is lost."""

    name = "redundancy"

    def __init__(self, cfg: SimConfig) -> None:
        super().__init__(cfg, cfg.replicas)
        self.r = cfg.redundancy
        self._restart_end = -math.inf

    def _unit_of(self, host: int) -> int:
        return host // self.cfg.hosts_per_replica

    def _out_run_through(self, unit: int) -> int:
        """Length of the run of consecutive out groups that ``unit`` going out would create."""
        n, run = self.units, 1
        for step in (-1, 1):
            k = 1
            while run < self.r and k < n and (unit + step * k) % n in self._back:
                run, k = run + 1, k + 1
        return run

    def on_failure(self, t: float, host: int, work: float) -> float:
        unit = self._unit_of(host)
        if t < self._restart_end:
            self._count("failures during job restart")
            self._restart_end = self._stall(t, self.cfg.sync_stall_min, "job restart")
            return 0.0
        if unit in self._back:
            self._count("failures of units already out")
            self._take_out(t, unit)
            return 0.0
        if self._out_run_through(unit) >= self.r:
            self._count("fatal")
            lost = self._rollback(work)
            self._back.clear()
            self._heap.clear()
            self._restart_end = self._stall(t, self.cfg.sync_stall_min, "job restart")
            return lost
        self._count("masked")
        return self._ride_through(t, unit, work)

    def _running_rates(self) -> tuple[float, tuple[tuple[str, float], ...]]:
        useful = 1.0 / self.r
        return useful, (("units out", self._out), ("redundant compute", 1.0 - useful - self._out))


STRATEGIES: dict[str, type[_Base]] = {s.name: s for s in (Sync, FtHsdp, ReducedDegree, Redundancy)}
