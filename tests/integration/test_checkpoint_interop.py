"""ftjax checkpoints and plain orbax, both ways (docs/design/checkpoints.md, "Checkpoint layout"): a program with
only jax and orbax restores a run's parameters and verifies them against the recorded
`params_digest`; a run starts from a plain orbax checkpoint of the user's parameters
(`--init-from`), and refuses one of another model, naming every leaf that differs."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import FTJAX, REPO

from ftjax.cli.train import build_parser, main, parse_config, run_standalone
from ftjax.launch import cli as launch_cli
from ftjax.program.data import make_stream
from ftjax.program.digest import params_digest, state_digest
from ftjax.program.step import build_program, device_batch, where
from ftjax.runtime import checkpoint
from ftjax.runtime.metrics import read_jsonl, read_metrics

TINY = f"{REPO}/configs/tiny.yaml"

# What a user's program does to read and verify an ftjax checkpoint: jax, numpy and orbax only.
# The recipe and the digest are docs/design/index.md's ("Checkpoint layout"), step by step.
PLAIN_READER = r"""
import hashlib, json, sys
import jax, numpy as np
import orbax.checkpoint as ocp

root = sys.argv[1]  # RUN/checkpoints
manager = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(read_only=True))
device = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # whatever mesh wrote it
checkpointer = ocp.StandardCheckpointer()
out = {"steps": manager.all_steps(), "latest": manager.latest_step(), "recorded": {}, "computed": {}}
for step in manager.all_steps():
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    out["recorded"][step] = meta["params_digest"]
    path = f"{root}/{step}/state"
    tree = checkpointer.metadata(path).item_metadata.tree  # shapes and dtypes, no array read
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), tree)
    params = checkpointer.restore(path, target)["params"]
    h = hashlib.sha256()
    for keys, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        v = np.asarray(leaf)
        h.update(f"{jax.tree_util.keystr(keys)}|{v.dtype}|{v.shape}|".encode())
        h.update(np.ascontiguousarray(v).tobytes())
    out["computed"][step] = h.hexdigest()[:16]
manager.close()
checkpointer.close()
assert "ftjax" not in sys.modules, sorted(m for m in sys.modules if m.startswith("ftjax"))
print(json.dumps(out))
"""


def train(out, *argv):
    args = build_parser().parse_intermixed_args([TINY, "--out", str(out), *argv])
    return run_standalone(parse_config(args), args, out)


def events(run_dir, kind):
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("event") == kind]


def save_plain(directory, tree):
    """What a user's program does: orbax's StandardCheckpointer, nothing of ftjax."""
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(directory, tree)
    checkpointer.wait_until_finished()
    checkpointer.close()
    return directory


def program_of(*overrides):
    cfg = parse_config(build_parser().parse_intermixed_args([TINY, *overrides]))
    return cfg, build_program(cfg)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run with checkpoints every 2 steps, one of which was found corrupt on a resume: RUN/checkpoints
    holds steps 2, 4 (saved again), 6 and ftjax's own entries (each step's checksums, corrupt/)."""
    out = tmp_path_factory.mktemp("run")
    assert train(out, "steps=4", "checkpoint.every=2") == 0
    seal = out / "checkpoints" / "4" / checkpoint.CHECKSUMS
    seal.write_text(seal.read_text().replace('"', "'", 2))  # unreadable: step 4 counts as corrupt
    assert train(out, "steps=6", "checkpoint.every=2", "--resume") == 0
    assert len(list((out / "checkpoints" / "corrupt").iterdir())) == 1
    return out


