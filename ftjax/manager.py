"""The step protocol of a fault-tolerant replica (docs/design.md, "One step").

One `Manager` per process of a replica owns the protocol; its leader (process 0) also talks to the
coordinator and serves catch-up snapshots. Each step:

1. the leader's quorum request for step n is already in flight while this host computes the
   gradients of step n (async dispatch);
2. the leader's quorum is broadcast to the replica's hosts;
3. local gradient shards go to host as one flat buffer; FTAR (host rank h of every participant)
   averages it over the contributors; a healing member relays zeros;
4. two-phase commit: every host votes; the update is applied only if all hosts' FTAR succeeded.
   Otherwise the step is discarded, the failed peer reported, and step n retried with the same batch;
5. a replica that is behind, or has no state, heals: it fetches a snapshot from its assigned source
   in the background, keeps the averaged gradients it receives meanwhile, and replays them through
   the same jitted update once the snapshot is installed, so it ends bitwise in step.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import shutil
import os
import sys
import time
from dataclasses import fields
from pathlib import Path

import jax
import numpy as np

from coordinator.client import CoordinatorClient, MemberInfo, QuorumResult, new_incarnation
from coordinator.quorum import Participant
from ftjax.catchup import SnapshotFetch, SnapshotServer, restore_snapshot, snapshot_dir
from ftjax.checkpoint import DurableCheckpoints
from ftjax.config import Config
from ftjax.data import make_stream
from ftjax.digest import state_digest
from ftjax.faults import FaultPlan, parse_die_at
from ftjax.flat import HostFlattener
from ftjax.ftar import FTAREndpoint, FTARError
from ftjax.metrics import MetricsLog
from ftjax.replica_comm import ReplicaComm
from ftjax.replay import ReplayBuffer
from ftjax.watchdog import ProgressWatchdog
from ftjax.step import build_program, device_batch, param_count


def lr_scale(policy: str, live: int, total: int) -> float:
    """Learning-rate response to missing replicas (FT-HSDP paper: sqrt beat linear beat none)."""
    frac = min(live, total) / total
    return {"none": 1.0, "linear": frac, "sqrt": math.sqrt(frac)}[policy]


def _quorum_to_json(q: QuorumResult) -> dict:
    """A quorum as plain JSON, to broadcast it to the replica's other hosts."""
    d = {f.name: getattr(q, f.name) for f in fields(q)}
    d["participants"] = [dict(p._asdict()) for p in q.participants]
    return d


def _quorum_from_json(d: dict) -> QuorumResult:
    d = dict(d)
    d["participants"] = tuple(Participant(**{**p, "ftar_addresses": tuple(p["ftar_addresses"])})
                              for p in d["participants"])
    return QuorumResult(**d)


EXIT_NO_PROGRESS = 75  # the progress watchdog ended the process (a restart may help: EX_TEMPFAIL)


class JobStateLost(RuntimeError):
    """The job has committed steps but no live peer and no durable checkpoint holds its state."""


