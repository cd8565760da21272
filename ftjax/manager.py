"""`FaultTolerance`: the one owner of a replica's step protocol, for any training loop.

A training loop calls a few methods per step (docs/design.md, "The API"):

    ft.ask()                                   # the next quorum is requested (once, then by commit)
    info = ft.begin()                          # the quorum: heals, installs a snapshot, serves peers
    grads = my_grads(ft.state, batch_at(info.data_position)) if info.contributes else None
    update, error = ft.average(info.quorum, grads)
    if ft.vote(info.quorum, error):            # every host of the replica averaged: commit
        ft.commit(info.quorum, update)         # applies it (or keeps it for the replay while healing)

and owns nothing else: the state lives here (`ft.state`, `ft.step`, `ft.data_position`), because a
step that heals replaces it with a peer's snapshot and replays the updates averaged meanwhile
through the loop's `apply(state, update, scale)`. The built-in loop (ftjax/trainer.py) is one user;
examples/own_loop.py is another, in fifty lines. `FaultTolerance.join` assembles one for a script
from a config, standalone or as a member of a job.

Everything between replicas (quorums, FTAR, votes, snapshots) is `StepProtocol`'s (ftjax/protocol.py);
this object decides what the quorum means for this replica's state and data position.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ftjax.coordinator.client import QuorumResult
from ftjax.digest import state_digest
from ftjax.events import ReplicaEvent as E
from ftjax.protocol import StepProtocol


class Left(Exception):
    """The replica leaves the job at this step boundary (the message says why)."""


class Finished(Exception):
    """The job finished at step `args[0]` without this replica, and nobody alive can heal it."""


@dataclass(frozen=True)
class StepInfo:
    """What the quorum says of the next step, for the loop."""

    quorum: QuorumResult
    step: int            # the step being trained (1-based: the quorum's step + 1)
    data_position: int   # the position of this replica's stream to compute
    contributes: bool    # compute gradients (False: this replica heals and relays zeros)
    no_state: bool       # nobody in the quorum has state: the loop initializes it (`init_state`)
    past_end: bool       # the job trained every step; this replica only catches up
    catching_up: bool    # this replica is behind: a snapshot is on its way (it contributes nothing)


class FaultTolerance:
    """`apply(state, update_tree, lr_scale) -> state` applies an averaged update (also in the replay);
    `meta()` is what a snapshot served to a peer carries beside the state; `constant`: the constant
    global batch (stream position = step); `after_apply`: a test hook (fault injection)."""

    def __init__(self, protocol: StepProtocol, *, apply: Callable[[Any, Any, float], Any], abstract_state: Any,
                 log: Any, meta: Callable[[], dict] | None = None, constant: bool = False, digest_every: int = 1,
                 after_apply: Callable[[int, Any], Any] | None = None, batch_id: Callable[[int], int] = lambda p: p,
                 steps: int = 1 << 62):
        self.protocol, self.apply, self.abstract, self.log = protocol, apply, abstract_state, log
        self.meta = meta or (lambda: {"step": self.step, "data_position": self.data_position})
        self.constant, self.digest_every = constant, digest_every
        self.after_apply = after_apply or (lambda step, state: state)
        self.batch_id, self.steps = batch_id, steps
        self.state: Any = None
        self.step = 0            # steps committed (the state's step when it has one)
        self.data_position = 0   # next batch of this replica's own stream
        self.job_step = 0        # the highest step of a quorum with state this process has seen
        self.digest = ""         # the latest digest of the state (ft.digest_every)
        self.last_digest = ""    # the digest the latest commit computed ("" if none)

    @property
    def has_state(self) -> bool:
        return self.state is not None

    @property
    def incarnation(self) -> str:
        return self.protocol.incarnation

    @property
    def has_peers(self) -> bool:
        """A member of a job (a standalone run has nobody to serve or drain for)."""
        return self.protocol.transport is not None

    @property
    def healing(self) -> bool:
        return self.protocol.heal_started is not None

    # --- the step ---------------------------------------------------------------------------------
    def ask(self, digest: str = "") -> None:
        """Request the quorum of the next step (the leader; answered in `begin`)."""
        self.protocol.ask(self.step, self.data_position, self.has_state, digest)

    def begin(self) -> StepInfo:
        """Wait for the quorum, and take in what it says of this replica: a snapshot to install, a
        heal to start, a peer to serve, where the data stream resumes. Raises Left or Finished."""
        agreement = self.protocol.agree()
        if agreement.finished is not None:
            raise Finished(agreement.finished, agreement.leave)
        if agreement.leave is not None:
            raise Left(agreement.leave)
        q = agreement.quorum
        catching_up = False if q.no_state else self._follow(q, agreement.install)
        contributes = not q.no_state and not q.healing and self.has_state
        return StepInfo(q, q.step + 1, self.data_position, contributes, q.no_state, q.step >= self.steps, catching_up)

    def init_state(self, state: Any, step: int = 0, data_position: int = 0) -> None:
        """The loop's state for a quorum without state (durable checkpoint, or an init at job start)."""
        self.state, self.step, self.data_position = state, step, data_position

    def average(self, q: QuorumResult, update: Any | None) -> tuple[Any, dict | None]:
        """(the average over the quorum's contributors, None), or (None, the failure)."""
        return self.protocol.average(q, update)

    def vote(self, q: QuorumResult, error: dict | None) -> bool:
        """The replica's two-phase commit: True if every host averaged; otherwise the step is
        discarded, the peers at fault reported, and the next quorum requested."""
        if self.protocol.vote(q, error):
            return True
        self.ask()
        return False

    def commit(self, q: QuorumResult, update: Any, *, scale: float = 1.0, contributed: bool = True) -> bool:
        """The step went through: apply the average (or keep it for the replay while healing),
        move the data position past the batch trained, request the next quorum. Returns whether
        this replica applied it."""
        applied = self.has_state and self.step == q.step
        self.protocol.committed(q, applied)
        digest = ""
        if applied:
            self.state = self.after_apply(self.step + 1, self.apply(self.state, self.protocol.reducer.tree(update), scale))
            self.step += 1
            if contributed:
                self.data_position += 1
            if self.digest_every and self.step % self.digest_every == 0:
                digest = self.digest = state_digest(self.state)  # (the coordinator compares them)
        else:  # healing: keep the update for the replay
            self.protocol.keep(q, update, scale)
        self.last_digest = digest
        self.ask(digest)  # the next quorum is requested while the loop finishes this step
        return applied

    # --- what a quorum means for this replica ----------------------------------------------------
    def _follow(self, q: QuorumResult, install: Any) -> bool:
        """Returns whether this replica is catching up."""
        self.job_step = max(self.job_step, q.step)
        if q.majority_digest and self.has_state:  # our state is not the one the quorum kept: heal
            self.log.event(E.DIVERGED, step=self.step, digest=self.digest, majority_digest=q.majority_digest,
                           source=q.heal_source)
            self.state = None  # (from here on, the heal of a restarted replica)
        if install is not None:  # replaces a stale state, if we kept one
            installed = self.protocol.install(install, q, self.abstract, self.apply)
            if installed is not None:
                self.state, self.step = installed
        catching_up = q.healing and not (self.has_state and self.step == q.step)  # (not if just installed)
        if catching_up:
            self.protocol.healing(q, self.step if self.has_state else None)
        else:
            self.protocol.up_to_date(self.step)
            if self.protocol.transport is not None:
                self.protocol.serve(q, self.state, self.step, self.meta())
        self._adopt_position(q)
        return catching_up

    def _adopt_position(self, q: QuorumResult) -> None:
        """Where our stream resumes: the job's record, but never below a batch that we trained in a
        committed step (a coordinator that lost its record may say less: the batch would repeat).
        With a constant global batch every stream is at the step: step n trains batch n of each."""
        if self.constant:
            self.data_position = self.step
            return
        position = q.data_position
        if position > self.data_position:
            self.log.event(E.BATCHES_COMMITTED_BY_PEERS,
                           batch_ids=[self.batch_id(p) for p in range(self.data_position, position)])
            self.data_position = position
        elif position < self.data_position:
            self.log.event(E.POSITION_KEPT, position=self.data_position, coordinator_said=position)

    # --- the end ----------------------------------------------------------------------------------
    def drain(self, replicas: int, timeout_s: float) -> None:
        """Training is over for this replica, maybe not for a peer that is restarting or catching
        up: keep answering quorums at the final step and serving snapshots until every replica of
        the job holds the final state, or `timeout_s` passes. Without this a replica killed near
        the end would find nobody to catch up from."""
        deadline = time.monotonic() + timeout_s
        while True:
            agreement = self.protocol.agree()
            if agreement.leave is not None:
                raise Left(agreement.leave)
            q = agreement.quorum
            if self.protocol.transport is not None:
                self.protocol.serve(q, self.state, self.step, self.meta())
            everyone = len(q.participants) >= replicas and not any(p.healing for p in q.participants)
            stop = everyone or time.monotonic() > deadline
            if self.protocol.group.hosts > 1:  # the leader's clock decides: every host leaves together
                stop = self.protocol.group.broadcast_bytes(b"1" if stop else b"0") == b"1"
            if stop:
                if not everyone:
                    self.log.event(E.DRAIN_TIMEOUT, participants=len(q.participants),
                                   healing=[p.replica_id for p in q.participants if p.healing])
                return
            time.sleep(0.05)
            self.ask()

    def request_leave(self, reason: str) -> None:
        """Leave the job at the next step boundary (a signal handler may call it): the leader asks
        no further quorum, and tells its hosts with the next step's agreement; nobody's step fails."""
        self.protocol.leaving = reason

    def leave_now(self, reason: str) -> None:
        """This process leaves the job now (a watchdog's verdict): the coordinator drops it at once."""
        self.protocol.leave(reason)

    def forget_positions(self) -> None:
        self.protocol.forget_positions()

    @property
    def commit_failures(self) -> int:
        return self.protocol.total_commit_failures

    def close(self) -> None:
        self.protocol.close()
