"""A failure changes the time, not the math: with `ft.global_batch: constant` every step trains the
same R batches whoever is alive (ftjax/batches.py, docs/design.md "Constant global batch")."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ftjax.batches import assign, check_tiling
from ftjax.config import ConfigError, load_config
from ftjax.ftar import FTAREndpoint, FTARError

TOKEN = "test-token"


# --- the assignment: a pure function of the quorum, by tables of cases ----------------------------
@pytest.mark.parametrize("streams, rows, unit, contributors, expected", [
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
])
def test_missing_batches_are_dealt_out_evenly_in_stream_order(streams, rows, unit, contributors, expected):
    got = assign(streams, rows, unit, contributors)
    assert got == expected
    work = [[c, *p] for c, pieces in got.items() for p in pieces]
    assert check_tiling(streams, rows, work) is None
    loads = [sum(b - a for _, a, b in pieces) for pieces in got.values()]
    assert max(loads) - min(loads) <= unit  # as even as the units allow


@pytest.mark.parametrize("args, message", [
    ((3, 8, 3, [0]), "unit: 3 rows do not divide a batch of 8"),
    ((3, 8, 2, []), "contributors: none"),
    ((3, 8, 2, [0, 3]), r"contributors: \[0, 3\] are not all streams of 0..2"),
    ((0, 8, 2, [0]), "streams"),
])
def test_a_bad_assignment_request_names_the_argument(args, message):
    with pytest.raises(ValueError, match=message):
        assign(*args)


@pytest.mark.parametrize("work, why", [
    ([[0, 0, 0, 8], [1, 1, 0, 8]], None),
    ([[0, 0, 0, 8], [0, 1, 0, 4], [1, 1, 4, 8]], None),
    ([[0, 0, 0, 8]], "stream 1: rows 0..8 not trained"),
    ([[0, 0, 0, 8], [0, 1, 0, 6], [1, 1, 4, 8]], "stream 1: rows 6..4 trained twice"),
    ([[0, 0, 0, 8], [0, 1, 0, 4], [1, 1, 6, 8]], "stream 1: rows 4..6 not trained"),
    ([[0, 0, 0, 8], [1, 1, 0, 8], [1, 2, 0, 8]], "not rows of a stream"),
])
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
                    out[i] = eps[i].allreduce(bufs[i], quorum_id=qid, step=0, members=members, rank=i,
                                              divisor=divisors[i])
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
            got = alone.allreduce(np.full(4, 9.0, np.float32), quorum_id=1, step=0, members=[alone.address], rank=0,
                                  divisor=3)
            assert np.all(got == 3.0)
            with pytest.raises(ValueError, match="divisor"):
                alone.allreduce(got, quorum_id=2, step=0, members=[alone.address], rank=0, divisor=0)
        finally:
            alone.close()
    finally:
        for e in eps:
            e.close()
