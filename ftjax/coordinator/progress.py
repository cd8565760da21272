"""What the coordinator tells an operator: the job's progress and each replica's story.

`CoordinatorState` feeds a `JobProgress` the events it sees anyway (a member registers, reports its
latest step with a quorum request, takes part in a quorum, is accused, departs) under its lock;
`JobProgress` turns them into what the status page and /metrics show:

- **per replica**: its lifecycle phase (`ftjax.runs.lifecycle.Phase`, the phases and colours of the
  launcher's timeline.png): *starting* (connected, not yet contributing), *training* (it contributes
  to the quorums), *stalled* (training, but the gap since its last quorum breaks the stall rule),
  *catching up* (a quorum says it heals, from whom), *down* (departed before the job's last step),
  *done* (departed after it); its latest figures (loss, step time, tokens/s) from its step reports;
  its incarnations (restarts) as seen by this coordinator; and its timeline (bounded);
- **the job**: target and committed steps, steps/s and ETA, tokens/s, loss, ETTR and goodput;
- **DiLoCo** (step reports with `inner_steps`, ft.sync diloco | streaming_diloco): a step is an
  outer round; the job's and each replica's inner steps per round, the fragment of the latest round,
  and the bytes averaged (per round, in all since this coordinator started, and per token). Reports
  without them (every-step sync) add nothing to the figures, the JSON or the page;
- **incidents**: one per replica outage, with what happened next: how long the job waited (the
  stall), when the replica was restarted, whom it healed from and for how long, when it trained
  again.

Phases come from quorums (every client takes part in them), figures from step reports (a client
that sends none still has a phase). A quorum in which a replica contributes is its *step signal*:
gaps between its signals drive the stall rule and the ETTR, as gaps between its step records do in
the launcher's summary (ftjax/runs/summary.py).

Everything is O(1) per event except a quorum, which is O(participants) like the quorum itself, and
bounded in memory per replica. Times are the coordinator's monotonic clock; `wall_offset` turns
them into wall-clock times for display. The state is soft like the rest of the coordinator's: a
restarted coordinator starts these records afresh.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ftjax.coordinator.quorum import MAX_STEP, InvalidField, Quorum, check_int
from ftjax.runs.lifecycle import Phase, is_stall

MAX_SEGMENTS = 100  # timeline segments kept per replica (the oldest go first)
MAX_INCIDENTS = 50
RATE_WINDOW_S = 60.0  # steps/s and the ETA: over the job's progress in this window
TOKENS_WINDOW_S = 30  # tokens/s: over this many one-second buckets
LOSS_POINTS = 400  # the loss curve keeps at most this many points (thinned by 2 when full)
MAX_STEP_TIME_S = 1e7
MAX_MFU = 100.0  # (above 1 only with a wrong peak, hardware.peak_flops_per_device: shown as reported)
MAX_REPLICAS = 1 << 20
# The stall rule (ftjax.runs.lifecycle.is_stall) judges every gap between a replica's steps, as the
# launcher's summary does. A replica is *shown* stalled now only once its current gap is also
# longer than this: on a busy machine sub-second gaps of a fast job come and go every few steps,
# and a state word that flickers tells a person nothing (the timeline still shows every one).
STALLED_NOW_AFTER_S = 1.0


class StepFigures(NamedTuple):
    """A replica's step report (coordinator.proto `StepReport`)."""

    step: int
    committed: bool
    contributed: bool
    loss: float
    step_time_s: float
    tokens: int
    target_steps: int = 0
    replicas: int = 0
    mfu: float | None = None  # model FLOPs utilization of the step (None: the devices' peak is not known)
    eval_loss: float | None = None  # its held-out loss after the step (None: it did not evaluate)
    # DiLoCo: the step is an outer round of `inner_steps` inner steps that averaged `fragment`, of
    # `sync_bytes` the bytes in FTAR's frames, ft.wire_dtype (None: every-step sync)
    inner_steps: int | None = None
    fragment: int | None = None
    sync_bytes: int | None = None
    # a catch-up under way while the replica's steps go on: bytes fetched of the snapshot's, ETA
    catchup_bytes_done: int | None = None
    catchup_bytes_total: int | None = None
    catchup_eta_s: float | None = None
    # DiLoCo's synchronous warm-up: the job's first `warmup_steps` steps are one averaged inner step each
    warmup_steps: int | None = None

    def validate(self, prefix: str = "report") -> None:
        """InvalidField naming the first field out of bounds (the loss may be any float)."""
        check_int(f"{prefix}.step", self.step, 0, MAX_STEP)
        check_int(f"{prefix}.tokens", self.tokens, 0, MAX_STEP)
        check_int(f"{prefix}.target_steps", self.target_steps, 0, MAX_STEP)
        check_int(f"{prefix}.replicas", self.replicas, 0, MAX_REPLICAS)
        _check_seconds(f"{prefix}.step_time_s", self.step_time_s)
        if self.mfu is not None and not (math.isfinite(self.mfu) and 0 <= self.mfu <= MAX_MFU):
            raise InvalidField(f"{prefix}.mfu", f"{self.mfu} is not a finite fraction in [0, {MAX_MFU:g}]")
        for name, lo in (("inner_steps", 1), ("fragment", 0), ("sync_bytes", 0), ("warmup_steps", 1)):
            value = getattr(self, name)
            if value is not None:
                check_int(f"{prefix}.{name}", value, lo, MAX_STEP)
        done, total, eta = self.catchup_bytes_done, self.catchup_bytes_total, self.catchup_eta_s
        if (done is None) != (total is None) or (eta is not None and total is None):
            raise InvalidField(f"{prefix}.catchup_bytes_total", "catch-up fields come together (bytes done and total)")
        if total is not None:
            check_int(f"{prefix}.catchup_bytes_total", total, 0, MAX_STEP)
            check_int(f"{prefix}.catchup_bytes_done", done or 0, 0, total)  # (done is set with total)
        if eta is not None:
            _check_seconds(f"{prefix}.catchup_eta_s", eta)


