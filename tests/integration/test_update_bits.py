"""Bitwise agreement by construction: the same averaged gradient gives the same state after the
update on every mesh a replica can have (full, reduced degree), with the global-norm clip active.

The gradient is built so that the order of the sum of squares matters: 4096 (square 2^24) in the
first FSDP block of one leaf and many 1s (square 1) in the others. Summed in another grouping
(one device's reduction against per-device partial sums), 2^24 + 1 rounds back to 2^24 and the
ones vanish: a norm with other bits, a clipped update with other bits."""

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.config import load_config
from ftjax.program.digest import state_digest
from ftjax.program.sharding import replica_mesh
from ftjax.program.step import build_program


def _adversarial_gradient(shapes, specs):
    """Zeros except the first leaf sharded over FSDP: 4096 at the start of its first block, 1 in
    every element of the other blocks."""
    out, done = [], False
    shardings = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
    for shape, spec in zip(jax.tree.leaves(shapes), shardings):
        g = np.zeros(shape.shape, np.float32)
        axes = [i for i, name in enumerate(spec.spec) if name is not None]
        if axes and not done:
            a, block = axes[0], shape.shape[axes[0]] // 4
            ones = [slice(None)] * g.ndim
            ones[a] = slice(block, None)
            g[tuple(ones)] = 1.0
            g[(0,) * g.ndim] = 4096.0
            done = True
        out.append(g)
    assert done
    return jax.tree.unflatten(jax.tree.structure(shapes), out)


def test_the_update_has_the_same_bits_on_every_replica_degree():
    cfg = load_config("tiny", ["mesh.hosts=4", "mesh.devices_per_host=1"])  # a full replica: 4 devices
    digests, g = {}, None
    for devices in (4, 2, 1):  # full, and live_hosts 2 and 1 (each host then holds 2 or 4 lanes)
        program = build_program(cfg, replica_mesh(jax.devices()[:devices]))
        state = program.init(jnp.int32(0))
        if g is None:
            g = {"params": _adversarial_gradient(state["params"], program.grad_shardings["params"])}
        for _ in range(2):
            state = program.apply(state, jax.device_put(g, program.grad_shardings), jnp.float32(1.0))
        digests[devices] = state_digest(state)
    assert len(set(digests.values())) == 1, digests
