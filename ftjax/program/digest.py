"""Bitwise digests of a train state: how tests and the launcher check that replicas agree."""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P


def host_values(leaves: list[Any]) -> list[np.ndarray]:
    """The full values of `leaves`, on this host. The multi-process sharded ones are gathered by
    one compiled program (an identity whose outputs are replicated: XLA all-gathers them), not one
    per leaf as `process_allgather` does: a replica's hosts digest every step, and each program's
    first call compiles. Collective when some leaf is sharded across processes."""
    sharded = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and not x.is_fully_addressable]
    out = [None if i in sharded else np.asarray(jax.device_get(x)) for i, x in enumerate(leaves)]
    if sharded:
        xs = [leaves[i] for i in sharded]
        gathered = _replicate(tuple(x.sharding.update(spec=P()) for x in xs))(xs)
        for i, v in zip(sharded, gathered):
            out[i] = np.asarray(v.addressable_data(0))
    return out


@functools.lru_cache(maxsize=8)
def _replicate(shardings: tuple) -> Any:
    return jax.jit(lambda xs: xs, out_shardings=list(shardings))


def tree_digest(tree: Any) -> str:
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
    recompute it (docs/design.md, "Checkpoint layout"). Collective, as `tree_digest`."""
    return tree_digest(_string_keys(state["params"]))


def _string_keys(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {str(k): _string_keys(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):  # (a named tuple's paths are its fields)
        return [_string_keys(v) for v in tree]
    return tree
