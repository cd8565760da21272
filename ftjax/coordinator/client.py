"""The coordinator client used by a replica's leader.

    client = CoordinatorClient("host:port", token, MemberInfo(...))
    client.start()                                   # heartbeat thread, independent of training
    future = client.quorum_async(step, data_position, has_state=True)   # overlaps with compute
    result = future.result()                         # a QuorumResult
    client.report_failure(result.quorum_id, peer_id, peer_incarnation, "ring socket closed")
    client.close()

Heartbeats and quorum requests each use one long-lived stream on a channel of their own. When the
coordinator is unreachable (restarting, say) both reconnect with capped exponential backoff on a
fresh channel, and a quorum request is re-sent until its quorum timeout; errors that are the
caller's fault (INVALID_ARGUMENT, FAILED_PRECONDITION, UNAUTHENTICATED, RESOURCE_EXHAUSTED) raise
`CoordinatorError` at once and are not retried.
"""

from __future__ import annotations

import logging
import queue
import random
import socket
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any

import grpc

from ftjax.base.net import split_address
from ftjax.base.tls import TLS, speaks_tls
from ftjax.coordinator import TOKEN_METADATA_KEY
from ftjax.coordinator import coordinator_pb2 as pb
from ftjax.coordinator import coordinator_pb2_grpc as pb_grpc
from ftjax.coordinator.codec import result_from_proto
from ftjax.coordinator.layout import MAX_LAYOUT_BYTES
from ftjax.coordinator.quorum import MAX_REASON_BYTES, RECONNECT_CAP_S
from ftjax.coordinator.types import CoordinatorError, JobFinished, MemberInfo, QuorumResult

log = logging.getLogger(__name__)

CALLER_FAULT = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.ALREADY_EXISTS,
    }
)
# ALREADY_EXISTS (another live process holds this replica id) is retried this long before it is
# final: a predecessor that was just killed may not have been seen to die yet (its heartbeat stream's
# end reaches the coordinator within milliseconds; a silent one is dead after the heartbeat timeout).
DUPLICATE_GRACE_S = 5.0
# A coordinator that has not answered this long is said on stderr, once an outage, long before a timeout.
UNREACHABLE_SAY_S = 10.0
_STREAM_LIFETIME_S = 3600.0  # streams are renewed this often (every call has a deadline)
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", int(RECONNECT_CAP_S * 1000)),
    ("grpc.use_local_subchannel_pool", 1),  # a fresh channel is a fresh connection
]


class _Backoff:
    """Capped exponential backoff with jitter: 50 ms, 100 ms, ... 1 s (RECONNECT_CAP_S)."""

    def __init__(self, first: float = 0.05, cap: float = RECONNECT_CAP_S) -> None:
        self._first, self._cap, self._next = first, cap, first

    def reset(self) -> None:
        self._next = self._first

    def next(self) -> float:
        delay, self._next = self._next, min(self._cap, self._next * 2)
        return delay * random.uniform(0.75, 1.25)


# the events after which no fetch is under way (ftjax/runs/events.py)
_CATCHUP_ENDS = frozenset({"catchup_done", "catchup_failed", "catchup_abandoned", "catchup_cancelled"})


class _Stream:
    """One request-and-answer stream (Quorum, Commits): send a request, wait for its answer (at most
    `timeout`)."""

    def __init__(self, channel: grpc.Channel, metadata, method: str = "Quorum") -> None:
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self.expires = time.monotonic() + _STREAM_LIFETIME_S
        self.method = method
        self._call = getattr(pb_grpc.CoordinatorStub(channel), method)(
            iter(self._requests.get, None), timeout=_STREAM_LIFETIME_S, metadata=metadata
        )

    def exchange(self, request: Any, timeout: float) -> Any:
        self._requests.put(request)
        # The server bounds the wait by the request's timeout_ms; this bounds it if the server hangs.
        watchdog = threading.Timer(timeout, self._call.cancel)
        watchdog.daemon = True
        watchdog.start()
        try:
            return next(self._call)
        except StopIteration:
            closed = f"the coordinator closed the {self.method} stream"
            raise CoordinatorError(grpc.StatusCode.UNAVAILABLE, closed) from None
        finally:
            watchdog.cancel()

    def close(self) -> None:
        self._requests.put(None)
        self._call.cancel()


