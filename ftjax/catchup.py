"""Non-blocking peer catch-up: a live replica serves its state to a restarted one.

Source side (`SnapshotServer`): when a quorum names this replica as the heal source of a peer, the
replica snapshots the state it holds at that step with orbax's async checkpointer. Only the
device-to-host copy blocks (after it, the train step may donate the state's buffers); the write to
a local directory and the transfer run in the background. The snapshot directory is served over
HTTP (a stream of files, sent with zero-copy sendfile), only to requests carrying the job token, and only while the quorum still
lists that peer as healing (`keep_only` drops the others and deletes their files).

Newcomer side (`SnapshotFetch`): a background thread downloads the snapshot into a local
directory; `restore_snapshot` reads it with orbax into the newcomer's own mesh and shardings
(orbax reshards, so the newcomer's device count may differ). Meanwhile the newcomer keeps taking
part in FTAR with zero gradients; the step protocol keeps what it receives and replays it on install.

Why orbax + HTTP: orbax owns the serialization and resharding of sharded arrays; what no library
does is the peer-to-peer transport and its lifetime rules, which are here.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import http.client
import json
import shutil
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, quote, urlparse

from ftjax import net
from ftjax.coordinator.http import IDLE_TIMEOUT_S, MAX_CONNECTIONS, BoundedHTTPServer
from ftjax.coordinator.quorum import split_address

TOKEN_HEADER = "X-Ftjax-Token"
_CHUNK = 4 << 20


def _checkpointer():
    import orbax.checkpoint as ocp

    return ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler())


@dataclass
class _Snapshot:
    key: str
    step: int
    meta: dict
    path: Path
    checkpointer: Any
    ready: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    nbytes: int = 0


class SnapshotServer:
    """Serves orbax snapshots of this replica's state to healing peers (one server per replica)."""

    def __init__(self, token: str, workdir: str | Path, *, host: str = "127.0.0.1", port: int = 0,
                 advertise: str | None = None, serve: bool = True, rate_limit_mbps: float | None = None,
                 wait_offer_s: float = 30.0,
                 idle_timeout_s: float = IDLE_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS):
        self.token = token
        self.workdir = Path(workdir).absolute()
        self.rate_limit_mbps = rate_limit_mbps
        self.wait_offer_s = wait_offer_s
        self._snapshots: dict[str, _Snapshot] = {}
        self._refresh: dict[str, int] = {}  # key -> min step a fetcher asked for
        self._cv = threading.Condition()
        self._httpd = None
        self._advertise = net.advertised(host, advertise)
        if serve:  # only a replica's leader serves; every host takes part in the orbax save
            # Idle connections time out and surplus ones are refused (a peer stalled or flooding
            # the port cannot pin threads in the training process); a slow transfer that keeps
            # moving, and the wait for an offer, are not cut.
            self._httpd = BoundedHTTPServer((host, port), self._handler(), idle_timeout_s=idle_timeout_s,
                                            max_connections=max_connections)
            threading.Thread(target=self._httpd.serve_forever, name="snapshot-server", daemon=True).start()

    @property
    def address(self) -> str:
        """Where healing peers fetch from: the advertised host and the bound port."""
        return net.format_address(self._advertise, self._httpd.server_address[1])

    # --- source side, called from the training loop -------------------------------------------
    def offer(self, key: str, state: Any, step: int, meta: dict) -> None:
        """Snapshot `state` (at `step`) for peer `key`. Returns once the state is copied to host."""
        import jax

        path = self.workdir / f"{_safe(key)}-step{step}"
        if jax.process_index() == 0 and path.exists():
            shutil.rmtree(path)
        ckptr = _checkpointer()
        import orbax.checkpoint as ocp

        ckptr.save(path, args=ocp.args.StandardSave(state))  # blocks for the device->host copy only
        snap = _Snapshot(key, step, dict(meta), path, ckptr)
        threading.Thread(target=self._finish, args=(snap,), name="snapshot-write", daemon=True).start()
        with self._cv:
            old = self._snapshots.pop(key, None)
            self._snapshots[key] = snap
            self._refresh.pop(key, None)
            self._cv.notify_all()
        if old is not None:
            self._drop(old)

    def _finish(self, snap: _Snapshot) -> None:
        try:
            snap.checkpointer.wait_until_finished()
            snap.nbytes = sum(f.stat().st_size for f in snap.path.rglob("*") if f.is_file())
        except Exception as e:  # noqa: BLE001 - reported to the fetcher, which asks another source
            snap.error = f"{type(e).__name__}: {e}"
        snap.ready.set()

    def offered(self, key: str) -> bool:
        with self._cv:
            return key in self._snapshots and key not in self._refresh

    def keep_only(self, keys: set[str]) -> None:
        """Drop (and delete) every snapshot not for one of `keys`: its quorum no longer stands."""
        with self._cv:
            gone = [self._snapshots.pop(k) for k in list(self._snapshots) if k not in keys]
            for k in list(self._refresh):
                if k not in keys:
                    del self._refresh[k]
        for snap in gone:
            self._drop(snap)

    def _drop(self, snap: _Snapshot) -> None:
        def rm():
            snap.ready.wait(60)
            shutil.rmtree(snap.path, ignore_errors=True)

        threading.Thread(target=rm, daemon=True).start()

    def close(self) -> None:
        if self._httpd is not None:
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
                snap.ready.wait()
                if snap.error or not snap.path.exists():
                    return self.send_error(410, f"snapshot unavailable: {snap.error or 'withdrawn'}")
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("X-Ftjax-Step", str(snap.step))
                self.send_header("X-Ftjax-Meta", json.dumps(snap.meta))
                self.end_headers()
                _send_tree(self.connection, snap.path, server.rate_limit_mbps)

        return Handler


