"""The ring algorithm: reduce-scatter then all-gather over one link to the right neighbour and one
from the left, chunked and pipelined.

The buffer is cut into ``world`` segments and each segment into chunks. Member ``r`` sends the
chunks of a schedule in order (a sender thread) while receiving its left neighbour's schedule in
order (the calling thread): receive a chunk straight into its place in the result, add this
member's own contribution in place, and count it done. A send that forwards what was received
(every step after the first) waits only for *that chunk*, so sending chunk k+1, receiving chunk k
and adding chunk k-1 overlap; numpy and socket calls release the GIL.

After ``world - 1`` reduce-scatter steps member ``r`` owns segment ``r + 1``: it divides it by the
number of contributors (and, for bfloat16, rounds the float32 sum once) and the all-gather carries
those exact bits to everyone, so all members end bitwise identical.

A link to a member on the same host usually has a shared-memory segment (see shm.py): the sender
then writes each chunk into a slot of it and sends only the frame header; the receiver adds (or
copies) straight from the slot, then hands the slot back with an acknowledgement on the link. The
schedule, the frame checks and every failure path are the same on both kinds of link.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ftjax.ftar import shm, wire
from ftjax.ftar.errors import FTARError, PeerFailed, PeerTimeout, ProtocolError

RS, AG = wire.PHASE_REDUCE_SCATTER, wire.PHASE_ALL_GATHER


@dataclass(frozen=True)
class Chunk:
    phase: int
    start: int  # element range in the buffer
    stop: int
    first: bool = False  # sends: the first reduce-scatter step, which carries this member's own data
    need: int = -1  # sends: index of the receive that must be done first (-1: none)
    owned: bool = False  # receives: completes a segment this member owns (finalise it)


def segment_bounds(n: int, world: int) -> list[int]:
    """Element offsets of the ``world`` segments (sizes differ by at most one element)."""
    return [i * n // world for i in range(world + 1)]


def schedule(n: int, world: int, rank: int, chunk_elems: int) -> tuple[list[Chunk], list[Chunk]]:
    """(sends, receives) of member ``rank``, in wire order.

    The receives of member r are exactly the sends of member r-1, chunk for chunk, so the i-th frame
    on a link is identified by its sequence number i. A send at step t > 0 forwards the segment
    received at step t-1; ``need`` points at that receive.
    """
    bounds = segment_bounds(n, world)

    def chunks(seg: int) -> list[tuple[int, int]]:
        lo, hi = bounds[seg], bounds[seg + 1]
        return [(a, min(a + chunk_elems, hi)) for a in range(lo, hi, chunk_elems)]

    steps = world - 1
    send_segs = [(RS, (rank - s) % world) for s in range(steps)] + [(AG, (rank + 1 - s) % world) for s in range(steps)]
    recv_segs = [(RS, (rank - s - 1) % world) for s in range(steps)] + [(AG, (rank - s) % world) for s in range(steps)]

    recvs: list[Chunk] = []
    recv_offsets = []
    for t, (phase, seg) in enumerate(recv_segs):
        recv_offsets.append(len(recvs))
        owned = phase == RS and t == steps - 1
        recvs += [Chunk(phase, a, b, owned=owned) for a, b in chunks(seg)]
    sends: list[Chunk] = []
    for t, (phase, seg) in enumerate(send_segs):
        for k, (a, b) in enumerate(chunks(seg)):
            sends.append(Chunk(phase, a, b, first=t == 0, need=recv_offsets[t - 1] + k if t else -1))
    return sends, recvs


class Aborted(Exception):
    """Raised inside a call's threads once the call has failed elsewhere; the first error is kept."""


@dataclass
class CallState:
    """What a call's threads share: the first error, the done counter, the sockets to interrupt."""

    quorum_id: int
    step: int
    on_abort: Callable[[], None] = lambda: None  # wakes waiters outside this object (the endpoint)
    error: BaseException | None = None
    done: int = 0  # receives completed, in order
    sockets: list = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def fail(self, err: BaseException) -> None:
        """Record ``err`` if it is the first error, and wake every thread of the call: blocked
        socket calls return (interrupt), waits on ``cond`` and on the endpoint end."""
        with self.cond:
            if self.error is not None:
                return
            self.error = err
            for sock in self.sockets:
                wire.interrupt(sock)
            self.cond.notify_all()
        self.on_abort()

    def attach(self, sock) -> None:
        """Register a socket of this call so that a failure interrupts it."""
        with self.cond:
            self.sockets.append(sock)
            if self.error is not None:
                wire.interrupt(sock)
                raise Aborted

    def check(self) -> None:
        if self.error is not None:
            raise Aborted


def _bytes(arr: np.ndarray) -> memoryview:
    return memoryview(arr.view(np.uint8))


