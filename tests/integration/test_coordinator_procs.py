"""The real coordinator process and three real replica-leader processes (tests/coord_client_proc.py):
a killed replica leaves the next quorum quickly, a hung one at the heartbeat timeout, and a
coordinator restart loses nothing. Times come from CLOCK_MONOTONIC, shared by all processes."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time

import pytest
from conftest import FTJAX, REPO

from ftjax.base.net import split_address

HERE = os.path.join(REPO, "tests")
HEARTBEAT_TIMEOUT_S = 1.0
SUSPECT_S = 0.3

pytestmark = pytest.mark.timeout(120)


class Replica:
    """A running tests/coord_client_proc.py and the events it printed."""

    def __init__(self, procs, tmp_path, address: str, token_file: str, rid: str) -> None:
        self.rid = rid
        self.commands = str(tmp_path / f"commands-{rid}.json")
        self.proc = procs.python(
            os.path.join(HERE, "coord_client_proc.py"),
            "--address",
            address,
            "--token-file",
            token_file,
            "--replica-id",
            rid,
            "--commands",
            self.commands,
            stdout=subprocess.PIPE,
        )
        self.events: queue.Queue = queue.Queue()
        self.seen: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.incarnation = self.next(lambda e: e["event"] == "start")["incarnation"]

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.events.put(json.loads(line))

    def next(self, predicate, timeout: float = 15.0) -> dict:
        """The next event (in order) that satisfies `predicate`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"{self.rid}: no such event within {timeout} s; last: {self.seen[-3:]}") from None
            self.seen.append(event)
            if event["event"] == "error":
                raise AssertionError(f"{self.rid}: {event['error']}")
            if predicate(event):
                return event

    def command(self, **cmd) -> None:
        tmp = self.commands + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(cmd, f)
        os.replace(tmp, self.commands)


def members(event: dict) -> set[str]:
    return {rid for rid, _ in event["members"]}


