"""Sliding-window attention (window=): SDPA and the module against an explicit boolean mask,
for both tile kernels, prefill, decode with a cache, split-K lengths, GQA, need_weights; keys
outside the window are not read; thread-count invariance; argument errors."""
import sys

import numpy as np
import pytest

import mha_cy
from mha_cy import _attention_kernel, reference

from conftest import DTYPES, assert_close, make_pair


@pytest.fixture
def small_tiles():
    """Tiles of 16 queries x 32 keys: windows then cover tiles fully, partly or not at all."""
    previous = _attention_kernel._set_tile_sizes(16, 32)
    yield
    _attention_kernel._set_tile_sizes(*previous)


def window_mask(q_len, k_len, window):
    """The contract written out: slot i sees j with i + (Lk - Lq) - window < j <= i + Lk - Lq."""
    i = np.arange(q_len)[:, None] + (k_len - q_len)
    j = np.arange(k_len)[None, :]
    return (j <= i) & (j > i - window)


def qkv(rng, dtype, B, Hq, Hkv, Lq, Lk, D=16):
    return (rng.standard_normal((B, Hq, Lq, D)).astype(dtype),
            rng.standard_normal((B, Hkv, Lk, D)).astype(dtype),
            rng.standard_normal((B, Hkv, Lk, D)).astype(dtype))


SHAPES = [  # (B, Hq, Hkv, Lq, Lk): prefill, chunked prefill, decode (split-K), GQA, MQA
    (2, 4, 4, 100, 100),
    (1, 4, 2, 37, 150),
    (2, 8, 2, 1, 300),
    (1, 4, 1, 1, 1100),
    (1, 1, 1, 1, 1100),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [1, 5, 33, 64, 2000])
def test_sdpa_window_equals_explicit_mask(rng, tile_kernel, small_tiles, dtype, shape, window):
    B, Hq, Hkv, Lq, Lk = shape
    q, k, v = qkv(rng, dtype, B, Hq, Hkv, Lq, Lk)
    expected = reference.scaled_dot_product_attention(q, k, v,
                                                      attn_mask=window_mask(Lq, Lk, window))
    out = mha_cy.scaled_dot_product_attention(q, k, v, is_causal=True, window=window)
    assert_close(out, expected, dtype)
    # the reference's own window agrees with the explicit mask too
    assert_close(reference.scaled_dot_product_attention(q, k, v, is_causal=True, window=window),
                 expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_window_with_other_masks_and_default_tiles(rng, tile_kernel, dtype):
    """Default tile sizes (256 keys), a window inside a tile, plus a bool attn_mask."""
    q, k, v = qkv(rng, dtype, 2, 4, 2, 300, 700, D=32)
    extra = rng.random((2, 1, 300, 700)) < 0.8
    out = mha_cy.scaled_dot_product_attention(q, k, v, attn_mask=extra, is_causal=True,
                                              window=100)
    expected = reference.scaled_dot_product_attention(
        q, k, v, attn_mask=extra & window_mask(300, 700, 100))
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 4096), (2, 8, 2, 1, 2000), (1, 4, 4, 64, 1500)])
def test_keys_before_the_window_are_not_read(rng, tile_kernel, shape):
    """NaN in the keys and values before every row's window: a read (even a masked one, whose
    p = 0 still meets v = NaN in P V) would make the output NaN."""
    B, Hq, Hkv, Lq, Lk = shape
    window = 300
    q, k, v = qkv(rng, np.float32, B, Hq, Hkv, Lq, Lk)
    first_seen = Lk - Lq + 1 - window              # the first window key of query 0
    expected = reference.scaled_dot_product_attention(q, k, v, is_causal=True, window=window)
    k[:, :, :first_seen] = np.nan
    v[:, :, :first_seen] = np.nan
    out = mha_cy.scaled_dot_product_attention(q, k, v, is_causal=True, window=window)
    assert_close(out, expected, np.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (4, 1)])
def test_module_window_prefill_need_weights(rng, small_tiles, dtype, heads, kv_heads):
    weights = dict(num_kv_heads=kv_heads)
    fast, ref = make_pair(rng, 32, heads, dtype, **weights)
    fast.window = ref.window = 9
    x = rng.standard_normal((2, 70, 32)).astype(dtype)
    out_f, w_f = fast(x, is_causal=True, need_weights=True)
    out_r, w_r = ref(x, is_causal=True, need_weights=True)
    assert_close(out_f, out_r, dtype)
    assert_close(w_f, w_r, dtype)
    assert_close(fast(x, is_causal=True), out_r, dtype)           # the fast self-attention path
    outside = ~window_mask(70, 70, 9)
    assert (w_f[..., outside] == 0).all()                          # exactly 0, not tiny
    # the window as an explicit mask of an unwindowed module gives the same
    plain = mha_cy.MultiHeadAttention.from_weights(
        fast.q_weight, fast.k_weight, fast.v_weight, fast.out_weight, num_heads=heads,
        num_kv_heads=kv_heads, q_bias=fast.q_bias, k_bias=fast.k_bias, v_bias=fast.v_bias,
        out_bias=fast.out_bias)
    assert_close(plain(x, attn_mask=window_mask(70, 70, 9)), out_r, dtype)


