"""A failure changes the time, not the math: with `ft.global_batch: constant` every step trains the
same R batches whoever is alive (ftjax/base/batches.py, docs/design/step.md "Constant global batch")."""

from __future__ import annotations

import subprocess
import threading

import jax
import numpy as np
import pytest
from conftest import FTJAX, REPO

from ftjax.base.batches import assign, check_tiling, chunk_sizes, for_others
from ftjax.config import ConfigError, load_config
from ftjax.ftar import FTAREndpoint, FTARError

TOKEN = "test-token"


# --- the assignment: a pure function of the quorum, by tables of cases ----------------------------
@pytest.mark.parametrize(
    "streams, rows, unit, contributors, expected",
    [
        # everybody there: each its own batch, nothing else (the elastic program)
        (3, 8, 2, [0, 1, 2], {0: ((0, 0, 8),), 1: ((1, 0, 8),), 2: ((2, 0, 8),)}),
        # one of three away: its 4 units split 2 / 2 -> each computes 1.5 batches (R / C), not 2
        (3, 8, 2, [0, 2], {0: ((0, 0, 8), (1, 0, 4)), 2: ((2, 0, 8), (1, 4, 8))}),
        # two of three away: the last one computes all three batches
        (3, 8, 2, [1], {1: ((1, 0, 8), (0, 0, 8), (2, 0, 8))}),
        # 4 streams, one away, 3 contributors: 4 units as 2 / 1 / 1, the first by id gets the extra
        (4, 8, 2, [0, 1, 3], {0: ((0, 0, 8), (2, 0, 4)), 1: ((1, 0, 8), (2, 4, 6)), 3: ((3, 0, 8), (2, 6, 8))}),
        # two away among 4, units of a whole batch: one each
        (4, 8, 8, [2, 3], {2: ((2, 0, 8), (0, 0, 8)), 3: ((3, 0, 8), (1, 0, 8))}),
        # a run of units crosses two orphan streams: two pieces
        (4, 4, 2, [3], {3: ((3, 0, 4), (0, 0, 4), (1, 0, 4), (2, 0, 4))}),
        (4, 4, 2, [0, 3], {0: ((0, 0, 4), (1, 0, 4)), 3: ((3, 0, 4), (2, 0, 4))}),
        # order and duplicates of the contributors do not matter
        (3, 8, 2, [2, 0, 2], {0: ((0, 0, 8), (1, 0, 4)), 2: ((2, 0, 8), (1, 4, 8))}),
    ],
)
def test_missing_batches_are_dealt_out_evenly_in_stream_order(streams, rows, unit, contributors, expected):
    got = assign(streams, rows, unit, contributors)
    assert got == expected
    work = [[c, *p] for c, pieces in got.items() for p in pieces]
    assert check_tiling(streams, rows, work) is None
    loads = [sum(b - a for _, a, b in pieces) for pieces in got.values()]
    assert max(loads) - min(loads) <= unit  # as even as the units allow


REDUCED = {  # (streams, rows, unit, contributors, own rows) -> assignment
    # a reduced replica (1 of 2 hosts) computes half its batch; the full one takes the other half
    "2 replicas, one at half degree": (2, 8, 2, [0, 1], {1: 4}, {0: ((0, 0, 8), (1, 4, 8)), 1: ((1, 0, 4),)}),
    # the orphan's units go where the work per device is least: 2 / 1 to the full / the reduced
    "one away, one reduced": (
        3,
        8,
        2,
        [0, 1],
        {1: 4},
        {0: ((0, 0, 8), (1, 4, 8), (2, 0, 4)), 1: ((1, 0, 4), (2, 4, 8))},
    ),
    "a reduced replica alone computes everything": (2, 8, 2, [1], {1: 4}, {1: ((1, 0, 4), (0, 0, 8), (1, 4, 8))}),
    "quarter degree": (2, 8, 2, [0, 1], {1: 2}, {0: ((0, 0, 8), (1, 2, 8)), 1: ((1, 0, 2),)}),
}


@pytest.mark.parametrize("streams, rows, unit, contributors, own, expected", REDUCED.values(), ids=REDUCED.keys())
def test_a_reduced_replica_computes_its_share_and_the_rest_is_dealt_out(
    streams, rows, unit, contributors, own, expected
):
    got = assign(streams, rows, unit, contributors, own_rows=own)
    assert got == expected
    assert check_tiling(streams, rows, [[c, *p] for c, pieces in got.items() for p in pieces]) is None


def test_a_reduced_share_must_be_whole_units():
    with pytest.raises(ValueError, match="own_rows: contributor 1 computes 3 rows"):
        assign(2, 8, 2, [0, 1], own_rows={1: 3})


