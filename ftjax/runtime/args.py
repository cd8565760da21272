"""A replica process's command line: what `ftjax train` takes and what `ftjax launch` (and
`ftjax launch --entry SCRIPT`) passes to each replica process, parsed into a validated config.

It lives below the CLI because three parties read it: `ftjax train`, a script's
`FaultTolerance.join` (`RunArgs.parse`), and the launcher (`init_from_override`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, fields
from pathlib import Path

from ftjax.base import net
from ftjax.base.net import split_address
from ftjax.base.tls import TLS, add_tls_arguments, tls_of
from ftjax.config import Config, ConfigError, load_config
from ftjax.runs.jsonl import read_jsonl


def option(p: argparse.ArgumentParser | argparse._ArgumentGroup, flag: str, metavar: str, **kwargs) -> None:
    """An option that takes a value and stays None when not given (what then applies is derived
    later, from the config or the job): the common form of `ftjax train`'s, `ftjax launch`'s and
    the cluster job files' options."""
    p.add_argument(flag, default=None, metavar=metavar, **kwargs)


def add_init_from(p: argparse.ArgumentParser, who: str, more: str) -> None:
    """`--init-from DIR`, as `ftjax train` takes it and `ftjax launch` passes it on (the override it
    stands for: `init_from_override`); `who` starts the help, `more` ends it."""
    option(
        p,
        "--init-from",
        "DIR",
        help=f"{who} from the parameters of this orbax checkpoint instead of the seed's (sets "
        f"checkpoint.init_from{more})",
    )


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """`ftjax train`'s parser (``description``: its --help text)."""
    p = argparse.ArgumentParser(
        prog="ftjax train", description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _run_arguments(p)
    _process_arguments(p)
    add_tls_arguments(p)
    _fault_arguments(p)
    option(
        p,
        "--log-every",
        "N",
        type=int,
        help="when stdout is not a terminal (a file, a pipe), print a plain line every N steps "
        "(default: about 20 lines per run), besides one per event and the end of the run",
    )
    return p


def _run_arguments(p: argparse.ArgumentParser) -> None:
    """What to train, where, and from what: the config, its overrides, the run directory."""
    p.add_argument("config", help="YAML config: a path, or a built-in name (tiny, gpt_small)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. steps=30 model.d_model=128")
    p.add_argument(
        "--out",
        default=None,
        help="run directory (default: runs/<config name>; a job member's: runs/<config name>/replica-R)",
    )
    p.add_argument("--resume", action="store_true", help="continue from the latest durable checkpoint")
    add_init_from(p, "start", "; checkpoint.init_opt=true takes its optimizer state too")
    option(p, "--stop-after", "N", type=int, help="stop (with a checkpoint) once N steps are done, as if interrupted")


def _process_arguments(p: argparse.ArgumentParser) -> None:
    """Where this process stands: its rank in the replica, the replica's in the job."""
    p.add_argument("--num-processes", type=int, default=None, help="hosts in this replica (sets mesh.hosts)")
    p.add_argument("--process-id", type=int, default=0, help="this process's rank within the replica")
    p.add_argument(
        "--dist-address",
        default=None,
        help="HOST:PORT of the replica's jax.distributed service (process 0 serves it, bound to "
        "net.bind_host; every process dials HOST)",
    )
    p.add_argument("--replica-id", type=int, default=0, help="this replica's index in the job (0-based)")
    p.add_argument("--coordinator", default=None, help="HOST:PORT of the job's coordinator (joins a job)")


def process_flags(processes: int, process_id: int, dist_address: str) -> list[str]:
    """The flags that make a process host `process_id` of a replica of `processes` hosts, meeting
    at `dist_address` (what `_process_arguments` reads)."""
    return ["--num-processes", str(processes), "--process-id", str(process_id), "--dist-address", dist_address]


# flag, value, what it injects (ftjax/runtime/faults.py); each one's help starts "fault injection: "
FAULT_FLAGS = (
    ("--die-at", "STEP:PHASE", "SIGKILL this process at that step and phase (forward|ftar|commit|catchup|eval)"),
    ("--hang-at", "STEP:PHASE", "block the training thread forever at that step and phase"),
    (
        "--flip-bit-at",
        "STEP",
        "flip one bit of one parameter after applying that step (a silent divergence, which the "
        "coordinator detects from the digests and heals)",
    ),
)


def _fault_arguments(p: argparse.ArgumentParser) -> None:
    for flag, metavar, what in FAULT_FLAGS:
        option(p, flag, metavar, help=f"fault injection: {what}")


def parse_config(args: argparse.Namespace) -> Config:
    overrides = list(args.overrides)
    if args.num_processes is not None:
        if args.num_processes < 1:
            raise ConfigError(f"--num-processes: must be >= 1 (got {args.num_processes})")
        overrides.append(f"mesh.hosts={args.num_processes}")
    init_from = getattr(args, "init_from", None)  # (the sync baseline's parser has no --init-from)
    if init_from is not None:
        overrides.append(init_from_override(init_from))
    cfg = load_config(args.config, overrides)
    for flag, value in (("--dist-address", args.dist_address), ("--coordinator", args.coordinator)):
        if value:
            try:
                split_address(value)
            except ValueError as e:
                raise ConfigError(f"{flag}: {e} (an IPv6 host goes in brackets: [fd00::1]:29400)") from None
    if cfg.mesh.live > 1 and not args.dist_address:
        raise ConfigError(f"mesh.hosts={cfg.mesh.live} needs --dist-address HOST:PORT for the replica's processes")
    if not 0 <= args.process_id < cfg.mesh.live:  # a reduced-degree replica runs on mesh.live_hosts
        raise ConfigError(f"--process-id: {args.process_id} is not in [0, {cfg.mesh.live})")
    if args.log_every is not None and args.log_every < 1:
        raise ConfigError(f"--log-every: must be >= 1 (got {args.log_every})")
    if not 0 <= args.replica_id < cfg.ft.replicas:
        raise ConfigError(f"--replica-id: {args.replica_id} is not in [0, ft.replicas={cfg.ft.replicas})")
    try:
        args.tls = tls_of(args)  # (RunOptions.tls)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return cfg


def init_from_override(directory: str) -> str:
    """The override that `--init-from DIR` stands for: the absolute path (the job identity records
    it, and a launcher's replicas may start elsewhere), quoted (a path is a string, whatever YAML
    would make of it). An empty one stays empty, for the config to refuse (not the current directory)."""
    return f"checkpoint.init_from={json.dumps(str(Path(directory).absolute()) if directory else directory)}"


def dist_bind_address(cfg: Config, dist_address: str) -> str:
    """Where process 0 binds the replica's jax.distributed service: `net.bind_host` (or
    $FTJAX_BIND_HOST), else all interfaces, or the loopback address that `dist_address` names."""
    host, port = split_address(dist_address)
    env = {net.BIND_ENV: os.environ.get(net.BIND_ENV, "")}  # (what this process advertises is beside the point)
    addrs = net.choose(advertise_host=host, bind_host=cfg.net.bind_host, environ=env)
    return net.grpc_bind(addrs.bind, port)


@dataclass(frozen=True)
class RunOptions:
    """How this process runs, beside the config (`ftjax train`'s flags; `ftjax.fit`'s arguments)."""

    replica_id: int = 0
    coordinator: str | None = None  # HOST:PORT: join that job; None: train standalone
    resume: bool = False  # standalone: continue from the latest durable checkpoint
    stop_after: int | None = None  # standalone: stop (with a checkpoint) after N steps
    die_at: str | None = None  # fault injection (ftjax/runtime/faults.py)
    hang_at: str | None = None
    flip_bit_at: str | None = None
    log_every: int | None = None
    tls: TLS | None = None  # the coordinator's gRPC and catch-up over TLS (ftjax/base/tls.py)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunOptions:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def resume_refusal(cfg: Config, out: Path) -> str:
    """Why a standalone `--resume` into `out` must not start ("" if it may). A run's directory whose
    metrics.jsonl holds trained steps but whose checkpoint directory holds no checkpoint (orbax's
    step directories, named by the step) has nothing to resume from: starting from the seed there
    would train step 1 a second time into the same history. A directory with no trained step (new,
    empty, or a run stopped before its first step) starts from the seed: nothing is lost, and a job
    script may pass --resume on every start (its `init` event says where it looked)."""
    ckpts = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else out / "checkpoints"
    if ckpts.is_dir() and any(p.name.isdigit() and p.is_dir() for p in ckpts.iterdir()):
        return ""
    trained = [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "event" not in r and "step" in r]
    if not trained:
        return ""
    return (
        f"--resume: {out / 'metrics.jsonl'} holds a run (trained to step {max(trained)}), but there is no "
        f"checkpoint in {ckpts} (checkpoint.dir) to resume it from; set checkpoint.every to save them, "
        "or drop --resume and give another --out to start afresh"
    )


def held_run(out: Path) -> str:
    """What of a run `out` holds ("" if none). A standalone run that started from the seed into it
    would append a second history to its metrics and mix its checkpoints with the old ones (a later
    --resume would restore the old run's newest). A job's member is exempt: a restarted replica
    reuses its directory and heals from its peers."""
    return ", ".join(name for name in ("metrics.jsonl", "checkpoints", "summary.json") if (out / name).exists())


@dataclass(frozen=True)
class RunArgs:
    """A replica process's command line, as `ftjax train` takes it (what `ftjax launch --entry`
    passes to a script): the config, its overrides, and the run options. It owns no process state
    beyond the JAX platform settings `parse` applies."""

    cfg: Config
    options: RunOptions
    out: Path

    @classmethod
    def parse(cls, argv: list[str] | None = None) -> RunArgs:
        """Parse `CONFIG [key=value ...] [--out DIR] [--replica-id R] [--coordinator HOST:PORT] ...`.
        Before JAX is imported, it also applies the config's platform and device count."""
        args = build_parser().parse_intermixed_args(sys.argv[1:] if argv is None else argv)
        cfg = parse_config(args)
        if cfg.mesh.live > 1:
            raise ValueError(
                f"FaultTolerance.join: a script's replica runs on one host, "
                f"this one on {cfg.mesh.live} (mesh.hosts={cfg.mesh.hosts})"
            )
        if "jax" not in sys.modules:
            from ftjax.base.env import configure_run

            configure_run(cfg.platform, device_count=cfg.mesh.devices_per_host)
        return cls(cfg, RunOptions.from_args(args), Path(args.out or "runs/script"))
