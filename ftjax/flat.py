"""A host's gradient shards as one flat buffer, and back.

FTAR reduces one flat buffer per host rank. Host h of every replica holds the same shards of every
leaf (the topology fingerprint guarantees it), so the buffer of host h of every replica has the same
layout: leaves in tree order, and for each leaf the distinct shards this host holds, in device
order. A replicated leaf contributes one copy, not one per device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np


@dataclass(frozen=True)
class _Piece:
    leaf: int
    index: tuple  # the shard's index into the global array
    shape: tuple
    offset: int
    size: int


class HostFlattener:
    """Fixed layout for one tree structure and sharding; `flatten` and `unflatten` are inverses."""

    def __init__(self, tree_shape: Any, shardings: Any, dtype=np.float32):
        self.treedef = jax.tree.structure(tree_shape)
        self.shapes = [tuple(x.shape) for x in jax.tree.leaves(tree_shape)]
        self.shardings = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
        self.dtype = np.dtype(dtype)
        pieces, offset = [], 0
        for i, (shape, sharding) in enumerate(zip(self.shapes, self.shardings)):
            seen = set()
            for device, index in sorted(sharding.addressable_devices_indices_map(shape).items(),
                                        key=lambda kv: kv[0].id):
                key = _index_key(index, shape)
                if key in seen:
                    continue
                seen.add(key)
                pshape = tuple(len(range(*s.indices(n))) for s, n in zip(index, shape))
                size = int(np.prod(pshape, dtype=np.int64))
                pieces.append(_Piece(i, key, pshape, offset, size))
                offset += size
        self.pieces = pieces
        self.size = offset

    def flatten(self, tree: Any, out: np.ndarray | None = None) -> np.ndarray:
        """This host's shards of `tree` copied into one flat buffer (device -> host)."""
        out = np.empty(self.size, self.dtype) if out is None else out
        leaves = jax.tree.leaves(tree)
        shards = [{_index_key(s.index, self.shapes[i]): s for s in leaf.addressable_shards}
                  for i, leaf in enumerate(leaves)]
        for p in self.pieces:
            out[p.offset:p.offset + p.size] = np.asarray(shards[p.leaf][p.index].data).reshape(-1)
        return out

    def unflatten(self, flat: np.ndarray) -> Any:
        """Arrays with the original shardings, built from this host's part of a flat buffer (host -> device)."""
        by_leaf: dict[int, dict[tuple, np.ndarray]] = {}
        for p in self.pieces:
            by_leaf.setdefault(p.leaf, {})[p.index] = flat[p.offset:p.offset + p.size].reshape(p.shape)
        leaves = []
        for i, (shape, sharding) in enumerate(zip(self.shapes, self.shardings)):
            arrays = [jax.device_put(by_leaf[i][_index_key(index, shape)], device)
                      for device, index in sharding.addressable_devices_indices_map(shape).items()]
            leaves.append(jax.make_array_from_single_device_arrays(shape, sharding, arrays))
        return jax.tree.unflatten(self.treedef, leaves)


def _index_key(index: tuple, shape: tuple) -> tuple:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))
