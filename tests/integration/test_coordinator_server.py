"""The coordinator served for real (gRPC on 127.0.0.1, in a background thread of this process),
driven by real clients: quorums, healing, failure reports, auth, bad input, HTTP status. One test
drives the gRPC service's handlers on an event loop of its own, to order two events exactly."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import queue
import time
import urllib.error
import urllib.request

import grpc
import pytest

from ftjax.cli.coordinator import main
from ftjax.coordinator import TOKEN_METADATA_KEY
from ftjax.coordinator import coordinator_pb2 as pb
from ftjax.coordinator import coordinator_pb2_grpc as pb_grpc
from ftjax.coordinator.client import CoordinatorClient, CoordinatorError
from ftjax.coordinator.http import Metrics
from ftjax.coordinator.quorum import MemberReport, Settings
from ftjax.coordinator.server import CoordinatorServer
from ftjax.coordinator.service import CoordinatorService
from ftjax.coordinator.state import CoordinatorState
from ftjax.coordinator.types import JobFinished, MemberInfo, new_incarnation

TOKEN = "test-token"
FAST = Settings(min_replicas=2, join_timeout_s=5.0, heartbeat_timeout_s=2.0, suspect_window_s=0.3)
# The servers here skip the startup grace (to be quick), so a quorum may form of the replicas that
# happen to have registered: tests of three-replica quorums require all three.
THREE = dataclasses.replace(FAST, min_replicas=3)
_PORTS = {rid: 100 + i for i, rid in enumerate("abcdefgh")}


def info(rid: str, *, inc: str | None = None, fp: str = "fp", topology: str = "") -> MemberInfo:
    n = _PORTS.get(rid, 99)
    return MemberInfo(
        rid, inc or new_incarnation(), 1, (f"127.0.0.1:{20000 + n}",), (f"127.0.0.1:{30000 + n}",), fp, topology
    )


@pytest.fixture
def make_server():
    servers = []

    def make(settings: Settings = FAST, **kw) -> CoordinatorServer:
        server = CoordinatorServer(settings, TOKEN, startup_grace=0.0, **kw).start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture
def make_client():
    clients = []

    def make(
        server: CoordinatorServer,
        rid: str,
        *,
        token: str = TOKEN,
        start: bool = True,
        quorum_timeout: float = 10.0,
        duplicate_grace_s: float = 5.0,
        **kw,
    ) -> CoordinatorClient:
        client = CoordinatorClient(
            server.address,
            token,
            info(rid, **kw),
            heartbeat_interval_s=0.05,
            quorum_timeout_s=quorum_timeout,
            duplicate_grace_s=duplicate_grace_s,
        )
        if start:
            client.start()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


class Raw:
    """Hand-made calls, for what a well-behaved client never sends."""

    def __init__(self, server: CoordinatorServer, token: str | None = TOKEN) -> None:
        self.channel = grpc.insecure_channel(server.address)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self.metadata = () if token is None else ((TOKEN_METADATA_KEY, token),)
        self.calls = []

    def quorum_stream(self):
        requests: queue.SimpleQueue = queue.SimpleQueue()
        call = self.stub.Quorum(iter(requests.get, None), metadata=self.metadata, timeout=30)
        self.calls.append(call)
        return requests, call

    def quorum_once(self, request: pb.QuorumRequest) -> pb.QuorumResponse:
        requests, call = self.quorum_stream()
        requests.put(request)
        return next(call)

    def heartbeat_stream(self, first: pb.HeartbeatRequest):
        requests: queue.SimpleQueue = queue.SimpleQueue()
        requests.put(first)
        call = self.stub.Heartbeat.future(iter(requests.get, None), metadata=self.metadata, timeout=30)
        self.calls.append(call)
        return requests, call

    def report(self, **fields) -> pb.FailureVerdict:
        return self.stub.ReportFailure(pb.FailureReport(**fields), metadata=self.metadata, timeout=5)

    def close(self) -> None:
        for call in self.calls:
            call.cancel()
        self.channel.close()


@pytest.fixture
def raw():
    made = []

    def make(server: CoordinatorServer, token: str | None = TOKEN) -> Raw:
        made.append(Raw(server, token))
        return made[-1]

    yield make
    for r in made:
        r.close()


def member_proto(rid: str = "x", **fields) -> pb.Member:
    base = dict(
        replica_id=rid,
        incarnation="inc-1",
        step=0,
        data_position=0,
        has_state=True,
        num_hosts=1,
        ftar_addresses=["127.0.0.1:1"],
        catchup_addresses=["127.0.0.1:2"],
        topology_fingerprint="fp",
    )
    base.update(fields)
    return pb.Member(**base)


def membership(server: CoordinatorServer):
    """Everything a request could change (not counters, not heartbeat ages)."""
    s = server.state.snapshot(time.monotonic())
    replicas = sorted(
        (
            r["replica_id"],
            r["incarnation"],
            r["step"],
            r["data_position"],
            r["has_state"],
            r["requesting"],
            r["suspected"],
            r["alive"],
        )
        for r in s["replicas"]
    )
    return (
        replicas,
        s["quorum"],
        [h["quorum_id"] for h in s["history"]],
        s["topology_fingerprint"],
        s["failure_epoch"],
        len(s["failures"]),
    )


def wait_pending(server: CoordinatorServer, rid: str, timeout: float = 5.0) -> None:
    """Until the coordinator holds a pending quorum request of `rid`."""
    deadline = time.monotonic() + timeout
    while not ((m := server.state.members.get(rid)) and m.requested_at is not None):
        assert time.monotonic() < deadline, f"no pending request of {rid}"
        time.sleep(0.005)


def wait_registered(server: CoordinatorServer, *rids: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(rid in server.state.members for rid in rids):
        assert time.monotonic() < deadline, f"not all of {rids} registered"
        time.sleep(0.005)


def settle(clients_or_futures, timeout: float = 10.0):
    return [f.result(timeout) for f in clients_or_futures]


# -- quorums --------------------------------------------------------------------------------------


def test_three_replicas_share_one_quorum_step_after_step(make_server, make_client):
    server = make_server(THREE)
    clients = [make_client(server, rid) for rid in "cab"]
    first = settle([c.quorum_async(0, 0, True) for c in clients])
    assert len({r.quorum_id for r in first}) == 1
    assert [r.replica_ids for r in first] == [("a", "b", "c")] * 3
    assert [r.rank for r in first] == [2, 0, 1]
    assert all(r.step == 0 and r.num_contributors == 3 and not r.healing and not r.no_state for r in first)
    assert first[1].participants[2].ftar_addresses == clients[0].member.ftar_addresses
    for step in range(1, 4):  # same members, no failures: the fast path keeps the id
        results = settle([c.quorum_async(step, step, True) for c in clients])
        assert {r.quorum_id for r in results} == {first[0].quorum_id}
        assert {r.step for r in results} == {step}
    assert server.state.counters["quorum_id_changes"] == 1


def test_membership_is_sent_only_to_callers_that_do_not_hold_it(make_server, raw):
    server = make_server()
    r = raw(server)
    (qa, ca), (qb, cb) = r.quorum_stream(), r.quorum_stream()
    # step 0: nobody holds anything; step 1: b holds quorum 1's membership, a says it does not
    for step, (known_a, known_b), (members_a, members_b) in [(0, (0, 0), (2, 2)), (1, (0, 1), (2, 0))]:
        qa.put(pb.QuorumRequest(member=member_proto("a", step=step), timeout_ms=5000, known_quorum_id=known_a))
        qb.put(pb.QuorumRequest(member=member_proto("b", step=step), timeout_ms=5000, known_quorum_id=known_b))
        ra, rb = next(ca), next(cb)
        assert ra.quorum_id == rb.quorum_id == 1
        assert (len(ra.members), len(rb.members)) == (members_a, members_b)
        assert ra.step == step and list(ra.steps) == [] and list(ra.heal_sources) == []  # uniform: omitted
        # both reported position 0; once step 0 is committed their batch 0 is trained: 1
        assert list(ra.data_positions) == [step, step] and (ra.rank, rb.rank) == (0, 1)


def test_commit_failures_force_a_new_quorum_id(make_server, make_client):
    server = make_server()
    a, b = make_client(server, "a"), make_client(server, "b")
    q0 = settle([a.quorum_async(0, 0, True), b.quorum_async(0, 0, True)])[0].quorum_id
    q1 = settle([a.quorum_async(0, 0, True, commit_failures=1), b.quorum_async(1, 1, True)])
    assert q1[0].quorum_id == q1[1].quorum_id == q0 + 1
    assert q1[0].healing and q1[0].heal_source == "b" and q1[0].step == 1  # a discarded the step b committed


def test_restarted_replica_heals_from_a_peer_and_learns_its_data_position(make_server, make_client):
    server = make_server(THREE)
    a, b, c = (make_client(server, rid) for rid in "abc")
    # step 10: everybody contributes its batch (positions 8, 9, 10: a stream advances at most once a step)
    settle([a.quorum_async(10, 8, True), b.quorum_async(10, 9, True), c.quorum_async(10, 10, True)])
    c.close()  # c dies before committing; a and b commit step 10
    c2 = make_client(server, "c")  # c restarts: new incarnation, no state
    results = settle([a.quorum_async(11, 9, True), b.quorum_async(11, 10, True), c2.quorum_async(0, 0, False)])
    ra, rb, rc = results
    assert ra.quorum_id == rc.quorum_id and ra.replica_ids == ("a", "b", "c")
    assert rc.healing and rc.heal_source == "a" and rc.heal_source_addresses == a.member.catchup_addresses
    assert rc.step == 11 and ra.num_contributors == 2
    assert rc.data_position == 11  # its batch of step 10 was trained: a and b committed step 10
    assert [t.replica_id for t in ra.heal_targets] == ["c"] and rb.heal_targets == ()
    assert rc.participants[2].incarnation == c2.member.incarnation


def test_quorum_times_out_with_the_reason(make_server, make_client):
    server = make_server()
    lonely = make_client(server, "a", quorum_timeout=0.6)
    t0 = time.monotonic()
    with pytest.raises(CoordinatorError) as e:
        lonely.quorum(0, 0, True)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "min_replicas=2" in str(e.value)
    assert 0.5 < time.monotonic() - t0 < 3.0
    assert not server.state.members["a"].requested_at  # the request was withdrawn


def test_a_requester_that_hangs_up_is_withdrawn_and_its_broken_stream_makes_it_a_suspect(make_server, raw):
    server = make_server()
    r = raw(server)
    _hb, hb_call = r.heartbeat_stream(pb.HeartbeatRequest(member=member_proto("a")))
    requests, call = r.quorum_stream()
    requests.put(pb.QuorumRequest(member=member_proto("a"), timeout_ms=10_000))
    wait_pending(server, "a")
    deadline = time.monotonic() + 5
    call.cancel()
    hb_call.cancel()
    while server.state.members["a"].requested_at or server.state.members["a"].suspected_at is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_requester_that_hangs_up_as_its_quorum_forms_leaves_its_peers_answered():
    """A caller hangs up (its handler is cancelled, which cancels its pending answer) and, before
    its handler runs again to withdraw, the last request forms a quorum with it. The others must
    get their answers: an exception on the cancelled one once left them waiting out their
    deadlines while the state counted them answered (a DiLoCo job stalled 120 s on a kill).
    The service is driven on its own event loop, so the order of the two events is the one a
    real server can see, every time."""

    class Context:
        def time_remaining(self):
            return None

        async def abort(self, code, message):
            raise RuntimeError(f"{code}: {message}")

    async def requests(q: asyncio.Queue):
        while (item := await q.get()) is not None:
            yield item

    async def serve(service, q: asyncio.Queue) -> list:
        return [pb.QuorumResponse.FromString(a) async for a in service.quorum(requests(q), Context())]

    async def scenario() -> None:
        state = CoordinatorState(THREE, 0.0, startup_grace=0.0)
        service = CoordinatorService(state, Metrics(state), asyncio.get_running_loop())
        queues = {rid: asyncio.Queue() for rid in "abc"}
        tasks = {rid: asyncio.create_task(serve(service, queues[rid])) for rid in "abc"}
        for rid in "ab":
            queues[rid].put_nowait(pb.QuorumRequest(member=member_proto(rid), timeout_ms=10_000))
        while not all((m := state.members.get(rid)) and m.requested_at for rid in "ab"):
            await asyncio.sleep(0)
        # c's request wakes its handler first, a's cancellation second: a is still a requester
        queues["c"].put_nowait(pb.QuorumRequest(member=member_proto("c"), timeout_ms=10_000))
        tasks["a"].cancel()
        for rid in "bc":
            queues[rid].put_nowait(None)
        answers = await asyncio.wait_for(asyncio.gather(tasks["b"], tasks["c"]), 5)
        for (answer,) in answers:
            assert answer.quorum_id >= 1 and [m.replica_id for m in answer.members] == ["a", "b", "c"]
        with pytest.raises(asyncio.CancelledError):
            await tasks["a"]
        assert not any(m.requested_at for m in state.members.values())

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_a_new_incarnation_aborts_the_old_ones_pending_request(make_server, raw):
    server = make_server()
    r = raw(server)
    requests, old = r.quorum_stream()
    requests.put(pb.QuorumRequest(member=member_proto("a", incarnation="old"), timeout_ms=10_000))
    wait_pending(server, "a")
    requests2, _new = r.quorum_stream()
    requests2.put(pb.QuorumRequest(member=member_proto("a", incarnation="new"), timeout_ms=10_000))
    with pytest.raises(grpc.RpcError) as e:
        next(old)
    assert e.value.code() == grpc.StatusCode.ABORTED and "new" in e.value.details()
    assert server.state.members["a"].report.incarnation == "new"


# -- failure reports ----------------------------------------------------------------------------------


def test_accusing_a_silent_member_drops_it_and_a_live_one_stays(make_server, make_client, raw):
    server = make_server(Settings(min_replicas=2, join_timeout_s=30.0, heartbeat_timeout_s=5.0, suspect_window_s=0.3))
    a, b = make_client(server, "a"), make_client(server, "b")
    wait_registered(server, "a", "b")  # so that the first quorum waits for all three
    r = raw(server)
    # c: connected, then silent (a hung process keeps its connection open)
    r.heartbeat_stream(pb.HeartbeatRequest(member=member_proto("c", incarnation="c1")))
    c_requests, c_call = r.quorum_stream()
    c_requests.put(pb.QuorumRequest(member=member_proto("c", incarnation="c1"), timeout_ms=20_000))
    first = settle([a.quorum_async(0, 0, True), b.quorum_async(0, 0, True)])[0]
    assert first.replica_ids == ("a", "b", "c") and next(c_call).quorum_id == first.quorum_id
    pending = [a.quorum_async(1, 1, True), b.quorum_async(1, 1, True)]  # blocked: c has not asked
    time.sleep(0.4)
    assert not any(f.done() for f in pending)

    t0 = time.monotonic()
    assert a.report_failure(first.quorum_id, "b", b.member.incarnation, "false alarm") is False
    assert time.monotonic() - t0 >= 0.2  # waited for b's suspect window, and b heartbeat in it
    assert "b" in server.state.members and server.state.members["b"].suspected_at is None
    assert a.report_failure(first.quorum_id, "c", "some-older-incarnation", "stale") is False
    assert a.report_failure(first.quorum_id, "nobody", "x", "unknown") is False
    assert not any(f.done() for f in pending)

    t0 = time.monotonic()
    assert a.report_failure(first.quorum_id, "c", "c1", "ring socket closed") is True
    second = settle(pending, timeout=5)
    assert time.monotonic() - t0 < 0.5  # not the 5 s heartbeat timeout nor the 30 s join timeout
    assert second[0].replica_ids == ("a", "b") and second[0].quorum_id == first.quorum_id + 1
    verdicts = [(f["replica_id"], f["outcome"]) for f in server.state.snapshot(time.monotonic())["failures"]]
    assert ("c", "DROPPED") in verdicts and ("b", "ALIVE") in verdicts and ("c", "STALE_INCARNATION") in verdicts


# -- auth and bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("token", [None, "wrong-token"], ids=["missing", "wrong"])
def test_calls_without_the_job_token_are_refused_and_change_nothing(make_server, make_client, raw, token):
    server = make_server()
    a = make_client(server, "a")
    a.quorum_async(0, 0, True)  # pending: one requester of min 2
    wait_pending(server, "a")
    before = membership(server)
    bad = raw(server, token)
    with pytest.raises(grpc.RpcError) as e:
        bad.quorum_once(pb.QuorumRequest(member=member_proto("b"), timeout_ms=1000))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    _, hb = bad.heartbeat_stream(pb.HeartbeatRequest(member=member_proto("b")))
    assert hb.exception(5).code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        bad.report(quorum_id=0, replica_id="a", incarnation=a.member.incarnation)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    vote = pb.CommitVote(formation=1, quorum_id=1, replica_id="a", incarnation="i", ok=False, timeout_ms=100)
    with pytest.raises(grpc.RpcError) as e:
        next(bad.stub.Commits(iter([vote]), metadata=bad.metadata, timeout=5))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert membership(server) == before and server.state.commits.counts == {"COMMIT": 0, "ABORT": 0}


def test_a_client_with_the_wrong_token_fails_at_once(make_server, make_client):
    server = make_server()
    client = make_client(server, "a", token="nope", start=False)
    t0 = time.monotonic()
    with pytest.raises(CoordinatorError) as e:
        client.quorum(0, 0, True)
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED and time.monotonic() - t0 < 2.0


BAD_QUORUM_REQUESTS = [
    ("member.replica_id", pb.QuorumRequest(member=member_proto("bad id!"), timeout_ms=1000)),
    ("member.replica_id", pb.QuorumRequest(member=member_proto("x" * 65), timeout_ms=1000)),
    ("member.incarnation", pb.QuorumRequest(member=member_proto(incarnation=""), timeout_ms=1000)),
    ("member.step", pb.QuorumRequest(member=member_proto(step=-1), timeout_ms=1000)),
    ("member.data_position", pb.QuorumRequest(member=member_proto(data_position=-3), timeout_ms=1000)),
    ("member.commit_failures", pb.QuorumRequest(member=member_proto(commit_failures=-1), timeout_ms=1000)),
    (
        "member.catchup_addresses[0]",
        pb.QuorumRequest(member=member_proto(catchup_addresses=["h:1" + "0" * 10_000]), timeout_ms=1000),
    ),
    (
        "member.topology_fingerprint",
        pb.QuorumRequest(member=member_proto(topology_fingerprint="f" * 300), timeout_ms=1000),
    ),
    (
        "member.num_hosts",
        pb.QuorumRequest(member=member_proto(num_hosts=2000, ftar_addresses=["h:1"] * 2000), timeout_ms=1000),
    ),
    ("member.catchup_addresses", pb.QuorumRequest(member=member_proto(num_hosts=2), timeout_ms=1000)),
    ("member.ftar_addresses[0]", pb.QuorumRequest(member=member_proto(ftar_addresses=["no-port"]), timeout_ms=1000)),
    ("member", pb.QuorumRequest(timeout_ms=1000)),
    ("timeout_ms", pb.QuorumRequest(member=member_proto(), timeout_ms=0)),
    ("known_quorum_id", pb.QuorumRequest(member=member_proto(), timeout_ms=1000, known_quorum_id=-1)),
]


@pytest.mark.parametrize(
    "field,request_", BAD_QUORUM_REQUESTS, ids=[f"{i}-{f}" for i, (f, _) in enumerate(BAD_QUORUM_REQUESTS)]
)
def test_bad_quorum_requests_are_refused_naming_the_field_and_change_nothing(
    make_server, make_client, raw, field, request_
):
    server = make_server()
    a = make_client(server, "x")  # the garbled requests reuse its id: they must not touch it
    a.quorum_async(3, 30, True)
    wait_pending(server, "x")
    before = membership(server)
    with pytest.raises(grpc.RpcError) as e:
        raw(server).quorum_once(request_)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(field)
    assert membership(server) == before


def test_bad_first_heartbeats_are_refused(make_server, raw):
    server = make_server()
    r = raw(server)
    for first, field in [
        (pb.HeartbeatRequest(), "member"),
        (pb.HeartbeatRequest(member=member_proto("a b")), "member.replica_id"),
        (pb.HeartbeatRequest(member=member_proto(step=-2)), "member.step"),
    ]:
        _, call = r.heartbeat_stream(first)
        error = call.exception(5)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith(field)
    assert server.state.members == {} and server.state.departed == {}


@pytest.mark.parametrize(
    "fields,field",
    [
        (dict(quorum_id=-1, replica_id="a", incarnation="i"), "quorum_id"),
        (dict(quorum_id=1, replica_id="a/b", incarnation="i"), "replica_id"),
        (dict(quorum_id=1, replica_id="a", incarnation=""), "incarnation"),
        (dict(quorum_id=1, replica_id="a", incarnation="i", reason="r" * 5000), "reason"),
        (dict(quorum_id=1, replica_id="a", incarnation="i", reporter_id="not ok"), "reporter_id"),
    ],
    ids=["quorum_id", "replica_id", "incarnation", "reason", "reporter_id"],
)
def test_bad_failure_reports_are_refused(make_server, make_client, raw, fields, field):
    server = make_server()
    a = make_client(server, "a", inc="i")
    a.quorum_async(0, 0, True)
    wait_pending(server, "a")
    before = membership(server)
    with pytest.raises(grpc.RpcError) as e:
        raw(server).report(**fields)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(field)
    assert membership(server) == before


def test_oversized_message_is_refused_by_the_transport(make_server, make_client, raw):
    server = make_server()
    a = make_client(server, "a")
    a.quorum_async(0, 0, True)
    wait_pending(server, "a")
    before = membership(server)
    huge = member_proto(num_hosts=1, ftar_addresses=["h:1"], topology_fingerprint="f")
    huge.catchup_addresses.append("h:" + "1" * (2 << 20))  # 2 MiB: past the server's 1 MiB limit
    with pytest.raises(grpc.RpcError) as e:
        raw(server).quorum_once(pb.QuorumRequest(member=huge, timeout_ms=1000))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert membership(server) == before


def test_a_replica_with_another_topology_is_refused_with_both_fingerprints(make_server, make_client):
    server = make_server()
    a = make_client(server, "a", fp="mesh-dp2-fsdp4")
    a.quorum_async(0, 0, True)
    wait_pending(server, "a")
    b = make_client(server, "b", fp="mesh-dp4-fsdp2", start=False)
    with pytest.raises(CoordinatorError) as e:
        b.quorum(0, 0, True)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "mesh-dp2-fsdp4" in str(e.value) and "mesh-dp4-fsdp2" in str(e.value)
    assert "b" not in server.state.members


# -- HTTP and CLI -------------------------------------------------------------------------------------


def test_status_page_json_and_metrics(make_server, make_client):
    server = make_server()
    a, b = make_client(server, "a"), make_client(server, "b")
    settle([a.quorum_async(4, 40, True), b.quorum_async(4, 41, True)])

    def get(path: str) -> str:
        with urllib.request.urlopen(f"http://{server.http_address}{path}", timeout=5) as r:
            return r.read().decode()

    status = json.loads(get("/status"))
    assert [(r["replica_id"], r["step"], r["data_position"], r["alive"]) for r in status["replicas"]] == [
        ("a", 4, 40, True),
        ("b", 4, 41, True),
    ]
    assert status["quorum"]["quorum_id"] == 1 and status["history"][0]["participants"] == ["a", "b"]
    metrics = get("/metrics")
    assert "ftjax_coordinator_quorums_total 1.0" in metrics
    assert "ftjax_coordinator_alive_replicas 2.0" in metrics
    assert "ftjax_coordinator_quorum_latency_seconds_count 2.0" in metrics  # one per participant
    assert "ftjax_coordinator_quorum_wait_seconds_count 1.0" in metrics
    page = get("/")
    assert "ftjax coordinator" in page and '<td class="rid">a</td>' in page and '<td class="rid">b</td>' in page
    with pytest.raises(urllib.error.HTTPError) as e:
        get("/nope")
    assert e.value.code == 404


def test_cli_refuses_to_start_without_a_token(monkeypatch, capsys):
    monkeypatch.delenv("FTJAX_TOKEN", raising=False)
    assert main(["--port", "0"]) == 2
    assert "FTJAX_TOKEN" in capsys.readouterr().err


# -- plausibility and the position ledger across a restart -----------------------------------------


def test_an_absurd_step_from_an_authenticated_member_is_refused_reported_and_changes_nothing(
    make_server, make_client, raw
):
    server = make_server()
    a, b = make_client(server, "a"), make_client(server, "b")
    settle([a.quorum_async(5, 5, True), b.quorum_async(5, 5, True)])
    pending = a.quorum_async(6, 6, True)
    wait_pending(server, "a")
    before = membership(server)
    for member in (
        member_proto("evil", step=2**62),
        member_proto("b", incarnation=b.member.incarnation, step=6, data_position=10**6),
    ):
        with pytest.raises(grpc.RpcError) as e:
            raw(server).quorum_once(pb.QuorumRequest(member=member, timeout_ms=1000))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "beyond what the job can have reached" in e.value.details() and "step 5" in e.value.details()
    after = membership(server)
    assert after[:5] == before[:5] and after[5] == before[5] + 2  # only the two refusals were recorded
    refused = [f for f in server.state.snapshot(time.monotonic())["failures"] if f["kind"] == "implausible"]
    assert {f["replica_id"] for f in refused} == {"evil", "b"}
    ra, rb = settle([pending, b.quorum_async(6, 6, True)])
    assert ra.step == 6 and not ra.healing and not rb.healing  # nobody was put behind


def test_a_restarted_coordinator_rebuilds_positions_from_the_members_heartbeat_streams(make_server, raw):
    server = make_server()
    known = [pb.ReplicaPosition(replica_id="a", data_position=7), pb.ReplicaPosition(replica_id="c", data_position=41)]
    _, _call = raw(server).heartbeat_stream(
        pb.HeartbeatRequest(member=member_proto("a", step=7, data_position=7), known_positions=known)
    )
    wait_registered(server, "a")
    assert server.state.ledger.positions == {"a": 7, "c": 41}
    # replica c, down across the restart, comes back with no state and no memory of its stream
    r = raw(server)
    requests, answers = r.quorum_stream()
    requests.put(pb.QuorumRequest(member=member_proto("c", has_state=False), timeout_ms=5000))
    requests2, answers2 = raw(server).quorum_stream()
    requests2.put(pb.QuorumRequest(member=member_proto("a", step=7, data_position=7), timeout_ms=5000))
    got = next(answers)
    next(answers2)
    assert got.healing and got.data_position == 41


@pytest.mark.parametrize(
    "entry,field",
    [
        (pb.ReplicaPosition(replica_id="no spaces", data_position=1), "known_positions[0].replica_id"),
        (pb.ReplicaPosition(replica_id="c", data_position=-1), "known_positions[0].data_position"),
    ],
)
def test_bad_known_positions_are_refused_naming_the_entry(make_server, raw, entry, field):
    server = make_server()
    _, call = raw(server).heartbeat_stream(pb.HeartbeatRequest(member=member_proto("a"), known_positions=[entry]))
    error = call.exception(5)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith(field)
    assert server.state.members == {} and server.state.ledger.positions == {}


# -- one history (issue 26 items 2 and 3) ----------------------------------------------------------

ONE = dataclasses.replace(FAST, min_replicas=1)


def _wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_member_behind_a_finished_job_heals_from_a_holder_else_is_told_the_job_finished(make_server, make_client):
    server = make_server(ONE)
    a, b = make_client(server, "a"), make_client(server, "b")
    _wait_until(lambda: {"a", "b"} <= set(server.state.members))  # (else a alone may form the first quorum)
    settle([a.quorum_async(2, 2, True), b.quorum_async(2, 2, True)])
    late = b.member.incarnation
    b.close()  # b is cut off holding step 2; a trains steps 3 and 4 (the last) alone
    a.report_step({"step": 3, "committed": True}, target_steps=4)
    a.quorum(3, 3, True)
    a.quorum(4, 4, True)
    assert server.state.finished_step == 4
    # b is back (the same process) while a drains at the final step: it heals from a
    back = make_client(server, "b", inc=late)
    asked = back.quorum_async(2, 2, True)
    _wait_until(lambda: server.state.members.get("b") and server.state.members["b"].requested_at is not None)
    _drain, healed = settle([a.quorum_async(4, 4, True), asked])
    assert healed.healing and healed.heal_source == "a" and healed.step == 4
    # a has left; b, still behind, is told that the job finished: it never trains steps 3-4 alone
    a.close()
    with pytest.raises(JobFinished) as e:
        back.quorum(2, 2, True)
    assert e.value.step == 4 and "finished at step 4" in str(e.value)
    with pytest.raises(JobFinished):  # nor does a restart without state start the job over
        make_client(server, "a").quorum(0, 0, False)
    assert all(h["step"] >= 4 for h in server.state.history if "b" in h["participants"] and h["step"] > 2)


def test_no_quorum_forms_behind_the_committed_step_even_after_a_coordinator_restart():
    # A restarted coordinator has lost the committed step: the holders' first heartbeats carry it.
    state = CoordinatorState(ONE, 0.0, startup_grace=0.0)

    def member(rid, step):
        return MemberReport(rid, f"{rid}-1", step, step, True, ("127.0.0.1:1",), ("127.0.0.1:2",), "fp")

    state.register(member("a", 5), 0.0)  # a holds step 5 ...
    state.register(member("b", 3), 0.0)  # ... b was cut off at step 3
    state.disconnected("a", "a-1", 0.1)  # a is away (its stream ended): dead after the suspect window
    state.request(member("b", 3), 1.0)
    decision = state.evaluate(1.0)
    assert decision.quorum is None and "committed step 5" in decision.reason
    state.request(member("a", 5), 1.1)  # a is back: b heals from it
    q = state.evaluate(1.1).quorum
    assert q.step == 5 and [p.heal_source for p in q.participants] == ["", "a"]


def test_a_second_process_with_a_live_replica_id_is_refused_and_a_restart_is_admitted(make_server, make_client):
    server = make_server()
    a, b = make_client(server, "a"), make_client(server, "b")
    first = settle([a.quorum_async(0, 0, True), b.quorum_async(0, 0, True)])
    _wait_until(lambda: server.state._streams.get(("a", a.member.incarnation)))
    twin = make_client(server, "a", duplicate_grace_s=0.3)
    with pytest.raises(CoordinatorError) as e:
        twin.quorum(0, 0, True)
    assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert "replica id 'a'" in e.value.details and a.member.incarnation in e.value.details
    twin.close()
    # the live one is undisturbed: the same incarnation, the same quorum id
    again = settle([a.quorum_async(1, 1, True), b.quorum_async(1, 1, True)])
    assert again[0].quorum_id == first[0].quorum_id
    assert server.state.members["a"].report.incarnation == a.member.incarnation
    a.close()  # it dies: its restart is admitted as soon as its stream's end is seen
    a2 = make_client(server, "a")
    restarted, _ = settle([a2.quorum_async(0, 0, False), b.quorum_async(2, 2, True)])
    assert restarted.healing and restarted.heal_source == "b"


def test_a_silent_holder_of_an_id_is_replaced_after_its_heartbeat_timeout(make_server, make_client, raw):
    server = make_server(Settings(min_replicas=1, heartbeat_timeout_s=0.6, suspect_window_s=0.2))
    raw(server).heartbeat_stream(pb.HeartbeatRequest(member=member_proto("a")))  # open, then silent (SIGSTOP)
    _wait_until(lambda: "a" in server.state.members)
    newcomer = make_client(server, "a")  # refused while the silent one may be alive, admitted after
    assert newcomer.quorum(0, 0, False).participants[0].incarnation == newcomer.member.incarnation


def test_a_replica_whose_layout_differs_is_refused_naming_the_leaves(make_server, make_client):
    server = make_server()
    job = "mesh: lanes=1\n['params']['w']: (64, 64) float32 ()\n['params']['b']: (64,) float32 ()"
    a = make_client(server, "a", fp="fp-a", topology=job)
    _wait_until(lambda: "a" in server.state.members)
    b = make_client(server, "b", fp="fp-b", topology=job.replace("(64, 64)", "(128, 128)"))
    _wait_until(lambda: "fp-b" in server.state.layouts)  # (b's heartbeat was refused, its layout kept)
    with pytest.raises(CoordinatorError) as e:
        b.quorum(0, 0, True)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert (
        "1 items differ: ['params']['w'] (job: (64, 64) float32 (); this replica: (128, 128) float32 ())"
        in e.value.details
    ), e.value.details
    assert a.member.replica_id in server.state.members and "b" not in server.state.members
