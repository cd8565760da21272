"""Gradient lanes (ftjax/runtime/lanes.py): the same buffers from any replica degree, and a full and a
reduced-degree replica averaging together as one replica would on both sample sets."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ftjax.base.batches import assign
from ftjax.config import load_config
from ftjax.coordinator.layout import layout_difference
from ftjax.coordinator.quorum import Participant
from ftjax.coordinator.types import QuorumResult
from ftjax.ftar import FTAREndpoint
from ftjax.program.data import make_stream
from ftjax.program.sharding import replica_mesh
from ftjax.program.step import build_program, device_batch, topology_fingerprint, where
from ftjax.runtime.lanes import LaneFlattener, lane_regions
from ftjax.runtime.reduce import FTARReducer

LANE_CASES = {
    "sharded rows, 2 lanes of 2 devices": (
        (8, 3),
        P("fsdp", None),
        2,
        2,
        [[((0, 2), (0, 3)), ((2, 4), (0, 3))], [((4, 6), (0, 3)), ((6, 8), (0, 3))]],
    ),
    "sharded columns, 2 lanes of 1 device": ((2, 4), P(None, "fsdp"), 2, 1, [[((0, 2), (0, 2))], [((0, 2), (2, 4))]]),
    "replicated: whole in every lane": ((5,), P(), 2, 2, [[((0, 5),)], [((0, 5),)]]),
    "one lane": ((4, 4), P("fsdp"), 1, 2, [[((0, 2), (0, 4)), ((2, 4), (0, 4))]]),
}
# mesh.tensor = 2: a host's 2 devices are one tensor group (fsdp rows = hosts)
TENSOR_CASES = {
    "fsdp x tensor": (
        (4, 6),
        P("fsdp", "tensor"),
        2,
        2,
        [[((0, 2), (0, 3)), ((0, 2), (3, 6))], [((2, 4), (0, 3)), ((2, 4), (3, 6))]],
    ),
    "tensor only: every lane holds it all": ((6,), P("tensor"), 2, 2, [[((0, 3),), ((3, 6),)]] * 2),
    "fsdp only: a tensor group shares its rows": ((4, 3), P("fsdp"), 2, 2, [[((0, 2), (0, 3))], [((2, 4), (0, 3))]]),
}


@pytest.mark.parametrize("shape,spec,lanes,dph,want", LANE_CASES.values(), ids=LANE_CASES.keys())
def test_lane_regions(shape, spec, lanes, dph, want):
    assert lane_regions(shape, spec, lanes, dph) == want


@pytest.mark.parametrize("shape,spec,lanes,dph,want", TENSOR_CASES.values(), ids=TENSOR_CASES.keys())
def test_lane_regions_with_tensor_groups(shape, spec, lanes, dph, want):
    assert lane_regions(shape, spec, lanes, dph, tensor=2) == want


def test_an_axis_other_than_fsdp_and_tensor_is_refused_naming_it():
    with pytest.raises(ValueError, match="'fsdp' and 'tensor' axes only"):
        lane_regions((4, 4), P("tp", None), 2, 1)


def _tree(devices: int):
    mesh = replica_mesh(jax.devices()[:devices])
    tree = {"a": jnp.arange(32.0).reshape(8, 4), "b": jnp.arange(5.0) - 2, "c": {"d": jnp.arange(16.0).reshape(4, 4)}}
    shard = {
        "a": NamedSharding(mesh, P("fsdp", None)),
        "b": NamedSharding(mesh, P()),
        "c": {"d": NamedSharding(mesh, P(None, "fsdp"))},
    }
    return jax.device_put(tree, shard), shard


def test_every_degree_makes_the_same_lane_buffers_and_takes_them_back():
    full, full_shard = _tree(4)  # a full replica: 2 hosts x 2 devices (all in this process)
    reduced, red_shard = _tree(2)  # the same values on a reduced one: 1 host x 2 devices
    f_full = LaneFlattener(full, full_shard, lanes=2, devices_per_host=2, served=[0, 1])
    f_host1 = LaneFlattener(full, full_shard, lanes=2, devices_per_host=2, served=[1])
    f_red = LaneFlattener(reduced, red_shard, lanes=2, devices_per_host=2, served=[0, 1])
    assert f_full.size == f_red.size == 8 * 4 // 2 + 5 + 4 * 4 // 2  # a replicated leaf once per lane
    bufs_full, bufs_red = f_full.flatten(full), f_red.flatten(reduced)
    for a, b in zip(bufs_full, bufs_red):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(f_host1.flatten(full)[0], bufs_full[1])
    for flat, bufs, tree, shard in ((f_full, bufs_full, full, full_shard), (f_red, bufs_red, reduced, red_shard)):
        back = flat.unflatten([b * 2 for b in bufs])
        for x, y, s in zip(jax.tree.leaves(tree), jax.tree.leaves(back), jax.tree.leaves(shard)):
            np.testing.assert_array_equal(np.asarray(y), 2 * np.asarray(x))
            assert y.sharding == s


def _tensor_tree(devices: int):
    mesh = replica_mesh(jax.devices()[:devices], tensor=2)
    tree = {"w": jnp.arange(48.0).reshape(8, 6), "b": jnp.arange(6.0), "e": jnp.arange(12.0).reshape(4, 3), "s": 7.0}
    specs = {"w": P("fsdp", "tensor"), "b": P("tensor"), "e": P("fsdp"), "s": P()}
    shard = {k: NamedSharding(mesh, v) for k, v in specs.items()}
    return jax.device_put(tree, shard), shard


def test_tensor_groups_make_the_same_lane_buffers_on_every_degree_and_take_them_back():
    """mesh.tensor = 2: a full replica of 2 hosts x 2 devices (fsdp 2 x tensor 2) and a reduced
    one of 1 host x 2 devices (fsdp 1 x tensor 2) cut the same lanes from their 2-D shards."""
    full, full_shard = _tensor_tree(4)
    reduced, red_shard = _tensor_tree(2)
    kw = dict(lanes=2, devices_per_host=2, tensor=2)
    f_full = LaneFlattener(full, full_shard, served=[0, 1], **kw)
    f_red = LaneFlattener(reduced, red_shard, served=[0, 1], **kw)
    f_host0 = LaneFlattener(full, full_shard, served=[0], **kw)
    assert f_full.size == f_red.size == 48 // 2 + 6 + 12 // 2 + 1  # per lane: half of w and e, all of b and s
    bufs_full, bufs_red = f_full.flatten(full), f_red.flatten(reduced)
    for a, b in zip(bufs_full, bufs_red):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(f_host0.flatten(full)[0], bufs_full[0])
    w = np.arange(48.0).reshape(8, 6)  # leaves in tree order b, e, s, w: lane 1's w from offset 6 + 6 + 1
    np.testing.assert_array_equal(bufs_full[1][13:], np.concatenate([w[4:, :3].ravel(), w[4:, 3:].ravel()]))
    for flat, bufs, tree, shard in ((f_full, bufs_full, full, full_shard), (f_red, bufs_red, reduced, red_shard)):
        back = flat.unflatten([b * 2 for b in bufs])
        for x, y, sh in zip(jax.tree.leaves(tree), jax.tree.leaves(back), jax.tree.leaves(shard)):
            np.testing.assert_array_equal(np.asarray(y), 2 * np.asarray(x))
            assert y.sharding == sh


def _quorum(rank: int, lanes: list[list[str]]) -> QuorumResult:
    parts = tuple(Participant(str(i), "inc", 3, 3, tuple(a), ("c:1",), False, "") for i, a in enumerate(lanes))
    return QuorumResult(
        quorum_id=7,
        step=3,
        participants=parts,
        rank=rank,
        healing=False,
        heal_source="",
        heal_source_addresses=(),
        num_contributors=len(parts),
        data_position=3,
        no_state=False,
    )


def test_a_full_and_a_reduced_replica_average_as_one_replica_on_both_sample_sets():
    over = ["mesh.hosts=2", "mesh.devices_per_host=1", "ft.replicas=2", "ft.global_batch=constant"]
    full_cfg = load_config("tiny", over)
    red_cfg = load_config("tiny", [*over, "mesh.live_hosts=1"])
    full, red = build_program(full_cfg), build_program(red_cfg)
    assert full.mesh.devices.size == 2 and red.mesh.devices.size == 1
    assert topology_fingerprint(full) == topology_fingerprint(red)  # they may average together
    params = full.init(jnp.int32(0))["params"]
    red_params = jax.device_put(params, red.grad_shardings["params"])
    b = full_cfg.data.batch_size
    work = assign(2, b, full_cfg.micro_rows, [0, 1], own_rows={1: red_cfg.own_rows})
    assert work == {0: ((0, 0, b), (1, b // 2, b)), 1: ((1, 0, b // 2),)}
    batches = {s: make_stream(full_cfg, replica=s).batch(3) for s in (0, 1)}

    def grads(program, p, pieces):  # a contributor's gradient sum of its rows / B, as the trainer computes it
        g = program.zeros()
        rows = np.concatenate([batches[s][a:c] for s, a, c in pieces])
        for i in range(0, len(rows), full_cfg.micro_rows):
            g, _ = program.accumulate(
                g, p, {}, device_batch(program, rows[i : i + full_cfg.micro_rows]), where(3, 0, i)
            )
        return g

    g_full, g_red = grads(full, params, work[0]), grads(red, red_params, work[1])
    shapes = full.abstract_update()
    reducers = [
        FTARReducer(
            [FTAREndpoint("t") for _ in range(2)],
            LaneFlattener(shapes, prog.grad_shardings, lanes=2, devices_per_host=1, served=[0, 1]),
            divisor=2,
        )
        for prog in (full, red)
    ]
    lanes = [[e.address for e in r.endpoints] for r in reducers]
    results = {}

    def run(i, g):
        results[i] = reducers[i].tree(reducers[i].average(_quorum(i, lanes), g))

    threads = [threading.Thread(target=run, args=(i, g)) for i, g in enumerate((g_full, g_red))]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    [r.close() for r in reducers]
    # one replica on both sample sets: the mean loss over all 2B rows
    _, _, want = full.grads(params, {}, jnp.asarray(np.concatenate([batches[0], batches[1]])), where(3, 0, 0))
    for got_full, got_red, w in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(got_full), np.asarray(got_red))  # bitwise, every member
        np.testing.assert_allclose(np.asarray(got_full), np.asarray(w), rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize(
    "live, lanes, served",
    [(1, 1, [[0]]), (2, 2, [[0], [1]]), (1, 2, [[0, 1]]), (2, 4, [[0, 1], [2, 3]]), (3, 6, [[0, 1], [2, 3], [4, 5]])],
)
def test_each_lane_is_served_by_exactly_one_host_and_lane_host_finds_it(live, lanes, served):
    from ftjax.runtime.lanes import lane_host, served_lanes

    assert [served_lanes(h, live, lanes) for h in range(live)] == served
    assert [lane_host(lane, live, lanes) for lane in range(lanes)] == [h for h in range(live) for _ in served[h]]


def test_another_model_size_has_another_fingerprint_and_the_difference_names_its_leaves():
    # Issue 26 item 3: `model.d_model=128` had the same fingerprint as 64 (specs only), was admitted,
    # then crashed with a LayoutMismatch. The layout now carries every leaf's shape and dtype.
    small, big = build_program(load_config("tiny", [])), build_program(load_config("tiny", ["model.d_model=128"]))
    assert topology_fingerprint(small) != topology_fingerprint(big)
    why = layout_difference(small.topology(), big.topology())
    assert "items differ" in why and "(64," in why and "(128," in why and "['params']" in why, why
    assert layout_difference(small.topology(), build_program(load_config("tiny", [])).topology()) == ""


def test_a_replica_of_another_job_identity_has_another_topology_naming_the_setting():
    # A replica started with another learning rate was admitted (the layout had only shapes), trained
    # the job with it, and on a tie of digests healed its peers to its own state.
    from ftjax.runtime.replica import _topology

    def topology(*overrides):
        cfg = load_config("tiny", list(overrides))
        return _topology(cfg, build_program(cfg), "data-fp")

    base = topology()
    why = layout_difference(base, topology("optim.lr=0.1"))
    assert why.startswith("; 1 items differ: job optim.lr (job: 0.003; this replica: 0.1)"), why
    assert "job seed" in layout_difference(base, topology("seed=1"))
    # where the weights to start from lie is not the job's identity (each machine has its copy)
    assert layout_difference(topology("checkpoint.init_from=/a/w"), topology("checkpoint.init_from=/b/w")) == ""
    assert "job checkpoint.init_opt" in layout_difference(base, topology("checkpoint.init_from=/a/w"))
