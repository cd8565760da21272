"""A replica's lifecycle (ftjax/runs/lifecycle.py): the transition table and the stall rule as tables of
cases, the fold, and one recorded run folded by the launcher's live path and by the summary: the
same segments."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from test_launch_summary import make_frozen_run, make_run
from test_supervisor_rules import _Job

from ftjax.launch.fault_plan import FaultPlan
from ftjax.launch.supervisor import POLL_S, RunLog, Supervisor
from ftjax.runs.events import EVENT, REPLICA, TIME, StepField
from ftjax.runs.events import LauncherEvent as L
from ftjax.runs.events import ReplicaEvent as E
from ftjax.runs.lifecycle import Lifecycle, Phase, Segment, is_stall, next_phase, segments, signal
from ftjax.runs.summary import build_summary, load_run, median_step, timeline, warm_time

RECORDED = Path(__file__).parents[1] / "data" / "launch_kill_restart"
STARTING, TRAINING, STALLED, CATCHING_UP = Phase.STARTING, Phase.TRAINING, Phase.STALLED, Phase.CATCHING_UP
DOWN, DONE, GONE = Phase.DOWN, Phase.DONE, Phase.GONE


def step(t=0.0, n=5, *, committed=True, healing=False):
    return {
        TIME: t,
        "step": n,
        "committed": committed,
        "healing": healing,
        "loss": None if healing else 2.0,
        "batch_id": None,
        "data_position": 3,
        "participants": 2,
        "contributors": 2,
    }


def ev(name, t=0.0, **fields):
    return {TIME: t, EVENT: name, **fields}


def test_the_vocabulary_is_the_strings_on_disk():
    for vocabulary in (E, L, StepField):
        assert [m.value for m in vocabulary] == [m.name.lower() for m in vocabulary]
    assert json.dumps({EVENT: E.CATCHUP_DONE}) == '{"event": "catchup_done"}'


# name: phase before, record, phase after
TRANSITIONS = {
    "the launcher starts an incarnation": (DOWN, ev(L.REPLICA_STARTED, replica=1, incarnation=2), STARTING),
    "its process is up: still starting": (STARTING, ev(E.START, replica="1"), STARTING),
    "init, restore: still starting": (STARTING, ev(E.INIT, seed=0), STARTING),
    "the first own step ends starting": (STARTING, step(), TRAINING),
    "an own step: training": (TRAINING, step(), TRAINING),
    "an own step ends a stall": (STALLED, step(), TRAINING),
    "the first own step ends a catch-up": (CATCHING_UP, step(), TRAINING),
    "a relayed step while starting: it heals": (STARTING, step(committed=False, healing=True), CATCHING_UP),
    "a relayed step while training: it fell behind": (TRAINING, step(committed=False, healing=True), CATCHING_UP),
    "a step it did not commit is no own step": (TRAINING, step(committed=False), CATCHING_UP),
    "catchup_started while starting": (STARTING, ev(E.CATCHUP_STARTED, source="0", at_step=9), CATCHING_UP),
    "stale_state while training": (TRAINING, ev(E.STALE_STATE, step=4, job_step=9), CATCHING_UP),
    "stale_state while stalled": (STALLED, ev(E.STALE_STATE, step=4, job_step=9), CATCHING_UP),
    "catchup_done: catching up until the first own step": (CATCHING_UP, ev(E.CATCHUP_DONE, at_step=9), CATCHING_UP),
    "catchup_failed: the next quorum fetches again": (CATCHING_UP, ev(E.CATCHUP_FAILED, error="x"), CATCHING_UP),
    "killed while training": (TRAINING, ev(L.REPLICA_DOWN, replica=0, cause="kill"), DOWN),
    "killed while catching up": (CATCHING_UP, ev(L.REPLICA_DOWN, replica=0, cause="kill_catchup"), DOWN),
    "killed while stalled": (STALLED, ev(L.REPLICA_DOWN, replica=0, cause="hang"), DOWN),
    "finished": (TRAINING, ev(L.REPLICA_DONE, replica=0, step=10), DONE),
    "finished right after catching up to the last step": (CATCHING_UP, ev(L.REPLICA_DONE, replica=0), DONE),
    "not restarted: gone": (DOWN, ev(L.NOT_RESTARTED, replica=0), GONE),
    "abandoned: gone": (CATCHING_UP, ev(L.ABANDONED, replica=0), GONE),
    "a late step of a dead incarnation": (DOWN, step(), DOWN),
    "a late record of an abandoned one": (GONE, ev(E.CATCHUP_STARTED), GONE),
    "a step read after the end": (DONE, step(), DONE),
    "a commit failure does not end a stall": (STALLED, ev(E.COMMIT_FAILURE, step=6, errors=[]), STALLED),
    "the launcher's copy of a commit failure (it has a step)": (
        TRAINING,
        ev(L.COMMIT_FAILURE, replica=0, step=6),
        TRAINING,
    ),
    "a peer unreachable does not end a stall": (STALLED, ev(E.PEER_UNREACHABLE, step=6, peer="10.0.0.2:5"), STALLED),
    "nor does the launcher's copy": (STALLED, ev(L.PEER_UNREACHABLE, replica=0, step=6, peer="10.0.0.2:5"), STALLED),
    "rejoined copies catchup_done": (CATCHING_UP, ev(L.REJOINED, replica=1, at_step=9), CATCHING_UP),
    "a hang fault: the clock will tell": (TRAINING, ev(L.FAULT, kind="hang", replica=1), TRAINING),
    "hang_detected: replica_down follows": (STALLED, ev(L.HANG_DETECTED, replica=1), STALLED),
}


@pytest.mark.parametrize("before,record,after", TRANSITIONS.values(), ids=TRANSITIONS.keys())
def test_next_phase(before, record, after):
    assert next_phase(before, record) is after


SIGNALLED = {
    E.START,
    E.CATCHUP_STARTED,
    E.STALE_STATE,
    E.CATCHUP_DONE,
    L.REPLICA_STARTED,
    L.REPLICA_DOWN,
    L.REPLICA_DONE,
    L.NOT_RESTARTED,
    L.ABANDONED,
}


@pytest.mark.parametrize("phase", list(Phase))
def test_every_other_event_changes_no_phase(phase):
    assert {name for name in (*E, *L) if signal(ev(name)) is not None} == SIGNALLED
    for name in {*E, *L} - SIGNALLED:
        assert next_phase(phase, ev(name, replica=0)) is phase, name


# name: gap, median step, stall?
STALLS = {
    "one step": (0.1, 0.1, False),
    "exactly two median steps": (0.2, 0.1, False),
    "just over two": (0.2001, 0.1, True),
    "a 0.6 s wait in a 0.1 s-step job (the old live rule's + 0.5 s hid it)": (0.6, 0.1, True),
    "1.5 s gaps of a 1 s-step job": (1.5, 1.0, False),
    "no gap measured yet": (60.0, None, False),
    "no median": (60.0, 0.0, False),
}


@pytest.mark.parametrize("gap,median,stall", STALLS.values(), ids=STALLS.keys())
def test_stall_rule(gap, median, stall):
    assert is_stall(gap, median) is stall


def _kill_restart_catchup():
    """Replica 1 of a 20-step job, step time 1 s: a stall (3 s), a death, a catch-up, the end."""
    return [
        ev(L.REPLICA_STARTED, 0.0, replica=1),
        ev(E.START, 2.0),
        ev(E.INIT, 3.0),
        *(step(t, n) for n, t in enumerate((10.0, 11.0, 12.0, 15.0, 16.0), 1)),
        ev(L.REPLICA_DOWN, 16.5, replica=1),
        ev(L.REPLICA_STARTED, 17.0, replica=1),
        ev(E.START, 18.0),
        ev(E.CATCHUP_STARTED, 18.5),
        step(19.0, 12, committed=False, healing=True),
        ev(E.CATCHUP_DONE, 19.5),
        ev(L.REJOINED, 19.6, replica=1),
        step(20.0, 13),
        step(21.0, 14),
        ev(L.REPLICA_DONE, 21.5, replica=1),
    ]


def test_fold():
    assert segments(_kill_restart_catchup(), 1.0, until=22.0, steps=20) == [
        Segment(0.0, 10.0, STARTING),
        Segment(10.0, 12.0, TRAINING),
        Segment(12.0, 15.0, STALLED),
        Segment(15.0, 16.5, TRAINING),
        Segment(16.5, 17.0, DOWN),
        Segment(17.0, 18.5, STARTING),
        Segment(18.5, 20.0, CATCHING_UP),
        Segment(20.0, 21.5, TRAINING),
        Segment(21.5, 22.0, DONE),
    ]
    # no median: no stall; `until` cuts the fold short
    assert segments(_kill_restart_catchup(), None, until=16.0) == [
        Segment(0.0, 10.0, STARTING),
        Segment(10.0, 16.0, TRAINING),
    ]


def test_the_wait_after_the_last_step_is_no_stall():
    """A replica that trained the job's last step serves its peers, then exits: no stall, whatever
    that takes; without the job's step count the same gap is one."""
    records = [ev(L.REPLICA_STARTED, 0.0, replica=0), step(1.0, 1), step(2.0, 2), ev(L.REPLICA_DONE, 9.0, replica=0)]
    assert [g.phase for g in segments(records, 1.0, 10.0, steps=2)] == [STARTING, TRAINING, DONE]
    assert [g.phase for g in segments(records, 1.0, 10.0)] == [STARTING, TRAINING, STALLED, DONE]