def test_plain_orbax_restores_the_params_and_verifies_their_digest(run):
    r = subprocess.run(
        [sys.executable, "-c", PLAIN_READER, str(run / "checkpoints")],
        cwd=run,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    # orbax's own step discovery sees exactly the steps (corrupt/ and the checksums are not steps)
    assert got["steps"] == [2, 4, 6] and got["latest"] == 6, got
    assert got["computed"] == got["recorded"], got
    summary = json.loads((run / "summary.json").read_text())
    assert got["computed"]["6"] == summary["params_digest"], (got, summary)
    assert len(set(got["computed"].values())) == 3  # the digest sees the training
    for step in got["steps"]:  # and the reader changed nothing that ftjax checks
        checkpoint.verify(run / "checkpoints" / str(step), step)


def design_snippets(section: str) -> str:
    """The Python blocks of docs/design/checkpoints.md's `section`, joined: the documented code as written."""
    text = (Path(REPO) / "docs" / "design" / "checkpoints.md").read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return "\n".join(block.split("```", 1)[0] for block in body.split("```python\n")[1:])


@pytest.mark.timeout(360)
def test_the_documented_reader_works_with_its_relative_path(run, tmp_path):
    """docs/design/checkpoints.md's reading recipe and digest, run as written from the directory where its
    relative "RUN/checkpoints" is this run's (orbax refused it: the path must be made absolute)."""
    (tmp_path / "RUN").symlink_to(run)
    code = design_snippets("Checkpoint layout") + '\nprint("verified", step, meta["params_digest"])\n'
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # (the snippet asserts its digest against the meta's; the run ended at step 6 with that state)
    summary = json.loads((run / "summary.json").read_text())
    assert r.stdout.split() == ["verified", "6", summary["params_digest"]], r.stdout


def test_init_from_a_plain_checkpoint_of_params(tmp_path):
    cfg, program = program_of("steps=2")
    params = program.init(np.int32(7))["params"]  # another seed's: not what the run would start from
    init = save_plain(tmp_path / "init", params)
    batch = device_batch(program, make_stream(cfg).batch(0))
    expected = float(program.grads(params, {}, batch, where(0, 0, 0))[0])
    seeds = float(program.grads(program.init(np.int32(cfg.seed))["params"], {}, batch, where(0, 0, 0))[0])
    assert abs(seeds - expected) > 1e-3 * expected  # (the two starts are told apart)

    assert train(tmp_path / "run", "steps=2", "--init-from", str(init)) == 0
    first = next(r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["step"] == 1)
    assert first["loss"] == pytest.approx(expected, rel=1e-6), (first["loss"], expected)
    [event] = events(tmp_path / "run", "init_from")
    assert event["path"] == str(init) and event["opt"] is False, event
    assert event["params_digest"] == params_digest({"params": params})
    assert not events(tmp_path / "run", "init")


def test_init_opt_from_an_ftjax_run_takes_params_and_optimizer_state(run):
    """An ftjax run's RUN/checkpoints/STEP/state, with checkpoint.init_opt: the same parameters and
    optimizer state as that run's own restore."""
    _cfg, program = program_of("steps=6")
    loaded = checkpoint.load_init(run / "checkpoints" / "6" / "state", program.abstract_state(), opt=True)
    ck = checkpoint.DurableCheckpoints(run / "checkpoints", every=2, keep=3, async_save=False)
    state, meta = ck.restore(program.abstract_state(), 6)
    ck.close()
    assert sorted(loaded) == ["opt", "params"]
    assert state_digest(loaded) == state_digest(state)
    assert params_digest(loaded) == meta["params_digest"]
    shardings = jax.tree.leaves(jax.tree.map(lambda a: a.sharding, program.abstract_state()["params"]))
    assert [x.sharding for x in jax.tree.leaves(loaded["params"])] == shardings


def test_init_from_is_part_of_the_job_identity(tmp_path):
    plain, _ = program_of()
    cfg = parse_config(
        build_parser().parse_intermixed_args([TINY, "--init-from", str(tmp_path), "checkpoint.init_opt=true"])
    )
    assert cfg.checkpoint.init_from == str(tmp_path.absolute())
    identity = checkpoint.job_identity(cfg, "fp")
    assert identity["checkpoint.init_from"] == str(tmp_path) and identity["checkpoint.init_opt"] is True
    # a job without it keeps the identity it had before the field existed (its checkpoints restore)
    assert not any(k.startswith("checkpoint.") for k in checkpoint.job_identity(plain, "fp"))


def test_another_models_checkpoint_is_refused_naming_every_leaf(tmp_path):
    """`ftjax train --init-from` a checkpoint of model.d_model=32 into d_model=64: exit 2, one error
    that names each leaf whose shape differs, no traceback, nothing trained."""
    _, small = program_of("model.d_model=32")
    _, ours = program_of()
    init = save_plain(tmp_path / "init", small.init(np.int32(0))["params"])

    def shapes(program):
        flat = jax.tree_util.tree_flatten_with_path(program.abstract_state()["params"])[0]
        return {"params/" + "/".join(str(k.key) for k in path): a.shape for path, a in flat}

    differ = [name for name, shape in shapes(ours).items() if shapes(small)[name] != shape]
    assert len(differ) > 10
    r = subprocess.run(
        [*FTJAX, "train", TINY, "--out", str(tmp_path / "run"), "steps=2", "--init-from", str(init)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("ftjax train: error:")]
    assert len(errors) == 1 and f"checkpoint.init_from {init}" in errors[0], r.stderr[-3000:]
    named = {ln.strip().split(":")[0]: ln for ln in r.stderr.splitlines() if ln.startswith("  params/")}
    assert sorted(named) == sorted(differ), (sorted(named), differ)
    assert "params/blocks/0/attn/qkv/kernel: checkpoint float32[32,96], this model float32[64,192]" in r.stderr
    assert not (tmp_path / "run" / "summary.json").exists()


def test_a_missing_or_extra_leaf_is_refused_naming_it(tmp_path, capsys):
    _, program = program_of()
    params = jax.tree.map(np.asarray, program.init(np.int32(0))["params"])
    del params["head"]["bias"]
    params["head"]["extra"] = np.zeros(3, np.float32)
    init = save_plain(tmp_path / "init", params)
    code = main([TINY, "--out", str(tmp_path / "run"), "steps=2", "--init-from", str(init)])
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert "  params/head/bias: missing from the checkpoint (this model: float32[256])" in err, err[-3000:]
    assert "  params/head/extra: in the checkpoint (float32[3]), not in this model" in err, err[-3000:]
    assert "2 leaves differ" in err and "Traceback" not in err, err[-3000:]


def test_init_opt_needs_the_optimizer_state_in_the_checkpoint(tmp_path):
    _, program = program_of()
    init = save_plain(tmp_path / "init", program.init(np.int32(0))["params"])
    with pytest.raises(checkpoint.InitCheckpointError, match="checkpoint.init_opt asks for its optimizer state"):
        train(tmp_path / "run", "steps=2", "--init-from", str(init), "checkpoint.init_opt=true")


def test_launch_passes_init_from_to_its_replicas(tmp_path, capsys):
    args = launch_cli.build_parser().parse_intermixed_args(
        [TINY, "--init-from", str(tmp_path), "--out", str(tmp_path / "job")]
    )
    launch = launch_cli.prepare(args)
    assert launch.cfg.checkpoint.init_from == str(tmp_path)
    assert launch.overrides[-1] == f'checkpoint.init_from="{tmp_path}"'  # LocalJob gives every replica its overrides
    missing = tmp_path / "nowhere"
    assert launch_cli.main([TINY, "--init-from", str(missing), "--out", str(tmp_path / "job")]) == 2
    assert f"--init-from {missing}: not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("saved_scanned", [False, True], ids=["unrolled into scanned", "scanned into unrolled"])
def test_init_from_converts_a_llama_between_the_layouts_of_scan_layers(tmp_path, saved_scanned):
    """A Llama's parameters saved with one `model.scan_layers` start a run with the other: stacked
    (or unstacked) on load, the same numbers bitwise, placed with this model's shardings on a
    2 x 2 tensor-parallel replica; with checkpoint.init_opt its optimizer state too (AdamW's
    moments are parameter-shaped trees: converted alike)."""
    from ftjax.config import load_config
    from ftjax.program.models.llama import stacked_layers, unstacked_layers

    def prog(scanned):
        mesh = ["mesh.devices_per_host=4", "mesh.tensor=2", f"model.scan_layers={scanned}"]
        return build_program(load_config("llama_tiny", ["model.n_layers=3", *mesh]))

    source, target = prog(saved_scanned), prog(not saved_scanned)
    state = source.init(np.int32(3))
    batch = device_batch(source, np.stack([source.task.source[i] for i in range(8)]))
    _, _, update = source.grads(state["params"], {}, batch, where(0, 0, 0))
    state = jax.device_get(source.apply(state, update, np.float32(1.0)))  # (AdamW's moments: not zeros)
    with ocp.StandardCheckpointer() as saver:
        saver.save(tmp_path / "init", {"params": state["params"]})
        saver.save(tmp_path / "both", {"params": state["params"], "opt": state["opt"]})
    convert = unstacked_layers if saved_scanned else stacked_layers

    def placed_as_this_model(tree, k):
        shardings = jax.tree.leaves(jax.tree.map(lambda a: a.sharding, target.abstract_state()[k]))
        return [x.sharding for x in jax.tree.leaves(tree)] == shardings

    loaded = checkpoint.load_init(tmp_path / "init", target.abstract_state(), opt=False)
    jax.tree.map(np.testing.assert_array_equal, loaded["params"], convert(state["params"]))
    assert placed_as_this_model(loaded["params"], "params")
    both = checkpoint.load_init(tmp_path / "both", target.abstract_state(), opt=True)
    jax.tree.map(np.testing.assert_array_equal, both["params"], loaded["params"])
    assert jax.tree.structure(both["opt"]) == jax.tree.structure(target.abstract_state()["opt"])
    [saved], [got] = (adam_states(s) for s in (state["opt"], both["opt"]))
    assert int(got.count) == int(saved.count) == 1 and np.abs(jax.tree.leaves(saved.mu)[0]).max() > 0
    for moment in ("mu", "nu"):
        jax.tree.map(np.testing.assert_array_equal, getattr(got, moment), convert(getattr(saved, moment)))
    assert placed_as_this_model(both["opt"], "opt")


def adam_states(opt_state) -> list:
    """The AdamW states (count, mu, nu) inside an optax chain's state."""
    return [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "mu")) if hasattr(x, "mu")]
