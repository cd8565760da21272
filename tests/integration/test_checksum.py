"""The per-step digest (`state_checksum`, ftjax/program/digest.py; docs/design/index.md "Bitwise agreement
and divergence"): any flipped bit of any element changes it, it is the same whatever the replica's
degree and the leaves' shardings, and computing it moves only per-leaf sums between devices."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ftjax.config import load_config
from ftjax.program import digest
from ftjax.program.digest import leaf_sums, state_checksum, tree_checksum
from ftjax.program.sharding import replica_mesh
from ftjax.program.step import build_program


def _flip(x: np.ndarray, flat: int, bit: int) -> np.ndarray:
    """`x` with bit `bit` of the raw bytes of its element `flat` flipped."""
    y = np.array(x)
    raw = y.reshape(-1).view(f"u{y.dtype.itemsize}")
    raw[flat] ^= np.array(1 << bit, raw.dtype)
    return y


def test_one_flipped_bit_of_one_element_of_a_large_leaf_changes_the_checksum():
    big = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
    tree = {"w": big, "b": np.zeros(7, np.float32)}
    before = tree_checksum(jax.tree.map(jnp.asarray, tree))
    for flat, bit in ((0, 0), (123_457, 13), (big.size - 1, 31)):
        flipped = {**tree, "w": _flip(big, flat, bit)}
        assert tree_checksum(jax.tree.map(jnp.asarray, flipped)) != before, (flat, bit)
    assert tree_checksum(jax.tree.map(jnp.asarray, tree)) == before  # (and it is a function of the bits)


@jax.jit
def _sums_of(x):
    return digest._plain_program(x)[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32", "uint8", "bool"])
def test_thousands_of_random_single_bit_flips_are_all_detected(dtype):
    """Every one of 3000 random flips (element and bit) changes the leaf's sums: a change of one
    element always changes the first sum (the per-element mix is a bijection of its bits)."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((96, 40)) * 100).astype(jnp.dtype(dtype))
    base = np.asarray(_sums_of(x))
    bits = 1 if dtype == "bool" else 8 * x.dtype.itemsize
    missed = [
        (flat, bit)
        for flat, bit in zip(rng.integers(0, x.size, 3000), rng.integers(0, bits, 3000))
        if np.array_equal(np.asarray(_sums_of(_flip(x, int(flat), int(bit)))), base)
    ]
    assert missed == []


def test_moved_or_swapped_values_change_the_checksum():
    """The mix depends on each element's index: a permutation of the same values is another state."""
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    base = leaf_sums([jnp.asarray(x)])
    for y in (x.T, x[::-1], np.roll(x, 1), _swap(x)):
        assert not np.array_equal(leaf_sums([jnp.asarray(np.ascontiguousarray(y))]), base)


def _swap(x):
    y = x.copy().reshape(-1)
    y[[3, 40]] = y[[40, 3]]
    return y.reshape(x.shape)


def test_every_flip_in_the_tiny_models_state_is_detected():
    """A hundred single-bit flips across the parameters and the optimizer state of the built-in
    model, each in a random leaf: all change `state_checksum`."""
    program = build_program(load_config("tiny", []), replica_mesh(jax.devices()[:1]))
    state = jax.device_get(program.init(jnp.int32(0)))
    leaves, treedef = jax.tree.flatten({k: state[k] for k in ("params", "opt")})
    base = state_checksum(jax.tree.unflatten(treedef, leaves))
    rng = np.random.default_rng(2)
    for _ in range(100):
        i = int(rng.choice([i for i, x in enumerate(leaves) if np.size(x)]))
        x = np.asarray(leaves[i])
        flipped = list(leaves)
        flipped[i] = _flip(x, int(rng.integers(x.size)), int(rng.integers(8 * x.dtype.itemsize)))
        assert state_checksum(jax.tree.unflatten(treedef, flipped)) != base, treedef


def _placed(tree, specs, devices):
    mesh = replica_mesh(jax.devices()[:devices])
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)


