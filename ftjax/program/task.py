"""A task: what a replica trains, in one object (docs/design/index.md, "Tasks").

A `Task` is the user's model init, loss, optimizer and data source. ftjax owns everything else:
which global batch a replica trains at which step (exactly once), the average over the quorum, the
state's checkpoints, digests and catch-up. The adapters build one from what a JAX team already has:

- `nnx_task`: a Flax NNX module. Gradients of `nnx.Param` only; RNG streams are reseeded for every
  computation from (seed, step, stream, first row), so a batch's dropout masks do not depend on which
  replica computes it; every other variable (`nnx.BatchStat`, ...) is *model state*.
- `linen_task`: a Flax Linen module (`init`/`apply`); its non-`params` collections are model state,
  updated through `mutable`.
- `pytree_task`: a plain parameter pytree and a function.

The loss takes the model (or parameters) and the user's batch (any pytree of arrays whose leading
axis is the batch: a token array, a dict of tokens, masks and segment ids) and returns one loss per
example, or `(per_example, aux)` with `aux` a dict of per-example or scalar metrics. Per-example
losses are what let ftjax weigh every row of a step with the user's loss, whoever computes it
(constant global batch, reduced-degree replicas). Model state is averaged over the step's
contributors with the gradients (the update carries it), so replicas stay bitwise equal.

A task is found by import path (`task: "pkg.module:factory"` in the config, with `task_args`): the
factory is called as `factory(cfg, **task_args)` and returns a Task. The built-in models are tasks
found the same way (`ftjax.program.tasks:language_model`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from ftjax.base.trees import PyTree
from ftjax.config import Config, ConfigError

Batch = PyTree  # a pytree of arrays, leading axis = examples
# loss(params, model_state, batch, key) -> (per_example[B], aux {name: [B] or scalar}, new model_state)
LossFn = Callable[[PyTree, PyTree, Batch, jax.Array], tuple[jax.Array, dict, PyTree]]


class Source(Protocol):
    """What `Task.source` (and `heldout`) is: random access, `len` and `source[i]` -> one example."""

    def __len__(self) -> int: ...
    def __getitem__(self, index: int, /) -> PyTree: ...


class TaskError(ValueError):
    """A task that cannot be trained: the message names the task and what is wrong."""


@dataclass(frozen=True)
class Task:
    """What a replica trains. Build one with `nnx_task`, `linen_task` or `pytree_task`.

    `init(key)` returns `(params, model_state)` (pure pytrees of arrays; model_state may be `{}`).
    `loss(params, model_state, batch, key)` returns `(per_example, aux, new_model_state)`.
    `source` is random access (`len`, `__getitem__` -> one example); ftjax shuffles and batches it.
    `heldout`: examples of the same form that training never sees, for `eval:` (None: no evaluation).
    `param_axes`: a logical PartitionSpec per parameter (ftjax/program/sharding.py maps names to mesh
    axes), or None (every parameter replicated). `optimizer`: any optax transformation, or None for
    the config's AdamW (`optim:`), whose clip gives the same bits on every replica degree.
    """

    name: str
    init: Callable[[jax.Array], tuple[PyTree, PyTree]]
    loss: LossFn
    source: Source
    param_axes: PyTree | None = None
    optimizer: optax.GradientTransformation | None = None
    tokens_per_example: int = 0  # for the tokens/s figures (0: not a token model)
    heldout: Source | None = None  # a random-access source of held-out examples, like `source` (eval.every); None: none
    # ft.sync diloco | streaming_diloco: the outer optimizer of the averaged parameter deltas, any optax
    # transformation (None: the config's, ft.outer_optimizer); set it with dataclasses.replace(task, ...)
    outer_optimizer: optax.GradientTransformation | None = None
    # names of `task_args` that say where the data is, not what it is (the source's fingerprint says
    # what): left out of the job identity, so that a run resumes from its data moved or named by
    # another path (ftjax/runtime/checkpoint.py, job_identity)
    locations: tuple[str, ...] = ()
    # config settings (`section.field`, e.g. `model.seq_len`) a custom task's factory reads besides its
    # task_args: recorded in the job identity with their values, which has none of the built-in model's
    # `model:` section and `data.source` otherwise (ftjax/runtime/checkpoint.py, job_identity)
    reads: tuple[str, ...] = ()
    # False when a row's loss depends on the other rows of its batch (batch statistics: Linen's
    # `batch_stats`, NNX's BatchStat, which the adapters detect; in-batch negatives, ...): a constant
    # global batch then computes a missing replica's batch whole, never split between contributors
    rows_independent: bool = True

    def data_fingerprint(self) -> str:
        """The source's own `fingerprint` attribute, else a hash of its type, length and first example."""
        own = getattr(self.source, "fingerprint", None)
        if own:
            return str(own)
        h = hashlib.sha256(
            f"{type(self.source).__module__}.{type(self.source).__qualname__}|{len(self.source)}".encode()
        )
        for leaf in jax.tree.leaves(self.source[0]):
            a = np.asarray(leaf)
            h.update(f"{a.dtype}{a.shape}".encode() + a.tobytes())
        return h.hexdigest()[:16]

    def example_batch(self, rows: int = 1) -> Batch:
        """The first `rows` examples of the source, stacked: what a batch of this task looks like (a
        source shorter than `rows` repeats, as its epochs do in training)."""
        return stack([self.source[i % len(self.source)] for i in range(rows)], self.name)


