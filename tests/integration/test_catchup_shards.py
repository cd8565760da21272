"""Catch-up host by host: a host's shards travel from memory to memory and land in the newcomer's
own shardings, and the leader installs only what every host of its replica fetched, of one step."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fakes import Events, OneHost, participant, quorum
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ftjax.runs.events import ReplicaEvent as E
from ftjax.runtime import catchup
from ftjax.runtime.catchup import (
    HostShards,
    LayoutMismatch,
    Piece,
    ReceiveArena,
    ShardTransport,
    SnapshotFetch,
    SnapshotServer,
    _Snapshot,
    source_hosts,
)
from ftjax.runtime.protocol import HealOrder, StepProtocol
from ftjax.runtime.replay import ReplayBuffer

TOKEN = "test-token"


def mesh(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), ("x",))


def state_on(m: Mesh):
    """A small train state: a sharded matrix, a replicated vector, a bfloat16 leaf and a scalar."""
    rng = np.random.default_rng(0)
    return {
        "params": {
            "w": jax.device_put(rng.standard_normal((8, 6), np.float32), NamedSharding(m, P("x"))),
            "b": jax.device_put(rng.standard_normal(6).astype(np.float32), NamedSharding(m, P())),
        },
        "mu": jax.device_put(jnp.asarray(rng.standard_normal((4, 8)), jnp.bfloat16), NamedSharding(m, P(None, "x"))),
        "count": jax.device_put(jnp.int32(7), NamedSharding(m, P())),
    }


def abstract(state, m: Mesh):
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(m, a.sharding.spec)), state
    )


def assert_same(got, want) -> None:
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))


def test_a_state_crosses_the_network_bitwise_and_replicated_shards_travel_once():
    src = state_on(mesh(4))
    server, client = ShardTransport(TOKEN, rate_limit_mbps=None, timeout_s=30), None
    try:
        server.offer("b/1", src, 12, {"step": 12, "data_position": 30})
        client = ShardTransport(TOKEN, rate_limit_mbps=None, timeout_s=30)
        fetch = client.fetch(server.address, "b/1", source="a", min_step=12)
        assert fetch.done.wait(30) and fetch.error is None, fetch.error
        got = fetch.result
        assert (got.step, got.meta, got.source) == (12, {"step": 12, "data_position": 30}, "a")
        # one piece per distinct region: 4 of w, 4 of mu, 1 of b and 1 of count (not 4 each)
        assert len(got.shards.pieces) == 10 and got.nbytes == sum(a.nbytes for a in jax.tree.leaves(src))
        assert_same(client.load(got, abstract(src, mesh(4))), src)
    finally:
        server.close()
        if client is not None:
            client.close()


def test_a_snapshot_lands_in_the_arena_mapped_for_it_and_what_does_not_fit_spills():
    # issue 32: a newcomer's receive arena (mapped ahead for its own layout) holds every piece of
    # the snapshot, 64-byte aligned, and serves one fetch; a smaller one holds the pieces that fit
    # and the rest are allocated on their own; either way the state is placed bitwise
    src = state_on(mesh(4))
    into = abstract(src, mesh(4))
    server = ShardTransport(TOKEN, rate_limit_mbps=None, timeout_s=30)
    try:
        server.offer("b/1", src, 12, {"step": 12})
        for arena, inside in ((ReceiveArena.for_state(into), 10), (ReceiveArena(300), 5)):  # (4 of w, b)
            assert arena is not None and arena.ready(30)
            base, size = arena._buffer.ctypes.data, len(arena._buffer)
            client = ShardTransport(TOKEN, rate_limit_mbps=None, timeout_s=30, arena=arena)
            try:
                fetch = client.fetch(server.address, "b/1", source="a", min_step=12)
                assert client.arena is None  # (one fetch takes it)
                assert fetch.done.wait(30) and fetch.error is None, fetch.error
                at = [p.data.ctypes.data - base for p in fetch.result.shards.pieces]
                assert sum(0 <= a < size for a in at) == inside and all(a % 64 == 0 for a in at if 0 <= a < size), at
                inner = [p.data.nbytes for p, a in zip(fetch.result.shards.pieces, at) if 0 <= a < size]
                assert fetch.result.arena_bytes == sum(inner)
                assert_same(client.load(fetch.result, into), src)
                assert arena.take() is None
            finally:
                client.close()
        # b and count once (replicated), every piece rounded up to 64 bytes (w's 4 and mu's 4 of 48 and
        # 16), and 8 x 64 bytes a piece for the cuts of a source of more hosts
        assert ReceiveArena.for_state(into).nbytes == 8 * 64 + 64 + 64 + 10 * 8 * 64
    finally:
        server.close()


def test_the_newcomer_may_have_another_device_count():
    src = state_on(mesh(4))
    for n in (2, 1):  # regions of 2 (or all 4) source shards assembled into one
        into = abstract(src, mesh(n))
        got = HostShards.take(src).to_state(into)
        assert_same(got, src)
        assert got["params"]["w"].sharding == into["params"]["w"].sharding


SOURCE_HOSTS = {  # (this host, its replica's hosts, the source's hosts) -> the source hosts it fetches from
    "same degree": ((1, 2, 2), [1]),
    "a reduced newcomer: every host of a full source": ((0, 1, 2), [0, 1]),
    "a full newcomer from a reduced source": ((1, 2, 1), [0]),
    "4 hosts from 2": ((3, 4, 2), [1]),
    "2 hosts from 3 (slices that straddle)": ((1, 2, 3), [1, 2]),
}


@pytest.mark.parametrize("args,want", SOURCE_HOSTS.values(), ids=SOURCE_HOSTS.keys())
def test_source_hosts(args, want):
    assert source_hosts(*args) == want


def _host_part(state, host: int, hosts: int) -> dict:
    """What host `host` of `hosts` holds of a state laid out over this process's devices."""
    whole = HostShards.take(state)
    n = len(jax.devices()[:4]) // hosts
    keep = []
    for leaf, region_shape in whole.leaves.items():
        shape = region_shape[0]
        for p in (p for p in whole.pieces if p.leaf == leaf):
            # a sharded dimension is cut in 4 (the devices); host h holds blocks h*n .. h*n + n - 1
            cut = [i for i, ((a, b), d) in enumerate(zip(p.region, shape)) if b - a != d]
            if not cut or host * n <= p.region[cut[0]][0] * 4 // shape[cut[0]] < (host + 1) * n:
                keep.append(p)
    return HostShards(whole.leaves, keep)


