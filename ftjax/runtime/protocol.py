"""The fault-tolerant step of one replica host, and nothing else (docs/design/step.md, "One step").

`StepProtocol` owns what happens between replicas: the quorum of each step (asked by the leader
while the step computes, handed to the replica's other hosts as the coordinator's own protobuf
message), the average of a gradient update over the quorum's contributors (or the peer that
failed it), the replica's two-phase vote, failure reports, and the healing hooks (serve a snapshot
to a peer, fetch one, keep the updates received meanwhile, install and replay). It is built from
its collaborators, so a test can pass fakes:

- `quorums`: where quorums come from: the leader's `CoordinatorClient`, `LocalQuorum` for a
  standalone run (a quorum of one, at once), None on the replica's other hosts;
- `reducer`: averages an update over the quorum (`ftjax.runtime.reduce`: FTAR, or the identity);
- `transport`: how a state travels to a healing peer (`ftjax.runtime.catchup.CatchupTransport`);
- `group`: the hosts of this replica (a `HostGroup`; `JaxHostGroup` in a real process): rank, broadcast, allgather;
- `buffer`: the updates kept while healing (`ftjax.runtime.replay.ReplayBuffer`);
- `log` and `watchdog`: where events go, and who is told that the loop moves on.

What the training loop owns (`ftjax.runtime.trainer`): the state, the data stream, checkpoints, metrics and
fault injection. Its one owner is `FaultTolerance` (ftjax/runtime/manager.py): nobody else holds a
`StepProtocol` once it is built, nor reaches through it to a collaborator (tests/unit/test_layout.py).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from typing import Any, Protocol, TypeAlias, TypeVar

from ftjax.base.net import ADVERTISE_ENV, is_loopback
from ftjax.coordinator.codec import decode_quorum, encode_quorum
from ftjax.coordinator.quorum import Participant
from ftjax.coordinator.types import CoordinatorError, JobFinished, QuorumResult
from ftjax.ftar import FTARError
from ftjax.runs.events import ReplicaEvent
from ftjax.runtime.catchup import CatchupTransport, FetchResult, SnapshotFetch, source_hosts
from ftjax.runtime.lanes import lane_host
from ftjax.runtime.replay import ReplayBuffer
from ftjax.runtime.watchdog import NoWatchdog

# A pytree of arrays: a replica's state, a gradient update, their templates. Its structure is the
# user's model's (any nesting of dicts, lists, dataclasses, flax modules' states): the runtime passes
# it on to JAX and never looks inside, and JAX names no type for it.
PyTree: TypeAlias = Any
T = TypeVar("T")


class EventLog(Protocol):
    """Where a replica's events go (`MetricsLog`; ftjax/runs/events.py names them)."""

    def event(self, kind: str, **fields: object) -> None: ...  # (fields: JSON values)


class Watchdog(Protocol):
    """Who is told that the loop moves on (`ProgressWatchdog`, `NoWatchdog`)."""

    def beat(self, phase: str) -> None: ...
    def exempt(self, phase: str) -> AbstractContextManager[None]: ...


class QuorumSource(Protocol):
    """Where quorums come from, and where votes and failure reports go: `CoordinatorClient`, `LocalQuorum`."""

    known_positions: dict[str, int]

    def quorum_async(
        self, step: int, data_position: int, has_state: bool, commit_failures: int = 0, digest: str = ""
    ) -> Future: ...
    def report_failure(self, quorum_id: int, replica_id: str, incarnation: str, reason: str = "") -> bool: ...
    def vote_commit(self, q: QuorumResult, ok: bool, reason: str, timeout_s: float) -> tuple[str, str]: ...
    def leave(self, reason: str) -> None: ...
    def close(self) -> None: ...


class Reducer(Protocol):
    """Averages an update over a quorum (ftjax/runtime/reduce.py: FTAR, or the identity)."""

    def average(self, q: QuorumResult, grads: PyTree | None) -> PyTree: ...  # raises FTARError
    def tree(self, update: PyTree) -> PyTree: ...
    def detach(self, update: PyTree) -> PyTree: ...  # what the replay may keep past the next step
    def close(self) -> None: ...


class HostGroup(Protocol):
    """The hosts of one replica (`JaxHostGroup`): the leader's word to all, everyone's to each."""

    rank: int
    hosts: int

    def broadcast_bytes(self, data: bytes) -> bytes: ...
    def allgather(self, obj: T) -> list[T]: ...


