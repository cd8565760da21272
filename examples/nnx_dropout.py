"""Example (a): a Flax NNX model with dropout and its own loss with an auxiliary term.

The model is a small next-byte predictor; the loss is cross-entropy plus a z-loss (the squared log
of the softmax normalizer, as PaLM uses to keep logits from drifting), and reports both terms as
auxiliary metrics. `task(cfg, ...)` is what the config names (`task: nnx_dropout:task`).

    ftjax launch examples/nnx_dropout.yaml --replicas 2 --kill 1@15:ftar
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import ftjax


class DropoutLM(nnx.Module):
    def __init__(self, *, vocab: int, d_model: int, d_ff: int, dropout: float, rngs: nnx.Rngs):
        init = nnx.initializers.normal(stddev=0.02)
        self.embed = nnx.Embed(
            vocab, d_model, embedding_init=nnx.with_partitioning(init, ("vocab", "embed")), rngs=rngs
        )
        self.up = nnx.Linear(d_model, d_ff, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.down = nnx.Linear(d_ff, vocab, kernel_init=nnx.with_partitioning(init, ("mlp", "vocab")), rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = ftjax.constrain_rows(self.embed(tokens))  # split by rows like the batch (README, "Bring your own model")
        return self.down(self.drop(jax.nn.gelu(self.up(x))))


def loss(model: DropoutLM, tokens: jax.Array):
    """Per-sequence loss, and its two terms as auxiliary metrics."""
    logits = model(tokens[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean(axis=1)
    z = jnp.square(jax.nn.logsumexp(logits, axis=-1)).mean(axis=1)
    return ce + 1e-4 * z, {"cross_entropy": ce, "z_loss": z}


def task(cfg, *, d_model: int = 64, d_ff: int = 256, dropout: float = 0.1) -> ftjax.Task:
    corpus = ftjax.stdlib_corpus()  # bytes of Python's own sources (any random-access source works)
    source = ftjax.Windows(corpus.tokens, cfg.model.seq_len + 1, corpus.fingerprint)
    task = ftjax.nnx_task(
        lambda rngs: DropoutLM(vocab=256, d_model=d_model, d_ff=d_ff, dropout=dropout, rngs=rngs),
        loss,
        source,
        tokens_per_example=cfg.model.seq_len,
    )
    return dataclasses.replace(task, reads=("model.seq_len",))  # (its windows' length: in the job identity)
