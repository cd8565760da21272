"""The replica's compiled functions: state init, gradients, update, and the fused train step.

The train state is a plain pytree `{"params", "opt", "step"}` (plus `"model_state"` when the task
has non-parameter variables: batch statistics, ...), pure dicts and optax states, so that orbax,
digests and FTAR's flat buffers all see the same leaves in the same order. Every function is one
`jax.jit` with explicit in/out shardings over the replica mesh (pjit-style). What is computed is the
task's (ftjax/program/task.py): its init, its per-example loss, its optimizer.

The step is split in two, gradients then update, with the average over the quorum between them
(FTAR on the host; the identity for a standalone run). What is averaged is the *update*:
`{"params": gradients}`, plus the new model state when the task has one, each contributor's
weighted like its gradients, so that replicas keep equal model state. The fused `train_step` is what
the synchronous baseline of `ftjax bench step` runs, its gradient all-reduce an XLA collective.
Both compute the same update: `lr_scale` multiplies the final updates (AdamW's updates, weight decay
included, are linear in the learning rate), and a scale of exactly 1.0 leaves every bit unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ftjax.base.fingerprint import fingerprint
from ftjax.base.trees import PyTree
from ftjax.config import Config
from ftjax.program import sharding as shd
from ftjax.program.digest import state_checksum
from ftjax.program.optim import block_norm, make_optimizer
from ftjax.program.task import Task, TaskError, batch_rows, normalize_loss, replicated_axes, step_key

State = dict[str, PyTree]  # {"params", "opt_state", "step", ["model_state"]}


@dataclass
class ReplicaProgram:
    """Everything compiled for one replica: mesh, shardings, and the jitted step functions.

    `where` arguments are int32[3] = (step, stream, first row) of the rows computed: the RNG key of
    the computation (ftjax/program/task.py `step_key`), the same whoever computes those rows."""

    cfg: Config
    task: Task
    mesh: jax.sharding.Mesh
    state_shardings: State
    batch_sharding: jax.sharding.NamedSharding
    update_shardings: PyTree
    example: PyTree  # one batch's ShapeDtypeStructs (with the batch sharding)
    init: Callable[..., State]  # (seed: int array) -> State
    grads: Callable[..., tuple[jax.Array, PyTree, PyTree]]  # (params, model_state, batch, where) -> (loss, aux, update)
    apply: Callable[..., State]  # (State, update, lr_scale) -> State  (donates State)
    train_step: Callable[..., tuple[State, jax.Array]]  # (State, batch, lr_scale) -> (State, loss)  (donates State)
    accumulate: Callable[
        ..., tuple[PyTree, jax.Array]
    ]  # (acc, params, model_state, rows, where) -> (acc + update of rows weighted rows/B, row losses)
    zeros: Callable[[], PyTree]  # () -> an update of zeros, in the update's shardings
    add: Callable[[PyTree, PyTree], PyTree]  # (a, b) -> a + b, updates (neither donated)
    opt_init: Callable[[PyTree], PyTree]  # (params) -> the optimizer's initial state (a start from given parameters)
    evaluate: Callable[
        ..., jax.Array
    ]  # (params, model_state, batch) -> the batch's mean loss (no gradient, nothing donated)
    compiled_accumulate: dict = field(default_factory=dict)  # rows -> `accumulate` compiled for them
    _abstract: State | None = field(default=None, init=False, repr=False)  # (abstract_state, once)

    def accumulate_rows(self, acc, state, rows, where):
        """`accumulate`, through the executable compiled for this many rows if there is one."""
        fn = self.compiled_accumulate.get(batch_rows(rows), self.accumulate)
        return fn(acc, state["params"], model_state(state), rows, where)

    def grads_of(self, state, batch, where):
        return self.grads(state["params"], model_state(state), batch, where)

    @property
    def has_model_state(self) -> bool:
        return "model_state" in self.state_shardings

    @property
    def unit_rows(self) -> int:
        """The unit a constant global batch deals missing rows out in: `cfg.micro_rows`, or the
        whole batch for a task whose rows interact (batch statistics of a split batch would not be
        the failure-free run's)."""
        return self.cfg.micro_rows if self.task.rows_independent else self.cfg.data.batch_size

    @property
    def chunk_rows(self) -> tuple[int, ...]:
        """The micro-batch sizes a share of rows is computed in: whole batches, then micro-batches
        (fewer calls than micro-batches alone: each call of a multi-host replica all-gathers the
        parameters)."""
        return tuple(sorted({self.cfg.data.batch_size, self.unit_rows}, reverse=True))

    @property
    def grad_shardings(self):
        """The shardings of what is averaged over the quorum (the update)."""
        return self.update_shardings

    def abstract_state(self) -> State:
        """Shapes, dtypes and shardings of the state, for restoring a checkpoint into this mesh.
        Traced once (a replica's start asks for it about ten times; each trace of `init` took
        ~0.07 s of a tiny replica's few CPU-seconds): `init` and the shardings never change."""
        if self._abstract is None:
            shapes = jax.eval_shape(self.init, jnp.int32(0))
            self._abstract = jax.tree.map(
                lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, self.state_shardings
            )
        return dict(self._abstract)  # (a caller may add keys to its copy: DiLoCo's outer state)

    def abstract_update(self) -> PyTree:
        st = self.abstract_state()
        tree = {"params": st["params"], **({"model_state": st["model_state"]} if self.has_model_state else {})}
        return jax.tree.map(
            lambda a, sh: jax.ShapeDtypeStruct(a.shape, jnp.float32, sharding=sh), tree, self.update_shardings
        )

    def _abstract_args(self):
        st = self.abstract_state()
        where = jax.ShapeDtypeStruct((3,), jnp.int32, sharding=shd.replicated(self.mesh))
        lr = jax.ShapeDtypeStruct((), jnp.float32, sharding=shd.replicated(self.mesh))
        return st, where, lr

    def precompile(self) -> None:
        """Compile `grads` and `apply` ahead of time and call the executables directly from now on.

        A replica that joins a running job does this before its first quorum: compiling inside the
        step would make every peer wait for it at the next FTAR."""
        st, where, lr = self._abstract_args()
        ms, upd = model_state(st), self.abstract_update()
        self.grads = lowered(self.grads, st["params"], ms, self.example, where).compile()
        self.apply = lowered(self.apply, st, upd, lr).compile()
        if self.cfg.eval.every:  # an evaluation must not stall the next step's peers with a compile
            self.evaluate = lowered(self.evaluate, st["params"], ms, self.example).compile()
        if self.cfg.ft.global_batch == "constant":  # an outage must not wait for a compile
            for n in self.chunk_rows:
                rows = rows_like(self.example, n)
                self.compiled_accumulate[n] = lowered(self.accumulate, upd, st["params"], ms, rows, where).compile()
            self.zeros = lowered(self.zeros).compile()
            self.add = lowered(self.add, upd, upd).compile()

    def warm_up(self) -> None:
        """Run each precompiled executable once on zeros: a first run pays one-time costs (buffers,
        thread pools; on several hosts, the collectives' contexts) that would otherwise fall on the
        first step this replica contributes to, which every peer waits for at its FTAR. Every host
        of the replica calls it (the executables span them)."""

        def zeros(a):  # (a jit with out_shardings makes global arrays, on one host or several)
            return jax.jit(lambda: jnp.zeros(a.shape, a.dtype), out_shardings=a.sharding)()

        _st, where, lr = self._abstract_args()
        state = self.init(np.int32(0))  # (zeros would do, but a model may divide by its state)
        w = zeros(where)
        _, _, g = self.grads_of(state, jax.tree.map(zeros, self.example), w)
        if self.cfg.ft.global_batch == "constant":
            for n in self.chunk_rows:
                g, _ = self.accumulate_rows(g, state, jax.tree.map(zeros, rows_like(self.example, n)), w)
            g = self.add(g, self.zeros())
        state = jax.block_until_ready(self.apply(state, g, zeros(lr)))  # (donates the old one)
        if self.cfg.ft.digest_every:  # the per-step digest's program compiles on first use
            state_checksum(state)

    def topology(self) -> str:
        """Gradient lanes, and every state leaf's shape, dtype and shard layout: replicas may
        exchange gradients and snapshots only if these agree (another model size has other shapes
        under the same specs). A reduced-degree replica (fewer hosts, fewer devices) has the same:
        its hosts serve the same lanes (ftjax/runtime/lanes.py). One `key: value` line per item, so that the
        coordinator can name the items that differ (ftjax/coordinator/layout.py)."""
        lanes = f"mesh: lanes={self.cfg.mesh.hosts} devices_per_lane={self.cfg.mesh.devices_per_host}"
        state = self.abstract_state()
        rest = {k: v for k, v in state.items() if k != "params"}  # (the parameters first: named first)
        return "\n".join(
            [f"task: {self.task.name}", lanes, shd.describe({"params": state["params"]}), shd.describe(rest)]
        )


def lowered(fn: Callable[..., object], *args: PyTree) -> jax.stages.Lowered:
    """`fn`, one of a program's functions as `build_program` jitted it (`precompile` replaces them
    with executables, which are not lowered again), lowered for `args`."""
    return cast(jax.stages.Wrapped, fn).lower(*args)


def model_state(state: State) -> PyTree:
    """The state's non-parameter model variables ({} for a task without any)."""
    return state.get("model_state", {})


def rows_like(example: PyTree, n: int) -> PyTree:
    """`example` (a batch's ShapeDtypeStructs) with `n` rows."""
    return jax.tree.map(lambda a: a.update(shape=(n, *a.shape[1:])), example)


@dataclass(frozen=True)
class _Layout:
    """What a replica's functions are built over: the task's shapes, the optimizer, the shardings."""

    params_shape: PyTree
    ms_shape: PyTree
    has_ms: bool
    tx: optax.GradientTransformation
    p_shard: PyTree
    ms_shard: PyTree
    opt_shard: PyTree
    rep: jax.sharding.NamedSharding
    state_shardings: State
    update_shardings: PyTree
    b_shard: jax.sharding.NamedSharding
    example: PyTree


def build_program(cfg: Config, mesh: jax.sharding.Mesh | None = None, task: Task | None = None) -> ReplicaProgram:
    """Compile a replica's functions for the config's task (`task`: an already loaded one) over
    `mesh` (default: the replica's own FSDP mesh; the synchronous baseline of `ftjax bench step`
    passes a (replica, fsdp) mesh instead)."""
    if task is None:
        from ftjax.program.tasks import task_of

        task = task_of(cfg)
    if mesh is None:
        # jax.devices() is global (every process's devices); a replica uses the first
        # live hosts x devices_per_host of them, which lets tests build several meshes in one process.
        devices = jax.devices()[: cfg.mesh.live_devices]
        mesh = shd.replica_mesh(devices, cfg.mesh.tensor)
    lay = _layout(cfg, mesh, task)
    return ReplicaProgram(
        cfg=cfg,
        task=task,
        mesh=mesh,
        state_shardings=lay.state_shardings,
        batch_sharding=lay.b_shard,
        update_shardings=lay.update_shardings,
        example=lay.example,
        **_jitted(lay, *_state_functions(task, lay), *_loss_functions(cfg, task, lay)),
    )


def _layout(cfg: Config, mesh: jax.sharding.Mesh, task: Task) -> _Layout:
    """The task's shapes and optimizer, and the shardings of state, update and batch over `mesh`."""
    params_shape, ms_shape = jax.eval_shape(task.init, jax.random.key(0))
    logical = task.param_axes if task.param_axes is not None else replicated_axes(params_shape)
    try:
        p_shard = shd.param_shardings(logical, mesh, params_shape)
    except shd.Indivisible as e:
        raise TaskError(f"task {task.name}: {e} (mesh {dict(mesh.shape)})") from None
    except ValueError as e:
        raise TaskError(f"task {task.name}: its parameter axes do not match its parameters: {e}") from None
    ms_shard = jax.tree.map(lambda _: shd.replicated(mesh), ms_shape)
    has_ms = bool(jax.tree.leaves(ms_shape))
    # the clip's norm in blocks of a full replica's shards: the same bits on every degree
    blocks = {shd.FSDP: cfg.mesh.fsdp, shd.TENSOR: cfg.mesh.tensor}
    tx = task.optimizer or make_optimizer(cfg.optim, cfg.train_steps, norm=block_norm(p_shard, blocks, mesh))
    opt_shard = shd.follow_params(jax.eval_shape(tx.init, params_shape), p_shard, mesh)
    rep = shd.replicated(mesh)
    state_shardings = {
        "params": p_shard,
        "opt": opt_shard,
        "step": rep,
        **({"model_state": ms_shard} if has_ms else {}),
    }
    update_shardings = {"params": p_shard, **({"model_state": ms_shard} if has_ms else {})}
    b_shard = shd.batch_sharding(mesh)
    B = cfg.data.batch_size
    example = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((B, *x.shape[1:]), x.dtype, sharding=b_shard), task.example_batch(1)
    )
    return _Layout(
        params_shape=params_shape,
        ms_shape=ms_shape,
        has_ms=has_ms,
        tx=tx,
        p_shard=p_shard,
        ms_shard=ms_shard,
        opt_shard=opt_shard,
        rep=rep,
        state_shardings=state_shardings,
        update_shardings=update_shardings,
        b_shard=b_shard,
        example=example,
    )


