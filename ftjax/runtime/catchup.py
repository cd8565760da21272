"""Non-blocking peer catch-up, host by host: a live replica serves its state to a restarted one.

Source side (`SnapshotServer`, on every host of a replica): when a quorum names this replica as the
heal source of a peer, each host copies the shards of the state that it holds to host memory
(`HostShards.take`). Only that copy blocks the step (after it, the train step may donate the
state's buffers). Each host serves its copy over HTTP, only to requests that carry the job token,
and only while the quorum still lists that peer as healing (`keep_only` drops the others).

Newcomer side (`SnapshotFetch`, on every host of the healing replica): in a background thread, host
h downloads the shards of the source's hosts that hold its own (`source_hosts`: host h of the same
degree; both hosts of a full source for the one host of a reduced-degree newcomer).
`HostShards.to_state` then places them on this host's devices in the newcomer's own shardings. When
a region that the newcomer needs is not one of the source's shards, it is assembled from the pieces
that cover it. A single-host source holds every region, so the newcomer's device count may differ.
Meanwhile the newcomer keeps taking part in FTAR with zero gradients, and the step protocol keeps
what it receives and replays it on install.

No directory is shared and nothing is written to disk: hosts of a cluster share nothing but the
network (docs/design/recovery.md, "Catch-up"). That is why catch-up does not use orbax, which the durable
checkpoints use: orbax's multi-host save writes one checkpoint from every process into one directory
and has process 0 commit it, which needs a file system that all hosts of a replica share. What no
library does here is the peer-to-peer transport, its layout matching and its lifetime rules.
(`jax.experimental.transfer` moves arrays between processes, but it is experimental and does not
authenticate.)
"""

from __future__ import annotations

import contextlib
import hmac
import http.client
import json
import math
import mmap
import os
import ssl
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Protocol
from urllib.parse import parse_qs, quote, urlparse

import numpy as np

from ftjax.base import net
from ftjax.base.http import HEADER_TIMEOUT_S, IDLE_TIMEOUT_S, MAX_CONNECTIONS, MAX_PENDING, BoundedHTTPServer
from ftjax.base.net import split_address
from ftjax.base.tls import TLS
from ftjax.base.trees import PyTree
from ftjax.runtime.regions import HOST_ALIGN, LayoutMismatch, Piece, Region, assemble, region_of, size

TOKEN_HEADER = "X-Ftjax-Token"
_CHUNK = 4 << 20  # one sendall / readinto
_SLOW_CHUNK = 256 << 10  # one sendall under a rate limit (a test's slow link)
_MAX_MANIFEST = 256 << 20  # a manifest lists every piece of a host's shards: far less
_MIN_RANGE, _MAX_RANGE = 4 << 20, 64 << 20  # bytes of one request


