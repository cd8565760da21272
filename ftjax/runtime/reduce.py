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

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from ftjax.coordinator.types import QuorumResult
from ftjax.ftar import FTAREndpoint
from ftjax.runtime.lanes import LaneFlattener


class FTARReducer:
    """`endpoints`: one per lane this host serves (`flat.served`, in that order). `divisor`: None
    averages over the contributors (elastic global batch); the job's batch count R divides the
    contributors' sums in constant-batch mode, whoever computed the R batches."""

    def __init__(self, endpoints: list[FTAREndpoint], flat: LaneFlattener, divisor: int | None = None):
        if len(endpoints) != len(flat.served):
            raise ValueError(f"{len(endpoints)} FTAR endpoints for {len(flat.served)} lanes")
        self.endpoints, self.flat, self.divisor = endpoints, flat, divisor
        self._zeros = [np.zeros(flat.size, flat.dtype) for _ in flat.served]  # (a healing member's)
        shardings = jax.tree.unflatten(flat.treedef, flat.shardings)
        self._narrow = _cast(flat.dtype, shardings) if flat.dtype != np.float32 else None
        self._widen = _cast(np.float32, shardings) if flat.dtype != np.float32 else None
        # lanes after the first run beside it, each on its own endpoint (one call at a time each)
        self._pool = ThreadPoolExecutor(len(endpoints) - 1, "ftar-lane") if len(endpoints) > 1 else None

    def average(self, q: QuorumResult, grads: Any | None) -> np.ndarray:
        """The averages of this host's lanes, end to end in one buffer (raises FTARError naming the
        peer, once every lane's call has ended)."""
        if grads is not None and self._narrow is not None:
            grads = self._narrow(grads)
        bufs = self.flat.flatten(grads) if grads is not None else self._zeros
        contributors = [not p.healing for p in q.participants]

        def lane(i: int) -> np.ndarray:
            return self.endpoints[i].allreduce(
                bufs[i],
                quorum_id=q.quorum_id,
                step=q.step,
                rank=q.rank,
                contributors=contributors,
                members=[p.ftar_addresses[self.flat.served[i]] for p in q.participants],
                divisor=self.divisor,
            )

        others = [self._pool.submit(lane, i) for i in range(1, len(bufs))] if self._pool else []
        try:
            first = lane(0)
        finally:
            errors = [f.exception() for f in others]
        if any(errors):
            raise next(e for e in errors if e is not None)
        return np.concatenate([first, *(f.result() for f in others)]) if others else first

    def tree(self, update: np.ndarray) -> Any:
        tree = self.flat.unflatten(np.split(update, len(self.flat.served)))
        return tree if self._widen is None else self._widen(tree)

    def close(self) -> None:
        for e in self.endpoints:
            e.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)


class LocalReducer:
    def __init__(self, divisor: int | None = None, dtype=np.float32) -> None:
        self.divisor = divisor  # constant batch: a standalone replica computes all R batches
        self.dtype = np.dtype(dtype)  # ft.grad_dtype: rounded as FTAR would

    def average(self, q: QuorumResult, grads: Any | None) -> Any:
        if grads is None:
            raise ValueError("a standalone replica always contributes its own gradients")
        if self.dtype != np.float32:
            return _local_average(grads, self.divisor or 1, self.dtype)
        if self.divisor in (None, 1):
            return grads
        return jax.tree.map(lambda g: g / self.divisor, grads)

    def tree(self, update: Any) -> Any:
        return update

    def close(self) -> None:
        pass


def _cast(dtype, shardings: Any):
    """A jitted cast of every leaf of an update to `dtype`, its shardings kept."""
    return jax.jit(lambda tree: jax.tree.map(lambda x: x.astype(dtype), tree), out_shardings=shardings)


@jax.jit(static_argnums=(1, 2))
def _local_average(grads: Any, divisor: int, dtype) -> Any:
    """What FTAR gives a quorum of one: the update as sent (rounded to `dtype`), divided in float32,
    the quotient rounded once to `dtype`; float32 for `apply`."""

    def one(g):
        sent = g.astype(dtype).astype(np.float32)
        return sent if divisor == 1 else (sent / divisor).astype(dtype).astype(np.float32)

    return jax.tree.map(one, grads)
