"""The quorum rules as tables of cases (pure function, explicit clock), the data-position ledger,
field validation, and the state machine around them (`CoordinatorState`, driven with a fake clock)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from ftjax.coordinator.quorum import (
    RECONNECT_CAP_S,
    RECONNECT_WINDOW_S,
    InvalidField,
    MemberReport,
    MemberState,
    Participant,
    Quorum,
    Settings,
    compute_quorum,
    is_alive,
    split_address,
)
from ftjax.coordinator.state import CoordinatorState, PositionLedger, Rejected

NOW = 100.0
S = Settings(min_replicas=2, join_timeout_s=1.0, heartbeat_timeout_s=2.0, suspect_window_s=0.3)


def report(
    rid: str,
    *,
    inc: str = "1",
    step: int = 5,
    pos: int = 0,
    state: bool = True,
    failures: int = 0,
    known: int = 0,
    fp: str = "fp",
) -> MemberReport:
    return MemberReport(
        rid,
        inc,
        step,
        pos,
        state,
        (f"10.0.0.1:{1000 + ord(rid[0])}",),
        (f"10.0.0.1:{2000 + ord(rid[0])}",),
        fp,
        failures,
        known,
    )


def member(
    rid: str, *, seen: float = NOW - 0.05, asked: float | None = NOW - 0.1, suspected: float | None = None, **kw
) -> MemberState:
    return MemberState(report(rid, **kw), seen, asked, suspected)


def table(*members: MemberState) -> dict[str, MemberState]:
    return {m.report.replica_id: m for m in members}


def prev_quorum(qid: int, *rids: str, inc: str = "1", epoch: int = 0) -> Quorum:
    return Quorum(qid, 5, tuple(Participant(r, inc, 5, 0, (), "", False, "") for r in rids), failure_epoch=epoch)


# name, previous quorum, members, expected participants (None: wait), expected reason (substring),
# expected quorum id (formed) or wake-up time (waiting)
FORMATION = [
    ("below min_replicas", None, table(member("a"), member("b", asked=None)), None, "min_replicas=2", None),
    (
        "first quorum: every alive member asked",
        None,
        table(member("a"), member("b"), member("c")),
        "abc",
        "all_joined",
        1,
    ),
    (
        "straggler inside the join timeout: wait for it",
        None,
        table(member("a", asked=NOW - 0.5), member("b", asked=NOW - 0.4), member("c", asked=None)),
        None,
        "join timeout",
        NOW + 0.5,
    ),
    (
        "straggler after the join timeout: left out",
        None,
        table(member("a", asked=NOW - 1.5), member("b", asked=NOW - 0.2), member("c", asked=None)),
        "ab",
        "join_timeout",
        1,
    ),
    (
        "split brain: 2 requesters of 5 alive never form",
        None,
        table(
            member("a", asked=NOW - 5),
            member("b", asked=NOW - 5),
            member("c", asked=None, seen=NOW - 1.5),
            member("d", asked=None),
            member("e", asked=None),
        ),
        None,
        "more than half",
        NOW + 0.5,
    ),  # c's heartbeat expires first
    (
        "split brain: exactly half is not enough",
        None,
        table(member("a", asked=NOW - 5), member("b", asked=NOW - 5), member("c", asked=None), member("d", asked=None)),
        None,
        "more than half",
        NOW - 0.05 + 2.0,
    ),
    (
        "fast path: the previous quorum is back, a straggler is not waited for",
        prev_quorum(7, "a", "b", "c"),
        table(member("a"), member("b"), member("c"), member("d", asked=None)),
        "abc",
        "fast_path",
        7,
    ),
    (
        "fast path takes in a new member that asked",
        prev_quorum(7, "a", "b"),
        table(member("a"), member("b"), member("d")),
        "abd",
        "fast_path",
        8,
    ),
    (
        "a restarted member (new incarnation) is not the fast path",
        prev_quorum(7, "a", "b", "c"),
        table(member("a"), member("b"), member("c", inc="2"), member("d", asked=None)),
        None,
        "join timeout",
        NOW + 0.9,
    ),
    (
        "join during a shrink: c died, d joined",
        prev_quorum(7, "a", "b", "c"),
        table(member("a"), member("b"), member("c", asked=None, seen=NOW - 2.5), member("d")),
        "abd",
        "all_joined",
        8,
    ),
    (
        "join during a shrink, c not expired yet: wait for its death",
        prev_quorum(7, "a", "b", "c"),
        table(member("a", asked=NOW - 0.2), member("b"), member("c", asked=None, seen=NOW - 1.5), member("d")),
        None,
        "previous quorum",
        NOW + 0.5,
    ),
    # a live member of the previous quorum may be committing its step: never left out while alive
    (
        "join during a shrink, join timeout passed: still wait for the previous member's death",
        prev_quorum(7, "a", "b", "c"),
        table(member("a", asked=NOW - 1.2), member("b"), member("c", asked=None, seen=NOW - 1.5), member("d")),
        None,
        "previous quorum",
        NOW + 0.5,
    ),
    (
        "join during a shrink, the previous member dead: the newcomer is in",
        prev_quorum(7, "a", "b", "c"),
        table(member("a", asked=NOW - 1.2), member("b"), member("c", asked=None, seen=NOW - 2.1), member("d")),
        "abd",
        "all_joined",
        8,
    ),
    (
        "a new member after the join timeout is left out; a previous one is not",
        prev_quorum(7, "a", "b"),
        table(member("a", asked=NOW - 1.5), member("b"), member("d", asked=None)),
        "ab",
        "fast_path",
        7,
    ),
    (
        "shrink without a newcomer",
        prev_quorum(7, "a", "b", "c"),
        table(member("a"), member("b"), member("c", seen=NOW - 2.0)),
        "ab",
        "all_joined",
        8,
    ),
    (
        "a silent suspect is dead at once",
        prev_quorum(7, "a", "b", "c"),
        table(member("a"), member("b"), member("c", asked=None, seen=NOW - 0.31, suspected=NOW - 0.1)),
        "ab",
        "all_joined",
        8,
    ),
    (
        "a suspect heard from recently is still alive",
        prev_quorum(7, "a", "b", "c"),
        table(member("a"), member("b"), member("c", asked=None, seen=NOW - 0.1, suspected=NOW - 0.05)),
        None,
        "previous quorum",
        NOW + 0.2,
    ),
    (
        "a dead requester is not a participant",
        None,
        table(member("a"), member("b"), member("c", seen=NOW - 2.01)),
        "ab",
        "all_joined",
        1,
    ),
    (
        "commit failures force a new id",
        prev_quorum(7, "a", "b"),
        table(member("a"), member("b", failures=1)),
        "ab",
        "fast_path",
        8,
    ),
    (
        "ids stay above what members hold (coordinator restart)",
        None,
        table(member("a", known=41), member("b", known=40)),
        "ab",
        "all_joined",
        42,
    ),
]


@pytest.mark.parametrize("name,prev,members,expected,reason,number", FORMATION, ids=[c[0] for c in FORMATION])
def test_formation(name, prev, members, expected, reason, number):
    d = compute_quorum(prev, members, NOW, S)
    assert reason in d.reason
    if expected is None:
        assert d.quorum is None
        assert d.wake_at == pytest.approx(number)
    else:
        assert d.quorum is not None
        assert "".join(p.replica_id for p in d.quorum.participants) == expected
        assert d.quorum.quorum_id == number
        assert d.wake_at is None


def test_quorum_id_changes_after_an_accepted_failure_report():
    members = table(member("a"), member("b"))
    assert compute_quorum(prev_quorum(3, "a", "b"), members, NOW, S).quorum.quorum_id == 3
    assert compute_quorum(prev_quorum(3, "a", "b"), members, NOW, S, failure_epoch=1).quorum.quorum_id == 4


def test_nothing_forms_before_the_coordinator_has_listened_long_enough():
    members = table(member("a"), member("b"))
    d = compute_quorum(None, members, NOW, S, not_before=NOW + 0.7)
    assert d.quorum is None and d.wake_at == NOW + 0.7
    assert compute_quorum(None, members, NOW + 0.7, S, not_before=NOW + 0.7).quorum is not None


def test_job_start_waits_for_the_expected_replicas_until_the_startup_timeout():
    s = Settings(
        min_replicas=1, join_timeout_s=1.0, heartbeat_timeout_s=2.0, expected_replicas=3, startup_timeout_s=2.5
    )
    fresh = table(member("a", state=False, asked=NOW - 2), member("b", state=False, asked=NOW - 1.5))
    d = compute_quorum(None, fresh, NOW, s)
    assert d.quorum is None and "2 of 3 expected" in d.reason and d.wake_at == NOW + 0.5
    assert compute_quorum(None, fresh, NOW + 0.51, s).quorum is not None  # the timeout passed
    everyone = table(*fresh.values(), member("c", state=False))
    assert [p.replica_id for p in compute_quorum(None, everyone, NOW, s).quorum.participants] == ["a", "b", "c"]
    # mid-run (somebody has state, e.g. after a coordinator restart) the rule does not apply
    running = table(member("a", asked=NOW - 2), member("b", asked=NOW - 1.5))
    assert compute_quorum(None, running, NOW, s).quorum is not None


def test_min_replicas_applies_to_the_fast_path_too():
    d = compute_quorum(prev_quorum(2, "a"), table(member("a")), NOW, S)
    assert d.quorum is None


# (replica: (step, has_state)) -> expected {healer: source}, max step, no_state
HEALING = [
    ("one behind heals from the up-to-date", {"a": (5, True), "b": (5, True), "c": (3, True)}, {"c": "a"}, 5, False),
    ("a restarted replica without state heals", {"a": (5, True), "b": (0, False)}, {"b": "a"}, 5, False),
    ("stateless but claiming a high step still heals", {"a": (5, True), "b": (9, False)}, {"b": "a"}, 5, False),
    (
        "healers spread over sources round robin",
        {
            "a": (7, True),
            "b": (7, True),
            "c": (7, True),
            "d": (7, True),
            "e": (0, False),
            "f": (6, True),
            "g": (2, True),
        },
        {"e": "a", "f": "b", "g": "c"},
        7,
        False,
    ),
    (
        "more healers than sources wrap around",
        {"a": (4, True), "b": (1, True), "c": (4, True), "d": (0, False), "e": (3, True), "f": (0, False)},
        {"b": "a", "d": "c", "e": "a", "f": "c"},
        4,
        False,
    ),
    ("nobody has state: nobody heals, flagged", {"a": (0, False), "b": (3, False)}, {}, 3, True),
]


@pytest.mark.parametrize("name,replicas,healing,step,no_state", HEALING, ids=[c[0] for c in HEALING])
def test_healing(name, replicas, healing, step, no_state):
    members = table(*(member(r, step=s, state=h) for r, (s, h) in replicas.items()))
    q = compute_quorum(None, members, NOW, S).quorum
    assert q.step == step and q.no_state == no_state
    assert {p.replica_id: p.heal_source for p in q.participants if p.healing} == healing
    assert all(p.heal_source == "" for p in q.participants if not p.healing)
    assert q.num_contributors == len(replicas) - len(healing)


# (replica: (step, digest)) -> expected {healer: source}, {diverged: digest kept}
DIVERGENCE = [
    ("the minority heals from the majority", {"a": (5, "x"), "b": (5, "y"), "c": (5, "y")}, {"a": "b"}, {"a": "y"}),
    ("a tie keeps the first replica id's digest", {"a": (5, "x"), "b": (5, "y")}, {"b": "a"}, {"b": "x"}),
    ("one without a digest of this step is no vote", {"a": (5, "x"), "b": (5, ""), "c": (5, "x")}, {}, {}),
    ("a digest of an older step is no vote", {"a": (5, "x"), "b": (4, "y"), "c": (5, "x")}, {"b": "a"}, {}),
    (
        "two minorities heal, from the majority only",
        {"a": (5, "x"), "b": (5, "y"), "c": (5, "z"), "d": (5, "y"), "e": (3, "")},
        {"a": "b", "c": "d", "e": "b"},
        {"a": "y", "c": "y"},
    ),
]


@pytest.mark.parametrize("name,replicas,healing,diverged", DIVERGENCE, ids=[c[0] for c in DIVERGENCE])
def test_a_replica_whose_digest_differs_from_the_majority_heals_from_it(name, replicas, healing, diverged):
    members = table(
        *(MemberState(report(r, step=s)._replace(digest=d), NOW - 0.05, NOW - 0.1) for r, (s, d) in replicas.items())
    )
    q = compute_quorum(None, members, NOW, S).quorum
    assert {p.replica_id: p.heal_source for p in q.participants if p.healing} == healing
    assert dict(q.diverged) == diverged


def test_the_diverged_replica_is_told_the_digest_kept_and_its_peers_are_not():
    from ftjax.coordinator.codec import QuorumEncoding, decode_quorum

    members = table(*(MemberState(report(r)._replace(digest=d), NOW - 0.05, NOW - 0.1) for r, d in zip("ab", "xy")))
    enc = QuorumEncoding(compute_quorum(None, members, NOW, S).quorum)
    a, b = (decode_quorum(enc.for_member(rank, 0)) for rank in (0, 1))
    assert (a.majority_digest, a.healing) == ("", False)
    assert (b.majority_digest, b.healing, b.heal_source) == ("x", True, "a")


def test_participants_carry_the_ledgers_position_when_it_is_ahead():
    members = table(member("a", pos=10), member("b", pos=3, state=False, step=0))
    q = compute_quorum(None, members, NOW, S, positions={"a": 4, "b": 8}).quorum
    assert [p.data_position for p in q.participants] == [10, 8]


def test_liveness_boundaries():
    assert is_alive(member("a", seen=NOW - 1.999), NOW, S)
    assert not is_alive(member("a", seen=NOW - 2.0), NOW, S)
    assert is_alive(member("a", seen=NOW - 0.299, suspected=NOW), NOW, S)
    assert not is_alive(member("a", seen=NOW - 0.3, suspected=NOW), NOW, S)


# -- data positions ------------------------------------------------------------------------------


def _quorum_at(step: int, *parts: tuple[str, int, bool]) -> Quorum:
    return Quorum(
        1, step, tuple(Participant(r, "1", step, pos, (), "", heal, "x" if heal else "") for r, pos, heal in parts)
    )


def test_ledger_advances_every_contributor_once_somebody_committed():
    ledger = PositionLedger()
    ledger.record(_quorum_at(5, ("a", 10, False), ("b", 20, False), ("c", 0, True)))
    ledger.observe("b", 5, 20)  # b retries step 5: nobody committed it yet
    assert ledger.position("a") == 0 and ledger.position("b") == 20
    ledger.observe("a", 6, 11)  # a committed step 5: b's batch of step 5 was trained too
    assert (ledger.position("a"), ledger.position("b"), ledger.position("c")) == (11, 21, 0)
    assert ledger.pending_steps() == []


def test_ledger_retry_replaces_the_record_and_old_steps_apply_in_order():
    ledger = PositionLedger()
    ledger.record(_quorum_at(5, ("a", 10, False), ("b", 20, False)))
    ledger.record(_quorum_at(5, ("a", 10, False)))  # retry of step 5 without b
    ledger.record(_quorum_at(6, ("a", 11, False)))
    ledger.observe("a", 7, 12)
    assert (ledger.position("a"), ledger.position("b")) == (12, 0)


def test_ledger_forgets_on_a_whole_job_restart_from_checkpoint():
    ledger = PositionLedger()
    ledger.observe("a", 5, 50)
    ledger.record(Quorum(2, 0, (Participant("a", "2", 0, 50, (), "", False, ""),), no_state=True))
    assert ledger.position("a") == 0 and ledger.pending_steps() == []


# -- validation ------------------------------------------------------------------------------------

BAD_FIELDS = [
    ("member.replica_id", dict(replica_id="")),
    ("member.replica_id", dict(replica_id="a b")),
    ("member.replica_id", dict(replica_id="x" * 65)),
    ("member.replica_id", dict(replica_id="r\x00")),
    ("member.incarnation", dict(incarnation="in/c")),
    ("member.step", dict(step=-1)),
    ("member.data_position", dict(data_position=-5)),
    ("member.commit_failures", dict(commit_failures=-1)),
    ("member.num_hosts", dict(catchup_addresses=())),
    ("member.num_hosts", dict(catchup_addresses=("h:1",) * 1025)),
    ("member.lanes", dict(ftar_addresses=())),
    ("member.lanes", dict(ftar_addresses=("h:1",) * 1025)),
    ("member.ftar_addresses[1]", dict(ftar_addresses=("h:1", "nohostport"))),
    ("member.ftar_addresses[0]", dict(ftar_addresses=("h:70000",))),
    ("member.ftar_addresses[0]", dict(ftar_addresses=("h" * 300 + ":1",))),
    ("member.catchup_addresses[0]", dict(catchup_addresses=(":80",))),
    ("member.topology_fingerprint", dict(topology_fingerprint="")),
    ("member.topology_fingerprint", dict(topology_fingerprint="f" * 257)),
]


@pytest.mark.parametrize("field,change", BAD_FIELDS, ids=[f"{f}:{next(iter(c))}" for f, c in BAD_FIELDS])
def test_validation_names_the_bad_field(field, change):
    with pytest.raises(InvalidField) as e:
        report("a")._replace(**change).validate()
    assert e.value.field == field and field in str(e.value)


def test_valid_report_and_ipv6_address_pass():
    report("a")._replace(
        ftar_addresses=("[::1]:5000", "host-2.example:6000"), catchup_addresses=("[::1]:5001", "host-2.example:6001")
    ).validate()


def test_each_host_serves_the_same_number_of_lanes():
    two_hosts = ("h1:5001", "h2:5001")
    with pytest.raises(InvalidField, match="member.ftar_addresses: 3 lanes for 2 hosts"):
        report("a")._replace(ftar_addresses=("h1:5000", "h2:5000", "h3:5000"), catchup_addresses=two_hosts).validate()
    # a reduced-degree replica: one host serves both lanes of a job of 2-host replicas
    report("a")._replace(ftar_addresses=("h1:5000", "h1:5002"), catchup_addresses=("h1:5001",)).validate()
    report("a")._replace(ftar_addresses=("h1:5000", "h2:5000"), catchup_addresses=two_hosts).validate()


def test_settings_are_checked():
    with pytest.raises(ValueError, match="min_replicas"):
        Settings(min_replicas=0)
    with pytest.raises(ValueError, match="suspect_window"):
        Settings(heartbeat_timeout_s=0.2, suspect_window_s=0.3)


# -- the state around the rules (explicit clock) ------------------------------------------------------


def new_state(**kw) -> CoordinatorState:
    return CoordinatorState(dataclasses.replace(S, **kw), 0.0, startup_grace=0.0)


def test_topology_fixed_by_first_member_until_nobody_is_alive():
    state = new_state()
    state.request(report("a", fp="mesh-2x4"), 1.0)
    with pytest.raises(Rejected) as e:
        state.register(report("b", fp="mesh-4x2"), 1.1)
    assert e.value.code == "FAILED_PRECONDITION"
    assert "mesh-2x4" in str(e.value) and "mesh-4x2" in str(e.value)
    assert "b" not in state.members
    state.register(report("b", fp="mesh-4x2"), 5.0)  # a is long dead: b sets the topology afresh
    assert state.fingerprint == "mesh-4x2"


def test_static_fields_cannot_change_within_an_incarnation():
    state = new_state()
    state.register(report("a"), 1.0)
    with pytest.raises(Rejected, match="fixed for an incarnation"):
        state.request(report("a")._replace(catchup_addresses=("10.9.9.9:1",)), 1.1)
    state.request(report("a", inc="2")._replace(catchup_addresses=("10.9.9.9:1",)), 1.2)  # a restart may


def test_accusation_of_a_silent_member_drops_it_and_of_a_live_one_does_not():
    state = new_state()
    for rid in "abc":
        state.register(report(rid), 1.0)
    state.heartbeat("a", "1", 1.9)
    state.heartbeat("b", "1", 1.9)
    # c last heard at 1.0: silent for 1 s > the 0.3 s suspect window
    verdict = state.accuse("c", "1", 2.0, reporter="a")
    assert verdict.verdict == "DROPPED" and verdict.dropped
    assert "c" not in state.members and state.failure_epoch == 1
    # b heard 0.1 s ago: pending, and a heartbeat before the window ends proves it alive
    verdict = state.accuse("b", "1", 2.0, reporter="a")
    assert verdict.verdict == "PENDING" and verdict.confirm_at == pytest.approx(2.2)
    state.heartbeat("b", "1", 2.1)
    assert state.confirm("b", "1", 2.0, 2.25).verdict == "ALIVE"
    assert "b" in state.members and state.failure_epoch == 1
    # a is accused and then stays silent: dropped when its window ends
    assert state.accuse("a", "1", 2.0).verdict == "PENDING"
    assert state.confirm("a", "1", 2.0, 2.21).verdict == "DROPPED"
    assert "a" not in state.members and state.failure_epoch == 2


def test_accusation_with_a_stale_incarnation_or_unknown_member_changes_nothing():
    state = new_state()
    state.register(report("a", inc="2"), 1.0)
    assert state.accuse("a", "1", 1.5).verdict == "STALE_INCARNATION"
    assert state.accuse("zz", "1", 1.5).verdict == "UNKNOWN_REPLICA"
    assert "a" in state.members and state.members["a"].suspected_at is None and state.failure_epoch == 0


def test_broken_heartbeat_stream_makes_a_suspect_that_a_heartbeat_clears():
    state = new_state()
    state.register(report("a"), 1.0)
    state.disconnected("a", "1", 1.05)
    assert state.members["a"].suspected_at == 1.05
    state.register(report("a"), 1.1)  # reconnected
    assert state.members["a"].suspected_at is None
    state.disconnected("a", "1", 1.2)
    assert not state.may_form(1.39) and "a" in state.members
    assert not state.may_form(1.41)  # the sweep runs: dead 0.3 s after it was last heard (1.1)
    assert "a" not in state.members and "a" in state.departed


def test_a_report_against_a_member_whose_stream_broke_drops_it_at_once():
    state = new_state()
    state.register(report("a"), 1.0)
    state.register(report("b"), 1.0)
    state.disconnected("b", "1", 1.01)
    assert state.accuse("b", "1", 1.02).verdict == "DROPPED"  # heard from 20 ms ago, but its connection is gone
    assert "b" not in state.members and state.failure_epoch == 1
    assert state.accuse("a", "1", 1.02).verdict == "PENDING"  # a's stream is fine: wait for its window


def test_a_new_incarnation_replaces_the_old_one():
    state = new_state()
    state.request(report("a", inc="1"), 1.0)
    assert state.request(report("a", inc="2", state=False), 1.5) is True
    assert state.members["a"].report.incarnation == "2"


def test_restart_grace_waits_one_heartbeat_timeout_by_default():
    state = CoordinatorState(S, 10.0)
    state.request(report("a"), 10.1)
    state.request(report("b"), 10.1)
    for t in (10.5, 11.5, 11.99):  # every alive member asked, even the join timeout passed: still wait
        assert not state.may_form(t) and state.evaluate(t).quorum is None
        assert state.next_wake(t) <= 12.0
    assert state.may_form(12.0) and state.evaluate(12.0).quorum is not None


def test_restart_grace_is_never_shorter_than_a_clients_longest_reconnect_wait():
    """With a heartbeat timeout of 1 s, a live client still in a backoff of up to 1.25 s when the
    coordinator comes back would miss its first quorum: the grace is then RECONNECT_WINDOW_S."""
    state = CoordinatorState(dataclasses.replace(S, heartbeat_timeout_s=1.0, suspect_window_s=0.3), 10.0)
    assert state.not_before == 10.0 + RECONNECT_WINDOW_S > 10.0 + RECONNECT_CAP_S * 1.25
    state.request(report("a"), 10.1)
    state.request(report("b"), 10.1)
    for t in (10.5, 10.9, 11.3):  # (their heartbeats)
        state.heartbeat("a", "1", t), state.heartbeat("b", "1", t)
    assert not state.may_form(11.3) and state.evaluate(11.3).quorum is None  # (past the heartbeat timeout)
    end = 10.0 + RECONNECT_WINDOW_S
    assert state.may_form(end) and state.evaluate(end).quorum is not None


# -- the O(1) pre-check never hides a quorum that the pure function would form ------------------------

EVENTS = st.lists(
    st.tuples(
        st.sampled_from(["request"] * 5 + ["heartbeat"] * 3 + ["withdraw", "disconnect", "accuse", "tick"]),
        st.sampled_from("abcde"),
        st.sampled_from(["1", "1", "2"]),
        st.floats(min_value=0.0, max_value=0.8),
    ),
    min_size=1,
    max_size=40,
)


@hsettings(max_examples=200, deadline=None)
@given(EVENTS, st.integers(min_value=1, max_value=3))
def test_may_form_is_never_false_when_a_quorum_would_form(events, min_replicas):
    state = new_state(min_replicas=min_replicas)
    now = 1.0
    for kind, rid, inc, dt in events:
        now += dt
        try:
            if kind == "request":
                state.request(report(rid, inc=inc), now)
            elif kind == "heartbeat":
                state.heartbeat(rid, inc, now)
            elif kind == "withdraw":
                state.withdraw(rid, inc)
            elif kind == "disconnect":
                state.disconnected(rid, inc, now)
            elif kind == "accuse":
                state.accuse(rid, inc, now)
        except Rejected:
            pass
        would = compute_quorum(
            state.prev,
            dict(state.members),
            now,
            state.settings,
            failure_epoch=state.failure_epoch,
            not_before=state.not_before,
        )
        if would.quorum is not None:
            assert state.may_form(now), (kind, rid, would.reason)
            formed = state.evaluate(now).quorum
            assert formed is not None and formed.members == would.quorum.members
        wake = state.next_wake(now)
        assert wake is None or wake > now


@pytest.mark.parametrize(
    "address, expected",
    [
        ("127.0.0.1:80", ("127.0.0.1", 80)),
        ("node-3.cluster:29400", ("node-3.cluster", 29400)),
        ("[::1]:8080", ("::1", 8080)),  # brackets removed: socket calls take the bare host
        ("::1:8080", ("::1", 8080)),  # the port is after the last colon
        *[(bad, None) for bad in ("h", "h:", ":80", "[]:80", "h:+80", "h:8 ", "h:\u0663")],
        *[(bad, "range") for bad in ("h:0", "h:65536", "127.0.0.1:99999")],
    ],
)
def test_split_address(address, expected):
    if expected is None:
        with pytest.raises(ValueError, match="is not host:port"):
            split_address(address)
    elif expected == "range":
        with pytest.raises(ValueError, match=r": port \d+ is not in 1-65535"):
            split_address(address)
    else:
        assert split_address(address) == expected
