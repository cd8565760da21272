"""`ftjax train CONFIG [key=value ...]`: one replica, one or several processes.

Standalone (no `--coordinator`), the replica trains alone; with `--coordinator`, its leader joins
a fault-tolerant job. Both run the same loop (`ftjax.trainer`) and step protocol (`ftjax.protocol`),
assembled in `ftjax.replica`. Either way: config validated before JAX starts (exit 2 on a bad
one), the platform from the config (`platform: auto` uses what JAX finds; `cpu` simulates
`mesh.devices_per_host` CPU devices), metrics in RUN_DIR, durable checkpoints with orbax.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

from ftjax.config import Config, ConfigError, load_config
from ftjax.coordinator.quorum import split_address
from ftjax.env import check_platform, configure_run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ftjax train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="YAML config: a path, or a built-in name (tiny, gpt_small)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. steps=30 model.d_model=128")
    p.add_argument("--out", default=None, help="run directory (default: runs/<config name>)")
    p.add_argument("--resume", action="store_true", help="continue from the latest durable checkpoint")
    p.add_argument("--init-from", default=None, metavar="DIR",
                   help="start from the parameters of this orbax checkpoint instead of the seed's (sets "
                        "checkpoint.init_from; checkpoint.init_opt=true takes its optimizer state too)")
    p.add_argument("--stop-after", type=int, default=None, metavar="N",
                   help="stop (with a checkpoint) once N steps are done, as if interrupted")
    p.add_argument("--num-processes", type=int, default=None, help="hosts in this replica (sets mesh.hosts)")
    p.add_argument("--process-id", type=int, default=0, help="this process's rank within the replica")
    p.add_argument("--dist-address", default=None,
                   help="HOST:PORT of the replica's jax.distributed service (process 0 serves it, bound to "
                        "net.bind_host; every process dials HOST)")
    p.add_argument("--replica-id", type=int, default=0, help="this replica's index in the job (0-based)")
    p.add_argument("--coordinator", default=None, help="HOST:PORT of the job's coordinator (joins a job)")
    p.add_argument("--die-at", default=None, metavar="STEP:PHASE",
                   help="fault injection: SIGKILL this process at that step and phase "
                        "(forward|ftar|commit|catchup)")
    p.add_argument("--hang-at", default=None, metavar="STEP:PHASE",
                   help="fault injection: block the training thread forever at that step and phase")
    p.add_argument("--flip-bit-at", default=None, metavar="STEP",
                   help="fault injection: flip one bit of one parameter after applying that step (a silent "
                        "divergence, which the coordinator detects from the digests and heals)")
    p.add_argument("--log-every", type=int, default=None, metavar="N",
                   help="when stdout is not a terminal (a file, a pipe), print a plain line every N steps "
                        "(default: about 20 lines per run), besides one per event and the end of the run")
    return p


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
    return cfg


def init_from_override(directory: str) -> str:
    """The override that `--init-from DIR` stands for: the absolute path (the job identity records
    it, and a launcher's replicas may start elsewhere), quoted (a path is a string, whatever YAML
    would make of it). An empty one stays empty, for the config to refuse (not the current directory)."""
    return f"checkpoint.init_from={json.dumps(str(Path(directory).absolute()) if directory else directory)}"


def dist_bind_address(cfg: Config, dist_address: str) -> str:
    """Where process 0 binds the replica's jax.distributed service: `net.bind_host` (or
    $FTJAX_BIND_HOST), else all interfaces, or the loopback address that `dist_address` names."""
    from ftjax import net

    host, port = split_address(dist_address)
    env = {net.BIND_ENV: os.environ.get(net.BIND_ENV, "")}  # (what this process advertises is beside the point)
    addrs = net.choose(advertise_host=host, bind_host=cfg.net.bind_host, environ=env)
    return net.grpc_bind(addrs.bind, port)


def init_distributed(cfg: Config, args: argparse.Namespace) -> None:
    """Form the replica's own jax.distributed cluster (CPU collectives over gloo)."""
    import jax

    if cfg.mesh.live > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=args.dist_address, num_processes=cfg.mesh.live,
                                   process_id=args.process_id,
                                   coordinator_bind_address=dist_bind_address(cfg, args.dist_address))


def main(argv: list[str]) -> int:
    args = build_parser().parse_intermixed_args(argv)
    try:
        cfg = parse_config(args)
    except ConfigError as e:
        print(f"ftjax train: config error: {e}", file=sys.stderr)
        return 2
    configure_run(cfg.platform, device_count=cfg.mesh.devices_per_host)
    out = Path(args.out or Path("runs") / Path(args.config).stem)
    init_distributed(cfg, args)
    try:
        check_platform(cfg.platform, cfg.mesh.devices_per_host)
    except RuntimeError as e:
        print(f"ftjax train: {e}", file=sys.stderr)
        return 2
    from ftjax.checkpoint import CheckpointError
    from ftjax.coordinator.client import CoordinatorError
    from ftjax.replay import SpillError
    from ftjax.task import TaskError
    from ftjax.tasks import check_task

    try:
        check_task(cfg)  # a task that cannot train fails here, named, before any peer waits for it
    except TaskError as e:
        print(f"ftjax train: error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        if args.coordinator:
            return run_member(cfg, args, out)
        return run_standalone(cfg, args, out)
    except (CheckpointError, SpillError, CoordinatorError) as e:
        # another job's checkpoint or none intact (2); a full disk, the coordinator unreachable (1):
        # one line, no traceback
        code = 2 if isinstance(e, CheckpointError) else 1
        print(f"ftjax train: error: {e}", file=sys.stderr, flush=True)
        if cfg.mesh.hosts > 1:
            os._exit(code)  # (as below: not into jax.distributed's shutdown barrier)
        return code
    except Exception:
        if cfg.mesh.hosts == 1:
            raise
        # One host of a replica failed: exit now. A normal exit would wait in jax.distributed's
        # shutdown barrier (up to 5 minutes) for hosts that wait for this one in a collective; this
        # way they fail at once, and the launcher, or srun --kill-on-bad-exit, restarts the replica.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def run_standalone(cfg: Config, args: argparse.Namespace, out: Path) -> int:
    from ftjax import replica  # (imports JAX: after configure_process)

    return replica.run_standalone(cfg, replica.RunOptions.from_args(args), out)


def run_member(cfg: Config, args: argparse.Namespace, out: Path) -> int:
    from ftjax import replica

    return replica.run_member(cfg, replica.RunOptions.from_args(args), out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