def _send_tree(sock, root: Path, mbps: float | None) -> int:
    """Stream every file under `root`: per file an 8-byte header length, a JSON header
    {path, size}, then the bytes (zero-copy `sendfile` unless a test caps the rate). An empty
    header ends the stream. Returns the bytes sent."""
    sent, t0 = 0, time.monotonic()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        size = f.stat().st_size
        header = json.dumps({"path": f.relative_to(root).as_posix(), "size": size}).encode()
        sock.sendall(len(header).to_bytes(8, "little") + header)
        with open(f, "rb") as fh:
            if mbps is None:
                sock.sendfile(fh)
                sent += size
                continue
            while chunk := fh.read(256 << 10):
                sock.sendall(chunk)
                sent += len(chunk)
                ahead = sent / (mbps * 1e6) - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)
    sock.sendall((0).to_bytes(8, "little"))
    return sent


def _recv_tree(resp, dest: Path) -> int:
    """The receiving end of `_send_tree`: files land under `dest` (paths may not leave it)."""
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    total = 0

    def read_exact(n: int) -> bytes:
        data = resp.read(n)
        if len(data) != n:
            raise ConnectionError(f"snapshot stream ended early ({len(data)} of {n} bytes)")
        return data

    while True:
        n = int.from_bytes(read_exact(8), "little")
        if n == 0:
            return total
        if n > 4096:
            raise ValueError(f"snapshot stream: file header of {n} bytes")
        header = json.loads(read_exact(n))
        rel, size = Path(header["path"]), int(header["size"])
        if rel.is_absolute() or ".." in rel.parts or size < 0:
            raise ValueError(f"snapshot stream: refused path {header['path']!r}")
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as out:
            left = size
            while left:
                got = resp.readinto(view[: min(left, _CHUNK)])
                if not got:
                    raise ConnectionError(f"snapshot stream ended inside {rel}")
                out.write(view[:got])
                left -= got
        total += size


@dataclass(frozen=True)
class FetchResult:
    path: Path
    step: int
    meta: dict
    nbytes: int
    seconds: float       # the transfer itself (first byte of the body to the last)
    source: str


class SnapshotFetch:
    """Downloads a peer's snapshot in a background thread (newcomer side, run by the leader)."""

    def __init__(self, address: str, key: str, token: str, dest: str | Path, *, source: str,
                 min_step: int = 0, timeout_s: float = 120.0):
        self.address, self.key, self.source = address, key, source
        self.result: FetchResult | None = None
        self.error: str | None = None
        self.done = threading.Event()
        self._args = (token, Path(dest).absolute(), min_step, timeout_s)
        threading.Thread(target=self._run, name="snapshot-fetch", daemon=True).start()

    def _run(self) -> None:
        token, dest, min_step, timeout_s = self._args
        try:
            if dest.exists():
                shutil.rmtree(dest)
            dest.mkdir(parents=True)
            host, port = split_address(self.address)
            conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
            conn.request("GET", f"/snapshot?key={quote(self.key)}&min_step={min_step}",
                         headers={TOKEN_HEADER: token})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"source {self.source} ({self.address}) answered {resp.status}: {resp.reason}")
            t0 = time.monotonic()
            nbytes = _recv_tree(resp, dest)
            conn.close()
            self.result = FetchResult(dest, int(resp.getheader("X-Ftjax-Step")),
                                      json.loads(resp.getheader("X-Ftjax-Meta") or "{}"), nbytes,
                                      time.monotonic() - t0, self.source)
        except Exception as e:  # noqa: BLE001 - the protocol asks the next quorum for another source
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.done.set()


