"""The built-in tasks, and the task of a config.

`language_model` is a task like any user's: the config's `model:` section builds a Flax NNX model
(ftjax/program/models: the GPT-2-style model, the Llama-class one, or the token MLP), `data.source`
names the source, and the loss is each sequence's mean next-token cross-entropy (in float32). A
config without `task:` trains it.
`token_lm` is the same model and loss on a tokenized corpus (`ftjax data prepare`, ftjax/program/tokens.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from ftjax.program.sources import token_source
from ftjax.program.task import (
    Task,
    TaskError,
    batch_rows,
    config_setting,
    first_leaf_not,
    load_task,
    nnx_task,
    normalize_loss,
)

BUILTIN = "ftjax.program.tasks:language_model"

_loaded: dict[str, Task] = {}


def token_losses(model, batch):
    """Per-token next-token cross-entropy (float32) [B, seq_len] and its weights [B, seq_len].

    A batch is an int32[B, seq_len + 1] token array (every weight 1), or a dict of `tokens` and
    `segment_ids` (packed documents, the same shape): the model attends within a segment only, and
    a target in another segment than its input (the first token of the next document, after an EOS)
    weighs 0, so no loss crosses a document boundary."""
    tokens, segments = (batch["tokens"], batch.get("segment_ids")) if isinstance(batch, dict) else (batch, None)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    kw = {} if segments is None else {"segment_ids": segments[:, :-1]}
    if getattr(model, "logits_chunk", 0):  # (a Llama with model.logits_chunk set)
        losses = chunked_cross_entropy(model.logits, model.features(inputs, **kw), targets, model.logits_chunk)
    else:
        losses = optax.softmax_cross_entropy_with_integer_labels(model(inputs, **kw).astype("float32"), targets)
    if segments is None:
        return losses, jnp.ones_like(losses)
    return losses, (segments[:, 1:] == segments[:, :-1]).astype(losses.dtype)


def chunked_cross_entropy(logits_of, features: jax.Array, targets: jax.Array, chunk: int) -> jax.Array:
    """Per-token cross-entropy [B, T] of `logits_of(features)` against `targets` [B, T], the logits
    of `chunk` positions (of every row) at a time.

    A 128K-token vocabulary makes the float32 logits the step's largest buffer (the 1B Llama's
    8 x 2048 tokens: 8.4 GB, and as much again for their gradient). Here a scan computes one chunk's
    logits, reduces them to its losses and drops them; the backward pass recomputes each chunk's
    logits (jax.checkpoint) instead of keeping them. The losses are the same numbers (each logit is
    the same dot product); the output projection's gradient is summed chunk by chunk, so it differs
    from the unchunked one in rounding only. A length that `chunk` does not divide is padded, and
    the padding's losses dropped."""
    rows, length = targets.shape
    n = -(-length // chunk)
    if pad := n * chunk - length:
        features = jnp.pad(features, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))

    @jax.checkpoint
    def one(part):
        f, t = part
        return optax.softmax_cross_entropy_with_integer_labels(logits_of(f).astype("float32"), t)

    # chunk-major, so the scan walks positions and every chunk keeps the batch's rows (and sharding)
    parts = (features.reshape(rows, n, chunk, -1).swapaxes(0, 1), targets.reshape(rows, n, chunk).swapaxes(0, 1))
    return jax.lax.map(one, parts).swapaxes(0, 1).reshape(rows, n * chunk)[:, :length]


def _lm_task(cfg, source, name: str) -> Task:
    """Next-token prediction on `source`'s examples (`token_losses`) with the model of `cfg.model`:
    each sequence's mean loss over its weighted targets."""
    from ftjax.program import models

    def loss(model, batch):
        losses, weights = token_losses(model, batch)
        if not isinstance(batch, dict) or "segment_ids" not in batch:
            return losses.mean(axis=1)  # (the unpacked loss, bit for bit as before)
        return (losses * weights).sum(axis=1) / jnp.maximum(weights.sum(axis=1), 1.0)

    return nnx_task(
        lambda rngs: models.build(cfg.model, rngs), loss, source, name=name, tokens_per_example=cfg.model.seq_len
    )


def language_model(cfg) -> Task:
    """The model of `cfg.model` on the built-in source of `data.source` (stdlib bytes, synthetic)."""
    return _lm_task(cfg, token_source(cfg.data.source, cfg.seed, cfg.model.seq_len, cfg.model.vocab_size), BUILTIN)


