"""Fault injection inside a replica process: `--die-at STEP:PHASE` SIGKILLs this process at that
point of that step (the launcher passes it to a replica's first incarnation only); `--hang-at
STEP:PHASE` blocks the training thread there forever while the rest of the process (its
heartbeats) lives on: a hung driver call, as the progress watchdog must catch; `--flip-bit-at STEP`
flips one bit of one parameter right after this replica applies that step's update: a silent
divergence (a bad memory bit, a nondeterministic kernel), which the coordinator must find from
the replicas' digests and heal.

If the replica never runs that phase of exactly that step (it joined the job late and healed
past it, say), it dies the first time it reaches that phase at a later step: a requested fault
always happens."""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import jax

# No JAX at import: the launcher reads PHASES and parses the flags here, and a launcher process
# that imported JAX for it spent ~1.2 s of CPU doing so at every start.

PHASES = ("forward", "ftar", "commit", "catchup", "eval")  # eval: during an evaluation (eval.every)


def parse_step_phase(text: str, flag: str) -> tuple[int, str]:
    """`STEP[:PHASE]` -> (step, phase): STEP >= 1, PHASE in PHASES (default forward). ValueError
    naming `flag` otherwise."""
    step, _, phase = text.partition(":")
    phase = phase or "forward"
    if not (step.isascii() and step.isdigit()) or int(step) < 1 or phase not in PHASES:
        raise ValueError(f"{flag}: expected STEP[:PHASE] with STEP >= 1 and PHASE in {'|'.join(PHASES)}, got {text!r}")
    return int(step), phase


def parse_die_at(text: str | None, flag: str = "--die-at") -> tuple[int, str] | None:
    """`--die-at` / `--hang-at`: STEP[:PHASE], or None when not given."""
    return parse_step_phase(text, flag) if text else None


class InjectedFaults:
    """The faults a replica process injects into itself (`--die-at`, `--hang-at`), at their points."""

    def __init__(
        self, die_at: tuple[int, str] | None, hang_at: tuple[int, str] | None = None, flip_at: int | None = None
    ):
        self.die_at = die_at
        self.hang_at = hang_at
        self.flip_at = flip_at

    def point(self, step: int, phase: str) -> None:
        """Called at each phase of step `step` (1-based: the step being computed)."""
        if self.die_at is not None and phase == self.die_at[1] and step >= self.die_at[0]:
            print(f"fault injection: SIGKILL at step {step} phase {phase}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.hang_at is not None and phase == self.hang_at[1] and step >= self.hang_at[0]:
            print(f"fault injection: training thread hangs at step {step} phase {phase}", file=sys.stderr, flush=True)
            threading.Event().wait()  # forever: only the process's end ends it

    def corrupt(self, step: int, state: dict) -> dict:
        """Called with the state after each applied step `step`, on every host of the replica (the
        flip is one computation over the replica's mesh): `--flip-bit-at` flips the lowest bit of
        the first parameter's first element, once."""
        if self.flip_at is None or step < self.flip_at:
            return state
        self.flip_at = None
        print(f"fault injection: one bit of the parameters flipped after step {step}", file=sys.stderr, flush=True)
        import jax

        leaves, treedef = jax.tree.flatten(state["params"])
        leaves[0] = _flip_first_bit(leaves[0])
        return {**state, "params": jax.tree.unflatten(treedef, leaves)}


def parse_flip_at(text: str | None) -> int | None:
    """`--flip-bit-at STEP` (STEP >= 1), or None when not given; ValueError naming the flag."""
    if text is None:
        return None
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise ValueError(f"--flip-bit-at: expected STEP >= 1, got {text!r}")
    return int(text)


def _flip_first_bit(x: jax.Array) -> jax.Array:
    import jax
    import jax.numpy as jnp

    bits = jnp.dtype(f"uint{8 * x.dtype.itemsize}")

    def flip(a):
        first = (0,) * a.ndim
        flipped = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(a[first], bits) ^ 1, a.dtype)
        return a.at[first].set(flipped)

    return jax.jit(flip, out_shardings=x.sharding)(x)
