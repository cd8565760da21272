"""Kubernetes job files: `token.yaml` (the token Secret, mode 600), `coordinator.yaml` (the config
ConfigMap, the outputs' claim with --pvc-size, the coordinator's Job and Service) and one JobSet
per replica, `replica-R.yaml` (ftjax/launch/emit.py says how they behave)."""

from __future__ import annotations

import secrets

import yaml

from ftjax.base.env import TOKEN_ENV
from ftjax.config import Config
from ftjax.launch.cluster.commands import Shell, TrainCommand, config_yaml, coordinator_args, shell_join
from ftjax.launch.cluster.options import COORDINATOR_PORT, DIST_PORT, FS_GROUP, HTTP_PORT, RUN_DIR, EmitOptions


class _Dumper(yaml.SafeDumper):
    """YAML without anchors and aliases (`&id001`): a shared dict is written out each time."""

    def ignore_aliases(self, data) -> bool:
        return True


def _yaml(*docs: dict) -> str:
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False)


def _labels(name: str, component: str, **extra: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "ftjax",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": component,
        **extra,
    }


def files(cfg: Config, name: str, o: EmitOptions) -> dict[str, tuple[str, int]]:
    objects = [_config_map(cfg, name)]
    if o.pvc_size:
        objects.append(_outputs_claim(name, o))
    objects += [_coordinator_job(cfg, name, o), _coordinator_service(name)]
    files = {"coordinator.yaml": (_yaml(*objects), 0o644)}
    for r in range(cfg.ft.replicas):
        files[f"replica-{r}.yaml"] = (_yaml(_replica_jobset(cfg, name, o, r)), 0o644)
    files["token.yaml"] = (_yaml(_token_secret(name)), 0o600)
    return files


def _token_env(name: str) -> dict:
    """The environment variable that gives a container the token, from its Secret."""
    return {"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": f"{name}-token", "key": "token"}}}


def _token_secret(name: str) -> dict:
    # The token's Secret has a file of its own, readable by its owner only; the pods read it
    # through secretKeyRef, and every other manifest may be shared.
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": f"{name}-token", "labels": _labels(name, "token")},
        "type": "Opaque",
        "stringData": {"token": secrets.token_hex(16)},
    }


def _config_map(cfg: Config, name: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-config", "labels": _labels(name, "config")},
        "data": {"config.yaml": config_yaml(cfg)},
    }


def _outputs_claim(name: str, o: EmitOptions) -> dict:
    """The PersistentVolumeClaim --pvc-size creates."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": o.pvc, "labels": _labels(name, "outputs")},
        "spec": {
            "accessModes": ["ReadWriteMany"],
            "resources": {"requests": {"storage": o.pvc_size}},
            **({"storageClassName": o.storage_class} if o.storage_class else {}),
        },
    }


def _coordinator_pod(cfg: Config, name: str, o: EmitOptions) -> dict:
    """The coordinator Job's pod template."""
    health = {"grpc": {"port": COORDINATOR_PORT}}
    return {
        "metadata": {"labels": _labels(name, "coordinator")},
        "spec": {
            "restartPolicy": "Never",  # a failed pod is replaced by the Job (its state is soft)
            "securityContext": {"fsGroup": FS_GROUP},
            "containers": [
                {
                    "name": "coordinator",
                    "image": o.image,
                    "env": [_token_env(name)],
                    "command": coordinator_args(
                        cfg, port=COORDINATOR_PORT, http_port=HTTP_PORT, idle_exit_s=o.idle_exit_s
                    ),
                    "ports": [
                        {"name": "grpc", "containerPort": COORDINATOR_PORT},
                        {"name": "http", "containerPort": HTTP_PORT},
                    ],
                    "readinessProbe": {**health, "periodSeconds": 5},
                    "livenessProbe": {**health, "initialDelaySeconds": 10, "periodSeconds": 10, "failureThreshold": 6},
                    "resources": {"requests": {"cpu": "1", "memory": "512Mi"}, "limits": {"memory": "4Gi"}},
                }
            ],
        },
    }


