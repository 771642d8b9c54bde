"""No silent 32-bit truncation: operands whose row stride does not fit BLAS's 32-bit leading
dimensions are copied (or refused), never read at the wrong rows."""
import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

import mha_cy
from mha_cy import reference
from mha_cy.attention import _INT_MAX, _blas_operand

from conftest import assert_close


def _huge_stride_view(rng, stride_elements, rows=2, d=16):
    """(1, 1, rows, d) float32 rows `stride_elements` apart in a lazily zeroed buffer: only the
    touched pages become memory (16 GiB of address space for a 2**32 + 1 stride)."""
    try:
        buf = np.zeros(stride_elements * (rows - 1) + d, np.float32)
    except MemoryError:
        pytest.skip("the address space for the view cannot be reserved here")
    view = as_strided(buf, shape=(1, 1, rows, d), strides=(0, 0, stride_elements * 4, 4))
    view[...] = rng.standard_normal((1, 1, rows, d)).astype(np.float32)
    return view


@pytest.mark.parametrize("stride", [2 ** 31 + 2, 2 ** 32 + 1], ids=["negative_int", "wraps_to_1"])
def test_row_stride_beyond_32_bits_gives_the_right_answer(rng, stride):
    k = _huge_stride_view(rng, stride)
    assert _blas_operand(k).strides[2] == 16 * 4                 # copied, not truncated
    q = rng.standard_normal((1, 1, 3, 16)).astype(np.float32)
    expected = reference.scaled_dot_product_attention(q, np.array(k), np.array(k))
    for kernel in ("blas", "fused"):
        previous = mha_cy._attention_kernel._set_tile_kernel(kernel)
        try:
            out = mha_cy.scaled_dot_product_attention(q, k, k)
        finally:
            mha_cy._attention_kernel._set_tile_kernel(previous)
        assert_close(out, expected, np.float32)


def test_strides_within_32_bits_are_not_copied(rng):
    x = rng.standard_normal((2, 3, 5, 8)).astype(np.float32)
    assert _blas_operand(x) is x
    view = x[:, :, ::2]                                          # rows 16 elements apart
    assert _blas_operand(view) is view
    assert _INT_MAX == 2 ** 31 - 1
