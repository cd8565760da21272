"""A replica's mesh, and the one place where logical axis names become mesh axes.

Models annotate each parameter with logical axis names (`("vocab", "embed")`, `("embed", "mlp")`,
`("embed", "heads", "head_dim")`, ...). FSDP inside a replica shards every parameter along its
`embed` dimension over the `fsdp` axis. With `mesh.tensor: T > 1` the mesh is `fsdp x tensor` (T
consecutive devices of a host form a tensor group) and the heads, the MLP's hidden dimension and
the vocabulary (`heads`, `kv_heads`, `qkv`, `mlp`, `vocab`) are split over `tensor` (Megatron-style
tensor parallelism, here by sharding annotations: XLA inserts the collectives). Everything else is
replicated. Optimizer state follows its parameter. Batches are split along their first dimension
over `fsdp` and replicated over `tensor` (a tensor group computes the same rows together), and so
are the activations the models constrain (`constrain_rows`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ftjax.base.trees import PyTree

FSDP = "fsdp"
TENSOR = "tensor"
REPLICA = "replica"  # only in the synchronous HSDP baseline mesh

# logical axis name -> mesh axis (None: replicated). Names not listed, and axes the mesh does not
# have (`tensor` on a mesh without tensor parallelism), are replicated.
LOGICAL_AXIS_RULES: Mapping[str, str | None] = {
    "embed": FSDP,
    "vocab": TENSOR,  # the embedding and output projection vocabulary-parallel (Megatron's), the logits too
    "mlp": TENSOR,
    "qkv": TENSOR,
    "heads": TENSOR,  # query heads (llama: attention's output projection too)
    "kv_heads": TENSOR,  # key/value heads of grouped-query attention
    "head_dim": None,
    "seq": None,
    "layers": None,  # a scanned model's stacking axis (model.scan_layers): every device holds every layer's shard
}


def replica_mesh(devices: list | None = None, tensor: int = 1) -> Mesh:
    """All of this replica's devices (every host's): one `fsdp` axis, or `fsdp x tensor` when
    `tensor` > 1 (groups of `tensor` consecutive devices; the config makes it divide a host's).

    Device order is JAX's global order, so process i holds a contiguous block of the fsdp axis and
    its local shards are the i-th slice of every fsdp-sharded dimension: the same layout on every
    replica of the same topology, which FTAR relies on (host rank h of each replica owns the same
    shards). A reduced-degree replica keeps `tensor` and has fewer fsdp rows.
    """
    devices = jax.devices() if devices is None else devices
    if tensor == 1:
        return Mesh(np.asarray(devices), (FSDP,))
    if len(devices) % tensor:
        raise ValueError(f"mesh: {len(devices)} devices are not groups of tensor={tensor}")
    return Mesh(np.asarray(devices).reshape(-1, tensor), (FSDP, TENSOR))


def hsdp_mesh(devices: list, replicas: int) -> Mesh:
    """Synchronous HSDP baseline: `replicas` x `fsdp` devices; parameters are sharded over `fsdp`
    and replicated over `replica`, batches split over both (see `batch_sharding`)."""
    return Mesh(np.asarray(devices).reshape(replicas, -1), (REPLICA, FSDP))


def logical_to_mesh(spec: P, axes: tuple[str, ...] = (FSDP,)) -> P:
    """The mesh PartitionSpec of a logical one, on a mesh with `axes`. A mesh axis is used once
    per leaf (the first dimension that maps to it), as a PartitionSpec requires."""
    out, used = [], set()
    for name in spec:
        axis = LOGICAL_AXIS_RULES.get(name) if isinstance(name, str) else None
        if axis not in axes or axis in used:
            axis = None
        used.add(axis)
        out.append(axis)
    return P(*out)


def param_shardings(logical_specs: PyTree, mesh: Mesh, shapes: PyTree) -> PyTree:
    """A tree of NamedShardings for a tree of logical PartitionSpecs and the parameters'
    ShapeDtypeStructs (`shapes`, the same structure: ValueError otherwise). A dimension that the
    `tensor` axis does not divide stays whole (a vocabulary of 50257 on 2): its size is the same on
    every degree of a replica, so the layout is too (fsdp, which a reduced-degree replica shrinks,
    must divide what it splits)."""
    axes = tuple(mesh.axis_names)

    def one(path, spec: P, shape: jax.ShapeDtypeStruct) -> NamedSharding:
        unknown = [n for n in spec if isinstance(n, str) and n not in LOGICAL_AXIS_RULES]
        if unknown:  # (a misspelt name would leave the parameter whole on every device, silently)
            raise Indivisible(
                f"parameter {jax.tree_util.keystr(path)}: logical axis {unknown[0]!r} is not one of "
                f"{', '.join(LOGICAL_AXIS_RULES)} (ftjax/program/sharding.py; None: not split)"
            )
        split, dims = logical_to_mesh(spec, axes), shape.shape
        if TENSOR in axes:
            t = mesh.shape[TENSOR]
            split = P(*(None if a == TENSOR and i < len(dims) and dims[i] % t else a for i, a in enumerate(split)))
        for i, a in enumerate(split[: len(dims)]):
            ways = math.prod(mesh.shape[n] for n in ((a,) if isinstance(a, str) else a or ()))
            if dims[i] % ways:  # (jax would say so only when the step is compiled, in a traceback)
                raise Indivisible(
                    f"parameter {jax.tree_util.keystr(path)} {tuple(dims)}: its dimension {i} ({dims[i]}, logical "
                    f"axis {spec[i]!r}) is split {ways} ways over mesh axis {a!r}, which does not divide it"
                )
        return NamedSharding(mesh, split)

    return jax.tree_util.tree_map_with_path(one, logical_specs, shapes, is_leaf=lambda x: isinstance(x, P))


class Indivisible(ValueError):
    """A parameter the mesh cannot split as its logical axes ask: a dimension the mesh axes it is
    split over do not divide, or a logical axis name that is not in LOGICAL_AXIS_RULES."""


def follow_params(tree_shape: PyTree, params_sharding: PyTree, mesh: Mesh) -> PyTree:
    """Shardings for an optimizer state: a leaf whose key path ends with a parameter's key path
    (and has its shape) gets that parameter's sharding; everything else (counts, scalars) is
    replicated. This holds for optax's states, whose moments mirror the parameter tree."""
    by_path = {}
    for path, sh in jax.tree_util.tree_flatten_with_path(params_sharding)[0]:
        by_path[tuple(path)] = sh
    replicated = NamedSharding(mesh, P())

    def pick(path, leaf):
        path = tuple(path)
        for i in range(len(path)):
            sh = by_path.get(path[i:])
            if sh is not None and len(sh.spec) <= len(getattr(leaf, "shape", ())):
                return sh
        return replicated

    return jax.tree_util.tree_map_with_path(pick, tree_shape)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows split over the data axes (all but `tensor`, whose groups share their rows); any
    trailing axes whole."""
    return NamedSharding(mesh, P(tuple(a for a in mesh.axis_names if a != TENSOR)))


_ROWS: ContextVar[NamedSharding | None] = ContextVar("ftjax_rows", default=None)


@contextmanager
def rows_split(batch: NamedSharding) -> Iterator[None]:
    """While a replica's step is traced: its rows are split as `batch` (`batch_sharding`), which
    `constrain_rows` then says of an activation. Tracing is Python, so a context variable carries it
    (jax.set_mesh may not be entered inside jit)."""
    token = _ROWS.set(batch)
    try:
        yield
    finally:
        _ROWS.reset(token)


def constrain_rows(x: jax.Array) -> jax.Array:
    """x [rows, ...] split over the data axes like the batch's rows while a step is traced
    (`rows_split`), the rest of it whole; as is elsewhere. XLA's partitioner does not carry the
    rows' split into the activations on its own: it split the built-in models' residual stream along
    the width like their `embed`-sharded parameters, and every device computed every row
    (docs/design/model.md, "Rows")."""
    batch = _ROWS.get()
    if batch is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(batch.mesh, P(batch.spec[0], *[None] * (x.ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def describe(state: PyTree) -> str:
    """A stable text of every leaf's path, shape, dtype and partition spec, one `path: ...` line
    per leaf (`state`: ShapeDtypeStructs with shardings; part of the topology fingerprint)."""
    rows = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        rows.append(f"{jax.tree_util.keystr(path)}: {tuple(leaf.shape)} {leaf.dtype} {tuple(leaf.sharding.spec)}")
    return "\n".join(rows)
