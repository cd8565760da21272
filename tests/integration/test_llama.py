"""The Llama model (issue 28): its shapes and parameter counts against the closed form, the built-in
configs and their checks, the causal and document mask. Training in bfloat16, remat and gradient
accumulation, which compile whole train steps, are in tests/integration/test_llama_training.py."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from ftjax.config import ConfigError, load_config
from ftjax.program import models
from ftjax.program.models.llama import (
    LAYERS,
    apply_rope,
    chunked_attention,
    rope_frequencies,
    rope_tables,
    segment_mask,
    stacked_layers,
    unstacked_layers,
)
from ftjax.program.sharding import LOGICAL_AXIS_RULES


def closed_form(m) -> int:
    """Parameters of a Llama of ModelConfig `m`: embedding (and untied output), per block the four
    attention matrices (query and output n_heads heads, key and value n_kv_heads), SwiGLU's three
    matrices and two RMSNorm scales, and the final norm."""
    hd = m.d_model // m.n_heads
    attn = m.d_model * hd * (2 * m.n_heads + 2 * m.kv_heads)
    block = attn + 3 * m.d_model * m.d_ff + 2 * m.d_model
    return m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2) + m.n_layers * block + m.d_model


@functools.lru_cache
def abstract_params(name: str):
    """The parameters of built-in config `name`'s model as shapes only (nothing allocated: the 8B
    builds on any machine)."""
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: models.build(load_config(name).model, nnx.Rngs(0)))
    return nnx.state(model, nnx.Param)


@pytest.mark.parametrize(
    "name, count",
    [("llama_tiny", 115_008), ("llama_150m", 151_758_144), ("llama_1b", 1_235_814_400), ("llama_8b", 8_030_261_248)],
)
def test_builtin_configs_validate_and_build_with_the_closed_form_parameter_count(name, count):
    cfg = load_config(name)
    assert cfg.model.kind == "llama"
    params = abstract_params(name)
    got = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    assert got == closed_form(cfg.model)
    assert got == count, f"{name}: {got:,}"
    # every parameter has logical axis names, one per dimension, each one the sharding rules know
    for path, spec in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.get_partition_spec(params)))[0]:
        assert all(a in LOGICAL_AXIS_RULES for a in spec), (path, spec)
    for leaf in jax.tree.leaves(params):
        assert leaf.dtype == jnp.float32  # master weights


def test_llama_3_shapes():
    """The 1B ties its embeddings (no output matrix); the 8B does not. Grouped-query attention:
    8 key/value heads of 128 dims for 32 query heads."""
    one = nnx.to_pure_dict(abstract_params("llama_1b"))
    eight = nnx.to_pure_dict(abstract_params("llama_8b"))
    assert "head" not in one and eight["head"].shape == (4096, 128256)
    attn = eight["blocks"][0]["attn"]
    assert attn["wq"].shape == (4096, 32, 128) and attn["wk"].shape == attn["wv"].shape == (4096, 8, 128)
    assert attn["wo"].shape == (32, 128, 4096)
    mlp = eight["blocks"][31]["mlp"]
    assert mlp["w_gate"].shape == mlp["w_up"].shape == (4096, 14336) and mlp["w_down"].shape == (14336, 4096)


@pytest.mark.parametrize(
    "name, hf",
    [
        (
            "llama_1b",  # meta-llama/Llama-3.2-1B's config.json
            dict(vocab=128256, d=2048, layers=16, heads=32, kv=8, hd=64, ff=8192, factor=32.0, tied=True),
        ),
        (
            "llama_8b",  # meta-llama/Llama-3.1-8B's config.json
            dict(vocab=128256, d=4096, layers=32, heads=32, kv=8, hd=128, ff=14336, factor=8.0, tied=False),
        ),
    ],
)
def test_builtin_llama_3_configs_are_the_released_models(name, hf):
    """Shapes, tying, epsilon and RoPE (theta 500000, llama3 scaling) of the released config.json:
    a released checkpoint converted by `ftjax convert hf` loads as the same model, not another."""
    m = load_config(name).model
    got = (m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.kv_heads, m.head_size, m.d_ff, m.tie_embeddings)
    assert got == tuple(hf[k] for k in ("vocab", "d", "layers", "heads", "kv", "hd", "ff", "tied"))
    assert m.rope_theta == 500000.0 and m.norm_eps == 1e-5
    rs = m.rope_scaling
    assert (rs.rope_type, rs.factor, rs.low_freq_factor, rs.high_freq_factor) == ("llama3", hf["factor"], 1.0, 4.0)
    assert rs.original_max_position_embeddings == 8192


def test_llama3_rope_scaling_keeps_high_divides_low_and_interpolates_between():
    """The three cases of transformers' `_compute_llama3_parameters`, at the 1B's settings, each
    frequency against its case's closed form in float64."""
    rs = load_config("llama_1b").model.rope_scaling.model_dump()
    base = 1.0 / 500000.0 ** (np.arange(0, 64, 2) / 64)
    got = np.asarray(rope_frequencies(64, 500000.0, rs), np.float64)
    wavelen = 2 * np.pi / base
    high, low = wavelen < 8192 / 4, wavelen > 8192 / 1
    smooth = (8192 / wavelen - 1) / (4 - 1)
    want = np.where(high, base, np.where(low, base / 32, (1 - smooth) * base / 32 + smooth * base))
    assert high.sum() and low.sum() and (~high & ~low).sum()  # every case occurs at head_dim 64
    np.testing.assert_allclose(got, want, rtol=1e-6)
    linear = np.asarray(rope_frequencies(64, 500000.0, {"rope_type": "linear", "factor": 4.0}), np.float64)
    np.testing.assert_allclose(linear, base / 4, rtol=1e-6)


