"""`ftjax bench catchup CONFIG`: catch-up transfer rate against the raw loopback link, same run.

A source process builds the config's model, trains two steps (so the optimizer moments are not
all zeros), and offers a snapshot exactly as a replica's host does for a healing peer. This process
then, `--rounds` times over, measures (a) the raw link: one-way TCP from the source process to this
one, the snapshot's byte count in 4 MiB sendall / recv_into calls, over one connection into one reused
buffer (cache-hot), over one into a fresh buffer of the snapshot's size, from a resident buffer of
that size into another (memory to memory, as a catch-up moves a snapshot) over one connection and
over `ft.catchup_streams` at once (each a share), and over as many from and into the reused buffer;
and (b) the snapshot transfer (`SnapshotFetch`: a manifest, then byte ranges streamed from the
source's memory into place in this one's) with `ft.catchup_streams` connections into a receive arena
mapped beforehand (`ReceiveArena`, as a replica maps it while it starts: the shipped path), the same
into fresh memory (`unmapped`: the path before the arena), and with one connection into fresh memory
(`single_stream`: the transport before issue 32), and places the last one on this process's devices
(`HostShards.to_state`). Prints one JSON line: medians of `catchup_mb_s`, `link_mb_s` (one
connection, cache-hot), `ratio` (their quotient), `ratio_tcp` (against cache-hot raw TCP over as
many connections), `ratio_in_place` (against one connection into a fresh buffer), `ratio_resident`
and `ratio_resident_tcp` (against the link moving the same bytes memory to memory, over one
connection and over as many as the fetch), `arena_s` (mapping the arena: off the transfer's path),
and the other costs of a catch-up (the source's copy to host memory, the placement) for context.
`orbax`: the same snapshot written and read back through orbax's `StandardCheckpointer` on this
machine's local disk, against the copy and placement above (`vs_copy_and_place`; docs/design/recovery.md,
"Catch-up": why the transport's serialization is not orbax's).
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
    resident = np.ones(nbytes, np.uint8)  # (every page touched: memory as resident as a snapshot's)
    link = socket.create_server(("127.0.0.1", 0))

    def send(conn) -> None:
        with conn:
            header = conn.recv(17, socket.MSG_WAITALL)
            n, from_resident = int.from_bytes(header[:8], "little"), header[8] == 1
            first = int.from_bytes(header[9:], "little")  # (a resident share's place in the buffer)
            view, at = memoryview(resident if from_resident else payload), 0
            while at < n:
                k = min(n - at, _CHUNK)
                conn.sendall(view[first + at : first + at + k] if from_resident else view[:k])
                at += k

    def link_loop():  # a thread per connection: the raw link over several connections at once
        while True:
            conn, _ = link.accept()
            threading.Thread(target=send, args=(conn,), daemon=True).start()

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


def _receive(address: str, nbytes: int, into: str, resident=None, first: int = 0) -> None:
    """One-way TCP of `nbytes` from the source: `into` "hot", from and into one reused 4 MiB buffer
    (cache-hot: the loopback's best case, which no transfer of a large state has); "place", into a
    fresh buffer of `nbytes` (each page touched for the first time); "resident", from a resident
    buffer of the source's into the resident buffer `resident` (memory to memory, as a catch-up
    moves a snapshot whose buffers are already mapped)."""
    import numpy as np

    if into == "resident":
        buf = memoryview(resident)[first : first + nbytes]
    else:
        buf = memoryview(np.empty(nbytes if into == "place" else _CHUNK, np.uint8))
    with socket.create_connection(split_address(address)) as s:
        s.sendall(nbytes.to_bytes(8, "little") + bytes([into == "resident"]) + first.to_bytes(8, "little"))
        done = 0
        while done < nbytes:
            at = 0 if into == "hot" else done
            got = s.recv_into(buf[at : at + min(nbytes - done, _CHUNK)])
            if not got:
                raise ConnectionError("link sender closed early")
            done += got


def _link_seconds(address: str, nbytes: int, streams: int = 1, into: str = "hot", resident=None) -> float:
    """`nbytes` of raw TCP from the source, over `streams` connections at once (each a share)."""
    shares = [nbytes // streams + (k < nbytes % streams) for k in range(streams)]
    firsts = [sum(shares[:k]) for k in range(streams)]
    threads = [threading.Thread(target=_receive, args=(address, n, into, resident, f)) for n, f in zip(shares, firsts)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def _transfer_seconds(address: str, streams: int, arena=None) -> tuple[float, object]:
    from ftjax.runtime.catchup import SnapshotFetch

    fetch = SnapshotFetch(address, "bench/0", "bench-token", source="bench", streams=streams, arena=arena)
    fetch.done.wait(300)
    if fetch.result is None:
        raise RuntimeError(f"fetch failed: {fetch.error}")
    return fetch.result.seconds, fetch.result


def _arena(nbytes: int, times: dict[str, list[float]]):
    """A newcomer's receive arena, mapped before its fetch as a replica maps it while it starts
    (the fetch does not wait for it); its mapping time goes to `times["arena"]`."""
    from ftjax.runtime.catchup import ReceiveArena

    arena = ReceiveArena(nbytes)
    arena.ready()
    times["arena"].append(arena.seconds)
    return arena


def _measure(info: dict, streams: int, rounds: int) -> tuple[dict[str, list[float]], object]:
    """Seconds of each of the transfers, `rounds` times, interleaved (a load that comes and goes on
    the machine weighs on all of them alike); and the last fetch's result."""
    import numpy as np

    kinds = ("link", "link_tcp", "link_in_place", "link_resident", "link_resident_tcp")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    times.update(catchup=[], unmapped=[], single=[], arena=[])
    resident = np.ones(info["nbytes"], np.uint8)
    result = None
    for _ in range(rounds):
        times["link"].append(_link_seconds(info["link"], info["nbytes"]))
        times["link_in_place"].append(_link_seconds(info["link"], info["nbytes"], into="place"))
        times["link_resident"].append(_link_seconds(info["link"], info["nbytes"], into="resident", resident=resident))
        times["link_tcp"].append(_link_seconds(info["link"], info["nbytes"], streams))
        times["link_resident_tcp"].append(
            _link_seconds(info["link"], info["nbytes"], streams, into="resident", resident=resident)
        )
        times["single"].append(_transfer_seconds(info["address"], 1)[0])
        times["unmapped"].append(_transfer_seconds(info["address"], streams)[0])
        seconds, result = _transfer_seconds(info["address"], streams, _arena(info["nbytes"], times))
        times["catchup"].append(seconds)
    return times, result


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--serve":
        return _serve(argv[1:])
    p = common.parser("catchup", __doc__, config_default=None)
    p.add_argument("overrides", nargs="*", help="config overrides, key.sub=value")
    p.add_argument("--rounds", type=int, default=3, help="transfers timed; the JSON has their medians")
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
        try:
            times, result = _measure(info, cfg.ft.catchup_streams, args.rounds)
        except (RuntimeError, ConnectionError) as e:
            print(f"ftjax bench catchup: {e}", file=sys.stderr)
            return 1
        import jax

        from ftjax.program.step import build_program

        abstract = build_program(cfg).abstract_state()
        t0 = time.perf_counter()
        state = jax.block_until_ready(result.shards.to_state(abstract))
        restore_s = time.perf_counter() - t0
        source.stdin.close()
        source.wait(30)
    record = _report(args, cfg.ft.catchup_streams, info, times, restore_s)
    record["orbax"] = _orbax_round_trip(state, abstract, our_s=info["offer_s"] + restore_s)
    print(json.dumps(record))
    return 0


