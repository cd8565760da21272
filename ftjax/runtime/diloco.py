"""DiLoCo and streaming DiLoCo (`ft.sync`): replicas average parameter deltas, not gradients.

Every replica takes `inner` optimizer steps (the task's optimizer, AdamW by default) on its own
batches from the job's global parameters, then the replicas average their pseudo-gradients
(global - local parameters) through FTAR and an outer optimizer (Nesterov SGD by default) applies
the average to the global parameters (Douillard et al. 2023). Streaming DiLoCo cuts the parameters
into `fragments` and averages one fragment per round, in turn, so that the bytes of one round are
a fragment's (Douillard et al. 2025; the overlap of a fragment's exchange with the next inner
steps is not built: docs/design.md, "Training across slow links").

An outer round is one step of the step protocol: the quorum, FTAR, the vote, the commit, the heal
and its replay, durable checkpoints and exactly-once positions all work per round as they do per
step, unchanged. What is per replica and what the job shares:

- shared (bitwise equal on every replica, the per-step digest and the final one cover it):
  `params` (the global parameters) and `outer` (one outer optimizer state per fragment);
- per replica: `opt` and `step` (the inner optimizer's state and step count) and, with
  fragments, `local` (the parameters the inner steps train; a fragment's are reset to the new
  global ones each time it is averaged). A replica that heals takes its peer's (the snapshot
  carries the whole state), as a restarted worker of the paper would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ftjax.program import sharding as shd
from ftjax.program.task import TaskError


def outer_optimizer(ft: Any) -> optax.GradientTransformation:
    """The config's outer optimizer (`ft.outer_optimizer`, `ft.outer_lr`, `ft.outer_momentum`)."""
    if ft.outer_optimizer == "nesterov":
        return optax.sgd(ft.outer_lr, momentum=ft.outer_momentum, nesterov=True)
    if ft.outer_optimizer == "sgd":
        return optax.sgd(ft.outer_lr, momentum=ft.outer_momentum or None)
    return optax.adam(ft.outer_lr)