def test_a_head_dim_of_its_own_shapes_the_attention():
    model = tiny_model(head_dim=24)  # d_model 64 / 4 heads would be 16
    assert model.blocks[0].attn.wq.shape == (64, 4, 24) and model.blocks[0].attn.wo.shape == (4, 24, 64)
    logits = jitted(model)(jnp.zeros((1, 8), jnp.int32), None)
    assert logits.shape == (1, 8, 256) and np.isfinite(np.asarray(logits)).all()


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["model.kind=llama", "model.n_kv_heads=3"], "model: n_kv_heads (3) must divide n_heads (4)"),
        (["model.kind=llama", "model.n_heads=8", "model.d_model=24"], "model: d_model / n_heads (3, the head size)"),
        (["model.n_kv_heads=2"], "model: n_kv_heads: only for kind llama (kind is gpt)"),
        (["model.tie_embeddings=true"], "model: tie_embeddings: only for kind llama"),
        (["model.compute_dtype=bfloat16"], "model: compute_dtype: bfloat16 is for kind llama"),
        (["model.kind=mlp", "model.remat=full"], "model: remat: only for kind llama or gpt (kind is mlp)"),
        (["model.remat=some"], "model.remat: Input should be 'none', 'full' or 'save_dots'"),
        (["model.compute_dtype=fp16"], "model.compute_dtype: Input should be 'auto', 'float32' or 'bfloat16'"),
        (["model.attention=cudnn"], "model: attention: only for kind llama (kind is gpt)"),
        (["model.logits_chunk=16"], "model: logits_chunk: only for kind llama (kind is gpt)"),
        (["model.kind=llama", "model.logits_chunk=-1"], "model.logits_chunk: Input should be greater than or equal"),
        (["model.kind=llama", "model.logits_chunk=64"], "model: logits_chunk (64) must be below seq_len (64)"),
        (["model.kind=llama", "model.attention_chunk=24"], "model: attention_chunk (24) must divide seq_len (64)"),
        (["model.kind=llama", "model.attention_chunk=64"], "model: attention_chunk (64) must divide seq_len (64)"),
        (["model.attention_chunk=16"], "model: attention_chunk: only for kind llama (kind is gpt)"),
        (["model.scan_layers=true"], "model: scan_layers: only for kind llama (kind is gpt)"),
        (["model.kind=llama", "model.head_dim=9"], "model: head_dim (9, the head size) must be even"),
        (["model.head_dim=16"], "model: head_dim: only for kind llama (kind is gpt)"),
        (["model.rope_scaling={rope_type: linear, factor: 2}"], "model: rope_scaling: only for kind llama"),
        (["model.kind=llama", "model.rope_scaling={rope_type: yarn, factor: 2}"], "model.rope_scaling.rope_type"),
        (
            ["model.kind=llama", "model.rope_scaling={rope_type: llama3, factor: 8, high_freq_factor: 1}"],
            "high_freq_factor (1.0) must exceed low_freq_factor (1.0)",
        ),
        (
            ["model.kind=llama", "model.attention=cudnn", "model.attention_chunk=16"],
            "model: attention_chunk: only for attention xla or auto",
        ),
        (["model.kind=llama", "model.attention=flash"], "model.attention: Input should be 'auto', 'xla' or 'cudnn'"),
        (["data.micro_batches=3"], "data: micro_batches (3) must divide batch_size (8)"),
        (["data.micro_batches=8", "mesh.devices_per_host=2"], "data.micro_batches (8): a micro-batch of 1 rows"),
    ],
)
def test_settings_are_checked_and_name_the_field(overrides, says):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", overrides)
    assert says in str(e.value)


