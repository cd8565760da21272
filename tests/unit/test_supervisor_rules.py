"""The supervisor's rules without processes: the hang rule, a pure function, and the supervisor
applying it (and the host-repair rule) to metrics files written the way replicas write them."""

import json
import math
from types import SimpleNamespace

import pytest

from ftjax.launch.fault_plan import FaultPlan, Partition
from ftjax.launch.supervisor import LaunchError, RunLog, Supervisor, is_hung, last_line, refusal, repeats
from ftjax.runs.events import EXIT_NO_PROGRESS
from ftjax.runs.jsonl import read_jsonl

T = 20.0  # --hang-timeout-s of every case


def _steps(first, last, every=1.0):
    """Step times first, first + every, ... up to last (inclusive)."""
    n = round((last - first) / every)
    return [round(first + i * every, 6) for i in range(n + 1)]


# is_hung(now, last, peers' step times, T): the rule alone. Replica silent since `last`.
RULE = {
    "job-wide stall, one peer resumes a poll earlier": (
        130.1,
        100.0,
        [_steps(90, 100) + [130.0], _steps(90, 100)],
        False,
    ),
    "frozen while its peers train on": (130.6, 100.0, [_steps(90, 100) + _steps(110.5, 130.5)], True),
    "any one peer training is enough": (130.6, 100.0, [_steps(90, 100), _steps(90, 100) + _steps(110.5, 130.5)], True),
    "no record yet (the startup timeout's business)": (130.5, None, [_steps(90, 130)], False),
    "silent, but not for the hang timeout yet": (119.5, 100.0, [_steps(90, 119)], False),
    "everyone stalled (the coordinator is away)": (125.0, 100.0, [_steps(90, 100), _steps(90, 100)], False),
    "the peer trained on, then stalled too": (125.5, 100.0, [_steps(90, 115)], False),
    "a peer's single step after a stall": (134.0, 100.0, [_steps(90, 100) + [125.0]], False),
    "a peer's gap of exactly T / 2 breaks its training": (130.5, 100.0, [[120.5, 130.5]], False),
    "no live peer": (130.0, 100.0, [], False),
}


@pytest.mark.parametrize("now,last,peers_steps,hung", RULE.values(), ids=RULE.keys())
def test_hang_rule(now, last, peers_steps, hung):
    assert is_hung(now, last, peers_steps, T) is hung


class _Job:
    """What the supervisor's checks use of a LocalJob, with no process behind it: every replica
    runs (no exit code yet) and a kill does nothing (the log says what the supervisor decided)."""

    def __init__(self, root, replicas):
        self.root, self.replicas = root, replicas
        self.cfg = SimpleNamespace(
            steps=10_000,
            mesh=SimpleNamespace(hosts=1),
            ft=SimpleNamespace(ftar_timeout_s=T / 2, on_host_loss="restart", reduced_min_fraction=0.5),
        )
        self.hosts, self.placement = {}, {}

    def replica_dir(self, r):
        return self.root / f"replica-{r}"

    def replica_exit_codes(self, r):
        return [None]

    def kill_replica(self, r, host=None):
        pass


def _hung_by_supervisor(tmp_path, steps, now, started_s_ago=200.0):
    """The replicas a supervisor declares hung at `now`, given each replica's step times (written to
    its metrics.jsonl) and when its incarnation started."""
    job = _Job(tmp_path, len(steps))
    for r, times in enumerate(steps):
        job.replica_dir(r).mkdir(parents=True)
        (job.replica_dir(r) / "metrics.jsonl").write_text(
            "".join(
                json.dumps(
                    {
                        "time": t,
                        "step": k + 1,
                        "committed": True,
                        "healing": False,
                        "loss": 1.0,
                        "participants": len(steps),
                    }
                )
                + "\n"
                for k, t in enumerate(times)
            )
        )
    events = []
    supervisor = Supervisor(
        job, FaultPlan(), RunLog(tmp_path / "launcher.jsonl", listener=events.append), hang_timeout_s=T
    )
    for s in supervisor.status:
        s.started_at = now - started_s_ago
    supervisor._read_metrics(now)
    supervisor._check_replicas(now)
    return {e["replica"] for e in events if e["event"] == "hang_detected"}


