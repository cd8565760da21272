"""The committed gRPC stubs match ftjax/coordinator/coordinator.proto (regenerate: python scripts/gen_proto.py)."""

import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FILES = [
    "scripts/gen_proto.py",
    "ftjax/coordinator/coordinator.proto",
    "ftjax/coordinator/coordinator_pb2.py",
    "ftjax/coordinator/coordinator_pb2_grpc.py",
    "ftjax/coordinator/coordinator_pb2.pyi",  # the messages' types, for mypy
]


def _check(root: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, os.path.join(root, "scripts/gen_proto.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_committed_stubs_are_current():
    result = _check(REPO)
    assert result.returncode == 0, result.stderr


def test_check_notices_an_edited_proto(tmp_path):
    for rel in FILES:
        os.makedirs(tmp_path / os.path.dirname(rel), exist_ok=True)
        shutil.copy(os.path.join(REPO, rel), tmp_path / rel)
    assert _check(str(tmp_path)).returncode == 0
    proto = tmp_path / "ftjax/coordinator/coordinator.proto"
    proto.write_text(proto.read_text().replace("int64 heartbeats = 1;", "int64 heartbeats = 1;\n  int64 added = 2;"))
    result = _check(str(tmp_path))
    assert result.returncode == 1
    assert "coordinator_pb2.py was not generated from the current" in result.stderr


def test_check_wants_the_message_types(tmp_path):
    """coordinator_pb2.pyi is generated with the stubs (mypy types the messages from it)."""
    for rel in FILES[:-1]:
        os.makedirs(tmp_path / os.path.dirname(rel), exist_ok=True)
        shutil.copy(os.path.join(REPO, rel), tmp_path / rel)
    result = _check(str(tmp_path))
    assert result.returncode == 1
    assert "missing ftjax/coordinator/coordinator_pb2.pyi" in result.stderr
