"""The options of `ftjax launch --emit`: what the cluster files ask of the cluster, checked before
anything is written, and the fixed ports and names both kinds of files share."""

from __future__ import annotations

import argparse
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from ftjax.runtime.args import option

# Kubernetes: a pod has the node's ports to itself, so the ports are fixed there. Slurm: none is.
COORDINATOR_PORT = 29400
HTTP_PORT = 29401
DIST_PORT = 29500  # each replica's own jax.distributed service, on its host 0
RUN_DIR = "/ftjax-run"  # k8s: where replicas write their outputs (a PVC with --pvc, else an emptyDir)
MAX_NAME = 30  # a JobSet's pod hostnames, <name>-replica-R-host-0-H, must fit in 63 characters
IDLE_EXIT_S = 900.0  # the coordinator ends when no replica has been alive this long
FS_GROUP = 1000  # k8s: volumes writable by the image's user (the Dockerfile's ftjax, uid and gid 1000)


class EmitError(ValueError):
    """Files that cannot be written (unknown kind, DIR not empty, a bad option); nothing was written."""


@dataclass(frozen=True)
class EmitOptions:
    """What the cluster files ask of the cluster. Slurm-only: time, partition, account, exclusive.
    Kubernetes-only: image, gpu_resource, pvc, pvc_size, storage_class."""

    name: str | None = None  # default: ftjax-<config stem>-<4 hex digits>
    image: str = "ftjax:latest"
    max_restarts: int = 10
    restart_delay_s: float = 1.0
    gpus_per_host: int = 0
    gpu_resource: str = "nvidia.com/gpu"
    cpus_per_host: int | None = None
    mem_per_host_gib: float | None = None
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    exclusive: bool = False
    pvc: str | None = None
    pvc_size: str | None = None
    storage_class: str | None = None
    idle_exit_s: float = IDLE_EXIT_S


