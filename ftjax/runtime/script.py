"""The runtime a script that owns its training loop sees: `ftjax.FaultTolerance` (`ftjax.RunArgs`, which must
not import JAX, is in ftjax/runtime/args.py).

`FaultTolerance.join(run, ...)` assembles the step protocol's owner for a script's replica from a
config (standalone, or a member of the job at `--coordinator`), the way ftjax/runtime/replica.py
assembles the built-in loop's; the object it returns is `ftjax.runtime.manager.FaultTolerance`
plus what a launcher needs of a replica process: the records and events (RUN/metrics.jsonl,
summary.json), the injected faults (`--die-at`), and an init of the state at job start only.

This module sits above the assembly (replica.py) and the core (manager.py), which know nothing of
it: the core's owner of the step protocol never imports the code that builds it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ftjax.base.env import read_token
from ftjax.base.fingerprint import fingerprint
from ftjax.config import Config
from ftjax.coordinator.types import QuorumResult
from ftjax.program.digest import state_checksum
from ftjax.program.sharding import describe, replica_mesh
from ftjax.runs.events import ReplicaEvent, StepField, digest_fields, step_record
from ftjax.runtime import manager
from ftjax.runtime import replica as rp
from ftjax.runtime.args import RunArgs
from ftjax.runtime.faults import InjectedFaults
from ftjax.runtime.host_group import JaxHostGroup
from ftjax.runtime.manager import Apply, StepInfo, final_digests
from ftjax.runtime.metrics import MetricsLog
from ftjax.runtime.protocol import PyTree, StepProtocol


class FaultTolerance(manager.FaultTolerance):
    """`ftjax.FaultTolerance`: the owner of a script's step protocol (ftjax/runtime/manager.py says
    what it owns), built by `FaultTolerance.join`. Beyond the core it owns the replica's records
    (its MetricsLog: step records, events, the summary) and its injected faults; it must not touch
    the script's model, optimizer or data (only `apply`, `batch_id` and `init` reach them), and
    leaves DiLoCo (`ft.sync`) to the built-in loop."""

    def __init__(
        self,
        protocol: StepProtocol,
        *,
        faults: InjectedFaults,
        replica_id: str,
        fingerprint: str,
        quorum_timeout_s: float,
        drain_timeout_s: float,
        replicas: int,
        log: MetricsLog,
        apply: Apply,
        abstract_state: PyTree,
        digest_every: int,
        steps: int,
        batch_id: Callable[[int], int],
    ) -> None:
        super().__init__(
            protocol,
            apply=apply,
            abstract_state=abstract_state,
            log=log,
            digest_every=digest_every,
            steps=steps,
            batch_id=batch_id,
        )
        self.records = log  # (the core sees only events; the script's records are this one's)
        self.faults, self.replica_id, self.fingerprint = faults, replica_id, fingerprint
        self.quorum_timeout_s, self.drain_timeout_s, self.replicas = quorum_timeout_s, drain_timeout_s, replicas
        self._t0 = time.perf_counter()
        # when this step's quorum came and its averaging began and ended (perf_counter): the
        # record's timings, as the built-in loop's (a peer's wait shows apart from the loop's own work)
        self._at_quorum = self._at_average = self._averaged = 0.0
        self._asked = False

    @staticmethod
    def join(
        run: RunArgs,
        *,
        state: PyTree,
        update_template: PyTree,
        apply: Apply,
        batch_id: Callable[[int], int] | None = None,
        warm_up: Callable[[PyTree], object] | None = None,
    ) -> FaultTolerance:
        """The fault-tolerance object of a script's replica: a member of the job at
        `run.options.coordinator` (the token in $FTJAX_TOKEN), or alone. `state`: the state's pytree of
        arrays (an initial one, or ShapeDtypeStructs with shardings), what a healing peer receives;
        `update_template`: what is averaged (the gradients' pytree, arrays or ShapeDtypeStructs with
        shardings); `apply(state, update, scale)`. The stream of replica r of R trains global batches
        r, R + r, ... (`batch_id`, default that). `warm_up(state)`: the loop's gradient computation on
        a state of zeros, which join runs, with `apply` and the digest, before the replica asks for a
        quorum (`_warm_up`)."""
        cfg, options, out = run.cfg, run.options, run.out
        if cfg.ft.sync != "every_step":  # (its rounds, outer state and fragments are the built-in loop's)
            raise ValueError(
                f"ft.sync={cfg.ft.sync}: DiLoCo runs in the built-in loop (ftjax.fit, ftjax train), not join"
            )
        abstract, template = _placed(cfg, state, update_template)
        _warm_up(abstract, template, apply, warm_up, bool(cfg.ft.digest_every))
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
        ft = FaultTolerance(
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

    def begin(self) -> StepInfo:
        """The core's `begin`, after the first request (the `start` event) and the fault points."""
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
        self._at_quorum = time.perf_counter()
        if info.catching_up:
            self.faults.point(info.step, "catchup")
        return info

    def initialize(self, init: Callable[[], PyTree]) -> None:
        """A quorum without state: `init()` at job start; later, nobody holds the job's state, so wait
        for a peer (JobStateLost after ft.quorum_timeout_s), never restart from scratch. Asks again."""
        if self.job_step == 0:
            self.init_state(init())
            self.log.event(ReplicaEvent.INIT, seed=0)
        else:
            self.wait_for_a_source(self.quorum_timeout_s, self.replica_id)
        self.ask()

    def average(self, q: QuorumResult, update: PyTree | None) -> tuple[PyTree, dict | None]:
        """The core's `average`, after the `ftar` fault point."""
        self.faults.point(q.step + 1, "ftar")
        self._at_average = time.perf_counter()
        try:
            return super().average(q, update)
        finally:
            self._averaged = time.perf_counter()

    def commit(
        self,
        q: QuorumResult,
        update: PyTree,
        *,
        scale: float = 1.0,
        contributed: bool = True,
        loss: float | None = None,
    ) -> bool:
        """The core's `commit`, then the step's record (`loss`: of this replica's batch)."""
        self.faults.point(q.step + 1, "commit")
        position = self.data_position
        applied = super().commit(q, update, scale=scale, contributed=contributed)
        record = step_record(
            step=q.step + 1,
            committed=applied,
            healing=not contributed,
            loss=loss if contributed else None,
            tokens=0,
            batch_id=self.batch_id(position) if applied and contributed else None,
            data_position=self.data_position,
            quorum_id=q.quorum_id,
            participants=len(q.participants),
            contributors=q.num_contributors,
            lr_scale=scale,
            step_time_s=(end := time.perf_counter()) - self._t0,
            timings=self._timings(end),
            commit_failures=self.commit_failures,
        )
        self.records.log({**record, **digest_fields(self.last_digest, self.last_digest_s)})
        return applied

    def _timings(self, end: float) -> dict[str, float] | None:
        """The step's split (the built-in loop's fields): the quorum's wait from `begin`, the loop's
        own work up to `average`, the averaging, then the vote, update and digest up to `end`. None
        where the loop did not average since its quorum came (the stamps are an earlier step's)."""
        t0, quorum, average, averaged = self._t0, self._at_quorum, self._at_average, self._averaged
        if not t0 <= quorum <= average <= averaged <= end:
            return None
        return {
            StepField.COMPUTE_S: average - quorum,
            StepField.QUORUM_WAIT_S: quorum - t0,
            StepField.FTAR_S: averaged - average,
            StepField.COMMIT_S: end - averaged,
        }

    def finish(self) -> int:
        """The loop trained every step: serve late peers (drain), write the summary. Returns 0."""
        if self.has_peers:
            self.drain(self.replicas, self.drain_timeout_s)
        self.records.summary(
            **final_digests(self.state),
            replica=self.replica_id,
            incarnation=self.incarnation,
            data_position=self.data_position,
            commit_failures=self.commit_failures,
        )
        return 0

    def close(self) -> None:
        """The protocol's connections, then the records."""
        super().close()
        self.records.close()


