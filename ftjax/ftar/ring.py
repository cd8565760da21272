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

A TCP link may be several connections (``streams``): frame ``seq`` travels on connection
``seq % streams``, so each connection still carries its frames in order and its receiver knows
which frame comes next on it; one sender and one receiver thread per connection. The receives then
complete out of order across connections, and ``done`` counts the longest finished prefix. A
failure on any connection interrupts all of them (every socket is attached to the CallState).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ftjax.ftar import quant, shm, wire
from ftjax.ftar.errors import FTARError, PeerFailed, PeerTimeout, ProtocolError

RS, AG = wire.PHASE_REDUCE_SCATTER, wire.PHASE_ALL_GATHER
INT8 = np.dtype(np.int8)  # the wire_dtype of row-wise int8 frames (quant.py): they travel as bytes


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
    done: int = 0  # receives completed, in order (the longest finished prefix: see Ring._complete)
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
    return arr.view(np.uint8).data


class Ring:
    """One all-reduce of ``buf`` into ``res`` between this member, its ``left`` and its ``right``.

    ``res`` has ``buf``'s length and dtype (float32 or bfloat16). float32 sums accumulate in ``res``
    itself; bfloat16 ones in ``scratch`` (float32, at least as long as ``buf``; the caller keeps it
    across calls so its pages are not faulted in again every step).

    What the frames carry (``wire_dtype``): by default reduce-scatter frames carry float32 partial
    sums and all-gather frames the result's own dtype. A bfloat16 wire carries every frame in
    bfloat16, whatever the buffer: a sender rounds its partial sum as it sends, a receiver widens
    and adds in float32, the owner divides in float32 and rounds once, and a float32 ``res`` ends
    holding the owner's bfloat16 bits widened, so every member is still bitwise identical. The
    all-gather then moves the bfloat16 result in ``image`` (bfloat16, ``buf``'s length, kept by the
    caller), so that forwarding a chunk never rounds it again; ``res`` gets each chunk widened.

    Each link is ``streams`` TCP connections: frame ``seq`` travels on connection ``seq % streams``,
    each with a sender (or receiver) thread of its own taking its frames in order. A link whose
    payloads go through shared memory keeps one connection (the copies, not the socket, bound it).
    ``stages`` (at least ``2 * streams`` rows of a chunk, of the reduce-scatter wire dtype; kept by
    the caller across calls) are the threads' staging buffers for frames whose dtype differs from
    the memory they come from or go to.
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
        wire_dtype: np.dtype | None = None,
        streams: int = 1,
        stages: np.ndarray | None = None,
        image: np.ndarray | None = None,
    ) -> None:
        self.state, self.buf, self.res = state, buf, res
        # the pipeline's hooks (ftjax.runtime.pipeline): `ready(a, b)` returns once buf[a:b] holds this
        # member's data (its device-to-host copy may still be filling the rest), `on_result(a, b)` says
        # res[a:b] is final (its host-to-device copy may start); both run in the ring's threads
        # (on_result one call at a time, as with a single receiver thread)
        self.ready, self.on_result = ready or _always, on_result or _always
        self._result_lock = threading.Lock()
        self.contributes, self.count = contributes, count
        self.meta, self.left, self.right = meta, left, right
        self.timeout_s, self.checksum = timeout_s, checksum
        self.sends, self.recvs = schedule(buf.size, world, rank, chunk_elems)
        self.finished = bytearray(len(self.recvs))  # receives completed, in any order (see _complete)
        self.int8 = wire_dtype is not None and np.dtype(wire_dtype) == INT8
        if self.int8:  # every frame is quant's bytes; the all-gather forwards the owner's frames
            wire_dtype, stages, image = np.dtype(np.uint8), self._int8_stages(streams, chunk_elems), self._frames()
        self.wire_rs = np.dtype(np.float32) if wire_dtype is None else np.dtype(wire_dtype)
        self.wire_ag = res.dtype if wire_dtype is None else np.dtype(wire_dtype)
        self.streams = streams
        if stages is None:
            stages = np.empty((2 * streams, chunk_elems), self.wire_rs)
        rows, row = stages.shape
        assert stages.dtype == self.wire_rs and rows >= 2 * streams and row >= self._length(chunk_elems)
        self.stages = stages  # rows [0, streams): the senders'; [streams, 2 streams): the receivers'
        if res.dtype == np.float32:
            self.acc = res
        else:
            assert scratch is not None and scratch.dtype == np.float32 and scratch.size >= buf.size
            self.acc = scratch[: buf.size]
        self.image = self._result_image(image)
        # a non-contributor's first step sends zeros
        self.zeros = None if contributes else np.zeros(self._length(chunk_elems), self.wire_rs)  # (int8: scales 0)

    def _result_image(self, image: np.ndarray | None) -> np.ndarray:
        """The result as the all-gather carries it: ``res`` itself unless it is wider than the wire
        (int8: the frames, `_frames`)."""
        if self.int8:
            assert image is not None, "int8: the frames come with the call"
            return image
        if self.res.dtype == self.wire_ag:
            return self.res
        assert image is not None and image.dtype == self.wire_ag and image.size >= self.buf.size
        return image[: self.buf.size]

    def _int8_stages(self, streams: int, chunk_elems: int) -> np.ndarray:
        return np.empty((2 * streams, quant.nbytes(chunk_elems)), np.uint8)

    def _frames(self) -> np.ndarray:
        """int8 wire: the encoded result, each chunk's frame at its offset (`_image_of`)."""
        self.offsets, total = {}, 0
        for c in sorted({(c.start, c.stop) for c in self.sends + self.recvs}):
            self.offsets[c[0]], total = total, total + quant.nbytes(c[1] - c[0])
        return np.empty(total, np.uint8)

    def _length(self, n: int) -> int:
        """The items of a frame of ``n`` elements (int8 wire: its bytes)."""
        return quant.nbytes(n) if self.int8 else n

    def _image_of(self, a: int, b: int) -> np.ndarray:
        """The all-gather's copy of result elements a..b (int8 wire: their frame)."""
        if not self.int8:
            return self.image[a:b]
        return self.image[self.offsets[a] : self.offsets[a] + quant.nbytes(b - a)]

    def _widen(self, a: int, b: int, image: np.ndarray) -> None:
        """res[a:b] from the all-gather's copy: widened, or an int8 frame decoded (the same bits everywhere)."""
        if not self.int8:
            np.copyto(self.res[a:b], image)
        elif self.res.dtype == np.float32:
            quant.decode(image, b - a, out=self.res[a:b])
        else:
            np.copyto(self.res[a:b], quant.decode(image, b - a))

    # --- public -----------------------------------------------------------------------------
    def run(self, connect_out: Callable[[int], socket.socket], connect_in: Callable[[int], socket.socket]) -> None:
        """Run the call: ``connect_out(i)`` and ``connect_in(i)`` return connection ``i`` of the link
        to the right and of the one from the left (each called in the thread that will use it).
        Raises the call's first error."""
        sender = threading.Thread(
            target=self._side,
            args=(self._sender, connect_out, self.right),
            daemon=True,
            name=f"ftar-send-q{self.state.quorum_id}",
        )
        sender.start()
        try:
            self._side(self._receiver, connect_in, self.left)
        finally:
            sender.join()
        if self.state.error is not None:
            raise self.state.error

    # --- threads ----------------------------------------------------------------------------
    def _side(self, loop: Callable, connect: Callable[[int], socket.socket], peer: str) -> None:
        """One direction of the ring: open connection 0, learn from it how many the link has (one
        where payloads go through shared memory: both ends know whether it does), and run it here
        and every other connection in a thread of its own."""
        sock = self._open(connect, 0, peer)
        if sock is None:
            return
        streams = 1 if shm.segment_of(sock) is not None else self.streams
        threads = [
            threading.Thread(target=self._stream, args=(loop, connect, i, streams, peer), daemon=True)
            for i in range(1, streams)
        ]
        for t in threads:
            t.start()
        loop(sock, 0, streams)
        for t in threads:
            t.join()

    def _stream(
        self, loop: Callable, connect: Callable[[int], socket.socket], index: int, streams: int, peer: str
    ) -> None:
        sock = self._open(connect, index, peer)
        if sock is not None:
            loop(sock, index, streams)

    def _open(self, connect: Callable[[int], socket.socket], index: int, peer: str) -> socket.socket | None:
        """Connection ``index`` of a link, or None once a failure to open it failed the call."""
        try:
            return connect(index)
        except BaseException as exc:
            self._fail(exc, peer)
            return None

    def _sender(self, sock, first: int, streams: int) -> None:
        """Send frames ``first``, ``first + streams``, ... on ``sock``, each once its data is there."""
        try:
            segment = shm.segment_of(sock)
            state, stage = self.state, self.stages[first]
            acked = 0  # shared memory: slots the receiver has handed back
            for seq in range(first, len(self.sends), streams):
                chunk = self.sends[seq]
                if chunk.need >= 0 and state.done <= chunk.need:
                    with state.cond:
                        while state.done <= chunk.need and state.error is None:
                            state.cond.wait()
                state.check()
                if chunk.first and self.contributes:
                    self.ready(chunk.start, chunk.stop)
                if segment is None:
                    payload = self._send_view(chunk, stage)
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

    def _receiver(self, sock, first: int, streams: int) -> None:
        """Receive frames ``first``, ``first + streams``, ... from ``sock``, in order, into place."""
        try:
            segment = shm.segment_of(sock)
            header = memoryview(bytearray(wire.FRAME.size))
            stage = self.stages[self.streams + first]
            for seq in range(first, len(self.recvs), streams):
                chunk = self.recvs[seq]
                a, b = chunk.start, chunk.stop
                dest = self.acc[a:b] if chunk.phase == RS else self._image_of(a, b)
                if chunk.phase == RS and self.contributes:
                    self.ready(a, b)
                dtype = self._wire(chunk)
                if segment is None:
                    # straight into place when the frame's dtype is the destination's
                    incoming = dest if dest.dtype == dtype else stage[: self._length(b - a)]
                    wire.recv_into_all(sock, [header, _bytes(incoming)])
                    self._check(header, _bytes(incoming), chunk, seq)
                    self._combine(chunk, incoming, dest)
                else:
                    # the frame names a slot the sender has filled; read it once, straight into place
                    wire.recv_into_all(sock, [header])
                    slot = segment.slot(seq, self._length(b - a) * dtype.itemsize, dtype)
                    self._check(header, _bytes(slot), chunk, seq, shm=True)
                    self._combine(chunk, slot, dest)
                    wire.send_all(sock, [memoryview(shm.ACK.pack(seq))])  # the slot is the sender's again
                if chunk.owned:
                    self._finalise(chunk, dest)
                elif chunk.phase == AG and self.image is not self.res:
                    self._widen(a, b, dest)  # the owner's bits
                if chunk.owned or chunk.phase == AG:
                    with self._result_lock:
                        self.on_result(a, b)
                self._complete(seq)
        except BaseException as exc:
            self._fail(exc, self.left)

    def _complete(self, seq: int) -> None:
        """Count receive ``seq`` done. ``done`` is the number of receives completed *in order* (the
        longest finished prefix): a send forwarding chunk k waits for ``done > k``, whichever
        connection chunk k came on."""
        state = self.state
        with state.cond:
            self.finished[seq] = 1
            if seq == state.done:
                while state.done < len(self.finished) and self.finished[state.done]:
                    state.done += 1
                state.cond.notify_all()

    # --- helpers ----------------------------------------------------------------------------
    def _wire(self, chunk: Chunk) -> np.dtype:
        """The dtype frame ``chunk`` travels in."""
        return self.wire_ag if chunk.phase == AG else self.wire_rs

    def _source(self, chunk: Chunk) -> np.ndarray | None:
        """What a send carries, before any conversion: the result (all-gather), the running sum (later
        reduce-scatter steps), this member's own data (the first), or None for a non-contributor's zeros."""
        a, b = chunk.start, chunk.stop
        if chunk.phase == AG:
            return self._image_of(a, b)
        if not chunk.first:
            return self.acc[a:b]
        return self.buf[a:b] if self.contributes else None

    def _send_view(self, chunk: Chunk, stage: np.ndarray) -> memoryview:
        """A TCP send's payload in the frame's dtype: the source itself where it has that dtype (no
        copy), else the source converted into ``stage`` (bfloat16 own data widened for a float32 wire;
        float32 sums rounded for a bfloat16 one; the all-gather's ``image`` always has the wire's dtype)."""
        src = self._source(chunk)
        if src is None:  # non-contributor: zeros
            assert self.zeros is not None  # (set for a non-contributor)
            return _bytes(self.zeros[: self._length(chunk.stop - chunk.start)])
        if src.dtype == self._wire(chunk):
            return _bytes(src)
        if self.int8:  # a partial sum (or own data) encoded as it is sent, as a bfloat16 wire rounds it
            return _bytes(quant.encode(src, stage))
        np.copyto(stage[: src.size], src)
        return _bytes(stage[: src.size])

    def _fill_slot(self, chunk: Chunk, segment: shm.Segment, seq: int) -> np.ndarray:
        """Write what frame ``seq`` carries into its slot (one copy, converted on the way). A slot
        holds a float32 chunk: a bfloat16 frame fills half of it."""
        dtype = self._wire(chunk)
        slot = segment.slot(seq, self._length(chunk.stop - chunk.start) * dtype.itemsize, dtype)
        src = self._source(chunk)
        if src is None:
            slot.fill(0)
        elif self.int8 and src.dtype != dtype:
            quant.encode(src, slot)
        else:
            np.copyto(slot, src)
        return slot

    def _combine(self, chunk: Chunk, incoming: np.ndarray, dest: np.ndarray) -> None:
        """Put a received frame in place: reduce-scatter adds this member's data (in float32, the
        frame widened), all-gather copies (from a staging row or a shared-memory slot)."""
        if chunk.phase == RS and self.int8:  # the frame decoded, then this member's data added in float32
            quant.decode(incoming, chunk.stop - chunk.start, out=dest)
            if self.contributes:
                np.add(dest, self.buf[chunk.start : chunk.stop], out=dest)
        elif chunk.phase == RS and self.contributes:
            np.add(incoming, self.buf[chunk.start : chunk.stop], out=dest)
        elif incoming is not dest:
            np.copyto(dest, incoming)

    def _finalise(self, chunk: Chunk, acc: np.ndarray) -> None:
        """The owner's average: divide in float32, then the one rounding (to a bfloat16 result, or to
        the bfloat16 wire's image, whose bits a float32 result then holds on every member alike)."""
        if self.count != 1:
            np.divide(acc, self.count, out=acc)
        a, b = chunk.start, chunk.stop
        if self.int8:  # encoded once, and the owner keeps the decoded frame's bits, as every member will
            self._widen(a, b, quant.encode(acc, self._image_of(a, b)))
            return
        if self.acc is not self.image:
            np.copyto(self.image[a:b], acc)  # the one rounding to bfloat16, at the owner
        if self.image is not self.res:
            np.copyto(self.res[a:b], self.image[a:b])

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

    def named(error: type[FTARError], message: str) -> FTARError:
        return error(message, peer=peer, quorum_id=state.quorum_id, step=state.step)

    if isinstance(exc, FTARError):
        return exc
    if isinstance(exc, (BlockingIOError, TimeoutError)):  # kernel SO_*TIMEO (EAGAIN) or Python timeout
        return named(PeerTimeout, f"no progress for {timeout_s:g} s")
    if isinstance(exc, EOFError):
        return named(PeerFailed, "connection closed")
    if isinstance(exc, wire.WireError):
        return named(ProtocolError, str(exc))
    if isinstance(exc, OSError):
        return named(PeerFailed, f"connection error: {exc.strerror or exc}")
    return exc
