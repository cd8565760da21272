"""A Llama-class decoder (the Llama 2/3 architecture) in Flax NNX.

Pre-norm blocks of RMSNorm, grouped-query attention with rotary position embeddings (RoPE), and a
SwiGLU feed-forward; no biases; the output projection optionally tied to the input embedding.

Every parameter carries logical axis names (ftjax/program/sharding.py maps them to the mesh):
`vocab`, `embed` (the model width), `heads` (query heads), `kv_heads` (key/value heads),
`head_dim`, `mlp` (the feed-forward's hidden width). Heads and the hidden width are named apart so
that a tensor-parallel axis can shard them.

Precision (docs/design/model.md, "Precision"): parameters are float32 master weights; the matmuls run
in `compute_dtype` (their inputs cast); the residual stream, RMSNorm's statistics, RoPE, the
attention softmax and the logits are float32.

With `scan_layers` the blocks' parameters are stacked along a first axis named `layers` (one leaf per
kind of parameter, not per layer) and the forward pass is a `jax.lax.scan` over them: XLA compiles
one block instead of n_layers copies, and a rematerialized block's saved input is the scan's
explicit per-layer residual (docs/design/model.md, "Scanned layers").

Attention goes through `jax.nn.dot_product_attention` (`attention`: xla, or cudnn's fused kernel on a
GPU: `ftjax.program.models.attention_impl` picks), causal, and with `segment_ids` [B, T] (packed
documents) also within a token's own segment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from ftjax.program.sharding import constrain_rows

F32 = jnp.float32
AttentionImpl = Literal["xla", "cudnn"]  # jax.nn.dot_product_attention's implementations (model.attention, resolved)

# remat setting -> what a block keeps for the backward pass (the rest is recomputed)
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,  # its input only
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # and its weight matmuls' outputs
}


@dataclass(frozen=True)
class Decoder:
    """The shape every decoder here shares (this one and the GPT): its vocabulary, its width, its
    blocks, their attention heads and their feed-forward width."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], std: float = 0.02) -> nnx.Param:
    init = nnx.with_partitioning(nnx.initializers.normal(stddev=std), axes)
    return nnx.Param(init(rngs.params(), shape))


def _mm(spec: str, x: jax.Array, w: nnx.Param, dtype) -> jax.Array:
    """A matmul in `dtype`: both operands cast (the float32 parameter stays the master copy)."""
    return jnp.einsum(spec, x.astype(dtype), w[...].astype(dtype))


