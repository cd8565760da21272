"""The Commits stream served for real (ft.commit_decision: coordinator): real clients vote on
their quorum's step over gRPC and get one decision; bad votes are refused naming the field; a restarted
coordinator answers UNKNOWN (the voter does not commit)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from test_coordinator_server import make_client, make_server, raw, settle  # noqa: F401 (fixtures)

from ftjax.coordinator import coordinator_pb2 as pb


def _quorum(server, make_client, rids="ab"):  # noqa: F811
    clients = [make_client(server, rid) for rid in rids]
    results = settle([c.quorum_async(0, 0, True) for c in clients])
    assert len({r.formation for r in results}) == 1 and results[0].formation > 0  # (it reached the replicas)
    return clients, results


def _votes(clients, results, oks, timeouts):
    with ThreadPoolExecutor(len(clients)) as pool:
        futures = [
            pool.submit(c.vote_commit, q, ok, "" if ok else "ring failed", t)
            for c, q, ok, t in zip(clients, results, oks, timeouts)
        ]
        return [f.result(timeout=60) for f in futures]


def test_every_participant_voting_yes_commits_the_step_for_all(make_server, make_client):  # noqa: F811
    server = make_server()
    clients, results = _quorum(server, make_client)
    decisions = _votes(clients, results, [True, True], [20.0, 20.0])
    assert [d for d, _ in decisions] == ["COMMIT", "COMMIT"]
    assert server.state.committed_step == 1  # the job committed step 1 when it decided, not when they report
    assert clients[0].vote_commit(results[0], True, "", 1.0)[0] == "COMMIT"  # a repeated vote: the same answer
    assert server.state.commits.counts == {"COMMIT": 1, "ABORT": 0}


def test_a_no_vote_aborts_the_waiting_yes_voter_at_once(make_server, make_client):  # noqa: F811
    server = make_server()
    clients, results = _quorum(server, make_client)
    # a waits up to 30 s; b's ring failed. a's answer is ABORT (had it waited out its timeout, PENDING)
    (a, why), (b, _) = _votes(clients, results, [True, False], [30.0, 30.0])
    assert (a, b) == ("ABORT", "ABORT") and "replica b voted no: ring failed" in why
    assert server.state.committed_step == 0


def test_a_silent_participant_aborts_the_step_at_the_deadline_and_a_late_yes_cannot_commit_it(
    make_server,  # noqa: F811
    make_client,  # noqa: F811
):
    server = make_server()
    clients, results = _quorum(server, make_client)
    decision, why = clients[0].vote_commit(results[0], True, "", 0.3)
    assert decision in ("ABORT", "PENDING"), why  # (the deadline and the wait end together)
    assert clients[1].vote_commit(results[1], True, "", 5.0)[0] == "ABORT"
    assert server.state.committed_step == 0


@pytest.mark.parametrize(
    "fields, code, text",
    [
        (dict(formation=0), "INVALID_ARGUMENT", "formation"),
        (dict(timeout_ms=0), "INVALID_ARGUMENT", "timeout_ms"),
        (dict(replica_id="a/b"), "INVALID_ARGUMENT", "replica_id"),
        (dict(reason="r" * 5000), "INVALID_ARGUMENT", "reason"),
        (dict(replica_id="c"), "FAILED_PRECONDITION", "replica c"),
        (dict(step=7), "FAILED_PRECONDITION", "step 7"),
    ],
    ids=["formation", "timeout_ms", "replica_id", "reason", "not-a-participant", "wrong-step"],
)
def test_bad_votes_are_refused_naming_the_field_and_decide_nothing(make_server, make_client, raw, fields, code, text):  # noqa: F811
    server = make_server()
    clients, results = _quorum(server, make_client)
    q = results[0]
    vote = dict(
        formation=q.formation,
        quorum_id=q.quorum_id,
        step=q.step,
        replica_id="a",
        incarnation=clients[0].member.incarnation,
        ok=False,
        timeout_ms=1000,
    )
    r = raw(server)
    with pytest.raises(grpc.RpcError) as e:
        next(r.stub.Commits(iter([pb.CommitVote(**{**vote, **fields})]), metadata=r.metadata, timeout=5))
    assert e.value.code() == getattr(grpc.StatusCode, code) and text in e.value.details()
    assert server.state.commits.counts == {"COMMIT": 0, "ABORT": 0}  # (the refused no vote decided nothing)


def test_a_restarted_coordinator_answers_unknown_and_the_voter_does_not_commit(make_server, make_client):  # noqa: F811
    first = make_server()
    clients, results = _quorum(first, make_client)
    port = int(first.address.rsplit(":", 1)[1])
    first.stop()
    second = make_server(port=port)  # (the same address: the clients' channels reconnect)
    assert second.address == first.address
    decision, why = clients[0].vote_commit(results[0], True, "", 2.0)
    assert decision == "UNKNOWN" and "restarted" in why


@pytest.mark.timeout(360)
def test_a_job_whose_commits_the_coordinator_decides_survives_kills_in_ftar_and_in_commit(launch):
    # 3 replicas; 1 killed in its ring at step 10 (its peers' votes then abort the step, or its
    # departure does), 2 killed between its vote and its apply at step 20 (the step committed
    # without it: it comes back behind and heals). Every step either committed was decided.
    run = launch(
        "--replicas", "3", "steps=40", "ft.commit_decision=coordinator", "--kill", "1@10:ftar", "--kill", "2@20:commit"
    )
    assert run.wait(300) == 0, run.output()
    s = run.summary()
    assert s["digests_equal"] and s["exactly_once"] and not s.get("split_history"), run.output()
    downs = {(e["replica"], e.get("at")) for e in s["failure_events"]}
    assert {(1, "10:ftar"), (2, "20:commit")} <= downs, downs
    for r in range(3):
        committed = [m for m in run.metrics(r) if "event" not in m and m.get("committed")]
        assert committed and all(m["decision_s"] >= 0 for m in committed)
