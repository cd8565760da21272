"""Deterministic, resumable, per-replica streams of batches of a task's source.

The built-in sources (the Python standard library's own source files read as bytes, synthetic
tokens) are ftjax/program/sources.py's, and their names are importable from here too.

Batching is grain's random-access `MapDataset`: a shuffled sequence of fixed-length windows, repeated
over epochs, batched. Random access makes the stream position a single integer: replica r of R takes
the global batches r, R + r, 2R + r, ... so its k-th batch is global batch `k * R + r`. That makes
R replicas of batch B equal to one replica of batch R*B row for row (each global batch of the
R*B stream is the concatenation of the R replicas' k-th batches), and resuming at position k is an
index, not a replay.
"""

from __future__ import annotations

import grain

# (importable from here, where they were first: examples and users spell `ftjax.program.data.Windows`)
from ftjax.program.sources import Corpus, Synthetic, Windows, stdlib_corpus, token_source

__all__ = [
    "BatchStream",
    "Corpus",
    "Synthetic",
    "Windows",
    "eval_share",
    "heldout_batch",
    "make_stream",
    "stdlib_corpus",
    "token_source",
]


class BatchStream:
    """Replica `replica` of `replicas` of a task's random-access source: batch k is global batch
    `k * replicas + replica` of the shuffled, repeated source, batched.

    A batch is the task's examples stacked (an array, or a pytree of arrays, leading axis the rows).
    """

    def __init__(
        self, items, *, seed: int, batch_size: int, replica: int = 0, replicas: int = 1, fingerprint: str = ""
    ):
        if not 0 <= replica < replicas:
            raise ValueError(f"replica index {replica} out of range for {replicas} replicas")
        self.replica, self.replicas = replica, replicas
        self.fingerprint = fingerprint or str(getattr(items, "fingerprint", ""))
        self._batches = grain.MapDataset.source(items).shuffle(seed=seed).repeat().batch(batch_size)

    def batch_id(self, position: int) -> int:
        """Global id of this replica's batch at stream position `position` (its k-th batch)."""
        return position * self.replicas + self.replica

    def batch(self, position: int):
        if position < 0:
            raise ValueError(f"negative stream position {position}")
        return self._batches[self.batch_id(position)]


def make_stream(cfg, replica: int = 0, task=None) -> BatchStream:
    """The stream of replica `replica` for a Config, over its task's source (`task`: the loaded one)."""
    from ftjax.program.tasks import task_of  # (here: importing a stream's module loads no JAX)

    task = task if task is not None else task_of(cfg)
    return BatchStream(
        task.source,
        seed=cfg.seed,
        batch_size=cfg.data.batch_size,
        replica=replica,
        replicas=cfg.ft.replicas,
        fingerprint=task.data_fingerprint(),
    )


def eval_share(batches: int, replica: int, replicas: int) -> list[int]:
    """The held-out batches replica `replica` of `replicas` evaluates: i with i % replicas == replica
    (every replica its own share: nobody waits for another's)."""
    return list(range(replica, batches, replicas))


def heldout_batch(source, i: int, batch_size: int):
    """Held-out batch i: examples i*B .. (i+1)*B - 1 of `source` in order, wrapping around its end
    (no shuffle: the same rows on every run, whatever the training did)."""
    from ftjax.program.task import stack

    n = len(source)
    return stack([source[(i * batch_size + j) % n] for j in range(batch_size)])
