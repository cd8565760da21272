"""TLS on the control plane (`--tls-cert/--tls-key/--tls-ca`): the coordinator's gRPC and the
catch-up HTTPS, with certificates this test makes with `openssl` (a CA, a server certificate it
signs for 127.0.0.1, and a second CA that signed nothing of ours)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np
import pytest
from conftest import FTJAX

from ftjax.base.net import split_address
from ftjax.base.tls import TLS, speaks_tls
from ftjax.coordinator.client import CoordinatorClient
from ftjax.coordinator.quorum import Settings
from ftjax.coordinator.server import CoordinatorServer
from ftjax.coordinator.types import CoordinatorError, MemberInfo
from ftjax.runtime.catchup import HostShards, Piece, SnapshotFetch, SnapshotServer, _Snapshot

TOKEN = "tls-token"
pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command"),
]


def openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def new_ca(d, name: str) -> None:
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
            "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=d)  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, TLS]:
    """ "good": the server certificate (SAN IP 127.0.0.1) and the CA that signed it; "other": the
    same certificate, checked against another CA."""
    d = tmp_path_factory.mktemp("certs")
    new_ca(d, "ca")
    new_ca(d, "other")
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj", "/CN=ftjax",
            "-keyout", "server.key", "-out", "server.csr", cwd=d)  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-extfile", "san.ext", "-out", "server.pem", cwd=d)  # fmt: skip
    return {
        "good": TLS.from_flags(str(d / "server.pem"), str(d / "server.key"), str(d / "ca.pem")),
        "other": TLS.from_flags(str(d / "server.pem"), str(d / "server.key"), str(d / "other.pem")),
    }


def member(address: str, tls: TLS | None, *, heartbeats: bool = False) -> CoordinatorClient:
    """A member; `heartbeats` as a replica sends them (one that asks for a quorum and then stays
    silent a heartbeat timeout is dead, and its request goes unanswered: the first quorum forms a
    heartbeat timeout after the coordinator's start, so on a busy machine that raced it)."""
    info = MemberInfo("0", "incarnation", 1, ("127.0.0.1:1",), ("127.0.0.1:2",), "fingerprint")
    client = CoordinatorClient(address, TOKEN, info, quorum_timeout_s=60, tls=tls)
    if heartbeats:
        client.start()
    return client


def test_coordinator_over_tls_takes_the_right_ca_and_refuses_the_others(certs):
    with CoordinatorServer(Settings(min_replicas=1), TOKEN, http_port=None, tls=certs["good"]) as server:
        assert speaks_tls(*split_address(server.address), timeout_s=10)
        client = member(server.address, certs["good"], heartbeats=True)
        try:
            assert client.quorum_async(0, 0, True).result(30).quorum_id == 1
        finally:
            client.close()
        # Without TLS, or with a CA that did not sign its certificate: refused at the first call, in
        # one line naming TLS (not retried until ft.quorum_timeout_s, 60 s here).
        for tls, says in ((None, "serves TLS, and this member dials it without"), (certs["other"], "handshake")):
            client = member(server.address, tls)
            try:
                with pytest.raises(CoordinatorError) as e:
                    client.quorum_async(0, 0, True).result(30)
            except FutureTimeout:
                raise AssertionError(f"{tls}: still retrying after 30 s") from None
            finally:
                client.close()
            assert str(e.value).startswith("UNAVAILABLE: TLS: ") and says in str(e.value), e.value
            assert "\n" not in str(e.value)


def test_a_plain_coordinator_is_not_taken_for_a_tls_one(certs):
    with CoordinatorServer(Settings(min_replicas=1), TOKEN, http_port=None) as server:
        assert not speaks_tls(*split_address(server.address), timeout_s=10)
        client = member(server.address, None, heartbeats=True)
        try:
            assert client.quorum_async(0, 0, True).result(30).quorum_id == 1
        finally:
            client.close()


def test_catchup_over_https_is_bitwise_and_refuses_plain_or_other_ca(certs):
    rng = np.random.default_rng(0)
    leaves = {"a": rng.standard_normal((300, 7)).astype(np.float32), "d/b": rng.integers(0, 255, 5000, np.uint8)}
    # (a long wait for the offer: this process may import JAX between the manifest and the ranges)
    server = SnapshotServer(TOKEN, wait_offer_s=120, ssl_context=certs["good"].server_context())
    try:
        pieces = [Piece(k, tuple((0, n) for n in v.shape), v) for k, v in leaves.items()]
        shards = HostShards({k: (v.shape, v.dtype.name) for k, v in leaves.items()}, pieces)
        server.publish(_Snapshot("peer", 7, {"k": 1}, shards))
        f = SnapshotFetch(server.address, "peer", TOKEN, source="test", timeout_s=30, tls=certs["good"])
        assert f.done.wait(35) and f.error is None, f.error
        got = {p.leaf: p.data for p in f.result.shards.pieces}
        assert f.result.step == 7 and all(got[k].tobytes() == v.tobytes() for k, v in leaves.items())
        for tls in (None, certs["other"]):
            f = SnapshotFetch(server.address, "peer", TOKEN, source="test", timeout_s=10, tls=tls)
            assert f.done.wait(15) and f.result is None and f.error, f.error
            if tls is not None:
                assert "CERTIFICATE_VERIFY_FAILED" in f.error, f.error
        # a plain request is dropped at its failed handshake: no HTTP answer, nothing served
        with socket.create_connection(split_address(server.address), timeout=10) as s:
            s.sendall(f"GET /snapshot/manifest?key=peer HTTP/1.0\r\nX-Ftjax-Token: {TOKEN}\r\n\r\n".encode())
            try:
                answer = s.recv(4096)  # EOF, or a TLS alert record
            except ConnectionResetError:
                answer = b""
            assert not answer.startswith(b"HTTP/"), answer
    finally:
        server.close()


def test_incomplete_or_unreadable_tls_flags_are_one_line_exit_2(certs, tmp_path):
    good = certs["good"]
    cases = [
        (["train", "tiny", "--tls-cert", good.cert, "--tls-ca", good.ca], "--tls-key"),
        (["coordinator", "--tls-cert", good.cert, "--tls-key", good.key, "--tls-ca", str(tmp_path / "no")], "--tls-ca"),
        (["coordinator", "--tls-cert", good.ca, "--tls-key", good.key, "--tls-ca", good.ca], "--tls-cert"),
    ]
    for argv, flag in cases:
        env = {**os.environ, "FTJAX_TOKEN": TOKEN}
        r = subprocess.run([*FTJAX, *argv], capture_output=True, text=True, timeout=120, env=env)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and flag in lines[0], (argv, r.returncode, r.stderr)


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_launch_with_tls_and_a_kill_ends_with_equal_digests(launch, certs):
    # The launcher gives the flags to the coordinator (gRPC over TLS) and to every replica it starts,
    # a restarted one too, which catches up over HTTPS.
    run = launch("--replicas", "2", "--kill", "1@10", "steps=40", *certs["good"].flags())
    run.wait_for(lambda e: e["event"] == "replica_started", timeout=120)
    grpc_address = json.loads((run.run_dir / "coordinator.json").read_text())["grpc"]
    assert speaks_tls(*split_address(grpc_address), timeout_s=10)
    code = run.wait(timeout=400)
    s = run.summary()
    assert code == 0 and s["digests_equal"] and s["exactly_once"], run.output()
    assert s["replicas"]["1"]["restarts"] == 1, s
    rejoined = [e for e in run.events() if e["event"] == "rejoined"]
    assert [e["replica"] for e in rejoined] == [1], run.output()
