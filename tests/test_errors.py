"""Bad input raises ValueError/TypeError whose message names the argument (and the expected and
actual values). Both implementations share the checks: every call is tried on both."""
import numpy as np
import pytest

import mha_cy
from mha_cy import reference

CLASSES = [mha_cy.MultiHeadAttention, reference.MultiHeadAttention]
SDPAS = [mha_cy.scaled_dot_product_attention, reference.scaled_dot_product_attention]


@pytest.fixture(params=["fast", "reference"])
def cls(request):
    return CLASSES[request.param == "reference"]


@pytest.fixture(params=["fast", "reference"])
def sdpa(request):
    return SDPAS[request.param == "reference"]


@pytest.fixture
def mha(cls):
    return cls(16, 4, num_kv_heads=2, seed=0)


X = np.ones((2, 3, 16))


# -- constructor ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(embed_dim=10, num_heads=4), ValueError, r"num_heads \(4\) must divide embed_dim \(10\)"),
    (dict(embed_dim=16, num_heads=4, num_kv_heads=3), ValueError,
     r"num_kv_heads \(3\) must divide num_heads \(4\)"),
    (dict(embed_dim=0, num_heads=1), ValueError, "embed_dim must be >= 1; got 0"),
    (dict(embed_dim=16, num_heads=-2), ValueError, "num_heads must be >= 1; got -2"),
    (dict(embed_dim=16.0, num_heads=4), TypeError, "embed_dim must be an int"),
    (dict(embed_dim=16, num_heads=True), TypeError, "num_heads must be an int"),
    (dict(embed_dim=16, num_heads=4, num_kv_heads=0), ValueError, "num_kv_heads must be >= 1"),
    (dict(embed_dim=16, num_heads=4, head_dim=0), ValueError, "head_dim must be >= 1"),
    (dict(embed_dim=16, num_heads=4, kdim=0), ValueError, "kdim must be >= 1"),
    (dict(embed_dim=16, num_heads=4, vdim="8"), TypeError, "vdim must be an int"),
    (dict(embed_dim=16, num_heads=4, dtype=np.int32), TypeError,
     "dtype must be float32 or float64; got int32"),
    (dict(embed_dim=16, num_heads=4, dtype=np.float16), TypeError, "dtype must be float32"),
    (dict(embed_dim=16, num_heads=4, dtype="complex128"), TypeError, "dtype must be float32"),
    (dict(embed_dim=16, num_heads=4, dtype="not a dtype"), TypeError, "dtype must be float32"),
    (dict(embed_dim=16, num_heads=4, bias=1), TypeError, "bias must be a bool"),
])
def test_constructor_errors(cls, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        cls(**kwargs)


def test_head_dim_need_not_divide(cls):
    mha = cls(10, 4, head_dim=3)            # embed_dim need not be num_heads * head_dim
    assert mha.q_weight.shape == (12, 10) and mha(np.ones((1, 2, 10))).shape == (1, 2, 10)


# -- from_weights -----------------------------------------------------------------------------

def weights(E=16, H=4, Hkv=2, D=4, kdim=16, vdim=16):
    return dict(q_weight=np.ones((H * D, E)), k_weight=np.ones((Hkv * D, kdim)),
                v_weight=np.ones((Hkv * D, vdim)), out_weight=np.ones((E, H * D)))


@pytest.mark.parametrize("change,exc,match", [
    (dict(k_weight=np.ones((6, 16))), ValueError,
     r"k_weight has 6 rows; expected num_kv_heads \* head_dim = 2 \* 4 = 8"),
    (dict(v_weight=np.ones((16, 16))), ValueError, "v_weight has 16 rows; expected"),
    (dict(out_weight=np.ones((16, 8))), ValueError,
     r"out_weight must have shape .* = \(16, 16\); got \(16, 8\)"),
    (dict(out_weight=np.ones((12, 16))), ValueError, "out_weight must have shape"),
    (dict(q_weight=np.ones((18, 16))), ValueError, "q_weight has 18 rows, which num_heads=4"),
    (dict(q_weight=np.ones(16)), ValueError, r"q_weight must be 2-D .*got shape \(16,\)"),
    (dict(k_weight=np.ones((8, 16, 1))), ValueError, "k_weight must be 2-D"),
    (dict(q_weight=np.ones((16, 16), complex)), TypeError, "q_weight must have a real"),
    (dict(v_weight=[["a"] * 16] * 8), TypeError, "v_weight must have a real"),
    (dict(q_bias=np.ones(15)), ValueError, r"q_bias must have shape \(16,\); got \(15,\)"),
    (dict(k_bias=np.ones(16)), ValueError, r"k_bias must have shape \(8,\)"),
    (dict(out_bias=np.ones((1, 16))), ValueError, r"out_bias must have shape \(16,\)"),
    (dict(num_kv_heads=3), ValueError, r"num_kv_heads \(3\) must divide num_heads \(4\)"),
    (dict(num_heads=0), ValueError, "num_heads must be >= 1"),
    (dict(dtype=np.int64), TypeError, "dtype must be float32 or float64"),
])
def test_from_weights_errors(cls, change, exc, match):
    kwargs = dict(weights(), num_heads=4, num_kv_heads=2)
    kwargs.update(change)
    with pytest.raises(exc, match=match):
        cls.from_weights(**kwargs)


def test_from_weights_infers_dims(cls):
    mha = cls.from_weights(**weights(E=12, H=4, Hkv=1, D=5, kdim=7, vdim=9), num_heads=4,
                           num_kv_heads=1)
    assert (mha.embed_dim, mha.kdim, mha.vdim, mha.head_dim) == (12, 7, 9, 5)
    assert mha.num_kv_heads == 1 and mha.out_bias is None


# -- inputs -----------------------------------------------------------------------------------

@pytest.mark.parametrize("args,exc,match", [
    ((np.ones(16),), ValueError, r"query must be 2-D or 3-D .*got shape \(16,\)"),
    ((np.ones((1, 2, 3, 16)),), ValueError,
     r"query must be 2-D or 3-D .*got shape \(1, 2, 3, 16\)"),
    ((np.ones((2, 3, 15)),), ValueError, "query has last axis .embed_dim. of size 15; expected 16"),
    ((X, np.ones((2, 5))), ValueError, r"key must be 3-D like query .*got shape \(2, 5\)"),
    ((X, np.ones((2, 5, 16)), np.ones((5, 16))), ValueError, "value must be 3-D like query"),
    ((X, np.ones((2, 5, 12))), ValueError, "key has last axis .kdim. of size 12; expected 16"),
    ((X, np.ones((2, 5, 16)), np.ones((2, 5, 8))), ValueError,
     "value has last axis .vdim. of size 8; expected 16"),
    ((X, np.ones((3, 5, 16))), ValueError, "key has batch size 3; expected 2"),
    ((X, np.ones((2, 5, 16)), np.ones((1, 5, 16))), ValueError,
     "value has batch size 1; expected 2"),
    ((X, np.ones((2, 5, 16)), np.ones((2, 4, 16))), ValueError,
     "value has length .* 4; expected 5"),
    ((X, None, np.ones((2, 3, 16))), ValueError, "value was given without key"),
    ((X.astype(complex),), TypeError, "query must have a real .*complex128"),
    ((X, X.astype(np.complex64)), TypeError, "key must have a real .*complex64"),
    ((np.full((2, 3, 16), None, dtype=object),), TypeError, "query must have a real .*object"),
    (("abc",), TypeError, "query must have a real"),
])
def test_input_errors(mha, args, exc, match):
    with pytest.raises(exc, match=match):
        mha(*args)


def test_self_attention_needs_kdim_equal_embed_dim(cls):
    mha = cls(16, 4, kdim=8, seed=0)
    with pytest.raises(ValueError, match="key is required: this module has kdim=8"):
        mha(X)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(is_causal=1), TypeError, "is_causal must be a bool; got 1"),
    (dict(is_causal=None), TypeError, "is_causal must be a bool"),
    (dict(need_weights="yes"), TypeError, "need_weights must be a bool; got 'yes'"),
    (dict(need_weights=np.array([True, False])), TypeError, "need_weights must be a bool"),
])
def test_flag_errors(mha, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        mha(X, **kwargs)


def test_numpy_bools_are_accepted(mha):
    out, w = mha(X, is_causal=np.bool_(True), need_weights=np.bool_(True))
    assert w.shape == (2, 4, 3, 3)


# -- masks ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(key_padding_mask=np.zeros((2, 4), bool)), ValueError,
     r"key_padding_mask must have shape \(batch, key_len\) = \(2, 3\); got \(2, 4\)"),
    (dict(key_padding_mask=np.zeros(3, bool)), ValueError,
     r"key_padding_mask must have shape .*got \(3,\)"),
    (dict(key_padding_mask=np.zeros((2, 3))), TypeError,
     "key_padding_mask must be a bool array .*got dtype float64"),
    (dict(key_padding_mask=np.zeros((2, 3), np.uint8)), TypeError,
     "key_padding_mask must be a bool array"),
    (dict(attn_mask=np.ones((3, 3), np.int64)), TypeError,
     "attn_mask must be bool .* or floating .*got dtype int64"),
    (dict(attn_mask=np.ones((3, 3), complex)), TypeError, "attn_mask must be bool"),
    (dict(attn_mask=np.ones((3, 4), bool)), ValueError,
     r"attn_mask of shape \(3, 4\) does not fit \(Lq, Lk\) = \(3, 3\)"),
    (dict(attn_mask=np.ones((3, 3, 3))), ValueError,
     r"attn_mask of shape \(3, 3, 3\) does not fit \(B, Lq, Lk\) = \(2, 3, 3\)"),
    (dict(attn_mask=np.ones((2, 3, 3, 3))), ValueError,
     r"attn_mask of shape \(2, 3, 3, 3\) does not fit \(B, H, Lq, Lk\) = \(2, 4, 3, 3\)"),
    (dict(attn_mask=np.ones(3, bool)), ValueError,
     r"attn_mask must be 2-D \(Lq, Lk\), 3-D .*got shape \(3,\)"),
    (dict(attn_mask=np.ones((1, 2, 4, 3, 3), bool)), ValueError, "attn_mask must be 2-D"),
])
def test_mask_errors(mha, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        mha(X, **kwargs)


def test_pytorch_3d_mask_layout_gets_a_hint(mha):
    with pytest.raises(ValueError, match=r"PyTorch's \(B \* num_heads, Lq, Lk\) layout"):
        mha(X, attn_mask=np.zeros((2 * 4, 3, 3)))
    with pytest.raises(ValueError, match=r"PyTorch's .*reshape it to \(B, num_heads, Lq, Lk\)"):
        mha(X[:1], attn_mask=np.zeros((4, 3, 3), bool))
    # torch's SDPA reads a 3-D mask per head (right-aligned broadcasting); here it is per
    # sequence, so a per-head mask of a batch of 2 does not fit, and the error says how to
    # write it
    with pytest.raises(ValueError, match=r"reshape it to \(1, num_heads, Lq, Lk\)"):
        mha(X, attn_mask=np.zeros((4, 3, 3), bool))


def test_unbatched_padding_mask_shape(mha):
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):
        mha(X[0], key_padding_mask=np.zeros(4, bool))
    assert mha(X[0], key_padding_mask=np.zeros(3, bool)).shape == (3, 16)