def _state_functions(task: Task, lay: _Layout):
    """(init, apply, zeros): the state from a seed, the state after an update, an update of zeros."""
    tx, has_ms = lay.tx, lay.has_ms

    def init(seed):
        params, ms = task.init(jax.random.key(seed))
        return {
            "params": params,
            "opt": tx.init(params),
            "step": jnp.zeros((), jnp.int32),
            **({"model_state": ms} if has_ms else {}),
        }

    def apply(state, update, lr_scale):
        updates, opt = tx.update(update["params"], state["opt"], state["params"])
        updates = jax.tree.map(lambda u: u * lr_scale.astype(u.dtype), updates)
        out = {"params": optax.apply_updates(state["params"], updates), "opt": opt, "step": state["step"] + 1}
        if has_ms:
            out["model_state"] = jax.tree.map(
                lambda new, old: new.astype(old.dtype), update["model_state"], state["model_state"]
            )
        return out

    def zeros():
        return jax.tree.map(
            lambda a: jnp.zeros(a.shape, jnp.float32),
            {"params": lay.params_shape, **({"model_state": lay.ms_shape} if has_ms else {})},
        )

    return init, apply, zeros


def _loss_functions(cfg: Config, task: Task, lay: _Layout):
    """(grads, accumulate, evaluate): a batch's mean loss, metrics and update; rows' update added to a
    sum; a batch's mean loss alone."""
    has_ms, B, k = lay.has_ms, cfg.data.batch_size, cfg.data.micro_batches

    def update_of(params, ms, batch, where, weight):
        """(per-example losses, aux, the update of `batch` with its loss weighted `weight` per row)."""

        def total(p):
            per_example, aux, new_ms = task_losses(task, cfg.seed, lay.b_shard, p, ms, batch, where)
            return per_example.sum() * weight, (per_example, aux, new_ms)

        (_, (per_example, aux, new_ms)), g = jax.value_and_grad(total, has_aux=True)(params)
        rows = per_example.shape[0]
        update = {"params": g}
        if has_ms:  # each contributor's new model state, weighted like its rows
            update["model_state"] = jax.tree.map(lambda x: x.astype(jnp.float32) * (rows * weight), new_ms)
        return per_example, aux, update

    def summed(params, ms, rows, where, weight):
        """`update_of`, in micro-batches when data.micro_batches asks for them."""
        if k == 1:
            return update_of(params, ms, rows, where, weight)
        return in_micro_batches(lambda r, w: update_of(params, ms, r, w, weight), rows, where, B // k)

    def grads(params, ms, batch, where):
        per_example, aux, update = summed(params, ms, batch, where, 1.0 / batch_rows(batch))
        return per_example.mean(), {name: v.mean() for name, v in aux.items()}, update

    def accumulate(acc, params, ms, rows, where):
        # Gradient accumulation for a constant global batch (ftjax/base/batches.py): each row's loss
        # counts 1 / batch_size, so the micro-batches of one whole batch sum to its mean loss.
        per_row, _, update = summed(params, ms, rows, where, 1.0 / B)
        return jax.tree.map(jnp.add, acc, update), per_row

    def evaluate(params, ms, batch):
        # the loss alone: no gradient, and the model state it returns is dropped (eval changes nothing)
        per_example, _, _ = task_losses(task, cfg.seed, lay.b_shard, params, ms, batch, jnp.full(3, -1, jnp.int32))
        return per_example.mean()

    return grads, accumulate, evaluate


def task_losses(task: Task, seed: int, rows_sharding: jax.sharding.NamedSharding, params, ms, batch, where):
    """The task's loss of `batch` at the computation `where` (its RNG key), checked: (per-example
    losses, metrics, new model state). Traced with the batch's rows split as `rows_sharding`, which
    the models' `constrain_rows` then keeps (docs/design/model.md, "Rows"): every trace of a task's loss
    for a step goes through here."""
    with shd.rows_split(rows_sharding):
        per_example, aux, new_ms = task.loss(params, ms, batch, step_key(seed, where))
    per_example, aux = normalize_loss((per_example, aux), batch_rows(batch), task.name)
    return per_example, aux, new_ms


def in_micro_batches(update_of, rows, where, most: int):
    """`update_of(rows, where) -> (per-example losses, aux, update)` of `rows`, computed as micro-batches
    of at most `most` rows whose updates a `lax.scan` sums: the device holds one micro-batch's
    activations at a time, and the sum leaves it once (gradient accumulation, data.micro_batches).

    Micro-batch j is rows j, j + m, j + 2m, ... (m micro-batches): a device's rows of the batch (a
    block of them) then hold an equal part of every micro-batch, so no row moves between devices.
    Its RNG key is that of its first row (`where`'s third entry + j). The losses come back in the
    rows' order; a scalar metric, one per micro-batch."""
    n = batch_rows(rows)
    size = math.gcd(n, most)  # (both multiples of the device count: so is the micro-batch)
    if size == n:
        return update_of(rows, where)
    m = n // size
    pieces = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(size, m, *x.shape[1:]), 0, 1), rows)

    def body(acc, xs):
        j, piece = xs
        per_example, aux, update = update_of(piece, where.at[2].add(j))
        return jax.tree.map(jnp.add, acc, update), (per_example, aux)

    first = jax.tree.map(lambda x: x[0], pieces)
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(update_of, first, where)[2])
    update, (per_example, aux) = jax.lax.scan(body, zeros, (jnp.arange(m, dtype=where.dtype), pieces))

    def in_order(v):  # [m, size] -> the rows' order; [m] (a scalar per micro-batch) as is
        return v.T.reshape(n) if v.ndim == 2 else v

    return in_order(per_example), {name: in_order(v) for name, v in aux.items()}, update


