"""A tiny token MLP for exactness tests: embed each token, two dense layers, predict the next token.

Small enough that multi-replica equivalence tests run in seconds, with the same logical axis names
(and so the same FSDP sharding) as the GPT.
"""

from __future__ import annotations

import jax
from flax import nnx

from ftjax.program.models.gpt import linear


class TokenMLP(nnx.Module):
    def __init__(self, *, vocab_size: int, d_model: int, d_ff: int, rngs: nnx.Rngs, **_unused):
        init = nnx.initializers.normal(stddev=0.02)
        self.wte = nnx.Embed(
            vocab_size, d_model, embedding_init=nnx.with_partitioning(init, ("vocab", "embed")), rngs=rngs
        )
        self.fc = linear(d_model, d_ff, ("embed", "mlp"), rngs)
        self.out = linear(d_ff, vocab_size, ("mlp", "vocab"), rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.out(jax.nn.gelu(self.fc(self.wte(tokens))))
