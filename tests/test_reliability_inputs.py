"""Input conversion: dtype=None is refused, bool data is converted like any other input."""
import numpy as np
import pytest

import mha_cy
from mha_cy import reference
from mha_cy._checks import as_array, float_dtype


@pytest.mark.parametrize("impl", [mha_cy, reference])
def test_constructor_dtype_none_raises_naming_the_argument(impl):
    # np.dtype(None) is float64: None used to give a float64 module silently.
    with pytest.raises(TypeError, match=r"dtype must be float32 or float64; got None"):
        impl.MultiHeadAttention(8, 2, dtype=None)


def test_float_dtype_none_raises_and_names_the_argument():
    with pytest.raises(TypeError, match=r"^cache_dtype must be float32 or float64; got None"):
        float_dtype(None, "cache_dtype")
    assert float_dtype(np.float32) == np.float32
    assert float_dtype("float64") == np.float64


def test_from_weights_dtype_none_still_infers_from_the_weights():
    w = [np.eye(4)] * 4                                          # float64 weights
    assert mha_cy.MultiHeadAttention.from_weights(*w, num_heads=2).dtype == np.float64
    w32 = [np.eye(4, dtype=np.float32)] * 4
    assert mha_cy.MultiHeadAttention.from_weights(*w32, num_heads=2, dtype=None).dtype == np.float32


def test_as_array_accepts_bool_data():
    arr = as_array(np.array([True, False]), "x")
    assert arr.dtype == np.bool_
    with pytest.raises(TypeError, match="x must have a real floating"):
        as_array(np.array(["a"]), "x")
    with pytest.raises(TypeError, match="x must have a real floating"):
        as_array(np.array([1 + 2j]), "x")


@pytest.mark.parametrize("impl", [mha_cy, reference])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_module_converts_bool_inputs(impl, dtype):
    rng = np.random.default_rng(0)
    m = impl.MultiHeadAttention(8, 2, dtype=dtype, seed=0)
    x = rng.random((2, 5, 8)) > 0.5
    out = m(x)
    assert out.dtype == dtype
    np.testing.assert_array_equal(out, m(x.astype(dtype)))
    out_kv = m(x, x[:, :3], x[:, :3])
    np.testing.assert_array_equal(out_kv, m(x.astype(dtype), x[:, :3].astype(dtype)))


@pytest.mark.parametrize("impl", [mha_cy, reference])
def test_sdpa_converts_bool_inputs(impl):
    rng = np.random.default_rng(1)
    q, k, v = (rng.random((1, 2, 4, 8)) > 0.5 for _ in range(3))
    out = impl.scaled_dot_product_attention(q, k, v)
    assert out.dtype == np.float32
    f = [a.astype(np.float32) for a in (q, k, v)]
    np.testing.assert_array_equal(out, impl.scaled_dot_product_attention(*f))


def test_bool_weights_are_data():
    w = [np.eye(4, dtype=bool)] * 4
    m = mha_cy.MultiHeadAttention.from_weights(*w, num_heads=2)
    assert m.dtype == np.float32
    np.testing.assert_array_equal(m.q_weight, np.eye(4, dtype=np.float32))


def test_bool_masks_keep_their_meaning():
    # A bool key_padding_mask is still True = padding, not data.
    m = mha_cy.MultiHeadAttention(8, 2, seed=0)
    x = np.random.default_rng(2).standard_normal((1, 4, 8)).astype(np.float32)
    pad = np.array([[False, False, True, True]])
    np.testing.assert_allclose(m(x[:, :2], x, key_padding_mask=pad), m(x[:, :2], x[:, :2]),
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="key_padding_mask must be a bool array"):
        m(x, key_padding_mask=pad.astype(np.float32))


@pytest.mark.parametrize("impl", [mha_cy, reference])
def test_big_endian_float64_computes_in_float64(impl):
    # '>f8' == np.float64 is False: such inputs were computed, and returned, in float32
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 2, 5, 8)) for _ in range(3))
    out = impl.scaled_dot_product_attention(q.astype(">f8"), k, v.astype(">f8"))
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, impl.scaled_dot_product_attention(q, k, v))
    w = [rng.standard_normal((8, 8)) for _ in range(4)]
    m = impl.MultiHeadAttention.from_weights(*[a.astype(">f8") for a in w], num_heads=2)
    assert m.dtype == np.float64
    np.testing.assert_array_equal(m.in_proj_weight, np.concatenate(w[:3]))


@pytest.mark.parametrize("causal", [False, True])
def test_values_near_float32_max_stay_finite_in_float64(causal):
    # README "range": the one-pass softmax sums weighted values before dividing, so float32
    # values near 3.4e38 / keys may overflow; the same data in float64 must match the
    # two-pass reference (the remedy the README gives).
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, 6, 8)) for _ in range(3))
    v = v * 1e38
    got = mha_cy.scaled_dot_product_attention(q, k, v, is_causal=causal)
    want = reference.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
