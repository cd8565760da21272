"""The coordinator's gRPC server, and `ftjax coordinator`.

One asyncio event loop (uvloop when installed) serves every call: heartbeats and quorum requests
arrive on long-lived streams, and a pending quorum request is a future that the formation of a
quorum resolves. The membership itself lives in `CoordinatorState` (one lock), which the HTTP
status thread reads. Nothing here is durable: a restarted coordinator relearns everything from the
members (see coordinator/state.py).

A quorum's answer is serialized once and shared (`QuorumEncoding`, ftjax/coordinator/codec.py):
each participant gets the common bytes followed by a few bytes of its own, and the static
membership only when it does not hold it yet, so a quorum of N members costs O(N) bytes to build,
not O(N^2).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hmac
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ftjax.base import net
from ftjax.base.env import TOKEN_ENV, read_token
from ftjax.base.net import ADVERTISE_ENV, BIND_ENV
from ftjax.base.tls import TLS, add_tls_arguments, tls_of
from ftjax.config import CoordinatorConfig, flag_name
from ftjax.coordinator import TOKEN_METADATA_KEY
from ftjax.coordinator import coordinator_pb2 as pb
from ftjax.coordinator.codec import QuorumEncoding
from ftjax.coordinator.commits import PENDING, NotAParticipant
from ftjax.coordinator.http import Metrics, StatusHTTPServer
from ftjax.coordinator.jobview import JobView
from ftjax.coordinator.layout import MAX_LAYOUT_BYTES
from ftjax.coordinator.lifetime import JobEnd, watch
from ftjax.coordinator.progress import StepFigures
from ftjax.coordinator.quorum import (
    MAX_HOSTS,
    MAX_REASON_BYTES,
    MAX_STEP,
    MAX_TIMEOUT_MS,
    RECONNECT_WINDOW_S,
    InvalidField,
    MemberReport,
    Settings,
    check_id,
    check_int,
    check_text,
)
from ftjax.coordinator.state import MAX_MEMBERS, Accusation, CoordinatorState, Rejected

SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
# The standard gRPC health service (grpc.health.v1.Health), for probes (Kubernetes' `grpc` probes,
# grpc_health_probe): it answers without the job token, and says SERVING for "" and SERVICE.
HEALTH_PREFIX = f"/{health.SERVICE_NAME}/"
MAX_MESSAGE_BYTES = 1 << 20  # a Member is at most ~270 KB (1024 addresses of 256 bytes)
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_concurrent_streams", 1 << 20),
    # Calls not yet picked up by the loop: the defaults (1000 soft, 3000 hard) cancel calls when a
    # thousand replicas (re)connect at once.
    ("grpc.server.max_pending_requests", 50_000),
    ("grpc.server.max_pending_requests_hard_limit", 100_000),
    ("grpc.so_reuseport", 0),  # a second coordinator on the same port must fail
]
_VERDICTS = pb.FailureVerdict.Verdict


class MemberDecoder:
    """Wire Member -> validated MemberReport. The static fields of a member are validated once per
    incarnation, not on every step's request (remembered in a bounded set)."""

    def __init__(self, capacity: int = 4 * MAX_MEMBERS) -> None:
        self._valid: set[tuple] = set()
        self._capacity = capacity

    def __call__(self, member: pb.Member, known_quorum_id: int = 0, prefix: str = "member") -> MemberReport:
        """Raise InvalidField naming the bad field."""
        check_int(f"{prefix}.num_hosts", member.num_hosts, 1, MAX_HOSTS)
        if len(member.catchup_addresses) != member.num_hosts:
            raise InvalidField(
                f"{prefix}.catchup_addresses",
                f"{len(member.catchup_addresses)} addresses for num_hosts={member.num_hosts}",
            )
        report = MemberReport(
            member.replica_id,
            member.incarnation,
            member.step,
            member.data_position,
            member.has_state,
            tuple(member.ftar_addresses),
            tuple(member.catchup_addresses),
            member.topology_fingerprint,
            member.commit_failures,
            known_quorum_id,
            member.digest,
        )
        static = (report.replica_id, report.incarnation, *report.static_fields())
        known = static in self._valid
        report.validate(prefix, static=not known)
        if not known:
            if len(self._valid) >= self._capacity:
                self._valid.clear()
            self._valid.add(static)
        return report


