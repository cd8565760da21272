"""scripts/gpu_check.sh's dry run on CPU (issue 59): the GPU check's own code path with tiny shapes,
so it is not broken when a device comes. Every stage writes its JSON line and log tail to OUT as it
ends; a stage over its limit says so, with its processes' log tails, and leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAGES = ["alone", "bench150", "bench1b", "kill150", "kill1b", "probe", "wire"]


def _survivors(marker: str) -> list[str]:
    """Command lines of live processes that name `marker` (the test's scratch folder)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if proc.name.isdigit() and marker in cmd:
            found.append(cmd)
    return found


@pytest.mark.slow
# the dry run is bounded by its T_TOTAL (900 s: each stage 240 s on a busy machine) and graces
@pytest.mark.timeout(1080)
def test_gpu_check_dry_run_tells_every_stage_and_why_one_failed(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    # bench150 gets 6 s: on CPU its two launches cannot finish, so it is the stage that fails (a limit, not a code path)
    env = {**os.environ, "DRY_RUN": "1", "T_BENCH150": "6", "PYTHON": sys.executable, "WORK": str(work)}
    proc = subprocess.Popen(
        ["bash", "scripts/gpu_check.sh", str(out)], cwd=ROOT, env=env, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        stdout, _ = proc.communicate(timeout=980)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = [json.loads(line) for line in (out / "stages.jsonl").read_text().splitlines()]
    by = {rec["stage"]: rec for rec in lines}
    assert [rec["stage"] for rec in lines] == STAGES, stdout
    failed = by.pop("bench150")
    assert not failed["ok"] and failed["reason"] == "timeout: over its 6 s limit" and failed["rc"] == 124
    tail = (out / "bench150.tail.txt").read_text()
    assert "== bench150/ft/replica-0/host-0.log" in tail  # the replicas' own logs, not only the launcher's
    for name, rec in by.items():
        assert rec["ok"] and rec["reason"] == "ok" and rec["result"], (name, rec)
        assert (out / f"{name}.tail.txt").stat().st_size > 0
    for name in ("kill150", "kill1b"):
        res = by[name]["result"]
        assert res["ok"] and res["digests_equal"] and res["exactly_once"] and res["committed_steps"] == 8
    bench = by["bench1b"]["result"]
    assert bench["ft_vs_standalone"] > 0 and bench["phases"]["grad_bytes"] > 0
    probe = by["probe"]["result"]
    assert probe["raw"]["bytes"] == probe["grad_bytes"] == bench["phases"]["grad_bytes"]  # the step's own bytes
    assert probe["d2h_vs_raw_pageable"] == round(bench["phases"]["d2h_gbps"] / probe["raw"]["d2h_gbps"], 3)
    assert by["wire"]["result"]["bf16"]["ring_s"] > 0
    assert "alone" in by and by["alone"]["result"]["step_time_s"] > 0
    assert all(p.is_file() for p in out.iterdir())  # flat: nothing too deep to come back from the device
    assert _survivors(str(work)) == []  # the timed-out stage's replicas were killed with it
