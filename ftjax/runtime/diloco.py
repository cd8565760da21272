"""DiLoCo and streaming DiLoCo (`ft.sync`): replicas average parameter deltas, not gradients.

Every replica takes `inner` optimizer steps (the task's optimizer, AdamW by default) on its own
batches from the job's global parameters, then the replicas average their pseudo-gradients
(global - local parameters) through FTAR and an outer optimizer (Nesterov SGD by default) applies
the average to the global parameters (Douillard et al. 2023). Streaming DiLoCo cuts the parameters
into `fragments` and averages one fragment per round, in turn, so that the bytes of one round are
a fragment's (Douillard et al. 2025). With torchft's `ft.fragment_sync_delay` tau the fragment's
pseudo-gradient is taken tau inner steps before the round's end, and with `ft.fragment_update_alpha`
alpha its local parameters after the outer step are alpha x local + (1 - alpha) x global; the
exchange then runs while those tau steps compute (`inner_steps` yields the delta on the way:
ftjax/runtime/sync.py, docs/design/replicas.md "Overlap").

With `ft.sync_warmup_steps` W, the job's first W steps are synchronous, as the paper's runs
start from a model trained with every-step sync: each averages the replicas' gradients of one
batch (tagged `SYNC`; the whole gradient, also when streaming: through a reducer of its own over
every parameter) and applies the inner optimizer to the global parameters, as every_step would;
the rounds start at step W with the inner optimizer's state as the warm-up left it, a fresh outer
state and, streaming, local parameters equal to the global ones.

An outer round is one step of the step protocol: the quorum, FTAR, the vote, the commit, the heal
and its replay, durable checkpoints and exactly-once positions all work per round as they do per
step, unchanged. What is per replica and what the job shares:

- shared (bitwise equal on every replica, the per-step digest and the final one cover it):
  `params` (the global parameters) and `outer` (one outer optimizer state per fragment);
- per replica: `opt` and `step` (the inner optimizer's state and step count) and, with
  fragments, `local` (the parameters the inner steps train; a fragment's are reset to the new
  global ones each time it is averaged) and `since` (each fragment's inner steps since then). A
  replica that heals takes its peer's (the snapshot carries the whole state), as a restarted
  worker of the paper would; its fragments then lack the peer's inner steps of the replayed
  rounds, which `since` counts: a streaming round's average is weighted by them (`weight`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ftjax.config import Config, FTConfig
from ftjax.coordinator.types import QuorumResult
from ftjax.ftar import quant
from ftjax.program import sharding as shd
from ftjax.program.data import BatchStream
from ftjax.program.step import ReplicaProgram, State
from ftjax.program.task import TaskError
from ftjax.runtime.pipeline import Averaged
from ftjax.runtime.protocol import Reducer


def outer_optimizer(ft: FTConfig) -> optax.GradientTransformation:
    """The config's outer optimizer (`ft.outer_optimizer`, `ft.outer_lr`, `ft.outer_momentum`)."""
    if ft.outer_optimizer == "nesterov":
        return optax.sgd(ft.outer_lr, momentum=ft.outer_momentum, nesterov=True)
    if ft.outer_optimizer == "sgd":
        return optax.sgd(ft.outer_lr, momentum=ft.outer_momentum or None)
    return optax.adam(ft.outer_lr)


SYNC = -1  # the tag of a warm-up step's average: the whole gradient, which the inner optimizer applies


def round_span(position: int, inner: int, warmup: int = 0) -> tuple[int, int]:
    """(the first batch, the number of batches) beneath data position `position` of a replica's
    stream: one batch per position for the first `warmup` positions (synchronous steps), then
    `inner` per position (rounds). Every batch lies beneath exactly one position."""
    if position < warmup:
        return position, 1
    return warmup + (position - warmup) * inner, inner


