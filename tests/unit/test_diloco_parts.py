"""DiLoCo's pure parts (ftjax/runtime/diloco.py): fragments, rounds of a stream, the tagged replay,
the config's rules (tests/integration/test_diloco.py: the outer step and jobs with kills)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftjax.config import ConfigError, load_config
from ftjax.coordinator.quorum import Participant
from ftjax.coordinator.types import QuorumResult
from ftjax.program.data import BatchStream
from ftjax.runtime.diloco import SYNC, FragmentReducer, Piece, RoundStream, Tagged, fragment_pieces, round_span


def _check(sizes: list[int], n: int, cut) -> None:
    """Every element of every leaf in exactly one piece, no fragment empty, each at its fair share."""
    assert len(cut) == n and all(cut)
    covered = {i: [] for i in range(len(sizes))}
    for pieces in cut:
        assert list(pieces) == sorted(pieces) and len({p.leaf for p in pieces}) == len(pieces)
        for p in pieces:
            assert 0 <= p.start < p.stop <= sizes[p.leaf]
            covered[p.leaf].append((p.start, p.stop))
    for i, ranges in covered.items():  # the pieces of a leaf tile it
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == sizes[i]
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    loads = sorted(sum(p.size for p in pieces) for pieces in cut)
    total = sum(sizes)
    assert loads[0] == total // n and loads[-1] == -(-total // n)  # the peak: the fair share, to one element
    assert sum(len(pieces) for pieces in cut) <= len(sizes) + n - 1  # at most n - 1 leaves cut


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=40), st.integers(1, 40))
def test_fragments_cover_every_element_once_none_empty_each_at_its_fair_share(sizes, n):
    if n > sum(sizes):
        with pytest.raises(ValueError, match=f"ft.fragments={n}"):
            fragment_pieces(sizes, n)
        return
    _check(sizes, n, fragment_pieces(sizes, n))
    cut = fragment_pieces([4 * x for x in sizes], n, unit=4)
    assert cut == tuple(tuple(Piece(p.leaf, 4 * p.start, 4 * p.stop) for p in f) for f in fragment_pieces(sizes, n))


def test_fragments_keep_leaves_whole_where_they_can_and_refuse_more_fragments_than_elements():
    assert [len(g) for g in fragment_pieces([4] * 8, 4)] == [2, 2, 2, 2]
    assert all(p.size == 4 for g in fragment_pieces([4] * 8, 4) for p in g)  # nothing to cut
    assert fragment_pieces([4] * 8, 1) == (tuple(Piece(i, 0, 4) for i in range(8)),)
    assert fragment_pieces([5, 1, 1, 1, 1, 1], 2) == ((Piece(0, 0, 5),), tuple(Piece(i, 0, 1) for i in range(1, 6)))
    assert fragment_pieces([3], 3) == ((Piece(0, 0, 1),), (Piece(0, 1, 2),), (Piece(0, 2, 3),))
    with pytest.raises(ValueError, match="ft.fragments=4"):
        fragment_pieces([2, 1], 4)
    # in units of a replica's FSDP devices (every piece shards like its leaf), fair to one unit
    assert fragment_pieces([8, 4], 3, unit=4) == ((Piece(0, 0, 4),), (Piece(1, 0, 4),), (Piece(0, 4, 8),))
    with pytest.raises(ValueError, match="does not divide"):
        fragment_pieces([8, 6], 2, unit=4)
    # the tiny Llama's shapes (floats, 1,797 x 64 in all): whole arrays cannot make a quarter each
    # (the best peak is 450 x 64, 0.2504), one cut array makes it exact
    sizes = [16384] + [12288] * 6 + [4096] * 4 + [2048] * 4 + [64] * 5
    cut = fragment_pieces(sizes, 4)
    _check(sizes, 4, cut)
    assert max(sum(p.size for p in g) for g in cut) * 4 == sum(sizes)
    assert sum(p.size != sizes[p.leaf] for g in cut for p in g) <= 2 * 3


def test_the_rounds_of_a_stream_cover_its_batches_once_each():
    items = np.arange(1000, dtype=np.int32)
    stream = BatchStream(items, seed=0, batch_size=2, replica=1, replicas=3)
    rounds = RoundStream(stream, 4)
    seen = [i for p in range(10) for i in rounds.batch_ids(p)]
    assert seen == [stream.batch_id(k) for k in range(40)]  # the batches beneath, in order, none twice
    assert [rounds.batch_id(p) for p in range(3)] == [1, 4, 7]  # a round's id: interleaved like a batch's
    assert all(np.array_equal(a, b) for a, b in zip(rounds.batch(2), [stream.batch(k) for k in range(8, 12)]))
    assert rounds.fingerprint != stream.fingerprint  # a round stream's positions mean something else


@pytest.mark.parametrize("warmup", [0, 1, 5])
def test_after_a_warmup_of_single_batches_the_rounds_still_cover_the_stream_once(warmup):
    items = np.arange(1000, dtype=np.int32)
    stream = BatchStream(items, seed=0, batch_size=2, replica=0, replicas=2)
    rounds = RoundStream(stream, 4, warmup)
    spans = [rounds.span(p) for p in range(10)]
    assert [n for _, n in spans] == [1] * warmup + [4] * (10 - warmup)  # a warm-up position: one batch
    seen = [i for p in range(10) for i in rounds.batch_ids(p)]
    assert seen == [stream.batch_id(k) for k in range(warmup + 4 * (10 - warmup))]  # in order, none twice
    assert all(np.array_equal(a, b) for a, b in zip(rounds.batch(warmup), [stream.batch(warmup + k) for k in range(4)]))
    assert (rounds.fingerprint == RoundStream(stream, 4).fingerprint) == (warmup == 0)  # positions mean other things


def _q(step: int, positions: tuple[int, ...] = (), rank: int = 0, healing: tuple[int, ...] = ()) -> QuorumResult:
    parts = tuple(Participant(str(i), "x", step, p, (), (), i in healing, "") for i, p in enumerate(positions))
    return QuorumResult(1, step, parts, rank, False, "", (), len(parts) - len(healing) or 1, 0, False)


class _Flat:
    """A reducer whose flat buffers are bfloat16 (ft.grad_dtype), as FTAR's are."""

    def __init__(self, n: int):
        import ml_dtypes

        self.flat = type("F", (), {"dtype": np.dtype(ml_dtypes.bfloat16)})()
        self.n = n

    def average(self, q, grads):
        return np.asarray(grads, self.flat.dtype)

    def tree(self, update):
        assert update.dtype == self.flat.dtype, update.dtype  # given back as it was kept
        return [update.astype(np.float32)]

    def detach(self, update):
        return update.copy()

    def close(self):
        pass


