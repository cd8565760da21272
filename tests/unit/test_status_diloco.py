"""The coordinator's view of a DiLoCo job: step reports with `inner_steps`, `fragment` and
`sync_bytes` (ftjax/runtime/trainer.py's round records) become outer rounds, inner steps and bytes
averaged on the status page, its JSON and /metrics; an every-step job's view is what it was."""

from __future__ import annotations

import re
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

ROUND_TOKENS = 20 * 512  # 20 inner steps of 512 tokens
DELTA_BYTES = 1_000_000  # float32 bytes of the fragment averaged per round


def _wire(record: dict, warmup: int = 0) -> pb.QuorumRequest:
    """The quorum request that carries `record`, through the client's report_step."""
    client = SimpleNamespace(_report=None)
    CoordinatorClient.report_step(client, record, target_steps=10, replicas=2, warmup_steps=warmup)
    return pb.QuorumRequest(report=client._report)


def _record(step: int, diloco: bool, warmup: int = 0) -> dict:
    """Step `step`'s record: an every-step step, or a streaming DiLoCo round of 20 inner steps (two
    fragments), or a DiLoCo round after a synchronous warm-up of `warmup` steps of one inner step."""
    record = {"step": step, "committed": True, "loss": 3.0, "step_time_s": 2.0, "tokens": ROUND_TOKENS}
    if diloco:
        record.update(inner_steps=20, fragment=0 if warmup else (step - 1) % 2, sync_bytes=DELTA_BYTES)
    if step <= warmup:  # (a warm-up is diloco's, one fragment: streaming refuses it)
        record.update(inner_steps=1, fragment=0, tokens=ROUND_TOKENS // 20)
    return record


def _state(diloco: bool) -> CoordinatorState:
    """Replicas a and b: rounds 1 to 3; b then sends its round-3 report again (a retried request)."""
    state = CoordinatorState(Settings(min_replicas=1, expected_replicas=2), 0.0, startup_grace=0.0)

    def member(rid: str, step: int) -> MemberReport:
        return MemberReport(rid, f"{rid}-inc", step=step, data_position=step, ftar_addresses=(f"h:{rid}",))

    for rid in "ab":
        state.register(member(rid, 0), 0.0)
    for t, step in ((0.1, 0), (0.2, 1), (0.3, 2), (0.4, 3)):
        for rid in "ab":
            figures = _step_figures(_wire(_record(step, diloco))) if step else None
            state.request(member(rid, step), t, figures)
        assert state.evaluate(t).quorum is not None
    state.request(member("b", 3), 0.45, _step_figures(_wire(_record(3, diloco))))
    return state


def test_the_step_report_carries_a_rounds_fields_or_nothing():
    figures = _step_figures(_wire(_record(3, diloco=True)))
    assert (figures.inner_steps, figures.fragment, figures.sync_bytes) == (20, 0, DELTA_BYTES)
    assert figures.tokens == ROUND_TOKENS
    every = _wire(_record(3, diloco=False))
    assert not any(every.report.HasField(f) for f in ("inner_steps", "fragment", "sync_bytes"))
    figures = _step_figures(every)
    assert (figures.inner_steps, figures.fragment, figures.sync_bytes) == (None, None, None)
    for field, bad in (("inner_steps", 0), ("fragment", -1), ("sync_bytes", -8)):
        with pytest.raises(InvalidField) as e:
            StepFigures(3, True, True, 1.0, 0.1, 512, **{field: bad}).validate()
        assert e.value.field == f"report.{field}"


def test_a_healing_rounds_report_is_valid_and_leaves_the_rounds_fields_to_its_peers():
    """A replica's healing round (the trainer's record: it trained nothing, 0 inner steps) is
    reported without the round's fields: with them the coordinator refused the report
    (inner_steps 0) and the healed replica exited 2 after every heal."""
    healing = {**_record(3, diloco=True), "healing": True, "loss": None, "tokens": 0, "inner_steps": 0}
    for warmup in (0, 6):
        wire = _wire(healing, warmup)
        assert not any(wire.report.HasField(f) for f in ("inner_steps", "fragment", "sync_bytes", "warmup_steps"))
        figures = _step_figures(wire)  # (validated: it raised InvalidField report.inner_steps)
        assert (figures.contributed, figures.inner_steps) == (False, None)
    state = _state(diloco=True)
    b = MemberReport("b", "b-inc", step=3, data_position=3, ftar_addresses=("h:b",))
    state.request(b, 0.5, _step_figures(_wire(healing)))
    assert state.progress.inner_steps == 20  # the job's rounds are still its contributors'


def test_a_diloco_job_shows_outer_rounds_inner_steps_and_bytes_averaged():
    state = _state(diloco=True)
    snap = state.snapshot(0.5)
    # 3 rounds per replica, each counted once (b's repeated report adds nothing)
    assert snap["job"]["sync"] == {
        "outer_rounds": 3,
        "warmup_steps": 0,
        "optimizer_steps": 60,
        "inner_steps": 20,
        "fragment": 0,
        "fragments_seen": 2,
        "bytes_per_round": DELTA_BYTES,
        "bytes_total": 2 * 3 * DELTA_BYTES,
        "bytes_per_token": DELTA_BYTES / ROUND_TOKENS,
    }
    rows = {r["replica_id"]: r for r in snap["replicas"]}
    for rid in "ab":
        assert rows[rid]["inner_steps"] == 20 and rows[rid]["sync_bytes"] == DELTA_BYTES
        assert rows[rid]["sync_bytes_total"] == 3 * DELTA_BYTES
        assert rows[rid]["sync_bytes_per_token"] == pytest.approx(97.65625)

    page = status_page(snap)
    assert "<title>ftjax: training, outer round 3/10</title>" in page
    assert "committed outer rounds" in page and "outer rounds/s" in page
    assert re.search(r">DiLoCo<.*>20 inner steps<.*\(60 optimizer steps in all\); streaming: fragment 0", page)
    assert re.search(r">bytes averaged<.*>6.0 MB<.*1.0 MB per replica per round, 97.7 B/token", page)
    assert "<th>round</th>" in page and "<th>round time</th>" in page
    assert "<th>averaged</th><th>B/token</th><th>data position<sup>*</sup></th>" in page
    assert '<td class="n">3.0 MB</td><td class="n">97.7</td>' in page

    metrics = Metrics(state).text().decode()
    assert "ftjax_job_inner_steps 20.0" in metrics
    assert "ftjax_job_sync_bytes_total 6e+06" in metrics
    assert f"ftjax_job_sync_bytes_per_token {DELTA_BYTES / ROUND_TOKENS}" in metrics
    assert 'ftjax_replica_sync_bytes_total{replica="a"} 3e+06' in metrics


# The job's and a replica's keys in /status, and the replica table's header, before DiLoCo.
EVERY_STEP_JOB = {
    "target_steps",
    "committed_steps",
    "replicas",
    "alive",
    "training",
    "steps_per_s",
    "eta_s",
    "tokens_per_s",
    "tokens_total",
    "goodput_tokens_per_s",
    "ettr",
    "loss",
    "median_step_s",
    "warm_at",
    "finished",
    "first_step",
    "finished_at",
}
EVERY_STEP_REPLICA = {
    "replica_id",
    "incarnation",
    "step",
    "data_position",
    "has_state",
    "num_hosts",
    "heartbeat_age_s",
    "alive",
    "requesting",
    "suspected",
    "departed_because",
    "state",
    "state_text",
    "since_s",
    "heal_source",
    "incarnation_number",
    "restarts",
    "finished",
    "loss",
    "step_time_s",
    "tokens_per_s",
    "mfu",
    "eval_loss",
    "report_step",
}
EVERY_STEP_HEADER = (
    '<table class="replicas"><tr><th>replica</th><th>state</th><th>step</th><th>loss</th><th>step time</th>'
    "<th>tokens/s</th><th>MFU</th><th>eval loss</th><th>data position<sup>*</sup></th><th>restarts</th>"
    "<th>last heard</th></tr>"
)


def test_an_every_step_job_renders_as_before():
    state = _state(diloco=False)
    snap = state.snapshot(0.5)
    assert set(snap["job"]) == EVERY_STEP_JOB
    assert all(set(r) == EVERY_STEP_REPLICA for r in snap["replicas"])
    page = status_page(snap)
    assert "<title>ftjax: training, step 3/10</title>" in page
    assert EVERY_STEP_HEADER in page and "committed steps" in page and " steps/s" in page
    for word in ("outer round", "DiLoCo", "inner steps", "averaged", "B/token", "round time"):
        assert word not in page
    metrics = Metrics(state).text().decode()
    assert "sync" not in metrics and "inner" not in metrics
    # and with the same reports, only the round fields set the two apart
    diloco = status_page(_state(diloco=True).snapshot(0.5))
    assert "DiLoCo" in diloco and EVERY_STEP_HEADER not in diloco


@pytest.mark.parametrize("diloco", [False, True])
def test_a_retried_report_counts_its_tokens_once(diloco):
    # b's round-3 report came twice (a retried quorum request): the job's tokens are 2 replicas x 3
    # steps, and /metrics says the same (before, b's step 3 was counted twice)
    state = _state(diloco)
    snap = state.snapshot(0.5)
    assert snap["job"]["tokens_total"] == 2 * 3 * ROUND_TOKENS
    assert f"ftjax_job_tokens_total {float(2 * 3 * ROUND_TOKENS)}" in Metrics(state).text().decode()
    # a new incarnation of b (the job restarted from a checkpoint at step 2) trains step 3 again:
    # those tokens were trained again, so they count
    state.register(MemberReport("b", "b-inc2", step=2, data_position=2, ftar_addresses=("h:b2",)), 0.6)
    again = MemberReport("b", "b-inc2", step=3, data_position=3, ftar_addresses=("h:b2",))
    state.request(again, 0.7, _step_figures(_wire(_record(3, diloco))))
    state.request(again, 0.8, _step_figures(_wire(_record(3, diloco))))  # and retried: once
    assert state.snapshot(0.9)["job"]["tokens_total"] == 7 * ROUND_TOKENS


def test_a_warmed_up_diloco_job_shows_its_synchronous_steps_then_its_rounds():
    # ft.sync_warmup_steps=2: steps 1 and 2 average gradients (one inner step each), then rounds of 20
    state = CoordinatorState(Settings(min_replicas=1, expected_replicas=1), 0.0, startup_grace=0.0)
    state.register(MemberReport("a", "a-inc", step=0, data_position=0, ftar_addresses=("h:a",)), 0.0)
    cards = []
    for step in range(5):
        figures = _step_figures(_wire(_record(step, True, warmup=2), warmup=2)) if step else None
        state.request(MemberReport("a", "a-inc", step=step, data_position=step, ftar_addresses=("h:a",)), step, figures)
        assert state.evaluate(step).quorum is not None
        sync = state.snapshot(step + 0.5)["job"].get("sync")
        page = status_page(state.snapshot(step + 0.5))
        cards.append(re.search(r">DiLoCo</div><div class=\"v\">(.*?)</div><div class=\"s\">(.*?)</div>", page))
        if step:
            assert (sync["warmup_steps"], sync["outer_rounds"]) == (2, max(0, step - 2))
            assert sync["optimizer_steps"] == min(step, 2) + 20 * max(0, step - 2)
    assert cards[0] is None  # no report yet: nothing says it is DiLoCo
    assert cards[1].groups() == ("synchronous warm-up", "1 of its 2 steps: gradients averaged every step")
    assert cards[2].groups() == ("synchronous warm-up", "2 of its 2 steps: gradients averaged every step")
    after = "per outer round (42 optimizer steps in all, the first 2 synchronous)"
    assert cards[4].groups() == ("20 inner steps", after)
    # the job's count holds the warm-up's steps and the rounds: it says steps, not outer rounds
    assert "committed steps" in page and "committed outer rounds" not in page
    # without a warm-up, a round reported before any commit is a round, not a warm-up step
    state = CoordinatorState(Settings(min_replicas=1, expected_replicas=1), 0.0, startup_grace=0.0)
    state.register(MemberReport("a", "a-inc", step=0, data_position=0, ftar_addresses=("h:a",)), 0.0)
    uncommitted = _step_figures(_wire({**_record(1, True), "committed": False}))
    state.request(MemberReport("a", "a-inc", step=0, data_position=0, ftar_addresses=("h:a",)), 0.1, uncommitted)
    assert state.snapshot(0.2)["job"]["committed_steps"] == 0
    assert '>DiLoCo</div><div class="v">20 inner steps</div>' in status_page(state.snapshot(0.2))
    # only a DiLoCo round's report carries the warm-up; a bad count is refused naming the field
    assert not _wire(_record(3, False), warmup=2).report.HasField("warmup_steps")
    with pytest.raises(InvalidField) as e:
        StepFigures(3, True, True, 1.0, 0.1, 512, inner_steps=1, warmup_steps=0).validate()
    assert e.value.field == "report.warmup_steps"
