"""Tensor parallelism inside a replica (`mesh.tensor`; docs/design/model.md "Tensor parallelism"): the
same training as FSDP alone, the same update bits on every replica degree, and the heads and the
MLP's hidden dimension really split over the `tensor` axis."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from launchrun import Launch

from ftjax.config import ConfigError, load_config
from ftjax.program.data import make_stream
from ftjax.program.digest import state_digest
from ftjax.program.sharding import TENSOR, replica_mesh
from ftjax.program.step import build_program, device_batch

STEPS = 20


def _losses(config: str, overrides: list[str]) -> list[float]:
    cfg = load_config(config, ["mesh.hosts=1", "mesh.devices_per_host=4", f"steps={STEPS}", *overrides])
    program = build_program(cfg)
    stream = make_stream(cfg, replica=0)
    state, losses = program.init(jnp.int32(0)), []
    for k in range(STEPS):
        state, loss = program.train_step(state, device_batch(program, stream.batch(k)), jnp.float32(1.0))
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("config", ["tiny", "llama_tiny"])
def test_tensor_x_fsdp_trains_like_fsdp_alone(config):
    """2 x 2 (fsdp x tensor) against FSDP over the same 4 devices: the same loss at every step of
    20, within 1e-5 relative (the sums are grouped differently; nothing else differs)."""
    fsdp, tp = _losses(config, []), _losses(config, ["mesh.tensor=2"])
    assert fsdp[-1] < fsdp[0]  # it trains
    np.testing.assert_allclose(tp, fsdp, rtol=1e-5)


def test_the_heads_and_the_mlp_are_split_over_the_tensor_axis():
    cfg = load_config("tiny", ["mesh.hosts=1", "mesh.devices_per_host=4", "mesh.tensor=2"])
    program = build_program(cfg)
    assert dict(program.mesh.shape) == {"fsdp": 2, "tensor": 2}
    specs = {
        jax.tree_util.keystr(path): tuple(s.spec)
        for path, s in jax.tree_util.tree_flatten_with_path(program.state_shardings["params"])[0]
    }
    on_tensor = {k for k, spec in specs.items() if TENSOR in spec}
    assert any("mlp" in k and "fc" in k and "kernel" in k for k in on_tensor), specs
    assert any("qkv" in k and "kernel" in k for k in on_tensor), specs
    # the batch: rows over fsdp, the same rows on both devices of a tensor group
    assert jax.tree.leaves(tuple(program.batch_sharding.spec)) == ["fsdp"]


def test_the_update_has_the_same_bits_on_a_full_and_a_reduced_tensor_replica():
    """2 hosts x 2 devices with tensor 2 (fsdp 2) and the same replica on 1 host (fsdp 1): the
    global-norm clip cuts leaves in the full replica's blocks along both axes, so applying the same
    update gives the same bits (docs/design/index.md, "Bitwise agreement")."""
    cfg = load_config("tiny", ["mesh.hosts=2", "mesh.devices_per_host=2", "mesh.tensor=2", "optim.clip_norm=0.01"])
    digests = {}
    g = None
    for devices in (4, 2):
        program = build_program(cfg, replica_mesh(jax.devices()[:devices], tensor=2))
        state = program.init(jnp.int32(0))
        if g is None:
            key = jax.random.key(1)
            g = {
                "params": jax.tree.map(
                    lambda x: np.asarray(jax.random.normal(key, x.shape, jnp.float32)) * 3.0, state["params"]
                )
            }
        for _ in range(2):  # the clip scales (norm >> 0.01): the norm's bits matter
            state = program.apply(state, jax.device_put(g, program.grad_shardings), jnp.float32(1.0))
        digests[devices] = state_digest(state)
    assert len(set(digests.values())) == 1, digests


@pytest.mark.parametrize(
    "overrides,field",
    [(["mesh.devices_per_host=2", "mesh.tensor=4"], "tensor"), (["mesh.tensor=2", "model.d_ff=255"], "d_ff")],
)
def test_a_tensor_size_that_does_not_fit_is_refused_naming_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field):
        load_config("tiny", ["mesh.devices_per_host=2", *overrides])


@pytest.mark.timeout(960)
@pytest.mark.slow
def test_a_tensor_parallel_llama_job_survives_kills_in_ftar_and_in_catch_up(procs, tmp_path):
    """Issue 28: 3 replicas of llama_tiny on fsdp 1 x tensor 2, replica 1 killed mid-FTAR at step
    20, replica 2 at step 40 and again while it catches up: every replica ends with the same digest,
    every batch trained exactly once (lanes, FTAR, catch-up and digests carry tensor-sharded leaves)."""
    args = ["llama_tiny", "--replicas", "3", "--kill", "1@20:ftar", "--kill", "2@40:catchup", "steps=60"]
    tp = ["mesh.devices_per_host=2", "mesh.tensor=2", "ft.drain_timeout_s=120"]
    run = Launch(procs, [*args, *tp, "--restart-delay-s", "0.5"], tmp_path / "run")
    try:
        code = run.wait(900)
        s = run.summary()
        assert code == 0 and s["digests_equal"] and s["exactly_once"], run.output()
        assert sorted(e["replica"] for e in s["failure_events"]) == [1, 2, 2], s["failure_events"]
        assert s["committed_steps"] == 60 and run.leftovers() == []
    finally:
        run.close()