def config_setting(cfg: Config, key: str) -> object:
    """The value of the config setting `key` (`section.field`, one of a task's `reads`), as JSON;
    TaskError naming it if the config has no such setting."""
    node = cfg
    for part in key.split("."):
        if part not in getattr(type(node), "model_fields", {}):
            raise TaskError(f"Task.reads: {key!r} is not a config setting (`section.field`, e.g. model.seq_len)")
        node = getattr(node, part)
    return node.model_dump(mode="json") if hasattr(node, "model_dump") else node


def stack(examples: Sequence[Any], task: str = "") -> Batch:
    """Examples (each a pytree of arrays) stacked along a new leading axis."""
    try:
        return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *examples)
    except (ValueError, TypeError) as e:
        raise TaskError(
            f"task {task!r}: the source's examples do not batch (each must be the same pytree "
            f"of equally shaped arrays): {e}"
        ) from None


def batch_rows(batch: Batch) -> int:
    """The rows (examples) of a batch: its leaves' leading axis."""
    return jax.tree.leaves(batch)[0].shape[0]


def slice_rows(batch: Batch, a: int, b: int) -> Batch:
    """Rows a..b of a batch (every leaf)."""
    return jax.tree.map(lambda x: x[a:b], batch)


def concat_rows(batches: Sequence[Batch]) -> Batch:
    """Batches of one structure, their rows end to end."""
    return jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs]), *batches)


# --- the loss's result ------------------------------------------------------------------------------


def split_output(out: Any) -> tuple[jax.Array, PyTree]:
    """(per_example, aux) of what a user's loss returned: `per_example` or `(per_example, aux)`."""
    return out if isinstance(out, tuple) and len(out) == 2 else (out, {})


def normalize_loss(out: Any, rows: int, task: str) -> tuple[jax.Array, dict]:
    """(per_example, aux) from what a user's loss returned, checked: `rows` losses, scalar or
    per-example metrics. Runs while tracing, so a wrong shape fails before the first step."""
    per_example, aux = split_output(out)
    per_example = jnp.asarray(per_example)
    if per_example.shape != (rows,):
        raise TaskError(
            f"task {task!r}: the loss must return one loss per example, shape ({rows},) for this "
            f"batch; it returned shape {tuple(per_example.shape)} (return the per-example losses, "
            "not their mean: ftjax weighs the rows of a step)"
        )
    if not jnp.issubdtype(per_example.dtype, jnp.floating):
        raise TaskError(f"task {task!r}: the loss returned dtype {per_example.dtype}, not a float")
    if not isinstance(aux, dict):
        raise TaskError(
            f"task {task!r}: the loss's auxiliary output must be a dict of metrics, got {type(aux).__name__}"
        )
    clean = {}
    for k, v in aux.items():
        v = jnp.asarray(v)
        if v.shape not in ((), (rows,)):
            raise TaskError(
                f"task {task!r}: auxiliary metric {k!r} has shape {tuple(v.shape)}: a scalar or "
                f"one value per example ({rows},)"
            )
        clean[str(k)] = v.astype(jnp.float32)
    return per_example.astype(jnp.float32), clean


