"""The replica's compiled functions: state init, gradients, update, and the fused train step.

The train state is a plain pytree `{"params", "opt", "step"}` (pure dicts and optax states), so
that orbax, digests and FTAR's flat gradient buffers all see the same leaves in the same order.
Every function is one `jax.jit` with explicit in/out shardings over the replica mesh (pjit-style).

The step is split in two, gradients then update, with the average over the quorum between them
(FTAR on the host; the identity for a standalone run); the fused `train_step` is what the
synchronous baseline of `ftjax bench step` runs, its gradient all-reduce an XLA collective. Both
compute the same update:
`lr_scale` multiplies the final updates (AdamW's updates, weight decay included, are linear in the
learning rate), and a scale of exactly 1.0 leaves every bit unchanged.
"""

from __future__ import annotations

import hashlib

from dataclasses import dataclass, field
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ftjax import models
from ftjax import sharding as shd
from ftjax.config import Config
from ftjax.digest import state_digest
from ftjax.optim import block_norm, make_optimizer

# Variables are created unsharded and placed by jit's out_shardings, from the logical names.
flax.config.update("flax_always_shard_variable", False)

State = dict[str, Any]


def loss_fn(graphdef, params, batch: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy of a (batch, seq_len + 1) token array."""
    model = nnx.merge(graphdef, params)
    logits = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def row_losses(graphdef, params, rows: jax.Array) -> jax.Array:
    """Each row's mean next-token cross-entropy: (rows,) for a (rows, seq_len + 1) token array."""
    model = nnx.merge(graphdef, params)
    logits = model(rows[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, rows[:, 1:]).mean(axis=1)


@dataclass
class ReplicaProgram:
    """Everything compiled for one replica: mesh, shardings, and the jitted step functions."""

    cfg: Config
    mesh: jax.sharding.Mesh
    state_shardings: State
    batch_sharding: jax.sharding.NamedSharding
    init: Any          # (seed: int array) -> State
    grads: Any         # (params, batch) -> (loss, grads)
    apply: Any         # (State, grads, lr_scale) -> State  (donates State)
    train_step: Any    # (State, batch, lr_scale) -> (State, loss)  (donates State)
    accumulate: Any    # (acc, params, rows) -> (acc + grads of rows' loss sum / batch_size, row losses)
    zeros: Any         # () -> gradients of zeros, in the gradients' shardings
    add: Any           # (a, b) -> a + b, gradients (neither donated)
    compiled_accumulate: dict = field(default_factory=dict)  # rows -> `accumulate` compiled for them

    def accumulate_rows(self, acc, params, rows):
        """`accumulate`, through the executable compiled for this many rows if there is one."""
        return self.compiled_accumulate.get(rows.shape[0], self.accumulate)(acc, params, rows)

    @property
    def chunk_rows(self) -> tuple[int, ...]:
        """The micro-batch sizes a share of rows is computed in: whole batches, then micro-batches
        (fewer calls than micro-batches alone: each call of a multi-host replica all-gathers the
        parameters)."""
        return tuple(sorted({self.cfg.data.batch_size, self.cfg.micro_rows}, reverse=True))

    @property
    def grad_shardings(self):
        return self.state_shardings["params"]

    def abstract_state(self) -> State:
        """Shapes, dtypes and shardings of the state, for restoring a checkpoint into this mesh."""
        shapes = jax.eval_shape(self.init, jnp.int32(0))
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, self.state_shardings)

    def precompile(self) -> None:
        """Compile `grads` and `apply` ahead of time and call the executables directly from now on.

        A replica that joins a running job does this before its first quorum: compiling inside the
        step would make every peer wait for it at the next FTAR."""
        st = self.abstract_state()
        batch = jax.ShapeDtypeStruct((self.cfg.data.batch_size, self.cfg.model.seq_len + 1), jnp.int32,
                                     sharding=self.batch_sharding)
        lr = jax.ShapeDtypeStruct((), jnp.float32, sharding=shd.replicated(self.mesh))
        self.grads = self.grads.lower(st["params"], batch).compile()
        self.apply = self.apply.lower(st, st["params"], lr).compile()
        if self.cfg.ft.global_batch == "constant":  # an outage must not wait for a compile
            for n in self.chunk_rows:
                rows = batch.update(shape=(n, batch.shape[1]))
                self.compiled_accumulate[n] = self.accumulate.lower(st["params"], st["params"], rows).compile()
            self.zeros = self.zeros.lower().compile()
            self.add = self.add.lower(st["params"], st["params"]).compile()

    def warm_up(self) -> None:
        """Run each precompiled executable once on zeros: a first run pays one-time costs (buffers,
        thread pools; on several hosts, the collectives' contexts) that would otherwise fall on the
        first step this replica contributes to, which every peer waits for at its FTAR. Every host
        of the replica calls it (the executables span them)."""
        def zeros(a):  # (a jit with out_shardings makes global arrays, on one host or several)
            return jax.jit(lambda: jnp.zeros(a.shape, a.dtype), out_shardings=a.sharding)()

        st = self.abstract_state()
        batch = jax.ShapeDtypeStruct((self.cfg.data.batch_size, self.cfg.model.seq_len + 1), jnp.int32,
                                     sharding=self.batch_sharding)
        lr = jax.ShapeDtypeStruct((), jnp.float32, sharding=shd.replicated(self.mesh))
        state = jax.tree.map(zeros, st)
        _, g = self.grads(state["params"], zeros(batch))
        if self.cfg.ft.global_batch == "constant":
            for n in self.chunk_rows:
                g, _ = self.accumulate_rows(g, state["params"], zeros(batch.update(shape=(n, batch.shape[1]))))
            g = self.add(g, self.zeros())
        state = jax.block_until_ready(self.apply(state, g, zeros(lr)))  # (donates the old one)
        if self.cfg.ft.digest_every and jax.process_count() > 1:  # its gather compiles on first use
            state_digest(state)

    def topology(self) -> str:
        """Gradient lanes, and every state leaf's shape, dtype and shard layout: replicas may
        exchange gradients and snapshots only if these agree (another model size has other shapes
        under the same specs). A reduced-degree replica (fewer hosts, fewer devices) has the same:
        its hosts serve the same lanes (ftjax/lanes.py). One `key: value` line per item, so that the
        coordinator can name the items that differ (ftjax/coordinator/layout.py)."""
        lanes = f"mesh: lanes={self.cfg.mesh.hosts} devices_per_lane={self.cfg.mesh.devices_per_host}"
        state = self.abstract_state()
        rest = {k: v for k, v in state.items() if k != "params"}  # (the parameters first: named first)
        return "\n".join([lanes, shd.describe({"params": state["params"]}), shd.describe(rest)])


def build_program(cfg: Config, mesh: jax.sharding.Mesh | None = None) -> ReplicaProgram:
    """Compile a replica's functions over `mesh` (default: the replica's own FSDP mesh; the
    synchronous baseline of `ftjax bench step` passes a (replica, fsdp) mesh instead)."""
    if mesh is None:
        # jax.devices() is global (every process's devices); a replica uses the first
        # live hosts x devices_per_host of them, which lets tests build several meshes in one process.
        devices = jax.devices()[: cfg.mesh.live_devices]
        mesh = shd.replica_mesh(devices)
    abstract_model = nnx.eval_shape(lambda: models.build(cfg.model, nnx.Rngs(0)))
    graphdef, abstract_vars = nnx.split(abstract_model)
    logical = nnx.to_pure_dict(nnx.get_partition_spec(abstract_vars))
    p_shard = shd.param_shardings(logical, mesh)
    # the clip's norm in blocks of a full replica's shards: the same bits on every degree
    full_devices = cfg.mesh.hosts * cfg.mesh.devices_per_host
    tx = make_optimizer(cfg.optim, cfg.steps, norm=block_norm(p_shard, full_devices, mesh))

    def _init_params(seed):
        return nnx.to_pure_dict(nnx.state(models.build(cfg.model, nnx.Rngs(jax.random.key(seed)))))

    params_shape = jax.eval_shape(_init_params, jnp.int32(0))
    opt_shard = shd.follow_params(jax.eval_shape(tx.init, params_shape), p_shard, mesh)
    rep = shd.replicated(mesh)
    state_shardings = {"params": p_shard, "opt": opt_shard, "step": rep}
    b_shard = shd.batch_sharding(mesh)

    def init(seed):
        params = _init_params(seed)
        return {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    def grads(params, batch):
        return jax.value_and_grad(lambda p: loss_fn(graphdef, p, batch))(params)

    def apply(state, g, lr_scale):
        updates, opt = tx.update(g, state["opt"], state["params"])
        updates = jax.tree.map(lambda u: u * lr_scale.astype(u.dtype), updates)
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt, "step": state["step"] + 1}

    def train_step(state, batch, lr_scale):
        loss, g = grads(state["params"], batch)
        return apply(state, g, lr_scale), loss

    def accumulate(acc, params, rows):
        # Gradient accumulation for a constant global batch (ftjax/batches.py): each row's loss
        # counts 1 / batch_size, so the micro-batches of one whole batch sum to its mean loss.
        def rows_loss(p):
            per_row = row_losses(graphdef, p, rows)
            return per_row.sum() / cfg.data.batch_size, per_row

        (_, per_row), g = jax.value_and_grad(rows_loss, has_aux=True)(params)
        return jax.tree.map(jnp.add, acc, g), per_row

    def zeros():
        return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), params_shape)

    return ReplicaProgram(
        cfg=cfg, mesh=mesh, state_shardings=state_shardings, batch_sharding=b_shard,
        init=jax.jit(init, out_shardings=state_shardings),
        grads=jax.jit(grads, in_shardings=(p_shard, b_shard), out_shardings=(rep, p_shard)),
        apply=jax.jit(apply, in_shardings=(state_shardings, p_shard, rep), out_shardings=state_shardings,
                      donate_argnums=0),
        train_step=jax.jit(train_step, in_shardings=(state_shardings, b_shard, rep),
                           out_shardings=(state_shardings, rep), donate_argnums=0),
        accumulate=jax.jit(accumulate, in_shardings=(p_shard, p_shard, b_shard), out_shardings=(p_shard, rep),
                           donate_argnums=0),
        zeros=jax.jit(zeros, out_shardings=p_shard),
        add=jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b), in_shardings=(p_shard, p_shard), out_shardings=p_shard),
    )


def device_batch(program: ReplicaProgram, batch) -> jax.Array:
    """Place a full (global) batch on the replica mesh; each process contributes its own rows."""
    import numpy as np

    n_proc = jax.process_count()
    rows = batch.shape[0] // n_proc
    local = np.asarray(batch)[jax.process_index() * rows:(jax.process_index() + 1) * rows]
    return jax.make_array_from_process_local_data(program.batch_sharding, local, batch.shape)


def topology_fingerprint(program: ReplicaProgram) -> str:
    """A short hash of the mesh shape and shard layout: replicas that average together must match."""
    return hashlib.sha256(program.topology().encode()).hexdigest()[:16]


def param_count(state: State) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(state["params"]))
