"""A hidden key has no effect whatever its K or V hold (issue 10, item 1): a NaN or inf in V
(or a NaN or +inf score) at a key that a mask, causality, padding, the sliding window, a
ragged length or the head's group hides must not reach a row through 0 * NaN, on every path:
the fused kernel (packed and direct), the BLAS tile path, split-K decoding, the weights path,
cache steps and pruned (uneven) groups. A non-finite V at a key the row sees still reaches it.
Each case is checked against mha_cy.reference, which defines the semantics."""
import numpy as np
import pytest

import mha_cy
from mha_cy import _attention_kernel, reference

from conftest import DTYPES, assert_close, make_pair

SDPA = mha_cy.scaled_dot_product_attention
REF = reference.scaled_dot_product_attention


def assert_same(actual, expected, dtype):
    """The same NaN and inf pattern, and the finite values within the tolerance."""
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected), "NaN pattern")
    np.testing.assert_array_equal(np.isinf(actual), np.isinf(expected), "inf pattern")
    np.testing.assert_array_equal(actual[np.isinf(actual)], expected[np.isinf(expected)])
    finite = np.isfinite(expected)
    assert_close(np.where(finite, actual, 0), np.where(finite, expected, 0), dtype)


def assert_weights_path_matches(fast, ref, x, kw, dtype):
    """fast(x, **kw) as ref's, with weights (hidden ones +0, not -0) and without; returns the
    output."""
    out, w = fast(x, need_weights=True, **kw)
    out_r, w_r = ref(x, need_weights=True, **kw)
    assert_same(out, out_r, dtype)
    assert_same(w, w_r, dtype)
    assert not np.signbit(w[w == 0]).any()
    assert_same(fast(x, **kw), out_r, dtype)
    return out


def qkv(rng, dtype, b=1, hq=2, hkv=1, lq=3, lk=300, d=32):
    q = rng.standard_normal((b, hq, lq, d)).astype(dtype)
    k = rng.standard_normal((b, hkv, lk, d)).astype(dtype)
    v = rng.standard_normal((b, hkv, lk, d)).astype(dtype)
    return q, k, v


def poison(k, v, keys, huge_k=True):
    """NaN in V, inf and -inf in V, and a huge K (+-inf scores) at the given keys."""
    v[:, :, keys, 1] = np.nan
    v[:, :, keys, 2] = np.inf
    v[:, :, keys, 3] = -np.inf
    if huge_k:      # (at a hidden key only: which infinity a visible one gets depends on
        k[:, :, keys[:1], :] = np.finfo(k.dtype).max    # the summation order)


@pytest.fixture(params=["packed", "direct"])
def fused_variant(request):
    """The fused kernel's packed variant (direct off) or its direct one (for every row
    count up to 4 and any head dim)."""
    previous = _attention_kernel._set_fused_direct(*((0, 0) if request.param == "packed"
                                                     else (4, 0)))
    yield request.param
    _attention_kernel._set_fused_direct(*previous)


