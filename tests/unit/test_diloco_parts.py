"""DiLoCo's pure parts (ftjax/runtime/diloco.py): fragments, rounds of a stream, the tagged replay,
the config's rules (tests/integration/test_diloco.py: the outer step and jobs with kills)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftjax.config import ConfigError, load_config
from ftjax.coordinator.types import QuorumResult
from ftjax.program.data import BatchStream
from ftjax.runtime.diloco import FragmentReducer, RoundStream, Tagged, fragment_leaves


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=40), st.integers(1, 40))
def test_fragments_deal_every_leaf_once_none_empty_the_peak_within_one_leaf_of_fair(sizes, n):
    if n > len(sizes):
        with pytest.raises(ValueError, match="ft.fragments"):
            fragment_leaves(sizes, n)
        return
    groups = fragment_leaves(sizes, n)
    assert len(groups) == n and all(groups) and all(list(g) == sorted(g) for g in groups)
    assert sorted(i for g in groups for i in g) == list(range(len(sizes)))  # every leaf in exactly one
    peak = max(sum(sizes[i] for i in g) for g in groups)
    assert sum(sizes) / n <= peak <= sum(sizes) / n + max(sizes)


def test_equal_leaves_deal_evenly_and_a_large_leaf_stands_alone():
    assert [len(g) for g in fragment_leaves([4] * 8, 4)] == [2, 2, 2, 2]
    assert fragment_leaves([4] * 8, 1) == (tuple(range(8)),)
    assert fragment_leaves([5, 1, 1, 1, 1, 1], 2) == ((0,), (1, 2, 3, 4, 5))
    # the tiny Llama's shapes (floats): 2 fragments within 0.03% of half (its total is odd in units of 64)
    sizes = [16384] + [12288] * 6 + [4096] * 4 + [2048] * 4 + [64] * 5
    peak = max(sum(sizes[i] for i in g) for g in fragment_leaves(sizes, 2))
    assert peak / sum(sizes) < 0.5003


def test_the_rounds_of_a_stream_cover_its_batches_once_each():
    items = np.arange(1000, dtype=np.int32)
    stream = BatchStream(items, seed=0, batch_size=2, replica=1, replicas=3)
    rounds = RoundStream(stream, 4)
    seen = [i for p in range(10) for i in rounds.batch_ids(p)]
    assert seen == [stream.batch_id(k) for k in range(40)]  # the batches beneath, in order, none twice
    assert [rounds.batch_id(p) for p in range(3)] == [1, 4, 7]  # a round's id: interleaved like a batch's
    assert all(np.array_equal(a, b) for a, b in zip(rounds.batch(2), [stream.batch(k) for k in range(8, 12)]))
    assert rounds.fingerprint != stream.fingerprint  # a round stream's positions mean something else


def _q(step: int) -> QuorumResult:
    return QuorumResult(1, step, (), 0, False, "", (), 1, 0, False)


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
    # a reduced-degree replica trains its whole batch with DiLoCo (nobody else computes its rows)
    cfg = load_config("llama_tiny", ["ft.sync=diloco", "mesh.hosts=2", "mesh.live_hosts=1", "ft.on_host_loss=reduce"])
    assert cfg.own_rows == cfg.data.batch_size