def step_key(seed: int, where: jax.Array) -> jax.Array:
    """The RNG key of one computation: `where` = [step, stream, first row] folded into the seed's key."""
    key = jax.random.key(seed)
    for i in range(where.shape[0]):
        key = jax.random.fold_in(key, where[i])
    return key


# --- Flax NNX ---------------------------------------------------------------------------------------


def nnx_task(
    model: Callable[[Any], Any],
    loss: Callable[[Any, Batch], Any],
    source: Source,
    *,
    optimizer: optax.GradientTransformation | None = None,
    name: str = "nnx",
    tokens_per_example: int = 0,
    rows_independent: bool | None = None,
) -> Task:
    """A task of a Flax NNX module. `model(rngs)` builds it; `loss(module, batch)` returns the
    per-example losses (or `(per_example, aux)`). Parameters are the `nnx.Param` variables (with
    their `sharding` metadata as logical axes); RNG streams are reseeded per computation; every
    other variable is model state, averaged over the step's contributors. `rows_independent`
    (`Task.rows_independent`), when None: False if the module has `nnx.BatchStat` variables."""
    from flax import nnx

    def split(module):
        graphdef, *states = nnx.split(module, nnx.Param, nnx.RngState, ...)
        params, rngs, rest = states
        return graphdef, params, rngs, rest

    def build(rngs):
        # variables are created unsharded and placed by jit's out_shardings (from their logical
        # names): flax must not shard them eagerly, which needs a mesh in context
        with nnx.use_eager_sharding(False):
            return model(rngs)

    abstract = nnx.eval_shape(lambda: build(nnx.Rngs(0)))
    graphdef, a_params, a_rngs, a_rest = split(abstract)
    a_rngs = nnx.to_pure_dict(a_rngs)
    axes = nnx.to_pure_dict(nnx.get_partition_spec(a_params))
    _check_float_state(nnx.to_pure_dict(a_rest), name)
    tags = sorted({n.tag for _, n in nnx.iter_graph(abstract) if isinstance(n, nnx.RngStream)})

    def init(key):
        _, params, _, rest = split(build(nnx.Rngs(key)))
        return nnx.to_pure_dict(params), nnx.to_pure_dict(rest)

    def wrapped(params, rest, batch, key):
        module = nnx.merge(graphdef, params, _rng_placeholders(a_rngs), rest)
        if tags:
            keys: dict[str, Any] = {t: jax.random.fold_in(key, i) for i, t in enumerate(tags)}  # (stream names)
            nnx.reseed(module, **keys)
        per_example, aux = split_output(loss(module, batch))
        _, _, _, new_rest = split(module)
        return per_example, aux, nnx.to_pure_dict(new_rest)

    if rows_independent is None:
        rows_independent = not jax.tree.leaves(nnx.to_pure_dict(nnx.state(abstract, nnx.BatchStat)))
    return Task(
        name, init, wrapped, source, axes, optimizer, tokens_per_example, rows_independent=rows_independent
    )  # (the fields in order)


def _rng_placeholders(a_rngs: PyTree) -> PyTree:
    """RNG variables (typed keys, counters) are not state ftjax keeps: placeholders of their
    shapes (`a_rngs`: their abstract pure dict), which `nnx.reseed` replaces for this computation."""

    def leaf(a):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            return jax.random.split(jax.random.key(0), a.shape) if a.shape else jax.random.key(0)
        return jnp.zeros(a.shape, a.dtype)

    return jax.tree.map(leaf, a_rngs)


