"""Flax NNX models with FSDP partitioning annotations (logical axis names on every parameter)."""

from ftjax.program.models.gpt import GPT
from ftjax.program.models.llama import Decoder, Llama
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


def build(cfg, rngs):
    """Build the model named by a ModelConfig (`kind`: gpt | mlp | llama)."""
    if cfg.kind == "mlp":
        return TokenMLP(vocab_size=cfg.vocab_size, d_model=cfg.d_model, d_ff=cfg.d_ff, rngs=rngs)
    shape = Decoder(cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_ff)
    if cfg.kind == "gpt":
        return GPT(shape, seq_len=cfg.seq_len, remat=cfg.remat, rngs=rngs)
    return Llama(
        shape,
        n_kv_heads=cfg.kv_heads,
        rope_theta=cfg.rope_theta,
        tie_embeddings=cfg.tie_embeddings,
        norm_eps=cfg.norm_eps,
        compute_dtype=compute_dtype(cfg.compute_dtype),
        remat=cfg.remat,
        rngs=rngs,
    )
