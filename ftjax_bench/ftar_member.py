"""A stand-alone FTAR member process, driven by JSON lines over a control connection.

The benchmark and the multi-process failure tests start N of these (``python -m
ftjax_bench.ftar_member --control HOST:PORT``); each dials the parent's control listener, sends its
FTAR address and pid, and then runs the all-reduces (or raw TCP transfers) it is told to. Data
are generated in place from a seed (integer-valued floats, so that the exact average is known
bitwise whatever the summation order), so 64 MiB buffers never cross the channel: a member
reports timings, a digest of its result and whether it is exact.

:func:`start_members` and :class:`MemberClient` are the parent's side.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import ml_dtypes
import numpy as np

from ftjax.ftar import wire
from ftjax.ftar.endpoint import DEFAULT_CHUNK_BYTES, FTAREndpoint
from ftjax.ftar.errors import FTARError

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def make_data(seed: int, n: int, dtype: str) -> np.ndarray:
    """Deterministic integer-valued data: |x| < 128 (exact in bfloat16 too), sums exact in float32."""
    x = np.arange(n, dtype=np.uint32) * np.uint32(2654435761) + np.uint32((seed * 40503 + 12345) & 0xFFFFFFFF)
    vals = ((x >> np.uint32(13)) % np.uint32(255)).astype(np.int32) - 127
    return vals.astype(np.float32).astype(DTYPES[dtype])


def expected_average(seeds: list[int], contributors: list[bool], n: int, dtype: str) -> np.ndarray:
    total = np.zeros(n, np.float32)
    for seed, c in zip(seeds, contributors):
        if c:
            total += make_data(seed, n, dtype).astype(np.float32)
    return (total / sum(contributors)).astype(DTYPES[dtype])


# --- the member process ------------------------------------------------------------------------
class _Channel:
    """JSON lines to and from the parent, over the control connection it gave us."""

    def __init__(self, address: str) -> None:
        if address.startswith("unix:"):  # the parent is in another network namespace (a virtual cluster)
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(address[len("unix:") :])
        else:
            self.sock = socket.create_connection(wire.parse_address(address))
        self.lines = self.sock.makefile("r")

    def emit(self, obj: dict[str, Any]) -> None:
        self.sock.sendall((json.dumps(obj) + "\n").encode())


_buffers: dict[tuple[int, int, str], tuple[np.ndarray, np.ndarray]] = {}


def _buffers_for(seed: int, n: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(data, output) for a call; kept for the next command with the same data, as a training loop
    keeps its gradient buffers (a new 64 MiB array costs page faults on first touch)."""
    key = (seed, n, dtype)
    if key not in _buffers:
        _buffers.clear()
        _buffers[key] = (make_data(seed, n, dtype), np.zeros(n, DTYPES[dtype]) + 0)  # + 0: pages touched
    return _buffers[key]


def _allreduce(eps: dict[str, FTAREndpoint], cmd: dict[str, Any], chan: _Channel) -> dict[str, Any]:
    n, dtype, rank = cmd["n"], cmd["dtype"], cmd["rank"]
    ep = eps[cmd.get("endpoint", "")]
    contributors = cmd.get("contributors") or [True] * len(cmd["members"])
    buf, out = _buffers_for(cmd["seeds"][rank], n, dtype)
    times = []
    chan.emit({"event": "started", "t": time.time()})
    for i in range(cmd.get("iters", 1)):
        t0 = time.perf_counter()
        try:
            ep.allreduce(
                buf,
                quorum_id=cmd["quorum_id"],
                step=cmd["step"] + i,
                members=cmd["members"],
                rank=rank,
                contributors=contributors,
                out=out,
            )
        except FTARError as exc:
            return {
                "ok": False,
                "error": type(exc).__name__,
                "peer": exc.peer,
                "quorum_id": exc.quorum_id,
                "step": exc.step,
                "message": str(exc),
                "t": time.time(),
                "elapsed": time.perf_counter() - t0,
            }
        times.append(time.perf_counter() - t0)
    reply = {
        "ok": True,
        "times": times,
        "t_end": time.time(),
        "digest": hashlib.sha256(out.view(np.uint8)).hexdigest(),
        "stats": dict(ep.stats),
    }
    if cmd.get("verify"):
        want = expected_average(cmd["seeds"], contributors, n, dtype)
        if ep.wire_dtype == "bfloat16":
            # each hop rounds its partial sum (|sum| < 128 * members: off by at most 2**-8 of it), so
            # "exact" here means within those roundings
            bound = len(cmd["members"]) * 128 * 2**-8
            reply["exact"] = bool(np.all(np.abs(out.astype(np.float32) - want.astype(np.float32)) <= bound))
        else:
            reply["exact"] = bool(np.array_equal(out.view(np.uint8), want.view(np.uint8)))
    return reply