def _coordinator_job(cfg: Config, name: str, o: EmitOptions) -> dict:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": f"{name}-coordinator", "labels": _labels(name, "coordinator")},
        "spec": {
            # A failed pod is replaced; it ends with the job: 0 once every replica finished (the Job
            # completes), 3 once no replica has been alive for --idle-exit-s, 2 on a bad option or
            # token (the Job fails). An evicted or preempted pod does not count as a failure.
            "backoffLimit": max(o.max_restarts, 1),
            "podFailurePolicy": {
                "rules": [
                    {
                        "action": "FailJob",
                        "onExitCodes": {"containerName": "coordinator", "operator": "In", "values": [2, 3]},
                    },
                    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                ]
            },
            "template": _coordinator_pod(cfg, name, o),
        },
    }


def _coordinator_service(name: str) -> dict:
    labels = _labels(name, "coordinator")
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": f"{name}-coordinator", "labels": labels},
        "spec": {
            "selector": labels,
            "ports": [
                {"name": "grpc", "port": COORDINATOR_PORT, "targetPort": "grpc"},
                {"name": "http", "port": HTTP_PORT, "targetPort": "http"},
            ],
        },
    }


def _replica_resources(o: EmitOptions) -> dict:
    """A replica container's resources: its requests, and its limits if any."""
    requests: dict[str, str] = {"cpu": str(o.cpus_per_host or 1), "memory": "2Gi"}
    limits: dict[str, str] = {}
    if o.mem_per_host_gib:
        requests["memory"] = limits["memory"] = f"{max(1, round(o.mem_per_host_gib * 1024))}Mi"
    if o.gpus_per_host:
        limits[o.gpu_resource] = str(o.gpus_per_host)
    return {"requests": requests, **({"limits": limits} if limits else {})}


def _replica_container(cfg: Config, name: str, o: EmitOptions, r: int) -> dict:
    """The `train` container of replica r's pods."""
    jobset = f"{name}-replica-{r}"
    hosts = cfg.mesh.hosts
    # JobSet pod hostnames: <jobset>-<replicatedJob>-<job index>-<pod index>.<subdomain = jobset>
    dist = f"{jobset}-host-0-0.{jobset}:{DIST_PORT}" if hosts > 1 else None
    command = TrainCommand("/config/config.yaml", f"{name}-coordinator:{COORDINATOR_PORT}", hosts)
    args = command.args(r, f"{RUN_DIR}/replica-{r}", Shell('"$JOB_COMPLETION_INDEX"'), dist)
    # each pod advertises its own IP to its peers (ftjax/base/net.py): the route to the coordinator's
    # Service would name the same address, this is explicit
    pod_ip_env = {"name": "FTJAX_ADVERTISE_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    return {
        "name": "train",
        "image": o.image,
        "command": ["/bin/sh", "-c", "exec " + shell_join(args)],
        "env": [_token_env(name), pod_ip_env],
        "resources": _replica_resources(o),
        "volumeMounts": [
            {"name": "config", "mountPath": "/config", "readOnly": True},
            # on a shared claim, each job writes under its own name
            {"name": "run", "mountPath": RUN_DIR, "subPath": name},
            # a memory-backed /dev/shm, larger than the container default of 64 MiB
            # (shared memory of the accelerator libraries)
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }


def _replica_jobset(cfg: Config, name: str, o: EmitOptions, r: int) -> dict:
    """Replica r's JobSet: one Job of H indexed pods, one per host."""
    hosts = cfg.mesh.hosts
    labels = _labels(name, "replica", **{"ftjax-replica": str(r)})
    outputs = (
        {"name": "run", "persistentVolumeClaim": {"claimName": o.pvc}} if o.pvc else {"name": "run", "emptyDir": {}}
    )
    pod = {
        "metadata": {"labels": labels},
        "spec": {
            "restartPolicy": "Never",
            "securityContext": {"fsGroup": FS_GROUP},
            "containers": [_replica_container(cfg, name, o, r)],
            "volumes": [
                {"name": "config", "configMap": {"name": f"{name}-config"}},
                outputs,
                {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            ],
        },
    }
    job = {
        "metadata": {"labels": labels},
        "spec": {
            "completionMode": "Indexed",
            "completions": hosts,
            "parallelism": hosts,
            "backoffLimit": 0,
            "template": pod,
        },
    }
    spec = {
        # any failed pod fails its Job (backoffLimit 0), and the JobSet recreates the Job: the
        # whole replica restarts, and catches up from a live peer; the other replicas go on
        "failurePolicy": {"maxRestarts": o.max_restarts},
        "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
        "replicatedJobs": [{"name": "host", "replicas": 1, "template": job}],
    }
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": f"{name}-replica-{r}", "labels": labels},
        "spec": spec,
    }
