"""A user's task outside the ftjax package (tests): the built-in GPT with its own loss, `scale` x
the per-sequence cross-entropy. With scale 10 a row weighed with ftjax's built-in loss instead of
this one would count a tenth of what it should."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import optax
from flax import nnx

import ftjax
from ftjax.program import models
from ftjax.program.data import token_source


def task(cfg, *, scale: float = 10.0) -> ftjax.Task:
    def loss(model, tokens):
        logits = model(tokens[:, :-1])
        return scale * optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean(axis=1)

    source = token_source(cfg.data.source, cfg.seed, cfg.model.seq_len, cfg.model.vocab_size)
    return ftjax.nnx_task(
        lambda rngs: models.build(cfg.model, rngs), loss, source, tokens_per_example=cfg.model.seq_len
    )


def broken_shape(cfg, **_) -> ftjax.Task:
    """A loss that returns the batch's mean instead of one loss per example."""

    def loss(model, tokens):
        return optax.softmax_cross_entropy_with_integer_labels(model(tokens[:, :-1]), tokens[:, 1:]).mean()

    source = token_source(cfg.data.source, cfg.seed, cfg.model.seq_len, cfg.model.vocab_size)
    return ftjax.nnx_task(lambda rngs: models.build(cfg.model, rngs), loss, source)


class _Ragged:
    """Examples of different lengths: they do not batch."""

    def __len__(self) -> int:
        return 100

    def __getitem__(self, i: int):
        import numpy as np

        return np.zeros(5 + int(i) % 3, np.int32)


def ragged(cfg, **_) -> ftjax.Task:
    return dataclasses.replace(task(cfg), source=_Ragged())


def raises(cfg, **_) -> ftjax.Task:
    """A factory that fails the way a user's does: an exception of its own, not a TypeError."""
    raise RuntimeError("could not open /data/shards: no such file")


class _IntParam(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.table = nnx.Param(jnp.zeros((256, 4), jnp.int32))
        self.head = nnx.Linear(4, 256, rngs=rngs)

    def __call__(self, tokens):
        return self.head(self.table[tokens].astype(jnp.float32))


def int_params(cfg, **_) -> ftjax.Task:
    """A model with an integer parameter: no gradient can be taken of it."""

    def loss(model, tokens):
        return optax.softmax_cross_entropy_with_integer_labels(model(tokens[:, :-1]), tokens[:, 1:]).mean(axis=1)

    source = token_source(cfg.data.source, cfg.seed, cfg.model.seq_len, cfg.model.vocab_size)
    return ftjax.nnx_task(_IntParam, loss, source)


class _Odd(nnx.Module):
    """A width of 34, split over the `embed` axis: 4 devices do not divide it."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.embed = nnx.Embed(256, 34, embedding_init=nnx.with_partitioning(init, ("vocab", "embed")), rngs=rngs)
        self.head = nnx.Linear(34, 256, kernel_init=nnx.with_partitioning(init, ("embed", "vocab")), rngs=rngs)

    def __call__(self, tokens):
        return self.head(self.embed(tokens))


def odd_width(cfg, **_) -> ftjax.Task:
    def loss(model, tokens):
        return optax.softmax_cross_entropy_with_integer_labels(model(tokens[:, :-1]), tokens[:, 1:]).mean(axis=1)

    source = token_source(cfg.data.source, cfg.seed, cfg.model.seq_len, cfg.model.vocab_size)
    return ftjax.nnx_task(_Odd, loss, source)
