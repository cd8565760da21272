"""`ftjax check CONFIG [key=value ...]`: load the config's task and trace its init and loss on
the source's first examples (on the CPU, nothing trained). Exit 2 naming what is wrong. `ftjax
launch` runs it before it starts anything when the config names a task."""

from __future__ import annotations

import argparse
import sys

from ftjax.config import ConfigError, load_config
from ftjax.program.task import TaskError


def main(argv: list[str]) -> int:
    import jax  # (here, not at import: `ftjax --help` stays light)

    from ftjax.program.tasks import check_task

    p = argparse.ArgumentParser(prog="ftjax check", description=__doc__)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        jax.config.update("jax_platforms", "cpu")  # (before any backend starts: shapes only, no device)
        task = check_task(cfg)
    except (ConfigError, TaskError) as e:
        print(f"ftjax check: error: {e}", file=sys.stderr)
        return 2
    print(
        f"ftjax check: task {task.name}: ok ({len(task.source):,} examples, data fingerprint {task.data_fingerprint()})"
    )
    return 0
