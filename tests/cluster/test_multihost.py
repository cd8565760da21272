"""Replicas on different machines: the addresses a process binds and advertises, the platform it
runs on, a replica that cannot reach a peer saying so, and a job across two network namespaces
(two "machines" that share nothing but a network)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
from conftest import FTJAX, REPO, need_namespaces

from ftjax.base import net
from ftjax.base.env import run_env
from ftjax.base.net import split_address
from ftjax.config import ConfigError, load_config
from ftjax.coordinator.quorum import Settings
from ftjax.ftar import FTAREndpoint

TOKEN = "test-token"
TINY = f"{REPO}/configs/tiny.yaml"


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback on this machine")


# --- which address: unit tests --------------------------------------------------------------------
def test_a_coordinator_on_loopback_gives_loopback_and_only_then():
    local = net.choose("127.0.0.1", environ={})
    assert (local.advertise, local.bind) == ("127.0.0.1", "127.0.0.1")
    assert "route to the coordinator 127.0.0.1" in local.why
    here = net.host_address()
    if net.is_loopback(here):
        pytest.skip("this machine has no address but loopback")
    remote = net.choose(here, environ={})  # the coordinator on this machine's own network address
    assert remote.advertise == here and not net.is_loopback(remote.advertise)
    assert remote.bind == net.ALL_INTERFACES  # every interface, not loopback
    assert remote.address(4000) == net.format_address(here, 4000)


def test_environment_beats_config_beats_route():
    env = {net.ADVERTISE_ENV: "10.9.8.7"}
    assert net.choose("127.0.0.1", advertise_host="10.1.1.1", environ=env).advertise == "10.9.8.7"
    chosen = net.choose("127.0.0.1", advertise_host="10.1.1.1", environ={})
    assert (chosen.advertise, chosen.why) == ("10.1.1.1", "net.advertise_host")
    assert chosen.bind == net.ALL_INTERFACES  # it advertises an address others may dial
    assert net.choose("127.0.0.1", interface="lo", environ={}).advertise == "127.0.0.1"
    with pytest.raises(ValueError, match="interface 'nosuch0'"):
        net.choose("127.0.0.1", interface="nosuch0", environ={})
    # the bind host: environment, then config
    assert net.choose("127.0.0.1", bind_host="0.0.0.0", environ={}).bind == "0.0.0.0"
    assert net.choose("127.0.0.1", bind_host="::", environ={}).bind == net.ALL_INTERFACES
    assert net.choose("127.0.0.1", bind_host="10.0.0.1", environ={net.BIND_ENV: "*"}).bind == net.ALL_INTERFACES
    with pytest.raises(ValueError, match="not an address peers can dial"):
        net.choose("127.0.0.1", environ={net.ADVERTISE_ENV: "0.0.0.0"})
    with pytest.raises(OSError, match="nosuchhost.invalid"):
        net.route_source("nosuchhost.invalid")


def test_ipv6_addresses_are_bracketed_and_canonical():
    assert net.format_address("fd00::1", 80) == "[fd00::1]:80"
    assert net.format_address("[fd00::1]", 80) == "[fd00::1]:80"
    assert net.format_address("10.0.0.1", 80) == "10.0.0.1:80"
    assert net.normalize_host("[FD00:0:0::1]") == "fd00::1"
    assert net.normalize_host("::ffff:10.0.0.1") == "10.0.0.1"
    assert split_address(net.format_address("fd00::1", 80)) == ("fd00::1", 80)
    chosen = net.choose("127.0.0.1", advertise_host="FD00::0:5", environ={})
    assert chosen.address(29400) == "[fd00::5]:29400"
    assert net.grpc_bind("", 5) == "[::]:5" and net.grpc_bind("0.0.0.0", 5) == "0.0.0.0:5"
    if _has_ipv6_loopback():
        assert net.route_source("::1") == "::1"
        assert net.choose("[::1]", environ={}).address(7) == "[::1]:7"


def test_net_config_is_checked():
    cfg = load_config(TINY, ["net.advertise_host=10.0.0.5", "net.bind_host=0.0.0.0"])
    assert (cfg.net.advertise_host, cfg.net.bind_host, cfg.net.interface) == ("10.0.0.5", "0.0.0.0", None)
    with pytest.raises(ConfigError, match="net.advertise_host"):
        load_config(TINY, ["net.advertise_host=0.0.0.0"])
    with pytest.raises(ConfigError, match="net.bind_host"):
        load_config(TINY, ["net.bind_host='a b'"])
    with pytest.raises(ConfigError, match="platform"):
        load_config(TINY, ["platform=quantum"])


# --- listeners on every interface, dialled over IPv4 and IPv6 ---------------------------------------
@needs_ipv6
def test_ftar_endpoints_bound_to_every_interface_meet_over_ipv4_and_ipv6():
    """One endpoint advertises its IPv6 loopback address, the other its IPv4 one; both listen on one
    dual-stack socket, so each dials the other in its own family."""
    eps = [
        FTAREndpoint(TOKEN, host="", advertise=adv, timeout_s=10, shared_memory=False) for adv in ("::1", "127.0.0.1")
    ]
    try:
        assert eps[0].address.startswith("[::1]:") and eps[1].address.startswith("127.0.0.1:")
        members = [ep.address for ep in eps]
        bufs = [np.full(1000, i + 1, np.float32) for i in range(2)]
        results, errors = [None, None], [None, None]

        def member(i):
            try:
                results[i] = eps[i].allreduce(bufs[i], quorum_id=1, step=0, members=members, rank=i)
            except Exception as e:
                errors[i] = e

        threads = [threading.Thread(target=member, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert errors == [None, None]
        for r in results:
            np.testing.assert_array_equal(r, np.full(1000, 1.5, np.float32))
    finally:
        for ep in eps:
            ep.close()


@needs_ipv6
def test_coordinator_and_catchup_servers_bound_to_every_interface_answer_over_ipv6(tmp_path):
    from ftjax.coordinator.client import CoordinatorClient
    from ftjax.coordinator.server import CoordinatorServer
    from ftjax.coordinator.types import MemberInfo, new_incarnation
    from ftjax.runtime.catchup import SnapshotServer

    server = CoordinatorServer(Settings(min_replicas=1), TOKEN, host="", advertise="::1", startup_grace=0.0).start()
    client = None
    try:
        assert server.bind_host == "" and server.address.startswith("[::1]:")
        port = split_address(server.address)[1]
        info = MemberInfo("a", new_incarnation(), 1, ("[fd00::1]:20000",), ("[fd00::1]:30000",), "fp")
        for target in (server.address, f"127.0.0.1:{port}"):  # both families reach it
            client = CoordinatorClient(target, TOKEN, info, heartbeat_interval_s=0.05, quorum_timeout_s=10)
            client.start()
            q = client.quorum_async(0, 0, has_state=True).result(10)
            assert q.participants[0].ftar_addresses == ("[fd00::1]:20000",)
            client.close()
            client = None
        http_port = split_address(server.http_address)[1]
        with urllib.request.urlopen(f"http://[::1]:{http_port}/status", timeout=10) as r:
            assert json.load(r)["alive"] == 1
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status", timeout=10) as r:
            assert r.status == 200
    finally:
        if client is not None:
            client.close()
        server.stop()
    snapshots = SnapshotServer(TOKEN, listen=net.Listen("", advertise="::1"))
    try:
        host, port = split_address(snapshots.address)
        assert host == "::1"
        for target in ("::1", "127.0.0.1"):
            with socket.create_connection((target, port), timeout=5) as s:
                s.sendall(b"GET /nowhere HTTP/1.0\r\n\r\n")
                assert s.recv(64).startswith(b"HTTP/1.0 404")
    finally:
        snapshots.close()


def test_the_coordinator_command_binds_every_interface_and_advertises_an_address(tmp_path):
    """`ftjax coordinator` with no --host binds every interface and prints the address it
    advertises: this machine's, not loopback (where the machine has another address)."""
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen(
        [*FTJAX, "coordinator", "--ready-file", str(ready)],
        env={**run_env(), "FTJAX_TOKEN": "t"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "bound to every interface" in line, line
        deadline = time.monotonic() + 10
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        grpc_address = json.loads(ready.read_text())["grpc"]
        host, port = split_address(grpc_address)
        assert host == net.host_address()
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # every interface: loopback too
    finally:
        proc.kill()
        proc.wait(10)


# --- the platform ---------------------------------------------------------------------------------
def test_a_run_is_not_forced_onto_simulated_cpu_devices_nor_one_thread():
    base = {"PATH": "/usr/bin", "HOME": "/root"}
    auto = run_env(base, platform="auto", device_count=4)
    assert "JAX_PLATFORMS" not in auto and "XLA_FLAGS" not in auto
    assert not any(k in auto for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"))
    cpu = run_env(base, platform="cpu", device_count=4)
    assert cpu["JAX_PLATFORMS"] == "cpu"
    assert cpu["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"  # simulated devices, threads as JAX likes
    gpu = run_env({**base, "JAX_PLATFORMS": "cpu"}, platform="gpu")
    assert "JAX_PLATFORMS" not in gpu  # a CPU leftover would hide the GPU asked for
    assert run_env({**base, "JAX_PLATFORMS": "cuda"}, platform="auto")["JAX_PLATFORMS"] == "cuda"


@pytest.mark.timeout(540)
def test_a_platform_that_is_not_there_is_an_error_naming_it(tmp_path):
    env = {k: v for k, v in run_env().items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    r = subprocess.run(
        [*FTJAX, "train", TINY, "--out", str(tmp_path), "platform=tpu", "steps=1"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=REPO,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "platform: tpu" in r.stderr
    r = subprocess.run(
        [*FTJAX, "train", TINY, "--out", str(tmp_path), "platform=auto", "mesh.devices_per_host=2", "steps=1"],
        capture_output=True,
        text=True,
        timeout=240,
        env={**env, "JAX_PLATFORMS": "cpu"},
        cwd=REPO,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "mesh.devices_per_host=2" in r.stderr and "platform: cpu" in r.stderr


def test_emitted_cluster_files_do_not_force_cpu(tmp_path):
    from ftjax.launch.emit import emit

    for kind in ("slurm", "k8s"):
        for path in emit(kind, tmp_path / kind, TINY, ["ft.replicas=2", "mesh.hosts=2"]):
            text = path.read_text()
            assert "JAX_PLATFORMS" not in text and "127.0.0.1" not in text and "0.0.0.0" not in text, path
    assert "status.podIP" in (tmp_path / "k8s" / "replica-0.yaml").read_text()


# --- no silent hang -------------------------------------------------------------------------------
def test_a_peer_failing_every_attempt_is_reported_once_after_ten_seconds():
    from ftjax.runtime.protocol import UnreachablePeers

    u = UnreachablePeers(after_s=10.0)
    # refused at once, attempt after attempt: reported once 10 s have passed since the first began
    assert all(u.failed({"10.0.0.2:5"}, i / 10, i / 10 + 0.01) == [] for i in range(99))  # 0 .. 9.81 s
    [(peer, seconds, attempts)] = u.failed({"10.0.0.2:5"}, 10.0, 10.01)
    assert (peer, attempts) == ("10.0.0.2:5", 100) and seconds == pytest.approx(10.01)
    assert u.failed({"10.0.0.2:5"}, 10.1, 10.11) == []  # once
    # another peer in between starts a new streak; a success ends every streak
    u.succeeded()
    assert u.failed({"10.0.0.2:5"}, 20.0, 30.0) == []  # one attempt, however long, is not a streak
    assert u.failed({"10.0.0.3:5"}, 30.0, 40.0) == []  # another peer: the first one's streak ends
    assert u.failed({"10.0.0.2:5"}, 40.0, 50.0) == []
    # a peer that drops connections: each attempt ends with the FTAR timeout (10 s)
    assert [p for p, _, _ in u.failed({"10.0.0.2:5"}, 50.0, 60.0)] == ["10.0.0.2:5"]  # at 20 s: within 30 s


class _Group:
    rank, hosts = 0, 1

    def broadcast_bytes(self, data):
        return data

    def allgather(self, obj):
        return [obj]


class _Log:
    def __init__(self):
        self.events = []

    def event(self, kind, **fields):
        self.events.append((str(kind), fields))


class _Quorums:
    """A coordinator that keeps answering with this replica and one peer at `peer` (a new quorum id
    each time, as after a commit failure), and takes the reports."""

    def __init__(self, me, peer):
        from ftjax.coordinator.quorum import Participant

        self.known_positions, self.reports, self.qid = {}, [], 0
        self.members = (
            Participant("0", "inc0", 0, 0, (me,), "", False, ""),
            Participant("1", "inc1", 0, 0, (peer,), "", False, ""),
        )

    def quorum_async(self, step, data_position, has_state, commit_failures=0, digest=""):
        from concurrent.futures import Future

        from ftjax.coordinator.types import QuorumResult

        self.qid += 1
        future = Future()
        future.set_result(
            QuorumResult(
                quorum_id=self.qid,
                step=0,
                participants=self.members,
                rank=0,
                healing=False,
                heal_source="",
                heal_source_addresses=(),
                num_contributors=2,
                data_position=0,
                no_state=False,
            )
        )
        return future

    def report_failure(self, quorum_id, replica_id, incarnation, reason=""):
        self.reports.append((replica_id, reason))
        return False  # ALIVE: it heartbeats, so the coordinator keeps it

    def leave(self, reason):
        pass

    def close(self):
        pass


class _FTAR:
    def __init__(self, endpoint):
        self.endpoint = endpoint

    def average(self, q, grads):
        return self.endpoint.allreduce(
            np.zeros(64, np.float32),
            quorum_id=q.quorum_id,
            step=q.step,
            members=[p.ftar_addresses[0] for p in q.participants],
            rank=q.rank,
        )

    def tree(self, update):
        return update

    def close(self):
        self.endpoint.close()


def test_a_replica_given_an_unreachable_peer_address_names_it_within_30_s(tmp_path, capsys):
    """The issue's hang: a peer that heartbeats (so the coordinator keeps it) at an address nobody
    listens on. Every step fails on it; within 30 s the replica names the address, on stderr and
    in its log, with what to check."""
    from ftjax.base.procs import free_port
    from ftjax.runtime.protocol import StepProtocol
    from ftjax.runtime.replay import ReplayBuffer

    dead = f"127.0.0.1:{free_port()}"  # nobody listens there
    endpoint = FTAREndpoint(TOKEN, timeout_s=10, shared_memory=False)
    quorums, log = _Quorums(endpoint.address, dead), _Log()
    protocol = StepProtocol(
        replica_id="0",
        incarnation="inc0",
        group=_Group(),
        reducer=_FTAR(endpoint),
        transport=None,
        quorums=quorums,
        buffer=ReplayBuffer(tmp_path / "replay", 0),
        log=log,
    )
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 30 and not any(kind == "peer_unreachable" for kind, _ in log.events):
            protocol.ask(0, 0, True)
            q = protocol.agree().quorum
            _, error = protocol.average(q, None)
            assert error is not None and error["peer"] == dead, error
            assert not protocol.vote(q, error)
    finally:
        protocol.close()
    took = time.monotonic() - t0
    [(_, fields)] = [(k, f) for k, f in log.events if k == "peer_unreachable"]
    assert took < 30 and fields["peer"] == dead and (fields["replica"], fields["host"]) == ("1", 0)
    err = capsys.readouterr().err
    assert err.count(dead) >= 2 and "replica 1 host 0" in err and "loopback" in err, err
    assert "firewall" in err and "FTJAX_ADVERTISE_HOST" in err and "net.advertise_host" in err
    assert quorums.reports and all(rid == "1" for rid, _ in quorums.reports)  # it accused the right replica


@pytest.mark.parametrize("prefix", ["10.0.0.", "127.0.0."])
def test_the_coordinator_status_says_the_job_makes_no_progress_and_why(prefix):
    """Quorums keep forming at step 1 to retry a step whose FTAR fails, and the accused replica is
    alive: /status says there is no progress, since when, the latest accusation, and which replicas
    advertise loopback addresses (the issue's replicas on two machines did)."""
    from ftjax.coordinator.http import status_page
    from ftjax.coordinator.quorum import MemberReport
    from ftjax.coordinator.state import NO_PROGRESS_S, CoordinatorState

    state = CoordinatorState(Settings(min_replicas=2, heartbeat_timeout_s=2.0), 0.0, startup_grace=0.0)

    def report(rid, step, failures):
        return MemberReport(
            rid,
            f"inc{rid}",
            step=step,
            ftar_addresses=(f"{prefix}{rid}:1",),
            catchup_addresses=(f"{prefix}{rid}:2",),
            topology_fingerprint="fp",
            commit_failures=failures,
        )

    def one_quorum(now, step, failures):
        for rid in "12":
            state.request(report(rid, step, failures), now)
        assert state.evaluate(now).quorum is not None

    one_quorum(0.0, 0, 0)
    one_quorum(1.0, 1, 0)  # progress: step 1
    t = 1.0
    while t < 1.0 + NO_PROGRESS_S - 0.5:  # every attempt at step 2 fails from now on
        t += 0.25
        one_quorum(t, 1, 1)
        accused = state.accuse("2", "inc2", t, reporter="1", reason=f"PeerFailed: peer {prefix}2:1: refused")
        assert accused.verdict == "PENDING"
    assert state.snapshot(t)["no_progress"] is None  # not yet 10 s
    assert not state.summary(t)["stalled"]
    while t < 1.0 + NO_PROGRESS_S + 1:
        t += 0.25
        one_quorum(t, 1, 1)
    snap = state.snapshot(t)
    text = snap["no_progress"]
    assert text and text.startswith("no progress since ") and "at step 1" in text, text
    assert f"{prefix}2:1" in text and "replica '1' accused '2'" in text and "heartbeats" in text, text
    loopback = (
        f"advertising a loopback address (only their own machine reaches it: right only if every replica "
        f"runs there): 1 ({prefix}1:1), 2 ({prefix}2:1)"
    )
    assert (loopback in text) == (prefix == "127.0.0."), text
    assert snap["progress"]["step"] == 1 and snap["progress"]["retries_since"] >= 40
    assert state.summary(t)["stalled"] and "no progress since" in status_page(snap)
    one_quorum(t + 0.25, 2, 0)  # a step goes through
    assert state.snapshot(t + 0.25)["no_progress"] is None


# --- two machines: two network namespaces joined by a bridge ----------------------------------------
# Each "machine" is a host of a virtual cluster (ftjax/launch/vcluster.py): a network namespace with
# its own address (IPv4 and IPv6, on a bridge in a namespace of its own); each process also gets a
# private /dev/shm and temp dir (a mount namespace with its own tmpfs) and its own compilation cache,
# so the machines share nothing but the network. The README's "Replicas on different machines" shows
# the same commands by hand.
MACHINES = ("a", "b")


class Machines:
    """The virtual cluster, and the processes started on it (all killed, the namespaces deleted, by
    `close`, which the fixture runs whatever happens)."""

    def __init__(self, root) -> None:
        from ftjax.launch.vcluster import VirtualCluster

        self.cluster = VirtualCluster(list(MACHINES), ipv6=True)
        self.prefix = self.cluster.prefix
        self.procs: list[subprocess.Popen] = []
        self.root = root

    @property
    def no_ipv6(self) -> str | None:
        return self.cluster.no_ipv6

    def address(self, machine: str, family: str = "ipv4") -> str:
        return self.cluster.address(machine, 4 if family == "ipv4" else 6)

    def create(self) -> None:
        self.cluster.create()
        for m in MACHINES:
            (self.root / m).mkdir(parents=True, exist_ok=True)

    def env(self, machine: str) -> dict[str, str]:
        """A real run's environment: no platform, device or thread setting from the tests."""
        env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
        return {**env, "FTJAX_TOKEN": TOKEN, "JAX_COMPILATION_CACHE_DIR": str(self.root / machine / "xla-cache")}

    def start(self, machine: str, argv: list[str], log_name: str) -> subprocess.Popen:
        """`argv` on `machine` (its network namespace, a private /dev/shm and temp dir); output to a log file."""
        log = open(self.root / machine / log_name, "w")
        proc = subprocess.Popen(
            self.cluster.command(machine, argv),
            env=self.env(machine),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,
        )
        log.close()
        self.procs.append(proc)
        return proc

    def run(self, machine: str, argv: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.cluster.command(machine, argv, private=False),
            env=self.env(machine),
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )

    def close(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.cluster.close()


@pytest.fixture(scope="module")
def machines(tmp_path_factory):
    need_namespaces("the two-machine tests")
    m = Machines(tmp_path_factory.mktemp("machines"))
    try:
        m.create()
        yield m
    finally:
        m.close()
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert m.prefix not in left, left


def test_each_machine_advertises_the_address_of_its_route_to_the_coordinator(machines):
    code = (
        "import sys; from ftjax.base import net; "
        "print(net.choose(sys.argv[1], environ={}).address(1), net.host_address())"
    )
    for family in ("ipv4", "ipv6") if machines.no_ipv6 is None else ("ipv4",):
        coordinator = machines.address("a", family)
        for machine in MACHINES:
            want = net.format_address(machines.address(machine, family), 1)
            r = machines.run(machine, [sys.executable, "-c", code, coordinator])
            assert r.returncode == 0, r.stderr
            address, here = r.stdout.split()
            assert address == want and here == machines.address(machine), (machine, r.stdout)


@pytest.mark.timeout(360)
@pytest.mark.slow
@pytest.mark.parametrize("family", ["ipv4", "ipv6"])
def test_two_replicas_on_two_machines_train_and_end_equal(machines, family):
    """The issue's reproduction: the coordinator and replica 0 on machine a, replica 1 on machine
    b, `ftjax train configs/tiny.yaml ft.replicas=2 steps=30 --coordinator IP:PORT` on each. Both
    train the 30 steps together and end with the same parameters."""
    if family == "ipv6" and machines.no_ipv6 is not None:
        pytest.skip(f"no IPv6 in the namespaces: {machines.no_ipv6}")
    port = 29400 if family == "ipv4" else 29410
    coordinator = net.format_address(machines.address("a", family), port)
    coord = machines.start(
        "a",
        [
            sys.executable,
            "-m",
            "ftjax",
            "coordinator",
            "--port",
            str(port),
            "--http-port",
            str(port + 1),
            "--expected-replicas",
            "2",
        ],
        f"coordinator-{family}.log",
    )
    log = machines.root / "a" / f"coordinator-{family}.log"
    deadline = time.monotonic() + 30
    while "coordinator listening" not in log.read_text():
        assert coord.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    runs = {}
    for r, machine in enumerate(MACHINES):
        runs[machine] = machines.root / machine / f"run-{family}"
        machines.start(
            machine,
            [
                sys.executable,
                "-m",
                "ftjax",
                "train",
                TINY,
                "ft.replicas=2",
                "steps=30",
                "--replica-id",
                str(r),
                "--coordinator",
                coordinator,
                "--out",
                str(runs[machine]),
            ],
            f"replica-{r}-{family}.log",
        )
    codes = [p.wait(300) for p in machines.procs[-2:]]
    logs = {m: (machines.root / m / f"replica-{r}-{family}.log").read_text() for r, m in enumerate(MACHINES)}
    assert codes == [0, 0], {m: text[-3000:] for m, text in logs.items()}
    for machine in MACHINES:
        here = machines.address(machine, family)
        assert f"peers reach this process at {here} (chosen by the route to the coordinator" in logs[machine]
        assert "no progress" not in logs[machine]
        steps = [json.loads(line) for line in (runs[machine] / "metrics.jsonl").read_text().splitlines()]
        committed = [s for s in steps if s.get("committed")]
        assert [s["step"] for s in committed] == list(range(1, 31))
        assert not any(s.get("event") in ("commit_failure", "peer_unreachable") for s in steps)
        assert all(s["participants"] == 2 and s["contributors"] == 2 for s in committed)  # trained together
    digests = [json.loads((runs[m] / "summary.json").read_text())["param_digest"] for m in MACHINES]
    assert digests[0] == digests[1], digests
    status = machines.run(
        "a",
        [
            sys.executable,
            "-c",
            "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())",
            f"http://{net.format_address(machines.address('a'), port + 1)}/status",
        ],
    )
    assert status.returncode == 0, status.stderr
    status = json.loads(status.stdout)
    assert status["no_progress"] is None and status["progress"]["step"] == 30, status["progress"]
    os.killpg(coord.pid, signal.SIGKILL)