@dataclass(frozen=True)
class Agreement:
    """What a host of the replica knows before the step: the quorum (the same on every host), and
    the snapshot to install now (this host's part of it, fetched from the same host of the source)."""

    quorum: QuorumResult | None  # None: the replica leaves the job instead (`leave` says why)
    install: FetchResult | None = None
    leave: str | None = None
    finished: int | None = None  # leaving because the job finished at this step (nothing left to train)


@dataclass(frozen=True)
class HealOrder:
    """The leader's catch-up decision for a step, carried out by every host: drop the fetch in
    flight, install what every host fetched, and/or start a fetch (each host from the same host of
    the source) of a snapshot no older than `fetch_min_step`."""

    drop: bool = False
    install: bool = False
    fetch_min_step: int | None = None
    leave: str | None = None  # the replica leaves the job at this step boundary (no quorum was asked)
    finished: int | None = None  # ... because the job finished at this step (coordinator/client.py JobFinished)


class LocalQuorum:
    """The quorum source of a standalone run: a quorum of this replica alone, at once. With it the
    protocol needs no coordinator, and the standalone loop is the fault-tolerant one. It owns nothing
    but the replica's id; its methods are `QuorumSource`'s (a vote commits what every host averaged)."""

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self.known_positions: dict[str, int] = {}

    def quorum_async(
        self, step: int, data_position: int, has_state: bool, commit_failures: int = 0, digest: str = ""
    ) -> Future:
        me = Participant(self.replica_id, "local", step, data_position, (), (), False, "")
        future: Future = Future()
        future.set_result(
            QuorumResult(
                quorum_id=1,
                step=step,
                participants=(me,),
                rank=0,
                healing=False,
                heal_source="",
                heal_source_addresses=(),
                num_contributors=1,
                data_position=data_position,
                no_state=not has_state,
            )
        )
        return future

    def report_failure(self, quorum_id: int, replica_id: str, incarnation: str, reason: str = "") -> bool:
        raise AssertionError("a standalone run has no peer to report")

    def vote_commit(self, q: QuorumResult, ok: bool, reason: str, timeout_s: float) -> tuple[str, str]:
        return ("COMMIT", "a replica alone") if ok else ("ABORT", reason)

    def leave(self, reason: str) -> None:
        pass

    def close(self) -> None:
        pass


UNREACHABLE_AFTER_S = 10.0  # consecutive failed attempts on one peer for this long: say so
PROGRESS_EVERY_S = 2.0  # a long catch-up says how far it is this often (a short one never does)


class UnreachablePeers:
    """Which peers every attempt at a step fails on, and for how long (no clock of its own).

    The same peer named in consecutive failed attempts (`failed`, with the time each attempt
    began), for `after_s` or more and in two attempts at least, is *unreachable*: it is reported
    once (`failed` returns it), until an attempt succeeds (`succeeded`). A peer whose connections
    are refused fails an attempt within milliseconds, one that drops them within the FTAR timeout
    (10 s by default): either way it is reported within 2 x max(after_s, FTAR timeout) of the first
    failed attempt."""

    def __init__(self, after_s: float = UNREACHABLE_AFTER_S) -> None:
        self.after_s = after_s
        self._streaks: dict[str, tuple[float, int]] = {}  # peer -> (first attempt began, attempts)
        self._told: set[str] = set()

    def failed(self, peers: set[str], began: float, now: float) -> list[tuple[str, float, int]]:
        """An attempt that began at `began` failed naming `peers`. Returns (peer, seconds, attempts)
        of each peer that has just become unreachable."""
        self._streaks = {
            p: (
                self._streaks[p][0] if p in self._streaks else began,
                self._streaks[p][1] + 1 if p in self._streaks else 1,
            )
            for p in peers
        }
        out = []
        for peer, (since, attempts) in self._streaks.items():
            if attempts >= 2 and now - since >= self.after_s and peer not in self._told:
                self._told.add(peer)
                out.append((peer, now - since, attempts))
        return out

    def succeeded(self) -> None:
        """An attempt went through: every streak ends, and a peer may be reported again."""
        self._streaks.clear()
        self._told.clear()