def _orbax_round_trip(state, abstract, our_s: float) -> dict:
    """What serializing the same snapshot through orbax would cost on a catch-up's critical path
    (issue 32): `StandardCheckpointer` writes it to this machine's temp directory and restores it
    into the target shardings (`restore(dir, abstract)`), the moving of its files between hosts not
    counted. `vs_copy_and_place`: that against this transport's own serialization and layout, the
    source's copy to host memory plus the newcomer's placement (`snapshot_copy_s + restore_s`)."""
    import tempfile
    from pathlib import Path

    import jax
    import orbax.checkpoint as ocp

    with tempfile.TemporaryDirectory(prefix="ftjax-bench-orbax-") as tmp:
        ckptr = ocp.StandardCheckpointer()
        t0 = time.perf_counter()
        ckptr.save(Path(tmp) / "snapshot", state)
        ckptr.wait_until_finished()
        save_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        restored = jax.block_until_ready(ckptr.restore(Path(tmp) / "snapshot", abstract))
        load_s = time.perf_counter() - t0
        ckptr.close()
    same = all(bool((a == b).all()) for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)))
    return {
        "save_s": round(save_s, 3),
        "restore_s": round(load_s, 3),
        "vs_copy_and_place": round((save_s + load_s) / our_s, 2),
        "bitwise_equal": same,
    }


def _report(args, streams: int, info: dict, times: dict[str, list[float]], restore_s: float) -> dict:
    mb = info["nbytes"] / 1e6
    arena_s = statistics.median(times.pop("arena"))
    rate = {k: mb / statistics.median(v) for k, v in times.items()}
    return {
        "bench": "catchup",
        "config": args.config,
        "snapshot_mb": round(mb, 2),
        "streams": streams,
        "catchup_mb_s": round(rate["catchup"], 1),
        "link_mb_s": round(rate["link"], 1),
        "ratio": round(rate["catchup"] / rate["link"], 3),
        "link_tcp_mb_s": round(rate["link_tcp"], 1),
        "ratio_tcp": round(rate["catchup"] / rate["link_tcp"], 3),
        "link_in_place_mb_s": round(rate["link_in_place"], 1),
        "ratio_in_place": round(rate["catchup"] / rate["link_in_place"], 3),
        "link_resident_mb_s": round(rate["link_resident"], 1),
        "ratio_resident": round(rate["catchup"] / rate["link_resident"], 3),
        "link_resident_tcp_mb_s": round(rate["link_resident_tcp"], 1),
        "ratio_resident_tcp": round(rate["catchup"] / rate["link_resident_tcp"], 3),
        "single_stream": {"catchup_mb_s": round(rate["single"], 1), "ratio": round(rate["single"] / rate["link"], 3)},
        "unmapped": {"catchup_mb_s": round(rate["unmapped"], 1), "ratio": round(rate["unmapped"] / rate["link"], 3)},
        "arena_s": round(arena_s, 6),  # (a tiny arena maps in well under a millisecond)
        "snapshot_copy_s": round(info["offer_s"], 3),
        "restore_s": round(restore_s, 3),
        "rounds": args.rounds,
    }
