"""Arrays that start on a cache line, for the buffers the kernels read in whole vectors.

NumPy's large arrays come from malloc: glibc maps them 16 bytes past a page boundary, so every
row of a (B, H, L, 64) float32 array starts 16 bytes into a cache line and each 64-byte load
of it spans two lines. The projections' outputs (q, k, v) and the KV cache's storage
(_cache.py) are allocated here instead.
Measured with the same values at a 0 / 16-byte offset, SDPA (1, 12, 128, 64): 281 / 319 us at
2 threads; (8, 12, 512, 64): 34.3 / 36.6 ms (Intel Xeon, same process).
"""
import math

import numpy as np

CACHE_LINE_BYTES = 64


def empty_lines(shape, dtype):
    """np.empty(shape, dtype), C-contiguous, starting on a cache-line boundary."""
    return lines_view(np.empty(lines_bytes(shape, dtype), dtype=np.uint8), shape, dtype)


def zeros_lines(shape, dtype):
    """np.zeros(shape, dtype), C-contiguous, starting on a cache-line boundary."""
    return lines_view(np.zeros(lines_bytes(shape, dtype), dtype=np.uint8), shape, dtype)


def on_lines(a):
    """a itself when it is C-contiguous and starts on a cache line, else such a copy of it
    (writeable, as a copy is)."""
    if a.flags.c_contiguous and a.__array_interface__["data"][0] % CACHE_LINE_BYTES == 0:
        return a
    return copy_lines(a)


def copy_lines(a):
    """A C-contiguous copy of a starting on a cache line."""
    out = empty_lines(a.shape, a.dtype)
    out[...] = a
    return out


def lines_bytes(shape, dtype):
    """The bytes of a raw uint8 buffer that lines_view can place a (shape, dtype) array in."""
    return math.prod(shape) * np.dtype(dtype).itemsize + CACHE_LINE_BYTES


def lines_view(raw, shape, dtype):
    """A C-contiguous (shape, dtype) view of the uint8 buffer raw (at least lines_bytes long),
    starting on its first cache-line boundary."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    start = -raw.__array_interface__["data"][0] % CACHE_LINE_BYTES
    return raw[start:start + nbytes].view(dtype).reshape(shape)
