"""FTAR in one process: the schedule, the numbers (property tests over world sizes, lengths, dtypes,
wire dtypes, streams per link and zero-contributors, against numpy), link reuse across quorums, bad
input, and frames that do not belong to the call."""

from __future__ import annotations

import collections
import glob
import itertools
import os
import socket
import threading
import time

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftjax.ftar import (
    FTAREndpoint,
    FTARError,
    HandshakeRefused,
    PeerFailed,
    PeerTimeout,
    ProtocolError,
    quant,
    shm,
    wire,
)
from ftjax.ftar.ring import AG, RS, Ring, schedule

TOKEN = "test-token"
CHUNK_BYTES = 64  # 16 float32 elements: most buffers below span many chunks per segment
BF16 = np.dtype(ml_dtypes.bfloat16)
_quorums = itertools.count(1)


def run_ring(endpoints, bufs, contributors=None, *, quorum_id=None, step=0, members=None, timeout=20.0):
    """One all-reduce, each of ``endpoints`` in its own thread (``members``: the ring they are
    told about, by default just them). Returns (results, errors) in the order of ``endpoints``."""
    quorum_id = next(_quorums) if quorum_id is None else quorum_id
    members = [ep.address for ep in endpoints] if members is None else members
    results, errors = [None] * len(endpoints), [None] * len(endpoints)

    def member(i):
        try:
            results[i] = endpoints[i].allreduce(
                bufs[i],
                quorum_id=quorum_id,
                step=step,
                members=members,
                rank=members.index(endpoints[i].address),
                contributors=contributors,
            )
        except Exception as exc:
            errors[i] = exc

    threads = [threading.Thread(target=member, args=(r,), daemon=True) for r in range(len(endpoints))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "an allreduce did not return"
    return results, errors


# (shared memory, streams per link, wire dtype) of the pools below
POOLS = {
    "shm": (True, 1, "float32"),
    "tcp": (False, 1, "float32"),
    "tcp-3streams": (False, 3, "float32"),
    "shm-bf16wire": (True, 3, "bfloat16"),  # 3 streams asked for: a shared-memory link keeps one
    "tcp-3streams-bf16wire": (False, 3, "bfloat16"),
    "shm-int8wire": (True, 1, "int8"),
    "tcp-3streams-int8wire": (False, 3, "int8"),
}


@pytest.fixture(scope="module", params=list(POOLS.values()), ids=list(POOLS))
def pool(request):
    """Five endpoints reused by every example: each example picks a subset in a random order under
    a fresh quorum id, so membership changes, link reuse and re-dials are exercised as a side effect.
    With same-host links through shared memory (the default) or TCP links only, one or three
    connections per link, float32 or bfloat16 frames."""
    shared_memory, streams, wire_dtype = request.param
    eps = [
        FTAREndpoint(
            TOKEN, chunk_bytes=CHUNK_BYTES, timeout_s=10, shared_memory=shared_memory, streams=streams,
            wire_dtype=wire_dtype,
        )
        for _ in range(5)
    ]  # fmt: skip
    yield eps
    for ep in eps:
        ep.close()
    links = sum(ep.stats["dials"] for ep in eps)
    assert sum(ep.stats["shm_dials"] for ep in eps) == (links if shared_memory else 0)


# --- the schedule, without sockets -----------------------------------------------------------------
@given(n=st.integers(0, 300), world=st.integers(2, 5), chunk=st.integers(1, 40))
@settings(max_examples=60, deadline=None)
def test_schedule_is_consistent_and_reduces_correctly(n, world, chunk):
    plans = [schedule(n, world, r, chunk) for r in range(world)]
    for r in range(world):
        left_sends = plans[(r - 1) % world][0]
        assert [(c.phase, c.start, c.stop) for c in plans[r][1]] == [(c.phase, c.start, c.stop) for c in left_sends]
    # run the schedules against each other, each member sending as soon as its dependency is met
    # and receiving in order: every member must end with the total
    data = [np.arange(n) * (r + 1) for r in range(world)]
    acc = [d.copy() for d in data]
    res = [np.full(n, -1) for _ in range(world)]
    inbox = [collections.deque() for _ in range(world)]
    sent, done = [0] * world, [0] * world
    progress = True
    while progress:
        progress = False
        for r, (sends, recvs) in enumerate(plans):
            while sent[r] < len(sends) and sends[sent[r]].need < done[r]:
                c = sends[sent[r]]
                src = res[r] if c.phase == AG else (data[r] if c.first else acc[r])
                inbox[(r + 1) % world].append((c, src[c.start : c.stop].copy()))
                sent[r] += 1
                progress = True
            while inbox[r]:
                c, payload = inbox[r].popleft()
                mine = recvs[done[r]]
                assert (mine.phase, mine.start, mine.stop) == (c.phase, c.start, c.stop)
                if c.phase == RS:
                    acc[r][c.start : c.stop] = payload + data[r][c.start : c.stop]
                    if mine.owned:
                        res[r][c.start : c.stop] = acc[r][c.start : c.stop]
                else:
                    res[r][c.start : c.stop] = payload
                done[r] += 1
                progress = True
    assert sent == [len(p[0]) for p in plans] and done == [len(p[1]) for p in plans]
    for r in range(world):
        np.testing.assert_array_equal(res[r], sum(data))


# --- the numbers ---------------------------------------------------------------------------------
@st.composite
def cases(draw):
    world = draw(st.integers(1, 5))
    n = draw(st.one_of(st.integers(0, 8), st.integers(9, 2000)))  # tiny ones, and multi-chunk ones
    dtype = draw(st.sampled_from([np.dtype(np.float32), BF16]))
    contributors = draw(st.lists(st.booleans(), min_size=world, max_size=world).filter(any))
    order = draw(st.permutations(range(5)))[:world]
    seed = draw(st.integers(0, 2**32 - 1))
    return world, n, dtype, contributors, order, seed


@given(case=cases())
@settings(max_examples=60, deadline=None)
def test_allreduce_matches_numpy(pool, case):
    world, n, dtype, contributors, order, seed = case
    rng = np.random.default_rng(seed)
    bufs = [rng.standard_normal(n).astype(np.float32).astype(dtype) for _ in range(world)]
    endpoints = [pool[i] for i in order]
    results, errors = run_ring(endpoints, bufs, contributors)
    assert errors == [None] * world
    contributed = [b.astype(np.float64) for b, c in zip(bufs, contributors) if c]
    expected = np.sum(contributed, axis=0) / len(contributed) if n else np.zeros(0)
    for res in results:
        assert res.dtype == dtype and res.shape == (n,)
        # identical bits everywhere: replicas must not drift apart
        assert res.view(np.uint8).tobytes() == results[0].view(np.uint8).tobytes()
    if endpoints[0].wire_dtype == "bfloat16":
        check_bf16_wire_result(results[0], expected, contributed, world)
        return
    if endpoints[0].wire_dtype == "int8":
        check_int8_wire_result(results[0], expected, contributed, world)
        return
    # float32: a sum of <= 5 terms in another order; bfloat16: one rounding of the float32 result
    rtol, atol = (1e-6, 1e-6) if dtype == np.float32 else (2**-8, 1e-6)
    np.testing.assert_allclose(results[0].astype(np.float64), expected, rtol=rtol, atol=atol * 8)


def check_bf16_wire_result(res, expected, contributed, world):
    """A bfloat16 wire: the result is a bfloat16 value (whatever the buffer dtype), within bfloat16
    rounding of each hop's partial sum (at most ``world`` of them, each |partial| <= sum |x|: a
    relative error of 2**-9 each, in the worst case) and of the average."""
    assert (res.astype(BF16).astype(res.dtype).view(np.uint8) == res.view(np.uint8)).all()
    if not res.size:
        return
    magnitude = np.sum(np.abs(contributed), axis=0) / len(contributed)
    bound = world * 2**-9 * magnitude + 2**-8 * np.abs(expected) + 1e-30
    assert (np.abs(res.astype(np.float64) - expected) <= bound).all()


def check_int8_wire_result(res, expected, contributed, world):
    """An int8 wire: the result within the int8 frames' error of each hop's partial sum (at most
    ``world`` - 1 of them, each within half a row's scale: |partial| / 254, |partial| <= sum |x|,
    divided by the contributors) and of the average's own frame (|average| / 254)."""
    if not res.size:
        return
    top = np.max(np.sum(np.abs(contributed), axis=0))
    bound = (world / len(contributed) + 1) * top / 254 * (1 + 1e-5)
    assert np.max(np.abs(res.astype(np.float64) - expected)) <= bound
    # and not the float32 average: the frames did quantize (where the values are not few exact ones)
    if res.size > 8:
        assert not np.allclose(res, expected, rtol=1e-6, atol=0)


def test_bfloat16_rounds_once_at_the_owner(pool):
    """Three bfloat16 values whose float32 sum is exact but whose pairwise bfloat16 sums are not: the
    result must be the float32 sum rounded once."""
    if pool[0].wire_dtype != "float32":
        pytest.skip("a bfloat16 or int8 wire rounds each hop's partial sum (by design)")
    a, b, c = (np.array([v] * 50, dtype=BF16) for v in (256.0, 1.0, 1.0))
    results, errors = run_ring(pool[:3], [a, b, c])
    assert errors == [None] * 3
    expected = np.float32(258.0 / 3).astype(BF16)  # bf16(256 + 1) would already lose the 1
    assert all((r == expected).all() for r in results)


class Filling:
    """A buffer that starts as NaN and is filled in slices by a thread (a device-to-host copy in
    flight), with the pipeline's hooks: `ready` waits for a range, `on_result` counts each element."""

    def __init__(self, data: np.ndarray, slices: int):
        self.data, self.buf = data, np.full_like(data, np.nan)
        self.filled, self.cond = 0, threading.Condition()
        self.results = np.zeros(data.size, np.int64)
        self.thread = threading.Thread(target=self._fill, args=(slices,), daemon=True)

    def _fill(self, slices: int) -> None:
        for a, b in itertools.pairwise(np.linspace(0, self.data.size, slices + 1).astype(int)):
            time.sleep(0.002)
            self.buf[a:b] = self.data[a:b]
            with self.cond:
                self.filled = b
                self.cond.notify_all()

    def ready(self, a: int, b: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.filled >= b)

    def on_result(self, a: int, b: int) -> None:
        self.results[a:b] += 1


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_buffer_still_filling_is_read_only_where_ready_and_every_result_is_announced_once(pool, world):
    """The pipeline's hooks: members start the call on NaN buffers still being filled; a ring that read
    a range before `ready` said so would carry a NaN into the average."""
    rng = np.random.default_rng(world)
    fills = [Filling(rng.standard_normal(3001).astype(np.float32), slices=40) for _ in range(world)]
    members, quorum_id, results = [ep.address for ep in pool[:world]], next(_quorums), [None] * world

    def member(i):
        fills[i].thread.start()
        results[i] = pool[i].allreduce(
            fills[i].buf, quorum_id=quorum_id, step=0, members=members, rank=i,
            ready=fills[i].ready, on_result=fills[i].on_result,
        )  # fmt: skip

    threads = [threading.Thread(target=member, args=(i,), daemon=True) for i in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    expected = np.mean([f.data.astype(np.float64) for f in fills], axis=0)
    tol = 1e-6 if pool[0].wire_dtype == "float32" else world * 2**-7  # |data| < ~5: bfloat16 per hop
    for f, res in zip(fills, results):
        np.testing.assert_allclose(res, expected, rtol=tol, atol=tol * 5)
        assert (f.results == 1).all(), np.flatnonzero(f.results != 1)[:10]


def test_world_of_one_returns_the_buffer(pool):
    buf = np.arange(10, dtype=np.float32)
    out = pool[0].allreduce(buf, quorum_id=next(_quorums), step=0, members=[pool[0].address], rank=0)
    if pool[0].wire_dtype == "int8":  # quantized alone as a ring's owner quantizes: the same values in any world
        buf = quant.decode(quant.encode(buf), buf.size)
    np.testing.assert_array_equal(out, buf)
    assert out is not buf


LINK_KINDS = pytest.mark.parametrize(
    "shared_memory, streams", [(True, 1), (False, 1), (True, 3), (False, 3)], ids=["shm", "tcp", "shm-3", "tcp-3"]
)


@LINK_KINDS
def test_same_and_changed_quorum_reuse_links(shared_memory, streams):
    eps = [FTAREndpoint(TOKEN, chunk_bytes=CHUNK_BYTES, shared_memory=shared_memory, streams=streams) for _ in range(3)]
    per_link = 1 if shared_memory else streams  # connections: a shared-memory link keeps one
    try:
        bufs = [np.full(100, r, np.float32) for r in range(3)]
        q = next(_quorums)
        assert run_ring(eps, bufs, quorum_id=q, step=0)[1] == [None] * 3
        dials = [ep.stats["dials"] for ep in eps]
        assert dials == [per_link] * 3
        assert run_ring(eps, bufs, quorum_id=q, step=1)[1] == [None] * 3
        assert [ep.stats["dials"] for ep in eps] == dials  # same quorum: no new connection
        # member 2 leaves: link 0 -> 1 stays, 1 -> 0 is new, 1 -> 2 and 2 -> 0 are dropped
        results, errors = run_ring(eps[:2], bufs[:2], quorum_id=next(_quorums))
        assert errors == [None, None]
        np.testing.assert_array_equal(results[0], np.full(100, 0.5, np.float32))
        assert [ep.stats["dials"] for ep in eps[:2]] == [per_link, 2 * per_link]
    finally:
        for ep in eps:
            ep.close()


# --- same-host links through shared memory -------------------------------------------------------
def _segment_files() -> set[str]:
    return set(glob.glob(os.path.join(shm.SHM_DIR, shm.NAME_PREFIX + "*")))


def test_same_host_links_use_shared_memory_and_leave_no_file_behind():
    before = _segment_files()
    eps = [FTAREndpoint(TOKEN, chunk_bytes=CHUNK_BYTES) for _ in range(3)]
    try:
        bufs = [np.arange(1000, dtype=np.float32) * (r + 1) for r in range(3)]
        for quorum_members in (eps, eps[::-1], eps[:2]):  # new links each time, some kept
            results, errors = run_ring(quorum_members, bufs[: len(quorum_members)])
            assert errors == [None] * len(quorum_members)
            scale = sum(range(1, len(quorum_members) + 1)) / len(quorum_members)
            np.testing.assert_array_equal(results[0], np.arange(1000, dtype=np.float32) * np.float32(scale))
        assert all(ep.stats["shm_dials"] == ep.stats["dials"] > 0 for ep in eps)
        assert sum(ep.stats["shm_accepted"] for ep in eps) == sum(ep.stats["dials"] for ep in eps)
        assert _segment_files() == before  # every name unlinked once the peer had mapped it
    finally:
        for ep in eps:
            ep.close()


def test_link_to_an_endpoint_without_shared_memory_carries_payloads_over_tcp():
    a = FTAREndpoint(TOKEN, chunk_bytes=CHUNK_BYTES)  # offers, but b declines
    b = FTAREndpoint(TOKEN, chunk_bytes=CHUNK_BYTES, shared_memory=False)  # offers nothing
    before = _segment_files()
    try:
        results, errors = run_ring([a, b], [np.full(300, 1, np.float32), np.full(300, 4, np.float32)])
        assert errors == [None, None]
        np.testing.assert_array_equal(results[1], np.full(300, 2.5, np.float32))
        assert [a.stats["shm_dials"], b.stats["shm_dials"], a.stats["shm_accepted"], b.stats["shm_accepted"]] == [0] * 4
        assert _segment_files() == before
    finally:
        a.close()
        b.close()


def test_offers_of_a_segment_the_listener_cannot_verify_are_declined_and_bad_ones_refused():
    ep = FTAREndpoint(TOKEN)
    fake = FakePeer()
    try:
        # a well-formed name that does not exist here (another host's /dev/shm)
        missing = shm.OFFER.pack(shm.OFFER_MAGIC, 43, 2, 64, bytes(16)) + (shm.NAME_PREFIX + "0" * 32).encode()
        assert fake.dial(ep.address, 3, missing)[1] == wire.STATUS_OK and fake.mapped == 0
        # a real segment, but the offer's nonce is not the one written in it
        offer, _segment, path = shm.create_offer(2, 64)
        forged = offer[: shm.OFFER.size - 16] + bytes(16) + offer[shm.OFFER.size :]
        assert fake.dial(ep.address, 3, forged)[1] == wire.STATUS_OK and fake.mapped == 0
        assert fake.dial(ep.address, 3, offer)[1] == wire.STATUS_OK and fake.mapped == 1  # the true one
        shm.discard_offer(path)
        # a path outside /dev/shm's segments is never opened
        escape = shm.OFFER.pack(shm.OFFER_MAGIC, 11, 2, 64, bytes(16)) + b"../../etc/x"
        assert fake.dial(ep.address, 3, escape)[1] == wire.STATUS_OK and fake.mapped == 0
        refused = ep.stats["refused"]
        assert fake.dial(ep.address, 3, b"JUNK" + bytes(shm.OFFER.size - 4))[1] == wire.STATUS_BAD_MESSAGE
        assert ep.stats["refused"] == refused + 1
    finally:
        ep.close()
        fake.close()


# --- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change, field",
    [
        (dict(buf=np.zeros((2, 2), np.float32)), "buf"),
        (dict(buf=np.zeros(4, np.float64)), "buf"),
        (dict(rank=1), "rank"),
        (dict(rank=-1), "rank"),
        (dict(step=-3), "step"),
        (dict(contributors=[True]), "contributors"),
        (dict(contributors=[False, False]), "contributors"),
        (dict(members=["nohost", "x:1"]), "members"),
        (dict(out=np.zeros(3, np.float32)), "out"),
        (dict(quorum_id=0), "quorum_id"),  # older than the quorum already run below
    ],
)
@LINK_KINDS
def test_bad_input_is_refused_and_changes_nothing(change, field, shared_memory, streams):
    settings = dict(chunk_bytes=CHUNK_BYTES, shared_memory=shared_memory, streams=streams)
    a, b = (FTAREndpoint(TOKEN, **settings) for _ in range(2))
    try:
        bufs = [np.ones(8, np.float32), np.full(8, 3, np.float32)]
        assert run_ring([a, b], bufs, quorum_id=5)[1] == [None, None]
        call = dict(buf=bufs[0], quorum_id=6, step=0, members=[a.address, b.address], rank=0)
        call.update(change)
        with pytest.raises(ValueError, match=field):
            a.allreduce(**call)
        # nothing changed: the same ring still works, with its cached links and quorum floor
        results, errors = run_ring([a, b], bufs, quorum_id=5, step=1)
        assert errors == [None, None]
        np.testing.assert_array_equal(results[0], np.full(8, 2, np.float32))
        assert a.stats["dials"] == (1 if shared_memory else streams)
    finally:
        a.close()
        b.close()


# --- frames and hellos that do not belong ---------------------------------------------------------
class FakePeer:
    """A hand-driven member: a listener that accepts the real member's link, and a link of its own to
    the real member, over which the test sends whatever frames it likes."""

    def __init__(self, token: str = TOKEN) -> None:
        self.token = token.encode()
        self.accepted = threading.Event()  # the real member's link is up
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()  # one per stream

    def _serve(self, conn):
        try:
            wire.read_hello(conn, self.token)
            shm.read_offer(conn, accept=False)  # payloads on TCP, where we read them
            conn.sendall(bytes([wire.STATUS_OK, 0]))
            self.accepted.set()
            while conn.recv(1 << 16):  # swallow the real member's frames
                pass
        except (OSError, EOFError, wire.WireError):
            pass

    def dial(self, target: str, quorum_id: int, offer: bytes = shm.NO_OFFER) -> tuple[socket.socket, int]:
        """Open a ring link; with an offer of shared memory, ``self.mapped`` says if it was taken."""
        sock = socket.create_connection(wire.parse_address(target), timeout=5)
        sock.sendall(wire.encode_hello(self.token, wire.Hello(wire.KIND_RING, quorum_id, self.address)) + offer)
        status = wire.recv_exact(sock, 1)[0]
        if status == wire.STATUS_OK:
            self.mapped = wire.recv_exact(sock, 1)[0]
        return sock, status

    def close(self):
        self.listener.close()


def _first_frame_of_left(ep, fake, n):
    """What the real member (rank 0 of [ep, fake]) expects first from its left neighbour."""
    members = [ep.address, fake.address]
    meta = wire.call_fingerprint(
        n, np.dtype(np.float32), ep.chunk_elems, members, [True, True], 2, ep.wire_dtype, ep.streams
    )
    return members, meta, schedule(n, 2, 1, ep.chunk_elems)[0][0]


@pytest.mark.parametrize("streams", [1, 3])
@pytest.mark.parametrize("link", ["tcp", "shm"])
@pytest.mark.parametrize("fault", ["step", "quorum_id", "meta", "length", "checksum", "place"])
def test_frame_that_does_not_belong_raises_and_endpoint_recovers(fault, link, streams):
    """The fake left neighbour dials connection 0 only (with 3 streams, the others are still awaited
    when its frame 0 arrives: the error must end them too)."""
    checksum = fault == "checksum"
    ep = FTAREndpoint(TOKEN, chunk_bytes=CHUNK_BYTES, timeout_s=5, checksum=checksum, streams=streams)
    fake = FakePeer()
    try:
        n, q, step = 40, 7, 3
        members, meta, first = _first_frame_of_left(ep, fake, n)
        box = {}

        def call():
            try:
                ep.allreduce(np.ones(n, np.float32), quorum_id=q, step=step, members=members, rank=0)
            except FTARError as exc:
                box["err"] = exc

        t = threading.Thread(target=call)
        t.start()
        offer, segment, path = (
            shm.create_offer(shm.DEFAULT_SLOTS, CHUNK_BYTES) if link == "shm" else (shm.NO_OFFER, None, None)
        )
        sock, status = fake.dial(ep.address, q, offer)
        shm.discard_offer(path)
        assert status == wire.STATUS_OK and fake.mapped == (link == "shm")
        payload = np.ones(first.stop - first.start, np.float32)
        fields = dict(quorum_id=q, step=step, phase=first.phase, seq=0, meta=meta)
        if fault in ("step", "quorum_id"):
            fields[fault] += 1
        elif fault == "meta":
            fields["meta"] ^= 1
        elif fault == "length":
            payload = payload[:-1]
        in_slot = (link == "shm") != (fault == "place")  # "place": the header says the other one
        header = wire.pack_frame(payload=memoryview(payload.view(np.uint8)), checksum=checksum, shm=in_slot, **fields)
        body = bytearray(payload.view(np.uint8).tobytes())
        if fault == "checksum":
            body[5] ^= 0x10  # one flipped bit in flight (or in the slot)
        if segment is not None:
            segment.slot(0, len(body), np.uint8)[:] = np.frombuffer(bytes(body), np.uint8)
        sock.sendall(header + (b"" if in_slot else bytes(body)) + bytes(64))
        t.join(10)
        assert not t.is_alive()
        err = box["err"]
        assert isinstance(err, ProtocolError) and err.peer == fake.address
        assert {
            "step": "step",
            "quorum_id": "quorum_id",
            "meta": "fingerprint",
            "length": "length",
            "checksum": "checksum",
            "place": "shared memory",
        }[fault] in str(err)
        sock.close()
        # the endpoint serves the next quorum with real peers
        other = FTAREndpoint(TOKEN, chunk_bytes=CHUNK_BYTES, timeout_s=5, checksum=checksum, streams=streams)
        results, errors = run_ring([ep, other], [np.ones(n, np.float32), np.full(n, 2, np.float32)], quorum_id=q + 1)
        other.close()
        assert errors == [None, None]
        np.testing.assert_array_equal(results[0], np.full(n, 1.5, np.float32))
    finally:
        ep.close()
        fake.close()


def test_checksums_on_carry_correct_results():
    eps = [FTAREndpoint(TOKEN, chunk_bytes=CHUNK_BYTES, checksum=True) for _ in range(3)]
    try:
        bufs = [np.arange(500, dtype=np.float32) * (r + 1) for r in range(3)]
        results, errors = run_ring(eps, bufs)
        assert errors == [None] * 3
        np.testing.assert_array_equal(results[2], np.arange(500, dtype=np.float32) * 2)
    finally:
        for ep in eps:
            ep.close()


def test_wrong_token_and_stale_quorum_are_refused():
    ep = FTAREndpoint(TOKEN)
    other = FTAREndpoint(TOKEN)
    try:
        bufs = [np.ones(4, np.float32)] * 2
        assert run_ring([ep, other], bufs, quorum_id=10)[1] == [None, None]
        assert FakePeer("another-job").dial(ep.address, 10)[1] == wire.STATUS_BAD_TOKEN
        assert FakePeer().dial(ep.address, 9)[1] == wire.STATUS_STALE_QUORUM
        assert FakePeer().dial(ep.address, 11)[1] == wire.STATUS_OK  # a future quorum is parked
        assert ep.stats["refused"] == 2
    finally:
        ep.close()
        other.close()


def test_dialing_a_peer_of_another_job_raises_handshake_refused():
    ep = FTAREndpoint(TOKEN, timeout_s=5)
    stranger = FTAREndpoint("another-job", timeout_s=5)
    try:
        with pytest.raises(HandshakeRefused, match="wrong job token") as info:
            ep.allreduce(np.ones(4, np.float32), quorum_id=1, step=0, members=[ep.address, stranger.address], rank=0)
        assert info.value.peer == stranger.address
    finally:
        ep.close()
        stranger.close()


def test_missing_left_neighbour_times_out_naming_it():
    ep = FTAREndpoint(TOKEN, timeout_s=0.5)
    fake = FakePeer()  # accepts our link but never dials back
    try:
        with pytest.raises(PeerTimeout) as info:
            ep.allreduce(np.ones(4, np.float32), quorum_id=1, step=0, members=[ep.address, fake.address], rank=0)
        assert info.value.peer == fake.address
    finally:
        ep.close()
        fake.close()


def test_left_neighbour_dying_before_it_dials_is_named_at_once():
    """Rank 0 of [ep, fake]: the fake takes our link, then its process "dies" (its listener closes)
    before it dials us. Nothing fails on our link to it, and no notice can come from a dead member:
    only probing its listener tells. We must raise PeerFailed naming it within about a probe
    interval, not after the 10 s link timeout."""
    ep = FTAREndpoint(TOKEN, timeout_s=10)
    fake = FakePeer()
    errors = []
    t0 = time.monotonic()

    def call():
        try:
            ep.allreduce(np.ones(64, np.float32), quorum_id=1, step=0, members=[ep.address, fake.address], rank=0)
        except FTARError as exc:
            errors.append((exc, time.monotonic() - t0))

    caller = threading.Thread(target=call)
    try:
        caller.start()
        assert fake.accepted.wait(5), "the member never dialed its right neighbour"
        fake.close()
        caller.join(15)
        assert not caller.is_alive()
        ((exc, took),) = errors
        assert isinstance(exc, PeerFailed) and exc.peer == fake.address, exc
        assert "refuses connections" in str(exc)
        assert took < 2.0, f"raised after {took:.2f} s"
    finally:
        ep.close()
        fake.close()
        caller.join(15)


def _dead_address() -> str:
    """An address nobody listens on (bound then closed)."""
    ep = FTAREndpoint(TOKEN)
    ep.close()
    return ep.address


def test_abort_notice_fails_a_member_waiting_for_a_dead_neighbour_promptly():
    """A -> B -> dead -> A: B's link to the dead member is refused; A, which only waits for a link
    from it, must raise at once (B's notice), not after its 10 s timeout, and name the dead member."""
    a, b = (FTAREndpoint(TOKEN, timeout_s=10) for _ in range(2))
    dead = _dead_address()
    try:
        members = [a.address, b.address, dead]
        errors = {}

        def call(ep, rank):
            t0 = time.monotonic()
            try:
                ep.allreduce(np.ones(64, np.float32), quorum_id=1, step=0, members=members, rank=rank)
            except FTARError as exc:
                errors[rank] = (exc, time.monotonic() - t0)

        threads = [threading.Thread(target=call, args=(ep, r)) for r, ep in enumerate((a, b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        for rank in (0, 1):
            exc, took = errors[rank]
            assert isinstance(exc, PeerFailed) and exc.peer == dead, exc
            assert took < 2.0, f"member {rank} raised after {took:.2f} s"
        # a member joining the abandoned call late fails at once too (the notice waits for it)
        t0 = time.monotonic()
        with pytest.raises(PeerFailed):
            a.allreduce(np.ones(64, np.float32), quorum_id=1, step=0, members=members, rank=0)
        assert time.monotonic() - t0 < 2.0
    finally:
        a.close()
        b.close()


def test_member_gone_between_steps_is_named_at_once_on_the_next_step():
    """Links cached from step 0 are checked before reuse: the step after a member vanished fails
    fast (not after the 10 s timeout) on every survivor, naming it."""
    eps = [FTAREndpoint(TOKEN, chunk_bytes=CHUNK_BYTES, timeout_s=10) for _ in range(3)]
    try:
        bufs = [np.ones(100, np.float32)] * 3
        q = next(_quorums)
        assert run_ring(eps, bufs, quorum_id=q, step=0)[1] == [None] * 3
        gone = eps[1].address
        eps[1].close()
        t0 = time.monotonic()
        _, errors = run_ring([eps[0], eps[2]], bufs[:2], quorum_id=q, step=1, members=[e.address for e in eps])
        assert time.monotonic() - t0 < 3.0
        assert all(isinstance(e, PeerFailed) and e.peer == gone for e in errors), errors
    finally:
        for ep in eps:
            ep.close()


def test_idle_connections_are_capped_and_a_ring_still_works():
    """Issue 26 item 9c: 3000 idle connections to an FTAR port made 1293 threads. Connections in
    their handshake are capped (MAX_HANDSHAKES): past it the oldest that said nothing is closed."""
    from ftjax.ftar import endpoint

    cap = endpoint.MAX_HANDSHAKES
    eps = [FTAREndpoint(TOKEN, chunk_bytes=CHUNK_BYTES) for _ in range(2)]
    base, peak, idle = threading.active_count(), 0, []
    try:
        for _ in range(4 * cap):
            idle.append(socket.create_connection(wire.parse_address(eps[0].address), timeout=30))
            peak = max(peak, threading.active_count())
        deadline = time.monotonic() + 60  # until the listener has taken them all in
        while eps[0].stats.get("evicted", 0) < 3 * cap and time.monotonic() < deadline:
            peak = max(peak, threading.active_count())
            time.sleep(0.01)
        assert peak <= base + cap + 4, (peak, base)
        for s in idle[: 3 * cap]:  # the oldest were closed by the listener
            assert s.recv(1) == b""
        # the newest idle ones still hold every slot: a peer's link evicts one and the ring works
        results, errors = run_ring(eps, [np.full(50, r, np.float32) for r in range(2)])
        assert errors == [None, None]
        np.testing.assert_array_equal(results[1], np.full(50, 0.5, np.float32))
    finally:
        for s in idle:
            s.close()
        for ep in eps:
            ep.close()


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "tcp"])
def test_a_retry_after_a_call_abandoned_before_it_began_reads_no_stale_frame(shared_memory):
    """Issue 26 item 5: member A enters (quorum 1, step 1) on the link to B cached from step 0 and
    sends its first frame; B is busy elsewhere (its replica waits on a partitioned host), so A times
    out and resets the link, but the reset is lost in the partition (here: another descriptor keeps
    A's socket open). B then enters the call, fails at once from A's abort notice, and both retry
    under quorum 2. B reused its cached link from A, read A's quorum-1 frame and failed the retry too
    (`frame quorum_id is 1, expected 2`). A failed call must leave no cached link behind.

    B's listener is slowed down between reading A's notice and recording it: A's call returns
    only after B acknowledged, so B must hold the notice by then (it once acknowledged first, and
    a B entering in between ran the call on its stale links: `connection closed`, not `abandoned`).
    A waits up to probe_timeout_s for each acknowledgement: 5 s here, far above the slowdown, so
    that a busy machine does not make A give up on B's answer (then nothing says B holds it)."""
    eps = [
        FTAREndpoint(TOKEN, chunk_bytes=CHUNK_BYTES, timeout_s=1, shared_memory=shared_memory, probe_timeout_s=5)
        for _ in range(2)
    ]
    members = [ep.address for ep in eps]
    record = eps[1]._on_notice

    def slow_record(notice):
        time.sleep(0.5)
        record(notice)

    eps[1]._on_notice = slow_record
    try:
        bufs = [np.full(100, r, np.float32) for r in range(2)]
        assert run_ring(eps, bufs, quorum_id=1, step=0)[1] == [None, None]  # links cached
        lost_reset = eps[0]._links_out[(members[1], 0)].dup()  # A's reset never reaches B
        with pytest.raises(PeerTimeout):  # A alone: its frame waits on B's cached link
            eps[0].allreduce(bufs[0], quorum_id=1, step=1, members=members, rank=0)
        with pytest.raises(FTARError, match="abandoned"):  # B: abandoned before it began (A's notice)
            eps[1].allreduce(bufs[1], quorum_id=1, step=1, members=members, rank=1)
        # B first: it takes whatever link from A it holds before A dials a fresh one
        results, errors = run_ring(eps[::-1], bufs[::-1], quorum_id=2, step=1, members=members)
        assert errors == [None, None], errors
        np.testing.assert_array_equal(results[0], np.full(100, 0.5, np.float32))
        lost_reset.close()
    finally:
        for ep in eps:
            ep.close()


# --- settings members must agree on -----------------------------------------------------------------
@pytest.mark.parametrize(
    "mine, theirs",
    [(dict(wire_dtype="bfloat16"), dict(wire_dtype="float32")), (dict(streams=3), dict(streams=1))],
    ids=["wire_dtype", "streams"],
)
@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "tcp"])
def test_members_that_disagree_on_wire_dtype_or_streams_fail_naming_the_peer(mine, theirs, shared_memory):
    """Each frame's fingerprint covers the wire dtype and the streams per link: the member that reads
    the other's first frame raises ProtocolError naming it; neither uses a byte of it."""
    a = FTAREndpoint(TOKEN, chunk_bytes=CHUNK_BYTES, timeout_s=5, shared_memory=shared_memory, **mine)
    b = FTAREndpoint(TOKEN, chunk_bytes=CHUNK_BYTES, timeout_s=5, shared_memory=shared_memory, **theirs)
    try:
        _, errors = run_ring([a, b], [np.ones(400, np.float32), np.full(400, 3, np.float32)])
        assert all(isinstance(e, FTARError) for e in errors), errors
        assert errors[0].peer == b.address and errors[1].peer == a.address, errors
        protocol = [e for e in errors if isinstance(e, ProtocolError)]
        assert protocol and all("fingerprint" in str(e) for e in protocol), errors
        # each serves the next quorum with a peer that agrees with it
        for ep, settings in ((a, mine), (b, theirs)):
            peer = FTAREndpoint(TOKEN, chunk_bytes=CHUNK_BYTES, timeout_s=5, shared_memory=shared_memory, **settings)
            assert run_ring([ep, peer], [np.ones(40, np.float32)] * 2)[1] == [None, None]
            peer.close()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "tcp"])