class _RawTCP:
    """Plain TCP transfers between members, without FTAR: the yardsticks FTAR is compared with.
    Same socket settings and per-call size as a ring link, and the fastest Python pattern (sendall
    of preallocated memory; recv_into with MSG_WAITALL).

    ``spread``: a transfer walks through an ``nbytes`` buffer on both sides, as the all-reduce does
    (its data do not fit in a cache). Otherwise one ``chunk`` is sent again and again and received
    into one ``chunk``: cache-hot copies, an upper bound no real transfer of ``nbytes`` meets.
    """

    def __init__(self, host: str, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.listener = socket.create_server((host, 0))
        self.address = f"{host}:{self.listener.getsockname()[1]}"
        self.memory = {"send": np.ones(0, np.uint8), "recv": np.ones(0, np.uint8)}

    def _views(self, role: str, nbytes: int, chunk: int, spread: bool) -> list[memoryview]:
        """The chunk-size pieces of a transfer, in order (piece k goes on connection k % streams)."""
        if self.memory[role].size < (nbytes if spread else chunk):
            self.memory[role] = np.ones(nbytes if spread else chunk, np.uint8)  # ones: pages touched now
        mem = memoryview(self.memory[role])
        return [
            mem[a : min(a + chunk, nbytes)] if spread else mem[: min(chunk, nbytes - a)]
            for a in range(0, nbytes, chunk)
        ]

    def transfer(
        self, send_to: str | None, receive: bool, nbytes: int, chunk: int, spread: bool, streams: int = 1
    ) -> dict[str, Any]:
        """Send ``nbytes`` to ``send_to`` (if given) while receiving ``nbytes`` from one dialer
        (if ``receive``), over ``streams`` parallel connections each way (piece k on connection
        k % streams, one thread per connection, as FTAR's links do). Returns the seconds until both
        are done (a send is done when the receiver has acknowledged its last byte)."""
        send_views = self._views("send", nbytes, chunk, spread) if send_to else []
        recv_views = self._views("recv", nbytes, chunk, spread) if receive else []
        errors: list[BaseException] = []
        threads = [
            threading.Thread(target=self._send, args=(send_to, i, send_views[i::streams], errors), daemon=True)
            for i in range(streams if send_to else 0)
        ]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        if receive:
            self.listener.settimeout(self.timeout_s)
            conns = [self.listener.accept()[0] for _ in range(streams)]
            receivers = [
                threading.Thread(target=self._receive, args=(c, recv_views, streams, errors), daemon=True)
                for c in conns
            ]
            for t in receivers:
                t.start()
            threads += receivers
        for t in threads:
            t.join()
        if errors:
            return {"ok": False, "error": repr(errors[0])}
        return {"ok": True, "seconds": time.perf_counter() - t0}

    def _send(self, send_to: str, index: int, views: list[memoryview], errors: list[BaseException]) -> None:
        try:
            with socket.create_connection(wire.parse_address(send_to), timeout=self.timeout_s) as sock:
                wire.tune(sock, self.timeout_s)
                sock.sendall(index.to_bytes(4, "little"))  # which pieces follow: the receiver's share
                for view in views:
                    sock.sendall(view)
                wire.recv_exact(sock, 1)
        except BaseException as exc:
            errors.append(exc)

    def _receive(self, conn: socket.socket, views: list[memoryview], streams: int, errors: list) -> None:
        try:
            with conn:
                wire.tune(conn, self.timeout_s)
                index = int.from_bytes(wire.recv_exact(conn, 4), "little")  # connections arrive in any order
                for view in views[index::streams]:
                    wire.recv_into_all(conn, [view])
                conn.sendall(b"k")
        except BaseException as exc:
            errors.append(exc)


def main(argv: list[str] | None = None) -> int:
    """The member process: serve commands from the control channel until "exit" or its end."""
    ap = argparse.ArgumentParser(prog="python -m ftjax_bench.ftar_member", description=__doc__.splitlines()[0])
    ap.add_argument("--token", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES)
    ap.add_argument("--checksum", action="store_true")
    ap.add_argument("--no-shared-memory", action="store_true", help="ring payloads over TCP even on one host")
    ap.add_argument("--streams", type=int, default=1, help="TCP connections per ring link")
    ap.add_argument("--wire-dtype", default="float32", help="what FTAR frames carry (float32 or bfloat16)")
    ap.add_argument("--control", required=True, help="host:port (or unix:PATH) of the parent's control listener")
    args = ap.parse_args(argv)
    chan = _Channel(args.control)
    settings = dict(
        host=args.host,
        timeout_s=args.timeout,
        chunk_bytes=args.chunk_bytes,
        checksum=args.checksum,
        shared_memory=not args.no_shared_memory,
    )
    # endpoints by name: "" is the one of the command line; the benchmark adds one per setting it
    # compares ("endpoint" op), so that its rounds interleave them all under the same load
    eps = {"": FTAREndpoint(args.token, **settings, streams=args.streams, wire_dtype=args.wire_dtype)}
    raw = _RawTCP(args.host, args.timeout)
    chan.emit({"address": eps[""].address, "raw_address": raw.address, "pid": os.getpid()})
    for line in chan.lines:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "allreduce":
            chan.emit(_allreduce(eps, cmd, chan))
        elif op == "endpoint":
            ep = FTAREndpoint(args.token, **settings, streams=cmd["streams"], wire_dtype=cmd["wire_dtype"])
            eps[cmd["name"]] = ep
            chan.emit({"ok": True, "address": ep.address})
        elif op == "raw":
            keys = ("send_to", "receive", "nbytes", "chunk", "spread", "streams")
            chan.emit(raw.transfer(**{k: cmd[k] for k in keys if k in cmd}))
        elif op == "exit":
            break
        else:
            chan.emit({"ok": False, "error": f"unknown op {op!r}"})
    for ep in eps.values():
        ep.close()
    return 0


# --- the parent's side -------------------------------------------------------------------------
class MemberClient:
    """The parent's handle on one member process: its address, pid, and a JSON-lines channel.
    Replies are read by a thread so that every wait has a timeout."""

    def __init__(
        self,
        proc: subprocess.Popen,
        conn: socket.socket,
        hello: dict[str, Any],
        lines: queue.Queue[dict[str, Any] | None],
    ) -> None:
        self.proc, self._conn, self._lines = proc, conn, lines
        self.address: str = hello["address"]
        self.raw_address: str = hello["raw_address"]  # plain TCP listener, for the yardsticks
        self.pid: int = hello["pid"]

    def send(self, **cmd: Any) -> None:
        self._conn.sendall((json.dumps(cmd) + "\n").encode())

    def reply(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """The next line the member sends (TimeoutError if none within ``timeout_s``)."""
        try:
            msg = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"member {self.pid}: no reply within {timeout_s} s") from None
        if msg is None:
            raise EOFError(f"member {self.pid} closed its channel (exit code {self.proc.poll()})")
        return msg

    def result(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """The next reply that is not an event line."""
        while "event" in (msg := self.reply(timeout_s)):
            pass
        return msg


def _read_lines(conn: socket.socket, lines: queue.Queue[dict[str, Any] | None]) -> None:
    try:
        for line in conn.makefile("r"):
            lines.put(json.loads(line))
    except OSError:
        pass
    lines.put(None)


def start_members(
    group,
    count: int,
    token: str,
    *,
    timeout_s: float = 30.0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    checksum: bool = False,
    shared_memory: bool = True,
    streams: int = 1,
    wire_dtype: str = "float32",
    start_timeout_s: float = 60.0,
    cluster=None,
    hosts: list[str] | None = None,
) -> list[MemberClient]:
    """Start ``count`` member processes in ``group`` (a :class:`ftjax.base.procs.ProcessGroup`, which
    kills them on close). Each dials back a control channel to this process; returned in start order.

    With ``cluster`` (a :class:`ftjax.launch.vcluster.VirtualCluster`) member i runs on virtual host
    ``hosts[i]`` and listens on its address; the control channel is then a Unix socket in the
    cluster's state dir (a path reaches across network namespaces; this process's loopback does not)."""
    if cluster is None:
        control = socket.create_server(("127.0.0.1", 0))
        where = f"127.0.0.1:{control.getsockname()[1]}"
    else:
        path = cluster.state_dir / f"control-{os.getpid()}-{len(os.listdir(cluster.state_dir))}.sock"
        control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        control.bind(str(path))
        control.listen(count)
        where = f"unix:{path}"
    control.settimeout(start_timeout_s)
    args = [
        "-m",
        "ftjax_bench.ftar_member",
        "--token",
        token,
        "--timeout",
        str(timeout_s),
        "--chunk-bytes",
        str(chunk_bytes),
        "--control",
        where,
        "--streams",
        str(streams),
        "--wire-dtype",
        wire_dtype,
    ]
    if checksum:
        args.append("--checksum")
    if not shared_memory:
        args.append("--no-shared-memory")
    if cluster is None:
        procs = [group.python(*args) for _ in range(count)]
    else:
        procs = [
            group.start(cluster.command(h, [sys.executable, *args, "--host", cluster.address(h)]))
            for h in hosts[:count]
        ]
    by_pid: dict[int, MemberClient] = {}
    with control:
        while len(by_pid) < count:
            conn, _ = control.accept()
            conn.settimeout(None)
            lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
            threading.Thread(target=_read_lines, args=(conn, lines), daemon=True).start()
            try:
                hello = lines.get(timeout=start_timeout_s)
            except queue.Empty:
                raise TimeoutError("a member connected but sent no hello") from None
            if hello is None:
                raise EOFError("a member closed its control channel before its hello")
            proc = next(p for p in procs if p.pid == hello["pid"])
            by_pid[proc.pid] = MemberClient(proc, conn, hello, lines)
    return [by_pid[p.pid] for p in procs]


if __name__ == "__main__":
    sys.exit(main())
