"""`ftjax check CONFIG [key=value ...]`: load the config's task and trace its init and loss on
the source's first examples (on the CPU, nothing trained); a source that can check its files
(token files: `verify`, their recorded sha256) checks them. Exit 2 naming what is wrong. `ftjax
launch` runs it before it starts anything when the config names a task."""

from __future__ import annotations

import argparse
import sys

from ftjax.config import ConfigError, load_config
from ftjax.program.task import TaskError
from ftjax.program.tokens import TokenFileError


def main(argv: list[str]) -> int:
    import jax  # (here, not at import: `ftjax --help` stays light)

    from ftjax.program.tasks import check_task

    p = argparse.ArgumentParser(prog="ftjax check", description=__doc__)
    p.add_argument("config", help="a config file or a built-in config's name")
    p.add_argument("overrides", nargs="*", help="config overrides, key.sub=value")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        jax.config.update("jax_platforms", "cpu")  # (before any backend starts: shapes only, no device)
        task = check_task(cfg)
        for source in (task.source, task.heldout):  # (token files: their recorded hash; a big corpus takes a while)
            if callable(verify := getattr(source, "verify", None)):
                verify()
    except (ConfigError, TaskError, TokenFileError) as e:
        print(f"ftjax check: error: {e}", file=sys.stderr)
        return 2
    n = len(task.source)
    print(
        f"ftjax check: task {task.name}: ok ({n:,} example{'s' if n != 1 else ''}, "
        f"data fingerprint {task.data_fingerprint()})"
    )
    return 0