class Manager:
    def __init__(self, cfg: Config, args: argparse.Namespace, out: Path, token: str):
        self.cfg, self.out, self.token = cfg, out, token
        self.replica_id = str(args.replica_id)
        self.comm = ReplicaComm()
        self.host = self.comm.rank
        self.leader = self.host == 0
        self.program = build_program(cfg)
        self.program.precompile()  # before joining: a late compile would stall every peer's FTAR
        self.abstract = self.program.abstract_state()
        self.flat = HostFlattener(self.abstract["params"], self.program.grad_shardings)
        self.stream = make_stream(cfg, replica=args.replica_id)
        self.faults = FaultPlan(parse_die_at(getattr(args, "die_at", None)),
                                parse_die_at(getattr(args, "hang_at", None), "--hang-at"))
        self.watchdog: ProgressWatchdog | None = None
        self.log = MetricsLog(out, enabled=self.leader, total_steps=cfg.steps, label=f"replica {self.replica_id}")
        self.ckpt = None
        if cfg.checkpoint.every > 0:
            self.ckpt = DurableCheckpoints.from_config(cfg, out, data_fingerprint=self.stream.fingerprint)
        self.endpoint = FTAREndpoint(token, timeout_s=cfg.ft.ftar_timeout_s, shared_memory=cfg.ft.ftar_shared_memory)
        ftar_addresses = self.comm.allgather(self.endpoint.address)
        self.catchup_dir = snapshot_dir(cfg.ft.catchup_dir, out)
        if self.leader:  # what a killed incarnation of this replica left behind (it may be in RAM)
            shutil.rmtree(self.catchup_dir, ignore_errors=True)
        self.snapshots = SnapshotServer(token, self.catchup_dir / "served", serve=self.leader,
                                        rate_limit_mbps=cfg.ft.catchup_rate_limit_mbps)
        self.topology = hashlib.sha256(self.program.topology().encode()).hexdigest()[:16]
        self.incarnation = self.comm.broadcast(new_incarnation() if self.leader else None)
        self.client = None
        if self.leader:
            info = MemberInfo(replica_id=self.replica_id, incarnation=self.incarnation, num_hosts=self.comm.hosts,
                              ftar_addresses=tuple(ftar_addresses), catchup_address=self.snapshots.address,
                              topology_fingerprint=self.topology)
            self.client = CoordinatorClient(args.coordinator, token, info,
                                            quorum_timeout_s=cfg.ft.quorum_timeout_s)
        # training state of this replica
        self.state = None
        self.step = 0              # steps committed (the state's step when it has one)
        self.position = 0          # next batch of this replica's own stream
        self.commit_failures = 0   # since the last successful step (tells the coordinator)
        self.total_commit_failures = 0
        self.fetch: SnapshotFetch | None = None
        self.fetch_source: str = ""
        # averaged updates received while healing, replayed on install (RAM-bounded, spills to local disk)
        self.buffer = ReplayBuffer(out / f"replay-host{self.host}", int(cfg.ft.catchup_buffer_mib * 2**20))
        self.job_step = 0          # the highest step of a quorum with state this process has seen
        self.known_positions: dict[str, int] = {}  # leader: every replica's data position, as far as we know
        self.state_lost_since: float | None = None
        self.heal_started: float | None = None
        self.fetch_count = 0

    # --- helpers ------------------------------------------------------------------------------
    @property
    def has_state(self) -> bool:
        return self.state is not None

    def _ask(self):
        """Start the leader's quorum request for the next step (the future is read later)."""
        if self.leader:
            return self.client.quorum_async(self.step, self.position, self.has_state, self.commit_failures)
        return None

    def _meta(self) -> dict:
        return {"step": self.step, "data_position": self.position, "data_fingerprint": self.stream.fingerprint}

    def _init_state(self) -> None:
        """Nobody in the quorum has state: the latest durable checkpoint, else a fresh init from the
        seed, but only at job start. Once this process has seen the job past step 0, seed weights
        would silently restart training: it keeps asking for a peer to heal from instead, and gives
        up with an error after `ft.quorum_timeout_s`."""
        if self.ckpt is not None and self.ckpt.latest_step() is not None:
            self.state, meta = self.ckpt.restore(self.abstract)
            self.step, self.position = int(meta["step"]), int(meta["data_position"])
            self.log.event("restore", restored_step=self.step, data_position=self.position, source="durable")
        elif self.job_step == 0:
            self.state = self.program.init(np.int32(self.cfg.seed))
            self.step = 0
            self.log.event("init", seed=self.cfg.seed)
        else:
            self._wait_for_a_source()

    def _wait_for_a_source(self) -> None:
        now = time.monotonic()
        if self.state_lost_since is None:
            self.state_lost_since = now
            self.log.event("state_unavailable", job_step=self.job_step,
                           reason="no participant has state and there is no durable checkpoint")
        if now - self.state_lost_since > self.cfg.ft.quorum_timeout_s:
            raise JobStateLost(
                f"replica {self.replica_id}: the job was at step {self.job_step}, but for "
                f"{self.cfg.ft.quorum_timeout_s:.0f} s no live peer held its state and there is no durable "
                "checkpoint (checkpoint.every); not restarting the job from the seed")
        time.sleep(0.05)

    def _adopt_position(self, q: QuorumResult) -> None:
        """Where our stream resumes: the job's record, but never below a batch that we trained in a
        committed step (a coordinator that lost its record may say less: the batch would repeat)."""
        position = q.data_position
        if position > self.position:
            self.log.event("batches_committed_by_peers",
                           batch_ids=[self.stream.batch_id(p) for p in range(self.position, position)])
            self.position = position
        elif position < self.position:
            self.log.event("position_kept", position=self.position, coordinator_said=position)

    def _record_positions(self, q: QuorumResult, committed: bool) -> None:
        """The leader's own record of every replica's data position (see PositionLedger): what the
        quorum hands out, and past each contributor's batch once a step is committed. It travels to
        the coordinator with each new heartbeat stream, so a restarted coordinator loses nothing."""
        if not self.leader:
            return
        known = {} if q.no_state else self.known_positions
        for p in q.participants:
            done = p.data_position + (1 if committed and not p.healing else 0)
            if done > known.get(p.replica_id, 0):
                known[p.replica_id] = done
        self.known_positions = known
        self.client.known_positions = dict(known)

    def _healing(self, q: QuorumResult) -> None:
        """We are behind the job or have no state. A stale state is kept (not dropped) until a
        snapshot replaces it: if the quorum that put us behind was wrong (a member that reported an
        absurd step, say), the next one finds us up to date again and nothing was lost."""
        if self.has_state and self.heal_started is None:
            self.log.event("stale_state", step=self.step, job_step=q.step)
        if self.heal_started is None:
            self.heal_started = time.monotonic()
        self.faults.point(q.step + 1, "catchup")

    def _up_to_date(self, q: QuorumResult) -> None:
        if self.heal_started is not None:  # a catch-up no longer needed: we hold the job's step
            self.log.event("catchup_cancelled", step=self.step, buffered=len(self.buffer))
            self.buffer.clear()
            self.heal_started = None
        self._serve(q)

    def _serve(self, q: QuorumResult) -> None:
        """Source role: snapshot our state for each peer that heals from us, once per peer incarnation."""
        keys = set()
        for p in q.heal_targets:
            key = f"{p.replica_id}/{p.incarnation}"
            keys.add(key)
            if self.has_state and not self.snapshots.offered(key):
                self.snapshots.offer(key, self.state, self.step, self._meta())
                self.log.event("snapshot_offered", to=p.replica_id, at_step=self.step)
        self.snapshots.keep_only(keys)

    def _heal_bookkeeping(self, q: QuorumResult) -> dict | None:
        """Newcomer role (leader): start or restart the fetch; report a finished one to all hosts."""
        me = q.participants[q.rank]
        if not me.healing:
            if self.fetch is not None:
                self.log.event("catchup_abandoned", source=self.fetch_source, reason="no longer behind")
            self.fetch = None
            return None
        source_alive = any(p.replica_id == self.fetch_source for p in q.participants)
        if self.fetch is not None and self.fetch.done.is_set():
            fetch, self.fetch = self.fetch, None
            if fetch.result is not None:
                r = fetch.result
                return {"path": str(r.path), "step": r.step, "meta": r.meta, "nbytes": r.nbytes,
                        "seconds": r.seconds, "source": r.source}
            self.log.event("catchup_failed", source=fetch.source, error=fetch.error)
        if self.fetch is not None and not source_alive:
            self.log.event("catchup_abandoned", source=self.fetch_source, reason="source left the quorum")
            self.fetch = None
        if self.fetch is None and q.heal_source:
            missing = self.buffer.first_missing(q.step)
            self.fetch_count += 1
            self.fetch_source = q.heal_source
            self.fetch = SnapshotFetch(q.heal_source_address, f"{me.replica_id}/{me.incarnation}", self.token,
                                       self.catchup_dir / f"fetch{self.fetch_count}", source=q.heal_source,
                                       min_step=missing, timeout_s=self.cfg.ft.quorum_timeout_s)
            self.log.event("catchup_started", source=q.heal_source, at_step=q.step, min_step=missing)
        return None

    def _install(self, got: dict, q: QuorumResult) -> None:
        """Every host: restore the fetched snapshot into our mesh and replay the buffered updates."""
        with self.watchdog.exempt("snapshot restore"):
            state = restore_snapshot(got["path"], self.abstract)
        self.comm.allgather(None)  # every host has read the snapshot: it can go (it may be in RAM)
        if self.leader:
            shutil.rmtree(got["path"], ignore_errors=True)
        step = got["step"]
        replayed = 0
        while step < q.step:
            if step not in self.buffer:
                self.log.event("catchup_gap", snapshot_step=got["step"], missing=step)
                return  # incomplete: the next quorum asks for a fresher snapshot
            g, scale = self.buffer.get(step)
            state = self.program.apply(state, self.flat.unflatten(g), np.float32(scale))
            step += 1
            replayed += 1
            self.watchdog.beat(f"replay of step {step}")
        self.state, self.step = state, step
        spilled = self.buffer.spilled_bytes
        self.buffer.clear()
        seconds = time.monotonic() - self.heal_started if self.heal_started else 0.0
        self.log.event("catchup_done", source=got["source"], snapshot_step=got["step"], at_step=step,
                       bytes=got["nbytes"], transfer_s=got["seconds"],
                       mb_per_s=got["nbytes"] / 1e6 / max(got["seconds"], 1e-9), replayed=replayed,
                       update_bytes=self.flat.size * 4, replay_spilled_bytes=spilled, catchup_s=seconds)
        self.heal_started = None

    # --- the loop -----------------------------------------------------------------------------
    def run(self) -> int:
        cfg = self.cfg
        if self.leader:
            self.client.start()
        self.watchdog = ProgressWatchdog(cfg.ft.progress_timeout_s, self._no_progress)
        self.log.event("start", replica=self.replica_id, incarnation=self.incarnation, topology=self.topology,
                       data_fingerprint=self.stream.fingerprint, hosts=self.comm.hosts,
                       devices=int(self.program.mesh.devices.size), pid=os.getpid())
        tokens = cfg.data.batch_size * cfg.model.seq_len
        zeros = np.zeros(self.flat.size, np.float32)
        fut = self._ask()
        while self.step < cfg.steps:
            self.watchdog.beat("forward")
            t0 = time.perf_counter()
            grads = loss = None
            used_position = self.position
            if self.has_state and self.heal_started is None:  # (a healing replica contributes nothing)
                self.faults.point(self.step + 1, "forward")
                batch = device_batch(self.program, self.stream.batch(self.position))
                loss, grads = self.program.grads(self.state["params"], batch)
                jax.block_until_ready(grads)
            t1 = time.perf_counter()
            msg = None
            if self.leader:
                with self.watchdog.exempt("quorum"):
                    q = fut.result()
                msg = {"q": _quorum_to_json(q),
                       "install": self._heal_bookkeeping(q) if (q.healing or self.fetch) else None}
                self.watchdog.beat("quorum broadcast")
                msg = self.comm.broadcast(msg)
            else:  # (the leader's message waits for the quorum)
                with self.watchdog.exempt("quorum"):
                    msg = self.comm.broadcast(msg)
            q, install = _quorum_from_json(msg["q"]), msg.get("install")
            t2 = time.perf_counter()

            if q.no_state:
                # nobody has state: everyone restores its latest durable checkpoint (or inits), then asks again
                with self.watchdog.exempt("init"):
                    self._init_state()
                fut = self._ask()
                continue
            self.job_step, self.state_lost_since = max(self.job_step, q.step), None
            self._record_positions(q, committed=False)
            if install is not None:
                self._install(install, q)  # replaces a stale state, if we kept one
            if q.healing:
                self._healing(q)
            else:
                self._up_to_date(q)

            self._adopt_position(q)
            if q.step >= cfg.steps:
                # the job has trained every step: nothing to reduce; this replica only catches up
                time.sleep(0.05)
                fut = self._ask()
                continue

            contributes = not q.healing and self.has_state
            if contributes and (grads is None or used_position != self.position):  # (rare) our batch changed
                batch = device_batch(self.program, self.stream.batch(self.position))
                loss, grads = self.program.grads(self.state["params"], batch)

            # FTAR of this host's flat gradient buffer over host rank `self.host` of every participant
            self.faults.point(q.step + 1, "ftar")
            buf = self.flat.flatten(grads) if contributes else zeros
            self.watchdog.beat("ftar")
            t3 = time.perf_counter()
            members = [p.ftar_addresses[self.host] for p in q.participants]
            contributors = [not p.healing for p in q.participants]
            error = None
            try:
                avg = self.endpoint.allreduce(buf, quorum_id=q.quorum_id, step=q.step, members=members,
                                              rank=q.rank, contributors=contributors)
            except FTARError as e:
                error = {"peer": e.peer, "error": f"{type(e).__name__}: {e}"}
            t4 = time.perf_counter()

            # two-phase commit inside the replica: apply only if every host's FTAR succeeded
            self.watchdog.beat("commit vote")
            votes = self.comm.allgather(error)
            self.watchdog.beat("commit")
            failed = [v for v in votes if v is not None]
            if failed:
                self._discard(q, failed)
                fut = self._ask()
                continue
            self.faults.point(q.step + 1, "commit")
            scale = lr_scale(cfg.ft.lr_scaling, q.num_contributors, cfg.ft.replicas)
            batch_id = None
            applied = self.has_state and self.step == q.step
            # a step we apply is committed for the job: every contributor's batch of it is trained
            self._record_positions(q, committed=applied)
            if applied:
                self.state = self.program.apply(self.state, self.flat.unflatten(avg), np.float32(scale))
                self.step += 1
                if contributes:
                    batch_id = self.stream.batch_id(self.position)
                    self.position += 1
            else:  # healing: keep the update for the replay
                self.buffer.put(q.step, avg, scale)
            self.commit_failures = 0
            fut = self._ask()  # the next quorum is requested while this step finishes
            if self.ckpt is not None and applied:
                self.ckpt.maybe_save(self.step, self.state, self._meta())
            t5 = time.perf_counter()
            record = {
                "step": q.step + 1, "committed": applied, "healing": not contributes,
                "loss": float(loss) if contributes else None, "tokens": tokens if contributes else 0,
                "batch_id": batch_id, "data_position": self.position, "quorum_id": q.quorum_id,
                "participants": len(q.participants), "contributors": q.num_contributors, "lr_scale": scale,
                "step_time_s": t5 - t0, "compute_s": t1 - t0, "quorum_wait_s": t2 - t1, "d2h_s": t3 - t2,
                "ftar_s": t4 - t3, "commit_s": t5 - t4, "commit_failures": self.total_commit_failures,
            }
            if applied and cfg.ft.digest_every and self.step % cfg.ft.digest_every == 0:
                record["param_digest"] = state_digest(self.state)
            self.log.log(record)
            self.watchdog.arm()  # a step is done: from now on this process must make progress
        with self.watchdog.exempt("drain"):
            self._drain(fut)
        return self._finish()

    def _drain(self, fut) -> None:
        """Training is over for this replica, maybe not for a peer that is restarting or catching
        up: keep answering quorums at the final step and serving snapshots until every replica of
        the job holds the final state, or `ft.drain_timeout_s` passes. Without this a replica
        killed near the end would find nobody to catch up from."""
        deadline = time.monotonic() + self.cfg.ft.drain_timeout_s
        while True:
            q = self.comm.broadcast(_quorum_to_json(fut.result()) if self.leader else None)
            q = _quorum_from_json(q)
            self._serve(q)
            everyone = len(q.participants) >= self.cfg.ft.replicas and not any(p.healing for p in q.participants)
            if everyone or time.monotonic() > deadline:
                if not everyone:
                    self.log.event("drain_timeout", participants=len(q.participants),
                                   healing=[p.replica_id for p in q.participants if p.healing])
                return
            time.sleep(0.05)
            fut = self._ask()

    def _discard(self, q: QuorumResult, failed: list[dict]) -> None:
        self.commit_failures += 1
        self.total_commit_failures += 1
        self.log.event("commit_failure", step=q.step + 1, quorum_id=q.quorum_id, errors=failed)
        if self.leader:
            by_address = {a: p for p in q.participants for a in p.ftar_addresses}
            for f in failed:
                p = by_address.get(f["peer"])
                if p is not None and p.replica_id != self.replica_id:
                    self.client.report_failure(q.quorum_id, p.replica_id, p.incarnation, f["error"][:200])

    def _finish(self) -> int:
        if self.ckpt is not None:
            self.ckpt.maybe_save(self.step, self.state, self._meta(), force=True)
            self.ckpt.close()
        digest = state_digest(self.state)
        self.log.summary(param_digest=digest, replica=self.replica_id, incarnation=self.incarnation,
                         data_position=self.position, commit_failures=self.total_commit_failures,
                         params=param_count(self.state))
        self.close()
        return 0

    def _no_progress(self, phase: str, silent_s: float) -> None:
        """The watchdog's verdict (see ftjax/watchdog.py): leave the job and end this process, so
        that the peers go on without this replica and it is restarted."""
        why = (f"replica {self.replica_id} host {self.host}: no progress for {silent_s:.1f} s in phase "
               f"'{phase}' (ft.progress_timeout_s={self.cfg.ft.progress_timeout_s}); a host of this replica "
               "hung, or this process did: leaving the job so that it goes on, to be restarted")
        self.log.event("progress_timeout", phase=phase, silent_s=round(silent_s, 3), host=self.host)
        print(f"ftjax train: {why}", file=sys.stderr, flush=True)
        if self.client is not None:
            self.client.leave(why)
        os._exit(EXIT_NO_PROGRESS)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
        if self.client is not None:
            self.client.close()
        self.endpoint.close()
        self.snapshots.close()
        if self.leader:
            shutil.rmtree(self.catchup_dir, ignore_errors=True)
        self.log.close()


def run_member(cfg: Config, args: argparse.Namespace, out: Path) -> int:
    token = os.environ.get("FTJAX_TOKEN", "")
    if not token:
        print("ftjax train: --coordinator needs the job token in $FTJAX_TOKEN", file=sys.stderr)
        return 2
    manager = Manager(cfg, args, out, token)
    try:
        code = manager.run()
    except BaseException:
        manager.close()
        raise
    if cfg.mesh.hosts > 1:
        jax.distributed.shutdown()
    return code
