"""A replica process, assembled from its config: the training loop (`ftjax.runtime.trainer`), the step
protocol (`ftjax.runtime.protocol`) and the protocol's collaborators.

`run_member` joins a fault-tolerant job: the leader talks to the coordinator and serves catch-up
snapshots, every host runs FTAR with the same host rank of every peer. `run_standalone` is the same
loop with a quorum of one and the identity reducer.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import grpc
import jax
import numpy as np

from ftjax.base import net
from ftjax.base.env import read_token
from ftjax.base.fingerprint import fingerprint
from ftjax.base.net import split_address
from ftjax.base.tls import TLS
from ftjax.config import Config
from ftjax.coordinator.client import CoordinatorClient, CoordinatorError
from ftjax.coordinator.types import MemberInfo, new_incarnation
from ftjax.ftar import FTAREndpoint
from ftjax.program.data import BatchStream, make_stream
from ftjax.program.plan import check_fits, peak_flops, step_flops
from ftjax.program.step import ReplicaProgram, build_program
from ftjax.program.task import Task
from ftjax.runtime.args import RunOptions
from ftjax.runtime.catchup import ReceiveArena, ShardTransport
from ftjax.runtime.checkpoint import DurableCheckpoints, replica_identity
from ftjax.runtime.diloco import FragmentReducer, HeldReducer, Piece, fragment_cut, piece_templates
from ftjax.runtime.faults import InjectedFaults, parse_die_at, parse_flip_at
from ftjax.runtime.host_group import JaxHostGroup
from ftjax.runtime.lanes import LaneFlattener, served_lanes
from ftjax.runtime.metrics import MetricsLog, ModelFlops
from ftjax.runtime.protocol import LocalQuorum, PyTree, Reducer, StepProtocol
from ftjax.runtime.reduce import FTARReducer, LocalReducer
from ftjax.runtime.replay import ReplayBuffer
from ftjax.runtime.tensorboard import wandb_init
from ftjax.runtime.trainer import Trainer
from ftjax.runtime.watchdog import NoWatchdog, ProgressWatchdog


def _checkpoints(
    cfg: Config, args: RunOptions, out: Path, stream: BatchStream, program: ReplicaProgram
) -> DurableCheckpoints | None:
    """The replica's durable checkpoints, when the config or the command line asks for any."""
    if cfg.checkpoint.every > 0 or args.resume or args.stop_after:
        return DurableCheckpoints.from_config(
            cfg,
            out,
            data_fingerprint=stream.fingerprint,
            params=program.abstract_state()["params"],
            locations=program.task.locations,
            reads=program.task.reads,
            replica=args.replica_id if args.coordinator else None,  # (a job member: its own subdirectory)
        )
    return None


def faults_of(args: RunOptions) -> InjectedFaults:
    """The faults the command line asks the process to inject into itself (--die-at, --hang-at, --flip-bit-at)."""
    return InjectedFaults(
        parse_die_at(args.die_at), parse_die_at(args.hang_at, "--hang-at"), parse_flip_at(args.flip_bit_at)
    )


def _divisor(cfg: Config) -> int | None:
    """What divides the sum of the contributors' gradients: their number (elastic), or the job's
    constant batch count R (constant: the contributors computed all R batches between them)."""
    return cfg.ft.replicas if cfg.ft.global_batch == "constant" else None


def _pinned(cfg: Config, shardings: PyTree) -> bool:
    """ft.grad_path: pinned, or auto where this host's devices are accelerators with page-locked host memory."""
    if cfg.ft.grad_path != "auto":
        return cfg.ft.grad_path == "pinned"
    devices = {d for s in jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
               for d in s.addressable_devices}  # fmt: skip
    return all(d.platform != "cpu" and "pinned_host" in {m.kind for m in d.addressable_memories()} for d in devices)


def _grad_dtype(cfg: Config) -> np.dtype:
    """The dtype of the update on FTAR's wire (ft.grad_dtype; bfloat16 is ml_dtypes')."""
    return jax.numpy.dtype(cfg.ft.grad_dtype)


