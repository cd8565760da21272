"""Flax NNX models with FSDP partitioning annotations (logical axis names on every parameter)."""

from ftjax.program.models.gpt import GPT
from ftjax.program.models.llama import AttentionImpl, Decoder, Llama
from ftjax.program.models.mlp import TokenMLP

MODELS = {"gpt": GPT, "mlp": TokenMLP, "llama": Llama}


def compute_dtype(setting: str):
    """The dtype of a model's matmuls for `model.compute_dtype`: auto is bfloat16 on an accelerator
    (gpu, tpu) and float32 on cpu, where bfloat16 matmuls are emulated and slower."""
    import jax
    import jax.numpy as jnp

    if setting == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return jnp.dtype(setting)


def attention_impl(setting: str, dtype, head_dim: int, backend: str | None = None) -> AttentionImpl:
    """The implementation of `jax.nn.dot_product_attention` for `model.attention`. JAX's own default
    is XLA's, which materializes every T x T score matrix (4 GiB a layer for 8 x 32 heads x 2048^2
    in float32); cuDNN's fused kernel never does, but runs only on a GPU, in 16-bit (of the compute
    dtypes `model.compute_dtype` names, bfloat16), for head sizes that are a multiple of 8 up to
    128 (where it cannot, `model.attention_chunk` bounds XLA's matrices). auto picks it where it can
    run. A cudnn setting that cannot run is refused here, at build, rather than by cuDNN inside the
    first compile."""
    import jax
    import jax.numpy as jnp

    backend = backend or jax.default_backend()
    problems = [
        why
        for bad, why in (
            (backend != "gpu", f"a GPU (JAX's backend is {backend})"),
            (jnp.dtype(dtype) != jnp.bfloat16, f"bfloat16 compute (it is {jnp.dtype(dtype)})"),
            (head_dim % 8 or head_dim > 128, f"a head size a multiple of 8 up to 128 (it is {head_dim})"),
        )
        if bad
    ]
    if setting == "auto":
        return "xla" if problems else "cudnn"
    if setting == "cudnn" and problems:
        from ftjax.config import ConfigError

        raise ConfigError(f"model.attention: cudnn needs {' and '.join(problems)}; use xla or auto")
    return "cudnn" if setting == "cudnn" else "xla"  # (the config allows auto, xla and cudnn only)


def build(cfg, rngs):
    """Build the model named by a ModelConfig (`kind`: gpt | mlp | llama)."""
    if cfg.kind == "mlp":
        return TokenMLP(vocab_size=cfg.vocab_size, d_model=cfg.d_model, d_ff=cfg.d_ff, rngs=rngs)
    shape = Decoder(cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_ff)
    if cfg.kind == "gpt":
        return GPT(shape, seq_len=cfg.seq_len, remat=cfg.remat, rngs=rngs)
    dtype = compute_dtype(cfg.compute_dtype)
    attention = attention_impl(cfg.attention, dtype, cfg.head_size)
    if cfg.attention_chunk and attention == "cudnn":  # (attention: cudnn with a chunk is refused by the config)
        import warnings

        warnings.warn(
            f"model.attention_chunk={cfg.attention_chunk} is unused: attention auto runs cuDNN's fused kernel "
            "here, which keeps no score matrix (the chunks are for XLA's attention)",
            stacklevel=2,
        )
    return Llama(
        shape,
        n_kv_heads=cfg.kv_heads,
        rope_theta=cfg.rope_theta,
        tie_embeddings=cfg.tie_embeddings,
        norm_eps=cfg.norm_eps,
        head_dim=cfg.head_size,
        rope_scaling=None if cfg.rope_scaling is None else cfg.rope_scaling.model_dump(),
        compute_dtype=dtype,
        attention=attention,
        remat=cfg.remat,
        logits_chunk=cfg.logits_chunk,
        attention_chunk=cfg.attention_chunk,
        scan_layers=cfg.scan_layers,
        rngs=rngs,
    )
