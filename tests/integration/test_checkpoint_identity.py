"""A durable checkpoint is restored only by the job that wrote it (same seed, data, model, optimizer)."""

import json
import os
import shutil
import subprocess
import time
import urllib.request

import numpy as np
import pytest
from conftest import FTJAX, REPO

from ftjax.cli.train import build_parser, parse_config, run_standalone
from ftjax.program.data import make_stream
from ftjax.program.digest import state_digest
from ftjax.program.step import build_program
from ftjax.runtime import checkpoint

TINY = f"{REPO}/configs/tiny.yaml"
BASE = ["steps=3", "checkpoint.every=3"]


def train(out, *argv):
    """`ftjax train configs/tiny.yaml --out OUT ARGV...` in this process."""
    args = build_parser().parse_intermixed_args([TINY, "--out", str(out), *argv])
    assert run_standalone(parse_config(args), args, out) == 0


def open_checkpoints(run_dir, *overrides):
    """(config, program, RUN/checkpoints as the tiny config with `overrides` opens them)."""
    cfg = parse_config(build_parser().parse_intermixed_args([TINY, *overrides]))
    program = build_program(cfg)
    ck = checkpoint.DurableCheckpoints.from_config(
        cfg, run_dir, data_fingerprint=make_stream(cfg).fingerprint, params=program.abstract_state()["params"]
    )
    return cfg, program, ck


@pytest.fixture(scope="module")
def old_run(tmp_path_factory):
    """An earlier run: 3 steps of the tiny config, its step-3 checkpoint in RUN/checkpoints."""
    out = tmp_path_factory.mktemp("old_run")
    train(out, *BASE)
    return out


@pytest.mark.parametrize(
    "override, field, ours",
    [
        ("seed=1", "seed", "1"),
        ("data.source=synthetic", "data.source", "synthetic"),
        ("optim.lr=1e-3", "optim.lr", "0.001"),
        ("model.d_model=32", "model.d_model", "32"),  # refused by its identity, not by a shape error
    ],
)
def test_another_job_is_refused(tmp_path, old_run, override, field, ours):
    ckpt_dir = old_run / "checkpoints"
    with pytest.raises(ValueError) as exc:
        train(tmp_path, *BASE, f"checkpoint.dir={ckpt_dir}", override, "--resume")
    assert isinstance(exc.value, checkpoint.CheckpointMismatch), repr(exc.value)
    msg = str(exc.value)
    assert str(ckpt_dir) in msg and "step 3" in msg, msg
    line = next((ln for ln in msg.splitlines() if ln.strip().startswith(f"{field}:")), None)
    assert line is not None and ours in line, msg
    assert "checkpoint.dir" in msg and "remove" in msg, msg  # says what to do
    assert not (tmp_path / "summary.json").exists()  # nothing trained


def test_data_source_names_fingerprint_too(tmp_path, old_run):
    with pytest.raises(checkpoint.CheckpointMismatch) as exc:
        train(tmp_path, *BASE, f"checkpoint.dir={old_run / 'checkpoints'}", "data.source=synthetic", "--resume")
    assert "data.fingerprint: checkpoint " in str(exc.value) and "synthetic-0" in str(exc.value)


def test_same_job_restores_bitwise(old_run):
    summary = json.loads((old_run / "summary.json").read_text())
    cfg, program, ck = open_checkpoints(old_run, *BASE)
    state, meta = ck.restore(program.abstract_state())
    ck.close()
    assert meta["step"] == 3 and meta["data_position"] == 3
    assert state_digest(state) == summary["param_digest"]
    again = program.init(np.int32(cfg.seed))  # a fresh init differs: the digest does see the state
    assert state_digest(again) != summary["param_digest"]


def test_extending_steps_on_another_mesh_is_the_same_job(tmp_path, old_run):
    """`steps`, the mesh and the checkpoint cadence are not the job's identity: a run may be extended."""
    shutil.copytree(old_run / "checkpoints", tmp_path / "checkpoints")
    train(tmp_path, "steps=5", "checkpoint.every=5", "mesh.devices_per_host=2", "--resume")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["data_position"] == 5