def addresses(cfg: Config, coordinator: str) -> net.Addresses:
    """What this process's listeners bind and advertise (ftjax/base/net.py): by default every interface,
    and the source address of this machine's route to the coordinator."""
    return net.choose(
        split_address(coordinator)[0],
        advertise_host=cfg.net.advertise_host,
        interface=cfg.net.interface,
        bind_host=cfg.net.bind_host,
    )


def member_protocol(
    cfg: Config,
    args: RunOptions,
    out: Path,
    token: str,
    addrs: net.Addresses,
    group: JaxHostGroup,
    log: MetricsLog,
    *,
    update_template: PyTree,
    update_shardings: PyTree,
    topology: str,
    arena: ReceiveArena | None = None,
) -> StepProtocol:
    """The step protocol of one host of a job's replica: FTAR endpoints (one per gradient lane this
    host serves), the catch-up transport, and on the leader the coordinator client. `update_template`:
    the averaged update's shapes (ShapeDtypeStructs or arrays) and `update_shardings` its shardings;
    `topology`: what replicas must agree on to average together (ftjax/coordinator/layout.py);
    `arena`: where a catch-up snapshot would land (mapped ahead, ftjax/runtime/catchup.py)."""
    leader = group.rank == 0
    served = served_lanes(group.rank, cfg.mesh.live, cfg.mesh.hosts)
    endpoints = _ftar_endpoints(cfg, token, addrs, served)
    ftar_addresses = [a for host in group.allgather([e.address for e in endpoints]) for a in host]  # lane order
    transport = _catchup_transport(cfg, token, addrs, arena, args.tls)
    catchup_addresses = group.allgather(transport.address)
    _announce(args, group, addrs, endpoints, transport)
    incarnation = group.broadcast(new_incarnation() if leader else None)
    client = None
    if leader:
        info = MemberInfo(
            replica_id=str(args.replica_id),
            incarnation=incarnation,
            num_hosts=group.hosts,
            ftar_addresses=tuple(ftar_addresses),
            catchup_addresses=tuple(catchup_addresses),
            topology_fingerprint=fingerprint(topology),
            topology=topology,
        )
        client = _coordinator_client(cfg, args, token, info, log)
    return StepProtocol(
        replica_id=str(args.replica_id),
        incarnation=incarnation,
        group=group,
        reducer=_ftar_reducer(cfg, endpoints, served, update_template, update_shardings),
        transport=transport,
        quorums=client,
        buffer=ReplayBuffer(out / f"replay-host{group.rank}", int(cfg.ft.catchup_buffer_mib * 2**20)),
        log=log,
        commit_decision=cfg.ft.commit_decision,
        decision_timeout_s=cfg.ft.ftar_timeout_s,
        decision_patience_s=cfg.ft.quorum_timeout_s,
    )


def _ftar_reducer(
    cfg: Config, endpoints: list[FTAREndpoint], served: Sequence[int], update_template: PyTree, update_shardings: PyTree
) -> Reducer:
    """How this host averages the update: its lanes through FTAR, on the gradient path of ft.grad_path;
    with DiLoCo, a fragment of the parameters' deltas per round, each through a reducer of its own."""
    if cfg.ft.sync != "every_step":
        return _fragments(cfg, update_template, update_shardings, partial(_ftar_reducer_of, cfg, endpoints, served))
    return _ftar_reducer_of(cfg, endpoints, served, update_template, update_shardings)


def _fragments(
    cfg: Config, template: PyTree, shardings: PyTree, reducer_of: Callable[[PyTree, PyTree], HeldReducer]
) -> FragmentReducer:
    """DiLoCo's reducer: the parameters cut into fragments as ftjax/runtime/diloco.py cuts them, one
    reducer each, over the fragment's pieces."""
    leaves, sh = jax.tree.leaves(template["params"]), jax.tree.leaves(shardings["params"])
    cut = fragment_cut(cfg, leaves)
    reducers = [reducer_of(*piece_templates(leaves, sh, ps, weight=len(cut) > 1)) for ps in cut]
    sync = None  # a warm-up step averages the whole gradient: streaming, through a reducer of its own
    if cfg.warmup_sync_steps and len(cut) > 1:
        sync = reducer_of(*piece_templates(leaves, sh, tuple(Piece(i, 0, a.size) for i, a in enumerate(leaves))))
    return FragmentReducer(reducers, len(cut), cfg.inner_per_step, cfg.warmup_sync_steps, sync)


