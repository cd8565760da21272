"""`ftjax launch --emit slurm` on a real Slurm cluster: the local one of `scripts/local_slurm.sh`
(one slurmctld, several slurmd nodes on this machine). `make slurm-test` brings it up, runs this
file with FTJAX_SLURM_TEST=1 and takes it down; without that variable the test is skipped (`make
test` does not need Slurm).

2 replicas x 2 hosts, a constant global batch and `ft.on_host_loss: reduce`, submitted with the
emitted submit.sh exactly as a user would. Mid-run host 1 of replica 1 fails: its node is drained
(what a node health check does) and its process SIGKILLed. srun ends the replica's step
(--kill-on-bad-exit), and the batch script restarts the replica at once on host 0 alone, at reduced
degree (it computes half its rows, the other replica the rest); once the node is resumed the
reduced replica leaves at a step boundary and comes back whole, catching up from replica 0. Then
replica 0's job is requeued (`scontrol requeue`, what Slurm does to a --requeue job whose node
died): it starts over from its batch script and catches up from replica 1, and the requeue is a
failure event. The job ends with equal digests, every row of every step exactly once (the summary
that finish.sbatch writes from run/, the same functions as for a local `ftjax launch`), and the
coordinator job ending by itself.

The job trains a user's task from a module outside the ftjax package (tests/usertasks/scaled_ce.py,
named by import path in its config with `task_path`): the emitted job carries what finds it."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import REPO

from ftjax.base.env import limited_env
from ftjax.launch.emit import EmitOptions, emit
from ftjax.runs.summary import build_summary

USER_TASK = f"{REPO}/tests/usertasks/scaled_ce.yaml"  # tiny's model and batch, a user module's loss
STEPS = 500  # enough for three restarts in a row (reduced, whole, requeued) on a loaded machine
BATCH = 8  # the config's data.batch_size: a reduced replica (1 of 2 hosts) computes half
REQUIRED = os.environ.get("FTJAX_SLURM_TEST") == "1"
SLURM_CONF = os.environ.get("SLURM_CONF") or "/tmp/ftjax-slurm/slurm.conf"

pytestmark = pytest.mark.skipif(not REQUIRED, reason="needs the local Slurm cluster: `make slurm-test`")


def _slurm_env() -> dict[str, str]:
    env = limited_env(device_count=1)  # many JAX processes on a few cores: one thread each
    env["SLURM_CONF"] = SLURM_CONF
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # the nodes' `ftjax`
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _run(args, env, timeout=30) -> str:
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, (args, r.stdout, r.stderr)
    return r.stdout


def _committed(path: Path) -> int:
    if not path.exists():
        return 0
    return sum(
        1
        for line in path.read_text().splitlines()
        if line.endswith("}") and '"committed": true' in line and '"healing": false' in line
    )


def _pids_of(job_dir: Path, replica: int, process_id: int) -> list[int]:
    """The `ftjax train` processes of that replica host, found by their command lines."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        flags = dict(zip(argv, argv[1:]))
        if (
            "train" in argv
            and str(job_dir / "config.yaml") in argv
            and flags.get("--replica-id") == str(replica)
            and flags.get("--process-id") == str(process_id)
        ):
            pids.append(int(entry.name))
    return pids


def _queue(env, ids: list[str]) -> list[str]:
    out = subprocess.run(
        ["squeue", "-h", "-j", ",".join(ids), "-o", "%i %T"], env=env, capture_output=True, text=True, timeout=30
    ).stdout
    return [line for line in out.splitlines() if line.strip()]


@pytest.fixture
def job_dir():
    """Outside pytest's tmp_path (other pytest runs on this machine may rotate it away mid-job); the
    test removes it when it passes, and a failure leaves it for its logs."""
    path = Path(tempfile.mkdtemp(prefix="ftjax-slurm-test-"))
    print(f"job directory: {path}/job")
    return path / "job"


def _events(run: Path, replica: int) -> list[dict]:
    path = run / f"replica-{replica}" / "slurm-events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _own_steps(run: Path, replica: int, since: float) -> list[dict]:
    """Replica's committed steps with its own batch, after `since`."""
    path = run / f"replica-{replica}" / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return [m for m in records if m.get("committed") and not m.get("healing") and m["time"] > since]


def _rows(step: dict, replica: int) -> int:
    """The rows of the step that `replica` computed (constant global batch: the step's `work`)."""
    return sum(b - a for who, _, a, b in step["work"] if who == replica)


