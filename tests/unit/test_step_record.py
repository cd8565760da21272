"""The step record's one builder (ftjax/runs/events.py `step_record`, `digest_fields`), which the
built-in loop and a script's loop both write through, and the record fields a loop gets from
`FaultTolerance` (not from its protocol): the same bytes on disk as the records written by hand
before, and the protocol's figures through the owner's public methods."""

import json

import numpy as np
import pytest
from fakes import Events, FakeQuorums, FakeReducer, FakeTransport, OneHost, participant, quorum

from ftjax.runs.events import StepField, digest_fields, is_step, step_record
from ftjax.runs.jsonl import read_jsonl
from ftjax.runtime.manager import FaultTolerance
from ftjax.runtime.protocol import StepProtocol
from ftjax.runtime.replay import ReplayBuffer

HEAD = dict(
    step=3,
    committed=True,
    healing=False,
    loss=1.5,
    batch_id=5,
    data_position=3,
    quorum_id=7,
    participants=2,
    contributors=2,
    lr_scale=0.5,
    step_time_s=0.25,
    commit_failures=1,
)


def test_the_built_in_loops_record_is_the_one_it_wrote_by_hand():
    timings = {StepField.COMPUTE_S: 0.125, StepField.QUORUM_WAIT_S: 0.0625, StepField.FTAR_S: 0.03125}
    record = step_record(**HEAD, tokens=64, timings={**timings, StepField.COMMIT_S: 0.5}, protocol={"decision_s": 0.01})
    record.update(lr=0.001)  # (a writer's own fields follow, then the digest)
    record.update(digest_fields("abc", 0.02))
    assert json.dumps(record) == (
        '{"step": 3, "committed": true, "healing": false, "loss": 1.5, "tokens": 64, "batch_id": 5, '
        '"data_position": 3, "quorum_id": 7, "participants": 2, "contributors": 2, "lr_scale": 0.5, '
        '"step_time_s": 0.25, "compute_s": 0.125, "quorum_wait_s": 0.0625, "ftar_s": 0.03125, "commit_s": 0.5, '
        '"commit_failures": 1, "decision_s": 0.01, "lr": 0.001, "param_digest": "abc", "digest_s": 0.02}'
    )
    assert all(type(k) is str for k in record)  # plain strings, not the enum's members


def test_a_scripts_record_is_the_one_it_wrote_by_hand():
    record = {**step_record(**HEAD, tokens=0), **digest_fields("", 0.3)}  # no digest at this step: none
    assert json.dumps(record) == (
        '{"step": 3, "committed": true, "healing": false, "loss": 1.5, "tokens": 0, "batch_id": 5, '
        '"data_position": 3, "quorum_id": 7, "participants": 2, "contributors": 2, "lr_scale": 0.5, '
        '"step_time_s": 0.25, "commit_failures": 1}'
    )


class Phases:
    def record(self):
        return {"d2h_s": 0.5, "ring_s": 0.25}


def test_a_loop_gets_the_protocols_record_fields_from_fault_tolerance(tmp_path):
    """The trainer's record reads the decision's wait and FTAR's phases through `FaultTolerance`;
    a committed step applies the average to the owner's state, bit for bit."""
    a, b = participant("a", 0, 0), participant("b", 0, 0)
    quorums = FakeQuorums([quorum(1, 0, [a, b], "a"), quorum(2, 1, [a, b], "a")], decisions=[("COMMIT", "")])
    reducer = FakeReducer()
    reducer.phases = Phases()
    protocol = StepProtocol(
        replica_id="a",
        incarnation="a-inc",
        group=OneHost(),
        reducer=reducer,
        transport=FakeTransport(),
        quorums=quorums,
        buffer=ReplayBuffer(tmp_path / "replay", 8),
        log=Events(),
        commit_decision="coordinator",
    )
    ft = FaultTolerance(protocol, apply=lambda s, u, scale: s - scale * u, abstract_state=None, log=Events())
    assert ft.step_fields() == {} and ft.phase_fields() == {"d2h_s": 0.5, "ring_s": 0.25}
    ft.init_state(np.ones(4, np.float32))
    ft.ask()
    info = ft.begin()
    assert info.contributes and info.step == 1
    update, error = ft.average(info.quorum, np.full(4, 4.0, np.float32))
    assert ft.vote(info.quorum, error)
    assert ft.commit(info.quorum, update, scale=0.5)
    np.testing.assert_array_equal(ft.state, np.ones(4, np.float32) - 0.5 * (np.full(4, 6.0, np.float32) / 2))
    assert ft.step == 1 and ft.data_position == 1
    fields = ft.step_fields()
    assert list(fields) == ["decision_s"] and fields["decision_s"] >= 0.0
    assert quorums.votes[0][:2] == (1, True)