class _StreamSlot:
    """The stream of one method (Quorum, Commits) on a channel of its own: kept while it has time
    left, opened again on a fresh connection once dropped after a failure."""

    def __init__(self, open_channel, metadata, method: str) -> None:
        self._open_channel, self._metadata, self.method = open_channel, metadata, method
        self.stream: _Stream | None = None
        self._channel: grpc.Channel | None = None
        self._lock = threading.Lock()

    def get(self, needed_s: float) -> _Stream:
        """The stream, opened again if it ends within `needed_s` (+ 5 s)."""
        with self._lock:
            stream = self.stream
            if stream is not None and stream.expires - time.monotonic() > needed_s + 5.0:
                return stream
            if stream is not None:
                stream.close()
            if self._channel is None:
                self._channel = self._open_channel()
            self.stream = _Stream(self._channel, self._metadata, self.method)
            return self.stream

    def drop(self) -> None:
        """Forget the stream and its channel: the next attempt starts on a fresh connection."""
        with self._lock:
            stream, self.stream = self.stream, None
            channel, self._channel = self._channel, None
        if stream is not None:
            stream.close()
        if channel is not None:
            channel.close()


def _code_and_details(e: grpc.RpcError | CoordinatorError) -> tuple[grpc.StatusCode, str]:
    if isinstance(e, grpc.RpcError):
        return e.code(), e.details() or ""
    return e.code, e.details