def test_window_in_constructor_and_from_weights(rng):
    mha = mha_cy.MultiHeadAttention(16, 4, window=8, seed=0)
    assert mha.window == 8 and "window=8" in repr(mha)
    assert mha_cy.MultiHeadAttention(16, 4).window is None
    w = mha_cy.MultiHeadAttention.from_weights(mha.q_weight, mha.k_weight, mha.v_weight,
                                               mha.out_weight, num_heads=4, window=np.int64(8))
    assert w.window == 8 and type(w.window) is int
    ref = reference.MultiHeadAttention(16, 4, window=8, seed=0)
    x = rng.standard_normal((1, 20, 16)).astype(np.float32)
    assert_close(mha(x, is_causal=True), ref(x, is_causal=True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads", [4, 1])
@pytest.mark.parametrize("prefill,chunk", [(1, 1), (40, 1), (30, 17)])
def test_decode_with_window_equals_one_windowed_pass(rng, dtype, kv_heads, prefill, chunk):
    fast, ref = make_pair(rng, 32, 4, dtype, num_kv_heads=kv_heads)
    fast.window = ref.window = 12
    B, L = 2, 90
    x = rng.standard_normal((B, L, 32)).astype(dtype)
    expected = ref(x, is_causal=True)
    for mha in (fast, ref):
        cache = mha.new_cache(B, L)
        outs, start = [], 0
        for stop in [prefill] + list(range(prefill + chunk, L, chunk)) + [L]:
            if stop > start:
                outs.append(mha(x[:, start:stop], cache=cache))
                start = stop
        assert_close(np.concatenate(outs, axis=1), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_decode_with_window_split_k(rng, tile_kernel, dtype):
    """One sequence, MQA, 3000 cached keys: split-K over the window only."""
    fast, ref = make_pair(rng, 64, 4, dtype, num_kv_heads=1)
    fast.window = ref.window = 1500
    x = rng.standard_normal((1, 3001, 64)).astype(dtype)
    cache = fast.new_cache(1, 3001)
    fast(x[:, :3000], cache=cache)
    step, w = fast(x[:, 3000:], cache=cache, need_weights=True)
    ref_cache = ref.new_cache(1, 3001)
    ref(x[:, :3000], cache=ref_cache)
    ref_step, ref_w = ref(x[:, 3000:], cache=ref_cache, need_weights=True)
    assert_close(step, ref_step, dtype)
    assert_close(w, ref_w, dtype)
    assert (w[..., :3001 - 1500] == 0).all()
    cache.truncate(3000)
    assert_close(fast(x[:, 3000:], cache=cache), ref_step, dtype)   # without weights


@pytest.mark.parametrize("shape,window", [((1, 8, 1, 1, 5000), 2048), ((2, 4, 2, 1, 1200), 700),
                                          ((1, 4, 4, 200, 1300), 150)])
def test_window_results_do_not_depend_on_the_thread_count(rng, tile_kernel, shape, window):
    B, Hq, Hkv, Lq, Lk = shape
    q, k, v = qkv(rng, np.float32, B, Hq, Hkv, Lq, Lk, D=64)
    results = []
    for n in (1, 2, 3, 4):
        with mha_cy.threads(n):
            results.append(mha_cy.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                               window=window))
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])


@pytest.mark.parametrize("bad,error", [(0, ValueError), (-3, ValueError), (1.5, TypeError),
                                       (True, TypeError), ("4", TypeError),
                                       (sys.maxsize + 1, ValueError)])  # was OverflowError
def test_bad_window_values(rng, bad, error):
    q, k, v = qkv(rng, np.float32, 1, 2, 2, 4, 4)
    with pytest.raises(error, match="window must be"):
        mha_cy.scaled_dot_product_attention(q, k, v, is_causal=True, window=bad)
    with pytest.raises(error, match="window must be"):
        reference.scaled_dot_product_attention(q, k, v, is_causal=True, window=bad)
    for cls in (mha_cy.MultiHeadAttention, reference.MultiHeadAttention):
        with pytest.raises(error, match="window must be"):
            cls(8, 2, window=bad)
    mha = mha_cy.MultiHeadAttention(8, 2)
    with pytest.raises(error, match="window must be"):
        mha_cy.MultiHeadAttention.from_weights(mha.q_weight, mha.k_weight, mha.v_weight,
                                               mha.out_weight, num_heads=2, window=bad)


def test_the_largest_window_is_unlimited(rng):
    q, k, v = qkv(rng, np.float32, 1, 2, 2, 4, 4)
    np.testing.assert_array_equal(
        mha_cy.scaled_dot_product_attention(q, k, v, is_causal=True, window=sys.maxsize),
        mha_cy.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_window_needs_causal_or_a_cache(rng):
    q, k, v = qkv(rng, np.float32, 1, 2, 2, 4, 4)
    for sdpa in (mha_cy.scaled_dot_product_attention, reference.scaled_dot_product_attention):
        with pytest.raises(ValueError, match="window=3 needs is_causal=True"):
            sdpa(q, k, v, window=3)
    x = rng.standard_normal((1, 5, 8)).astype(np.float32)
    for cls in (mha_cy.MultiHeadAttention, reference.MultiHeadAttention):
        mha = cls(8, 2, window=3, seed=1)
        with pytest.raises(ValueError, match="window=3 needs is_causal=True"):
            mha(x)
        with pytest.raises(ValueError, match="window=3 needs is_causal=True"):
            mha(x, x)                                   # cross-attention, not causal
        cache = mha.new_cache(1, 5)
        assert_close(mha(x, cache=cache), mha(x, is_causal=True))   # a cache is causal
