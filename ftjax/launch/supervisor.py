"""The launcher's supervisor: restart policy and fault schedule of a local job.

The supervisor owns no process itself: `LocalJob` starts and kills them. It polls (every
`POLL_S`) the processes' exit codes and the replicas' `metrics.jsonl` files (tailed, complete
lines only), and decides:

- **Restarts.** A replica whose process (any of its H hosts) dies is killed as a whole and started
  again, as a new incarnation, after `restart_delay_s`. A replica whose peers have all finished is
  not restarted (nobody could give it the state: it would start from scratch), and one that is still
  without state when they finish is stopped ("abandoned"). A dead coordinator is restarted on the
  same ports after the same delay (its state is soft).
- **Faults.** `--kill R@STEP[:PHASE]` and `--kill-host R@STEP:HOST` are self-SIGKILLs at exactly
  that point (`ftjax train --die-at`), given to the replica's next incarnation until one fires.
  `R@STEP:catchup` kills replica R at STEP (forward), then kills its next incarnation as soon as it
  reports `catchup_started` (the fetch of its state is under way). `--mtbf-s S --seed K` kills a
  whole replica at exponentially distributed intervals (mean S, seeded), one replica at a time: a
  kill that falls due while any replica is not training waits for all to train again. None is fired
  once the steps left would not let a restarted replica catch up before the end: 1.5 x the measured
  restart time (start to first own step), or before any restart was measured, half of the steps. `--hang R@T`
  SIGSTOPs replica R; `--kill-coordinator-at T` SIGKILLs the coordinator. Times T count from the
  end of warm-up (every replica has committed a step with its own batch).
- **Partitions** (a virtual cluster only, `ftjax.launch.vcluster`): `--partition R[/H]@STEP:SECONDS`
  cuts the links of every host of replica R (or of host H only) once R has trained step STEP, and
  restores them SECONDS later. Keyed off the replica's metrics like a kill, so the cut lands within
  a poll (0.1 s) of that step's record. Overlapping windows on one host are merged: its links come
  back when the last window covering it ends. A cut replica is silent because the network says nothing,
  not because it hangs: the hang rule leaves it alone while it is cut, and counts its silence
  from the restore plus the cut's length (TCP's retransmission backoff: a connection silent for S
  seconds may take about S more to send again once the link is back). `--bandwidth-mbit` caps are
  set before anything starts (`ftjax.launch.cli`).
- **Hangs.** A replica is declared hung, SIGKILLed and restarted when its newest record is older
  than `hang_timeout_s` while a peer kept training through the last half of that silence: the peer
  logged a step at or before its start and then never went `hang_timeout_s / 2` without one, up to
  now. A peer's newest step alone proves nothing: after a job-wide stall (a quorum, the coordinator
  away) longer than the timeout, the first replica to resume would make every other one look hung
  until they log their own first step a moment later. The peers of a truly hung replica wait one
  FTAR timeout for it (half the default timeout) and then train on, so it is caught about
  `hang_timeout_s` after it stopped; one silent past a job-wide stall, `hang_timeout_s / 2` after
  its peers resumed. The rule needs steps shorter than `hang_timeout_s / 2`. A replica that logs
  no step within `startup_timeout_s` of its start is hung too.

- **Phases.** What the view shows of a replica (starting, training, stalled, catching up, down,
  done, gone) is its `ftjax.runs.lifecycle.Lifecycle`, fed each of its records as they are tailed and
  each event logged about it; a training replica is stalled while the gap since its last own step
  breaks the stall rule, judged with the median of the replicas' recent gaps. The summary folds the
  same records with the same rules afterwards.

Every decision is appended to `RUN/launcher.jsonl` (`RunLog`), the input of `ftjax.runs.summary`.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ftjax.base.batches import for_others
from ftjax.launch.fault_plan import FaultPlan, Injection, Partition
from ftjax.launch.job import LocalJob
from ftjax.runs.events import (
    EVENT,
    EXIT_LEFT,
    EXIT_NO_PROGRESS,
    REPLICA,
    TIME,
    LauncherEvent,
    ReplicaEvent,
    StepField,
    is_own_step,
    is_step,
)
from ftjax.runs.jsonl import parse_jsonl
from ftjax.runs.lifecycle import Lifecycle, Phase

if TYPE_CHECKING:  # (the virtual cluster's module is loaded only by a job that has one)
    from ftjax.launch.vcluster import VirtualCluster

POLL_S = 0.1


class LaunchError(RuntimeError):
    """The job cannot go on (a replica failed more often than allowed, or it ran out of time)."""


# --- the run log ----------------------------------------------------------------------------------
class RunLog:
    """`RUN/launcher.jsonl`: one JSON object per supervisor decision, each with `time` and `event`.

    A write that fails (a full disk) must not take the launcher down: it would leave the job
    unsupervised and write no summary. The failure is said in one line (once), the records are
    kept in memory, and `close()` writes the whole log again, whole lines only, if a write failed."""

    def __init__(self, path: str | Path, listener: Callable[[dict], None] | None = None):
        self.path = Path(path)
        # unbuffered: a failed write is lost alone, not retried (and failed again) by every later one
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.listener = listener
        self.records: list[dict] = []
        self.failed: OSError | None = None  # the first write that failed (None: none did)

    def event(self, name: str, /, **fields: Any) -> dict:
        record = {TIME: round(time.time(), 6), EVENT: name, **fields}
        self.records.append(record)
        self._write((json.dumps(record) + "\n").encode())
        if self.listener is not None:
            self.listener(record)
        return record

    def _write(self, data: bytes) -> None:
        try:
            while data:
                data = data[os.write(self._fd, data) :]
        except OSError as e:
            if self.failed is None:
                print(f"ftjax launch: cannot write {self.path} ({e.strerror}); supervising on", file=sys.stderr)
            self.failed = e

    def close(self) -> None:
        """Close the log; if a write failed, write it again whole (it may have lost lines, or cut one)."""
        os.close(self._fd)
        if self.failed is None:
            return
        try:
            text = "".join(json.dumps(r) + "\n" for r in self.records)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(text)
            tmp.replace(self.path)
            self.failed = None
        except OSError as e:
            print(f"ftjax launch: cannot write {self.path} again whole ({e.strerror})", file=sys.stderr)


class MetricsTail:
    """New complete lines of a file that another process appends to."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0
        self._partial = b""

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()  # the last element is an incomplete line (or b"")
        return parse_jsonl(lines)


