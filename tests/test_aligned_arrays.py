"""Buffers the kernels read in whole vectors start on a cache line (mha_cy/_aligned_arrays.py):
the projections' head outputs of the general path. Alignment changes speed only, never values."""
import numpy as np
import pytest

import mha_cy
from mha_cy import attention, reference
from mha_cy._aligned_arrays import CACHE_LINE_BYTES, empty_lines
from mha_cy._cache import _STORAGE


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


def _at_offset(a, offset):
    """A copy of a whose data starts `offset` bytes past a cache line."""
    raw = np.empty(a.nbytes + 2 * CACHE_LINE_BYTES, dtype=np.uint8)
    start = -_address(raw) % CACHE_LINE_BYTES + offset
    out = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("dv", [64, 24, 80])
@pytest.mark.parametrize("non_finite", [False, True])
def test_value_rows_off_cache_lines_give_the_same_bits(dtype, dv, non_finite):
    # tasks of more rows than one register block copy V rows that start off a cache line
    # onto lines (attention_microkernel_impl.h): the values, hence the bits, are the same
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 3, 100, 32)).astype(dtype)
    k = rng.standard_normal((1, 3, 150, 32)).astype(dtype)
    v = rng.standard_normal((1, 3, 150, dv)).astype(dtype)
    if non_finite:                  # that tile's columns take the exact path
        v[0, 1, 70, 3] = np.inf
    on_line = mha_cy.scaled_dot_product_attention(*(_at_offset(a, 0) for a in (q, k, v)))
    item = np.dtype(dtype).itemsize
    for offset in (16, item):
        off_line = mha_cy.scaled_dot_product_attention(
            *(_at_offset(a, offset) for a in (q, k, v)))
        assert off_line.tobytes() == on_line.tobytes()
    if not non_finite:
        tol = 1e-5 if dtype == np.float32 else 1e-12
        np.testing.assert_allclose(on_line, reference.scaled_dot_product_attention(q, k, v),
                                   rtol=tol, atol=tol)


def _storage(cache):
    return [getattr(cache, n) for n in _STORAGE if getattr(cache, n) is not None]


@pytest.mark.parametrize("cache_dtype", [None, np.float16, "int8"])
def test_kv_cache_storage_starts_on_lines_through_copy_pickle_and_reorder(cache_dtype):
    import pickle
    m = mha_cy.MultiHeadAttention(32, 4, num_kv_heads=2, seed=0)
    cache = (m.new_cache(3, 40) if cache_dtype is None
             else m.new_cache(3, 40, dtype=cache_dtype))
    m(np.random.default_rng(0).standard_normal((3, 5, 32)).astype(np.float32), cache=cache)
    cache.reorder([2, 0, 0])
    for c in (cache, cache.copy(), pickle.loads(pickle.dumps(cache))):
        for a in _storage(c):
            assert _address(a) % CACHE_LINE_BYTES == 0 and a.flags.c_contiguous
            assert a.flags.writeable
        for a, b in zip(_storage(c), _storage(cache)):
            assert np.array_equal(a, b)


@pytest.mark.parametrize("cache_dtype", [None, np.float16, "int8"])
def test_kv_cache_off_lines_gives_the_same_bits(cache_dtype):
    # storage a user put 16 bytes past a line (NumPy's malloc offset) reads the same values
    m = mha_cy.MultiHeadAttention(64, 8, num_kv_heads=2, head_dim=32, seed=1)
    rng = np.random.default_rng(2)
    prompt = rng.standard_normal((2, 30, 64)).astype(np.float32)
    step = rng.standard_normal((2, 1, 64)).astype(np.float32)
    cache = (m.new_cache(2, 31) if cache_dtype is None
             else m.new_cache(2, 31, dtype=cache_dtype))
    m(prompt, cache=cache)
    off = cache.copy()
    for name in _STORAGE:
        if getattr(off, name) is not None:
            setattr(off, name, _at_offset(getattr(off, name), 16))
    assert _address(off.key) % CACHE_LINE_BYTES == 16
    assert np.array_equal(m(step, cache=off), m(step, cache=cache))
    assert np.array_equal(off.key, cache.key) and np.array_equal(off.value, cache.value)
