"""The Python API (ftjax/api.py, ftjax/program/task.py, ftjax/runtime/manager.py): a user's model, loss, data and
loop, through `ftjax.fit`, `ftjax train`/`launch` by import path, and `FaultTolerance`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import FTJAX, REPO, SUITE_XLA_LEVEL
from launchrun import Launch

USER = f"{REPO}/tests/usertasks/scaled_ce.yaml"


def test_import_ftjax_exports_the_api_without_importing_jax():
    code = (
        "import ftjax, sys; print(sorted(n for n in dir(ftjax) if not n.startswith('_'))); print('jax' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    names = eval(out[0])
    for name in ("Task", "nnx_task", "linen_task", "pytree_task", "fit", "FaultTolerance", "load_config"):
        assert name in names
    assert out[1] == "False"  # `ftjax coordinator` and `ftjax launch` stay free of JAX


class Pairs:
    """A random-access source: (x, y) examples of a noisy linear map, a pure function of the index."""

    fingerprint = "pairs-v1"

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i):
        rng = np.random.default_rng([7, int(i)])
        x = rng.normal(size=8).astype(np.float32)
        return {
            "x": x,
            "y": (x @ np.arange(16, dtype=np.float32).reshape(8, 2) / 10 + 0.1 * rng.normal(size=2)).astype(np.float32),
        }


def mlp_init(key):
    k1, k2 = jax.random.split(key)
    return {"w1": 0.3 * jax.random.normal(k1, (8, 32)), "w2": 0.3 * jax.random.normal(k2, (32, 2))}


def mlp_loss(params, batch, key=None):
    pred = jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"]
    return jnp.sum(jnp.square(pred - batch["y"]), axis=1)  # one loss per example


def test_fit_gives_the_losses_of_a_plain_jax_optax_loop(tmp_path):
    """A user's pytree model, loss, optimizer and dict batches through `ftjax.fit` (standalone):
    step for step the losses of the same model trained by a plain loop written here."""
    import ftjax
    from ftjax.program.data import BatchStream

    steps, batch_size, seed = 12, 16, 3
    tx = optax.adam(1e-2)
    task = ftjax.pytree_task(mlp_init, mlp_loss, Pairs(), optimizer=tx, name="pairs_mlp")
    config = {"seed": seed, "steps": steps, "data": {"batch_size": batch_size}, "ft": {"digest_every": 0}}
    result = ftjax.fit(task, config, out=tmp_path / "fit")
    assert result.exit_code == 0
    assert len(result.losses) == steps

    stream = BatchStream(Pairs(), seed=seed, batch_size=batch_size)  # the batches ftjax trains, in order
    params = mlp_init(jax.random.key(seed))
    opt = tx.init(params)
    want = []
    for k in range(steps):
        batch = jax.tree.map(jnp.asarray, stream.batch(k))
        loss, g = jax.value_and_grad(lambda p: mlp_loss(p, batch).mean())(params)
        updates, opt = tx.update(g, opt, params)
        params = optax.apply_updates(params, updates)
        want.append(float(loss))
    np.testing.assert_allclose(result.losses, want, rtol=1e-6)
    # into the same directory again: refused (as `ftjax train` does), the run untouched
    before = (tmp_path / "fit" / "metrics.jsonl").read_bytes()
    with pytest.raises(FileExistsError, match="already holds a run .*resume=True continues it"):
        ftjax.fit(task, config, out=tmp_path / "fit")
    assert (tmp_path / "fit" / "metrics.jsonl").read_bytes() == before


@pytest.mark.timeout(1560)
def test_a_user_loss_weighs_every_row_own_and_covered(tmp_path):
    """Constant global batch, a user loss of 10 x cross-entropy: the rows a replica computes for a
    missing peer go through that loss too. Each step's per-stream loss sums of a run where replica 1
    dies (its stream covered by the others) equal the failure-free run's, where every stream is its
    own replica's: a covered row weighed by ftjax's own loss would count a tenth."""
    from ftjax.base.procs import ProcessGroup

    common = ["--replicas", "3", "steps=24", "ft.global_batch=constant", "--restart-delay-s", "0.5"]
    with ProcessGroup() as procs:
        free = Launch(procs, [USER, *common], tmp_path / "free")
        assert free.wait(600) == 0, free.output()
        chaos = Launch(procs, [USER, *common, "--kill", "1@8:ftar", "ft.drain_timeout_s=120"], tmp_path / "chaos")
        assert chaos.wait(900) == 0, chaos.output()

    def sums(launch):  # (step, stream) -> sum of the rows' losses, over whoever computed them
        out: dict[tuple[int, int], float] = {}
        for r in range(3):
            for rec in launch.metrics(r):
                if rec.get("committed") and rec.get("loss_sums") and "event" not in rec:
                    for stream, _a, _b, total in rec["loss_sums"]:
                        out[(rec["step"], stream)] = out.get((rec["step"], stream), 0.0) + total
        return out

    want, got = sums(free), sums(chaos)
    covered = {
        (rec["step"], s)
        for r in (0, 2)
        for rec in chaos.metrics(r)
        if rec.get("committed") and "event" not in rec
        for s, *_ in (rec.get("loss_sums") or [])
        if s == 1
    }
    assert covered, "nobody computed stream 1's rows for it: the kill did not take effect"
    for key in covered:
        assert got[key] == pytest.approx(want[key], rel=1e-4), (key, got[key], want[key])
    assert want[(1, 0)] / 8 > 30  # 10 x a byte-level cross-entropy (about 5.5 at the start)


@pytest.mark.timeout(660)
@pytest.mark.parametrize(
    "task, says",
    [
        ("scaled_ce:missing", "has no callable 'missing'"),
        ("nonexistent_module:task", "cannot import 'nonexistent_module'"),
        ("scaled_ce:broken_shape", "one loss per example"),
        ("scaled_ce:ragged", "do not batch"),
        ("scaled_ce:raises", "raises(cfg, **task_args) failed: RuntimeError: could not open /data/shards"),
        ("scaled_ce:int_params", "parameter ['table'] is int32: every parameter is differentiated"),
    ],
)
def test_a_bad_task_is_one_clear_error_before_anything_starts(tmp_path, task, says):
    train = subprocess.run(
        [*FTJAX, "train", USER, f"task={task}", "steps=2", "--out", str(tmp_path / "t")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert train.returncode == 2, train.stderr[-2000:]
    assert says in train.stderr and task in train.stderr, train.stderr[-2000:]
    assert "Traceback" not in train.stderr
    launch = subprocess.run(
        [*FTJAX, "launch", USER, f"task={task}", "--replicas", "2", "--out", str(tmp_path / "l")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert launch.returncode == 2 and says in launch.stderr, launch.stderr[-2000:]
    assert not (tmp_path / "l" / "replica-0").exists()  # refused before any replica started


@pytest.mark.timeout(660)
@pytest.mark.parametrize(
    "example, entry",
    [
        ("nnx_dropout.yaml", None),  # (a) nnx.Dropout, a loss with an auxiliary term
        ("linen_batchnorm.yaml", None),  # (b) a Linen model with batch statistics
        ("own_loop.yaml", f"python {REPO}/examples/own_loop.py"),  # (c) a hand-written loop with FaultTolerance
    ],
)
def test_each_example_survives_a_kill_with_equal_digests_and_every_batch_once(tmp_path, example, entry):
    from ftjax.base.procs import ProcessGroup

    args = [
        f"{REPO}/examples/{example}",
        "--replicas",
        "2",
        "--kill",
        "1@15:ftar",
        "--restart-delay-s",
        "0.5",
        *(["--entry", entry] if entry else []),
    ]
    with ProcessGroup() as procs:
        run = Launch(procs, args, tmp_path / "run")
        try:
            assert run.wait(600) == 0, run.output()
        finally:
            run.close()
    summary = run.summary()
    assert summary["digests_equal"] and summary["exactly_once"], json.dumps(summary)[:2000]
    assert any(e.get("event") == "replica_down" and e.get("replica") == 1 for e in run.events())  # really killed
    if example == "nnx_dropout.yaml":  # the auxiliary metrics are logged with each step
        rec = next(r for r in run.metrics(0) if r.get("committed") and "event" not in r)
        assert set(rec["aux"]) == {"cross_entropy", "z_loss"}


@pytest.mark.timeout(360)
def test_a_parameter_the_mesh_cannot_split_is_one_line_naming_it(tmp_path):
    """A user's model whose width (34) the fsdp axis of 4 devices does not divide: named at the
    program's layout, not a traceback from the step's compile."""
    train = subprocess.run(
        [*FTJAX, "train", USER, "task=scaled_ce:odd_width", "steps=2", "platform=cpu", "mesh.devices_per_host=4"]
        + ["--out", str(tmp_path / "t")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert train.returncode == 2, train.stderr[-2000:]
    says = "parameter ['embed']['embedding'] (256, 34): its dimension 1 (34, logical axis 'embed') is split 4 ways"
    assert says in train.stderr and "Traceback" not in train.stderr, train.stderr[-2000:]


@pytest.mark.timeout(360)
def test_a_loss_that_is_not_finite_stops_the_run_before_it_is_checkpointed(tmp_path):
    run = tmp_path / "nan"
    train = subprocess.run(
        [*FTJAX, "train", USER, "task_args.scale=.nan", "steps=3", "checkpoint.every=1", "--out", str(run)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert train.returncode == 2, train.stderr[-2000:]
    assert "replica 0: step 1: the loss of its rows is nan" in train.stderr, train.stderr[-2000:]
    assert "Traceback" not in train.stderr
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "step" in r and "event" not in r]
    assert [r["step"] for r in steps] == [1] and steps[0]["loss"] != steps[0]["loss"]  # (NaN)
    assert not list((run / "checkpoints").glob("[0-9]*")), "a NaN state was checkpointed"


def test_a_logical_axis_name_not_in_the_rules_is_refused_naming_the_parameter():
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from ftjax.program.sharding import Indivisible, param_shardings

    mesh = Mesh(np.array(jax.devices()[:2]), ("fsdp",))
    shapes = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32)}
    assert param_shardings({"w": P("embed", None)}, mesh, shapes)["w"].spec == P("fsdp", None)
    with pytest.raises(Indivisible, match=r"parameter \['w'\]: logical axis 'embd' is not one of embed, vocab"):
        param_shardings({"w": P("embd", None)}, mesh, shapes)


def test_a_state_gone_nan_under_a_finite_loss_is_never_checkpointed(tmp_path):
    """A loss whose value is finite and whose gradient is not (sqrt at 0): step 1's loss is 0, its
    update makes the parameters NaN. The checkpoint due at step 1 is refused, the run stops."""
    import ftjax
    from ftjax.runtime.trainer import NotFinite

    def loss(params, batch, key=None):
        return jnp.sqrt(jnp.sum(params["w"] * 0.0) * batch["x"][:, 0] ** 2) + 0.0 * params["w"].sum()

    task = ftjax.pytree_task(lambda key: {"w": jnp.ones(3)}, loss, Pairs(), optimizer=optax.sgd(0.1), name="sqrt0")
    config = {"steps": 3, "data": {"batch_size": 4}, "checkpoint": {"every": 1}}
    with pytest.raises(NotFinite, match=r"replica 0: step 1: its state holds a NaN or an infinity"):
        ftjax.fit(task, config, out=tmp_path / "run")
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in steps if "step" in r and "event" not in r], "step 1 was recorded as done"
    assert not list((tmp_path / "run" / "checkpoints").glob("[0-9]*")), "a NaN state was checkpointed"


@pytest.mark.timeout(660)
@pytest.mark.slow
def test_an_own_loop_compiles_before_it_rejoins_so_its_peer_does_not_wait(tmp_path):
    """examples/own_loop.py killed at step 5: its restarted incarnation compiles its step in
    `FaultTolerance.join` (`warm_up`), before it asks for a quorum. Compiled inside its first
    contributing step instead, the survivor waited for it at FTAR (1.8 s and 2.5 s, two runs,
    against a 0.1-0.2 s stall at the kill)."""
    from ftjax.base.procs import ProcessGroup

    args = [f"{REPO}/examples/own_loop.yaml", "--replicas", "2", "steps=3500", "--kill", "1@5:forward"]
    args += ["--restart-delay-s", "0.5", "--entry", f"python {REPO}/examples/own_loop.py"]
    # the restarted replica compiles as a user's would: no cache to load from (filled, it loads the
    # step in tenths of a second), at XLA's default level (the suite's level 0 compiles it in as little)
    args += ["--compile-cache", "none"]
    flags = os.environ.get("XLA_FLAGS", "").replace(SUITE_XLA_LEVEL, "")
    with ProcessGroup() as procs:
        run = Launch(procs, args, tmp_path / "run", env={"XLA_FLAGS": flags})
        try:
            assert run.wait(600) == 0, run.output()
        finally:
            run.close()
    s = run.summary()
    assert s["digests_equal"] and s["exactly_once"] and s["replicas"]["1"]["restarts"] == 1, json.dumps(s)[:2000]
    back = [r for r in run.metrics(1) if r.get("committed") and r.get("step", 0) > 5 and r.get("loss") is not None]
    assert len(back) >= 10, "the restarted replica contributed to too few steps to measure its rejoin"
    # what the survivor waited for its peer in each step (at the quorum and at FTAR), not its gaps:
    # load on its own work (a digest, a compute) is not the rejoin's; a script's records split their
    # step as the built-in loop's do
    waited = run.waited(0)
    print(f"own loop: survivor waited at most {max(w for _, w in waited)} s, median step {s['median_step_s']} s")
    assert max(w for _, w in waited) <= 1.5 * s["median_step_s"] + 0.5, (waited, s)


def test_batch_statistics_are_detected_as_rows_that_interact():
    """Linen's `batch_stats` and NNX's BatchStat make a task's rows interact (a constant global
    batch then deals missing batches out whole: ReplicaProgram.unit_rows); other model state, or
    none, does not; a task says so itself through `rows_independent`."""
    import flax.linen as nn
    from flax import nnx

    import ftjax

    class Linen(nn.Module):
        norm: bool

        @nn.compact
        def __call__(self, x):
            h = nn.Dense(4)(x)
            return nn.BatchNorm(use_running_average=False)(h) if self.norm else nn.Dropout(0.1, deterministic=False)(h)

    class Nnx(nnx.Module):
        def __init__(self, norm, rngs):
            self.dense = nnx.Linear(8, 4, rngs=rngs)
            self.norm = nnx.BatchNorm(4, rngs=rngs) if norm else None

        def __call__(self, x):
            h = self.dense(x)
            return self.norm(h) if self.norm is not None else h

    def linen_loss(apply, batch):
        return jnp.sum(apply(batch["x"]) ** 2, axis=1)

    def nnx_loss(module, batch):
        return jnp.sum(module(batch["x"]) ** 2, axis=1)

    src = Pairs()
    assert not ftjax.linen_task(Linen(True), linen_loss, src).rows_independent
    assert ftjax.linen_task(Linen(False), linen_loss, src).rows_independent
    assert not ftjax.nnx_task(lambda rngs: Nnx(True, rngs), nnx_loss, src).rows_independent
    assert ftjax.nnx_task(lambda rngs: Nnx(False, rngs), nnx_loss, src).rows_independent
    assert ftjax.linen_task(Linen(True), linen_loss, src, rows_independent=True).rows_independent  # declared
    assert ftjax.pytree_task(mlp_init, mlp_loss, src).rows_independent
    assert not ftjax.pytree_task(mlp_init, mlp_loss, src, rows_independent=False).rows_independent
