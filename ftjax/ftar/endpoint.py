"""The FTAR endpoint of one replica host: a listener, the links to its ring neighbours, membership
per call, and failure handling.

Links. Each member dials its right neighbour (and only sends on that link) and accepts a link
from its left one. A link is opened by an authenticated hello naming a quorum id; the listener
refuses wrong tokens and quorums older than the newest one this endpoint has begun, and *parks*
the others until a call asks for them (a neighbour may dial for quorum q+1 while this member is
still finishing quorum q). After a successful call both links stay cached; the next call, of the
same or a new quorum, reuses a link whose neighbour is unchanged and dials only changed links.
A dialer offers a shared-memory segment after its hello; a listener on the same host maps it,
and the link's payloads then go through it (shm.py), its headers still over TCP. A TCP link may be
``streams`` connections (ring.py: frame seq on connection seq % streams); each hello names its
stream index, and links are parked and cached per (peer, stream). A link through shared memory
keeps one connection: only stream 0 is dialled (and offers the segment).

Failures. Any error in a call interrupts and resets both of its links (and any cached one: see
`_end`), which makes the neighbours fail at once, and so on around the ring. A failing member also
sends a short *abort notice* ("I left (quorum, step) because of X") to every member, which aborts
their call even where no link carries the failure (a member still waiting for a link from a dead
neighbour), and which every listener acknowledges at once. The acknowledgements say whom to blame: a
closed link or a timeout cannot tell "my neighbour died (or hangs)" from "my neighbour gave up
because another member did", but a member whose listener refuses the notice is dead, and one that
does not acknowledge it within ``probe_timeout_s`` hangs. The error names that member. A member
waiting for a link from its left neighbour probes that neighbour's listener every
LIVENESS_PROBE_S (0.1 s): when the neighbour died before dialing and nobody else noticed (a world
of two), the refusal names it at once.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence

import ml_dtypes
import numpy as np

from ftjax.base import net
from ftjax.ftar import quant, shm, wire
from ftjax.ftar.errors import FTARError, HandshakeRefused, PeerFailed, PeerTimeout, ProtocolError
from ftjax.ftar.ring import INT8, Aborted, CallState, Ring

log = logging.getLogger("ftjax.ftar")

DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16))
# ft.wire_dtype: what frames carry. float32: reduce-scatter partial sums in float32, the all-gather
# in the buffer's dtype; bfloat16: every frame in bfloat16, whatever the buffer (half the bytes);
# int8: every frame row-wise int8 with float32 scales (quant.py: about a quarter of the bytes)
WIRE_DTYPES = {"float32": None, "bfloat16": np.dtype(ml_dtypes.bfloat16), "int8": INT8}
DEFAULT_CHUNK_BYTES = 1 << 20
HANDSHAKE_TIMEOUT_S = 10.0  # a connection that does not finish its hello in time is dropped
# Connections still in their handshake, each on its own thread: at most this many. Past it the oldest
# unauthenticated one is closed (a peer's hello arrives at once; a connection that says nothing is
# the one to drop), so idle connections cannot make threads without bound nor lock peers out.
MAX_HANDSHAKES = 64
# How often a member waiting for its left neighbour's link checks that it is alive: the delay before
# a healthy replica learns that a peer died in its forward pass (before dialing). A probe is one
# connect that the listener closes unread, and only a refusal counts, so probing often is cheap and
# never mistakes a slow neighbour for a dead one (0.5 s here once stalled the healthy replica of a
# kill in forward 0.55 s, 20x its step).
LIVENESS_PROBE_S = 0.1


class FTAREndpoint:
    """Host-side fault-tolerant all-reduce between the members of a quorum (see module doc).

    Binds ``host`` ("" for every interface, IPv6 and IPv4) and listens at once (port 0: the OS
    picks); peers dial :attr:`address`, ``advertise`` (default: ``host``, or this machine's address
    when ``host`` is every interface) with the bound port. One call at a time; use
    the same endpoint for the whole life of the replica host, and ``close()`` it at the end.
    All members of a job must use the same ``chunk_bytes``, ``checksum``, ``wire_dtype`` and
    ``streams`` settings (the last two are in every frame's fingerprint: a member that differs
    fails the call with ProtocolError naming it).
    """

    def __init__(
        self,
        token: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise: str | None = None,
        timeout_s: float = 30.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        checksum: bool = False,
        probe_timeout_s: float = 0.5,
        shared_memory: bool = True,
        wire_dtype: str = "float32",
        streams: int = 1,
        confirm: bool = True,
    ) -> None:
        if not isinstance(token, str) or not token:
            raise ValueError("token: must be a non-empty string (the job's shared secret)")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s!r}")
        if not isinstance(chunk_bytes, int) or chunk_bytes < 4:
            raise ValueError(f"chunk_bytes: must be an int >= 4, got {chunk_bytes!r}")
        if not probe_timeout_s > 0:
            raise ValueError(f"probe_timeout_s: must be > 0, got {probe_timeout_s!r}")
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype: must be one of {sorted(WIRE_DTYPES)}, got {wire_dtype!r}")
        if not isinstance(streams, int) or isinstance(streams, bool) or not 1 <= streams <= wire.MAX_STREAMS:
            raise ValueError(f"streams: must be an int in 1..{wire.MAX_STREAMS}, got {streams!r}")
        self.wire_dtype, self.streams = wire_dtype, streams
        self.confirm = bool(confirm)  # see `allreduce`: every call ends with a confirmation ring
        self.timeout_s = float(timeout_s)
        self.chunk_elems = chunk_bytes // 4  # in float32 elements: the unit of both phases
        self.checksum = checksum
        self.probe_timeout_s = probe_timeout_s
        self.shared_memory = bool(shared_memory)  # offer and accept same-host shared-memory links
        self._token = token.encode()
        self._listener = net.listen(host, port, backlog=128)
        self._address = net.format_address(net.advertised(host, advertise), self._listener.getsockname()[1])

        self._cv = threading.Condition()  # guards everything below
        self._closed = False
        self._floor = -1  # newest quorum id begun here; hellos for older ones are refused
        self._parked: dict[tuple[str, int, int], socket.socket] = {}  # (dialer address, quorum, stream) -> link
        self._links_in: dict[tuple[str, int], socket.socket] = {}  # (left neighbour, stream) -> idle link
        self._links_out: dict[tuple[str, int], socket.socket] = {}  # (right neighbour, stream) -> idle link
        self._notices: dict[tuple[int, int], wire.Hello] = {}  # (quorum, step) -> first abort notice
        self._call: CallState | None = None
        self._call_lock = threading.Lock()
        self._scratch: np.ndarray | None = None  # see _scratch_for
        self._stages: np.ndarray | None = None  # see _stages_for
        self._image: np.ndarray | None = None  # see _image_for
        # counters, for metrics and tests: links dialled, links accepted, hellos refused, and of
        # those links, the ones whose payloads go through shared memory (dialled / accepted)
        # and connections closed unheard to make room for newer ones (MAX_HANDSHAKES)
        self.stats = {"dials": 0, "accepted": 0, "refused": 0, "shm_dials": 0, "shm_accepted": 0, "evicted": 0}
        self._slots = threading.BoundedSemaphore(MAX_HANDSHAKES)  # one per handshake thread
        self._unheard: dict[socket.socket, None] = {}  # in their handshake, no hello yet: oldest first

        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True, name=f"ftar-accept-{self._address}")
        self._acceptor.start()

    @property
    def address(self) -> str:
        """``"host:port"`` that peers dial."""
        return self._address

    # --- the call ------------------------------------------------------------------------------
    def allreduce(
        self,
        buf: np.ndarray,
        *,
        quorum_id: int,
        step: int,
        members: Sequence[str],
        rank: int,
        contributors: Sequence[bool] | None = None,
        out: np.ndarray | None = None,
        divisor: int | None = None,
        ready: Callable[[int, int], None] | None = None,
        on_result: Callable[[int, int], None] | None = None,
    ) -> np.ndarray:
        """Average ``buf`` over the contributing members of the ring ``members`` (this one is
        ``members[rank]``). Non-contributors add zeros but still relay. Returns ``out`` (or a new
        array) holding sum / ``divisor`` (default: the number of contributors), bitwise identical
        on every member. (A constant global batch divides by the job's batch count, however many
        members contributed it.)

        Every member must pass the same ``members``, ``contributors``, length and dtype (checked:
        each frame carries a fingerprint of them). Calls with the same ``quorum_id`` reuse the
        links; a new one keeps links to unchanged neighbours. Pass ``out`` to reuse its memory.

        Pipelining (``ftjax.runtime.pipeline``): ``buf`` may still be filling when the call begins;
        ``ready(a, b)``, called from the call's threads before they first read ``buf[a:b]``, returns
        once that range is filled. ``on_result(a, b)`` is called once ``out[a:b]`` holds its final
        bits; every element is covered exactly once by the time the call returns.

        Confirmed (``confirm``, the default): a returned call means every member's ring completed
        too, not only this one's (`_confirm`).

        Raises ValueError for bad arguments (nothing changes), FTARError subclasses naming the peer
        at fault if the ring fails; ``out`` then holds garbage, and the endpoint serves the next
        quorum. A (quorum_id, step) that failed is abandoned for good: retry under a new quorum id
        (a member still to join it fails at once, from the abort notices it received).
        """
        buf, members = self._validate(buf, quorum_id, step, members, rank)
        out, contributors = self._checked_out(buf, out, contributors, len(members))
        if divisor is not None and (
            not isinstance(divisor, (int, np.integer)) or isinstance(divisor, bool) or divisor < 1
        ):
            raise ValueError(f"divisor: must be a positive int, got {divisor!r}")
        if not self._call_lock.acquire(blocking=False):
            raise RuntimeError("FTAREndpoint.allreduce: another call is running on this endpoint")
        try:
            count = sum(contributors) if divisor is None else int(divisor)
            if len(members) == 1:
                if ready is not None:
                    ready(0, buf.size)
                self._alone(buf, out, count, WIRE_DTYPES[self.wire_dtype])
                if on_result is not None:
                    on_result(0, buf.size)
                return out
            hooks = dict(ready=ready, on_result=on_result)
            self._ring_call(buf, out, quorum_id, step, members, rank, contributors, count, hooks)
            return self._confirm(quorum_id, step, members, rank, out) if self.confirm else out
        finally:
            self._call_lock.release()

    def _confirm(self, quorum_id: int, step: int, members: list[str], rank: int, out: np.ndarray) -> np.ndarray:
        """The confirmation ring: every member's 1.0, summed over the same links, after the data
        ring. A member joins it only once its own data ring has completed, so its completion
        means every member's data ring completed. Without it a ring's last frames let a member
        finish while its neighbour, whose last frame was lost, fails: the first would commit a
        step the second retries in another quorum (two histories of one step; docs/design/index.md,
        "Split brain"). What remains is the same window on this ring's own last frame, one small
        frame instead of a chunk of the average. The same quorum and step: an abort notice a
        failing member sent for the data ring fails this one at once (else its silence times it out)."""
        world = len(members)
        ones, total = np.ones(world, np.float32), np.empty(world, np.float32)
        hooks = dict(ready=None, on_result=None)
        # (not in int8 frames: a frame's 3 may decode a float32 ulp off 3)
        wire_dtype = "float32" if self.wire_dtype == "int8" else None
        self._ring_call(ones, total, quorum_id, step, members, rank, [True] * world, 1, hooks, wire_dtype)
        if not (total == world).all():  # (a frame that passed its checks but not its sum)
            raise ProtocolError(
                f"confirmation summed to {total.tolist()}, not {world} per member",
                peer=members[(rank - 1) % world],
                quorum_id=quorum_id,
                step=step,
            )
        return out

    @staticmethod
    def _alone(buf: np.ndarray, out: np.ndarray, count: int, wire_dtype: np.dtype | None) -> None:
        """A ring of one: the average is the data divided by the divisor, rounded as the ring does
        (a bfloat16 wire rounds a float32 result too, so that its values do not depend on the world)."""
        if wire_dtype == INT8:  # encoded and decoded once, as a ring's owner does
            out[...] = quant.decode(quant.encode(buf.astype(np.float32) / np.float32(count)), buf.size)
        elif wire_dtype is not None and buf.dtype != wire_dtype:
            out[...] = (buf / np.float32(count)).astype(wire_dtype)
        elif count == 1:
            np.copyto(out, buf)
        elif buf.dtype == np.float32:
            np.divide(buf, count, out=out)
        else:  # bfloat16: one rounding of the float32 quotient, as the ring does
            out[...] = buf.astype(np.float32) / count

    def _validate(
        self, buf: np.ndarray, quorum_id: int, step: int, members: Sequence[str], rank: int
    ) -> tuple[np.ndarray, list[str]]:
        """Check the buffer and the ring's identity before anything changes; ValueError names the
        argument at fault."""
        if self._closed:
            raise RuntimeError("FTAREndpoint is closed")
        if not isinstance(buf, np.ndarray) or buf.ndim != 1:
            raise ValueError("buf: must be a 1-D numpy array")
        if buf.dtype not in DTYPES:
            raise ValueError(f"buf: dtype must be float32 or bfloat16, got {buf.dtype}")
        for name, value in (("quorum_id", quorum_id), ("step", step), ("rank", rank)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}: must be a non-negative int, got {value!r}")
        if quorum_id < self._floor:
            raise ValueError(f"quorum_id: {quorum_id} is older than quorum {self._floor} already begun here")
        members = list(members)
        if not members:
            raise ValueError("members: must not be empty")
        for m in members:
            try:
                wire.parse_address(m)
            except ValueError as exc:
                raise ValueError(f"members: {exc}") from None
        if len(set(members)) != len(members):
            raise ValueError(f"members: duplicate addresses in {members}")
        if rank >= len(members) or members[rank] != self._address:
            raise ValueError(
                f"rank: members[{rank}] must be this endpoint's address {self._address}, members are {members}"
            )
        return np.ascontiguousarray(buf), members

    @staticmethod
    def _checked_out(
        buf: np.ndarray, out: np.ndarray | None, contributors: Sequence[bool] | None, world: int
    ) -> tuple[np.ndarray, list[bool]]:
        """The contributors (default: every member) and the result array (default: a new one),
        checked after `_validate`."""
        contributors = [True] * world if contributors is None else [bool(c) for c in contributors]
        if len(contributors) != world:
            raise ValueError(f"contributors: length {len(contributors)} != number of members {world}")
        if not any(contributors):
            raise ValueError("contributors: at least one member must contribute")
        if out is None:
            return np.empty_like(buf), contributors
        if (
            not isinstance(out, np.ndarray)
            or out.shape != buf.shape
            or out.dtype != buf.dtype
            or not out.flags.c_contiguous
            or not out.flags.writeable
        ):
            raise ValueError(f"out: must be a writeable contiguous {buf.dtype} array of shape {buf.shape}")
        if np.shares_memory(out, buf):
            raise ValueError("out: must not overlap buf")
        return out, contributors

    def _ring_call(
        self,
        buf: np.ndarray,
        out: np.ndarray,
        quorum_id: int,
        step: int,
        members: list[str],
        rank: int,
        contributors: list[bool],
        count: int,
        hooks: dict,
        wire_dtype: str | None = None,
    ) -> np.ndarray:
        world = len(members)
        left, right = members[(rank - 1) % world], members[(rank + 1) % world]
        wire_dtype = wire_dtype or self.wire_dtype
        meta = wire.call_fingerprint(
            buf.size, buf.dtype, self.chunk_elems, members, contributors, count, wire_dtype, self.streams
        )
        state = CallState(quorum_id, step, on_abort=self._wake)
        pending = self._begin(state, left, right)
        ring = Ring(
            state=state,
            buf=buf,
            res=out,
            rank=rank,
            world=world,
            contributes=contributors[rank],
            count=count,
            chunk_elems=self.chunk_elems,
            meta=meta,
            left=left,
            right=right,
            timeout_s=self.timeout_s,
            checksum=self.checksum,
            scratch=self._scratch_for(buf),
            wire_dtype=WIRE_DTYPES[wire_dtype],
            streams=self.streams,
            stages=self._stages_for(wire_dtype),
            image=self._image_for(buf, wire_dtype),
            **hooks,
        )
        links_in: dict[tuple[str, int], socket.socket] = {}  # (peer, stream) -> link, as the call takes them
        links_out: dict[tuple[str, int], socket.socket] = {}
        try:
            if pending is not None:
                raise pending
            ring.run(
                lambda i: self._link_out(right, i, state, links_out), lambda i: self._link_in(left, i, state, links_in)
            )
        except FTARError as err:
            self._end(state, None)
            raise self._resolve(err, members) from None
        except BaseException:
            self._end(state, None)
            raise
        self._end(state, (links_in, links_out))
        return out

    def _scratch_for(self, buf: np.ndarray) -> np.ndarray | None:
        """float32 accumulator for bfloat16 calls, kept across calls (grown when needed)."""
        if buf.dtype == np.float32:
            return None
        if self._scratch is None or self._scratch.size < buf.size:
            self._scratch = np.empty(buf.size, np.float32)
        return self._scratch

    def _image_for(self, buf: np.ndarray, wire_name: str) -> np.ndarray | None:
        """bfloat16 copy of a float32 result for a bfloat16 wire (what its all-gather forwards, so
        that it is rounded once), kept across calls like the scratch accumulator."""
        wire_dtype = WIRE_DTYPES[wire_name]
        if wire_dtype is None or buf.dtype == wire_dtype or wire_dtype == INT8:  # (int8: the ring's own)
            return None
        if self._image is None or self._image.size < buf.size:
            self._image = np.empty(buf.size, wire_dtype)
        return self._image

    def _stages_for(self, wire_name: str) -> np.ndarray | None:
        """The ring threads' staging rows (a chunk each; see Ring), kept across calls."""
        dtype = WIRE_DTYPES[wire_name] or np.dtype(np.float32)
        if dtype == INT8:  # (the ring's own: rows of a frame's bytes)
            return None
        if self._stages is None:
            self._stages = np.empty((2 * self.streams, self.chunk_elems), dtype)
        return self._stages

    def _begin(self, state: CallState, left: str, right: str) -> FTARError | None:
        """Enter a call: raise the quorum floor, drop what is stale, keep links to unchanged
        neighbours. Returns the error to fail with at once if the call was already abandoned by a
        member (its notice arrived before this member joined)."""
        q, key = state.quorum_id, (state.quorum_id, state.step)
        with self._cv:
            self._floor = max(self._floor, q)
            for k in [k for k in self._parked if k[1] < q]:
                wire.close_hard(self._parked.pop(k))
            for links, keep in ((self._links_in, left), (self._links_out, right)):
                for stale in [k for k in links if k[0] != keep]:  # (not `key`: the call's own, used below)
                    wire.close_hard(links.pop(stale))
            for old in [n for n in self._notices if n < key]:
                del self._notices[old]
            self._call = state
            notice = self._notices.get(key)
            return self._notice_error(notice, state) if notice is not None else None

    def _end(self, state: CallState, links: tuple[dict, dict] | None) -> None:
        """Leave a call: cache its links after a success, reset them all after a failure. A failure
        also resets the cached links the call never took up (it failed first, or was abandoned
        before it began): a neighbour may have sent this call's frames into one and lost its own
        reset in a partition, and the retry, under a new quorum, would read them as its own."""
        with self._cv:
            self._call = None
            if links is not None:  # (incoming, outgoing): (peer, stream) -> socket
                self._links_in.update(links[0])
                self._links_out.update(links[1])
                return
            stale = [*state.sockets, *self._links_in.values(), *self._links_out.values()]
            self._links_in.clear()
            self._links_out.clear()
        for sock in stale:
            wire.close_hard(sock)

    # --- links ---------------------------------------------------------------------------------
    def _link_out(self, right: str, stream: int, state: CallState, links: dict) -> socket.socket:
        """Connection ``stream`` of the link to ``right``: the cached one if still open, else a dial."""
        with self._cv:
            sock = self._links_out.pop((right, stream), None)
        if sock is not None and not wire.is_open(sock):
            wire.close_hard(sock)
            sock = None
        if sock is None:
            sock = self._dial(right, stream, state)
        else:
            state.attach(sock)
        links[(right, stream)] = sock
        return sock

    def _dial(self, peer: str, stream: int, state: CallState) -> socket.socket:
        host, port = wire.parse_address(peer)
        sock = socket.create_connection((host, port), timeout=self.timeout_s)
        with self._cv:
            self.stats["dials"] += 1
        try:
            state.attach(sock)
        except Aborted:
            sock.close()
            raise
        hello = wire.Hello(wire.KIND_RING, state.quorum_id, self._address, stream=stream)
        offer, segment, path = (  # only stream 0 offers: a link through shared memory is one connection
            shm.create_offer(shm.DEFAULT_SLOTS, self.chunk_elems * 4)
            if self.shared_memory and stream == 0
            else (shm.NO_OFFER, None, None)
        )
        try:
            sock.sendall(wire.encode_hello(self._token, hello) + offer)
            status = wire.recv_exact(sock, 1)[0]
            if status != wire.STATUS_OK:
                raise HandshakeRefused(
                    f"refused our link: {wire.STATUS_TEXT.get(status, status)}",
                    peer=peer,
                    quorum_id=state.quorum_id,
                    step=state.step,
                )
            mapped = wire.recv_exact(sock, 1)[0] == 1
        finally:
            shm.discard_offer(path)  # both sides have it mapped (or never will): the name can go
        if mapped and segment is not None:
            shm.bind(sock, segment)
            with self._cv:
                self.stats["shm_dials"] += 1
        wire.tune(sock, self.timeout_s)
        return sock

    def _link_in(self, left: str, stream: int, state: CallState, links: dict) -> socket.socket:
        """Connection ``stream`` of the link from ``left``: a parked fresh one, else the cached one if
        still open, else wait for its dial. While waiting, probe its listener now and then: a neighbour that died before
        dialing us (or whose cached link we find closed) is named at once, not after the timeout.
        Nothing else would tell us in a world of two, where our sender may still have sent its
        first chunk over a link the dying process had not closed yet, and then waits for us."""
        start = time.monotonic()
        deadline, probe_at = start + self.timeout_s, start + LIVENESS_PROBE_S
        while True:
            with self._cv:
                state.check()
                sock, closed = self._ready_link_in(left, stream, state.quorum_id)
                if sock is None:
                    now = time.monotonic()
                    if closed:  # closed under us: is it alive?
                        probe_at = now
                    if now >= deadline:
                        raise PeerTimeout(
                            f"no link from it within {self.timeout_s:g} s",
                            peer=left,
                            quorum_id=state.quorum_id,
                            step=state.step,
                        )
                    if now < probe_at:
                        self._cv.wait(min(deadline, probe_at) - now)
                        continue
            if sock is not None:
                break
            if not _listening(left, self.probe_timeout_s):  # outside the lock: it may take a while
                raise PeerFailed(
                    "no link from it, and its listener refuses connections: its process is gone",
                    peer=left,
                    quorum_id=state.quorum_id,
                    step=state.step,
                )
            probe_at = time.monotonic() + LIVENESS_PROBE_S
        state.attach(sock)
        links[(left, stream)] = sock
        return sock

    def _ready_link_in(self, left: str, stream: int, quorum_id: int) -> tuple[socket.socket | None, bool]:
        """(link, False) if one from ``left`` is usable now: a parked fresh one, else the cached one
        if still open. (None, True) if the cached one turned out closed, (None, False) if there is
        none. Call with ``self._cv`` held."""
        sock = self._parked.pop((left, quorum_id, stream), None)
        if sock is not None:  # a fresh link supersedes a cached one: the dialer dropped it
            old = self._links_in.pop((left, stream), None)
            if old is not None:
                wire.close_hard(old)
            return sock, False
        sock = self._links_in.pop((left, stream), None)
        if sock is None:
            return None, False
        if wire.is_open(sock):
            return sock, False
        wire.close_hard(sock)
        return None, True

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    # --- listener ------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                log.exception("ftar %s: accept failed", self._address)
                time.sleep(0.1)  # e.g. out of descriptors: do not spin
                continue
            self._admit(conn)
            threading.Thread(target=self._handshake, args=(conn,), daemon=True, name="ftar-hello").start()

    def _admit(self, conn: socket.socket) -> None:
        """Take a handshake slot for `conn`, closing the oldest unheard connection while none is free."""
        while not self._slots.acquire(blocking=False):
            with self._cv:
                oldest = next(iter(self._unheard), None)
                if oldest is not None:
                    del self._unheard[oldest]
                    self.stats["evicted"] += 1
            if oldest is not None:
                try:  # wakes its thread (recv returns), which closes it and frees the slot
                    oldest.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # its thread closed it meanwhile
            if self._slots.acquire(timeout=1.0):
                break
        with self._cv:
            self._unheard[conn] = None

    def _handshake(self, conn: socket.socket) -> None:
        try:
            self._handshake_once(conn)
        finally:
            self._heard(conn)
            self._slots.release()

    def _heard(self, conn: socket.socket) -> None:
        with self._cv:
            self._unheard.pop(conn, None)

    def _handshake_once(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(min(self.timeout_s, HANDSHAKE_TIMEOUT_S))
            if not conn.recv(1, socket.MSG_PEEK):  # a liveness probe (see _link_in): no word, closed
                conn.close()
                return
            hello = wire.read_hello(conn, self._token)
            self._heard(conn)  # authenticated: never evicted
        except wire.HelloRefused as exc:
            self._refuse(conn, exc.status, f"a connection from {_peername(conn)}: {exc}")
            return
        except (OSError, EOFError) as exc:
            self._drop(conn, "hello", exc)
            return
        if hello.kind == wire.KIND_NOTICE:
            # Record first, acknowledge second: once the broadcaster's call has returned, every
            # member that acknowledged holds the notice, so its own entry into the call fails at
            # once. (Acknowledging first let a member enter between the two and read stale frames.)
            self._on_notice(hello)
            _answer_and_close(conn, wire.STATUS_OK)  # the acknowledgement is the liveness probe
            return
        if self._stale(hello, conn):
            return
        try:  # outside the lock: the dialer may be slow to send its offer
            segment = shm.read_offer(conn, accept=self.shared_memory)
        except ValueError as exc:
            self._refuse(conn, wire.STATUS_BAD_MESSAGE, f"a link from {hello.address}: {exc}")
            return
        except (OSError, EOFError) as exc:
            self._drop(conn, "offer", exc)
            return
        with self._cv:
            if self._stale(hello, conn):  # the floor may have moved meanwhile
                return
            try:
                conn.sendall(bytes([wire.STATUS_OK, segment is not None]))
                wire.tune(conn, self.timeout_s)
            except OSError:
                conn.close()
                return
            shm.bind(conn, segment)
            key = (hello.address, hello.quorum_id, hello.stream)
            old = self._parked.pop(key, None)
            if old is not None:  # the dialer redialled: the newer link wins
                wire.close_hard(old)
            self._parked[key] = conn
            self.stats["accepted"] += 1
            self.stats["shm_accepted"] += segment is not None
            self._cv.notify_all()

    def _stale(self, hello: wire.Hello, conn: socket.socket) -> bool:
        """Refuse (and close) a link for a quorum older than the newest begun here, or after close()."""
        with self._cv:
            if not (self._closed or hello.quorum_id < self._floor):
                return False
        self._refuse(
            conn,
            wire.STATUS_STALE_QUORUM,
            f"a link from {hello.address} for stale quorum {hello.quorum_id} (now at {self._floor})",
        )
        return True

    def _drop(self, conn: socket.socket, during: str, exc: BaseException) -> None:
        """Close a connection that went away (or stalled) in the middle of its handshake."""
        log.info("ftar %s: dropped a connection during its %s: %s", self._address, during, exc)
        conn.close()

    def _refuse(self, conn: socket.socket, status: int, what: str) -> None:
        with self._cv:
            self.stats["refused"] += 1
        log.warning("ftar %s: refused %s", self._address, what)
        _answer_and_close(conn, status)

    # --- abort notices -------------------------------------------------------------------------
    def _on_notice(self, notice: wire.Hello) -> None:
        with self._cv:
            if notice.quorum_id < self._floor or notice.address == self._address:
                return
            self._notices.setdefault((notice.quorum_id, notice.step), notice)
            self._cv.notify_all()
            call = self._call
        if call is not None and (call.quorum_id, call.step) == (notice.quorum_id, notice.step):
            call.fail(self._notice_error(notice, call))

    def _notice_error(self, notice: wire.Hello, state: CallState) -> FTARError:
        suspect = notice.suspect if notice.suspect != self._address else notice.address
        return PeerFailed(
            f"call abandoned by {notice.address} ({notice.reason} of {notice.suspect})",
            peer=suspect,
            quorum_id=state.quorum_id,
            step=state.step,
        )

    def _broadcast_notice(self, err: FTARError, members: list[str]) -> dict[str, str]:
        """Tell every other member that this call is abandoned and whom we blame. Returns each
        member's health as its listener answered: "dead" (refused), "hung" (no answer within
        ``probe_timeout_s``) or "alive"."""
        notice = wire.encode_hello(
            self._token, wire.Hello(wire.KIND_NOTICE, err.quorum_id, self._address, err.step, err.peer, err.kind)
        )
        health: dict[str, str] = {}

        def send(member: str) -> None:
            try:
                with socket.create_connection(wire.parse_address(member), timeout=self.probe_timeout_s) as s:
                    s.sendall(notice)
                    # closed without an answer: a process dying while we dialled (its listener
                    # took the connection into its backlog, then went away)
                    health[member] = "alive" if s.recv(1) == bytes([wire.STATUS_OK]) else "dead"
            except ConnectionError:  # refused, or reset by a listener going away
                health[member] = "dead"
            except OSError:  # no answer in time (stopped), or unreachable
                health[member] = "hung"

        threads = [threading.Thread(target=send, args=(m,), daemon=True) for m in members if m != self._address]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return health

    def _resolve(self, err: FTARError, members: list[str]) -> FTARError:
        """The error to raise. A closed link or a timeout is blamed on the neighbour that showed it
        only if that neighbour is itself dead or hung; otherwise on the member that is."""
        health = self._broadcast_notice(err, members)
        if err.kind not in ("failed", "timeout"):
            return err  # a protocol violation or a refusal: the neighbour that did it is the one
        culprit = (
            err.peer
            if health.get(err.peer, "alive") != "alive"
            else next((m for state in ("dead", "hung") for m in members if health.get(m) == state), None)
        )
        if culprit is None:
            return err
        cls, what = (
            (PeerFailed, "its process is gone")
            if health[culprit] == "dead"
            else (PeerTimeout, f"it does not answer within {self.probe_timeout_s:g} s")
        )
        if culprit == err.peer and cls is type(err):
            return err
        return cls(
            f"{what} (seen here: {err.detail}, from {err.peer})", peer=culprit, quorum_id=err.quorum_id, step=err.step
        )

    # --- shutdown ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop listening and close every link. Call it when no allreduce is running."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            socks = [*self._parked.values(), *self._links_in.values(), *self._links_out.values()]
            self._parked.clear()
            self._links_in.clear()
            self._links_out.clear()
        wire.interrupt(self._listener)
        self._listener.close()
        for sock in socks:
            wire.close_hard(sock)
        self._acceptor.join(timeout=5)

    def __enter__(self) -> FTAREndpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _peername(conn: socket.socket) -> str:
    try:
        host, port = conn.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"


def _answer_and_close(conn: socket.socket, status: int) -> None:
    try:
        conn.sendall(bytes([status]))
    except OSError:
        pass
    conn.close()


def _listening(address: str, timeout_s: float) -> bool:
    """Whether a member's listener still takes connections. Only a refusal says no: a listener is
    open for the whole life of its endpoint, so a refused connection means the process is gone. A
    probe that times out (a hung or unreachable host) says yes: the link timeout decides then."""
    try:
        with socket.create_connection(wire.parse_address(address), timeout=timeout_s):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return True
