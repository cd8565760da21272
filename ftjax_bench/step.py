"""`ftjax bench step CONFIG`: an FT-HSDP step against a synchronous HSDP step, same model, same
devices, and against one of its replicas training alone.

(a) FT-HSDP: 2 replicas of 1 process x 2 devices each, a coordinator, FTAR between them;
(b) synchronous HSDP (`ftjax_bench.sync_baseline`): one jax.distributed cluster of 2 processes x
    2 devices, mesh replica=2 x fsdp=2, the cross-replica gradient reduction done by XLA
    collectives (gloo);
(c) standalone: the two replicas of (a) as two `ftjax train CONFIG` without a coordinator, each 1
    process x 2 devices with the per-replica batch (data.batch_size), running at the same time:
    (a) without any cross-replica work, the machine shared by two replicas as in (a).
(a) and (b) train the same global batch (2 x data.batch_size) per step. The three run one after
the other in this command, so they see the same machine; each step time is the median after
warm-up. Prints one JSON line: ft_step_s, sync_step_s, ratio = ft / sync, standalone_step_s and
ft_vs_standalone = ft / standalone (the fault tolerance's own overhead).

The gradient path (issue 30): (a) runs pipelined (ft.grad_path auto: device -> host, FTAR
and host -> device overlap); (d) runs (a) again with `ft.grad_path=serial`, the serial path, in the
same command: ft_serial_step_s and serial_vs_standalone. `phases` and `serial_phases`: the medians
of (a)'s and (d)'s replica 0 per-step d2h_s, ring_s, h2d_s, reduce_wall_s and overlap_share
(the share of d2h + ring + h2d hidden behind each other), with grad_bytes (the update's bytes on the
host) and d2h_gbps, h2d_gbps (those bytes over the phase's seconds). `--no-sync` skips (b) and
`--no-serial` skips (d) (their fields are null).

`--pin-cores`: each replica of (a) and (d), and each standalone process of (c), runs on its own half
of this machine's cores (`pinned_cores`). Unpinned, the two FT replicas compute in lockstep on shared
cores (and one memory bus) while the standalone pair drifts apart and interleaves: part of
ft_vs_standalone is then that contention, which replicas on machines of their own do not have.

The digests (ft.digest_every at its default, 1: (a) and (c) compute the per-step checksum every
step, inside their step time), from (a)'s replica 0: digest_s, the median time of the per-step
checksum (`state_checksum`, its step records' `digest_s`), sha256_s, the time of the sha256 of the
same state at the end of the run (`state_digest`, what the per-step digest was before issue 28),
digest_share = digest_s / ft_step_s and sha256_share = sha256_s / ft_step_s. ft_mfu: the median
MFU of (a)'s replica 0 after warm-up (null where the devices' peak is not known: CPU, unless
`hardware.peak_flops_per_device=...` says it).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from ftjax.base.procs import ProcessGroup, free_port
from ftjax.launch.job import LocalJob
from ftjax.runtime.args import process_flags
from ftjax.runtime.metrics import read_metrics
from ftjax_bench import common


def _median_step(metrics: Path, warmup: int) -> float:
    recs = read_metrics(metrics)
    times = [r["step_time_s"] for r in recs if r["step"] > warmup]
    if not times:
        raise RuntimeError(f"{metrics}: no steps after the {warmup} warm-up steps")
    return statistics.median(times)


def _median_mfu(metrics: Path, warmup: int) -> float | None:
    """The median MFU of a replica's steps after warm-up (None where the devices' peak is not known:
    CPU, unless hardware.peak_flops_per_device says it)."""
    mfus = [r["mfu"] for r in read_metrics(metrics) if r["step"] > warmup and r.get("mfu") is not None]
    return round(statistics.median(mfus), 4) if mfus else None


PHASES = ("d2h_s", "ring_s", "h2d_s", "reduce_wall_s", "overlap_share")


def _phases(metrics: Path, warmup: int) -> dict:
    """Medians after warm-up of a replica's per-step gradient-path phases, and the update's bytes on
    its host with the GB/s (1e9 bytes per second) of its device -> host and host -> device phases,
    the figures a raw copy of the same bytes is held against (`scripts/copy_probe.py`)."""
    recs = [r for r in read_metrics(metrics) if r["step"] > warmup and r.get("grad_bytes")]
    if not recs:
        return {}
    out = {k: round(statistics.median(r[k] for r in recs), 5) for k in PHASES}
    out["grad_bytes"] = nbytes = recs[-1]["grad_bytes"]
    for phase in ("d2h", "h2d"):
        seconds = out[f"{phase}_s"]
        out[f"{phase}_gbps"] = round(nbytes / seconds / 1e9, 3) if seconds > 0 else None
    return out


def _digest_costs(run: Path, warmup: int) -> tuple[float, float]:
    """(median seconds of the per-step checksum after warm-up, seconds of the final sha256) of a
    replica's run directory."""
    times = [r["digest_s"] for r in read_metrics(run / "metrics.jsonl") if r["step"] > warmup and "digest_s" in r]
    if not times:
        raise RuntimeError(f"{run}: no per-step digest after the {warmup} warm-up steps")
    return statistics.median(times), json.loads((run / "summary.json").read_text())["param_digest_s"]


