"""Parity with PyTorch: weights copied from torch.nn.MultiheadAttention, and the inputs of
torch.nn.functional.scaled_dot_product_attention, give the same outputs. Skipped cleanly when
torch is not installed."""
import numpy as np
import pytest

import mha_cy
from mha_cy import reference

from conftest import DTYPES, random_bool_mask, random_float_mask, random_padding

torch = pytest.importorskip("torch")
F = torch.nn.functional

TORCH_DTYPE = {np.float32: torch.float32, np.float64: torch.float64}
# torch and mha_cy both compute natively in the dtype, with different summation orders
TOL = {np.float32: 1e-5, np.float64: 1e-12}


def assert_torch_close(actual, expected_tensor, dtype):
    expected = expected_tensor.detach().numpy()
    assert not np.isnan(expected).any()            # the comparison is only meaningful then
    assert actual.dtype == dtype and actual.shape == expected.shape
    scale = max(float(np.abs(expected).max()), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=TOL[dtype], atol=TOL[dtype] * scale)


def t(x):
    return torch.from_numpy(np.array(x, order="C"))       # a writable copy


def torch_mha(rng, dtype, embed_dim, num_heads, kdim=None, vdim=None):
    """A torch MultiheadAttention with random non-zero biases, and its weights for from_weights."""
    torch.manual_seed(int(rng.integers(2**31)))
    mod = torch.nn.MultiheadAttention(embed_dim, num_heads, batch_first=True, kdim=kdim,
                                      vdim=vdim, dtype=TORCH_DTYPE[dtype]).eval()
    with torch.no_grad():
        mod.in_proj_bias.uniform_(-0.5, 0.5)
        mod.out_proj.bias.uniform_(-0.5, 0.5)
    E = embed_dim
    bias = mod.in_proj_bias.detach().numpy()
    if mod._qkv_same_embed_dim:
        qw, kw, vw = np.split(mod.in_proj_weight.detach().numpy(), 3)
    else:
        qw, kw, vw = (p.detach().numpy() for p in (mod.q_proj_weight, mod.k_proj_weight,
                                                   mod.v_proj_weight))
    weights = dict(q_weight=qw, k_weight=kw, v_weight=vw,
                   out_weight=mod.out_proj.weight.detach().numpy(), num_heads=num_heads,
                   q_bias=bias[:E], k_bias=bias[E:2 * E], v_bias=bias[2 * E:],
                   out_bias=mod.out_proj.bias.detach().numpy())
    return mod, weights


def ours(weights, dtype):
    return (mha_cy.MultiHeadAttention.from_weights(**weights, dtype=dtype),
            reference.MultiHeadAttention.from_weights(**weights, dtype=dtype))