@pytest.mark.parametrize(
    "rows, sizes, want",
    [(16, (8, 2), [8, 8]), (12, (8, 2), [8, 2, 2]), (4, (8, 2), [2, 2]), (8, (8,), [8]), (0, (8, 2), [])],
)
def test_a_share_is_computed_in_whole_batches_then_micro_batches(rows, sizes, want):
    assert chunk_sizes(rows, sizes) == want


def test_who_computes_whose_rows_reads_for_people():
    work = [[0, 0, 0, 8], [0, 1, 0, 4], [2, 2, 0, 8], [2, 1, 4, 8]]
    assert (for_others(work, 0), for_others(work, 2), for_others(work, 1)) == ("r1[0:4]", "r1[4:8]", "")


@pytest.mark.parametrize(
    "args, message",
    [
        ((3, 8, 3, [0]), "unit: 3 rows do not divide a batch of 8"),
        ((3, 8, 2, []), "contributors: none"),
        ((3, 8, 2, [0, 3]), r"contributors: \[0, 3\] are not all streams of 0..2"),
        ((0, 8, 2, [0]), "streams"),
    ],
)
def test_a_bad_assignment_request_names_the_argument(args, message):
    with pytest.raises(ValueError, match=message):
        assign(*args)


@pytest.mark.parametrize(
    "work, why",
    [
        ([[0, 0, 0, 8], [1, 1, 0, 8]], None),
        ([[0, 0, 0, 8], [0, 1, 0, 4], [1, 1, 4, 8]], None),
        ([[0, 0, 0, 8]], "stream 1: rows 0..8 not trained"),
        ([[0, 0, 0, 8], [0, 1, 0, 6], [1, 1, 4, 8]], "stream 1: rows 6..4 trained twice"),
        ([[0, 0, 0, 8], [0, 1, 0, 4], [1, 1, 6, 8]], "stream 1: rows 4..6 not trained"),
        ([[0, 0, 0, 8], [1, 1, 0, 8], [1, 2, 0, 8]], "not rows of a stream"),
    ],
)
def test_the_tiling_check_finds_rows_missed_or_trained_twice(work, why):
    got = check_tiling(2, 8, work)
    assert (got is None) if why is None else (why in got), got


# --- the pieces it rests on ---------------------------------------------------------------------
def test_micro_batch_rows_must_divide_the_batch_and_fit_the_devices(tmp_path):
    assert load_config("tiny", []).micro_rows == 2  # a quarter of 8 rows
    assert load_config("tiny", ["data.batch_size=12", "mesh.devices_per_host=2"]).micro_rows == 4
    with pytest.raises(ConfigError, match=r"ft.micro_batch_rows \(3\) must divide data.batch_size \(8\)"):
        load_config("tiny", ["ft.micro_batch_rows=3"])
    with pytest.raises(ConfigError, match="ft.global_batch"):
        load_config("tiny", ["ft.global_batch=fixed"])


def test_ftar_divides_the_contributors_sum_by_the_job_batch_count_and_members_must_agree_on_it():
    eps = [FTAREndpoint(TOKEN, timeout_s=5) for _ in range(2)]
    members = [e.address for e in eps]
    bufs = [np.full(1000, 3.0, np.float32), np.full(1000, 6.0, np.float32)]
    try:
        for qid, divisors, expect in ((1, (3, 3), 3.0), (2, (None, None), 4.5), (3, (3, 2), None)):
            out, errors = [None, None], [None, None]

            def call(i):
                try:
                    out[i] = eps[i].allreduce(
                        bufs[i], quorum_id=qid, step=0, members=members, rank=i, divisor=divisors[i]
                    )
                except FTARError as e:
                    errors[i] = e

            threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            if expect is None:  # a member dividing by another count: the call's fingerprint differs
                assert all(e is not None for e in errors), out
            else:
                assert errors == [None, None] and all(np.all(o == np.float32(expect)) for o in out)
        alone = FTAREndpoint(TOKEN)
        try:
            got = alone.allreduce(
                np.full(4, 9.0, np.float32), quorum_id=1, step=0, members=[alone.address], rank=0, divisor=3
            )
            assert np.all(got == 3.0)
            with pytest.raises(ValueError, match="divisor"):
                alone.allreduce(got, quorum_id=2, step=0, members=[alone.address], rank=0, divisor=0)
        finally:
            alone.close()
    finally:
        for e in eps:
            e.close()


# --- real jobs -----------------------------------------------------------------------------------
def _committed(records):
    return [r for r in records if "event" not in r and r.get("committed")]