# Every case: the step times of replicas 0, 1 (and 2), the poll time, the replicas declared hung.
CASES = {
    # the whole job stalled 30 s (longer than T) for a quorum; replica 1 logged its first step after
    # it one poll before the others: they are not hung, they resume a moment later
    "job-wide stall, one peer resumes a poll earlier": (
        [_steps(90, 100), _steps(90, 100) + [130.0], _steps(90, 100)],
        130.1,
        set(),
    ),
    # replica 0 froze at 100; replica 1 waited one FTAR timeout (T / 2) for it, then trained on alone
    "frozen while its peer trains on": ([_steps(90, 100), _steps(90, 100) + _steps(110.5, 130.5)], 130.6, {0}),
    # after a job-wide stall the peer has trained for more than T / 2 and replica 0 is still silent
    "still silent long after the job resumed": ([_steps(90, 100), _steps(90, 100) + _steps(130, 141)], 141.5, {0}),
    "everyone stalled (the coordinator is away)": ([_steps(90, 100), _steps(90, 100)], 125.0, set()),
    "silent, but not for the hang timeout yet": ([_steps(90, 100), _steps(90, 119)], 119.5, set()),
    # a peer that logged one step after a stall and nothing since is not training: one step is not enough
    "a peer's single step after a stall": ([_steps(90, 100), _steps(90, 100) + [125.0]], 134.0, set()),
}


@pytest.mark.parametrize("steps,now,hung", CASES.values(), ids=CASES.keys())
def test_supervisor_declares_hung_only_a_replica_silent_while_peers_train(tmp_path, steps, now, hung):
    assert _hung_by_supervisor(tmp_path, steps, now) == hung


def test_a_replica_without_a_record_is_left_to_the_startup_timeout(tmp_path):
    peers_train = _steps(90, 130)
    assert _hung_by_supervisor(tmp_path, [[], peers_train], 130.5, started_s_ago=10.0) == set()
    assert _hung_by_supervisor(tmp_path / "late", [[], peers_train], 130.5, started_s_ago=301.0) == {0}


def test_a_restarted_replicas_row_starts_empty(tmp_path):
    """The view's row of a replica that restarts shows the new incarnation, not the dead one's step,
    loss and quorum size."""
    job = _Job(tmp_path, 2)
    job.start_replica = lambda r, **kw: [SimpleNamespace(pid=1000 + r)]
    job.coordinator_http = None
    for r in range(2):
        job.replica_dir(r).mkdir(parents=True)
        (job.replica_dir(r) / "metrics.jsonl").write_text(
            "".join(
                json.dumps(
                    {
                        "time": 100.0 + k,
                        "step": k + 1,
                        "committed": True,
                        "healing": False,
                        "loss": 2.5,
                        "participants": 2,
                    }
                )
                + "\n"
                for k in range(5)
            )
        )
    supervisor = Supervisor(job, FaultPlan(), RunLog(tmp_path / "launcher.jsonl"), hang_timeout_s=T)
    supervisor._read_metrics(105.0)
    s = supervisor.status[1]
    assert (s.step, s.loss, s.participants) == (5, 2.5, 2)
    supervisor._start(1)
    assert (s.step, s.loss, s.participants, s.incarnation) == (0, None, 0, 1)
    assert supervisor.job_view()["step"] == 5  # the job's step is its other replica's


@pytest.mark.parametrize(
    "hosts, up, min_fraction, live",
    [
        (2, 1, 0.5, 1),  # issue 18's case: a 2-host replica goes on with its surviving host
        (2, 1, 0.75, None),  # below the minimum fraction: it waits to restart whole
        (2, 2, 0.5, None),  # every host up: nothing to reduce
        (4, 3, 0.5, 2),  # 3 hosts up: the largest divisor of 4 they cover (each host serves 2 lanes)
        (4, 1, 0.5, None),  # 1 of 4 is below half
        (4, 1, 0.25, 1),
        (6, 5, 0.5, 3),
        (3, 2, 0.3, 1),  # 2 does not divide 3: one host serves all three lanes
        (1, 0, 0.0, None),  # nothing up
    ],
)
def test_reduced_degree_is_the_largest_divisor_the_surviving_hosts_cover(hosts, up, min_fraction, live):
    from ftjax.launch.supervisor import reduced_degree

    assert reduced_degree(hosts, up, min_fraction) == live


class _Cluster:
    """A virtual cluster's links, as the supervisor sees them: which hosts are cut now."""

    def __init__(self):
        self.down: set[str] = set()

    def cut(self, names):
        self.down |= set(names)

    def restore(self, names):
        self.down -= set(names)


