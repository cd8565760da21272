"""A replica's lifecycle: its phases, the one rule that moves it from phase to phase, and the fold
of its records into time segments.

The records of replica R are its own (`replica-R/metrics.jsonl`: event and step records) and the
launcher's events about it (`launcher.jsonl` records with `replica` == R), in time order. The
launcher's live view folds them one at a time as the supervisor tails them and logs its decisions
(`ftjax.launch.supervisor`); the run's summary and `timeline.png` fold the run directory afterwards
(`ftjax.runs.summary`). Both call `Lifecycle.feed`, so what the terminal showed and what the
summary reports are one story.

Two kinds of transition, both pure:

- `next_phase(phase, record)`: what one record does (the table in its docstring);
- the clock: a `TRAINING` replica whose gap since its last own step breaks the stall rule
  (`is_stall`) is `STALLED` for that whole gap. A record cannot say so (a stalled replica writes
  nothing), hence `Lifecycle.phase_at(now, ...)` live and `Lifecycle.segments(...)` afterwards.
  After its own step of the job's last step a replica only finishes (it serves peers that still
  catch up, writes its summary, exits): that wait is no stall, it stays TRAINING until `replica_done`.
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Iterable
from dataclasses import dataclass

from ftjax.runs.events import EVENT, TIME, LauncherEvent, ReplicaEvent, StepField, is_own_step, is_step


class Phase(enum.Enum):
    """Where a replica is. The values are the names summary.json and the views use."""

    STARTING = "starting"  # its process runs, no step with its own batch yet (imports, compiles, joins, inits)
    TRAINING = "training"  # it commits steps with its own batch
    STALLED = "stalled"  # training, but the current gap between its own steps breaks the stall rule
    CATCHING_UP = "catching up"  # behind or without state: it fetches a snapshot and relays zeros
    DOWN = "down"  # dead; the launcher restarts it
    DONE = "done"  # finished: every process exited 0
    GONE = "gone"  # dead for good: not restarted, or abandoned (it could only start the job over)

    @property
    def alive(self) -> bool:
        return self in _ALIVE


_ALIVE = frozenset({Phase.STARTING, Phase.TRAINING, Phase.STALLED, Phase.CATCHING_UP})

# One colour per phase, keyed by the phase names: RUN/timeline.png (ftjax/launch/plots.py) and the
# coordinator's status page draw with the same ones.
PHASE_COLORS = {
    Phase.STARTING.value: "#9ecae1",
    Phase.TRAINING.value: "#31a354",
    Phase.STALLED.value: "#fd8d3c",
    Phase.CATCHING_UP.value: "#756bb1",
    Phase.DOWN.value: "#de2d26",
    Phase.DONE.value: "#d9d9d9",
    Phase.GONE.value: "#636363",
}


# --- the stall rule -------------------------------------------------------------------------------
# A gap between two own steps of a replica is a stall when it is longer than STALL_FACTOR median
# steps. Why 2 x median and no absolute slack: a gap that long lost at least one whole step of time
# to waiting (for a dead peer's FTAR timeout, a quorum, the coordinator), while ordinary jitter
# stays well inside it; the ETTR credits a stalled gap with one median step, so a gap it calls
# training costs at most one step. Relative to the step time, the rule holds for 10 ms steps as
# for 10 s ones (the old live rule's + 0.5 s hid every stall of a fast job). The live view needs no
# slack either: it calls a gap stalled once the gap has grown past the threshold, and the gap is at
# least that long when it ends, so the summary calls it stalled too.
STALL_FACTOR = 2.0


def is_stall(gap_s: float, median_step_s: float | None) -> bool:
    """THE stall rule (see above). No median (no gap measured yet): no stall."""
    return median_step_s is not None and median_step_s > 0 and gap_s > STALL_FACTOR * median_step_s


# --- transitions ----------------------------------------------------------------------------------
class Signal(enum.Enum):
    """What one record says about the lifecycle (`signal`)."""

    STARTED = "started"  # replica_started (launcher), start (its process)
    OWN_STEP = "own step"  # a step it committed with its own batch
    RELAY_STEP = "relay step"  # a step it only relayed zeros in (healing), or did not commit
    BEHIND = "behind"  # catchup_started, stale_state
    INSTALLED = "installed"  # catchup_done: the job's state is installed (no own step yet)
    DIED = "died"  # replica_down
    FINISHED = "finished"  # replica_done
    LEFT = "left"  # not_restarted, abandoned


_EVENT_SIGNALS: dict[str, Signal] = {
    LauncherEvent.REPLICA_STARTED: Signal.STARTED,
    ReplicaEvent.START: Signal.STARTED,
    ReplicaEvent.CATCHUP_STARTED: Signal.BEHIND,
    ReplicaEvent.STALE_STATE: Signal.BEHIND,
    ReplicaEvent.CATCHUP_DONE: Signal.INSTALLED,
    LauncherEvent.REPLICA_DOWN: Signal.DIED,
    LauncherEvent.REPLICA_DONE: Signal.FINISHED,
    LauncherEvent.NOT_RESTARTED: Signal.LEFT,
    LauncherEvent.ABANDONED: Signal.LEFT,
}


def signal(record: dict) -> Signal | None:
    """The record's signal; None for every other record (it changes no phase: snapshot_offered,
    commit_failure, a fault, rejoined (a copy of catchup_done), ...)."""
    if is_step(record):
        return Signal.OWN_STEP if is_own_step(record) else Signal.RELAY_STEP
    return _EVENT_SIGNALS.get(record.get(EVENT, ""))


# The launcher's verdicts hold from any phase; a replica's own signals move a live replica only (a
# record read after the launcher declared it down, done or gone changes nothing).
_VERDICTS = {
    Signal.STARTED: Phase.STARTING,
    Signal.DIED: Phase.DOWN,
    Signal.FINISHED: Phase.DONE,
    Signal.LEFT: Phase.GONE,
}
_WHILE_ALIVE = {Signal.OWN_STEP: Phase.TRAINING, Signal.RELAY_STEP: Phase.CATCHING_UP, Signal.BEHIND: Phase.CATCHING_UP}


def next_phase(phase: Phase, record: dict) -> Phase:
    """The phase after `record`. The whole table (any: every phase; alive: STARTING, TRAINING,
    STALLED, CATCHING_UP):

    =====================================  =============  ===============
    record (signal)                        from           to
    =====================================  =============  ===============
    replica_started, start (STARTED)       any            STARTING
    replica_down (DIED)                    any            DOWN
    replica_done (FINISHED)                any            DONE
    not_restarted, abandoned (LEFT)        any            GONE
    own committed step (OWN_STEP)          alive          TRAINING
    healing step (RELAY_STEP)              alive          CATCHING_UP
    catchup_started, stale_state (BEHIND)  alive          CATCHING_UP
    catchup_done (INSTALLED)               alive          unchanged: catching up ends with the first own step
    any other record (None)                any            unchanged
    OWN/RELAY_STEP, BEHIND, INSTALLED      DOWN/DONE/GONE unchanged
    =====================================  =============  ===============

    STALLED is entered by the clock only (`is_stall`); it leaves like TRAINING."""
    sig = signal(record)
    if sig in _VERDICTS:
        return _VERDICTS[sig]
    if sig in _WHILE_ALIVE and phase.alive:
        return _WHILE_ALIVE[sig]
    return phase


def _applied(record: dict) -> bool:
    return bool(record.get(StepField.COMMITTED))


# --- the fold -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Segment:
    """A span of time a replica spent in one phase."""

    start: float
    end: float
    phase: Phase


_PHASES = list(Phase)


class Lifecycle:
    """One replica's lifecycle, fed its records one at a time in time order.

    It keeps the boundaries only: the time of each phase change and of each own step while
    training (9 bytes each), so a stall is judged when segments are asked for, with the median
    step time known then. `steps`: the job's step count (None: unknown, every gap is judged)."""

    def __init__(self, steps: int | None = None) -> None:
        self.steps = steps
        self.phase = Phase.STARTING  # after the last record (never STALLED: that is the clock's, `phase_at`)
        self.installed = False  # CATCHING_UP with the job's state installed (catchup_done), no own step yet
        self.finished_at: float | None = None  # its own step of the job's last step: no stall after it
        self._times = array("d")  # boundary i: phase _PHASES[_codes[i]] from _times[i] on
        self._codes = bytearray()

    def feed(self, record: dict) -> Phase:
        """Take the next record; the phase after it."""
        new = next_phase(self.phase, record)
        sig = signal(record)
        if sig is Signal.INSTALLED and new is Phase.CATCHING_UP:
            self.installed = True
        elif new is not self.phase or sig is Signal.BEHIND or (sig is Signal.RELAY_STEP and not _applied(record)):
            # (a relay step the replica committed applied the update to the state it installed: it
            # still holds the job's state; seen when a replica rejoins at the job's next-to-last step)
            self.installed = False
        t = float(record[TIME])
        if not self._times or new is not self.phase or (new is Phase.TRAINING and sig is Signal.OWN_STEP):
            self._times.append(t)
            self._codes.append(_PHASES.index(new))
        if sig is Signal.OWN_STEP and self.steps is not None and record[StepField.STEP] >= self.steps:
            self.finished_at = t
        self.phase = new
        return new

    def _stalled(self, start: float, end: float, median_step_s: float | None) -> bool:
        """Whether a gap of TRAINING from `start` to `end` is a stall."""
        return (self.finished_at is None or start < self.finished_at) and is_stall(end - start, median_step_s)

    @property
    def waiting_for_state(self) -> bool:
        """Alive but without the job's state: starting, or catching up and not yet installed."""
        return self.phase is Phase.STARTING or (self.phase is Phase.CATCHING_UP and not self.installed)

    def phase_at(self, now: float, median_step_s: float | None) -> Phase:
        """The phase at `now`, the clock's transition included: STALLED while the gap since the last
        own step breaks the stall rule."""
        if self.phase is Phase.TRAINING and self._stalled(self._times[-1], now, median_step_s):
            return Phase.STALLED
        return self.phase

    def segments(self, median_step_s: float | None, until: float) -> list[Segment]:
        """The phases from the first record to `until`; a gap of TRAINING that breaks the stall rule
        is STALLED; adjacent segments of one phase are merged, empty ones dropped."""
        out: list[Segment] = []
        ends = [*self._times[1:], max(until, self._times[-1])] if self._times else []
        for a, b, code in zip(self._times, ends, self._codes):
            a, b = min(a, until), min(b, until)
            phase = _PHASES[code]
            if phase is Phase.TRAINING and self._stalled(a, b, median_step_s):
                phase = Phase.STALLED
            if b <= a:
                continue
            if out and out[-1].phase is phase and out[-1].end == a:
                out[-1] = Segment(out[-1].start, b, phase)
            else:
                out.append(Segment(a, b, phase))
        return out


def segments(
    records: Iterable[dict], median_step_s: float | None, until: float, steps: int | None = None
) -> list[Segment]:
    """A replica's lifecycle segments from its records (its own and the launcher's about it, in time
    order) up to `until`; `steps`: the job's (see `Lifecycle`)."""
    lifecycle = Lifecycle(steps)
    for record in records:
        lifecycle.feed(record)
    return lifecycle.segments(median_step_s, until)
