"""`ftjax launch CONFIG [key=value ...]`: a fault-tolerant job on this machine.

Starts the coordinator and R replicas of H hosts (processes) with D simulated CPU devices each,
restarts a replica whose process dies (as a whole, after --restart-delay-s), injects the faults
asked for, shows the job live, and writes RUN/summary.json, RUN/loss.png and RUN/timeline.png.
With --virtual-cluster every process runs on a virtual host of its own (network and mount
namespaces: hosts share nothing but the network), and --partition / --bandwidth-mbit inject
network faults. With --emit slurm|k8s DIR it writes the cluster job files of the same job instead
of running it.
No process outlives the launcher: not on a normal end, not on Ctrl-C or SIGTERM, not on an error.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from ftjax.base.tls import add_tls_arguments, tls_of
from ftjax.config import Config, ConfigError, load_config
from ftjax.launch.cluster import options as cluster
from ftjax.launch.fault_plan import (
    FaultPlan,
    check_seconds,
    parse_bandwidth,
    parse_hang,
    parse_kill,
    parse_kill_host,
    parse_partition,
    parse_seconds,
)
from ftjax.launch.supervisor import LaunchError, check_host_repair
from ftjax.runtime.args import add_init_from, init_from_override, option

if TYPE_CHECKING:
    from ftjax.base.procs import ProcessGroup
    from ftjax.launch.job import LocalJob
    from ftjax.launch.supervisor import RunLog, Supervisor
    from ftjax.launch.vcluster import VirtualCluster
    from ftjax.launch.view import LiveView, PlainView


class UsageError(ValueError):
    """A bad option; the message names it. Exit code 2, nothing started or written."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ftjax launch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_job_arguments(p)
    _add_fault_arguments(p)
    _add_virtual_cluster_arguments(p)
    _add_supervision_arguments(p)
    _add_emit_arguments(p)
    return p


def _add_job_arguments(p: argparse.ArgumentParser) -> None:
    """The job itself: config, overrides, its shape, its run directory, what each replica runs."""
    p.add_argument("config", help="YAML config: a path, or a built-in name (tiny, gpt_small)")
    p.add_argument(
        "overrides", nargs="*", help="key.sub=value overrides, e.g. steps=400 coordinator.heartbeat_timeout_s=2"
    )
    p.add_argument("--replicas", type=int, default=None, help="replicas R (default: the config's ft.replicas)")
    p.add_argument("--hosts-per-replica", type=int, default=None, help="processes per replica H (default: mesh.hosts)")
    p.add_argument(
        "--devices-per-host",
        type=int,
        default=None,
        help="simulated CPU devices per process D (default: mesh.devices_per_host)",
    )
    p.add_argument(
        "--out", default=None, help="run directory (default: runs/launch-<config name>); must be new or empty"
    )
    p.add_argument("--overwrite", action="store_true", help="delete --out first if it holds an earlier run")
    p.add_argument(
        "--no-plots",
        dest="plots",
        action="store_false",
        help="do not draw RUN/loss.png and RUN/timeline.png at the end (scripts, sweeps, the test suite: "
        "drawing them is ~2 s of CPU per job, most of it importing matplotlib)",
    )
    option(
        p,
        "--entry",
        "COMMAND",
        help="run COMMAND instead of `ftjax train` for each replica (a script that owns its loop through "
        "ftjax.FaultTolerance.join); it gets `ftjax train`'s arguments. A leading `python` is this "
        "launcher's interpreter",
    )
    add_init_from(p, "every replica starts", ", passed on to the replicas")
    add_tls_arguments(p)  # passed on to the coordinator and the replicas