def job_losses(metric_files, streams: int, rows: int) -> dict[int, float]:
    """Each step's loss over all R*B rows of the step, from the committed records' loss sums (a
    step whose rows are not all in the records, its contributor killed as it committed, is left out)."""
    from ftjax.runs.jsonl import read_jsonl

    pieces: dict[int, dict[tuple, float]] = {}
    for f in metric_files:
        for rec in _committed(read_jsonl(f)):
            for s, a, b, loss_sum in rec["loss_sums"] or ():  # (None: it applied a step it healed into)
                pieces.setdefault(rec["step"], {})[(s, a, b)] = loss_sum
    out = {}
    for step, got in pieces.items():
        if check_tiling(streams, rows, [[0, *k] for k in got]) is None:
            out[step] = sum(got.values()) / (streams * rows)
    return out


def largest_relative_difference(a: dict[int, float], b: dict[int, float]) -> float:
    return max(abs(a[n] - b[n]) / abs(b[n]) for n in a)


def final_params(run_dir, overrides):
    from ftjax.program.data import make_stream
    from ftjax.program.step import build_program
    from ftjax.runtime.checkpoint import DurableCheckpoints

    cfg = load_config("tiny", [*overrides, "ft.replicas=3"])
    program = build_program(cfg)
    ckpt = DurableCheckpoints.from_config(
        cfg, run_dir, data_fingerprint=make_stream(cfg).fingerprint, params=program.abstract_state()["params"]
    )
    try:
        state, meta = ckpt.restore(program.abstract_state())
    finally:
        ckpt.close()
    assert meta["step"] == cfg.steps
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(state["params"])])


@pytest.mark.timeout(360)
@pytest.mark.slow
def test_without_failures_constant_and_elastic_are_the_same_program(launch):
    runs = {}
    for mode in ("elastic", "constant"):
        run = runs[mode] = launch("--replicas", "3", "steps=15", f"ft.global_batch={mode}", name=mode)
        assert run.wait(300) == 0, run.output()
    for r in range(3):
        losses = {m: [(s["step"], s["loss"]) for s in _committed(runs[m].metrics(r))] for m in runs}
        assert len(losses["constant"]) == 15 and losses["constant"] == losses["elastic"]  # bitwise
    assert {d["param_digest"] for d in runs["constant"].summary()["replicas"].values()} == {
        d["param_digest"] for d in runs["elastic"].summary()["replicas"].values()
    }
    assert runs["constant"].summary()["constant_batch"]["steps_with_reassigned_rows"] == 0


@pytest.mark.slow
@pytest.mark.timeout(2160)  # its runs' own bounds below (150-207 s in a hogged suite on a 2-core machine)
def test_kills_at_three_steps_and_phases_change_the_time_not_the_math(launch, tmp_path, procs):
    """Replica 0 always lives (it holds the job's state); 1 dies at step 5 (forward) and again while
    it catches up, 2 at step 15 in FTAR. Each step kill hits a first incarnation, which trains from
    the job's start: a kill planned for a restarted incarnation at a later step was missed when a
    loaded machine took longer to restart it than the job took to finish (a catch-up still happens
    then, served by the finished replicas while they drain). The per-step loss over the R
    batches and the final parameters must equal the failure-free run's to float32 rounding. The
    rounding floor is measured here: the same failure-free job as one process that sums all R
    batches in one accumulation (`ftjax train`, a quorum of one) instead of FTAR's ring."""
    steps = 60  # (at 120 the restarted replicas too rejoined only at the end, while the others drained)
    job = [f"steps={steps}", "ft.global_batch=constant", f"checkpoint.every={steps}"]
    free = launch("--replicas", "3", *job, name="free")
    assert free.wait(600) == 0, free.output()
    alone = procs.start(
        [*FTJAX, "train", "tiny", *job, "ft.replicas=3", "--out", str(tmp_path / "alone")],
        stdout=open(tmp_path / "alone.out", "w"),
        stderr=subprocess.STDOUT,
    )
    assert alone.wait(600) == 0, (tmp_path / "alone.out").read_text()[-3000:]
    chaos = launch(
        "--replicas", "3", *job, "ft.drain_timeout_s=300", "--kill", "1@5:catchup", "--kill", "2@15:ftar", name="chaos"
    )
    assert chaos.wait(900) == 0, chaos.output()

    s = chaos.summary()
    assert s["digests_equal"] and s["exactly_once"], chaos.output()
    downs = [(e["replica"], e.get("at")) for e in s["failure_events"]]
    assert (1, "5:forward") in downs and (2, "15:ftar") in downs, downs
    assert [e["replica"] for e in chaos.events() if e["event"] == "fault" and e.get("kind") == "kill_catchup"] == [1]
    assert s["constant_batch"]["steps_with_reassigned_rows"] > 10  # the others computed the missing batches
    shown = (chaos.run_dir.parent / "chaos.out").read_text()  # the launcher's progress lines say who computes what
    assert "+r1[" in shown or "+r2[" in shown, shown[-3000:]

    rows = 8
    ref = job_losses([free.run_dir / f"replica-{r}" / "metrics.jsonl" for r in range(3)], 3, rows)
    floor_run = job_losses([tmp_path / "alone" / "metrics.jsonl"], 3, rows)
    got = job_losses([chaos.run_dir / f"replica-{r}" / "metrics.jsonl" for r in range(3)], 3, rows)
    assert len(ref) == len(floor_run) == steps and len(got) >= 0.9 * steps, (len(ref), len(floor_run), len(got))
    floor, diff = largest_relative_difference(floor_run, ref), largest_relative_difference(got, ref)
    print(f"largest relative loss difference: {diff:.3g} with failures, floor {floor:.3g}")
    assert 0 < floor < 1e-3, floor  # the two orders of the sum do differ, by rounding only
    assert diff <= 4 * floor, (diff, floor)

    p_ref = final_params(free.run_dir / "replica-0", job)
    p_floor = np.abs(final_params(tmp_path / "alone", job) - p_ref).max()
    np.testing.assert_allclose(final_params(chaos.run_dir / "replica-0", job), p_ref, rtol=0, atol=4 * p_floor)


