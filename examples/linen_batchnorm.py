"""Example (b): a Flax Linen model with a non-parameter collection (BatchNorm's `batch_stats`).

ftjax calls the module through `apply`, with `mutable=["batch_stats"]`; the new statistics are model
state, averaged over the step's contributors with the gradients, so every replica keeps the same.
BatchNorm makes a batch's rows interact (detected from `batch_stats`): under `ft.global_batch=constant`
a missing replica's batch is computed whole by one peer, so its statistics are the failure-free ones.

    ftjax launch examples/linen_batchnorm.yaml --replicas 2 --kill 1@15:ftar
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import optax

import ftjax


class BatchNormLM(nn.Module):
    vocab: int = 256
    d_model: int = 64
    d_ff: int = 256

    @nn.compact
    def __call__(self, tokens, train: bool = True):
        init = nn.initializers.normal(stddev=0.02)
        x = nn.Embed(self.vocab, self.d_model, embedding_init=nn.with_logical_partitioning(init, ("vocab", "embed")))(
            tokens
        )
        x = nn.Dense(self.d_ff, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.Dense(self.vocab, kernel_init=nn.with_logical_partitioning(init, ("mlp", "vocab")))(nn.gelu(x))


def loss(apply, tokens):
    logits = apply(tokens[:, :-1], train=True)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean(axis=1)


def task(cfg, *, d_model: int = 64) -> ftjax.Task:
    corpus = ftjax.stdlib_corpus()
    source = ftjax.Windows(corpus.tokens, cfg.model.seq_len + 1, corpus.fingerprint)
    task = ftjax.linen_task(BatchNormLM(d_model=d_model), loss, source, tokens_per_example=cfg.model.seq_len)
    return dataclasses.replace(task, reads=("model.seq_len",))  # (its windows' length: in the job identity)
