"""The coordinator's server: the gRPC service (ftjax/coordinator/service.py) on its event loop, in a
thread of its own, and the HTTP status pages beside it. `ftjax coordinator` (ftjax/cli/coordinator.py)
runs one in a process.

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

import asyncio
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ftjax.base import net
from ftjax.base.tls import TLS
from ftjax.coordinator import coordinator_pb2 as pb
from ftjax.coordinator.http import Metrics, StatusHTTPServer
from ftjax.coordinator.jobview import JobView
from ftjax.coordinator.quorum import Settings
from ftjax.coordinator.service import MAX_MESSAGE_BYTES, SERVICE, CoordinatorService, TokenCheck
from ftjax.coordinator.state import CoordinatorState

SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_concurrent_streams", 1 << 20),
    # Calls not yet picked up by the loop: the defaults (1000 soft, 3000 hard) cancel calls when a
    # thousand replicas (re)connect at once.
    ("grpc.server.max_pending_requests", 50_000),
    ("grpc.server.max_pending_requests_hard_limit", 100_000),
    ("grpc.so_reuseport", 0),  # a second coordinator on the same port must fail
]


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
        service = CoordinatorService(self.state, self.metrics, asyncio.get_running_loop())
        server = grpc.aio.server(
            interceptors=[TokenCheck(self._token, lambda: self.metrics.rejected("UNAUTHENTICATED"))],
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
