"""`ftjax simulate --from-run` against a real chaos run of `ftjax launch` (issue 19).

The launcher kills whole replicas at random (`--mtbf-s`); the run measures its own step time,
stall per failure, restart and catch-up times and failure times; the simulation replays those
failures with the mean costs and must land within 0.05 of the ETTR the run's summary measured.
"""

from __future__ import annotations

import pytest

from ftjax.sim.from_run import predict


@pytest.mark.timeout(480)
@pytest.mark.slow
def test_from_run_predicts_the_ettr_of_a_chaos_run(launch):
    # seed 1: the first kill falls 1.2 s after warm-up, so the run has at least one failure
    run = launch("--replicas", "2", "--mtbf-s", "8", "--seed", "1", "steps=600")
    code = run.wait(timeout=400)
    assert code == 0, run.output()
    summary = run.summary()
    assert summary["failures"] >= 1, summary["failure_events"]
    out = predict(run.run_dir)
    assert out["measured_ettr"] == pytest.approx(summary["ettr"], abs=1e-3)
    assert out["failures"] == len([e for e in summary["failure_events"] if e["replica"] is not None])
    assert abs(out["predicted_ettr"] - out["measured_ettr"]) <= 0.05, out
