"""Deterministic, resumable, per-replica streams of byte-level token batches.

The default corpus is real text that every machine has: the Python standard library's own source
files, read as bytes. Files are listed in sorted relative-path order and fingerprinted (paths and
contents), so two machines with the same Python build the same corpus; the fingerprint is logged.

Batching is grain's random-access `MapDataset`: a shuffled sequence of fixed-length windows, repeated
over epochs, batched. Random access makes the stream position a single integer: replica r of R takes
the global batches r, R + r, 2R + r, ... so its k-th batch is global batch `k * R + r`. That makes
R replicas of batch B equal to one replica of batch R*B row for row (each global batch of the
R*B stream is the concatenation of the R replicas' k-th batches), and resuming at position k is an
index, not a replay.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import grain
import numpy as np


@dataclass(frozen=True)
class Corpus:
    tokens: np.ndarray  # uint8, all files concatenated
    fingerprint: str
    num_files: int


def _stdlib_files(root: Path) -> list[Path]:
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


@functools.lru_cache(maxsize=1)
def stdlib_corpus() -> Corpus:
    """The Python standard library's .py sources as one byte string, with a content fingerprint."""
    root = Path(sysconfig.get_paths()["stdlib"])
    digest = hashlib.sha256()
    chunks = []
    files = _stdlib_files(root)
    for path in files:
        data = path.read_bytes()
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + len(data).to_bytes(8, "little"))
        digest.update(data)
        chunks.append(data)
    if not chunks:
        raise RuntimeError(f"no Python source files under {root}: cannot build the stdlib corpus")
    return Corpus(np.frombuffer(b"".join(chunks), dtype=np.uint8), digest.hexdigest()[:16], len(files))


class Windows:
    """Random-access source of the non-overlapping `window`-token windows of a token array (int32
    arrays; the tail shorter than a window is left out), e.g. `Windows(stdlib_corpus().tokens,
    seq_len + 1, stdlib_corpus().fingerprint)`. `fingerprint` names the data in the job identity."""

    def __init__(self, tokens: np.ndarray, window: int, fingerprint: str = ""):
        self.tokens, self.window, self.fingerprint = tokens, window, fingerprint
        self.n = len(tokens) // window

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        i = int(i)
        return self.tokens[i * self.window : (i + 1) * self.window].astype(np.int32)


class Synthetic:
    """Random tokens, a pure function of (seed, index): for exactness tests."""

    def __init__(self, seed: int, window: int, vocab: int, n: int = 1 << 20):
        self.seed, self.window, self.vocab, self.n = seed, window, vocab, n
        self.fingerprint = f"synthetic-{seed}"

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, int(i)])
        return rng.integers(0, self.vocab, self.window, dtype=np.int32)


def token_source(source: str, seed: int, seq_len: int, vocab_size: int):
    """The built-in sources (`data.source`): the stdlib corpus's windows, or synthetic tokens."""
    window = seq_len + 1
    if source == "stdlib":
        corpus = stdlib_corpus()
        return Windows(corpus.tokens, window, corpus.fingerprint)
    if source == "synthetic":
        return Synthetic(seed, window, vocab_size)
    raise ValueError(f"data.source: unknown source {source!r}")


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
    from ftjax.program.tasks import task_of

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