def test_a_reduced_newcomer_fetches_from_every_host_of_its_source_over_the_network():
    src = state_on(mesh(4))
    servers = [ShardTransport(TOKEN, rate_limit_mbps=None, timeout_s=30) for _ in range(2)]
    arena = ReceiveArena.for_state(abstract(src, mesh(2)))  # (the newcomer's own layout: 2 devices)
    client = ShardTransport(TOKEN, rate_limit_mbps=None, timeout_s=30, arena=arena)
    try:
        from ftjax.runtime.catchup import _Snapshot

        for h, server in enumerate(servers):  # host h of a 2-host source serves its half
            server.server.publish(_Snapshot("b/1", 12, {"step": 12}, _host_part(src, h, 2)))
        fetch = client.fetch([servers[k].address for k in source_hosts(0, 1, 2)], "b/1", source="a", min_step=12)
        assert fetch.done.wait(30) and fetch.error is None, fetch.error
        assert fetch.result.nbytes >= sum(a.nbytes for a in jax.tree.leaves(src))  # both halves came
        assert fetch.result.arena_bytes == fetch.result.nbytes  # (smaller pieces, a replicated leaf twice: all in)
        assert_same(client.load(fetch.result, abstract(src, mesh(2))), src)
        one = client.fetch([servers[0].address], "b/1", source="a", min_step=12)  # half is not enough
        assert one.done.wait(30)
        with pytest.raises(LayoutMismatch, match=r"this host needs region .* of which the source's hosts sent"):
            client.load(one.result, abstract(src, mesh(2)))
    finally:
        for t in (*servers, client):
            t.close()