@dataclass
class _Failure:
    """A pending request answered with an error instead of a quorum."""

    code: grpc.StatusCode
    message: str


@dataclass
class _Finished:
    """A pending request answered `finished_step` instead of a quorum."""

    step: int


@dataclass
class _Waiter:
    future: asyncio.Future
    incarnation: str
    known_quorum_id: int
    since: float


class _Service:
    """The three RPCs; every method runs on the server's event loop."""

    def __init__(self, state: CoordinatorState, metrics: Metrics, loop: asyncio.AbstractEventLoop) -> None:
        self.state = state
        self.metrics = metrics
        self.loop = loop
        self._waiters: dict[str, _Waiter] = {}
        self._decode = MemberDecoder()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        self._votes: dict[int, list[asyncio.Future]] = {}  # formation -> its voters awaiting the decision

    # -- scheduling ---------------------------------------------------------------------------

    def _after_event(self, now: float) -> None:
        self._answer_finished(now)  # (first: a finished job forms no quorum, not even one without state)
        if self.state.may_form(now):
            self._evaluate(now, sweep=False)
        self._answer_votes(now)
        self._arm(self.state.next_wake(now))

    def _answer_votes(self, now: float) -> None:
        """Answer the voters of every formation decided since the last look (a vote, a deadline, a
        participant's departure or a newer quorum decided it)."""
        for formation, decision in self.state.commit_decisions(now):
            for future in self._votes.pop(formation, ()):
                if not future.done():
                    future.set_result(decision)

    def _arm(self, when: float | None) -> None:
        if when is None or (self._timer is not None and self._timer_at <= when):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = self.loop.call_later(max(0.0, when - time.monotonic()), self._on_timer)

    def _on_timer(self) -> None:
        self._timer, self._timer_at = None, float("inf")
        now = time.monotonic()
        self._answer_finished(now)
        self._evaluate(now)
        self._answer_votes(now)
        self._arm(self.state.next_wake(now))

    def _evaluate(self, now: float, *, sweep: bool = True) -> None:
        decision = self.state.evaluate(now, sweep=sweep)
        q = decision.quorum
        if q is None:
            return
        encoded = QuorumEncoding(q)
        first = now
        # Oldest request first (the dict keeps arrival order): who asked first has waited longest.
        for rid, waiter in list(self._waiters.items()):
            rank = encoded.rank(rid)
            if rank is None or q.participants[rank].incarnation != waiter.incarnation:
                continue  # not in this quorum (a dead member's request stays pending)
            del self._waiters[rid]
            if waiter.future.done():
                # Its caller hung up: cancelling the handler cancelled this future, and the
                # handler's withdrawal is still queued behind us. It stays a participant, as a
                # member that died just after its answer would (its peers' FTAR fails and they
                # ask again); answering it would raise and leave the rest of the quorum unanswered
                # while the state counts them as answered: they would wait out their deadlines.
                continue
            first = min(first, waiter.since)
            # Each handler encodes its own few bytes: the first answers leave sooner.
            waiter.future.set_result((encoded, rank, waiter.known_quorum_id, now))
        self.metrics.observe_wait(now - first)
        self.loop.call_soon(self.state.settle_progress)  # after the answers' handlers (call_soon is FIFO)

    def _answer_finished(self, now: float) -> None:
        """Tell members behind a finished job that nobody can heal them to: the job is over."""
        done = self.state.finished_step
        for rid, incarnation in self.state.finished_requesters(now) if done is not None else ():
            waiter = self._waiters.get(rid)
            if waiter is not None and waiter.incarnation == incarnation and not waiter.future.done():
                del self._waiters[rid]
                waiter.future.set_result(_Finished(done))  # type: ignore[arg-type]

    def _fail_waiter(self, replica_id: str, code: grpc.StatusCode, message: str, *, spare: str | None = None) -> None:
        """Answer the replica's pending request with an error (unless it is incarnation `spare`'s)."""
        waiter = self._waiters.get(replica_id)
        if waiter is None or waiter.incarnation == spare:
            return
        del self._waiters[replica_id]
        if not waiter.future.done():
            waiter.future.set_result(_Failure(code, message))

    async def _reject(self, context: grpc.aio.ServicerContext, code: str, message: str) -> None:
        self.state.reject()
        self.metrics.rejected(code)
        await context.abort(getattr(grpc.StatusCode, code), message)

    async def _reject_request(self, context: grpc.aio.ServicerContext, error: InvalidField | Rejected) -> None:
        """A malformed request gets INVALID_ARGUMENT naming the field; a refused one, its own code."""
        await self._reject(context, error.code if isinstance(error, Rejected) else "INVALID_ARGUMENT", str(error))

    # -- RPCs -----------------------------------------------------------------------------------

    async def heartbeat(self, request_iterator, context: grpc.aio.ServicerContext) -> pb.HeartbeatSummary:
        key: tuple[str, str] | None = None
        count = 0
        try:
            async for request in request_iterator:
                now = time.monotonic()
                count += 1
                if key is not None:
                    current, revived = self.state.heartbeat(key[0], key[1], now)
                    if not current:
                        await self._reject(
                            context,
                            "FAILED_PRECONDITION",
                            f"replica {key[0]!r} incarnation {key[1]!r} was replaced by a newer one",
                        )
                    if revived:
                        self._after_event(now)
                    continue
                if not request.HasField("member"):
                    await self._reject(
                        context, "INVALID_ARGUMENT", "member: the first heartbeat of a stream must carry it"
                    )
                try:
                    report = self._decode(request.member)
                    check_text("topology", request.topology, MAX_LAYOUT_BYTES)
                    self.state.note_layout(report.topology_fingerprint, request.topology)
                    replaced = self.state.register(report, now, _known_positions(request.known_positions))
                except (InvalidField, Rejected) as e:
                    await self._reject_request(context, e)
                key = report.key
                self.state.stream_opened(key)
                if replaced:
                    self._fail_waiter(
                        report.replica_id,
                        grpc.StatusCode.ABORTED,
                        f"replica {report.replica_id!r} restarted as incarnation {report.incarnation!r}",
                        spare=report.incarnation,
                    )
                self._after_event(now)
        finally:
            if key is not None:
                now = time.monotonic()
                self.state.stream_closed(key)
                self.state.disconnected(key[0], key[1], now)
                self._arm(self.state.next_wake(now))
        return pb.HeartbeatSummary(heartbeats=count)

    async def quorum(self, request_iterator, context: grpc.aio.ServicerContext):
        mine: tuple[str, _Waiter] | None = None
        try:
            async for request in request_iterator:
                now = time.monotonic()
                try:
                    check_int("timeout_ms", request.timeout_ms, 1, MAX_TIMEOUT_MS)
                    check_int("known_quorum_id", request.known_quorum_id, 0, 2**62)
                    if not request.HasField("member"):
                        raise InvalidField("member", "missing")
                    report = self._decode(request.member, request.known_quorum_id)
                    replaced = self.state.request(report, now, _step_figures(request))
                except (InvalidField, Rejected) as e:
                    await self._reject_request(context, e)
                rid = report.replica_id
                self._fail_waiter(
                    rid,
                    grpc.StatusCode.ABORTED,
                    f"replica {rid!r} restarted as incarnation {report.incarnation!r}"
                    if replaced
                    else f"superseded by a newer quorum request of replica {rid!r}",
                )
                waiter = _Waiter(self.loop.create_future(), report.incarnation, request.known_quorum_id, now)
                self._waiters[rid] = waiter
                mine = (rid, waiter)
                self._after_event(now)
                budget = request.timeout_ms / 1000
                remaining = context.time_remaining()
                if remaining is not None:
                    budget = min(budget, remaining)
                expiry = self.loop.call_later(budget, self._expire, rid, waiter)
                try:
                    result = await waiter.future
                finally:
                    expiry.cancel()
                mine = None
                if isinstance(result, _Failure):
                    await context.abort(result.code, result.message)
                if isinstance(result, _Finished):
                    yield pb.QuorumResponse(finished_step=result.step).SerializeToString()
                    continue
                encoded, rank, known_quorum_id, formed_at = result
                answer = encoded.for_member(rank, known_quorum_id)
                self.metrics.observe_answer(time.monotonic() - formed_at)
                yield answer
        finally:
            if mine is not None:  # the stream went away (the caller died or hung up) while waiting
                self._withdraw(*mine)

    def _withdraw(self, rid: str, waiter: _Waiter) -> None:
        if self._waiters.get(rid) is waiter:
            del self._waiters[rid]
            self.state.withdraw(rid, waiter.incarnation)
            now = time.monotonic()
            self._arm(self.state.next_wake(now))

    def _expire(self, rid: str, waiter: _Waiter) -> None:
        if waiter.future.done():
            return
        reason = self.state.explain(time.monotonic())  # before withdrawing: the caller's view
        self._withdraw(rid, waiter)
        waiter.future.set_result(
            _Failure(grpc.StatusCode.DEADLINE_EXCEEDED, f"no quorum within the request's deadline: {reason}")
        )

    async def report_failure(self, request: pb.FailureReport, context: grpc.aio.ServicerContext) -> pb.FailureVerdict:
        try:
            check_int("quorum_id", request.quorum_id, 0, 2**62)
            check_id("replica_id", request.replica_id)
            check_id("incarnation", request.incarnation)
            check_text("reason", request.reason, MAX_REASON_BYTES)
            if request.reporter_id:
                check_id("reporter_id", request.reporter_id)
        except InvalidField as e:
            await self._reject_request(context, e)
        now = time.monotonic()
        verdict = self.state.accuse(
            request.replica_id,
            request.incarnation,
            now,
            quorum_id=request.quorum_id,
            reporter=request.reporter_id,
            reason=request.reason,
        )
        self._after_event(now)
        if verdict.verdict == "PENDING":
            # The accused was heard from recently: it is dropped only if it stays silent until
            # the end of its suspect window; a heartbeat before then proves it alive.
            wait = verdict.confirm_at - time.monotonic() + 0.002  # type: ignore[operator]
            remaining = context.time_remaining()
            if remaining is not None:
                wait = min(wait, remaining - 0.05)
            await asyncio.sleep(max(0.0, wait))
            later = time.monotonic()
            verdict = self.state.confirm(request.replica_id, request.incarnation, now, later)
            self._after_event(later)
        return _verdict_proto(verdict)

    async def commits(self, request_iterator, context: grpc.aio.ServicerContext):
        """The Commits stream (ft.commit_decision: coordinator): each vote answered with its step's decision."""
        async for request in request_iterator:
            yield await self._commit(request, context)

    async def _commit(self, request: pb.CommitVote, context: grpc.aio.ServicerContext) -> pb.CommitDecision:
        """Record one vote, then wait for the step's decision until the vote's timeout_ms (PENDING
        if none by then)."""
        try:
            check_int("formation", request.formation, 1, 2**63 - 1)
            check_int("quorum_id", request.quorum_id, 0, 2**62)
            check_int("step", request.step, 0, MAX_STEP)
            check_id("replica_id", request.replica_id)
            check_id("incarnation", request.incarnation)
            check_text("reason", request.reason, MAX_REASON_BYTES)
            check_int("timeout_ms", request.timeout_ms, 1, MAX_TIMEOUT_MS)
        except InvalidField as e:
            await self._reject_request(context, e)
        now, budget = time.monotonic(), request.timeout_ms / 1000
        member, step = (request.replica_id, request.incarnation), (request.quorum_id, request.step)
        try:
            decision = self.state.vote_commit(
                request.formation, step, member, request.ok, now, now + budget, request.reason
            )
        except NotAParticipant as e:
            await self._reject(context, "FAILED_PRECONDITION", str(e))
        self._after_event(now)  # (answers the voters of a formation this vote decided)
        if decision[0] == PENDING:
            future = self.loop.create_future()
            self._votes.setdefault(request.formation, []).append(future)
            remaining = context.time_remaining()
            try:
                decision = await asyncio.wait_for(future, budget if remaining is None else min(budget, remaining))
            except TimeoutError:
                decision = (PENDING, f"no decision within the vote's {request.timeout_ms} ms")
        self.metrics.commit_decided(decision[0])
        return pb.CommitDecision(decision=decision[0], detail=decision[1])


