"""Gradient lanes: the job's flat gradient, cut the same way whatever a replica's degree.

FTAR averages one flat buffer per lane, in a ring of its own: member p's `ftar_addresses[l]` for
lane l. There are `lanes` = mesh.hosts of them, fixed for the job: lane l is what host l of a
*full* replica (mesh.hosts hosts of devices_per_host devices, one FSDP axis over all of them) holds
of every leaf: for each leaf in tree order, the distinct shards of that host's devices in device
order (a replicated leaf once). So in a full replica host h serves lane h, and its buffer is what
it holds.

A reduced-degree replica runs on `live` hosts (a divisor of `lanes`) over fewer devices; each of its
devices holds a larger block of every sharded leaf, so host h' holds lanes h'k .. h'k + k - 1
(k = lanes / live) whole, and serves them all: it cuts each lane's pieces out of its shards, and
puts the averaged lanes back into its shards. Replicas of any degree thus average together, and
the result is bitwise the same on every member of a lane's ring; a replicated leaf rides in every
lane at the same offset of buffers of one length, so every lane sums it in the same order and every
host ends with the same bits (docs/design/replicas.md, "Reduced-degree replicas").
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import jax
import numpy as np

from ftjax.base.trees import PyTree
from ftjax.program.sharding import FSDP, TENSOR
from ftjax.runtime.regions import Piece, Region, assemble, contains, region_of, size, within


def served_lanes(host: int, live: int, lanes: int) -> list[int]:
    """The lanes host `host` of a replica of `live` hosts serves: lanes / live consecutive ones."""
    k = lanes // live
    return list(range(host * k, (host + 1) * k))


def lane_host(lane: int, live: int, lanes: int) -> int:
    """The host of a replica of `live` hosts that serves `lane` (the inverse of `served_lanes`)."""
    return lane * live // lanes


def lane_regions(
    shape: tuple[int, ...], spec: Sequence, lanes: int, devices_per_host: int, tensor: int = 1
) -> list[list[Region]]:
    """For each lane, the distinct regions of a leaf of `shape` and partition `spec` that host l of
    a full replica holds, in device order. A full replica's device g sits at (g // tensor,
    g % tensor) of its `fsdp x tensor` mesh (`tensor` divides devices_per_host, so a host holds
    whole tensor groups); a dimension may be sharded over `fsdp` or `tensor`."""
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    counts = {FSDP: lanes * devices_per_host // tensor, TENSOR: tensor}
    if any(name is not None and name not in counts for name in spec):
        raise ValueError(f"partition {spec}: gradient lanes support the '{FSDP}' and '{TENSOR}' axes only")
    out = []
    for lane in range(lanes):
        regions: list[Region] = []
        for g in range(lane * devices_per_host, (lane + 1) * devices_per_host):
            at = {FSDP: g // tensor, TENSOR: g % tensor}
            region = tuple(
                (0, d) if name is None else (at[name] * (d // counts[name]), (at[name] + 1) * (d // counts[name]))
                for d, name in zip(shape, spec)
            )
            if region not in regions:  # replicated over an axis: held once
                regions.append(region)
        out.append(regions)
    return out


class LaneFlattener:
    """The buffers of the lanes this host serves, cut from its shards of a tree, and back.

    `served`: the lanes, ascending. The tree's leaves must be sharded over `shardings` (this host's
    devices: its addressable shards). `flatten` and `unflatten` are inverses."""

    def __init__(
        self,
        tree_shape: PyTree,
        shardings: PyTree,
        *,
        lanes: int,
        devices_per_host: int,
        served: Sequence[int],
        dtype=np.float32,
        tensor: int = 1,
    ):
        self.treedef = jax.tree.structure(tree_shape)
        self.shapes = [tuple(x.shape) for x in jax.tree.leaves(tree_shape)]
        self.shardings = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
        self.served = tuple(served)
        if (
            not self.served
            or list(self.served) != sorted(set(self.served))
            or not 0 <= self.served[0] <= self.served[-1] < lanes
        ):
            raise ValueError(f"served: {list(served)} are not distinct lanes of 0..{lanes - 1}, ascending")
        self.dtype = np.dtype(dtype)
        # per lane: (leaf, region, offset) of each piece; every lane has the same length
        self.pieces: list[list[tuple[int, Region, int]]] = []
        for lane in self.served:
            pieces, offset = [], 0
            for i, (shape, sharding) in enumerate(zip(self.shapes, self.shardings)):
                for region in lane_regions(shape, sharding.spec, lanes, devices_per_host, tensor)[lane]:
                    pieces.append((i, region, offset))
                    offset += size(region)
            self.pieces.append(pieces)
            self.size = offset

    def flatten(self, tree: PyTree) -> list[np.ndarray]:
        """One buffer per served lane, from this host's shards of `tree` (device -> host)."""
        shards = self.host_shards(tree)
        out = []
        for pieces in self.pieces:
            buf = np.empty(self.size, self.dtype)
            for leaf, region, offset in pieces:
                buf[offset : offset + size(region)] = self.piece_data(shards, leaf, region)
            out.append(buf)
        return out

    def unflatten(self, bufs: Sequence[np.ndarray]) -> PyTree:
        """Arrays with the original shardings, from the served lanes' buffers (host -> device)."""
        by_leaf = self.pieces_by_leaf(bufs)
        leaves = [self.leaf_array(i, by_leaf[i]) for i in range(len(self.shapes))]
        return jax.tree.unflatten(self.treedef, leaves)

    def host_shards(self, tree: PyTree) -> list[list[tuple[Region, jax.Shard]]]:
        """Per leaf of `tree`: (region, shard) of each of this host's shards."""
        return [
            [(region_of(s.index, shape), s) for s in leaf.addressable_shards]
            for leaf, shape in zip(jax.tree.leaves(tree), self.shapes)
        ]

    def piece_data(self, shards: list[list[tuple[Region, jax.Shard]]], leaf: int, region: Region) -> np.ndarray:
        """The values of `region` of `leaf`, flat, from the shard that holds it (device -> host)."""
        held, shard = next((r, s) for r, s in shards[leaf] if contains(r, region))
        data = np.asarray(shard.data)
        return (data if held == region else data[within(region, held)]).reshape(-1)

    def pieces_by_leaf(self, bufs: Sequence[np.ndarray]) -> dict[int, list[Piece]]:
        """Per leaf: its pieces, views into the served lanes' buffers `bufs`."""
        by_leaf: dict[int, list[Piece]] = defaultdict(list)
        for buf, pieces in zip(bufs, self.pieces):
            for leaf, region, offset in pieces:
                by_leaf[leaf].append(
                    Piece(str(leaf), region, buf[offset : offset + size(region)].reshape([b - a for a, b in region]))
                )
        return by_leaf

    def leaf_array(self, i: int, pieces: list[Piece], copy: bool = False) -> jax.Array:
        """Leaf i with its sharding, from its pieces (host -> device). `copy`: the array must not
        alias the pieces' memory (a buffer the next step overwrites). A CPU `device_put` of a
        suitably aligned numpy array shares its memory, even with `may_alias=False` (measured:
        tests/integration/test_pipeline.py), so on CPU the piece is copied first."""
        shape, sharding, pieces = self.shapes[i], self.shardings[i], _distinct(pieces)
        arrays = []
        for device, index in sharding.addressable_devices_indices_map(shape).items():
            data = assemble(pieces, region_of(index, shape), self.dtype, f"leaf {i}", f"lanes {list(self.served)}")
            if copy and device.platform == "cpu":
                data = np.array(data, copy=True)
            arrays.append(jax.device_put(data, device, may_alias=False if copy else None))
        return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _distinct(pieces: list[Piece]) -> list[Piece]:
    """The first piece of each region: a replicated leaf comes back from every lane (the same bits)."""
    seen: dict[Region, Piece] = {}
    for p in pieces:
        seen.setdefault(p.region, p)
    return list(seen.values())