@pytest.mark.timeout(1260)
@pytest.mark.slow
def test_a_batchnorm_model_gets_the_failure_free_losses_a_missing_batch_computed_whole(tmp_path, procs):
    """examples/linen_batchnorm.py normalizes over its batch: a missing replica's batch split between
    two survivors would be normalized in halves (losses ~5% off, nothing else says so). Its rows
    interact (a `batch_stats` collection), so the batch is computed whole by one contributor. Floor:
    the failure-free job in one process (the R batches summed in one accumulation)."""
    from launchrun import Launch

    from ftjax.program.tasks import task_of

    example = f"{REPO}/examples/linen_batchnorm.yaml"
    assert not task_of(load_config(example, [])).rows_independent  # detected, not declared
    job = ["steps=12", "ft.global_batch=constant"]

    def launch(name, *extra):
        run = Launch(procs, [example, "--replicas", "3", "--restart-delay-s", "0.5", *job, *extra], tmp_path / name)
        assert run.wait(600) == 0, run.output()
        return run

    free, chaos = launch("free"), launch("chaos", "--kill", "1@5:forward")
    alone = procs.start(
        [*FTJAX, "train", example, *job, "ft.replicas=3", "--out", str(tmp_path / "alone")],
        stdout=open(tmp_path / "alone.out", "w"),
        stderr=subprocess.STDOUT,
    )
    assert alone.wait(600) == 0, (tmp_path / "alone.out").read_text()[-3000:]
    assert chaos.summary()["constant_batch"]["steps_with_reassigned_rows"] >= 1, chaos.output()
    ref = job_losses([free.run_dir / f"replica-{r}" / "metrics.jsonl" for r in range(3)], 3, 8)
    floor_run = job_losses([tmp_path / "alone" / "metrics.jsonl"], 3, 8)
    got = job_losses([chaos.run_dir / f"replica-{r}" / "metrics.jsonl" for r in range(3)], 3, 8)
    floor, diff = largest_relative_difference(floor_run, ref), largest_relative_difference(got, ref)
    print(f"batchnorm: largest relative loss difference {diff:.3g} with a kill, floor {floor:.3g}")
    assert len(got) >= 10 and 0 < floor < 1e-4, (len(got), floor)
    assert diff <= 4 * floor, (diff, floor)
    work = [r["work"] for r in _committed(chaos.metrics(0)) if r["step"] > 5 and r.get("work")]
    assert any(len(w) > 2 for w in work)
    for w in work:  # every batch a contributor computes is a whole one
        assert all((a, b) == (0, 8) for _, _, a, b in w), w


@pytest.mark.timeout(360)
def test_a_batchnorm_model_refuses_what_would_split_its_batch(tmp_path):
    example, why = f"{REPO}/examples/linen_batchnorm.yaml", "task linen_batchnorm:task's rows interact"
    for arg in ("ft.micro_batch_rows=4", "ft.on_host_loss=reduce"):
        train = subprocess.run(
            [*FTJAX, "train", example, "ft.global_batch=constant", "ft.replicas=2", arg, "--out", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        says = f"{arg}: {why} (batch statistics)"
        assert train.returncode == 2 and says in train.stderr and "Traceback" not in train.stderr, train.stderr[-2000:]
