"""Bitwise digests of a train state: how replicas, tests and the launcher check that they agree.

Two of them (docs/design/recovery.md, "Bitwise agreement and divergence"):

- `state_checksum`, every step (`ft.digest_every`), what the coordinator compares: per leaf two
  32-bit sums over its elements of a mix of each element's bits and its global index, computed on
  the devices by one compiled program (each device sums its shard, and only those scalars cross
  devices), then combined on the host. Any change of one element changes it; it does not depend
  on how a leaf is sharded, so a reduced-degree replica computes the same one.
- `state_digest` / `params_digest`, a sha256 of the full bytes on the host: at durable
  checkpoints and at the end of a run (what the launcher compares, what a reader of a checkpoint
  can recompute without ftjax).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ftjax.base.trees import PyTree


def host_values(leaves: list[PyTree]) -> list[np.ndarray]:
    """The full values of `leaves`, on this host. The multi-process sharded ones are gathered by
    one compiled program (an identity whose outputs are replicated: XLA all-gathers them), not one
    per leaf as `process_allgather` does: a replica's hosts digest every step, and each program's
    first call compiles. Collective when some leaf is sharded across processes."""
    sharded = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and not x.is_fully_addressable]
    out: list[np.ndarray | None] = [
        None if i in sharded else np.asarray(jax.device_get(x)) for i, x in enumerate(leaves)
    ]
    if sharded:
        xs = [leaves[i] for i in sharded]
        gathered = _replicate(tuple(x.sharding.update(spec=P()) for x in xs))(xs)
        for i, v in zip(sharded, gathered):
            out[i] = np.asarray(v.addressable_data(0))
    return cast(list[np.ndarray], out)  # (every one is set by now)


@functools.lru_cache(maxsize=8)
def _replicate(shardings: tuple) -> Callable[[list[jax.Array]], list[jax.Array]]:
    return jax.jit(lambda xs: xs, out_shardings=list(shardings))


def tree_digest(tree: PyTree) -> str:
    """sha256 (first 16 hex digits) of every leaf's path, dtype, shape and bytes, in tree order.

    Collective in multi-process replicas (every process must call it)."""
    h = hashlib.sha256()
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    for (path, _), v in zip(flat, host_values([leaf for _, leaf in flat])):
        h.update(f"{jax.tree_util.keystr(path)}|{v.dtype}|{v.shape}|".encode())
        h.update(np.ascontiguousarray(v).tobytes())
    return h.hexdigest()[:16]


def state_digest(state: dict) -> str:
    """Digest of parameters, optimizer state and model state (batch statistics, ...), not of the
    step counter."""
    return tree_digest({k: state[k] for k in ("params", "opt", "model_state") if k in state})


def params_digest(state: dict) -> str:
    """`tree_digest` of the parameters alone, every dict key made a string: the tree that a plain
    orbax restore of a checkpoint's `params` returns (orbax stores dict keys as strings; an NNX
    model's layer lists are int-keyed dicts in memory), so that a program without ftjax can
    recompute it (docs/design/checkpoints.md, "Checkpoint layout"). Collective, as `tree_digest`."""
    return tree_digest(_string_keys(state["params"]))


def _string_keys(tree: PyTree) -> PyTree:
    if isinstance(tree, dict):
        return {str(k): _string_keys(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):  # (a named tuple's paths are its fields)
        return [_string_keys(v) for v in tree]
    return tree


# --- the per-step checksum --------------------------------------------------------------------------
_INDEX_MUL = 0x9E3779B9  # an element's key: its flat global index times this (odd: distinct keys)
_MIX = (0x85EBCA6B, 0xC2B2AE35)  # murmur3's finalizer: a bijection of uint32 that spreads every bit


def _fmix32(h: jax.Array) -> jax.Array:
    h = h ^ (h >> 16)
    h = h * jnp.uint32(_MIX[0])
    h = h ^ (h >> 13)
    h = h * jnp.uint32(_MIX[1])
    return h ^ (h >> 16)


def _words(x: jax.Array) -> jax.Array:
    """The raw bits of `x` as uint32, one word per element (an element of 8 or 16 bytes: a trailing
    axis of words). No reshape: a sharded leaf stays sharded as it is."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = jnp.dtype(x.dtype).itemsize
    if size >= 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * size}")).astype(jnp.uint32)


