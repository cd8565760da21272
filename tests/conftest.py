import os
import signal
import sys

import pytest

# Tests import ftjax before JAX: give this process (and every child, through limited_env) one
# compute thread and a few simulated CPU devices.
from ftjax.base.env import configure_process

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