def test_overlapping_partitions_of_a_replica_restore_its_links_when_the_last_window_ends(tmp_path):
    """Issue 26 item 6: `--partition 1@10:10 --partition 1/0@12:10` (both cut r1h0, the first r1h1
    too). Before, the first window's end restored r1h0 although the second still cut it."""
    job = _Job(tmp_path, 2)
    job.cluster = _Cluster()
    job.host_names = lambda r: [f"r{r}h0", f"r{r}h1"]
    job.host_name = lambda r, h: f"r{r}h{h}"
    events = []
    supervisor = Supervisor(
        job, FaultPlan(), RunLog(tmp_path / "launcher.jsonl", listener=events.append), hang_timeout_s=T
    )
    whole, host0 = Partition(1, 10, 10.0), Partition(1, 12, 10.0, 0)
    supervisor._cut(whole, 100.0)
    supervisor._cut(host0, 105.0)
    assert job.cluster.down == {"r1h0", "r1h1"} and supervisor.status[1].cut
    supervisor._restore_links(110.0)  # the first window ends: r1h0 is still in the second
    assert job.cluster.down == {"r1h0"} and supervisor.status[1].cut
    supervisor._restore_links(115.0)
    assert job.cluster.down == set() and not supervisor.status[1].cut
    cuts = [(e["cut"], e["hosts"]) for e in events if e["event"] == "fault"]
    ends = [(e["cut"], e["restored"]) for e in events if e["event"] == "partition_ended"]
    assert cuts == [(1, ["r1h0", "r1h1"]), (2, ["r1h0"])] and ends == [(1, ["r1h1"]), (2, ["r1h0"])]
    # r1h0 was cut for 15 s: the hang rule's grace after the restore counts all of it
    assert supervisor.status[1].quiet_until - supervisor.status[1].reconnected_at == pytest.approx(15.0)


def _step(k: int, healing: bool = False) -> dict:
    return {"time": 100.0 + k, "step": k, "committed": True, "healing": healing, "loss": 2.0, "participants": 2}


def test_a_host_repaired_after_reduced_steps_is_back_once_its_replica_trained_them_whatever_the_clock(tmp_path):
    """--host-repair-steps N: the lost host of a reduced replica is back after the replica committed N
    steps of its own (a healing step is not one), not after some seconds; where no reduced replica
    can run, at once; refused without ft.on_host_loss=reduce."""
    job = _Job(tmp_path, 2)
    job.cfg.mesh.hosts, job.cfg.ft.on_host_loss = 2, "reduce"
    job.start_replica = lambda r, **kw: [SimpleNamespace(pid=1000 + r)]
    job.terminate_replica = lambda r: asked_to_leave.append(r)
    events, asked_to_leave = [], []
    supervisor = Supervisor(
        job, FaultPlan(), RunLog(tmp_path / "launcher.jsonl", listener=events.append), host_repair_steps=2
    )
    s = supervisor.status[1]
    s.hosts_down = {1: math.inf}
    supervisor._plan_restart(s, now=100.0)
    assert (s.restart_at, s.restart_on) == (100.0, [0])  # at once, reduced, on the host that is up
    supervisor._start(1)
    back = lambda: [e for e in events if e["event"] == "host_back"]
    supervisor._consume(1, [_step(40, healing=True), _step(41)], now=1e9)
    supervisor._hosts_back(now=1e9)  # a day later by the clock: still one own step only
    assert s.hosts_down == {1: math.inf} and not back()
    supervisor._consume(1, [_step(42)], now=1e9)
    supervisor._hosts_back(now=1e9)
    assert s.hosts_down == {} and back() == [{**back()[0], "replica": 1, "host": 1}]
    assert asked_to_leave == [1]  # to come back whole at a step boundary

    job.cfg.ft.reduced_min_fraction = 0.75  # 1 of 2 hosts is too few: the replica waits for the host
    s.hosts_down = {1: math.inf}
    supervisor._plan_restart(s, now=200.0)
    assert s.hosts_down == {} and s.restart_at == 200.0 + supervisor.restart_delay_s and len(back()) == 2

    job.cfg.ft.on_host_loss = "restart"
    with pytest.raises(ValueError, match="--host-repair-steps: needs ft.on_host_loss=reduce"):
        Supervisor(job, FaultPlan(), RunLog(tmp_path / "again.jsonl"), host_repair_steps=2)


