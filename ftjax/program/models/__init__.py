"""Flax NNX models with FSDP partitioning annotations (logical axis names on every parameter)."""

from ftjax.program.models.gpt import GPT
from ftjax.program.models.mlp import TokenMLP

MODELS = {"gpt": GPT, "mlp": TokenMLP}


def build(cfg, rngs):
    """Build the model named by a ModelConfig (`kind`: gpt | mlp)."""
    kwargs = dict(vocab_size=cfg.vocab_size, d_model=cfg.d_model, d_ff=cfg.d_ff)
    if cfg.kind == "gpt":
        kwargs.update(n_layers=cfg.n_layers, n_heads=cfg.n_heads, seq_len=cfg.seq_len)
    return MODELS[cfg.kind](**kwargs, rngs=rngs)
