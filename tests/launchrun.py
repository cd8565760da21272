"""Helpers for tests that run `ftjax launch` as a real process (real signals, real children)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO

from ftjax.base.procs import ProcessGroup
from ftjax.runs.events import is_step
from ftjax.runs.jsonl import read_jsonl
from ftjax.runs.summary import load_run, step_wait, warm_time

TINY = f"{REPO}/configs/tiny.yaml"


def job_pids(run_dir: Path) -> set[int]:
    """Every process the launcher started (coordinator incarnations, every host of every replica)."""
    pids = set()
    for e in read_jsonl(run_dir / "launcher.jsonl"):
        if e.get("event") == "coordinator_started":
            pids.add(e["pid"])
        elif e.get("event") == "replica_started":
            pids.update(e["pids"])
    return pids


def live_in_groups(groups: set[int]) -> list[int]:
    """Processes (not zombies) whose process group is one of `groups`: each child of the launcher
    leads its own group, so this also finds anything those children started."""
    live = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        state, pgrp = fields[0], int(fields[2])
        if pgrp in groups and state != "Z":
            live.append(int(entry))
    return live


def kill_groups(groups: set[int]) -> None:
    for g in groups:
        try:
            os.killpg(g, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class Launch:
    """One `ftjax launch` process; `close()` makes sure neither it nor any of its children survives."""

    def __init__(
        self, procs: ProcessGroup, args: list[str], run_dir: Path, plots: bool = False, env: dict | None = None
    ):
        """`plots`: let the launcher draw its plots (~2 s of CPU at the end of every job, and no test
        but one reads them: `--no-plots` otherwise). `env`: variables of the launcher (and so of
        its children) set apart from the suite's."""
        self.run_dir = run_dir
        self.log = open(run_dir.parent / f"{run_dir.name}.out", "w")
        self.proc = procs.start(
            [sys.executable, "-m", "ftjax", "launch", *args, *([] if plots else ["--no-plots"]), "--out", str(run_dir)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"ftjax launch still running after {timeout} s:\n{self.output()}") from None

    def output(self) -> str:
        """The launcher's output, then the last lines of each replica's host logs and of the
        coordinator's: what a failure message needs to say why (the run directory is gone once CI
        has finished)."""
        self.log.flush()
        text = (self.run_dir.parent / f"{self.run_dir.name}.out").read_text()[-6000:]
        for log in [*sorted(self.run_dir.glob("replica-*/host-*.log")), self.run_dir / "coordinator.log"]:
            if not log.exists():
                continue
            tail = log.read_text(errors="replace").splitlines()[-12:]
            text += f"\n--- {log.relative_to(self.run_dir)} (last lines)\n" + "\n".join(x[:300] for x in tail)
        return text

    def events(self) -> list[dict]:
        return read_jsonl(self.run_dir / "launcher.jsonl")

    def wait_for(self, predicate, timeout: float) -> dict:
        """The first launcher event matching `predicate` (polled; the launcher writes line by line)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.events():
                if predicate(e):
                    return e
            if self.proc.poll() is not None:
                raise AssertionError(f"ftjax launch exited with {self.proc.returncode}:\n{self.output()}")
            time.sleep(0.2)
        raise AssertionError(f"no such launcher event after {timeout} s:\n{self.output()}")

    def metrics(self, r: int) -> list[dict]:
        return read_jsonl(self.run_dir / f"replica-{r}" / "metrics.jsonl")

    def waited(self, r: int, since: float | None = None, until: float = float("inf")) -> list[tuple[float, float]]:
        """(time, seconds) that replica r waited for its peers in each step ending in [since, until]
        (`since`: the run's warm time, as the summary's): the gap since its previous committed step
        less its own compute and commit. On a 2-core machine a restarting replica's import and
        compile, or the other tests, take a core from r, so r's own compute and digest slow too
        (a 2.07 s digest once, quiet): that is load, not waiting for a peer."""
        if since is None:
            since = warm_time(load_run(self.run_dir))
        steps = [m for m in self.metrics(r) if is_step(m) and m["committed"]]
        waits = [(b["time"], step_wait(a, b)) for a, b in zip(steps, steps[1:]) if since <= b["time"] <= until]
        assert all(w is not None for _, w in waits), "a step record without compute_s and commit_s"
        return [(t, round(w, 3)) for t, w in waits]

    def pids(self) -> set[int]:
        return job_pids(self.run_dir)

    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())

    def leftovers(self) -> list[int]:
        return live_in_groups(job_pids(self.run_dir))

    def close(self) -> None:
        kill_groups(job_pids(self.run_dir))  # only matters when a test failed half-way
        self.log.close()


@pytest.fixture
def launch(procs, tmp_path):
    """`launch(*args, name="run", plots=False)` starts `ftjax launch configs/tiny.yaml *args --out tmp/name`."""
    runs = []

    def start(*args: str, name: str = "run", plots: bool = False) -> Launch:
        run = Launch(procs, [TINY, "--restart-delay-s", "0.5", *args], tmp_path / name, plots=plots)
        runs.append(run)
        return run

    yield start
    for run in runs:
        run.close()
