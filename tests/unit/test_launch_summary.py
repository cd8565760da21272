"""RUN/summary.json from fixture run directories whose every figure is known by hand."""

import json
from dataclasses import asdict

import pytest

from ftjax.launch.fault_plan import FaultPlan, Hang
from ftjax.launch.plots import write_loss, write_timeline
from ftjax.launch.view import _StallNote
from ftjax.runs.summary import build_summary, load_run, timeline, write_summary

T = 100.0  # launch time


def _step(t, step, *, batch=None, position=0, loss=None, healing=False, committed=True):
    return {
        "time": t,
        "step": step,
        "committed": committed,
        "healing": healing,
        "loss": loss,
        "batch_id": batch,
        "data_position": position,
        "participants": 2,
        "contributors": 2,
    }


def _write(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def make_run(tmp_path, *, r1_own_batches=(9, 11, 13), peers=(1, 3, 5, 7), torn_line=False):
    """Two replicas, 10 steps. Replica 0 never fails and stalls once (0.6 s between steps 5 and 6).
    Replica 1 trains steps 1-3, is killed, restarts, heals through steps 6-7 and trains 8-10."""
    _write(
        tmp_path / "launcher.jsonl",
        [
            {
                "time": T,
                "event": "launch",
                "replicas": 2,
                "hosts": 1,
                "devices": 1,
                "steps": 10,
                "config": "c.yaml",
                "overrides": [],
                "out": str(tmp_path),
            },
            {"time": T, "event": "replica_started", "replica": 0, "incarnation": 1},
            {"time": T, "event": "replica_started", "replica": 1, "incarnation": 1},
            {
                "time": 110.35,
                "event": "replica_down",
                "replica": 1,
                "incarnation": 1,
                "cause": "kill",
                "step": 3,
                "at": "4:ftar",
            },
            {"time": 110.45, "event": "replica_started", "replica": 1, "incarnation": 2},
            {"time": 111.25, "event": "rejoined", "replica": 1, "at_step": 7, "catchup_s": 0.7, "source": "0"},
            {"time": 111.6, "event": "replica_done", "replica": 0, "incarnation": 1, "step": 10},
            {"time": 111.6, "event": "replica_done", "replica": 1, "incarnation": 2, "step": 10},
            {"time": 111.7, "event": "end", "ok": True},
        ],
    )
    r0_times = [110.1, 110.2, 110.3, 110.4, 110.5, 111.1, 111.2, 111.3, 111.4, 111.5]
    _write(
        tmp_path / "replica-0" / "metrics.jsonl",
        [{"time": 105.0, "event": "start"}]
        + [_step(t, k + 1, batch=2 * k, position=k + 1, loss=3.0 - 0.1 * k) for k, t in enumerate(r0_times)],
    )
    r1 = [{"time": 105.0, "event": "start"}]
    r1 += [_step(110.1 + 0.1 * k, k + 1, batch=2 * k + 1, position=k + 1, loss=3.05 - 0.1 * k) for k in range(3)]
    r1 += [
        {"time": 110.5, "event": "start"},
        {"time": 110.55, "event": "batches_committed_by_peers", "batch_ids": list(peers)},
        {"time": 110.55, "event": "catchup_started", "source": "0", "at_step": 5},
        _step(111.1, 6, position=4, healing=True, committed=False),
        _step(111.2, 7, position=4, healing=True, committed=False),
        {"time": 111.25, "event": "catchup_done", "source": "0", "catchup_s": 0.7, "at_step": 7},
    ]
    r1 += [
        _step(111.3 + 0.1 * i, 8 + i, batch=b, position=5 + i, loss=2.2 + 0.1 * i) for i, b in enumerate(r1_own_batches)
    ]
    _write(tmp_path / "replica-1" / "metrics.jsonl", r1)
    if torn_line:  # a SIGKILL in the middle of a write leaves half a line
        with open(tmp_path / "replica-1" / "metrics.jsonl", "a") as f:
            f.write('{"time": 111.55, "step": 1')
    for r, position in ((0, 10), (1, 4 + len(r1_own_batches))):
        (tmp_path / f"replica-{r}" / "summary.json").write_text(
            json.dumps({"param_digest": "abc", "data_position": position, "final_loss": 2.0})
        )
    return tmp_path


def test_summary_figures_match_the_hand_computed_ones(tmp_path):
    s = write_summary(make_run(tmp_path, torn_line=True))
    assert json.loads((tmp_path / "summary.json").read_text()) == s
    assert s["ok"] and s["committed_steps"] == 10 and s["steps"] == 10
    assert s["wall_s"] == pytest.approx(11.7)
    assert s["warmup_s"] == pytest.approx(10.1)  # both replicas' first own step at 110.1
    # gaps of the never-failed replica 0 after warm-up: 0.1 x 4, 0.6, 0.1 x 4
    assert s["median_step_s"] == pytest.approx(0.1)
    assert s["max_healthy_stall_s"] == pytest.approx(0.6)
    # window [110.1, 111.5] x 2 replicas = 2.8 replica-s. Replica 0: 0.4 training + one median step
    # for its stalled gap + 0.4 training = 0.9. Replica 1: 0.25 training until its death at 110.35,
    # then 0.2 after its first own step back (111.3 -> 111.5) = 0.45.
    assert s["ettr"] == pytest.approx((0.9 + 0.45) / 2.8, abs=1e-4)
    assert s["final_loss"] == pytest.approx((2.1 + 2.4) / 2)  # the last 5% of 10 steps: step 10 of each
    assert s["failures"] == 1
    assert s["failure_events"] == [
        {
            "time_s": pytest.approx(10.35),
            "replica": 1,
            "cause": "kill",
            "step": 3,
            "at": "4:ftar",
            "recovery_s": pytest.approx(0.9),
        }
    ]
    assert s["exactly_once"] and s["digests_equal"]
    r0, r1 = s["replicas"]["0"], s["replicas"]["1"]
    assert (r0["restarts"], r0["failures"], r0["steps_committed"]) == (0, 0, 10)
    assert (r1["restarts"], r1["failures"], r1["steps_committed"], r1["steps_contributed"]) == (1, 1, 6, 6)
    assert r1["catchup_s"] == pytest.approx(0.7) and r1["data_position"] == 7
    assert r1["seconds_in_state"]["down"] == pytest.approx(0.1)
    assert r1["seconds_in_state"]["catching up"] == pytest.approx(0.75)  # 110.55 -> 111.3


def test_timeline_states(tmp_path):
    run = load_run(make_run(tmp_path))
    segs = timeline(run, median_s=0.1)
    states0 = [(round(a, 2), round(b, 2), st) for a, b, st in segs[0]]
    assert states0 == [
        (100.0, 110.1, "starting"),
        (110.1, 110.5, "training"),
        (110.5, 111.1, "stalled"),
        (111.1, 111.6, "training"),
        (111.6, 111.7, "done"),
    ]
    states1 = [(round(a, 2), round(b, 2), st) for a, b, st in segs[1]]
    assert states1 == [
        (100.0, 110.1, "starting"),
        (110.1, 110.35, "training"),
        (110.35, 110.45, "down"),
        (110.45, 110.55, "starting"),
        (110.55, 111.3, "catching up"),
        (111.3, 111.6, "training"),
        (111.6, 111.7, "done"),
    ]


def test_a_batch_trained_twice_breaks_exactly_once(tmp_path):
    # the restarted incarnation commits batch 5, which its first incarnation had already committed
    s = build_summary(make_run(tmp_path, r1_own_batches=(5, 11, 13)))
    assert not s["exactly_once"] and s["replicas"]["0"]["exactly_once"]
    assert "batch 5 trained twice" in s["replicas"]["1"]["exactly_once_error"]


def test_a_batch_trained_by_peers_then_again_is_a_repeat(tmp_path):
    # peers committed batch 9 for replica 1 (it died after contributing it), and it trains 9 again
    s = build_summary(make_run(tmp_path, peers=(1, 3, 5, 7, 9), r1_own_batches=(9, 11, 13)))
    assert "batch 9 trained twice" in s["replicas"]["1"]["exactly_once_error"]


def test_a_skipped_batch_breaks_exactly_once(tmp_path):
    # nobody trained batch 7, yet the stream resumed after it
    s = build_summary(make_run(tmp_path, peers=(1, 3, 5)))
    assert not s["exactly_once"]
    assert "missing batches [7]" in s["replicas"]["1"]["exactly_once_error"]


def test_a_replica_that_caught_up_and_committed_nothing_after_ends_at_the_step_it_caught_up_to(tmp_path):
    # replica 1 rejoins at step 7 (its last commit was step 3, before the kill) and trains no step after
    s = build_summary(make_run(tmp_path, r1_own_batches=()))
    assert s["replicas"]["1"]["final_step"] == 7 and s["replicas"]["1"]["steps_committed"] == 3
    assert s["replicas"]["0"]["final_step"] == 10


def test_a_replica_leaving_as_asked_to_come_back_whole_is_no_failure(tmp_path):
    # ft.on_host_loss: reduce: a reduced-degree replica leaves (exit 76, cause "left") once its host
    # is back, and restarts at full degree: a restart, not a failure
    make_run(tmp_path)
    events = [json.loads(line) for line in (tmp_path / "launcher.jsonl").read_text().splitlines()]
    left = {"time": 111.27, "event": "replica_down", "replica": 1, "incarnation": 2, "cause": "left", "step": 7}
    back = {"time": 111.28, "event": "replica_started", "replica": 1, "incarnation": 3}
    at = next(i for i, e in enumerate(events) if e["event"] == "replica_done")
    _write(tmp_path / "launcher.jsonl", events[:at] + [left, back] + events[at:])
    s = build_summary(tmp_path)
    assert s["failures"] == 1 and [e["cause"] for e in s["failure_events"]] == ["kill"]
    assert s["replicas"]["1"]["failures"] == 1 and s["replicas"]["1"]["restarts"] == 2


def test_different_digests_are_reported(tmp_path):
    make_run(tmp_path)
    (tmp_path / "replica-1" / "summary.json").write_text(json.dumps({"param_digest": "xyz", "data_position": 7}))
    assert not build_summary(tmp_path)["digests_equal"]


def test_replicas_that_end_with_different_digests_make_the_launch_fail(tmp_path):
    from ftjax.runs.summary import exit_code

    make_run(tmp_path)
    assert exit_code(build_summary(tmp_path), 0) == (0, "")
    (tmp_path / "replica-1" / "summary.json").write_text(json.dumps({"param_digest": "xyz", "data_position": 7}))
    code, why = exit_code(build_summary(tmp_path), 0)
    assert code == 1 and "replica 0 abc, replica 1 xyz" in why
    (tmp_path / "replica-1" / "summary.json").unlink()  # a missing digest is no difference
    assert exit_code(build_summary(tmp_path), 0) == (0, "")


def test_a_divergence_incident_is_in_the_summary(tmp_path):
    make_run(tmp_path)
    with open(tmp_path / "replica-1" / "metrics.jsonl", "a") as f:
        f.write(
            json.dumps(
                {
                    "time": 111.32,
                    "event": "diverged",
                    "step": 8,
                    "digest": "bad",
                    "majority_digest": "good",
                    "source": "0",
                }
            )
            + "\n"
        )
    assert build_summary(tmp_path)["divergences"] == [
        {"time_s": 11.32, "replica": 1, "step": 8, "digest": "bad", "majority_digest": "good", "source": "0"}
    ]


def test_a_replica_without_a_digest_is_no_difference(tmp_path):
    """A run ended by --timeout-s before any replica finished has no digest at all: the summary says
    so instead of "DIFFER"; with one replica missing it names it and judges the others."""
    from io import StringIO

    from rich.console import Console

    from ftjax.launch.view import print_summary

    def printed(summary):
        out = StringIO()
        print_summary(Console(file=out, width=200), summary, str(tmp_path))
        return out.getvalue()

    make_run(tmp_path)
    for r in (0, 1):
        (tmp_path / f"replica-{r}" / "summary.json").unlink()
    s = build_summary(tmp_path)
    assert [rec["param_digest"] for rec in s["replicas"].values()] == [None, None]
    assert not s["digests_equal"] and s["digests_missing"] == ["0", "1"]
    text = printed(s)
    assert "no digest for any replica" in text and "DIFFER" not in text, text
    (tmp_path / "replica-0" / "summary.json").write_text(json.dumps({"param_digest": "abc", "data_position": 7}))
    text = printed(build_summary(tmp_path))
    assert "no digest for replica 1" in text and "DIFFER" not in text, text


def test_the_printed_summary_counts_each_replicas_contributed_steps(tmp_path):
    """The table names what each replica trained with its own batches, apart from the steps it
    committed: a replica refused after every heal committed steps (healing) and contributed none,
    which "digests equal, exactly once" alone did not show."""
    from io import StringIO

    from rich.console import Console

    from ftjax.launch.view import print_summary

    make_run(tmp_path)
    metrics = tmp_path / "replica-1" / "metrics.jsonl"  # replica 1 commits its healing steps 6-7
    metrics.write_text(
        metrics.read_text().replace('"committed": false, "healing": true', '"committed": true, "healing": true')
    )
    out = StringIO()
    print_summary(Console(file=out, width=200), build_summary(tmp_path), str(tmp_path))
    lines = out.getvalue().splitlines()
    header = [c.strip() for c in next(x for x in lines if "┃" in x).split("┃")[1:-1]]
    assert header[:4] == ["replica", "steps", "contributed", "restarts"], header
    rows = [[c.strip() for c in x.split("│")[1:-1]] for x in lines if "│" in x]
    # replica 0 trained all 10 steps; replica 1 committed 8, its own batches in 1-3 and 8-10 (6-7 healing)
    assert {r[0]: tuple(r[1:4]) for r in rows} == {"0": ("10", "10", "0"), "1": ("8", "6", "1")}, rows


def test_the_printed_summary_in_a_log_file_keeps_every_header_whole(tmp_path):
    """In a file (not a terminal: 80 columns) the table takes the width it needs: rich would squash
    every header to "…" to fit 80 columns once a digest carries its note (`ftjax launch ... > log`)."""
    from io import StringIO

    from rich.console import Console

    from ftjax.launch.view import print_summary

    make_run(tmp_path)
    summary = build_summary(tmp_path)
    for rec in summary["replicas"].values():
        rec["ended_behind"], rec["param_digest"] = True, "0123456789abcdef"
    out = StringIO()
    console = Console(file=out, soft_wrap=True)  # what ftjax launch uses when stdout is not a terminal
    print_summary(console, summary, str(tmp_path))
    header = next(x for x in out.getvalue().splitlines() if "┃" in x)
    assert "…" not in header
    assert [c.strip() for c in header.split("┃")[1:-1]][:3] == ["replica", "steps", "contributed"]
    assert console.width == 80  # the console itself is left as it was


def test_not_a_run_directory(tmp_path):
    with pytest.raises(ValueError, match="not a run directory"):
        build_summary(tmp_path)


def test_plots_are_written(tmp_path):
    run = load_run(make_run(tmp_path))
    write_loss(run, tmp_path / "loss.png")
    write_timeline(run, tmp_path / "timeline.png", 0.1)
    for name in ("loss.png", "timeline.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("plots", [True, False])
def test_the_launchers_report_draws_the_plots_unless_told_not_to(tmp_path, plots):
    """`ftjax launch` ends with the summary and the plots; `--no-plots` leaves the plots out, and the
    table lists only the files that exist."""
    from io import StringIO

    from rich.console import Console

    from ftjax.launch.cli import _report

    out = make_run(tmp_path / "run")
    console = Console(file=StringIO(), width=200)
    _report(out, console, 0, plots=plots)
    shown = console.file.getvalue()
    assert (out / "summary.json").exists() and f"{out}/summary.json" in shown
    for name in ("loss.png", "timeline.png"):
        assert (out / name).exists() == plots and (f"{out}/{name}" in shown) == plots, shown


def make_frozen_run(tmp_path):
    """Two replicas. `--hang 1@0.4` SIGSTOPs replica 1 after its step 5 (110.5), and something sends it
    SIGCONT 15.1 s later, before the hang timeout: it is never declared hung, never killed. Replica 0
    waits 1.9 s for it (step 6 at 112.4), trains on alone every 0.1 s, and replica 1 rejoins with a
    healing step at 125.6 and an own step at 125.7: a 15.2 s gap between its committed steps."""
    r0_times = [round(110.1 + 0.1 * k, 3) for k in range(5)] + [round(112.4 + 0.1 * k, 3) for k in range(140)]
    steps = len(r0_times)
    r1_own_from = next(k for k, t in enumerate(r0_times) if t >= 125.7)  # replica 0's step at 125.7
    _write(
        tmp_path / "launcher.jsonl",
        [
            {
                "time": T,
                "event": "launch",
                "replicas": 2,
                "hosts": 1,
                "devices": 1,
                "steps": steps,
                "config": "c.yaml",
                "overrides": [],
                "out": str(tmp_path),
                "restart_delay_s": 1.0,
                "faults": asdict(FaultPlan(hangs=(Hang(1, 0.4),))),
            },
            {"time": T, "event": "replica_started", "replica": 0, "incarnation": 1},
            {"time": T, "event": "replica_started", "replica": 1, "incarnation": 1},
            {"time": 110.1, "event": "warm", "step": 1},
            {"time": 110.55, "event": "fault", "kind": "hang", "replica": 1, "step": 5},
            {"time": r0_times[-1] + 0.05, "event": "replica_done", "replica": 0, "incarnation": 1, "step": steps},
            {"time": r0_times[-1] + 0.05, "event": "replica_done", "replica": 1, "incarnation": 1, "step": steps},
            {"time": r0_times[-1] + 0.1, "event": "end", "ok": True},
        ],
    )
    _write(
        tmp_path / "replica-0" / "metrics.jsonl",
        [{"time": 105.0, "event": "start"}]
        + [_step(t, k + 1, batch=2 * k, position=k + 1, loss=2.0) for k, t in enumerate(r0_times)],
    )
    _write(
        tmp_path / "replica-1" / "metrics.jsonl",
        [{"time": 105.0, "event": "start"}]
        + [_step(r0_times[k], k + 1, batch=2 * k + 1, position=k + 1, loss=2.0) for k in range(5)]
        + [_step(125.6, r1_own_from, position=5, healing=True, committed=False)]
        + [
            _step(r0_times[k], k + 1, batch=2 * (k - r1_own_from + 5) + 1, position=k - r1_own_from + 6, loss=2.0)
            for k in range(r1_own_from, steps)
        ],
    )
    return tmp_path


def test_a_frozen_replica_is_not_healthy(tmp_path):
    # replica 1 was never killed, yet its 15.2 s gap is its own freeze, not a stall a failure caused
    s = build_summary(make_frozen_run(tmp_path))
    assert s["failures"] == 0 and s["replicas"]["1"]["restarts"] == 0
    assert s["max_healthy_stall_s"] == 1.9  # replica 0's wait for the frozen one
    assert s["median_step_s"] == 0.1


def test_a_constant_batch_stall_does_not_count_the_rows_taken_over_from_an_absent_peer(tmp_path):
    """With a constant global batch, replica 0 computes replica 1's rows while it is away: that
    longer step is work, not a wait. Its stall is the gap less those rows at the median rate of one
    batch (median step / rows of a batch); `max_healthy_gap_s` keeps the gap itself."""
    from ftjax.runs.summary import median_step, warm_time

    run_dir = make_run(tmp_path)
    path = run_dir / "replica-0" / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for rec in records:
        if "step" in rec:  # step 6 (the 0.6 s gap): replica 0 also computed all 8 rows of stream 1
            rec["work"] = [[0, 0, 0, 8], [0 if rec["step"] == 6 else 1, 1, 0, 8]]
    _write(path, records)
    run = load_run(run_dir)
    median, gaps = median_step(run, warm_time(run))
    assert median == pytest.approx(0.1)
    by_time = {round(t, 2): (gap, stall) for t, gap, stall in gaps}
    assert by_time[111.1] == (pytest.approx(0.6), pytest.approx(0.6 - 8 * 0.1 / 8))
    assert all(stall == gap for t, (gap, stall) in by_time.items() if t != 111.1)  # its own rows only
    s = build_summary(run_dir)
    assert s["max_healthy_stall_s"] == pytest.approx(0.5) and s["max_healthy_gap_s"] == pytest.approx(0.6)


def test_overlapping_partitions_are_each_checked_over_their_own_window(tmp_path):
    """Issue 26 item 6: two `--partition` windows of replica 1 overlap: #1 from 110 to 120, #2 from
    115 to 125. Replica 1 commits step 14 at 122, inside #2 only (a split brain). Each window is
    read from its cut to its own end (matched by number): #2's check must see step 14. Before, both
    cuts took the first end record (120) and #2 read [115, 120]: `isolated_commits: []`."""
    r1h0 = ["r1h0"]
    _write(
        tmp_path / "launcher.jsonl",
        [
            {
                "time": T,
                "event": "launch",
                "replicas": 2,
                "hosts": 1,
                "devices": 1,
                "steps": 20,
                "config": "c.yaml",
                "overrides": [],
                "out": str(tmp_path),
            },
            {"time": T, "event": "replica_started", "replica": 0, "incarnation": 1},
            {"time": T, "event": "replica_started", "replica": 1, "incarnation": 1},
            {
                "time": 110.0,
                "event": "fault",
                "kind": "partition",
                "replica": 1,
                "host": None,
                "step": 10,
                "seconds": 10.0,
                "hosts": r1h0,
                "cut": 1,
            },
            {
                "time": 115.0,
                "event": "fault",
                "kind": "partition",
                "replica": 1,
                "host": None,
                "step": 12,
                "seconds": 10.0,
                "hosts": r1h0,
                "cut": 2,
            },
            {
                "time": 120.0,
                "event": "partition_ended",
                "replica": 1,
                "host": None,
                "hosts": r1h0,
                "seconds": 10.0,
                "cut": 1,
                "restored": [],
            },
            {
                "time": 125.0,
                "event": "partition_ended",
                "replica": 1,
                "host": None,
                "hosts": r1h0,
                "seconds": 10.0,
                "cut": 2,
                "restored": r1h0,
            },
            {"time": 131.0, "event": "end", "ok": True},
        ],
    )
    r0 = [_step(100.0 + k, k + 1, batch=2 * k, position=k + 1, loss=2.0) for k in range(20)]  # steps 1-20 at 100-119
    r1 = [_step(100.0 + k, k + 1, batch=2 * k + 1, position=k + 1, loss=2.0) for k in range(10)]  # 1-10 by 109
    r1 += [{**_step(122.0, 14, batch=27, position=11, loss=2.0), "participants": 1}]  # alone, still cut off by #2
    _write(tmp_path / "replica-0" / "metrics.jsonl", r0)
    _write(tmp_path / "replica-1" / "metrics.jsonl", r1)
    first, second = build_summary(tmp_path)["partitions"]
    assert (first["restored"], first["isolated_commits"], first["peer_commits"]) == (True, [], {"0": 9})
    assert (second["restored"], second["isolated_commits"], second["peer_commits"]) == (True, [14], {"0": 4})


def test_steps_committed_with_the_peer_after_the_cut_record_are_not_isolated(tmp_path):
    """The launcher records a cut before it cuts; on a busy machine cutting takes a while, and the
    replica may commit a step or two more together with its peer (the same step, a quorum of 2 in
    both records) after the record: not a split brain. A step it commits alone is one."""
    cut = {"time": 110.5, "event": "fault", "kind": "partition", "replica": 1, "step": 10, "host": None}
    cut |= {"hosts": ["r1h0"], "seconds": 5.0, "cut": 1}
    end = {"time": 115.5, "event": "partition_ended", "replica": 1, "host": None, "hosts": ["r1h0"]}
    end |= {"seconds": 5.0, "cut": 1, "restored": ["r1h0"]}
    _write(tmp_path / "launcher.jsonl", [{"time": 100.0, "event": "launch", "replicas": 2, "steps": 20}, cut, end])
    r0 = [_step(100.0 + k, k + 1, batch=2 * k, position=k + 1, loss=2.0) for k in range(20)]
    together = [_step(100.0 + k, k + 1, batch=2 * k + 1, position=k + 1, loss=2.0) for k in range(13)]  # to 112
    alone = {**_step(113.0, 14, batch=27, position=14, loss=2.0), "participants": 1}
    _write(tmp_path / "replica-0" / "metrics.jsonl", r0)
    _write(tmp_path / "replica-1" / "metrics.jsonl", together)
    (p,) = build_summary(tmp_path)["partitions"]
    assert (p["in_flight"], p["isolated_commits"]) == ([12], []), p  # 13 too: with the peer
    _write(tmp_path / "replica-1" / "metrics.jsonl", [*together, alone])
    (p,) = build_summary(tmp_path)["partitions"]
    assert p["isolated_commits"] == [14], p


def make_split_run(tmp_path, *, late_trains_again: bool):
    """Issue 26 item 2 in small: replica 1 is cut off after step 2 while replica 0 trains steps 3-4
    in quorum 2 and finishes. Back, replica 1 either trains steps 3-4 again alone in quorum 3 (a
    split history) or is told that the job finished and exits (`job_finished`)."""
    _write(
        tmp_path / "launcher.jsonl",
        [
            {
                "time": T,
                "event": "launch",
                "replicas": 2,
                "hosts": 1,
                "devices": 1,
                "steps": 4,
                "config": "c.yaml",
                "overrides": [],
                "out": str(tmp_path),
            },
            {"time": T, "event": "replica_started", "replica": 0, "incarnation": 1},
            {"time": T, "event": "replica_started", "replica": 1, "incarnation": 1},
            {"time": 112.0, "event": "replica_done", "replica": 0, "incarnation": 1, "step": 4},
            {"time": 120.0, "event": "replica_done", "replica": 1, "incarnation": 1, "step": 4},
            {"time": 120.1, "event": "end", "ok": True},
        ],
    )

    def step(t, n, q, digest, batch, position):
        return _step(t, n, batch=batch, position=position, loss=1.0) | {"quorum_id": q, "param_digest": digest}

    _write(
        tmp_path / "replica-0" / "metrics.jsonl",
        [
            {"time": 105.0, "event": "start"},
            step(110.1, 1, 1, "d1", 0, 1),
            step(110.2, 2, 1, "d2", 2, 2),
            step(111.0, 3, 2, "d3", 4, 3),
            step(111.1, 4, 2, "d4", 6, 4),
        ],
    )
    r1 = [{"time": 105.0, "event": "start"}, step(110.1, 1, 1, "d1", 1, 1), step(110.2, 2, 1, "d2", 3, 2)]
    if late_trains_again:
        r1 += [step(119.0, 3, 3, "x3", 5, 3), step(119.1, 4, 3, "x4", 7, 4)]
    else:
        r1 += [{"time": 119.0, "event": "job_finished", "job_step": 4, "step": 2, "reason": "..."}]
    _write(tmp_path / "replica-1" / "metrics.jsonl", r1)
    (tmp_path / "replica-0" / "summary.json").write_text(json.dumps({"param_digest": "d4", "data_position": 4}))
    if late_trains_again:
        (tmp_path / "replica-1" / "summary.json").write_text(json.dumps({"param_digest": "x4", "data_position": 4}))
    return tmp_path


def test_a_step_committed_in_two_lineages_is_a_split_history_and_not_ok(tmp_path):
    s = build_summary(make_split_run(tmp_path, late_trains_again=True))
    assert s["split_history"]["steps"] == [3, 4]
    assert s["split_history"]["first"] == {
        "step": 3,
        "commits": [
            {"quorum_id": 2, "param_digest": "d3", "replicas": [0]},
            {"quorum_id": 3, "param_digest": "x3", "replicas": [1]},
        ],
    }
    assert not s["ok"]  # the launcher said ok: the summary knows better (and the launcher exits 1)


def test_a_replica_told_the_job_finished_ends_behind_and_the_history_is_one(tmp_path):
    s = build_summary(make_split_run(tmp_path, late_trains_again=False))
    assert s["split_history"] is None and s["ok"]
    assert s["replicas"]["1"]["ended_behind"] and not s["replicas"]["0"]["ended_behind"]
    assert s["digests_equal"] and s["digests_missing"] == []  # its stale digest is not the job's


def test_a_stalled_job_prints_why_the_coordinator_waits_every_30_s_and_only_while_it_holds_requests():
    note = _StallNote(every_s=30.0)
    waiting = {
        "pending": 2,
        "waiting_because": "waiting for a live member of the previous quorum to ask: 1",
        "quorum": {"quorum_id": 3},
    }
    assert note.poll(3, waiting, 100.0) is None  # (the step just seen)
    assert note.poll(3, waiting, 129.0) is None
    line = note.poll(3, waiting, 130.5)
    assert line is not None and "step 3: none for 30 s" in line and "previous quorum to ask: 1" in line
    assert note.poll(3, waiting, 140.0) is None  # once per 30 s
    assert "none for 60 s" in note.poll(3, waiting, 160.0)
    assert note.poll(4, waiting, 161.0) is None and note.poll(4, waiting, 190.0) is None  # the step moved
    assert note.poll(4, {"pending": 0, "waiting_because": "no pending request"}, 195.0) is None  # nobody asks
    assert note.poll(4, None, 195.0) is None  # (no answer from the coordinator yet)


def test_before_the_first_quorum_the_stall_line_says_the_job_is_starting():
    # at a job's start replicas compile before they ask: "step 0: none for 38 s" read as a stall
    note = _StallNote(every_s=30.0)
    starting = {"pending": 1, "waiting_because": "1 requesters of 2 alive members", "quorum": None}
    assert note.poll(0, starting, 0.0) is None
    line = note.poll(0, starting, 31.0)
    assert line.startswith("  starting: no quorum yet after 31 s") and "1 requesters of 2 alive members" in line


def test_a_host_logs_tail_is_its_last_characters_read_from_the_end(tmp_path):
    # the launcher reads it at every crash (the down line's last words): only the end of the file,
    # multi-byte characters intact
    from ftjax.base.procs import ProcessGroup
    from ftjax.launch.job import LocalJob

    with ProcessGroup() as procs:
        job = LocalJob("tiny", [], tmp_path, replicas=1, procs=procs)
        job.replica_dir(0).mkdir()
        text = "step 1 ✓\n" * 200_000 + "ftjax train: error: no quorum within 120 s — the peer ✗\n"
        (job.replica_dir(0) / "host-0.log").write_text(text)
        assert job.log_tail(0, 0, 60) == text[-60:]
        assert job.log_tail(0, 0, 10**7) == text  # (more than it holds: all of it)
        assert job.log_tail(0, 1) == ""


def make_refused_run(tmp_path):
    """`make_run`, until replica 1's restart after its kill: that incarnation and the next are refused
    (exit 2, the same reason), and the launcher stops the job at step 6, before its end."""
    out = make_run(tmp_path)
    events = [e for e in load_run(out).events if e["time"] <= 110.45]
    why = "ftjax train: error: token files do not match their index"
    refused = {"event": "replica_down", "replica": 1, "cause": "refused (host 0 exit 2)", "codes": [2], "error": why}
    events += [
        {**refused, "time": 110.9, "incarnation": 2, "step": 0},
        {"time": 111.0, "event": "replica_started", "replica": 1, "incarnation": 3},
        {**refused, "time": 111.12, "incarnation": 3, "step": 0},
        {"time": 111.15, "event": "end", "ok": False, "error": f"replica 1 was refused twice: {why}"},
    ]
    _write(out / "launcher.jsonl", events)
    for r in range(2):
        metrics = [m for m in load_run(out).metrics[r] if m["time"] <= 111.1]
        _write(out / f"replica-{r}" / "metrics.jsonl", metrics)
        (out / f"replica-{r}" / "summary.json").unlink()
    return out, why


def test_the_summary_tells_each_incarnations_end_and_contribution(tmp_path):
    s = build_summary(make_run(tmp_path))
    assert s["error"] is None and s["replicas"]["1"]["refusals"] == []
    ends = [(i["cause"], i["steps_contributed"], i["steps_committed"]) for i in s["replicas"]["1"]["incarnations"]]
    assert ends == [("kill", 3, 3), ("done", 3, 3)]  # steps 6, 7 healed: committed by peers, not by it
    assert [i["cause"] for i in s["replicas"]["0"]["incarnations"]] == ["done"]


def test_a_stopped_job_fails_with_its_reason_its_refusals_and_no_ettr(tmp_path):
    from io import StringIO

    from rich.console import Console

    from ftjax.launch.cli import _report
    from ftjax.runs.summary import exit_code

    out, why = make_refused_run(tmp_path)
    s = build_summary(out)
    assert not s["ok"] and s["error"] == f"replica 1 was refused twice: {why}"
    assert s["replicas"]["1"]["refusals"] == [{"incarnation": 2, "reason": why}, {"incarnation": 3, "reason": why}]
    assert [i["steps_contributed"] for i in s["replicas"]["1"]["incarnations"]] == [3, 0, 0]
    assert s["committed_steps"] == 6 and s["ettr"] is None
    assert s["ettr_why"] == "the job did not finish (6 of 10 steps committed)"
    assert exit_code(s, 0) == (1, f"the run failed: replica 1 was refused twice: {why}")
    console = Console(file=StringIO(), width=300)
    assert _report(out, console, 1, plots=False) == 1
    shown = console.file.getvalue()
    assert "ETTR n/a (the job did not finish (6 of 10 steps committed))" in shown, shown
    assert f"replica 1 incarnation 3: refused (host 0 exit 2) after contributing 0 steps: {why}" in shown, shown
    assert shown.splitlines()[-1] == f"ftjax launch: the run failed: replica 1 was refused twice: {why}", shown


def test_a_summary_that_cannot_be_written_is_one_line_and_a_failed_launch(tmp_path, monkeypatch):
    """The disk is full when the launcher writes summary.json: it says so in one line naming the
    file, still prints the summary, and exits non-zero even though the job itself went well."""
    import errno
    import os
    from io import StringIO
    from pathlib import Path

    from rich.console import Console

    from ftjax.launch.cli import _report

    out = make_run(tmp_path / "run")
    write_text = Path.write_text

    def full(self, *args, **kw):
        if self.name == "summary.json" and self.parent == out:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return write_text(self, *args, **kw)

    monkeypatch.setattr(Path, "write_text", full)
    console = Console(file=StringIO(), width=300)
    assert _report(out, console, 0, plots=False) == 1
    shown = console.file.getvalue()
    assert f"ftjax launch: cannot write {out / 'summary.json'} (No space left on device)" in shown, shown
    assert "committed steps 10/10" in shown and not (out / "summary.json").exists()


def test_the_largest_wait_leaves_out_a_replicas_own_computing_and_committing(tmp_path):
    """`max_healthy_wait_s`: replica 0's 0.6 s gap (step 6, at 111.1) was its own load, 0.5 s of
    computing and a slow 0.05 s commit, and its 0.1 s gaps each hold a 0.03 s wait; one of them
    (step 9) took 0.15 s, of which 0.08 s waiting for its peer. The stall counts the whole 0.6 s
    gap, the wait only the 0.08 s. Replica 1 failed: its waits (0.1 s: its records say it computed
    nothing) do not count. Records without the split give no wait."""
    run_dir = make_run(tmp_path)
    assert build_summary(run_dir)["max_healthy_wait_s"] is None  # (make_run's records have no split)
    path = run_dir / "replica-0" / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for rec in records:
        if "step" in rec:
            rec["compute_s"], rec["commit_s"] = (0.5, 0.05) if rec["step"] == 6 else (0.06, 0.01)
    by_step = {rec["step"]: rec for rec in records if "step" in rec}
    for k in range(9, 11):  # step 9 ends 0.05 s later: a wait for the peer
        by_step[k]["time"] = round(by_step[k]["time"] + 0.05, 3)
    _write(path, records)
    r1 = run_dir / "replica-1" / "metrics.jsonl"
    r1_records = [json.loads(line) for line in r1.read_text().splitlines()]
    for rec in r1_records:
        if "step" in rec:
            rec["compute_s"], rec["commit_s"] = 0.0, 0.0  # its gaps would all be waits: it failed
    _write(r1, r1_records)
    s = build_summary(run_dir)
    assert s["max_healthy_stall_s"] == pytest.approx(0.6)  # the loaded step
    assert s["max_healthy_wait_s"] == pytest.approx(0.15 - 0.06 - 0.01)


def test_a_job_whose_replicas_all_exited_0_short_of_its_last_step_failed(tmp_path):
    # an --entry script that returns without training: every replica "done", the launcher's end ok
    from ftjax.runs.summary import exit_code

    make_run(tmp_path)
    assert build_summary(tmp_path)["ok"]
    events = [json.loads(line) for line in (tmp_path / "launcher.jsonl").read_text().splitlines()]
    launch = next(e for e in events if e["event"] == "launch")
    launch["steps"] = 12  # two steps past what the replicas committed
    _write(tmp_path / "launcher.jsonl", events)
    s = build_summary(tmp_path)
    assert not s["ok"] and s["committed_steps"] == 10 and s["steps"] == 12
    assert exit_code(s, 0) == (1, "the job committed 10 of its 12 steps, though every replica exited 0")
    assert exit_code(s, 1) == (1, "the job committed 10 of its 12 steps")


def make_restored_run(tmp_path, *, position=2):
    """One replica, 8 steps, killed after step 4; its second incarnation restores the durable
    checkpoint of step 2 (data position `position`) and trains steps 3 to 8 again from there: the
    batches of steps 3 and 4 are trained twice, but the first time was undone by the restore."""
    _write(
        tmp_path / "launcher.jsonl",
        [
            {"time": T, "event": "launch", "replicas": 1, "hosts": 1, "devices": 1, "steps": 8},
            {"time": T, "event": "replica_started", "replica": 0, "incarnation": 1},
            {"time": 110.5, "event": "replica_down", "replica": 0, "incarnation": 1, "cause": "kill", "step": 4},
            {"time": 111.0, "event": "replica_started", "replica": 0, "incarnation": 2},
            {"time": 113.0, "event": "replica_done", "replica": 0, "incarnation": 2, "step": 8},
            {"time": 113.1, "event": "end", "ok": True},
        ],
    )
    records = [{"time": 105.0, "event": "start"}]
    records += [_step(110.1 + 0.1 * k, k + 1, batch=k, position=k + 1) for k in range(4)]
    records += [{"time": 111.5, "event": "start"}]
    records += [{"time": 111.6, "event": "restore", "restored_step": 2, "data_position": position}]
    records += [_step(112.0 + 0.1 * k, k + 1, batch=k, position=k + 1) for k in range(2, 8)]
    _write(tmp_path / "replica-0" / "metrics.jsonl", records)
    (tmp_path / "replica-0" / "summary.json").write_text(json.dumps({"param_digest": "abc", "data_position": 8}))
    return tmp_path


def test_batches_trained_again_after_a_restore_from_a_checkpoint_are_no_repeat(tmp_path):
    from ftjax.runs.summary import exit_code

    s = build_summary(make_restored_run(tmp_path))
    assert s["exactly_once"] and s["ok"] and exit_code(s, 0) == (0, ""), s["replicas"]["0"]


def test_a_repeat_fails_the_launch_naming_the_batch(tmp_path):
    # the restore says position 3, yet the batch of position 2 is trained again after it
    from ftjax.runs.summary import exit_code

    s = build_summary(make_restored_run(tmp_path, position=3))
    assert not s["exactly_once"] and not s["ok"]
    assert exit_code(s, 0) == (
        1,
        "not every batch was trained exactly once: replica 0: batch 2 trained twice (again at step 3)",
    )
