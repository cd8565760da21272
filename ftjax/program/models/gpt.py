"""A decoder-only transformer (GPT-2 style, pre-LayerNorm) in Flax NNX.

Every parameter carries logical axis names (see `ftjax/program/sharding.py` for how they map to the mesh):
`embed` is the model width, `mlp` the feed-forward width, `qkv` the fused query/key/value width,
`vocab` the token vocabulary and `seq` the position. Byte-level tokens: vocab 256.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ftjax.program.models.llama import REMAT_POLICIES, Decoder
from ftjax.program.sharding import constrain_rows

_init = nnx.initializers.normal(stddev=0.02)


def linear(din: int, dout: int, axes: tuple[str, str], rngs: nnx.Rngs, std: float = 0.02) -> nnx.Linear:
    """A dense layer with logical axis names on its kernel (`axes`) and bias (the output axis)."""
    return nnx.Linear(
        din,
        dout,
        kernel_init=nnx.with_partitioning(nnx.initializers.normal(stddev=std), axes),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), (axes[1],)),
        rngs=rngs,
    )


def _layer_norm(d: int, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(
        d,
        epsilon=1e-5,
        scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), ("embed",)),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("embed",)),
        rngs=rngs,
    )


class CausalSelfAttention(nnx.Module):
    def __init__(self, d_model: int, n_heads: int, n_layers: int, rngs: nnx.Rngs):
        self.n_heads = n_heads
        self.qkv = linear(d_model, 3 * d_model, ("embed", "qkv"), rngs)
        # GPT-2's scaled init of residual projections keeps the residual stream's variance flat.
        self.proj = linear(d_model, d_model, ("qkv", "embed"), rngs, std=0.02 / (2 * n_layers) ** 0.5)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
        q, k, v = (a.reshape(b, t, h, d // h) for a in (q, k, v))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(d // h))
        mask = jnp.tril(jnp.ones((t, t), dtype=bool))
        att = jnp.where(mask, att, jnp.finfo(att.dtype).min)
        att = jax.nn.softmax(att, axis=-1)
        y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d)
        return self.proj(y)


class MLP(nnx.Module):
    def __init__(self, d_model: int, d_ff: int, n_layers: int, rngs: nnx.Rngs):
        self.fc = linear(d_model, d_ff, ("embed", "mlp"), rngs)
        self.proj = linear(d_ff, d_model, ("mlp", "embed"), rngs, std=0.02 / (2 * n_layers) ** 0.5)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.proj(jax.nn.gelu(self.fc(x)))


class Block(nnx.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int, n_layers: int, rngs: nnx.Rngs):
        self.ln1 = _layer_norm(d_model, rngs)
        self.attn = CausalSelfAttention(d_model, n_heads, n_layers, rngs)
        self.ln2 = _layer_norm(d_model, rngs)
        self.mlp = MLP(d_model, d_ff, n_layers, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nnx.Module):
    def __init__(self, shape: Decoder, *, seq_len: int, remat: str = "none", rngs: nnx.Rngs):
        d, vocab = shape.d_model, shape.vocab_size
        self.remat = remat  # each block rematerialized in the backward pass (ftjax/program/models/llama.py)
        self.wte = nnx.Embed(vocab, d, embedding_init=nnx.with_partitioning(_init, ("vocab", "embed")), rngs=rngs)
        self.wpe = nnx.Param(nnx.with_partitioning(_init, ("seq", "embed"))(rngs.params(), (seq_len, d)))
        self.blocks = nnx.List(
            [Block(d, shape.n_heads, shape.d_ff, shape.n_layers, rngs) for _ in range(shape.n_layers)]
        )
        self.ln_f = _layer_norm(d, rngs)
        self.head = linear(d, vocab, ("embed", "vocab"), rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens (batch, time) int32 -> logits (batch, time, vocab) float32."""
        # the residual stream split by rows like the batch, not along the width like the `embed`-sharded
        # parameters (constrain_rows; docs/design/model.md, "Rows")
        x = constrain_rows(self.wte(tokens) + self.wpe[: tokens.shape[1]])
        run = _call if self.remat == "none" else nnx.remat(_call, policy=REMAT_POLICIES[self.remat])
        for block in self.blocks:
            x = constrain_rows(run(block, x))
        return self.head(constrain_rows(self.ln_f(x)))


def _call(block: Block, x: jax.Array) -> jax.Array:
    return block(x)