def token_lm(cfg, *, dir: str, split: str = "train", packing: str = "none") -> Task:
    """The model of `cfg.model` on token files (`ftjax data prepare --out DIR`): windows of
    seq_len + 1 tokens of `split`, memory-mapped. `model.vocab_size` must hold the files' vocabulary
    (it may be larger: a vocabulary padded to a round size). `packing: segments` (llama models):
    attention and loss stay within each document of a window (TokenWindows, `token_losses`)."""
    from ftjax.program.tokens import PACKINGS, SPLITS, TokenFileError, TokenWindows

    name = "ftjax.program.tasks:token_lm"
    if split not in SPLITS:
        raise TaskError(f"task {name}: task_args.split: {split!r} is not one of {', '.join(SPLITS)}")
    if packing not in PACKINGS:
        raise TaskError(f"task {name}: task_args.packing: {packing!r} is not one of {', '.join(PACKINGS)}")
    if packing != "none" and cfg.model.kind != "llama":
        raise TaskError(
            f"task {name}: task_args.packing={packing} needs a model that takes segment ids "
            f"(model.kind=llama), not model.kind={cfg.model.kind}"
        )
    try:
        source = TokenWindows(dir, split, cfg.model.seq_len + 1, packing)
    except TokenFileError as e:
        raise TaskError(f"task {name}: task_args.dir: {e}") from None
    if cfg.model.vocab_size < source.vocab_size:
        raise TaskError(
            f"task {name}: model.vocab_size ({cfg.model.vocab_size}) is smaller than the token files' "
            f"vocabulary ({source.vocab_size}, {source.directory}/index.json): set "
            f"model.vocab_size={source.vocab_size} or more"
        )
    if len(source) == 0:
        raise TaskError(
            f"task {name}: split {split!r} of {dir} has {source.count} tokens, fewer than one "
            f"window of model.seq_len + 1 = {source.window}"
        )
    heldout = _heldout(dir, cfg.model.seq_len + 1, packing) if split == "train" else None
    if heldout is None and cfg.eval.every:  # (said here: check_task's message cannot say why)
        held = source.index["splits"].get("heldout", {}).get("tokens", 0)
        why = (
            f"task_args.split is {split!r}: evaluation uses the heldout split of a task that trains on 'train'"
            if split != "train"
            else f"its heldout split holds {held} tokens, fewer than one window of model.seq_len + 1 = "
            f"{source.window} (`ftjax data prepare --heldout-fraction` sets its share)"
            if held < source.window
            else "its heldout split cannot be read"
        )
        raise TaskError(f"task {name}: eval.every={cfg.eval.every}: {source.directory}: {why}; or set eval.every=0")
    return dataclasses.replace(_lm_task(cfg, source, name), heldout=heldout, locations=("dir",))


def _heldout(dir: str, window: int, packing: str):
    """The `heldout` split's windows (for `eval:`; packed as the training windows are: the same
    loss), or None when it holds less than one window."""
    from ftjax.program.tokens import TokenFileError, TokenWindows

    try:
        source = TokenWindows(dir, "heldout", window, packing)
    except TokenFileError:
        return None
    return source if len(source) else None


def task_of(cfg) -> Task:
    """The config's task (`task:`, else the built-in language model), loaded once per config."""
    key = cfg.model_dump_json()
    if key not in _loaded:
        _loaded[key] = load_task(cfg.task or BUILTIN, cfg, cfg.task_args, cfg.task_path)
    return _loaded[key]


def _check_float_params(name: str, params) -> None:
    """Gradients are taken of every parameter, and FTAR sums them as floats: an integer one would
    fail inside the first step's jax.grad, after the replica joined its job."""
    import jax.numpy as jnp

    if found := first_leaf_not(params, jnp.inexact):
        raise TaskError(
            f"task {name}: parameter {found[0]} is {found[1]}: every parameter is differentiated, so it "
            "must be floating point (or not a parameter)"
        )


def check_task(cfg) -> Task:
    """Load the config's task and run its loss once on a batch (shapes only, nothing computed):
    a task that does not import, a source whose examples do not batch, a loss of the wrong shape
    fail here, named, before the process joins a job."""
    import jax

    task = task_of(cfg)
    if cfg.eval.every and task.heldout is None:
        raise TaskError(
            f"eval.every={cfg.eval.every}: task {task.name} has no held-out data to evaluate on (the built-in "
            "language_model has none; token files' heldout split, from `ftjax data prepare`, is used by "
            "ftjax.program.tasks:token_lm; a task of yours sets Task.heldout): set eval.every=0"
        )
    for key in task.reads:  # (named now, not when the job identity is first taken)
        config_setting(cfg, key)
    batch = task.example_batch(min(cfg.data.batch_size, 2))
    try:
        params, state = jax.eval_shape(task.init, jax.random.key(0))
        rows = batch_rows(batch)
        jax.eval_shape(
            lambda *a: normalize_loss(task.loss(*a)[:2], rows, task.name), params, state, batch, jax.random.key(0)
        )
    except TaskError:
        raise
    except Exception as e:
        raise TaskError(
            f"task {task.name}: its init or loss failed on a batch of the source's first examples: "
            f"{type(e).__name__}: {e}"
        ) from e
    _check_float_params(task.name, params)
    if cfg.ft.sync != "every_step" and jax.tree.leaves(state):
        raise TaskError(
            f"ft.sync={cfg.ft.sync}: task {task.name} has model state (batch statistics ...), which DiLoCo "
            "does not average: use ft.sync=every_step"
        )
    if cfg.ft.global_batch == "constant" and not task.rows_independent:
        _check_whole_batches(cfg, task.name)
    return task


def _check_whole_batches(cfg, name: str) -> None:
    """A constant global batch of a task whose rows interact (batch statistics) deals missing
    batches out whole (ReplicaProgram.unit_rows): what would split a batch is refused, named."""
    b, m = cfg.data.batch_size, cfg.ft.micro_batch_rows
    why = f"task {name}'s rows interact (batch statistics), so a batch is computed whole, never split"
    if m is not None and m != b:
        raise TaskError(f"ft.micro_batch_rows={m}: {why}: leave it unset or set it to data.batch_size ({b})")
    if cfg.ft.on_host_loss == "reduce" or cfg.mesh.live < cfg.mesh.hosts:
        key = "ft.on_host_loss=reduce" if cfg.ft.on_host_loss == "reduce" else f"mesh.live_hosts={cfg.mesh.live}"
        raise TaskError(f"{key}: {why} (a reduced-degree replica computes part of its batch)")
