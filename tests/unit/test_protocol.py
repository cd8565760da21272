"""The step protocol driven in-process with fake collaborators: a quorum, an FTAR failure and its
retry with the same batch, and a heal that replays the updates kept while the snapshot travelled."""

import time

import numpy as np
from fakes import Events, FakeQuorums, FakeReducer, FakeTransport, OneHost, participant, protocol, quorum

from ftjax.coordinator.codec import decode_quorum, encode_quorum
from ftjax.runtime.protocol import HealOrder, StepProtocol, _decode_agreement, _encode_agreement
from ftjax.runtime.replay import ReplayBuffer


def test_a_failed_average_is_voted_down_reported_and_retried_with_the_same_batch(tmp_path):
    t0 = time.monotonic()
    a, b = participant("a", 3, 3), participant("b", 3, 3)
    quorums = FakeQuorums([quorum(7, 3, [a, b], "a", position=3), quorum(8, 3, [a], "a", position=3)])
    reducer = FakeReducer(fail_steps={(7, 3)})
    p = protocol(tmp_path, quorums, reducer)
    grads = np.arange(4, dtype=np.float32)

    p.ask(3, 3, True)
    q = p.agree().quorum
    assert (q.quorum_id, q.step, q.replica_ids) == (7, 3, ("a", "b"))
    update, error = p.average(q, grads)
    assert update is None and error["peer"] == "b-host:1" and "connection reset" in error["error"]
    assert not p.vote(q, error)
    assert quorums.reports == [(7, "b", "b-inc")]  # the peer at fault, by its incarnation
    assert p.log.kinds() == ["commit_failure"] and p.commit_failures == 1

    p.ask(3, 3, True)  # the retry: the same step and data position (the same batch), one failure told
    assert quorums.asked == [(3, 3, True, 0), (3, 3, True, 1)]
    q = p.agree().quorum
    update, error = p.average(q, grads)
    assert error is None and p.vote(q, error)
    np.testing.assert_array_equal(update, grads + 2.0)
    assert np.array_equal(reducer.calls[0][1], reducer.calls[1][1])  # the same gradients both times
    p.committed(q, applied=True)
    assert p.commit_failures == 0 and p.total_commit_failures == 1
    assert quorums.known_positions == {"a": 4, "b": 3}  # a's batch of step 3 was trained; b left before
    assert time.monotonic() - t0 < 5


def test_a_newcomer_heals_and_replays_the_updates_it_kept(tmp_path):
    t0 = time.monotonic()
    src = participant("b", 5, 5)
    me = participant("a", 0, 2, healing=True, source="b")
    transport = FakeTransport()
    quorums = FakeQuorums(
        [
            quorum(3, 5, [me, src], "a", healing=True, source="b", position=2),
            quorum(3, 6, [me._replace(step=0), src._replace(step=6)], "a", healing=True, source="b", position=2),
        ]
    )
    p = protocol(tmp_path, quorums, FakeReducer(), transport)

    p.ask(0, 0, False)
    agreement = p.agree()
    q = agreement.quorum
    assert agreement.install is None and transport.fetches == [(["b-host:2"], "a/a-inc", "b", 5)]
    p.healing(q, stale_step=None)
    update, error = p.average(q, None)  # a healing member relays zeros
    assert error is None and p.vote(q, error)
    p.committed(q, applied=False)
    p.keep(q, update, 0.5)  # the average of step 5, kept for the replay
    assert p.log.kinds() == ["catchup_started"]
    assert transport.released == 0  # (a healing replica applies nothing: its receive arena stays)

    p.ask(0, 2, False)
    agreement = p.agree()
    assert agreement.install is not None and agreement.install.step == 5

    def apply(state, grads, scale):
        return state + scale * grads

    state, step = p.install(agreement.install, agreement.quorum, None, apply)
    assert step == 6
    np.testing.assert_array_equal(state, np.full(4, 5.0) + 0.5 * np.full(4, 2.0))  # snapshot + kept update
    done = dict(p.log.events)["catchup_done"]
    assert done["replayed"] == 1 and done["snapshot_step"] == 5 and done["at_step"] == 6
    assert len(p.buffer) == 0
    p.committed(agreement.quorum, applied=True)  # its first step of its own: no fetch is coming
    assert transport.released == 1
    assert time.monotonic() - t0 < 5


def test_the_quorum_travels_to_the_other_hosts_as_the_coordinators_message():
    q = quorum(
        9,
        4,
        [participant("a", 4, 4), participant("b", 0, 1, healing=True, source="a")],
        "b",
        healing=True,
        source="a",
        position=1,
    )
    assert decode_quorum(encode_quorum(q)) == q
    for order in (HealOrder(), HealOrder(drop=True, fetch_min_step=3), HealOrder(install=True)):
        assert _decode_agreement(_encode_agreement(q, order)) == (q, order)
    leave = HealOrder(leave="SIGTERM")  # a leave order carries no quorum
    assert _decode_agreement(_encode_agreement(None, leave)) == (None, leave)


class TwoHosts(OneHost):
    """The leader of a 2-host replica: what it broadcasts to its other host is kept."""

    hosts = 2

    def __init__(self):
        self.sent = []

    def broadcast_bytes(self, data):
        self.sent.append(data)
        return data

    def allgather(self, obj):
        return [obj, obj]


def test_a_replica_asked_to_leave_asks_no_quorum_and_every_host_leaves_at_the_boundary(tmp_path):
    a, b = participant("a", 3, 3), participant("b", 3, 3)
    quorums = FakeQuorums([quorum(1, 3, [a, b], "a")])
    p = StepProtocol(
        replica_id="a",
        incarnation="a-inc",
        group=TwoHosts(),
        reducer=FakeReducer(),
        transport=FakeTransport(),
        quorums=quorums,
        buffer=ReplayBuffer(tmp_path / "r", 8),
        log=Events(),
    )
    p.ask(3, 3, True)
    p.leaving = "SIGTERM"  # arrives while a quorum is under way: that step is trained first
    assert p.agree().quorum.quorum_id == 1
    p.ask(4, 4, True)
    assert len(quorums.asked) == 1 and quorums.left == "SIGTERM"  # no request; the coordinator drops us now
    agreement = p.agree()
    assert agreement.quorum is None and agreement.leave == "SIGTERM"
    assert _decode_agreement(p.group.sent[-1]) == (None, HealOrder(leave="SIGTERM"))  # what the other host gets


def test_a_failure_report_that_cannot_reach_the_coordinator_is_logged_not_fatal(tmp_path):
    # A replica cut off from the coordinator (a partition) fails its FTAR and reports the peer: the
    # report times out; the step is still voted down and retried, the process lives on.
    import grpc

    from ftjax.coordinator.client import CoordinatorError

    class Unreachable(FakeQuorums):
        def report_failure(self, quorum_id, replica_id, incarnation, reason=""):
            raise CoordinatorError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    a, b = participant("a", 3, 3), participant("b", 3, 3)
    p = protocol(tmp_path, Unreachable([quorum(7, 3, [a, b], "a", position=3)]), FakeReducer(fail_steps={(7, 3)}))
    p.ask(3, 3, True)
    q = p.agree().quorum
    update, error = p.average(q, np.ones(4, np.float32))
    assert update is None and error["peer"] == "b-host:1"
    assert p.vote(q, error) is False and p.commit_failures == 1
    ((_kind, fields),) = [e for e in p.log.events if e[0] == "report_undelivered"]
    assert fields["replica"] == "b" and "DEADLINE_EXCEEDED" in fields["error"]
