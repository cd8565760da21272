"""One host's gradient path, pipelined: device -> host, FTAR and host -> device overlap.

Serial, the path is three phases end to end: copy every lane to the host, run the ring, put every
leaf back. Here (docs/design/index.md, "The gradient path"):

- every shard's device -> host copy is started at once (`copy_to_host_async`), and a d2h thread
  moves the update into the lane buffers in the order the ring reads them: the segment this member
  sends first, then the ones it adds to as they arrive. The ring waits only for the range it is
  about to read (FTAR's `ready` hook), so it starts on the first block while later ones still copy;
- an h2d thread puts each leaf back on its devices as soon as the ring has finalised every element
  of it (FTAR's `on_result` hook), while the ring still moves the others.

The lane and result buffers are allocated once per job. The math is unchanged: the same bytes
enter the ring, the same bits leave it (tests/integration/test_pipeline.py holds both paths equal).
"""

from __future__ import annotations

import bisect
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ftjax.base.trees import PyTree
from ftjax.ftar.ring import segment_bounds
from ftjax.runtime.lanes import LaneFlattener
from ftjax.runtime.regions import aligned_empty, size

BLOCK_ELEMS = 1 << 20  # d2h progress is tracked per block of a piece (4 MiB of float32)


@dataclass
class Averaged:
    """A step's average: `flat`, the lanes end to end (the pipeline reuses this memory within two
    steps: `detach` copies it), and `tree`, already on the devices (None: not put back yet; on CPU
    its arrays share `flat`'s memory: apply it before the step after next)."""

    flat: np.ndarray
    tree: PyTree | None = None


@dataclass
class Phases:
    """Seconds of one step's gradient path: d2h and h2d are their threads' busy time, ring the
    calls' wall time, wall the whole; `overlap` the share of d2h + ring + h2d hidden behind each other.
    `grad_bytes`: what this host's update moved each way (0: it relayed zeros, nothing left the devices)."""

    d2h_s: float = 0.0
    ring_s: float = 0.0
    h2d_s: float = 0.0
    wall_s: float = 0.0
    grad_bytes: int = 0

    def record(self) -> dict:
        total = self.d2h_s + self.ring_s + self.h2d_s
        overlap = max(0.0, 1.0 - self.wall_s / total) if total > 0 else 0.0
        return {
            "d2h_s": self.d2h_s,
            "ring_s": self.ring_s,
            "h2d_s": self.h2d_s,
            "reduce_wall_s": self.wall_s,
            "overlap_share": round(overlap, 4),
            "grad_bytes": self.grad_bytes,
        }


class _Blocks:
    """The lanes' pieces cut into blocks, and which blocks of this step the d2h thread has filled."""

    def __init__(self, flat: LaneFlattener, block_elems: int):
        self.blocks: list[list[tuple[int, int, int]]] = []  # per lane: (piece, start, stop), ascending
        for pieces in flat.pieces:
            lane = []
            for p, (_, region, offset) in enumerate(pieces):
                n = size(region)
                lane += [(p, a, min(a + block_elems, offset + n)) for a in range(offset, offset + n, block_elems)]
            self.blocks.append(lane)
        self.starts = [[a for _, a, _ in lane] for lane in self.blocks]
        self.filled = [np.zeros(len(lane), bool) for lane in self.blocks]
        self.error: BaseException | None = None
        self.cond = threading.Condition()

    def reset(self) -> None:
        for f in self.filled:
            f[:] = False
        self.error = None

    def span(self, lane: int, a: int, b: int) -> range:
        """The blocks of `lane` that overlap elements [a, b)."""
        return range(max(0, bisect.bisect_right(self.starts[lane], a) - 1), bisect.bisect_left(self.starts[lane], b))

    def wait(self, lane: int, a: int, b: int) -> None:
        """Return once elements [a, b) of `lane` are filled (raise the d2h thread's error if it failed)."""
        blocks, filled = self.span(lane, a, b), self.filled[lane]
        if all(filled[k] for k in blocks):
            return
        with self.cond:
            while self.error is None and not all(filled[k] for k in blocks):
                self.cond.wait()
            if self.error is not None:
                raise self.error

    def mark(self, lane: int, k: int) -> None:
        with self.cond:
            self.filled[lane][k] = True
            self.cond.notify_all()

    def fail(self, err: BaseException) -> None:
        with self.cond:
            self.error = err
            self.cond.notify_all()

    def order(self, rank: int, world: int, size_: int) -> list[tuple[int, int]]:
        """(lane, block) in the order the ring of member `rank` of `world` first reads them: its own
        segment `rank` (sent first), then rank - 1, rank - 2, ... (added to as they arrive)."""
        bounds = segment_bounds(size_, world)

        def need(a: int, b: int) -> int:
            first, last = bisect.bisect_right(bounds, a) - 1, bisect.bisect_right(bounds, b - 1) - 1
            return min((rank - s) % world for s in range(first, min(last, world - 1) + 1))

        keyed = [(need(a, b), lane, a, k) for lane, bl in enumerate(self.blocks) for k, (_, a, b) in enumerate(bl)]
        return [(lane, k) for _, lane, _, k in sorted(keyed)]


