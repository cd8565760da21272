"""`ftjax launch ... --emit slurm|k8s DIR`: the same job as cluster job files.

One job per replica (its H hosts are the job's H tasks/pods) and the coordinator as a job of its
own, so that the cluster's scheduler plays the launcher's supervisor: a replica whose host dies is
restarted as a whole, and only that replica. Every name derives from the job's name (`--name`,
default `ftjax-<config>-<4 hex digits>`), so that two jobs share a Slurm account or a Kubernetes
namespace. The coordinator is told how many replicas to wait for at job start
(`--expected-replicas`), and ends with the job: it exits 0 once every replica has reached the last
step and left, and 3 when no replica has been alive for `--idle-exit-s` (ftjax/coordinator/lifetime.py).

- **slurm** (`ftjax/launch/cluster/slurm.py`, the scripts' bash in `cluster/templates/`):
  `DIR/submit.sh` submits `coordinator.sbatch`, one `replica-R.sbatch` per replica (started once
  the coordinator runs: `--dependency=after`), and `finish.sbatch` (once every replica ended:
  `afterany`). No fixed port: the coordinator and each replica's `jax.distributed` service take
  free ports and publish them. Jobs are `--requeue`able (a dead node
  sends the job back to the queue; the requeued script records the requeue as a failure) and
  restart their replica whole after a failed step, up to --max-restarts times in all. With
  `ft.on_host_loss: reduce` a replica's job is `--no-kill` and, when Slurm reports a node of its
  allocation lost, restarts at once on the nodes up, at reduced degree, and whole once they all are
  (`templates/reduce.sh`). DIR must be on a filesystem the nodes share; the run directory is
  `DIR/run`, laid out like `ftjax launch`'s, so `ftjax.runs.summary` reads it (finish.sbatch
  writes `run/launcher.jsonl` and `run/summary.json`).
- **k8s** (`ftjax/launch/cluster/k8s.py`): `DIR/token.yaml` (the token Secret, mode 600),
  `DIR/coordinator.yaml` (the config ConfigMap, optionally the PersistentVolumeClaim for the outputs,
  the coordinator's Job and Service) and one JobSet per replica in `DIR/replica-R.yaml` (the JobSet
  controller, kubernetes-sigs/jobset, must be installed): a failed pod fails its Job, and the JobSet recreates that replica's pods, all of them,
  up to --max-restarts times (also with `ft.on_host_loss: reduce`: a JobSet cannot shrink a
  replica, docs/design/operations.md "Cluster launch"). The coordinator serves `grpc.health.v1` for its readiness and
  liveness probes. Apply with `kubectl apply -f DIR/`, remove with `kubectl delete -f DIR/`.

The replica command is `ftjax train` exactly as `LocalJob` runs it, with the config resolved (every
override applied) so the cluster runs what was validated here.
"""

from __future__ import annotations

import os
from pathlib import Path

from ftjax.config import load_config
from ftjax.launch.cluster import k8s, slurm
from ftjax.launch.cluster.options import EmitError, EmitOptions, check_options, default_name

__all__ = ["EmitError", "EmitOptions", "emit"]


def emit(
    kind: str, out_dir: str | Path, config: str, overrides: list[str], *, options: EmitOptions | None = None
) -> list[Path]:
    """Write the job files of `kind` (slurm | k8s) into `out_dir`; returns the paths written."""
    if kind not in ("slurm", "k8s"):
        raise EmitError(f"--emit: unknown kind {kind!r}; choose slurm or k8s")
    options = options or EmitOptions()
    check_options(options)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise EmitError(f"--emit: {out} is not empty")
    cfg = load_config(config, overrides)
    if options.gpus_per_host and options.gpus_per_host < cfg.mesh.devices_per_host:
        raise EmitError(
            f"--gpus-per-host {options.gpus_per_host}: fewer than mesh.devices_per_host "
            f"({cfg.mesh.devices_per_host}), the devices each host trains on"
        )
    name = options.name or default_name(config)
    files = (slurm if kind == "slurm" else k8s).files(cfg, name, options)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for file, (text, mode) in files.items():
        path = out / file
        # created with its mode (a token file is never readable by others, not even for a moment)
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "w") as f:
            os.fchmod(f.fileno(), mode)  # (not narrowed by the umask)
            f.write(text)
        written.append(path)
    return written
