"""FT-HSDP: replicas that train together (and equal one big replica), and survive each other."""

import numpy as np
import pytest
from conftest import REPO
from ftjob import committed_digests, final_params, max_gap, records

from ftjax.cli.train import build_parser, parse_config, run_standalone
from ftjax.launch import LocalJob

TINY = f"{REPO}/configs/tiny.yaml"
STEPS = 20


def _equivalence(tmp_path, procs, hosts, devices_per_host):
    """2 FT replicas of batch 8 vs one standalone replica of batch 16, same seed and data.

    The exactness model is the token MLP: the GPT has parameters whose true gradient is zero (the
    key bias: softmax ignores a constant shift), which Adam turns into updates of pure fp32 noise."""
    common = [
        "model.kind=mlp",
        f"steps={STEPS}",
        f"checkpoint.every={STEPS}",
        f"mesh.devices_per_host={devices_per_host}",
    ]
    job = LocalJob(
        TINY,
        [*common, f"mesh.hosts={hosts}", "data.batch_size=8", "coordinator.min_replicas=2"],
        tmp_path / "ft",
        replicas=2,
        procs=procs,
    )
    job.start_coordinator()
    for r in range(2):
        job.start_replica(r)
    # the reference runs in this process meanwhile: 1 replica, 2 x the batch, the same devices in all
    ref_args = [*common, f"mesh.devices_per_host={hosts * devices_per_host}", "data.batch_size=16", "ft.replicas=1"]
    args = build_parser().parse_intermixed_args([TINY, "--out", str(tmp_path / "ref"), *ref_args])
    assert run_standalone(parse_config(args), args, tmp_path / "ref") == 0
    codes = job.wait(timeout=400)
    assert codes == {0: [0] * hosts, 1: [0] * hosts}, job.log_tail(0) + job.log_tail(1)

    d0, d1 = (committed_digests(job.replica_dir(r)) for r in range(2))
    assert sorted(d0) == list(range(1, STEPS + 1))
    assert d0 == d1  # bitwise equal state at every committed step
    ref = final_params(TINY, ref_args, tmp_path / "ref" / "checkpoints")
    for r in range(2):
        got = final_params(TINY, ref_args, job.replica_dir(r) / "checkpoints")
        # Relative to each parameter tensor's norm: fp32 summation order differs (two means of 8
        # averaged vs one mean of 16), and Adam's normalisation magnifies it on near-zero gradients,
        # so single near-zero entries are no fair yardstick.
        for path, a, b in zip(_paths(ref), _leaves(got), _leaves(ref)):
            rel = np.linalg.norm(a - b) / np.linalg.norm(b)
            assert rel <= 1e-5, (path, rel)
    steps0, _ = records(job.replica_dir(0))
    assert all(r["contributors"] == 2 and r["participants"] == 2 for r in steps0)
    # the two replicas trained disjoint halves of the reference's batches
    ids = sorted(r["batch_id"] for d in (0, 1) for r in records(job.replica_dir(d))[0])
    assert ids == list(range(2 * STEPS))


def _leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def _paths(tree):
    import jax

    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


@pytest.mark.slow
def test_two_replicas_equal_one_with_twice_the_batch(tmp_path, procs):
    _equivalence(tmp_path, procs, hosts=1, devices_per_host=2)


@pytest.mark.slow
def test_two_multihost_replicas_equal_one_with_twice_the_batch(tmp_path, procs):
    _equivalence(tmp_path, procs, hosts=2, devices_per_host=1)


@pytest.mark.timeout(480)
@pytest.mark.slow
def test_survivors_finish_when_a_replica_dies_in_ftar(tmp_path, procs):
    steps = 30
    job = LocalJob(
        TINY,
        [
            f"steps={steps}",
            "coordinator.min_replicas=2",
            "coordinator.heartbeat_timeout_s=2",
            "ft.drain_timeout_s=0",
        ],  # replica 2 is not coming back: no waiting for it at the end
        tmp_path,
        replicas=3,
        procs=procs,
    )
    job.start_coordinator()
    job.start_replica(0)
    job.start_replica(1)
    job.start_replica(2, die_at="10:ftar")
    codes = job.wait([0, 1], timeout=400)
    assert codes == {0: [0], 1: [0]}, job.log_tail(0)
    assert job.replica_exit_codes(2) == [-9]  # really SIGKILLed, not restarted

    d0, d1 = (committed_digests(job.replica_dir(r)) for r in (0, 1))
    assert sorted(d0) == list(range(1, steps + 1)) and d0 == d1
    for r in (0, 1):
        steps_r, events = records(job.replica_dir(r))
        committed = [s for s in steps_r if s["committed"]]
        # each replica's own batches, each exactly once, in order: a discarded step retried its batch
        assert [s["batch_id"] for s in committed] == [3 * k + r for k in range(steps)]
        assert committed[8]["participants"] == 3 and committed[-1]["participants"] == 2
        failures = [e for e in events if e["event"] == "commit_failure"]
        assert all(f["step"] == 10 for f in failures)
        gap, median = max_gap(steps_r[2:])  # (the first steps include compilation)
        assert gap <= median + 1.5, (gap, median)
