"""NaN semantics of the reference (the oracle), against hand-computed cases.

A row whose keys are all masked (bool mask, padding, causality, -inf additive mask) is
zeros; otherwise a NaN or +inf that reaches the row's scores makes the row NaN.
"""
import numpy as np
import pytest

from mha_cy import reference

nan, inf = np.nan, np.inf

# The inputs overflow on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def _sdpa(q, k, v, **kw):
    q, k, v = (np.asarray(a, np.float64)[None, None] for a in (q, k, v))
    return reference.scaled_dot_product_attention(q, k, v, scale=1.0, **kw)[0, 0]


def _attention(q, k, v, **kw):
    from mha_cy.reference import _attention
    q, k, v = (np.asarray(a, np.float64)[None, None] for a in (q, k, v))
    kw.setdefault("attn_mask", None)
    kw.setdefault("key_padding_mask", None)
    kw.setdefault("is_causal", False)
    out, weights = _attention(q, k, v, scale=1.0, **kw)
    return out[0, 0], weights[0, 0]


K = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
V = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]


def test_finite_case_by_hand():
    out, w = _attention([[1.0, 0.0]], K[:2], V[:2])
    e = np.e
    np.testing.assert_allclose(w, [[e / (e + 1), 1 / (e + 1)]])
    np.testing.assert_allclose(out, [[(e * 1 + 3) / (e + 1), (e * 2 + 4) / (e + 1)]])


def test_nan_in_a_key_makes_every_row_that_sees_it_nan():
    k = np.array(K)
    k[1, 0] = nan
    out, w = _attention([[1.0, 0.0], [0.0, 1.0]], k, V)
    assert np.isnan(out).all() and np.isnan(w).all()


def test_nan_in_a_query_makes_its_row_nan_only():
    out, w = _attention([[nan, 0.0], [0.0, 1.0]], K, V)
    assert np.isnan(out[0]).all() and np.isnan(w[0]).all()
    assert np.isfinite(out[1]).all() and np.isfinite(w[1]).all()


def test_nan_key_behind_the_causal_diagonal_only_reaches_later_rows():
    k = np.array(K)
    k[2, 1] = nan
    q = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
    out, w = _attention(q, k, V, is_causal=True)
    np.testing.assert_allclose(out[0], V[0])                 # row 0 sees key 0 only
    e = np.e
    np.testing.assert_allclose(w[1], [1 / (1 + e), e / (1 + e), 0])
    assert np.isnan(out[2]).all() and np.isnan(w[2]).all()


def test_nan_key_under_padding_is_ignored():
    k = np.array(K)
    k[2] = nan
    pad = np.array([[False, False, True]])
    out, w = _attention([[1.0, 0.0]], k, V, key_padding_mask=pad)
    e = np.e
    np.testing.assert_allclose(w, [[e / (e + 1), 1 / (e + 1), 0]])
    np.testing.assert_allclose(out, [[(e * 1 + 3) / (e + 1), (e * 2 + 4) / (e + 1)]])


def test_nan_key_under_a_false_bool_mask_is_ignored():
    k = np.array(K)
    k[0] = nan
    mask = np.array([[False, True, True]])
    out = _sdpa([[0.0, 0.0]], k, V, attn_mask=mask)
    np.testing.assert_allclose(out, [[4.0, 5.0]])          # mean of V[1], V[2]


@pytest.mark.parametrize("bad", [nan, inf])
def test_nan_or_plus_inf_in_an_additive_mask_makes_the_row_nan(bad):
    mask = np.zeros((2, 3))
    mask[0, 1] = bad
    out, w = _attention([[1.0, 0.0], [0.0, 1.0]], K, V, attn_mask=mask)
    assert np.isnan(out[0]).all() and np.isnan(w[0]).all()
    assert np.isfinite(out[1]).all()


