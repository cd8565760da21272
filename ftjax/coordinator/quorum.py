"""Quorum formation, as a pure function.

`compute_quorum(prev, members, now, settings)` decides from the previous quorum, each member's
latest report and heartbeat, and the time, whether a quorum forms now and who heals from whom; if
not, until when nothing but a new event can change the answer. It reads no clock, holds no lock,
knows nothing of gRPC: the server feeds it, and the tests feed it tables of cases.

The rules (torchft's lighthouse rules, plus fast failure exclusion):
- a member is *alive* if its last heartbeat (or request) is younger than the heartbeat timeout,
  and it is not a suspect that has been silent for the suspect window (a suspect is a member
  accused by a peer, or whose heartbeat stream broke);
- the alive members that have asked for a quorum are the *requesters*; a quorum is formed of all
  of them when there are at least `min_replicas`, more than half of the alive members (so two
  halves of a partitioned job can never both form one), and either every member of the previous
  quorum is back (fast path), or every alive member has asked, or the join timeout has passed
  since the first pending request (stragglers that heartbeat but have not asked are left out);
- except a live member of the previous quorum: it may be committing that quorum's step, so no
  quorum forms without it until it asks or is dead (else two groups could commit the same step
  number with different updates);
- at job start (no requester has state) the quorum waits, up to `startup_timeout_s`, for
  `expected_replicas` to ask, so that a job's replicas start together;
- nothing forms until the coordinator has listened for one heartbeat timeout since it started
  (`not_before`): before that it cannot know who is alive, so neither "everybody asked" nor the
  split-brain guard could be trusted (this is what makes a coordinator restart safe);
- the quorum id changes only when the participant set (replica id, incarnation) changes, a
  participant reports commit failures, or a failure report was accepted since the last quorum;
- one history: no quorum forms whose participants with state are all behind the step the job has
  committed (`committed_step`, the highest step a member with state reported): it would commit
  those steps a second time, in another lineage. It waits for a member that holds the step (its
  peers heal from it); a job that finished tells such late members so (coordinator/state.py);
- a participant heals if it has no state or is behind the max step; the up-to-date participants
  are its sources, assigned round-robin in replica-id order;
- a participant at the max step whose state digest of that step differs from the one the quorum
  keeps (the most common among those reported; a tie keeps the digest of the first replica id) has
  *diverged*: it heals too, from a participant that kept the digest (`diverged_members`).
  If no participant has state the quorum still forms with `no_state` set and nobody healing: they
  restore a durable checkpoint.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ftjax.base.net import split_address
from ftjax.config import CoordinatorConfig, validated

_DEFAULTS = CoordinatorConfig()

# Bounds on what a member may send; the server rejects anything beyond them, naming the field.
MAX_HOSTS = 1024
MAX_STRING_BYTES = 256
MAX_REASON_BYTES = 1024
# A client reconnects to a coordinator that went away with capped exponential backoff and jitter
# (client._Backoff, grpc's max_reconnect_backoff_ms): after a restart a live member may wait up to
# RECONNECT_CAP_S x 1.25 before it even tries. A restarted coordinator listens at least that long,
# plus a heartbeat's round trip, before its first quorum (CoordinatorState.not_before), so that no
# live member is left out of it for a timer that had not fired yet.
RECONNECT_CAP_S = 1.0
RECONNECT_WINDOW_S = RECONNECT_CAP_S * 1.25 + 0.25
MAX_STEP = 2**62  # leaves int64 headroom for step + 1 and position + 1
MAX_TIMEOUT_MS = 86_400_000
_ID = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


class InvalidField(ValueError):
    """A field of a message is malformed; `field` names it (e.g. ``member.ftar_addresses[2]``)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


def check_id(field: str, value: str) -> None:
    """Replica ids and incarnations: 1-64 characters of [A-Za-z0-9_.-]."""
    if not isinstance(value, str) or not _ID.fullmatch(value):
        shown = value if len(value) <= 80 else value[:80] + "..."
        raise InvalidField(field, f"{shown!r} is not 1-64 characters of [A-Za-z0-9_.-]")


def check_int(field: str, value: int, lo: int, hi: int) -> None:
    if not lo <= value <= hi:
        raise InvalidField(field, f"{value} is outside [{lo}, {hi}]")


