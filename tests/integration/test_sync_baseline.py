"""The synchronous HSDP baseline of `ftjax bench step` (ftjax_bench/sync_baseline.py), run as its
two real processes."""

import subprocess
import textwrap

import pytest
from conftest import REPO

from ftjax.base.procs import ProcessGroup, free_port
from ftjax.runs.events import is_step
from ftjax.runs.jsonl import read_jsonl
from ftjax.runtime.args import process_flags

# Process 1 as `python -m ftjax_bench.sync_baseline` runs it, but 35 s slower between building its
# program and its first step: longer than the 30 s gloo gives the processes to meet at the first
# collective, as a busy machine made one process's compile once (CI, both cores busy).
SLOW_PROCESS = textwrap.dedent(
    """
    import sys, time
    import ftjax.program.step as step
    from ftjax_bench import sync_baseline

    built = step.build_program
    def slowly_built(*args, **kwargs):
        program = built(*args, **kwargs)
        time.sleep(35)
        return program
    step.build_program = slowly_built
    sys.exit(sync_baseline.main(sys.argv[1:]))
    """
)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_process_slower_by_more_than_gloos_30_s_does_not_fail_the_sync_baseline(tmp_path):
    # it did (`bench step` in CI: "Gloo context initialization failed: DEADLINE_EXCEEDED:
    # GetKeyValue() timed out"): the processes now compile, then meet, then run
    port, out = free_port(), tmp_path / "sync"
    args = [f"{REPO}/configs/tiny.yaml", "steps=3", "mesh.devices_per_host=2", "data.batch_size=16", "--out", str(out)]
    fast = ["-m", "ftjax_bench.sync_baseline", *args, *process_flags(2, 0, f"127.0.0.1:{port}")]
    slow = ["-c", SLOW_PROCESS, *args, *process_flags(2, 1, f"127.0.0.1:{port}")]
    logs = [tmp_path / f"process-{i}.log" for i in range(2)]
    with ProcessGroup() as procs:
        started = [
            procs.python(*c, device_count=2, stdout=log.open("w"), stderr=subprocess.STDOUT)
            for c, log in zip((fast, slow), logs)
        ]
        for i, p in enumerate(started):
            assert p.wait(timeout=360) == 0, f"process {i}:\n{logs[i].read_text()[-3000:]}"
    records = read_jsonl(out / "metrics.jsonl")
    steps = [r["step"] for r in records if is_step(r)]
    assert steps == [1, 2, 3], records