def restore_snapshot(path: str | Path, abstract_state: Any) -> Any:
    """Read a fetched snapshot into `abstract_state`'s shardings (every host of the newcomer calls it)."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(Path(path).absolute(), abstract_state)


def snapshot_dir(configured: str | None, replica_out: str | Path) -> Path:
    """Where a replica writes the snapshots it serves and the ones it fetches.

    Snapshots are transient, so by default they live in RAM-backed /dev/shm (when writable): that
    spares the disk a write and a read on each side of a catch-up. The directory is a function of
    the replica's run directory, so every host of a replica, a restarted incarnation (which clears
    what a killed one left) and the launcher (which removes it at the end) agree on it."""
    out = Path(replica_out).absolute()
    if configured:
        base = Path(configured)
    elif os.access("/dev/shm", os.W_OK):
        base = Path("/dev/shm") / f"ftjax-{os.getuid()}"
    else:
        return out / "catchup"
    return base / hashlib.sha256(str(out).encode()).hexdigest()[:16]


def _safe(key: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in key)


class CatchupTransport(Protocol):
    """How a replica's state travels from a live source to a healing peer: what the step protocol
    needs of catch-up, and nothing about how. `OrbaxHTTPTransport` is the one implementation today
    (orbax snapshot, files sent over HTTP); a per-host network transfer can take its place."""

    address: str  # where healing peers reach this replica's source side (empty on non-leaders)

    def offer(self, key: str, state: Any, step: int, meta: dict) -> None: ...  # every host of the source
    def offered(self, key: str) -> bool: ...
    def keep_only(self, keys: set[str]) -> None: ...
    def fetch(self, address: str, key: str, *, source: str, min_step: int) -> "SnapshotFetch": ...  # leader
    def load(self, fetched: FetchResult, abstract_state: Any) -> Any: ...  # every host of the newcomer
    def discard(self, fetched: FetchResult) -> None: ...  # leader, once every host has loaded it
    def close(self) -> None: ...


class OrbaxHTTPTransport:
    """`SnapshotServer` + `SnapshotFetch` + `restore_snapshot`, in one snapshot directory per replica
    (see `snapshot_dir`): what a killed incarnation left there is cleared at start, all of it at close."""

    def __init__(self, token: str, directory: Path, *, leader: bool, rate_limit_mbps: float | None,
                 timeout_s: float, host: str = "127.0.0.1", advertise: str | None = None):
        self.token, self.directory, self.leader, self.timeout_s = token, directory, leader, timeout_s
        if leader:  # what a killed incarnation of this replica left behind (it may be in RAM)
            shutil.rmtree(directory, ignore_errors=True)
        self.server = SnapshotServer(token, directory / "served", serve=leader, host=host, advertise=advertise,
                                     rate_limit_mbps=rate_limit_mbps)
        self.address = self.server.address if leader else ""
        self._fetches = 0

    def offer(self, key: str, state: Any, step: int, meta: dict) -> None:
        self.server.offer(key, state, step, meta)

    def offered(self, key: str) -> bool:
        return self.server.offered(key)

    def keep_only(self, keys: set[str]) -> None:
        self.server.keep_only(keys)

    def fetch(self, address: str, key: str, *, source: str, min_step: int) -> SnapshotFetch:
        self._fetches += 1
        return SnapshotFetch(address, key, self.token, self.directory / f"fetch{self._fetches}", source=source,
                             min_step=min_step, timeout_s=self.timeout_s)

    def load(self, fetched: FetchResult, abstract_state: Any) -> Any:
        return restore_snapshot(fetched.path, abstract_state)

    def discard(self, fetched: FetchResult) -> None:
        shutil.rmtree(fetched.path, ignore_errors=True)

    def close(self) -> None:
        self.server.close()
        if self.leader:
            shutil.rmtree(self.directory, ignore_errors=True)