@dataclass
class _Accusation:
    reporter: str
    reason: str
    verdict: str
    at: float


@dataclass
class ReplicaView:
    """One replica as the status page shows it."""

    replica_id: str
    incarnation: str = ""
    incarnations: int = 0  # incarnations this coordinator has seen
    phase: Phase = Phase.STARTING
    since: float = 0.0  # when the current phase began
    heal_source: str = ""
    last_signal: float | None = None  # its latest quorum as a contributor (this incarnation, no heal since)
    finished: bool = False  # it contributed to a quorum at the job's target step
    report: StepFigures | None = None
    eval_loss: float | None = None  # its latest report's that had one (eval.every)
    # DiLoCo: bytes it averaged and the tokens of those rounds (each round counted once: a report
    # can come again with a retried quorum request), up to round `sync_step`, since this coordinator
    # started (across incarnations: what the replica id sent)
    sync_bytes: int = 0
    sync_tokens: int = 0
    sync_step: int = 0
    # the latest committed step this incarnation's reports were counted for (tokens, loss): a retried
    # quorum request carries the same report again, which must not count twice
    counted_step: int = -1
    down_why: str = ""
    phase_before_down: Phase = Phase.STARTING
    accusation: _Accusation | None = None
    stream_lost_at: float | None = None
    segments: deque = field(default_factory=lambda: deque(maxlen=MAX_SEGMENTS))  # [start, end|None, phase]

    def set_phase(self, phase: Phase, now: float) -> None:
        if phase is self.phase and self.segments:
            return
        if self.segments and self.segments[-1][1] is None:
            self.segments[-1][1] = now
        self.segments.append([now, None, phase])
        self.phase, self.since = phase, now

    def stalled_at(self, now: float, median_s: float | None) -> bool:
        """Whether the replica is stalled now (its open gap; see STALLED_NOW_AFTER_S)."""
        return (
            self.phase is Phase.TRAINING
            and not self.finished
            and self.last_signal is not None
            and now - self.last_signal > STALLED_NOW_AFTER_S
            and is_stall(now - self.last_signal, median_s)
        )