def run_torch(mod, q, k, v, **kwargs):
    with torch.no_grad():
        return mod(t(q), t(k), t(v), **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,L", [(1, 1), (2, 17), (3, 70)])
def test_self_attention(rng, dtype, batch, L):
    mod, w = torch_mha(rng, dtype, 32, 4)
    x = rng.standard_normal((batch, L, 32)).astype(dtype)
    expected, expected_w = run_torch(mod, x, x, x, need_weights=True, average_attn_weights=False)
    for mha in ours(w, dtype):
        out, weights = mha(x, need_weights=True)
        assert_torch_close(out, expected, dtype)
        assert_torch_close(weights, expected_w, dtype)
        assert_torch_close(mha(x), expected, dtype)
    # torch's need_weights=False (its fused fast path in eval mode) gives the same
    assert_torch_close(ours(w, dtype)[0](x), run_torch(mod, x, x, x, need_weights=False)[0],
                       dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_key_padding_mask(rng, dtype):
    mod, w = torch_mha(rng, dtype, 32, 4)
    x = rng.standard_normal((3, 40, 32)).astype(dtype)
    pad = random_padding(rng, 3, 40)                 # True = padding in both libraries
    expected, expected_w = run_torch(mod, x, x, x, key_padding_mask=t(pad),
                                     average_attn_weights=False)
    for mha in ours(w, dtype):
        out, weights = mha(x, key_padding_mask=pad, need_weights=True)
        assert_torch_close(out, expected, dtype)
        assert_torch_close(weights, expected_w, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ["2d", "3d"])
def test_bool_attn_mask(rng, dtype, shape):
    """torch.nn.MultiheadAttention's bool attn_mask means True = NOT allowed: invert it."""
    B, H, L = 2, 4, 30
    mod, w = torch_mha(rng, dtype, 32, H)
    x = rng.standard_normal((B, L, 32)).astype(dtype)
    allowed = random_bool_mask(rng, (L, L) if shape == "2d" else (B, H, L, L), 0.6)
    allowed[..., 0] = True                           # no fully masked row (torch gives NaN)
    torch_mask = ~allowed if shape == "2d" else ~allowed.reshape(B * H, L, L)
    expected, expected_w = run_torch(mod, x, x, x, attn_mask=t(torch_mask),
                                     average_attn_weights=False)
    for mha in ours(w, dtype):
        out, weights = mha(x, attn_mask=allowed, need_weights=True)
        assert_torch_close(out, expected, dtype)
        assert_torch_close(weights, expected_w, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_float_attn_mask_with_padding(rng, dtype):
    B, H, L = 2, 4, 30
    mod, w = torch_mha(rng, dtype, 32, H)
    x = rng.standard_normal((B, L, 32)).astype(dtype)
    mask = random_float_mask(rng, (L, L), 0.2).astype(dtype)
    mask[:, 0] = 0.5
    pad = random_padding(rng, B, L)
    pad[:, 0] = False
    # torch wants both masks of one type: its padding as a float mask, -inf = padding
    torch_pad = np.where(pad, -np.inf, 0).astype(dtype)
    expected, expected_w = run_torch(mod, x, x, x, attn_mask=t(mask),
                                     key_padding_mask=t(torch_pad), average_attn_weights=False)
    for mha in ours(w, dtype):
        out, weights = mha(x, attn_mask=mask, key_padding_mask=pad, need_weights=True)
        assert_torch_close(out, expected, dtype)
        assert_torch_close(weights, expected_w, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_is_causal(rng, dtype):
    """torch's is_causal is only a hint: it needs the causal mask itself as attn_mask."""
    L = 70
    mod, w = torch_mha(rng, dtype, 32, 4)
    x = rng.standard_normal((2, L, 32)).astype(dtype)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(L, dtype=TORCH_DTYPE[dtype])
    expected, expected_w = run_torch(mod, x, x, x, attn_mask=causal, is_causal=True,
                                     average_attn_weights=False)
    for mha in ours(w, dtype):
        out, weights = mha(x, is_causal=True, need_weights=True)
        assert_torch_close(out, expected, dtype)
        assert_torch_close(weights, expected_w, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_attention_kdim_vdim(rng, dtype):
    mod, w = torch_mha(rng, dtype, 32, 4, kdim=12, vdim=20)
    q = rng.standard_normal((2, 9, 32)).astype(dtype)
    k = rng.standard_normal((2, 13, 12)).astype(dtype)
    v = rng.standard_normal((2, 13, 20)).astype(dtype)
    pad = random_padding(rng, 2, 13)
    expected, expected_w = run_torch(mod, q, k, v, key_padding_mask=t(pad),
                                     average_attn_weights=False)
    for mha in ours(w, dtype):
        assert (mha.kdim, mha.vdim) == (12, 20)
        out, weights = mha(q, k, v, key_padding_mask=pad, need_weights=True)
        assert_torch_close(out, expected, dtype)
        assert_torch_close(weights, expected_w, dtype)


def test_torch_tensors_are_accepted(rng):
    mod, w = torch_mha(rng, np.float32, 16, 2)
    x = rng.standard_normal((2, 5, 16)).astype(np.float32)
    mha = mha_cy.MultiHeadAttention.from_weights(
        q_weight=t(w["q_weight"]), k_weight=t(w["k_weight"]), v_weight=t(w["v_weight"]),
        out_weight=mod.out_proj.weight, num_heads=2, q_bias=t(w["q_bias"]),
        k_bias=t(w["k_bias"]), v_bias=t(w["v_bias"]), out_bias=mod.out_proj.bias)
    assert mha.dtype == np.float32
    assert_torch_close(mha(t(x)), run_torch(mod, x, x, x)[0], np.float32)


# -- scaled_dot_product_attention --------------------------------------------------------------

def sdpa_inputs(rng, dtype, B, Hq, Hkv, q_len, k_len, D, Dv=None):
    Dv = D if Dv is None else Dv
    return (rng.standard_normal((B, Hq, q_len, D)).astype(dtype),
            rng.standard_normal((B, Hkv, k_len, D)).astype(dtype),
            rng.standard_normal((B, Hkv, k_len, Dv)).astype(dtype))


def _torch_has_enable_gqa():
    one = torch.zeros(1, 2, 1, 1)
    try:
        F.scaled_dot_product_attention(one, one[:, :1], one[:, :1], enable_gqa=True)
    except TypeError:
        return False
    return True


TORCH_GQA = _torch_has_enable_gqa()


def torch_sdpa(q, k, v, **kwargs):
    if q.shape[1] != k.shape[1]:
        if TORCH_GQA:
            kwargs["enable_gqa"] = True
        else:                   # older torch: repeat K/V per group (what enable_gqa means)
            group = q.shape[1] // k.shape[1]
            k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    if isinstance(kwargs.get("attn_mask"), np.ndarray):
        kwargs["attn_mask"] = t(kwargs["attn_mask"])
    with torch.no_grad():
        return F.scaled_dot_product_attention(t(q), t(k), t(v), **kwargs)


def check_sdpa(q, k, v, dtype, torch_kwargs=None, **kwargs):
    expected = torch_sdpa(q, k, v, **(torch_kwargs if torch_kwargs is not None else kwargs))
    for sdpa in (mha_cy.scaled_dot_product_attention, reference.scaled_dot_product_attention):
        assert_torch_close(sdpa(q, k, v, **kwargs), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("q_len,k_len", [(1, 40), (33, 33), (70, 300)])
def test_sdpa(rng, dtype, Hq, Hkv, q_len, k_len):
    q, k, v = sdpa_inputs(rng, dtype, 2, Hq, Hkv, q_len, k_len, 16)
    check_sdpa(q, k, v, dtype)
    check_sdpa(q, k, v, dtype, scale=0.3)
    # F.sdpa's bool mask means True = take part, as ours
    mask = random_bool_mask(rng, (2, Hq, q_len, k_len), 0.7)
    mask[..., 0] = True
    check_sdpa(q, k, v, dtype, attn_mask=mask)
    fmask = random_float_mask(rng, (q_len, k_len), 0.2)
    fmask[:, 0] = 0
    check_sdpa(q, k, v, dtype, attn_mask=fmask.astype(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (6, 2)])
def test_sdpa_value_head_dim(rng, dtype, Hq, Hkv):
    q, k, v = sdpa_inputs(rng, dtype, 2, Hq, Hkv, 9, 20, 16, Dv=24)
    check_sdpa(q, k, v, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L", [1, 33, 300])
def test_sdpa_causal_square(rng, dtype, L):
    q, k, v = sdpa_inputs(rng, dtype, 2, 4, 2, L, L, 16)
    check_sdpa(q, k, v, dtype, is_causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_len,k_len", [(1, 40), (7, 300), (40, 50)])
def test_sdpa_causal_bottom_right(rng, dtype, q_len, k_len):
    """torch's is_causal is top-left for Lq != Lk: compare with a bottom-right mask built by
    hand (and with torch's own causal_lower_right where this torch has it)."""
    q, k, v = sdpa_inputs(rng, dtype, 2, 4, 1, q_len, k_len, 16)
    i, j = np.ogrid[:q_len, :k_len]
    bottom_right = np.ascontiguousarray(np.broadcast_to(j <= i + (k_len - q_len),
                                                        (q_len, k_len)))
    check_sdpa(q, k, v, dtype, torch_kwargs=dict(attn_mask=t(bottom_right)), is_causal=True)
    try:
        from torch.nn.attention.bias import causal_lower_right
    except ImportError:          # older torch: the hand-made mask above is the check
        return
    expected = torch_sdpa(q, np.repeat(k, 4, 1), np.repeat(v, 4, 1),
                          attn_mask=causal_lower_right(q_len, k_len))
    assert_torch_close(mha_cy.scaled_dot_product_attention(q, k, v, is_causal=True), expected,
                       dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kdim,vdim", [(None, None), (12, 20)])
@pytest.mark.parametrize("bias", [True, False])
def test_from_torch(rng, dtype, kdim, vdim, bias):
    """MultiHeadAttention.from_torch reads a torch module directly (fused or separate q/k/v
    projections, with or without bias) and gives torch's outputs."""
    torch.manual_seed(int(rng.integers(2**31)))
    mod = torch.nn.MultiheadAttention(32, 4, bias=bias, kdim=kdim, vdim=vdim, batch_first=True,
                                      dtype=TORCH_DTYPE[dtype]).eval()
    if bias:
        with torch.no_grad():
            mod.in_proj_bias.uniform_(-0.5, 0.5)
            mod.out_proj.bias.uniform_(-0.5, 0.5)
    x = rng.standard_normal((2, 9, 32)).astype(dtype)
    kv = rng.standard_normal((2, 11, kdim or 32)).astype(dtype)
    val = rng.standard_normal((2, 11, vdim or 32)).astype(dtype)
    expected = run_torch(mod, x, kv, val, need_weights=False)[0]
    for cls in (mha_cy.MultiHeadAttention, reference.MultiHeadAttention):
        mha = cls.from_torch(mod)
        assert mha.dtype == np.dtype(dtype) and (mha.out_bias is not None) == bias
        assert_torch_close(mha(x, kv, val), expected, dtype)


def test_from_torch_rejects_bias_kv():
    for kwargs in (dict(add_bias_kv=True), dict(add_zero_attn=True)):
        mod = torch.nn.MultiheadAttention(8, 2, **kwargs)
        with pytest.raises(ValueError, match="add_bias_kv|add_zero_attn"):
            mha_cy.MultiHeadAttention.from_torch(mod)