def test_a_standalone_owner_drains_without_a_peer_to_serve(tmp_path):
    """No transport (a replica alone): `serve` does nothing, and the drain ends at the first quorum."""
    from ftjax.runtime.protocol import LocalQuorum

    protocol = StepProtocol(
        replica_id="a",
        incarnation="a-inc",
        group=OneHost(),
        reducer=FakeReducer(),
        transport=None,
        quorums=LocalQuorum("a"),
        buffer=ReplayBuffer(tmp_path / "replay", 8),
        log=Events(),
    )
    ft = FaultTolerance(protocol, apply=lambda s, u, scale: s, abstract_state=None, log=Events())
    ft.init_state(np.zeros(4, np.float32), step=2, data_position=2)
    assert not ft.has_peers
    ft.ask()
    ft.drain(replicas=1, timeout_s=5.0)  # returns: everyone (itself) holds the final state
    assert ft.log.kinds() == []


def test_a_scripts_record_splits_its_step_as_the_built_in_loops_does(tmp_path):
    """A script's step record carries the built-in loop's timings: the quorum's wait, the loop's own
    work between `begin` and `average`, the averaging, the commit. A peer's wait then shows apart
    from load on the replica's own work (tests/launchrun.py `Launch.waited`); before, a script's
    record had the step's time alone."""
    import time

    from ftjax.runtime.faults import InjectedFaults
    from ftjax.runtime.metrics import MetricsLog
    from ftjax.runtime.script import FaultTolerance as ScriptFaultTolerance

    a, b = participant("a", 0, 0), participant("b", 0, 0)
    protocol = StepProtocol(
        replica_id="a",
        incarnation="a-inc",
        group=OneHost(),
        reducer=FakeReducer(),
        transport=FakeTransport(),
        quorums=FakeQuorums([quorum(1, 0, [a, b], "a"), quorum(2, 1, [a, b], "a")]),
        buffer=ReplayBuffer(tmp_path / "replay", 8),
        log=Events(),
    )
    log = MetricsLog(tmp_path, total_steps=1, label="script")
    ft = ScriptFaultTolerance(
        protocol,
        faults=InjectedFaults(None),
        replica_id="a",
        fingerprint="f",
        quorum_timeout_s=5.0,
        drain_timeout_s=5.0,
        replicas=2,
        log=log,
        apply=lambda s, u, scale: s - scale * u,
        abstract_state=None,
        digest_every=0,
        steps=1,
        batch_id=lambda position: position,
    )
    ft.init_state(np.ones(4, np.float32))
    info = ft.begin()
    time.sleep(0.05)  # the loop's own work: its gradients
    update, error = ft.average(info.quorum, np.full(4, 2.0, np.float32))
    assert ft.vote(info.quorum, error) and ft.commit(info.quorum, update, loss=1.0)
    log.close()
    (record,) = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if is_step(r) and r["step"] == 1]
    split = [record[f] for f in (StepField.COMPUTE_S, StepField.QUORUM_WAIT_S, StepField.FTAR_S, StepField.COMMIT_S)]
    assert all(s >= 0 for s in split) and record[StepField.COMPUTE_S] >= 0.05, record
    assert sum(split) == pytest.approx(record[StepField.STEP_TIME_S], abs=1e-6), record