def _add_fault_arguments(p: argparse.ArgumentParser) -> None:
    f = p.add_argument_group("faults (times count from warm-up: every replica has trained a step)")
    f.add_argument(
        "--kill",
        action="append",
        default=[],
        metavar="R@STEP[:PHASE]",
        help="replica R SIGKILLs itself at STEP in PHASE: forward (default) | ftar | commit | catchup "
        "(catchup: killed at STEP, then killed again while its new incarnation catches up)",
    )
    f.add_argument(
        "--kill-host",
        action="append",
        default=[],
        metavar="R@STEP:HOST",
        help="only host HOST of replica R dies at STEP; the whole replica restarts, or with "
        "ft.on_host_loss=reduce its other hosts go on as a reduced-degree replica",
    )
    option(f, "--mtbf-s", "S", type=float, help="random whole-replica kills, exponential intervals of mean S seconds")
    f.add_argument("--seed", type=int, default=0, help="seed of the random kills (default 0)")
    f.add_argument("--hang", action="append", default=[], metavar="R@T", help="SIGSTOP replica R at T seconds")
    f.add_argument(
        "--kill-coordinator-at",
        action="append",
        default=[],
        metavar="T",
        help="SIGKILL the coordinator at T seconds (it is restarted after --restart-delay-s)",
    )


def _add_virtual_cluster_arguments(p: argparse.ArgumentParser) -> None:
    v = p.add_argument_group("virtual cluster (Linux, as root)")
    v.add_argument(
        "--virtual-cluster",
        action="store_true",
        help="run the coordinator and every host of every replica on a virtual host of its own: its own "
        "network namespace (an address on a bridge, its own loopback) and mount namespace (its own "
        "/dev/shm and temp dir), so that hosts share nothing but the network",
    )
    v.add_argument(
        "--partition",
        action="append",
        default=[],
        metavar="R[/H]@STEP:SECONDS",
        help="cut the links of replica R's hosts (of host H only, with /H) once R has trained STEP, and "
        "restore them SECONDS later (needs --virtual-cluster)",
    )
    v.add_argument(
        "--bandwidth-mbit",
        action="append",
        default=[],
        metavar="all|R|R/H=MBIT",
        help="cap the bandwidth of every host (all), of replica R's hosts, or of host H of replica R, "
        "at MBIT megabits per second each way: tc tbf (needs --virtual-cluster)",
    )