class RMSNorm(nnx.Module):
    def __init__(self, d: int, eps: float, rngs: nnx.Rngs):
        self.scale = nnx.Param(nnx.with_partitioning(nnx.initializers.ones_init(), ("embed",))(rngs.params(), (d,)))
        self.eps = eps

    def __call__(self, x: jax.Array, dtype) -> jax.Array:
        """The statistics in float32, the result in `dtype` (the next matmul's input)."""
        x = x.astype(F32)
        y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...]).astype(dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> jax.Array:
    """RoPE's inverse frequencies [head_dim / 2], float32: theta^(-2i / head_dim), stretched by
    `scaling` (`model.rope_scaling`, a dict of its fields) as Hugging Face's Llama computes them
    (transformers' modeling_rope_utils: `_compute_linear_scaling_rope_parameters`,
    `_compute_llama3_parameters`), in float32 as there, so converted checkpoints see the same angles."""
    freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=F32) / head_dim)
    if scaling is None:
        return freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return freq / factor
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * jnp.pi / freq
    # long wavelengths (beyond the original context / low) slowed by factor, short ones (below
    # original / high) kept, those between interpolated linearly in original / wavelength
    scaled = jnp.where(wavelen > old / low, freq / factor, freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return jnp.where(medium, smoothed, scaled)


def rope_tables(
    length: int, head_dim: int, theta: float, scaling: dict | None = None, positions: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """cos and sin [length, head_dim / 2] (or [B, T, head_dim / 2] of `positions` [B, T]) of RoPE's
    angles: position x `rope_frequencies`."""
    freq = rope_frequencies(head_dim, theta, scaling)
    pos = jnp.arange(length, dtype=F32) if positions is None else positions.astype(F32)
    angle = pos[..., None] * freq
    return jnp.cos(angle), jnp.sin(angle)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, heads, head_dim] rotated by position, in float32: the head's first half paired
    with its second half (the rotate-half layout)."""
    x1, x2 = jnp.split(x.astype(F32), 2, axis=-1)
    c, s = cos[..., None, :], sin[..., None, :]  # (broadcast over heads: [T, 1, hd/2] or [B, T, 1, hd/2])
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def segment_mask(segment_ids: jax.Array) -> jax.Array:
    """[B, 1, T, T]: query t may attend to key s of the same segment (causality is added apart).
    Positions need no reset at a document's start: RoPE sees only the distance between tokens."""
    return (segment_ids[:, None, :, None] == segment_ids[:, None, None, :]).astype(bool)


class Attention(nnx.Module):
    """Grouped-query attention: n_heads query heads share n_kv_heads key/value heads."""

    def __init__(self, d: int, n_heads: int, n_kv_heads: int, n_layers: int, rngs: nnx.Rngs, hd: int = 0):
        hd = hd or d // n_heads
        self.wq = _param(rngs, (d, n_heads, hd), ("embed", "heads", "head_dim"))
        self.wk = _param(rngs, (d, n_kv_heads, hd), ("embed", "kv_heads", "head_dim"))
        self.wv = _param(rngs, (d, n_kv_heads, hd), ("embed", "kv_heads", "head_dim"))
        # GPT-2's scaled init of the residual projections keeps the residual stream's variance flat
        self.wo = _param(rngs, (n_heads, hd, d), ("heads", "head_dim", "embed"), std=0.02 / (2 * n_layers) ** 0.5)

    def __call__(self, x, cos, sin, mask, dtype, impl: AttentionImpl = "xla", chunk: int = 0) -> jax.Array:
        q = apply_rope(_mm("btd,dhk->bthk", x, self.wq, dtype), cos, sin)
        k = apply_rope(_mm("btd,dhk->bthk", x, self.wk, dtype), cos, sin)
        v = _mm("btd,dhk->bthk", x, self.wv, dtype)
        if chunk and impl == "xla":
            y = chunked_attention(q, k, v, mask, chunk)
        else:
            y = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=impl)  # softmax in f32
        return _mm("bthk,hkd->btd", y, self.wo, dtype)


def chunked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, chunk: int) -> jax.Array:
    """Causal attention of q [B, T, H, hd] over k, v [B, T, KV, hd], `chunk` query positions at a
    time (`model.attention_chunk`): XLA's attention writes every T x T score matrix, this one the
    chunk x T scores of one chunk, each chunk a `jax.checkpoint` whose scores the backward pass
    recomputes. Every query row's softmax is over the same keys as unchunked, so the outputs are
    the same numbers to rounding. `mask` [B, 1, T, T] (segments) or None; T a multiple of chunk."""
    rows, length = q.shape[:2]
    n, keys = length // chunk, jnp.arange(length)

    @jax.checkpoint
    def one(part):
        qc, start = part
        allowed = (keys[None, :] <= start + jnp.arange(chunk)[:, None])[None, None]  # causal, [1, 1, chunk, T]
        if mask is not None:
            allowed = allowed & jax.lax.dynamic_slice_in_dim(mask, start, chunk, axis=2)
        return jax.nn.dot_product_attention(qc, k, v, mask=allowed, implementation="xla")

    parts = (q.reshape(rows, n, chunk, *q.shape[2:]).swapaxes(0, 1), jnp.arange(n) * chunk)
    return jax.lax.map(one, parts).swapaxes(0, 1).reshape(q.shape)


class SwiGLU(nnx.Module):
    def __init__(self, d: int, d_ff: int, n_layers: int, rngs: nnx.Rngs):
        self.w_gate = _param(rngs, (d, d_ff), ("embed", "mlp"))
        self.w_up = _param(rngs, (d, d_ff), ("embed", "mlp"))
        self.w_down = _param(rngs, (d_ff, d), ("mlp", "embed"), std=0.02 / (2 * n_layers) ** 0.5)

    def __call__(self, x: jax.Array, dtype) -> jax.Array:
        h = jax.nn.silu(_mm("btd,df->btf", x, self.w_gate, dtype)) * _mm("btd,df->btf", x, self.w_up, dtype)
        return _mm("btf,fd->btd", h, self.w_down, dtype)