def check_text(field: str, value: str, max_bytes: int = MAX_STRING_BYTES) -> None:
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise InvalidField(field, f"{size} bytes, at most {max_bytes}")


def check_address(field: str, value: str) -> None:
    """A "host:port" address (see split_address)."""
    check_text(field, value)
    try:
        split_address(value)
    except ValueError as e:
        raise InvalidField(field, str(e)) from None


# The records below are NamedTuples rather than dataclasses: the coordinator creates one per
# heartbeat and per request (thousands a second), and a tuple is several times cheaper to build.


class MemberReport(NamedTuple):
    """What a replica's leader said about its replica in its latest heartbeat or quorum request."""

    replica_id: str
    incarnation: str
    step: int = 0
    data_position: int = 0
    has_state: bool = True
    ftar_addresses: tuple[str, ...] = ()  # one per gradient lane (the job's mesh.hosts)
    catchup_addresses: tuple[str, ...] = ()  # one per host rank (fewer in a reduced-degree replica)
    topology_fingerprint: str = ""
    commit_failures: int = 0
    known_quorum_id: int = 0  # the quorum id whose membership the member holds (0: none)
    digest: str = ""  # the digest of its state at `step` (empty: not computed at this step)

    @property
    def key(self) -> tuple[str, str]:
        return (self.replica_id, self.incarnation)

    def static_fields(self) -> tuple:
        """The fields that may not change within one incarnation."""
        return (self.ftar_addresses, self.catchup_addresses, self.topology_fingerprint)

    def validate(self, prefix: str = "member", *, static: bool = True) -> None:
        """Raise InvalidField naming the first field out of bounds. `static=False` skips the fields
        that are fixed for an incarnation (for a caller that has validated them before)."""
        check_int(f"{prefix}.step", self.step, 0, MAX_STEP)
        check_int(f"{prefix}.data_position", self.data_position, 0, MAX_STEP)
        check_int(f"{prefix}.commit_failures", self.commit_failures, 0, MAX_STEP)
        check_text(f"{prefix}.digest", self.digest)
        if not static:
            return
        check_id(f"{prefix}.replica_id", self.replica_id)
        check_id(f"{prefix}.incarnation", self.incarnation)
        check_int(f"{prefix}.num_hosts", len(self.catchup_addresses), 1, MAX_HOSTS)
        check_int(f"{prefix}.lanes", len(self.ftar_addresses), 1, MAX_HOSTS)
        for i, address in enumerate(self.ftar_addresses):
            check_address(f"{prefix}.ftar_addresses[{i}]", address)
        if len(self.ftar_addresses) % len(self.catchup_addresses):
            raise InvalidField(
                f"{prefix}.ftar_addresses",
                f"{len(self.ftar_addresses)} lanes for "
                f"{len(self.catchup_addresses)} hosts: each host serves the same number of lanes",
            )
        for i, address in enumerate(self.catchup_addresses):
            check_address(f"{prefix}.catchup_addresses[{i}]", address)
        check_text(f"{prefix}.topology_fingerprint", self.topology_fingerprint)
        if not self.topology_fingerprint:
            raise InvalidField(f"{prefix}.topology_fingerprint", "empty")


class MemberState(NamedTuple):
    """A member as the coordinator sees it: its latest report and what it knows of its liveness."""

    report: MemberReport
    last_seen: float  # last heartbeat or request, on the coordinator's clock
    requested_at: float | None = None  # when its pending quorum request arrived (None: not asking)
    suspected_at: float | None = None  # accused by a peer, or its heartbeat stream broke
    stream_lost: bool = False  # its heartbeat stream broke (and it has not reconnected)


