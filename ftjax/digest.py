"""Bitwise digests of a train state: how tests and the launcher check that replicas agree."""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import numpy as np


def host_value(x: Any) -> np.ndarray:
    """The full value of a (possibly multi-process sharded) array, on this host."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def tree_digest(tree: Any) -> str:
    """sha256 (first 16 hex digits) of every leaf's path, dtype, shape and bytes, in tree order.

    Collective in multi-process replicas (every process must call it)."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        v = host_value(leaf)
        h.update(f"{jax.tree_util.keystr(path)}|{v.dtype}|{v.shape}|".encode())
        h.update(np.ascontiguousarray(v).tobytes())
    return h.hexdigest()[:16]


def state_digest(state: dict) -> str:
    """Digest of parameters and optimizer state (not of the step counter)."""
    return tree_digest({"params": state["params"], "opt": state["opt"]})
