"""What FTAR puts on the wire: the data frame header, the handshake that opens a connection, and
the socket helpers that move whole buffers without copying them in Python.

A frame is a fixed 44-byte header followed by the payload (a chunk of the buffer: raw floats in
host byte order, little-endian wherever JAX runs). The header carries everything a receiver needs
to refuse a frame that is not the one it expects (another quorum, another step, another member
list, a truncated or garbled stream), so that a call either sums the right data or raises: never
silently wrong.

Every connection opens with a hello from the dialer: its kind (a ring link, or an abort notice),
quorum id, the dialer's address and an HMAC-SHA256 keyed with the job token, so a process of
another job (or a stray scanner) is refused without the token ever crossing the wire.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import zlib
from dataclasses import dataclass

from ftjax.base.net import split_address

VERSION = 3  # 2: a ring hello is followed by a shared-memory offer (see shm.py); 3: hellos name a stream

# --- data frames -------------------------------------------------------------------------------
FRAME_MAGIC = b"FTRF"
# magic, version, phase, flags, (pad), quorum_id, step, seq, meta, payload length, crc32
FRAME = struct.Struct("<4sBBBxqqIIQI")
FLAG_CRC = 1
FLAG_SHM = 2  # the payload is in the link's shared-memory slot, not on the socket
PHASE_REDUCE_SCATTER = 0
PHASE_ALL_GATHER = 1


class WireError(ValueError):
    """A frame or hello that does not parse or does not match what the receiver expects."""


def call_fingerprint(
    n: int,
    dtype,
    chunk_elems: int,
    members: list[str],
    contributors: list[bool],
    divisor: int,
    wire_dtype: str = "float32",
    streams: int = 1,
) -> int:
    """32-bit digest of what every member of a call must agree on; carried in every frame. The wire
    dtype and the streams per link are in it: a member that frames or spreads chunks differently
    would otherwise be read as garbage (or waited for on a connection it never opens)."""
    key = (n, str(dtype), chunk_elems, list(members), [bool(c) for c in contributors], int(divisor))
    return zlib.crc32(repr(key + (str(wire_dtype), int(streams))).encode())


def pack_frame(
    *,
    quorum_id: int,
    step: int,
    phase: int,
    seq: int,
    meta: int,
    payload: memoryview,
    checksum: bool,
    shm: bool = False,
) -> bytes:
    """The header for ``payload`` (a byte-format memoryview; with ``shm``, the slot it was written to)."""
    crc = zlib.crc32(payload) if checksum else 0
    flags = (FLAG_CRC if checksum else 0) | (FLAG_SHM if shm else 0)
    return FRAME.pack(FRAME_MAGIC, VERSION, phase, flags, quorum_id, step, seq, meta, payload.nbytes, crc)


def check_frame(
    header: memoryview,
    payload: memoryview,
    *,
    quorum_id: int,
    step: int,
    phase: int,
    seq: int,
    meta: int,
    require_checksum: bool,
    shm: bool = False,
) -> None:
    """Raise WireError naming the first field of ``header`` that differs from what this call expects.

    ``payload`` has already been received (into its destination) when this runs; a mismatch makes
    the caller abort the call, so the bytes are never used.
    """
    magic, version, f_phase, flags, f_quorum, f_step, f_seq, f_meta, length, crc = FRAME.unpack(header)
    expected = (
        ("magic", magic, FRAME_MAGIC),
        ("version", version, VERSION),
        ("quorum_id", f_quorum, quorum_id),
        ("step", f_step, step),
        ("phase", f_phase, phase),
        ("sequence", f_seq, seq),
        ("call fingerprint (members, contributors, length, dtype, chunk size, wire dtype, streams)", f_meta, meta),
        ("payload length", length, payload.nbytes),
        ("payload place (shared memory)", bool(flags & FLAG_SHM), shm),
    )
    for field, got, want in expected:
        if got != want:
            raise WireError(f"frame {field} is {got!r}, expected {want!r}")
    if flags & FLAG_CRC:
        if zlib.crc32(payload) != crc:
            raise WireError(f"frame sequence {seq}: payload checksum mismatch (garbled data)")
    elif require_checksum:
        raise WireError(f"frame sequence {seq} carries no checksum, and this endpoint requires one")


# --- handshake ---------------------------------------------------------------------------------
HELLO_MAGIC = b"FTAH"
# magic, version, kind, address length, suspect length, quorum_id, step, reason, stream
HELLO = struct.Struct("<4sBBHHqqBB")
MAC_BYTES = 32
MAX_ADDRESS = 255
MAX_STREAMS = 64  # TCP connections per ring link (ft.link_streams); a hello names one of them
KIND_RING = 1  # a ring link: the dialer will send frames, the listener receives them
KIND_NOTICE = 2  # an abort notice: "I abandoned (quorum, step) because of <suspect>"
REASONS = ("failed", "timeout", "protocol", "refused")

# one-byte answer of the listener to a ring hello
STATUS_OK = 0
STATUS_BAD_TOKEN = 1
STATUS_STALE_QUORUM = 2
STATUS_BAD_MESSAGE = 3
STATUS_TEXT = {
    STATUS_BAD_TOKEN: "wrong job token",
    STATUS_STALE_QUORUM: "stale quorum id",
    STATUS_BAD_MESSAGE: "malformed hello",
}


@dataclass(frozen=True)
class Hello:
    kind: int
    quorum_id: int
    address: str  # the dialer's listening address ("host:port"), authenticated by the MAC
    step: int = 0
    suspect: str = ""  # notices only: the peer the dialer blames
    reason: str = "failed"  # notices only: one of REASONS
    stream: int = 0  # ring links only: which of the link's connections this is (frame seq % streams)


def _mac(token: bytes, body: bytes) -> bytes:
    return hmac.new(token, body, hashlib.sha256).digest()


def encode_hello(token: bytes, hello: Hello) -> bytes:
    """The bytes a dialer sends first: header, addresses, then the MAC over all of them."""
    addr, suspect = hello.address.encode(), hello.suspect.encode()
    if len(addr) > MAX_ADDRESS or len(suspect) > MAX_ADDRESS:
        raise ValueError("address longer than 255 bytes")
    if not 0 <= hello.stream < MAX_STREAMS:
        raise ValueError(f"stream {hello.stream} out of range (0..{MAX_STREAMS - 1})")
    body = (
        HELLO.pack(
            HELLO_MAGIC,
            VERSION,
            hello.kind,
            len(addr),
            len(suspect),
            hello.quorum_id,
            hello.step,
            REASONS.index(hello.reason),
            hello.stream,
        )
        + addr
        + suspect
    )
    return body + _mac(token, body)


class HelloRefused(WireError):
    """A hello the listener must refuse; ``status`` is the answer byte to send back."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def read_hello(sock: socket.socket, token: bytes) -> Hello:
    """Read and authenticate a hello. Raises HelloRefused (or OSError/EOFError from the socket)."""
    head = recv_exact(sock, HELLO.size)
    magic, version, kind, addr_len, suspect_len, quorum_id, step, reason, stream = HELLO.unpack(head)
    if magic != HELLO_MAGIC or version != VERSION or kind not in (KIND_RING, KIND_NOTICE):
        raise HelloRefused(STATUS_BAD_MESSAGE, f"bad hello (magic {magic!r}, version {version}, kind {kind})")
    if addr_len > MAX_ADDRESS or suspect_len > MAX_ADDRESS or reason >= len(REASONS) or stream >= MAX_STREAMS:
        raise HelloRefused(STATUS_BAD_MESSAGE, "bad hello (field out of range)")
    rest = recv_exact(sock, addr_len + suspect_len + MAC_BYTES)
    body, mac = head + rest[:-MAC_BYTES], rest[-MAC_BYTES:]
    if not hmac.compare_digest(mac, _mac(token, body)):
        raise HelloRefused(STATUS_BAD_TOKEN, "hello with a wrong job token")
    try:
        address = rest[:addr_len].decode()
        suspect = rest[addr_len : addr_len + suspect_len].decode()
    except UnicodeDecodeError:
        raise HelloRefused(STATUS_BAD_MESSAGE, "bad hello (address is not UTF-8)") from None
    return Hello(kind, quorum_id, address, step, suspect, REASONS[reason], stream)


