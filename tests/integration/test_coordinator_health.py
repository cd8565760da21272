"""The coordinator on a cluster: the standard gRPC health service for probes (no token needed, and
nothing else opened by it), and its own end once the job is over (`--final-step`, `--idle-exit-s`)."""

import json
import subprocess
import time

import grpc
import pytest
from conftest import FTJAX
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ftjax.base.procs import free_port
from ftjax.coordinator import coordinator_pb2 as pb
from ftjax.coordinator.client import CoordinatorClient
from ftjax.coordinator.lifetime import EXIT_DONE, EXIT_IDLE, JobEnd
from ftjax.coordinator.quorum import Settings
from ftjax.coordinator.server import CoordinatorServer
from ftjax.coordinator.service import SERVICE
from ftjax.coordinator.types import MemberInfo, new_incarnation

TOKEN = "health-test-token"
SERVING = health_pb2.HealthCheckResponse.SERVING


def _member(rid: str) -> MemberInfo:
    return MemberInfo(rid, new_incarnation(), 1, ("127.0.0.1:20001",), ("127.0.0.1:30001",), "fp")


def test_health_service_answers_serving_without_the_token_and_nothing_else_opens():
    with (
        CoordinatorServer(Settings(), TOKEN, startup_grace=0.0) as server,
        grpc.insecure_channel(server.address) as channel,
    ):
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE):  # the server as a whole, and the coordinator's own service
            assert stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == SERVING
        with pytest.raises(grpc.RpcError) as e:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        # Watch streams the status (what grpc_health_probe and some meshes use)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert next(watch).status == SERVING
        watch.cancel()
        # the coordinator's own calls still need the job token
        report = channel.unary_unary(
            f"/{SERVICE}/ReportFailure",
            request_serializer=pb.FailureReport.SerializeToString,
            response_deserializer=pb.FailureVerdict.FromString,
        )
        with pytest.raises(grpc.RpcError) as e:
            report(pb.FailureReport(quorum_id=1, replica_id="0", incarnation="x"), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def _rows(*rows):
    return {"replicas": [{"replica_id": r, "step": s, "alive": a} for r, s, a in rows]}


def test_job_end_rule():
    end = JobEnd(expected=2, final_step=10, idle_s=5.0)
    assert end.observe(_rows(), 0.0) is None  # nobody yet: waits for ever (the replicas may be queued)
    assert end.observe(_rows(), 100.0) is None
    assert end.observe(_rows(("0", 3, True), ("1", 3, True)), 101.0) is None
    assert end.observe(_rows(("0", 10, True), ("1", 7, True)), 102.0) is None  # 0 done, draining
    assert end.observe(_rows(("0", 10, False), ("1", 9, True)), 103.0) is None  # 1 still alive
    assert end.observe(_rows(("0", 10, False), ("1", 10, False)), 104.0) == EXIT_DONE

    gone = JobEnd(expected=2, final_step=10, idle_s=5.0)
    assert gone.observe(_rows(("0", 4, True), ("1", 4, True)), 0.0) is None
    assert gone.observe(_rows(("0", 4, False), ("1", 4, False)), 1.0) is None  # both down: restarting?
    assert gone.observe(_rows(("0", 4, False), ("1", 4, False)), 5.9) is None
    assert gone.observe(_rows(("0", 4, True), ("1", 4, False)), 6.0) is None  # one came back: not idle
    assert gone.observe(_rows(("0", 4, False), ("1", 4, False)), 7.0) is None  # idle again from 7
    assert gone.observe(_rows(("0", 4, False), ("1", 4, False)), 12.0) == EXIT_IDLE
    assert "no replica alive for 5 s" in gone.why(EXIT_IDLE)
    # without --idle-exit-s, a job that is not finished never ends the coordinator
    assert JobEnd(expected=2, final_step=10).observe(_rows(("0", 4, False)), 1e9) is None


def _start(tmp_path, *flags) -> tuple[subprocess.Popen, str]:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen(
        [
            *FTJAX,
            "coordinator",
            "--host",
            "127.0.0.1",
            "--startup-grace-s",
            "0",
            "--heartbeat-timeout-s",
            "1",
            "--token-file",
            str(token),
            "--ready-file",
            str(ready),
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=5)[0]
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())["grpc"]


def test_coordinator_exits_0_when_every_replica_finished_and_3_when_the_job_is_gone(tmp_path):
    procs = []
    try:
        # done: the one expected replica reaches step 3, then leaves
        proc, address = _start(tmp_path, "--expected-replicas", "1", "--final-step", "3", "--idle-exit-s", "60")
        procs.append(proc)
        with CoordinatorClient(address, TOKEN, _member("0"), heartbeat_interval_s=0.05) as client:
            for step in (1, 2, 3):
                client.quorum(step, step, True)
            time.sleep(1.5)
            assert proc.poll() is None  # alive at the final step (draining): not over yet
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == EXIT_DONE and "all 1 replicas reached step 3 and left" in out, out

        # gone: a replica joined, then nobody is alive for --idle-exit-s
        (tmp_path / "b").mkdir()
        proc, address = _start(tmp_path / "b", "--expected-replicas", "2", "--final-step", "30", "--idle-exit-s", "1")
        procs.append(proc)
        with CoordinatorClient(address, TOKEN, _member("0"), heartbeat_interval_s=0.05) as client:
            time.sleep(1.5)
        t_left = time.monotonic()
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == EXIT_IDLE and "the job is gone" in out, out
        assert time.monotonic() - t_left < 10
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_bad_lifetime_flags_exit_2(tmp_path):
    (tmp_path / "token").write_text(TOKEN)
    for flags in (["--final-step", "5"], ["--final-step", "0", "--expected-replicas", "2"], ["--idle-exit-s", "0"]):
        r = subprocess.run(
            [*FTJAX, "coordinator", "--token-file", str(tmp_path / "token"), *flags],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2 and "ftjax coordinator:" in r.stderr, (flags, r.stderr)


def test_a_coordinator_that_does_not_answer_is_said_long_before_the_quorum_timeout(monkeypatch, capsys):
    from ftjax.coordinator import client as client_module
    from ftjax.coordinator.types import CoordinatorError

    monkeypatch.setattr(client_module, "UNREACHABLE_SAY_S", 0.5)
    address = f"127.0.0.1:{free_port()}"  # nobody listens there
    client = CoordinatorClient(address, TOKEN, _member("0"), heartbeat_interval_s=0.05, quorum_timeout_s=2.0)
    with client, pytest.raises(CoordinatorError, match="cannot reach the coordinator"):
        client.quorum(1, 0, True)
    said = [line for line in capsys.readouterr().err.splitlines() if "has not answered" in line]
    assert len(said) == 1 and f"the coordinator at {address} (--coordinator) has not answered for 0.5 s" in said[0]
    assert "UNAVAILABLE" in said[0] and "s more (ft.quorum_timeout_s)" in said[0], said
