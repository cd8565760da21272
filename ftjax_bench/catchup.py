"""`ftjax bench catchup CONFIG`: catch-up transfer rate against the raw loopback link, same run.

A source process builds the config's model, trains two steps (so the optimizer moments are not
all zeros), and offers a snapshot exactly as a replica's host does for a healing peer. This process
then, three times over, measures (a) the raw link: one-way TCP from the source process to this one,
the snapshot's byte count in 4 MiB sendall / recv_into calls, and (b) the snapshot transfer
(`SnapshotFetch`: HTTP request, the source's shards streamed from its memory into this one's), and
places the last one on this process's devices (`HostShards.to_state`). Prints one JSON line: medians
of `catchup_mb_s` and `link_mb_s`, `ratio`, and the other costs of a catch-up (the source's copy to
host memory, the placement) for context.
"""

from __future__ import annotations

import json
import socket
import statistics
import sys
import threading
import time

from ftjax.base.net import split_address
from ftjax_bench import common

_CHUNK = 4 << 20


def _serve(argv: list[str]) -> int:
    from ftjax.base.env import configure_process
    from ftjax.config import load_config

    cfg = load_config(argv[0], argv[1:])
    configure_process(device_count=cfg.mesh.devices_per_host)
    import jax
    import numpy as np

    from ftjax.program.data import make_stream
    from ftjax.program.step import build_program, device_batch
    from ftjax.runtime.catchup import SnapshotServer

    program = build_program(cfg)
    state = program.init(np.int32(cfg.seed))
    stream = make_stream(cfg)
    for k in range(2):
        state, _ = program.train_step(state, device_batch(program, stream.batch(k)), np.float32(1.0))
    jax.block_until_ready(state)
    server = SnapshotServer("bench-token")
    t0 = time.perf_counter()
    server.offer("bench/0", state, 2, {"step": 2})
    offer_s = time.perf_counter() - t0
    nbytes = server._snapshots["bench/0"].shards.nbytes
    payload = bytearray(_CHUNK)
    link = socket.create_server(("127.0.0.1", 0))

    def link_loop():
        while True:
            conn, _ = link.accept()
            with conn:
                n = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "little")
                view = memoryview(payload)
                while n > 0:
                    conn.sendall(view[: min(n, _CHUNK)])
                    n -= _CHUNK

    threading.Thread(target=link_loop, daemon=True).start()
    print(
        json.dumps(
            {
                "address": server.address,
                "link": f"127.0.0.1:{link.getsockname()[1]}",
                "nbytes": nbytes,
                "offer_s": offer_s,
            }
        ),
        flush=True,
    )
    sys.stdin.read()  # until the parent closes our stdin
    server.close()
    return 0


def _link_seconds(address: str, nbytes: int) -> float:
    buf = memoryview(bytearray(_CHUNK))
    with socket.create_connection(split_address(address)) as s:
        t0 = time.perf_counter()
        s.sendall(nbytes.to_bytes(8, "little"))
        left = nbytes
        while left > 0:
            got = s.recv_into(buf, min(left, _CHUNK))
            if not got:
                raise ConnectionError("link sender closed early")
            left -= got
        return time.perf_counter() - t0


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--serve":
        return _serve(argv[1:])
    p = common.parser("catchup", __doc__, config_default=None)
    p.add_argument("overrides", nargs="*")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_intermixed_args(argv)
    cfg = common.load("catchup", args.config, args.overrides)
    if cfg is None:
        return 2
    import subprocess

    from ftjax.base.env import configure_process
    from ftjax.base.procs import ProcessGroup

    configure_process(device_count=cfg.mesh.devices_per_host)
    with ProcessGroup() as procs:
        source = procs.start(
            [sys.executable, "-m", "ftjax", "bench", "catchup", "--serve", args.config, *args.overrides],
            device_count=cfg.mesh.devices_per_host,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        info = json.loads(source.stdout.readline())
        from ftjax.runtime.catchup import SnapshotFetch

        links, transfers, fetch = [], [], None
        for _i in range(args.rounds):
            links.append(_link_seconds(info["link"], info["nbytes"]))
            fetch = SnapshotFetch(info["address"], "bench/0", "bench-token", source="bench")
            fetch.done.wait(300)
            if fetch.result is None:
                print(f"ftjax bench catchup: fetch failed: {fetch.error}", file=sys.stderr)
                return 1
            transfers.append(fetch.result.seconds)
        import jax

        from ftjax.program.step import build_program

        abstract = build_program(cfg).abstract_state()
        t0 = time.perf_counter()
        jax.block_until_ready(fetch.result.shards.to_state(abstract))
        restore_s = time.perf_counter() - t0
        source.stdin.close()
        source.wait(30)
    mb = info["nbytes"] / 1e6
    link_mb_s, catchup_mb_s = mb / statistics.median(links), mb / statistics.median(transfers)
    print(
        json.dumps(
            {
                "bench": "catchup",
                "config": args.config,
                "snapshot_mb": round(mb, 2),
                "catchup_mb_s": round(catchup_mb_s, 1),
                "link_mb_s": round(link_mb_s, 1),
                "ratio": round(catchup_mb_s / link_mb_s, 3),
                "snapshot_copy_s": round(info["offer_s"], 3),
                "restore_s": round(restore_s, 3),
                "rounds": args.rounds,
            }
        )
    )
    return 0
