"""The coordinator's HTTP side: `/` a status page (ftjax/coordinator/page.py), `/status` JSON,
`/metrics` Prometheus text.

Served by the standard library's threading HTTP server in a daemon thread; every request reads a
snapshot of the state under its lock, so the gRPC loop is never blocked for more than a copy.
`BoundedHTTPServer`, that server with bounds on idle and surplus connections, also serves a
replica's catch-up snapshots (ftjax/runtime/catchup.py).
"""

from __future__ import annotations

import io
import json
import math
import selectors
import socket
import socketserver
import ssl
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ftjax.base import net
from ftjax.coordinator.page import status_page
from ftjax.coordinator.state import CoordinatorState
from ftjax.runs.lifecycle import Phase

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0)
_WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# BoundedHTTPServer's defaults: a client is idle for 10 s at most, and a few peers or scrapers
# at a time are the normal load, so 64 connections leave room without letting a flood in.
IDLE_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 64
# A request's line and headers must all arrive within HEADER_TIMEOUT_S of its connection (a total,
# not per read: a client that drips a byte at a time is dropped then). Until they have, a connection
# holds no thread, only its bytes: MAX_PENDING of them at once, then new ones are refused.
HEADER_TIMEOUT_S = 10.0
MAX_PENDING = 256
_MAX_HEAD = 64 << 10  # a request line and headers longer than this are not a client of ours
_BUSY_BODY = b"too many connections: retry later\n"
_BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY)
)


class BoundedHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server (a daemon thread per request) that idle, slow or surplus connections
    cannot exhaust:

    - a new connection holds no thread until its request line and headers have all arrived: one
      thread (`_HeadReader`, a selector) reads every connection's head, and hands a complete one to
      a thread of its own. A head must arrive within `header_timeout_s` of the connection in all
      (a client that sends a byte at a time is dropped then, however often it sends one), and at
      most `max_pending` connections wait for theirs; one more is refused (503) at once;
    - every wait for the client, for its head or later, lasts at most `idle_timeout_s`: one that
      sends nothing, or stops reading its response, is dropped then. After the head, that bounds
      idleness, not duration: a long response that keeps moving (a rate-limited snapshot) is never
      cut, nor is a handler's wait that does not touch the socket (one `sendall` must finish within
      the timeout, though: a long response is written in chunks);
    - at most `max_connections` requests are served at once. One more is answered 503 and closed at
      once by the reading thread, without a thread of its own: queueing it instead would let slow
      requests pile up in the queue, and its client learns at once that it should retry.

    With `ssl_context` (a server-side `ssl.SSLContext`) every connection is TLS: its handshake is
    made in the reading thread too, under the same deadline. The host of `address` may be "" (every
    interface: one dual-stack IPv6 socket where the kernel has IPv6), an IPv4 or an IPv6 address.
    """

    daemon_threads = True
    request_queue_size = 128  # the listen backlog: a burst of connections is accepted, then judged

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        *,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
        header_timeout_s: float = HEADER_TIMEOUT_S,
        max_pending: int = MAX_PENDING,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        for name, value in (("idle_timeout_s", idle_timeout_s), ("header_timeout_s", header_timeout_s)):
            if value <= 0:
                raise ValueError(f"{name} must be positive, not {value}")
        for name, value in (("max_connections", max_connections), ("max_pending", max_pending)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, not {value}")
        self.idle_timeout_s = idle_timeout_s
        self.ssl_context = ssl_context
        self._slots = threading.BoundedSemaphore(max_connections)
        host, port = address
        self.address_family = net.family_of(host)
        super().__init__((net.sockaddr_host(host, self.address_family), port), handler)
        self._heads = _HeadReader(self._dispatch, header_timeout_s, idle_timeout_s, max_pending)

    def server_bind(self) -> None:
        # HTTPServer.server_bind would look up this host's name (socket.getfqdn), which waits on DNS
        # where there is none (a network namespace, a cluster node): not needed, so skipped.
        if self.address_family == socket.AF_INET6 and self.server_address[0] == "::":
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]  # type: ignore[assignment]

    def process_request(self, request: socket.socket, client_address) -> None:  # type: ignore[override]
        """A new connection (the accepting thread): to the head reader, or refused if it is full."""
        try:
            request.setblocking(False)
            if self.ssl_context is not None:
                request = self.ssl_context.wrap_socket(request, server_side=True, do_handshake_on_connect=False)
        except OSError:
            self.shutdown_request(request)
            return
        if not self._heads.add(request, client_address):
            if self.ssl_context is None:  # (a TLS client could not read a plain 503)
                _refuse(request)
            self.shutdown_request(request)

    def _dispatch(self, request: socket.socket, client_address, head: bytes) -> None:
        """A connection whose head has arrived (the reading thread): a thread serves it, if a slot is free."""
        if not self._slots.acquire(blocking=False):
            _refuse(request)
            self.shutdown_request(request)
            return
        try:
            request.settimeout(self.idle_timeout_s)
            super().process_request(_Received(request, head), client_address)  # type: ignore[arg-type]  # starts the request's thread
        except BaseException:
            self._slots.release()
            self.shutdown_request(request)
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def server_close(self) -> None:
        super().server_close()
        self._heads.close()

    def handle_error(self, request, client_address) -> None:
        # A client that hung up or went idle mid-response is its own business, not a server error:
        # no traceback on stderr for it (a flood of them would drown the process's output).
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError, ssl.SSLError)):
            super().handle_error(request, client_address)


def _refuse(request: socket.socket) -> None:
    """Best effort, never blocking: a 503 fits the empty send buffer of a new connection, and what
    the client sent already is read (closing on unread bytes resets the connection, and the client
    may then lose the 503)."""
    try:
        request.setblocking(False)
        request.send(_BUSY)
        request.recv(1 << 16)
    except OSError:
        pass


class _Replay(io.RawIOBase):
    """A connection's bytes as a raw stream: the head read already, then the socket's."""

    def __init__(self, head: bytes, sock: socket.socket) -> None:
        self._head, self._sock = memoryview(head), sock

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        if self._head:
            n = min(len(b), len(self._head))
            b[:n], self._head = self._head[:n], self._head[n:]
            return n
        return self._sock.recv_into(b)


class _Received:
    """A connection whose head `_HeadReader` read: the handler's `rfile` replays it, then reads the
    socket; everything else is the socket's."""

    def __init__(self, sock: socket.socket, head: bytes) -> None:
        self._sock, self._head = sock, head

    def __getattr__(self, name: str):
        return getattr(self._sock, name)

    def makefile(self, mode: str = "r", buffering: int | None = None, **kwargs):
        if "r" not in mode:
            return self._sock.makefile(mode, buffering, **kwargs)  # type: ignore[call-overload]
        raw = _Replay(self._head, self._sock)
        return raw if buffering == 0 else io.BufferedReader(raw, io.DEFAULT_BUFFER_SIZE)