def test_a_kept_fragment_comes_back_as_the_same_fragment_and_bits():
    reducer = FragmentReducer([_Flat(3), _Flat(5)], 2)
    for step, size in ((0, 3), (1, 5), (6, 3), (7, 5)):
        grads = np.linspace(-1, 1, size).astype(np.float32)
        avg = reducer.average(_q(step), grads)
        assert isinstance(avg, Tagged) and avg.fragment == step % 2
        kept = reducer.detach(avg)  # what the replay buffer holds (and may spill)
        f, tree = reducer.tree(kept)
        assert f == step % 2
        assert np.array_equal(tree[0], np.asarray(grads, reducer.reducers[f].flat.dtype).astype(np.float32))
        assert reducer.tree(avg)[0] == f


class _Sum:
    """A reducer that hands back what it was given (FTAR's sum of one), on lists of arrays."""

    flat = None

    def average(self, q, grads):
        return grads

    def tree(self, update):
        return [np.asarray(x, np.float32) for x in update] if isinstance(update, list) else [update]

    def detach(self, update):
        return np.concatenate([np.asarray(x, np.float32).reshape(-1) for x in update])

    def close(self):
        pass


def test_a_warmup_step_averages_the_whole_gradient_tagged_as_such_and_kept_so():
    reducer = FragmentReducer([_Sum()], 1, inner=4, warmup=3)
    grads = [np.linspace(-1, 1, 6).astype(np.float32)]
    for step in (0, 2):  # warm-up steps: the gradient, tagged SYNC, also once kept by the replay
        avg = reducer.average(_q(step, (step, step)), grads)
        assert avg.fragment == SYNC and avg.update is grads
        f, tree = reducer.tree(reducer.detach(avg))
        assert f == SYNC and np.array_equal(tree[0], grads[0])
    assert reducer.average(_q(3, (3, 3)), grads).fragment == 0  # the rounds: the fragment's delta
    # a warm-up step where a restore left a position past the warm-up (4 batches beneath): the mean
    # gradient of its 4 batches counts 4 times one batch's, (1 g0 + 4 g1) / 5 over both
    sent = [reducer.average(_q(1, (1, 3), rank=r), [np.full(2, g, np.float32)]).update for r, g in ((0, 1.0), (1, 6.0))]
    np.testing.assert_allclose((sent[0][0] + sent[1][0]) / 2, (1 * 1.0 + 4 * 6.0) / 5, rtol=1e-6)