class _Leaves:
    """Counts, per leaf, the elements of its pieces the ring has finalised; a leaf whose every piece
    is final goes on `ready` (for the h2d thread)."""

    def __init__(self, flat: LaneFlattener):
        self.offsets = [[offset for _, _, offset in pieces] for pieces in flat.pieces]
        self.pieces = flat.pieces
        self.need: dict[int, int] = defaultdict(int)
        for pieces in flat.pieces:
            for leaf, region, _ in pieces:
                self.need[leaf] += size(region)
        self.empty = [i for i in range(len(flat.shapes)) if self.need.get(i, 0) == 0]
        self.covered: dict[int, int] = defaultdict(int)
        self.lock = threading.Lock()
        self.ready: queue.SimpleQueue = queue.SimpleQueue()

    def reset(self) -> None:
        self.covered.clear()
        for leaf in self.empty:
            self.ready.put(leaf)

    def final(self, lane: int, a: int, b: int) -> None:
        offsets, pieces = self.offsets[lane], self.pieces[lane]
        with self.lock:
            j = max(0, bisect.bisect_right(offsets, a) - 1)
            while j < len(pieces) and offsets[j] < b:
                leaf, region, offset = pieces[j]
                overlap = min(b, offset + size(region)) - max(a, offset)
                if overlap > 0:
                    self.covered[leaf] += overlap
                    if self.covered[leaf] == self.need[leaf]:
                        self.ready.put(leaf)
                j += 1