def _add_supervision_arguments(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("supervision")
    s.add_argument("--restart-delay-s", type=float, default=1.0, help="delay before a dead replica restarts (1.0)")
    s.add_argument("--max-restarts", type=int, default=10, help="per replica; one more failure ends the job (10)")
    option(
        s,
        "--host-repair-s",
        "S",
        type=float,
        help="a host whose process died (--kill-host, a crash of one host) is back S seconds later: "
        "its replica restarts whole then, or goes on reduced meanwhile with "
        "ft.on_host_loss=reduce (default: back at once, with the restart)",
    )
    option(
        s,
        "--host-repair-steps",
        "N",
        type=int,
        help="instead of --host-repair-s: the host is back once its replica has trained N steps of its "
        "own at a reduced degree (needs ft.on_host_loss=reduce): a repair paced by the job, not the clock",
    )
    s.add_argument(
        "--hang-timeout-s",
        type=float,
        default=None,
        help="silence that makes a replica hung while peers train (default: 2 x ft.ftar_timeout_s)",
    )
    s.add_argument(
        "--startup-timeout-s", type=float, default=300.0, help="first step of an incarnation due within (300)"
    )
    s.add_argument("--timeout-s", type=float, default=3600.0, help="the whole job (3600)")
    option(
        s,
        "--compile-cache",
        "DIR|none",
        help="JAX persistent compilation cache shared by the job's processes, so that a restarted "
        "replica does not compile again (default: the machine-wide ~/.cache/ftjax/xla; none: off)",
    )


def _add_emit_arguments(p: argparse.ArgumentParser) -> None:
    e = p.add_argument_group("cluster job files")
    e.add_argument(
        "--emit",
        nargs=2,
        metavar=("slurm|k8s", "DIR"),
        default=None,
        help="write job files for this job to DIR instead of running it",
    )
    cluster.add_arguments(e)


def check_options(args: argparse.Namespace) -> None:
    """Range-check every option (argparse checks only their types): UsageError naming the option."""
    for flag, value, low in (
        ("--replicas", args.replicas, 1),
        ("--hosts-per-replica", args.hosts_per_replica, 1),
        ("--devices-per-host", args.devices_per_host, 1),
        ("--max-restarts", args.max_restarts, 0),
        ("--host-repair-steps", args.host_repair_steps, 1),
    ):  # 0: the first failure ends the job
        if value is not None and value < low:
            raise UsageError(f"{flag}: must be >= {low} (got {value})")
    try:
        check_seconds("--restart-delay-s", args.restart_delay_s)
        for flag, value in (
            ("--mtbf-s", args.mtbf_s),
            ("--hang-timeout-s", args.hang_timeout_s),
            ("--host-repair-s", args.host_repair_s),
            ("--startup-timeout-s", args.startup_timeout_s),
            ("--timeout-s", args.timeout_s),
        ):
            if value is not None:  # None: the default, derived from the config
                check_seconds(flag, value, positive=True)
    except ValueError as e:
        raise UsageError(str(e)) from None
    for flag, path in (
        ("--out", args.out),
        ("--emit", args.emit[1] if args.emit else None),
        ("--compile-cache", None if args.compile_cache == "none" else args.compile_cache),
    ):
        if path is not None:
            check_directory(flag, path)
    for flag, given in (("--partition", args.partition), ("--bandwidth-mbit", args.bandwidth_mbit)):
        if given and not args.virtual_cluster:
            raise UsageError(f"{flag}: needs --virtual-cluster (the links it acts on are the virtual cluster's)")
    if args.virtual_cluster and args.emit is not None:
        raise UsageError("--virtual-cluster: runs the job on this machine; --emit writes job files for a real cluster")
    try:
        cluster.options_from_args(args)
    except ValueError as e:
        raise UsageError(str(e)) from None


def check_directory(flag: str, path: str) -> None:
    """`path` must be a directory, or one that can be made there: an empty name would mean the
    current directory, and a file in the way fails only once the job has started."""
    if not path:
        raise UsageError(f"{flag}: empty path")
    where = Path(path)
    existing = next(p for p in (where, *where.parents) if p.exists())  # "." or "/" at the latest
    if not existing.is_dir():
        raise UsageError(f"{flag} {path}: {existing} is not a directory")


def entry_command(entry: str | None) -> list[str] | None:
    """`--entry`'s argv (a leading `python` or `python3`: this interpreter, whose ftjax is this one)."""
    if entry is None:
        return None
    argv = shlex.split(entry)
    if not argv:
        raise UsageError("--entry: empty command")
    return [sys.executable, *argv[1:]] if argv[0] in ("python", "python3") else argv


def check_entry(args: argparse.Namespace, cfg: Config) -> None:
    """--entry's command exists here, and its replicas run on one host (`FaultTolerance.join`'s;
    `RunArgs.parse` refuses more in every host of every incarnation, which would be restarted)."""
    command = entry_command(args.entry)
    if command is None:
        return
    # (with --emit the command runs on the cluster, whose PATH is not this machine's)
    if args.emit is None and shutil.which(command[0]) is None:
        raise UsageError(f"--entry: {command[0]}: no such command (not on PATH, or not an executable file)")
    if cfg.mesh.hosts > 1:
        raise UsageError(
            f"--entry: FaultTolerance.join runs a script's replica on one host, not mesh.hosts={cfg.mesh.hosts}: "
            "run a multi-host replica in the built-in loop (ftjax train, ftjax.fit), or give mesh.hosts=1"
        )


def check_task_in_child(config: str, overrides: list[str]) -> None:
    """`ftjax check` in a child process (this one keeps JAX unimported: on an accelerator, JAX
    would take the device's memory): a user's task that does not import, or whose loss has the
    wrong shape, is refused before any process starts."""
    proc = subprocess.run(
        [sys.executable, "-m", "ftjax", "check", config, *overrides], capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        raise UsageError(
            lines[-1].removeprefix("ftjax check: error: ") if lines else f"ftjax check exited {proc.returncode}"
        )


@dataclass(frozen=True)
class Launch:
    """A launch, validated: the options, the config, its overrides, replicas, the faults, the run directory."""

    args: argparse.Namespace
    cfg: Config
    overrides: list[str]
    replicas: int
    plan: FaultPlan
    out: Path


def prepare(args: argparse.Namespace) -> Launch:
    """Validate everything before anything starts."""
    check_options(args)
    overrides = list(args.overrides)
    if args.hosts_per_replica is not None:
        overrides.append(f"mesh.hosts={args.hosts_per_replica}")
    if args.devices_per_host is not None:
        overrides.append(f"mesh.devices_per_host={args.devices_per_host}")
    if args.init_from is not None:
        if args.emit is None and not Path(args.init_from).is_dir():  # (a cluster's path may exist only there)
            raise UsageError(f"--init-from {args.init_from}: not a directory")
        overrides.append(init_from_override(args.init_from))
    try:
        args.tls = tls_of(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.tls is not None and args.emit is not None:
        raise UsageError("--tls-cert: not with --emit (the cluster files have no TLS flags yet)")
    cfg = load_config(args.config, overrides)
    replicas = cfg.ft.replicas if args.replicas is None else args.replicas
    cfg = load_config(args.config, [*overrides, f"ft.replicas={replicas}"])
    check_entry(args, cfg)
    if cfg.task is not None:
        check_task_in_child(args.config, overrides)
    if cfg.coordinator.min_replicas > replicas:
        raise UsageError(
            f"coordinator.min_replicas ({cfg.coordinator.min_replicas}) exceeds --replicas {replicas}: "
            "no quorum could ever form"
        )
    try:
        plan = FaultPlan(
            injections=(*map(parse_kill, args.kill), *map(parse_kill_host, args.kill_host)),
            hangs=tuple(map(parse_hang, args.hang)),
            coordinator_kills=tuple(parse_seconds("--kill-coordinator-at", t) for t in args.kill_coordinator_at),
            mtbf_s=args.mtbf_s,
            seed=args.seed,
            partitions=tuple(map(parse_partition, args.partition)),
            bandwidth=tuple(map(parse_bandwidth, args.bandwidth_mbit)),
        )
        plan.validate(replicas, cfg.mesh.hosts, cfg.steps)
        check_host_repair(args.host_repair_s, args.host_repair_steps, cfg.ft.on_host_loss)
    except ValueError as e:
        raise UsageError(str(e)) from None
    out = Path(args.out or Path("runs") / f"launch-{Path(args.config).stem}")
    if args.emit is None and args.out is None:
        check_directory("--out", str(out))  # the default: a file of that name may be in the way too
    if args.emit is None and out.exists() and any(out.iterdir()):
        if not args.overwrite:
            raise UsageError(f"--out {out}: not empty (choose a new directory, or --overwrite an earlier run)")
        if not (out / "launcher.jsonl").exists():
            raise UsageError(f"--out {out}: holds no earlier run (no launcher.jsonl); refusing to delete it")
    if args.virtual_cluster and args.emit is None:
        from ftjax.launch.vcluster import bandwidth_unavailable, unavailable

        why = unavailable() or (bandwidth_unavailable() if plan.bandwidth else None)
        if why is not None:
            raise UsageError(f"--virtual-cluster: this machine cannot run one: {why}")
    return Launch(args, cfg, overrides, replicas, plan, out)


def make_cluster(replicas: int, hosts: int, plan: FaultPlan) -> VirtualCluster:
    """The virtual cluster of a job: a host for the coordinator and one for each host of each
    replica, with the plan's bandwidth caps set."""
    from ftjax.launch.job import COORDINATOR_HOST, host_name, job_hosts
    from ftjax.launch.vcluster import VirtualCluster

    cluster = VirtualCluster(job_hosts(replicas, hosts)).create()
    try:
        for cap in plan.bandwidth:
            if cap.replica is None:
                names = [COORDINATOR_HOST, *(host_name(r, h) for r in range(replicas) for h in range(hosts))]
            else:
                names = [host_name(cap.replica, h) for h in (range(hosts) if cap.host is None else [cap.host])]
            cluster.limit(names, cap.mbit)
    except BaseException:
        cluster.close()
        raise
    return cluster


def compile_cache_env(cache: str | None, out: Path) -> dict[str, str]:
    """Environment for the children's persistent JAX compilation cache.

    By default every ftjax process already shares one machine-wide cache (`ftjax.base.env`): a
    restarted incarnation reads back the programs its first incarnation compiled instead of
    compiling them again (a restart on a small machine is mostly compilation). `DIR` points this
    job at its own cache; `none` turns caching off."""
    if cache is None:
        return {}
    if cache == "none":
        return {"JAX_COMPILATION_CACHE_DIR": ""}
    return {"JAX_COMPILATION_CACHE_DIR": str(Path(cache).resolve())}


def _raise_on_signal(signum, frame):
    # SIGINT and SIGTERM become exceptions, so that every `finally` (which kills the children) runs.
    raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    # (a log file or a pipe: no wrapping at rich's default 80 columns, which broke figures in two)
    console = Console() if sys.stdout.isatty() else Console(soft_wrap=True)
    try:
        args = build_parser().parse_intermixed_args(argv)
        launch = prepare(args)
    except (UsageError, ConfigError) as e:
        print(f"ftjax launch: error: {e}", file=sys.stderr)
        return 2
    if args.emit is not None:
        from ftjax.launch.emit import EmitError, emit

        kind, where = args.emit
        try:
            written = emit(
                kind,
                where,
                args.config,
                [*launch.overrides, f"ft.replicas={launch.replicas}"],
                options=cluster.options_from_args(args),
            )
        except EmitError as e:
            print(f"ftjax launch: error: {e}", file=sys.stderr)
            return 2
        for path in written:
            console.print(str(path), highlight=False)
        return 0
    previous = {s: signal.signal(s, _raise_on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return run(launch, console)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run(launch: Launch, console: Console) -> int:
    from ftjax.base.procs import ProcessGroup
    from ftjax.launch.job import LocalJob
    from ftjax.launch.supervisor import RunLog
    from ftjax.launch.view import make_view

    args, out, replicas = launch.args, launch.out, launch.replicas
    if args.overwrite and out.exists():
        shutil.rmtree(out)
    view = make_view(console)
    code, log = 1, None
    with ProcessGroup() as procs:  # leaving the block (any way) SIGKILLs every child
        try:
            cluster = _start_virtual_cluster(args, replicas, launch.cfg.mesh.hosts, launch.plan, procs, view)
            job = LocalJob(
                args.config,
                launch.overrides,
                out,
                replicas=replicas,
                procs=procs,
                extra_env=compile_cache_env(args.compile_cache, out),
                cluster=cluster,
                entry=entry_command(args.entry),
                tls=getattr(args, "tls", None),
            )
            log = RunLog(out / "launcher.jsonl", listener=view.event)
            _log_launch(log, launch, cluster)
            supervisor = _supervisor(args, job, launch.plan, log, view)
            view.start()
            code = 0 if supervisor.run() else 1
        except LaunchError as e:
            if log is not None:
                log.event("end", ok=False, error=str(e))
            code = 1
            view.stop()
            console.print(f"[red]ftjax launch: {e}[/]")
        except (KeyboardInterrupt, SystemExit) as e:  # Ctrl-C, SIGTERM: the children die with the group
            code = 130 if isinstance(e, KeyboardInterrupt) else int(e.code or 1)
            if log is not None:
                log.event("end", ok=False, error=f"interrupted ({type(e).__name__})")
            view.stop()
            console.print("[yellow]ftjax launch: interrupted; every process of the job is stopped[/]")
        finally:  # also on any other exception: nothing outlives the launcher
            view.stop()
            procs.close()
            if log is not None:
                log.close()
    if log is None:
        return code
    return _report(out, console, code, plots=args.plots)


def _start_virtual_cluster(
    args: argparse.Namespace,
    replicas: int,
    hosts: int,
    plan: FaultPlan,
    procs: ProcessGroup,
    view: PlainView | LiveView,
) -> VirtualCluster | None:
    """With --virtual-cluster, the job's virtual cluster (closed with `procs`); else None."""
    if not args.virtual_cluster:
        return None
    from ftjax.launch.job import COORDINATOR_HOST
    from ftjax.launch.vcluster import VirtualClusterError

    try:
        cluster = make_cluster(replicas, hosts, plan)
    except VirtualClusterError as e:
        raise LaunchError(f"--virtual-cluster: {e}") from None
    procs.on_close(cluster.close)  # after every child is killed: the namespaces go too
    view.probe.in_thread = partial(cluster.enter, COORDINATOR_HOST)  # its status page is there
    return cluster


def _log_launch(log: RunLog, launch: Launch, cluster: VirtualCluster | None) -> None:
    """The run log's `launch` event: what the job is."""
    args, cfg = launch.args, launch.cfg
    log.event(
        "launch",
        config=args.config,
        overrides=launch.overrides,
        out=str(launch.out),
        replicas=launch.replicas,
        hosts=cfg.mesh.hosts,
        devices=cfg.mesh.devices_per_host,
        steps=cfg.steps,
        restart_delay_s=args.restart_delay_s,
        host_repair_s=args.host_repair_s,
        host_repair_steps=args.host_repair_steps,
        faults=asdict(launch.plan),
        virtual_cluster=None
        if cluster is None
        else {name: {"address": h.ipv4, "netns": h.netns} for name, h in cluster.hosts.items()},
    )


def _supervisor(
    args: argparse.Namespace, job: LocalJob, plan: FaultPlan, log: RunLog, view: PlainView | LiveView
) -> Supervisor:
    """The Supervisor of the job, with the options' policy."""
    from ftjax.launch.supervisor import Supervisor

    return Supervisor(
        job,
        plan,
        log,
        restart_delay_s=args.restart_delay_s,
        hang_timeout_s=args.hang_timeout_s,
        startup_timeout_s=args.startup_timeout_s,
        max_restarts=args.max_restarts,
        timeout_s=args.timeout_s,
        on_poll=view.poll,
        host_repair_s=args.host_repair_s,
        host_repair_steps=args.host_repair_steps,
    )


def _report(out: Path, console: Console, code: int, plots: bool = True) -> int:
    """Write summary.json and (unless --no-plots) the plots, print the summary table."""
    from ftjax.launch.view import print_summary
    from ftjax.runs.summary import build_summary, exit_code, load_run, write_summary

    try:
        summary = write_summary(out)
    except OSError as e:  # a full disk: say so in one line, print what can be printed
        console.print(f"[red]ftjax launch: cannot write {e.filename or out / 'summary.json'} ({e.strerror})[/]")
        summary = build_summary(out)
        code = code or 1
    if plots:
        from ftjax.launch.plots import write_loss, write_timeline

        try:
            run = load_run(out)
            write_loss(run, out / "loss.png")
            write_timeline(run, out / "timeline.png", summary["median_step_s"] or 0.0)
        except OSError as e:
            console.print(f"[yellow]ftjax launch: cannot write the plots ({e.strerror})[/]")
    print_summary(console, summary, str(out))
    code, why = exit_code(summary, code)
    if why:
        console.print(f"[red]ftjax launch: {why}[/]")
    return code
