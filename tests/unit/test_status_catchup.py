"""A catch-up under way on the coordinator's status page, its JSON and /metrics: the healing
replica's `catchup_progress` events (ftjax/runtime/protocol.py) ride its next quorum requests
(StepReport's catchup fields) until the catch-up ends; the page says how many bytes it fetched
of how many, and how long it has left."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from ftjax.coordinator import coordinator_pb2 as pb
from ftjax.coordinator.client import CoordinatorClient
from ftjax.coordinator.http import Metrics
from ftjax.coordinator.page import status_page
from ftjax.coordinator.progress import StepFigures
from ftjax.coordinator.quorum import InvalidField, MemberReport, Settings
from ftjax.coordinator.service import _step_figures
from ftjax.coordinator.state import CoordinatorState

STEP = {"step": 4, "committed": True, "healing": True, "loss": None, "step_time_s": 0.5, "tokens": 0}
PROGRESS = {"event": "catchup_progress", "source": "a", "bytes_done": 12_300_000, "bytes_total": 45_600_000}


def _client() -> SimpleNamespace:
    """The client's report bookkeeping alone (no channel): report_step and the request it builds."""
    return SimpleNamespace(_report=None, _catchup=None)


def _request(client) -> pb.QuorumRequest:
    """The report part of the next quorum request, as `_request_quorum` fills it."""
    calls = []

    class Stream:
        def exchange(self, request, timeout):
            calls.append(request)
            raise KeyboardInterrupt  # (stop at the first send: only the request is wanted)

    fake = SimpleNamespace(
        **vars(client),
        _closed=SimpleNamespace(is_set=lambda: False),
        quorum_timeout_s=5.0,
        _membership=(0, ()),
        member=SimpleNamespace(replica_id="b", incarnation="b-2"),
        _quorums=SimpleNamespace(get=lambda remaining: Stream()),
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("ftjax.coordinator.client.member_proto", lambda *a: pb.Member())
        with pytest.raises(KeyboardInterrupt):
            CoordinatorClient._request_quorum(fake, 4, 0, False, 0)
    return calls[0]


def test_progress_events_ride_the_quorum_requests_until_the_catchup_ends():
    client = _client()
    report = lambda record: CoordinatorClient.report_step(client, record, target_steps=10, replicas=2)
    report(STEP)
    assert not _request(client).report.HasField("catchup_bytes_total")  # no fetch yet
    report({**PROGRESS, "eta_s": 3.2})
    r = _request(client).report
    assert (r.catchup_bytes_done, r.catchup_bytes_total, r.catchup_eta_s) == (12_300_000, 45_600_000, 3.2)
    report({**STEP, "step": 5})  # a later healing step keeps the fetch's figures
    assert _request(client).report.catchup_bytes_done == 12_300_000
    report({**PROGRESS, "eta_s": None})  # an ETA not known yet travels as absent
    r = _request(client).report
    assert r.HasField("catchup_bytes_done") and not r.HasField("catchup_eta_s")
    report({"event": "catchup_done", "at_step": 5})
    assert not _request(client).report.HasField("catchup_bytes_done")
    figures = _step_figures(_request(client))
    assert (figures.catchup_bytes_done, figures.catchup_bytes_total, figures.catchup_eta_s) == (None, None, None)


def test_the_catchup_fields_are_checked_naming_the_field_at_fault():
    ok = StepFigures(4, True, False, float("nan"), 0.5, 0, catchup_bytes_done=5, catchup_bytes_total=9)
    ok.validate()
    for change, field in (
        ({"catchup_bytes_done": 10, "catchup_bytes_total": 9}, "report.catchup_bytes_done"),
        ({"catchup_bytes_done": 1, "catchup_bytes_total": -1}, "report.catchup_bytes_total"),
        ({"catchup_bytes_done": 1, "catchup_bytes_total": None}, "report.catchup_bytes_total"),
        ({"catchup_eta_s": float("inf")}, "report.catchup_eta_s"),
        ({"catchup_eta_s": -1.0}, "report.catchup_eta_s"),
    ):
        with pytest.raises(InvalidField) as e:
            ok._replace(**change).validate()
        assert e.value.field == field, change


def test_a_healing_replica_shows_the_bytes_fetched_and_its_eta():
    t = time.monotonic()  # (/metrics reads the clock: the replicas must be alive at its now)
    state = CoordinatorState(Settings(min_replicas=1, expected_replicas=2), t, startup_grace=0.0)
    a = lambda step: MemberReport("a", "a-1", step=step, data_position=step, ftar_addresses=("h:a",))
    b = MemberReport("b", "b-2", step=0, data_position=0, has_state=False, ftar_addresses=("h:b",))
    state.register(a(3), t)
    state.register(b, t)
    client = _client()
    CoordinatorClient.report_step(client, STEP, target_steps=10, replicas=2)
    CoordinatorClient.report_step(client, {**PROGRESS, "eta_s": 3.2}, target_steps=10, replicas=2)
    state.request(a(3), t + 0.01, None)
    state.request(b, t + 0.01, _step_figures(_request(client)))
    q = state.evaluate(t + 0.01).quorum
    assert q is not None and [p.replica_id for p in q.participants if p.healing] == ["b"]
    snap = state.snapshot(t + 0.02)
    rows = {r["replica_id"]: r for r in snap["replicas"]}
    assert (rows["b"]["catchup_bytes_done"], rows["b"]["catchup_bytes_total"]) == (12_300_000, 45_600_000)
    assert rows["b"]["catchup_eta_s"] == 3.2
    assert "catchup_bytes_done" not in rows["a"]  # (a replica not catching up has none)
    assert "12.3 of 45.6 MB fetched, about 3 s to go" in rows["b"]["state_text"]
    assert "12.3 of 45.6 MB fetched, about 3 s to go" in status_page(snap)
    metrics = Metrics(state).text().decode()
    assert 'ftjax_replica_catchup_bytes{replica="b"} 1.23e+07' in metrics
    assert 'ftjax_replica_catchup_total_bytes{replica="b"} 4.56e+07' in metrics
    assert 'ftjax_replica_catchup_eta_seconds{replica="b"} 3.2' in metrics
    assert 'ftjax_replica_catchup_bytes{replica="a"}' not in metrics
