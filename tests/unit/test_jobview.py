"""The coordinator's job view in TensorBoard (ftjax/coordinator/jobview.py): the state driven in
process through a few quorums, a catch-up and failure reports, the event files read back with
TensorBoard's own reader."""

from __future__ import annotations

from pathlib import Path

from ftjax.coordinator.jobview import JobView
from ftjax.coordinator.quorum import MemberReport, Settings
from ftjax.coordinator.state import CoordinatorState

SETTINGS = Settings(min_replicas=1, heartbeat_timeout_s=2.0, suspect_window_s=0.3, join_timeout_s=1.0)


def scalars(directory: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def member(rid: str, step: int, has_state: bool = True) -> MemberReport:
    return MemberReport(
        rid, f"{rid}-1", step=step, data_position=step, ftar_addresses=(f"h:{rid}",), has_state=has_state
    )


def test_quorums_failures_and_catchups_are_scalars_at_the_job_step(tmp_path):
    state = CoordinatorState(SETTINGS, 0.0, startup_grace=0.0)
    state.job_view = JobView(tmp_path / "job", flush_s=0.1)
    for rid in "abc":
        state.register(member(rid, 0), 0.0)
    # step 5: c has no state and heals from a peer (a catch-up)
    for rid, step, has_state in (("a", 5, True), ("b", 5, True), ("c", 0, False)):
        state.request(member(rid, step, has_state), 0.1)
    q = state.evaluate(0.1).quorum
    assert q is not None and q.step == 5 and q.num_contributors == 2
    # step 6: c is still healing (one catch-up over two quorums: counted once)
    for rid, step, has_state in (("a", 6, True), ("b", 6, True), ("c", 0, False)):
        state.request(member(rid, step, has_state), 0.15)
    assert state.evaluate(0.15).quorum.num_contributors == 2
    for rid in "abc":
        state.request(member(rid, 7), 0.2)
    assert state.evaluate(0.2).quorum.num_contributors == 3
    # a report on c while it is heard from (PENDING: a suspect), one on nobody (not counted)
    assert state.accuse("c", "c-1", 0.3, reporter="a").verdict == "PENDING"
    assert state.accuse("z", "z-1", 0.3, reporter="a").verdict == "UNKNOWN_REPLICA"
    for rid in "ab":  # c stays silent past the suspect window: dropped, the quorum goes on without it
        state.request(member(rid, 8), 1.0)
    q = state.evaluate(1.0).quorum
    assert q is not None and [p.replica_id for p in q.participants] == ["a", "b"]
    state.job_view.close()

    got = scalars(tmp_path / "job")
    assert got["job/quorum_size"] == {5: 3, 6: 3, 7: 3, 8: 2}
    assert got["job/contributors"] == {5: 2, 6: 2, 7: 3, 8: 2}
    assert got["job/step"] == {5: 5, 6: 6, 7: 7, 8: 8}
    assert got["job/catchups"] == {5: 1}
    assert got["job/failures"] == {7: 1}


def test_the_server_writes_the_view_only_when_given_a_directory(tmp_path):
    from ftjax.cli.coordinator import parser as _parser
    from ftjax.coordinator.server import CoordinatorServer

    assert CoordinatorServer(SETTINGS, "token", http_port=None).state.job_view is None
    server = CoordinatorServer(SETTINGS, "token", http_port=None, tensorboard_dir=tmp_path / "job")
    assert server.state.job_view is not None
    server.stop()  # (never started) closes the view: its files are there, nothing left queued
    assert server.state.job_view is None and list((tmp_path / "job").glob("events.out.tfevents.*"))
    assert _parser().parse_args(["--tensorboard-dir", "d"]).tensorboard_dir == "d"
    assert _parser().parse_args([]).tensorboard_dir is None