def _sums(x: jax.Array, offsets: Sequence[jax.Array | int] = (), global_shape: Sequence[int] = ()) -> jax.Array:
    """uint32[2]: over the words of `x` (the block of a leaf at `offsets` in a leaf of
    `global_shape`; default: the whole leaf), the sums mod 2^32 of m_i and of m_i * (2i + 1), where
    m_i = fmix32(word_i ^ (i * 0x9E3779B9)) and i is the word's flat index in the whole leaf. For
    each i, m_i is a bijection of the word: a change of one word always changes the first sum.
    Integer sums do not depend on the order of their terms: blocks' sums added up give the same
    bits however the leaf is cut.

    A nested jit: the leaves of a state repeat a few block shapes (every layer's, and the optimizer
    moments' of each parameter), and a signature traced once is looked up for the others, so the
    digest program of a replica's state traces in a fraction of the time (it is traced on the
    first commit of every incarnation: a restart waits for it). Integer arithmetic: the same bits."""
    return _sums_traced(x, tuple(offsets), tuple(global_shape))


@functools.partial(jax.jit, static_argnums=(2,))
def _sums_traced(x: jax.Array, offsets: Sequence[jax.Array | int], global_shape: Sequence[int]) -> jax.Array:
    w = _words(x)
    offsets = tuple(offsets) + (0,) * (w.ndim - len(offsets))
    global_shape = tuple(global_shape) + w.shape[len(global_shape) :]
    index, stride = jnp.zeros(w.shape, jnp.uint32), 1
    for d in reversed(range(w.ndim)):
        at = jax.lax.broadcasted_iota(jnp.uint32, w.shape, d) + jnp.asarray(offsets[d]).astype(jnp.uint32)
        index = index + at * jnp.uint32(stride % (1 << 32))
        stride *= global_shape[d]
    m = _fmix32(w ^ (index * jnp.uint32(_INDEX_MUL)))
    weighted = m * (index * jnp.uint32(2) + jnp.uint32(1))
    # One variadic reduce for both sums: XLA fuses it with the mix (a plain sum is rewritten by
    # XLA:CPU into a tree of windows over a materialized copy of its input: 15x slower here).
    zero = jnp.uint32(0)
    return jnp.stack(
        jax.lax.reduce((m, weighted), (zero, zero), lambda a, b: (a[0] + b[0], a[1] + b[1]), tuple(range(w.ndim)))
    )


def _block_sums(x: jax.Array, spec: P, mesh: Mesh) -> jax.Array:
    """`_sums` of this device's block of a leaf laid out by `spec` (inside `shard_map`): its offset
    from the device's position along the axes each dimension is split over; zero where the device
    holds a copy that another device counts (a leaf replicated over a mesh axis counts once)."""
    offsets: list[jax.Array | int] = []
    global_shape: list[int] = []
    used: set[str] = set()
    for d, n in enumerate(x.shape):
        position = 0
        for name in _names(spec, d):
            position = position * mesh.shape[name] + jax.lax.axis_index(name)
        offsets.append(position * n)
        global_shape.append(n * _split(spec, d, mesh))
        used.update(_names(spec, d))
    counted = jnp.bool_(True)
    for name in mesh.axis_names:
        if name not in used:
            counted = counted & (jax.lax.axis_index(name) == 0)
    return jnp.where(counted, _sums(x, offsets, global_shape), jnp.uint32(0))


@functools.lru_cache(maxsize=8)
def _sharded_program(mesh: Mesh, specs: tuple) -> Callable[..., jax.Array]:
    """The sums of every leaf in one program over `mesh`: each device sums its blocks, and one
    all-reduce of uint32[leaves, 2] adds them up (the only data that crosses devices)."""

    def per_device(*leaves):
        return jax.lax.psum(jnp.stack([_block_sums(x, s, mesh) for x, s in zip(leaves, specs)]), mesh.axis_names)

    body = jax.shard_map(per_device, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)
    return jax.jit(lambda *leaves: body(*leaves), out_shardings=jax.sharding.NamedSharding(mesh, P()))