class _Releasing(_Sum):
    def __init__(self):
        self.released = self.closed = 0

    def release(self):
        self.released += 1

    def close(self):
        self.closed += 1


def test_streaming_warmup_reducer_releases_its_buffers_once_the_rounds_start_and_still_unflattens():
    """Streaming DiLoCo's warm-up averages through a reducer of its own (FTAR buffers of an update's
    size): the first round step releases its buffers, once, and nothing else's (its links are the
    job's, closed at the end with the others); a warm-up average kept by the replay still comes
    back as a tree after that (a healing replica replays it later)."""
    fragments, sync = [_Releasing(), _Releasing()], _Releasing()
    reducer = FragmentReducer(fragments, 2, inner=4, warmup=2, sync=sync)
    grads = [np.linspace(-1, 1, 6).astype(np.float32)]
    kept = reducer.detach(reducer.average(_q(0, (0, 0)), grads))
    reducer.average(_q(1, (1, 1)), grads)
    assert sync.released == 0  # (warm-up steps)
    assert reducer.average(_q(2, (2, 2)), grads).fragment == 0
    reducer.average(_q(3, (6, 6)), grads)
    assert (sync.released, [r.released for r in fragments]) == (1, [0, 0])
    f, tree = reducer.tree(kept)
    assert f == SYNC and np.array_equal(tree[0], grads[0])
    reducer.close()
    assert (sync.closed, [r.closed for r in fragments]) == (1, [1, 1])
    # plain DiLoCo's warm-up uses the one fragment's reducer: nothing released
    one = _Releasing()
    plain = FragmentReducer([one], 1, inner=4, warmup=2)
    plain.average(_q(2, (2, 2)), grads)
    assert one.released == 0


def test_a_delta_counts_by_its_inner_steps_when_a_contributor_lags_into_the_rounds():
    """Replica 1 missed two warm-up steps: at round step 7 its position 4 (< warm-up 5) has one inner
    step against replica 0's four; each scales its delta so that FTAR's plain mean over the two
    contributors is the mean weighted by inner steps, (4 d0 + 1 d1) / 5."""
    reducer = FragmentReducer([_Sum()], 1, inner=4, warmup=5)
    assert [round_span(p, 4, 5) for p in (4, 5, 6)] == [(4, 1), (5, 4), (9, 4)]
    d0, d1 = [np.full(3, 2.0, np.float32)], [np.full(3, 7.0, np.float32)]
    sent0 = reducer.average(_q(7, (6, 4), rank=0), d0).update
    sent1 = reducer.average(_q(7, (6, 4), rank=1), d1).update
    mean = (np.asarray(sent0[0]) + np.asarray(sent1[0])) / 2  # what FTAR hands every contributor
    np.testing.assert_allclose(mean, (4 * 2.0 + 1 * 7.0) / 5, rtol=1e-6)
    # equal inner steps (every round without a lag): the delta as it was, not a bit changed
    assert reducer.average(_q(7, (6, 6), rank=1), d1).update is d1
    # a healing participant contributes nothing, so it does not count
    assert reducer.average(_q(7, (6, 6, 2), rank=0, healing=(2,)), d0).update is d0
    # no warm-up: never scaled (every round has the same inner steps)
    assert FragmentReducer([_Sum()], 1, inner=4).average(_q(7, (6, 0)), d0).update is d0