def test_bf16_wire_gives_every_member_the_owners_bits(shared_memory):
    """Values whose float32 average is not a bfloat16: each member gets the bfloat16 rounding of the
    float32 average (one rounding, at the owner), widened into its float32 result, bit for bit."""
    eps = [
        FTAREndpoint(TOKEN, chunk_bytes=CHUNK_BYTES, wire_dtype="bfloat16", shared_memory=shared_memory, streams=2)
        for _ in range(2)
    ]
    try:
        # 1 + 2**-7 is a bfloat16; the average 1 + 2**-8 is not (ties to even: 1.0)
        bufs = [np.full(100, 1 + 2**-7, np.float32), np.full(100, 1.0, np.float32)]
        results, errors = run_ring(eps, bufs)
        assert errors == [None, None]
        for res in results:
            assert res.dtype == np.float32
            np.testing.assert_array_equal(res, np.float32(1 + 2**-8).astype(BF16).astype(np.float32))
    finally:
        for ep in eps:
            ep.close()


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "tcp"])
@pytest.mark.parametrize("confirm", [True, False], ids=["confirmed", "unconfirmed"])
def test_a_member_whose_neighbour_lost_its_last_frame_does_not_return_a_result(monkeypatch, confirm, shared_memory):
    """The two generals at a ring's end (docs/design/index.md, "Split brain"): member 1's last frame to
    member 0 is lost (a partition), so member 0 times out while member 1 holds every frame it
    needs. Unconfirmed, member 1 returns the average: its replica would commit the step that
    member 0's retries in another quorum. Confirmed (the default), member 1 fails as well."""
    n = 64
    init = Ring.__init__

    def losing_last_frame(self, **kw):
        init(self, **kw)
        if kw["rank"] == 1 and kw["buf"].size == n:  # member 1's data ring (not its confirmation)
            self.sends = self.sends[:-1]

    monkeypatch.setattr(Ring, "__init__", losing_last_frame)
    eps = [FTAREndpoint(TOKEN, timeout_s=1.0, shared_memory=shared_memory, confirm=confirm) for _ in range(2)]
    try:
        results, errors = run_ring(eps, [np.full(n, 1.0 + r, np.float32) for r in range(2)])
    finally:
        for ep in eps:
            ep.close()
    assert isinstance(errors[0], FTARError) and results[0] is None, (results, errors)
    if confirm:  # (whichever times out first: member 0 on the lost frame, member 1 on its confirmation)
        assert isinstance(errors[1], FTARError) and results[1] is None, (results, errors)
    else:
        assert isinstance(errors[0], PeerTimeout) and errors[0].peer == eps[1].address, errors
        assert errors[1] is None and (results[1] == 1.5).all(), (results, errors)