@jax.jit
def _plain_program(*leaves: jax.Array) -> jax.Array:
    return jnp.stack([_sums(x, (), x.shape) for x in leaves])


def _layout(leaves: tuple) -> tuple[Mesh, tuple] | None:
    """(mesh, specs) when every leaf (shape, dtype, sharding) is laid out by a NamedSharding on one
    mesh in equal blocks (what `shard_map` takes), else None."""
    shardings = [sharding for _, _, sharding in leaves]
    if not all(isinstance(s, jax.sharding.NamedSharding) for s in shardings):
        return None
    mesh = shardings[0].mesh
    for shape, _, s in leaves:
        if s.mesh != mesh or any(n % _split(s.spec, d, mesh) for d, n in enumerate(shape)):
            return None
    return mesh, tuple(s.spec for s in shardings)


def _names(spec: P, d: int) -> tuple:
    """The mesh axes dimension `d` is split over (major first)."""
    names = spec[d] if d < len(spec) else None
    return () if names is None else (names,) if isinstance(names, str) else tuple(names)


def _split(spec: P, d: int, mesh: Mesh) -> int:
    return int(np.prod([mesh.shape[name] for name in _names(spec, d)], dtype=np.int64))


def leaf_sums(leaves: list) -> np.ndarray:
    """uint32[len(leaves), 2]: `_sums` of each whole leaf, computed on the devices; the same bits
    whatever the leaves' shardings. Collective in multi-process replicas (every process must call
    it), as any program over the state is."""
    if not leaves:
        return np.zeros((0, 2), np.uint32)
    leaves = [x if isinstance(x, jax.Array) else jnp.asarray(x) for x in leaves]
    out = _program(tuple((x.shape, x.dtype, x.sharding) for x in leaves))(*leaves)
    return np.asarray(out.addressable_data(0))


@functools.lru_cache(maxsize=16)
def _program(leaves: tuple) -> Callable[..., jax.Array]:
    """The program for leaves of these (shape, dtype, sharding)s (looked up once per layout)."""
    layout = _layout(leaves)
    return _plain_program if layout is None else _sharded_program(*layout)


def tree_checksum(tree: PyTree) -> str:
    """sha256 (first 16 hex digits) of every leaf's path, dtype and shape and its two sums
    (`leaf_sums`, little-endian), in tree order: 64 bits from a few bytes per leaf on the host."""
    leaves, treedef = jax.tree.flatten(tree)
    sums = leaf_sums(leaves)
    heads = _headers(treedef, tuple((np.shape(x), x.dtype) for x in leaves))
    return hashlib.sha256(b"".join(h + row.astype("<u4").tobytes() for h, row in zip(heads, sums))).hexdigest()[:16]


@functools.lru_cache(maxsize=16)
def _headers(treedef: jax.tree_util.PyTreeDef, leaves: tuple) -> tuple[bytes, ...]:
    """Each leaf's `PATH|DTYPE|SHAPE|` (as `tree_digest` writes them), once per tree layout."""
    numbered = jax.tree.unflatten(treedef, range(len(leaves)))
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(numbered)[0]]
    return tuple(
        f"{jax.tree_util.keystr(p)}|{dtype}|{tuple(shape)}|".encode() for p, (shape, dtype) in zip(paths, leaves)
    )


def state_checksum(state: dict) -> str:
    """The per-step digest replicas compare: `tree_checksum` of what `state_digest` covers
    (parameters, optimizer state, model state; not the step counter)."""
    return tree_checksum({k: state[k] for k in ("params", "opt", "model_state") if k in state})


def all_finite(tree: PyTree) -> bool:
    """Whether every floating-point element of `tree` is finite: one compiled reduction on the
    devices, one boolean to the host (collective when a leaf is sharded across processes)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return bool(_all_finite(leaves)) if leaves else True


@jax.jit
def _all_finite(leaves: list) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))
