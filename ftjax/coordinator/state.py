"""The coordinator's soft state: membership, pending requests, quorum history, data positions.

Everything here can be lost: a restarted coordinator rebuilds it from what the members send (see
`PositionLedger` for the one thing that a restart cannot fully rebuild). One lock guards it: the
gRPC event loop mutates it, the HTTP thread reads snapshots. Methods take `now` (the coordinator's
monotonic clock) explicitly, so tests can drive time.

Members that are known to be dead are moved out of `members` into `departed` by a sweep. Between
two sweeps nobody in `members` can have died (the next sweep is due no later than the earliest
possible death), so `len(members)` is the number of alive members and two counters (pending
requests, pending requests from members of the previous quorum) tell in O(1) whether a quorum
could form: the full, pure `compute_quorum` runs only when it could, or when a deadline passes.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace

from ftjax.base.net import is_loopback
from ftjax.coordinator.commits import COMMIT, CommitBook
from ftjax.coordinator.jobview import JobView
from ftjax.coordinator.layout import layout_difference
from ftjax.coordinator.progress import JobProgress, StepFigures
from ftjax.coordinator.quorum import (
    RECONNECT_WINDOW_S,
    Decision,
    MemberReport,
    MemberState,
    Quorum,
    Settings,
    compute_quorum,
    death_time,
    is_alive,
    split_address,
)

MAX_MEMBERS = 10_000  # alive members; beyond that registration gets RESOURCE_EXHAUSTED
MAX_DEPARTED = 10_000  # dead members remembered for the status page and for late failure reports
HISTORY = 50  # quorums and failures kept for the status page
MAX_LAYOUTS = 16  # layout texts kept (by fingerprint) to name what differs when a member's fingerprint does
NO_PROGRESS_S = 10.0  # the job's step unchanged this long while failed attempts keep forming quorums: say so


class Rejected(Exception):
    """A request the coordinator refuses without changing anything; `code` names a gRPC status."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class PositionLedger:
    """Job-level data positions.

    Every quorum's contributors (participants not healing) are recorded with the data position of
    the batch each trains at that step. When a member reports a step above s, somebody committed
    step s, so every contributor of step s has its position advanced past that batch, whether or
    not it committed the step itself (it will heal, or it died). The position handed out for a
    replica is max(what it reports, this record), so a restarted replica learns where its stream
    resumes.

    A coordinator restart loses this record, so the members keep one too (every replica's leader
    records the positions of the quorums it takes part in) and send it when their heartbeat stream
    registers (`merge`). A restarted coordinator listens for one heartbeat timeout before its first
    quorum, so the record is whole again before anyone is handed a position: a replica that is
    down across the restart resumes where it left off instead of at 0.
    A quorum where nobody has state is a whole-job restart from a durable checkpoint, which carries
    its own positions: the ledger forgets everything then.
    """

    def __init__(self) -> None:
        self.positions: dict[str, int] = {}
        self._contributions: dict[int, Quorum] = {}  # step -> the latest quorum of that step

    def position(self, replica_id: str) -> int:
        return self.positions.get(replica_id, 0)

    def _advance(self, replica_id: str, position: int) -> None:
        """The record only moves forward."""
        if position > self.positions.get(replica_id, 0):
            self.positions[replica_id] = position

    def observe(self, replica_id: str, step: int, position: int) -> None:
        """A member reported `step` steps committed and `position` as its next batch."""
        self._advance(replica_id, position)
        self.committed(step)

    def committed(self, step: int) -> None:
        """The job committed `step` steps (a member reported it, or the coordinator decided it):
        every contributor of each step below is past its batch."""
        if self._contributions:
            for committed in sorted(s for s in self._contributions if s < step):
                for p in self._contributions.pop(committed).participants:
                    if not p.healing:
                        self._advance(p.replica_id, p.data_position + 1)

    def merge(self, known: Mapping[str, int]) -> None:
        """Positions a member knows of."""
        for replica_id, position in known.items():
            self._advance(replica_id, position)

    def record(self, quorum: Quorum) -> None:
        """Remember who contributes which batch to the step of `quorum`."""
        if quorum.no_state:
            self.positions.clear()
            self._contributions.clear()
            return
        # A retried step (after a failed commit) replaces the record of the attempt before it.
        self._contributions[quorum.step] = quorum

    def pending_steps(self) -> list[int]:
        return sorted(self._contributions)


@dataclass(frozen=True, slots=True)
class Accusation:
    """The answer to a failure report: a final verdict, or the time to look again."""

    verdict: str  # DROPPED | ALREADY_GONE | ALIVE | STALE_INCARNATION | UNKNOWN_REPLICA | SUSPECT | PENDING
    detail: str
    confirm_at: float | None = None  # PENDING, SUSPECT: when the accused, if still silent, counts as dead

    @property
    def dropped(self) -> bool:
        return self.verdict in ("DROPPED", "ALREADY_GONE")


