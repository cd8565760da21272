import os
import signal
import sys

import pytest

# The suite's models are tiny, so its time is mostly XLA compiling them, and on CPU most of that is
# LLVM optimising code that then runs for milliseconds. Compiling at backend optimisation level 0
# cut a compile-bound test by a quarter, and a fresh machine (cold compilation cache) with both
# cores busy took the suite over 30 minutes at the default level (docs/dev/testing.md). Every
# process of the suite inherits the flag (limited_env keeps XLA_FLAGS), so what a test compares was
# compiled alike; the level enters the cache key, so no entry of another level is read. A user's
# run, `ftjax demo` and the benchmarks keep XLA's default. Set XLA_FLAGS to choose otherwise.
SUITE_XLA_LEVEL = "--xla_backend_optimization_level=0"  # (a test that compiles as a user's would removes it)
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + SUITE_XLA_LEVEL).strip()

# Tests import ftjax before JAX: give this process (and every child, through limited_env) one
# compute thread and a few simulated CPU devices.
from ftjax.base.env import configure_process  # noqa: E402

configure_process(device_count=int(os.environ.get("FTJAX_TEST_DEVICES", "4")))

from ftjax.base.procs import ProcessGroup  # noqa: E402

pytest_plugins = ["launchrun"]  # the `launch` fixture: real `ftjax launch` runs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FTJAX = [sys.executable, "-m", "ftjax"]


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"pytest got signal {signum}")


def pytest_configure(config):
    """SIGTERM (a CI job's time limit, `kill`) stops the run as Ctrl-C does, so the running test's
    fixtures tear down and kill what it started: by default SIGTERM ends pytest at once, and the
    processes a test started (each in a session of its own) kept running."""
    signal.signal(signal.SIGTERM, _interrupted)


def need_namespaces(what: str) -> None:
    """Skip (fail, when $CI is true: CI must run them) unless this machine can make a virtual cluster
    (network and mount namespaces: Linux, as root)."""
    from ftjax.launch.vcluster import unavailable

    why = unavailable()
    if why is not None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but this machine cannot run {what}: {why}")
        pytest.skip(f"{what} need network namespaces: {why}")


@pytest.fixture
def procs():
    """Start real child processes; every one is SIGKILLed at teardown, also when the test fails."""
    with ProcessGroup() as group:
        yield group


# --- the order of the files -----------------------------------------------------------------------
# `make test` hands a test file at a time to each worker (xdist --dist loadfile, in collection order:
# --no-loadscope-reorder). xdist's own order, most tests first, left the files of one or two
# minute-long tests to the end, where one worker ran them while the others had finished. Heaviest
# first (longest-processing-time scheduling) ends the run on the short files instead. The costs are
# a hogged run's seconds per file (tests/costs.json, written by scripts/test_costs.py from a JUnit
# report); a file not in it counts as a middling one. Within a file, the order stays as written.
_COSTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "costs.json")
_UNRECORDED_S = 10.0


def heaviest_first(items: list, costs: dict[str, float], nodeid=lambda item: item.nodeid) -> None:
    """Sort `items` in place by their file's cost, heaviest first; a stable sort keeps each file's order."""
    items.sort(key=lambda item: -costs.get(nodeid(item).split("::", 1)[0], _UNRECORDED_S))


def pytest_collection_modifyitems(config, items):
    import json

    try:
        with open(_COSTS) as f:
            costs = json.load(f)["seconds"]
    except FileNotFoundError:
        return
    heaviest_first(items, costs)