def test_a_host_that_lacks_a_region_it_needs_is_an_error_naming_the_leaf():
    src = state_on(mesh(4))
    w = src["params"]["w"]
    whole = HostShards.take(src)
    # what host 0 of a 2-host source holds of w: its rows 0-3 (devices 0 and 1)
    half = HostShards(whole.leaves, [p for p in whole.pieces if p.leaf != "['params']['w']" or p.region[0][1] <= 4])
    rows = NamedSharding(mesh(2), P("x"))  # device 0 needs rows 0-3 (held), device 1 rows 4-7 (not)
    with pytest.raises(LayoutMismatch, match=r"\['params'\]\['w'\]: this host needs region \[\(4, 8\), \(0, 6\)\]"):
        half.to_state(
            {
                **abstract(src, mesh(2)),
                "params": {
                    "w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=rows),
                    "b": abstract(src, mesh(2))["params"]["b"],
                },
            }
        )
    bad = {**abstract(src, mesh(4)), "count": jax.ShapeDtypeStruct((), jnp.float32)}
    with pytest.raises(LayoutMismatch, match=r"\['count'\]: the source has shape/dtype"):
        whole.to_state(bad)
    with pytest.raises(LayoutMismatch, match="missing"):
        whole.to_state({**abstract(src, mesh(4)), "extra": abstract(src, mesh(4))["count"]})


# --- the leader's decision over every host's fetch ------------------------------------------------
class Fetch:
    def __init__(self, source="a"):
        self.source, self.done, self.result, self.error = source, threading.Event(), None, None


def healing_quorum():
    a, me = participant("a", 10, 10), participant("me", 0, 3, healing=True, source="a")
    return quorum(4, 10, [a, me], "me", healing=True, source="a", position=3)


def done(step):
    return {"done": True, "error": None, "step": step}


RUNNING = {"done": False, "error": None, "step": None}


@pytest.mark.parametrize(
    "hosts, order, event",
    [
        ([done(9), done(9)], HealOrder(install=True), None),
        ([done(9), RUNNING], HealOrder(), None),  # host 1 still fetching: wait for it
        (
            [RUNNING, {"done": True, "error": "ConnectionError: reset", "step": None}],
            HealOrder(drop=True, fetch_min_step=10),
            E.CATCHUP_FAILED,
        ),  # no waiting for the others: again at once
        ([done(9), done(10)], HealOrder(drop=True, fetch_min_step=10), E.CATCHUP_FAILED),  # parts of two states
    ],
)
def test_the_leader_installs_only_what_every_host_fetched_of_one_step(tmp_path, hosts, order, event):
    log = Events()
    p = StepProtocol(
        replica_id="me",
        incarnation="me-inc",
        group=OneHost(),
        reducer=None,
        transport=None,
        quorums=None,
        buffer=ReplayBuffer(tmp_path / "replay", 8),
        log=log,
    )
    p.fetch = Fetch()
    assert p._heal_bookkeeping(healing_quorum(), hosts) == order
    assert (log.kinds()[:1] or [None])[0] == event
    if event == E.CATCHUP_FAILED:
        assert "host 1" in log.events[0][1]["error"] or "different steps [9, 10]" in log.events[0][1]["error"]