class JobProgress:
    def __init__(self, now: float, wall_offset: float, *, expected_replicas: int = 0) -> None:
        self.started_at = now
        self.wall_offset = wall_offset  # wall clock = monotonic + wall_offset
        self.expected_replicas = expected_replicas
        self.replicas: dict[str, ReplicaView] = {}
        self.target_steps = 0
        self.job_replicas = 0  # ft.replicas, as reported
        self.max_participants = 0
        self.step: int | None = None  # the job's committed steps (the latest quorum's step)
        self.first_step: int | None = None  # the step of this coordinator's first quorum (> 0: a restart)
        self.last_advance: float | None = None  # when the job's step last moved
        self.finished_at: float | None = None  # when a quorum first reached the target step
        self._advances: deque[tuple[float, int]] = deque(maxlen=512)
        self._intervals: deque[float] = deque(maxlen=100)  # between the job's step advances
        self._median: float | None = None
        self.warm_at: float | None = None  # every replica of the job has contributed
        self._warm: set[str] = set()
        self.productive_s = 0.0  # replica-seconds of training since warm_at (the ETTR's numerator)
        self.tokens_total = 0
        self._tokens_warm = 0  # ... since warm_at
        self._buckets: deque[list[int]] = deque(maxlen=TOKENS_WINDOW_S + 1)  # [second, tokens]
        self.loss_points: list[tuple[int, float]] = []
        self._loss_stride = 1
        self._loss_pending: dict[int, list[float]] = {}
        self.incidents: deque[dict] = deque(maxlen=MAX_INCIDENTS)
        self._open: dict[str, dict] = {}  # replica id -> its incident until it trains again
        # DiLoCo: the latest report's inner steps (None: no DiLoCo report, every-step sync), and the
        # replicas' bytes averaged and tokens in those rounds (see ReplicaView.sync_bytes)
        self.inner_steps: int | None = None
        self.fragment: int | None = None
        self.fragments_seen = 0  # the highest fragment reported + 1 (more than 1: streaming DiLoCo)
        self.round_bytes: int | None = None
        self.warmup_steps = 0  # DiLoCo's synchronous steps before its rounds (ft.sync_warmup_steps)
        self.sync_bytes = 0
        self.sync_tokens = 0

    # -- derived figures ---------------------------------------------------------------------------

    @property
    def median_step_s(self) -> float | None:
        return self._median

    @property
    def size(self) -> int:
        """The job's replicas: ft.replicas as reported, else the expected replicas, else the largest quorum."""
        return self.job_replicas or self.expected_replicas or self.max_participants

    def _view(self, rid: str) -> ReplicaView:
        v = self.replicas.get(rid)
        if v is None:
            v = self.replicas[rid] = ReplicaView(rid)
        return v

    def _done(self, v: ReplicaView) -> bool:
        if v.finished:
            return True
        step = v.report.step if v.report is not None else None
        return bool(self.target_steps) and step is not None and step >= self.target_steps

    # -- events ------------------------------------------------------------------------------------

    def registered(self, rid: str, incarnation: str, now: float, *, replaced_alive: bool = False) -> None:
        """A new incarnation of `rid` (its first message to this coordinator). `replaced_alive`: the
        previous incarnation was still counted alive (it died and came back faster than detection)."""
        v = self._view(rid)
        if replaced_alive and v.phase.alive and not self._done(v):
            self._open_incident(v, now, "it restarted as a new incarnation before the coordinator saw it die")
            self._open[rid]["restarted_after_s"] = 0.0
        elif rid in self._open:
            self._open[rid]["restarted_after_s"] = round(now - self._open[rid]["t"], 3)
        v.incarnation, v.incarnations = incarnation, v.incarnations + 1
        v.last_signal, v.finished, v.heal_source, v.down_why = None, False, "", ""
        v.report = v.accusation = v.stream_lost_at = None
        v.counted_step = -1  # a new incarnation may train steps again (the job restarted from a checkpoint)
        v.set_phase(Phase.STARTING, now)

    def revived(self, rid: str, now: float) -> None:
        """A member counted dead was heard from again (same incarnation)."""
        v = self._view(rid)
        if rid in self._open:
            inc = self._open.pop(rid)
            inc["outcome"] = f"a false alarm: it was heard from again after {now - inc['t']:.1f} s"
        v.down_why = ""
        v.set_phase(v.phase_before_down if v.phase_before_down.alive else Phase.STARTING, now)

    def reported(self, rid: str, fig: StepFigures, now: float) -> None:
        v = self._view(rid)
        v.report = fig
        if fig.eval_loss is not None and math.isfinite(fig.eval_loss):
            v.eval_loss = fig.eval_loss
        self.target_steps = max(self.target_steps, fig.target_steps)
        self.job_replicas = max(self.job_replicas, fig.replicas)
        if fig.inner_steps is not None:
            self.inner_steps, self.fragment, self.round_bytes = fig.inner_steps, fig.fragment, fig.sync_bytes
            self.fragments_seen = max(self.fragments_seen, (fig.fragment or 0) + 1)
            self.warmup_steps = max(self.warmup_steps, fig.warmup_steps or 0)
        if not (fig.committed and fig.contributed) or fig.step <= v.counted_step:
            return
        v.counted_step = fig.step
        if fig.sync_bytes is not None and fig.step > v.sync_step:
            v.sync_step = fig.step
            v.sync_bytes += fig.sync_bytes
            v.sync_tokens += fig.tokens
            self.sync_bytes += fig.sync_bytes
            self.sync_tokens += fig.tokens
        self.tokens_total += fig.tokens
        if self.warm_at is not None:
            self._tokens_warm += fig.tokens
        second = int(now)
        if self._buckets and self._buckets[-1][0] == second:
            self._buckets[-1][1] += fig.tokens
        else:
            self._buckets.append([second, fig.tokens])
        self._add_loss(fig.step, fig.loss)

    def _add_loss(self, step: int, loss: float) -> None:
        if not math.isfinite(loss):
            return
        pending = self._loss_pending
        acc = pending.setdefault(step, [0.0, 0])
        acc[0] += loss
        acc[1] += 1
        if len(pending) > 3:  # steps well behind the newest are complete: into the curve
            for s in sorted(pending)[:-3]:
                total, n = pending.pop(s)
                if s % self._loss_stride == 0 and (not self.loss_points or s > self.loss_points[-1][0]):
                    self.loss_points.append((s, total / n))
            if len(self.loss_points) > LOSS_POINTS:
                self._loss_stride *= 2
                self.loss_points = [p for p in self.loss_points if p[0] % self._loss_stride == 0]

    def disconnected(self, rid: str, now: float) -> None:
        v = self._view(rid)
        if v.stream_lost_at is None:
            v.stream_lost_at = now

    def accused(self, rid: str, reporter: str, reason: str, verdict: str, now: float) -> None:
        self._view(rid).accusation = _Accusation(reporter, reason, verdict, now)

    def departed(self, rid: str, now: float, why: str, heartbeat_timeout_s: float) -> None:
        """The member is out of the membership (why: report | suspect_silent | heartbeat_timeout)."""
        v = self._view(rid)
        v.phase_before_down = v.phase
        if self._done(v):
            v.set_phase(Phase.DONE, now)
            return
        v.down_why = self._why(v, why, heartbeat_timeout_s)
        v.set_phase(Phase.DOWN, now)
        if rid not in self._open:
            self._open_incident(v, now, v.down_why)

    @staticmethod
    def _why(v: ReplicaView, why: str, heartbeat_timeout_s: float) -> str:
        acc, lost = v.accusation, v.stream_lost_at is not None
        stream = "its heartbeat stream ended (the process died or lost its connection)"
        if acc is not None and why in ("report", "suspect_silent"):
            reason = acc.reason if len(acc.reason) <= 200 else acc.reason[:200] + "..."
            if acc.reporter == v.replica_id:
                text = f"it left the job: {reason}" if reason else "it left the job"
            else:
                who = f"replica {acc.reporter}" if acc.reporter else "a peer"
                text = f"{who} reported it" + (f" ({reason})" if reason else "")
            return f"{text}; {stream}" if lost and acc.reporter != v.replica_id else text
        if lost:
            return stream
        return f"no heartbeat for {heartbeat_timeout_s:g} s"

    def _open_incident(self, v: ReplicaView, now: float, how: str) -> None:
        inc = {
            "t": now,
            "replica": v.replica_id,
            "incarnation": v.incarnations,
            "step": self.step,
            "replica_step": v.report.step if v.report is not None else None,
            "how": how,
            "progress_before": self.last_advance,
            "stall_s": None,
            "quorum_after": None,
            "restarted_after_s": None,
            "healing_from": None,
            "heal_started": None,
            "catchup_s": None,
            "back_after_s": None,
            "back_step": None,
            "outcome": None,
        }
        self.incidents.append(inc)
        self._open[v.replica_id] = inc

    def quorum(self, q: Quorum, has_state: dict[str, bool], now: float) -> None:
        """A quorum formed; `has_state`: each participant's latest report."""
        self.max_participants = max(self.max_participants, len(q.participants))
        if self.first_step is None:
            self.first_step = q.step
        if q.no_state:
            for p in q.participants:
                self._view(p.replica_id).set_phase(Phase.STARTING, now)
            self.step = q.step
            return
        advanced = self.step is None or q.step > self.step
        if advanced:
            if self.last_advance is not None and self.step is not None:
                self._intervals.append((now - self.last_advance) / max(1, q.step - self.step))
                self._median = statistics.median(self._intervals)
            self.last_advance = now
            self._advances.append((now, q.step))
            if self.target_steps and q.step >= self.target_steps and self.finished_at is None:
                self.finished_at = now
        self.step = q.step if self.step is None else max(self.step, q.step)
        over = self.finished_at is not None and now > self.finished_at
        contributors = 0
        for p in q.participants:
            v = self._view(p.replica_id)
            inc = self._open.get(p.replica_id)
            if p.healing:
                if v.phase is not Phase.CATCHING_UP:
                    v.set_phase(Phase.CATCHING_UP, now)
                v.heal_source, v.last_signal = p.heal_source, None
                if inc is not None and inc["heal_started"] is None:
                    inc["healing_from"], inc["heal_started"] = p.heal_source, now
                continue
            if not has_state.get(p.replica_id, True):
                continue  # (no state and not healing: only in a no_state quorum)
            contributors += 1
            self._step_signal(v, now, over)
            if self.target_steps and q.step >= self.target_steps:
                v.finished = True
            if inc is not None:
                inc["back_after_s"], inc["back_step"] = round(now - inc["t"], 3), q.step
                if inc["heal_started"] is not None:
                    inc["catchup_s"] = round(now - inc["heal_started"], 3)
                del self._open[p.replica_id]
        for inc in self._open.values():
            if inc["quorum_after"] is None and now >= inc["t"]:
                inc["quorum_after"] = [contributors, len(q.participants)]
        if advanced:
            for inc in self.incidents:  # the job moved again: how long it stood still around each failure
                if inc["stall_s"] is None and now > inc["t"]:
                    before = inc["progress_before"] if inc["progress_before"] is not None else inc["t"]
                    inc["stall_s"] = round(now - before, 3)

    def _step_signal(self, v: ReplicaView, now: float, over: bool) -> None:
        """`v` contributes to a quorum at `now`: it trains."""
        median = self._median
        if v.phase is Phase.TRAINING and v.last_signal is not None:
            gap = now - v.last_signal
            stall = is_stall(gap, median) and not v.finished
            if self.warm_at is not None and v.last_signal >= self.warm_at and not over:
                self.productive_s += min(gap, median) if stall and median is not None else gap
            if stall:  # the gap was a stall: a segment of its own, then training again
                last = v.segments[-1]
                if last[0] < v.last_signal:
                    last[1] = v.last_signal
                    v.segments.append([v.last_signal, now, Phase.STALLED])
                else:  # (no training since the previous stall: one longer stall)
                    v.segments.pop()
                    before = v.segments[-1] if v.segments else None
                    if before is not None and before[2] is Phase.STALLED and before[1] == last[0]:
                        before[1] = now
                    else:
                        v.segments.append([last[0], now, Phase.STALLED])
                v.segments.append([now, None, Phase.TRAINING])
                v.since = now
        else:
            v.set_phase(Phase.TRAINING, now)
        v.last_signal, v.heal_source = now, ""
        if self.warm_at is None:
            self._warm.add(v.replica_id)
            if self.size and len(self._warm) >= self.size:
                self.warm_at = now

    # -- pictures ----------------------------------------------------------------------------------

    def phase_now(self, v: ReplicaView, now: float) -> Phase:
        return Phase.STALLED if v.stalled_at(now, self._median) else v.phase

    def job(self, now: float, alive: int) -> dict[str, Any]:
        """The job's figures (JSON-able; None where not known yet)."""
        end = self.finished_at if self.finished_at is not None else now
        rate = None
        recent = [(t, s) for t, s in self._advances if t >= now - RATE_WINDOW_S]
        if len(recent) < 2 and len(self._advances) >= 2:
            recent = list(self._advances)[-2:]
        if len(recent) >= 2:
            span = (end if self.finished_at is not None else now) - recent[0][0]
            rate = (recent[-1][1] - recent[0][1]) / span if span > 0 else None
        step = self.step or 0
        left = max(0, self.target_steps - step) if self.target_steps else None
        eta = 0.0 if left == 0 else (left / rate if rate and left is not None else None)
        cutoff = int(now) - TOKENS_WINDOW_S
        window_tokens = sum(n for s, n in self._buckets if s > cutoff)
        seconds = min(float(TOKENS_WINDOW_S), now - self.started_at)
        tokens_per_s = window_tokens / seconds if seconds > 0 and self.tokens_total else None
        ettr = goodput = None
        if self.warm_at is not None and self.size and end - self.warm_at > (self._median or 0.0):
            productive = self.productive_s
            for v in self.replicas.values():  # the open gap of each training replica
                if (
                    v.phase is Phase.TRAINING
                    and v.last_signal is not None
                    and not v.finished
                    and v.last_signal >= self.warm_at
                    and end > v.last_signal
                ):
                    gap = end - v.last_signal
                    productive += min(gap, self._median) if self._median and is_stall(gap, self._median) else gap
            ettr = min(1.0, productive / (self.size * (end - self.warm_at)))
            goodput = self._tokens_warm / (end - self.warm_at)
        losses = [
            v.report.loss
            for v in self.replicas.values()
            if v.phase.alive and v.report is not None and v.report.contributed and math.isfinite(v.report.loss)
        ]
        training = self._contributing()
        sync = {"sync": self._sync(step)} if self.inner_steps is not None else {}
        return {
            "target_steps": self.target_steps or None,
            "committed_steps": step,
            "replicas": self.size or None,
            "alive": alive,
            "training": training,
            "steps_per_s": rate,
            "eta_s": eta,
            "tokens_per_s": tokens_per_s,
            "tokens_total": self.tokens_total,
            "goodput_tokens_per_s": goodput,
            "ettr": ettr,
            "loss": statistics.fmean(losses) if losses else None,
            "median_step_s": self._median,
            "warm_at": self.wall(self.warm_at),
            "finished": self.finished_at is not None,
            "first_step": self.first_step,
            "finished_at": self.wall(self.finished_at),
            **sync,
        }

    def _sync(self, step: int) -> dict[str, Any]:
        """A DiLoCo job's rounds and bytes averaged (docs/design/replicas.md, "Training across slow links"). With
        a synchronous warm-up, its steps are one optimizer step each and the rounds start after it;
        the latest report's inner steps are those of the rounds once a round was committed."""
        warm = min(step, self.warmup_steps)
        return {
            "outer_rounds": step - warm,
            "warmup_steps": self.warmup_steps,
            "optimizer_steps": warm + (step - warm) * (self.inner_steps or 1),
            "inner_steps": self.inner_steps,
            "fragment": self.fragment,
            "fragments_seen": self.fragments_seen,
            "bytes_per_round": self.round_bytes,
            "bytes_total": self.sync_bytes,
            "bytes_per_token": self.sync_bytes / self.sync_tokens if self.sync_tokens else None,
        }

    def wall(self, t: float | None) -> float | None:
        return None if t is None else round(t + self.wall_offset, 3)

    def replica(self, rid: str, now: float) -> dict[str, Any]:
        """The page's columns for one replica."""
        v = self.replicas.get(rid)
        if v is None:
            return {"state": Phase.STARTING.value, "state_text": "starting", "since_s": 0.0}
        phase = self.phase_now(v, now)
        r = v.report
        return {
            "state": phase.value,
            "state_text": self.describe(v, phase, now),
            "since_s": round(
                now - (v.last_signal if phase is Phase.STALLED and v.last_signal is not None else v.since), 3
            ),
            "heal_source": v.heal_source,
            "incarnation_number": v.incarnations,
            "restarts": max(0, v.incarnations - 1),
            "finished": v.finished,
            "loss": r.loss if r is not None and r.contributed and math.isfinite(r.loss) else None,
            "step_time_s": r.step_time_s if r is not None else None,
            "tokens_per_s": r.tokens / r.step_time_s if r is not None and r.contributed and r.step_time_s > 0 else None,
            "mfu": r.mfu if r is not None and r.contributed else None,
            "eval_loss": v.eval_loss,
            "report_step": r.step if r is not None else None,
            **self._replica_sync(v, r),
            **self._replica_catchup(phase, r),
        }

    @staticmethod
    def _replica_catchup(phase: Phase, r: StepFigures | None) -> dict[str, Any]:
        """A fetch under way: its bytes and ETA (none while the replica is not catching up)."""
        if phase is not Phase.CATCHING_UP or r is None or r.catchup_bytes_total is None:
            return {}
        return {
            "catchup_bytes_done": r.catchup_bytes_done,
            "catchup_bytes_total": r.catchup_bytes_total,
            "catchup_eta_s": r.catchup_eta_s,
        }

    @staticmethod
    def _replica_sync(v: ReplicaView, r: StepFigures | None) -> dict[str, Any]:
        """A DiLoCo replica's columns (none for a replica that never reported a round)."""
        if not v.sync_step and (r is None or r.inner_steps is None):
            return {}
        latest = r if r is not None and r.inner_steps is not None else None
        return {
            "inner_steps": latest.inner_steps if latest else None,
            "fragment": latest.fragment if latest else None,
            "sync_bytes": latest.sync_bytes if latest else None,
            "sync_bytes_total": v.sync_bytes,
            "sync_bytes_per_token": v.sync_bytes / v.sync_tokens if v.sync_tokens else None,
        }

    def describe(self, v: ReplicaView, phase: Phase, now: float) -> str:
        """The replica's state in words."""
        if phase is Phase.STARTING:
            if v.incarnations > 1:
                return "restarted: joining the job"
            return (
                "starting: connected, waiting for the job's first quorum"
                if self.step is None
                else "starting: connected, joining the job"
            )
        if phase is Phase.TRAINING:
            if v.finished:
                return "finished its steps: serving peers until every replica holds the final state"
            size, contributing = self.size, self._contributing()
            if size and contributing < size:
                return f"training, reduced: {contributing} of {size} replicas contribute"
            return "training"
        if phase is Phase.STALLED and v.last_signal is not None:  # (stalled: it has a last signal)
            return f"stalled for {now - v.last_signal:.1f} s (waiting for a quorum or a peer)"
        if phase is Phase.CATCHING_UP:
            source = f"replica {v.heal_source}" if v.heal_source else "a peer"
            text = f"healing from {source} ({now - v.since:.1f} s so far)"
            r = v.report
            if r is not None and r.catchup_bytes_total is not None:
                text += f": {_megabytes(r.catchup_bytes_done or 0)} of {_megabytes(r.catchup_bytes_total)} MB fetched"
                if r.catchup_eta_s is not None:
                    text += f", about {r.catchup_eta_s:.0f} s to go"
            return text
        if phase is Phase.DOWN:
            return f"down since {_clock(v.since + self.wall_offset)} ({now - v.since:.0f} s): {v.down_why}"
        if phase is Phase.DONE:
            step = v.report.step if v.report is not None else self.step
            return f"done at step {step}"
        return phase.value

    def _contributing(self) -> int:
        """Replicas that contribute to the job's steps now (training, stalled included)."""
        return sum(v.phase is Phase.TRAINING and not v.finished for v in self.replicas.values())

    def incident_rows(self, now: float) -> list[dict]:
        """The incidents, newest first, with wall-clock times."""
        out = []
        for inc in reversed(self.incidents):
            row = {k: v for k, v in inc.items() if k not in ("t", "progress_before", "heal_started")}
            row["time"] = self.wall(inc["t"])
            row["age_s"] = round(now - inc["t"], 3)
            row["open"] = self._open.get(inc["replica"]) is inc
            if inc["heal_started"] is not None and inc["catchup_s"] is None and row["open"]:
                row["healing_for_s"] = round(now - inc["heal_started"], 3)
            out.append(row)
        return out

    def timeline(self, now: float) -> dict[str, Any]:
        """Each replica's segments as [start, end, phase] in seconds since the coordinator started."""
        t0, rows = self.started_at, {}
        for rid, v in sorted(self.replicas.items()):
            segs = []
            for a, b, phase in v.segments:
                end = now if b is None else b
                if b is None and v.stalled_at(now, self._median):  # the open gap is a stall, so far
                    assert v.last_signal is not None  # (stalled_at: it has one)
                    if v.last_signal > a:
                        segs.append([round(a - t0, 3), round(v.last_signal - t0, 3), phase.value])
                    segs.append([round(max(a, v.last_signal) - t0, 3), round(now - t0, 3), Phase.STALLED.value])
                    continue
                if end > a:
                    segs.append([round(a - t0, 3), round(end - t0, 3), phase.value])
            rows[rid] = segs
        failures = [[round(inc["t"] - t0, 3), inc["replica"]] for inc in self.incidents]
        return {"start": self.wall(t0), "now_s": round(now - t0, 3), "replicas": rows, "failures": failures}


def _clock(wall: float) -> str:
    import time

    return time.strftime("%H:%M:%S", time.localtime(wall))


def _check_seconds(name: str, value: float) -> None:
    if not (math.isfinite(value) and 0 <= value <= MAX_STEP_TIME_S):
        raise InvalidField(name, f"{value} is not a finite number of seconds in [0, {MAX_STEP_TIME_S:g}]")


def _megabytes(n: int) -> str:
    return f"{n / 1e6:,.1f}"