def test_checkpoint_without_identity_is_refused(tmp_path):
    """A checkpoint written before the identity was recorded: nothing proves it is ours."""
    _, program, ck = open_checkpoints(tmp_path, *BASE)
    legacy = checkpoint.DurableCheckpoints(tmp_path / "checkpoints", every=1, keep=1, async_save=False)
    legacy.maybe_save(3, program.init(np.int32(0)), {"step": 3, "data_position": 3}, force=True)
    legacy.close()
    ck.manager.reload()  # opened before the legacy checkpoint was written
    with pytest.raises(checkpoint.CheckpointMismatch, match="no job identity") as exc:
        ck.restore(program.abstract_state())
    ck.close()
    assert str(tmp_path / "checkpoints") in str(exc.value)


def test_cli_resume_with_another_seed_exits_2(tmp_path, old_run):
    out = tmp_path / "run"
    shutil.copytree(old_run, out)
    r = subprocess.run(
        [*FTJAX, "train", "configs/tiny.yaml", "--out", str(out), *BASE, "seed=7", "--resume"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "seed: checkpoint 0, this job 7" in r.stderr, r.stderr[-3000:]
    assert str(out / "checkpoints") in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]


def test_how_the_model_is_computed_is_not_the_job(tmp_path):
    """The llama's compute dtype, remat, attention and its chunk settings may change between restarts
    of one job (and a checkpoint written before the chunk settings existed has none of them): the
    identity is the same whatever they are, and a model field that is the model's is not."""
    from ftjax.config import load_config

    base = load_config("llama_tiny", ["model.seq_len=64"])
    how = load_config(
        "llama_tiny",
        ["model.seq_len=64", "model.compute_dtype=float32", "model.remat=full", "model.attention=xla",
         "model.attention_chunk=16", "model.logits_chunk=16"],
    )  # fmt: skip
    assert checkpoint.job_identity(how, "fp") == checkpoint.job_identity(base, "fp")
    assert not any("chunk" in key for key in checkpoint.job_identity(how, "fp"))
    other = load_config("llama_tiny", ["model.seq_len=64", "model.d_ff=128"])
    assert checkpoint.job_identity(other, "fp") != checkpoint.job_identity(base, "fp")
    # model.scan_layers is another parameter tree: in the identity when set, absent when not (so a
    # checkpoint written before the setting existed keeps its identity)
    scanned = checkpoint.job_identity(load_config("llama_tiny", ["model.seq_len=64", "model.scan_layers=true"]), "fp")
    assert scanned["model.scan_layers"] is True and "model.scan_layers" not in checkpoint.job_identity(base, "fp")


def test_where_token_files_are_is_not_the_job_but_how_they_are_read_is(tmp_path):
    """`token_lm`'s `task_args.dir` only says where the data is (`data.fingerprint` says what): it is
    left out of the identity, also when a checkpoint recorded it (written before it was left out);
    its other arguments (the packing) stay in."""
    from ftjax.config import load_config

    def cfg(**task_args):
        return load_config("llama_tiny", ["task=ftjax.program.tasks:token_lm", f"task_args={json.dumps(task_args)}"])

    ours = checkpoint.job_identity(cfg(dir="data/tokens"), "fp", locations=("dir",))
    assert ours == checkpoint.job_identity(cfg(dir="/elsewhere/tokens"), "fp", locations=("dir",))
    ck = checkpoint.DurableCheckpoints(tmp_path, every=1, keep=1, identity=ours, locations=("dir",))
    recorded = checkpoint.job_identity(cfg(dir="./data/tokens"), "fp")  # an older checkpoint's: with its dir
    assert "tokens" in recorded["task_args"]
    ck._check(3, {"identity": recorded})  # accepted
    packed = checkpoint.job_identity(cfg(dir="data/tokens", packing="segments"), "fp")
    with pytest.raises(checkpoint.CheckpointMismatch, match="task_args"):
        ck._check(3, {"identity": packed})
    ck.close()


def test_a_custom_task_checkpoint_is_not_the_builtin_models(tmp_path):
    """A custom task's `--resume` with `model.d_model=128` was refused ("belongs to another job:
    model.d_model") though the task never reads `model:`: its identity now holds its task, task_args
    and the settings it declares (Task.reads), also against a checkpoint that recorded the built-in ones."""
    from ftjax.config import load_config

    custom, reads = ["task=linen_batchnorm:task"], ("model.seq_len",)
    ours = checkpoint.job_identity(load_config("tiny", [*custom, "model.d_model=128"]), "fp", reads=reads)
    ck = checkpoint.DurableCheckpoints(tmp_path, every=1, keep=1, identity=ours)
    ck._check(3, {"identity": checkpoint.job_identity(load_config("tiny", custom), "fp", reads=reads)})  # accepted
    older = {**ours, "model.kind": "gpt", "model.d_model": 64, "data.source": "stdlib"}  # recorded them
    ck._check(3, {"identity": older})  # accepted
    with pytest.raises(checkpoint.CheckpointMismatch, match="model.seq_len: checkpoint 32, this job 64"):
        ck._check(3, {"identity": {**older, "model.seq_len": 32}})  # what it reads is its job
    ck.close()


def member(procs, address, out, rid, *overrides):
    """`ftjax train` of the tiny config, replica `rid` of a 2-replica job at the coordinator `address`."""
    argv = ["train", "configs/tiny.yaml", "--replica-id", str(rid), "--coordinator", address, "--out", str(out)]
    return procs.start(
        [*FTJAX, *argv, "ft.replicas=2", *overrides],
        env={"FTJAX_TOKEN": "identity-t0ken"},
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.timeout(360)
def test_a_replica_of_other_steps_or_wire_dtype_is_refused_naming_the_setting(procs, tmp_path):
    """Replicas of other `steps` (another learning-rate schedule: decay_steps defaults to it) or another
    `ft.wire_dtype` (FTAR frames the peer cannot read: the job stalled at step 0) were admitted. Now the
    coordinator refuses the second one, naming the setting, and it exits 2; the first one is untouched."""
    (tmp_path / "token").write_text("identity-t0ken")
    ready = tmp_path / "ready.json"
    coordinator = ["coordinator", "--port", "0", "--http-port", "0", "--min-replicas", "2"]
    procs.start([*FTJAX, *coordinator, "--token-file", str(tmp_path / "token"), "--ready-file", str(ready)])
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert time.monotonic() < deadline, "the coordinator did not start"
        time.sleep(0.05)
    addresses = json.loads(ready.read_text())
    first = member(procs, addresses["grpc"], tmp_path / "r0", 0)  # waits for its peer: a quorum needs 2

    def status():
        with urllib.request.urlopen(f"http://{addresses['http']}/status", timeout=10) as r:
            return json.loads(r.read())

    deadline = time.monotonic() + 240
    while not status()["topology_fingerprint"]:  # its layout fixes the job's
        assert first.poll() is None, first.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "replica 0 did not join"
        time.sleep(0.2)
    fingerprint = status()["topology_fingerprint"]
    others = {
        "steps=43": ["job optim.decay_steps (job: 30; this replica: 43)", "job steps (job: 30; this replica: 43)"],
        "ft.wire_dtype=bfloat16": ['job ft.wire_dtype (job: "float32"; this replica: "bfloat16")'],
    }
    refused = {o: member(procs, addresses["grpc"], tmp_path / o, 1, o) for o in others}
    for override, proc in refused.items():
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 2, (override, proc.returncode, err[-3000:])
        (line,) = [ln for ln in err.splitlines() if "the coordinator refused replica 1" in ln]
        assert f"{len(others[override])} items differ: " + ", ".join(others[override]) in line, line
        assert "Traceback" not in err, err[-3000:]
    assert first.poll() is None and status()["topology_fingerprint"] == fingerprint  # the job is still replica 0's
    assert not os.path.exists(tmp_path / "r0" / "summary.json")