# lk = 4096 with one query row and one K/V head: split-K; lq = 40: normal tasks
CASES = [(1, 300), (3, 300), (40, 300), (1, 4096), (3, 4096)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lq, lk", CASES)
@pytest.mark.parametrize("mask_kind", ["bool", "additive", "padding_like"])
def test_non_finite_values_at_masked_keys_change_nothing(rng, dtype, lq, lk, mask_kind,
                                                         tile_kernel, fused_variant):
    q, k, v = qkv(rng, dtype, lq=lq, lk=lk)
    hidden = [5, 70, lk - 1]
    poison(k, v, hidden)
    allowed = np.ones((lq, lk), bool)
    if mask_kind == "padding_like":        # the same keys hidden from every row
        allowed[:, hidden] = False
    else:                                  # row-dependent: row i also sees key 70 if i is odd
        allowed[:, hidden] = False
        allowed[1::2, 70] = True
    mask = allowed if mask_kind != "additive" else np.where(allowed, 0, -np.inf).astype(dtype)
    out = SDPA(q, k, v, attn_mask=mask)
    assert_same(out, REF(q, k, v, attn_mask=mask), dtype)
    assert np.isfinite(out[:, :, 0::2]).all()          # even rows see no poisoned key
    clean_v, clean_k = v.copy(), k.copy()
    clean_v[:, :, hidden] = 0
    clean_k[:, :, hidden] = 0
    if lq > 1 and mask_kind != "padding_like":          # odd rows see key 70's NaN and inf
        assert np.isnan(out[:, :, 1::2, 1]).all()
    else:          # nothing poisoned is seen at all (the slow exact P V: not bitwise)
        assert_close(out, SDPA(q, clean_k, clean_v, attn_mask=mask), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lq, lk", CASES)
@pytest.mark.parametrize("window", [None, 7])
def test_non_finite_values_above_the_diagonal_or_outside_the_window(rng, dtype, lq, lk, window,
                                                                    tile_kernel, fused_variant):
    q, k, v = qkv(rng, dtype, lq=lq, lk=lk)
    last = lk - lq                                     # the key of row 0's diagonal
    if lq > 1:                                         # above row 0's diagonal only
        poison(k, v, [last + 1], huge_k=False)
    if window is not None:                             # just outside every row's window
        poison(k, v, [last - window])
    if lq == 1 and window is None:                     # a key seen by the only row
        poison(k, v, [last - 8], huge_k=False)
    out = SDPA(q, k, v, is_causal=True, window=window)
    assert_same(out, REF(q, k, v, is_causal=True, window=window), dtype)
    if window is not None or lq > 1:
        assert np.isfinite(out[:, :, 0]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows_stay_zeros_with_non_finite_values(rng, dtype, tile_kernel,
                                                             fused_variant):
    for lq, lk in CASES:
        q, k, v = qkv(rng, dtype, lq=lq, lk=lk)
        v[:, :, ::7] = np.nan
        k[:, :, 3] = np.inf
        allowed = np.zeros((lq, lk), bool)
        allowed[1::2, 1::7] = True                    # odd rows see finite keys only
        out = SDPA(q, k, v, attn_mask=allowed)
        assert_same(out, REF(q, k, v, attn_mask=allowed), dtype)
        np.testing.assert_array_equal(out[:, :, 0::2], 0)
        assert np.isfinite(out).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_visible_non_finite_value_still_reaches_its_row(rng, dtype, tile_kernel,
                                                          fused_variant):
    """Even when its weight underflows to 0 (0 * NaN is NaN, as in torch)."""
    for lq, lk in CASES:
        q, k, v = qkv(rng, dtype, lq=lq, lk=lk)
        v[:, :, 9, 0] = np.nan
        v[:, :, 11, 1] = np.inf
        mask = np.zeros((lq, lk), dtype)
        mask[:, 9] = -1e4                              # weight exp(-1e4): exactly 0
        out = SDPA(q, k, v, attn_mask=mask)
        assert_same(out, REF(q, k, v, attn_mask=mask), dtype)
        assert np.isnan(out[..., 0]).all() and (out[..., 1] == np.inf).all()
        assert np.isfinite(out[..., 2:]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_scores_of_minus_inf_from_the_data_hide_their_keys(rng, dtype, tile_kernel,
                                                           fused_variant):
    """q . k = -inf (overflow) hides the key like a mask: its NaN V is never read, and a
    row whose scores are all -inf gives zeros (the reference's documented choice)."""
    for lq, lk in CASES:
        q, k, v = qkv(rng, dtype, lq=lq, lk=lk)
        big = np.finfo(dtype).max
        q[:] = np.abs(q) + 0.1
        k[:] = -np.abs(k) - 0.1                         # every score negative
        k[:, :, 4] = -big                               # key 4: -inf
        v[:, :, 4] = np.nan
        out = SDPA(q, k, v)
        assert_same(out, REF(q, k, v), dtype)
        assert np.isfinite(out).all()
        q[:, 0] *= big                                  # head 0: all scores -inf
        out = SDPA(q, k, v)
        assert_same(out, REF(q, k, v), dtype)
        np.testing.assert_array_equal(out[:, 0], 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_module_need_weights_padding_and_causal(rng, dtype, tile_kernel):
    """The weights path (whole rows and one P V product): NaN tokens that only padded or
    later positions hold; the weights of hidden keys are +0, not -0."""
    fast, ref = make_pair(rng, 32, 4, dtype)
    x = rng.standard_normal((2, 12, 32)).astype(dtype)
    pad = np.zeros((2, 12), bool)
    pad[0, 9:] = True
    x[0, 10] = np.nan                    # padding of sequence 0: K and V NaN, its query too
    for kw in (dict(key_padding_mask=pad), dict(key_padding_mask=pad, is_causal=True)):
        out = assert_weights_path_matches(fast, ref, x, kw, dtype)
        assert np.isfinite(out[0, :10]).all() and np.isfinite(out[1]).all()
    x[0, 10] = 0
    x[1, 7] = np.inf                     # sequence 1: rows 0-6 do not see token 7
    out, w = fast(x, is_causal=True, need_weights=True)
    out_r, w_r = ref(x, is_causal=True, need_weights=True)
    assert_same(out, out_r, dtype)
    assert_same(w, w_r, dtype)
    assert np.isfinite(out[1, :7]).all() and np.isnan(out[1, 7:]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_cache_steps_and_ragged_lengths_ignore_the_scratch(rng, dtype, kv_heads, tile_kernel):
    """Cache positions past a sequence's length are scratch: NaN there changes nothing, in a
    ragged prefill, in the decode steps after it and with a sliding window."""
    for window in (None, 3):
        fast, ref = make_pair(rng, 32, 4, dtype, num_kv_heads=kv_heads)
        fast.window = ref.window = window
        x = rng.standard_normal((3, 6, 32)).astype(dtype)
        caches = [m.new_cache(3, 40) for m in (fast, ref)]
        for c in caches:
            c.key[:] = np.nan
            c.value[:] = np.inf
        lengths = np.array([6, 2, 4])
        outs = [m(x, cache=c, lengths=lengths) for m, c in zip((fast, ref), caches)]
        assert_same(outs[0], outs[1], dtype)
        assert np.isfinite(outs[0]).all()
        for step in range(3):
            x1 = rng.standard_normal((3, 1, 32)).astype(dtype)
            outs = [m(x1, cache=c) for m, c in zip((fast, ref), caches)]
            assert_same(outs[0], outs[1], dtype)
            assert np.isfinite(outs[0]).all()
        # a token that the window has left behind may hold anything
        if window is not None:
            for c in caches:
                c.value[:, :, 0] = np.nan
            x1 = rng.standard_normal((3, 1, 32)).astype(dtype)
            outs = [m(x1, cache=c) for m, c in zip((fast, ref), caches)]
            assert_same(outs[0], outs[1], dtype)
            assert np.isfinite(outs[0]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("weights", [False, True])
def test_uneven_groups_read_only_their_kv_head(rng, dtype, q_len, weights, tile_kernel):
    """Query heads 0-2 read K/V head 0 and heads 3-4 K/V head 1 (a pruned module's uneven
    groups, kv_index): NaN and inf in K/V head 1 reach heads 3-4 only."""
    kv_index = np.array([0, 0, 0, 1, 1], dtype=np.intp)
    q = rng.standard_normal((2, 5, q_len, 16)).astype(dtype)
    k = rng.standard_normal((2, 2, 300, 16)).astype(dtype)
    v = rng.standard_normal((2, 2, 300, 16)).astype(dtype)
    v[:, 1, ::3] = np.nan
    k[:, 1, 1::3] = np.inf
    out = np.empty_like(q)
    w = np.empty((2, 5, q_len, 300), dtype) if weights else None
    _attention_kernel.attention(q, k, v, out, None, None, True, 0.25, w, 2, 0, None, kv_index)
    expected, w_r = reference._attention(q, k, v, None, None, True, 0.25, None, kv_index)
    assert_same(out, expected, dtype)
    if weights:
        assert_same(w, w_r, dtype)
    assert np.isfinite(out[:, :3]).all() and np.isnan(out[:, 3:]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_len", [1, 5])
def test_pruned_module_with_non_finite_values_matches_the_reference(rng, dtype, q_len,
                                                                   tile_kernel):
    """Pruning query heads 1, 5, 6 of 8 (2 K/V heads) leaves groups of 3 and 2; a cache of
    NaN scratch and NaN values at padded keys change nothing."""
    fast, ref = make_pair(rng, 64, 8, dtype, num_kv_heads=2)
    fast, ref = fast.prune_heads([1, 5, 6]), ref.prune_heads([1, 5, 6])
    x = rng.standard_normal((2, 8, 64)).astype(dtype)
    pad = np.zeros((2, 8), bool)
    pad[1, 5:] = True
    x[1, 6] = np.nan
    out, out_r = fast(x, key_padding_mask=pad), ref(x, key_padding_mask=pad)
    assert_same(out, out_r, dtype)
    assert np.isfinite(out[0]).all() and np.isfinite(np.delete(out[1], 6, axis=0)).all()
    caches = [m.new_cache(2, 20) for m in (fast, ref)]
    for c in caches:
        c.value[:] = np.nan
    x = x[:, :q_len].copy()
    x[1, 0] = 0
    outs = [m(x, cache=c) for m, c in zip((fast, ref), caches)]
    assert_same(outs[0], outs[1], dtype)
    assert np.isfinite(outs[0]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_row_length_with_hidden_and_underflowing_keys(rng, dtype, tile_kernel):
    """Rows of 1 to 70 keys, so every tail of the softmax's vector exp (16 and 8 lanes, a
    masked last vector or a scalar loop) and a second key tile: keys hidden by an additive
    -inf, scores far below the exp's underflow (probability +0, their V still read) and
    ordinary ones. Output and weights as the reference; hidden weights are +0."""
    fast, ref = make_pair(rng, 32, 2, dtype)
    for lk in range(1, 71):
        x = rng.standard_normal((1, lk, 32)).astype(dtype)
        mask = rng.standard_normal((lk, lk)).astype(dtype)
        mask[rng.random((lk, lk)) < 0.3] = -np.inf
        mask[rng.random((lk, lk)) < 0.2] = -1e4         # exp underflows to 0 at any dtype
        for kw in (dict(attn_mask=mask), dict(attn_mask=mask, is_causal=True)):
            assert_weights_path_matches(fast, ref, x, kw, dtype)
