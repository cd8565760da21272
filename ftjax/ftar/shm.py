"""Same-host links: ring payloads through shared memory, frame headers still on the TCP link.

Two members on one host (several replicas per machine, as in the demo, the tests and the benchmark)
need not pay loopback TCP's two kernel copies per byte: the sender writes a chunk into a slot of a
segment both processes map, the receiver adds it straight from there. Everything else stays on the
link's TCP connection, so nothing about failures changes: each 44-byte frame header (quorum, step,
sequence, length, optional crc32 of the slot) travels as before and is checked as before, and the
receiver acknowledges every slot it is done with on the same connection, in the other direction.
A dead peer is still a closed socket, a hung one still a receive timeout.

Negotiation, per link, rides on the dialer's hello: the dialer (the sending side) creates a segment
in /dev/shm (mode 0600, random name, a random nonce written in its first bytes) and names it in an
*offer* that follows its hello; the listener maps it only if it can open it and reads the same nonce
(a listener on another host, or in a container with another /dev/shm, cannot: the link then carries
payloads over TCP). The dialer unlinks the file as soon as the listener has answered, so no name is
left behind even if either process is killed later; the memory goes when both unmap it.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import socket
import struct
import weakref

import numpy as np

from ftjax.ftar.wire import recv_exact

SHM_DIR = "/dev/shm"
NAME_PREFIX = "ftjax-ftar-"
_NAME = re.compile(r"ftjax-ftar-[0-9a-f]{32}\Z")
NONCE_BYTES = 16
HEADER_BYTES = 4096  # the nonce lives here; slots start page-aligned
DEFAULT_SLOTS = 4  # chunks a sender may run ahead of its receiver (measured: 8 or 16 are no faster)
MAX_SEGMENT_BYTES = 1 << 30

OFFER_MAGIC = b"FTSO"
# magic, name length (0: no offer), slots, slot bytes, nonce
OFFER = struct.Struct("<4sHIQ16s")
NO_OFFER = OFFER.pack(OFFER_MAGIC, 0, 0, 0, bytes(NONCE_BYTES))
ACK = struct.Struct("<I")  # the receiver's "done with the slot of frame <seq>"


class Segment:
    """One link's shared slots, mapped in this process."""

    def __init__(self, mem: mmap.mmap, slots: int, slot_bytes: int) -> None:
        self.slots, self.slot_bytes = slots, slot_bytes
        self._mem = mem
        self._raw = np.frombuffer(mem, np.uint8, slots * slot_bytes, HEADER_BYTES)

    def slot(self, seq: int, nbytes: int, dtype: np.dtype) -> np.ndarray:
        """The slot that frame ``seq`` travels in, viewed as ``nbytes`` of ``dtype``."""
        start = (seq % self.slots) * self.slot_bytes
        return self._raw[start : start + nbytes].view(dtype)


# A link's segment, keyed by its socket: the endpoint keeps, reuses and drops links as sockets, and
# the segment lives exactly as long as the socket object does.
_segments: weakref.WeakKeyDictionary[socket.socket, Segment] = weakref.WeakKeyDictionary()


def segment_of(sock: socket.socket) -> Segment | None:
    return _segments.get(sock)


def _check_sizes(slots: int, slot_bytes: int) -> bool:
    return 1 <= slots <= 64 and slot_bytes >= 1 and slots * slot_bytes <= MAX_SEGMENT_BYTES


def _map(fd: int, size: int) -> mmap.mmap:
    return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def create_offer(slots: int, slot_bytes: int) -> tuple[bytes, Segment | None, str | None]:
    """The dialer's side: (offer bytes, its segment, the file to unlink once answered). Without a
    usable /dev/shm the offer is "none" and the link carries payloads over TCP."""
    if not _check_sizes(slots, slot_bytes) or not os.path.isdir(SHM_DIR):
        return NO_OFFER, None, None
    name = NAME_PREFIX + secrets.token_hex(16)
    path = os.path.join(SHM_DIR, name)
    nonce = secrets.token_bytes(NONCE_BYTES)
    size = HEADER_BYTES + slots * slot_bytes
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return NO_OFFER, None, None
    try:
        # Reserve the pages now: a full /dev/shm (64 MiB by default in a container) then fails
        # here, and the link uses TCP, instead of a SIGBUS on first touch in the middle of a call.
        os.posix_fallocate(fd, 0, size)
        mem = _map(fd, size)
    except OSError:
        os.close(fd)
        os.unlink(path)
        return NO_OFFER, None, None
    os.close(fd)  # the mapping keeps the memory
    mem[:NONCE_BYTES] = nonce
    offer = OFFER.pack(OFFER_MAGIC, len(name), slots, slot_bytes, nonce) + name.encode()
    return offer, Segment(mem, slots, slot_bytes), path


def discard_offer(path: str | None) -> None:
    """Unlink the offered file (after the answer, or when the dial failed)."""
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def read_offer(sock: socket.socket, *, accept: bool) -> Segment | None:
    """The listener's side: read the offer that follows a ring hello and map its segment if
    ``accept`` and it is really this host's (same nonce). Returns None to keep payloads on TCP.
    Raises ValueError for an offer that does not parse (the link is then refused)."""
    magic, name_len, slots, slot_bytes, nonce = OFFER.unpack(recv_exact(sock, OFFER.size))
    if magic != OFFER_MAGIC or name_len > 255:
        raise ValueError("bad shared-memory offer")
    if name_len == 0:
        return None
    try:
        name = recv_exact(sock, name_len).decode()
    except UnicodeDecodeError:
        raise ValueError("bad shared-memory offer (name is not UTF-8)") from None
    if not accept or not _NAME.match(name) or not _check_sizes(slots, slot_bytes):
        return None
    size = HEADER_BYTES + slots * slot_bytes
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return None  # not this host's /dev/shm
    try:
        if os.fstat(fd).st_size != size:
            return None
        mem = _map(fd, size)
    except OSError:
        return None
    finally:
        os.close(fd)
    if mem[:NONCE_BYTES] != nonce:
        mem.close()
        return None
    return Segment(mem, slots, slot_bytes)


def bind(sock: socket.socket, segment: Segment | None) -> None:
    """Make ``segment`` the data plane of the link ``sock`` (None: TCP payloads)."""
    if segment is not None:
        _segments[sock] = segment