def test_gpt_and_mlp_configs_are_unchanged():
    for name, overrides in (("tiny", []), ("gpt_small", []), ("tiny", ["model.kind=mlp"])):
        cfg = load_config(name, overrides)
        assert cfg.model.compute_dtype == "auto" and cfg.model.remat == "none"


def tiny_model(**overrides):
    cfg = load_config("llama_tiny", [f"model.{k}={v}" for k, v in overrides.items()])
    with nnx.use_eager_sharding(False):
        return models.build(cfg.model, nnx.Rngs(0))


def jitted(model):
    """The model's forward, compiled once: (tokens, segment_ids or None) -> logits."""
    graphdef, state = nnx.split(model)
    return jax.jit(lambda t, s: nnx.merge(graphdef, state)(t, s))


def test_forward_shapes_and_tied_or_untied_output():
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
    for tie in (True, False):
        model = tiny_model(tie_embeddings=tie)
        logits = jitted(model)(tokens, None)
        assert logits.shape == (2, 16, 256) and logits.dtype == jnp.float32
        assert (model.head is None) == tie
        assert np.isfinite(np.asarray(logits)).all()


def test_a_token_sees_only_earlier_tokens_of_its_own_segment():
    """Two documents packed in one row (segment ids 0 then 1): an output does not change when a
    token of the other segment or a later token changes, and does when an earlier token of its own
    segment does (so the comparison can fail)."""
    model = jitted(tiny_model())
    tokens = jax.random.randint(jax.random.key(2), (1, 16), 0, 256)
    seg = jnp.asarray([[0] * 6 + [1] * 10])

    def out(t, s=seg):
        return np.asarray(model(t, s)[0])

    base = out(tokens)
    other_doc = out(tokens.at[0, 3].set((tokens[0, 3] + 1) % 256))  # a token of document 0
    np.testing.assert_array_equal(other_doc[6:], base[6:])  # document 1 does not see it
    assert not np.allclose(other_doc[3:6], base[3:6])  # document 0 does, from position 3 on
    later = out(tokens.at[0, 10].set((tokens[0, 10] + 1) % 256))
    np.testing.assert_array_equal(later[:10], base[:10])  # causal: nothing before position 10 moves
    assert not np.allclose(later[10:], base[10:])
    # without segment ids the row is one document: document 1's outputs do see position 3
    whole = out(tokens, None)
    changed = out(tokens.at[0, 3].set((tokens[0, 3] + 1) % 256), None)
    assert not np.allclose(changed[6:], whole[6:])


