"""Control messages between the hosts of one replica, over the replica's own jax.distributed
collectives: the leader's quorum broadcast, and the two-phase commit vote.

A single-host replica skips the collectives. Messages are bytes (the quorum travels as the
coordinator's protobuf message) or small JSON objects; the collectives need fixed shapes, so
lengths travel first.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np

from ftjax.runtime.compile_cache import write_from_every_process

MEET_TIMEOUT_S = 600.0  # hosts of a replica meet before their first collective (jax.distributed gives 300 s to connect)


class JaxHostGroup:
    """The hosts of this replica (the step protocol's `HostGroup`), over jax.distributed."""

    def __init__(self) -> None:
        self.hosts = jax.process_count()
        self.rank = jax.process_index()
        if self.hosts > 1:  # before the replica's programs compile, in `ftjax train` and a script's loop
            write_from_every_process()

    def meet(self, name: str, timeout_s: float = MEET_TIMEOUT_S) -> None:
        """Wait until every host of the replica is here, through jax.distributed's coordination
        service (no gloo). Called before the first collective: gloo gives its hosts 30 s to meet
        when it sets up its context, and the work before it (compiling, or reading the compilation
        cache; opening the data) may differ by more between hosts, on a busy machine or when one
        node's cache is cold. Names must not repeat within a process."""
        if self.hosts == 1:
            return
        from jax._src import distributed

        client = distributed.global_state.client
        assert client is not None  # (hosts > 1: jax.distributed is initialized)
        client.wait_at_barrier(f"ftjax/{name}", int(timeout_s * 1000))

    def broadcast(self, obj: Any) -> Any:
        """The leader's `obj` (JSON), on every host (others pass anything, e.g. None)."""
        if self.hosts == 1:
            return obj
        return json.loads(self.broadcast_bytes(json.dumps(obj).encode() if self.rank == 0 else b"").decode())

    def broadcast_bytes(self, data: bytes) -> bytes:
        """The leader's `data`, on every host (others pass anything, e.g. b"")."""
        if self.hosts == 1:
            return data
        from jax.experimental import multihost_utils as mh

        mine = np.frombuffer(data, np.uint8) if self.rank == 0 else np.zeros(0, np.uint8)
        n = int(mh.broadcast_one_to_all(np.array([mine.size], np.int64))[0])
        buf = np.zeros(n, np.uint8)
        if self.rank == 0:
            buf[:] = mine
        return bytes(np.asarray(mh.broadcast_one_to_all(buf)))

    def allgather(self, obj: Any) -> list[Any]:
        """Every host's `obj`, in host order."""
        if self.hosts == 1:
            return [obj]
        from jax.experimental import multihost_utils as mh

        data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
        sizes = np.asarray(mh.process_allgather(np.array([data.size], np.int64))).reshape(-1)
        buf = np.zeros(int(sizes.max()), np.uint8)
        buf[: data.size] = data
        rows = np.asarray(mh.process_allgather(buf)).reshape(self.hosts, -1)
        return [json.loads(bytes(rows[i, : sizes[i]]).decode()) for i in range(self.hosts)]
