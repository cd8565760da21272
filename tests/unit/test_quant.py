"""ftjax/ftar/quant.py: row-wise int8 frames with float32 scales (issue 56's low-bit outer deltas)."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftjax.ftar import quant


def _rows_max(x: np.ndarray) -> np.ndarray:
    """Each element's row's largest magnitude (rows of quant.ROW from the start)."""
    rows = -(-x.size // quant.ROW)
    padded = np.zeros(rows * quant.ROW, np.float32)
    padded[: x.size] = np.abs(x)
    return np.repeat(padded.reshape(rows, quant.ROW).max(axis=1), quant.ROW)[: x.size]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 1000), st.integers(0, 2**31 - 1), st.floats(-30, 30))
def test_a_round_trip_is_within_half_a_rows_scale_of_every_element(n, seed, log_scale):
    rng = np.random.default_rng(seed)
    # rows of very different magnitudes: each row's error is bounded by its own scale, not the frame's
    x = (rng.standard_normal(n) * np.exp(log_scale + rng.uniform(-8, 8, n))).astype(np.float32)
    frame = quant.encode(x)
    assert frame.dtype == np.uint8 and frame.size == quant.nbytes(n)
    back = quant.decode(frame, n)
    bound = _rows_max(x) / np.float32(254) * np.float32(1 + 2**-20)  # (q x scale: one float32 rounding)
    assert np.all(np.abs(back.astype(np.float64) - x) <= bound)
    # the row's largest magnitude survives to its float32 rounding: rows are not flattened to zero
    top = _rows_max(x)
    assert np.allclose(_rows_max(back), top, rtol=1e-6, atol=0)


def test_encoding_is_a_function_of_the_bits_and_decoding_too():
    rng = np.random.default_rng(3)
    x = rng.standard_normal(1000).astype(np.float32)
    a, b = quant.encode(x), quant.encode(x.copy())
    assert np.array_equal(a, b)
    out = np.full(quant.nbytes(1000) + 7, 255, np.uint8)  # into a caller's (longer) buffer: the same bytes
    assert np.array_equal(quant.encode(x, out), a) and np.all(out[a.size :] == 255)
    assert np.array_equal(quant.decode(a, 1000).view(np.uint32), quant.decode(a.copy(), 1000).view(np.uint32))
    # bfloat16 input encodes as its float32 widening
    h = x.astype(ml_dtypes.bfloat16)
    assert np.array_equal(quant.encode(h), quant.encode(h.astype(np.float32)))
    # the exact values: a row of 127 x 2**-3 multiples comes back bitwise
    exact = (np.arange(-127, 129, dtype=np.float32)[: quant.ROW] / 8).astype(np.float32)
    exact[0] = -127 / 8
    assert np.array_equal(quant.decode(quant.encode(exact), quant.ROW), exact)


def test_a_zero_row_is_zeros_and_a_row_that_is_not_finite_is_nan_alone():
    x = np.ones(3 * quant.ROW, np.float32)
    x[: quant.ROW] = 0
    x[quant.ROW + 5] = np.nan
    x[2 * quant.ROW + 1] = np.inf
    back = quant.decode(quant.encode(x), x.size)
    assert np.all(back[: quant.ROW] == 0)
    assert np.all(np.isnan(back[quant.ROW :]))  # the NaN row, and the infinite one
    y = np.ones(2 * quant.ROW, np.float32)
    y[quant.ROW] = np.nan
    assert np.array_equal(quant.decode(quant.encode(y), y.size)[: quant.ROW], np.ones(quant.ROW, np.float32))


def test_a_frame_is_at_least_1_8_times_smaller_than_bfloat16():
    for n in (quant.ROW, 115_008, 460_032, 10**6 + 1):  # (the tiny Llama's fragment and update)
        assert 2 * n / quant.nbytes(n) >= 1.8
    assert quant.nbytes(1) == 5 and quant.nbytes(quant.ROW + 1) == 8 + quant.ROW + 1


def test_a_frame_of_another_length_is_refused_naming_both():
    frame = quant.encode(np.ones(10, np.float32))
    with pytest.raises(ValueError, match=r"an int8 frame of 11 elements has 15 bytes, got 14"):
        quant.decode(frame, 11)