def core_sets(pin: bool) -> list[set[int] | None]:
    """The cores of each of the two replicas (and of each standalone process): with `pin`, this
    process's cores in two disjoint halves, as if each replica had a machine of its own; else any."""
    if not pin:
        return [None, None]
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("ftjax bench step: --pin-cores needs at least 2 cores")
    half = len(cores) // 2
    return [set(cores[:half]), set(cores[half : 2 * half])]


def run_ft(config: str, overrides: list[str], out: Path, timeout: float, cpus: list) -> tuple[Path, list]:
    """Run (a); replica 0's run directory and the cores each replica process was allowed, as read
    from the live processes."""
    with ProcessGroup() as procs:
        job = LocalJob(config, [*overrides, "coordinator.min_replicas=2"], out, replicas=2, procs=procs)
        job.cpus = dict(enumerate(cpus))
        job.start_coordinator()
        cores = [sorted(os.sched_getaffinity(p.pid)) for r in range(2) for p in job.start_replica(r)]
        codes = job.wait(timeout=timeout)
        if codes != {0: [0], 1: [0]}:
            raise RuntimeError(f"FT-HSDP run failed {codes}:\n{job.log_tail(0)}")
        return job.replica_dir(0), cores


def _run_processes(
    name: str, commands: list[list[str]], devices: int, out: Path, timeout: float, cpus: list | None = None
) -> None:
    """Run `commands` (`python -m ...`, one process each, at the same time, process i on the cores
    `cpus[i]`) to completion; their output goes to OUT/NAME-i.log."""
    with ProcessGroup() as procs:
        children = []
        for i, command in enumerate(commands):
            log = open(out / f"{name}-{i}.log", "w")
            children.append(
                procs.start(
                    [sys.executable, "-m", *command],
                    device_count=devices,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cpus=cpus[i] if cpus else None,
                )
            )
        for i, c in enumerate(children):
            if c.wait(timeout) != 0:
                raise RuntimeError(f"{name} run failed:\n{(out / f'{name}-{i}.log').read_text()[-3000:]}")


def run_sync(config: str, overrides: list[str], batch: int, devices: int, out: Path, timeout: float) -> Path:
    port = free_port()
    _run_processes(
        "sync",
        [
            [
                "ftjax_bench.sync_baseline",
                config,
                *overrides,
                f"data.batch_size={2 * batch}",
                *process_flags(2, i, f"127.0.0.1:{port}"),
                "--out",
                str(out / "sync"),
            ]
            for i in range(2)
        ],
        devices,
        out,
        timeout,
    )
    return out / "sync" / "metrics.jsonl"


def run_standalone(config: str, overrides: list[str], devices: int, out: Path, timeout: float, cpus: list) -> Path:
    """Both replicas of (a), each training alone, at the same time; replica 0's metrics."""
    runs = [out / f"standalone-{r}" for r in range(2)]
    _run_processes(
        "standalone",
        [["ftjax", "train", config, *overrides, "--replica-id", "0", "--out", str(run)] for run in runs],
        devices,
        out,
        timeout,
        cpus,
    )
    return runs[0] / "metrics.jsonl"