@dataclass
class HostShards:
    """The distinct shards of a state that one host holds, in host memory."""

    leaves: dict[str, tuple[tuple[int, ...], str]]  # leaf path -> (global shape, dtype name)
    pieces: list[Piece]

    @property
    def nbytes(self) -> int:
        return sum(p.data.nbytes for p in self.pieces)

    def views(self, offset: int, length: int):
        """The bytes [offset, offset + length) of the pieces laid one after the other (a snapshot's
        body), as memoryviews of the pieces themselves: sent from and received into in place."""
        start = 0
        for p in self.pieces:
            data = p.data.reshape(-1).view(np.uint8).data
            lo, hi = max(offset, start), min(offset + length, start + len(data))
            if lo < hi:
                yield data[lo - start : hi - start]
            start += len(data)

    @classmethod
    def take(cls, state: PyTree) -> HostShards:
        """Copy this host's shards of `state` to host memory; a replicated shard is copied once."""
        import jax

        leaves, pending = {}, []
        for path, arr in jax.tree_util.tree_flatten_with_path(state)[0]:
            name = jax.tree_util.keystr(path)
            leaves[name] = (tuple(arr.shape), arr.dtype.name)
            seen: set[Region] = set()
            for shard in arr.addressable_shards:
                region = region_of(shard.index, arr.shape)
                if region not in seen:
                    seen.add(region)
                    pending.append((name, region, shard.data))
        for _, _, data in pending:  # every copy in flight at once, then wait for each
            data.copy_to_host_async()
        # An owned copy: the snapshot outlives the state, whose buffers the next step donates.
        return cls(leaves, [Piece(n, r, np.array(d, copy=True, order="C")) for n, r, d in pending])

    def to_state(self, abstract_state: PyTree) -> PyTree:
        """These shards as arrays on this host's devices, in `abstract_state`'s shapes, dtypes and
        shardings. Raises LayoutMismatch naming the leaf if they do not make that state."""
        import jax
        import jax.numpy as jnp

        flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
        names = [jax.tree_util.keystr(path) for path, _ in flat]
        if set(names) != set(self.leaves):
            extra, missing = sorted(set(self.leaves) - set(names)), sorted(set(names) - set(self.leaves))
            raise LayoutMismatch(f"the source's state has other leaves: missing {missing[:3]}, unknown {extra[:3]}")
        by_leaf: dict[str, list[Piece]] = defaultdict(list)
        for p in self.pieces:
            by_leaf[p.leaf].append(p)
        arrays = []
        for name, (_, a) in zip(names, flat):
            if self.leaves[name] != (tuple(a.shape), jnp.dtype(a.dtype).name):
                raise LayoutMismatch(
                    f"{name}: the source has shape/dtype {self.leaves[name]}, "
                    f"this replica {(tuple(a.shape), jnp.dtype(a.dtype).name)}"
                )
            on_devices = [
                jax.device_put(
                    assemble(by_leaf[name], region_of(index, a.shape), a.dtype, name, "the source's hosts"), device
                )
                for device, index in a.sharding.addressable_devices_indices_map(a.shape).items()
            ]
            arrays.append(jax.make_array_from_single_device_arrays(a.shape, a.sharding, on_devices))
        return jax.tree_util.tree_unflatten(treedef, arrays)


@dataclass
class _Snapshot:
    key: str
    step: int
    meta: dict
    shards: HostShards

    def manifest(self) -> dict:
        """What a fetcher allocates from: the step, the meta, and every piece's leaf, shape, dtype and
        region, in the order of the body (the pieces' bytes one after the other)."""
        pieces = []
        for p in self.shards.pieces:
            shape, dtype = self.shards.leaves[p.leaf]
            pieces.append({"leaf": p.leaf, "shape": list(shape), "dtype": dtype, "region": [list(r) for r in p.region]})
        return {"step": self.step, "meta": self.meta, "pieces": pieces}


class _Bucket:
    """One token bucket for every stream of a server: the rate limit holds for their sum, so
    parallel streams cannot take more of the link than one did (catch-up never starves FTAR)."""

    def __init__(self, mbps: float):
        self.rate, self.burst = mbps * 1e6, float(_SLOW_CHUNK)
        self._tokens, self._t = 0.0, time.monotonic()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._t) * self.rate) - n
            self._t = now
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:  # outside the lock: every stream's debt is counted before any sleeps
            time.sleep(wait)


@dataclass
class _Lease:
    """A snapshot that a fetch is downloading: it outlives `keep_only` and a fresher offer until
    every byte was sent, or nothing asked for it for `wait_offer_s` (the fetcher is gone)."""

    snap: _Snapshot
    total: int
    sent: int = 0
    active: int = 0
    touched: float = field(default_factory=time.monotonic)


