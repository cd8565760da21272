"""The optimizer: optax AdamW with warmup + cosine decay and global-norm clipping, from the config.

The clip's norm is computed so that every mesh a replica can have (full, reduced degree) gets the
same bits from the same averaged gradient (`block_norm`; docs/design/index.md, "Bitwise agreement")."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ftjax.base.trees import PyTree
from ftjax.config import OptimConfig


def schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    decay = cfg.decay_steps or total_steps
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=max(decay, cfg.warmup_steps + 1),
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def make_optimizer(
    cfg: OptimConfig, total_steps: int, norm: Callable[[PyTree], jax.Array] = optax.global_norm
) -> optax.GradientTransformation:
    """`norm`: the clip's global norm of a gradient tree (`block_norm` in a replica)."""
    return optax.chain(
        clip_by_norm(cfg.clip_norm, norm),
        optax.adamw(schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay),
    )


def clip_by_norm(max_norm: float, norm: Callable[[PyTree], jax.Array]) -> optax.GradientTransformation:
    """optax.clip_by_global_norm (same arithmetic, same empty state) with the norm given."""

    def update(updates, state, params=None):
        del params
        g_norm = norm(updates)
        trigger = g_norm < max_norm
        return jax.tree.map(
            lambda t: jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm), updates
        ), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def block_norm(shardings: PyTree, blocks: Mapping[str, int], mesh: Mesh) -> Callable[[PyTree], jax.Array]:
    """A global norm whose bits do not depend on the mesh the leaves are sharded over.

    XLA's sum of squares of a sharded leaf is a per-device reduction, then a sum across devices:
    the terms are grouped by the mesh, and a 1-, 2- and 4-device replica get norms 1 ulp apart
    (hence different clipped updates); even a row reduction's bits depend on how many rows a
    device holds. Here each leaf is cut into equal blocks along each of its sharded dimensions:
    `blocks[axis]` along a dimension sharded over mesh axis `axis` (the full replica's size of that
    axis, which every degree's size divides, so a block never straddles two devices). Each device
    reduces its blocks one at a time in one loop body, whose input is one materialized block: the
    same computation on the same values on every mesh. The partial sums are gathered axis by axis
    (so in the same global block order on every mesh) and summed on every device, again a
    reduction of the same shape everywhere."""
    specs = [s.spec for s in jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))]
    local = {name: blocks[name] // size for name, size in mesh.shape.items() if name in blocks}

    def leaf_sums(x: jax.Array, spec) -> jax.Array:
        axes = [(i, name) for i, name in enumerate(spec) if name is not None]
        if not axes:  # replicated: the whole leaf, on every device
            return _sum_squares(x).reshape(1)
        # split each sharded dimension into (local blocks, block), block counts to the front
        shape = list(x.shape)
        for i, name in reversed(axes):
            n = local[name]
            shape[i : i + 1] = [n, x.shape[i] // n]
        x = x.reshape(shape)
        starts = [i + k for k, (i, _) in enumerate(axes)]  # where each block count sits now
        x = jnp.moveaxis(x, starts, list(range(len(axes))))
        front = x.shape[: len(axes)]
        sums = jax.lax.map(_sum_squares, x.reshape((-1, *x.shape[len(axes) :]))).reshape(front)
        for k, (_, name) in enumerate(axes):  # gather each axis's blocks: global block order
            sums = jax.lax.all_gather(sums, name, axis=k, tiled=True)
        return sums.reshape(-1)

    def partial_sums(*leaves):
        sums = [leaf_sums(x, spec) for x, spec in zip(leaves, specs)]
        return jnp.sqrt(jnp.sum(jax.lax.optimization_barrier(jnp.concatenate(sums))))  # (same shape everywhere)

    def norm(tree: PyTree) -> jax.Array:
        leaves = jax.tree.leaves(tree)
        if len(leaves) != len(specs):
            raise ValueError(f"block_norm: {len(leaves)} leaves, {len(specs)} shardings")
        for x, spec in zip(leaves, specs):
            for i, name in enumerate(spec):
                if name is not None and (not isinstance(name, str) or name not in blocks or x.shape[i] % blocks[name]):
                    raise ValueError(
                        f"block_norm: a leaf of shape {x.shape} and partition {tuple(spec)} is not "
                        f"equal blocks along its sharded dimensions (blocks per axis: {dict(blocks)})"
                    )
        return jax.shard_map(partial_sums, mesh=mesh, in_specs=tuple(specs), out_specs=P(), check_vma=False)(*leaves)

    return norm


def _sum_squares(block: jax.Array) -> jax.Array:
    # the barrier makes the block a value of its own: XLA cannot fuse the reduction with the
    # slicing around it, whose shapes differ from mesh to mesh
    return jnp.sum(jnp.square(jax.lax.optimization_barrier(block)))
