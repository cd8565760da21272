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
network (docs/design.md, "Catch-up"). That is why catch-up does not use orbax, which the durable
checkpoints use: orbax's multi-host save writes one checkpoint from every process into one directory
and has process 0 commit it, which needs a file system that all hosts of a replica share. What no
library does here is the peer-to-peer transport, its layout matching and its lifetime rules.
(`jax.experimental.transfer` moves arrays between processes, but it is experimental and does not
authenticate.)
"""

from __future__ import annotations

import hmac
import http.client
import json
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any, Protocol
from urllib.parse import parse_qs, quote, urlparse

import numpy as np

from ftjax.base import net
from ftjax.base.net import split_address
from ftjax.coordinator.http import IDLE_TIMEOUT_S, MAX_CONNECTIONS, BoundedHTTPServer
from ftjax.runtime.regions import LayoutMismatch, Piece, Region, assemble, region_of

TOKEN_HEADER = "X-Ftjax-Token"
_CHUNK = 4 << 20
_MAX_HEADER = 64 << 10


@dataclass
class HostShards:
    """The distinct shards of a state that one host holds, in host memory."""

    leaves: dict[str, tuple[tuple[int, ...], str]]  # leaf path -> (global shape, dtype name)
    pieces: list[Piece]

    @property
    def nbytes(self) -> int:
        return sum(p.data.nbytes for p in self.pieces)

    @classmethod
    def take(cls, state: Any) -> HostShards:
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

    def to_state(self, abstract_state: Any) -> Any:
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


class SnapshotServer:
    """Serves this host's shards of a snapshot to the same host of a healing peer (one per host)."""

    def __init__(
        self,
        token: str,
        *,
        listen: net.Listen | None = None,
        rate_limit_mbps: float | None = None,
        wait_offer_s: float = 30.0,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ):
        self.token = token
        self.rate_limit_mbps = rate_limit_mbps
        self.wait_offer_s = wait_offer_s
        self._snapshots: dict[str, _Snapshot] = {}
        self._refresh: dict[str, int] = {}  # key -> min step a fetcher asked for
        self._cv = threading.Condition()
        listen = listen or net.Listen()  # default: loopback, a port the OS picks
        self._advertise = listen.advertised_host()
        # Idle connections time out and surplus ones are refused (a peer stalled or flooding the
        # port cannot pin threads in the training process); a slow transfer that keeps moving, and
        # the wait for an offer, are not cut.
        self._httpd = BoundedHTTPServer(
            (listen.host, listen.port), self._handler(), idle_timeout_s=idle_timeout_s, max_connections=max_connections
        )
        threading.Thread(target=self._httpd.serve_forever, name="snapshot-server", daemon=True).start()

    @property
    def address(self) -> str:
        """Where the healing peer's host fetches from: the advertised host and the bound port."""
        return net.format_address(self._advertise, self._httpd.server_address[1])

    # --- source side, called from the training loop -------------------------------------------
    def offer(self, key: str, state: Any, step: int, meta: dict) -> None:
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
        progress keeps its own reference until it ends)."""
        with self._cv:
            for k in [k for k in self._snapshots if k not in keys]:
                del self._snapshots[k]
            for k in [k for k in self._refresh if k not in keys]:
                del self._refresh[k]

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self.keep_only(set())

    # --- HTTP ------------------------------------------------------------------------------------
    def _lookup(self, key: str, min_step: int) -> _Snapshot | None:
        deadline = time.monotonic() + self.wait_offer_s
        with self._cv:
            while True:
                snap = self._snapshots.get(key)
                if snap is not None and snap.step >= min_step:
                    return snap
                if snap is not None:
                    self._refresh[key] = min_step  # the training loop takes a fresher snapshot
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(min(left, 0.5))

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet: the step protocol logs transfers
                pass

            def do_GET(self):
                url = urlparse(self.path)
                if url.path != "/snapshot":
                    return self.send_error(404, "unknown path")
                token = self.headers.get(TOKEN_HEADER, "")
                if not hmac.compare_digest(token.encode(), server.token.encode()):
                    return self.send_error(401, "bad or missing job token")
                q = parse_qs(url.query)
                key = q.get("key", [""])[0]
                try:
                    min_step = int(q.get("min_step", ["0"])[0])
                except ValueError:
                    return self.send_error(400, "min_step: not an integer")
                snap = server._lookup(key, min_step)
                if snap is None:
                    return self.send_error(404, f"no snapshot offered for {key!r} (quorum gone?)")
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("X-Ftjax-Step", str(snap.step))
                self.send_header("X-Ftjax-Meta", json.dumps(snap.meta))
                self.end_headers()
                _send_shards(self.connection, snap.shards, server.rate_limit_mbps)

        return Handler


def _send_shards(sock, shards: HostShards, mbps: float | None) -> int:
    """Stream every piece: an 8-byte header length, a JSON header {leaf, shape, dtype, region},
    then the piece's bytes. An empty header ends the stream. Returns the bytes sent."""
    sent, t0 = 0, time.monotonic()
    for p in shards.pieces:
        shape, dtype = shards.leaves[p.leaf]
        header = json.dumps({"leaf": p.leaf, "shape": shape, "dtype": dtype, "region": p.region}).encode()
        sock.sendall(len(header).to_bytes(8, "little") + header)
        data = memoryview(p.data.reshape(-1).view(np.uint8))
        if mbps is None:
            sock.sendall(data)
            sent += len(data)
            continue
        for i in range(0, len(data), 256 << 10):  # a test's slow link
            chunk = data[i : i + (256 << 10)]
            sock.sendall(chunk)
            sent += len(chunk)
            ahead = sent / (mbps * 1e6) - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)
    sock.sendall((0).to_bytes(8, "little"))
    return sent


