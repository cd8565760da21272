"""Commit decisions made by the coordinator (ft.commit_decision: coordinator): the coordinator's
state driven with a fake clock (ftjax/coordinator/commits.py, `CoordinatorState.vote_commit`), and
the step protocol's side of it with fakes: a replica commits a step only on COMMIT."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from fakes import FakeQuorums, FakeReducer, participant, protocol, quorum
from test_quorum import S, report

from ftjax.coordinator.commits import ABORT, COMMIT, PENDING, UNKNOWN, NotAParticipant
from ftjax.coordinator.state import CoordinatorState


def formed(state: CoordinatorState, t: float, *rids: str, step: int = 5, positions=None):
    """Every replica of `rids` asks at step `step`; the quorum they form."""
    for rid in rids:
        state.request(report(rid, step=step, pos=(positions or {}).get(rid, 0)), t)
    q = state.evaluate(t).quorum
    assert q is not None and {p.replica_id for p in q.participants} == set(rids)
    return q


def vote(state, q, rid, ok=True, t=1.0, timeout=5.0, inc="1"):
    why = "" if ok else "why"
    return state.vote_commit(q.formation, (q.quorum_id, q.step), (rid, inc), ok, t, t + timeout, why)


def new_state() -> CoordinatorState:
    return CoordinatorState(dataclasses.replace(S, heartbeat_timeout_s=30.0), 0.0, startup_grace=0.0)


def test_a_step_commits_once_every_participant_voted_yes_and_the_job_has_committed_it_from_then():
    state = new_state()
    q = formed(state, 1.0, "a", "b", positions={"a": 7, "b": 9})
    assert q.formation > 0
    assert vote(state, q, "a") == (PENDING, "1 of 2 participants voted yes")
    assert state.committed_step == 5  # (what they reported: step 6 is not decided yet)
    assert vote(state, q, "b")[0] == COMMIT
    # b never hears the answer: it asks at step 5 again, but the job committed step 6 and both
    # contributors' batches are spent, so nothing trains step 6 again with b's batch
    assert state.committed_step == 6
    assert state.ledger.position("a") == 8 and state.ledger.position("b") == 10
    assert vote(state, q, "b")[0] == COMMIT  # (a repeated vote: the same answer)
    assert vote(state, q, "a")[0] == COMMIT


def test_one_no_vote_aborts_the_step_at_once_and_a_later_yes_cannot_commit_it():
    state = new_state()
    q = formed(state, 1.0, "a", "b", "c")
    assert vote(state, q, "a")[0] == PENDING
    decision, why = vote(state, q, "b", ok=False)
    assert decision == ABORT and "replica b voted no: why" in why
    assert vote(state, q, "c")[0] == ABORT and vote(state, q, "a")[0] == ABORT
    assert state.committed_step == 5  # (the step they hold)


def test_a_participant_silent_past_the_deadline_aborts_the_step_naming_it():
    state = new_state()
    q = formed(state, 1.0, "a", "b")
    assert vote(state, q, "a", t=1.0, timeout=2.0)[0] == PENDING
    assert state.next_wake(1.5) == pytest.approx(3.0)  # (the server's timer wakes for the deadline)
    assert state.commit_decisions(2.9) == []
    ((formation, (decision, why)),) = state.commit_decisions(3.0)
    assert formation == q.formation and decision == ABORT and "no vote from b" in why
    assert vote(state, q, "b", t=3.1)[0] == ABORT  # too late: never COMMIT after an ABORT


def test_a_participant_that_leaves_the_job_aborts_the_step_before_the_deadline():
    state = CoordinatorState(S, 0.0, startup_grace=0.0)  # heartbeat timeout 2 s
    q = formed(state, 1.0, "a", "b")
    state.heartbeat("a", "1", 2.5)
    assert vote(state, q, "a", t=2.5, timeout=60.0)[0] == PENDING
    state.heartbeat("a", "1", 3.2)
    state.evaluate(3.2)  # b was last heard at 1.0: dead at 3.0
    ((_, (decision, why)),) = state.commit_decisions(3.2)
    assert decision == ABORT and "replica b left the job before it voted (heartbeat_timeout)" in why


def test_a_retried_step_with_the_same_members_is_a_new_formation_with_its_own_decision():
    # after an ABORT the same replicas retry the same step: the same quorum id and step, which
    # alone would find the ABORT again; the formation number tells the two attempts apart
    state = new_state()
    q1 = formed(state, 1.0, "a", "b")
    assert vote(state, q1, "a", ok=False)[0] == ABORT
    q2 = formed(state, 2.0, "a", "b")
    assert (q2.quorum_id, q2.step) == (q1.quorum_id, q1.step) and q2.formation != q1.formation
    assert vote(state, q2, "a", t=2.0)[0] == PENDING and vote(state, q2, "b", t=2.0)[0] == COMMIT
    assert vote(state, q1, "b", t=2.0)[0] == ABORT  # (the first attempt's answer stands)


def test_an_open_step_aborts_when_a_newer_quorum_forms():
    state = new_state()
    q1 = formed(state, 1.0, "a", "b")
    assert vote(state, q1, "a")[0] == PENDING
    formed(state, 2.0, "a", "b")  # (b asked again without voting: it gave up on that step)
    ((formation, (decision, why)),) = state.commit_decisions(2.0)
    assert formation == q1.formation and decision == ABORT and "a newer quorum" in why


def test_a_restarted_coordinator_knows_no_earlier_formation_and_refuses_non_participants():
    state = new_state()
    q = formed(state, 1.0, "a", "b")
    restarted = new_state()
    formed(restarted, 1.0, "a", "b")
    decision, why = vote(restarted, q, "a")
    assert decision == UNKNOWN and "the coordinator restarted" in why  # (the member does not commit)
    with pytest.raises(NotAParticipant, match="replica c .* is not|replica c"):
        vote(state, q, "c")
    with pytest.raises(NotAParticipant, match="incarnation 2"):
        vote(state, q, "a", inc="2")  # a replaced incarnation
    with pytest.raises(NotAParticipant, match="step 4"):
        state.vote_commit(q.formation, (q.quorum_id, 4), ("a", "1"), True, 1.0, 6.0)


@pytest.mark.parametrize("decision", [ABORT, PENDING, UNKNOWN, "UNREACHABLE", "REFUSED"])
def test_a_replica_whose_average_succeeded_commits_only_on_the_coordinators_commit(tmp_path, decision):
    a, b = participant("a", 3, 3), participant("b", 3, 3)
    answers = [(COMMIT, "all 2 participants voted yes"), (decision, "the coordinator's reason")]
    quorums = FakeQuorums([quorum(7, 3, [a, b], "a", position=3)], decisions=answers)
    p = protocol(tmp_path, quorums, FakeReducer())
    p.commit_decision, p.decision_timeout_s = "coordinator", 4.0
    p.decision_patience_s = 0.0  # (no second asking: that is the next test's)
    p.ask(3, 3, True)
    q = p.agree().quorum
    _, error = p.average(q, np.ones(4, np.float32))
    assert error is None
    assert p.vote(q, error) is True and quorums.votes == [(7, True, "", 4.0)]
    assert p.vote(q, error) is False and p.commit_failures == 1  # the ring succeeded, the step does not commit
    ((_, fields),) = [e for e in p.log.events if e[0] == "commit_not_decided"]
    assert fields["decision"] == decision and fields["detail"] == "the coordinator's reason"
    assert quorums.reports == []  # (nobody to blame: no peer failed)


def test_a_failed_average_votes_no_so_that_peers_abort_at_once(tmp_path):
    a, b = participant("a", 3, 3), participant("b", 3, 3)
    answers = [(ABORT, "replica a voted no")]
    quorums = FakeQuorums([quorum(7, 3, [a, b], "a", position=3)], decisions=answers)
    p = protocol(tmp_path, quorums, FakeReducer(fail_steps={(7, 3)}))
    p.commit_decision = "coordinator"
    p.ask(3, 3, True)
    q = p.agree().quorum
    _, error = p.average(q, np.ones(4, np.float32))
    assert p.vote(q, error) is False
    ((_, ok, reason, _),) = quorums.votes
    assert not ok and "b-host:1" in reason and "connection reset" in reason
    assert p.log.kinds() == ["commit_failure"] and quorums.reports == [(7, "b", "b-inc")]  # as without it


def test_every_host_of_a_replica_gets_its_leaders_decision(tmp_path):
    class Hosts:
        hosts = 2

        def __init__(self, rank, received=b""):
            self.rank, self.received, self.sent = rank, received, []

        def broadcast_bytes(self, data):
            self.sent.append(data)
            return data if self.rank == 0 else self.received

        def allgather(self, obj):
            return [obj, obj]

    a, b = participant("a", 3, 3), participant("b", 3, 3)
    for rank, received, expected in [(0, b"", True), (1, b"COMMIT\nall voted yes", True), (1, b"ABORT\nno", False)]:
        quorums = FakeQuorums([], decisions=[(COMMIT, "all voted yes")])
        p = protocol(tmp_path / f"{rank}{expected}", quorums, FakeReducer())
        p.group, p.leader, p.commit_decision = Hosts(rank, received), rank == 0, "coordinator"
        q = quorum(7, 3, [a, b], "a", position=3)
        assert p.vote(q, None) is expected
        assert len(quorums.votes) == (rank == 0)  # only the leader asks the coordinator
        if rank == 0:
            assert p.group.sent == [b"COMMIT\nall voted yes"]  # what its other hosts decide on


def test_an_answer_lost_on_the_way_is_asked_for_again_until_the_patience_runs_out(tmp_path):
    # every participant could miss a COMMIT (the coordinator unreachable as it answered): then nobody
    # would hold the step the job committed. The same vote is sent again and gets the decision made.
    a, b = participant("a", 3, 3), participant("b", 3, 3)
    q = quorum(7, 3, [a, b], "a", position=3)
    lost = [("UNREACHABLE", "UNAVAILABLE: connection refused"), (PENDING, "no decision within 4000 ms")]
    quorums = FakeQuorums([], decisions=[*lost, (COMMIT, "all 2 participants voted yes")])
    p = protocol(tmp_path / "a", quorums, FakeReducer())
    p.commit_decision, p.decision_patience_s = "coordinator", 30.0
    assert p.vote(q, None) is True and [v[1] for v in quorums.votes] == [True, True, True]
    # patience spent: the replica does not commit (its next quorum heals it if a peer did)
    quorums = FakeQuorums([], decisions=[lost[0]] * 50)
    p = protocol(tmp_path / "b", quorums, FakeReducer())
    p.commit_decision, p.decision_patience_s = "coordinator", 0.3
    assert p.vote(q, None) is False and 2 <= len(quorums.votes) < 50
    # a no vote is not repeated: nothing to wait for
    quorums = FakeQuorums([], decisions=[lost[0]] * 5)
    p = protocol(tmp_path / "c", quorums, FakeReducer())
    p.commit_decision, p.decision_patience_s = "coordinator", 30.0
    assert p.vote(q, {"peer": "b-host:1", "error": "PeerFailed: gone"}) is False and len(quorums.votes) == 1
