"""`ftjax launch ... --emit slurm|k8s DIR`: the same job as cluster job files.

One job per replica (its H hosts are the job's H tasks/pods) and the coordinator as a job of its
own, so that the cluster's scheduler plays the launcher's supervisor: a replica whose host dies is
restarted as a whole, and only that replica.

- **slurm**: `DIR/coordinator.sbatch`, `DIR/replica-R.sbatch`, `DIR/submit.sh`, the resolved
  `DIR/config.yaml` and a fresh job token `DIR/token` (mode 600). A replica's batch script runs its
  hosts with `srun --kill-on-bad-exit=1` (one dead task ends the step) in a loop that starts the
  replica again after a delay, up to --max-restarts times. The coordinator writes its address to
  `DIR/coordinator.address` (DIR must be on a filesystem shared by the nodes) and is restarted on
  its node if it dies; `submit.sh` submits everything and a last job that cancels the coordinator
  once every replica has ended.
- **k8s**: `DIR/coordinator.yaml` (the token Secret, the config ConfigMap, a Deployment and a
  Service for the coordinator) and `DIR/replica-R.yaml`: one JobSet per replica (the JobSet
  controller, kubernetes-sigs/jobset, must be installed), whose failure policy recreates all of the
  replica's pods when one fails, up to --max-restarts times. Pods reach their replica's leader by
  the JobSet's DNS hostnames. Apply with `kubectl apply -f DIR/`.

The replica command is `ftjax train` exactly as `LocalJob` runs it, with the config resolved (every
override applied) so the cluster runs what was validated here.
"""

from __future__ import annotations

import os
import secrets
import shlex
from pathlib import Path

import yaml

from ftjax.config import Config, load_config
from ftjax.env import TOKEN_ENV

COORDINATOR_PORT = 29400
HTTP_PORT = 29401
DIST_PORT = 29500  # each replica's own jax.distributed service, on its host 0
RUN_DIR = "/ftjax-run"  # k8s: where replicas write metrics (an emptyDir; mount a volume to keep them)


class EmitError(ValueError):
    """Files that cannot be written (unknown kind, DIR not empty); nothing was written."""


class Shell(str):
    """An argument that is shell text (a variable expansion), not a literal to quote."""


def shell_join(args: list[str]) -> str:
    return " ".join(a if isinstance(a, Shell) else shlex.quote(a) for a in args)


def train_args(config: str, replica: int, coordinator: str, hosts: int, out: str, process_id: str | None = None,
               dist: str | None = None) -> list[str]:
    """`ftjax train` arguments of one host of a replica (the same as LocalJob.start_replica)."""
    args = ["ftjax", "train", config, "--out", out, "--replica-id", str(replica), "--coordinator", coordinator,
            "--num-processes", str(hosts)]
    args += ["--process-id", process_id] if process_id is not None else []
    return args + (["--dist-address", dist] if dist else [])


def coordinator_args(cfg: Config, token_file: str | None = None) -> list[str]:
    """`ftjax coordinator` arguments with the config's `coordinator:` settings and fixed ports. It
    binds every interface (IPv6 and IPv4); replicas dial it by its node's or its Service's name."""
    args = ["ftjax", "coordinator", "--port", str(COORDINATOR_PORT), "--http-port", str(HTTP_PORT),
            *cfg.coordinator.flags()]
    return args + (["--token-file", token_file] if token_file else [])


def emit(kind: str, out_dir: str | Path, config: str, overrides: list[str], *, image: str = "ftjax:latest",
         max_restarts: int = 10, restart_delay_s: float = 1.0) -> list[Path]:
    """Write the job files of `kind` (slurm | k8s) into `out_dir`; returns the paths written."""
    if kind not in ("slurm", "k8s"):
        raise EmitError(f"--emit: unknown kind {kind!r}; choose slurm or k8s")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise EmitError(f"--emit: {out} is not empty")
    cfg = load_config(config, overrides)
    files = (_slurm if kind == "slurm" else _k8s)(cfg, image=image, max_restarts=max_restarts,
                                                  restart_delay_s=restart_delay_s)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (text, mode) in files.items():
        path = out / name
        path.write_text(text)
        os.chmod(path, mode)
        written.append(path)
    return written