class SnapshotServer:
    """Serves this host's shards of a snapshot to the same host of a healing peer (one per host).

    Two requests, each with the job token: `/snapshot/manifest?key=&min_step=` (waits for the offer;
    the step, the meta and the pieces' layout, as JSON) and `/snapshot/range?key=&step=&offset=&length=`
    (that byte range of the body: the pieces' bytes one after the other). A fetch asks for several
    ranges at once, over as many connections (`SnapshotFetch`, `streams`)."""

    def __init__(
        self,
        token: str,
        *,
        listen: net.Listen | None = None,
        rate_limit_mbps: float | None = None,
        wait_offer_s: float = 30.0,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
        header_timeout_s: float = HEADER_TIMEOUT_S,
        max_pending: int = MAX_PENDING,
        ssl_context: ssl.SSLContext | None = None,
    ):
        self.token = token
        self.rate_limit_mbps = rate_limit_mbps
        self.wait_offer_s = wait_offer_s
        self._snapshots: dict[str, _Snapshot] = {}
        self._refresh: dict[str, int] = {}  # key -> min step a fetcher asked for
        self._leases: dict[tuple[str, int], _Lease] = {}
        self._bucket: _Bucket | None = None
        self._cv = threading.Condition()
        listen = listen or net.Listen()  # default: loopback, a port the OS picks
        self._advertise = listen.advertised_host()
        # Idle and slow connections time out and surplus ones are refused (a peer stalled, dripping
        # or flooding the port cannot pin threads in the training process); a slow transfer that
        # keeps moving, and the wait for an offer, are not cut.
        self._httpd = BoundedHTTPServer(
            (listen.host, listen.port),
            self._handler(),
            idle_timeout_s=idle_timeout_s,
            max_connections=max_connections,
            header_timeout_s=header_timeout_s,
            max_pending=max_pending,
            ssl_context=ssl_context,
        )
        threading.Thread(target=self._httpd.serve_forever, name="snapshot-server", daemon=True).start()

    @property
    def address(self) -> str:
        """Where the healing peer's host fetches from: the advertised host and the bound port."""
        return net.format_address(self._advertise, self._httpd.server_address[1])

    # --- source side, called from the training loop -------------------------------------------
    def offer(self, key: str, state: PyTree, step: int, meta: dict) -> None:
        """Snapshot this host's part of `state` (at `step`) for peer `key`; returns once it is in host memory."""
        self.publish(_Snapshot(key, step, dict(meta), HostShards.take(state)))

    def publish(self, snap: _Snapshot) -> None:
        with self._cv:
            self._snapshots[snap.key] = snap
            self._refresh.pop(snap.key, None)
            self._cv.notify_all()

    def offered(self, key: str) -> bool:
        with self._cv:
            return key in self._snapshots and key not in self._refresh

    def keep_only(self, keys: set[str]) -> None:
        """Drop every snapshot not for one of `keys`: its quorum no longer stands (a transfer in
        progress keeps its lease until it ends)."""
        with self._cv:
            for k in [k for k in self._snapshots if k not in keys]:
                del self._snapshots[k]
            for k in [k for k in self._refresh if k not in keys]:
                del self._refresh[k]

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self.keep_only(set())
        with self._cv:
            self._leases.clear()

    # --- HTTP ------------------------------------------------------------------------------------
    def _lookup(self, key: str, min_step: int) -> _Snapshot | None:
        """The offered snapshot for `key` of at least `min_step`, waited for; leased to the fetch."""
        deadline = time.monotonic() + self.wait_offer_s
        with self._cv:
            while True:
                snap = self._snapshots.get(key)
                if snap is not None and snap.step >= min_step:
                    self._leases.setdefault(
                        (key, snap.step), _Lease(snap, snap.shards.nbytes)
                    ).touched = time.monotonic()
                    return snap
                if snap is not None:
                    self._refresh[key] = min_step  # the training loop takes a fresher snapshot
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(min(left, 0.5))

    def _lease(self, key: str, step: int) -> _Lease | None:
        """The lease of a manifest served before, for one more range; expired ones are dropped."""
        now = time.monotonic()
        with self._cv:
            for k in [k for k, v in self._leases.items() if not v.active and now - v.touched > self.wait_offer_s]:
                del self._leases[k]
            lease = self._leases.get((key, step))
            if lease is not None:
                lease.active += 1
            return lease

    def _release(self, key: str, lease: _Lease, sent: int) -> None:
        with self._cv:
            lease.active, lease.sent, lease.touched = lease.active - 1, lease.sent + sent, time.monotonic()
            if lease.sent >= lease.total and not lease.active:
                self._leases.pop((key, lease.snap.step), None)

    def _throttle(self) -> _Bucket | None:
        """The shared bucket for the current rate limit (a test may change it on a live server)."""
        mbps = self.rate_limit_mbps
        if mbps is None:
            return None
        if self._bucket is None or self._bucket.rate != mbps * 1e6:
            self._bucket = _Bucket(mbps)
        return self._bucket

    def _send_range(self, sock, key: str, lease: _Lease, offset: int, length: int) -> None:
        sent, bucket = 0, self._throttle()
        step = _CHUNK if bucket is None else _SLOW_CHUNK  # one sendall must end within the idle timeout
        try:
            for view in lease.snap.shards.views(offset, length):
                for i in range(0, len(view), step):
                    chunk = view[i : i + step]
                    if bucket is not None:
                        bucket.take(len(chunk))
                    sock.sendall(chunk)
                    sent += len(chunk)
        finally:
            self._release(key, lease, sent)

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet: the step protocol logs transfers
                pass

            def do_GET(self):
                url = urlparse(self.path)
                if url.path not in ("/snapshot/manifest", "/snapshot/range"):
                    return self.send_error(404, "unknown path")
                token = self.headers.get(TOKEN_HEADER, "")
                if not hmac.compare_digest(token.encode(), server.token.encode()):
                    return self.send_error(401, "bad or missing job token")
                q = {k: v[0] for k, v in parse_qs(url.query).items()}
                try:
                    if url.path == "/snapshot/manifest":
                        return self._manifest(q.get("key", ""), int(q.get("min_step", "0")))
                    return self._range(q.get("key", ""), int(q["step"]), int(q["offset"]), int(q["length"]))
                except (KeyError, ValueError) as e:
                    return self.send_error(400, f"bad query: {type(e).__name__}: {e}")

            def _manifest(self, key: str, min_step: int) -> None:
                snap = server._lookup(key, min_step)
                if snap is None:
                    return self.send_error(404, f"no snapshot offered for {key!r} (quorum gone?)")
                self._reply(json.dumps(snap.manifest()).encode())

            def _range(self, key: str, step: int, offset: int, length: int) -> None:
                lease = server._lease(key, step)
                if lease is None:
                    return self.send_error(410, f"the snapshot of {key!r} at step {step} is no longer served")
                if not 0 <= offset <= offset + length <= lease.total:
                    server._release(key, lease, 0)
                    return self.send_error(416, f"range {offset}+{length} outside {lease.total} bytes")
                self._reply(None, length)
                server._send_range(self.connection, key, lease, offset, length)

            def _reply(self, body: bytes | None, length: int = 0) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream" if body is None else "application/json")
                self.send_header("Content-Length", str(length if body is None else len(body)))
                self.end_headers()
                if body is not None:
                    self.wfile.write(body)

        return Handler