# -- cache ------------------------------------------------------------------------------------

def test_cache_overflow_error(mha):
    cache = mha.new_cache(2, 4)
    mha(X, cache=cache)
    with pytest.raises(ValueError, match=r"cache overflow: 3 cached \+ 3 new tokens > max_len 4"):
        mha(X, cache=cache)
    assert cache.length == 3


# -- scaled_dot_product_attention --------------------------------------------------------------

Q = np.ones((2, 4, 3, 8))
KV = np.ones((2, 2, 5, 8))


@pytest.mark.parametrize("args,kwargs,exc,match", [
    ((Q[0], KV, KV), {}, ValueError, r"q must be 4-D \(batch, heads, length, head_dim\)"),
    ((Q, KV[0], KV), {}, ValueError, "k must be 4-D"),
    ((Q, KV, KV[..., None]), {}, ValueError, "v must be 4-D"),
    ((Q, np.ones((1, 2, 5, 8)), KV), {}, ValueError, "k has batch size 1; expected 2"),
    ((Q, KV, np.ones((3, 2, 5, 8))), {}, ValueError, "v has batch size 3; expected 2"),
    ((Q, np.ones((2, 2, 5, 7)), KV), {}, ValueError, "k has head_dim .* 7; expected 8"),
    ((Q, KV, np.ones((2, 1, 5, 8))), {}, ValueError, "v has heads .* 1; expected 2"),
    ((Q, KV, np.ones((2, 2, 4, 8))), {}, ValueError, "v has length .* 4; expected 5"),
    ((Q, np.ones((2, 3, 5, 8)), np.ones((2, 3, 5, 8))), {}, ValueError,
     "q has 4 heads and k/v have 3"),
    ((Q, np.ones((2, 0, 5, 8)), np.ones((2, 0, 5, 8))), {}, ValueError,
     "q has 4 heads and k/v have 0"),
    ((Q.astype(complex), KV, KV), {}, TypeError, "q must have a real"),
    ((Q, KV, KV.astype(object)), {}, TypeError, "v must have a real"),
    ((Q, KV, KV), dict(scale="2"), TypeError, "scale must be a real number or None"),
    ((Q, KV, KV), dict(scale=True), TypeError, "scale must be a real number"),
    ((Q, KV, KV), dict(scale=np.inf), ValueError, "scale must be finite"),
    ((Q, KV, KV), dict(scale=10 ** 400), ValueError, "scale must be finite"),   # was a
    ((Q, KV, KV), dict(scale=-10 ** 400), ValueError, "scale must be finite"),  # NumPy TypeError
    ((Q, KV, KV), dict(is_causal="no"), TypeError, "is_causal must be a bool"),
    ((Q, KV, KV), dict(attn_mask=np.ones((3, 4), bool)), ValueError,
     r"attn_mask of shape \(3, 4\) does not fit \(Lq, Lk\) = \(3, 5\)"),
    ((Q, KV, KV), dict(attn_mask=np.ones((3, 5), np.int8)), TypeError, "attn_mask must be bool"),
    ((Q, KV, KV), dict(attn_mask=np.ones((8, 3, 5))), ValueError, "PyTorch's"),
])
def test_sdpa_errors(sdpa, args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        sdpa(*args, **kwargs)


def test_sdpa_scale_may_be_any_real_number(sdpa):
    """numbers.Real is what check_scale accepts: a Fraction raised NumPy's TypeError
    ("ufunc 'isfinite' not supported") instead of being used."""
    from fractions import Fraction
    q = np.random.default_rng(0).standard_normal((1, 2, 3, 8))
    np.testing.assert_array_equal(sdpa(q, q, q, scale=Fraction(1, 4)), sdpa(q, q, q, scale=0.25))


# -- threads ----------------------------------------------------------------------------------

@pytest.mark.parametrize("n,exc", [(0, ValueError), (-1, ValueError), (1.5, TypeError),
                                   (True, TypeError), ("2", TypeError)])
def test_set_num_threads_errors(n, exc):
    before = mha_cy.get_num_threads()
    with pytest.raises(exc, match="n must be an int >= 1 or None"):
        mha_cy.set_num_threads(n)
    with pytest.raises(exc, match="n must be an int >= 1 or None"):
        with mha_cy.threads(n):
            pass
    assert mha_cy.get_num_threads() == before