@dataclass(frozen=True, slots=True)
class Settings:
    """The rules' settings, durations in seconds: ftjax.config.CoordinatorConfig's fields (their
    defaults, meanings and checks are the config's) plus the job's size."""

    min_replicas: int = _DEFAULTS.min_replicas
    join_timeout_s: float = _DEFAULTS.join_timeout_s  # wait for alive members that have not asked yet
    heartbeat_timeout_s: float = _DEFAULTS.heartbeat_timeout_s  # silence after which a member is dead
    # A suspect (accused, or its stream broke) is dead once silent this long. Three default
    # heartbeat intervals: long enough that a live member's heartbeat always lands in it on a busy
    # machine, short enough that a dead one is out well within half a second of the report.
    suspect_window_s: float = _DEFAULTS.suspect_window_s
    # Job start (every requester without state): wait up to `startup_timeout_s` for this many
    # replicas, so that a job's replicas all start together instead of the first ones to finish
    # importing JAX training while the others heal from them. 0: off.
    expected_replicas: int = 0
    startup_timeout_s: float = _DEFAULTS.startup_timeout_s

    @classmethod
    def from_config(cls, config: CoordinatorConfig, expected_replicas: int = 0) -> Settings:
        return cls(**config.model_dump(), expected_replicas=expected_replicas)

    def __post_init__(self) -> None:
        # the config's checks: ConfigError (a ValueError) naming the field, e.g. coordinator.min_replicas
        validated(
            CoordinatorConfig, {name: getattr(self, name) for name in CoordinatorConfig.model_fields}, "coordinator"
        )


def death_time(member: MemberState, settings: Settings) -> float:
    """When the member counts as dead if nothing more is heard from it: one heartbeat timeout
    after it was last heard from, or one suspect window if it is a suspect."""
    if member.suspected_at is not None:
        return member.last_seen + min(settings.heartbeat_timeout_s, settings.suspect_window_s)
    return member.last_seen + settings.heartbeat_timeout_s


def is_alive(member: MemberState, now: float, settings: Settings) -> bool:
    """Alive: heard from within the heartbeat timeout, and not a suspect silent for the suspect window."""
    return now < death_time(member, settings)


class Participant(NamedTuple):
    replica_id: str
    incarnation: str
    step: int
    data_position: int  # max(what it reported, the coordinator's record)
    ftar_addresses: tuple[str, ...]
    catchup_addresses: tuple[str, ...]
    healing: bool
    heal_source: str  # replica_id of its source; empty if not healing


