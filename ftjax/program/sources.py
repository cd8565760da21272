"""The built-in sources of examples: the Python standard library's own sources as bytes (`stdlib_corpus`,
whose windows `Windows` cuts), and synthetic tokens (`Synthetic`); `token_source` picks one for
`data.source`.

The default corpus is real text that every machine has: the standard library's .py files, listed in
sorted relative-path order and fingerprinted (paths and contents), so two machines with the same
Python build the same corpus; the fingerprint is logged. A source is random access (`len`, `[i]`):
what ftjax/program/data.py batches into a replica's stream, and what the built-in tasks
(ftjax/program/tasks.py) train on; neither is imported here.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

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
