"""`ftjax train CONFIG [key=value ...]`: one replica, one or several processes.

Standalone (no `--coordinator`), the replica trains alone; with `--coordinator`, its leader joins
a fault-tolerant job. Both run the same loop (`ftjax.runtime.trainer`) and step protocol (`ftjax.runtime.protocol`),
assembled in `ftjax.runtime.replica`. Either way: config validated before JAX starts (exit 2 on a bad
one), the platform from the config (`platform: auto` uses what JAX finds; `cpu` simulates
`mesh.devices_per_host` CPU devices), metrics in RUN_DIR, durable checkpoints with orbax.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

from ftjax.base.env import check_platform, configure_run
from ftjax.config import Config, ConfigError
from ftjax.runtime.args import RunOptions, build_parser, dist_bind_address, held_run, parse_config, resume_refusal


def init_distributed(cfg: Config, args: argparse.Namespace) -> None:
    """Form the replica's own jax.distributed cluster (CPU collectives over gloo)."""
    import jax

    if cfg.mesh.live > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=args.dist_address,
            num_processes=cfg.mesh.live,
            process_id=args.process_id,
            coordinator_bind_address=dist_bind_address(cfg, args.dist_address),
        )


def out_refusal(cfg: Config, args: argparse.Namespace, out: Path) -> str:
    """Why a standalone run must not start in `out` ("" if it may): a run there already, unless
    resumed; resumed, a run there with no checkpoint to resume from (resume_refusal)."""
    if args.coordinator:
        return ""
    if not args.resume and (held := held_run(out)):
        return f"--out {out} already holds a run ({held}): --resume continues it; another --out starts a new one"
    return resume_refusal(cfg, out) if args.resume else ""


def _reported() -> tuple[tuple[type[Exception], ...], tuple[type[Exception], ...]]:
    """(the errors `ftjax train` reports in one line, without a traceback; those of them that are the
    machine's or the network's, exit 1: a full disk, the coordinator unreachable; the others exit 2).
    Imported here: they import JAX."""
    from ftjax.coordinator.client import CoordinatorError
    from ftjax.program.plan import DoesNotFit
    from ftjax.program.task import TaskError
    from ftjax.program.tokens import TokenFileError
    from ftjax.runtime.checkpoint import CheckpointError, CheckpointWriteError
    from ftjax.runtime.metrics import RecordsWriteError
    from ftjax.runtime.replay import SpillError
    from ftjax.runtime.trainer import NotFinite

    environment = (SpillError, CoordinatorError, CheckpointWriteError, RecordsWriteError)
    return (CheckpointError, DoesNotFit, TokenFileError, TaskError, NotFinite, *environment), environment


def default_out(args) -> Path:
    """--out, else runs/<config name>; a job member's runs/<config name>/replica-R: members started by
    hand without --out must not share one metrics.jsonl and one checkpoints/ (they would resume
    each other's state, or none, after a restart of the whole job)."""
    if args.out:
        return Path(args.out)
    base = Path("runs") / Path(args.config).stem
    return base / f"replica-{args.replica_id}" if args.coordinator else base


def main(argv: list[str]) -> int:
    args = build_parser(__doc__).parse_intermixed_args(argv)
    try:
        cfg = parse_config(args)
    except ConfigError as e:
        print(f"ftjax train: config error: {e}", file=sys.stderr)
        return 2
    configure_run(cfg.platform, device_count=cfg.mesh.devices_per_host)
    out = default_out(args)
    if why := out_refusal(cfg, args, out):
        # (checked before jax.distributed connects the replica's processes: none has written yet)
        print(f"ftjax train: error: {why}", file=sys.stderr)
        return 2
    init_distributed(cfg, args)
    try:
        check_platform(cfg.platform, cfg.mesh.devices_per_host)
    except RuntimeError as e:
        print(f"ftjax train: {e}", file=sys.stderr)
        return 2
    from ftjax.program.task import TaskError
    from ftjax.program.tasks import check_task

    reported, environment = _reported()
    try:
        check_task(cfg)  # a task that cannot train fails here, named, before any peer waits for it
    except (TaskError, ConfigError) as e:  # (ConfigError: a setting this platform cannot run)
        print(f"ftjax train: error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        if args.coordinator:
            return run_member(cfg, args, out)
        return run_standalone(cfg, args, out)
    except reported as e:
        # another job's checkpoint or none intact, a step that does not fit the device, token files
        # that do not match their index, a task the mesh cannot hold, a loss gone NaN (2); a full
        # disk, the coordinator unreachable (1): one line, no traceback
        code = 1 if isinstance(e, environment) else 2
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
    from ftjax.runtime import replica  # (imports JAX: after configure_process)

    return replica.run_standalone(cfg, RunOptions.from_args(args), out)


def run_member(cfg: Config, args: argparse.Namespace, out: Path) -> int:
    from ftjax.runtime import replica

    return replica.run_member(cfg, RunOptions.from_args(args), out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
