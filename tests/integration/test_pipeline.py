"""The pipelined gradient path (ftjax/runtime/pipeline.py) against the serial one, over real FTAR
endpoints: the same bits, buffers allocated once, an update put back intact until it is applied,
a healing member's zeros, a failed ring that leaves the next step whole, and the phases recorded."""

import gc
import threading
import weakref

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ftjax.coordinator.quorum import Participant
from ftjax.coordinator.types import QuorumResult
from ftjax.ftar import FTAREndpoint, FTARError
from ftjax.program.sharding import replica_mesh
from ftjax.runtime.lanes import LaneFlattener
from ftjax.runtime.pipeline import Averaged, Pipeline
from ftjax.runtime.reduce import FTARReducer

SPECS = {"emb": P("fsdp", None), "w": P(None, "fsdp"), "b": P(), "s": P("fsdp")}
SHAPES = {"emb": (64, 40), "w": (24, 16), "b": (7,), "s": (6000,)}


def _update(seed: int, devices: int = 2):
    mesh = replica_mesh(jax.devices()[:devices])
    shardings = {k: NamedSharding(mesh, s) for k, s in SPECS.items()}
    rng = np.random.default_rng(seed)
    values = {k: rng.standard_normal(shape).astype(np.float32) for k, shape in SHAPES.items()}
    return {k: jax.device_put(v, shardings[k]) for k, v in values.items()}, shardings


def _quorum(qid: int, step: int, lanes: list[list[str]], rank: int, healing=()) -> QuorumResult:
    parts = tuple(
        Participant(str(i), "inc", step, step, tuple(a), ("c:1",), i in healing, "") for i, a in enumerate(lanes)
    )
    return QuorumResult(
        quorum_id=qid,
        step=step,
        participants=parts,
        rank=rank,
        healing=rank in healing,
        heal_source="",
        heal_source_addresses=(),
        num_contributors=sum(not p.healing for p in parts),
        data_position=step,
        no_state=False,
    )


def _reducers(pipelined: list[bool], dtype=np.float32, block_elems: int = 97, lanes: int = 1, pinned: bool = False):
    """One reducer per member, each of 2 devices; small blocks and chunks: many of each per step."""
    update, shardings = _update(0)
    out = []
    for p in pipelined:
        flat = LaneFlattener(
            update, shardings, lanes=lanes, devices_per_host=2 // lanes, served=list(range(lanes)), dtype=dtype
        )
        r = FTARReducer([FTAREndpoint("t", chunk_bytes=256) for _ in range(lanes)], flat, pipelined=p)
        if p:
            r.pipeline = Pipeline(flat, block_elems=block_elems, pinned=pinned)
        out.append(r)
    return out


def _step(reducers, grads, qid: int, step: int = 0, healing=()):
    """One averaging step of every member in its own thread: [(tree or error)]."""
    lanes = [[e.address for e in r.endpoints] for r in reducers]
    got = [None] * len(reducers)

    def member(i):
        try:
            update = reducers[i].average(_quorum(qid, step, lanes, i, healing), grads[i])
            got[i] = reducers[i].tree(update) if grads[i] is not None else reducers[i].detach(update)
        except Exception as exc:
            got[i] = exc

    threads = [threading.Thread(target=member, args=(i,), daemon=True) for i in range(len(reducers))]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert not any(t.is_alive() for t in threads)
    return got


def _bits(tree) -> dict:
    return {k: np.asarray(v).tobytes() for k, v in tree.items()}


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("lanes", [1, 2], ids=["1 lane", "2 lanes on one host"])
def test_the_pipelined_path_gives_the_serial_paths_bits_and_the_mean(dtype, lanes):
    reducers = _reducers([True, False, True], dtype, lanes=lanes)
    grads = [_update(seed)[0] for seed in (1, 2, 3)]
    got = _step(reducers, grads, qid=1)
    want = {k: np.mean([np.asarray(g[k]).astype(dtype).astype(np.float64) for g in grads], axis=0) for k in SHAPES}
    for tree in got:
        assert _bits(tree) == _bits(got[1]), "members differ"  # serial (member 1) and pipelined alike
        for k, v in tree.items():
            assert v.dtype == np.float32 and v.sharding == grads[0][k].sharding
            np.testing.assert_allclose(np.asarray(v), want[k], rtol=1e-6 if dtype == np.float32 else 2**-7, atol=1e-6)
    assert reducers[0].phases.d2h_s > 0 and reducers[0].phases.h2d_s > 0 and reducers[0].phases.ring_s > 0
    assert 0 <= reducers[0].phases.record()["overlap_share"] < 1
    [r.close() for r in reducers]


def test_through_page_locked_host_memory_the_bits_are_the_same():
    """ft.grad_path pinned: the update leaves the devices through JAX's pinned_host memory kind (on CPU
    too, where it exists but is not the default), and the ring gets the same bytes."""
    reducers = _reducers([True, False], pinned=True)
    assert reducers[0].pipeline.pinned is not None
    grads = [_update(seed)[0] for seed in (5, 6)]
    got = _step(reducers, grads, qid=1)
    assert _bits(got[0]) == _bits(got[1])
    want = (np.asarray(grads[0]["s"]) + np.asarray(grads[1]["s"])) / 2
    np.testing.assert_allclose(np.asarray(got[0]["s"]), want, rtol=1e-6)
    [r.close() for r in reducers]