def _ftar_reducer_of(
    cfg: Config, endpoints: list[FTAREndpoint], served: Sequence[int], update_template: PyTree, update_shardings: PyTree
) -> FTARReducer:
    m = cfg.mesh  # the lanes are cut by the job's full replica, whatever this one's degree
    flat = LaneFlattener(
        update_template, update_shardings, dtype=_grad_dtype(cfg),
        lanes=m.hosts, devices_per_host=m.devices_per_host, served=served, tensor=m.tensor,
    )  # fmt: skip
    pipelined, pinned = cfg.ft.grad_path != "serial", _pinned(cfg, update_shardings)
    return FTARReducer(endpoints, flat, divisor=_divisor(cfg), pipelined=pipelined, pinned=pinned)


def _topology(cfg: Config, program: ReplicaProgram, data_fingerprint: str) -> str:
    """What replicas must agree on to average together: the program's layout, the job's identity
    (the settings that change the run's numbers or FTAR's frames: seed, data, model, optimizer, steps,
    wire dtypes, ...: `replica_identity`; a replica with another learning rate would train the job
    with it, and heal its peers to its own state when the digests tie), and with DiLoCo how the
    rounds go (another inner step count or fragment cut would average other things). One
    `key: value` line each, so that a refusal names what differs."""
    identity = replica_identity(cfg, data_fingerprint, program.task.locations, program.task.reads)
    job = "\n".join(f"job {k}: {json.dumps(v, sort_keys=True, default=str)}" for k, v in identity.items())
    layout = f"{program.topology()}\n{job}"
    if cfg.ft.sync == "every_step":
        return layout
    sync = f"sync: {cfg.ft.sync} inner_steps={cfg.ft.inner_steps} fragments={cfg.sync_fragments}"
    return f"{layout}\n{sync}" + (f" warmup={cfg.warmup_sync_steps}" if cfg.warmup_sync_steps else "")


def _ftar_endpoints(cfg: Config, token: str, addrs: net.Addresses, served: Sequence[int]) -> list[FTAREndpoint]:
    """One FTAR endpoint per gradient lane this host serves."""
    return [
        FTAREndpoint(
            token,
            host=addrs.bind,
            advertise=addrs.advertise,
            timeout_s=cfg.ft.ftar_timeout_s,
            shared_memory=cfg.ft.ftar_shared_memory,
            wire_dtype=cfg.ft.wire_dtype,
            streams=cfg.ft.link_streams,
        )
        for _ in served
    ]


def _catchup_transport(
    cfg: Config, token: str, addrs: net.Addresses, arena: ReceiveArena | None, tls: TLS | None
) -> ShardTransport:
    """What serves and fetches catch-up snapshots (over HTTPS with `tls`)."""
    return ShardTransport(
        token,
        rate_limit_mbps=cfg.ft.catchup_rate_limit_mbps,
        timeout_s=cfg.ft.quorum_timeout_s,
        streams=cfg.ft.catchup_streams,
        host=addrs.bind,
        advertise=addrs.advertise,
        arena=arena,
        tls=tls,
    )


def _announce(
    args: RunOptions,
    group: JaxHostGroup,
    addrs: net.Addresses,
    endpoints: list[FTAREndpoint],
    transport: ShardTransport,
) -> None:
    """One line on stderr: where peers reach this process, and why that address."""
    print(
        f"ftjax: replica {args.replica_id} host {group.rank}: peers reach this process at "
        f"{addrs.advertise} (chosen by {addrs.why}; ${net.ADVERTISE_ENV} or net.advertise_host to change): "
        f"FTAR {' '.join(e.address for e in endpoints)}, catch-up {transport.address}; "
        f"listening on {net.describe_bind(addrs.bind)}",
        file=sys.stderr,
        flush=True,
    )