def _config_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(), sort_keys=False)


# --- SLURM ------------------------------------------------------------------------------------------
_SLURM_COORDINATOR = """#!/bin/bash
#SBATCH --job-name=ftjax-coordinator
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --output=%x-%j.log
# The job's coordinator: soft state only, so it is simply restarted on its node if it dies.
set -uo pipefail
JOB_DIR=${{FTJAX_JOB_DIR:-$SLURM_SUBMIT_DIR}}
rm -f "$JOB_DIR/coordinator.address" "$JOB_DIR/coordinator.json"
while true; do
  {command} --ready-file "$JOB_DIR/coordinator.json" &
  pid=$!
  while [ ! -s "$JOB_DIR/coordinator.json" ] && kill -0 "$pid" 2>/dev/null; do sleep 0.5; done
  echo "$(hostname):{port}" > "$JOB_DIR/coordinator.address.tmp" && mv "$JOB_DIR/coordinator.address.tmp" "$JOB_DIR/coordinator.address"
  wait "$pid"
  echo "coordinator exited with $?; restarting" >&2
  rm -f "$JOB_DIR/coordinator.json"
  sleep 1
done
"""

_SLURM_REPLICA = """#!/bin/bash
#SBATCH --job-name=ftjax-replica-{replica}
#SBATCH --nodes={hosts}
#SBATCH --ntasks-per-node=1
#SBATCH --output=%x-%j.log
# Replica {replica}: {hosts} host(s). One dead host ends the srun step (--kill-on-bad-exit), and the
# loop starts the whole replica again: it catches up from a live peer. Only this replica restarts.
set -uo pipefail
JOB_DIR=${{FTJAX_JOB_DIR:-$SLURM_SUBMIT_DIR}}
export FTJAX_TOKEN="$(cat "$JOB_DIR/token")"
until [ -s "$JOB_DIR/coordinator.address" ]; do sleep 1; done
LEADER="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"
for attempt in $(seq 0 {max_restarts}); do
  COORDINATOR="$(cat "$JOB_DIR/coordinator.address")"
  srun --kill-on-bad-exit=1 --nodes={hosts} --ntasks={hosts} --ntasks-per-node=1 \\
    bash -c 'exec "$@" --process-id "$SLURM_PROCID"' ftjax-host \\
    {command}{dist} && exit 0
  echo "replica {replica}: attempt $attempt failed; restarting the whole replica in {delay} s" >&2
  sleep {delay}
done
exit 1
"""

_SLURM_SUBMIT = """#!/bin/bash
# Submit the coordinator, the {replicas} replicas, and a job that cancels the coordinator at the end.
set -euo pipefail
cd "$(dirname "$0")"
coordinator=$(sbatch --parsable coordinator.sbatch)
replicas=""
for r in $(seq 0 {last}); do
  replicas="$replicas:$(sbatch --parsable "replica-$r.sbatch")"
done
sbatch --parsable --job-name=ftjax-cleanup --dependency="afterany$replicas" --wrap "scancel $coordinator" >/dev/null
echo "coordinator job $coordinator, replica jobs ${{replicas#:}}"
"""


def _slurm(cfg: Config, *, image: str, max_restarts: int, restart_delay_s: float) -> dict[str, tuple[str, int]]:
    del image  # SLURM runs the installed `ftjax` of the nodes
    hosts = cfg.mesh.hosts
    files = {
        "config.yaml": (_config_yaml(cfg), 0o644),
        "token": (secrets.token_hex(16) + "\n", 0o600),
        "coordinator.sbatch": (_SLURM_COORDINATOR.format(
            command=shell_join(coordinator_args(cfg, Shell('"$JOB_DIR/token"'))), port=COORDINATOR_PORT),
            0o755),
        "submit.sh": (_SLURM_SUBMIT.format(replicas=cfg.ft.replicas, last=cfg.ft.replicas - 1), 0o755),
    }
    for r in range(cfg.ft.replicas):
        # the process id is appended per task (the `bash -c` above): only srun knows it
        command = shell_join(train_args(Shell('"$JOB_DIR/config.yaml"'), r, Shell('"$COORDINATOR"'), hosts,
                                        Shell(f'"$JOB_DIR/run/replica-{r}"')))
        dist = f' --dist-address "$LEADER:{DIST_PORT}"' if hosts > 1 else ""
        files[f"replica-{r}.sbatch"] = (_SLURM_REPLICA.format(
            replica=r, hosts=hosts, max_restarts=max_restarts, delay=restart_delay_s, command=command, dist=dist),
            0o755)
    return files


