"""mha_cy.reference, the oracle of every other test, checked against the textbook formula.

The slow oracle here is written independently of mha_cy: explicit Python loops over batch,
head, query and key, per-head slices of the weights, math.exp, the mask rules of DESIGN.md
spelled out one key at a time. Sizes are tiny.
"""
import math

import numpy as np
import pytest

from mha_cy import reference

from conftest import random_bool_mask, random_float_mask, random_weights

TOL = dict(rtol=1e-12, atol=1e-13)


def slow_attention_head(q, k, v, allowed, add, scale):
    """One head: q (Lq, D), k (Lk, D), v (Lk, Dv); allowed[i][j] bool, add[i][j] float."""
    q_len, k_len, dv = len(q), len(k), len(v[0]) if len(v) else 0
    out = np.zeros((q_len, dv))
    weights = np.zeros((q_len, k_len))
    for i in range(q_len):
        scores = {}
        for j in range(k_len):
            if allowed[i][j]:
                s = sum(q[i][d] * k[j][d] for d in range(len(q[i]))) * scale + add[i][j]
                if s != -math.inf:
                    scores[j] = s
        if not scores:
            continue                      # every key masked: zeros
        top = max(scores.values())
        total = sum(math.exp(s - top) for s in scores.values())
        for j, s in scores.items():
            weights[i, j] = math.exp(s - top) / total
            for d in range(dv):
                out[i, d] += weights[i, j] * v[j][d]
    return out, weights


def slow_masks(b, h, q_len, k_len, attn_mask, key_padding_mask, is_causal):
    """allowed[i][j], add[i][j] of batch b, head h, from masks given in full (B, H, Lq, Lk)."""
    allowed = [[True] * k_len for _ in range(q_len)]
    add = [[0.0] * k_len for _ in range(q_len)]
    for i in range(q_len):
        for j in range(k_len):
            if key_padding_mask is not None and key_padding_mask[b][j]:
                allowed[i][j] = False
            if is_causal and j > i + (k_len - q_len):
                allowed[i][j] = False
            if attn_mask is not None:
                m = attn_mask[b][h][i][j]
                if isinstance(m, (bool, np.bool_)):
                    allowed[i][j] = allowed[i][j] and bool(m)
                else:
                    add[i][j] = float(m)
    return allowed, add


def slow_mha(w, query, key, value, attn_mask=None, key_padding_mask=None, is_causal=False):
    """The textbook multi-head attention with per-head weight slices, loop by loop."""
    H, Hkv = w["num_heads"], w["num_kv_heads"]
    D = w["q_weight"].shape[0] // H
    E = w["out_weight"].shape[0]
    zeros = np.zeros

    def lin(x, W, b):
        return x @ W.T + (zeros(W.shape[0]) if b is None else b)

    B, q_len, k_len = query.shape[0], query.shape[1], key.shape[1]
    out = np.zeros((B, q_len, E))
    weights = np.zeros((B, H, q_len, k_len))
    for b in range(B):
        heads = []
        for h in range(H):
            g = h // (H // Hkv)           # the key/value head query head h shares
            rq, rkv = slice(h * D, (h + 1) * D), slice(g * D, (g + 1) * D)
            q = lin(query[b], w["q_weight"][rq], None if w.get("q_bias") is None
                    else w["q_bias"][rq])
            k = lin(key[b], w["k_weight"][rkv], None if w.get("k_bias") is None
                    else w["k_bias"][rkv])
            v = lin(value[b], w["v_weight"][rkv], None if w.get("v_bias") is None
                    else w["v_bias"][rkv])
            allowed, add = slow_masks(b, h, q_len, k_len, attn_mask, key_padding_mask,
                                      is_causal)
            o, weights[b, h] = slow_attention_head(q.tolist(), k.tolist(), v.tolist(), allowed,
                                                   add, 1 / math.sqrt(D))
            heads.append(o)
        out[b] = lin(np.concatenate(heads, axis=1), w["out_weight"], w.get("out_bias"))
    return out, weights