class Pipeline:
    """The pipelined path of one host's lanes. `run(grads, rank, world, call)` fills the lane buffers
    from `grads` (None: a healing member relays zeros) while `call(bufs, outs, hooks)` runs every
    lane's FTAR, and puts the averaged leaves back as they become final."""

    def __init__(self, flat: LaneFlattener, block_elems: int = BLOCK_ELEMS, pinned: bool = False):
        self.flat = flat
        # pinned: the update leaves the devices by one DMA into page-locked host memory (JAX's
        # `pinned_host` memory kind): measured on an H100, 52 GB/s against 1.7 GB/s for pageable
        # copies (README "On a GPU"); on CPU it is one more copy, so the default is off there
        self.pinned = (
            jax.tree.unflatten(flat.treedef, [s.with_memory_kind("pinned_host") for s in flat.shardings])
            if pinned
            else None
        )
        self.bufs = [np.empty(flat.size, flat.dtype) for _ in flat.served]
        self.zeros = [np.zeros(flat.size, flat.dtype) for _ in flat.served]
        # On CPU a device_put of host memory shares it (`LaneFlattener.leaf_array`): copying every
        # leaf out of the result buffer cost a pass over the update each step (and fresh pages to
        # fault in). Instead two result buffers take turns and the leaves alias them: the arrays of
        # step n are read by step n's apply, which step n + 1's gradients wait for, before step
        # n + 2 writes the same buffer again (docs/design/step.md, "One step"). Devices copy on their own.
        self.alias = not pinned and all(d.platform == "cpu" for s in flat.shardings for d in s.device_set)
        self._results = [self._result_buffer() for _ in range(2 if self.alias else 1)]
        self._turn = 0
        self.flat_out, self.outs, self.out_pieces = self._results[0]
        self.blocks, self.leaves = _Blocks(flat, block_elems), _Leaves(flat)
        self.phases = Phases()

    def _result_buffer(self) -> tuple[np.ndarray, list[np.ndarray], dict]:
        """The lanes' results end to end, each lane's view of it, and per leaf the views of its pieces."""
        flat_out = aligned_empty(self.flat.size * len(self.flat.served), self.flat.dtype)
        outs = np.split(flat_out, len(self.flat.served))
        return flat_out, outs, self.flat.pieces_by_leaf(outs)

    def run(self, grads: PyTree | None, rank: int, world: int, call) -> Averaged:
        """`call(bufs, outs, hooks)` runs every lane's FTAR (hooks: per lane, the kwargs to pass)."""
        t0 = time.perf_counter()
        self._turn = (self._turn + 1) % len(self._results)
        self.flat_out, self.outs, self.out_pieces = self._results[self._turn]
        self.phases = phases = Phases()
        if grads is None:  # healing: relays zeros; its average is kept for the replay, not put back
            call(self.zeros, self.outs, [{} for _ in self.outs])
            phases.ring_s = phases.wall_s = time.perf_counter() - t0
            return Averaged(self.flat_out)
        self.blocks.reset()
        self.leaves.reset()
        self._h2d_error: BaseException | None = None
        tree: list[Any] = [None] * len(self.flat.shapes)
        order = self.blocks.order(rank, world, self.flat.size)
        workers = [
            threading.Thread(target=self._d2h, args=(grads, order, phases), name="ftar-d2h", daemon=True),
            threading.Thread(target=self._h2d, args=(tree, phases), name="ftar-h2d", daemon=True),
        ]
        for w in workers:
            w.start()
        try:
            call(self.bufs, self.outs, self._hooks())
            phases.ring_s = time.perf_counter() - t0
        finally:
            self.leaves.ready.put(None)  # the h2d thread ends once what is final is put back
            for w in workers:
                w.join()
            phases.wall_s = time.perf_counter() - t0
        if self._h2d_error is not None:
            raise self._h2d_error
        return Averaged(self.flat_out, jax.tree.unflatten(self.flat.treedef, tree))

    def _hooks(self) -> list[dict]:
        """Per lane: the `ready` (the d2h thread fills) and `on_result` (the h2d thread empties) hooks."""
        return [
            {
                "ready": lambda a, b, i=i: self.blocks.wait(i, a, b),
                "on_result": lambda a, b, i=i: self.leaves.final(i, a, b),
            }
            for i in range(len(self.outs))
        ]

    def _d2h(self, grads: PyTree, order: list[tuple[int, int]], phases: Phases) -> None:
        began = time.perf_counter()
        try:
            if self.pinned is not None:
                grads = jax.device_put(grads, self.pinned)  # asynchronous: every leaf's DMA in flight
            shards = self.flat.host_shards(grads)
            for held in shards if self.pinned is None else ():
                for _, shard in held:
                    shard.data.copy_to_host_async()  # every transfer in flight at once
            parts: dict[tuple[int, int], np.ndarray] = {}
            for lane, k in order:
                p, a, b = self.blocks.blocks[lane][k]
                leaf, region, offset = self.flat.pieces[lane][p]
                part = parts.get((lane, p))
                if part is None:
                    part = parts[(lane, p)] = self.flat.piece_data(shards, leaf, region)
                self.bufs[lane][a:b] = part[a - offset : b - offset]
                self.blocks.mark(lane, k)
        except BaseException as exc:
            self.blocks.fail(exc)
        finally:
            phases.d2h_s = time.perf_counter() - began

    def _h2d(self, tree: list[Any], phases: Phases) -> None:
        busy = 0.0
        while (leaf := self.leaves.ready.get()) is not None:
            began = time.perf_counter()
            try:
                tree[leaf] = self.flat.leaf_array(leaf, self.out_pieces[leaf], copy=not self.alias)
            except BaseException as exc:
                self._h2d_error = exc
            busy += time.perf_counter() - began
        # A transfer from host memory may still be reading it after device_put returns (it is
        # asynchronous), and the next step overwrites these buffers: the step ends once all have landed.
        began = time.perf_counter()
        jax.block_until_ready([t for t in tree if t is not None])
        phases.h2d_s = busy + time.perf_counter() - began