class ReceiveArena:
    """Host memory that a newcomer's snapshot lands in, mapped before the transfer begins.

    A process that receives a snapshot into fresh memory takes a page fault for every 4 KiB it
    writes: 42,000 for `gpt_small`'s 173 MB, as much time as the bytes themselves at loopback speed
    (README, `bench catchup`). A replica therefore maps this arena while it starts (a background
    thread, `MAP_POPULATE`: the kernel faults every page in one call), beside its imports and
    compiles, and its first fetch lays the pieces out in it; a replica that turns out to need no
    catch-up drops it at its first committed step. One use: the arrays placed from it may alias it."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.seconds: float | None = None  # mapping and faulting it in (off the transfer's path)
        self._buffer: np.ndarray | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._map, name="catchup-arena", daemon=True).start()

    def _map(self) -> None:
        t0 = time.perf_counter()
        try:
            populate = getattr(mmap, "MAP_POPULATE", 0)  # (Linux only)
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate
            buffer = np.frombuffer(mmap.mmap(-1, max(self.nbytes, 1), flags=flags), np.uint8)
            if not populate:
                buffer[:: mmap.PAGESIZE] = 0  # (the kernel could not: one write per page)
            self._buffer = buffer
        except (OSError, ValueError, MemoryError):  # no arena: the fetch allocates as it did before
            self._buffer = None
        finally:
            self.seconds = time.perf_counter() - t0
            self._ready.set()

    def ready(self, timeout_s: float | None = None) -> bool:
        """Whether the mapping has finished (waiting up to `timeout_s` for it)."""
        return self._ready.wait(timeout_s)

    def take(self, timeout_s: float = 60.0) -> np.ndarray | None:
        """The mapped bytes (waiting for the mapping to finish), once; None after that."""
        self.ready(timeout_s)
        buffer, self._buffer = self._buffer, None
        return buffer

    @classmethod
    def for_state(cls, state: PyTree) -> ReceiveArena | None:
        """An arena for a snapshot of `state`'s layout on this host, or None if it would take more
        than a quarter of this host's free memory."""
        # as _Layout lays them out, and room for a source of up to 8x this replica's hosts, whose
        # pieces (smaller, each aligned) cut a leaf up to 8 times
        sizes = _shard_bytes(state)
        nbytes = sum(_aligned(n) for n in sizes) + 8 * HOST_ALIGN * len(sizes)
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            return None
        return cls(nbytes) if 0 < nbytes <= free // 4 else None


