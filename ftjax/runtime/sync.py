"""How replicas synchronize (`ft.sync`): one `Sync` strategy per mode, which the trainer calls.

A step of the step protocol is one *round* of a strategy: the trainer asks the strategy what the
round computes (`compute`), hands what it returns to FTAR, and has the strategy apply the average
(`apply`); the strategy also says what the state holds (`abstract_state`, `init`), what of it the
replicas hold bitwise equal (`digest_view`), how the data stream goes (`stream`, `place`) and what
a round's record adds (`record`). Every-step sync averages gradients of one batch
(docs/design/step.md); DiLoCo averages pseudo-gradients of rounds of inner steps, streaming DiLoCo
one fragment per round, its exchange overlapped with the round's last tau inner steps
(docs/design/replicas.md, ftjax/runtime/diloco.py). A new mode is one new class here.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Protocol, TypeAlias

import jax
import numpy as np
import optax

from ftjax.base.batches import RowSpan
from ftjax.base.trees import PyTree
from ftjax.config import Config
from ftjax.program.data import BatchStream
from ftjax.program.optim import schedule
from ftjax.program.step import ReplicaProgram, State, device_batch, where
from ftjax.runtime.diloco import InnerResult, OuterSync, RoundStream, finish_round, round_span

Stream = BatchStream | RoundStream  # a replica's stream: batches, or (DiLoCo) rounds of batches
Batch: TypeAlias = PyTree  # a batch on the host or the devices: an array, or a pytree of them (the task's)


@dataclass
class Computed:
    """What a replica computed of a round, before the quorum's average: every-step sync, the
    gradients of its share of the step; DiLoCo, its inner steps (`grads`: the fragment's delta)."""

    loss: float | jax.Array  # the mean loss of the rows computed
    grads: optax.Updates
    position: int  # the data position they are for
    work: tuple[RowSpan, ...]  # the rows computed: (stream, first row, end row)
    loss_sums: list[list[float]] | None = None  # constant batch: [stream, first row, end row, sum of row losses]
    own: Computed | None = None  # constant batch: the own batch's `grads`, which this share adds to
    aux: dict[str, jax.Array] | None = None  # the task's auxiliary metrics, means over the own batch
    inner: InnerResult | None = None  # DiLoCo: the round's inner steps (`grads`: the fragment's pseudo-gradient)
    step: int = -1  # the committed step the round started from (its state; DiLoCo: its fragment)
    reused: bool = False  # DiLoCo: the inner steps of a discarded attempt of the round, not computed again
    # the rest of the round, still to compute once `grads` is out (streaming DiLoCo with tau >= 1:
    # the last tau inner steps, which run while `grads` is averaged); None: nothing left
    rest: Callable[[], None] | None = None
    overlap_s: float = 0.0  # seconds the round's exchange ran while its rest computed (the trainer's `_exchange`)
    rest_s: float = 0.0  # seconds the rest took (beside the exchange)


class Loop(Protocol):
    """What a strategy reads of the trainer's loop (ftjax/runtime/trainer.py)."""

    state: State
    step: int
    position: int
    own: int
    stream: Stream

    def own_batch(self, position: int) -> Batch: ...
    def gradients(self, work: tuple[RowSpan, ...], done: Computed | None) -> Computed: ...
    def beat(self) -> None: ...


class Sync(Protocol):
    """A synchronization mode: what a round computes, averages and applies, and the state around it.
    The trainer owns the loop, the state and the data position; a strategy owns the arithmetic of a
    round and touches neither the protocol nor the trainer's fields."""

    def stream(self, stream: BatchStream) -> Stream:
        """The data stream a position of which one round trains."""

    def place(self, program: ReplicaProgram, batch: Batch | list[Batch]) -> Batch | list[Batch]:
        """A position's host batch (batches, for a round) on the devices."""

    def abstract_state(self) -> State:
        """The state's shapes, dtypes and shardings (a restore's and a snapshot's template)."""

    def init(self, state: State) -> State:
        """The strategy's state of a fresh program state (seed, or loaded parameters)."""

    def digest_view(self, state: State) -> State:
        """What of the state every replica holds bitwise equal (what the digests cover)."""

    def compute(self, loop: Loop, work: tuple[RowSpan, ...], done: Computed | None) -> Computed:
        """This replica's part of the round after the loop's committed step: what FTAR averages."""

    def stale(self, computed: Computed, step: int) -> bool:
        """Whether `computed` (of this position) must be computed again at committed step `step`."""

    def retry(self, computed: Computed) -> Computed | None:
        """What a discarded round keeps for its retry (None: computed again)."""

    def apply(self, state: State, update: optax.Updates, scale: float, mine: Computed | None) -> State:
        """The state after the round's average (`mine`: this replica's part, None in a replay)."""

    def optimizer_steps(self, computed: Computed) -> int:
        """The optimizer steps this replica's batches of the round went through."""

    def record(self, step: int, computed: Computed | None) -> dict[str, int | bool | float]:
        """The round's fields of the step record after committed step `step`."""

    def learning_rates(self) -> np.ndarray | None:
        """The learning rate of each step's update (index: the step before it), or None."""


class EveryStep:
    """Every-step sync (`ft.sync: every_step`): a round is one batch; its gradients (the share of
    the step this replica computes: the trainer's `gradients`) are averaged and the program's
    optimizer applies the average."""

    def __init__(self, cfg: Config, program: ReplicaProgram) -> None:
        self.cfg, self.program = cfg, program

    def stream(self, stream: BatchStream) -> Stream:
        return stream

    def place(self, program: ReplicaProgram, batch: Batch) -> Batch:
        return device_batch(program, batch)

    def abstract_state(self) -> State:
        return self.program.abstract_state()

    def init(self, state: State) -> State:
        return state

    def digest_view(self, state: State) -> State:
        return state

    def compute(self, loop: Loop, work: tuple[RowSpan, ...], done: Computed | None) -> Computed:
        out = loop.gradients(work, done)
        out.step = loop.step
        return out

    def stale(self, computed: Computed, step: int) -> bool:
        return False  # (a share is recomputed when its position or rows change, as before strategies)

    def retry(self, computed: Computed) -> Computed | None:
        return None

    def apply(self, state: State, update: optax.Updates, scale: float, mine: Computed | None) -> State:
        return self.program.apply(state, update, np.float32(scale))

    def optimizer_steps(self, computed: Computed) -> int:
        return 1

    def record(self, step: int, computed: Computed | None) -> dict[str, int | bool | float]:
        return {}

    def learning_rates(self) -> np.ndarray | None:
        """The config's AdamW learning rate of each step's update, for the step records; None for a
        task's own optimizer (its schedule is not known here)."""
        if self.program.task.optimizer is not None:
            return None
        # One jitted program, not optax's ~20 operations run eagerly (each its own tiny compile and
        # dispatch: 0.25 s of every replica's start against 0.07 s). XLA fuses them, so a value may
        # differ from the optimizer's own by float32 rounding: this is only the records' figure.
        steps = self.cfg.steps
        return np.asarray(jax.jit(jax.vmap(schedule(self.cfg.optim, steps)))(np.arange(steps)), np.float64)


class DiLoCo:
    """DiLoCo (`ft.sync: diloco`): a round is `ft.inner_steps` inner optimizer steps on this
    replica's own batches from the committed state; the replicas average the pseudo-gradients
    (global - local parameters) and an outer optimizer applies the average (`OuterSync`, which
    holds the arithmetic). The stream goes by rounds (`RoundStream`); the shared state is the global
    parameters and the outer state (`OuterSync.shared`); a discarded round keeps its inner steps."""

    def __init__(self, cfg: Config, program: ReplicaProgram) -> None:
        self.outer = OuterSync(cfg, program)
        self.outer.warm_up()

    def stream(self, stream: BatchStream) -> Stream:
        return RoundStream(stream, self.outer.inner, self.outer.warmup)

    def span(self, position: int) -> tuple[int, int]:
        """(the first batch, the number of batches) of the round at `position` (`round_span`)."""
        return round_span(position, self.outer.inner, self.outer.warmup)

    def place(self, program: ReplicaProgram, batch: list[Batch]) -> list[Batch]:
        return [device_batch(program, b) for b in batch]

    def abstract_state(self) -> State:
        return self.outer.abstract_state()

    def init(self, state: State) -> State:
        return self.outer.init(state)

    def digest_view(self, state: State) -> State:
        return self.outer.shared(state)

    def compute(self, loop: Loop, work: tuple[RowSpan, ...], done: Computed | None) -> Computed:
        """The round's inner steps on this replica's own batches, from the committed state."""
        steps = self._inner_steps(loop)
        next(steps)  # (the delta, taken on the way)
        res = finish_round(steps)
        jax.block_until_ready(res.delta)
        return Computed(res.loss, res.delta, loop.position, work, aux=res.aux, inner=res, step=loop.step)

    def _inner_steps(self, loop: Loop) -> Generator[list[jax.Array], None, InnerResult]:
        """The round's inner steps (`OuterSync.inner_steps`: the delta on the way, then the rest)."""
        sync, step = self.outer, loop.step
        first, inner = self.span(loop.position)  # (one batch at a warm-up position)
        wheres = [where(first + h, loop.own, 0) for h in range(inner)]
        return sync.inner_steps(
            loop.state,
            loop.own_batch(loop.position),
            wheres,
            sync.fragment(step),
            loop.beat,
            sync.synchronous(step),
            step=step,
        )

    def stale(self, computed: Computed, step: int) -> bool:
        return computed.step != step  # (computed from another state)

    def retry(self, computed: Computed) -> Computed | None:
        return computed  # (a retried round: its inner steps are a function of the same state and batches)

    def apply(self, state: State, update: optax.Updates, scale: float, mine: Computed | None) -> State:
        """The outer step (`update`: the fragment and its average)."""
        return self.outer.apply(state, update, scale, mine.inner if mine is not None else None)

    def optimizer_steps(self, computed: Computed) -> int:
        return self.span(computed.position)[1]

    def record(self, step: int, computed: Computed | None) -> dict[str, int | bool | float]:
        """The round: its inner steps, the fragment averaged and its bytes, whether retried."""
        reused = bool(computed is not None and computed.reused)
        inner = 0 if computed is None else self.optimizer_steps(computed)
        return {"inner_steps": inner, **self.outer.round_fields(step), "reused_inner": reused}

    def learning_rates(self) -> np.ndarray | None:
        return None  # (a step is an outer round: many inner learning rates)


class StreamingDiLoCo(DiLoCo):
    """Streaming DiLoCo (`ft.sync: streaming_diloco`): one fragment of the parameters per round, in
    turn (`OuterSync.fragment`), each delta weighted by the inner steps it holds. With
    `ft.fragment_sync_delay` tau >= 1 the fragment's delta is taken tau inner steps before the
    round's end, and `compute` returns it with those steps still to run (`Computed.rest`): the
    trainer runs them while the round's exchange (quorum answered, FTAR, vote) goes on, and applies
    the outer step at the round's end, exactly as without the overlap (docs/design/replicas.md)."""

    def compute(self, loop: Loop, work: tuple[RowSpan, ...], done: Computed | None) -> Computed:
        steps = self._inner_steps(loop)
        delta = next(steps)
        out = Computed(float("nan"), delta, loop.position, work, step=loop.step)

        def rest() -> None:
            res = finish_round(steps)
            jax.block_until_ready(res.delta)
            out.loss, out.aux, out.inner, out.rest = res.loss, res.aux, res, None

        out.rest = rest
        if self.outer.delay == 0 or self.outer.synchronous(loop.step):
            rest()  # (nothing to overlap: the delta is the round's end)
        else:
            jax.block_until_ready(delta)  # (FTAR reads it on the host while the rest computes)
        return out

    def record(self, step: int, computed: Computed | None) -> dict[str, int | bool | float]:
        """DiLoCo's fields, `overlap_s`: the seconds the round's exchange ran while its last tau inner
        steps computed (0: nothing overlapped, as with tau 0 or a retried round), and `rest_s`: the
        seconds those steps took."""
        overlap, rest = (computed.overlap_s, computed.rest_s) if computed is not None else (0.0, 0.0)
        return {**super().record(step, computed), "overlap_s": round(overlap, 6), "rest_s": round(rest, 6)}


def make_sync(cfg: Config, program: ReplicaProgram) -> Sync:
    """The strategy of `ft.sync`."""
    kinds: dict[str, type[EveryStep] | type[DiLoCo]] = {
        "every_step": EveryStep,
        "diloco": DiLoCo,
        "streaming_diloco": StreamingDiLoCo,
    }
    return kinds[cfg.ft.sync](cfg, program)