class Block(nnx.Module):
    def __init__(
        self, d: int, n_heads: int, n_kv_heads: int, d_ff: int, n_layers: int, eps: float, rngs: nnx.Rngs, hd: int = 0
    ):
        self.attn_norm = RMSNorm(d, eps, rngs)
        self.attn = Attention(d, n_heads, n_kv_heads, n_layers, rngs, hd)
        self.mlp_norm = RMSNorm(d, eps, rngs)
        self.mlp = SwiGLU(d, d_ff, n_layers, rngs)

    def __call__(self, x, cos, sin, mask, dtype, impl: AttentionImpl = "xla", chunk: int = 0) -> jax.Array:
        """x: the float32 residual stream; each branch computes in `dtype` and is added in float32."""
        x = x + self.attn(self.attn_norm(x, dtype), cos, sin, mask, dtype, impl, chunk).astype(F32)
        return x + self.mlp(self.mlp_norm(x, dtype), dtype).astype(F32)


def block_runner(remat: str, dtype, impl: AttentionImpl = "xla", chunk: int = 0):
    """`run(block, x, cos, sin, mask)`: a block's forward, rematerialized by `remat`'s policy."""

    def run(block: Block, x, cos, sin, mask):
        return block(x, cos, sin, mask, dtype, impl, chunk)

    return run if remat == "none" else nnx.remat(run, policy=REMAT_POLICIES[remat])


LAYERS = "layers"  # the logical name of a scanned model's stacking axis (replicated)


def stack_blocks(blocks: list[Block]) -> Block:
    """One Block whose every parameter is `blocks`' parameters stacked along a new first axis,
    logically named `layers`: the same numbers, so a seed initializes a scanned model exactly as
    it does an unrolled one, and a checkpoint converts between the two by stacking."""
    graphdef, first = nnx.split(blocks[0])
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), first, *(nnx.split(b)[1] for b in blocks[1:]))
    block = nnx.merge(graphdef, stacked)
    for _, v in nnx.iter_graph(block):
        if isinstance(v, nnx.Param):
            v.set_metadata(out_sharding=(LAYERS, *v.get_metadata()["out_sharding"]))
    return block