def full_mask(mask, B, H, q_len, k_len):
    """A mask of any accepted shape as nested (B, H, Lq, Lk) lists (the broadcast done by hand)."""
    if mask is None:
        return None
    mask = np.asarray(mask)
    if mask.ndim == 2:
        mask = mask[None, None]
    elif mask.ndim == 3:
        mask = mask[:, None]
    return np.broadcast_to(mask, (B, H, q_len, k_len)).tolist()


CONFIGS = [  # (embed_dim, num_heads, num_kv_heads)
    (8, 2, 2),    # MHA
    (12, 4, 2),   # GQA
    (8, 4, 1),    # MQA
]


@pytest.mark.parametrize("E,H,Hkv", CONFIGS)
@pytest.mark.parametrize("q_len,k_len", [(3, 3), (1, 4), (2, 5), (5, 3)])
@pytest.mark.parametrize("masks", ["none", "padding", "bool", "float", "all"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_reference_mha_equals_textbook_loops(rng, E, H, Hkv, q_len, k_len, masks, is_causal):
    B, kdim, vdim = 2, 5, 7
    w = random_weights(rng, E, H, Hkv, kdim=kdim, vdim=vdim)
    query = rng.standard_normal((B, q_len, E))
    key = rng.standard_normal((B, k_len, kdim))
    value = rng.standard_normal((B, k_len, vdim))
    attn_mask = key_padding_mask = None
    if masks in ("padding", "all"):
        key_padding_mask = rng.random((B, k_len)) < 0.3
    if masks == "bool":
        attn_mask = random_bool_mask(rng, (B, H, q_len, k_len))
    if masks in ("float", "all"):
        attn_mask = random_float_mask(rng, (q_len, k_len))

    mha = reference.MultiHeadAttention.from_weights(**w, dtype=np.float64)
    out, weights = mha(query, key, value, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                       is_causal=is_causal, need_weights=True)
    slow_out, slow_weights = slow_mha(w, query, key, value,
                                      full_mask(attn_mask, B, H, q_len, k_len),
                                      key_padding_mask, is_causal)
    np.testing.assert_allclose(weights, slow_weights, **TOL)
    np.testing.assert_allclose(out, slow_out, **TOL)


def test_reference_self_attention_no_bias(rng):
    w = random_weights(rng, 8, 2, bias=False)
    x = rng.standard_normal((2, 4, 8))
    mha = reference.MultiHeadAttention.from_weights(**w, dtype=np.float64)
    assert mha.out_bias is None
    out = mha(x, is_causal=True)
    np.testing.assert_allclose(out, slow_mha(w, x, x, x, is_causal=True)[0], **TOL)


@pytest.mark.parametrize("q_len,k_len", [(1, 6), (4, 6), (6, 6), (6, 2)])
def test_reference_causal_is_bottom_right(rng, q_len, k_len):
    """Query i sees exactly the keys j <= i + Lk - Lq (all weights > 0 there, 0 elsewhere)."""
    q = rng.standard_normal((1, 2, q_len, 4))
    k = rng.standard_normal((1, 2, k_len, 4))
    _, weights = reference._attention(q, k, k, None, None, True, 0.5)
    i, j = np.ogrid[:q_len, :k_len]
    visible = np.broadcast_to(j <= i + (k_len - q_len), weights.shape)
    assert (weights[visible] > 0).all()
    assert (weights[~visible] == 0).all()
    rows_with_keys = (k_len - q_len + np.arange(q_len)) >= 0
    np.testing.assert_allclose(weights.sum(-1)[..., rows_with_keys], 1, rtol=1e-12)
    np.testing.assert_array_equal(weights.sum(-1)[..., ~rows_with_keys], 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_reference_fully_masked_rows_are_zeros(rng, dtype):
    E, H, B, L = 8, 2, 2, 4
    mha = reference.MultiHeadAttention(E, H, dtype=dtype, seed=1)
    x = rng.standard_normal((B, L, E))
    pad = np.zeros((B, L), bool)
    pad[1] = True                                   # sequence 1: every key is padding
    attn_mask = np.ones((L, L), bool)
    attn_mask[2] = False                            # query 2: no key allowed
    float_mask = np.zeros((L, L))
    float_mask[3] = -np.inf                         # query 3: every key at -inf
    out, weights = mha(x, key_padding_mask=pad, attn_mask=attn_mask, need_weights=True)
    out2, weights2 = mha(x, attn_mask=float_mask, need_weights=True)
    for o, wts in ((out, weights), (out2, weights2)):
        assert np.isfinite(o).all() and np.isfinite(wts).all()
    # a zero context gives exactly the output bias (zero at init)
    np.testing.assert_array_equal(out[1], 0)
    np.testing.assert_array_equal(out[0, 2], 0)
    np.testing.assert_array_equal(weights[1], 0)
    np.testing.assert_array_equal(weights[0, :, 2], 0)
    np.testing.assert_array_equal(weights2[:, :, 3], 0)
    np.testing.assert_array_equal(out2[:, 3], 0)
    sums = weights.sum(-1)
    assert np.all((np.abs(sums - 1) < 1e-5) | (sums == 0))
    assert (sums[0, :, [0, 1, 3]] > 0.99).all()
    # causal with Lq > Lk: the first Lq - Lk queries see nothing
    q = rng.standard_normal((1, 1, 5, 3)).astype(dtype)
    k = rng.standard_normal((1, 1, 2, 3)).astype(dtype)
    o = reference.scaled_dot_product_attention(q, k, k, is_causal=True)
    np.testing.assert_array_equal(o[0, 0, :3], 0)
    assert np.abs(o[0, 0, 3:]).min() > 0


@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (4, 2), (3, 1)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_reference_sdpa_equals_textbook_loops(rng, Hq, Hkv, is_causal):
    B, q_len, k_len, D, Dv = 2, 3, 5, 4, 6
    q = rng.standard_normal((B, Hq, q_len, D))
    k = rng.standard_normal((B, Hkv, k_len, D))
    v = rng.standard_normal((B, Hkv, k_len, Dv))
    mask = random_bool_mask(rng, (B, 1, q_len, k_len))
    out = reference.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                                 scale=0.3)
    assert out.shape == (B, Hq, q_len, Dv)
    full = full_mask(mask, B, Hq, q_len, k_len)
    for b in range(B):
        for h in range(Hq):
            g = h // (Hq // Hkv)
            allowed, add = slow_masks(b, h, q_len, k_len, full, None, is_causal)
            o, _ = slow_attention_head(q[b, h].tolist(), k[b, g].tolist(), v[b, g].tolist(),
                                       allowed, add, 0.3)
            np.testing.assert_allclose(out[b, h], o, **TOL)


def test_reference_weights_rows_sum_to_one(rng):
    mha = reference.MultiHeadAttention(16, 4, num_kv_heads=2, dtype=np.float64, seed=0)
    x = rng.standard_normal((3, 7, 16))
    _, weights = mha(x, attn_mask=random_float_mask(rng, (3, 1, 7, 7), 0.0), need_weights=True)
    assert weights.shape == (3, 4, 7, 7)
    assert (weights >= 0).all()
    np.testing.assert_allclose(weights.sum(-1), 1, rtol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_reference_keeps_the_dtype(rng, dtype):
    """Regression: the default scale 1/np.sqrt(D) (a NumPy float64) promoted float32 to
    float64 in the reference, so its float32 results were float64 arrays."""
    mha = reference.MultiHeadAttention(8, 2, dtype=dtype, seed=0)
    out, weights = mha(rng.standard_normal((2, 3, 8)), need_weights=True)
    assert out.dtype == weights.dtype == dtype
    q = rng.standard_normal((1, 2, 3, 4)).astype(dtype)
    assert reference.scaled_dot_product_attention(q, q, q).dtype == dtype
    assert reference.scaled_dot_product_attention(q, q, q, scale=0.5).dtype == dtype