def first_leaf_not(tree: PyTree, kind: type) -> tuple[str, np.dtype] | None:
    """(path, dtype) of the first leaf of `tree` whose dtype is not of `kind` (jnp.floating, ...), or None."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not jnp.issubdtype(leaf.dtype, kind):
            return jax.tree_util.keystr(path), leaf.dtype
    return None


def _check_float_state(state: PyTree, task: str) -> None:
    if found := first_leaf_not(state, jnp.floating):
        raise TaskError(
            f"task {task}: non-parameter variable {found[0]} has dtype {found[1]}: model state is averaged "
            "over replicas with the gradients, so it must be floating point"
        )


# --- Flax Linen -------------------------------------------------------------------------------------


def linen_task(
    module: Any,
    loss: Callable[[Callable, Batch], Any],
    source: Source,
    *,
    optimizer: optax.GradientTransformation | None = None,
    name: str = "linen",
    rng_streams: Sequence[str] = ("dropout",),
    tokens_per_example: int = 0,
    rows_independent: bool | None = None,
) -> Task:
    """A task of a Flax Linen module. `loss(apply, batch)` calls `apply(*args, **kwargs)` where it
    would call `module.apply(variables, *args, **kwargs)`, and returns the per-example losses (or
    `(per_example, aux)`). ftjax supplies the variables, the RNGs named in `rng_streams` (reseeded
    per computation) and `mutable`: every collection but `params` is model state (batch statistics,
    ...), updated by the call and averaged over the step's contributors. The first call of `apply`
    on an example batch initializes the module (`module.init`), so one function serves both.
    Parameters boxed with `nn.with_logical_partitioning` are sharded by their logical names.
    `rows_independent` (`Task.rows_independent`), when None: False if it has a `batch_stats` collection."""
    import flax.linen as nn

    run = _linen_runner(module, loss, rng_streams)

    def boxed_init(key):
        _, variables = run(None, jax.tree.map(jnp.asarray, example), key, init_key=key)
        return dict(variables)

    example = stack([source[0]], name)
    abstract = jax.eval_shape(boxed_init, jax.random.key(0))
    axes = nn.get_partition_spec(abstract).get("params", {})
    _check_float_state({c: v for c, v in nn.meta.unbox(abstract).items() if c != "params"}, name)

    def init(key):
        variables = nn.meta.unbox(boxed_init(key))
        return variables["params"], {c: v for c, v in variables.items() if c != "params"}

    def wrapped(params, state, batch, key):
        out, new = run({"params": params, **state}, batch, key)
        per_example, aux = split_output(out)
        return per_example, aux, {c: new.get(c, v) for c, v in state.items()}

    if rows_independent is None:
        rows_independent = not jax.tree.leaves(abstract.get("batch_stats", {}))
    return Task(
        name, init, wrapped, source, axes, optimizer, tokens_per_example, rows_independent=rows_independent
    )  # (the fields in order)


def _linen_runner(module: Any, loss: Callable[[Callable, Batch], Any], rng_streams: Sequence[str]) -> Callable:
    """`run(variables, batch, key, init_key=None) -> (loss's output, variables)`: the user's loss
    with its `apply` bound to `module`, initializing it instead when `init_key` is given."""

    def run(variables, batch, key, init_key=None):
        rngs = {s: jax.random.fold_in(key, i) for i, s in enumerate(rng_streams)}
        got: dict = {}

        def apply(*args, **kwargs):
            if init_key is not None:
                out, v = module.init_with_output({"params": init_key, **rngs}, *args, **kwargs)
                got["variables"] = v
                return out
            collections = [c for c in variables if c != "params"]
            if not collections:
                return module.apply(variables, *args, rngs=rngs, **kwargs)
            out, new = module.apply(variables, *args, rngs=rngs, mutable=collections, **kwargs)
            got["variables"] = new
            return out

        out = loss(apply, batch)
        return out, got.get("variables", {})

    return run


# --- a plain pytree ---------------------------------------------------------------------------------


def pytree_task(
    init: Callable[[jax.Array], PyTree],
    loss: Callable[[PyTree, Batch, jax.Array], Any],
    source: Source,
    *,
    param_axes: PyTree | None = None,
    optimizer: optax.GradientTransformation | None = None,
    name: str = "pytree",
    tokens_per_example: int = 0,
    rows_independent: bool = True,
) -> Task:
    """A task of a parameter pytree: `init(key) -> params`, `loss(params, batch, key) -> per_example`
    (or `(per_example, aux)`). `param_axes`: a logical PartitionSpec per parameter (None: replicated).
    `rows_independent`: False when a row's loss depends on the batch's other rows (`Task`)."""

    def wrapped(params, state, batch, key):
        per_example, aux = split_output(loss(params, batch, key))
        return per_example, aux, state

    return Task(
        name=name,
        init=lambda key: (init(key), {}),
        loss=wrapped,
        source=source,
        param_axes=param_axes,
        optimizer=optimizer,
        tokens_per_example=tokens_per_example,
        rows_independent=rows_independent,
    )


# --- tasks by import path ---------------------------------------------------------------------------


def load_task(path: str, cfg: Config, args: dict | None = None, search: Sequence[str] = ()) -> Task:
    """`factory(cfg, **args)` for `path` = "pkg.module:factory"; `search`: directories tried first
    for the module (a job's `task_path`). Every failure is a TaskError naming the path."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise TaskError(f"task {path!r}: expected 'package.module:factory'")
    for d in reversed([str(Path(d).resolve()) for d in search]):
        if d not in sys.path:
            sys.path.insert(0, d)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # (an error inside the user's module too: named, not a traceback)
        raise TaskError(
            f"task {path!r}: cannot import {module_name!r}: {type(e).__name__}: {e} "
            f"(searched task_path {list(search)} and sys.path)"
        ) from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise TaskError(f"task {path!r}: {module_name} has no callable {attr!r}")
    _check_task_args(path, factory, args or {})
    try:
        task = factory(cfg, **(args or {}))
    except ConfigError:  # (a built-in factory's word on a setting: it names the field)
        raise
    except TaskError as e:  # (ours, from an adapter or a built-in factory: it says what is wrong)
        said = str(e)
        if path not in said:  # named by the adapter's default name ("task nnx: ..."): named by its path
            said = f"task {path!r}: " + (said.split(": ", 1)[1] if said.startswith("task ") else said)
        raise TaskError(said) from e
    except Exception as e:  # (the user's factory: named, not a traceback)
        raise TaskError(f"task {path!r}: {attr}(cfg, **task_args) failed: {type(e).__name__}: {e}") from e
    if not isinstance(task, Task):
        raise TaskError(f"task {path!r}: {attr} returned {type(task).__name__}, not an ftjax.Task")
    if not (hasattr(task.source, "__len__") and hasattr(task.source, "__getitem__")):
        raise TaskError(f"task {path!r}: its source is not random access (len, [i]): {type(task.source).__name__}")
    try:  # (a source that is random access but cannot read: its own message names the file at fault)
        n = len(task.source)
        task.source[0]
    except Exception as e:
        raise TaskError(f"task {path!r}: its source cannot read its first example: {type(e).__name__}: {e}") from e
    if n < 1:
        raise TaskError(f"task {path!r}: its source is empty")
    return dataclasses.replace(task, name=path)


def _check_task_args(path: str, factory: Callable, args: dict) -> None:
    """`task_args` that `factory(cfg, **args)` cannot take, named as the config's fields (a TypeError
    from inside the factory would name neither the field nor the config)."""
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):  # (no signature to read: the call itself will tell)
        return
    try:
        sig.bind(None, **args)
    except TypeError as e:
        named = list(sig.parameters.items())[1:]
        takes = [n for n, p in named if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        unknown = [k for k in args if k not in sig.parameters]
        missing = [n for n, p in named if n in takes and p.default is p.empty and n not in args]
        field = (
            f"task_args.{unknown[0]}: not an argument of"
            if unknown
            else f"task_args.{missing[0]}: required by"
            if missing
            else f"task_args: {e}: calling"
        )
        raise TaskError(f"task {path!r}: {field} {factory.__name__}(cfg, {', '.join(takes)})") from None


def replicated_axes(params: PyTree) -> PyTree:
    """A logical spec per parameter that replicates it (a task with no `param_axes`)."""
    return jax.tree.map(lambda _: P(), params)