class CoordinatorState:
    """Thread-safe membership table and quorum bookkeeping (see the module docstring)."""

    def __init__(self, settings: Settings, now: float, *, startup_grace: float | None = None) -> None:
        self.settings = settings
        self.started_at = now
        # (default: one heartbeat timeout to learn who is alive, and no less than a live client's
        # longest wait before it reconnects: quorum.RECONNECT_WINDOW_S)
        grace = max(settings.heartbeat_timeout_s, RECONNECT_WINDOW_S) if startup_grace is None else startup_grace
        self.not_before = now + grace
        self.members: dict[str, MemberState] = {}
        self.departed: dict[str, tuple[MemberState, float, str]] = {}  # rid -> (state, when, why)
        self.fingerprint: str | None = None
        self.prev: Quorum | None = None
        self.failure_epoch = 0
        self.ledger = PositionLedger()
        self.job_step: int | None = None  # the highest step of a quorum formed (None: none yet)
        # One history (docs/design/index.md): the highest step a member with state reported (the job
        # committed that many steps), and the job's configured steps (from the step reports; 0:
        # unknown). A quorum whose participants hold less than `committed_step` never forms.
        self.committed_step = 0
        self.target_steps = 0
        self.layouts: dict[str, str] = {}  # fingerprint -> the layout text a member sent with it
        self._streams: dict[tuple[str, str], int] = {}  # (replica_id, incarnation) -> open heartbeat streams
        self.history: deque[dict] = deque(maxlen=HISTORY)
        self.failures: deque[dict] = deque(maxlen=HISTORY)
        self.counters: dict[str, int] = {
            "heartbeats": 0,
            "quorum_requests": 0,
            "quorums": 0,
            "quorum_id_changes": 0,
            "rejected": 0,
        }
        # failures by (source, kind): source is what saw it (report, verdict, disconnect, departed,
        # implausible), kind what it found (a verdict, why a member departed, ...)
        self.failure_counts: dict[tuple[str, str], int] = {}
        self.progress = JobProgress(now, time.time() - now, expected_replicas=settings.expected_replicas)
        self._progress_backlog: deque[tuple] = deque()  # quorums formed, not yet told to `progress`
        # progress: when the job's step last moved (monotonic and wall clock), and the quorums formed
        # since, of which how many after a failed attempt (a participant reported commit failures)
        self._progress_at, self._progress_wall = now, time.time()
        self._quorums_since_progress = 0
        self._retries_since_progress = 0
        self._lock = threading.Lock()
        self._prev_keys: frozenset[tuple[str, str]] = frozenset()
        self._pending = 0  # members with a pending request
        self._pending_prev = 0  # ... of which members of the previous quorum
        self._first_request: float | None = None  # lower bound of the earliest pending request
        self._next_sweep = float("inf")  # no member of `members` can be dead before this
        self.job_view: JobView | None = None  # TensorBoard's view of the job (ftjax/coordinator/jobview.py)
        # ft.commit_decision: coordinator: the commit votes and decisions, per quorum formation,
        # numbered from a random base so that no formation of a restarted coordinator reuses one
        self.commits = CommitBook()
        self._formations = itertools.count((secrets.randbits(30) << 32) + 1)

    # -- the status page's bookkeeping --------------------------------------------------------

    def _jp(self) -> JobProgress:
        """`progress`, told every quorum formed so far first (events reach it in order)."""
        while self._progress_backlog:
            self.progress.quorum(*self._progress_backlog.popleft())
        return self.progress

    def settle_progress(self) -> None:
        """Tell `progress` the quorums formed since it last heard. The server calls this once the
        answers of a quorum are on their way: at 1000 participants it costs a millisecond or two,
        which the answers need not wait for. Every reader and every other event settles it first."""
        with self._lock:
            self._jp()

    # -- bookkeeping of `members` -------------------------------------------------------------

    def _count(self, m: MemberState, sign: int) -> None:
        if m.requested_at is not None:
            self._pending += sign
            if m.report.key in self._prev_keys:
                self._pending_prev += sign

    def _put(self, m: MemberState) -> None:
        rid = m.report.replica_id
        old = self.members.get(rid)
        if old is not None:
            self._count(old, -1)
        self.members[rid] = m
        self._count(m, +1)
        t = death_time(m, self.settings)
        if t < self._next_sweep:
            self._next_sweep = t
        if m.requested_at is not None and (self._first_request is None or m.requested_at < self._first_request):
            self._first_request = m.requested_at

    def _depart(self, rid: str, now: float, why: str) -> None:
        m = self.members.pop(rid)
        self.commits.departed(rid, why)
        self._count(m, -1)
        self.departed[rid] = (m, now, why)
        key = ("departed", why)
        self.failure_counts[key] = self.failure_counts.get(key, 0) + 1
        self._jp().departed(rid, now, why, self.settings.heartbeat_timeout_s)
        if len(self.departed) > MAX_DEPARTED:
            oldest = min(self.departed, key=lambda r: self.departed[r][1])
            del self.departed[oldest]
            self._jp().replicas.pop(oldest, None)

    def _sweep(self, now: float) -> None:
        """Move the dead out of `members`; find when the next one could die (one pass)."""
        dead = []
        next_sweep, first = float("inf"), None
        for rid, m in self.members.items():
            t = death_time(m, self.settings)
            if t <= now:  # the same test as `not is_alive(m, now)`
                dead.append(rid)
                continue
            if t < next_sweep:
                next_sweep = t
            if m.requested_at is not None and (first is None or m.requested_at < first):
                first = m.requested_at
        for rid in dead:
            why = "suspect_silent" if self.members[rid].suspected_at is not None else "heartbeat_timeout"
            self._depart(rid, now, why)
        self._next_sweep, self._first_request = next_sweep, first

    def _maybe_sweep(self, now: float) -> None:
        if now >= self._next_sweep:
            self._sweep(now)

    def _current(self, rid: str, incarnation: str) -> MemberState | None:
        """The member's state if `incarnation` is its latest, reviving it from `departed`."""
        m = self.members.get(rid)
        if m is not None:
            return m if m.report.incarnation == incarnation else None
        gone = self.departed.get(rid)
        if gone is not None and gone[0].report.incarnation == incarnation:
            return gone[0]
        return None

    def _admit(self, report: MemberReport, now: float) -> MemberState | None:
        """Checks that refuse a report before anything changes; returns the member's current state."""
        if self.fingerprint is not None and report.topology_fingerprint != self.fingerprint and self.members:
            raise Rejected(
                "FAILED_PRECONDITION",
                f"replica {report.replica_id!r} has topology fingerprint {report.topology_fingerprint!r} but "
                f"the job's is {self.fingerprint!r}: its model, mesh, shard layout or settings differ from the job's"
                + layout_difference(self.layouts.get(self.fingerprint), self.layouts.get(report.topology_fingerprint)),
            )
        m = self.members.get(report.replica_id)
        if m is not None and m.report.incarnation != report.incarnation and self._holds_id(m, now):
            raise Rejected(
                "ALREADY_EXISTS",
                f"replica id {report.replica_id!r} is held by a live process (incarnation {m.report.incarnation!r}: "
                f"its heartbeat stream is open and it heartbeats); incarnation {report.incarnation!r} is refused. "
                "Two processes may not run as one replica: give this one another replica id (a restarted replica "
                "is admitted once its predecessor's heartbeat stream ends or it misses its heartbeat timeout)",
            )
        if m is None:
            gone = self.departed.get(report.replica_id)
            m = gone[0] if gone is not None else None
            if len(self.members) >= MAX_MEMBERS:
                raise Rejected("RESOURCE_EXHAUSTED", f"the coordinator already tracks {MAX_MEMBERS} members")
        if (
            m is not None
            and m.report.incarnation == report.incarnation
            and m.report.static_fields() != report.static_fields()
        ):
            raise Rejected(
                "FAILED_PRECONDITION",
                f"replica {report.replica_id!r} incarnation {report.incarnation!r} changed its addresses or "
                "topology fingerprint; these are fixed for an incarnation (restart with a new incarnation)",
            )
        return m

    def _holds_id(self, m: MemberState, now: float) -> bool:
        """`m` (a member, not departed) is a live process: it heartbeats on an open stream. A process
        that died closed its stream (the kernel ends its connections) or, silent, is past its timeout."""
        return is_alive(m, now, self.settings) and self._streams.get(m.report.key, 0) > 0

    def stream_opened(self, key: tuple[str, str]) -> None:
        """A heartbeat stream of member `key` registered (the server calls `stream_closed` when it ends)."""
        with self._lock:
            self._streams[key] = self._streams.get(key, 0) + 1

    def stream_closed(self, key: tuple[str, str]) -> None:
        with self._lock:
            n = self._streams.pop(key, 0) - 1
            if n > 0:
                self._streams[key] = n

    def note_layout(self, fingerprint: str, layout: str) -> None:
        """Keep the layout text behind a fingerprint (a few, the first ones): a refusal names what differs."""
        with self._lock:
            if layout and fingerprint not in self.layouts and len(self.layouts) < MAX_LAYOUTS:
                self.layouts[fingerprint] = layout

    def _note_progress(self, report: MemberReport, figures: StepFigures | None = None) -> None:
        if report.has_state and report.step > self.committed_step:
            self.committed_step = report.step
        if figures is not None and figures.target_steps > self.target_steps:
            self.target_steps = figures.target_steps

    @property
    def finished_step(self) -> int | None:
        """The job's last step once a member holds it (it trained every step), else None."""
        done = self.target_steps and self.committed_step >= self.target_steps
        return self.committed_step if done else None

    def finished_requesters(self, now: float) -> list[tuple[str, str]]:
        """Members asking for a quorum behind a finished job that nobody alive can heal them to:
        their requests are withdrawn, and the server answers them `finished_step` (they exit instead of
        training finished steps again). [] while the job runs, or while a member holding its last step
        is alive (a draining replica: they heal from it)."""
        with self._lock:
            done = self.finished_step
            if done is None or not self._pending:
                return []
            self._maybe_sweep(now)
            if any(m.report.has_state and m.report.step >= done for m in self.members.values()):
                return []
            late = [(rid, m) for rid, m in self.members.items() if m.requested_at is not None]
            for rid, m in late:
                self._put(m._replace(requested_at=None))
                self._record_failure(
                    now,
                    "finished",
                    rid,
                    m.report.incarnation,
                    "",
                    f"asked at step {m.report.step}; the job finished at step {done}",
                    "FINISHED",
                )
            return [(rid, m.report.incarnation) for rid, m in late]

    def _check_plausible(self, report: MemberReport, now: float, known: Mapping[str, int] | None = None) -> None:
        """Refuse progress that no member of this job can have made: every committed step trains at
        most one batch of each replica's stream, and no member is more than one step past the
        highest quorum. Without this one authenticated request with an absurd step (2^62, say)
        would put every other replica behind the job and make it drop its state."""
        if self.job_step is None:
            return  # a restarted coordinator knows the job's step only from its first quorum on
        limit = self.job_step + 1
        claims = [("member.step", report.step), ("member.data_position", report.data_position)]
        claims += [(f"known_positions[{rid!r}]", p) for rid, p in (known or {}).items()]
        for name, value in claims:
            if value > limit:
                message = (
                    f"{name}: {value} is beyond what the job can have reached (its highest quorum "
                    f"is at step {self.job_step}); replica {report.replica_id!r} refused"
                )
                self._record_failure(now, "implausible", report.replica_id, report.incarnation, "", message, "REFUSED")
                raise Rejected("FAILED_PRECONDITION", message)

    def _upsert(self, report: MemberReport, now: float, requesting: bool | None) -> tuple[MemberState, bool]:
        """Record a report (heartbeat or request). `requesting`: True sets the pending request,
        None keeps it. Returns (new state, whether an older incarnation was replaced)."""
        m = self._admit(report, now)
        replaced = m is not None and m.report.incarnation != report.incarnation
        if m is None or replaced:
            requested_at = None
        else:
            requested_at = m.requested_at
        if requesting:
            requested_at = now if requested_at is None else requested_at
        was_departed = self.departed.pop(report.replica_id, None) is not None
        if m is None or replaced:
            self._jp().registered(
                report.replica_id, report.incarnation, now, replaced_alive=replaced and not was_departed
            )
        elif was_departed:
            self._jp().revived(report.replica_id, now)
        new = MemberState(report, now, requested_at, None)
        self._put(new)
        if self.fingerprint is None or len(self.members) == 1:
            self.fingerprint = report.topology_fingerprint  # the first alive member fixes it
        return new, replaced

    # -- events -----------------------------------------------------------------------------

    def register(self, report: MemberReport, now: float, known_positions: Mapping[str, int] | None = None) -> bool:
        """A heartbeat stream's first message, with what the member knows of every replica's data
        position. Returns True if an older incarnation was replaced."""
        with self._lock:
            self._maybe_sweep(now)
            self._check_plausible(report, now, known_positions)
            m = self.members.get(report.replica_id)
            keep = m is not None and m.report.incarnation == report.incarnation
            # A heartbeat does not carry progress: keep the progress of the member's last request.
            if keep and m is not None:  # (keep: the member is known)
                old = m.report
                report = report._replace(
                    step=old.step,
                    data_position=old.data_position,
                    has_state=old.has_state,
                    commit_failures=old.commit_failures,
                    known_quorum_id=old.known_quorum_id,
                    digest=old.digest,
                )
            _, replaced = self._upsert(report, now, requesting=None)
            self._note_progress(report)
            if known_positions:  # after every check: a refused registration changes nothing
                self.ledger.merge(known_positions)
            self.counters["heartbeats"] += 1
            return replaced

    def heartbeat(self, replica_id: str, incarnation: str, now: float) -> tuple[bool, bool]:
        """A heartbeat on an established stream. Returns (current, revived): current is False if
        that incarnation was replaced; revived is True if the member had been counted dead."""
        with self._lock:
            m = self._current(replica_id, incarnation)
            if m is None:
                return False, False
            self.counters["heartbeats"] += 1
            revived = self.departed.pop(replica_id, None) is not None
            if revived:
                self._jp().revived(replica_id, now)
            self._put(MemberState(m.report, now, m.requested_at, None))
            return True, revived

    def request(self, report: MemberReport, now: float, figures: StepFigures | None = None) -> bool:
        """A quorum request (it counts as a heartbeat), with the member's latest step report if it
        sent one. Returns True if it replaced an older incarnation (whose pending request, if any,
        must be answered ABORTED)."""
        with self._lock:
            self._maybe_sweep(now)
            self._check_plausible(report, now)
            _, replaced = self._upsert(report, now, requesting=True)
            self._note_progress(report, figures)
            if figures is not None:
                self._jp().reported(report.replica_id, figures, now)
            self.ledger.observe(report.replica_id, report.step, report.data_position)
            self.counters["quorum_requests"] += 1
            return replaced

    def withdraw(self, replica_id: str, incarnation: str) -> None:
        """The member's pending request went away (its stream ended or it timed out)."""
        with self._lock:
            m = self.members.get(replica_id)
            if m is not None and m.report.incarnation == incarnation and m.requested_at is not None:
                self._put(m._replace(requested_at=None))
                return
            gone = self.departed.get(replica_id)
            if gone is not None and gone[0].report.incarnation == incarnation:
                g = gone[0]
                self.departed[replica_id] = (g._replace(requested_at=None), gone[1], gone[2])

    def disconnected(self, replica_id: str, incarnation: str, now: float) -> None:
        """The member's heartbeat stream ended: evidence that it died. It becomes a suspect (dead
        unless heard from within the suspect window), and a peer's report drops it at once."""
        with self._lock:
            m = self.members.get(replica_id)
            if m is not None and m.report.incarnation == incarnation and not m.stream_lost:
                suspected_at = now if m.suspected_at is None else m.suspected_at
                self._put(m._replace(suspected_at=suspected_at, stream_lost=True))
                self._jp().disconnected(replica_id, now)
                self._record_failure(now, "disconnect", replica_id, incarnation, "", "", "heartbeat stream ended")

    def accuse(
        self, replica_id: str, incarnation: str, now: float, *, quorum_id: int = 0, reporter: str = "", reason: str = ""
    ) -> Accusation:
        """A peer reports that the member failed."""
        with self._lock:
            self._maybe_sweep(now)
            m = self.members.get(replica_id)
            gone = self.departed.get(replica_id)
            known = m or (gone[0] if gone else None)
            if known is None:
                result = Accusation("UNKNOWN_REPLICA", f"no member {replica_id!r}")
            elif known.report.incarnation != incarnation:
                result = Accusation(
                    "STALE_INCARNATION",
                    f"{replica_id!r} is now incarnation {known.report.incarnation!r}, not {incarnation!r}",
                )
            elif m is None:
                result = Accusation("ALREADY_GONE", f"{replica_id!r} was already out ({gone[2] if gone else ''})")
            else:
                self._jp().accused(replica_id, reporter, reason, "", now)  # (before it may depart)
                suspect = m if m.suspected_at is not None else m._replace(suspected_at=now)
                self._put(suspect)
                silent = now - m.last_seen
                if m.stream_lost or not is_alive(suspect, now, self.settings):
                    # Silent for the suspect window, or its connection is gone as well: two
                    # independent signs of death.
                    self._depart(replica_id, now, "report")
                    self.failure_epoch += 1
                    broken = ", its heartbeat stream broken" if m.stream_lost else ""
                    result = Accusation("DROPPED", f"{replica_id!r} was silent for {silent * 1000:.0f} ms{broken}")
                else:
                    result = Accusation(
                        "PENDING",
                        f"{replica_id!r} heard from {silent * 1000:.0f} ms ago",
                        death_time(suspect, self.settings),
                    )
            self._record_failure(
                now, "report", replica_id, incarnation, reporter, reason, result.verdict, quorum_id=quorum_id
            )
            if self.job_view is not None:
                self.job_view.failure_report(result.verdict)
            return result

    def confirm(self, replica_id: str, incarnation: str, accused_at: float, now: float) -> Accusation:
        """The verdict on an accusation whose suspect window has passed."""
        with self._lock:
            self._maybe_sweep(now)
            m = self.members.get(replica_id)
            gone = self.departed.get(replica_id)
            if m is not None and m.report.incarnation == incarnation:
                if m.last_seen > accused_at or m.suspected_at is None:
                    result = Accusation("ALIVE", f"{replica_id!r} heartbeat after the report: not removed")
                else:  # asked before the suspect window passed (the caller's deadline came first)
                    result = Accusation(
                        "SUSPECT",
                        f"{replica_id!r} silent for {(now - m.last_seen) * 1000:.0f} ms "
                        "so far: dropped if it stays silent",
                        death_time(m, self.settings),
                    )
            elif gone is not None and gone[0].report.incarnation == incarnation:
                self.failure_epoch += 1
                result = Accusation("DROPPED", f"{replica_id!r} stayed silent ({gone[2]})")
            else:
                result = Accusation("STALE_INCARNATION", f"{replica_id!r} was replaced by a newer incarnation")
            self._record_failure(now, "verdict", replica_id, incarnation, "", "", result.verdict)
            return result

    def _record_failure(
        self,
        now: float,
        kind: str,
        replica_id: str,
        incarnation: str,
        reporter: str,
        reason: str,
        outcome: str,
        *,
        quorum_id: int = 0,
    ) -> None:
        key = (kind, outcome if kind != "disconnect" else "stream_ended")
        self.failure_counts[key] = self.failure_counts.get(key, 0) + 1
        self.failures.append(
            {
                "time": time.time(),
                "t": now,
                "kind": kind,
                "replica_id": replica_id,
                "incarnation": incarnation,
                "reporter": reporter,
                "reason": reason,
                "outcome": outcome,
                "quorum_id": quorum_id,
            }
        )

    def reject(self) -> None:
        with self._lock:
            self.counters["rejected"] += 1

    # -- quorum ------------------------------------------------------------------------------

    def may_form(self, now: float) -> bool:
        """O(1): False only if `evaluate` would certainly not form a quorum now."""
        with self._lock:
            self._maybe_sweep(now)
            n, alive = self._pending, len(self.members)
            if now < self.not_before or n < self.settings.min_replicas or 2 * n <= alive:
                return False
            fast = self.prev is not None and self._pending_prev == len(self.prev.participants)
            timed_out = self._first_request is not None and now >= self._first_request + self.settings.join_timeout_s
            return fast or n == alive or timed_out

    def next_wake(self, now: float) -> float | None:
        """The next time after `now` when time alone may change what `evaluate` answers (what is
        already due is `may_form`'s business)."""
        with self._lock:
            times = [self._next_sweep, self.commits.next_deadline() or float("inf")]
            if self._pending:
                times.append(self.not_before)
                if self._first_request is not None:
                    times.append(self._first_request + self.settings.join_timeout_s)
            future = [t for t in times if now < t < float("inf")]
            return min(future) if future else None

    def _decide(self, now: float) -> Decision:
        """The pure quorum function on the current state (the caller holds the lock)."""
        return compute_quorum(
            self.prev,
            self.members,
            now,
            self.settings,
            failure_epoch=self.failure_epoch,
            positions=self.ledger.positions,
            not_before=self.not_before,
            committed_step=self.committed_step,
        )

    def explain(self, now: float) -> str:
        """Why no quorum forms now (the pure function's reason; nothing changes)."""
        with self._lock:
            return self._decide(now).reason

    def evaluate(self, now: float, *, sweep: bool = True) -> Decision:
        """Run the pure quorum function; if a quorum forms, clear its members' requests and record it.
        `sweep=False` right after `may_form` (which swept if anything could have died since)."""
        with self._lock:
            if sweep:
                self._sweep(now)
            else:
                self._maybe_sweep(now)
            self.commits.expire(now)
            decision = self._decide(now)
            if decision.quorum is not None:
                formed = replace(decision.quorum, formation=next(self._formations))
                decision = replace(decision, quorum=formed)
                self._record_quorum(formed, now)
                self.commits.superseded(formed.formation)
            return decision

    def vote_commit(
        self,
        formation: int,
        step: tuple[int, int],
        member: tuple[str, str],
        ok: bool,
        now: float,
        deadline: float,
        reason: str = "",
    ) -> tuple[str, str]:
        """A participant's commit vote (ftjax/coordinator/commits.py). On COMMIT the job has
        committed the step from this moment: the committed step rises and the contributors' data
        positions move past their batches, so a participant that misses the answer heals instead
        of training the step again. Raises NotAParticipant."""
        with self._lock:
            self._maybe_sweep(now)
            self.commits.expire(now)
            decision, why = self.commits.vote(self.prev, formation, step, member, ok, deadline, reason)
            if decision == COMMIT and self.prev is not None and self.prev.formation == formation:
                self.committed_step = max(self.committed_step, self.prev.step + 1)
                self.ledger.committed(self.committed_step)  # (the quorum's contributors, recorded at its formation)
            return decision, why

    def commit_decisions(self, now: float) -> list[tuple[int, tuple[str, str]]]:
        """Formations decided since the last call (deadlines passed by `now` included)."""
        with self._lock:
            self.commits.expire(now)
            return self.commits.take_fresh()

    def _record_quorum(self, q: Quorum, now: float) -> None:
        """A quorum formed: clear its members' requests and record it."""
        if q.no_state:  # a whole-job restart from durable state: the history goes on from there
            self.committed_step = 0
        first = now
        has_state = {}
        for p in q.participants:
            m = self.members[p.replica_id]
            first = min(first, now if m.requested_at is None else m.requested_at)
            has_state[p.replica_id] = m.report.has_state
            self.members[p.replica_id] = MemberState(m.report, m.last_seen, None, m.suspected_at, m.stream_lost)
        if self.prev is None or q.quorum_id != self.prev.quorum_id:
            self.counters["quorum_id_changes"] += 1
        self.prev = q
        self._note_job_step(q, now)
        self._prev_keys = frozenset(q.members)
        # After the sweep every member is alive, so every pending request was a participant's.
        self._pending = self._pending_prev = 0
        self._first_request = None
        self.ledger.record(q)
        # (the page's bookkeeping waits until the answers are out: see `settle_progress`)
        self._progress_backlog.append((q, has_state, now))
        self.counters["quorums"] += 1
        if self.job_view is not None:
            self.job_view.quorum(q)
        self.history.append(
            {
                "quorum_id": q.quorum_id,
                "step": q.step,
                "reason": q.reason,
                "time": time.time(),
                "wait_s": now - first,
                "no_state": q.no_state,
                "participants": [p.replica_id for p in q.participants],
                "healing": {p.replica_id: p.heal_source for p in q.participants if p.healing},
            }
        )

    def _note_job_step(self, q: Quorum, now: float) -> None:
        """The job's step: when it last moved, and the quorums (and retries) formed since."""
        if self.job_step is None or q.step > self.job_step:
            self._progress_at, self._progress_wall = now, time.time()
            self._quorums_since_progress = self._retries_since_progress = 0
        else:
            self._quorums_since_progress += 1
            self._retries_since_progress += any(
                self.members[p.replica_id].report.commit_failures for p in q.participants
            )
        self.job_step = q.step if self.job_step is None else max(self.job_step, q.step)

    # -- status ------------------------------------------------------------------------------

    def _no_progress(self, now: float) -> str | None:
        """Why the job makes no progress, if its step has not moved for NO_PROGRESS_S while
        quorums kept forming after failed attempts (every step fails: a peer nobody can reach, say);
        None otherwise. A quorum that waits for members is not this: `waiting_because` says why."""
        stalled = now - self._progress_at
        if self.job_step is None or stalled < NO_PROGRESS_S or self._retries_since_progress < 2:
            return None
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self._progress_wall))
        text = (
            f"no progress since {since} ({stalled:.0f} s at step {self.job_step}): "
            f"{self._quorums_since_progress} quorums formed since, {self._retries_since_progress} of them "
            "to retry a step whose FTAR failed"
        )
        report = next((f for f in reversed(self.failures) if f["kind"] == "report"), None)
        if report is not None:
            reporter = f"replica {report['reporter']!r}" if report["reporter"] else "a replica"
            text += (
                f"; latest failure report: {reporter} accused {report['replica_id']!r} "
                f"({report['outcome']}): {report['reason']}"
            )
            if report["outcome"] in ("ALIVE", "PENDING", "SUSPECT"):
                text += (
                    " -- the accused replica heartbeats, so it stays in the job, but its peers cannot reach "
                    "it: check the FTAR addresses it advertises and the network between the replicas"
                )
        loopback = sorted(
            f"{rid} ({m.report.ftar_addresses[0]})"
            for rid, m in self.members.items()
            if m.report.ftar_addresses and is_loopback(split_address(m.report.ftar_addresses[0])[0])
        )
        if loopback:
            text += (
                f"; replicas advertising a loopback address (only their own machine reaches it: right only "
                f"if every replica runs there): {', '.join(loopback)}"
            )
        return text

    def summary(self, now: float) -> dict:
        """Counters and gauges, in O(1) (for /metrics, which may be scraped often)."""
        with self._lock:
            self._maybe_sweep(now)
            q = self.prev
            return {
                "counters": dict(self.counters),
                "failure_counts": dict(self.failure_counts),
                "alive": len(self.members),
                "quorum_id": q.quorum_id if q else 0,
                "quorum_size": len(q.participants) if q else 0,
                "step": q.step if q else 0,
                "seconds_since_progress": now - self._progress_at if q else 0.0,
                "stalled": self._no_progress(now) is not None,
            }

    def metrics_view(self, now: float) -> dict:
        """What /metrics shows beyond `summary`: the job's figures and one row per replica (O(replicas))."""
        with self._lock:
            self._maybe_sweep(now)
            rows = []
            for rid, m, alive in [
                *((rid, m, True) for rid, m in self.members.items()),
                *((rid, g[0], False) for rid, g in self.departed.items()),
            ]:
                rows.append(
                    {
                        "replica_id": rid,
                        "alive": alive and is_alive(m, now, self.settings),
                        "step": m.report.step,
                        "heartbeat_age_s": now - m.last_seen,
                        "healing": self.prev is not None
                        and any(p.replica_id == rid and p.healing for p in self.prev.participants),
                        **self._jp().replica(rid, now),
                    }
                )
            return {"job": self._jp().job(now, len(self.members)), "replicas": rows}

    def _replica_row(self, m: MemberState, alive: bool, now: float, why: str = "") -> dict:
        r = m.report
        return {
            "replica_id": r.replica_id,
            "incarnation": r.incarnation,
            "step": r.step,
            "data_position": max(r.data_position, self.ledger.position(r.replica_id)),
            "has_state": r.has_state,
            "num_hosts": len(r.catchup_addresses),
            "heartbeat_age_s": round(now - m.last_seen, 3),
            "alive": alive,
            "requesting": m.requested_at is not None,
            "suspected": m.suspected_at is not None,
            "departed_because": why,
        }

    def _replica_rows(self, now: float) -> list[dict]:
        """The snapshot's replicas, alive and departed, in replica-id order."""
        replicas = [self._replica_row(m, is_alive(m, now, self.settings), now) for m in self.members.values()]
        replicas += [
            self._replica_row(m, False, now, why) | {"departed_s": round(now - when, 3)}
            for m, when, why in self.departed.values()
        ]
        replicas.sort(key=lambda r: _replica_order(r["replica_id"]))
        for r in replicas:
            r.update(self._jp().replica(r["replica_id"], now))
        return replicas

    def _quorum_view(self) -> dict | None:
        """The snapshot's current quorum (None: none formed yet)."""
        q = self.prev
        if q is None:
            return None
        return {
            "quorum_id": q.quorum_id,
            "step": q.step,
            "reason": q.reason,
            "no_state": q.no_state,
            "num_contributors": q.num_contributors,
            "participants": [
                {
                    "replica_id": p.replica_id,
                    "incarnation": p.incarnation,
                    "step": p.step,
                    "healing": p.healing,
                    "heal_source": p.heal_source,
                }
                for p in q.participants
            ],
        }

    def _settings_view(self) -> dict:
        s = self.settings
        return {
            "min_replicas": s.min_replicas,
            "join_timeout_s": s.join_timeout_s,
            "heartbeat_timeout_s": s.heartbeat_timeout_s,
            "suspect_window_s": s.suspect_window_s,
        }

    def _progress_view(self, now: float) -> dict:
        return {
            "step": self.job_step,
            "since": self._progress_wall,
            "committed_step": self.committed_step,
            "finished_step": self.finished_step,
            "seconds": round(now - self._progress_at, 3),
            "quorums_since": self._quorums_since_progress,
            "retries_since": self._retries_since_progress,
        }

    def snapshot(self, now: float) -> dict:
        """A JSON-able picture for the status page and /status."""
        with self._lock:
            replicas = self._replica_rows(now)
            failures = [
                {k: v for k, v in f.items() if k != "t"} | {"age_s": round(now - f["t"], 3)} for f in self.failures
            ]
            return {
                "settings": self._settings_view(),
                "uptime_s": round(now - self.started_at, 3),
                "topology_fingerprint": self.fingerprint,
                "alive": sum(r["alive"] for r in replicas),
                "replicas": replicas,
                "quorum": self._quorum_view(),
                "waiting_because": self._decide(now).reason if self._pending else "no pending request",
                "progress": self._progress_view(now),
                "no_progress": self._no_progress(now),
                "history": list(self.history)[::-1],
                "failures": failures[::-1],
                "counters": dict(self.counters),
                "commit_decisions": dict(self.commits.counts),  # (ft.commit_decision: coordinator; else zeros)
                "failure_counts": {f"{source}:{kind}": n for (source, kind), n in self.failure_counts.items()},
                "failure_epoch": self.failure_epoch,
                "expected_replicas": self.settings.expected_replicas,
                "now": round(time.time(), 3),
                "started_at": self._jp().wall(self.started_at),
                "pending": self._pending,
                "job": self._jp().job(now, len(self.members)),
                "incidents": self._jp().incident_rows(now),
                "timeline": self._jp().timeline(now),
                "loss_curve": [list(p) for p in self._jp().loss_points],
            }


def _replica_order(replica_id: str) -> tuple:
    """Replica ids in numeric order where they are numbers ("2" before "10")."""
    return (0, int(replica_id), "") if replica_id.isdigit() else (1, 0, replica_id)
