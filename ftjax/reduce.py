"""How a replica's update is averaged over the quorum (the step protocol's `reducer`).

`FTARReducer`: this host's gradient shards, as one flat host buffer, go through FTAR with host
rank h of every participant; the average is over the contributors (a healing member relays
zeros). `LocalReducer`: the average over a quorum of one is the update itself, so a standalone
run trains through the same loop and protocol as a fault-tolerant one, with no host copy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ftjax.coordinator.client import QuorumResult
from ftjax.flat import HostFlattener
from ftjax.ftar import FTAREndpoint


class FTARReducer:
    """`divisor`: None averages over the contributors (elastic global batch); the job's batch count
    R divides the contributors' sums in constant-batch mode, whoever computed the R batches."""

    def __init__(self, endpoint: FTAREndpoint, flat: HostFlattener, host: int, divisor: int | None = None):
        self.endpoint, self.flat, self.host, self.divisor = endpoint, flat, host, divisor
        self._zeros = np.zeros(flat.size, np.float32)

    def average(self, q: QuorumResult, grads: Any | None) -> np.ndarray:
        """The average of this host's flat buffer (raises FTARError naming the peer)."""
        buf = self.flat.flatten(grads) if grads is not None else self._zeros
        return self.endpoint.allreduce(buf, quorum_id=q.quorum_id, step=q.step,
                                       members=[p.ftar_addresses[self.host] for p in q.participants],
                                       rank=q.rank, contributors=[not p.healing for p in q.participants],
                                       divisor=self.divisor)

    def tree(self, update: np.ndarray) -> Any:
        return self.flat.unflatten(update)

    def close(self) -> None:
        self.endpoint.close()


class LocalReducer:
    def __init__(self, divisor: int | None = None) -> None:
        self.divisor = divisor  # constant batch: a standalone replica computes all R batches

    def average(self, q: QuorumResult, grads: Any | None) -> Any:
        if grads is None:
            raise ValueError("a standalone replica always contributes its own gradients")
        if self.divisor in (None, 1):
            return grads
        import jax

        return jax.tree.map(lambda g: g / self.divisor, grads)

    def tree(self, update: Any) -> Any:
        return update

    def close(self) -> None:
        pass
