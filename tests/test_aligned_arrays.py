"""Buffers the kernels read in whole vectors start on a cache line (mha_cy/_aligned_arrays.py):
the projections' head outputs of the general path. Alignment changes speed only, never values."""
import numpy as np
import pytest

from mha_cy import attention
from mha_cy._aligned_arrays import CACHE_LINE_BYTES, empty_lines


def _address(a):
    return a.__array_interface__["data"][0]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1,), (3, 5), (2, 3, 17, 64), (1, 12, 128, 64)])
def test_empty_lines_is_a_writable_c_array_on_a_line(shape, dtype):
    a = empty_lines(shape, dtype)
    assert a.shape == shape and a.dtype == dtype
    assert a.flags.c_contiguous and a.flags.writeable and a.flags.aligned
    assert _address(a) % CACHE_LINE_BYTES == 0
    a[...] = np.arange(a.size).reshape(shape)       # every element its own storage
    assert np.array_equal(a.ravel(), np.arange(a.size, dtype=dtype))


def test_empty_lines_of_no_elements():
    a = empty_lines((2, 0, 3), np.float32)
    assert a.shape == (2, 0, 3) and a.dtype == np.float32 and a.size == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_projection_heads_start_on_a_line_and_equal_the_product(dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 37, 48)).astype(dtype)
    w = rng.standard_normal((3 * 4 * 16, 48)).astype(dtype)
    b = rng.standard_normal(3 * 4 * 16).astype(dtype)
    heads = attention._linear_heads(x, w, b, 12, 16, 2)
    assert _address(heads) % CACHE_LINE_BYTES == 0
    expected = (x @ w.T + b).reshape(2, 37, 12, 16).transpose(0, 2, 1, 3)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(heads, expected, rtol=tol, atol=tol)