def main(argv: list[str]) -> int:
    p = common.parser("step", __doc__, config_default=None)
    p.add_argument("overrides", nargs="*", help="config overrides, key.sub=value")
    p.add_argument("--steps", type=int, default=12, help="steps timed")
    p.add_argument("--warmup", type=int, default=3, help="steps before timing (compile, caches)")
    p.add_argument("--out", default=None, help="keep the runs here (default: a temporary directory)")
    p.add_argument("--timeout", type=float, default=540.0, help="seconds, limit for each run")
    p.add_argument("--no-sync", action="store_true", help="skip the synchronous HSDP baseline (b)")
    p.add_argument("--no-serial", action="store_true", help="skip (d), the serial gradient path")
    p.add_argument(
        "--devices", type=int, default=2, help="devices per replica (1 on a machine of one GPU: both replicas share it)"
    )
    p.add_argument(
        "--pin-cores",
        action="store_true",
        help="each replica of (a) and (d), and each standalone process of (c), on half of the cores: "
        "replicas that do not compete for one core, as on machines of their own",
    )
    args = p.parse_intermixed_args(argv)
    if args.steps <= args.warmup + 1:
        print("ftjax bench step: --steps must exceed --warmup + 1", file=sys.stderr)
        return 2
    devices = args.devices
    overrides = [
        *args.overrides,
        f"steps={args.steps}",
        f"mesh.devices_per_host={devices}",
        "mesh.hosts=1",
        "ft.digest_every=1",
        "checkpoint.every=0",
    ]
    cfg = common.load("step", args.config, overrides)
    if cfg is None:
        return 2
    with common.run_directory("step", args.out) as out:
        cpus = core_sets(args.pin_cores)
        with common.phase("step", "(a) FT-HSDP"):
            ft_run, replica_cores = run_ft(args.config, overrides, out / "ft", args.timeout, cpus)
        ft = _median_step(ft_run / "metrics.jsonl", args.warmup)
        checksum, sha256 = _digest_costs(ft_run, args.warmup)
        serial_run = serial = None
        if not args.no_serial:
            serial_overrides = [*overrides, "ft.grad_path=serial"]
            with common.phase("step", "(d) FT-HSDP, serial gradient path"):
                serial_run, _ = run_ft(args.config, serial_overrides, out / "ft-serial", args.timeout, cpus)
            serial = _median_step(serial_run / "metrics.jsonl", args.warmup)
        with common.phase("step", "(c) standalone"):
            standalone = run_standalone(args.config, [*overrides, "ft.replicas=1"], devices, out, args.timeout, cpus)
        alone = _median_step(standalone, args.warmup)
        sync = None
        if not args.no_sync:
            with common.phase("step", "(b) synchronous HSDP"):
                sync_run = run_sync(
                    args.config, [*overrides, "ft.replicas=1"], cfg.data.batch_size, devices, out, args.timeout
                )
            sync = _median_step(sync_run, args.warmup)
        record = {
            "bench": "step",
            "config": args.config,
            "replicas": 2,
            "devices_per_replica": devices,
            "pinned_cores": None if cpus[0] is None else [sorted(c) for c in cpus],
            "replica_cores": replica_cores,
            "global_batch": 2 * cfg.data.batch_size,
            "steps": args.steps,
            "warmup": args.warmup,
            "ft_step_s": round(ft, 5),
            "sync_step_s": None if sync is None else round(sync, 5),
            "ratio": None if sync is None else round(ft / sync, 4),
            "standalone_step_s": round(alone, 5),
            "ft_vs_standalone": round(ft / alone, 4),
            "ft_serial_step_s": None if serial is None else round(serial, 5),
            "serial_vs_standalone": None if serial is None else round(serial / alone, 4),
            "phases": _phases(ft_run / "metrics.jsonl", args.warmup),
            "serial_phases": None if serial_run is None else _phases(serial_run / "metrics.jsonl", args.warmup),
            "digest_s": round(checksum, 5),
            "sha256_s": round(sha256, 5),
            "digest_share": round(checksum / ft, 5),
            "sha256_share": round(sha256 / ft, 5),
            "ft_mfu": _median_mfu(ft_run / "metrics.jsonl", args.warmup),
        }
    print(json.dumps(record))
    return 0