class CoordinatorClient:
    """A replica leader's connection to the coordinator (see the module docstring)."""

    def __init__(
        self,
        address: str,
        token: str,
        member: MemberInfo,
        *,
        heartbeat_interval_s: float = 0.1,
        rpc_timeout_s: float = 2.0,
        quorum_timeout_s: float = 60.0,
        duplicate_grace_s: float = DUPLICATE_GRACE_S,
        tls: TLS | None = None,
    ) -> None:
        self.address = address
        self.tls = tls
        self._credentials = None if tls is None else grpc.ssl_channel_credentials(tls.pem()[2])
        self._tls_probed = False  # (a plain client asks once whether the coordinator speaks TLS)
        self.duplicate_grace_s = duplicate_grace_s
        self.member = member
        self.heartbeat_interval_s = heartbeat_interval_s
        self.rpc_timeout_s = rpc_timeout_s
        self.quorum_timeout_s = quorum_timeout_s
        self._said_unreachable = False
        self._metadata = ((TOKEN_METADATA_KEY, token),)
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._progress = (0, 0, False)  # (step, data_position, has_state) of the latest request
        self._membership: tuple[int, tuple[pb.MemberAddress, ...]] = (0, ())
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._heartbeat_thread: threading.Thread | None = None
        self._heartbeat_call: grpc.Future | None = None
        self._quorum_thread: threading.Thread | None = None
        self._quorums = _StreamSlot(self._channel, self._metadata, "Quorum")
        self._report_channel: grpc.Channel | None = None
        self._commits = _StreamSlot(self._channel, self._metadata, "Commits")  # ft.commit_decision coordinator
        self.heartbeat_error: CoordinatorError | None = None  # the coordinator refused our heartbeats
        # What this member knows of every replica's data position (the caller keeps it current);
        # sent on each new heartbeat stream, so that a restarted coordinator can rebuild its record.
        self.known_positions: dict[str, int] = {}
        self._report: pb.StepReport | None = None  # the latest step, sent with the next quorum request
        self._catchup: dict | None = None  # a fetch under way (its latest catchup_progress event)

    def _channel(self) -> grpc.Channel:
        if self._credentials is None:
            return grpc.insecure_channel(self.address, options=_CHANNEL_OPTIONS)
        name = [("grpc.ssl_target_name_override", self.tls.server_name)] if self.tls and self.tls.server_name else []
        return grpc.secure_channel(self.address, self._credentials, options=[*_CHANNEL_OPTIONS, *name])

    def _tls_refusal(self, details: str) -> str | None:
        """Why TLS keeps this member out, once a call failed UNAVAILABLE with `details`: no retry mends
        it. A TLS client names a failed handshake (gRPC's details say so); a plain one asks once whether
        the coordinator speaks TLS."""
        if self.tls is not None:
            if "handshake" in details.lower() or "certificate" in details.lower():
                return (
                    f"TLS: the handshake with the coordinator at {self.address} failed: its certificate must be "
                    f"signed by --tls-ca {self.tls.ca} and name {self.tls.server_name or 'that address'} "
                    f"(gRPC: {details.splitlines()[0] if details else '-'})"
                )
            return None
        if self._tls_probed:
            return None
        self._tls_probed = True
        try:
            host, port = split_address(self.address)
        except ValueError:
            return None
        if speaks_tls(host, port, self.rpc_timeout_s):
            return (
                f"TLS: the coordinator at {self.address} serves TLS, and this member dials it without: "
                "give it --tls-cert, --tls-key and --tls-ca"
            )
        return None

    # -- heartbeats ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the heartbeat thread (a daemon)."""
        with self._lock:
            if self._heartbeat_thread is None:
                self._heartbeat_thread = threading.Thread(
                    target=self._heartbeat_loop, daemon=True, name=f"ftjax-heartbeat-{self.member.replica_id}"
                )
                self._heartbeat_thread.start()

    def _heartbeats(self, done: threading.Event):
        step, position, has_state = self._progress
        known = [pb.ReplicaPosition(replica_id=r, data_position=p) for r, p in dict(self.known_positions).items()]
        yield pb.HeartbeatRequest(
            member=member_proto(self.member, step, position, has_state),
            known_positions=known,
            topology=self.member.topology if len(self.member.topology) <= MAX_LAYOUT_BYTES else "",
        )
        while not done.wait(self.heartbeat_interval_s):
            yield pb.HeartbeatRequest()

    def _heartbeat_loop(self) -> None:
        backoff = _Backoff()
        while not self._closed.is_set():
            channel = self._channel()
            done = threading.Event()
            try:
                call = pb_grpc.CoordinatorStub(channel).Heartbeat.future(
                    self._heartbeats(done), timeout=_STREAM_LIFETIME_S, metadata=self._metadata
                )
                self._heartbeat_call = call
                if self._closed.is_set():
                    call.cancel()
                call.result()
                backoff.reset()  # the stream lived out its lifetime: renew it at once
            except (grpc.RpcError, grpc.FutureCancelledError) as e:  # cancelled: by close()
                if self._closed.is_set():
                    break
                if isinstance(e, grpc.RpcError) and e.code() in CALLER_FAULT:
                    error = CoordinatorError(e.code(), e.details() or "")
                    if str(error) != str(self.heartbeat_error):  # log each new refusal once
                        log.error("coordinator refused heartbeats of %s: %s", self.member.replica_id, error)
                    self.heartbeat_error = error
                self._closed.wait(backoff.next())
            finally:
                done.set()
                channel.close()

    # -- quorum -------------------------------------------------------------------------------

    def quorum_async(
        self, step: int, data_position: int, has_state: bool, commit_failures: int = 0, digest: str = ""
    ) -> Future:
        """Ask for the quorum of `step` in the background; the Future yields a QuorumResult.
        `digest`: of the state at `step`, when computed (the coordinator compares them).

        Requests are served one at a time, in order (one per training step)."""
        if self._closed.is_set():
            raise CoordinatorError(grpc.StatusCode.CANCELLED, "the client is closed")
        future: Future = Future()
        self._requests.put(((step, data_position, has_state, commit_failures, digest), future))
        with self._lock:
            if self._quorum_thread is None:
                self._quorum_thread = threading.Thread(
                    target=self._quorum_loop, daemon=True, name=f"ftjax-quorum-{self.member.replica_id}"
                )
                self._quorum_thread.start()
        return future

    def report_step(self, record: dict, *, target_steps: int = 0, replicas: int = 0, warmup_steps: int = 0) -> None:
        """Keep a step record of the training loop (ftjax/runtime/trainer.py) to send with the next quorum
        request: the coordinator's status page and /metrics show the replicas' loss, step time,
        tokens and MFU from them, and a DiLoCo round's inner steps, fragment and bytes averaged; the
        catch-up events give the bytes and ETA of a fetch under way until it ends. Other records are
        ignored."""
        event = record.get("event")
        if event in _CATCHUP_ENDS:
            self._catchup = None
        elif event == "catchup_progress":
            self._catchup = {k: record.get(k) for k in ("bytes_done", "bytes_total", "eta_s")}
        if "step" not in record or event is not None:
            return
        loss = record.get("loss")
        # a round's fields describe the replica's own inner steps: a healing round has none (0
        # inner steps, which the coordinator rightly refuses), so its report leaves them out
        diloco = "inner_steps" in record and not record.get("healing")
        self._report = pb.StepReport(
            step=int(record["step"]),
            committed=bool(record.get("committed")),
            contributed=not record.get("healing"),
            loss=float("nan") if loss is None else float(loss),
            step_time_s=max(0.0, float(record.get("step_time_s") or 0.0)),
            tokens=int(record.get("tokens") or 0),
            target_steps=target_steps,
            replicas=replicas,
            mfu=record.get("mfu"),
            eval_loss=record.get("eval_loss"),
            inner_steps=record["inner_steps"] if diloco else None,
            fragment=record.get("fragment") if diloco else None,
            sync_bytes=record.get("sync_bytes") if diloco else None,
            warmup_steps=warmup_steps if warmup_steps and diloco else None,
        )

    def quorum(
        self, step: int, data_position: int, has_state: bool, commit_failures: int = 0, digest: str = ""
    ) -> QuorumResult:
        """Blocking `quorum_async`."""
        return self.quorum_async(step, data_position, has_state, commit_failures, digest).result()

    def _quorum_loop(self) -> None:
        while True:
            item = self._requests.get()
            if item is None:
                return
            args, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self._request_quorum(*args))
            except BaseException as e:  # handed to the caller through the future
                future.set_exception(e)

    def _request_quorum(
        self, step: int, data_position: int, has_state: bool, commit_failures: int, digest: str = ""
    ) -> QuorumResult:
        self._progress = (step, data_position, has_state)
        member = member_proto(self.member, step, data_position, has_state, commit_failures, digest)
        deadline = time.monotonic() + self.quorum_timeout_s
        backoff = _Backoff()
        last_error = "none"
        duplicate_until = None  # refused as a duplicate replica id: until when that may still pass
        failing_since = None  # (since when this request's calls fail)
        while True:
            if self._closed.is_set():
                raise CoordinatorError(grpc.StatusCode.CANCELLED, "the client was closed")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CoordinatorError(grpc.StatusCode.DEADLINE_EXCEEDED, self._timeout_message(last_error))
            known_id, members = self._membership
            request = pb.QuorumRequest(
                member=member, timeout_ms=max(1, int(remaining * 1000)), known_quorum_id=known_id
            )
            report, catchup = self._report, self._catchup
            if report is not None:
                request.report.CopyFrom(report)
                if catchup is not None:
                    request.report.catchup_bytes_done = int(catchup["bytes_done"])
                    request.report.catchup_bytes_total = int(catchup["bytes_total"])
                    if catchup["eta_s"] is not None:
                        request.report.catchup_eta_s = float(catchup["eta_s"])
            try:
                response = self._quorums.get(remaining).exchange(request, remaining + 1.0)
            except (grpc.RpcError, CoordinatorError) as e:
                self._quorums.drop()
                code, details = _code_and_details(e)
                if code == grpc.StatusCode.ALREADY_EXISTS:
                    duplicate_until = duplicate_until or time.monotonic() + self.duplicate_grace_s
                if code in CALLER_FAULT and (duplicate_until is None or time.monotonic() >= duplicate_until):
                    raise CoordinatorError(code, details) from None
                last_error = f"{code.name}: {details}"
                if code == grpc.StatusCode.UNAVAILABLE and (refusal := self._tls_refusal(details)):
                    raise CoordinatorError(code, refusal) from None
                failing_since = failing_since or time.monotonic()
                if code == grpc.StatusCode.UNAVAILABLE and time.monotonic() - failing_since >= UNREACHABLE_SAY_S:
                    self._say_unreachable(last_error, deadline)
                self._closed.wait(min(backoff.next(), max(0.0, deadline - time.monotonic())))
                continue
            self._said_unreachable = False  # (answered: a later outage is said again)
            if response.finished_step:
                raise JobFinished(response.finished_step, self.member.replica_id, step)
            if response.members:
                members = tuple(response.members)
                self._membership = (response.quorum_id, members)
            elif response.quorum_id != known_id:
                raise CoordinatorError(
                    grpc.StatusCode.INTERNAL, f"quorum {response.quorum_id} came without its membership"
                )
            try:
                return result_from_proto(response, members)
            except ValueError as e:
                raise CoordinatorError(grpc.StatusCode.INTERNAL, str(e)) from None

    def _say_unreachable(self, last_error: str, deadline: float) -> None:
        """One stderr line once a quorum request has gone unanswered for UNREACHABLE_SAY_S, said again
        only after the coordinator has answered since: a wrong --coordinator or a coordinator not
        (yet, again) running would otherwise be silence until ft.quorum_timeout_s (120 s by default)
        ends it."""
        if self._said_unreachable:
            return
        self._said_unreachable = True
        left = max(0.0, deadline - time.monotonic())
        print(
            f"ftjax: replica {self.member.replica_id}: the coordinator at {self.address} (--coordinator) has not "
            f"answered for {UNREACHABLE_SAY_S:g} s ({last_error}); trying {left:.0f} s more (ft.quorum_timeout_s)",
            file=sys.stderr,
            flush=True,
        )

    def _timeout_message(self, last_error: str) -> str:
        try:  # (a dropped packet and a refusal both fail this; a coordinator with no quorum does not)
            socket.create_connection(split_address(self.address), timeout=self.rpc_timeout_s).close()
            return f"no quorum within {self.quorum_timeout_s:g} s (last error: {last_error})"
        except (OSError, ValueError):
            pass  # most likely a wrong --coordinator, or a coordinator that is not running
        return (
            f"cannot reach the coordinator at {self.address} (--coordinator): no answer in "
            f"{self.quorum_timeout_s:g} s (ft.quorum_timeout_s; last error: {last_error}). Check the "
            f"address that `ftjax coordinator` printed, that it runs, and that this machine reaches it"
        )

    # -- failure reports ----------------------------------------------------------------------

    def report_failure(self, quorum_id: int, replica_id: str, incarnation: str, reason: str = "") -> bool:
        """Report that a peer failed. True if the accused is out of the membership now (it was
        silent: dropped, or already gone); False if it is alive (or unknown, or replaced)."""
        request = pb.FailureReport(
            quorum_id=quorum_id,
            replica_id=replica_id,
            incarnation=str(incarnation),
            reason=reason,
            reporter_id=self.member.replica_id,
        )
        return self._unary("ReportFailure", request, self.rpc_timeout_s).dropped

    def vote_commit(self, q: QuorumResult, ok: bool, reason: str, timeout_s: float) -> tuple[str, str]:
        """ft.commit_decision: coordinator. This replica's vote on the step of quorum `q` (every
        host averaged it, or not), and the coordinator's (decision, why): COMMIT, ABORT, PENDING
        (none within `timeout_s`) or UNKNOWN; a coordinator that cannot be reached in time is
        ("UNREACHABLE", why), one that refuses the vote ("REFUSED", why). Only COMMIT lets the
        step commit (ftjax/coordinator/commits.py)."""
        request = pb.CommitVote(
            formation=q.formation,
            quorum_id=q.quorum_id,
            step=q.step,
            replica_id=self.member.replica_id,
            incarnation=self.member.incarnation,
            ok=ok,
            reason=reason.encode()[:MAX_REASON_BYTES].decode(errors="ignore"),
            timeout_ms=max(1, round(timeout_s * 1000)),
        )
        # (the answer may wait timeout_s for the decision: a margin beyond it for the answer itself)
        deadline = time.monotonic() + timeout_s + self.rpc_timeout_s
        backoff = _Backoff()
        while True:
            remaining = max(0.01, deadline - time.monotonic())
            try:
                answer = self._commits.get(remaining).exchange(request, remaining)
                return answer.decision, answer.detail
            except (grpc.RpcError, CoordinatorError) as e:
                self._commits.drop()  # (the next attempt on a fresh connection)
                code, details = _code_and_details(e)
                if code in CALLER_FAULT:  # a malformed vote, or not a participant
                    return "REFUSED", f"{code.name}: {details}"
                if time.monotonic() + 0.05 >= deadline:
                    return "UNREACHABLE", f"{code.name}: {details}"
                time.sleep(min(backoff.next(), max(0.0, deadline - time.monotonic())))

    def _unary(self, method: str, request: Any, timeout_s: float) -> Any:
        """One unary call, retried over a fresh channel until `timeout_s` if the coordinator cannot
        be reached (raises CoordinatorError: the caller's fault at once, else at the deadline)."""
        deadline = time.monotonic() + timeout_s
        backoff = _Backoff()
        while True:
            with self._lock:
                if self._report_channel is None:
                    self._report_channel = self._channel()
                channel = self._report_channel
            try:
                call = getattr(pb_grpc.CoordinatorStub(channel), method)
                return call(request, timeout=max(0.01, deadline - time.monotonic()), metadata=self._metadata)
            except grpc.RpcError as e:
                if e.code() in CALLER_FAULT or time.monotonic() + 0.05 >= deadline:
                    raise CoordinatorError(e.code(), e.details() or "") from None
                with self._lock:
                    if self._report_channel is channel:
                        self._report_channel = None
                channel.close()
                time.sleep(min(backoff.next(), max(0.0, deadline - time.monotonic())))

    def leave(self, reason: str) -> None:
        """This process leaves the job now (its training loop is stuck): stop heartbeating, then
        accuse itself. With its heartbeat stream gone the coordinator drops it on that report at
        once, instead of keeping peers waiting for a member that heartbeats but never asks."""
        self._closed.set()
        call = self._heartbeat_call
        if call is not None:
            call.cancel()
        try:
            self.report_failure(0, self.member.replica_id, self.member.incarnation, reason[:MAX_REASON_BYTES])
        except CoordinatorError as e:  # best effort: the heartbeat timeout decides otherwise
            log.warning("leaving the job: the coordinator did not take the report: %s", e)

    # -- shutdown -----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop heartbeating (the coordinator then drops this member) and fail pending requests."""
        if self._closed.is_set():
            return
        self._closed.set()
        call = self._heartbeat_call
        if call is not None:
            call.cancel()
        stream = self._quorums.stream
        if stream is not None:
            stream.close()
        self._requests.put(None)
        if self._quorum_thread is not None:
            self._quorum_thread.join(5)
        while True:  # requests queued behind the sentinel
            try:
                item = self._requests.get_nowait()
            except queue.Empty:
                break
            if item is not None and item[1].set_running_or_notify_cancel():
                item[1].set_exception(CoordinatorError(grpc.StatusCode.CANCELLED, "the client was closed"))
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join(5)
        self._quorums.drop()
        self._commits.drop()
        with self._lock:
            if self._report_channel is not None:
                self._report_channel.close()
                self._report_channel = None

    def __enter__(self) -> CoordinatorClient:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# MemberInfo's fields that every Member message carries. Its layout text is not one: it goes once,
# in the first heartbeat, for the coordinator to name what differs when fingerprints do not match.
_STATIC_FIELDS = (
    "replica_id",
    "incarnation",
    "num_hosts",
    "ftar_addresses",
    "catchup_addresses",
    "topology_fingerprint",
)


def member_proto(
    info: MemberInfo,
    step: int = 0,
    data_position: int = 0,
    has_state: bool = True,
    commit_failures: int = 0,
    digest: str = "",
) -> pb.Member:
    """A member's fields as the coordinator's message: its static ones and this moment's."""
    static = {name: getattr(info, name) for name in _STATIC_FIELDS}
    return pb.Member(
        **static,
        step=step,
        data_position=data_position,
        has_state=has_state,
        commit_failures=commit_failures,
        digest=digest,
    )