def test_a_crashed_replica_is_down_with_the_last_line_its_host_wrote(tmp_path):
    """A replica that exits on its own with an error (not a kill the launcher made): the down event,
    and the line the launcher prints, carry the last line of the dead host's log, what it died of
    (a CI log then says why without the run directory)."""
    from ftjax.launch.view import describe

    job = _Job(tmp_path, 2)
    job.cfg.mesh.hosts = 2
    job.hosts = {1: [SimpleNamespace(returncode=0, wait=lambda t: 0), SimpleNamespace(returncode=1, wait=lambda t: 1)]}
    job.placement = {1: [0, 1]}
    job.replica_dir(1).mkdir(parents=True)
    (job.replica_dir(1) / "host-1.log").write_text(
        "--- incarnation 1 host 1\nTraceback ...\nftjax train: error: no quorum within 120 s (last error: none)\n\n"
    )
    job.log_tail = lambda r, host=0: (job.replica_dir(r) / f"host-{host}.log").read_text()
    events = []
    supervisor = Supervisor(job, FaultPlan(), RunLog(tmp_path / "launcher.jsonl", listener=events.append))
    supervisor.tails[1].read = list  # (nothing more in its metrics)
    supervisor._down(1, now=100.0)
    (down,) = [e for e in events if e["event"] == "replica_down"]
    assert down["cause"] == "crash (host 1 exit 1)" and down["host"] == 1
    assert down["error"] == "ftjax train: error: no quorum within 120 s (last error: none)"
    assert describe(down).endswith("(last step 0): ftjax train: error: no quorum within 120 s (last error: none)")
    assert last_line("x" * 400, limit=300) == "x" * 297 + "..." and last_line("\n \n") is None


def test_a_crash_is_told_by_its_last_line_past_jaxs_note_on_filtered_frames():
    from ftjax.launch.supervisor import last_line

    tail = (
        "Traceback (most recent call last):\n  ...\nTypeError: grad requires real-valued inputs, got int32\n"
        "--------------------\nFor simplicity, JAX has removed its internal frames from the traceback of the "
        "following exception. Set JAX_TRACEBACK_FILTERING=off to include these.\n"
    )
    assert last_line(tail) == "TypeError: grad requires real-valued inputs, got int32"
    assert last_line("ok\n\n") == "ok" and last_line("") is None


# The restart rule for refusals: (the previous incarnation's refusal, this one's, stop restarting?)
REFUSALS = {
    "the same deterministic refusal twice": ("ftjax train: error: bad task", "ftjax train: error: bad task", True),
    "a first refusal": (None, "ftjax train: error: bad task", False),
    "another reason than the last": ("ftjax train: error: bad task", "ftjax train: error: token files", False),
    "not refused (a crash, a kill)": ("ftjax train: error: bad task", None, False),
    "the id still held by a predecessor may pass": (
        "ftjax train: the coordinator refused replica 1 (ALREADY_EXISTS): held",
        "ftjax train: the coordinator refused replica 1 (ALREADY_EXISTS): held",
        False,
    ),
}


@pytest.mark.parametrize("previous,reason,stop", REFUSALS.values(), ids=REFUSALS.keys())
def test_refusal_rule(previous, reason, stop):
    assert repeats(previous, reason) is stop


def test_a_refusal_is_an_exit_2_and_its_reason_the_last_line():
    assert refusal("refused (host 0 exit 2)", "ftjax train: error: x") == "ftjax train: error: x"
    assert refusal("refused (host 0 exit 2)", None) == "refused (host 0 exit 2) with no reason written"
    assert refusal("crash (host 0 exit 1)", "Traceback") is None
    assert refusal("watchdog (host 0 exit 75)", "no progress") is None


def _ended(tmp_path, code, last_words, times=1):
    """The supervisor's replica_down events after replica 0's process exits `code` `times` times in a
    row, its host log ending with `last_words` (a LaunchError is raised through)."""
    job = _Job(tmp_path, 2)
    job.hosts = {0: [SimpleNamespace(returncode=code, wait=lambda t: code)]}
    job.placement = {0: [0]}
    job.replica_dir(0).mkdir(parents=True)
    (job.replica_dir(0) / "host-0.log").write_text(f"--- incarnation 1 host 0\n{last_words}\n")
    job.log_tail = lambda r, host=0: (job.replica_dir(r) / f"host-{host}.log").read_text()
    events = []
    supervisor = Supervisor(job, FaultPlan(), RunLog(tmp_path / "launcher.jsonl", listener=events.append))
    supervisor.tails[0].read = list
    for _ in range(times):
        supervisor._down(0, now=100.0)
    return [e for e in events if e["event"] == "replica_down"]


