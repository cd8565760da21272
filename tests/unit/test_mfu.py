"""MFU, from the step record to the operator: the record's fields (ftjax/runtime/metrics.py), the
median in summaries, the step report on the wire, the coordinator's gauge and status page."""

import math

import pytest

from ftjax.coordinator import coordinator_pb2 as pb
from ftjax.coordinator.http import Metrics
from ftjax.coordinator.page import status_page
from ftjax.coordinator.progress import StepFigures
from ftjax.coordinator.quorum import InvalidField, MemberReport, Settings
from ftjax.coordinator.service import _step_figures
from ftjax.coordinator.state import CoordinatorState
from ftjax.runs.summary import median_mfu
from ftjax.runtime.metrics import ModelFlops


def test_a_step_record_carries_model_flops_and_mfu_when_the_peak_is_known():
    flops = ModelFlops(per_row=1e9, devices=4, peak_per_device=1e12)
    out = flops.fields(rows=8, step_time_s=0.01)
    assert out["model_flops_per_step"] == 8e9
    assert out["mfu"] == pytest.approx(8e9 / (0.01 * 4 * 1e12))  # 0.2
    # a constant global batch's share: more rows, more model FLOPs in the same step
    assert flops.fields(rows=12, step_time_s=0.01)["model_flops_per_step"] == 12e9
    assert "mfu" not in flops.fields(rows=0, step_time_s=0.01)  # healing: it computed nothing
    no_peak = ModelFlops(per_row=1e9, devices=4)  # CPU without hardware.peak_flops_per_device
    assert no_peak.fields(rows=8, step_time_s=0.01) == {"model_flops_per_step": 8e9}


def test_the_median_mfu_skips_records_without_one():
    assert median_mfu([{"mfu": 0.2}, {"mfu": 0.4}, {"step": 3}, {"mfu": 0.3}]) == 0.3
    assert median_mfu([{"step": 1}, {"step": 2}]) is None


def test_the_step_report_carries_mfu_or_nothing():
    with_peak = pb.QuorumRequest(report=pb.StepReport(step=3, committed=True, contributed=True, mfu=0.25))
    assert _step_figures(with_peak).mfu == 0.25
    without = pb.QuorumRequest(report=pb.StepReport(step=3, committed=True, contributed=True, mfu=None))
    assert _step_figures(without).mfu is None
    for bad in (-0.1, math.inf, math.nan, 1e6):
        with pytest.raises(InvalidField) as e:
            StepFigures(3, True, True, 1.0, 0.1, 512, mfu=bad).validate()
        assert e.value.field == "report.mfu"


def _state_with_reports(figures: dict[str, StepFigures]) -> CoordinatorState:
    state = CoordinatorState(Settings(min_replicas=1, expected_replicas=2), 0.0, startup_grace=0.0)

    def member(rid: str, step: int) -> MemberReport:
        return MemberReport(rid, f"{rid}-inc", step=step, data_position=step, ftar_addresses=(f"h:{rid}",))

    for rid in figures:
        state.register(member(rid, 0), 0.0)
    for t, step in ((0.1, 0), (0.2, 1)):
        for rid, fig in figures.items():
            state.request(member(rid, step), t, fig if step else None)
        assert state.evaluate(t).quorum is not None
    return state


def test_metrics_have_an_mfu_gauge_per_replica_and_the_page_a_column():
    state = _state_with_reports(
        {
            "a": StepFigures(1, True, True, 5.0, 0.1, 512, 10, 2, mfu=0.4215),
            "b": StepFigures(1, True, True, 5.0, 0.1, 512, 10, 2),  # no peak known
        }
    )
    text = Metrics(state).text().decode()
    assert 'ftjax_replica_mfu{replica="a"} 0.4215' in text, text
    assert 'ftjax_replica_mfu{replica="b"}' not in text
    rows = {r["replica_id"]: r for r in state.snapshot(0.3)["replicas"]}
    assert rows["a"]["mfu"] == 0.4215 and rows["b"]["mfu"] is None
    page = status_page(state.snapshot(0.3))
    assert "<th>MFU</th>" in page and '<td class="n">42.1%</td>' in page
