"""One replica process's training loop: the same loop for a standalone run and a fault-tolerant one.

Each step: compute the gradients of this replica's next batch (the leader's quorum request for
the step is already in flight), learn the quorum (`StepProtocol.agree`), average the update over
its contributors, vote, and apply it, or keep it for the replay while this replica heals. The
loop owns the training state, the data stream, durable checkpoints, metrics and fault injection;
everything between replicas is the protocol's (ftjax/runtime/protocol.py). A standalone run is the same
loop with a quorum of one and a reducer that returns its input (docs/design/step.md, "One step").
"""

from __future__ import annotations

import math
import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import jax
import numpy as np
import optax

from ftjax.base.batches import RowSpan, assign, chunk_sizes, row_count, share_rows
from ftjax.config import Config
from ftjax.coordinator.types import QuorumResult
from ftjax.program.data import BatchStream, eval_share, heldout_batch, make_stream
from ftjax.program.digest import all_finite, params_digest
from ftjax.program.step import (
    ReplicaProgram,
    State,
    device_batch,
    model_state,
    param_count,
    topology_fingerprint,
    where,
)
from ftjax.program.task import concat_rows, slice_rows
from ftjax.runs.events import EXIT_LEFT, EXIT_NO_PROGRESS, ReplicaEvent, StepField, digest_fields, step_record
from ftjax.runtime.checkpoint import CorruptCheckpoint, DurableCheckpoints, load_init
from ftjax.runtime.faults import InjectedFaults
from ftjax.runtime.manager import FaultTolerance, Finished, Left, final_digests
from ftjax.runtime.metrics import MetricsLog, ModelFlops
from ftjax.runtime.protocol import StepProtocol
from ftjax.runtime.sync import Batch, Computed, Stream, Sync, make_sync
from ftjax.runtime.watchdog import NoWatchdog, ProgressWatchdog


def lr_scale(policy: str, live: int, total: int) -> float:
    """Learning-rate response to missing replicas (FT-HSDP paper: sqrt beat linear beat none)."""
    frac = min(live, total) / total
    return {"none": 1.0, "linear": frac, "sqrt": math.sqrt(frac)}[policy]


class NotFinite(RuntimeError):
    """A step's loss, or the state about to be checkpointed, holds a NaN or an infinity: the run
    stops (`ftjax train`: one line, exit 2; docs/design/step.md, "A loss that is not finite")."""


@dataclass
class _Timing:
    t0: float
    compute: float = 0.0
    quorum: float = 0.0
    ftar: float = 0.0
    shared: float = 0.0  # seconds computing the rest of the share, once the quorum said what it is
    end: float = 0.0  # when the step was done (before an evaluation); 0: when its record is written