def test_the_same_state_has_the_same_checksum_on_a_full_and_a_reduced_degree_replica():
    """The built-in model's state on 4, 2 and 1 devices (a full replica and its reduced degrees, as
    tests/integration/test_update_bits.py builds them), and its host copy: one checksum."""
    cfg = load_config("tiny", ["mesh.hosts=4", "mesh.devices_per_host=1"])
    sums = {}
    for devices in (4, 2, 1):
        program = build_program(cfg, replica_mesh(jax.devices()[:devices]))
        state = program.init(jnp.int32(0))
        sums[devices] = state_checksum(state)
    sums["host"] = state_checksum(jax.tree.map(jnp.asarray, jax.device_get(state)))  # unsharded: jit's path
    assert len(set(sums.values())) == 1, sums


def test_any_sharding_of_any_leaf_gives_the_same_sums():
    """Rows, columns, a 3-d leaf's middle axis, an 8-byte dtype (two words an element), a scalar and
    a replicated leaf; on 4 and 2 devices and on one: the same checksum. The blocks' indices are
    global: a leaf with two shards swapped is another state (with shard-local indices it would not
    be)."""
    rng = np.random.default_rng(3)
    tree = {
        "rows": rng.standard_normal((8, 6)).astype(np.float32),
        "cols": rng.standard_normal((3, 8)).astype(np.float32),
        "cube": rng.integers(0, 1 << 30, (2, 4, 5)).astype(np.int32),
        "pair": (rng.standard_normal((4, 3)) + 1j * rng.standard_normal((4, 3))).astype(np.complex64),
        "scalar": np.float32(3.0),
        "copy": rng.standard_normal(5).astype(np.float16),
    }
    specs = {
        "rows": P("fsdp"),
        "cols": P(None, "fsdp"),
        "cube": P(None, "fsdp", None),
        "pair": P("fsdp"),
        "scalar": P(),
        "copy": P(),
    }
    want = tree_checksum(jax.tree.map(jnp.asarray, tree))
    assert {tree_checksum(_placed(tree, specs, n)) for n in (4, 2, 1)} == {want}
    swapped = {"rows": tree["rows"][[2, 3, 0, 1, 4, 5, 6, 7]]}  # the first two shards of 4 swapped
    assert tree_checksum(_placed(swapped, {"rows": P("fsdp")}, 4)) != tree_checksum(
        _placed({"rows": tree["rows"]}, {"rows": P("fsdp")}, 4)
    )


def test_the_checksum_moves_no_leaf_between_devices():
    """The compiled program over a state sharded on 4 devices has exactly one collective, an
    all-reduce of the per-leaf sums (uint32[leaves, 2]): no all-gather, nothing of a leaf's size."""
    program = build_program(load_config("tiny", ["mesh.hosts=4"]), replica_mesh(jax.devices()[:4]))
    state = program.init(jnp.int32(0))
    leaves = jax.tree.leaves({k: state[k] for k in ("params", "opt")})
    mesh, specs = digest._layout(tuple((x.shape, x.dtype, x.sharding) for x in leaves))
    assert any(s != P() for s in specs)  # (something is sharded)
    text = digest._sharded_program(mesh, specs).lower(*leaves).compile().as_text()
    collectives = re.findall(
        r"= (\S+) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(", text
    )
    assert collectives == [(f"u32[{len(leaves)},2]{{1,0}}", "all-reduce")], collectives


def test_all_finite_finds_one_nan_or_infinity_in_any_float_leaf_of_any_sharding():
    from ftjax.program.digest import all_finite

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("fsdp",))
    w = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("fsdp")))
    tree = {"w": w, "b": jnp.zeros(3, jnp.bfloat16), "count": jnp.array(7, jnp.int32)}
    assert all_finite(tree) and all_finite({"count": jnp.array(1)}) and all_finite({})
    assert not all_finite({**tree, "w": w.at[7, 3].set(jnp.nan)})
    assert not all_finite({**tree, "b": tree["b"].at[1].set(-jnp.inf)})
