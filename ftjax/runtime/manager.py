"""`FaultTolerance`: the one owner of a replica's step protocol, for any training loop.

A training loop calls a few methods per step (docs/design/index.md, "The API"):

    ft.ask()                                   # the next quorum is requested (once, then by commit)
    info = ft.begin()                          # the quorum: heals, installs a snapshot, serves peers
    grads = my_grads(ft.state, batch_at(info.data_position)) if info.contributes else None
    update, error = ft.average(info.quorum, grads)
    if ft.vote(info.quorum, error):            # every host of the replica averaged: commit
        ft.commit(info.quorum, update)         # applies it (or keeps it for the replay while healing)

and owns nothing else: the state lives here (`ft.state`, `ft.step`, `ft.data_position`), because a
step that heals replaces it with a peer's snapshot and replays the updates averaged meanwhile
through the loop's `apply(state, update, scale)`. The built-in loop (ftjax/runtime/trainer.py) is one user;
examples/own_loop.py is another, in fifty lines. `FaultTolerance.join` assembles one for a script
from a config, standalone or as a member of a job.

Everything between replicas (quorums, FTAR, votes, snapshots) is `StepProtocol`'s (ftjax/runtime/protocol.py);
this object decides what the quorum means for this replica's state and data position.

A script gets its own subclass (`ftjax.FaultTolerance`, ftjax/runtime/script.py), which adds the
records a launcher reads; this module knows nothing of it, nor of how a protocol is assembled
(ftjax/runtime/replica.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import jax

from ftjax.coordinator.types import QuorumResult
from ftjax.program.digest import state_checksum, state_digest
from ftjax.runs.events import ReplicaEvent
from ftjax.runtime.catchup import FetchResult
from ftjax.runtime.protocol import EventLog, PyTree, StepProtocol

# `apply(state, update, lr_scale) -> state`: the loop's update of its state (also in the replay)
Apply = Callable[[PyTree, PyTree, float], PyTree]


class JobStateLost(RuntimeError):
    """The job has committed steps but no live peer and no durable checkpoint holds its state."""


class Left(Exception):
    """The replica leaves the job at this step boundary (the message says why)."""


class Finished(Exception):
    """The job finished at step `args[0]` without this replica, and nobody alive can heal it."""


@dataclass(frozen=True)
class StepInfo:
    """What the quorum says of the next step, for the loop."""

    quorum: QuorumResult
    step: int  # the step being trained (1-based: the quorum's step + 1)
    data_position: int  # the position of this replica's stream to compute
    contributes: bool  # compute gradients (False: this replica heals and relays zeros)
    no_state: bool  # nobody in the quorum has state: the loop initializes it (`init_state`)
    past_end: bool  # the job trained every step; this replica only catches up
    catching_up: bool  # this replica is behind: a snapshot is on its way (it contributes nothing)


class FaultTolerance:
    """The one owner of a replica's step protocol, whatever loop drives it.

    It owns the replica's state (`state`, `step`, `data_position`: a heal replaces them with a
    peer's snapshot and replays the updates averaged meanwhile), the per-step digest, and what a
    quorum means for them (`begin`). It holds the `StepProtocol` and is the loop's only way to it:
    a loop calls these methods and reads these attributes, never `ft.protocol` (the layout test
    checks it), so a few methods only pass a call on (`average`, `request_leave`, `leave_now`,
    `forget_positions`, `close`, `step_fields`, `phase_fields`) because the loop must not hold
    the protocol. It must not touch the loop's model, optimizer, data stream, checkpoints or
    records: it reaches the state through `apply` and writes events only.

    `apply(state, update_tree, lr_scale) -> state` applies an averaged update (also in the replay);
    `meta()` is what a snapshot served to a peer carries beside the state; `constant`: the constant
    global batch (stream position = step); `after_apply`: a test hook (fault injection)."""

    def __init__(
        self,
        protocol: StepProtocol,
        *,
        apply: Apply,
        abstract_state: PyTree,
        log: EventLog,
        meta: Callable[[], dict] | None = None,
        constant: bool = False,
        digest_every: int = 1,
        after_apply: Callable[[int, PyTree], PyTree] | None = None,
        batch_id: Callable[[int], int] = lambda p: p,
        steps: int = 1 << 62,
        digest_view: Callable[[PyTree], PyTree] | None = None,
    ):
        self.protocol, self.apply, self.abstract, self.log = protocol, apply, abstract_state, log
        self.meta = meta or (lambda: {"step": self.step, "data_position": self.data_position})
        self.constant, self.digest_every = constant, digest_every
        self.after_apply = after_apply or (lambda step, state: state)
        self.batch_id, self.steps = batch_id, steps
        # what of the state the replicas hold in common, which the digests cover (DiLoCo: not the inner state)
        self.digest_view = digest_view or (lambda state: state)
        self.state: PyTree = None
        self.step = 0  # steps committed (the state's step when it has one)
        self.data_position = 0  # next batch of this replica's own stream
        self.job_step = 0  # the highest step of a quorum with state this process has seen
        self.digest = ""  # the latest digest of the state (ft.digest_every; `state_checksum`)
        self.last_digest = ""  # the digest the latest commit computed ("" if none)
        self.last_digest_s = 0.0  # the seconds it took (the update it follows excluded)
        self.state_lost_since: float | None = None  # since when no quorum had a member with state

    @property
    def has_state(self) -> bool:
        """The replica holds a state (none before an init, a restore or a heal installs one)."""
        return self.state is not None

    @property
    def incarnation(self) -> str:
        """This process's incarnation of the replica (new at each start)."""
        return self.protocol.incarnation

    @property
    def has_peers(self) -> bool:
        """A member of a job (a standalone run has nobody to serve or drain for)."""
        return self.protocol.has_peers

    @property
    def healing(self) -> bool:
        """A catch-up is under way (the replica computes nothing of its own meanwhile)."""
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
        assert q is not None  # (an agreement without a quorum is a leave or the job's end)
        catching_up = False if q.no_state else self._follow(q, agreement.install)
        contributes = not q.no_state and not q.healing and self.has_state
        return StepInfo(q, q.step + 1, self.data_position, contributes, q.no_state, q.step >= self.steps, catching_up)

    def init_state(self, state: PyTree, step: int = 0, data_position: int = 0) -> None:
        """The loop's state for a quorum without state (durable checkpoint, or an init at job start)."""
        self.state, self.step, self.data_position = state, step, data_position

    def wait_for_a_source(self, timeout_s: float, replica_id: str) -> None:
        """A quorum without state after the job has trained (`job_step` > 0): seed weights would
        silently restart training, so the loop asks again and waits for a peer that holds the job's
        state; JobStateLost once none has for `timeout_s`."""
        now = time.monotonic()
        if self.state_lost_since is None:
            self.state_lost_since = now
            self.log.event(
                ReplicaEvent.STATE_UNAVAILABLE,
                job_step=self.job_step,
                reason="no participant has state and there is no durable checkpoint",
            )
        if now - self.state_lost_since > timeout_s:
            raise JobStateLost(
                f"replica {replica_id}: the job was at step {self.job_step}, but for {timeout_s:.0f} s no live "
                "peer held its state and there is no durable checkpoint (checkpoint.every); not restarting "
                "the job from the seed"
            )
        time.sleep(0.05)

    def average(self, q: QuorumResult, update: PyTree | None) -> tuple[PyTree, dict | None]:
        """(the average over the quorum's contributors, None), or (None, the failure)."""
        return self.protocol.average(q, update)

    def vote(self, q: QuorumResult, error: dict | None) -> bool:
        """The replica's two-phase commit: True if every host averaged; otherwise the step is
        discarded, the peers at fault reported, and the next quorum requested."""
        if self.protocol.vote(q, error):
            return True
        self.ask()
        return False

    def commit(self, q: QuorumResult, update: PyTree, *, scale: float = 1.0, contributed: bool = True) -> bool:
        """The step went through: apply the average (or keep it for the replay while healing),
        move the data position past the batch trained, request the next quorum. Returns whether
        this replica applied it."""
        applied = self.has_state and self.step == q.step
        self.protocol.committed(q, applied)
        digest = ""
        if applied:
            self.state = self.after_apply(self.step + 1, self.apply(self.state, self.protocol.tree(update), scale))
            self.step += 1
            if contributed:
                self.data_position += 1
            if self.digest_every and self.step % self.digest_every == 0:
                digest = self.digest = self._checksum()  # (the coordinator compares them)
        else:  # healing: keep the update for the replay
            self.protocol.keep(q, update, scale)
        self.last_digest = digest
        self.ask(digest)  # the next quorum is requested while the loop finishes this step
        return applied

    def _checksum(self) -> str:
        """The per-step digest of the state (`state_checksum`: on the devices, a few bytes per leaf
        to the host), timed apart from the update it follows (`last_digest_s`)."""
        jax.block_until_ready(self.state)
        began = time.perf_counter()
        digest = state_checksum(self.digest_view(self.state))
        self.last_digest_s = time.perf_counter() - began
        return digest

    # --- what a quorum means for this replica ----------------------------------------------------
    def _follow(self, q: QuorumResult, install: FetchResult | None) -> bool:
        """Returns whether this replica is catching up."""
        self.job_step, self.state_lost_since = max(self.job_step, q.step), None
        if q.majority_digest and self.has_state:  # our state is not the one the quorum kept: heal
            self.log.event(
                ReplicaEvent.DIVERGED,
                step=self.step,
                digest=self.digest,
                majority_digest=q.majority_digest,
                source=q.heal_source,
            )
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
            self.log.event(
                ReplicaEvent.BATCHES_COMMITTED_BY_PEERS,
                batch_ids=[self.batch_id(p) for p in range(self.data_position, position)],
            )
            self.data_position = position
        elif position < self.data_position:
            self.log.event(ReplicaEvent.POSITION_KEPT, position=self.data_position, coordinator_said=position)

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
            assert q is not None  # (an agreement is a leave or a quorum)
            self.protocol.serve(q, self.state, self.step, self.meta())
            everyone = len(q.participants) >= replicas and not any(p.healing for p in q.participants)
            # the leader's clock decides: every host leaves together
            if self.protocol.leaders_word(everyone or time.monotonic() > deadline):
                if not everyone:
                    self.log.event(
                        ReplicaEvent.DRAIN_TIMEOUT,
                        participants=len(q.participants),
                        healing=[p.replica_id for p in q.participants if p.healing],
                    )
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
        """A whole-job restart from a durable checkpoint: its data positions rule, not the protocol's."""
        self.protocol.forget_positions()

    @property
    def commit_failures(self) -> int:
        """The steps this process's votes discarded (the summary's and each record's count)."""
        return self.protocol.total_commit_failures

    def step_fields(self) -> dict[str, float]:
        """What the step's record adds from the protocol (the wait for the coordinator's decision)."""
        return self.protocol.step_fields()

    def phase_fields(self) -> dict[str, float]:
        """What the step's record adds from the average: FTAR's phases (d2h, ring, h2d, overlap), if any."""
        return self.protocol.phase_fields()

    def close(self) -> None:
        """Close the protocol's connections (coordinator, FTAR, catch-up) and drop its replay buffer."""
        self.protocol.close()


def final_digests(state: PyTree) -> dict:
    """What a replica's summary records of its final state: `param_digest`, the sha256 of every
    byte (`state_digest`: what the launcher compares between replicas), the seconds it took, and
    `state_checksum`, the per-step digest of the same state (its last step record's)."""
    began = time.perf_counter()
    digest = state_digest(state)
    return {
        "param_digest": digest,
        "param_digest_s": time.perf_counter() - began,
        "state_checksum": state_checksum(state),
    }