def _step_figures(request: pb.QuorumRequest) -> StepFigures | None:
    """A quorum request's step report, validated (InvalidField names the field); None without one."""
    if not request.HasField("report"):
        return None
    r = request.report
    figures = StepFigures(
        r.step,
        r.committed,
        r.contributed,
        r.loss,
        r.step_time_s,
        r.tokens,
        r.target_steps,
        r.replicas,
        r.mfu if r.HasField("mfu") else None,
        r.eval_loss if r.HasField("eval_loss") else None,
        r.inner_steps if r.HasField("inner_steps") else None,
        r.fragment if r.HasField("fragment") else None,
        r.sync_bytes if r.HasField("sync_bytes") else None,
        r.catchup_bytes_done if r.HasField("catchup_bytes_done") else None,
        r.catchup_bytes_total if r.HasField("catchup_bytes_total") else None,
        r.catchup_eta_s if r.HasField("catchup_eta_s") else None,
        r.warmup_steps if r.HasField("warmup_steps") else None,
    )
    figures.validate()
    return figures


def _known_positions(entries) -> dict[str, int]:
    """A heartbeat registration's `known_positions`, validated (InvalidField names the entry)."""
    check_int("known_positions.size", len(entries), 0, MAX_MEMBERS)
    known: dict[str, int] = {}
    for i, e in enumerate(entries):
        check_id(f"known_positions[{i}].replica_id", e.replica_id)
        check_int(f"known_positions[{i}].data_position", e.data_position, 0, MAX_STEP)
        known[e.replica_id] = max(known.get(e.replica_id, 0), e.data_position)
    return known