def test_the_live_phase_is_the_fold_up_to_now():
    """The clock's transition: what the view shows at `now` is the last segment of the fold to `now`."""
    lifecycle = Lifecycle(steps=20)
    for record in _kill_restart_catchup()[:6]:  # up to the own step at 12.0
        lifecycle.feed(record)
    for now, shown in ((13.9, TRAINING), (14.1, STALLED)):
        assert lifecycle.phase is TRAINING and lifecycle.phase_at(now, 1.0) is shown
        assert lifecycle.segments(1.0, now)[-1].phase is shown


def test_waiting_for_state():
    """Starting, or catching up until the state is installed: the supervisor abandons such a
    replica once its peers have finished (nobody could give it the state)."""
    lifecycle = Lifecycle()
    waiting = []
    for record in _kill_restart_catchup()[8:]:  # from the death on
        lifecycle.feed(record)
        waiting.append((record.get(EVENT) or "step", lifecycle.waiting_for_state))
    assert waiting == [
        ("replica_down", False),
        ("replica_started", True),
        ("start", True),
        ("catchup_started", True),
        ("step", True),
        ("catchup_done", False),
        ("rejoined", False),
        ("step", False),
        ("step", False),
        ("replica_done", False),
    ]


def test_a_replica_that_rejoins_at_the_next_to_last_step_holds_the_state_to_the_end():
    """It installs the state at step n-1 and commits the job's last step n without a batch of its
    own (it relayed zeros in that quorum): a committed relay step applied the update to the
    installed state, so it is not waiting for state when its peers finish (a run where it was
    abandoned for that, its summary digest equal to the peers', made `ftjax launch` exit 1)."""
    lifecycle = Lifecycle(steps=100)
    for record in (
        {TIME: 1.0, EVENT: "start"},
        {TIME: 1.1, EVENT: "catchup_started"},
        {TIME: 1.2, "step": 99, "committed": False, "healing": True},
        {TIME: 1.3, EVENT: "catchup_done"},
        {TIME: 1.4, "step": 100, "committed": True, "healing": True},
    ):
        lifecycle.feed(record)
    assert lifecycle.phase is CATCHING_UP and not lifecycle.waiting_for_state
    lifecycle.feed({TIME: 1.5, "step": 101, "committed": False, "healing": True})  # a discarded relay: not proof
    assert lifecycle.waiting_for_state