def start_coordinator(procs, tmp_path, token_file: str, port: int = 0):
    ready = tmp_path / f"ready-{time.monotonic_ns()}.json"
    proc = procs.start(
        [
            *FTJAX,
            "coordinator",
            "--port",
            str(port),
            "--http-port",
            "0",
            "--min-replicas",
            "2",
            "--join-timeout-s",
            "30",
            "--heartbeat-timeout-s",
            str(HEARTBEAT_TIMEOUT_S),
            "--suspect-window-s",
            str(SUSPECT_S),
            "--token-file",
            token_file,
            "--ready-file",
            str(ready),
        ],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert proc.poll() is None, f"the coordinator exited with {proc.returncode}"
        assert time.monotonic() < deadline, "the coordinator did not start"
        time.sleep(0.02)
    return proc, json.loads(ready.read_text())


@pytest.fixture
def job(procs, tmp_path):
    """A coordinator and replicas a, b, c that have formed a quorum of all three."""
    token_file = str(tmp_path / "token")
    with open(token_file, "w", encoding="utf-8") as f:
        f.write("procs-test-token")
    coordinator, addresses = start_coordinator(procs, tmp_path, token_file)
    replicas = {rid: Replica(procs, tmp_path, addresses["grpc"], token_file, rid) for rid in "abc"}
    full = {rid: r.next(lambda e: e["event"] == "quorum" and members(e) == set("abc")) for rid, r in replicas.items()}
    return dict(
        coordinator=coordinator,
        addresses=addresses,
        replicas=replicas,
        full=full,
        token_file=token_file,
        procs=procs,
        tmp_path=tmp_path,
    )


def first_quorum_without(replica: Replica, gone: str, after: float) -> dict:
    return replica.next(lambda e: e["event"] == "quorum" and e["t"] > after and gone not in members(e))


def test_killed_replica_is_out_of_the_next_quorum_within_half_a_second_of_a_report(job):
    a, b, c = (job["replicas"][r] for r in "abc")
    quorum_id = a.seen[-1]["quorum_id"]
    t_kill = time.monotonic()
    job["procs"].kill(c.proc)
    a.command(op="report", quorum_id=quorum_id, replica_id="c", incarnation=c.incarnation)
    report = a.next(lambda e: e["event"] == "report")
    assert report["dropped"] is True
    for r in (a, b):
        q = first_quorum_without(r, "c", t_kill)
        assert members(q) == {"a", "b"}
        assert q["t"] - report["t_sent"] <= 0.5, f"{r.rid}: {q['t'] - report['t_sent']:.3f} s after the report"
        later = r.next(lambda e: e["event"] == "quorum" and e["t"] > report["t_done"])
        assert "c" not in members(later)


def test_killed_replica_is_out_within_the_heartbeat_timeout_without_a_report(job):
    a, b, c = (job["replicas"][r] for r in "abc")
    t_kill = time.monotonic()
    job["procs"].kill(c.proc)
    for r in (a, b):
        q = first_quorum_without(r, "c", t_kill)
        assert members(q) == {"a", "b"}
        assert q["t"] - t_kill <= HEARTBEAT_TIMEOUT_S + 0.5


def test_hung_replica_is_out_at_the_heartbeat_timeout_and_heals_when_it_wakes_up(job):
    a, _b, c = (job["replicas"][r] for r in "abc")
    t_stop = time.monotonic()
    job["procs"].kill(c.proc, signal.SIGSTOP)  # alive to the kernel (its sockets stay open), silent
    q = first_quorum_without(a, "c", t_stop)
    # a hung process is only noticed by its silence: out one heartbeat timeout after its last
    # heartbeat (sent at most one interval, 0.1 s, before the stop)
    assert HEARTBEAT_TIMEOUT_S - 0.25 <= q["t"] - t_stop <= HEARTBEAT_TIMEOUT_S + 0.5
    job["procs"].kill(c.proc, signal.SIGCONT)
    # (its first quorum after q: an answer it got just before the stop may be printed after the
    # wake-up, a quorum from before it was out, formed with it, that needs no heal)
    back = c.next(lambda e: e["event"] == "quorum" and members(e) == set("abc") and e["quorum_id"] > q["quorum_id"])
    assert back["healing"] is True and back["heal_source"] in ("a", "b")
    # the last step it held before it was out, counting those printed only after the wake-up
    before = max(e["step"] for e in c.seen if e["event"] == "quorum" and e["quorum_id"] < q["quorum_id"])
    assert back["step"] > before and back["asked_step"] <= before + 1, (before, back)


def test_coordinator_restart_mid_run_loses_nothing(job):
    replicas = job["replicas"]
    for r in replicas.values():  # a few steps of steady state
        r.next(lambda e: e["event"] == "quorum" and e["step"] >= 3)
    port = split_address(job["addresses"]["grpc"])[1]
    job["procs"].kill(job["coordinator"])
    job["coordinator"].wait(5)
    t_kill = time.monotonic()
    before = {rid: r.seen[-1] for rid, r in replicas.items()}
    start_coordinator(job["procs"], job["tmp_path"], job["token_file"], port=port)
    t_restart = time.monotonic()
    after = {
        rid: r.next(lambda e: e["event"] == "quorum" and e["t"] > t_kill, timeout=20) for rid, r in replicas.items()
    }
    for rid, q in after.items():
        assert members(q) == set("abc"), q
        assert q["quorum_id"] > before[rid]["quorum_id"]  # ids never repeat across the restart
        assert q["step"] >= before[rid]["step"] and not q["healing"]
        # it waits one heartbeat timeout (to learn who is alive) and the clients' reconnect backoff
        assert q["t"] - t_restart <= HEARTBEAT_TIMEOUT_S + 2.0
    assert len({q["quorum_id"] for q in after.values()}) == 1
    for r in replicas.values():  # and it goes on
        r.next(lambda e: e["event"] == "quorum" and e["step"] >= after["a"]["step"] + 2)


@pytest.mark.timeout(180)
def test_the_benchmark_runs_and_reports_one_json_line():
    # --timeout-s: the benchmark gives up (and kills what it started) before this test would
    result = subprocess.run(
        [*FTJAX, "bench", "coordinator", "--replicas", "20", "--steps", "5", "--step-ms", "20", "--timeout-s", "40"]
        + ["--commit-decision"],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert result.returncode == 0, result.stderr
    line = json.loads(result.stdout.strip().splitlines()[-1])
    assert line["bench"] == "coordinator" and line["replicas"] == 20 and line["steps"] == 3
    assert 0 < line["p50_ms"] <= line["p99_ms"] <= line["max_ms"] < 5000
    assert line["quorum_ids"] == 1  # the same members step after step keep one quorum id
    # the same clients against the bare grpcio server, in the same run
    assert 0 < line["floor_p50_ms"] <= line["floor_p99_ms"] < 5000
    assert line["p99_vs_floor"] == pytest.approx(line["p99_ms"] / line["floor_p99_ms"], rel=0.01)
    # every replica voted yes on every step and every decision was COMMIT (else the bench fails)
    assert 0 < line["commit_p50_ms"] <= line["commit_p99_ms"] < 5000
    assert line["commit_p99_vs_quorum_p99"] == pytest.approx(line["commit_p99_ms"] / line["p99_ms"], rel=0.02)