def _warm_up(
    abstract: PyTree, template: PyTree, apply: Apply, step: Callable[[PyTree], object] | None, digest: bool
) -> None:
    """Run the loop's programs once on zeros before the replica joins: a replica that (re)joins a
    running job would otherwise compile them inside its first steps, which every peer waits for at
    FTAR (the built-in loop's `ReplicaProgram.warm_up`). The results are dropped."""

    def zeros(a: jax.ShapeDtypeStruct) -> jax.Array:  # (numpy has no PRNG key dtype)
        typed_key = jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
        return jax.device_put((jnp if typed_key else np).zeros(a.shape, a.dtype), a.sharding)

    state = jax.tree.map(zeros, abstract)
    if step is not None:
        jax.block_until_ready(step(state))
    state = jax.block_until_ready(apply(state, jax.tree.map(zeros, template), 1.0))
    if digest:  # the per-step digest's program compiles on first use too
        state_checksum(state)


def _placed(cfg: Config, *trees: PyTree) -> tuple[PyTree, ...]:
    """ShapeDtypeStructs of each tree's leaves, with their shardings on the replica's mesh."""
    mesh = replica_mesh(jax.devices()[: cfg.mesh.devices_per_host], cfg.mesh.tensor)

    def placed(a: jax.Array | jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        # a leaf with no mesh sharding (plain, or on one device) is replicated on the replica's mesh
        sharding = getattr(a, "sharding", None)
        return jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=sharding if isinstance(sharding, NamedSharding) else NamedSharding(mesh, P())
        )

    return tuple(jax.tree.map(placed, tree) for tree in trees)


def _script_topology(cfg: Config, template: PyTree, abstract: PyTree) -> str:
    """What a script's replicas must agree on to average together: lanes, update and state layouts."""
    return "\n".join(
        [
            f"mesh: lanes={cfg.mesh.hosts} devices_per_lane={cfg.mesh.devices_per_host}",
            describe({"update": template}),
            describe({"state": abstract}),
        ]
    )


def _script_protocol(
    run: RunArgs, group: JaxHostGroup, log: MetricsLog, template: PyTree, topology: str
) -> StepProtocol:
    """A member's step protocol if the script joins a coordinator, else a standalone one."""
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
