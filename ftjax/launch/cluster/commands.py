"""The commands a cluster job runs, as argument lists: `ftjax train` for a replica's hosts and
`ftjax coordinator`, both kinds of files alike; the resolved config they read."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

import yaml

from ftjax.config import Config


class Shell(str):
    """An argument that is shell text (a variable expansion), not a literal to quote."""


def shell_join(args: list[str]) -> str:
    return " ".join(a if isinstance(a, Shell) else shlex.quote(a) for a in args)


@dataclass(frozen=True)
class TrainCommand:
    """`ftjax train` as the hosts of a job's replicas run it (the same as LocalJob.start_replica):
    what every host's command shares; `args` adds one host's own."""

    config: str
    coordinator: str
    hosts: int
    overrides: tuple[str, ...] = ()

    def args(self, replica: int, out: str, process_id: str | None = None, dist: str | None = None) -> list[str]:
        """The arguments of a host of replica `replica` (`process_id` None: appended later, per task)."""
        args = ["ftjax", "train", self.config, *self.overrides, "--out", out, "--replica-id", str(replica)]
        args += ["--coordinator", self.coordinator, "--num-processes", str(self.hosts)]
        args += ["--process-id", process_id] if process_id is not None else []
        return args + (["--dist-address", dist] if dist else [])


def coordinator_args(
    cfg: Config, *, port: int | str, http_port: int | str, idle_exit_s: float, token_file: str | None = None
) -> list[str]:
    """`ftjax coordinator` arguments: the config's `coordinator:` settings, the replicas to wait for
    at job start, the job's last step (it ends with the job). It binds every interface (IPv6 and
    IPv4); replicas dial it by its node's address (Slurm) or its Service's name (k8s)."""
    port, http_port = (p if isinstance(p, str) else str(p) for p in (port, http_port))  # keep a Shell a Shell
    args = [
        "ftjax",
        "coordinator",
        "--port",
        port,
        "--http-port",
        http_port,
        *cfg.coordinator.flags(),
        "--expected-replicas",
        str(cfg.ft.replicas),
        "--final-step",
        str(cfg.steps),
        "--idle-exit-s",
        f"{idle_exit_s:g}",
    ]
    return args + (["--token-file", token_file] if token_file else [])


def config_yaml(cfg: Config) -> str:
    """The config with every override applied: the cluster runs what was validated here."""
    return yaml.safe_dump(cfg.model_dump(), sort_keys=False)