def _verdict_proto(verdict: Accusation) -> pb.FailureVerdict:
    return pb.FailureVerdict(dropped=verdict.dropped, verdict=_VERDICTS.Value(verdict.verdict), detail=verdict.detail)  # type: ignore[arg-type]


class _TokenCheck(grpc.aio.ServerInterceptor):
    """Every call must carry the job token; otherwise UNAUTHENTICATED before any handler runs."""

    def __init__(self, token: str, on_reject: Callable[[], None]) -> None:
        self._token = token.encode()
        self._on_reject = on_reject

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        if details.method.startswith(HEALTH_PREFIX):  # probes carry no token; the answer says nothing
            return await continuation(details)
        given = b""
        for key, value in details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY:
                given = value.encode() if isinstance(value, str) else value
        handler = await continuation(details)
        if handler is None or hmac.compare_digest(given, self._token):
            return handler
        self._on_reject()

        async def deny(request_or_iterator, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"missing or wrong job token ({TOKEN_METADATA_KEY})")

        make = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(handler.request_streaming, handler.response_streaming)]
        return make(
            deny, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop  # a faster event loop: about a third less CPU per stream message
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class CoordinatorServer:
    """The coordinator, running in a background thread: gRPC on `address`, HTTP on `http_address`.

    >>> server = CoordinatorServer(Settings(min_replicas=2), token="secret").start()
    >>> server.address  # "127.0.0.1:PORT"
    >>> server.stop()
    """

    def __init__(
        self,
        settings: Settings,
        token: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        http_port: int | None = 0,
        startup_grace: float | None = None,
        advertise: str | None = None,
        tensorboard_dir: str | Path | None = None,
        tls: TLS | None = None,
    ) -> None:
        """`tensorboard_dir`: where the job view's TensorBoard event files go (None: none). `tls`: gRPC
        over TLS with its certificate (the HTTP status pages stay plain: read-only, no token)."""
        if not token:
            raise ValueError("the job token must not be empty")
        self.settings = settings
        self.state = CoordinatorState(settings, time.monotonic(), startup_grace=startup_grace)
        if tensorboard_dir is not None:
            self.state.job_view = JobView(tensorboard_dir)
        self.metrics = Metrics(self.state)
        self._token = token
        self._tls = tls
        self._host = net.bind_value(host)  # "" binds every interface
        self._advertise = net.advertised(self._host, advertise or None)
        self._port = port
        self._http_port = http_port
        self._http: StatusHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.address = ""
        self.http_address = ""

    @property
    def bind_host(self) -> str:
        """The host the servers bind ("" for every interface)."""
        return self._host

    def start(self, timeout: float = 30.0) -> CoordinatorServer:
        self._thread = threading.Thread(target=self._run, name="coordinator-grpc", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the coordinator's gRPC server did not start")
        if self._error is not None:
            raise RuntimeError(f"the coordinator could not start: {self._error}") from self._error
        if self._http_port is not None:
            self._http = StatusHTTPServer(
                self.state, self.metrics, self._host, self._http_port, advertise=self._advertise
            )
            self.http_address = self._http.address
        return self

    def _run(self) -> None:
        self._loop = new_event_loop()
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as e:  # reported to start(); the thread just ends
            self._error = e
            self._ready.set()
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        service = _Service(self.state, self.metrics, asyncio.get_running_loop())
        server = grpc.aio.server(
            interceptors=[_TokenCheck(self._token, lambda: self.metrics.rejected("UNAUTHENTICATED"))],
            options=SERVER_OPTIONS,
        )
        identity = None  # quorum answers are pre-serialized bytes
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    SERVICE,
                    {
                        "Heartbeat": grpc.stream_unary_rpc_method_handler(
                            service.heartbeat,
                            request_deserializer=pb.HeartbeatRequest.FromString,
                            response_serializer=pb.HeartbeatSummary.SerializeToString,
                        ),
                        "Quorum": grpc.stream_stream_rpc_method_handler(
                            service.quorum,
                            request_deserializer=pb.QuorumRequest.FromString,
                            response_serializer=identity,
                        ),
                        "ReportFailure": grpc.unary_unary_rpc_method_handler(
                            service.report_failure,
                            request_deserializer=pb.FailureReport.FromString,
                            response_serializer=pb.FailureVerdict.SerializeToString,
                        ),
                        "Commits": grpc.stream_stream_rpc_method_handler(
                            service.commits,
                            request_deserializer=pb.CommitVote.FromString,
                            response_serializer=pb.CommitDecision.SerializeToString,
                        ),
                    },
                ),
            )
        )
        probes = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(probes, server)
        port = self._add_port(server)
        await server.start()
        for name in ("", SERVICE):
            await probes.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.address = net.format_address(self._advertise, port)
        self._ready.set()
        await self._stop.wait()
        await probes.enter_graceful_shutdown()  # NOT_SERVING to anyone watching
        await server.stop(grace=None)

    def _add_port(self, server: grpc.aio.Server) -> int:
        bind = net.grpc_bind(self._host, self._port)
        if self._tls is None:
            return server.add_insecure_port(bind)
        cert, key, _ = self._tls.pem()  # (no client certificates: a member proves itself with the token)
        return server.add_secure_port(bind, grpc.ssl_server_credentials([(key, cert)]))

    def stop(self) -> None:
        """Stop serving (pending calls end with CANCELLED/UNAVAILABLE)."""
        if self._http is not None:
            self._http.close()
            self._http = None
        if self._loop is not None and self._stop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)
        if self.state.job_view is not None:  # (after the handlers: nothing is queued after the close)
            self.state.job_view.close()
            self.state.job_view = None

    def __enter__(self) -> CoordinatorServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# Collector settings of a coordinator process (see quiet_garbage_collector).
