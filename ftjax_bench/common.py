"""What the benchmarks' commands share: the head of their parser, the config check, the directory
their runs go to, and the best-of timing of a call (the scripts' probes use it too)."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
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
        p.add_argument("config", help="a config file or a built-in config's name")
    else:
        p.add_argument("config", nargs="?", default=config_default, help="a config file or a built-in config's name")
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


@contextmanager
def phase(name: str, what: str) -> Iterator[None]:
    """One line on stderr when `what` (a run of the benchmark) ends, with its seconds: a benchmark
    cut off by a caller's limit then says which of its runs it had finished, and how fast."""
    began = time.perf_counter()
    yield
    print(f"ftjax bench {name}: {what}: {time.perf_counter() - began:.1f} s", file=sys.stderr, flush=True)


def best_time(f, reps: int = 5) -> float:
    """The fastest of `reps` timed calls of `f` after one untimed call (compile, warm caches), each
    waiting for the arrays `f` returns (JAX dispatches asynchronously)."""
    import jax  # here: most benchmarks never need it

    jax.block_until_ready(f())
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        jax.block_until_ready(f())
        times.append(time.perf_counter() - began)
    return min(times)