class Ring:
    """One all-reduce of ``buf`` into ``res`` between this member, its ``left`` and its ``right``.

    ``res`` has ``buf``'s length and dtype (float32 or bfloat16). float32 sums accumulate in ``res``
    itself; bfloat16 ones in ``scratch`` (float32, at least as long as ``buf``; the caller keeps it
    across calls so its pages are not faulted in again every step), reduce-scatter frames carry
    float32 partial sums and all-gather frames the rounded bfloat16 values.
    """

    def __init__(
        self,
        *,
        state: CallState,
        buf: np.ndarray,
        res: np.ndarray,
        rank: int,
        world: int,
        contributes: bool,
        count: int,
        chunk_elems: int,
        meta: int,
        left: str,
        right: str,
        timeout_s: float,
        checksum: bool,
        scratch: np.ndarray | None = None,
        ready: Callable[[int, int], None] | None = None,
        on_result: Callable[[int, int], None] | None = None,
    ) -> None:
        self.state, self.buf, self.res = state, buf, res
        # the pipeline's hooks (ftjax.runtime.pipeline): `ready(a, b)` returns once buf[a:b] holds this
        # member's data (its device-to-host copy may still be filling the rest), `on_result(a, b)` says
        # res[a:b] is final (its host-to-device copy may start); both run in the ring's threads
        self.ready, self.on_result = ready or _always, on_result or _always
        self.contributes, self.count = contributes, count
        self.meta, self.left, self.right = meta, left, right
        self.timeout_s, self.checksum = timeout_s, checksum
        self.sends, self.recvs = schedule(buf.size, world, rank, chunk_elems)
        if res.dtype == np.float32:
            self.acc = res
        else:
            assert scratch is not None and scratch.dtype == np.float32 and scratch.size >= buf.size
            self.acc = scratch[: buf.size]
        # own data for the first step, as float32: zeros for a non-contributor, a converted copy for
        # bfloat16 (float32 contributors send straight from ``buf``)
        self.own = None
        if not contributes:
            self.own = np.zeros(chunk_elems, np.float32)
        elif buf.dtype != np.float32:
            self.own = np.empty(chunk_elems, np.float32)

    # --- public -----------------------------------------------------------------------------
    def run(self, connect_out: Callable[[], object], connect_in: Callable[[], object]) -> None:
        """Run the call: ``connect_out()`` (in the sender thread) and ``connect_in()`` (here) return
        the two links. Raises the call's first error."""
        sender = threading.Thread(
            target=self._sender, args=(connect_out,), daemon=True, name=f"ftar-send-q{self.state.quorum_id}"
        )
        sender.start()
        try:
            self._receiver(connect_in)
        finally:
            sender.join()
        if self.state.error is not None:
            raise self.state.error

    # --- threads ----------------------------------------------------------------------------
    def _sender(self, connect: Callable[[], object]) -> None:
        try:
            sock = connect()
            segment = shm.segment_of(sock)
            state = self.state
            acked = 0  # shared memory: slots the receiver has handed back
            for seq, chunk in enumerate(self.sends):
                if chunk.need >= 0 and state.done <= chunk.need:
                    with state.cond:
                        while state.done <= chunk.need and state.error is None:
                            state.cond.wait()
                state.check()
                if chunk.first and self.contributes:
                    self.ready(chunk.start, chunk.stop)
                if segment is None:
                    payload = self._send_view(chunk)
                    wire.send_all(sock, [self._header(chunk, seq, payload), payload])
                    continue
                if seq - acked >= segment.slots:  # the slot is still the receiver's: wait for it
                    acked = _await_acks(sock, acked, seq - segment.slots + 1)
                slot = self._fill_slot(chunk, segment, seq)
                wire.send_all(sock, [self._header(chunk, seq, _bytes(slot), shm=True)])
            if segment is not None:  # leave the link quiet: the next call starts again at slot 0
                _await_acks(sock, acked, len(self.sends))
        except BaseException as exc:
            self._fail(exc, self.right)

    def _header(self, chunk: Chunk, seq: int, payload: memoryview, shm: bool = False) -> memoryview:
        """The frame header of chunk number ``seq`` (its payload follows it, or sits in a slot)."""
        header = wire.pack_frame(
            quorum_id=self.state.quorum_id,
            step=self.state.step,
            phase=chunk.phase,
            seq=seq,
            meta=self.meta,
            payload=payload,
            checksum=self.checksum,
            shm=shm,
        )
        return memoryview(header)

    def _check(self, header: memoryview, payload: memoryview, chunk: Chunk, seq: int, shm: bool = False) -> None:
        """Raise unless ``header`` is chunk number ``seq`` of this very call (see wire.check_frame)."""
        wire.check_frame(
            header,
            payload,
            quorum_id=self.state.quorum_id,
            step=self.state.step,
            phase=chunk.phase,
            seq=seq,
            meta=self.meta,
            require_checksum=self.checksum,
            shm=shm,
        )

    def _receiver(self, connect: Callable[[], object]) -> None:
        try:
            sock = connect()
            segment = shm.segment_of(sock)
            state = self.state
            header = memoryview(bytearray(wire.FRAME.size))
            for seq, chunk in enumerate(self.recvs):
                dest = self.acc[chunk.start : chunk.stop] if chunk.phase == RS else self.res[chunk.start : chunk.stop]
                if chunk.phase == RS and self.contributes:
                    self.ready(chunk.start, chunk.stop)
                if segment is None:
                    payload = _bytes(dest)
                    wire.recv_into_all(sock, [header, payload])
                    self._check(header, payload, chunk, seq)
                    if chunk.phase == RS and self.contributes:
                        np.add(dest, self.buf[chunk.start : chunk.stop], out=dest)
                else:
                    # the frame names a slot the sender has filled; read it once, straight into place
                    wire.recv_into_all(sock, [header])
                    slot = segment.slot(seq, dest.nbytes, dest.dtype)
                    self._check(header, _bytes(slot), chunk, seq, shm=True)
                    if chunk.phase == RS and self.contributes:
                        np.add(slot, self.buf[chunk.start : chunk.stop], out=dest)
                    else:
                        np.copyto(dest, slot)
                    wire.send_all(sock, [memoryview(shm.ACK.pack(seq))])  # the slot is the sender's again
                if chunk.owned:
                    self._finalise(chunk, dest)
                if chunk.owned or chunk.phase == AG:
                    self.on_result(chunk.start, chunk.stop)
                with state.cond:
                    state.done = seq + 1
                    state.cond.notify_all()
        except BaseException as exc:
            self._fail(exc, self.left)

    # --- helpers ----------------------------------------------------------------------------
    def _source(self, chunk: Chunk) -> np.ndarray | None:
        """What a send carries, before any widening: the result (all-gather), the running sum (later
        reduce-scatter steps), this member's own data (the first), or None for a non-contributor's zeros."""
        a, b = chunk.start, chunk.stop
        if chunk.phase == AG:
            return self.res[a:b]
        if not chunk.first:
            return self.acc[a:b]
        return self.buf[a:b] if self.contributes else None

    def _send_view(self, chunk: Chunk) -> memoryview:
        """A TCP send's payload: float32 for reduce-scatter (bfloat16 own data widened into ``own``)."""
        src = self._source(chunk)
        if src is None:  # non-contributor: zeros
            return _bytes(self.own[: chunk.stop - chunk.start])
        if chunk.phase == AG or src.dtype == np.float32:  # no copy
            return _bytes(src)
        np.copyto(self.own[: src.size], src)
        return _bytes(self.own[: src.size])

    def _fill_slot(self, chunk: Chunk, segment: shm.Segment, seq: int) -> np.ndarray:
        """Write what frame ``seq`` carries into its slot (one copy; bfloat16 widened on the way)."""
        dtype = self.res.dtype if chunk.phase == AG else np.dtype(np.float32)
        slot = segment.slot(seq, (chunk.stop - chunk.start) * dtype.itemsize, dtype)
        src = self._source(chunk)
        if src is None:
            slot.fill(0)
        else:
            np.copyto(slot, src)
        return slot

    def _finalise(self, chunk: Chunk, acc: np.ndarray) -> None:
        if self.count != 1:
            np.divide(acc, self.count, out=acc)
        if self.acc is not self.res:
            self.res[chunk.start : chunk.stop] = acc  # the one rounding to bfloat16, at the owner

    def _fail(self, exc: BaseException, peer: str) -> None:
        if isinstance(exc, Aborted):
            return
        self.state.fail(_translate(exc, peer, self.state, self.timeout_s))