GC_YOUNG_THRESHOLDS = (700, 10)  # CPython's defaults for generations 0 and 1
GC_NEVER = 2**31 - 1  # as the threshold of generation 2: no full collection starts on its own
GC_OLD_CHECK_S = 10.0  # how often the backstop looks at the size of the old generation
GC_OLD_GROWTH = 50_000  # objects the old generation must grow by (and double) to make a full collection
GC_BACKSTOP_S = 600.0  # a full collection at least this often anyway


def quiet_garbage_collector() -> None:
    """Keep full collections out of quorum fan-outs (this process only; an embedding process keeps
    its own settings), yet free the reference cycles that serving makes.

    Serving does make cycles: every call leaves ~6 objects in one (grpc's handler lookup), a refused
    one ~30 (the abort's exception, traceback and frames, the call's state). With the collector off
    they were never freed: RSS grew 60 -> 103 MB over 15,000 calls, half of them refused. So the
    young generations are collected as usual: a collection scans only the objects allocated since
    the previous one, which keeps it short (measured, CPU time: 0.25 ms on average under a stream
    of calls; at 1000 replicas ~1 ms for generation 0, ~10 ms for generation 1, 30 ms at most),
    and frees those cycles (RSS flat over the same calls). A full collection scans every object
    (50-200 ms at 1000 replicas): none starts on its own, on whatever allocation the hot path
    makes; startup objects are frozen out of them; and a backstop thread runs one when the old
    generation (where the rare cycle that outlived two young collections ends up, ~1 object per 20
    calls) has grown enough, or every GC_BACKSTOP_S, so memory stays bounded at any call rate."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_YOUNG_THRESHOLDS, GC_NEVER)
    gc.enable()
    threading.Thread(target=_collect_old_generation, name="coordinator-gc", daemon=True).start()


def _collect_old_generation(
    stop: threading.Event | None = None,
    *,
    check_s: float = GC_OLD_CHECK_S,
    growth: int = GC_OLD_GROWTH,
    every_s: float = GC_BACKSTOP_S,
) -> None:
    """Run a full collection when the old generation grew by `growth` objects and at least doubled
    since the last one (so a growing membership costs few of them), or every `every_s`; until `stop`."""
    stop = stop or threading.Event()
    last, old = time.monotonic(), len(gc.get_objects(2))
    while not stop.wait(check_s):
        if len(gc.get_objects(2)) - old >= max(growth, old) or time.monotonic() - last >= every_s:
            gc.collect()
            last, old = time.monotonic(), len(gc.get_objects(2))


def write_ready_file(path: str, addresses: dict[str, str]) -> None:
    """Tell whoever started this server where it listens: `addresses` plus this pid, as JSON."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({**addresses, "pid": os.getpid()}, f)
    os.replace(tmp, path)  # readers never see a half-written file


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ftjax coordinator", description="The job's coordinator: gRPC quorum service plus HTTP status."
    )
    p.add_argument(
        "--host", default=None, help=f"address to bind (default: ${BIND_ENV}, else every interface, IPv6 and IPv4)"
    )
    p.add_argument(
        "--advertise-host",
        default=None,
        help=f"host the replicas dial, printed and written to --ready-file (default: "
        f"${ADVERTISE_ENV}, else --host when it names one address, else this machine's address)",
    )
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: the OS picks)")
    p.add_argument("--http-port", type=int, default=0, help="HTTP status port (0: the OS picks, -1: none)")
    # the settings: one flag per field of the config's `coordinator:` section, with its default
    for name, field in CoordinatorConfig.model_fields.items():
        p.add_argument(
            flag_name(name),
            type=field.annotation,  # type: ignore[arg-type]
            default=field.default,
            help=f"{field.description} (default: %(default)s)",
        )
    p.add_argument(
        "--expected-replicas",
        type=int,
        default=0,
        help="at job start, wait for this many replicas (up to --startup-timeout-s) before the first quorum",
    )
    p.add_argument(
        "--startup-grace-s",
        type=float,
        default=None,
        help="listen this long before forming the first quorum (default: the heartbeat timeout, at least "
        f"a client's longest reconnect wait, {RECONNECT_WINDOW_S:g} s)",
    )
    p.add_argument("--token-file", default=None, help=f"file holding the job token (default: ${TOKEN_ENV})")
    add_tls_arguments(p)
    p.add_argument("--ready-file", default=None, help="write the bound addresses here as JSON once serving")
    p.add_argument(
        "--tensorboard-dir",
        default=None,
        help="write the job view (quorums, failures, catch-ups) as TensorBoard event files here, "
        "RUN/tensorboard/job/ in a job (default: none)",
    )
    p.add_argument(
        "--final-step",
        type=int,
        default=None,
        help="the job's last step: exit 0 once every expected replica reached it and none is alive "
        "(a coordinator on a cluster ends with its job)",
    )
    p.add_argument(
        "--idle-exit-s",
        type=float,
        default=None,
        help="exit 3 when no replica has been alive for this long after one joined (the job is gone)",
    )
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        token = read_token(args.token_file)
        settings = Settings(
            **{name: getattr(args, name) for name in CoordinatorConfig.model_fields},
            expected_replicas=args.expected_replicas,
        )
        tls = tls_of(args)
    except (OSError, ValueError) as e:  # the config's checks raise ConfigError, a ValueError
        print(f"ftjax coordinator: {e}", file=sys.stderr)
        return 2
    host = args.host if args.host is not None else os.environ.get(BIND_ENV, "")
    advertise = args.advertise_host or os.environ.get(ADVERTISE_ENV, "").strip() or None
    server = CoordinatorServer(
        settings,
        token,
        host=host,
        port=args.port,
        advertise=advertise,
        http_port=None if args.http_port < 0 else args.http_port,
        startup_grace=args.startup_grace_s,
        tensorboard_dir=args.tensorboard_dir,
        tls=tls,
    )
    if args.final_step is not None and (args.final_step < 1 or args.expected_replicas < 1):
        print("ftjax coordinator: --final-step needs a step >= 1 and --expected-replicas", file=sys.stderr)
        return 2
    if args.idle_exit_s is not None and not args.idle_exit_s > 0:
        print(f"ftjax coordinator: --idle-exit-s must be > 0 (got {args.idle_exit_s})", file=sys.stderr)
        return 2
    stop = threading.Event()
    ended: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server.start()
    except (RuntimeError, OSError) as e:
        print(f"ftjax coordinator: {e}", file=sys.stderr)
        return 1
    quiet_garbage_collector()
    line = (
        f"coordinator listening grpc={server.address} http={server.http_address or '-'} "
        f"(bound to {net.describe_bind(server.bind_host)})"
    )
    print(line, flush=True)
    if args.ready_file:
        write_ready_file(args.ready_file, {"grpc": server.address, "http": server.http_address})
    if args.final_step is not None or args.idle_exit_s is not None:

        def end(code: int, why: str) -> None:
            print(f"ftjax coordinator: {why}; exiting with {code}", flush=True)
            ended.append(code)
            stop.set()

        watch(JobEnd(args.expected_replicas, args.final_step, args.idle_exit_s), server.state.snapshot, end, stop=stop)
    stop.wait()
    server.stop()
    return ended[0] if ended else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
