"""A test run stopped with SIGTERM (a CI job's time limit, `kill`) still kills what its running test
started (tests/conftest.py turns SIGTERM into Ctrl-C, so fixtures tear down)."""

from __future__ import annotations

import os
import signal
import time

from conftest import REPO

INNER = """
import time

def test_starts_a_child_then_waits(procs):
    child = procs.start(["sleep", "300"])
    open("child.pid", "w").write(str(child.pid))
    time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # (a zombie has exited)
    except FileNotFoundError:
        return False


def test_a_sigtermed_test_run_kills_the_processes_its_running_test_started(procs, tmp_path):
    (tmp_path / "test_inner.py").write_text(INNER)
    env = {"PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests")])}
    # the suite's conftest as a plugin: its `procs` fixture and its SIGTERM handling
    inner = procs.python(
        "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", "test_inner.py", cwd=str(tmp_path), env=env
    )
    pid_file, deadline = tmp_path / "child.pid", time.monotonic() + 120
    while not (pid_file.exists() and pid_file.read_text()):
        assert inner.poll() is None and time.monotonic() < deadline, "the inner test never started its child"
        time.sleep(0.1)
    child = int(pid_file.read_text())
    try:
        assert _alive(child)
        inner.send_signal(signal.SIGTERM)  # pytest alone, not its process group
        assert inner.wait(timeout=60) == 2  # pytest's "interrupted"
        assert not _alive(child), "the test's child outlived the SIGTERMed test run"
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