def test_every_host_fetches_from_the_same_host_of_the_source(tmp_path):
    class Host1(OneHost):
        rank, hosts = 1, 2

    asked = []

    class Transport:
        def fetch(self, address, key, *, source, min_step):
            asked.append((address, key, source, min_step))
            return Fetch(source)

    p = StepProtocol(
        replica_id="me",
        incarnation="me-inc",
        group=Host1(),
        reducer=None,
        transport=Transport(),
        quorums=None,
        buffer=ReplayBuffer(tmp_path / "replay", 8),
        log=Events(),
    )
    q = healing_quorum()
    q = type(q)(**{**q.__dict__, "heal_source_addresses": ("a-host0:2", "a-host1:2")})
    assert p._carry_out(q, HealOrder(fetch_min_step=7)).install is None
    assert asked == [(["a-host1:2"], "me/me-inc", "a", 7)]
    fetched = p.fetch.result = object()
    assert p._carry_out(q, HealOrder(install=True)).install is fetched and p.fetch is None


def _published(server: SnapshotServer, leaves: dict[str, np.ndarray], step: int = 3) -> None:
    shards = HostShards(
        {k: (v.shape, v.dtype.name) for k, v in leaves.items()},
        [Piece(k, tuple((0, n) for n in v.shape), v) for k, v in leaves.items()],
    )
    server.publish(_Snapshot("peer", step, {}, shards))


def test_parallel_streams_share_one_rate_limit_and_outlive_the_quorum_that_offered(monkeypatch):
    # issue 32: ranges of one large piece and several small ones over 4 connections at once land in
    # place, bitwise; the rate limit holds for their sum (1.5 MB at 1 MB/s: >= ~1.25 s with the burst),
    # progress counts up to the total, and a `keep_only` mid-transfer (the quorum moved on) does not
    # cut it: the fetch holds a lease until its last byte
    rng = np.random.default_rng(1)
    leaves = {
        "big": rng.integers(0, 255, 1_200_000, np.uint8),
        **{f"s{i}": np.full(75_000, i, np.uint8) for i in range(4)},
    }
    monkeypatch.setattr(catchup, "_MIN_RANGE", 100_000)  # 15 ranges, not one
    server = SnapshotServer(TOKEN, rate_limit_mbps=1.0)
    try:
        _published(server, leaves)
        fetch = SnapshotFetch(server.address, "peer", TOKEN, source="a", streams=4)
        # wait (however long a loaded machine takes to start) for bytes past the limiter's first burst:
        # from there the rate is the limit's, so the estimate is > 0 s and ~1 s of transfer is left
        deadline = time.monotonic() + 30
        while (seen := fetch.progress())["bytes_done"] <= 300_000 and not fetch.done.is_set():
            assert time.monotonic() < deadline, f"{seen['bytes_done']} bytes in 30 s"
            time.sleep(0.01)
        server.keep_only(set())  # mid-transfer
        assert fetch.done.wait(30) and fetch.error is None, fetch.error
        assert 0 < seen["bytes_done"] < seen["bytes_total"] == 1_500_000 and seen["eta_s"] > 0, seen
        assert fetch.progress()["bytes_done"] == 1_500_000 and fetch.result.seconds >= 1.2, fetch.result
        for p in fetch.result.shards.pieces:
            assert np.array_equal(p.data, leaves[p.leaf]), p.leaf
        # the lease goes once the server's handler has counted its last range sent, which on a
        # loaded machine may be just after the client has read it
        deadline = time.monotonic() + 10
        while server._leases and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not server._leases, "a finished transfer's lease is dropped"
    finally:
        server.close()


def test_a_refused_fetch_names_the_source_and_streams_must_be_positive():
    server = SnapshotServer(TOKEN)
    try:
        _published(server, {"a": np.zeros(10, np.uint8)})
        fetch = SnapshotFetch(server.address, "peer", "wrong-token", source="a")
        assert fetch.done.wait(10) and "source a" in fetch.error and "401" in fetch.error, fetch.error
        with pytest.raises(ValueError, match="streams"):
            SnapshotFetch(server.address, "peer", TOKEN, source="a", streams=0)
    finally:
        server.close()
