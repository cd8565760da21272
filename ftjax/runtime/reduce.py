"""How a replica's update is averaged over the quorum (the step protocol's `reducer`).

`FTARReducer`: the gradient lanes this host serves (`ftjax.runtime.lanes`: one in a full replica, several
on a host of a reduced-degree one), each a flat host buffer, go through FTAR with the host that
serves the same lane in every participant; the average is over the contributors (a healing member
relays zeros). `LocalReducer`: the average over a quorum of one is the update itself, so a
standalone run trains through the same loop and protocol as a fault-tolerant one, with no host copy.

`ft.grad_dtype: bfloat16`: the update is narrowed to bfloat16 on its devices, so half the bytes
reach the host and cross FTAR (which sums in float32 and rounds the average once, at the owner of
each segment), and is widened back to float32 for `apply`; a standalone replica rounds the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
from numpy.typing import DTypeLike

from ftjax.base.trees import PyTree
from ftjax.coordinator.types import QuorumResult
from ftjax.ftar import FTAREndpoint
from ftjax.runtime.lanes import LaneFlattener
from ftjax.runtime.pipeline import Averaged, Phases, Pipeline


class FTARReducer:
    """`endpoints`: one per lane this host serves (`flat.served`, in that order). `divisor`: None
    averages over the contributors (elastic global batch); the job's batch count R divides the
    contributors' sums in constant-batch mode, whoever computed the R batches. `pipelined`
    (ft.grad_path pipelined or pinned): device -> host, the ring and host -> device overlap (`ftjax.runtime.pipeline`);
    otherwise they run one after another (the path before it, kept to compare and to fall back on).
    `pinned` (ft.grad_path pinned): the pipeline's device -> host copies go through page-locked memory.
    `phases`: the last step's seconds in each (metrics.jsonl)."""

    def __init__(
        self,
        endpoints: list[FTAREndpoint],
        flat: LaneFlattener,
        divisor: int | None = None,
        pipelined: bool = True,
        pinned: bool = False,
    ):
        if len(endpoints) != len(flat.served):
            raise ValueError(f"{len(endpoints)} FTAR endpoints for {len(flat.served)} lanes")
        self.endpoints, self.flat, self.divisor = endpoints, flat, divisor
        self.host_bytes = flat.size * flat.dtype.itemsize * len(flat.served)  # the update's, on this host
        self.pipeline = Pipeline(flat, pinned=pinned) if pipelined else None
        self._zeros = [np.zeros(flat.size, flat.dtype) for _ in flat.served] if not pipelined else None
        self.phases = Phases()
        shardings = jax.tree.unflatten(flat.treedef, flat.shardings)
        self._narrow = _cast(flat.dtype, shardings) if flat.dtype != np.float32 else None
        self._widen = _cast(np.float32, shardings) if flat.dtype != np.float32 else None
        # lanes after the first run beside it, each on its own endpoint (one call at a time each)
        self._pool = ThreadPoolExecutor(len(endpoints) - 1, "ftar-lane") if len(endpoints) > 1 else None
        self._released = False

    def average(self, q: QuorumResult, grads: PyTree | None) -> Averaged | np.ndarray:
        """The averages of this host's lanes, end to end in one buffer (pipelined: with the tree
        already back on the devices); raises FTARError naming the peer, once every lane's call has ended."""
        if self._released:
            raise RuntimeError("this FTAR reducer's buffers were released (release(): its phase of the job is over)")
        if grads is not None and self._narrow is not None:
            grads = self._narrow(grads)
        contributors = [not p.healing for p in q.participants]
        if self.pipeline is not None:
            try:
                return self.pipeline.run(
                    grads, q.rank, len(q.participants), lambda b, o, h: self._lanes(q, contributors, b, o, h)
                )
            finally:
                self.phases = self.pipeline.phases
                self.phases.grad_bytes = self.host_bytes if grads is not None else 0
        began = time.perf_counter()
        bufs = self.flat.flatten(grads) if grads is not None else self._zeros
        assert bufs is not None  # (not pipelined: the zeros are kept)
        copied = time.perf_counter()
        outs = self._lanes(q, contributors, bufs, [None] * len(bufs), [{}] * len(bufs))
        done = time.perf_counter()
        nbytes = self.host_bytes if grads is not None else 0
        self.phases = Phases(d2h_s=copied - began, ring_s=done - copied, wall_s=done - began, grad_bytes=nbytes)
        return np.concatenate(outs) if len(outs) > 1 else outs[0]

    def _lanes(self, q: QuorumResult, contributors: list[bool], bufs, outs, hooks) -> list[np.ndarray]:
        """Every lane's FTAR call: the first here, the others beside it in the pool."""

        def lane(i: int) -> np.ndarray:
            return self.endpoints[i].allreduce(
                bufs[i],
                quorum_id=q.quorum_id,
                step=q.step,
                rank=q.rank,
                contributors=contributors,
                members=[p.ftar_addresses[self.flat.served[i]] for p in q.participants],
                divisor=self.divisor,
                out=outs[i],
                **hooks[i],
            )

        others = [self._pool.submit(lane, i) for i in range(1, len(bufs))] if self._pool else []
        try:
            first = lane(0)
        finally:
            errors = [f.exception() for f in others]
        if any(errors):
            raise next(e for e in errors if e is not None)
        return [first, *(f.result() for f in others)]

    def tree(self, update: Averaged | np.ndarray) -> PyTree:
        """The update as arrays on this host's devices, float32."""
        if isinstance(update, Averaged) and update.tree is not None:
            tree = update.tree
        else:
            began = time.perf_counter()
            flat = update.flat if isinstance(update, Averaged) else update
            tree = self.flat.unflatten(np.split(flat, len(self.flat.served)))
            self.phases.h2d_s = time.perf_counter() - began
        return tree if self._widen is None else self._widen(tree)

    def detach(self, update: Averaged | np.ndarray) -> np.ndarray:
        """The update as host memory of its own (the replay keeps it; the pipeline reuses its buffers)."""
        return update.flat.copy() if isinstance(update, Averaged) else update

    def release(self) -> None:
        """Its buffers (an update's size; an update the training still holds keeps its own) and lane
        threads go, not its links, which the job's other reducers share. `tree` of a flat update
        still works; `average` is refused."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        self.pipeline = self._zeros = self._pool = None
        self._released = True

    def close(self) -> None:
        for e in self.endpoints:
            e.close()
        self.release()


class LocalReducer:
    def __init__(self, divisor: int | None = None, dtype=np.float32) -> None:
        self.divisor = divisor  # constant batch: a standalone replica computes all R batches
        self.dtype = np.dtype(dtype)  # ft.grad_dtype: rounded as FTAR would

    def average(self, q: QuorumResult, grads: PyTree | None) -> PyTree:
        if grads is None:
            raise ValueError("a standalone replica always contributes its own gradients")
        if self.dtype != np.float32:
            return _local_average(grads, self.divisor or 1, self.dtype)
        if self.divisor in (None, 1):
            return grads
        return jax.tree.map(lambda g: g / self.divisor, grads)

    def tree(self, update: PyTree) -> PyTree:
        return update

    def detach(self, update: PyTree) -> PyTree:
        return update

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


def _cast(dtype: DTypeLike, shardings: PyTree) -> Callable[[PyTree], PyTree]:
    """A jitted cast of every leaf of an update to `dtype`, its shardings kept."""
    return jax.jit(lambda tree: jax.tree.map(lambda x: x.astype(dtype), tree), out_shardings=shardings)


@jax.jit(static_argnums=(1, 2))
def _local_average(grads: PyTree, divisor: int, dtype: DTypeLike) -> PyTree:
    """What FTAR gives a quorum of one: the update as sent (rounded to `dtype`), divided in float32,
    the quotient rounded once to `dtype`; float32 for `apply`."""

    def one(g):
        sent = g.astype(dtype).astype(np.float32)
        return sent if divisor == 1 else (sent / divisor).astype(dtype).astype(np.float32)

    return jax.tree.map(one, grads)
