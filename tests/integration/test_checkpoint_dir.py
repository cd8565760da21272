"""One `checkpoint.dir` given to every replica of a job: each replica saves under its own
subdirectory (DIR/replica-R), so that no replica's save collides with or deletes another's, and a
job whose replicas all die resumes from them (docs/design/checkpoints.md, "Checkpoint layout")."""

import pytest
from conftest import REPO
from ftjob import records

from ftjax.launch import LocalJob
from ftjax.runs.jsonl import read_jsonl

TINY = f"{REPO}/configs/tiny.yaml"
# synchronous saves: step 10's checkpoint is whole before the kills at step 13
SAVES = ["checkpoint.every=5", "checkpoint.async_save=false", "ft.digest_every=1"]


def _one_history(replica_dirs) -> dict[int, str]:
    """{step: digest} over every replica and incarnation; fails if a step was committed with two
    digests (a split history: a restart from the seed, or from another replica's state)."""
    seen: dict[int, str] = {}
    for d in replica_dirs:
        for r in read_jsonl(d / "metrics.jsonl"):
            if r.get("committed") and "param_digest" in r:
                assert seen.setdefault(r["step"], r["param_digest"]) == r["param_digest"], (d, r["step"])
    return seen


def _resumed_from_own_checkpoints(run_dir, ckpt_dir, r: int, step: int) -> None:
    steps, events = records(run_dir)
    assert len([e for e in events if e["event"] == "init"]) == 1, events  # the seed once, at job start
    restore = [e for e in events if e["event"] == "restore"]
    assert restore and restore[-1]["restored_step"] == step and restore[-1]["source"] == "durable", events
    after = [s["batch_id"] for s in steps if s["time"] > restore[-1]["time"] and s.get("committed")]
    assert after[:3] == [2 * k + r for k in range(step, step + 3)], after  # its own stream, where it stopped
    assert (ckpt_dir / f"replica-{r}" / str(step)).is_dir()


@pytest.mark.timeout(480)
def test_a_launch_given_one_checkpoint_dir_saves_per_replica_and_resumes(launch, tmp_path):
    """`ftjax launch --replicas 2 checkpoint.dir=DIR`, both replicas killed at step 13: the launcher
    restarts them, each restores its own step 10 from DIR/replica-R, the job ends with equal digests
    and no step committed with two digests."""
    ckpt = tmp_path / "shared-ckpt"
    run = launch(
        "--replicas", "2", "steps=20", *SAVES, f"checkpoint.dir={ckpt}", "coordinator.min_replicas=2",
        "--kill", "0@13:forward", "--kill", "1@13:forward",
    )  # fmt: skip
    assert run.wait(timeout=400) == 0, run.output()
    assert sorted(p.name for p in ckpt.iterdir()) == ["replica-0", "replica-1"]
    for r in (0, 1):
        _resumed_from_own_checkpoints(run.run_dir / f"replica-{r}", ckpt, r, 10)
    history = _one_history([run.run_dir / "replica-0", run.run_dir / "replica-1"])
    assert sorted(history) == list(range(1, 21)), history
    assert run.summary()["digests_equal"], run.output()


@pytest.mark.timeout(780)
def test_hand_started_members_all_killed_resume_from_one_given_checkpoint_dir(tmp_path, procs):
    """A job with no launcher: a coordinator and two `ftjax train --coordinator` members started by
    hand, given one checkpoint.dir, all killed at step 13 and started again by hand (no --resume):
    each restores its own step 10, nobody starts again from the seed, one history."""
    ckpt = tmp_path / "shared-ckpt"
    over = ["steps=16", *SAVES, f"checkpoint.dir={ckpt}", "coordinator.min_replicas=2"]
    job = LocalJob(TINY, over, tmp_path, replicas=2, procs=procs)
    job.start_coordinator()
    for r in (0, 1):
        job.start_replica(r, die_at="13:forward")
    for r in (0, 1):
        job.hosts[r][0].wait(300)
        assert job.replica_exit_codes(r) == [-9], job.log_tail(r)
    for r in (0, 1):
        job.start_replica(r)
    assert job.wait(timeout=400) == {0: [0], 1: [0]}, job.log_tail(0)
    for r in (0, 1):
        _resumed_from_own_checkpoints(job.replica_dir(r), ckpt, r, 10)
    assert sorted(_one_history([job.replica_dir(0), job.replica_dir(1)])) == list(range(1, 17))