def unreachable_message(
    replica_id: str, step: int, peer: str, who: str, seconds: float, attempts: int, error: str
) -> str:
    """What a replica prints when every attempt at a step fails on the same peer: the address, and
    what to check."""
    host = peer.rsplit(":", 1)[0].strip("[]")
    loop = (
        f" {host} is a loopback address, which only the peer's own machine can reach: if the peer "
        "runs on another machine, it advertises the wrong address."
        if is_loopback(host)
        else ""
    )
    return (
        f"replica {replica_id}: no progress for {seconds:.0f} s: all {attempts} attempts at step {step} failed "
        f"on {who} at {peer} ({error}).{loop} Check that this machine can reach {peer}: a firewall between "
        "the machines (the peer's FTAR and catch-up ports), a route, and the address the peer advertises "
        "(it prints it when it starts; by default the source address of its route to the coordinator; set "
        f"${ADVERTISE_ENV}, net.advertise_host or net.interface on the peer to one its peers can reach)."
    )


class StepProtocol:
    """The fault-tolerant step of one host of a replica (this module's docstring). It owns its
    collaborators (quorum source, reducer, transport, host group, replay buffer) and the protocol's
    bookkeeping (commit failures, known data positions, the catch-up in flight); it must not touch
    the replica's state, step or data position, which its owner (`FaultTolerance`) holds and passes
    in. Only that owner calls it; a loop goes through the owner."""

    def __init__(
        self,
        *,
        replica_id: str,
        incarnation: str,
        group: HostGroup,
        reducer: Reducer,
        transport: CatchupTransport | None,
        quorums: QuorumSource | None,
        buffer: ReplayBuffer,
        log: EventLog,
        watchdog: Watchdog | None = None,
        unreachable_after_s: float = UNREACHABLE_AFTER_S,
        commit_decision: str = "ring",
        decision_timeout_s: float = 5.0,
        decision_patience_s: float = 120.0,
    ) -> None:
        self.replica_id, self.incarnation = replica_id, incarnation
        self.group, self.reducer, self.transport, self.quorums = group, reducer, transport, quorums
        self.buffer, self.log = buffer, log
        self.watchdog: Watchdog = watchdog or NoWatchdog()
        self.leader = group.rank == 0
        self.commit_failures = 0  # since the last committed step (tells the coordinator)
        self.total_commit_failures = 0
        self.known_positions: dict[str, int] = {}  # leader: every replica's data position, as far as we know
        self._pending: Future | None = None
        self._attempt_began = time.monotonic()
        self.unreachable = UnreachablePeers(unreachable_after_s)
        self.fetch: SnapshotFetch | None = None
        self.heal_started: float | None = None
        self._progress_at = time.monotonic()  # the last catchup_progress event (none in the first seconds)
        self.leaving: str | None = None  # leader: leave at the next step boundary (why)
        # ft.commit_decision: "coordinator" asks the coordinator whether the step commits (`_vetoed`),
        # waiting up to `decision_timeout_s` (ft.ftar_timeout_s: a peer may fail its ring that late)
        self.commit_decision, self.decision_timeout_s = commit_decision, decision_timeout_s
        self.decision_patience_s = decision_patience_s  # (ft.quorum_timeout_s: see `_ask_decision`)
        self.decision_s: float | None = None  # the last step's wait for its decision (metrics.jsonl)

    # --- what only some hosts hold: each use says why it is there ---------------------------------
    def _coordinator(self) -> QuorumSource:
        """The coordinator's client: the leader host's only (every call through it is the leader's)."""
        assert self.quorums is not None, "only a replica's leader host talks to the coordinator"
        return self.quorums

    def _transport(self) -> CatchupTransport:
        """Catch-up: every host of a replica in a job has one (a standalone replica never heals)."""
        assert self.transport is not None, "catch-up without a transport (a standalone replica never heals)"
        return self.transport

    def _fetching(self) -> SnapshotFetch:
        """The snapshot fetch in flight (the leader decided on it, so every host started it)."""
        assert self.fetch is not None, "no snapshot fetch in flight"
        return self.fetch

    # --- the quorum ---------------------------------------------------------------------------
    def ask(self, step: int, position: int, has_state: bool, digest: str = "") -> None:
        """Start the leader's request for the quorum of the next step (answered in `agree`);
        `digest`: of the state at `step`, when this step computed one (the coordinator compares)."""
        if self.leader and self.leaving is not None:  # no request: the coordinator drops us now
            self._pending = None
            self.leave(self.leaving)
        elif self.leader:
            self._pending = self._coordinator().quorum_async(step, position, has_state, self.commit_failures, digest)

    def agree(self) -> Agreement:
        """Wait for the quorum the leader asked for; every host gets it, and the leader's catch-up
        decision (made from every host's fetch), in one broadcast."""
        with self.watchdog.exempt("quorum"):  # (the leader's message waits for the quorum)
            fetches = self._fetch_states()
            if not self.leader:
                return self._carry_out(*_decode_agreement(self.group.broadcast_bytes(b"")))
            q, order = None, HealOrder(leave=self.leaving)  # no request: leaving, every host ends here
            try:
                q = self._pending.result() if self._pending is not None else None
            except JobFinished as e:  # nothing left to train: every host ends here too
                order = HealOrder(leave=str(e), finished=e.step)
            if q is None:
                if self.group.hosts > 1:
                    self.group.broadcast_bytes(_encode_agreement(None, order))
                return Agreement(None, leave=order.leave, finished=order.finished)
        order = self._heal_bookkeeping(q, fetches) if (q.healing or self.fetch is not None) else HealOrder()
        if not q.no_state:
            self.record_positions(q, committed=False)
        self.watchdog.beat("quorum broadcast")
        if self.group.hosts > 1:
            self.group.broadcast_bytes(_encode_agreement(q, order))
        return self._carry_out(q, order)

    # --- averaging and the vote -----------------------------------------------------------------
    def average(self, q: QuorumResult, grads: PyTree | None) -> tuple[PyTree, dict | None]:
        """(the averaged update, None), or (None, the failure: the peer at fault and why). `grads`
        is None when this replica contributes nothing (it heals): it relays zeros."""
        self.watchdog.beat("ftar")
        self._attempt_began = time.monotonic()
        try:
            return self.reducer.average(q, grads), None
        except FTARError as e:
            return None, {"peer": e.peer, "error": f"{type(e).__name__}: {e}"}

    def vote(self, q: QuorumResult, error: dict | None) -> bool:
        """The replica's two-phase commit: True only if every host's average succeeded. Otherwise
        the step is discarded (and retried with the same batch), and the leader reports the
        peers at fault."""
        self.watchdog.beat("commit vote")
        failed = [v for v in self.group.allgather(error) if v is not None]
        self.watchdog.beat("commit")
        if self.commit_decision == "coordinator" and self._vetoed(q, failed):
            return False
        if not failed:
            self.unreachable.succeeded()
            return True
        self._count_failure()
        self.log.event(ReplicaEvent.COMMIT_FAILURE, step=q.step + 1, quorum_id=q.quorum_id, errors=failed)
        by_address = {
            a: (p, lane_host(lane, len(p.catchup_addresses), len(p.ftar_addresses)))
            for p in q.participants
            for lane, a in enumerate(p.ftar_addresses)
        }
        if self.leader:
            for f in failed:
                p = by_address.get(f["peer"], (None, 0))[0]
                if p is None or p.replica_id == self.replica_id:
                    continue
                try:
                    self._coordinator().report_failure(q.quorum_id, p.replica_id, p.incarnation, f["error"][:200])
                except CoordinatorError as e:  # best effort: a dead peer also times out its heartbeats
                    self.log.event(
                        ReplicaEvent.REPORT_UNDELIVERED, step=q.step + 1, replica=p.replica_id, error=str(e)[:200]
                    )
        newly = self.unreachable.failed({f["peer"] for f in failed}, self._attempt_began, time.monotonic())
        for peer, seconds, attempts in newly if self.leader else ():
            p, host = by_address.get(peer, (None, 0))
            who = f"replica {p.replica_id} host {host}" if p is not None else "a peer"
            error = next(f["error"] for f in failed if f["peer"] == peer)
            self.log.event(
                ReplicaEvent.PEER_UNREACHABLE,
                step=q.step + 1,
                peer=peer,
                replica=p.replica_id if p else None,
                host=host,
                seconds=round(seconds, 3),
                attempts=attempts,
                error=error,
            )
            message = unreachable_message(self.replica_id, q.step + 1, peer, who, seconds, attempts, str(error))
            print(f"ftjax train: {message}", file=sys.stderr, flush=True)
        return False

    def step_fields(self) -> dict[str, float]:
        """What the step's record adds from the protocol: the wait for the coordinator's decision."""
        return {} if self.decision_s is None else {"decision_s": self.decision_s}

    def phase_fields(self) -> dict[str, float]:
        """What the step's record adds from the average: the reducer's phases (FTAR's d2h, ring, h2d,
        overlap), {} for a reducer that has none."""
        phases = getattr(self.reducer, "phases", None)
        return {} if phases is None else phases.record()

    def tree(self, update: PyTree) -> PyTree:
        """The averaged `update` as the state's pytree, for `apply` (the reducer's form may be its own)."""
        return self.reducer.tree(update)

    @property
    def has_peers(self) -> bool:
        """A member of a job: peers to serve snapshots to (a standalone run has no transport)."""
        return self.transport is not None

    def leaders_word(self, yes: bool) -> bool:
        """The leader's `yes` on every host of the replica (one broadcast; a host's own with one host):
        a decision every host must take together, on the leader's clock."""
        if self.group.hosts > 1:
            return self.group.broadcast_bytes(b"1" if yes else b"0") == b"1"
        return yes

    def _count_failure(self) -> None:
        self.commit_failures += 1
        self.total_commit_failures += 1

    def _vetoed(self, q: QuorumResult, failed: list[dict]) -> bool:
        """ft.commit_decision coordinator: the leader votes (yes only if no host failed) and every
        host gets the coordinator's decision. True: every host averaged, but the decision was not
        COMMIT (ABORT, PENDING, UNKNOWN, UNREACHABLE, REFUSED; logged here); the step does not
        commit. A no vote's failure is logged and reported by the caller, as without the decision."""
        # (bounded by the vote's own timeout, which may exceed ft.progress_timeout_s's margin)
        began = time.perf_counter()
        with self.watchdog.exempt("commit decision"):
            if self.leader:
                reason = "; ".join(f"{f['peer']}: {f['error']}" for f in failed)[:512]
                decision, detail = self._ask_decision(q, not failed, reason)
                if self.group.hosts > 1:
                    self.group.broadcast_bytes(f"{decision}\n{detail}".encode())
            else:
                decision, _, detail = self.group.broadcast_bytes(b"").decode().partition("\n")
        self.decision_s = time.perf_counter() - began
        self.watchdog.beat("commit")
        if decision == "COMMIT" or failed:
            return False
        self._count_failure()
        self.log.event(
            ReplicaEvent.COMMIT_NOT_DECIDED, step=q.step + 1, quorum_id=q.quorum_id, decision=decision, detail=detail
        )
        return True

    def _ask_decision(self, q: QuorumResult, ok: bool, reason: str) -> tuple[str, str]:
        """The leader's vote and the coordinator's answer. A yes vote whose answer was lost on the
        way (UNREACHABLE) or not there in time (PENDING) is sent again until `decision_patience_s`:
        a COMMIT may have been decided unheard, and were it unheard by every participant, nobody
        would hold the step the job committed (no quorum forms behind it). The replica cannot train
        on without the coordinator anyway; a repeated vote gets the decision made, or ABORT past
        the deadline, or UNKNOWN from a restarted coordinator (which relearns the committed step
        from the members: nobody applied it)."""
        give_up, pause = time.monotonic() + self.decision_patience_s, 0.05
        while True:
            decision, detail = self._coordinator().vote_commit(q, ok, reason, self.decision_timeout_s)
            if not ok or decision not in ("UNREACHABLE", "PENDING") or time.monotonic() + pause >= give_up:
                return decision, detail
            time.sleep(pause)
            pause = min(2 * pause, 2.0)

    def committed(self, q: QuorumResult, applied: bool) -> None:
        """The step went through (the vote passed); `applied`: this replica applied it."""
        self.commit_failures = 0
        if applied and self.transport is not None:  # a replica with a state of its own fetches none now
            self.transport.release()
        self.record_positions(q, committed=applied)  # a step we apply is committed for the job

    def record_positions(self, q: QuorumResult, committed: bool) -> None:
        """The leader's own record of every replica's data position (see PositionLedger): what the
        quorum hands out, and past each contributor's batch once a step is committed. It travels to
        the coordinator with each new heartbeat stream, so a restarted coordinator loses nothing."""
        if not self.leader:
            return
        known, changed = self.known_positions, False
        for p in q.participants:
            done = p.data_position + (1 if committed and not p.healing else 0)
            if done > known.get(p.replica_id, 0):
                known[p.replica_id], changed = done, True
        if changed:  # a copy for the heartbeat thread, which reads it when its stream (re)connects
            self._coordinator().known_positions = dict(known)

    def forget_positions(self) -> None:
        """A whole-job restart from a durable checkpoint: its positions rule, not what we knew."""
        self.known_positions = {}
        if self.leader:
            self._coordinator().known_positions = {}

    # --- healing hooks ------------------------------------------------------------------------
    def serve(self, q: QuorumResult, state: PyTree, step: int, meta: dict) -> None:
        """Source role: snapshot our state for each peer that heals from us, once per incarnation
        (again if the peer asked for a fresher one). Every host snapshots the same step: the peer's
        hosts each fetch from one of ours, and must install parts of one state. Nothing standalone."""
        if self.transport is None:
            return
        keys = {f"{p.replica_id}/{p.incarnation}" for p in q.heal_targets}
        stale = {k for k in keys if not self.transport.offered(k)}
        if keys and self.group.hosts > 1:  # a host that a fetch asked for a fresher one tells all
            stale = set().union(*map(set, self.group.allgather(sorted(stale))))
        for key in sorted(stale) if state is not None else ():
            self.transport.offer(key, state, step, meta)
            self.log.event(ReplicaEvent.SNAPSHOT_OFFERED, to=key.split("/")[0], at_step=step)
        self.transport.keep_only(keys)

    def healing(self, q: QuorumResult, stale_step: int | None) -> None:
        """We are behind the job or have no state (`stale_step`: the step of a state we hold). A
        stale state is kept until a snapshot replaces it: if the quorum that put us behind was
        wrong, the next one finds us up to date again and nothing was lost."""
        if self.heal_started is None:
            if stale_step is not None:
                self.log.event(ReplicaEvent.STALE_STATE, step=stale_step, job_step=q.step)
            self.heal_started = time.monotonic()

    def up_to_date(self, step: int) -> None:
        """The quorum found this replica at the job's step: a catch-up under way is not needed."""
        if self.heal_started is not None:  # a catch-up no longer needed: we hold the job's step
            self.log.event(ReplicaEvent.CATCHUP_CANCELLED, step=step, buffered=len(self.buffer))
            self.buffer.clear()
            self.heal_started = None

    def keep(self, q: QuorumResult, update: PyTree, scale: float) -> None:
        """Healing: keep the averaged update of this step for the replay."""
        self.buffer.put(q.step, self.reducer.detach(update), scale)

    def install(
        self,
        got: FetchResult,
        q: QuorumResult,
        abstract_state: PyTree,
        apply: Callable[[PyTree, PyTree, float], PyTree],
    ) -> tuple[PyTree, int] | None:
        """Every host: restore the fetched snapshot and replay the kept updates through `apply`.
        Returns (state, step), or None if the snapshot is older than the oldest update kept."""
        with self.watchdog.exempt("snapshot restore"):
            state = self._transport().load(got, abstract_state)
        step, replayed = got.step, 0
        while step < q.step:
            if step not in self.buffer:
                self.log.event(ReplicaEvent.CATCHUP_GAP, snapshot_step=got.step, missing=step)
                return None  # incomplete: the next quorum asks for a fresher snapshot
            update, scale = self.buffer.get(step)
            state = apply(state, self.tree(update), scale)
            step, replayed = step + 1, replayed + 1
            self.watchdog.beat(f"replay of step {step}")
        self._caught_up(got, step, replayed)
        return state, step

    def _caught_up(self, got: FetchResult, step: int, replayed: int) -> None:
        spilled = self.buffer.spilled_bytes
        self.buffer.clear()
        seconds = time.monotonic() - self.heal_started if self.heal_started else 0.0
        self.log.event(
            ReplicaEvent.CATCHUP_DONE,
            source=got.source,
            snapshot_step=got.step,
            at_step=step,
            bytes=got.nbytes,
            arena_bytes=got.arena_bytes,
            transfer_s=got.seconds,
            mb_per_s=got.nbytes / 1e6 / max(got.seconds, 1e-9),
            replayed=replayed,
            update_bytes=self.buffer.update_bytes,
            replay_spilled_bytes=spilled,
            catchup_s=seconds,
        )
        self.heal_started = None

    def _fetch_states(self) -> list[dict]:
        """Every host's fetch in flight: done, and its step or error. (A collective only while a
        multi-host replica fetches: every host starts and drops its fetch on the same order.)"""
        if self.fetch is None:
            return []
        f = self.fetch
        mine = {
            "done": f.done.is_set(),
            "error": f.error,
            "step": f.result.step if f.done.is_set() and f.result is not None else None,
            **f.progress(),
        }
        return self.group.allgather(mine) if self.group.hosts > 1 else [mine]

    def _progress(self, fetches: list[dict]) -> None:
        """Leader: a catchup_progress event every PROGRESS_EVERY_S while the replica's hosts fetch
        (bytes of all of them, and the ETA of the slowest)."""
        now = time.monotonic()
        if not fetches or all(f["done"] for f in fetches) or now - self._progress_at < PROGRESS_EVERY_S:
            return
        self._progress_at = now
        etas = [f["eta_s"] for f in fetches if not f["done"]]
        self.log.event(
            ReplicaEvent.CATCHUP_PROGRESS,
            source=self._fetching().source,
            bytes_done=sum(f["bytes_done"] for f in fetches),
            bytes_total=sum(f["bytes_total"] for f in fetches),
            eta_s=None if None in etas else max(etas),
        )

    def _heal_bookkeeping(self, q: QuorumResult, fetches: list[dict]) -> HealOrder:
        """Newcomer role (leader): install a fetch that every host finished, or start (again)."""
        if not q.participants[q.rank].healing:
            if self.fetch is not None:
                self.log.event(ReplicaEvent.CATCHUP_ABANDONED, source=self.fetch.source, reason="no longer behind")
            return HealOrder(drop=self.fetch is not None)
        drop = False
        self._progress(fetches)
        errors = [f"host {h}: {f['error']}" for h, f in enumerate(fetches) if f["error"]]
        steps = {f["step"] for f in fetches}
        if self.fetch is not None and not errors and all(f["done"] for f in fetches):
            if len(steps) == 1:
                return HealOrder(install=True)
            errors = [f"the hosts fetched snapshots of different steps {sorted(steps)}"]
        if errors:
            source = self.fetch.source if self.fetch is not None else q.heal_source
            self.log.event(ReplicaEvent.CATCHUP_FAILED, source=source, error="; ".join(errors))
            drop = True
        elif self.fetch is not None and not any(p.replica_id == self.fetch.source for p in q.participants):
            self.log.event(ReplicaEvent.CATCHUP_ABANDONED, source=self.fetch.source, reason="source left the quorum")
            drop = True
        if (self.fetch is None or drop) and q.heal_source:
            missing = self.buffer.first_missing(q.step)
            self.log.event(ReplicaEvent.CATCHUP_STARTED, source=q.heal_source, at_step=q.step, min_step=missing)
            return HealOrder(drop=drop, fetch_min_step=missing)
        return HealOrder(drop=drop)

    def _carry_out(self, q: QuorumResult | None, order: HealOrder) -> Agreement:
        """Every host: what the leader decided of catch-up for this step."""
        if order.leave is not None:
            return Agreement(None, leave=order.leave, finished=order.finished)
        assert q is not None  # (the leader sends no quorum only with a leave)
        install = None
        if order.install:
            install = self._fetching().result
        if order.drop or order.install:
            self.fetch = None
        if order.fetch_min_step is not None:
            me, addresses = q.participants[q.rank], q.heal_source_addresses
            needed = [addresses[k] for k in source_hosts(self.group.rank, self.group.hosts, len(addresses))]
            self.fetch = self._transport().fetch(
                needed, f"{me.replica_id}/{me.incarnation}", source=q.heal_source, min_step=order.fetch_min_step
            )
        return Agreement(q, install)

    # --- leaving --------------------------------------------------------------------------------
    def leave(self, reason: str) -> None:
        """This process leaves the job now (the watchdog's verdict): the coordinator drops it at once."""
        if self.quorums is not None:
            self.quorums.leave(reason)

    def close(self) -> None:
        """Close the collaborators' connections and drop the kept updates."""
        if self.quorums is not None:
            self.quorums.close()
        self.reducer.close()
        if self.transport is not None:
            self.transport.close()
        self.buffer.clear()


def _encode_agreement(q: QuorumResult | None, order: HealOrder) -> bytes:
    """The quorum as the coordinator's protobuf message (none when leaving), then the catch-up
    order (JSON)."""
    data = encode_quorum(q) if q is not None else b""
    return len(data).to_bytes(8, "little") + data + json.dumps(asdict(order)).encode()


def _decode_agreement(data: bytes) -> tuple[QuorumResult | None, HealOrder]:
    n = int.from_bytes(data[:8], "little")
    return decode_quorum(data[8 : 8 + n]) if n else None, HealOrder(**json.loads(data[8 + n :]))