def _coordinator_client(
    cfg: Config, args: RunOptions, token: str, info: MemberInfo, log: MetricsLog
) -> CoordinatorClient:
    """The leader's client of the job's coordinator, started."""
    assert args.coordinator is not None  # (a job member's: standalone replicas have none)
    client = CoordinatorClient(args.coordinator, token, info, quorum_timeout_s=cfg.ft.quorum_timeout_s, tls=args.tls)
    client.start()
    # each step's figures travel to the coordinator with the next quorum request (status page, /metrics)
    log.listeners.append(
        partial(
            client.report_step, target_steps=cfg.steps, replicas=cfg.ft.replicas, warmup_steps=cfg.warmup_sync_steps
        )
    )
    return client


def _local_reducer(cfg: Config, program: ReplicaProgram | None) -> Reducer:
    """A replica alone averages nothing: the identity (with DiLoCo, one per fragment)."""
    local = lambda *_: LocalReducer(_divisor(cfg), _grad_dtype(cfg))
    if cfg.ft.sync != "every_step" and program is not None:
        return _fragments(cfg, program.abstract_update(), program.grad_shardings, local)
    return local()


def standalone_protocol(
    cfg: Config,
    args: RunOptions,
    out: Path,
    group: JaxHostGroup,
    log: MetricsLog,
    program: ReplicaProgram | None = None,
) -> StepProtocol:
    """The step protocol of a replica alone: a quorum of one, the identity average."""
    rid = str(args.replica_id)
    return StepProtocol(
        replica_id=rid,
        incarnation=new_incarnation(),
        group=group,
        reducer=_local_reducer(cfg, program),
        transport=None,
        quorums=LocalQuorum(rid) if group.rank == 0 else None,
        buffer=ReplayBuffer(out / "replay-unused", 0),
        log=log,
    )


def _compile(cfg: Config, program: ReplicaProgram) -> ModelFlops | None:
    """Compile the replica's step functions ahead of time (before joining: a late compile would
    stall every peer's FTAR), refuse a program that does not fit the device before anything is
    allocated (DoesNotFit, with the numbers; skipped on CPU), and the model FLOPs of its steps (for
    each record's MFU: computed once, here)."""
    program.precompile()
    check_fits(program)
    flops = step_flops(program)
    if flops is None:
        return None
    return ModelFlops(
        per_row=flops / cfg.data.batch_size,
        devices=int(program.mesh.devices.size),
        peak_per_device=peak_flops(cfg, jax.local_devices()[0]),
    )


def _member(cfg: Config, args: RunOptions, out: Path, token: str, addrs: net.Addresses, task: Task | None) -> Trainer:
    group = JaxHostGroup()
    program = build_program(cfg, task=task)
    # mapped while this process compiles: a snapshot lands in it if the replica must catch up
    arena = ReceiveArena.for_state(program.abstract_state())
    flops = _compile(cfg, program)
    group.meet("compiled")  # the first collective follows (warm_up): every host is ready for it
    program.warm_up()
    stream = make_stream(cfg, replica=args.replica_id, task=program.task)
    log = _metrics_log(cfg, args, out, group)
    protocol = member_protocol(
        cfg,
        args,
        out,
        token,
        addrs,
        group,
        log,
        update_template=program.abstract_update(),
        update_shardings=program.grad_shardings,
        topology=_topology(cfg, program, stream.fingerprint),
        arena=arena,
    )
    trainer = Trainer(
        cfg,
        program,
        stream,
        protocol,
        log=log,
        ckpt=_checkpoints(cfg, args, out, stream, program),
        faults=faults_of(args),
        watchdog=NoWatchdog(),
        replica_id=str(args.replica_id),
        restore_durable=True,
        flops=flops,
    )
    trainer.watchdog = protocol.watchdog = ProgressWatchdog(cfg.ft.progress_timeout_s, trainer.no_progress)
    # SIGTERM (a launcher taking the replica back to full degree, a scheduler's preemption): leave
    # the job at the next step boundary, so that no peer's step fails; exit EXIT_LEFT
    signal.signal(signal.SIGTERM, lambda *_: trainer.ft.request_leave("SIGTERM"))
    return trainer


def _metrics_log(cfg: Config, args: RunOptions, out: Path, group: JaxHostGroup) -> MetricsLog:
    """The replica's records: written by its host 0 alone."""
    return MetricsLog(
        out,
        enabled=group.rank == 0,
        total_steps=cfg.steps,
        label=f"replica {args.replica_id}",
        log_every=args.log_every,
        **record_sinks(cfg, args, out),
    )


