"""What the benchmarks' commands share: the head of their parser, the config check, and the
directory their runs go to."""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ftjax.config import Config, ConfigError, load_config


def parser(name: str, doc: str | None, config_default: str | None = "tiny") -> argparse.ArgumentParser:
    """`ftjax bench NAME CONFIG [key=value ...]` (CONFIG optional when it has a default)."""
    p = argparse.ArgumentParser(
        prog=f"ftjax bench {name}", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if config_default is None:
        p.add_argument("config")
    else:
        p.add_argument("config", nargs="?", default=config_default)
    return p


def load(name: str, config: str, overrides: list[str]) -> Config | None:
    """The config, or None after one line on stderr naming what is wrong (the caller exits 2)."""
    try:
        return load_config(config, overrides)
    except ConfigError as e:
        print(f"ftjax bench {name}: config error: {e}", file=sys.stderr)
        return None


@contextmanager
def run_directory(name: str, out: str | None) -> Iterator[Path]:
    """`out` (created if missing), else a temporary directory removed afterwards."""
    with tempfile.TemporaryDirectory(prefix=f"ftjax-bench-{name}-") as tmp:
        path = Path(out or tmp)
        path.mkdir(parents=True, exist_ok=True)
        yield path