def last_line(text: str, limit: int = 300) -> str | None:
    """The last non-empty line of a log's tail (None: none), cut to `limit` characters; past JAX's
    note on the frames it filtered, which it prints after the exception."""
    lines = [x.strip() for x in text.splitlines() if x.strip() and not _boilerplate(x)]
    if not lines:
        return None
    return lines[-1] if len(lines[-1]) <= limit else lines[-1][: limit - 3] + "..."


def _boilerplate(line: str) -> bool:
    return line.startswith("For simplicity, JAX has removed its internal frames") or set(line.strip()) == {"-"}


# --- per-replica status ---------------------------------------------------------------------------
@dataclass
class ReplicaStatus:
    """What the supervisor knows of one replica (shown by the view)."""

    replica: int
    state: Phase = Phase.STARTING  # its lifecycle's phase now (the clock's stall included)
    lifecycle: Lifecycle = field(default_factory=Lifecycle)  # its records and the launcher's events about it
    step: int = 0
    loss: float | None = None
    participants: int = 0
    computes: str = ""  # constant global batch: the other streams' rows it computes (ftjax.base.batches.for_others)
    incarnation: int = 0
    restarts: int = 0
    started_at: float = 0.0  # time.time() of the current incarnation's start
    last_record: float | None = None  # time.time() when its newest record was read
    last_step: float | None = None  # ... its newest step record
    trained: bool = False  # committed a step with its own batch in this incarnation
    restart_at: float | None = None
    killed_as: str | None = None  # set when the supervisor itself kills or stops it
    injection: Injection | None = None  # the self-kill given to the current incarnation
    kill_on_catchup: bool = False
    cut: bool = False  # its links are cut (--partition): silent, not hung
    reconnected_at: float | None = None  # when its links were last restored
    quiet_until: float | None = None  # the hang rule counts its silence from here (see _restore_links)
    gaps: deque = field(default_factory=lambda: deque(maxlen=50))
    recent_steps: deque = field(default_factory=deque)  # its step times of the last hang_timeout_s
    on_hosts: list[int] | None = None  # the hosts its incarnation runs on (None: all; fewer: reduced degree)
    restart_on: list[int] | None = None  # the hosts its next incarnation runs on (None: all)
    hosts_down: dict[int, float] = field(default_factory=dict)  # host -> when it is back (--host-repair-s)
    own_steps: int = 0  # steps its incarnation committed with its own batch (--host-repair-steps)
    leaving_since: float | None = None  # SIGTERMed to come back at full degree: it leaves at a step boundary
    refused: str | None = None  # why its last incarnation was refused (None: it was not; see `repeats`)

    @property
    def alive(self) -> bool:
        return self.state.alive

    def feed(self, record: dict) -> None:
        """The next record of its lifecycle: one of its own, or a launcher event about it."""
        self.state = self.lifecycle.feed(record)