class _Pending:
    """A connection whose head is still arriving."""

    def __init__(self, sock: socket.socket, address, deadline: float, idle_s: float) -> None:
        self.sock, self.address, self.deadline, self.idle_s = sock, address, deadline, idle_s
        self.expires = min(deadline, time.monotonic() + idle_s)  # the deadline, or sooner if it sends nothing
        self.head = b""
        self.handshaken = not isinstance(sock, ssl.SSLSocket)
        self.events = selectors.EVENT_READ
        self.gone = False  # dropped or handed over: no longer the reader's (its socket may be closed)


class _HeadReader:
    """Reads the request line and headers of every new connection in one thread (a selector, so a
    slow client costs a buffer, not a thread), and calls `ready(sock, address, head)` (in that
    thread) once a head has arrived. A connection past its deadline, over `_MAX_HEAD` bytes, closed
    or failing its TLS handshake is dropped."""

    def __init__(self, ready, timeout_s: float, idle_s: float, max_pending: int) -> None:
        self._ready, self._timeout_s, self._idle_s, self._max = ready, timeout_s, idle_s, max_pending
        self._lock = threading.Lock()
        self._new: list[_Pending] = []
        self._count, self._closed = 0, False
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        for s in (self._wake_r, self._wake_w):
            s.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="http-heads", daemon=True)
        self._thread.start()

    def add(self, sock: socket.socket, address) -> bool:
        """Whether the connection was taken (False: closing, or `max_pending` are waiting already)."""
        with self._lock:
            if self._closed or self._count >= self._max:
                return False
            self._count += 1
            self._new.append(_Pending(sock, address, time.monotonic() + self._timeout_s, self._idle_s))
        self._wake()
        return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._wake()
        self._thread.join(10)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # its buffer is full: the thread wakes anyway
            pass

    def _run(self) -> None:
        try:
            while self._turn():
                pass
        finally:
            for key in list(self._selector.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
            for p in self._new:
                p.sock.close()
            self._selector.close()
            self._wake_w.close()

    def _turn(self) -> bool:
        """One wait and what arrived; False once closed."""
        with self._lock:
            new, self._new, closed = self._new, [], self._closed
        if closed:
            self._new = new
            return False
        for p in new:
            self._selector.register(p.sock, p.events, p)
        pending = [k.data for k in self._selector.get_map().values() if k.data is not None]
        wait = min((p.expires for p in pending), default=time.monotonic() + 1.0) - time.monotonic()
        for key, _ in self._selector.select(max(0.0, wait)):
            if key.data is None:
                _drain(self._wake_r)
            else:
                self._advance(key.data)
        now = time.monotonic()
        for p in pending:
            if p.expires <= now and not p.gone:
                self._drop(p)  # idle, or its head did not arrive in time however often it sent a byte
        return True

    def _advance(self, p: _Pending) -> None:
        """Reads what `p` sent (after its TLS handshake); hands it over once its head is complete."""
        try:
            if not p.handshaken:
                p.sock.do_handshake()  # type: ignore[attr-defined]
                p.handshaken = True
            while True:
                data = p.sock.recv(1 << 16)
                if not data:
                    return self._drop(p)
                seen, p.head = len(p.head), p.head + data
                p.expires = min(p.deadline, time.monotonic() + p.idle_s)
                tail = p.head[max(0, seen - 3) :]  # where the head's end can be, not the whole head again
                if b"\r\n\r\n" in tail or b"\n\n" in tail:
                    return self._hand_over(p)
                if len(p.head) > _MAX_HEAD:
                    return self._drop(p)
        except ssl.SSLWantWriteError:
            self._want(p, selectors.EVENT_READ | selectors.EVENT_WRITE)
        except (ssl.SSLWantReadError, BlockingIOError):
            self._want(p, selectors.EVENT_READ)
        except OSError:  # reset, or a TLS handshake that failed (a plain client, another CA)
            self._drop(p)

    def _want(self, p: _Pending, events: int) -> None:
        if events != p.events:
            p.events = events
            self._selector.modify(p.sock, events, p)

    def _forget(self, p: _Pending) -> None:
        p.gone = True
        self._selector.unregister(p.sock)
        with self._lock:
            self._count -= 1

    def _drop(self, p: _Pending) -> None:
        self._forget(p)
        p.sock.close()

    def _hand_over(self, p: _Pending) -> None:
        self._forget(p)
        try:
            self._ready(p.sock, p.address, p.head)
        except Exception:  # (no thread could start): this connection only, never the reader
            p.sock.close()


def _drain(sock: socket.socket) -> None:
    try:
        while sock.recv(4096):
            pass
    except OSError:
        pass


class _StateCollector:
    """Counters and gauges read from the state at scrape time (nothing to update on the hot path).

    Per replica (label `replica`, its replica id): whether it is up, its lifecycle state, step,
    loss, step time, tokens/s, MFU, restarts. For the job: target and committed steps, steps/s, ETA,
    tokens/s, tokens, goodput, ETTR, loss. A figure not known yet (no report, no warm-up) has no sample.
    A DiLoCo job (steps are outer rounds) also has its inner steps per round and the bytes averaged,
    in all and per replica; an every-step job has none of these families."""

    def __init__(self, state: CoordinatorState) -> None:
        self._state = state

    def collect(self):
        now = time.monotonic()
        s = self._state.summary(now)
        c = s["counters"]
        yield CounterMetricFamily("ftjax_coordinator_heartbeats", "Heartbeats received.", value=c["heartbeats"])
        yield CounterMetricFamily(
            "ftjax_coordinator_quorum_requests", "Quorum requests received.", value=c["quorum_requests"]
        )
        yield CounterMetricFamily("ftjax_coordinator_quorums", "Quorums formed.", value=c["quorums"])
        yield CounterMetricFamily(
            "ftjax_coordinator_quorum_id_changes", "Quorums formed with a new id.", value=c["quorum_id_changes"]
        )
        failures = CounterMetricFamily(
            "ftjax_coordinator_failures",
            "Failure signals: source is what saw it (report: a peer's accusation, verdict: its outcome after the "
            "suspect window, disconnect: a heartbeat stream ended, departed: a member left the membership, "
            "implausible: a refused request), kind what it found (the verdict, or why the member departed).",
            labels=["source", "kind"],
        )
        for (source, kind), n in sorted(s["failure_counts"].items()):
            failures.add_metric([source, kind], n)
        yield failures
        yield GaugeMetricFamily("ftjax_coordinator_alive_replicas", "Replicas alive now.", value=s["alive"])
        yield GaugeMetricFamily(
            "ftjax_coordinator_quorum_id", "Id of the latest quorum (0: none yet).", value=s["quorum_id"]
        )
        yield GaugeMetricFamily(
            "ftjax_coordinator_quorum_size", "Participants of the latest quorum.", value=s["quorum_size"]
        )
        yield GaugeMetricFamily("ftjax_coordinator_step", "Step of the latest quorum.", value=s["step"])
        yield GaugeMetricFamily(
            "ftjax_coordinator_seconds_since_progress",
            "Seconds since the job's step last moved (0 before the first quorum).",
            value=s["seconds_since_progress"],
        )
        yield GaugeMetricFamily(
            "ftjax_coordinator_stalled",
            "1 while the job makes no progress and failed steps keep forming quorums.",
            value=int(s["stalled"]),
        )
        view = self._state.metrics_view(now)
        yield from _job_families(view["job"])
        yield from _replica_families(view["replicas"])


def _job_families(job: dict):
    gauges = [
        ("ftjax_job_target_steps", "The job's configured steps (from the replicas' reports).", "target_steps"),
        ("ftjax_job_committed_steps", "Steps the job has committed.", "committed_steps"),
        ("ftjax_job_replicas", "The job's replicas (ft.replicas as reported, else the expected replicas).", "replicas"),
        ("ftjax_job_replicas_training", "Replicas that contribute to the job's steps now.", "training"),
        ("ftjax_job_steps_per_second", "Committed steps per second over the last minute.", "steps_per_s"),
        ("ftjax_job_eta_seconds", "Estimated seconds to the target step at the recent step rate.", "eta_s"),
        ("ftjax_job_tokens_per_second", "Tokens of committed steps per second over the last 30 s.", "tokens_per_s"),
        (
            "ftjax_job_goodput_tokens_per_second",
            "Goodput: tokens of committed steps per second since warm-up (every replica trained a step).",
            "goodput_tokens_per_s",
        ),
        (
            "ftjax_job_ettr",
            "Effective training time ratio since warm-up: the replicas' productive time over "
            "replicas x elapsed time (as in RUN/summary.json).",
            "ettr",
        ),
        ("ftjax_job_loss", "Mean of the replicas' latest training losses.", "loss"),
        ("ftjax_job_median_step_seconds", "Median time between the job's steps (recent).", "median_step_s"),
    ]
    for name, help_text, key in gauges:
        if job.get(key) is not None:
            yield GaugeMetricFamily(name, help_text, value=job[key])
    yield CounterMetricFamily(
        "ftjax_job_tokens", "Tokens of committed steps since this coordinator started.", value=job["tokens_total"]
    )
    sync = job.get("sync")
    if sync:
        yield GaugeMetricFamily(
            "ftjax_job_inner_steps",
            "DiLoCo: inner optimizer steps per outer round (a step of the job is an outer round).",
            value=sync["inner_steps"],
        )
        yield CounterMetricFamily(
            "ftjax_job_sync_bytes",
            "DiLoCo: float32 bytes of parameter deltas the replicas averaged since this coordinator started.",
            value=sync["bytes_total"],
        )
        if sync["bytes_per_token"] is not None:
            yield GaugeMetricFamily(
                "ftjax_job_sync_bytes_per_token",
                "DiLoCo: bytes averaged per token trained in those rounds.",
                value=sync["bytes_per_token"],
            )


# A replica's series that are one value of its /status row each: (kind, name, help, row key).
_REPLICA_SERIES = [
    (GaugeMetricFamily, "ftjax_replica_step", "Steps the replica reported committed.", "step"),
    (GaugeMetricFamily, "ftjax_replica_loss", "Training loss of the replica's latest batch.", "loss"),
    (GaugeMetricFamily, "ftjax_replica_step_seconds", "Wall time of the replica's latest step.", "step_time_s"),
    (
        GaugeMetricFamily,
        "ftjax_replica_tokens_per_second",
        "Tokens per second of the replica's latest step.",
        "tokens_per_s",
    ),
    (
        GaugeMetricFamily,
        "ftjax_replica_mfu",
        "Model FLOPs utilization of the replica's latest step: model FLOPs / (step time x devices x peak "
        "FLOP/s); no sample where the devices' peak is not known.",
        "mfu",
    ),
    (GaugeMetricFamily, "ftjax_replica_healing", "1 while the latest quorum has the replica heal.", "healing"),
    (
        GaugeMetricFamily,
        "ftjax_replica_heartbeat_age_seconds",
        "Seconds since the coordinator last heard from the replica.",
        "heartbeat_age_s",
    ),
    (
        CounterMetricFamily,
        "ftjax_replica_restarts",
        "New incarnations of the replica seen by this coordinator after its first.",
        "restarts",
    ),
    (
        GaugeMetricFamily,
        "ftjax_replica_catchup_bytes",
        "Bytes of a catch-up's snapshot the replica's hosts fetched so far (while one is under way).",
        "catchup_bytes_done",
    ),
    (
        GaugeMetricFamily,
        "ftjax_replica_catchup_total_bytes",
        "Bytes of the snapshot a catch-up under way fetches.",
        "catchup_bytes_total",
    ),
    (
        GaugeMetricFamily,
        "ftjax_replica_catchup_eta_seconds",
        "Seconds a catch-up under way has left at its slowest host's rate.",
        "catchup_eta_s",
    ),
]


def _replica_families(rows: list[dict]):
    def family(kind, name: str, help_text: str, key: str):
        f = kind(name, help_text, labels=["replica"])
        for r in rows:
            v = r.get(key)
            if v is not None and not (isinstance(v, float) and math.isinf(v)):
                f.add_metric([r["replica_id"]], float(v))
        return f

    yield family(GaugeMetricFamily, "ftjax_replica_up", "1 while the replica heartbeats, 0 once it is out.", "alive")
    state = GaugeMetricFamily(
        "ftjax_replica_state",
        "1 for the replica's lifecycle state (starting, training, stalled, catching up, down, done), 0 for the others.",
        labels=["replica", "state"],
    )
    for r in rows:
        for phase in Phase:
            if phase is not Phase.GONE:
                state.add_metric([r["replica_id"], phase.value], 1.0 if r["state"] == phase.value else 0.0)
    yield state
    for series in _REPLICA_SERIES:
        yield family(*series)
    if any("sync_bytes_total" in r for r in rows):  # a DiLoCo job
        yield family(
            CounterMetricFamily,
            "ftjax_replica_sync_bytes",
            "DiLoCo: float32 bytes of parameter deltas the replica averaged since this coordinator started.",
            "sync_bytes_total",
        )


class Metrics:
    """The coordinator's Prometheus registry (one per server, so several can live in one process)."""

    def __init__(self, state: CoordinatorState) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(state))
        self._answer = Histogram(
            "ftjax_coordinator_quorum_latency_seconds",
            "Per participant: from the request that completed its quorum to its answer handed to gRPC.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._wait = Histogram(
            "ftjax_coordinator_quorum_wait_seconds",
            "From a quorum's first pending request to its formation (waiting for the others).",
            buckets=_WAIT_BUCKETS,
            registry=self.registry,
        )
        self._rejected = Counter(
            "ftjax_coordinator_rejected_calls", "Calls refused, by gRPC status.", ["code"], registry=self.registry
        )
        self._commits = Counter(
            "ftjax_coordinator_commit_answers",
            "Answers to commit votes (ft.commit_decision: coordinator), by decision.",
            ["decision"],
            registry=self.registry,
        )

    def observe_wait(self, seconds: float) -> None:
        self._wait.observe(seconds)

    def observe_answer(self, seconds: float) -> None:
        self._answer.observe(seconds)

    def rejected(self, code: str) -> None:
        self._rejected.labels(code).inc()

    def commit_decided(self, decision: str) -> None:
        self._commits.labels(decision).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)


class StatusHTTPServer:
    """Serves `/`, `/status` and `/metrics` from a daemon thread."""

    def __init__(
        self,
        state: CoordinatorState,
        metrics: Metrics,
        host: str,
        port: int,
        *,
        advertise: str | None = None,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
        header_timeout_s: float = HEADER_TIMEOUT_S,
        max_pending: int = MAX_PENDING,
    ) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, CONTENT_TYPE_LATEST, metrics.text())
                elif path == "/status":
                    body = json.dumps(state.snapshot(time.monotonic()), indent=1).encode()
                    self._send(200, "application/json", body)
                elif path == "/":
                    self._send(200, "text/html; charset=utf-8", status_page(state.snapshot(time.monotonic())).encode())
                else:
                    self._send(404, "text/plain", b"not found: try /, /status or /metrics\n")

            def _send(self, code: int, content_type: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # quiet: the coordinator's stdout is for its address line
                pass

        self._server = BoundedHTTPServer(
            (host, port),
            Handler,
            idle_timeout_s=idle_timeout_s,
            max_connections=max_connections,
            header_timeout_s=header_timeout_s,
            max_pending=max_pending,
        )
        self.address = net.format_address(net.advertised(host, advertise), self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="coordinator-http", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
