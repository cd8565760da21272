"""Regions of a leaf's global array, and arrays assembled from pieces that cover one.

A region is `((start, stop), ...)`, one pair per dimension of the leaf's global shape. Shards of one
sharding never overlap, but two shardings (a source's and a newcomer's in catch-up, a full and a
reduced replica's in the gradient lanes) cut a leaf differently: a region of one is then made of
parts of the other's pieces.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numpy.typing import DTypeLike

Region = tuple[tuple[int, int], ...]  # [start, stop) in each dimension of a leaf's global shape
HOST_ALIGN = 64  # bytes: XLA's CPU client places a host array aligned to this without a copy


def aligned_empty(n: int, dtype: DTypeLike) -> np.ndarray:
    """An empty 1-d array of n elements whose first byte is at a multiple of `HOST_ALIGN` (numpy's
    large allocations begin 16 bytes past a page)."""
    raw = np.empty(n * np.dtype(dtype).itemsize + HOST_ALIGN, np.uint8)
    start = -raw.ctypes.data % HOST_ALIGN
    return raw[start : start + n * np.dtype(dtype).itemsize].view(dtype)


class LayoutMismatch(ValueError):
    """Pieces that do not cover the region asked for (the message names the leaf)."""


class Piece(NamedTuple):
    leaf: str  # the leaf's tree path (jax.tree_util.keystr), or its index
    region: Region
    data: np.ndarray  # the region's values


def region_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> Region:
    """The region of a shard's index (a tuple of slices) into an array of `shape`."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def size(region: Region) -> int:
    return math.prod(b - a for a, b in region)


def contains(outer: Region, inner: Region) -> bool:
    return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner))


def within(region: Region, outer: Region) -> tuple[slice, ...]:
    """The slices that pick `region` out of an array holding `outer`."""
    return tuple(slice(c - a, d - a) for (a, _), (c, d) in zip(outer, region))


def assemble(
    pieces: list[Piece], region: Region, dtype: DTypeLike, leaf: str, source: str = "the source"
) -> np.ndarray:
    """The values of `region`: the piece that is exactly it, else the parts of the pieces that
    overlap it (pieces must not overlap each other). Raises LayoutMismatch if they do not cover it."""
    for p in pieces:
        if p.region == region:
            return p.data
    out = np.empty([b - a for a, b in region], dtype)
    covered = 0
    for p in pieces:
        overlap = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(region, p.region))
        if any(lo >= hi for lo, hi in overlap):
            continue
        out[within(overlap, region)] = p.data[within(overlap, p.region)]
        covered += size(overlap)
    if covered != size(region):
        raise LayoutMismatch(
            f"{leaf}: this host needs region {list(region)}, of which {source} "
            f"sent {covered} of {size(region)} elements (do the replicas' layouts differ?)"
        )
    return out
