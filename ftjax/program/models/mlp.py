"""A tiny token MLP for exactness tests: embed each token, two dense layers, predict the next token.

Small enough that multi-replica equivalence tests run in seconds, with the same logical axis names
(and so the same FSDP sharding) as the GPT.
"""

from __future__ import annotations

import jax
from flax import nnx


class TokenMLP(nnx.Module):
    def __init__(self, *, vocab_size: int, d_model: int, d_ff: int, rngs: nnx.Rngs, **_unused):
        init = nnx.initializers.normal(stddev=0.02)
        self.wte = nnx.Embed(
            vocab_size, d_model, embedding_init=nnx.with_partitioning(init, ("vocab", "embed")), rngs=rngs
        )
        self.fc = nnx.Linear(
            d_model,
            d_ff,
            kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("mlp",)),
            rngs=rngs,
        )
        self.out = nnx.Linear(
            d_ff,
            vocab_size,
            kernel_init=nnx.with_partitioning(init, ("mlp", "vocab")),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("vocab",)),
            rngs=rngs,
        )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.out(jax.nn.gelu(self.fc(self.wte(tokens))))
