"""`ftjax launch --emit slurm` on a real Slurm cluster: the local one of `scripts/local_slurm.sh`
(one slurmctld, several slurmd nodes on this machine). `make slurm-test` brings it up, runs this
file with FTJAX_SLURM_TEST=1 and takes it down; without that variable the test is skipped (`make
test` does not need Slurm).

2 replicas x 2 hosts, submitted with the emitted submit.sh exactly as a user would. Mid-run one
host process of replica 1 is SIGKILLed: srun ends the replica's step (--kill-on-bad-exit), the batch
script starts the whole replica again, and it catches up from replica 0. Then replica 0's job is
requeued (`scontrol requeue`, what Slurm does to a --requeue job whose node died): it starts over
from its batch script and catches up from replica 1. The job ends with equal digests, every batch
exactly once (the summary that finish.sbatch writes from run/, the same functions as for a local
`ftjax launch`), and the coordinator job ending by itself."""

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

from ftjax.env import limited_env
from ftjax.launch.emit import EmitOptions, emit
from ftjax.launch.summary import build_summary

from conftest import REPO

TINY = f"{REPO}/configs/tiny.yaml"
STEPS = 200
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
    return sum(1 for line in path.read_text().splitlines()
               if line.endswith("}") and '"committed": true' in line and '"healing": false' in line)


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
        if "train" in argv and str(job_dir / "config.yaml") in argv and flags.get("--replica-id") == str(replica) \
                and flags.get("--process-id") == str(process_id):
            pids.append(int(entry.name))
    return pids


def _queue(env, ids: list[str]) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-j", ",".join(ids), "-o", "%i %T"], env=env, capture_output=True,
                         text=True, timeout=30).stdout
    return [line for line in out.splitlines() if line.strip()]


@pytest.fixture
def job_dir():
    """Outside pytest's tmp_path (other pytest runs on this machine may rotate it away mid-job); the
    test removes it when it passes, and a failure leaves it for its logs."""
    path = Path(tempfile.mkdtemp(prefix="ftjax-slurm-test-"))
    print(f"job directory: {path}/job")
    return path / "job"