# --- one run, folded live and after the fact ------------------------------------------------------
def replay_live(run_dir: Path, tmp_path: Path) -> tuple[Supervisor, list[tuple[float, list[Phase]]]]:
    """The recorded run as the supervisor saw it: every replica's metrics.jsonl grows line by line
    and is tailed every POLL_S (`_read_metrics`, then `_check_replicas`, as in `Supervisor.run`); each
    launcher event about a replica is replayed where the supervisor logs its own (`observe`), after
    it read the replica's newest lines as it does before it logs a death or an end. No process: the
    replicas' exits are the recorded events. Returns the supervisor and the phases it showed at
    each poll."""
    run = load_run(run_dir)
    job = _Job(tmp_path, run.replicas)
    job.cfg.steps = run.steps
    for r in range(run.replicas):
        job.replica_dir(r).mkdir(parents=True)
    supervisor = Supervisor(
        job, FaultPlan(), RunLog(tmp_path / "launcher.jsonl"), hang_timeout_s=math.inf, startup_timeout_s=math.inf
    )
    lines = [(rec[TIME], 0, r, rec) for r in range(run.replicas) for rec in run.metrics[r]]
    events = [(e[TIME], 1, e[REPLICA], e) for e in run.events if e.get(REPLICA) is not None]
    items = sorted(lines + events, key=lambda item: item[:2])
    shown: list[tuple[float, list[Phase]]] = []
    now = items[0][0]

    def poll(t: float) -> None:
        supervisor._read_metrics(t)
        supervisor._check_replicas(t)
        shown.append((t, [s.state for s in supervisor.status]))

    for t, is_event, r, record in items:
        while now + POLL_S <= t:
            now += POLL_S
            poll(now)
        if is_event:
            supervisor._read_metrics(t)
            supervisor.observe(record)
        else:
            with open(job.replica_dir(r) / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
    poll(run.end)
    return supervisor, shown


def _phase_at(segs: list[tuple[float, float, str]], t: float) -> Phase:
    return next(Phase(phase) for a, b, phase in segs if a <= t < b)


RUNS = {
    "recorded: --kill 1@10, restart, catch-up, stall": lambda tmp: RECORDED,
    "synthetic: a kill, a restart, a catch-up, a healthy replica stalls": make_run,
    "synthetic: a frozen replica (SIGSTOP, never killed)": make_frozen_run,
}


@pytest.mark.parametrize("make", RUNS.values(), ids=RUNS.keys())
def test_the_live_view_and_the_summary_fold_a_run_alike(tmp_path, make):
    run_dir = make(tmp_path / "run")
    run = load_run(run_dir)
    median, _ = median_step(run, warm_time(run))
    summary = build_summary(run_dir)
    after = timeline(run, median)  # the summary's segments (build_summary's call)
    supervisor, shown = replay_live(run_dir, tmp_path / "live")

    for r, status in enumerate(supervisor.status):
        live = [(g.start, g.end, g.phase.value) for g in status.lifecycle.segments(median, run.end)]
        assert live == after[r]
        in_phase = {p.value: 0.0 for p in Phase}
        for a, b, phase in live:
            in_phase[phase] += b - a
        assert {k: round(v, 3) for k, v in in_phase.items()} == summary["replicas"][str(r)]["seconds_in_state"]
        # what the view showed at each poll is what the summary says of that moment, but for a
        # stall: the view shows it once the gap is past the threshold (with the median of the
        # moment), the summary calls the whole gap stalled
        for t, phases in shown:
            expected = _phase_at(after[r], t) if t < run.end else Phase(after[r][-1][2])
            assert phases[r] is expected or {phases[r], expected} == {TRAINING, STALLED}, (r, t)
        assert status.state is Phase(after[r][-1][2])
    assert {g[2] for segs in after.values() for g in segs} >= {"starting", "training", "stalled", "done"}
    if make is not make_frozen_run:
        assert {"down", "catching up"} <= {g[2] for segs in after.values() for g in segs}
