"""Row-wise int8 frames (issue 56's low-bit outer deltas): a chunk of floats as int8 values with one
float32 scale per row of `ROW` consecutive elements, about half a bfloat16 frame's bytes.

A frame of n elements is the ceil(n / ROW) scales (float32, little-endian) then the n int8
values: element i is `q[i] * scale[i // ROW]`, the scale a row's largest magnitude / 127 and q the
quotient rounded half to even, so the error of an element is at most half its row's scale (a
row's largest magnitude / 254). Encoding is a pure function of the floats' bits (IEEE float32
division and rounding, no reduction order), so every member that encodes the same floats sends
the same bytes, and every member that decodes a frame gets the same floats: a ring can requantize
each partial sum as it forwards it, as FTAR's bfloat16 wire rounds it, and stay bitwise equal on
every member once the owner's encoded average is what the all-gather carries and the owner
itself keeps. A row that is not finite encodes q = 0 and a NaN scale: it decodes to NaN (a
conversion of NaN to int8 would be the platform's choice), so a non-finite delta stays visible.

FTAR's `ft.wire_dtype: int8` (ring.py; DiLoCo's outer deltas): docs/design.md, "Training across slow links".
"""

from __future__ import annotations

import numpy as np

ROW = 128  # elements per scale: 4 / 128 bytes of scales per element, 1.94x fewer bytes than bfloat16
LIMIT = np.float32(127)  # q in [-127, 127]: symmetric, so a sign flip never clips


def nbytes(n: int) -> int:
    """The bytes of a frame of `n` elements."""
    return 4 * -(-n // ROW) + n


def encode(src: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """`src` (float32 or narrower, 1-D) as a frame: uint8, `nbytes(src.size)` long (into `out` if given)."""
    x = np.asarray(src, np.float32).reshape(-1)
    n, rows = x.size, -(-x.size // ROW)
    frame = np.empty(nbytes(n), np.uint8) if out is None else out[: nbytes(n)]
    padded = np.zeros(rows * ROW, np.float32)  # (the last row's tail: zeros, which change no maximum)
    padded[:n] = x
    blocks = padded.reshape(rows, ROW)
    with np.errstate(invalid="ignore"):  # (a NaN row: its maximum is NaN, its scale NaN)
        top = np.max(np.abs(blocks), axis=1)
    scale = top / LIMIT
    finite = np.isfinite(scale)
    safe = np.where(finite & (scale > 0), scale, np.float32(1))
    q = np.rint(blocks / safe[:, None])
    q[~finite] = 0
    frame[: 4 * rows].view("<f4")[:] = np.where(finite, scale, np.float32(np.nan))
    frame[4 * rows :].view(np.int8)[:] = np.clip(q, -LIMIT, LIMIT).reshape(-1)[:n]
    return frame


def decode(frame: np.ndarray, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """The `n` float32 values of a frame (into `out` if given)."""
    rows = -(-n // ROW)
    if frame.size != nbytes(n):
        raise ValueError(f"an int8 frame of {n} elements has {nbytes(n)} bytes, got {frame.size}")
    scale = frame[: 4 * rows].view("<f4")
    q = frame[4 * rows :].view(np.int8)
    res = np.empty(n, np.float32) if out is None else out[:n]
    np.multiply(q, np.repeat(scale, ROW)[:n], out=res, dtype=np.float32)
    return res