# --- sockets -----------------------------------------------------------------------------------
def parse_address(address: str) -> tuple[str, int]:
    """ "host:port" -> (host, port); ValueError naming the address if it is not one."""
    try:
        return split_address(address)
    except ValueError:
        raise ValueError(f"member address {address!r} is not 'host:port'") from None


def tune(sock: socket.socket, timeout_s: float) -> None:
    """Make ``sock`` a ring link: blocking, no Nagle delay, and kernel-side send/receive timeouts.

    The timeouts are SO_SNDTIMEO/SO_RCVTIMEO rather than Python's socket timeout: Python's puts the
    descriptor in non-blocking mode, which defeats MSG_WAITALL (one syscall per whole chunk). A
    kernel timeout surfaces as EAGAIN (BlockingIOError) when no byte moved within ``timeout_s``.
    """
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sec = int(timeout_s)
    timeval = struct.pack("ll", sec, int((timeout_s - sec) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes (EOFError if the peer closes first)."""
    buf = bytearray(n)
    recv_into_all(sock, [memoryview(buf)])
    return bytes(buf)


def _consume(bufs: list[memoryview], n: int) -> None:
    while n:
        if n >= bufs[0].nbytes:
            n -= bufs.pop(0).nbytes
        else:
            bufs[0] = bufs[0][n:]
            n = 0


def send_all(sock: socket.socket, bufs: list[memoryview]) -> None:
    """Send header and payload in one gathered syscall (no concatenation copy); loop on partial sends."""
    bufs = [b for b in bufs if b.nbytes]
    while bufs:
        _consume(bufs, sock.sendmsg(bufs))


def recv_into_all(sock: socket.socket, bufs: list[memoryview]) -> None:
    """Fill ``bufs`` (byte-format memoryviews) from the stream: one MSG_WAITALL syscall per call in
    the common case, straight into the destination. EOFError if the peer closes first."""
    bufs = [b for b in bufs if b.nbytes]
    while bufs:
        n = sock.recvmsg_into(bufs, 0, socket.MSG_WAITALL)[0]
        if n == 0:
            raise EOFError("connection closed by peer")
        _consume(bufs, n)


def is_open(sock: socket.socket) -> bool:
    """Whether an idle cached link still looks usable: no EOF, no error pending. (Data waiting is
    fine: the peer may already have started the next call.)"""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def interrupt(sock: socket.socket) -> None:
    """Wake any thread blocked on ``sock`` (its send fails with EPIPE, its receive sees EOF).
    Safe from another thread, unlike close()."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def close_hard(sock: socket.socket) -> None:
    """Close with a reset: a peer blocked sending to us fails at once (a FIN alone would not wake it)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()