def _always(start: int, stop: int) -> None:
    pass


def _await_acks(sock, acked: int, upto: int) -> int:
    """Read the receiver's acknowledgements until ``upto`` slots are handed back; returns ``upto``."""
    ack = bytearray(shm.ACK.size)
    while acked < upto:
        wire.recv_into_all(sock, [memoryview(ack)])
        (seq,) = shm.ACK.unpack(ack)
        if seq != acked:
            raise wire.WireError(f"acknowledgement for frame {seq}, expected frame {acked}")
        acked += 1
    return acked


def _translate(exc: BaseException, peer: str, state: CallState, timeout_s: float) -> BaseException:
    """Map a socket/wire exception met while talking to ``peer`` to the FTAR error naming it."""
    ids = dict(peer=peer, quorum_id=state.quorum_id, step=state.step)
    if isinstance(exc, FTARError):
        return exc
    if isinstance(exc, (BlockingIOError, TimeoutError)):  # kernel SO_*TIMEO (EAGAIN) or Python timeout
        return PeerTimeout(f"no progress for {timeout_s:g} s", **ids)
    if isinstance(exc, EOFError):
        return PeerFailed("connection closed", **ids)
    if isinstance(exc, wire.WireError):
        return ProtocolError(str(exc), **ids)
    if isinstance(exc, OSError):
        return PeerFailed(f"connection error: {exc.strerror or exc}", **ids)
    return exc