def test_minus_inf_in_an_additive_mask_masks_the_key():
    mask = np.array([[0.0, -inf, -inf], [-inf, -inf, -inf]])
    k = np.array(K)
    k[1] = nan                       # masked by -inf: never reaches the scores
    out, w = _attention([[1.0, 0.0], [0.0, 1.0]], k, V, attn_mask=mask)
    np.testing.assert_array_equal(out[0], V[0])
    np.testing.assert_array_equal(w[0], [1, 0, 0])
    np.testing.assert_array_equal(out[1], [0, 0])          # fully masked: zeros
    np.testing.assert_array_equal(w[1], [0, 0, 0])


def test_score_overflow_to_plus_inf_makes_the_row_nan():
    big = 1e200
    out, w = _attention([[big, 0.0]], [[big, 0.0], [0.0, 1.0]], V[:2])
    assert np.isnan(out).all() and np.isnan(w).all()


def test_scores_all_minus_inf_from_data_give_a_fully_masked_row():
    # A -inf score hides its key whatever made it (the kernels cannot tell a mask's -inf
    # from the data's, tile by tile): zeros, where torch gives NaN; its value is never read.
    big = 1e200
    v = np.array(V[:2])
    v[0, 0] = nan
    out, w = _attention([[big, 0.0]], [[-big, 0.0], [-big, 0.0]], v)
    assert (out == 0).all() and (w == 0).all()
    out, w = _attention([[big, 0.0]], [[-big, 0.0], [0.0, 1.0]], v)
    np.testing.assert_array_equal(out, [V[1]])
    np.testing.assert_array_equal(w, [[0, 1]])


def test_fully_masked_row_is_zeros_whatever_the_data():
    q = [[nan, 0.0], [0.0, 1.0]]                     # row 0 NaN, but fully masked
    v = np.array(V)
    v[0, 0] = inf                                    # and a non-finite value
    mask = np.array([[False, False, False], [True, True, True]])
    out, w = _attention(q, K, v, attn_mask=mask)
    np.testing.assert_array_equal(out[0], [0, 0])
    np.testing.assert_array_equal(w[0], [0, 0, 0])
    assert out[1, 0] == inf and np.isfinite(out[1, 1])      # a row that sees it: inf


def test_fully_padded_and_causal_rows_are_zeros():
    pad = np.array([[True, True, True]])
    out, w = _attention([[nan, 0.0]], K, V, key_padding_mask=pad)
    np.testing.assert_array_equal(out, [[0, 0]])
    np.testing.assert_array_equal(w, [[0, 0, 0]])
    # causal with Lq > Lk: the first query row sees no key
    out, w = _attention([[1.0, 0.0], [0.0, 1.0]], K[:1], V[:1], is_causal=True)
    np.testing.assert_array_equal(out[0], [0, 0])
    np.testing.assert_array_equal(out[1], V[0])


def test_no_keys_gives_zeros():
    out, w = _attention([[1.0, 0.0]], np.zeros((0, 2)), np.zeros((0, 2)))
    assert out.shape == (1, 2) and w.shape == (1, 0)
    np.testing.assert_array_equal(out, [[0, 0]])


def test_module_with_a_nan_query_weight_column_gives_nan_not_the_bias():
    rng = np.random.default_rng(0)
    e = 8
    w = [rng.standard_normal((e, e)) for _ in range(4)]
    w[0][:, 3] = nan
    m = reference.MultiHeadAttention.from_weights(*w, num_heads=2, out_bias=np.ones(e))
    out = m(rng.standard_normal((1, 4, e)))
    assert np.isnan(out).all()


def test_module_fully_padded_sequence_gives_exactly_the_bias():
    rng = np.random.default_rng(1)
    e = 8
    w = [rng.standard_normal((e, e)) for _ in range(4)]
    bias = np.arange(e) * 1.0
    m = reference.MultiHeadAttention.from_weights(*w, num_heads=2, out_bias=bias)
    x = rng.standard_normal((2, 4, e))
    x[1] = nan                                       # sequence 1: all padding, NaN garbage
    pad = np.array([[False, False, True, True], [True, True, True, True]])
    out = m(x[:, :2] * 0 + 1, x, key_padding_mask=pad)
    assert np.isfinite(out[0]).all()
    np.testing.assert_array_equal(out[1], np.broadcast_to(bias, (2, e)))