def _wait(condition, what, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what()
        time.sleep(0.5)


@pytest.mark.timeout(1200)
def test_emitted_job_survives_a_lost_host_at_reduced_degree_on_a_real_slurm_cluster(job_dir):
    env = _slurm_env()
    try:
        nodes = _run(["sinfo", "-h", "-N", "-o", "%N %T"], env)
    except (OSError, subprocess.SubprocessError, AssertionError) as e:
        pytest.fail(f"no Slurm cluster (SLURM_CONF={SLURM_CONF}): run scripts/local_slurm.sh up ({e})")
    assert len([line for line in nodes.splitlines() if "idle" in line or "mix" in line]) >= 2, nodes

    emit(
        "slurm",
        job_dir,
        USER_TASK,
        [
            "ft.replicas=2",
            "mesh.hosts=2",
            "platform=cpu",
            f"steps={STEPS}",
            "ft.global_batch=constant",
            "ft.on_host_loss=reduce",
        ],
        options=EmitOptions(name="ftjax-slurm-test", max_restarts=4),
    )
    t0 = time.monotonic()
    submitted = _run([str(job_dir / "submit.sh")], env)
    ids = [
        i
        for part in submitted.split("job ftjax-slurm-test: ")[1].split("\n")[0].replace(",", " ").split()
        for i in part.split(":")
        if i.isdigit()
    ]
    assert len(ids) == 4, submitted  # coordinator, 2 replicas, finish
    run = job_dir / "run"
    drained = None

    def state():
        return _queue(env, ids), (run / "replica-1" / "host-0.log").read_text()[-3000:]

    try:
        # both replicas train (so that a live peer holds the state), then host 1 of replica 1 fails:
        # its node is drained and its process killed
        _wait(
            lambda: (
                _committed(run / "replica-1" / "metrics.jsonl") >= 5
                and _committed(run / "replica-0" / "metrics.jsonl") >= 5
            ),
            lambda: (_queue(env, ids), list(run.rglob("*"))),
        )
        allocation = _run(["squeue", "-h", "-j", ids[2], "-o", "%N"], env).strip()
        drained = _run(["scontrol", "show", "hostnames", allocation], env).split()[1]
        _run(["scontrol", "update", f"NodeName={drained}", "State=DRAIN", "Reason=ftjax-slurm-test"], env)
        (victim,) = _pids_of(job_dir, 1, 1)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        assert _committed(run / "replica-0" / "metrics.jsonl") < STEPS  # mid-run: replica 0 trains on

        # replica 1 restarts on host 0 alone and trains there; then its node is back
        def reduced_start():
            return next((e for e in _events(run, 1) if e["event"] == "replica_started" and e.get("reduced")), None)

        _wait(lambda: reduced_start() and len(_own_steps(run, 1, reduced_start()["time"])) >= 3, state)
        _run(["scontrol", "update", f"NodeName={drained}", "State=RESUME"], env)
        drained = None
        resumed_at = time.monotonic()

        # it leaves, comes back whole, catches up and trains; then replica 0's job is requeued
        def whole_again():
            later = [
                e
                for e in _events(run, 1)
                if e["event"] == "replica_started" and not e["reduced"] and e["time"] > reduced_start()["time"]
            ]
            return later[0] if later else None

        _wait(lambda: whole_again() and len(_own_steps(run, 1, whole_again()["time"])) >= 1, state)
        _run(["scontrol", "requeue", ids[1]], env)
        requeued_at = time.monotonic()
        # Slurm starts a requeued job no sooner than 2 minutes later (as after a lost node); the
        # test does not wait for that
        _wait(lambda: _queue(env, [ids[1]]) == [f"{ids[1]} PENDING"], lambda: _queue(env, ids), 60)
        _run(["scontrol", "update", f"JobId={ids[1]}", "StartTime=now"], env)  # its BeginTime

        _wait(lambda: not _queue(env, ids), state, 600)
        elapsed = time.monotonic() - t0
    finally:
        subprocess.run(["scancel", *ids], env=env, capture_output=True, timeout=30)
        if drained is not None:
            subprocess.run(
                ["scontrol", "update", f"NodeName={drained}", "State=RESUME"], env=env, capture_output=True, timeout=30
            )

    logs = {p.name: p.read_text() for p in job_dir.glob("slurm-*.out")}
    assert (run / "summary.json").exists(), logs  # finish.sbatch wrote it; the same functions read run/ here
    summary = build_summary(run)
    r0, r1 = summary["replicas"]["0"], summary["replicas"]["1"]
    events = [json.loads(line) for line in (run / "launcher.jsonl").read_text().splitlines()]
    started = [e for e in events if e["event"] == "replica_started" and e["replica"] == 1]
    reduced = [e for e in started if e["reduced"]]
    reduced_steps = [m for m in _own_steps(run, 1, reduced[0]["time"]) if m["time"] < whole_again()["time"]]
    print(
        json.dumps(
            {
                "elapsed_s": round(elapsed, 1),
                "killed_after_s": round(killed_at - t0, 1),
                "resumed_after_s": round(resumed_at - t0, 1),
                "requeued_after_s": round(requeued_at - t0, 1),
                "wall_s": summary["wall_s"],
                "median_step_s": summary["median_step_s"],
                "restarts": [r0["restarts"], r1["restarts"]],
                "catchup_s": r1["catchup_s"],
                "replica_1_reduced_steps": len(reduced_steps),
                "replica_1_steps_after_restart": len(_own_steps(run, 1, started[-1]["time"])),
                "failures": [(e["replica"], e["cause"], round(e["time_s"], 1)) for e in summary["failure_events"]],
            }
        )
    )
    assert summary["ok"], (summary, logs)
    # replica 1: down with host 1 lost, at once on host 0 alone (the drained node's host), asked
    # back when its node was resumed, left at a step boundary, and whole again
    causes = [(e["replica"], e["cause"]) for e in summary["failure_events"]]
    down = next(e for e in events if e["event"] == "replica_down" and e["replica"] == 1)
    assert down["cause"] == "exit" and down["host"] == 1, down
    assert started[1] == reduced[0] and reduced[0]["hosts"] == [0] and reduced[0]["time"] - down["time"] < 5, started
    back = [e for e in events if e["event"] == "back_to_full_degree" and e["replica"] == 1]
    assert len(back) == 1 and back[0]["hosts"] == [0], back
    left = [e for e in events if e["event"] == "replica_down" and e["replica"] == 1 and e.get("cause") == "left"]
    assert len(left) == 1 and started[-1]["hosts"] == [0, 1] and not started[-1]["reduced"], (left, started)
    assert (1, "left") not in causes, causes  # (asked to leave, to come back whole: no failure)
    # the reduced incarnation computed half of its rows (1 of 2 hosts), the other replica the rest
    assert reduced_steps and {_rows(m, 1) for m in reduced_steps} <= {0, BATCH // 2}, reduced_steps
    assert any(_rows(m, 1) == BATCH // 2 for m in reduced_steps), reduced_steps
    # replica 0's requeue is a failure event, and it caught up from replica 1 as replica 1 did from 0
    assert (0, "requeue") in causes, (causes, logs)
    assert r0["restarts"] >= 1 and r1["restarts"] >= 2 and r0["catchups"] >= 1 and r1["catchups"] >= 2, summary
    assert summary["digests_equal"] and summary["exactly_once"] and summary["constant_batch"]["exactly_once"], summary
    assert max(r0["final_step"], r1["final_step"]) == STEPS, summary
    # the user's module trained: its loss is 10 x the cross-entropy (about 5.5 at the start)
    assert "task: scaled_ce:task" in (job_dir / "config.yaml").read_text()
    first = next(m for m in _own_steps(run, 0, 0.0) if m.get("loss") is not None)
    assert first["loss"] > 30, first
    # the coordinator's job ended by itself when the replicas had finished (not cancelled)
    (coordinator_log,) = [text for name, text in logs.items() if "-coordinator-" in name]
    assert f"the job is over: all 2 replicas reached step {STEPS} and left" in coordinator_log, coordinator_log
    # each restart: the same Slurm job (a new srun step in the same allocation, or the requeued job
    # from the top of its script), the attempts counted across the requeue; host-P.log has a header
    # for each attempt that ran a process P
    for r in (0, 1):
        started = [e for e in events if e["event"] == "replica_started" and e["replica"] == r]
        assert [e["incarnation"] for e in started] == list(range(1, len(started) + 1)) and len(started) >= 2
        assert {e["slurm_job"] for e in started} == {ids[1 + r]}
        for p in (0, 1):
            assert (run / f"replica-{r}" / f"host-{p}.log").read_text().count("--- attempt") == sum(
                len(e["hosts"]) > p for e in started
            )
    shutil.rmtree(job_dir.parent)