def test_a_replica_refused_twice_for_the_same_reason_is_not_restarted(tmp_path):
    why = "ftjax train: error: token files do not match their index"
    (first,) = _ended(tmp_path / "once", 2, why)
    assert first["cause"] == "refused (host 0 exit 2)" and first["error"] == why
    with pytest.raises(LaunchError, match="refused twice in a row for the same reason.*" + why):
        _ended(tmp_path / "twice", 2, why, times=2)
    held = "ftjax train: the coordinator refused replica 0 (ALREADY_EXISTS): replica id '0' is held"
    assert len(_ended(tmp_path / "held", 2, held, times=3)) == 3  # (counted against --max-restarts instead)


def test_a_watchdog_exit_is_labelled_the_watchdog_not_a_crash(tmp_path):
    (down,) = _ended(tmp_path, EXIT_NO_PROGRESS, "ftjax train: replica 0 host 0: no progress for 30.0 s")
    assert down["cause"] == f"watchdog (host 0 exit {EXIT_NO_PROGRESS})"
    assert down["error"] == "ftjax train: replica 0 host 0: no progress for 30.0 s"


def test_the_run_log_survives_a_full_disk_and_is_whole_once_written_again(tmp_path, monkeypatch, capsys):
    """Writes of launcher.jsonl fail with ENOSPC: no exception reaches the supervisor, the listener
    still hears every event, one line names the file, and closing writes the log again whole."""
    import errno
    import os

    import ftjax.launch.supervisor as supervisor_module

    heard = []
    log = RunLog(tmp_path / "launcher.jsonl", listener=heard.append)
    log.event("launch", replicas=2)

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as m:
        m.setattr(supervisor_module.os, "write", full)
        for r in range(3):
            log.event("replica_down", replica=r)
    assert [e["event"] for e in heard] == ["launch", *["replica_down"] * 3]
    lines = capsys.readouterr().err.splitlines()
    path = tmp_path / "launcher.jsonl"
    assert lines == [f"ftjax launch: cannot write {path} (No space left on device); supervising on"]
    assert len(read_jsonl(tmp_path / "launcher.jsonl")) == 1  # the lost lines ...
    log.event("end", ok=True)
    log.close()
    assert read_jsonl(tmp_path / "launcher.jsonl") == heard  # ... are back, once the disk has room


def test_a_host_log_that_cannot_be_written_does_not_stop_the_replicas_start(tmp_path, capsys):
    """The launcher's header line of a host log hits a full disk (/dev/full: every write fails with
    ENOSPC): one line names the log, and the host's process is started all the same."""
    import sys

    from conftest import REPO

    from ftjax.base.procs import ProcessGroup
    from ftjax.launch.job import LocalJob

    with ProcessGroup() as procs:
        sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
        job = LocalJob(f"{REPO}/configs/tiny.yaml", [], tmp_path, replicas=1, procs=procs, entry=sleeper)
        job.coordinator_address = "127.0.0.1:1"  # (never dialled: the entry only sleeps)
        job.replica_dir(0).mkdir(parents=True)
        (job.replica_dir(0) / "host-0.log").symlink_to("/dev/full")
        (proc,) = job.start_replica(0)
        assert proc.poll() is None
        path = job.replica_dir(0) / "host-0.log"
        assert (
            capsys.readouterr().err
            == f"ftjax launch: cannot write {path} (No space left on device); starting it anyway\n"
        )


def test_a_crash_loop_ends_the_run_naming_the_last_crash(tmp_path):
    """A replica that crashes every time (not a refusal: exit 1) is restarted up to --max-restarts
    (10), then the run fails with how it last died."""
    why = "RuntimeError: the device is gone"
    assert len(_ended(tmp_path / "ten", 1, why, times=10)) == 10
    with pytest.raises(
        LaunchError, match=r"failed 11 times \(--max-restarts 10\); last: crash \(host 0 exit 1\): " + why
    ):
        _ended(tmp_path / "eleven", 1, why, times=11)
