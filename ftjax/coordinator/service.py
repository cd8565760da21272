"""The coordinator's gRPC service: the handlers of Heartbeat, Quorum, ReportFailure and Commits,
the decoding and checks of what members send, and the job token's check before any handler.

Every handler runs on the one event loop of `CoordinatorServer` (ftjax/coordinator/server.py); the
membership itself lives in `CoordinatorState` (one lock), which the HTTP status thread reads.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health

from ftjax.coordinator import TOKEN_METADATA_KEY
from ftjax.coordinator import coordinator_pb2 as pb
from ftjax.coordinator.codec import QuorumEncoding
from ftjax.coordinator.commits import PENDING, NotAParticipant
from ftjax.coordinator.http import Metrics
from ftjax.coordinator.layout import MAX_LAYOUT_BYTES
from ftjax.coordinator.progress import StepFigures
from ftjax.coordinator.quorum import (
    MAX_HOSTS,
    MAX_REASON_BYTES,
    MAX_STEP,
    MAX_TIMEOUT_MS,
    InvalidField,
    MemberReport,
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


class CoordinatorService:
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
        if done is None:
            return
        for rid, incarnation in self.state.finished_requesters(now):
            waiter = self._waiters.get(rid)
            if waiter is not None and waiter.incarnation == incarnation and not waiter.future.done():
                del self._waiters[rid]
                waiter.future.set_result(_Finished(done))

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
            assert verdict.confirm_at is not None  # (a pending verdict has its deadline)
            wait = verdict.confirm_at - time.monotonic() + 0.002
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
    code = _VERDICTS.Value(verdict.verdict)
    return pb.FailureVerdict(dropped=verdict.dropped, verdict=code, detail=verdict.detail)  # type: ignore[arg-type]  # (an enum's number)


class TokenCheck(grpc.aio.ServerInterceptor):
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