# --- Kubernetes -------------------------------------------------------------------------------------
def _k8s(cfg: Config, *, image: str, max_restarts: int, restart_delay_s: float) -> dict[str, tuple[str, int]]:
    del restart_delay_s  # the JobSet controller restarts at once
    token_env = {"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": "ftjax-token", "key": "token"}}}
    # each pod advertises its own IP to its peers (ftjax/net.py): the route to the coordinator's
    # Service would name the same address, this is explicit
    pod_ip_env = {"name": "FTJAX_ADVERTISE_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    config_volume = {"name": "config", "configMap": {"name": "ftjax-config"}}
    coordinator = [
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "ftjax-token"}, "type": "Opaque",
         "stringData": {"token": secrets.token_hex(16)}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ftjax-config"},
         "data": {"config.yaml": _config_yaml(cfg)}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "ftjax-coordinator"},
         "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "ftjax-coordinator"}},
                  "template": {"metadata": {"labels": {"app": "ftjax-coordinator"}},
                               "spec": {"containers": [{
                                   "name": "coordinator", "image": image, "env": [token_env],
                                   "command": coordinator_args(cfg),
                                   "ports": [{"name": "grpc", "containerPort": COORDINATOR_PORT},
                                             {"name": "http", "containerPort": HTTP_PORT}]}]}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "ftjax-coordinator"},
         "spec": {"selector": {"app": "ftjax-coordinator"},
                  "ports": [{"name": "grpc", "port": COORDINATOR_PORT}, {"name": "http", "port": HTTP_PORT}]}},
    ]
    files = {"coordinator.yaml": (yaml.safe_dump_all(coordinator, sort_keys=False), 0o644)}
    hosts = cfg.mesh.hosts
    for r in range(cfg.ft.replicas):
        name = f"ftjax-replica-{r}"
        # JobSet pod hostnames: <jobset>-<replicatedJob>-<job index>-<pod index>.<subdomain = jobset>
        dist = f"{name}-host-0-0.{name}:{DIST_PORT}" if hosts > 1 else None
        args = train_args("/config/config.yaml", r, f"ftjax-coordinator:{COORDINATOR_PORT}", hosts,
                          f"{RUN_DIR}/replica-{r}", Shell('"$JOB_COMPLETION_INDEX"'), dist)
        script = "exec " + shell_join(args)
        jobset = {
            "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": name},
            "spec": {
                # any failed pod fails its Job (backoffLimit 0), and the JobSet recreates every Job:
                # the whole replica restarts, and catches up from a live peer
                "failurePolicy": {"maxRestarts": max_restarts},
                "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
                "replicatedJobs": [{
                    "name": "host", "replicas": 1,
                    "template": {"spec": {
                        "completionMode": "Indexed", "completions": hosts, "parallelism": hosts, "backoffLimit": 0,
                        "template": {"spec": {
                            "restartPolicy": "Never",
                            "containers": [{"name": "train", "image": image, "command": ["/bin/sh", "-c", script],
                                            "env": [token_env, pod_ip_env],
                                            "volumeMounts": [{"name": "config", "mountPath": "/config"},
                                                             {"name": "run", "mountPath": RUN_DIR}]}],
                            "volumes": [config_volume, {"name": "run", "emptyDir": {}}]}}}}}],
            },
        }
        files[f"replica-{r}.yaml"] = (yaml.safe_dump(jobset, sort_keys=False), 0o644)
    return files
