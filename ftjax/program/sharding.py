"""A replica's mesh, and the one place where logical axis names become mesh axes.

Models annotate each parameter with logical axis names (`("vocab", "embed")`, `("embed", "mlp")`,
`("embed", "heads", "head_dim")`, ...). FSDP inside a replica shards every parameter along its
`embed` dimension over all of the replica's devices; everything else is replicated. Optimizer
state follows its parameter. Batches are split along their first dimension over the same devices.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

FSDP = "fsdp"
REPLICA = "replica"  # only in the synchronous HSDP baseline mesh

# logical axis name -> mesh axis (None: replicated). Names not listed are replicated.
LOGICAL_AXIS_RULES: Mapping[str, str | None] = {
    "embed": FSDP,
    "vocab": None,
    "mlp": None,
    "qkv": None,
    "heads": None,  # query heads (llama: attention's output projection too)
    "kv_heads": None,  # key/value heads of grouped-query attention
    "head_dim": None,
    "seq": None,
}


def replica_mesh(devices: list | None = None) -> Mesh:
    """All of this replica's devices (every host's) along one `fsdp` axis.

    Device order is JAX's global order, so process i holds a contiguous block of the axis and its
    local shards are the i-th slice of every sharded dimension: the same layout on every replica
    of the same topology, which FTAR relies on (host rank h of each replica owns the same shards).
    """
    devices = jax.devices() if devices is None else devices
    return Mesh(np.asarray(devices), (FSDP,))


def hsdp_mesh(devices: list, replicas: int) -> Mesh:
    """Synchronous HSDP baseline: `replicas` x `fsdp` devices; parameters are sharded over `fsdp`
    and replicated over `replica`, batches split over both (see `batch_sharding`)."""
    return Mesh(np.asarray(devices).reshape(replicas, -1), (REPLICA, FSDP))


def logical_to_mesh(spec: P) -> P:
    return P(*(LOGICAL_AXIS_RULES.get(name) if isinstance(name, str) else None for name in spec))


def param_shardings(logical_specs: Any, mesh: Mesh) -> Any:
    """A tree of NamedShardings for a tree of logical PartitionSpecs."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, logical_to_mesh(s)), logical_specs, is_leaf=lambda x: isinstance(x, P)
    )


def follow_params(tree_shape: Any, params_sharding: Any, mesh: Mesh) -> Any:
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
    return NamedSharding(mesh, P(tuple(mesh.axis_names)))  # rows split; any trailing axes whole


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def describe(state: Any) -> str:
    """A stable text of every leaf's path, shape, dtype and partition spec, one `path: ...` line
    per leaf (`state`: ShapeDtypeStructs with shardings; part of the topology fingerprint)."""
    rows = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        rows.append(f"{jax.tree_util.keystr(path)}: {tuple(leaf.shape)} {leaf.dtype} {tuple(leaf.sharding.spec)}")
    return "\n".join(rows)