def _recv_shards(resp) -> HostShards:
    """The receiving end of `_send_shards`. Every header is checked before its bytes are read."""
    import jax.numpy as jnp

    leaves: dict[str, tuple[tuple[int, ...], str]] = {}
    pieces = []

    def read_exact(n: int) -> bytes:
        data = resp.read(n)
        if len(data) != n:
            raise ConnectionError(f"snapshot stream ended early ({len(data)} of {n} bytes)")
        return data

    while True:
        n = int.from_bytes(read_exact(8), "little")
        if n == 0:
            return HostShards(leaves, pieces)
        if n > _MAX_HEADER:
            raise ValueError(f"snapshot stream: piece header of {n} bytes")
        h = json.loads(read_exact(n))
        leaf, shape, dtype = str(h["leaf"]), tuple(int(d) for d in h["shape"]), jnp.dtype(h["dtype"])
        region = tuple((int(a), int(b)) for a, b in h["region"])
        if len(region) != len(shape) or any(not 0 <= a <= b <= d for (a, b), d in zip(region, shape)):
            raise ValueError(f"snapshot stream: {leaf}: region {list(region)} outside shape {list(shape)}")
        if leaves.setdefault(leaf, (shape, dtype.name)) != (shape, dtype.name):
            raise ValueError(f"snapshot stream: {leaf}: pieces of different shapes or dtypes")
        data = np.empty([b - a for a, b in region], dtype)
        view = memoryview(data.reshape(-1).view(np.uint8))
        got = 0
        while got < len(view):
            k = resp.readinto(view[got : got + _CHUNK])
            if not k:
                raise ConnectionError(f"snapshot stream ended inside {leaf}")
            got += k
        pieces.append(Piece(leaf, region, data))


@dataclass(frozen=True)
class FetchResult:
    step: int
    meta: dict
    nbytes: int
    seconds: float  # the transfer itself (first byte of the body to the last)
    source: str
    shards: HostShards = field(repr=False, compare=False)


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
    """Downloads this host's part of a peer's snapshot in a background thread (newcomer side): from
    each of `addresses` in turn (the source's hosts that hold this host's shards), into one result."""

    def __init__(
        self,
        addresses: str | list[str],
        key: str,
        token: str,
        *,
        source: str,
        min_step: int = 0,
        timeout_s: float = 120.0,
    ):
        self.addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        self.key, self.source = key, source
        self.result: FetchResult | None = None
        self.error: str | None = None
        self.done = threading.Event()
        self._args = (token, min_step, timeout_s)
        threading.Thread(target=self._run, name="snapshot-fetch", daemon=True).start()

    def _run(self) -> None:
        try:
            if not any(self.addresses):
                raise ValueError(f"source {self.source} gave no catch-up address for this host")
            parts = [self._one(address) for address in self.addresses]
            steps = {step for step, *_ in parts}
            if len(steps) > 1:
                raise RuntimeError(f"source {self.source}'s hosts served snapshots of different steps {sorted(steps)}")
            shards = HostShards(
                {k: v for *_, sh, _ in parts for k, v in sh.leaves.items()},
                [p for *_, sh, _ in parts for p in sh.pieces],
            )
            self.result = FetchResult(
                parts[0][0], parts[0][1], shards.nbytes, sum(t for *_, t in parts), self.source, shards
            )
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.done.set()

    def _one(self, address: str) -> tuple[int, dict, HostShards, float]:
        token, min_step, timeout_s = self._args
        host, port = split_address(address)
        conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
        conn.request("GET", f"/snapshot?key={quote(self.key)}&min_step={min_step}", headers={TOKEN_HEADER: token})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"source {self.source} ({address}) answered {resp.status}: {resp.reason}")
        t0 = time.monotonic()
        shards = _recv_shards(resp)
        conn.close()
        return (
            int(resp.getheader("X-Ftjax-Step")),
            json.loads(resp.getheader("X-Ftjax-Meta") or "{}"),
            shards,
            time.monotonic() - t0,
        )


class CatchupTransport(Protocol):
    """How a replica's state travels from a live source to a healing peer, host by host: what the
    step protocol needs of catch-up, and nothing about how."""

    address: str  # where the same host of a healing peer reaches this host's source side

    def offer(self, key: str, state: Any, step: int, meta: dict) -> None: ...  # every host of the source
    def offered(self, key: str) -> bool: ...
    def keep_only(self, keys: set[str]) -> None: ...
    def fetch(self, addresses: list[str], key: str, *, source: str, min_step: int) -> SnapshotFetch: ...  # every host
    def load(self, fetched: FetchResult, abstract_state: Any) -> Any: ...  # every host of the newcomer
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
    ):
        self.token, self.timeout_s = token, timeout_s
        self.server = SnapshotServer(
            token, listen=net.Listen(host, advertise=advertise), rate_limit_mbps=rate_limit_mbps
        )
        self.address = self.server.address

    def offer(self, key: str, state: Any, step: int, meta: dict) -> None:
        self.server.offer(key, state, step, meta)

    def offered(self, key: str) -> bool:
        return self.server.offered(key)

    def keep_only(self, keys: set[str]) -> None:
        self.server.keep_only(keys)

    def fetch(self, addresses: list[str], key: str, *, source: str, min_step: int) -> SnapshotFetch:
        return SnapshotFetch(addresses, key, self.token, source=source, min_step=min_step, timeout_s=self.timeout_s)

    def load(self, fetched: FetchResult, abstract_state: Any) -> Any:
        return fetched.shards.to_state(abstract_state)

    def close(self) -> None:
        self.server.close()
