"""Slurm job files: `submit.sh`, `coordinator.sbatch`, one `replica-R.sbatch` per replica,
`finish.sbatch`, the resolved config and the token (ftjax/launch/emit.py says what each does).

The scripts are the bash templates of `templates/` (package data, checked by shellcheck as they
are), filled here with the job's values: a `${TPL_X}` placeholder takes the value of `x`.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from importlib import resources

from ftjax.config import Config
from ftjax.launch.cluster.commands import Shell, TrainCommand, config_yaml, coordinator_args, shell_join
from ftjax.launch.cluster.options import EmitOptions
from ftjax.launch.supervisor import reduced_degree

_PLACEHOLDER = re.compile(r"\$\{TPL_([A-Z_]+)\}")


def _template(name: str) -> str:
    """A template of templates/, as the wheel or the checkout holds it."""
    return resources.files(__package__).joinpath("templates", name).read_text()


def _fill(template: str, **values: object) -> str:
    """`template` with each `${TPL_KEY}` replaced by values["key"]. A placeholder alone on its line
    whose value is empty takes its line with it (a fragment this job does not need)."""
    text = {key.upper(): str(value) for key, value in values.items()}

    def value(match: re.Match) -> str:
        assert match.group(1) in text, f"placeholder {match.group()} not filled"
        return text[match.group(1)]

    gone = [key for key, v in text.items() if v == ""]
    if gone:
        template = re.sub(rf"^\$\{{TPL_({'|'.join(gone)})\}}\n", "", template, flags=re.M)
    return _PLACEHOLDER.sub(value, template)


def _fragment(name: str) -> str:
    """A template that is a part of a script: it goes in on its own line(s)."""
    return _template(name).rstrip("\n")


def _sbatch(name: str, o: EmitOptions, *lines: str) -> str:
    lines = (
        f"--job-name={name}",
        *lines,
        *([f"--time={o.time}"] if o.time else []),
        *([f"--partition={o.partition}"] if o.partition else []),
        *([f"--account={o.account}"] if o.account else []),
        "--requeue",
        "--open-mode=append",
        "--output=slurm-%x-%j.out",
    )
    return "\n".join(f"#SBATCH {line}" for line in lines)


def _slurm_placement(cfg: Config, o: EmitOptions) -> tuple[str, str]:
    """The replica script's `place`, `lost_host` and `watch_step` for `ft.on_host_loss`, and the
    policy its header states."""
    hosts = cfg.mesh.hosts
    if cfg.ft.on_host_loss != "reduce":
        return (
            _fill(_fragment("whole.sh"), hosts=hosts, all_hosts=" ".join(map(str, range(hosts)))),
            f"# the whole replica, after {o.restart_delay_s:g} s. A dead node ends the allocation: Slurm requeues\n"
            "# the job (--requeue) and it starts over here.",
        )
    degrees = [reduced_degree(hosts, up, cfg.ft.reduced_min_fraction) or 0 for up in range(hosts)] + [hosts]
    return (
        _fill(
            _fragment("reduce.sh"),
            hosts=hosts,
            min_fraction=f"{cfg.ft.reduced_min_fraction:g}",
            degrees=" ".join(map(str, degrees)),
            all_hosts=" ".join(map(str, range(hosts))),
            leave_s=f"{math.ceil(cfg.ft.progress_timeout_s)}",
        ),
        "# when Slurm reports a node of the allocation lost (down, drained, not responding, or gone from\n"
        "# this --no-kill allocation), at once on the hosts up, at reduced degree (ft.on_host_loss:\n"
        f"# reduce), and whole again once they all are; else whole, after {o.restart_delay_s:g} s.\n"
        "# A lost batch node (host 0's) ends the allocation: Slurm requeues the job (--requeue) and it\n"
        "# starts over here.",
    )


def files(cfg: Config, name: str, o: EmitOptions) -> dict[str, tuple[str, int]]:
    common = {
        "name": name,
        "prelude": _fragment("prelude.sh"),
        "max_restarts": o.max_restarts,
        "last": cfg.ft.replicas - 1,
    }
    return {**_slurm_job_files(cfg, name, o, common), **_slurm_replica_files(cfg, name, o, common)}


def _slurm_job_files(cfg: Config, name: str, o: EmitOptions, common: dict) -> dict[str, tuple[str, int]]:
    """Every file but the replicas' scripts: config, token, coordinator.sbatch, finish.sbatch, submit.sh."""
    coordinator = shell_join(
        coordinator_args(
            cfg,
            port=Shell('"$port"'),
            http_port=Shell('"$http_port"'),
            idle_exit_s=o.idle_exit_s,
            token_file=Shell('"$JOB_DIR/token"'),
        )
    )
    launch = _slurm_launch_event(cfg, name, o)
    return {
        "config.yaml": (config_yaml(cfg), 0o644),
        "token": (secrets.token_hex(16) + "\n", 0o600),
        "coordinator.sbatch": (
            _fill(
                _template("coordinator.sbatch"),
                **common,
                idle=f"{o.idle_exit_s:g}",
                command=coordinator,
                node_address=_fragment("node_address.sh"),
                sbatch=_sbatch(f"{name}-coordinator", o, "--nodes=1", "--ntasks=1"),
            ),
            0o755,
        ),
        "finish.sbatch": (
            _fill(_template("finish.sbatch"), **common, sbatch=_sbatch(f"{name}-finish", o, "--nodes=1", "--ntasks=1")),
            0o755,
        ),
        "submit.sh": (
            _fill(_template("submit.sh"), **common, replicas=cfg.ft.replicas, launch=json.dumps(launch)[1:-1]),
            0o755,
        ),
    }