def check_host_repair(seconds: float | None, steps: int | None, on_host_loss: str) -> None:
    """ValueError unless the host-repair options go together: a repair after reduced steps needs a
    replica that can run reduced, and excludes a repair by the clock."""
    if steps is not None and (seconds is not None or on_host_loss != "reduce"):
        raise ValueError("--host-repair-steps: needs ft.on_host_loss=reduce, and not --host-repair-s with it")


def reduced_degree(hosts: int, up: int, min_fraction: float) -> int | None:
    """The hosts a reduced-degree replica runs on when `up` of its `hosts` are up: the largest
    divisor of `hosts` (each live host serves whole gradient lanes, ftjax/runtime/lanes.py) that they cover,
    if it is at least `min_fraction` of `hosts`; else None (the replica waits to restart whole)."""
    fits = [d for d in range(1, up + 1) if hosts % d == 0 and d >= min_fraction * hosts - 1e-9]
    return max(fits) if fits and up < hosts else None


# An incarnation's exit code that says more than "crash": the progress watchdog ended it
# (ftjax/runtime/watchdog.py), or it refused to run (bad input, a task or token files that cannot
# train, a loss gone NaN, the coordinator's refusal: `ftjax train` exits 2 with one line why).
EXIT_REFUSED = 2
EXIT_KINDS = {EXIT_NO_PROGRESS: "watchdog", EXIT_REFUSED: "refused"}
# A refusal that may pass by itself: another live process still held the replica's id (its
# predecessor, not yet seen to die). `ftjax train` names the coordinator's status code.
TRANSIENT_REFUSALS = ("(ALREADY_EXISTS)",)


def refusal(cause: str, error: str | None) -> str | None:
    """The reason an incarnation that ended of `cause` was refused (`error`: the last line its
    process wrote), or None: it was not."""
    if not cause.startswith(EXIT_KINDS[EXIT_REFUSED]):
        return None
    return error or f"{cause} with no reason written"


def repeats(previous: str | None, reason: str | None) -> bool:
    """The restart rule for refusals: a replica whose incarnation is refused for the same reason as
    the one before it is refused deterministically (a bad task, token files, a NaN loss, a layout the
    job refuses): a restart would only be refused again. A refusal that may pass by itself (the id
    still held by a predecessor) is a failure like any other, counted against --max-restarts."""
    return reason is not None and reason == previous and not any(t in reason for t in TRANSIENT_REFUSALS)


def is_hung(now: float, last: float | None, peers_steps: list[Sequence[float]], timeout_s: float) -> bool:
    """A replica whose newest record is at `last` is hung when it has been silent for more than
    `timeout_s` while some peer, whose recent step times are `peers_steps[i]`, trained through the
    last `timeout_s / 2` of it (see the module docstring: everyone stalls together when the
    coordinator is away, and that is no hang, even once the first of them resumes)."""
    if last is None or now - last <= timeout_s:
        return False
    return any(trained_through(steps, now - timeout_s / 2, now, timeout_s / 2) for steps in peers_steps)


def _silent_since(s: ReplicaStatus) -> float | None:
    """Where the hang rule counts a replica's silence from: its newest record, or the end of the grace
    after a partition if later (None: no record yet, the startup timeout's business)."""
    return None if s.last_record is None else _latest(s.last_record, s.quiet_until)


def _latest(*times: float | None) -> float | None:
    known = [t for t in times if t is not None]
    return max(known) if known else None


def trained_through(steps: Sequence[float], since: float, now: float, max_gap: float) -> bool:
    """Whether `steps` (ascending times) hold one at or before `since` and, from it to `now`, no
    silence of `max_gap` or more: the peer trained all along [since, now], not just at its end."""
    before = [t for t in steps if t <= since]
    if not before:
        return False
    times = [before[-1], *(t for t in steps if since < t <= now), now]
    return all(b - a < max_gap for a, b in zip(times, times[1:]))