class Trainer:
    """One replica process's training loop (module docstring). It owns the training state's
    lifecycle through its `FaultTolerance` (`ft`: the state, the step, the data position), the data
    stream and its prefetch, durable checkpoints, evaluation, step records, the watchdog's beats and
    fault injection. What a round computes, averages and applies is its `Sync` strategy's
    (ftjax/runtime/sync.py): the trainer holds no branch on the mode. It must not touch what is the
    step protocol's (quorum, FTAR, votes, catch-up: ftjax/runtime/protocol.py) other than through
    `ft`'s public methods (it must not hold or reach into the step protocol), nor a strategy's
    arithmetic."""

    def __init__(
        self,
        cfg: Config,
        program: ReplicaProgram,
        stream: BatchStream,
        protocol: StepProtocol,
        *,
        log: MetricsLog,
        ckpt: DurableCheckpoints | None,
        faults: InjectedFaults,
        watchdog: ProgressWatchdog | NoWatchdog,
        replica_id: str,
        restore_durable: bool,
        stop_after: int | None = None,
        flops: ModelFlops | None = None,
    ) -> None:
        self.sync: Sync = make_sync(cfg, program)  # every_step, DiLoCo or streaming DiLoCo (ft.sync)
        self.stream = self.sync.stream(stream)  # (a round's positions, with DiLoCo)
        self._mine: Computed | None = None  # this replica's part of the round being committed
        self._kept: Computed | None = None  # a discarded round's part the strategy keeps for its retry
        self.cfg, self.program, self.flops = cfg, program, flops  # (flops: the records' MFU; None: not known)
        self.log, self.ckpt, self.faults, self.watchdog = log, ckpt, faults, watchdog
        self.replica_id = replica_id
        self.restore_durable = restore_durable  # a fault-tolerant run, or a standalone --resume
        self.stop = min(cfg.steps, stop_after) if stop_after else cfg.steps
        self.abstract = self.sync.abstract_state()
        self.constant = cfg.ft.global_batch == "constant"
        # the step protocol's one owner: it holds the state, the step and the data position
        self.ft = FaultTolerance(
            protocol,
            apply=self._apply,
            abstract_state=self.abstract,
            log=log,
            meta=self._meta,
            constant=self.constant,
            digest_every=cfg.ft.digest_every,
            steps=cfg.steps,
            after_apply=faults.corrupt,
            batch_id=self.stream.batch_id,
            digest_view=self.sync.digest_view,
        )
        # A constant global batch trains stream r's batch n at step n, whoever computes it: replica
        # ids are the stream numbers 0..R-1 (ftjax/base/batches.py).
        self.own = int(replica_id) if self.constant else self.stream.replica
        if self.constant and not 0 <= self.own < cfg.ft.replicas:
            raise ValueError(
                f"ft.global_batch=constant: replica id {replica_id!r} is not a stream of "
                f"0..{cfg.ft.replicas - 1} (ft.replicas={cfg.ft.replicas})"
            )
        self.own_work: tuple[RowSpan, ...] = ((self.own, 0, cfg.data.batch_size),)
        # this replica's share of the latest quorum's step (a reduced-degree replica: part of its batch)
        self.work: tuple[RowSpan, ...] = ((self.own, 0, cfg.own_rows),)
        self.step_work: list[list[int]] | None = None  # constant: the whole step's [who, stream, a, b]
        self._streams = {self.own: self.stream}
        self.lrs = self.sync.learning_rates()
        # the next own batch, read and placed on the devices while FTAR averages this step's update
        # (a batch is a pure function of its position: a prefetch never changes what is trained)
        self._prefetch_pool = ThreadPoolExecutor(1, "ftjax-prefetch")
        self._exchange_pool = ThreadPoolExecutor(1, "ftjax-exchange")  # (a round's exchange, overlapped)
        self._prefetched: tuple[int, Future] | None = None

    # the state, the step and the data position are the fault-tolerance object's
    state = property(lambda self: self.ft.state, lambda self, v: setattr(self.ft, "state", v))
    step = property(lambda self: self.ft.step, lambda self, v: setattr(self.ft, "step", v))
    position = property(lambda self: self.ft.data_position, lambda self, v: setattr(self.ft, "data_position", v))
    has_state = property(lambda self: self.ft.has_state)

    def _meta(self) -> dict:
        return {"step": self.step, "data_position": self.position, "data_fingerprint": self.stream.fingerprint}

    def _ask(self, digest: str = "") -> None:
        self.ft.ask(digest)

    # --- the loop -------------------------------------------------------------------------------
    def run(self) -> int:
        """Train to the last step (or `stop_after`), drain for late peers, write the summary; the exit code."""
        self.log.event(
            ReplicaEvent.START,
            replica=self.replica_id,
            incarnation=self.ft.incarnation,
            topology=topology_fingerprint(self.program),
            data_fingerprint=self.stream.fingerprint,
            hosts=jax.process_count(),
            devices=int(self.program.mesh.devices.size),
            pid=os.getpid(),
        )
        self._ask()
        try:
            while self.step < self.stop:
                self._one_step()
            if self.stop == self.cfg.steps and self.ft.has_peers:  # (a standalone run has no peer)
                with self.watchdog.exempt("drain"):
                    self.ft.drain(self.cfg.ft.replicas, self.cfg.ft.drain_timeout_s)
        except Left as e:
            self.log.event(ReplicaEvent.LEFT, reason=str(e), step=self.step)
            return EXIT_LEFT
        except Finished as e:  # not a failure: the job is done, this replica's state is not its final one
            self.log.event(ReplicaEvent.JOB_FINISHED, job_step=e.args[0], step=self.step, reason=e.args[1])
            if self.ckpt is not None:
                self.ckpt.close()
            print(f"ftjax train: replica {self.replica_id}: {e.args[1]}; exiting", file=sys.stderr, flush=True)
            return 0
        return self._finish()

    def _one_step(self) -> None:
        self.watchdog.beat("forward")
        timing = _Timing(time.perf_counter())
        # Before the quorum answers: the own batch (nearly always part of the share; the same
        # program in both modes), or the whole share of a replica that has no whole own batch.
        # Rows of absent peers wait for the quorum: it may bring them back.
        ahead = self.own_work if self.own_work[0] in self.work else self.work
        kept, self._kept = self._kept, None
        computed: Computed | None
        if kept is not None and (kept.step, kept.position) == (self.step, self.position):
            computed = kept  # (a retried round: its inner steps are a function of the same state and batches)
            computed.reused = True
        else:
            computed = self._compute(ahead) if self.has_state and not self.ft.healing else None
        timing.compute = time.perf_counter()
        info = self.ft.begin()
        q = info.quorum
        timing.quorum = time.perf_counter()
        if info.no_state:  # nobody has state: the latest durable checkpoint (or an init), then ask again
            with self.watchdog.exempt("init"):
                self._init_state()
            return self._ask()
        if info.catching_up:
            self.faults.point(q.step + 1, "catchup")
        if info.past_end:  # the job has trained every step: this replica only catches up
            time.sleep(0.05)
            return self._ask()
        contributes = info.contributes
        if contributes:
            self.work = self._share(q)
        stale = computed is not None and self.sync.stale(computed, self.step)
        if contributes and (
            computed is None or stale or (computed.position, computed.work) != (self.position, self.work)
        ):
            began = time.perf_counter()  # the rest of the share, or all of it if we were behind
            computed = self._compute(self.work, computed)
            timing.shared = time.perf_counter() - began
        self.faults.point(q.step + 1, "ftar")
        if contributes:
            self._prefetch(self.position + 1)
        voted, update, timing.ftar = self._exchange(q, computed if contributes else None)
        if not voted:
            # discarded (the next quorum is asked): the same batch again, unless the job committed the
            # step. A DiLoCo round keeps its inner steps: only a replica that died loses its own.
            self._kept = self.sync.retry(computed) if contributes and computed is not None else None
            return
        self.faults.point(q.step + 1, "commit")
        self._commit(q, update, computed if contributes else None, contributes, timing)

    def _exchange(self, q: QuorumResult, computed: Computed | None) -> tuple[bool, optax.Updates, float]:
        """The round's average over its contributors and the vote on it: (whether it commits, the
        average, when FTAR ended). With the rest of the round still to compute (`Computed.rest`:
        streaming DiLoCo's last tau inner steps) the exchange runs in a thread meanwhile (FTAR works
        on host buffers and releases the GIL in its socket calls), joined before anything is applied
        or the round retried: a failed exchange discards the round as without the overlap."""

        began = []

        def exchange() -> tuple[bool, optax.Updates, float]:
            began.append(time.perf_counter())
            update, error = self.ft.average(q, computed.grads if computed is not None else None)
            ended = time.perf_counter()
            return self.ft.vote(q, error), update, ended

        rest = computed.rest if computed is not None else None
        if rest is None:  # (nothing left to compute: a retried round's overlap is none)
            if computed is not None:
                computed.overlap_s = computed.rest_s = 0.0
            return exchange()
        assert computed is not None  # (a round with steps left is a computed one)
        pending = self._exchange_pool.submit(exchange)
        rest_began = time.perf_counter()
        try:
            rest()
        except BaseException:
            wait([pending])  # (never leave the exchange running behind an error)
            raise
        computed_at = time.perf_counter()
        out = pending.result()
        # the seconds both ran: from the exchange's start to the rest's end or the average's, the earlier
        computed.overlap_s = max(0.0, min(computed_at, out[2]) - began[0])
        computed.rest_s = computed_at - rest_began
        return out

    def _share(self, q: QuorumResult) -> tuple[RowSpan, ...]:
        """The rows this replica computes at the quorum's step: its own batch (elastic), or its
        share of the step's R batches (constant; the whole step's assignment is kept for the record)."""
        if not self.constant:
            return self.own_work
        b, hosts = self.cfg.data.batch_size, self.cfg.mesh.hosts
        contributors = [p for p in q.participants if not p.healing]
        # a reduced-degree replica (fewer hosts: catch-up addresses) computes its share in
        # proportion to its devices; the rest of its batch is dealt to the others like an orphan's
        shares = assign(
            self.cfg.ft.replicas,
            b,
            self.program.unit_rows,
            [int(p.replica_id) for p in contributors],
            own_rows={int(p.replica_id): share_rows(b, len(p.catchup_addresses) or hosts, hosts) for p in contributors},
        )
        self.step_work = [[c, *span] for c, spans in sorted(shares.items()) for span in spans]
        return shares[self.own]

    def _compute(self, work: tuple[RowSpan, ...], done: Computed | None = None) -> Computed:
        """The gradients of `work`, the rows of this replica's share at the next data position. Its
        own batch alone goes through `grads`, the same program in both modes; other rows are summed
        in micro-batches inside `accumulate`, and added to the own batch's `grads` when the share
        holds it. So when the quorum changes a share whose own batch `done` already computed (a
        peer fails, or returns), only the other rows are computed again, and the result is the one
        a computation from scratch gives."""
        self.faults.point(self.step + 1, "forward")
        return self.sync.compute(self, work, done)

    def gradients(self, work: tuple[RowSpan, ...], done: Computed | None = None) -> Computed:
        """Every-step sync's round (`EveryStep.compute`): the gradients of `work` at the state."""
        if work == self.own_work:
            batch = self.own_batch(self.position)
            loss, aux, grads = self.program.grads_of(self.state, batch, where(self.position, self.own, 0))
            jax.block_until_ready(grads)
            return Computed(loss, grads, self.position, work, aux=aux)
        rest = tuple(p for p in work if p != self.own_work[0])
        own = None
        if len(rest) < len(work):  # the whole own batch, through `grads` (once per step)
            own = done.own if done is not None and done.own is not None else done
            if own is None or (own.position, own.work) != (self.position, self.own_work):
                own = self.gradients(self.own_work)
        rows = concat_rows([slice_rows(self._stream(s).batch(self.position), a, b) for s, a, b in rest])
        origin = [(s, r) for s, a, b in rest for r in range(a, b)]  # each row's (stream, row): its RNG key
        grads, per_row, start = self.program.zeros(), [], 0
        for n in chunk_sizes(len(origin), self.program.chunk_rows):
            chunk = device_batch(self.program, slice_rows(rows, start, start + n))
            grads, losses = self.program.accumulate_rows(grads, self.state, chunk, where(self.position, *origin[start]))
            per_row.append(losses)
            start += n
        sums = []
        if own is not None:
            grads = self.program.add(own.grads, grads)
            sums = [[*self.own_work[0], float(own.loss) * self.cfg.data.batch_size]]
        jax.block_until_ready(grads)
        row_losses = np.concatenate([np.asarray(x) for x in per_row])
        ends = np.cumsum([b - a for _, a, b in rest])
        sums += [[s, a, b, float(row_losses[end - (b - a) : end].sum())] for (s, a, b), end in zip(rest, ends)]
        return Computed(
            sum(x[3] for x in sums) / row_count(work),
            grads,
            self.position,
            work,
            sums,
            own,
            aux=own.aux if own is not None else None,
        )

    def _prefetch(self, position: int) -> Future:
        """The own batch at `position`, read and placed on the devices in the prefetch thread (once);
        with DiLoCo, the round's batches."""
        if self._prefetched is None or self._prefetched[0] != position:
            batch = lambda: self.sync.place(self.program, self.stream.batch(position))
            self._prefetched = (position, self._prefetch_pool.submit(batch))
        return self._prefetched[1]

    def own_batch(self, position: int) -> Batch:
        """The own batch at `position` on the devices: the prefetched one if it is that position's."""
        return self._prefetch(position).result()

    def _stream(self, s: int) -> Stream:
        if s not in self._streams:
            self._streams[s] = make_stream(self.cfg, replica=s, task=self.program.task)
        return self._streams[s]

    def _apply(self, state: State, grads: optax.Updates, scale: float) -> State:
        return self.sync.apply(state, grads, scale, self._mine)

    def beat(self) -> None:
        """A round's inner step is progress (the watchdog's)."""
        self.watchdog.beat("inner step")

    def _commit(
        self, q: QuorumResult, update: optax.Updates, computed: Computed | None, contributes: bool, timing: _Timing
    ) -> None:
        scale = 1.0 if self.constant else lr_scale(self.cfg.ft.lr_scaling, q.num_contributors, self.cfg.ft.replicas)
        position = self.position  # (the batch trained: commit moves past it)
        self._mine = computed if contributes else None
        try:
            applied = self.ft.commit(q, update, scale=scale, contributed=contributes)
        finally:
            self._mine = None
        batch_id = self.stream.batch_id(position) if applied and contributes else None
        digest = (self.ft.last_digest, self.ft.last_digest_s)
        if computed is not None and not math.isfinite(loss := float(computed.loss)):
            self._record(q, applied, computed, batch_id, scale, timing, digest)
            raise NotFinite(
                f"replica {self.replica_id}: step {q.step + 1}: the loss of its rows is {loss} (data position "
                f'{position}): stopping before it is checkpointed or trained on (docs/design/index.md, "A loss that is '
                'not finite")'
            )
        if self.ckpt is not None and applied:
            with self.watchdog.exempt("checkpoint save"):  # its length depends on the model, like a restore
                self._save(force=self.step == self.stop)
        every = self.cfg.eval.every
        evaluated = {}
        if applied and contributes and every and self.step % every == 0:
            timing.end = time.perf_counter()
            evaluated = self._evaluate()
        self._record(q, applied, computed, batch_id, scale, timing, digest, evaluated)
        # a step is done: from now on this process must make progress, the next step within twice
        # this one's own time (the quorum's wait aside) or ft.progress_timeout_s, whichever is longer
        self.watchdog.arm(time.perf_counter() - timing.t0 - (timing.quorum - timing.compute))

    def _record(
        self,
        q: QuorumResult,
        applied: bool,
        computed: Computed | None,
        batch_id: int | None,
        scale: float,
        timing: _Timing,
        digest: tuple[str, float] = ("", 0.0),
        evaluated: dict | None = None,
    ) -> None:
        t5 = timing.end or time.perf_counter()
        # the optimizer steps this replica's batches went through (none while healing)
        inner = 0 if computed is None else self.sync.optimizer_steps(computed)
        rows = row_count(computed.work) * inner if computed is not None else 0
        record = step_record(
            step=q.step + 1,
            committed=applied,
            healing=computed is None,
            loss=float(computed.loss) if computed is not None else None,
            tokens=rows * self.program.task.tokens_per_example,
            batch_id=batch_id,
            data_position=self.position,
            quorum_id=q.quorum_id,
            participants=len(q.participants),
            contributors=q.num_contributors,
            lr_scale=scale,
            step_time_s=t5 - timing.t0,
            timings={
                StepField.COMPUTE_S: timing.compute - timing.t0 + timing.shared,
                StepField.QUORUM_WAIT_S: timing.quorum - timing.compute,
                StepField.FTAR_S: timing.ftar - timing.quorum - timing.shared,
                StepField.COMMIT_S: t5 - timing.ftar,
            },
            commit_failures=self.ft.commit_failures,
            protocol=self.ft.step_fields(),  # (ft.commit_decision coordinator: decision_s, within commit_s)
        )
        if self.constant:  # who computed which rows of the step's R batches (ftjax/base/batches.py)
            record["work"] = self.step_work
            record["loss_sums"] = (
                computed.loss_sums or [[*computed.work[0], float(computed.loss) * rows]]
                if computed is not None
                else None
            )
        record.update(self.sync.record(q.step, computed))  # (DiLoCo: the round's inner steps, fragment, bytes)
        if self.lrs is not None and 0 <= q.step < len(self.lrs):  # the learning rate this update applied
            record["lr"] = float(self.lrs[q.step]) * scale
        if self.flops is not None:
            record.update(self.flops.fields(rows, record["step_time_s"]))
        record.update(self.ft.phase_fields())  # FTAR's: d2h, ring, h2d, overlap
        if computed is not None and computed.aux:
            record["aux"] = {k: float(v) for k, v in computed.aux.items()}
        record.update(digest_fields(*digest))  # the state's per-step digest, and the seconds it took
        record.update(evaluated or {})
        self.log.log(record)

    def _evaluate(self) -> dict:
        """The loss of this replica's share of the `eval.batches` held-out batches on the state just
        committed (docs/design/data.md, "Evaluation"): a jitted loss alone, so neither the state nor the
        data position changes, and no peer takes part. {} when its share is empty."""
        share = eval_share(self.cfg.eval.batches, self.own, self.cfg.ft.replicas)
        if not share:
            return {}
        self.watchdog.beat("eval")
        began, losses = time.perf_counter(), []
        params, ms = self.state["params"], model_state(self.state)
        for i in share:
            batch = device_batch(self.program, heldout_batch(self.program.task.heldout, i, self.cfg.data.batch_size))
            losses.append(float(self.program.evaluate(params, ms, batch)))
            self.faults.point(self.step, "eval")  # (--die-at STEP:eval: killed during an evaluation)
        loss = float(np.mean(losses))
        return {
            "eval_loss": loss,
            "eval_perplexity": math.exp(min(loss, 700.0)),
            "eval_batches": share,
            "eval_s": time.perf_counter() - began,
        }

    # --- state from elsewhere -------------------------------------------------------------------
    def _init_state(self) -> None:
        """Nobody in the quorum has state: the latest durable checkpoint, else a fresh init from the
        seed (its parameters from `checkpoint.init_from` when set), but only at job start. Once this
        process has seen the job past step 0, fresh weights would silently restart training: it keeps
        asking for a peer to heal from instead, and gives up with an error after `ft.quorum_timeout_s`."""
        if self.restore_durable and self.ckpt is not None and self.ckpt.latest_step() is not None:
            # the newest checkpoint that verifies (CheckpointMismatch if another job's)
            self.state, meta = self.ckpt.restore_intact(self.abstract, self._corrupt_checkpoint)
            self.step, self.position = int(meta["step"]), int(meta["data_position"])
            self.ft.forget_positions()
            self.log.event(ReplicaEvent.RESTORE, restored_step=self.step, data_position=self.position, source="durable")
        elif self.ft.job_step == 0:
            self.state = self.program.init(np.int32(self.cfg.seed))
            self.step = 0
            if self.cfg.checkpoint.init_from:
                self._init_from()
            else:  # (asked to restore and found nothing: said, so that a wrong directory shows)
                nothing = {} if not self.restore_durable or self.ckpt is None else {"no_checkpoint_in": self.ckpt.where}
                self.log.event(ReplicaEvent.INIT, seed=self.cfg.seed, **nothing)
            self.state = self.sync.init(self.state)  # (DiLoCo: the outer state of the initial parameters)
        else:
            self.ft.wait_for_a_source(self.cfg.ft.quorum_timeout_s, self.replica_id)

    def _init_from(self) -> None:
        """The parameters (with `checkpoint.init_opt`, the optimizer state) of the fresh state come from
        the checkpoint `checkpoint.init_from`; the model state and step counter stay the seed's.
        InitCheckpointError (exit 2) if it is not of this model, before any array is read."""
        c = self.cfg.checkpoint
        assert c.init_from is not None  # (called only with checkpoint.init_from)
        loaded = load_init(c.init_from, self.abstract, opt=c.init_opt, model=self.cfg.model)
        # a fresh optimizer state is made for the loaded parameters: an optimizer's may depend on them
        opt = loaded["opt"] if "opt" in loaded else self.program.opt_init(loaded["params"])
        self.state = {**self.state, "params": loaded["params"], "opt": opt}
        self.log.event(
            ReplicaEvent.INIT_FROM, path=c.init_from, opt=c.init_opt, params_digest=params_digest(self.state)
        )

    def _corrupt_checkpoint(self, e: CorruptCheckpoint) -> None:
        """A durable checkpoint failed its checksums: one event and one stderr line; the restore goes
        on with the next older one."""
        self.log.event(
            ReplicaEvent.CHECKPOINT_CORRUPT, step=e.step, file=e.file, problem=e.problem, moved_to=str(e.moved_to)
        )
        print(f"ftjax train: {e}; moved to {e.moved_to}, trying an older checkpoint", file=sys.stderr, flush=True)

    def _save(self, force: bool) -> None:
        """A durable checkpoint when one is due, of a finite state only: a peer whose own loss was
        finite has applied the average of one that was not (docs/design/step.md, "A loss that is not finite")."""
        assert self.ckpt is not None  # (called only with durable checkpoints)
        if not self.ckpt.due(self.step, force=force):
            return
        if not all_finite(self.state):
            raise NotFinite(
                f"replica {self.replica_id}: step {self.step}: its state holds a NaN or an infinity after the "
                "update (the average of a replica whose loss was not finite?): stopping before it is checkpointed"
            )
        self.ckpt.maybe_save(self.step, self.state, self._meta(), force=force)

    # --- the end ----------------------------------------------------------------------------------
    def _finish(self) -> int:
        if self.ckpt is not None:
            self._save(force=True)
            self.ckpt.close()
        self.log.summary(
            final_step=self.step,  # the state's step: a replica that caught up at the end logged no step of its own
            **final_digests(self.sync.digest_view(self.state)),
            params_digest=params_digest(self.state),
            replica=self.replica_id,
            incarnation=self.ft.incarnation,
            data_position=self.position,
            data_fingerprint=self.stream.fingerprint,
            commit_failures=self.ft.commit_failures,
            params=param_count(self.state),
            devices=int(self.program.mesh.devices.size),
            processes=jax.process_count(),
        )
        return 0

    def no_progress(self, phase: str, silent_s: float) -> None:
        """The watchdog's verdict (ftjax/runtime/watchdog.py): leave the job and end this process, so that
        the peers go on without this replica and it is restarted."""
        why = (
            f"replica {self.replica_id} host {jax.process_index()}: no progress for {silent_s:.1f} s in "
            f"phase '{phase}' (ft.progress_timeout_s={self.cfg.ft.progress_timeout_s}); a host of this "
            "replica hung, or this process did: leaving the job so that it goes on, to be restarted"
        )
        self.log.event(
            ReplicaEvent.PROGRESS_TIMEOUT, phase=phase, silent_s=round(silent_s, 3), host=jax.process_index()
        )
        print(f"ftjax train: {why}", file=sys.stderr, flush=True)
        self.ft.leave_now(why)
        self.log.close()  # (os._exit runs no `finally`: the event files would lose their unflushed tail)
        os._exit(EXIT_NO_PROGRESS)
