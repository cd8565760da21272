"""What the launcher shows while a job runs, and the summary table at its end.

On a terminal: a rich `Live` table (per replica: state, step, loss, participants, restarts) under a
header that follows the coordinator's own state (read from its `/status` by `CoordinatorProbe`:
waiting for replicas, the quorum and step, ETA and tokens/s, not answering, down), above the
latest events (failures, restarts, rejoins). Otherwise (a file, a pipe, a CI log): one plain line
per event, and a progress line every 5% of the steps, flushed as printed.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from ftjax.launch.supervisor import ReplicaStatus
from ftjax.runs.events import EVENT, REPLICA, TIME, LauncherEvent
from ftjax.runs.lifecycle import Phase

_PHASE_STYLE = {
    Phase.STARTING: "cyan",
    Phase.TRAINING: "green",
    Phase.STALLED: "yellow",
    Phase.CATCHING_UP: "magenta",
    Phase.DOWN: "bold red",
    Phase.DONE: "blue",
    Phase.GONE: "red",
}


# The events whose line is a template of their fields ({r}: the replica); `describe` composes the others.
_LINES = {
    LauncherEvent.LAUNCH: (
        "job: {replicas} replicas x {hosts} hosts x {devices} devices, {steps} steps of {config} -> {out}"
    ),
    LauncherEvent.COORDINATOR_STARTED: "coordinator up at {grpc} (status: http://{http}/)",
    LauncherEvent.COORDINATOR_DOWN: "coordinator down ({cause}); restarting",
    LauncherEvent.COMMIT_FAILURE: "replica {r}: step {step} discarded ({errors} FTAR error(s)), retrying",
    LauncherEvent.PEER_UNREACHABLE: (
        "replica {r}: every attempt at step {step} for {seconds:.0f} s failed on replica {peer_replica} "
        "at {peer}: can this replica reach it? ({error})"
    ),
    LauncherEvent.WARM: "every replica trains (step {step}): fault clocks start",
    LauncherEvent.REPLICA_DONE: "replica {r} finished at step {step}",
}


def describe(e: dict) -> str | None:
    """One line for a launcher event (None: not worth showing)."""
    k, r = e[EVENT], e.get(REPLICA)
    if k in _LINES:
        return _LINES[k].format_map({**e, "r": r})
    if k == LauncherEvent.REPLICA_STARTED:
        inject = f", will die at {e['die_at']} (host {e['die_host']})" if e.get("die_at") else ""
        verb = "started" if e["incarnation"] == 1 else f"restarted (incarnation {e['incarnation']})"
        return f"replica {r} {verb}{inject}"
    if k == LauncherEvent.REPLICA_DOWN:
        at = f" at {e['at']}" if e.get("at") else ""
        host = f" host {e['host']}" if e.get("host") is not None else ""
        error = f": {e['error']}" if e.get("error") else ""
        return f"replica {r} DOWN:{host} {e['cause']}{at} (last step {e['step']}){error}"
    if k in (LauncherEvent.REJOINED, LauncherEvent.CAUGHT_UP):
        verb = "rejoined" if k == LauncherEvent.REJOINED else "caught up (it joined late)"
        return f"replica {r} {verb} at step {e['at_step']}: state from replica {e['source']} in {e['catchup_s']:.2f} s"
    if k == LauncherEvent.FAULT:
        target = f"replica {r}" if r is not None else "coordinator"
        if e["kind"] == "partition":
            target += f" host {e['host']}" if e.get("host") is not None else ""
            return f"fault: partition: {target} cut off for {e['seconds']:g} s (step {e.get('step')})"
        return f"fault: {e['kind']} {target} (step {e.get('step')})"
    if k == LauncherEvent.PARTITION_ENDED:
        host = f" host {e['host']}" if e.get("host") is not None else ""
        if e.get("restored") == []:  # an overlapping window still cuts them
            return f"replica {r}{host}: partition of {e['seconds']:g} s over, links still cut by another"
        return f"replica {r}{host}: links restored after {e['seconds']:g} s"
    if k in (
        LauncherEvent.HANG_DETECTED,
        LauncherEvent.NOT_RESTARTED,
        LauncherEvent.ABANDONED,
        LauncherEvent.KILL_MISSED,
    ):
        return f"replica {r} {k.replace('_', ' ')}: {e.get('reason')}"
    if k == LauncherEvent.RANDOM_KILLS_STOPPED:
        took = f", a restart takes ~{e['recovery_s']} s" if e.get("recovery_s") is not None else ""
        return f"random kills stopped: {e['steps_left']} steps left{took}"
    if k == LauncherEvent.END:
        return "job finished" if e["ok"] else f"job ended: {e.get('error') or 'not every replica finished'}"
    return None


class CoordinatorProbe:
    """The coordinator's `/status`, read every `every_s` by a daemon thread (a slow or dead
    coordinator never blocks the supervisor's loop). `address` may change (a restarted coordinator)."""

    def __init__(self, every_s: float = 1.0, timeout_s: float = 1.0) -> None:
        self.address: str | None = None
        # called first in the probe's thread: a virtual cluster moves it into the coordinator's
        # network (VirtualCluster.enter), where the coordinator's address is reachable
        self.in_thread: Callable[[], None] | None = None
        self.every_s, self.timeout_s = every_s, timeout_s
        self.status: dict | None = None
        self.answered_at: float | None = None  # time.monotonic() of the latest answer
        self.failing_since: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="coordinator-probe", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        if self.in_thread is not None:
            self.in_thread()
        while not self._stop.is_set():
            address = self.address
            if address:
                try:
                    with urllib.request.urlopen(f"http://{address}/status", timeout=self.timeout_s) as r:
                        self.status = json.loads(r.read())
                    self.answered_at, self.failing_since = time.monotonic(), None
                except (OSError, ValueError):
                    if self.failing_since is None:
                        self.failing_since = time.monotonic()
            self._stop.wait(self.every_s if address else 0.2)

    def describe(self, supervisor_says: str) -> str:
        """One line on the coordinator, as of its latest answer."""
        if supervisor_says == "down":
            return "coordinator DOWN (restarting)"
        now = time.monotonic()
        if self.failing_since is not None and now - self.failing_since > 1.5:
            return f"coordinator not answering for {now - self.failing_since:.0f} s"
        s = self.status
        if s is None:
            return "coordinator starting"
        job, q = s.get("job") or {}, s.get("quorum")
        if s.get("no_progress"):
            stuck = s["progress"]
            return f"NO PROGRESS for {stuck['seconds']:.0f} s at step {stuck['step']} (see the status page)"
        if q is None:
            expected = s.get("expected_replicas") or 0
            return (
                f"coordinator up, waiting for replicas: {len(s.get('replicas', []))}"
                + (f" of {expected}" if expected else "")
                + " connected"
            )
        parts = [f"quorum #{q['quorum_id']}: {q['num_contributors']} of {len(q['participants'])} contributing"]
        if job.get("finished"):
            parts.append("target reached")
        elif job.get("eta_s") is not None:
            parts.append(f"ETA {job['eta_s']:.0f} s")
        if job.get("tokens_per_s"):
            parts.append(f"{job['tokens_per_s']:,.0f} tokens/s")
        if job.get("ettr") is not None:
            parts.append(f"ETTR {job['ettr']:.2f}")
        return "  ".join(parts)


