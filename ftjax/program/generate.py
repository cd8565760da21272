"""Decoding from the built-in Llama with a KV cache (`ftjax generate`; issue 55): enough to look at
what a model writes and to test a converted checkpoint end to end. One device, an unrolled model.

The prompt is one forward pass that fills each layer's key/value cache [1, S, kv_heads, head_dim]
(S = prompt + new tokens); every new token is then one position through the same blocks, its
keys and values written at its position and its query attending to the cache up to there. The
blocks' own modules compute (norms, projections, RoPE at the token's position, SwiGLU), so a
decoded position's logits are those of the whole-sequence forward to float32 rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ftjax.program.models.llama import F32, Llama, _mm, apply_rope


def _attend(attn, x, cos, sin, cache: tuple, start, dtype):
    """One block's attention of x [1, T, d] at positions start..start+T-1, through its cache."""
    q = apply_rope(_mm("btd,dhk->bthk", x, attn.wq, dtype), cos, sin)
    k = apply_rope(_mm("btd,dhk->bthk", x, attn.wk, dtype), cos, sin)
    v = _mm("btd,dhk->bthk", x, attn.wv, dtype)
    ck = jax.lax.dynamic_update_slice_in_dim(cache[0], k.astype(cache[0].dtype), start, axis=1)
    cv = jax.lax.dynamic_update_slice_in_dim(cache[1], v.astype(cache[1].dtype), start, axis=1)
    length, size = x.shape[1], ck.shape[1]
    allowed = jnp.arange(size)[None, :] <= start + jnp.arange(length)[:, None]  # causal over the cache
    y = jax.nn.dot_product_attention(q, ck, cv, mask=allowed[None, None], implementation="xla")
    return _mm("bthk,hkd->btd", y, attn.wo, dtype), (ck, cv)


def forward(model: Llama, tokens: jax.Array, start, cache: list) -> tuple[jax.Array, list]:
    """Logits [1, T, vocab] of tokens [1, T] at positions start.., and the caches with them written."""
    dtype = model.compute_dtype
    x = jnp.take(model.embed[...], tokens, axis=0)
    cos, sin = model.rope(tokens.shape[1], start + jnp.arange(tokens.shape[1])[None])
    out = []
    assert model.blocks is not None, "decoding needs the blocks one by one (model.scan_layers off)"
    for block, layer in zip(model.blocks, cache):
        h, layer = _attend(block.attn, block.attn_norm(x, dtype), cos, sin, layer, start, dtype)
        x = x + h.astype(F32)
        x = x + block.mlp(block.mlp_norm(x, dtype), dtype).astype(F32)
        out.append(layer)
    return model.logits(model.norm(x, dtype)), out


def pick(logits: jax.Array, key, temperature: float, top_k: int) -> jax.Array:
    """The next token of logits [vocab]: the argmax at temperature 0, else a sample of the softmax
    of logits / temperature over the top_k most likely (0: all)."""
    if temperature == 0:
        return jnp.argmax(logits)
    scaled = logits / temperature
    if top_k:
        kth = jax.lax.top_k(scaled, top_k)[0][-1]
        scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    return jax.random.categorical(key, scaled)


def generate(
    model: Llama, prompt: list[int], max_new: int, *, temperature: float = 0.0, top_k: int = 0, seed: int = 0
) -> list[int]:
    """The `max_new` tokens `model` writes after `prompt` (greedy at temperature 0)."""
    if model.blocks is None:
        raise ValueError("model.scan_layers: generate runs an unrolled model (set scan_layers false)")
    graphdef, state = nnx.split(model)
    size = len(prompt) + max_new
    kv = model.blocks[0].attn.wk.shape[1]
    cache = [(jnp.zeros((1, size, kv, model.head_dim), F32),) * 2 for _ in model.blocks]

    @jax.jit
    def step(state, tokens, start, cache, key):
        logits, cache = forward(nnx.merge(graphdef, state), tokens, start, cache)
        return pick(logits[0, -1], key, temperature, top_k), cache

    key, out = jax.random.key(seed), []
    token, cache = step(state, jnp.asarray([prompt], jnp.int32), 0, cache, jax.random.fold_in(key, 0))
    for i in range(max_new):
        out.append(int(token))
        if i + 1 < max_new:
            tokens = jnp.asarray([[out[-1]]], jnp.int32)
            token, cache = step(state, tokens, len(prompt) + i, cache, jax.random.fold_in(key, i + 1))
    return out