def test_config_rules_name_the_field_at_fault():
    with pytest.raises(ConfigError, match="ft.global_batch"):
        load_config("llama_tiny", ["ft.sync=diloco", "ft.global_batch=constant"])
    with pytest.raises(ConfigError, match="ft.fragments"):
        load_config("llama_tiny", ["ft.sync=streaming_diloco", "ft.inner_steps=10", "ft.fragments=4"])
    with pytest.raises(ConfigError, match="ft.sync"):
        load_config("llama_tiny", ["ft.sync=sometimes"])
    cfg = load_config("llama_tiny", ["ft.sync=streaming_diloco", "ft.inner_steps=8", "ft.fragments=4", "steps=10"])
    assert cfg.inner_per_step == 2 and cfg.train_steps == 20  # the inner optimizer's schedule spans every inner step
    assert load_config("llama_tiny", ["steps=10"]).train_steps == 10
    # a warm-up step is one optimizer step, a round after it inner_steps
    cfg = load_config("llama_tiny", ["ft.sync=diloco", "ft.inner_steps=4", "ft.sync_warmup_steps=3", "steps=10"])
    assert cfg.warmup_sync_steps == 3 and cfg.train_steps == 3 + 7 * 4
    with pytest.raises(ConfigError, match="ft.sync_warmup_steps"):
        load_config("llama_tiny", ["ft.sync=every_step", "ft.sync_warmup_steps=2"])
    # streaming: a warm-up step is one optimizer step, a round inner_steps / fragments
    cfg = load_config(
        "llama_tiny", ["ft.sync=streaming_diloco", "ft.sync_warmup_steps=2", "ft.inner_steps=4", "ft.fragments=2"]
    )
    assert cfg.warmup_sync_steps == 2 and cfg.train_steps == 2 + (cfg.steps - 2) * 2
    # a reduced-degree replica trains its whole batch with DiLoCo (nobody else computes its rows)
    cfg = load_config("llama_tiny", ["ft.sync=diloco", "mesh.hosts=2", "mesh.live_hosts=1", "ft.on_host_loss=reduce"])
    assert cfg.own_rows == cfg.data.batch_size


def test_fragment_sync_delay_and_update_alpha_are_streamings_and_bounded_naming_the_field():
    streaming = ["ft.sync=streaming_diloco", "ft.inner_steps=4", "ft.fragments=2"]
    cfg = load_config("llama_tiny", [*streaming, "ft.fragment_sync_delay=1", "ft.fragment_update_alpha=0.5"])
    assert (cfg.ft.fragment_sync_delay, cfg.ft.fragment_update_alpha) == (1, 0.5)
    for overrides, message in (
        (["ft.fragment_sync_delay=1"], "ft.fragment_sync_delay: only with ft.sync=streaming_diloco"),
        (["ft.sync=diloco", "ft.fragment_update_alpha=0.5"], "ft.fragment_update_alpha: only with"),
        (["ft.sync=streaming_diloco", "ft.inner_steps=4", "ft.fragments=1", "ft.fragment_sync_delay=1"], "ft.frag"),
        ([*streaming, "ft.fragment_sync_delay=2"], r"ft.fragment_sync_delay \(2\) must be less than a round's 2"),
        ([*streaming, "ft.fragment_update_alpha=1.5"], "ft.fragment_update_alpha"),
        ([*streaming, "ft.fragment_sync_delay=-1"], "ft.fragment_sync_delay"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config("llama_tiny", overrides)
