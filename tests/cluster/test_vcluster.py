"""The virtual cluster (issue 14): `ftjax launch --virtual-cluster` runs the coordinator and every host
of every replica on a host of its own (network namespace, mount namespace), and injects network
faults: partitions (`--partition`) and bandwidth caps (`--bandwidth-mbit`). `ftjax bench ftar
--virtual-cluster` measures FTAR between two such hosts against raw TCP between them.

Every test here needs network namespaces (Linux, root): skipped where the machine cannot make them,
a failure when $CI is true."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import FTJAX, REPO, need_namespaces
from launchrun import TINY

from ftjax.launch.fault_plan import BandwidthCap, FaultPlan, Partition, parse_bandwidth, parse_partition
from ftjax.runs.summary import load_run, median_step, warm_time


@pytest.fixture
def namespaces():
    need_namespaces("the virtual-cluster tests")


def _netns_of(pid: int) -> list[str]:
    """The namespaces a virtual cluster made by process `pid` left behind."""
    from ftjax.launch.vcluster import PREFIX, namespaces

    return [ns for ns in namespaces() if ns.startswith(f"{PREFIX}{pid}-")]


# --- options ---------------------------------------------------------------------------------------
def test_partition_and_bandwidth_options_are_parsed_and_checked():
    assert parse_partition("1@30:10") == Partition(1, 30, 10.0, None)
    assert parse_partition("1/0@30:2.5") == Partition(1, 30, 2.5, 0)
    assert parse_bandwidth("all=100") == BandwidthCap(100.0)
    assert parse_bandwidth("1=50") == BandwidthCap(50.0, 1, None)
    assert parse_bandwidth("0/1=0.5") == BandwidthCap(0.5, 0, 1)
    for bad in ("1@30", "x@30:10", "1@0:10", "1@30:0", "1@30:nan", "1/x@30:10", "1@30:-1", "@30:10"):
        with pytest.raises(ValueError, match="--partition"):
            parse_partition(bad)
    for bad in ("all", "1=0", "1=-3", "x=10", "1/=10", "all=inf"):
        with pytest.raises(ValueError, match="--bandwidth-mbit"):
            parse_bandwidth(bad)
    with pytest.raises(ValueError, match="--partition: replica 2 is not in"):
        FaultPlan(partitions=(Partition(2, 3, 1.0),)).validate(2, 1, 10)
    with pytest.raises(ValueError, match="--partition: host 1 is not in"):
        FaultPlan(partitions=(Partition(1, 3, 1.0, 1),)).validate(2, 1, 10)
    with pytest.raises(ValueError, match=r"--partition: step 11 is not in \[1, steps=10\]"):
        FaultPlan(partitions=(Partition(1, 11, 1.0),)).validate(2, 1, 10)
    with pytest.raises(ValueError, match="--bandwidth-mbit: host 2 is not in"):
        FaultPlan(bandwidth=(BandwidthCap(10.0, 0, 2),)).validate(2, 2, 10)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--partition", "1@3:1"], "--partition: needs --virtual-cluster"),
        (["--bandwidth-mbit", "all=10"], "--bandwidth-mbit: needs --virtual-cluster"),
        (["--virtual-cluster", "--partition", "2@3:1"], "--partition: replica 2 is not in [0, 2)"),
        (["--virtual-cluster", "--emit", "slurm", "x"], "--virtual-cluster: runs the job on this machine"),
    ],
)
def test_launch_refuses_bad_network_fault_options_naming_the_flag(tmp_path, args, message):
    r = subprocess.run(
        [*FTJAX, "launch", TINY, "--replicas", "2", "--out", str(tmp_path / "run"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()


# --- the namespaces themselves ----------------------------------------------------------------------
_PROBE = """
import os, socket, struct, sys, tempfile
name = socket.gethostname()
print(name, socket.gethostbyname(name), sorted(os.listdir("/dev/shm")), tempfile.gettempdir(), flush=True)
open("/dev/shm/ftjax-probe", "w").close()
if sys.argv[1] == "serve":  # each message: 8 bytes of length, then that many bytes; answered b"k"
    conn, _ = socket.create_server((sys.argv[2], 5000)).accept()
    while header := conn.recv(8, socket.MSG_WAITALL):
        left = struct.unpack("!Q", header)[0]
        while left:
            left -= len(conn.recv(min(left, 1 << 20)))
        conn.sendall(b"k")