def _slurm_launch_event(cfg: Config, name: str, o: EmitOptions) -> dict:
    """The `launch` event submit.sh writes to run/launch.jsonl."""
    return {
        "event": "launch",
        "config": "config.yaml",
        "overrides": [],
        "out": "run",
        "replicas": cfg.ft.replicas,
        "hosts": cfg.mesh.hosts,
        "devices": cfg.mesh.devices_per_host,
        "steps": cfg.steps,
        "scheduler": "slurm",
        "name": name,
        "max_restarts": o.max_restarts,
        "restart_delay_s": o.restart_delay_s,
    }


def _slurm_resources(o: EmitOptions) -> tuple[list[str], str]:
    """A replica host's resources: as sbatch options, and as srun's options."""
    resources, srun = [], ""
    if o.cpus_per_host:
        resources.append(f"--cpus-per-task={o.cpus_per_host}")
        srun += f" --cpus-per-task={o.cpus_per_host}"  # srun does not inherit it from sbatch
    if o.mem_per_host_gib:
        resources.append(f"--mem={max(1, round(o.mem_per_host_gib * 1024))}M")
    if o.gpus_per_host:
        resources.append(f"--gpus-per-node={o.gpus_per_host}")
    if o.exclusive:
        resources.append("--exclusive")
    return resources, srun


def _slurm_replica_files(cfg: Config, name: str, o: EmitOptions, common: dict) -> dict[str, tuple[str, int]]:
    """replica-R.sbatch of every replica."""
    hosts = cfg.mesh.hosts
    resources, srun = _slurm_resources(o)
    reduce = cfg.ft.on_host_loss == "reduce"
    placement, policy = _slurm_placement(cfg, o)
    files = {}
    for r in range(cfg.ft.replicas):
        files[f"replica-{r}.sbatch"] = (
            _fill(
                _template("replica.sbatch"),
                **common,
                replica=r,
                hosts=hosts,
                last_host=hosts - 1,
                delay=f"{o.restart_delay_s:g}",
                command=_slurm_train_command(r, hosts),
                srun=srun,
                wait_s=600,
                leader=_fragment("node_address.sh") + "\n" + _fragment("leader.sh") if hosts > 1 else "",
                dist=_fragment("dist.sh") if hosts > 1 else "",
                placement=placement,
                policy=policy,
                sbatch=_sbatch(
                    f"{name}-replica-{r}",
                    o,
                    f"--nodes={hosts}",
                    "--ntasks-per-node=1",
                    *resources,
                    *(["--no-kill"] if reduce else []),
                ),
            ),
            0o755,
        )
    return files


def _slurm_train_command(r: int, hosts: int) -> str:
    """Replica r's `ftjax train` command in its script."""
    # the process id is appended per task (the `bash -c` above): only srun knows it
    command = TrainCommand(Shell('"$JOB_DIR/config.yaml"'), Shell('"$COORDINATOR"'), hosts, (Shell('"${REDUCED[@]}"'),))
    return shell_join(command.args(r, Shell('"$OUT"'), dist=Shell('"$DIST"') if hosts > 1 else None))
