"""The optimizer: optax AdamW with warmup + cosine decay and global-norm clipping, from the config."""

from __future__ import annotations

import optax

from ftjax.config import OptimConfig


def schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    decay = cfg.decay_steps or total_steps
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
        decay_steps=max(decay, cfg.warmup_steps + 1), end_value=cfg.lr * cfg.min_lr_ratio,
    )


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                    weight_decay=cfg.weight_decay),
    )