def _jitted(lay: _Layout, init, apply, zeros, grads, accumulate, evaluate) -> dict[str, Any]:
    """ReplicaProgram's functions, each one `jax.jit` with its shardings (and donations)."""
    p_shard, b_shard, rep = lay.p_shard, lay.b_shard, lay.rep
    state_shardings, update_shardings = lay.state_shardings, lay.update_shardings

    def train_step(state, batch, lr_scale):
        loss, _, update = grads(state["params"], model_state(state), batch, jnp.zeros(3, jnp.int32))
        return apply(state, update, lr_scale), loss

    ms_in = lay.ms_shard if lay.has_ms else None
    return dict(
        init=jax.jit(init, out_shardings=state_shardings),
        grads=jax.jit(grads, in_shardings=(p_shard, ms_in, b_shard, rep), out_shardings=(rep, rep, update_shardings)),
        apply=jax.jit(
            apply,
            in_shardings=(state_shardings, update_shardings, rep),
            out_shardings=state_shardings,
            donate_argnums=0,
        ),
        train_step=jax.jit(
            train_step,
            in_shardings=(state_shardings, b_shard, rep),
            out_shardings=(state_shardings, rep),
            donate_argnums=0,
        ),
        accumulate=jax.jit(
            accumulate,
            in_shardings=(update_shardings, p_shard, ms_in, b_shard, rep),
            out_shardings=(update_shardings, rep),
            donate_argnums=0,
        ),
        zeros=jax.jit(zeros, out_shardings=update_shardings),
        add=jax.jit(
            lambda a, b: jax.tree.map(jnp.add, a, b),
            in_shardings=(update_shardings, update_shardings),
            out_shardings=update_shardings,
        ),
        opt_init=jax.jit(lay.tx.init, in_shardings=(p_shard,), out_shardings=lay.opt_shard),
        evaluate=jax.jit(evaluate, in_shardings=(p_shard, ms_in, b_shard), out_shardings=rep),
    )


def device_batch(program: ReplicaProgram, batch: PyTree) -> PyTree:
    """Place a full (global) batch (an array or a pytree of arrays) on the replica mesh; each
    process contributes its own rows."""
    n_proc, me = jax.process_count(), jax.process_index()

    def place(x):
        x = np.asarray(x)
        rows = x.shape[0] // n_proc
        return jax.make_array_from_process_local_data(program.batch_sharding, x[me * rows : (me + 1) * rows], x.shape)

    return jax.tree.map(place, batch)


def topology_fingerprint(program: ReplicaProgram) -> str:
    """A short hash of the mesh shape and shard layout: replicas that average together must match."""
    return fingerprint(program.topology())


def where(step: int, stream: int, first_row: int) -> np.ndarray:
    """The `where` argument of `grads`/`accumulate`: which rows these are (their RNG key)."""
    return np.asarray([step, stream, first_row], np.int32)


def param_count(state: State) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(state["params"]))