def test_buffers_are_allocated_once_and_an_update_put_back_outlives_the_next_step():
    """The pipeline reuses its lane buffers every step and, on CPU, two result buffers in turn, which
    the arrays put back share (no copy): step n's update must survive step n + 1 (its apply runs
    before step n + 1's gradients exist), and a kept update must be detached."""
    reducers = _reducers([True, True])
    pipe = reducers[0].pipeline
    assert pipe.alias, "CPU devices: the leaves put back alias the result buffer"
    bufs = [b.ctypes.data for b in pipe.bufs]

    def span(flat):
        return range(flat.ctypes.data, flat.ctypes.data + flat.nbytes)

    first = _step(reducers, [_update(1)[0], _update(2)[0]], qid=1, step=0)
    first_bits, first_out = _bits(first[0]), span(pipe.flat_out)
    aligned = [k for i, k in enumerate(sorted(SHAPES)) if all(p.data.ctypes.data % 64 == 0 for p in pipe.out_pieces[i])]
    assert aligned, "the result buffer is aligned: so is at least its first leaf"
    for k in aligned:
        pointers = [s.data.unsafe_buffer_pointer() for s in first[0][k].addressable_shards]
        assert all(p in first_out for p in pointers), f"{k}: put back as a copy, not shared"
    second = _step(reducers, [_update(3)[0], _update(4)[0]], qid=1, step=1)
    assert span(pipe.flat_out) != first_out and [b.ctypes.data for b in pipe.bufs] == bufs
    assert _bits(first[0]) == first_bits, "step 0's update changed when step 1 ran"
    assert _bits(second[0]) != first_bits
    _step(reducers, [_update(5)[0], _update(6)[0]], qid=1, step=2)
    assert span(pipe.flat_out) == first_out, "the result buffers take turns: none is allocated per step"
    update = Averaged(pipe.flat_out)
    kept = reducers[0].detach(update)
    assert not np.shares_memory(kept, pipe.flat_out) and kept.tobytes() == pipe.flat_out.tobytes()
    [r.close() for r in reducers]


def test_a_healing_member_relays_zeros_and_keeps_the_contributors_average():
    reducers = _reducers([True, True, False])
    grads = [_update(1)[0], None, _update(2)[0]]
    got = _step(reducers, grads, qid=1, healing=(1,))
    kept = got[1]
    assert isinstance(kept, np.ndarray)
    back = reducers[1].tree(kept)
    assert _bits(back) == _bits(got[0]) == _bits(got[2])
    np.testing.assert_allclose(np.asarray(back["b"]), (np.asarray(grads[0]["b"]) + np.asarray(grads[2]["b"])) / 2)
    [r.close() for r in reducers]


def test_a_ring_that_fails_mid_step_raises_naming_the_peer_and_the_next_step_is_whole():
    """Member 1 never joins quorum 1: member 0's ring times out naming it, with its d2h and h2d
    threads joined; then both average under quorum 2 and get the right numbers."""
    reducers = _reducers([True, True])
    for e in reducers[0].endpoints:
        e.timeout_s = 1.0
    grads = [_update(1)[0], _update(2)[0]]
    lanes = [[e.address for e in r.endpoints] for r in reducers]
    with pytest.raises(FTARError, match=lanes[1][0].split(":")[-1]):
        reducers[0].average(_quorum(1, 0, lanes, 0), grads[0])
    assert {t.name for t in threading.enumerate()} & {"ftar-d2h", "ftar-h2d"} == set()
    got = _step(reducers, grads, qid=2)
    want = (np.asarray(grads[0]["emb"]) + np.asarray(grads[1]["emb"])) / 2
    np.testing.assert_allclose(np.asarray(got[0]["emb"]), want, rtol=1e-6)
    assert _bits(got[0]) == _bits(got[1])
    [r.close() for r in reducers]


def test_a_released_reducer_drops_its_buffers_keeps_the_shared_links_and_still_unflattens():
    """release() (streaming DiLoCo's warm-up reducer, once the rounds start): its pipeline goes, the
    endpoints it shares with the job's other reducers stay open and carry their next step, a flat
    update it kept still comes back as the same tree, and averaging through it again is refused."""
    reducers = _reducers([True, True])
    first = _step(reducers, [_update(1)[0], _update(2)[0]], qid=1)
    kept = reducers[0].detach(Averaged(reducers[0].pipeline.flat_out))
    pipe = weakref.ref(reducers[0].pipeline)
    reducers[0].release()
    gc.collect()
    assert pipe() is None, "the released pipeline (its buffers) is still referenced"
    assert _bits(reducers[0].tree(kept)) == _bits(first[0])
    with pytest.raises(RuntimeError, match="released"):
        reducers[0].average(_quorum(2, 1, [[e.address for e in r.endpoints] for r in reducers], 0), _update(3)[0])
    # another reducer over the same endpoints (as DiLoCo's fragments share them) averages on
    update, shardings = _update(0)
    flat = LaneFlattener(update, shardings, lanes=1, devices_per_host=2, served=[0])
    others = [FTARReducer(r.endpoints, flat) for r in reducers]
    got = _step(others, [_update(3)[0], _update(4)[0]], qid=2, step=1)
    assert _bits(got[0]) == _bits(got[1])
    [r.close() for r in reducers + others]