@pytest.mark.parametrize("packed", [False, True], ids=["one document", "two documents"])
def test_attention_in_query_chunks_is_the_whole_attention_forward_and_backward(packed):
    """chunked_attention (model.attention_chunk) against jax.nn.dot_product_attention, grouped-query
    (4 query heads on 2 key/value heads), causal, with and without a segment mask: outputs and the
    gradients of q, k and v the same to float32 rounding; and the whole model with chunks gives the
    unchunked model's logits."""
    rows, length, heads, kv, hd = 2, 64, 4, 2, 16
    keys = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(keys[0], (rows, length, heads, hd))
    k, v = (jax.random.normal(key, (rows, length, kv, hd)) for key in keys[1:])
    seg = jnp.asarray([[0] * 20 + [1] * 44, [0] * 50 + [1] * 14]) if packed else None
    mask = None if seg is None else segment_mask(seg)

    def whole(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True)

    for chunk in (8, 32):
        np.testing.assert_allclose(chunked_attention(q, k, v, mask, chunk), whole(q, k, v), atol=1e-5)
        want = jax.grad(lambda *a: (whole(*a) ** 2).sum(), (0, 1, 2))(q, k, v)
        got = jax.grad(lambda *a, c=chunk: (chunked_attention(*a, mask, c) ** 2).sum(), (0, 1, 2))(q, k, v)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    tokens = jax.random.randint(jax.random.key(6), (rows, length), 0, 256)
    ref = jitted(tiny_model(seq_len=length))(tokens, seg)
    got = jitted(tiny_model(seq_len=length, attention_chunk=16))(tokens, seg)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_scanned_layers_are_the_unrolled_layers_stacked_and_compute_the_same():
    """model.scan_layers: a seed gives the unrolled model's parameters stacked along a first axis
    named `layers` (bitwise; `stacked_layers` and `unstacked_layers` convert either way), and the
    scanned model's logits and gradients are the unrolled model's to float32 rounding, with packed
    documents, with attention in chunks, and without remat and under save_dots."""
    unrolled, scanned = tiny_model(n_layers=3), tiny_model(n_layers=3, scan_layers=True)
    a, b = (nnx.to_pure_dict(nnx.state(m, nnx.Param)) for m in (unrolled, scanned))
    assert "blocks" not in b and "layers" not in a
    assert jax.tree.map(np.shape, b["layers"]["attn"]["wq"]) == (3, *np.shape(a["blocks"][0]["attn"]["wq"]))
    jax.tree.map(np.testing.assert_array_equal, stacked_layers(a), b)
    jax.tree.map(np.testing.assert_array_equal, unstacked_layers(b), a)
    specs_a, specs_b = (nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(m, nnx.Param))) for m in (unrolled, scanned))
    for path, spec in jax.tree_util.tree_flatten_with_path(specs_b["layers"], is_leaf=lambda x: isinstance(x, P))[0]:
        unrolled_spec = specs_a["blocks"][0]
        for key in path:
            unrolled_spec = unrolled_spec[key.key]
        assert tuple(spec) == (LAYERS, *unrolled_spec), path  # (`layers` is replicated: LOGICAL_AXIS_RULES)
    assert LOGICAL_AXIS_RULES[LAYERS] is None

    tokens = jax.random.randint(jax.random.key(7), (2, 32), 0, 256)
    seg = jnp.asarray([[0] * 12 + [1] * 20, [0] * 32])
    for settings in ({}, {"attention_chunk": 8}):
        want = jitted(tiny_model(n_layers=3, seq_len=32, **settings))(tokens, seg)
        got = jitted(tiny_model(n_layers=3, seq_len=32, scan_layers=True, **settings))(tokens, seg)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    def grads(model):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(p):
            return (nnx.merge(graphdef, p, rest)(tokens, seg) ** 2).mean()

        return nnx.to_pure_dict(jax.jit(jax.grad(loss))(params))

    want = stacked_layers(grads(tiny_model(n_layers=3, seq_len=32)))
    for remat in ("none", "save_dots"):  # (full: tests/integration/test_llama_training.py)
        got = grads(tiny_model(n_layers=3, seq_len=32, scan_layers=True, remat=remat))
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-7), got, want)


