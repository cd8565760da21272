"""`ftjax.fit`: the whole runtime for the common case, from Python (docs/design/index.md, "The API").

`fit(task, config)` trains a task standalone (a quorum of one) or, given a coordinator, as one
replica of a fault-tolerant job: the same loop and step protocol as `ftjax train`, which is this
function behind a command line. A script that owns its loop uses `ftjax.FaultTolerance` instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ftjax.config import Config, ConfigError, apply_overrides, load_config, load_config_dict

if TYPE_CHECKING:  # (imported where it runs: the API is lazy, it imports JAX)
    from ftjax.program.task import Task


@dataclass(frozen=True)
class FitResult:
    """What a run left: its exit code (0: trained every step), its directory, its summary
    (summary.json) and its per-step records (metrics.jsonl)."""

    exit_code: int
    run_dir: Path
    summary: dict
    records: list[dict]

    @property
    def losses(self) -> list[float]:
        """The loss of each committed step, in step order."""
        return [r["loss"] for r in self.records if r.get("committed") and r.get("loss") is not None]


def as_config(config: str | Path | dict | Config, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """A Config from a YAML path or built-in name, a dict of sections, or a Config, with
    `key.sub=value` overrides (ConfigError naming the field at fault)."""
    if isinstance(config, Config):
        return load_config_dict(apply_overrides(config.model_dump(), list(overrides))) if overrides else config
    if isinstance(config, dict):
        return load_config_dict(apply_overrides(config, list(overrides)))
    return load_config(config, list(overrides))


def fit(
    task: Task | None = None,
    config: str | Path | dict | Config = "tiny",
    overrides: list[str] | tuple[str, ...] = (),
    *,
    out: str | Path = "runs/fit",
    coordinator: str | None = None,
    replica_id: int = 0,
    resume: bool = False,
) -> FitResult:
    """Train `task` (an `ftjax.Task`; None: the config's `task:`) with `config`.

    Standalone unless `coordinator` (HOST:PORT of a job's `ftjax coordinator`; the job token in
    $FTJAX_TOKEN) is given. JAX runs on whatever this process has already set up: `platform` and
    `mesh.devices_per_host` are checked against it, not applied (see `ftjax train` for a process
    that sets them). A replica of several hosts calls `jax.distributed.initialize` first.
    Standalone, an `out` that already holds a run raises FileExistsError unless `resume`."""
    from ftjax.base.env import check_platform
    from ftjax.runtime.args import RunOptions, held_run
    from ftjax.runtime.metrics import read_metrics
    from ftjax.runtime.replica import run_member, run_standalone

    cfg = as_config(config, overrides)
    if task is not None and cfg.task is None:  # the identity of a checkpoint names the task it trained
        cfg = load_config_dict({**cfg.model_dump(), "task": _path_of(task)})
    check_platform(cfg.platform, cfg.mesh.devices_per_host)
    run_dir = Path(out)
    if not coordinator and not resume and (held := held_run(run_dir)):  # (as `ftjax train`)
        raise FileExistsError(f"out={str(run_dir)!r} already holds a run ({held}): resume=True continues it")
    options = RunOptions(replica_id=replica_id, coordinator=coordinator, resume=resume)
    if coordinator:
        code = run_member(cfg, options, run_dir, task)
    else:
        code = run_standalone(cfg, options, run_dir, task)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    metrics = run_dir / "metrics.jsonl"
    return FitResult(code, run_dir, summary, read_metrics(metrics) if metrics.exists() else [])


def _path_of(task: Task) -> str:
    """A task given as an object still gets a `module:name`-shaped identity (its adapter's name)."""
    name = getattr(task, "name", "") or "task"
    if ":" in name:
        return name
    safe = "".join(c if c.isalnum() or c == "_" else "_" for c in name) or "task"
    if safe[0].isdigit():
        safe = "_" + safe
    return f"__main__:{safe}"


__all__ = ["ConfigError", "FitResult", "as_config", "fit"]