@dataclass(frozen=True, slots=True)
class Quorum:
    quorum_id: int
    step: int  # max step among participants with state (with no_state: max step reported)
    participants: tuple[Participant, ...]  # ordered by replica_id
    no_state: bool = False  # no participant has state: nobody heals, all restore a checkpoint
    failure_epoch: int = 0  # accepted failure reports counted when it formed
    reason: str = ""  # fast_path | all_joined | join_timeout
    diverged: Mapping[str, str] = field(default_factory=dict)  # replica_id -> the digest kept (it heals)
    # Unique per formation (the coordinator numbers them; a retried step with unchanged members has
    # the same quorum_id and step): what a commit vote names (ftjax/coordinator/commits.py). 0: unset.
    formation: int = field(default=0, compare=False)
    # (replica_id, incarnation) of each participant: computed once, compared on every formation
    members: tuple[tuple[str, str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", tuple([(p.replica_id, p.incarnation) for p in self.participants]))

    @property
    def num_contributors(self) -> int:
        return sum(not p.healing for p in self.participants)

    def rank(self, replica_id: str) -> int:
        for i, p in enumerate(self.participants):
            if p.replica_id == replica_id:
                return i
        raise KeyError(replica_id)


@dataclass(frozen=True, slots=True)
class Decision:
    quorum: Quorum | None  # formed now, or None: wait
    wake_at: float | None  # waiting: when time alone may change the answer (None: only an event can)
    reason: str


def _earliest(*times: float | None) -> float | None:
    present = [t for t in times if t is not None]
    return min(present) if present else None


class _Census(NamedTuple):
    """The alive members as the rules see them at one time (one pass over `members`)."""

    requesters: dict[str, MemberState]  # the alive members with a pending request
    alive: int
    first_request: float | None  # the earliest pending request (None: no requester)
    next_death: float | None  # the earliest death time of an alive member that has not asked

    @property
    def n(self) -> int:
        return len(self.requesters)

    @property
    def first(self) -> float:
        """`first_request` where the rules ask for it: only once there are requesters."""
        assert self.first_request is not None, "no pending request"
        return self.first_request


def _census(members: Mapping[str, MemberState], now: float, settings: Settings) -> _Census:
    requesters: dict[str, MemberState] = {}
    alive = 0
    first_request = None
    # Only an alive member that has not asked can unblock a quorum by dying (a requester dying
    # never helps), so only their death times are wake-ups.
    next_death = None
    for rid, m in members.items():
        t = death_time(m, settings)
        if now >= t:  # dead (see is_alive)
            continue
        alive += 1
        if m.requested_at is not None:
            requesters[rid] = m
            if first_request is None or m.requested_at < first_request:
                first_request = m.requested_at
        elif next_death is None or t < next_death:
            next_death = t
    return _Census(requesters, alive, first_request, next_death)


def _still_listening(now: float, not_before: float | None) -> Decision | None:
    """Nothing forms before `not_before`: until then the coordinator cannot know who is alive."""
    if not_before is not None and now < not_before:
        return Decision(None, not_before, f"listening for heartbeats until t={not_before:.3f} before the first quorum")
    return None


def _below_min_replicas(c: _Census, settings: Settings) -> Decision | None:
    if c.n < settings.min_replicas:
        return Decision(None, None, f"{c.n} requesters, need min_replicas={settings.min_replicas}")
    return None


def _no_majority(c: _Census) -> Decision | None:
    """The split-brain guard: the requesters must be more than half of the alive members."""
    if 2 * c.n <= c.alive:
        return Decision(None, c.next_death, f"{c.n} requesters of {c.alive} alive members: need more than half")
    return None


def _waiting_for_job_start(c: _Census, now: float, settings: Settings) -> Decision | None:
    """At job start (no requester has state), wait up to the startup timeout for the expected replicas."""
    if c.n < settings.expected_replicas and not any(m.report.has_state for m in c.requesters.values()):
        deadline = c.first + settings.startup_timeout_s
        if now < deadline:
            return Decision(
                None,
                _earliest(deadline, c.next_death),
                f"job start: {c.n} of {settings.expected_replicas} expected replicas have asked",
            )
    return None


def _waiting_for_previous_quorum(
    prev: Quorum | None, members: Mapping[str, MemberState], now: float, settings: Settings, next_death: float | None
) -> Decision | None:
    # A live member of the previous quorum that has not asked yet may be committing that quorum's
    # step right now: forming a quorum without it would let two groups commit the same step
    # number with different updates (and lose its batch). So it is waited for, join timeout or
    # not, until it asks or dies (heartbeat timeout, or a confirmed failure report).
    straggler_death, stragglers = None, []
    for p in prev.participants if prev is not None else ():
        m = members.get(p.replica_id)
        if (
            m is not None
            and m.report.incarnation == p.incarnation
            and m.requested_at is None
            and is_alive(m, now, settings)
        ):
            straggler_death = _earliest(straggler_death, death_time(m, settings))
            stragglers.append(f"{p.replica_id} (incarnation {p.incarnation}, heard {now - m.last_seen:.1f} s ago)")
    if straggler_death is not None:  # (named: a wait that lasts says whom it waits for)
        return Decision(
            None,
            _earliest(straggler_death, next_death),
            f"waiting for a live member of the previous quorum to ask: {', '.join(stragglers)}",
        )
    return None


def _formation_reason(prev: Quorum | None, c: _Census, now: float, settings: Settings) -> str | None:
    """Why the requesters form a quorum now: every member of the previous quorum is back
    (fast_path), every alive member asked (all_joined), or the join timeout passed since the first
    request (join_timeout). None: none of these yet."""
    if prev is not None and all(
        (r := c.requesters.get(p.replica_id)) is not None and r.report.incarnation == p.incarnation
        for p in prev.participants
    ):
        return "fast_path"
    if c.n == c.alive:
        return "all_joined"
    if now >= c.first + settings.join_timeout_s:
        return "join_timeout"
    return None


def _waiting_for_stragglers(c: _Census, settings: Settings) -> Decision:
    """Alive members that have not asked are waited for until the join timeout."""
    deadline = c.first + settings.join_timeout_s
    return Decision(
        None,
        _earliest(deadline, c.next_death),
        f"{c.n} of {c.alive} alive members asked; waiting for the rest until the join timeout",
    )


def _behind_committed_step(quorum: Quorum, committed_step: int, next_death: float | None) -> Decision | None:
    """One history: a quorum whose participants with state are all behind the step the job
    committed would commit those steps a second time; wait for a member that holds it."""
    if not quorum.no_state and quorum.step < committed_step:
        return Decision(
            None,
            next_death,
            f"the job committed step {committed_step} but the requesters hold step "
            f"{quorum.step} at most: waiting for a member that holds it (training from step "
            f"{quorum.step} would commit steps {quorum.step + 1}-{committed_step} a second time)",
        )
    return None


def compute_quorum(
    prev: Quorum | None,
    members: Mapping[str, MemberState],
    now: float,
    settings: Settings,
    *,
    failure_epoch: int = 0,
    positions: Mapping[str, int] | None = None,
    not_before: float | None = None,
    committed_step: int = 0,
) -> Decision:
    """Form a quorum of the pending requesters now, or say why not and until when to wait.

    `members` maps replica_id to its state (read only); `positions` is the coordinator's record of
    each replica's data position; `failure_epoch` counts the failure reports accepted so far.
    """
    listening = _still_listening(now, not_before)
    if listening is not None:
        return listening
    c = _census(members, now, settings)
    # The rules in order: the first that says wait decides (each returns None when it does not).
    wait = (
        _below_min_replicas(c, settings)
        or _no_majority(c)
        or _waiting_for_job_start(c, now, settings)
        or _waiting_for_previous_quorum(prev, members, now, settings, c.next_death)
    )
    if wait is not None:
        return wait
    reason = _formation_reason(prev, c, now, settings)
    if reason is None:
        return _waiting_for_stragglers(c, settings)
    quorum = _form(prev, c.requesters, settings, failure_epoch, positions or {}, reason)
    return _behind_committed_step(quorum, committed_step, c.next_death) or Decision(quorum, None, reason)


def _form(
    prev: Quorum | None,
    requesters: Mapping[str, MemberState],
    settings: Settings,
    failure_epoch: int,
    positions: Mapping[str, int],
    reason: str,
) -> Quorum:
    reports = [requesters[rid].report for rid in sorted(requesters)]
    with_state = [r for r in reports if r.has_state]
    no_state = not with_state
    step = max(r.step for r in (reports if no_state else with_state))
    diverged = diverged_members(with_state, step) if not no_state else {}
    sources = [r.replica_id for r in with_state if r.step == step and r.replica_id not in diverged]
    heal_source: dict[str, str] = {}
    if not no_state:
        healers = [r.replica_id for r in reports if not r.has_state or r.step < step or r.replica_id in diverged]
        heal_source = {rid: sources[i % len(sources)] for i, rid in enumerate(healers)}
    # One lookup of the heal source per member (healing is having one): this runs for every member
    # on every step, on the path between the last request and the first answer.
    participants = tuple(
        [
            Participant(
                r.replica_id,
                r.incarnation,
                r.step,
                max(r.data_position, positions.get(r.replica_id, 0)),
                r.ftar_addresses,
                r.catchup_addresses,
                bool(source := heal_source.get(r.replica_id, "")),
                source,
            )
            for r in reports
        ]
    )
    members = tuple([r.key for r in reports])
    unchanged = (
        prev is not None
        and prev.members == members
        and prev.failure_epoch == failure_epoch
        and not any(r.commit_failures for r in reports)
    )
    if unchanged and prev is not None:  # (unchanged: there is a previous quorum)
        quorum_id = prev.quorum_id
    else:
        # Above every id a participant still holds, so that ids never repeat across a restart of
        # the coordinator (which forgets its previous quorum but hears the members' ids).
        floor = max([prev.quorum_id if prev else 0] + [r.known_quorum_id for r in reports])
        quorum_id = floor + 1
    return Quorum(quorum_id, step, participants, no_state, failure_epoch, reason, diverged)


def diverged_members(reports: Sequence[MemberReport], step: int) -> dict[str, str]:
    """replica_id -> the digest kept, for each member of `reports` (in replica-id order) whose digest
    of `step` differs from the kept one: the most common digest of the members at `step` that sent
    one; of two equally common, the first member's (a deterministic rule: with two replicas there is
    no majority, and nothing says which state is right). Empty when they all agree."""
    digests = {r.replica_id: r.digest for r in reports if r.digest and r.step == step}
    if len(set(digests.values())) < 2:
        return {}
    counts = Counter(digests.values())
    kept = max(digests.values(), key=counts.__getitem__)  # (max keeps the first of equals)
    return {rid: kept for rid, d in digests.items() if d != kept}