class _View:
    """What both views hold: the console, the coordinator's probe, and the time of the job's first
    event, from which every event line counts its seconds."""

    def __init__(self, console: Console, probe: CoordinatorProbe | None = None):
        self.console = console
        self.probe = probe or CoordinatorProbe()
        self.t0: float | None = None

    def _stamped(self, e: dict, width: int) -> str | None:
        """`e`'s line after its seconds since the first event, `width` characters wide (None: not shown)."""
        if self.t0 is None:
            self.t0 = e[TIME]
        line = describe(e)
        return f"[{e[TIME] - self.t0:{width}.1f}s] {line}" if line else None


class PlainView(_View):
    """Event lines on a non-terminal stream."""

    def __init__(self, console: Console, probe: CoordinatorProbe | None = None):
        super().__init__(console, probe)
        self._next = 1
        self._stall = _StallNote()

    def start(self) -> None:
        self.probe.start()

    def stop(self) -> None:
        self.probe.stop()

    def event(self, e: dict) -> None:
        line = self._stamped(e, 7)
        if line:
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def poll(self, replicas: list[ReplicaStatus], job: dict) -> None:
        self.probe.address = job.get("coordinator_http")
        parts = 20  # a progress line every 5% of the steps
        if job["steps"] and job["step"] * parts >= self._next * job["steps"]:
            self._next = job["step"] * parts // job["steps"] + 1
            cells = "  ".join(
                f"r{s.replica}:{s.state.value}@{s.step}"
                + (f" loss {s.loss:.3f}" if s.loss else "")
                + (f" +{s.computes}" if s.computes else "")
                for s in replicas
            )
            self.console.print(
                f"  step {job['step']}/{job['steps']}  {cells}  [{self.probe.describe(job['coordinator'])}]",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
        note = self._stall.poll(job["step"], self.probe.status, time.monotonic())
        if note:
            self.console.print(note, markup=False, highlight=False, soft_wrap=True)


class _StallNote:
    """A line when the job's step has not moved for `every_s` (and each `every_s` after) while the
    coordinator holds requests: its reason for not forming a quorum. A log read after the fact (CI,
    a batch job) then says who the job waited for, which the status page said only at the time."""

    def __init__(self, every_s: float = 30.0):
        self.every_s = every_s
        self._step, self._since, self._said = -1, 0.0, 0

    def poll(self, step: int, status: dict | None, now: float) -> str | None:
        if step != self._step:
            self._step, self._since, self._said = step, now, 0
            return None
        stalled = now - self._since
        if stalled < self.every_s * (self._said + 1) or not status or not status.get("pending"):
            return None
        self._said = int(stalled // self.every_s)
        why = status.get("waiting_because")
        if step == 0 and status.get("quorum") is None:  # the job's start: some may still compile, not stuck
            return f"  starting: no quorum yet after {stalled:.0f} s (replicas ask once compiled); waiting: {why}"
        return f"  step {step}: none for {stalled:.0f} s; coordinator waits: {why}"


class LiveView(_View):
    """A rich Live table on a terminal."""

    def __init__(self, console: Console, keep: int = 8, probe: CoordinatorProbe | None = None):
        super().__init__(console, probe)
        self.events: deque[str] = deque(maxlen=keep)
        self.live = Live(console=console, refresh_per_second=4, transient=False)

    def start(self) -> None:
        self.probe.start()
        self.live.start()

    def stop(self) -> None:
        self.probe.stop()
        self.live.stop()

    def event(self, e: dict) -> None:
        line = self._stamped(e, 6)
        if line:
            self.events.append(line)

    def poll(self, replicas: list[ReplicaStatus], job: dict) -> None:
        self.probe.address = job.get("coordinator_http")
        table = Table(
            title=f"ftjax launch: step {job['step']}/{job['steps']}  {self.probe.describe(job['coordinator'])}",
            title_justify="left",
        )
        others = any(s.computes for s in replicas)  # a constant global batch in an outage
        for col in ("replica", "state", "step", "loss", "participants", "restarts") + (
            ("also computes",) if others else ()
        ):
            table.add_column(col, justify="left" if col in ("state", "also computes") else "right")
        for s in replicas:
            table.add_row(
                str(s.replica),
                Text(s.state.value, style=_PHASE_STYLE[s.state]),
                str(s.step),
                f"{s.loss:.4f}" if s.loss is not None else "-",
                str(s.participants or "-"),
                str(s.restarts),
                *((s.computes or "-",) if others else ()),
            )
        if job.get("coordinator_http"):
            table.caption = f"status page: http://{job['coordinator_http']}/"
        self.live.update(Group(table, Text("\n".join(self.events), style="dim")))


def make_view(console: Console | None = None) -> PlainView | LiveView:
    console = console or Console()
    return LiveView(console) if sys.stdout.isatty() and console.is_terminal else PlainView(console)


def digests_verdict(summary: dict) -> str:
    """'equal', 'DIFFER', or which replicas have no digest (they never trained, or never finished:
    two missing digests are no difference)."""
    digests = {rid: rec.get("param_digest") for rid, rec in summary["replicas"].items() if not rec.get("ended_behind")}
    missing = [rid for rid, d in digests.items() if not d]
    present = {d for d in digests.values() if d}
    if missing:
        who = "any replica" if len(missing) == len(digests) else "replica " + ", ".join(missing)
        rest = "" if not present else "; the others " + ("[green]equal[/]" if len(present) == 1 else "[red]DIFFER[/]")
        return f"[yellow]no digest for {who}[/] (never trained, or did not finish){rest}"
    return "[green]equal[/]" if summary["digests_equal"] else "[red]DIFFER[/]"


def print_ends(console: Console, summary: dict) -> None:
    """One line per incarnation that did not finish: how it ended, what it contributed, its last words."""
    for rid, rec in summary["replicas"].items():
        for inc in rec.get("incarnations") or []:
            if inc["cause"] not in ("done", "running at the end"):
                console.print(
                    f"replica {rid} incarnation {inc['incarnation']}: {inc['cause']} after contributing "
                    f"{inc['steps_contributed']} steps" + (f": {inc['error']}" if inc.get("error") else ""),
                    highlight=False,
                    markup=False,
                )


def print_summary(console: Console, summary: dict, run_dir: str) -> None:
    """The end-of-run table: per replica steps committed and contributed (trained with its own
    batches: a replica that only heals contributes none), restarts, catch-up time, digest; then the
    job's figures."""
    table = Table(title="ftjax launch: summary", title_justify="left")
    for col in ("replica", "steps", "contributed", "restarts", "catch-up s", "exactly once"):
        table.add_column(col, justify="right")
    table.add_column("param digest", no_wrap=True, min_width=16)
    for rid, rec in summary["replicas"].items():
        table.add_row(
            rid,
            str(rec["steps_committed"]),
            str(rec["steps_contributed"]),
            str(rec["restarts"]),
            f"{rec['catchup_s']:.2f}",
            "yes" if rec["exactly_once"] else "[red]NO[/]",
            (rec["param_digest"] or "no digest")
            + (" (ended behind: the job finished without it)" if rec.get("ended_behind") else ""),
        )
    # In a log file or a pipe the console is 80 columns wide, and rich would squash the headers to
    # "…" to fit: there the table takes the width it needs (a terminal keeps its own width).
    # (print's own width= is capped at the console's: the console is widened for the table alone)
    width, wide = console.width, Measurement.get(console, console.options.update(max_width=1000), table).maximum
    try:
        if not console.is_terminal and wide > width:
            console.width = wide
        console.print(table)
    finally:
        console.width = width

    def num(key: str, fmt: str) -> str:
        v = summary.get(key)
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    ettr = num("ettr", ".3f") if summary.get("ettr") is not None else f"n/a ({summary.get('ettr_why') or 'unknown'})"
    console.print(
        f"committed steps {summary['committed_steps']}/{summary['steps']}   failures {summary['failures']}   "
        f"wall {num('wall_s', '.1f')} s   ETTR {ettr}   median step {num('median_step_s', '.3f')} s   "
        f"max healthy stall {num('max_healthy_stall_s', '.3f')} s (waited {num('max_healthy_wait_s', '.3f')} s)   "
        f"final loss {num('final_loss', '.4f')}"
    )
    equal = digests_verdict(summary)
    once = (
        "[red]NO[/]"
        if not summary["exactly_once"]
        else "[green]yes[/]"
        if summary["committed_steps"]
        else "- (none committed)"
    )
    console.print(f"replica digests {equal}   every batch exactly once {once}")
    print_ends(console, summary)  # (a run the launcher stopped: `exit_code` says why, last)
    if summary.get("split_history"):
        split = summary["split_history"]
        console.print(
            f"[red]split history[/]: {len(split['steps'])} steps committed in two quorum lineages with "
            f"different states (first: step {split['first']['step']}: {split['first']['commits']})"
        )
    for name in ("summary.json", "loss.png", "timeline.png"):
        if (Path(run_dir) / name).exists():  # (no plots with --no-plots)
            console.print(f"  {run_dir}/{name}", highlight=False)