def stacked_layers(tree: dict) -> dict:
    """A pure tree of an unrolled Llama's parameters (or one shaped like them: an update, an Adam
    moment), `blocks/<i>/...`, in the scanned layout, `layers/...` (`model.scan_layers`). The
    parameters of one seed map to each other exactly (`stack_blocks`); `unstacked_layers` undoes it."""
    out = {k: v for k, v in tree.items() if k != "blocks"}
    blocks = tree["blocks"]
    out["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *(blocks[i] for i in range(len(blocks))))
    return out


def unstacked_layers(tree: dict) -> dict:
    """The inverse of `stacked_layers`: `layers/...` [n_layers, ...] to `blocks/<i>/...`."""
    out = {k: v for k, v in tree.items() if k != "layers"}
    n = len(jax.tree.leaves(tree["layers"])[0])
    out["blocks"] = {i: jax.tree.map(lambda x, i=i: x[i], tree["layers"]) for i in range(n)}
    return out


def scan_blocks(layers: Block, x, cos, sin, mask, remat: str, dtype, impl: AttentionImpl = "xla", chunk: int = 0):
    """The residual stream through every layer of a stacked Block (`stack_blocks`), one scan step
    a layer. With remat the scan's body is rematerialized: the backward pass keeps each layer's
    input (and with save_dots its matmuls' outputs), stacked, and recomputes the rest."""
    graphdef, stacked = nnx.split(layers)

    def layer(x, params):
        x = constrain_rows(x)  # (the carry: XLA does not split a loop's rows by itself)
        return constrain_rows(nnx.merge(graphdef, params)(x, cos, sin, mask, dtype, impl, chunk)), None

    if remat != "none":  # (prevent_cse only guards unrolled code; in a scan it costs fusions)
        layer = jax.checkpoint(layer, policy=REMAT_POLICIES[remat], prevent_cse=False)
    return jax.lax.scan(layer, x, stacked)[0]


class Llama(nnx.Module):
    def __init__(
        self,
        shape: Decoder,
        *,
        n_kv_heads: int | None = None,
        rope_theta: float = 10000.0,
        tie_embeddings: bool = False,
        norm_eps: float = 1e-5,
        head_dim: int | None = None,
        rope_scaling: dict | None = None,
        compute_dtype=F32,
        attention: AttentionImpl = "xla",
        remat: str = "none",
        logits_chunk: int = 0,
        attention_chunk: int = 0,
        scan_layers: bool = False,
        rngs: nnx.Rngs,
    ):
        d, kv_heads = shape.d_model, n_kv_heads or shape.n_heads
        self.head_dim, self.rope_theta = head_dim or d // shape.n_heads, rope_theta
        # (a tuple of items, not a dict: NNX keeps a module's plain attributes as static, hashable data)
        self.rope_scaling = None if rope_scaling is None else tuple(sorted(rope_scaling.items()))
        self.compute_dtype, self.remat, self.attention = jnp.dtype(compute_dtype), remat, attention
        self.logits_chunk = logits_chunk  # positions whose logits the loss computes at once; 0: all
        self.attention_chunk = attention_chunk  # query positions XLA's attention takes at once; 0: all
        self.embed = _param(rngs, (shape.vocab_size, d), ("vocab", "embed"))
        blocks = [
            Block(d, shape.n_heads, kv_heads, shape.d_ff, shape.n_layers, norm_eps, rngs, self.head_dim)
            for _ in range(shape.n_layers)
        ]
        # unrolled: `blocks/<i>/...`, a leaf per layer; scanned: `layers/...`, stacked (stack_blocks)
        self.blocks = None if scan_layers else nnx.List(blocks)
        self.layers = stack_blocks(blocks) if scan_layers else None
        self.norm = RMSNorm(d, norm_eps, rngs)
        self.head = None if tie_embeddings else _param(rngs, (d, shape.vocab_size), ("embed", "vocab"))

    def __call__(
        self, tokens: jax.Array, segment_ids: jax.Array | None = None, positions: jax.Array | None = None
    ) -> jax.Array:
        """tokens (batch, time) int32, segment_ids (batch, time) int or None, positions (batch, time)
        int or None (0, 1, ...) -> logits (batch, time, vocab) float32."""
        return self.logits(self.features(tokens, segment_ids, positions))

    def rope(self, length: int, positions: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """cos, sin of RoPE for positions 0..length-1 (or `positions` [B, T])."""
        scaling = None if self.rope_scaling is None else dict(self.rope_scaling)
        return rope_tables(length, self.head_dim, self.rope_theta, scaling, positions)

    def features(
        self, tokens: jax.Array, segment_ids: jax.Array | None = None, positions: jax.Array | None = None
    ) -> jax.Array:
        """What the output projection reads: the final RMSNorm's output (batch, time, d_model) in the
        compute dtype. `logits` of any slice of its positions are those positions' logits, which is
        what lets the loss compute them a chunk at a time (`model.logits_chunk`)."""
        dtype = self.compute_dtype
        # the residual stream is split by rows like the batch (constrain_rows): left to itself, XLA
        # splits it along the width like the `embed`-sharded parameters (docs/design/model.md, "Rows")
        x = constrain_rows(jnp.take(self.embed[...], tokens, axis=0))  # float32 rows of the master embedding
        cos, sin = self.rope(tokens.shape[1], positions)
        mask = None if segment_ids is None else segment_mask(segment_ids)
        if self.layers is not None:
            x = scan_blocks(self.layers, x, cos, sin, mask, self.remat, dtype, self.attention, self.attention_chunk)
        else:
            run = block_runner(self.remat, dtype, self.attention, self.attention_chunk)
            assert self.blocks is not None  # (not scan_layers: the blocks are kept one by one)
            for block in self.blocks:
                x = constrain_rows(run(block, x, cos, sin, mask))
        return constrain_rows(self.norm(x, dtype))

    def logits(self, h: jax.Array) -> jax.Array:
        """features (..., d_model) -> float32 logits (..., vocab)."""
        dtype = self.compute_dtype
        if self.head is None:  # tied: the embedding's transpose
            return jnp.einsum("...d,vd->...v", h, self.embed[...].astype(dtype), preferred_element_type=F32)
        return jnp.einsum("...d,dv->...v", h, self.head[...].astype(dtype), preferred_element_type=F32)
