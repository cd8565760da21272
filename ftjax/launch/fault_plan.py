"""The fault plan of `ftjax launch`: what to inject, where and when (--kill, --kill-host, --hang,
--kill-coordinator-at, --mtbf-s, --partition, --bandwidth-mbit), parsed from the command line and
checked against the job. The supervisor (ftjax/launch/supervisor.py) fires it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ftjax.runtime.faults import PHASES, parse_step_phase


# --- the fault schedule ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Injection:
    """A self-SIGKILL at step `step`, phase `phase`, of host `host` of replica `replica`."""

    replica: int
    step: int
    phase: str = "forward"
    host: int = 0
    kind: str = "kill"  # kill | kill_host

    @property
    def die_at(self) -> str:
        # A catch-up kill first takes the replica down at that step; its next incarnation is killed
        # while it catches up (see the module docstring).
        return f"{self.step}:{'forward' if self.phase == 'catchup' else self.phase}"


@dataclass(frozen=True)
class Hang:
    replica: int
    after_s: float


@dataclass(frozen=True)
class Partition:
    """`--partition R[/H]@STEP:SECONDS`: the links of replica R's hosts (host H only, if given) are
    cut once R has trained step STEP, and restored `seconds` later."""

    replica: int
    step: int
    seconds: float
    host: int | None = None  # None: every host of the replica


@dataclass(frozen=True)
class BandwidthCap:
    """`--bandwidth-mbit TARGET=MBIT`: TARGET all (every host, the coordinator's too), R (every host
    of replica R) or R/H (host H of replica R)."""

    mbit: float
    replica: int | None = None  # None: every host
    host: int | None = None  # None: every host of the replica


@dataclass(frozen=True)
class FaultPlan:
    injections: tuple[Injection, ...] = ()
    hangs: tuple[Hang, ...] = ()
    coordinator_kills: tuple[float, ...] = ()
    mtbf_s: float | None = None
    seed: int = 0
    partitions: tuple[Partition, ...] = ()
    bandwidth: tuple[BandwidthCap, ...] = ()

    def validate(self, replicas: int, hosts: int, steps: int) -> None:
        """Raise ValueError naming the flag whose value does not fit this job."""
        for i in self.injections:
            flag = f"--{i.kind.replace('_', '-')}"
            if not 0 <= i.replica < replicas:
                raise ValueError(f"{flag}: replica {i.replica} is not in [0, {replicas})")
            if not 1 <= i.step <= steps:
                raise ValueError(f"{flag}: step {i.step} is not in [1, steps={steps}]")
            if not 0 <= i.host < hosts:
                raise ValueError(f"{flag}: host {i.host} is not in [0, {hosts}) (--hosts-per-replica {hosts})")
        for h in self.hangs:
            if not 0 <= h.replica < replicas:
                raise ValueError(f"--hang: replica {h.replica} is not in [0, {replicas})")
        if self.mtbf_s is not None and replicas < 2:
            raise ValueError("--mtbf-s: random kills need at least 2 replicas (a peer must hold the state)")
        targets: list[tuple[str, Partition | BandwidthCap]] = [
            *(("--partition", p) for p in self.partitions),
            *(("--bandwidth-mbit", b) for b in self.bandwidth),
        ]
        for flag, target in targets:
            if target.replica is not None and not 0 <= target.replica < replicas:
                raise ValueError(f"{flag}: replica {target.replica} is not in [0, {replicas})")
            if target.host is not None and not 0 <= target.host < hosts:
                raise ValueError(f"{flag}: host {target.host} is not in [0, {hosts}) (--hosts-per-replica {hosts})")
        for p in self.partitions:
            if not 1 <= p.step <= steps:
                raise ValueError(f"--partition: step {p.step} is not in [1, steps={steps}]")

    def for_replica(self, r: int) -> list[Injection]:
        return sorted((i for i in self.injections if i.replica == r), key=lambda i: i.step)


def _replica_and_rest(flag: str, text: str, form: str) -> tuple[int, str]:
    rid, sep, rest = text.partition("@")
    if not sep or not rid.isdigit() or not rest:
        raise ValueError(f"{flag}: expected {form}, got {text!r}")
    return int(rid), rest


def parse_kill(text: str) -> Injection:
    """`R@STEP[:PHASE]` (PHASE: forward|ftar|commit|catchup; default forward)."""
    form = f"REPLICA@STEP[:PHASE] with PHASE in {'|'.join(PHASES)}"
    r, rest = _replica_and_rest("--kill", text, form)
    try:
        step, phase = parse_step_phase(rest, "--kill")
    except ValueError:
        raise ValueError(f"--kill: expected {form} and STEP >= 1, got {text!r}") from None
    return Injection(r, step, phase)


def parse_kill_host(text: str) -> Injection:
    """`R@STEP:HOST`: host HOST of replica R kills itself at STEP (forward); the replica restarts whole."""
    form = "REPLICA@STEP:HOST"
    r, rest = _replica_and_rest("--kill-host", text, form)
    step, sep, host = rest.partition(":")
    if not sep or not step.isdigit() or int(step) < 1 or not host.isdigit():
        raise ValueError(f"--kill-host: expected {form} with STEP >= 1, got {text!r}")
    return Injection(r, int(step), "forward", int(host), kind="kill_host")


def _target(flag: str, text: str, form: str) -> tuple[int, int | None]:
    """`R` or `R/H` -> (replica, host or None)."""
    rid, sep, host = text.partition("/")
    if not (rid.isascii() and rid.isdigit()) or (sep and not (host.isascii() and host.isdigit())):
        raise ValueError(f"{flag}: expected {form}, got {text!r}")
    return int(rid), int(host) if sep else None


def parse_partition(text: str) -> Partition:
    """`R[/H]@STEP:SECONDS`: cut replica R's links (host H's only, if given) once R has trained step
    STEP, for SECONDS."""
    form = "REPLICA[/HOST]@STEP:SECONDS"
    target, sep, rest = text.partition("@")
    step, sep2, seconds = rest.partition(":")
    if not sep or not sep2 or not (step.isascii() and step.isdigit()) or int(step) < 1:
        raise ValueError(f"--partition: expected {form} with STEP >= 1, got {text!r}")
    replica, host = _target("--partition", target, form)
    try:
        value = float(seconds)
    except ValueError:
        raise ValueError(f"--partition: expected {form} with SECONDS a number, got {text!r}") from None
    return Partition(replica, int(step), check_seconds("--partition", value, positive=True), host)


def parse_bandwidth(text: str) -> BandwidthCap:
    """`TARGET=MBIT`: TARGET all, R or R/H; MBIT megabits per second (> 0), each way."""
    form = "TARGET=MBIT with TARGET all, REPLICA or REPLICA/HOST"
    target, sep, mbit = text.partition("=")
    if not sep:
        raise ValueError(f"--bandwidth-mbit: expected {form}, got {text!r}")
    replica, host = (None, None) if target == "all" else _target("--bandwidth-mbit", target, form)
    try:
        value = float(mbit)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"--bandwidth-mbit: expected {form} and MBIT a number > 0, got {text!r}")
    return BandwidthCap(value, replica, host)


def parse_seconds(flag: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{flag}: expected seconds (a number), got {text!r}") from None
    return check_seconds(flag, value)


def check_seconds(flag: str, value: float, *, positive: bool = False) -> float:
    """`value`, when it is a finite number of seconds >= 0 (> 0 if `positive`); else ValueError naming
    `flag`. NaN compares false with everything, so a plain `value < 0` test would let it through."""
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{flag}: expected a finite number of seconds {'>' if positive else '>='} 0, got {value:g}")
    return value


def parse_hang(text: str) -> Hang:
    """`R@T`: SIGSTOP replica R T seconds after warm-up."""
    r, rest = _replica_and_rest("--hang", text, "REPLICA@SECONDS")
    return Hang(r, parse_seconds("--hang", rest))
