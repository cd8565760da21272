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
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from ftjax.coordinator.layout import fingerprint
from ftjax.coordinator.types import QuorumResult
from ftjax.program.digest import state_checksum, state_digest
from ftjax.runs.events import ReplicaEvent
from ftjax.runtime.args import RunOptions
from ftjax.runtime.protocol import StepProtocol


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
    """`apply(state, update_tree, lr_scale) -> state` applies an averaged update (also in the replay);
    `meta()` is what a snapshot served to a peer carries beside the state; `constant`: the constant
    global batch (stream position = step); `after_apply`: a test hook (fault injection)."""

    def __init__(
        self,
        protocol: StepProtocol,
        *,
        apply: Callable[[Any, Any, float], Any],
        abstract_state: Any,
        log: Any,
        meta: Callable[[], dict] | None = None,
        constant: bool = False,
        digest_every: int = 1,
        after_apply: Callable[[int, Any], Any] | None = None,
        batch_id: Callable[[int], int] = lambda p: p,
        steps: int = 1 << 62,
        digest_view: Callable[[Any], Any] | None = None,
    ):
        self.protocol, self.apply, self.abstract, self.log = protocol, apply, abstract_state, log
        self.meta = meta or (lambda: {"step": self.step, "data_position": self.data_position})
        self.constant, self.digest_every = constant, digest_every
        self.after_apply = after_apply or (lambda step, state: state)
        self.batch_id, self.steps = batch_id, steps
        # what of the state the replicas hold in common, which the digests cover (DiLoCo: not the inner state)
        self.digest_view = digest_view or (lambda state: state)
        self.state: Any = None
        self.step = 0  # steps committed (the state's step when it has one)
        self.data_position = 0  # next batch of this replica's own stream
        self.job_step = 0  # the highest step of a quorum with state this process has seen
        self.digest = ""  # the latest digest of the state (ft.digest_every; `state_checksum`)
        self.last_digest = ""  # the digest the latest commit computed ("" if none)
        self.last_digest_s = 0.0  # the seconds it took (the update it follows excluded)
        self.state_lost_since: float | None = None  # since when no quorum had a member with state

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
        catching_up = False if q.no_state else self._follow(q, agreement.install)  # type: ignore[arg-type, union-attr]
        contributes = not q.no_state and not q.healing and self.has_state  # type: ignore[union-attr]
        return StepInfo(q, q.step + 1, self.data_position, contributes, q.no_state, q.step >= self.steps, catching_up)  # type: ignore[arg-type, union-attr]

    def init_state(self, state: Any, step: int = 0, data_position: int = 0) -> None:
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
            self.state = self.after_apply(
                self.step + 1, self.apply(self.state, self.protocol.reducer.tree(update), scale)
            )
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
    def _follow(self, q: QuorumResult, install: Any) -> bool:
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
            if self.protocol.transport is not None:
                self.protocol.serve(q, self.state, self.step, self.meta())  # type: ignore[arg-type]
            everyone = len(q.participants) >= replicas and not any(p.healing for p in q.participants)  # type: ignore[union-attr]
            stop = everyone or time.monotonic() > deadline
            if self.protocol.group.hosts > 1:  # the leader's clock decides: every host leaves together
                stop = self.protocol.group.broadcast_bytes(b"1" if stop else b"0") == b"1"
            if stop:
                if not everyone:
                    self.log.event(
                        ReplicaEvent.DRAIN_TIMEOUT,
                        participants=len(q.participants),  # type: ignore[union-attr]
                        healing=[p.replica_id for p in q.participants if p.healing],  # type: ignore[union-attr]
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
        self.protocol.forget_positions()

    @property
    def commit_failures(self) -> int:
        return self.protocol.total_commit_failures

    def close(self) -> None:
        self.protocol.close()


def final_digests(state: Any) -> dict:
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


# --- a script that owns its loop ----------------------------------------------------------------------


@dataclass(frozen=True)
class RunArgs:
    """A replica process's command line, as `ftjax train` takes it (what `ftjax launch --entry`
    passes to a script): the config, its overrides, and the run options."""

    cfg: Any
    options: RunOptions
    out: Path

    @classmethod
    def parse(cls, argv: list[str] | None = None) -> RunArgs:
        """Parse `CONFIG [key=value ...] [--out DIR] [--replica-id R] [--coordinator HOST:PORT] ...`.
        Before JAX is imported, it also applies the config's platform and device count."""
        import sys

        from ftjax.runtime.args import build_parser, parse_config

        args = build_parser().parse_intermixed_args(sys.argv[1:] if argv is None else argv)
        cfg = parse_config(args)
        if cfg.mesh.live > 1:
            raise ValueError("FaultTolerance.join: a script's replica runs on one host (mesh.hosts=1)")
        if "jax" not in sys.modules:
            from ftjax.base.env import configure_run

            configure_run(cfg.platform, device_count=cfg.mesh.devices_per_host)
        return cls(cfg, RunOptions.from_args(args), Path(args.out or "runs/script"))


class ScriptFaultTolerance(FaultTolerance):
    """`FaultTolerance` for a script's loop (`FaultTolerance.join`): it also writes the records and
    events a launcher reads (RUN/metrics.jsonl, summary.json), injects the faults it is asked to
    (`--die-at`), and initializes the state only at job start."""

    def __init__(
        self,
        protocol: StepProtocol,
        *,
        faults: Any,
        replica_id: str,
        fingerprint: str,
        quorum_timeout_s: float,
        drain_timeout_s: float,
        replicas: int,
        **kw: Any,
    ) -> None:
        super().__init__(protocol, **kw)
        self.faults, self.replica_id, self.fingerprint = faults, replica_id, fingerprint
        self.quorum_timeout_s, self.drain_timeout_s, self.replicas = quorum_timeout_s, drain_timeout_s, replicas
        self._t0 = time.perf_counter()
        self._asked = False

    def begin(self) -> StepInfo:
        if not self._asked:  # the first request: the job learns this replica exists
            self._asked = True
            self.log.event(
                ReplicaEvent.START,
                replica=self.replica_id,
                incarnation=self.incarnation,
                topology=self.fingerprint,
                data_fingerprint="",
                hosts=1,
                devices=1,
                pid=os.getpid(),
            )
            self.ask()
        self._t0 = time.perf_counter()
        self.faults.point(self.step + 1, "forward")
        info = super().begin()
        if info.catching_up:
            self.faults.point(info.step, "catchup")
        return info

    def initialize(self, init: Callable[[], Any]) -> None:
        """A quorum without state: `init()` at job start; later, nobody holds the job's state, so wait
        for a peer (JobStateLost after ft.quorum_timeout_s), never restart from scratch. Asks again."""
        if self.job_step == 0:
            self.init_state(init())
            self.log.event(ReplicaEvent.INIT, seed=0)
        else:
            self.wait_for_a_source(self.quorum_timeout_s, self.replica_id)
        self.ask()

    def average(self, q: QuorumResult, update: Any | None) -> tuple[Any, dict | None]:
        self.faults.point(q.step + 1, "ftar")
        return super().average(q, update)

    def commit(
        self, q: QuorumResult, update: Any, *, scale: float = 1.0, contributed: bool = True, loss: float | None = None
    ) -> bool:
        self.faults.point(q.step + 1, "commit")
        position = self.data_position
        applied = super().commit(q, update, scale=scale, contributed=contributed)
        record = {
            "step": q.step + 1,
            "committed": applied,
            "healing": not contributed,
            "loss": loss if contributed else None,
            "tokens": 0,
            "batch_id": self.batch_id(position) if applied and contributed else None,
            "data_position": self.data_position,
            "quorum_id": q.quorum_id,
            "participants": len(q.participants),
            "contributors": q.num_contributors,
            "lr_scale": scale,
            "step_time_s": time.perf_counter() - self._t0,
            "commit_failures": self.commit_failures,
        }
        if self.last_digest:
            record["param_digest"], record["digest_s"] = self.last_digest, self.last_digest_s  # type: ignore[assignment]
        self.log.log(record)
        return applied

    def finish(self) -> int:
        """The loop trained every step: serve late peers (drain), write the summary. Returns 0."""
        if self.has_peers:
            self.drain(self.replicas, self.drain_timeout_s)
        self.log.summary(
            **final_digests(self.state),
            replica=self.replica_id,
            incarnation=self.incarnation,
            data_position=self.data_position,
            commit_failures=self.commit_failures,
        )
        return 0

    def close(self) -> None:
        super().close()
        self.log.close()


def join(
    run: RunArgs,
    *,
    state: Any,
    update_template: Any,
    apply: Callable[[Any, Any, float], Any],
    batch_id: Callable[[int], int] | None = None,
    warm_up: Callable[[Any], Any] | None = None,
) -> ScriptFaultTolerance:
    """The fault-tolerance object of a script's replica: a member of the job at
    `run.options.coordinator` (the token in $FTJAX_TOKEN), or alone. `state`: the state's pytree of
    arrays (an initial one, or ShapeDtypeStructs with shardings), what a healing peer receives;
    `update_template`: what is averaged (the gradients' pytree, arrays or ShapeDtypeStructs with
    shardings); `apply(state, update, scale)`. The stream of replica r of R trains global batches
    r, R + r, ... (`batch_id`, default that). `warm_up(state)`: the loop's gradient computation on
    a state of zeros, which join runs, with `apply` and the digest, before the replica asks for a
    quorum (`_warm_up`)."""
    import signal

    from ftjax.runtime import replica as rp
    from ftjax.runtime.host_group import JaxHostGroup
    from ftjax.runtime.metrics import MetricsLog

    cfg, options, out = run.cfg, run.options, run.out
    if cfg.ft.sync != "every_step":  # (its rounds, outer state and fragments are the built-in loop's)
        raise ValueError(f"ft.sync={cfg.ft.sync}: DiLoCo runs in the built-in loop (ftjax.fit, ftjax train), not join")
    abstract, template = _placed(cfg, state, update_template)
    _warm_up(abstract, template, apply, warm_up, cfg.ft.digest_every)
    group = JaxHostGroup()
    log = MetricsLog(
        out,
        enabled=True,
        total_steps=cfg.steps,
        label=f"replica {options.replica_id}",
        log_every=options.log_every,
        **rp.record_sinks(cfg, options, out),
    )
    topology = _script_topology(cfg, template, abstract)
    protocol = _script_protocol(run, group, log, template, topology)
    replicas, rid = cfg.ft.replicas, options.replica_id
    ft = ScriptFaultTolerance(
        protocol,
        faults=rp.faults_of(options),
        replica_id=str(rid),
        fingerprint=fingerprint(topology),
        quorum_timeout_s=cfg.ft.quorum_timeout_s,
        drain_timeout_s=cfg.ft.drain_timeout_s,
        replicas=replicas,
        apply=apply,
        abstract_state=abstract,
        log=log,
        digest_every=cfg.ft.digest_every,
        steps=cfg.steps,
        batch_id=batch_id or (lambda p: p * replicas + rid),
    )
    signal.signal(signal.SIGTERM, lambda *_: ft.request_leave("SIGTERM"))
    return ft


def _warm_up(abstract: Any, template: Any, apply: Callable, step: Callable | None, digest: bool) -> None:
    """Run the loop's programs once on zeros before the replica joins: a replica that (re)joins a
    running job would otherwise compile them inside its first steps, which every peer waits for at
    FTAR (the built-in loop's `ReplicaProgram.warm_up`). The results are dropped."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    def zeros(a):  # (numpy has no PRNG key dtype)
        typed_key = jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
        return jax.device_put((jnp if typed_key else np).zeros(a.shape, a.dtype), a.sharding)

    state = jax.tree.map(zeros, abstract)
    if step is not None:
        jax.block_until_ready(step(state))
    state = jax.block_until_ready(apply(state, jax.tree.map(zeros, template), 1.0))
    if digest:  # the per-step digest's program compiles on first use too
        state_checksum(state)


def _placed(cfg: Any, *trees: Any) -> tuple:
    """ShapeDtypeStructs of each tree's leaves, with their shardings on the replica's mesh."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ftjax.program.sharding import replica_mesh

    mesh = replica_mesh(jax.devices()[: cfg.mesh.devices_per_host], cfg.mesh.tensor)

    def placed(a):  # a leaf with no mesh sharding (plain, or on one device) is replicated on the replica's mesh
        sharding = getattr(a, "sharding", None)
        return jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=sharding if isinstance(sharding, NamedSharding) else NamedSharding(mesh, P())
        )

    return tuple(jax.tree.map(placed, tree) for tree in trees)