def fragment_leaves(sizes: list[int], fragments: int) -> tuple[tuple[int, ...], ...]:
    """Deal leaves of `sizes` bytes to `fragments` fragments of about equal bytes, none empty: each
    fragment's leaf indices, ascending. Largest leaf first, each to the fragment with the fewest
    bytes so far (ties: the lower fragment), so the peak (what one round averages) is at most the
    fair share plus one leaf. Like the paper's strided layers, a fragment need not be contiguous. A
    leaf is never split (its average goes back whole): the peak is exactly total / fragments only
    when the leaves allow it."""
    if not 1 <= fragments <= len(sizes):
        raise ValueError(f"ft.fragments={fragments}: the model has {len(sizes)} parameter arrays to cut")
    loads, members = [0] * fragments, [[] for _ in range(fragments)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        f = min(range(fragments), key=lambda f: (loads[f], f))
        loads[f] += sizes[i]
        members[f].append(i)
    return tuple(tuple(sorted(m)) for m in members)


@dataclass
class InnerResult:
    """A round's inner steps on this replica: the mean loss, the last step's aux metrics, the
    pseudo-gradient of the round's fragment (global - local, float32 leaves), and the inner state
    to keep if the round commits."""

    loss: Any
    aux: dict | None
    delta: list
    local: Any  # the parameters after the inner steps
    opt: Any
    step: Any


class OuterSync:
    """The DiLoCo side of the built-in loop for one replica program (`ft.sync` not every_step).

    `inner`: inner steps per round (ft.inner_steps, divided among the fragments when streaming);
    `fragment(step)`: which fragment the round after committed step `step` averages."""

    def __init__(self, cfg: Any, program: Any, outer_tx: optax.GradientTransformation | None = None) -> None:
        ft = cfg.ft
        if program.has_model_state:  # (ftjax.program.tasks.check_task says so before a process starts)
            raise TaskError(
                f"ft.sync={ft.sync}: task {program.task.name} has model state (batch statistics ...), "
                "which DiLoCo does not average; use ft.sync=every_step"
            )
        self.fragments, self.inner = cfg.sync_fragments, cfg.inner_per_step
        self.tx = outer_tx or program.task.outer_optimizer or outer_optimizer(ft)
        self.program = program
        abstract = program.abstract_state()
        leaves, self.treedef = jax.tree.flatten(abstract["params"])
        self.groups = fragment_leaves([a.size * 4 for a in leaves], self.fragments)
        self._bytes = [sum(leaves[i].size * 4 for i in g) for g in self.groups]
        self.shardings = [a.sharding for a in leaves]
        mesh = program.mesh
        self.outer_abstract = []
        for f in range(self.fragments):
            shapes = jax.eval_shape(self.tx.init, self.part(leaves, f))
            sh = shd.follow_params(shapes, self.part(self.shardings, f), mesh)
            self.outer_abstract.append(
                jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h), shapes, sh)
            )
        self._outer_init = [
            jax.jit(self.tx.init, out_shardings=jax.tree.map(lambda a: a.sharding, o)) for o in self.outer_abstract
        ]
        copy = lambda t: jax.tree.map(jnp.copy, t)  # (new buffers: the program's apply donates its state)
        st = program.state_shardings
        self._copy_inner = jax.jit(copy, out_shardings={k: st[k] for k in ("params", "opt", "step")})
        self._copy_params = jax.jit(copy, out_shardings=st["params"])
        self._delta = jax.jit(lambda g, loc: [(a - b).astype(jnp.float32) for a, b in zip(g, loc)])
        tx = self.tx

        def outer(g, s, avg, scale):
            updates, s = tx.update(avg, s, g)
            updates = jax.tree.map(lambda u: u * scale.astype(u.dtype), updates)
            return optax.apply_updates(g, updates), s

        # per fragment, its shardings fixed: the results are state that peers fetch and checkpoints save
        self._outer = [
            jax.jit(outer, out_shardings=(self.part(self.shardings, f), jax.tree.map(lambda a: a.sharding, o)))
            for f, o in enumerate(self.outer_abstract)
        ]

    # --- the fragments ----------------------------------------------------------------------------
    def part(self, leaves: list, f: int) -> list:
        return [leaves[i] for i in self.groups[f]]

    def _replace(self, leaves: list, f: int, new: list) -> list:
        """`leaves` with fragment f's replaced by `new`."""
        out = list(leaves)
        for i, x in zip(self.groups[f], new, strict=True):
            out[i] = x
        return out

    def fragment(self, step: int) -> int:
        return step % self.fragments

    def fragment_bytes(self, f: int) -> int:
        """Bytes of fragment f's pseudo-gradient in float32 (what one replica averages in a round)."""
        return self._bytes[f]

    # --- the state --------------------------------------------------------------------------------
    def abstract_state(self) -> dict:
        """The program's state's shapes, dtypes and shardings, with the outer state (and local parameters)."""
        abstract = self.program.abstract_state()
        out = {**abstract, "outer": list(self.outer_abstract)}
        if self.fragments > 1:
            out["local"] = abstract["params"]
        return out

    def init(self, state: dict) -> dict:
        """A program state (a seed's, or loaded parameters) with the outer state of its parameters."""
        leaves = jax.tree.leaves(state["params"])
        out = {**state, "outer": [init(self.part(leaves, f)) for f, init in enumerate(self._outer_init)]}
        if self.fragments > 1:
            out["local"] = self._copy_params(state["params"])
        return out

    @staticmethod
    def shared(state: dict) -> dict:
        """What every replica holds bitwise equal (the digests' view: `outer` in the optimizer's place)."""
        return {"params": state["params"], "opt": state["outer"]}

    def local_params(self, state: dict) -> Any:
        return state["local"] if self.fragments > 1 else state["params"]

    # --- a round ----------------------------------------------------------------------------------
    def run_inner(self, state: dict, batches: list, wheres: list, f: int, beat=lambda: None) -> InnerResult:
        """The inner steps of a round on copies (the state stays as it is until the round commits:
        a discarded round is computed again from it)."""
        program = self.program
        inner = self._copy_inner({"params": self.local_params(state), "opt": state["opt"], "step": state["step"]})
        losses, aux = [], None
        one = np.float32(1.0)
        for batch, w in zip(batches, wheres):
            beat()
            loss, aux, grads = program.grads_of(inner, batch, w)
            inner = program.apply(inner, grads, one)  # (donates the copy)
            losses.append(loss)
        g = self.part(jax.tree.leaves(state["params"]), f)
        delta = self._delta(g, self.part(jax.tree.leaves(inner["params"]), f))
        loss = float(np.mean([float(x) for x in losses]))
        return InnerResult(loss, aux, delta, inner["params"], inner["opt"], inner["step"])

    def apply(self, state: dict, tagged: tuple[int, list], scale: float, mine: InnerResult | None) -> dict:
        """The outer step of fragment f with the contributors' average; `mine`: this replica's
        inner steps of the round (None in a replay: the state's own inner part stays)."""
        f, avg = tagged
        leaves = jax.tree.leaves(state["params"])
        g, s = self._outer[f](self.part(leaves, f), state["outer"][f], list(avg), np.float32(scale))
        new = self._replace(leaves, f, list(g))
        outer = list(state["outer"])
        outer[f] = s
        out = {**state, "params": jax.tree.unflatten(self.treedef, new), "outer": outer}
        if mine is not None:
            out["opt"], out["step"] = mine.opt, mine.step
        if self.fragments > 1:  # the fragment's local parameters start again from the new global ones
            local = jax.tree.leaves(mine.local if mine is not None else state["local"])
            local = self._replace(local, f, [jnp.copy(x) for x in g])
            out["local"] = jax.tree.unflatten(self.treedef, local)
        return out

    def warm_up(self) -> None:
        """Compile the outer step of every fragment before the first round (a compile at the first
        commit would make the peers wait at the next FTAR)."""
        leaves = jax.tree.leaves(self.program.abstract_state()["params"])  # (once: an eval_shape of the init)
        for f in range(self.fragments):
            zeros = [jax.device_put(np.zeros(a.shape, a.dtype), a.sharding) for a in self.part(leaves, f)]
            state = self._outer_init[f](zeros)
            self._outer[f](zeros, state, zeros, np.float32(1.0))
            self._delta(zeros, zeros)


