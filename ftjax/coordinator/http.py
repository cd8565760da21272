"""The coordinator's HTTP side: `/` a status page (ftjax/coordinator/page.py), `/status` JSON,
`/metrics` Prometheus text.

Served by the standard library's threading HTTP server in a daemon thread; every request reads a
snapshot of the state under its lock, so the gRPC loop is never blocked for more than a copy.
The server is `BoundedHTTPServer` (ftjax/base/http.py), with bounds on idle, slow and surplus
connections.
"""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ftjax.base import net
from ftjax.base.http import HEADER_TIMEOUT_S, IDLE_TIMEOUT_S, MAX_CONNECTIONS, MAX_PENDING, BoundedHTTPServer
from ftjax.coordinator.page import status_page
from ftjax.coordinator.state import CoordinatorState
from ftjax.runs.lifecycle import Phase

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0)
_WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


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