def _script_topology(cfg: Any, template: Any, abstract: Any) -> str:
    """What a script's replicas must agree on to average together: lanes, update and state layouts."""
    from ftjax.program.sharding import describe

    return "\n".join(
        [
            f"mesh: lanes={cfg.mesh.hosts} devices_per_lane={cfg.mesh.devices_per_host}",
            describe({"update": template}),
            describe({"state": abstract}),
        ]
    )


def _script_protocol(run: RunArgs, group: Any, log: Any, template: Any, topology: str) -> StepProtocol:
    """A member's step protocol if the script joins a coordinator, else a standalone one."""
    import jax

    from ftjax.base.env import read_token
    from ftjax.runtime import replica as rp

    cfg, options, out = run.cfg, run.options, run.out
    if not options.coordinator:
        return rp.standalone_protocol(cfg, options, out, group, log)
    addrs = rp.addresses(cfg, options.coordinator)
    return rp.member_protocol(
        cfg,
        options,
        out,
        read_token(),
        addrs,
        group,
        log,
        update_template=template,
        update_shardings=jax.tree.map(lambda a: a.sharding, template),
        topology=topology,
    )


FaultTolerance.join = staticmethod(join)  # type: ignore[attr-defined]  # (the API's spelling: ftjax.FaultTolerance.join)