def _shard_bytes(state: PyTree) -> list[int]:
    """The bytes of each distinct shard of `state` (arrays or ShapeDtypeStructs with shardings) that
    this host holds: the pieces a snapshot for this host carries."""
    import jax

    sizes = []
    for a in jax.tree.leaves(state):
        regions = {region_of(i, a.shape) for i in a.sharding.addressable_devices_indices_map(a.shape).values()}
        sizes += [size(r) * np.dtype(a.dtype).itemsize for r in regions]
    return sizes


def _aligned(n: int) -> int:
    """n rounded up to where the next piece of a receive arena begins: aligned, a CPU device takes
    the piece without a copy."""
    return -(-n // HOST_ALIGN) * HOST_ALIGN


class _Layout:
    """Empty arrays for a snapshot's pieces: carved one after the other (each at a multiple of
    `HOST_ALIGN` bytes) out of an arena while it lasts, then each allocated on its own."""

    def __init__(self, arena: np.ndarray | None):
        self.arena, self.at, self.placed = arena, 0, 0  # (placed: the bytes of the pieces in the arena)

    def empty(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        n = math.prod(shape) * np.dtype(dtype).itemsize
        start = _aligned(self.at)
        if self.arena is None or start + n > len(self.arena):
            return np.empty(shape, dtype)
        self.at, self.placed = start + n, self.placed + n
        return self.arena[start : start + n].view(dtype).reshape(shape)


def _allocate(manifest: dict, layout: _Layout) -> HostShards:
    """Empty host buffers for the pieces of a manifest, each checked before anything is allocated;
    the ranges are then read straight into them."""
    import jax.numpy as jnp

    leaves: dict[str, tuple[tuple[int, ...], str]] = {}
    checked = []
    for h in manifest["pieces"]:
        leaf, shape, dtype = str(h["leaf"]), tuple(int(d) for d in h["shape"]), jnp.dtype(h["dtype"])
        region = tuple((int(a), int(b)) for a, b in h["region"])
        if len(region) != len(shape) or any(not 0 <= a <= b <= d for (a, b), d in zip(region, shape)):
            raise ValueError(f"snapshot manifest: {leaf}: region {list(region)} outside shape {list(shape)}")
        if leaves.setdefault(leaf, (shape, dtype.name)) != (shape, dtype.name):
            raise ValueError(f"snapshot manifest: {leaf}: pieces of different shapes or dtypes")
        checked.append((leaf, region, dtype))
    return HostShards(leaves, [Piece(leaf, r, layout.empty(tuple(b - a for a, b in r), d)) for leaf, r, d in checked])


def _ranges(sizes: list[int], streams: int) -> list[tuple[int, int, int]]:
    """(source index, offset, length) of every request: each source's body cut into ranges small
    enough that `streams` connections share it evenly, large enough that a request costs nothing."""
    total = sum(sizes)
    chunk = min(_MAX_RANGE, max(_MIN_RANGE, -(-total // (4 * streams))))
    return [(i, o, min(chunk, n - o)) for i, n in enumerate(sizes) for o in range(0, n, chunk)]


@dataclass(frozen=True)
class FetchResult:
    step: int
    meta: dict
    nbytes: int
    seconds: float  # the transfer itself (first range asked for to the last byte)
    source: str
    shards: HostShards = field(repr=False, compare=False)
    arena_bytes: int = 0  # of `nbytes`, those that landed in the receive arena mapped beforehand


def source_hosts(host: int, hosts: int, source_hosts: int) -> list[int]:
    """The hosts of a source replica of `source_hosts` hosts whose shards overlap those of host
    `host` of a replica of `hosts`: each host holds a contiguous 1/hosts of every sharded leaf
    (ftjax/program/sharding.py), so these are the source hosts whose slice meets this host's. A reduced
    newcomer's host fetches from several; a full newcomer from a reduced source shares one."""
    return [
        k
        for k in range(source_hosts)
        if host * source_hosts < (k + 1) * hosts and k * hosts < (host + 1) * source_hosts
    ]


class SnapshotFetch:
    """Downloads this host's part of a peer's snapshot in a background thread (newcomer side): the
    manifest of each of `addresses` (the source's hosts that hold this host's shards), then every
    byte range of their bodies over `streams` connections at once, straight into buffers laid out
    from the manifests (in `arena` while it lasts). `progress()` says how far it is."""

    def __init__(
        self,
        addresses: str | list[str],
        key: str,
        token: str,
        *,
        source: str | None = None,
        min_step: int = 0,
        timeout_s: float = 120.0,
        streams: int = 1,
        arena: ReceiveArena | None = None,
        tls: TLS | None = None,
    ):
        if streams < 1:
            raise ValueError(f"streams must be at least 1, not {streams}")
        self.addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        # the name errors give the source by: its replica id, else its addresses
        self.key, self.source, self.streams = key, source or ",".join(self.addresses), streams
        self.result: FetchResult | None = None
        self.error: str | None = None
        self.done = threading.Event()
        self.bytes_done, self.bytes_total = 0, 0
        self._t0: float | None = None
        self._lock = threading.Lock()
        self._args = (token, min_step, timeout_s)
        self._arena = arena
        self._tls = tls  # HTTPS, the source's certificate checked against tls.ca
        threading.Thread(target=self._run, name="snapshot-fetch", daemon=True).start()

    def progress(self) -> dict:
        """Bytes received of the total, and the time left at the rate so far (None before the first byte)."""
        done, total, t0 = self.bytes_done, self.bytes_total, self._t0
        rate = done / (time.monotonic() - t0) if t0 is not None and done else 0.0
        eta = (total - done) / rate if rate > 0 else None
        return {"bytes_done": done, "bytes_total": total, "eta_s": None if eta is None else round(eta, 1)}

    def _run(self) -> None:
        try:
            if not any(self.addresses):
                raise ValueError(f"source {self.source} gave no catch-up address for this host")
            manifests = [self._manifest(address) for address in self.addresses]
            steps = {m["step"] for m in manifests}
            if len(steps) > 1:
                raise RuntimeError(f"source {self.source}'s hosts served snapshots of different steps {sorted(steps)}")
            layout = _Layout(self._arena.take() if self._arena is not None else None)
            self._arena = None
            parts = [_allocate(m, layout) for m in manifests]
            self.bytes_total, self._t0 = sum(p.nbytes for p in parts), time.monotonic()
            self._download(parts, _ranges([p.nbytes for p in parts], self.streams), manifests[0]["step"])
            shards = HostShards(
                {k: v for p in parts for k, v in p.leaves.items()}, [x for p in parts for x in p.pieces]
            )
            seconds = time.monotonic() - self._t0
            self.result = FetchResult(
                manifests[0]["step"], manifests[0]["meta"], shards.nbytes, seconds, self.source, shards, layout.placed
            )
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.done.set()

    def _get(self, address: str, path: str) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        token, _, timeout_s = self._args
        if self._tls is None:
            conn = http.client.HTTPConnection(*split_address(address), timeout=timeout_s)
        else:
            conn = _HTTPSConnection(self._tls, *split_address(address), timeout=timeout_s)
        conn.request("GET", path, headers={TOKEN_HEADER: token})
        resp = conn.getresponse()
        if resp.status != 200:
            conn.close()
            raise RuntimeError(f"source {self.source} ({address}) answered {resp.status}: {resp.reason}")
        return conn, resp

    def _manifest(self, address: str) -> dict:
        _, min_step, _ = self._args
        conn, resp = self._get(address, f"/snapshot/manifest?key={quote(self.key)}&min_step={min_step}")
        with contextlib.closing(conn):
            n = int(resp.getheader("Content-Length") or 0)
            if n > _MAX_MANIFEST:
                raise ValueError(f"source {self.source} ({address}): a manifest of {n} bytes")
            return json.loads(resp.read(n))

    def _download(self, parts: list[HostShards], ranges: list[tuple[int, int, int]], step: int) -> None:
        """Every range, over `streams` threads that each take the next one; the first error stops
        them all (the others finish the range they are in) and is raised."""
        todo = list(reversed(ranges))
        errors: list[BaseException] = []

        def work() -> None:
            while not errors:
                with self._lock:
                    if not todo:
                        return
                    i, offset, length = todo.pop()
                try:
                    self._fetch_range(self.addresses[i], parts[i], step, offset, length)
                except Exception as e:
                    errors.append(e)

        threads = [threading.Thread(target=work, name="snapshot-stream", daemon=True) for _ in range(self.streams)]
        for t in threads[: len(ranges)]:
            t.start()
        for t in threads[: len(ranges)]:
            t.join()
        if errors:
            raise errors[0]

    def _fetch_range(self, address: str, part: HostShards, step: int, offset: int, length: int) -> None:
        path = f"/snapshot/range?key={quote(self.key)}&step={step}&offset={offset}&length={length}"
        conn, resp = self._get(address, path)
        with contextlib.closing(conn):
            for view in part.views(offset, length):
                got = 0
                while got < len(view):
                    k = resp.readinto(view[got : got + _CHUNK])
                    if not k:
                        raise ConnectionError(f"source {self.source} ({address}): range {offset}+{length} ended early")
                    got += k
                    with self._lock:
                        self.bytes_done += k


class _HTTPSConnection(http.client.HTTPSConnection):
    """HTTPS to a catch-up server, its certificate checked against the job's CA, for the name that
    `tls.server_name` gives, else the host dialed."""

    def __init__(self, tls: TLS, host: str, port: int, *, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout, context=tls.client_context())
        self._tls = tls

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        self.sock = self._tls.wrap_client(self.sock, self.host)


class CatchupTransport(Protocol):
    """How a replica's state travels from a live source to a healing peer, host by host: what the
    step protocol needs of catch-up, and nothing about how."""

    address: str  # where the same host of a healing peer reaches this host's source side

    def offer(self, key: str, state: PyTree, step: int, meta: dict) -> None: ...  # every host of the source
    def offered(self, key: str) -> bool: ...
    def keep_only(self, keys: set[str]) -> None: ...
    def fetch(self, addresses: list[str], key: str, *, source: str, min_step: int) -> SnapshotFetch: ...  # every host
    def load(self, fetched: FetchResult, abstract_state: PyTree) -> PyTree: ...  # every host of the newcomer
    def release(self) -> None: ...  # memory kept for a fetch: none is coming
    def close(self) -> None: ...


class ShardTransport:
    """`SnapshotServer` + `SnapshotFetch` + `HostShards.to_state`: each host sends the shards it
    holds to the same host of the peer, over the network, from memory to memory."""

    def __init__(
        self,
        token: str,
        *,
        rate_limit_mbps: float | None,
        timeout_s: float,
        host: str = "127.0.0.1",
        advertise: str | None = None,
        streams: int = 1,
        arena: ReceiveArena | None = None,
        tls: TLS | None = None,
    ):
        self.token, self.timeout_s, self.streams, self.tls = token, timeout_s, streams, tls
        self.server = SnapshotServer(
            token,
            listen=net.Listen(host, advertise=advertise),
            rate_limit_mbps=rate_limit_mbps,
            ssl_context=None if tls is None else tls.server_context(),
        )
        self.address = self.server.address
        self.arena = arena  # (the next fetch lands in it: see ReceiveArena)

    def release(self) -> None:
        """No catch-up is coming (the replica applied a step of its own): drop the arena."""
        self.arena = None

    def offer(self, key: str, state: PyTree, step: int, meta: dict) -> None:
        self.server.offer(key, state, step, meta)

    def offered(self, key: str) -> bool:
        return self.server.offered(key)

    def keep_only(self, keys: set[str]) -> None:
        self.server.keep_only(keys)

    def fetch(self, addresses: list[str], key: str, *, source: str, min_step: int) -> SnapshotFetch:
        arena, self.arena = self.arena, None
        return SnapshotFetch(
            addresses,
            key,
            self.token,
            source=source,
            min_step=min_step,
            timeout_s=self.timeout_s,
            streams=self.streams,
            arena=arena,
            tls=self.tls,
        )

    def load(self, fetched: FetchResult, abstract_state: PyTree) -> PyTree:
        return fetched.shards.to_state(abstract_state)

    def close(self) -> None:
        self.server.close()
