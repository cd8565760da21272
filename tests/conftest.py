import os
import sys

import pytest

# Tests import ftjax before JAX: give this process (and every child, through limited_env) one
# compute thread and a few simulated CPU devices.
from ftjax.env import configure_process

configure_process(device_count=int(os.environ.get("FTJAX_TEST_DEVICES", "4")))

from ftjax.procs import ProcessGroup  # noqa: E402

pytest_plugins = ["launchrun"]  # the `launch` fixture: real `ftjax launch` runs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FTJAX = [sys.executable, "-m", "ftjax"]


@pytest.fixture
def procs():
    """Start real child processes; every one is SIGKILLed at teardown, also when the test fails."""
    with ProcessGroup() as group:
        yield group