def test_an_int8_wire_sends_at_least_1_8x_fewer_bytes_than_bfloat16_and_every_member_the_same_bits(monkeypatch):
    """The bytes on the sockets (every frame's header and payload, counted where FTAR sends them) of
    one all-reduce of the tiny Llama's streaming fragment (115,008 floats) between 3 members over TCP
    links, with a bfloat16 and an int8 wire; the int8 results bitwise equal on every member."""
    sent = {"n": 0}
    send_all = wire.send_all

    def counting(sock, views):
        sent["n"] += sum(memoryview(v).nbytes for v in views)
        return send_all(sock, views)

    monkeypatch.setattr(wire, "send_all", counting)
    rng = np.random.default_rng(0)
    bufs = [rng.standard_normal(115_008).astype(np.float32) * 1e-3 for _ in range(3)]
    total, results = {}, {}
    for wire_dtype in ("bfloat16", "int8"):
        eps = [FTAREndpoint(TOKEN, timeout_s=10, shared_memory=False, wire_dtype=wire_dtype) for _ in range(3)]
        try:
            run_ring(eps, bufs)  # (links dialled: the next call's bytes are its frames and confirmation)
            sent["n"] = 0
            results[wire_dtype], errors = run_ring(eps, bufs)
            total[wire_dtype] = sent["n"]
        finally:
            for ep in eps:
                ep.close()
        assert errors == [None] * 3
    assert total["bfloat16"] / total["int8"] >= 1.8, total
    print(f"bytes sent by 3 members: {total}, bfloat16 / int8 = {total['bfloat16'] / total['int8']:.3f}")
    assert all(np.array_equal(r.view(np.uint32), results["int8"][0].view(np.uint32)) for r in results["int8"])
    expected = np.mean(bufs, axis=0)
    check_int8_wire_result(results["int8"][0], expected, [b.astype(np.float64) for b in bufs], 3)
