"""Bounds that a hostile or broken client cannot push past: the coordinator's memory under a stream
of calls, and the threads and sockets that idle or surplus connections can hold in the two HTTP
servers (the coordinator's status server and a replica's catch-up server)."""

from __future__ import annotations

import gc
import json
import socket
import threading
import time
import urllib.error
import urllib.request
import weakref
from contextlib import ExitStack

import grpc
import numpy as np
import pytest
from conftest import FTJAX

from ftjax.base.net import split_address
from ftjax.coordinator import TOKEN_METADATA_KEY
from ftjax.coordinator import coordinator_pb2 as pb
from ftjax.coordinator import coordinator_pb2_grpc as pb_grpc
from ftjax.coordinator.collector import _collect_old_generation
from ftjax.coordinator.http import Metrics, StatusHTTPServer
from ftjax.coordinator.quorum import Settings
from ftjax.coordinator.state import CoordinatorState
from ftjax.runtime.catchup import HostShards, Piece, SnapshotFetch, SnapshotServer, _Snapshot

pytestmark = pytest.mark.timeout(120)
TOKEN = "bounds-token"


# --- coordinator memory ---------------------------------------------------------------------------
def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def start_coordinator(procs, tmp_path):
    """`ftjax coordinator` as its own process: its collector settings are the ones under test."""
    token_file, ready = tmp_path / "token", tmp_path / "ready.json"
    token_file.write_text(TOKEN)
    proc = procs.start(
        [*FTJAX, "coordinator", "--http-port", "-1", "--token-file", str(token_file), "--ready-file", str(ready)]
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None, f"the coordinator exited with {proc.returncode}"
        assert time.monotonic() < deadline, "the coordinator did not start"
        time.sleep(0.02)
    return proc, json.loads(ready.read_text())["grpc"]


@pytest.mark.timeout(300)  # 20,000 calls: 27 s quiet, 73-77 s in a hogged suite, past 120 s on a slower 2-core machine
def test_coordinator_memory_stays_bounded_under_sustained_unary_calls(procs, tmp_path):
    # Every wrong-token call leaves ~30 objects in reference cycles (the abort's exception and
    # traceback), every valid one ~6 (grpc's handler lookup): with the collector off they were
    # never freed, ~2.8 KB a call.
    proc, address = start_coordinator(procs, tmp_path)
    good, bad = ((TOKEN_METADATA_KEY, TOKEN),), ((TOKEN_METADATA_KEY, "wrong"),)
    report = pb.FailureReport(quorum_id=1, replica_id="ghost", incarnation="i", reason="memory test")
    calls, warm, rss = 20_000, 5_000, {}
    t0 = time.monotonic()
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        for i in range(calls):
            if i % 2:
                with pytest.raises(grpc.RpcError) as e:
                    stub.ReportFailure(report, metadata=bad, timeout=10)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            else:
                verdict = stub.ReportFailure(report, metadata=good, timeout=10)
                assert verdict.verdict == pb.FailureVerdict.UNKNOWN_REPLICA
            if i + 1 in (warm, calls):
                rss[i + 1] = rss_mb(proc.pid)
    growth = rss[calls] - rss[warm]
    print(f"{calls} calls in {time.monotonic() - t0:.1f} s; RSS {rss} MB")
    assert growth < 20, f"coordinator RSS grew {growth:.1f} MB from call {warm} to {calls} ({rss})"


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_backstop_collects_once_the_old_generation_grew():
    # The cycles that outlive two young collections sit in the old generation, which is never
    # collected automatically: the backstop must collect it once `growth` objects have reached it,
    # not only every few minutes, and not while it does not grow. (As in a coordinator, what exists
    # at the start is frozen out of it; the collector is off: only the backstop collects, and only
    # collections promote.)
    stop = threading.Event()
    backstop = threading.Thread(
        target=_collect_old_generation, args=(stop,), kwargs=dict(check_s=0.02, growth=5_000, every_s=1e9), daemon=True
    )
    full = []
    batches = []

    def count_full(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            full.append(threading.current_thread() is backstop)

    gc.disable()
    gc.freeze()
    gc.callbacks.append(count_full)
    try:
        backstop.start()
        time.sleep(0.5)  # ~25 checks of an old generation that does not grow
        assert full == [], "a full collection without growth"
        deadline = time.monotonic() + 20
        while all(ref() is not None for ref in batches):
            assert time.monotonic() < deadline, f"{len(batches)} batches of 1000 cycles, none collected"
            assert len(batches) < 1000, "collected only after 1M objects, for a growth of 5000"
            batch = [Cycle() for _ in range(1000)]
            gc.collect(1)  # survivors of a young collection: promoted to the old generation
            batches.append(weakref.ref(batch[0]))
            del batch
            time.sleep(0.01)
        assert full and all(full), full
    finally:
        stop.set()
        backstop.join(10)
        gc.callbacks.remove(count_full)
        gc.unfreeze()
        gc.enable()
        gc.collect()


# --- HTTP servers ---------------------------------------------------------------------------------
IDLE_S = 1.0
N_IDLE = 200


def half_sent(address: str, n: int) -> list[socket.socket]:
    """`n` connections that each send a request line without its final CRLF, then nothing."""
    conns = []
    for _ in range(n):
        s = socket.create_connection(split_address(address), timeout=10)
        s.sendall(b"GET /snap HTTP/1.0")
        conns.append(s)
    return conns


def closed_by_server(s: socket.socket, wait_s: float) -> bool:
    """Whether the server ended the connection (EOF, reset or a refusal) within `wait_s`."""
    s.settimeout(wait_s)
    try:
        data = s.recv(4096)
    except TimeoutError:
        return False
    except OSError:  # reset: closed with our unread request in its buffer
        return True
    return data == b"" or data.startswith(b"HTTP/1.0 503")


def thread_count_over(baseline: int, seconds: float) -> int:
    """The most threads above `baseline` seen while sampling for `seconds`."""
    most, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        most = max(most, threading.active_count() - baseline)
        time.sleep(0.01)
    return most


def wait_threads_back(baseline: int, timeout: float, margin: int = 2) -> int:
    deadline = time.monotonic() + timeout
    while (extra := threading.active_count() - baseline) > margin and time.monotonic() < deadline:
        time.sleep(0.05)
    return extra


class Status:
    """The coordinator's HTTP status server, and a normal request to it."""

    def __init__(self, **bounds) -> None:
        state = CoordinatorState(Settings(min_replicas=1), time.monotonic())
        self.server = StatusHTTPServer(state, Metrics(state), "127.0.0.1", 0, **bounds)
        self.address = self.server.address

    def normal_request(self) -> None:
        with urllib.request.urlopen(f"http://{self.address}/metrics", timeout=10) as r:
            assert r.status == 200 and b"ftjax_coordinator_heartbeats_total" in r.read()

    def close(self) -> None:
        self.server.close()


class Catchup:
    """A replica host's catch-up server offering a two-leaf snapshot, and a real fetch of it."""

    def __init__(self, **bounds) -> None:
        # (a lease outlives 60 s without a request: a fetch's first `import jax` between its manifest
        # and its ranges took over 5 s on a busy machine, and the range was answered 410)
        self.server = SnapshotServer(TOKEN, wait_offer_s=60.0, **bounds)
        self.address = self.server.address

    def offer(self, leaves: dict[str, np.ndarray], step: int = 7) -> None:
        """What `offer` holds once the state is in host memory (without JAX)."""
        shards = HostShards(
            {k: (v.shape, v.dtype.name) for k, v in leaves.items()},
            [Piece(k, tuple((0, n) for n in v.shape), v) for k, v in leaves.items()],
        )
        self.server.publish(_Snapshot("peer", step, {"k": 1}, shards))

    def fetch(self, timeout: float = 30.0):
        f = SnapshotFetch(self.address, "peer", TOKEN, source="test", timeout_s=timeout)
        assert f.done.wait(timeout + 5), "the fetch did not end"
        assert f.error is None, f.error
        return f.result

    def normal_request(self) -> None:
        result = self.fetch()
        assert result.step == 7 and result.shards.pieces[0].data.tobytes() == b"a" * 1000

    def close(self) -> None:
        self.server.close()


@pytest.fixture(params=["status", "catchup"])
def make_server(request, tmp_path):
    with ExitStack() as stack:

        def make(**bounds):
            if request.param == "status":
                server = Status(**bounds)
            else:
                server = Catchup(**bounds)
                server.offer({"a": np.full(1000, ord("a"), np.uint8), "d/b": np.full((2, 5), ord("b"), np.uint8)})
            stack.callback(server.close)
            return server

        yield make, stack


def test_idle_half_sent_connections_time_out(make_server):
    make, stack = make_server
    server = make(idle_timeout_s=IDLE_S, max_connections=N_IDLE + 50)
    baseline = threading.active_count()  # with the server's own accept thread
    conns = half_sent(server.address, N_IDLE)
    for s in conns:
        stack.callback(s.close)
    server.normal_request()  # served while they hang (below the cap)
    # Well within the deadline on a busy machine, each idle one is dropped by the server.
    extra = wait_threads_back(baseline, timeout=IDLE_S + 20)
    assert extra <= 2, f"{extra} threads still held {IDLE_S + 20:.0f} s after {N_IDLE} idle connections"
    still_open = sum(not closed_by_server(s, wait_s=2.0) for s in conns)
    assert still_open == 0, f"{still_open} of {N_IDLE} idle connections not closed by the server"
    server.normal_request()


def test_connections_beyond_the_cap_are_refused_without_a_thread(make_server):
    # Half-sent requests wait for their heads without a thread (no thread at all now), at most
    # `max_pending` of them: the surplus is refused at once.
    make, stack = make_server
    cap = 20
    server = make(idle_timeout_s=60.0, header_timeout_s=60.0, max_pending=cap)  # nothing times out here
    baseline = threading.active_count()
    conns = half_sent(server.address, N_IDLE)
    for s in conns:
        stack.callback(s.close)
    most = thread_count_over(baseline, seconds=1.0)
    assert most <= 2, f"{most} threads for {N_IDLE} half-sent connections"
    refused = sum(closed_by_server(s, wait_s=0.2) for s in conns)
    assert refused >= N_IDLE - cap, f"only {refused} of the {N_IDLE - cap} surplus connections were refused"
    for s in conns:  # the held ones end: their places free up for a normal request
        s.close()
    assert wait_threads_back(baseline, timeout=20) <= 2
    # (the selector sees each close on its next turn: a request sent before it has seen them all is
    # refused, as one beyond the cap should be; the places must come back, within a bound)
    deadline = time.monotonic() + 20
    while True:
        try:
            server.normal_request()
            break
        except (urllib.error.HTTPError, AssertionError) as e:  # (catch-up's fetch: an AssertionError naming it)
            assert "503" in str(e), e  # refused for want of a place: anything else is a failure now
            assert time.monotonic() < deadline, f"the held connections' places never came back: {e}"
            time.sleep(0.05)


def request_threads() -> set[threading.Thread]:
    """The live threads serving a request (`ThreadingHTTPServer` names each for its target)."""
    return {t for t in threading.enumerate() if "process_request_thread" in t.name}


def test_complete_requests_beyond_the_cap_are_refused_without_a_thread():
    # `max_connections` bounds the requests served at once: with its one slot held by a fetch
    # waiting for an offer, a second complete request is answered 503 at once, without a thread.
    server = Catchup(max_connections=1)
    try:
        server.offer({"a": np.full(1000, ord("a"), np.uint8)}, step=1)
        waiting = SnapshotFetch(server.address, "peer", TOKEN, source="test", min_step=5, timeout_s=30)
        deadline = time.monotonic() + 20
        while server.server.offered("peer"):  # until its request, in a handler, asks for a fresher one
            assert time.monotonic() < deadline, "the fetch's request was never served"
            time.sleep(0.01)
        # (the server's own request threads, not the process's: a test worker runs threads of its own)
        baseline = request_threads()
        assert len(baseline) == 1, f"the waiting fetch should hold the one slot: {baseline}"
        with socket.create_connection(split_address(server.address), timeout=10) as s:
            s.sendall(b"GET /snapshot/manifest?key=peer HTTP/1.0\r\n\r\n")
            answer = s.recv(4096)
            assert answer.startswith(b"HTTP/1.0 503"), answer[:200]
            started = request_threads() - baseline
        assert not started, f"a request beyond the cap was given a thread: {started}"
        server.offer({"a": np.full(1000, ord("a"), np.uint8)})
        assert waiting.done.wait(30) and waiting.error is None, waiting.error
    finally:
        server.close()


N_DRIP = 72  # more than the default 64 connections served at once


def test_slow_drip_clients_cannot_starve_a_normal_request(make_server):
    # Clients that send their request a byte at a time, each byte well within the idle timeout, held
    # all 64 slots as long as they dripped (the status page and /metrics answered 503): now their
    # heads are read without a thread, the normal request is served beside them, and each is dropped
    # once its head has not arrived within the header timeout in all.
    make, stack = make_server
    header_s = 6.0
    server = make(idle_timeout_s=3.0, header_timeout_s=header_s)  # (a byte every 0.1 s: never idle)
    # (before the connections: the server's header deadline runs from its accept, which may come
    # before a `t0` taken after connect returns; that one read 5.997 s once)
    t0 = time.monotonic()
    conns = [socket.create_connection(split_address(server.address), timeout=10) for _ in range(N_DRIP)]
    for s in conns:
        stack.callback(s.close)
    request = b"GET /snapshot/manifest?key=peer HTTP/1.0\r\n" + b"X-Pad: " + b"x" * 10_000
    dropped: dict[int, float] = {}  # conn index -> when a send or the server's EOF showed it closed
    stop = threading.Event()

    def drip() -> None:
        for k in range(len(request)):
            for i, s in enumerate(conns):
                if i not in dropped:
                    try:
                        s.send(request[k : k + 1])
                    except OSError:
                        dropped[i] = time.monotonic()
            if stop.wait(0.1) or len(dropped) == N_DRIP:
                return

    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    stack.callback(dripper.join, 10)
    stack.callback(stop.set)
    server.normal_request()  # (its connection is accepted after theirs)
    assert not dropped, f"{len(dropped)} drippers dropped before the normal request was served"
    still_open = sum(not closed_by_server(s, wait_s=header_s + 20) for s in conns)
    assert still_open == 0, f"{still_open} of {N_DRIP} dripping connections not closed by the server"
    assert time.monotonic() - t0 >= header_s  # dropped by the header deadline, not sooner
    server.normal_request()


def test_slow_catchup_transfer_outlives_the_idle_timeout():
    # The timeout bounds idleness, not duration: a rate-limited send of 1 MB at 0.4 MB/s (~2.5 s),
    # after a wait for the offer, both longer than the idle timeout, still completes.
    server = Catchup(idle_timeout_s=0.5, max_connections=4)
    big = np.full(1_000_000, ord("x"), np.uint8)
    later = threading.Timer(1.0, server.offer, args=({"a": np.full(1000, ord("a"), np.uint8), "big": big},))
    try:
        server.server.rate_limit_mbps = 0.4
        later.start()
        t0 = time.monotonic()
        result = server.fetch()
        assert result.nbytes == 1_001_000 and np.array_equal(result.shards.pieces[1].data, big)
        assert time.monotonic() - t0 >= 2.0  # it did take longer than the idle timeout
    finally:
        later.cancel()
        later.join()
        server.close()


def test_head_reader_outlives_a_head_completed_as_its_deadline_passed(monkeypatch):
    # A connection handed over (and closed by its worker) in the very turn in which its deadline
    # passed was then looked up by its closed socket: ValueError, and the reading thread was gone,
    # every later connection unserved. The reader's clock stands still until the first head is
    # handed over, then jumps past its deadline: the turn's deadline check comes next.
    from types import SimpleNamespace

    from ftjax.base import http

    served = []
    monkeypatch.setattr(http, "time", SimpleNamespace(monotonic=lambda: 1000.0 + (200.0 if served else 0.0)))

    def ready(sock, address, head):  # a worker that answers at once: the socket is closed in the turn
        served.append(head)
        sock.close()

    reader = http._HeadReader(ready, timeout_s=100.0, idle_s=100.0, max_pending=8)
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        client = socket.create_connection(listener.getsockname(), timeout=10)
        conn, address = listener.accept()
        conn.setblocking(False)
        assert reader.add(conn, address)
        client.sendall(b"GET / HTTP/1.0\r\n\r\n")
        deadline = time.monotonic() + 10
        while not served:
            assert time.monotonic() < deadline, "the head was never handed over"
            time.sleep(0.01)
        client.close()
        client = socket.create_connection(listener.getsockname(), timeout=10)  # a later connection
        client.sendall(b"GET /later HTTP/1.0\r\n\r\n")
        conn, address = listener.accept()
        conn.setblocking(False)
        assert reader.add(conn, address)
        while len(served) < 2:
            assert reader._thread.is_alive(), "the reading thread died"
            assert time.monotonic() < deadline, "the later head was never handed over"
            time.sleep(0.01)
        assert served[1].startswith(b"GET /later")
        client.close()
    finally:
        reader.close()
        listener.close()