class Supervisor:
    """Runs a `LocalJob` to the end under a `FaultPlan` (see the module docstring)."""

    def __init__(
        self,
        job: LocalJob,
        plan: FaultPlan,
        log: RunLog,
        *,
        restart_delay_s: float = 1.0,
        hang_timeout_s: float | None = None,
        startup_timeout_s: float = 300.0,
        max_restarts: int = 10,
        timeout_s: float = 3600.0,
        on_poll: Callable[[list[ReplicaStatus], dict], None] | None = None,
        host_repair_s: float | None = None,
        host_repair_steps: int | None = None,
    ):
        self.job, self.plan, self.log = job, plan, log
        self.restart_delay_s = restart_delay_s
        # a host whose process died is back after this (None: at once, with the replica's restart)
        self.host_repair_s = host_repair_s
        self.reduce = job.cfg.ft.on_host_loss == "reduce"
        # ... or once its replica has trained this many steps at a reduced degree: a repair paced by
        # the job, not the clock, so a test's reduced phase exists however slow the machine is
        self.host_repair_steps = host_repair_steps
        check_host_repair(host_repair_s, host_repair_steps, job.cfg.ft.on_host_loss)
        # A hung peer blocks the others for up to one FTAR timeout; after that they move on.
        self.hang_timeout_s = hang_timeout_s if hang_timeout_s is not None else 2 * job.cfg.ft.ftar_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.max_restarts = max_restarts
        self.timeout_s = timeout_s
        self.on_poll = on_poll
        self.steps = job.cfg.steps
        self.status = [ReplicaStatus(r, lifecycle=Lifecycle(self.steps)) for r in range(job.replicas)]
        self.tails = [MetricsTail(job.replica_dir(r) / "metrics.jsonl") for r in range(job.replicas)]
        self.pending = {r: plan.for_replica(r) for r in range(job.replicas)}
        self.hangs = sorted(plan.hangs, key=lambda h: h.after_s)
        self.coordinator_kills = sorted(plan.coordinator_kills)
        self.partitions = sorted(plan.partitions, key=lambda p: p.step)  # not yet fired
        self.cuts: list[tuple[Partition, list[str], float, int]] = []  # open: (partition, hosts, ends at, number)
        self.cuts_fired = 0  # windows opened so far (each one's number, in its fault and end records)
        self.cut_since: dict[str, float] = {}  # a cut host -> when its links went (the earliest open window)
        if (plan.partitions or plan.bandwidth) and getattr(job, "cluster", None) is None:
            raise ValueError("--partition and --bandwidth-mbit need a virtual cluster (--virtual-cluster)")
        self.coordinator_down_since: float | None = None
        self.coordinator_killed = False
        self.rng = random.Random(plan.seed)
        self.next_random_kill: float | None = None
        self.warm_at: float | None = None  # every replica has trained: the origin of fault times
        # restarted incarnations: start -> first own step (the room a random kill must leave)
        self.restart_s: list[float] = []

    # --- the loop ---------------------------------------------------------------------------------
    def run(self) -> bool:
        """Start everything and supervise until every replica ended; True when all finished."""
        deadline = time.monotonic() + self.timeout_s
        self.job.start_coordinator()
        coordinator = self.job.coordinator
        assert coordinator is not None  # (just started)
        self._log(
            LauncherEvent.COORDINATOR_STARTED,
            pid=coordinator.pid,
            grpc=self.job.coordinator_address,
            http=self.job.coordinator_http,
        )
        for r in range(self.job.replicas):
            self._start(r)
        while not all(s.state in (Phase.DONE, Phase.GONE) for s in self.status):
            if time.monotonic() > deadline:
                raise LaunchError(f"the job did not finish within --timeout-s {self.timeout_s:g}")
            now = time.time()
            self._read_metrics(now)
            self._check_coordinator(now)
            self._check_replicas(now)
            self._fire_faults(now)
            self._hosts_back(now)
            self._restart_due(now)
            if self.on_poll is not None:
                self.on_poll(self.status, self.job_view())
            time.sleep(POLL_S)
        ok = all(s.state is Phase.DONE for s in self.status)
        self._log(LauncherEvent.END, ok=ok)
        if self.on_poll is not None:
            self.on_poll(self.status, self.job_view())
        return ok

    def job_view(self) -> dict:
        return {
            "step": max((s.step for s in self.status), default=0),
            "steps": self.steps,
            "coordinator": "down" if self.coordinator_down_since is not None else "up",
            "coordinator_http": self.job.coordinator_http,
            "warm": self.warm_at is not None,
        }

    def _log(self, name: str, /, **fields: Any) -> dict:
        """Log a decision; one about a replica is a record of its lifecycle too (as in the summary)."""
        record = self.log.event(name, **fields)
        self.observe(record)
        return record

    def observe(self, event: dict) -> None:
        """A launcher event about a replica goes into its lifecycle (every one the supervisor logs;
        a test replays recorded ones here)."""
        if event.get(REPLICA) is not None:
            self.status[event[REPLICA]].feed(event)

    def median_step_s(self) -> float | None:
        """The median of the replicas' recent gaps between committed steps: the live stall rule's
        median (the summary's is that of the whole run)."""
        gaps = [g for s in self.status for g in s.gaps]
        return statistics.median(gaps) if gaps else None

    # --- starting and stopping --------------------------------------------------------------------
    def _start(self, r: int) -> None:
        s = self.status[r]
        inj = self.pending[r][0] if self.pending[r] else None
        on_hosts, s.restart_on = s.restart_on, None
        procs = self.job.start_replica(
            r, die_at=inj.die_at if inj else None, die_host=inj.host if inj else 0, on_hosts=on_hosts
        )
        s.on_hosts, s.leaving_since = on_hosts, None
        s.incarnation += 1
        s.started_at, s.restart_at = time.time(), None
        s.last_record = s.last_step = None
        s.trained, s.killed_as, s.injection, s.own_steps = False, None, inj, 0
        s.step, s.loss, s.participants, s.computes = 0, None, 0, ""  # a new incarnation's row starts empty
        s.gaps.clear()
        s.recent_steps.clear()
        self._log(
            LauncherEvent.REPLICA_STARTED,
            replica=r,
            incarnation=s.incarnation,
            pids=[p.pid for p in procs],
            die_at=inj.die_at if inj else None,
            die_host=inj.host if inj else None,
            hosts=on_hosts or list(range(self.job.cfg.mesh.hosts)),
            reduced=on_hosts is not None,
        )

    def _kill(self, r: int, kind: str) -> None:
        self.status[r].killed_as = kind
        self.job.kill_replica(r)

    def _down(self, r: int, now: float) -> None:
        s = self.status[r]
        self.job.kill_replica(r)  # the other hosts of a multi-host replica go with it
        for p in self.job.hosts.get(r, []):
            p.wait(10)
        self._consume(r, self.tails[r].read(), now)  # what the incarnation wrote before it died
        codes = [p.returncode for p in self.job.hosts.get(r, [])]
        placement = self.job.placement.get(r, list(range(len(codes))))
        cause, dead_host, error = self._cause(s, codes, placement)
        if cause != "left":
            s.restarts += 1
        self._log(
            LauncherEvent.REPLICA_DOWN,
            replica=r,
            incarnation=s.incarnation,
            cause=cause,
            codes=codes,
            step=s.step,
            at=s.injection.die_at if cause in ("kill", "kill_host") and s.injection else None,
            host=dead_host,
            error=error,  # a crash: the last line its host wrote (what it died of, in the launcher's output)
        )
        refused, s.refused = s.refused, refusal(cause, error)
        if repeats(refused, s.refused):
            raise LaunchError(
                f"replica {r} was refused twice in a row for the same reason, so it is not restarted: {s.refused}"
            )
        if s.restarts > self.max_restarts:
            raise LaunchError(
                f"replica {r} failed {s.restarts} times (--max-restarts {self.max_restarts}); "
                f"last: {cause}{f': {error}' if error else ''}; see {self.job.replica_dir(r)}"
            )
        if dead_host is not None and self.host_repair_s is not None:
            s.hosts_down[dead_host] = now + self.host_repair_s
        elif dead_host is not None and self.host_repair_steps is not None:
            s.hosts_down[dead_host] = math.inf  # back after the reduced steps (`_hosts_back`)
        self._plan_restart(s, now, left=cause == "left")

    def _cause(self, s: ReplicaStatus, codes: list, placement: list[int]) -> tuple[str, int | None, str | None]:
        """Why an incarnation of replica `s` ended with exit `codes`: (cause, the host that died
        alone or None, the last line its dead host wrote or None)."""
        inj, cause = s.injection, s.killed_as
        if cause is None and s.leaving_since is not None and all(c in (0, EXIT_LEFT) for c in codes):
            return "left", None, None  # asked to (the host it lacked is back): it returns at full degree
        if cause is not None:
            return cause, None, None
        dead = [h for h, c in enumerate(codes) if c not in (0, -signal.SIGKILL)]
        if inj is not None and codes[inj.host] == -signal.SIGKILL:
            self.pending[s.replica].pop(0)
            s.kill_on_catchup = inj.phase == "catchup"
            return inj.kind, placement[inj.host] if inj.kind == "kill_host" else None, None
        if not dead:
            return "killed (SIGKILL from outside)", None, None
        host, code = placement[dead[0]], codes[dead[0]]
        return (
            f"{EXIT_KINDS.get(code, 'crash')} (host {host} exit {code})",
            host if len(dead) < len(codes) else None,
            last_line(self.job.log_tail(s.replica, host)),
        )

    def _plan_restart(self, s: ReplicaStatus, now: float, left: bool = False) -> None:
        """When and on which hosts replica `s` starts again: at once on the hosts that are up, at a
        reduced degree, when `ft.on_host_loss` is reduce and enough are (the largest divisor of
        mesh.hosts that they cover, at least `ft.reduced_min_fraction` of it); else whole, once
        every host is back and `restart_delay_s` has passed. A replica that left to come back at
        full degree starts at once."""
        hosts = self.job.cfg.mesh.hosts
        up = [h for h in range(hosts) if h not in s.hosts_down]
        live = reduced_degree(hosts, len(up), self.job.cfg.ft.reduced_min_fraction) if self.reduce else None
        if s.hosts_down and live is not None:
            s.restart_at, s.restart_on = now, up[:live]
            return
        for h in [h for h, t in s.hosts_down.items() if t == math.inf]:  # no reduced steps can come
            del s.hosts_down[h]
            self._log(LauncherEvent.HOST_BACK, replica=s.replica, host=h)
        s.restart_at = now if left else max([now + self.restart_delay_s, *s.hosts_down.values()])

    def _hosts_back(self, now: float) -> None:
        """Repaired hosts return (`--host-repair-s` after their death, or once the reduced replica
        trained `--host-repair-steps`); a reduced replica whose hosts are all back is asked to leave
        at a step boundary (SIGTERM) and starts again whole (killed if it does not leave in time)."""
        for s in self.status:
            repaired = s.on_hosts is not None and s.own_steps >= (self.host_repair_steps or math.inf)
            for h in [h for h, t in s.hosts_down.items() if t <= now or repaired]:
                del s.hosts_down[h]
                self._log(LauncherEvent.HOST_BACK, replica=s.replica, host=h)
            if s.on_hosts is None or s.hosts_down or not s.alive:
                continue
            if s.leaving_since is None and s.state is Phase.TRAINING:
                s.leaving_since = now
                self._log(LauncherEvent.BACK_TO_FULL_DEGREE, replica=s.replica, hosts=s.on_hosts)
                self.job.terminate_replica(s.replica)
            elif s.leaving_since is not None and now - s.leaving_since > self.job.cfg.ft.progress_timeout_s:
                self._kill(s.replica, "did not leave")

    def _restart_due(self, now: float) -> None:
        for s in self.status:
            if s.state is Phase.DOWN and self._job_over_for(s):
                self._log(
                    LauncherEvent.NOT_RESTARTED,
                    replica=s.replica,
                    reason="the job has finished: no live peer holds the state to catch up from",
                )
            elif s.state is Phase.DOWN and s.restart_at is not None and now >= s.restart_at:
                self._start(s.replica)
        if self.coordinator_down_since is not None and now >= self.coordinator_down_since + self.restart_delay_s:
            self.job.restart_coordinator()
            coordinator = self.job.coordinator
            assert coordinator is not None  # (just started)
            self.coordinator_down_since = None
            self._log(
                LauncherEvent.COORDINATOR_STARTED,
                pid=coordinator.pid,
                grpc=self.job.coordinator_address,
                http=self.job.coordinator_http,
            )

    # --- watching ---------------------------------------------------------------------------------
    def _read_metrics(self, now: float) -> None:
        for r, tail in enumerate(self.tails):
            self._consume(r, tail.read(), now)

    def _consume(self, r: int, records: list[dict], now: float) -> None:
        s = self.status[r]
        abandon = None
        for rec in records:
            t = float(rec.get(TIME, now))  # the replica's own clock: the same machine
            s.last_record = t
            s.feed(rec)
            kind = rec.get(EVENT)
            if kind == ReplicaEvent.CATCHUP_STARTED:
                if s.kill_on_catchup and s.alive:
                    s.kill_on_catchup = False
                    self._log(LauncherEvent.FAULT, kind="kill_catchup", replica=r, step=rec.get("at_step"))
                    self._kill(r, "kill_catchup")
            elif kind in (ReplicaEvent.INIT, ReplicaEvent.INIT_FROM) and self.warm_at is not None and s.alive:
                # A fresh state after the job has trained means no live peer held the job's state
                # (they have all finished): training on would start the job over, alone.
                abandon = (
                    "it initialized from scratch after the job had trained: no live peer "
                    "held the state to catch up from"
                )
            elif kind == ReplicaEvent.CATCHUP_DONE:  # a restarted replica rejoins; a first one caught up at the start
                back = s.incarnation > 1 or s.reconnected_at is not None  # restarted, or back from a partition
                self._log(
                    LauncherEvent.REJOINED if back else LauncherEvent.CAUGHT_UP,
                    replica=r,
                    at_step=rec.get("at_step"),
                    catchup_s=rec.get("catchup_s"),
                    source=rec.get("source"),
                )
                s.step = max(s.step, int(rec.get("at_step") or 0))  # (its step, if it commits none after this)
                self._holds_state(s, t)  # (at the very end of a job it commits no step after this)
            elif kind == ReplicaEvent.COMMIT_FAILURE:
                self._log(
                    LauncherEvent.COMMIT_FAILURE,
                    replica=r,
                    step=rec.get(StepField.STEP),
                    errors=len(rec.get("errors") or []),
                )
            elif kind == ReplicaEvent.PEER_UNREACHABLE:
                self._log(
                    LauncherEvent.PEER_UNREACHABLE,
                    replica=r,
                    step=rec.get(StepField.STEP),
                    peer=rec.get("peer"),
                    peer_replica=rec.get("replica"),
                    seconds=rec.get("seconds"),
                    error=rec.get("error"),
                )
            elif is_step(rec):
                self._on_step(s, rec, t)
        if abandon is not None and s.alive:
            self._abandon(s, abandon)

    def _on_step(self, s: ReplicaStatus, rec: dict, now: float) -> None:
        if s.last_step is not None and rec.get(StepField.COMMITTED):
            s.gaps.append(now - s.last_step)
        s.last_step = now
        # The hang rule looks back at most hang_timeout_s (see `trained_through`): older steps are dropped.
        s.recent_steps.append(now)
        while s.recent_steps[0] < now - self.hang_timeout_s:
            s.recent_steps.popleft()
        s.step = int(rec[StepField.STEP])
        s.participants = int(rec.get(StepField.PARTICIPANTS) or 0)
        s.computes = for_others(rec.get("work") or [], s.replica)
        if is_own_step(rec):
            s.own_steps += 1
            s.loss = rec.get(StepField.LOSS)
            self._holds_state(s, now)

    def _holds_state(self, s: ReplicaStatus, now: float) -> None:
        """The first time an incarnation holds the job's state (a committed step, or a catch-up)."""
        if not s.trained:
            s.trained = True
            if s.incarnation > 1:
                self.restart_s.append(now - s.started_at)
            if self.warm_at is None and all(o.trained for o in self.status):
                self.warm_at = now
                self._log(LauncherEvent.WARM, step=s.step)
                if self.plan.mtbf_s:
                    self.next_random_kill = now + self.rng.expovariate(1.0 / self.plan.mtbf_s)

    def _check_replicas(self, now: float) -> None:
        median_step_s = self.median_step_s()
        for s in self.status:
            if not s.alive:
                continue
            codes = self.job.replica_exit_codes(s.replica)
            if codes and all(c == 0 for c in codes):
                self._consume(s.replica, self.tails[s.replica].read(), now)
                self._log(LauncherEvent.REPLICA_DONE, replica=s.replica, incarnation=s.incarnation, step=s.step)
                if s.injection is not None and self.pending[s.replica]:
                    self._log(
                        LauncherEvent.KILL_MISSED,
                        replica=s.replica,
                        at=s.injection.die_at,
                        reason="the incarnation finished without reaching that point",
                    )
                    self.pending[s.replica].pop(0)
                continue
            if any(c not in (None, 0) for c in codes):
                self._down(s.replica, now)
                continue
            peers = [o for o in self.status if o is not s]
            if s.last_step is None and now - s.started_at > self.startup_timeout_s:
                self._hung(s, now, f"no step within --startup-timeout-s {self.startup_timeout_s:g}")
            elif s.cut:  # silent because its links are cut (--partition), not hung
                s.state = s.lifecycle.phase_at(now, median_step_s)
            elif is_hung(
                now, last := _silent_since(s), [o.recent_steps for o in peers if o.alive], self.hang_timeout_s
            ):
                silent = now - cast(float, last)  # (is_hung holds only for a replica with a record)
                self._hung(s, now, f"no record for {silent:.1f} s while peers trained")
            else:  # the clock's transition: training -> stalled (ftjax.runs.lifecycle, the stall rule)
                s.state = s.lifecycle.phase_at(now, median_step_s)
            if s.lifecycle.waiting_for_state and self._job_over_for(s):
                self._abandon(s, "still without state when the job finished")

    def _job_over_for(self, s: ReplicaStatus) -> bool:
        """A peer has finished and no live peer holds the state: `s` could only start the job over."""
        peers = [o for o in self.status if o is not s]
        return any(o.state is Phase.DONE for o in peers) and not any(o.alive and o.trained for o in peers)

    def _abandon(self, s: ReplicaStatus, why: str) -> None:
        self._kill(s.replica, "abandoned")
        self.job.wait([s.replica], timeout=10)
        self._consume(s.replica, self.tails[s.replica].read(), time.time())  # what it wrote before it died
        self._log(LauncherEvent.ABANDONED, replica=s.replica, incarnation=s.incarnation, reason=why)

    def _hung(self, s: ReplicaStatus, now: float, why: str) -> None:
        self._log(LauncherEvent.HANG_DETECTED, replica=s.replica, reason=why)
        self._kill(s.replica, "hang")  # SIGKILL ends a stopped process too
        self._down(s.replica, now)

    def _check_coordinator(self, now: float) -> None:
        c = self.job.coordinator
        if self.coordinator_down_since is None and c is not None and c.poll() is not None:
            self.coordinator_down_since = now
            cause = "kill" if self.coordinator_killed else f"crash (exit {c.returncode})"
            self.coordinator_killed = False
            self._log(LauncherEvent.COORDINATOR_DOWN, cause=cause, code=c.returncode)

    # --- faults -----------------------------------------------------------------------------------
    def _fire_faults(self, now: float) -> None:
        self._restore_links(now)
        if self.warm_at is None:
            return
        for p in list(self.partitions):
            s = self.status[p.replica]
            if s.state in (Phase.TRAINING, Phase.STALLED) and s.step >= p.step:
                self.partitions.remove(p)
                self._cut(p, now)
        t = now - self.warm_at
        if self.coordinator_kills and t >= self.coordinator_kills[0] and self.coordinator_down_since is None:
            self.coordinator_kills.pop(0)
            self._log(LauncherEvent.FAULT, kind="kill_coordinator", step=self.job_view()["step"])
            self.coordinator_killed = True
            if self.job.coordinator is not None:
                self.job.procs.kill(self.job.coordinator)
        for h in list(self.hangs):
            s = self.status[h.replica]
            if t >= h.after_s and s.state is Phase.TRAINING:
                self.hangs.remove(h)
                self._log(LauncherEvent.FAULT, kind="hang", replica=h.replica, step=s.step)
                for proc in self.job.hosts[h.replica]:
                    self.job.procs.kill(proc, signal.SIGSTOP)
        if self.next_random_kill is not None and now >= self.next_random_kill:
            self._random_kill(now)

    def _cluster(self) -> VirtualCluster:
        """The virtual cluster, which a --partition needs (the plan's check refuses one without it)."""
        assert self.job.cluster is not None, "--partition needs --virtual-cluster"
        return self.job.cluster

    def _cut(self, p: Partition, now: float) -> None:
        hosts = self.job.host_names(p.replica) if p.host is None else [self.job.host_name(p.replica, p.host)]
        number = self.cuts_fired = self.cuts_fired + 1
        # logged before the cut: whatever the replica commits after this record, it did cut off
        self._log(
            LauncherEvent.FAULT,
            kind="partition",
            replica=p.replica,
            host=p.host,
            step=self.status[p.replica].step,
            seconds=p.seconds,
            hosts=hosts,
            cut=number,
        )
        fresh = [h for h in hosts if h not in self.cut_since]  # (others are cut by an overlapping window)
        self.cut_since.update((h, now) for h in fresh)
        self._cluster().cut(fresh)
        self.status[p.replica].cut = True
        self.cuts.append((p, hosts, now + p.seconds, number))

    def _restore_links(self, now: float) -> None:
        """End each window that is due. A host's links come back only when no window covering it is
        still open (overlapping `--partition`s of one replica: the first to end restores nothing
        that the other still cuts)."""
        for cut in [c for c in self.cuts if now >= c[2]]:
            p, hosts, _, number = cut
            self.cuts.remove(cut)
            still_cut = {h for c in self.cuts for h in c[1]}
            back = [h for h in hosts if h not in still_cut]
            if back:
                self._cluster().restore(back)
            s = self.status[p.replica]
            s.cut = any(c[0].replica == p.replica for c in self.cuts)
            if back:
                silent_s = now - min(self.cut_since.pop(h) for h in back)
                s.reconnected_at = time.time()
                # TCP retransmits with exponential backoff: after a silence of S seconds, a connection may
                # take about S more to send again. Until then the replica is still waiting on the network.
                s.quiet_until = _latest(s.quiet_until, s.reconnected_at + silent_s)
            self._log(
                LauncherEvent.PARTITION_ENDED,
                replica=p.replica,
                host=p.host,
                hosts=hosts,
                seconds=p.seconds,
                cut=number,
                restored=back,
            )

    def _random_kill(self, now: float) -> None:
        if not all(s.state is Phase.TRAINING for s in self.status):
            return  # one replica at a time: wait until everyone trains again
        left = self.steps - self.job_view()["step"]
        if self.restart_s:  # a restart has been measured: leave room for one more, with a margin
            recovery_s = self.restart_delay_s + statistics.median(self.restart_s)
            too_late = left * (self.median_step_s() or 0.0) < 1.5 * recovery_s
        else:  # first incarnations start together and contend: their start says little of a restart
            recovery_s, too_late = None, left < self.steps / 2
        if too_late:  # a restarted replica could not catch up before the end
            self.next_random_kill = None
            self._log(
                LauncherEvent.RANDOM_KILLS_STOPPED,
                steps_left=left,
                recovery_s=round(recovery_s, 2) if recovery_s is not None else None,
            )
            return
        r = self.rng.randrange(len(self.status))
        self._log(LauncherEvent.FAULT, kind="random_kill", replica=r, step=self.status[r].step)
        self._kill(r, "random_kill")
        assert self.plan.mtbf_s is not None  # (random kills only with --mtbf-s)
        self.next_random_kill = now + self.rng.expovariate(1.0 / self.plan.mtbf_s)