class Piece(NamedTuple):
    """Elements start..stop of parameter leaf `leaf`, flattened (row-major): a part of a fragment."""

    leaf: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def fragment_pieces(sizes: list[int], fragments: int, unit: int = 1) -> tuple[tuple[Piece, ...], ...]:
    """Cut leaves of `sizes` elements into `fragments` fragments of total // fragments or one more
    elements each, so that the peak (what one round averages) is the fair share to one element:
    each fragment's pieces, in (leaf, start) order. With `unit` (dividing every size; `cut_unit`),
    everything is counted in units of that many elements: every piece is whole units (it shards
    like its leaf), the shares fair to one unit.

    Whole leaves are dealt first, largest first, each to the fragment with the fewest elements so
    far (ties: the lower fragment): like the paper's strided layers, a fragment need not be
    contiguous, and most leaves stay whole (an average goes back as it came, no reshape). Then a
    fragment over its share gives the tail of the last leaf it was dealt to fragments under
    theirs. That tail always suffices: when the leaf was dealt, the fragment was the lightest, so
    without it the fragment is within the fair share. At most fragments - 1 leaves are cut."""
    if unit > 1:
        if any(n % unit for n in sizes):
            raise ValueError(f"a cut unit of {unit} elements does not divide every leaf")
        cut = fragment_pieces([n // unit for n in sizes], fragments)
        return tuple(tuple(Piece(p.leaf, p.start * unit, p.stop * unit) for p in f) for f in cut)
    total = sum(sizes)
    if not 1 <= fragments <= total:
        raise ValueError(f"ft.fragments={fragments}: the model has {total} parameters to cut")
    loads, dealt = [0] * fragments, [[] for _ in range(fragments)]  # type: ignore[var-annotated]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        f = min(range(fragments), key=lambda f: (loads[f], f))
        loads[f] += sizes[i]
        dealt[f].append(i)
    # the heaviest fragments take the one extra element where the total does not divide
    ranked = sorted(range(fragments), key=lambda f: (-loads[f], f))
    share = {f: total // fragments + (k < total % fragments) for k, f in enumerate(ranked)}
    pieces = [[Piece(i, 0, sizes[i]) for i in d] for d in dealt]
    tails = []  # (leaf, start, stop) cut off the fragments over their share
    for f in range(fragments):
        over = loads[f] - share[f]
        if over > 0:
            last = pieces[f].pop()
            if last.size > over:
                pieces[f].append(Piece(last.leaf, 0, last.size - over))
            tails.append(Piece(last.leaf, last.size - over, last.size))
    for f in range(fragments):
        need = share[f] - loads[f]
        while need > 0:
            tail = tails.pop()
            take = min(need, tail.size)
            pieces[f].append(Piece(tail.leaf, tail.start, tail.start + take))
            if take < tail.size:
                tails.append(Piece(tail.leaf, tail.start + take, tail.stop))
            need -= take
    return tuple(tuple(sorted(p)) for p in pieces)


def fragment_cut(cfg: Config, leaves: list) -> tuple[tuple[Piece, ...], ...]:
    """The job's fragments of these parameter leaves (anything with `.size`): what OuterSync steps
    and the fragments' reducers are built on, so both cut alike."""
    sizes = [a.size for a in leaves]
    return fragment_pieces(sizes, cfg.sync_fragments, cut_unit(cfg, sizes))


def cut_unit(cfg: Config, sizes: list[int]) -> int:
    """The elements a fragment's cut counts in: the devices a full replica of the job shards a leaf
    over (the FSDP axes; the same on every replica, whatever its degree, so that every replica cuts
    alike), where that divides every leaf, else 1. A cut piece of whole units shards over those
    devices like an FSDP leaf; one that is not rides replicated (every lane carries it)."""
    m = cfg.mesh
    unit = m.hosts * m.devices_per_host // m.tensor
    return unit if all(n % unit == 0 for n in sizes) else 1


def piece_templates(
    leaves: list, shardings: list, pieces: tuple[Piece, ...], weight: bool = False
) -> tuple[list, list]:
    """A fragment's pieces as arrays: a whole leaf as it is (its shape, its sharding); a cut one as
    a flat vector over the leaf's mesh, sharded over its batch axes where its length divides (see
    `cut_unit`), else replicated (the outer step takes it out of its leaf: a gather of that leaf,
    one fragment per round). `weight` (streaming): then one float32 more, replicated, the
    contributor's weight (`OuterSync.weight`)."""
    templates, out = [], []
    for p in pieces:
        a, sh = leaves[p.leaf], shardings[p.leaf]
        if p.size == a.size:
            templates.append(jax.ShapeDtypeStruct(a.shape, a.dtype))
            out.append(sh)
            continue
        templates.append(jax.ShapeDtypeStruct((p.size,), a.dtype))
        if not hasattr(sh, "mesh"):  # (one device)
            out.append(sh)
            continue
        flat = shd.batch_sharding(sh.mesh)
        out.append(flat if p.size % flat.num_devices == 0 else shd.replicated(sh.mesh))
    if weight:
        sh = shardings[pieces[0].leaf]
        templates.append(jax.ShapeDtypeStruct((1,), jnp.float32))
        out.append(shd.replicated(sh.mesh) if hasattr(sh, "mesh") else sh)
    return templates, out


@dataclass
class InnerResult:
    """A round's inner steps on this replica: the mean loss, the last step's aux metrics, the
    pseudo-gradient of the round's fragment (global - local, float32 leaves), and the inner state
    to keep if the round commits."""

    loss: float
    aux: dict[str, jax.Array] | None
    delta: list[jax.Array]
    local: optax.Params | None  # the parameters after the inner steps (None: a warm-up step's)
    opt: optax.OptState | None
    step: jax.Array | None
    steps: int = 0  # the inner steps taken (streaming: every fragment's count since its reset grows by them)


class OuterSync:
    """The DiLoCo side of the built-in loop for one replica program (`ft.sync` not every_step).

    `inner`: inner steps per round (ft.inner_steps, divided among the fragments when streaming);
    `fragment(step)`: which fragment the round after committed step `step` averages."""

    def __init__(
        self, cfg: Config, program: ReplicaProgram, outer_tx: optax.GradientTransformation | None = None
    ) -> None:
        ft = cfg.ft
        if program.has_model_state:  # (ftjax.program.tasks.check_task says so before a process starts)
            raise TaskError(
                f"ft.sync={ft.sync}: task {program.task.name} has model state (batch statistics ...), "
                "which DiLoCo does not average; use ft.sync=every_step"
            )
        self.fragments, self.inner, self.warmup = cfg.sync_fragments, cfg.inner_per_step, cfg.warmup_sync_steps
        # streaming: tau (the pseudo-gradient taken tau inner steps before the outer step) and alpha
        self.delay, restart = ft.fragment_sync_delay, _restart(float(ft.fragment_update_alpha))
        self.tx = outer_tx or program.task.outer_optimizer or outer_optimizer(ft)
        self.program = program
        abstract = program.abstract_state()
        leaves, self.treedef = jax.tree.flatten(abstract["params"])
        self.pieces = fragment_cut(cfg, leaves)
        # the leaves each fragment's pieces lie in (a fragment's jitted steps take and return only those)
        self.touched = [sorted({p.leaf for p in ps}) for ps in self.pieces]
        self._bytes = [_wire_bytes(ft.wire_dtype, sum(p.size for p in ps)) for ps in self.pieces]
        self.shardings = [a.sharding for a in leaves]
        weighted = self.fragments > 1  # streaming: each delta carries its weight (`weight`)
        self.outer_abstract, piece_shardings = _outer_shapes(
            self.tx, leaves, self.shardings, self.pieces, program.mesh, weighted
        )
        self._grads32 = _float32_leaves(self.shardings)  # (a warm-up step's gradient: whole leaves, in order)
        copy = lambda t: jax.tree.map(jnp.copy, t)  # (new buffers: the program's apply donates its state)
        st = program.state_shardings
        self._copy_inner = jax.jit(copy, out_shardings={k: st[k] for k in ("params", "opt", "step")})
        self._copy_params = jax.jit(copy, out_shardings=st["params"])
        self._since_sharding = st["step"]  # (replicated)
        tx = self.tx
        self._outer_init, self._delta, self._outer, self._reset = [], [], [], []
        for f, o in enumerate(self.outer_abstract):
            take, put = partial(self._take, f), partial(self._put, f)
            osh = jax.tree.map(lambda a: a.sharding, o)
            touched = [self.shardings[i] for i in self.touched[f]]

            def outer(g, s, avg, scale, take=take, put=put):
                pieces = take(g)
                if weighted:  # sum(w x delta) / sum(w): x / 1 when every weight is 1 (the same bits)
                    w = avg[-1][0]
                    w = jnp.where(w > 0, w, 1)  # (every weight 0: every delta taken at a reset, all zeros)
                    avg = [a / w.astype(a.dtype) for a in avg[:-1]]
                updates, s = tx.update(avg, s, pieces)
                updates = jax.tree.map(lambda u: u * scale.astype(u.dtype), updates)
                return put(g, optax.apply_updates(pieces, updates)), s

            self._outer_init.append(jax.jit(lambda g, take=take: tx.init(take(g)), out_shardings=osh))
            self._delta.append(jax.jit(_pseudo_gradient(take, weighted), out_shardings=piece_shardings[f]))
            # per fragment, its shardings fixed: the results are state that peers fetch and checkpoints save
            self._outer.append(jax.jit(outer, out_shardings=(touched, osh)))

            # a fragment's local parameters start again from the new global ones, or mix with them (alpha)
            self._reset.append(
                jax.jit(
                    lambda loc, g, take=take, put=put: put(loc, [restart(a, b) for a, b in zip(take(loc), take(g))]),
                    out_shardings=touched,
                )
            )

    # --- the fragments ----------------------------------------------------------------------------
    def _take(self, f: int, touched: list) -> list:
        """Fragment f's pieces out of its touched leaves (traced inside the fragment's jitted steps)."""
        by = dict(zip(self.touched[f], touched, strict=True))
        return [
            by[p.leaf] if p.size == by[p.leaf].size else by[p.leaf].reshape(-1)[p.start : p.stop]
            for p in self.pieces[f]
        ]

    def _put(self, f: int, touched: list, new: list) -> list:
        """Fragment f's touched leaves with its pieces replaced by `new` (the rest of a cut leaf kept)."""
        by = dict(zip(self.touched[f], touched, strict=True))
        for p, x in zip(self.pieces[f], new, strict=True):
            a = by[p.leaf]
            if p.size == a.size:
                by[p.leaf] = x.astype(a.dtype)
            else:
                by[p.leaf] = a.reshape(-1).at[p.start : p.stop].set(x.astype(a.dtype)).reshape(a.shape)
        return [by[i] for i in self.touched[f]]

    def part(self, leaves: list, f: int) -> list:
        """The leaves fragment f's pieces lie in."""
        return [leaves[i] for i in self.touched[f]]

    def _replace(self, leaves: list, f: int, new: list) -> list:
        """`leaves` with fragment f's touched ones replaced by `new`."""
        out = list(leaves)
        for i, x in zip(self.touched[f], new, strict=True):
            out[i] = x
        return out

    def fragment(self, step: int) -> int:
        """The fragment the step after committed step `step` averages (0, "all", in a warm-up step)."""
        return 0 if step < self.warmup else step % self.fragments

    def synchronous(self, step: int) -> bool:
        """Whether the step after committed step `step` is a warm-up step (gradients averaged)."""
        return step < self.warmup

    def fragment_bytes(self, f: int) -> int:
        """Bytes of fragment f's pseudo-gradient in FTAR's frames (what one replica averages in a round)."""
        return self._bytes[f]

    def round_fields(self, step: int) -> dict:
        """The record of the step after committed step `step`: the fragment it averages, the bytes
        it averages in FTAR's frames (`ft.wire_dtype`; the fragment's, or in a warm-up step the
        whole gradient's), whether it is a warm-up step."""
        synchronous = self.synchronous(step)
        nbytes = sum(self._bytes) if synchronous else self._bytes[self.fragment(step)]
        return {"fragment": self.fragment(step), "sync_bytes": nbytes, "synchronous": synchronous}

    # --- the state --------------------------------------------------------------------------------
    def abstract_state(self) -> dict:
        """The program's state's shapes, dtypes and shardings, with the outer state (and local parameters)."""
        abstract = self.program.abstract_state()
        out = {**abstract, "outer": list(self.outer_abstract)}
        if self.fragments > 1:
            out["local"] = abstract["params"]
            out["since"] = jax.ShapeDtypeStruct((self.fragments,), jnp.int32, sharding=self._since_sharding)
        return out

    def init(self, state: dict) -> dict:
        """A program state (a seed's, or loaded parameters) with the outer state of its parameters."""
        leaves = jax.tree.leaves(state["params"])
        out = {**state, "outer": [init(self.part(leaves, f)) for f, init in enumerate(self._outer_init)]}
        if self.fragments > 1:
            out["local"] = self._copy_params(state["params"])
            out["since"] = self._since(np.zeros(self.fragments))
        return out

    def _since(self, counts: np.ndarray) -> jax.Array:
        """`since` (streaming, each replica's): each fragment's inner steps since its last outer step."""
        return jax.device_put(np.asarray(counts, np.int32), self._since_sharding)

    def weight(self, state: dict, f: int, take: int, step: int | None) -> np.float32:
        """Streaming: this contributor's weight in the round's average of fragment f, the inner steps
        its delta holds (the fragment's `since` in the state, plus this round's `take` before the
        delta) over those of a replica that took every one since the fragment's last outer step (the
        schedule's, from the committed step `step`, the same on every replica). The average is
        sum(w x delta) / sum(w): every weight is 1, and the average the plain mean bitwise, unless a
        contributor's local parameters lack inner steps (it healed since the fragment's last outer
        step, or lagged in a warm-up)."""
        if self.fragments == 1:
            return np.float32(1)
        if step is None:
            raise ValueError("streaming DiLoCo: a round's weight needs the committed step")
        count = int(np.asarray(state["since"])[f]) + take
        full = self.inner * min(self.fragments - 1, step - self.warmup) + self.inner - self.delay
        return np.float32(count / full)

    @staticmethod
    def shared(state: dict) -> dict:
        """What every replica holds bitwise equal (the digests' view: `outer` in the optimizer's place)."""
        return {"params": state["params"], "opt": state["outer"]}

    def local_params(self, state: State) -> optax.Params:
        return state["local"] if self.fragments > 1 else state["params"]

    # --- a round ----------------------------------------------------------------------------------
    def run_inner(
        self,
        state: State,
        batches: list,
        wheres: list,
        f: int,
        beat: Callable[[], None] = lambda: None,
        synchronous: bool = False,
        step: int | None = None,
    ) -> InnerResult:
        """The inner steps of a round on copies (the state stays as it is until the round commits:
        a discarded round is computed again from it). `synchronous` (a warm-up step): the gradient
        of the one batch at the global parameters, to be averaged, and no inner state. `step`
        (streaming): the committed step, for the delta's weight (`weight`)."""
        steps = self.inner_steps(state, batches, wheres, f, beat, synchronous, step)
        next(steps)  # (the delta, taken on the way)
        return finish_round(steps)

    def inner_steps(
        self,
        state: State,
        batches: list,
        wheres: list,
        f: int,
        beat: Callable[[], None] = lambda: None,
        synchronous: bool = False,
        step: int | None = None,
    ) -> Generator[list[jax.Array], None, InnerResult]:
        """`run_inner` in two parts: yields the round's delta as soon as it is taken (tau inner
        steps before the round's end: its exchange may run while those steps compute), then returns
        the InnerResult. The same operations in the same order as `run_inner`: the same bits."""
        program = self.program
        if synchronous:  # (several batches only where a restore left the position past the warm-up's end)
            out = [program.grads_of(state, b, w) for b, w in zip(batches, wheres)]
            grads = [self._grads32(g) for _, _, g in out]
            mean = grads[0] if len(grads) == 1 else [sum(x) / len(grads) for x in zip(*grads)]
            yield mean
            return InnerResult(float(np.mean([float(x[0]) for x in out])), out[-1][1], mean, None, None, None)
        inner = self._copy_inner({"params": self.local_params(state), "opt": state["opt"], "step": state["step"]})
        losses, aux = [], None
        one = np.float32(1.0)
        g = self.part(jax.tree.leaves(state["params"]), f)
        # tau: the pseudo-gradient of the local parameters tau steps before the round's end (at its
        # start in a shorter round: one inner step at a position a lagging replica left in a warm-up)
        take = max(0, len(batches) - self.delay)
        weight = self.weight(state, f, take, step)
        delta = None
        for h, (batch, w) in enumerate(zip(batches, wheres)):
            if h == take:
                delta = self._delta[f](g, self.part(jax.tree.leaves(inner["params"]), f), weight)
                yield delta
            beat()
            loss, aux, grads = program.grads_of(inner, batch, w)
            inner = program.apply(inner, grads, one)  # (donates the copy: the delta is taken before the next)
            losses.append(loss)
        if delta is None:  # (tau 0: at the round's end)
            delta = self._delta[f](g, self.part(jax.tree.leaves(inner["params"]), f), weight)
            yield delta
        loss = float(np.mean([float(x) for x in losses]))
        return InnerResult(loss, aux, delta, inner["params"], inner["opt"], inner["step"], len(batches))

    def apply(self, state: dict, tagged: tuple[int, list], scale: float, mine: InnerResult | None) -> dict:
        """The outer step of fragment f with the contributors' average; `mine`: this replica's
        inner steps of the round (None in a replay: the state's own inner part stays)."""
        f, avg = tagged
        if f == SYNC:  # a warm-up step: every replica's inner optimizer applies the average, bitwise alike
            inner = {k: state[k] for k in ("params", "opt", "step")}
            update = {"params": jax.tree.unflatten(self.treedef, list(avg))}
            out = {**state, **self.program.apply(inner, update, np.float32(scale))}
            if self.fragments > 1:  # the inner steps start from the global parameters (copies: new buffers)
                out["local"] = self._copy_params(out["params"])
                out["since"] = self._since(np.zeros(self.fragments))
            return out
        leaves = jax.tree.leaves(state["params"])
        g, s = self._outer[f](self.part(leaves, f), state["outer"][f], list(avg), np.float32(scale))
        out = {**state, "params": jax.tree.unflatten(self.treedef, self._replace(leaves, f, g))}
        out["outer"] = [s if k == f else o for k, o in enumerate(state["outer"])]
        if mine is not None:
            out["opt"], out["step"] = mine.opt, mine.step
        if self.fragments > 1:
            local = jax.tree.leaves(mine.local if mine is not None else state["local"])
            local = self._replace(local, f, self._reset[f](self.part(local, f), g))
            out["local"] = jax.tree.unflatten(self.treedef, local)
            # every fragment's count grows by this replica's inner steps (none in a replay), f's restarts
            since = np.asarray(state["since"]) + (mine.steps if mine is not None else 0)
            since[f] = 0
            out["since"] = self._since(since)
        return out

    def warm_up(self) -> None:
        """Compile every fragment's steps before the first round (a compile at the first commit
        would make the peers wait at the next FTAR)."""
        leaves = jax.tree.leaves(self.program.abstract_state()["params"])  # (once: an eval_shape of the init)
        for f in range(self.fragments):
            zeros = [jax.device_put(np.zeros(a.shape, a.dtype), a.sharding) for a in self.part(leaves, f)]
            state = self._outer_init[f](zeros)
            delta = self._delta[f](zeros, zeros, np.float32(1))
            g, _ = self._outer[f](zeros, state, delta, np.float32(1.0))
            if self.fragments > 1:
                self._reset[f](zeros, g)
        if self.warmup:
            self._grads32(self.program.zeros())


def finish_round(steps: Generator[list[jax.Array], None, InnerResult]) -> InnerResult:
    """The rest of a round's inner steps (`OuterSync.inner_steps`, its delta already taken)."""
    try:
        next(steps)
    except StopIteration as done:
        return done.value
    raise RuntimeError("a round's inner steps yielded more than its delta")


def _outer_shapes(
    tx: optax.GradientTransformation,
    leaves: list,
    shardings: list,
    pieces: tuple[tuple[Piece, ...], ...],
    mesh: jax.sharding.Mesh,
    weighted: bool = False,
) -> tuple[list, list]:
    """Each fragment's outer optimizer state (shapes, dtypes, shardings following its pieces') and
    its pieces' shardings (`weighted`: and the weight's)."""
    outer, piece_shardings = [], []
    for ps in pieces:
        templates, sh = piece_templates(leaves, shardings, ps, weight=weighted)
        piece_shardings.append(sh)
        shapes = jax.eval_shape(tx.init, templates[: len(ps)])
        osh = shd.follow_params(shapes, sh[: len(ps)], mesh)
        outer.append(jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h), shapes, osh))
    return outer, piece_shardings


def _wire_bytes(wire_dtype: str, n: int) -> int:
    """The bytes of n elements in FTAR's frames (`ft.wire_dtype`; int8: row-wise, `quant.nbytes`)."""
    return quant.nbytes(n) if wire_dtype == "int8" else n * (2 if wire_dtype == "bfloat16" else 4)


def _pseudo_gradient(take: Callable[[list], list], weighted: bool) -> Callable:
    """A fragment's pseudo-gradient global - local in float32, from the touched leaves of both;
    `weighted` (streaming): each piece x the contributor's weight w, and w appended (`OuterSync.weight`)."""

    def delta(g, loc, w):
        out = [(a - b).astype(jnp.float32) for a, b in zip(take(g), take(loc))]
        return [x * w for x in out] + [jnp.reshape(w, (1,))] if weighted else out

    return delta


def _restart(alpha: float):
    """A fragment's piece of local parameters after its outer step, from (local, new global):
    torchft's lerp, alpha x local + (1 - alpha) x global in float32; at alpha 0 a copy of the
    global one (new buffers), bitwise, as before alpha existed."""
    if alpha == 0:
        return lambda local, g: jnp.copy(g)

    def mix(local, g):
        return (local.astype(jnp.float32) * alpha + g.astype(jnp.float32) * (1 - alpha)).astype(local.dtype)

    return mix


def _float32_leaves(shardings: list):
    """An update's parameter leaves as float32, in these shardings: a warm-up step's gradient laid out
    as its reducer takes it (whole leaves in order, the parameters' shardings)."""
    return jax.jit(lambda g: [x.astype(jnp.float32) for x in jax.tree.leaves(g["params"])], out_shardings=shardings)


class RoundStream:
    """A replica's data stream in rounds: position p is the `inner` batches p*inner .. p*inner +
    inner - 1 of the stream beneath (after `warmup` positions of one batch each: `round_span`), so
    exactly-once holds per round as it does per batch (a round's batches are a pure function of
    its position). `batch_id(p)`: the round's own id, in the same interleaving as a batch's
    (p * replicas + replica)."""

    def __init__(self, stream: BatchStream, inner: int, warmup: int = 0) -> None:
        self.stream, self.inner, self.warmup = stream, inner, warmup
        self.replica, self.replicas = stream.replica, stream.replicas
        self.fingerprint = f"{stream.fingerprint}|rounds of {inner}" + (f" after {warmup} of 1" if warmup else "")

    def span(self, position: int) -> tuple[int, int]:
        return round_span(position, self.inner, self.warmup)

    def batch_id(self, position: int) -> int:
        return position * self.replicas + self.replica

    def batch_ids(self, position: int) -> list[int]:
        """The ids of the batches beneath round `position`."""
        first, n = self.span(position)
        return [self.stream.batch_id(first + h) for h in range(n)]

    def batch(self, position: int) -> list:
        first, n = self.span(position)
        return [self.stream.batch(first + h) for h in range(n)]


class Tagged:
    """An averaged fragment and its index (the replay must know which fragment an update is)."""

    __slots__ = ("fragment", "update")

    def __init__(self, fragment: int, update: Averaged | np.ndarray) -> None:
        self.fragment, self.update = fragment, update


class HeldReducer(Reducer, Protocol):
    """A reducer whose buffers can go before it is closed (the warm-up's, once the rounds start)."""

    def release(self) -> None: ...


class FragmentReducer:
    """One reducer per fragment (FTAR over that fragment's leaves, buffers of its own), the round's
    chosen by the quorum's step. What the replay keeps is the fragment's flat average with its
    index appended (one float32: exact below 2**24; `SYNC` for a warm-up step's gradient).

    With a warm-up (`warmup` synchronous steps, `inner` steps per round after it), a replica that
    missed warm-up steps reaches the rounds with positions still below the warm-up's end, whose
    rounds have one inner step (`round_span`): its delta then counts by its inner steps in the
    round's mean (`weight`), as a warm-up step's mean gradient counts by its batches. Streaming
    rounds skip `weight`: their deltas carry their own (`OuterSync.weight`)."""

    def __init__(
        self,
        reducers: Sequence[Reducer],
        fragments: int,
        inner: int = 1,
        warmup: int = 0,
        sync: HeldReducer | None = None,
    ) -> None:
        self.reducers, self.fragments, self.inner, self.warmup = reducers, fragments, inner, warmup
        # a warm-up step's: over every parameter, whole leaves in order (the one fragment's, unless streaming)
        self.sync = sync if sync is not None else reducers[0]
        self._held = sync  # (a reducer of its own: its buffers go once the warm-up is over)
        self._last = 0

    @property
    def phases(self):
        return getattr(self._reducer(self._last), "phases", None)

    def average(self, q: QuorumResult, grads: list[jax.Array] | None) -> Tagged:
        f = self._last = SYNC if q.step < self.warmup else q.step % self.fragments
        if f != SYNC and self._held is not None:
            # the warm-up is over (a quorum's step does not go back in a process): its reducer's
            # buffers, an update's size, go; `tree` of a kept warm-up average does not need them
            held, self._held = self._held, None
            held.release()
        # streaming: a round's delta carries its own weight (`OuterSync.weight`: its inner steps)
        weigh = f == SYNC or self.fragments == 1
        return Tagged(f, self._reducer(f).average(q, self.weight(q, grads) if weigh else grads))

    def weight(self, q: QuorumResult, grads: list[jax.Array] | None) -> list[jax.Array] | None:
        """This contributor's delta scaled so that FTAR's mean over the C contributors is the mean
        weighted by inner steps: x n_mine * C / (the contributors' inner steps). Untouched (the same
        bits) when all took the same number, as they do unless one missed warm-up steps."""
        if grads is None or not self.warmup:
            return grads
        steps = [round_span(p.data_position, self.inner, self.warmup)[1] for p in q.participants if not p.healing]
        mine = round_span(q.participants[q.rank].data_position, self.inner, self.warmup)[1]
        if min(steps) == max(steps):
            return grads
        scale = np.float32(mine * len(steps) / sum(steps))
        return [x * scale for x in grads]

    def _reducer(self, f: int) -> Reducer:
        """Fragment f's reducer, or a warm-up step's (`SYNC`)."""
        return self.sync if f == SYNC else self.reducers[f]

    def tree(self, update: Tagged | np.ndarray) -> tuple[int, list[jax.Array]]:
        if isinstance(update, Tagged):
            return update.fragment, self._reducer(update.fragment).tree(update.update)
        f = int(update[-1])
        r = self._reducer(f)
        return f, r.tree(update[:-1].astype(_flat_dtype(r)))

    def detach(self, update: Tagged) -> np.ndarray:
        flat = np.asarray(self._reducer(update.fragment).detach(update.update), np.float32).reshape(-1)
        return np.append(flat, np.float32(update.fragment))

    def close(self) -> None:
        for r in {id(r): r for r in [*self.reducers, self.sync]}.values():
            r.close()


def _flat_dtype(reducer: Reducer) -> np.dtype:
    """The dtype of a reducer's flat buffers (FTAR's: ft.grad_dtype)."""
    flat = getattr(reducer, "flat", None)
    return np.dtype(flat.dtype) if flat is not None else np.dtype(np.float32)
