"""The synchronous HSDP baseline of `ftjax bench step`: one jax.distributed cluster, one replica
per process, mesh replica x fsdp, the cross-replica gradient reduction done by XLA collectives
(gloo) inside the fused train step. What FT-HSDP replaces with FTAR between separate replicas.

    python -m ftjax_bench.sync_baseline CONFIG [key=value ...] --out DIR \
        --num-processes N --process-id I --dist-address HOST:PORT

Each process trains its 1/N of every batch (`data.batch_size` is the global batch); process 0
writes DIR/metrics.jsonl, one record per step with `step_time_s` (data + compute), as
`ftjax train` does.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ftjax.base.env import configure_process
from ftjax.cli.train import init_distributed, parse_config
from ftjax.config import ConfigError


def run(cfg, out: Path) -> None:
    import jax
    import numpy as np

    from ftjax.program.data import make_stream
    from ftjax.program.sharding import hsdp_mesh
    from ftjax.program.step import build_program, device_batch, lowered
    from ftjax.runtime.host_group import JaxHostGroup
    from ftjax.runtime.metrics import MetricsLog

    group = JaxHostGroup()
    program = build_program(cfg, mesh=hsdp_mesh(jax.devices(), cfg.mesh.hosts))
    stream = make_stream(cfg)
    log = MetricsLog(out, enabled=jax.process_index() == 0, total_steps=cfg.steps, label="sync HSDP")
    log.event("start", mesh=dict(program.mesh.shape), processes=jax.process_count())
    seed, one = np.int32(cfg.seed), np.float32(1.0)
    # Everything compiles before anything runs, then the processes meet: gloo gives them 30 s to
    # set up its context at the first collective, and one process's compile (or data) may take
    # longer than the other's on a busy machine (as a replica's hosts meet, ftjax/runtime/replica.py).
    init = lowered(program.init, seed).compile()
    train_step = lowered(program.train_step, program.abstract_state(), program.example, one).compile()
    group.meet("compiled")
    state = init(seed)
    for step in range(1, cfg.steps + 1):
        t0 = time.perf_counter()
        batch = device_batch(program, stream.batch(step - 1))
        t1 = time.perf_counter()
        state, loss = train_step(state, batch, one)
        loss = float(loss)
        t2 = time.perf_counter()
        log.log({"step": step, "loss": loss, "step_time_s": t2 - t0, "data_s": t1 - t0, "compute_s": t2 - t1})
    log.close()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m ftjax_bench.sync_baseline", description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--out", required=True, help="run directory (metrics.jsonl)")
    p.add_argument("--num-processes", type=int, required=True, help="processes, one replica each (sets mesh.hosts)")
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--dist-address", required=True, help="HOST:PORT of the jax.distributed service")
    p.set_defaults(replica_id=0, coordinator=None, log_every=None)  # the `ftjax train` options it lacks
    args = p.parse_intermixed_args(argv)
    try:
        cfg = parse_config(args)
    except ConfigError as e:
        p.error(f"config error: {e}")  # exits 2
    configure_process(device_count=cfg.mesh.devices_per_host)
    init_distributed(cfg, args)
    run(cfg, Path(args.out))
    if cfg.mesh.hosts > 1:
        import jax

        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