class RoundStream:
    """A replica's data stream in rounds: position p is the `inner` batches p*inner .. p*inner +
    inner - 1 of the stream beneath, so exactly-once holds per round as it does per batch (a
    round's batches are a pure function of its position). `batch_id(p)`: the round's own id, in
    the same interleaving as a batch's (p * replicas + replica)."""

    def __init__(self, stream: Any, inner: int) -> None:
        self.stream, self.inner = stream, inner
        self.replica, self.replicas = stream.replica, stream.replicas
        self.fingerprint = f"{stream.fingerprint}|rounds of {inner}"

    def batch_id(self, position: int) -> int:
        return position * self.replicas + self.replica

    def batch_ids(self, position: int) -> list[int]:
        """The ids of the batches beneath round `position`."""
        return [self.stream.batch_id(position * self.inner + h) for h in range(self.inner)]

    def batch(self, position: int) -> list:
        return [self.stream.batch(position * self.inner + h) for h in range(self.inner)]


class Tagged:
    """An averaged fragment and its index (the replay must know which fragment an update is)."""

    __slots__ = ("fragment", "update")

    def __init__(self, fragment: int, update: Any) -> None:
        self.fragment, self.update = fragment, update


class FragmentReducer:
    """One reducer per fragment (FTAR over that fragment's leaves, buffers of its own), the round's
    chosen by the quorum's step. What the replay keeps is the fragment's flat average with its
    index appended (one float32: exact below 2**24)."""

    def __init__(self, reducers: list, fragments: int) -> None:
        self.reducers, self.fragments = reducers, fragments
        self._last = 0

    @property
    def phases(self):
        return getattr(self.reducers[self._last], "phases", None)

    def average(self, q: Any, grads: Any | None) -> Tagged:
        f = self._last = q.step % self.fragments
        return Tagged(f, self.reducers[f].average(q, grads))

    def tree(self, update: Tagged | np.ndarray) -> tuple[int, Any]:
        if isinstance(update, Tagged):
            return update.fragment, self.reducers[update.fragment].tree(update.update)
        f = int(update[-1])
        return f, self.reducers[f].tree(update[:-1].astype(_flat_dtype(self.reducers[f])))

    def detach(self, update: Tagged) -> np.ndarray:
        flat = np.asarray(self.reducers[update.fragment].detach(update.update), np.float32).reshape(-1)
        return np.append(flat, np.float32(update.fragment))

    def close(self) -> None:
        for r in self.reducers:
            r.close()


def _flat_dtype(reducer: Any) -> np.dtype:
    """The dtype of a reducer's flat buffers (FTAR's: ft.grad_dtype)."""
    flat = getattr(reducer, "flat", None)
    return np.dtype(flat.dtype) if flat is not None else np.dtype(np.float32)
