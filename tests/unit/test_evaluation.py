"""Held-out evaluation's pieces (`eval:`) and the TensorBoard writer (`log.tensorboard`), in process."""

from __future__ import annotations

import numpy as np
import pytest

from ftjax.config import ConfigError, load_config
from ftjax.program.data import eval_share, heldout_batch
from ftjax.runs.summary import last_eval_loss
from ftjax.runtime.faults import parse_die_at
from ftjax.runtime.metrics import MetricsLog
from ftjax.runtime.tensorboard import scalars


def test_each_replica_takes_the_batches_of_its_residue_and_together_all_once():
    shares = [eval_share(7, r, 3) for r in range(3)]
    assert shares == [[0, 3, 6], [1, 4], [2, 5]]
    assert sorted(i for s in shares for i in s) == list(range(7))
    assert eval_share(2, 3, 4) == []  # more replicas than batches: the last ones evaluate nothing


def test_a_heldout_batch_is_consecutive_examples_wrapping_around_the_source():
    source = [np.full(3, i, np.int32) for i in range(5)]
    assert heldout_batch(source, 0, 2)[:, 0].tolist() == [0, 1]
    assert heldout_batch(source, 2, 2)[:, 0].tolist() == [4, 0]


def test_eval_and_log_settings_default_off_and_on_and_are_validated():
    cfg = load_config("tiny")
    assert (cfg.eval.every, cfg.eval.batches, cfg.log.tensorboard) == (0, 4, True)
    cfg = load_config("tiny", ["eval.every=5", "eval.batches=2", "log.tensorboard=false"])
    assert (cfg.eval.every, cfg.eval.batches, cfg.log.tensorboard) == (5, 2, False)
    with pytest.raises(ConfigError, match="eval.batches"):
        load_config("tiny", ["eval.batches=0"])


def test_die_at_an_evaluation_parses():
    assert parse_die_at("8:eval") == (8, "eval")


def test_last_eval_loss_is_the_latest_record_that_has_one():
    steps = [{"step": 1, "eval_loss": 3.0}, {"step": 2}, {"step": 3, "eval_loss": 2.5}, {"step": 4}]
    assert last_eval_loss(steps) == 2.5 and last_eval_loss(steps[1:2]) is None


def test_a_step_record_becomes_scalars_by_tag():
    record = {"step": 3, "loss": 2.0, "eval_loss": 1.5, "eval_perplexity": 4.48, "participants": 2, "mfu": None}
    out = scalars({**record, "tokens": 512, "step_time_s": 0.5, "committed": True, "batch_id": 7, "lr": 1e-3})
    assert out["train/loss"] == 2.0 and out["eval/loss"] == 1.5 and out["eval/perplexity"] == 4.48
    assert out["quorum/participants"] == 2 and out["tokens_per_s"] == 1024 and "mfu" not in out
    assert out["lr"] == 1e-3


def test_metrics_log_writes_every_record_and_event_to_tensorboard_too(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLog(tmp_path, tensorboard=tmp_path / "tb")
    log.log({"step": 1, "loss": 3.0, "participants": 1})
    log.event("commit_failure", step=2, errors=1)
    log.log({"step": 2, "loss": 2.0, "eval_loss": 2.5, "eval_perplexity": 12.18, "participants": 1})
    log.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    values = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert values["train/loss"] == [(1, 3.0), (2, 2.0)] and values["eval/loss"] == [(2, 2.5)]
    assert values["events/commit_failure"] == [(1, 1.0)]  # marked at the latest step logged
    assert "events/commit_failure/text_summary" in acc.Tags()["tensors"]


def test_the_status_page_shows_each_replicas_latest_eval_loss():
    from ftjax.coordinator import coordinator_pb2 as pb
    from ftjax.coordinator.page import status_page
    from ftjax.coordinator.progress import StepFigures
    from ftjax.coordinator.quorum import MemberReport, Settings
    from ftjax.coordinator.service import _step_figures
    from ftjax.coordinator.state import CoordinatorState

    wire = pb.QuorumRequest(report=pb.StepReport(step=2, committed=True, contributed=True, eval_loss=2.25))
    assert _step_figures(wire).eval_loss == 2.25
    assert _step_figures(pb.QuorumRequest(report=pb.StepReport(step=2))).eval_loss is None
    state = CoordinatorState(Settings(min_replicas=1, expected_replicas=2), 0.0, startup_grace=0.0)

    def member(rid: str, step: int) -> MemberReport:
        return MemberReport(rid, f"{rid}-inc", step=step, data_position=step, ftar_addresses=(f"h:{rid}",))

    for rid in "ab":
        state.register(member(rid, 0), 0.0)
    for t, step in ((0.1, 0), (0.2, 1), (0.3, 2)):
        for rid in "ab":  # a evaluates at step 1 only: its latest eval loss stays on the page
            fig = StepFigures(
                step, True, True, 5.0, 0.1, 512, 10, 2, eval_loss=3.125 if (rid, step) == ("a", 1) else None
            )
            state.request(member(rid, step), t, fig if step else None)
        assert state.evaluate(t).quorum is not None
    rows = {r["replica_id"]: r for r in state.snapshot(0.4)["replicas"]}
    assert rows["a"]["eval_loss"] == 3.125 and rows["b"]["eval_loss"] is None
    page = status_page(state.snapshot(0.4))
    assert "<th>eval loss</th>" in page and '<td class="n">3.1250</td>' in page