else:
    conn = socket.create_connection((sys.argv[2], 5000), timeout=30)
    for line in sys.stdin:
        conn.sendall(struct.pack("!Q", int(line)) + b"x" * int(line))
        assert conn.recv(1) == b"k"
        print("echo", flush=True)
"""


def test_hosts_share_nothing_but_the_network_and_links_can_be_cut_and_capped(namespaces):
    """Two hosts: each has its own hostname (resolving to its address), an empty /dev/shm and temp
    dir of its own; a cut link silences the connection between them without breaking it, a restore
    lets it go on; a cap of 80 Mbit/s holds; close() deletes every namespace."""
    from ftjax.launch.vcluster import VirtualCluster

    cluster = VirtualCluster(["a", "b"]).create()
    procs = []
    try:
        a, b = cluster.address("a"), cluster.address("b")
        assert a != b and a.startswith("10.") and not (a.startswith("127.") or b.startswith("127."))
        server = subprocess.Popen(
            cluster.command("b", [sys.executable, "-c", _PROBE, "serve", b]),
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        procs.append(server)
        name, address, shm, tmp = server.stdout.readline().split(" ", 3)
        assert (name, address, shm) == ("b", b, "[]") and tmp.strip() == str(cluster.host("b").tmp)
        time.sleep(0.3)
        client = subprocess.Popen(
            cluster.command("a", [sys.executable, "-c", _PROBE, "dial", b]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        procs.append(client)
        assert client.stdout.readline().split(" ")[:3] == ["a", a, "[]"]  # b's /dev/shm file is not here

        def echo(nbytes: int) -> float:
            t0 = time.monotonic()
            client.stdin.write(f"{nbytes}\n")
            client.stdin.flush()
            assert client.stdout.readline().strip() == "echo"
            return time.monotonic() - t0

        echo(1000)
        cluster.cut(["b"])
        assert cluster.is_cut("b") and not cluster.is_cut("a")
        t0 = time.monotonic()
        client.stdin.write("1000\n")
        client.stdin.flush()
        time.sleep(2.0)
        cluster.restore(["b"])
        assert client.stdout.readline().strip() == "echo"  # the same connection, after the cut
        assert time.monotonic() - t0 >= 2.0
        assert not os.path.exists("/dev/shm/ftjax-probe")  # nor on this machine
        cluster.limit(["a"], 80)
        seconds = echo(4 << 20)  # 4 MiB = 33.5 Mbit: >= 0.42 s at 80 Mbit/s
        assert seconds > 0.8 * (4 << 20) * 8 / 80e6, seconds
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
        cluster.close()
    assert not [ns for ns in _netns_of(os.getpid()) if ns.startswith(cluster.prefix)]


def test_namespaces_of_a_dead_creator_are_removed(namespaces):
    from ftjax.launch.vcluster import PREFIX, remove_stale
    from ftjax.launch.vcluster import namespaces as all_namespaces

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{PREFIX}{dead.pid}-1-x"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert stale in remove_stale()
        assert stale not in all_namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)


# --- ftjax launch --virtual-cluster ------------------------------------------------------------------
def _check_no_leftovers(run) -> None:
    assert run.leftovers() == []
    assert _netns_of(run.proc.pid) == []  # the launcher deleted every namespace it made


def _events(run, name, **match):
    return [e for e in run.events() if e["event"] == name and all(e.get(k) == v for k, v in match.items())]


@pytest.mark.timeout(600)
@pytest.mark.slow
@pytest.mark.parametrize("hosts", [1, 2])
def test_one_host_of_a_replica_killed_at_step_30_on_a_virtual_cluster(launch, namespaces, hosts):
    """Issue 14: 2 replicas x H hosts, 70 steps, one host of replica 1 killed at step 30 and its
    replica restarted: digests equal, every batch exactly once, the healthy replica never waits for
    its peers more than 1.5 x its median step + 0.5 s in a step. Every process on a host of its own."""
    run = launch(
        "--virtual-cluster",
        "--replicas",
        "2",
        "--hosts-per-replica",
        str(hosts),
        "--kill-host",
        f"1@30:{hosts - 1}",
        "steps=70",
    )
    code = run.wait(timeout=500)
    s = run.summary()
    launched = _events(run, "launch")[0]
    addresses = {name: h["address"] for name, h in launched["virtual_cluster"].items()}
    assert len(set(addresses.values())) == 1 + 2 * hosts  # the coordinator's host and one per replica host
    coordinator = _events(run, "coordinator_started")[0]["grpc"]
    assert coordinator.startswith(addresses["coord"] + ":")
    for r in (0, 1):  # each process advertises its own host's address, chosen by its route
        for h in range(hosts):
            log = (run.run_dir / f"replica-{r}" / f"host-{h}.log").read_text()
            assert f"peers reach this process at {addresses[f'r{r}h{h}']} (chosen by the route" in log, log[-2000:]
    assert [(e["replica"], e["cause"], e["at"]) for e in s["failure_events"]] == [(1, "kill_host", "30:forward")]
    assert s["replicas"]["1"]["restarts"] == 1 and s["replicas"]["0"]["restarts"] == 0
    _check_no_leftovers(run)
    assert code == 0 and s["digests_equal"] and s["exactly_once"], run.output()
    waited = run.waited(0)
    assert max(w for _, w in waited) <= 1.5 * s["median_step_s"] + 0.5, (waited, s)
    # the launcher's view reads the coordinator's status page inside the cluster's network
    out = (run.run_dir.parent / f"{run.run_dir.name}.out").read_text()
    assert "coordinator not answering" not in out and "contributing" in out, out[-3000:]


@pytest.mark.timeout(660)
@pytest.mark.slow
def test_a_replica_that_loses_a_host_trains_on_at_reduced_degree_then_returns_whole(launch, namespaces):
    """Issue 18: 2 replicas x 2 hosts, constant global batch, `ft.on_host_loss: reduce`. Host 1 of
    replica 1 is killed at step 30, back once replica 1 trained 10 steps without it: replica 1 goes
    on as a 1-host replica within seconds (its surviving host serves both gradient lanes and
    computes a quarter of the step's rows); replica 0 never stalls more than 1.5 x its median step
    + 0.5 s (a stall: a gap less the rows it computed for replica 1, see ftjax/runs/summary.py); the
    host returns, replica 1 leaves at a step boundary and comes back with 2 hosts; both end bitwise
    equal, every row of every step exactly once."""
    run = launch(
        "--virtual-cluster",
        "--replicas",
        "2",
        "--hosts-per-replica",
        "2",
        "--kill-host",
        "1@30:1",
        "--host-repair-steps",  # not seconds: on a loaded machine the reduced replica's start took
        "10",  # longer than a 20 s repair, and it never trained reduced
        "ft.global_batch=constant",
        "ft.on_host_loss=reduce",
        # Past the whole incarnation's rejoin, steps only add time: it rejoined at step 105 of 340
        # (quiet machine, warm cache: 56 s into the run), at 135 of 200 with both cores busy; one
        # after the last step (served while replica 0 drains) is checked too (below).
        "steps=160",
    )
    code = run.wait(timeout=600)
    s = run.summary()
    assert code == 0 and s["digests_equal"] and s["exactly_once"], run.output()
    (down,) = _events(run, "replica_down", replica=1, cause="kill_host")
    (reduced,) = _events(run, "replica_started", replica=1, reduced=True)
    assert reduced["hosts"] == [0] and len(reduced["pids"]) == 1
    assert reduced["time"] - down["time"] < 5.0  # at once on the surviving host: no wait for the repair
    rejoins = _events(run, "rejoined", replica=1)
    assert len(rejoins) == 2, rejoins  # reduced, then whole
    assert rejoins[0]["time"] - down["time"] < 60.0  # start + compile + catch-up on a busy 2-core machine
    # the reduced incarnation trained: its steps computed a quarter of the rows (1 of 4 devices)
    reduced_steps = [
        m
        for m in run.metrics(1)
        if m.get("committed")
        and m.get("work")
        and m["time"] > rejoins[0]["time"]
        and m["time"] < _events(run, "host_back")[0]["time"]
    ]
    assert reduced_steps, "the reduced replica committed no step of its own"
    for m in reduced_steps:
        mine = sum(b - a for who, _, a, b in m["work"] if who == 1)
        assert mine in (0, 4), m["work"]  # 4 of the step's 16 rows (0: a step it healed into)
    assert any(sum(b - a for who, _, a, b in m["work"] if who == 1) == 4 for m in reduced_steps)
    # back at full degree: a 2-host incarnation, started after the reduced one left, rejoins and
    # ends with the job's state (digests equal, above). Whether it trains steps of its own before the
    # job ends is a race between its start (two processes compiling: 50-110 s on a busy 2-core
    # machine) and replica 0's remaining steps, so what it trains is checked, not that it trains:
    # every row count at full degree (8 of 16), and the job's last step once it trains.
    (left,) = _events(run, "replica_down", replica=1, cause="left")
    assert left["codes"] == [76]  # EXIT_LEFT: it left at a step boundary when asked
    whole = _events(run, "replica_started", replica=1, reduced=False)[-1]
    assert whole["hosts"] == [0, 1] and whole["time"] >= left["time"] and rejoins[1]["time"] > whole["time"]
    trained = [m for m in run.metrics(1) if m.get("committed") and m.get("work") and m["time"] > rejoins[1]["time"]]
    rows = [sum(b - a for who, _, a, b in m["work"] if who == 1) for m in trained]
    assert all(n in (0, 8) for n in rows), rows  # (0: a step it healed into)
    # Rejoined at step k, it joins the first quorum formed after that; the one of step k + 1 may
    # already have formed without it (rejoined at 159 of 160 with two more tests beside it: it
    # trained nothing). Back well before the end, it trains on to the job's last step.
    if trained:
        assert trained[-1]["step"] == 160 and rows[-1] == 8, (rejoins[1], rows)
    assert trained or rejoins[1]["at_step"] > 150, (rejoins[1], rows)
    assert s["replicas"]["0"]["restarts"] == 0
    # replica 0's stalls while replica 1 goes reduced and trains reduced, to the host's return. (The
    # whole incarnation's join afterwards is a restart's join, issue 14's test; on a 2-core machine
    # its catch-up competes with replica 0 for cores and can exceed the bound: docs/design/index.md.)
    median, gaps = median_step(load_run(run.run_dir), warm_time(load_run(run.run_dir)))
    back = _events(run, "host_back")[0]["time"]
    during = [(t, stall) for t, _, stall in gaps if down["time"] <= t <= back]
    # The window holds the 10 steps replica 1 trained reduced (--host-repair-steps), each one replica 0
    # committed too; how many more (the reduced start and catch-up) is the machine's speed: CI's had 19.
    # Replica 0's records of the last one or two may land after the launcher logs the host's return.
    assert len(during) >= 10 - 2 and round(median, 4) == s["median_step_s"]
    waited = run.waited(0, since=down["time"], until=back)
    assert len(waited) == len(during) and max(w for _, w in waited) <= 1.5 * median + 0.5, (waited, s)
    _check_no_leftovers(run)


@pytest.mark.timeout(480)
@pytest.mark.slow
@pytest.mark.parametrize("decision", ["ring", "coordinator"])
def test_a_partitioned_replica_commits_nothing_then_rejoins(launch, namespaces, decision):
    """Issue 14: replica 1's links cut for 10 s at step 30, then restored: replica 0 trains on, replica
    1 commits nothing while cut off (no split brain: every step both committed has one digest), then
    rejoins and catches up; digests equal, exactly once. FTAR's timeout is 2 s, so that replica 0
    trains on within seconds whatever the cut interrupts (with the default 10 s it may wait out the
    whole cut in the FTAR it was in). With ft.commit_decision coordinator every step either replica
    committed was decided by the coordinator (each record's decision_s), the cut-off side included."""
    run = launch(
        "--virtual-cluster",
        "--replicas",
        "2",
        "--partition",
        "1@30:10",
        "steps=200",
        "ft.ftar_timeout_s=2",
        "ft.progress_timeout_s=5",
        f"ft.commit_decision={decision}",
    )
    code = run.wait(timeout=400)
    s = run.summary()
    (cut,) = _events(run, "fault", kind="partition")
    (ended,) = _events(run, "partition_ended", replica=1)
    assert cut["replica"] == 1 and cut["step"] >= 30 and cut["hosts"] == ["r1h0"]
    assert 10.0 <= ended["time"] - cut["time"] < 11.0
    (p,) = s["partitions"]
    assert p["restored"] and p["isolated_commits"] == [], p  # the cut-off side committed nothing
    assert p["peer_commits"]["0"] >= 10, p  # the other side trained on
    assert p["rejoined_at_step"] is not None, p  # replica 1 caught up after the restore
    assert [e["replica"] for e in s["rejoins"]] == [1]
    assert s["replicas"]["0"]["restarts"] == 0
    digests = [
        {m["step"]: m["param_digest"] for m in run.metrics(r) if m.get("committed") and "param_digest" in m}
        for r in (0, 1)
    ]
    both = set(digests[0]) & set(digests[1])
    assert len(both) >= 30 and all(digests[0][n] == digests[1][n] for n in both)  # no split brain
    if decision == "coordinator":
        assert all("decision_s" in m for r in (0, 1) for m in run.metrics(r) if m.get("committed"))
    _check_no_leftovers(run)
    assert code == 0 and s["digests_equal"] and s["exactly_once"], run.output()


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_with_default_settings_a_cut_non_leader_host_stalls_the_healthy_replica_at_most_15_s(launch, namespaces):
    """Issue 26 item 5: 2 replicas x 2 hosts, every timeout at its default, host 1 of replica 1 cut off
    for 15 s. Its leader heartbeats on, so the coordinator keeps replica 1 while every attempt at the
    step fails on it. Before, the healthy replica stalled 38.3 s: nobody left within the cut (the
    progress deadline was 30 s), and its first retry after the cut failed on a stale FTAR frame
    (`quorum_id is 1, expected 2`). Now replica 1's leader leaves within ft.progress_timeout_s and
    is restarted; the healthy replica waits at most 15 s and is never restarted."""
    run = launch(
        "--virtual-cluster", "--replicas", "2", "--hosts-per-replica", "2", "--partition", "1/1@20:15", "steps=60"
    )
    code = run.wait(timeout=500)
    s = run.summary()
    (cut,) = _events(run, "fault", kind="partition")
    assert cut["hosts"] == ["r1h1"]
    assert s["replicas"]["0"]["restarts"] == 0 and not _events(run, "replica_down", replica=0)
    times = [m["time"] for m in run.metrics(0) if "event" not in m and m.get("committed")]
    gap = max(b - a for a, b in zip(times, times[1:]))
    assert gap <= 15.0, f"replica 0: largest gap {gap:.2f} s"
    _check_no_leftovers(run)
    assert code == 0 and s["digests_equal"] and s["exactly_once"], run.output()


@pytest.mark.slow
def test_sigterm_stops_every_process_and_deletes_every_namespace(launch, namespaces):
    run = launch("--virtual-cluster", "--replicas", "2", "steps=100000")
    run.wait_for(lambda e: e["event"] == "replica_started" and e["replica"] == 1, timeout=60)
    assert len(_netns_of(run.proc.pid)) == 4  # the bridge's, the coordinator's, one per replica
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(timeout=120) == 128 + signal.SIGTERM, run.output()
    _check_no_leftovers(run)


# --- ftjax bench ftar --virtual-cluster ----------------------------------------------------------------
def _bench(*args: str) -> dict:
    proc = subprocess.Popen(
        [*FTJAX, "bench", "ftar", "--virtual-cluster", "--world", "2", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    assert _netns_of(proc.pid) == []  # the bench deleted the namespaces it made
    return json.loads(lines[0])


@pytest.mark.slow
def test_bench_ftar_between_two_virtual_hosts_reports_busbw_against_raw_tcp(namespaces):
    # two connections per link and a bfloat16 wire too: between hosts the links are TCP, so the
    # streams are real connections here (on one host the links go through shared memory)
    rec = _bench("--mib", "8", "--rounds", "2", "--iters", "2", "--streams", "1,2", "--wire-dtypes", "float32,bfloat16")
    assert rec["virtual_cluster"] is True and rec["world"] == 2
    assert rec["busbw_gbps"] > 0 and rec["link_gbps"] > 0
    assert rec["ratio"] == pytest.approx(rec["busbw_gbps"] / rec["link_gbps"], rel=0.01)
    assert rec["shm_links"] == 0  # two hosts: the shared-memory offer is declined, the links are TCP
    assert [(r["streams"], r["wire_dtype"]) for r in rec["settings"]] == [
        (1, "float32"), (1, "bfloat16"), (2, "float32"), (2, "bfloat16"),
    ]  # fmt: skip
    for r in rec["settings"]:
        assert r["ratio"] == pytest.approx(r["busbw_gbps"] / r["link_gbps"], rel=0.01)
    capped = _bench("--mib", "2", "--rounds", "1", "--iters", "1", "--bandwidth-mbit", "100")
    assert capped["link_gbps"] < 1.2 * 100e6 / 8 / 1e9 and capped["busbw_gbps"] < 1.2 * 100e6 / 8 / 1e9, capped
