"""Corpora made at test time: short documents of a few words, and a byte-level BPE tokenizer
(`tokenizer.json`, with `</s>`) trained on them. Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import numpy as np

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "runs",
    "sat",
    "on",
    "mat",
    "tree",
    "blue",
    "green",
    "fast",
    "slow",
    "token",
    "file",
    "window",
    "replica",
]


def documents(n: int, seed: int = 0) -> list[str]:
    """`n` documents, each starting with its index, then 3 to 29 random words."""
    rng = np.random.default_rng(seed)
    return [f"document {i}: " + " ".join(rng.choice(WORDS, rng.integers(3, 30))) for i in range(n)]


def train_tokenizer(texts: list[str], path: Path, vocab_size: int = 300):
    """A byte-level BPE tokenizer trained on `texts`, saved to `path`; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(path))
    return tok