def test_positions_restart_nowhere_a_document_is_the_same_wherever_it_is_packed():
    """RoPE depends on distances only: a document's outputs are the same at the start of a row and
    after another document (up to float32 rounding of the rotation angles)."""
    model = jitted(tiny_model())
    doc = jax.random.randint(jax.random.key(3), (1, 8), 0, 256)
    before = jax.random.randint(jax.random.key(4), (1, 8), 0, 256)
    alone = np.asarray(model(doc, None)[0])
    packed = np.asarray(model(jnp.concatenate([before, doc], 1), jnp.asarray([[0] * 8 + [1] * 8]))[0, 8:])
    np.testing.assert_allclose(packed, alone, rtol=1e-4, atol=1e-4)


def test_auto_compute_dtype_is_float32_on_cpu():
    assert jax.default_backend() == "cpu"
    assert tiny_model(compute_dtype="auto").compute_dtype == jnp.float32
    assert tiny_model(compute_dtype="bfloat16").compute_dtype == jnp.bfloat16


def test_auto_attention_is_cudnn_only_where_it_can_run_and_a_cudnn_setting_that_cannot_is_refused():
    bf16, f32 = jnp.bfloat16, jnp.float32
    assert models.attention_impl("auto", bf16, 64, backend="gpu") == "cudnn"
    for dtype, head, backend in (
        (bf16, 64, "cpu"),
        (f32, 64, "gpu"),
        (bf16, 12, "gpu"),
        (bf16, 256, "gpu"),
        (jnp.float16, 64, "gpu"),
    ):
        assert models.attention_impl("auto", dtype, head, backend=backend) == "xla"
    assert models.attention_impl("xla", bf16, 64, backend="gpu") == "xla"
    with pytest.raises(ValueError, match=r"model.attention: cudnn needs a GPU \(JAX's backend is cpu\) and bfloat16"):
        models.attention_impl("cudnn", f32, 64, backend="cpu")
    with pytest.raises(ValueError, match="model.attention: cudnn needs a GPU"):
        tiny_model(attention="cudnn")  # this machine's backend is the CPU
    assert tiny_model(attention="auto").attention == "xla"


def test_an_attention_chunk_that_cudnn_makes_unused_is_warned_about(monkeypatch):
    """model.attention_chunk bounds XLA's score matrices; where `attention: auto` picks cuDNN's kernel
    (a GPU, bfloat16) the setting does nothing, and building the model says so, once; where XLA's
    attention runs, nothing is said."""
    cfg = load_config("llama_tiny", ["model.attention_chunk=16", "model.compute_dtype=bfloat16"]).model
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # on CPU the chunks are used: no warning
        with nnx.use_eager_sharding(False):
            models.build(cfg, nnx.Rngs(0))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    unused = r"model.attention_chunk=16 is unused: attention auto runs cuDNN"
    with pytest.warns(UserWarning, match=unused), nnx.use_eager_sharding(False):
        model = models.build(cfg, nnx.Rngs(0))
    assert model.attention == "cudnn"


def test_rope_scores_depend_on_the_distance_only_and_theta_sets_the_frequencies():
    """RoPE: q at position m against k at position n scores the same as at m + s, n + s, and
    differently at another distance; another theta, other scores."""
    q, k = jax.random.normal(jax.random.key(5), (2, 1, 1, 1, 16))

    def score(m, n, theta=10000.0):
        cos, sin = rope_tables(64, 16, theta)
        at = lambda x, i: apply_rope(x, cos[i : i + 1], sin[i : i + 1])
        return float(jnp.sum(at(q, m) * at(k, n)))

    assert score(9, 4) == pytest.approx(score(40, 35), rel=1e-5)
    assert score(9, 4) != pytest.approx(score(9, 6), rel=1e-3)
    assert score(9, 4, 500000.0) != pytest.approx(score(9, 4), rel=1e-3)
