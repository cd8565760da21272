"""The persistent compilation cache for every process of a multi-process replica on CPU
(ftjax/runtime/compile_cache.py): JAX itself writes only from process 0, and on CPU process 1's
keys are its own, so without the writer its entries never exist and it compiles at every start."""

import subprocess
import sys

import pytest

from ftjax.base.env import limited_env

# One process that JAX takes for process 1 of a jax.distributed cluster (the one field JAX's
# write rule reads), compiling one program with the cache on.
PROGRAM = """
import sys
import jax, jax.numpy as jnp
from jax._src import distributed
from ftjax.runtime.compile_cache import write_from_every_process

hits = []
jax.monitoring.register_event_listener(lambda event, **_: hits.append(event == "/jax/compilation_cache/cache_hits"))
distributed.global_state.process_id = 1
if sys.argv[1] == "every":
    assert write_from_every_process() and write_from_every_process()  # in place, and idempotent
print(jax.jit(lambda x: x * 3.0 + 1.0)(jnp.arange(4.0)).tolist(), sum(hits))
"""


def _compile_as_process_1(cache, writer: str) -> tuple[list[str], int]:
    """The cache's entries after the process ran, and how many programs it read from the cache."""
    env = limited_env(device_count=1)
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    out = subprocess.run([sys.executable, "-c", PROGRAM, writer], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    values, hits = out.stdout.strip().rsplit(" ", 1)
    assert values == "[1.0, 4.0, 7.0, 10.0]"
    return sorted(p.name for p in cache.glob("*-cache")), int(hits)


@pytest.mark.parametrize("writer", ["jax", "every"])
def test_a_process_other_than_0_writes_its_own_cpu_executables(tmp_path, writer):
    cache = tmp_path / "xla"
    entries, hits = _compile_as_process_1(cache, writer)
    assert hits == 0
    again, hits = _compile_as_process_1(cache, writer)
    if writer == "jax":
        assert not entries and not again and hits == 0  # JAX's rule: process 0 only; it compiles again
    else:
        assert entries and all(name.startswith("jit_") for name in entries), entries
        assert again == entries and hits >= 1  # the next start reads it back, nothing new to write
