"""NaN in means NaN out, on every kernel path: a NaN or +inf that reaches a row's scores makes
that row NaN (as in NumPy and torch), while a row that the masks, causality or padding hide
completely stays zeros, and a NaN at a key that a row cannot see changes nothing. Checked
against mha_cy.reference, which defines both, with the fused and the BLAS tile kernels, with
and without split-K (Lq = 1, one K/V head, long keys) and with the weights."""
import numpy as np
import pytest

import mha_cy
from mha_cy import reference

from conftest import DTYPES, assert_close

SDPA = mha_cy.scaled_dot_product_attention


def assert_same_nans_and_values(actual, expected, dtype):
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected))
    finite = ~np.isnan(expected)
    assert_close(np.where(finite, actual, 0), np.where(finite, expected, 0), dtype)


def qkv(rng, dtype, b=1, hq=2, hkv=1, lq=1, lk=4096, d=32):
    q = rng.standard_normal((b, hq, lq, d)).astype(dtype)
    k = rng.standard_normal((b, hkv, lk, d)).astype(dtype)
    v = rng.standard_normal((b, hkv, lk, d)).astype(dtype)
    return q, k, v


# lk = 4096 with one query row and one K/V head: split-K; lk = 300: one task per head
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lk", [300, 4096], ids=["one_part", "split_k"])
def test_nan_key_makes_every_row_that_sees_it_nan(rng, dtype, lk, tile_kernel):
    q, k, v = qkv(rng, dtype, lq=1, lk=lk)
    k[0, 0, 10, 3] = np.nan
    out = SDPA(q, k, v)
    assert np.isnan(out).all()
    assert_same_nans_and_values(out, reference.scaled_dot_product_attention(q, k, v), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lk", [300, 4096], ids=["one_part", "split_k"])
@pytest.mark.parametrize("where", ["q", "k"])
@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "plus_inf"])
def test_nan_or_inf_reaches_the_scores_at_scale_zero(rng, dtype, lk, where, bad, tile_kernel):
    """0 * NaN and 0 * inf are NaN: BLAS skips its operands when alpha (the scale) is 0, so
    the BLAS tiles (every head dim above 256 by default) gave a finite row instead."""
    q, k, v = qkv(rng, dtype, lq=3, lk=lk)
    (q[0, 1, 2] if where == "q" else k[0, 0, 7])[5] = bad
    for causal in (False, True):
        with np.errstate(invalid="ignore"):
            expected = reference.scaled_dot_product_attention(q, k, v, scale=0.0,
                                                              is_causal=causal)
        assert np.isnan(expected).any()
        assert_same_nans_and_values(SDPA(q, k, v, scale=0.0, is_causal=causal), expected,
                                    dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lk", [300, 4096], ids=["one_part", "split_k"])
@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "plus_inf"])
def test_nan_or_plus_inf_in_the_additive_mask_makes_the_row_nan(rng, dtype, lk, bad,
                                                                 tile_kernel):
    q, k, v = qkv(rng, dtype, hq=2, lq=3, lk=lk)
    mask = np.zeros((3, lk), dtype)
    mask[1, lk - 5] = bad                                   # row 1 only
    out = SDPA(q, k, v, attn_mask=mask)
    expected = reference.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert np.isnan(out[:, :, 1]).all() and not np.isnan(out[:, :, [0, 2]]).any()
    assert_same_nans_and_values(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lk", [300, 4096], ids=["one_part", "split_k"])
def test_all_nan_scores_give_nan_not_a_masked_row(rng, dtype, lk, tile_kernel):
    q, k, v = qkv(rng, dtype, lq=1, lk=lk)
    q[0, 1] = np.nan                                        # every score of head 1
    out = SDPA(q, k, v)
    assert np.isnan(out[0, 1]).all() and not np.isnan(out[0, 0]).any()
    assert_same_nans_and_values(out, reference.scaled_dot_product_attention(q, k, v), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lk", [300, 4096], ids=["one_part", "split_k"])
def test_rows_hidden_by_minus_inf_or_false_masks_are_zeros(rng, dtype, lk, tile_kernel):
    q, k, v = qkv(rng, dtype, lq=2, lk=lk)
    additive = np.zeros((2, lk), dtype)
    additive[0] = -np.inf
    boolean = np.ones((2, lk), bool)
    boolean[1] = False
    for mask in (additive, boolean):
        out = SDPA(q, k, v, attn_mask=mask)
        expected = reference.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert_same_nans_and_values(out, expected, dtype)
        hidden = 0 if mask is additive else 1
        np.testing.assert_array_equal(out[:, :, hidden], 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_at_keys_a_row_cannot_see_changes_nothing(rng, dtype, tile_kernel):
    """NaN scores or additive-mask entries at keys hidden by causality or padding."""
    mha = mha_cy.MultiHeadAttention(32, 4, dtype=dtype, seed=0)
    x = rng.standard_normal((2, 40, 32)).astype(dtype)
    pad = np.zeros((2, 40), bool)
    pad[0, 30:] = True
    mask = np.zeros((40, 40), dtype)
    mask[np.triu_indices(40, 1)] = np.nan                    # above the causal diagonal
    mask[:, 35] = np.nan                                     # key 35: padded in sequence 0 only
    out = mha(x, attn_mask=mask, key_padding_mask=pad, is_causal=True)
    ref_mha = reference.MultiHeadAttention.from_weights(
        mha.q_weight, mha.k_weight, mha.v_weight, mha.out_weight, num_heads=4,
        q_bias=mha.q_bias, k_bias=mha.k_bias, v_bias=mha.v_bias, out_bias=mha.out_bias)
    expected = ref_mha(x, attn_mask=mask, key_padding_mask=pad, is_causal=True)
    assert not np.isnan(out[0]).any()                       # key 35 is padding there
    assert np.isnan(out[1, 35:]).all() and not np.isnan(out[1, :35]).any()
    assert_same_nans_and_values(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_weight_column_gives_nan_output_not_the_bias(rng, dtype, tile_kernel):
    mha = mha_cy.MultiHeadAttention(32, 4, dtype=dtype, seed=0)
    mha.q_weight[:, 5] = np.nan
    x = rng.standard_normal((1, 9, 32)).astype(dtype)
    assert np.isnan(mha(x)).all()
    out, weights = mha(x, need_weights=True)
    assert np.isnan(out).all() and np.isnan(weights).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_weights_rows_with_nan_are_nan_and_masked_rows_zeros(rng, dtype):
    mha = mha_cy.MultiHeadAttention(16, 2, dtype=dtype, seed=0)
    x = rng.standard_normal((1, 6, 16)).astype(dtype)
    mask = np.zeros((6, 6), dtype)
    mask[2, 4] = np.nan
    mask[3] = -np.inf
    _, weights = mha(x, attn_mask=mask, need_weights=True)
    assert np.isnan(weights[0, :, 2]).all()
    np.testing.assert_array_equal(weights[0, :, 3], 0)
    others = weights[0, :, [0, 1, 4, 5]]
    assert not np.isnan(others).any()
    np.testing.assert_allclose(others.sum(-1), 1, rtol=1e-5)