def record_sinks(cfg: Config, args: RunOptions, out: Path) -> dict:
    """MetricsLog's `tensorboard` and `wandb` arguments for a replica writing its records to `out`."""
    return {"tensorboard": tensorboard_dir(cfg, args, out), "wandb": wandb_init_of(cfg, args, out)}


def wandb_init_of(cfg: Config, args: RunOptions, out: Path) -> dict | None:
    """wandb.init's arguments (`log.wandb`; None: off): the run directory is RUN for a job's member
    (its records are in RUN/replica-R/), `out` for a standalone run, as for the event files."""
    if not cfg.log.wandb:
        return None
    run_dir = Path(out).parent if args.coordinator else Path(out)
    return wandb_init(cfg.log.wandb_project, run_dir.resolve(), args.replica_id)


def tensorboard_dir(cfg: Config, args: RunOptions, out: Path) -> Path | None:
    """Where a replica's TensorBoard event files go (`log.tensorboard`): RUN/tensorboard/replica-R/ for
    a job's member (its records are in RUN/replica-R/), RUN/tensorboard/ for a standalone run."""
    if not cfg.log.tensorboard:
        return None
    if args.coordinator:
        return Path(out).parent / "tensorboard" / f"replica-{args.replica_id}"
    return Path(out) / "tensorboard"


def _standalone(cfg: Config, args: RunOptions, out: Path, task: Task | None) -> Trainer:
    group = JaxHostGroup()
    program = build_program(cfg, task=task)
    flops = _compile(cfg, program)
    stream = make_stream(cfg, replica=args.replica_id, task=program.task)
    log = _metrics_log(cfg, args, out, group)
    return Trainer(
        cfg,
        program,
        stream,
        standalone_protocol(cfg, args, out, group, log, program),
        log=log,
        ckpt=_checkpoints(cfg, args, out, stream, program),
        faults=faults_of(args),
        watchdog=NoWatchdog(),
        replica_id=str(args.replica_id),
        restore_durable=args.resume,
        stop_after=args.stop_after,
        flops=flops,
    )


def _run(trainer: Trainer, cfg: Config) -> int:
    try:
        code = trainer.run()
    finally:
        trainer.watchdog.close()
        trainer.ft.close()
        trainer.log.close()
    if cfg.mesh.live > 1:
        jax.distributed.shutdown()
    return code


# The coordinator's refusals of a replica (another live process holds its id, its layout differs from
# the job's, ...): reported in one line, exit 2, as bad input is.
REFUSED = frozenset(
    {grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT}
)


def run_member(cfg: Config, args: RunOptions, out: Path, task: Task | None = None) -> int:
    """Join the job at `args.coordinator` as replica `args.replica_id` (`task`: default the config's)."""
    coordinator = args.coordinator
    assert coordinator is not None  # (ftjax train calls this only with --coordinator)
    try:
        token = read_token()
    except ValueError as e:
        print(f"ftjax train: --coordinator needs the job token: {e}", file=sys.stderr)
        return 2
    try:
        addrs = addresses(cfg, coordinator)
    except (OSError, ValueError) as e:
        print(
            f"ftjax train: cannot tell which address peers reach this process at: {e}; name it with "
            f"${net.ADVERTISE_ENV}, net.advertise_host or net.interface",
            file=sys.stderr,
        )
        return 2
    try:
        return _run(_member(cfg, args, out, token, addrs, task), cfg)
    except CoordinatorError as e:
        if e.code not in REFUSED:
            raise
        # (its status code named: the launcher tells a refusal that may pass, ALREADY_EXISTS, from one that repeats)
        print(
            f"ftjax train: the coordinator refused replica {args.replica_id} ({e.code.name}): {e.details}",
            file=sys.stderr,
        )
        return 2


def run_standalone(cfg: Config, args: RunOptions, out: Path, task: Task | None = None) -> int:
    """Train alone: a quorum of one (`task`: default the config's)."""
    return _run(_standalone(cfg, args, out, task), cfg)