@pytest.mark.timeout(900)
def test_emitted_job_survives_a_killed_host_on_a_real_slurm_cluster(job_dir):
    env = _slurm_env()
    try:
        nodes = _run(["sinfo", "-h", "-N", "-o", "%N %T"], env)
    except (OSError, subprocess.SubprocessError, AssertionError) as e:
        pytest.fail(f"no Slurm cluster (SLURM_CONF={SLURM_CONF}): run scripts/local_slurm.sh up ({e})")
    assert len([line for line in nodes.splitlines() if "idle" in line or "mix" in line]) >= 2, nodes

    emit("slurm", job_dir, TINY, ["ft.replicas=2", "mesh.hosts=2", "platform=cpu", f"steps={STEPS}"],
         options=EmitOptions(name="ftjax-slurm-test", max_restarts=3))
    t0 = time.monotonic()
    submitted = _run([str(job_dir / "submit.sh")], env)
    ids = [i for part in submitted.split("job ftjax-slurm-test: ")[1].split("\n")[0].replace(",", " ").split()
           for i in part.split(":") if i.isdigit()]
    assert len(ids) == 4, submitted  # coordinator, 2 replicas, finish
    run = job_dir / "run"
    try:
        # both replicas train (so that a live peer holds the state), then host 1 of replica 1 is killed
        deadline = time.monotonic() + 300
        while _committed(run / "replica-1" / "metrics.jsonl") < 10 or _committed(run / "replica-0" / "metrics.jsonl") < 5:
            assert time.monotonic() < deadline, (_queue(env, ids), list(run.rglob("*")))
            time.sleep(0.5)
        (victim,) = _pids_of(job_dir, 1, 1)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        assert _committed(run / "replica-0" / "metrics.jsonl") < STEPS  # mid-run: replica 0 trains on

        # once replica 1 is back (caught up, and a few steps of its own), replica 0's job is requeued
        rejoined = _committed(run / "replica-1" / "metrics.jsonl") + 3
        deadline = time.monotonic() + 300
        while '"catchup_done"' not in (run / "replica-1" / "metrics.jsonl").read_text() \
                or _committed(run / "replica-1" / "metrics.jsonl") < rejoined:
            assert time.monotonic() < deadline, (_queue(env, ids), (run / "replica-1" / "host-0.log").read_text()[-3000:])
            time.sleep(0.5)
        _run(["scontrol", "requeue", ids[1]], env)
        requeued_at = time.monotonic()
        # Slurm starts a requeued job no sooner than 2 minutes later (as after a lost node); the
        # test does not wait for that
        while _queue(env, [ids[1]]) != [f"{ids[1]} PENDING"]:
            assert time.monotonic() < deadline, _queue(env, ids)
            time.sleep(0.2)
        _run(["scontrol", "update", f"JobId={ids[1]}", "StartTime=now"], env)  # its BeginTime

        deadline = time.monotonic() + 420
        while _queue(env, ids):
            assert time.monotonic() < deadline, (_queue(env, ids), (run / "replica-1" / "host-0.log").read_text()[-3000:])
            time.sleep(1)
        elapsed = time.monotonic() - t0
    finally:
        subprocess.run(["scancel", *ids], env=env, capture_output=True, timeout=30)

    logs = {p.name: p.read_text() for p in job_dir.glob("slurm-*.out")}
    assert (run / "summary.json").exists(), logs  # finish.sbatch wrote it; the same functions read run/ here
    summary = build_summary(run)
    r0, r1 = summary["replicas"]["0"], summary["replicas"]["1"]
    events = [json.loads(line) for line in (run / "launcher.jsonl").read_text().splitlines()]
    started = [e for e in events if e["event"] == "replica_started" and e["replica"] == 1]
    # the restarted replica may rejoin while replica 0 trains, or heal from it once it finished
    # (it drains: it serves its state until every replica holds it)
    own_after = [m for m in (json.loads(line) for line in (run / "replica-1" / "metrics.jsonl").read_text().splitlines())
                 if m.get("committed") and not m.get("healing") and m["time"] > started[-1]["time"]]
    print(json.dumps({"elapsed_s": round(elapsed, 1), "killed_after_s": round(killed_at - t0, 1),
                      "requeued_after_s": round(requeued_at - t0, 1),
                      "wall_s": summary["wall_s"], "median_step_s": summary["median_step_s"],
                      "restarts": [r0["restarts"], r1["restarts"]], "catchup_s": r1["catchup_s"],
                      "replica_1_steps_after_restart": len(own_after),
                      "failures": [(e["replica"], e["cause"], round(e["time_s"], 1)) for e in summary["failure_events"]]}))
    assert summary["ok"], (summary, logs)
    # the kill restarted replica 1, the requeue replica 0: each caught up from the other
    assert (1, "exit") in [(e["replica"], e["cause"]) for e in summary["failure_events"]], (summary, logs)
    assert r0["restarts"] >= 1 and r1["restarts"] >= 1 and r0["catchups"] >= 1 and r1["catchups"] >= 1, summary
    assert summary["digests_equal"] and summary["exactly_once"], summary
    assert max(r0["final_step"], r1["final_step"]) == STEPS, summary
    # the coordinator's job ended by itself when the replicas had finished (not cancelled)
    (coordinator_log,) = [text for name, text in logs.items() if "-coordinator-" in name]
    assert f"the job is over: all 2 replicas reached step {STEPS} and left" in coordinator_log, coordinator_log
    # each restart: the same Slurm job (a new srun step in the same allocation, or the requeued job
    # from the top of its script), both hosts, the attempts counted across the requeue
    for r in (0, 1):
        started = [e for e in events if e["event"] == "replica_started" and e["replica"] == r]
        assert [e["incarnation"] for e in started] == list(range(1, len(started) + 1)) and len(started) >= 2
        assert {e["slurm_job"] for e in started} == {ids[1 + r]}
        assert (run / f"replica-{r}" / "host-1.log").read_text().count("--- attempt") == len(started)
    shutil.rmtree(job_dir.parent)