_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
_QUANTITY = re.compile(r"\d+(\.\d+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")
_SLURM_TIME = re.compile(r"\d+(-\d+)?(:\d+){0,2}")  # minutes, m:s, h:m:s, d-h, d-h:m, d-h:m:s
_SLURM_WORD = re.compile(r"[A-Za-z0-9_.,-]+")
_RESOURCE = re.compile(r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[a-z0-9]([-a-z0-9._]*[a-z0-9])?")


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """The options of `ftjax launch --emit` (besides --max-restarts and --restart-delay-s)."""
    _add_job_arguments(group)
    _add_host_arguments(group)
    _add_slurm_arguments(group)
    _add_claim_arguments(group)
    group.add_argument(
        "--idle-exit-s",
        type=float,
        default=IDLE_EXIT_S,
        metavar="S",
        help=f"the coordinator ends when no replica has been alive this long ({IDLE_EXIT_S:g})",
    )


def _add_job_arguments(group: argparse._ArgumentGroup) -> None:
    """--name and --image."""
    group.add_argument(
        "--name",
        default=None,
        help=f"the job's name: every job, resource and file name derives from it (a DNS label of "
        f"at most {MAX_NAME} characters; default: ftjax-<config>-<4 hex digits>)",
    )
    group.add_argument("--image", default="ftjax:latest", help="container image (k8s; see the Dockerfile)")


def _add_host_arguments(group: argparse._ArgumentGroup) -> None:
    """What each replica host asks for: GPUs, CPUs, memory."""
    group.add_argument(
        "--gpus-per-host",
        type=int,
        default=0,
        metavar="G",
        help="GPUs of each replica host (slurm: --gpus-per-node; k8s: a limit of --gpu-resource)",
    )
    group.add_argument("--gpu-resource", default="nvidia.com/gpu", help="k8s: the GPUs' resource name")
    option(
        group,
        "--cpus-per-host",
        "C",
        type=int,
        help="CPUs of each replica host (slurm: --cpus-per-task; k8s: a request)",
    )
    option(
        group,
        "--mem-per-host-gib",
        "GIB",
        type=float,
        help="memory of each replica host (slurm: --mem; k8s: a request and a limit)",
    )


def _add_slurm_arguments(group: argparse._ArgumentGroup) -> None:
    """The sbatch-only options: time, partition, account, exclusive."""
    option(group, "--slurm-time", "TIME", help="slurm: each job's time limit (sbatch --time: MINUTES, H:M:S, D-H:M:S)")
    group.add_argument(
        "--slurm-partition", default=None, metavar="P", help="slurm: the partition(s) (sbatch --partition)"
    )
    group.add_argument(
        "--slurm-account", default=None, metavar="A", help="slurm: the account to charge (sbatch --account)"
    )
    group.add_argument("--slurm-exclusive", action="store_true", help="slurm: replica jobs take their nodes whole")


def _add_claim_arguments(group: argparse._ArgumentGroup) -> None:
    """The k8s outputs' PersistentVolumeClaim: --pvc, --pvc-size, --storage-class."""
    option(
        group,
        "--pvc",
        "CLAIM",
        help="k8s: write the outputs (metrics, checkpoints) to this PersistentVolumeClaim "
        "(ReadWriteMany), under <name>/; default: an emptyDir, lost with the pod",
    )
    group.add_argument(
        "--pvc-size", default=None, metavar="SIZE", help="k8s: also create the --pvc claim, of this size (e.g. 100Gi)"
    )
    group.add_argument("--storage-class", default=None, help="k8s: the storage class of the claim --pvc-size creates")


def options_from_args(args: argparse.Namespace) -> EmitOptions:
    """EmitOptions from `ftjax launch`'s arguments; EmitError naming the option if one is bad."""
    options = EmitOptions(
        name=args.name,
        image=args.image,
        max_restarts=args.max_restarts,
        restart_delay_s=args.restart_delay_s,
        gpus_per_host=args.gpus_per_host,
        gpu_resource=args.gpu_resource,
        cpus_per_host=args.cpus_per_host,
        mem_per_host_gib=args.mem_per_host_gib,
        time=args.slurm_time,
        partition=args.slurm_partition,
        account=args.slurm_account,
        exclusive=args.slurm_exclusive,
        pvc=args.pvc,
        pvc_size=args.pvc_size,
        storage_class=args.storage_class,
        idle_exit_s=args.idle_exit_s,
    )
    check_options(options)
    return options


def check_options(o: EmitOptions) -> None:
    def bad(flag: str, value, why: str) -> EmitError:
        return EmitError(f"{flag}: {why} (got {value!r})")

    if o.name is not None and (len(o.name) > MAX_NAME or not _DNS_LABEL.fullmatch(o.name)):
        raise bad(
            "--name",
            o.name,
            f"must be a DNS label of at most {MAX_NAME} characters "
            "(lower-case letters, digits and '-', starting with a letter)",
        )
    if not o.image or any(c.isspace() for c in o.image):
        raise bad("--image", o.image, "must be an image name")
    if o.gpus_per_host < 0:
        raise bad("--gpus-per-host", o.gpus_per_host, "must be >= 0")
    if not _RESOURCE.fullmatch(o.gpu_resource):
        raise bad("--gpu-resource", o.gpu_resource, "must be a resource name like nvidia.com/gpu")
    if o.cpus_per_host is not None and o.cpus_per_host < 1:
        raise bad("--cpus-per-host", o.cpus_per_host, "must be >= 1")
    if o.mem_per_host_gib is not None and not (0 < o.mem_per_host_gib < float("inf")):
        raise bad("--mem-per-host-gib", o.mem_per_host_gib, "must be > 0")
    if o.time is not None and not _SLURM_TIME.fullmatch(o.time):
        raise bad("--slurm-time", o.time, "must be a Slurm time: MINUTES, H:M:S or D-H:M:S")
    for flag, value in (("--slurm-partition", o.partition), ("--slurm-account", o.account)):
        if value is not None and not _SLURM_WORD.fullmatch(value):
            raise bad(flag, value, "must be a Slurm name")
    for flag, value in (("--pvc", o.pvc), ("--storage-class", o.storage_class)):
        if value is not None and (len(value) > 253 or not _DNS_SUBDOMAIN.fullmatch(value)):
            raise bad(flag, value, "must be a Kubernetes object name")
    if o.pvc_size is not None:
        if o.pvc is None:
            raise bad("--pvc-size", o.pvc_size, "needs --pvc, the claim's name")
        if not _QUANTITY.fullmatch(o.pvc_size):
            raise bad("--pvc-size", o.pvc_size, "must be a Kubernetes quantity like 100Gi")
    if o.storage_class is not None and o.pvc_size is None:
        raise bad("--storage-class", o.storage_class, "applies to the claim --pvc-size creates")
    if not (0 < o.idle_exit_s < float("inf")):
        raise bad("--idle-exit-s", o.idle_exit_s, "must be > 0")


def default_name(config: str) -> str:
    stem = re.sub(r"[^a-z0-9]+", "-", Path(config).stem.lower()).strip("-") or "job"
    suffix = secrets.token_hex(2)
    return f"ftjax-{stem[: MAX_NAME - len('ftjax--') - len(suffix)].strip('-')}-{suffix}"
