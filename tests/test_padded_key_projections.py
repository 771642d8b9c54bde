"""The K/V projections skip the rows of padded keys: nobody reads them. linear_heads (skip_rows)
writes whole panels of padded rows as 0 instead of computing them; the compiled small call packs
the unpadded rows first and computes K/V for those only (the others: 0). Every value anybody reads
keeps its bits: the module's output and weights must equal those of a run that computes every
row, bit for bit, on every path (self-attention, GQA, causal, RoPE, cross-attention), and agree
with the NumPy reference."""
import numpy as np
import pytest

import mha_cy
from mha_cy import _linear_kernel, _step_kernel, reference
from conftest import DTYPES, assert_close, make_pair, random_weights

PANEL_ROWS = {np.float32: 16, np.float64: 8}


@pytest.fixture
def row_skip():
    """Set the skip on (True) or off (False) for a block; restores the default afterwards."""
    previous = _linear_kernel._set_row_skip(True)
    try:
        yield _linear_kernel._set_row_skip
    finally:
        _linear_kernel._set_row_skip(previous)


def _padding(rng, batch, length, kind):
    pad = np.zeros((batch, length), bool)
    if kind == "trailing":              # right-padded prompts of random lengths, one empty
        for b, n in enumerate(rng.integers(0, length + 1, size=batch)):
            pad[b, n:] = True
        pad[0, :] = True
    elif kind == "leading":             # left padding
        for b, n in enumerate(rng.integers(0, length + 1, size=batch)):
            pad[b, :n] = True
    elif kind == "scattered":
        pad = rng.random((batch, length)) < 0.6
    elif kind == "all":
        pad[:] = True
    return pad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,L,K,H,D,skip_heads", [(3, 70, 40, 6, 16, 2), (2, 37, 33, 5, 8, 0),
                                                  (4, 100, 24, 3, 80, 3), (1, 300, 20, 4, 4, 1)])
@pytest.mark.parametrize("kind", ["trailing", "leading", "scattered", "all", "none"])
def test_skipped_rows_are_zero_and_the_rest_keep_their_bits(dtype, B, L, K, H, D, skip_heads,
                                                           kind, row_skip):
    rng = np.random.default_rng(B * L + K)
    x = rng.standard_normal((B * L, K)).astype(dtype)
    w = rng.standard_normal((H * D, K)).astype(dtype)
    bias = rng.standard_normal(H * D).astype(dtype)
    pad = _padding(rng, B, L, kind).reshape(-1)
    full = np.empty((B, H, L, D), dtype)
    _linear_kernel.linear_heads(x, w, bias, full, 1)
    # a row is skipped where its whole panel (of B * L rows; the last one: its real rows) is
    pr = PANEL_ROWS[dtype]
    panel_all = np.array([pad[p:p + pr].all() for p in range(0, B * L, pr)])
    skipped = np.repeat(panel_all, pr)[:B * L].reshape(B, L)
    expected = full.copy()
    expected[:, skip_heads:] = np.where(skipped[:, None, :, None], 0, full[:, skip_heads:])
    for n in (1, 2, 3):
        out = np.full((B, H, L, D), np.nan, dtype)
        _linear_kernel.linear_heads(x, w, bias, out, n, pad, skip_heads * D)
        np.testing.assert_array_equal(out, expected)
    if panel_all.any() and skip_heads < H:
        assert (expected != full).any()          # the case skipped something


def test_skip_rows_must_match_the_rows_and_cut_at_heads():
    x = np.ones((10, 4), np.float32)
    w = np.ones((6, 4), np.float32)
    out = np.empty((2, 3, 5, 2), np.float32)
    with pytest.raises(ValueError, match="skip_rows"):
        _linear_kernel.linear_heads(x, w, None, out, 1, np.zeros(9, bool), 0)
    with pytest.raises(ValueError, match="skip_rows"):
        _linear_kernel.linear_heads(x, w, None, out, 1, np.zeros(10, bool), 1)
    with pytest.raises(ValueError, match="skip_rows"):
        _linear_kernel.linear_heads(x, w, None, out, 1, np.zeros(10, bool), 8)


@pytest.fixture(params=["compiled", "general"])
def path(request):
    """Small calls run as one compiled call (_step_kernel); "general": a rule knob moved to a
    value that changes no tile (panels for every row count, as by default) sends them through
    the separate kernels (_linear_kernel.linear_heads) instead."""
    if request.param == "compiled":
        yield request.param
        return
    previous = _linear_kernel._set_panel_max_rows(2 ** 62)
    try:
        assert not _linear_kernel.default_rules
        yield request.param
    finally:
        _linear_kernel._set_panel_max_rows(previous)


def _skippable_rows(pad, dtype):
    """Token rows whose K/V the compiled small call skips: it packs the unpadded rows first
    and computes K/V up to the end of their last panel."""
    flat, pr = pad.reshape(-1), PANEL_ROWS[dtype]
    valid = int((~flat).sum())
    return flat.size - min(flat.size, -(-valid // pr) * pr)


def _run_both(row_skip, call):
    row_skip(False)
    every_row = call()
    row_skip(True)
    return every_row, call()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["trailing", "leading", "scattered"])
@pytest.mark.parametrize("kv_heads,causal,rope,need_weights", [
    (None, False, False, False), (None, False, False, True), (2, False, False, False),
    (1, True, False, False), (None, True, True, True)])
def test_self_attention_with_padding_is_unchanged_by_the_skip(dtype, kind, kv_heads, causal,
                                                              rope, need_weights, row_skip, path):
    rng = np.random.default_rng(7)
    B, L, E, H = 3, 150, 64, 4
    weights = random_weights(rng, E, H, num_kv_heads=kv_heads)
    rope = mha_cy.RoPE() if rope else None
    fast = mha_cy.MultiHeadAttention.from_weights(**weights, dtype=dtype, rope=rope)
    ref = reference.MultiHeadAttention.from_weights(**weights, dtype=dtype, rope=rope)
    x = rng.standard_normal((B, L, E)).astype(dtype)
    pad = _padding(rng, B, L, kind)
    pad[:, -1] = False                  # (causal: the last query sees a key)
    kwargs = dict(key_padding_mask=pad, is_causal=causal, need_weights=need_weights)
    every_row, skipped = _run_both(row_skip, lambda: fast(x, **kwargs))
    if path == "compiled" and not need_weights:     # (need_weights: the separate kernels)
        expected = _skippable_rows(pad, dtype)
        assert _step_kernel._last_skipped_rows() == expected > 0
    if need_weights:
        np.testing.assert_array_equal(skipped[0], every_row[0])
        np.testing.assert_array_equal(skipped[1], every_row[1])
        expected = ref(x, **kwargs)[0]
        skipped = skipped[0]
    else:
        np.testing.assert_array_equal(skipped, every_row)
        expected = ref(x, **kwargs)
    visible = ~pad.all(axis=1)          # (a sequence with no visible key: zeros either way)
    assert_close(skipped[visible], expected[visible], dtype, factor=10)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("same_key_value", [True, False])
def test_cross_attention_with_padding_is_unchanged_by_the_skip(dtype, same_key_value, row_skip):
    rng = np.random.default_rng(3)
    B, Lq, Lk, E, H = 2, 40, 130, 48, 6
    fast, ref = make_pair(rng, E, H, dtype)
    x = rng.standard_normal((B, Lq, E)).astype(dtype)
    memory = rng.standard_normal((B, Lk, E)).astype(dtype)
    value = memory if same_key_value else rng.standard_normal((B, Lk, E)).astype(dtype)
    pad = _padding(rng, B, Lk, "trailing")
    pad[:, 0] = False
    every_row, skipped = _run_both(
        row_skip, lambda: fast(x, memory, value, key_padding_mask=pad))
    np.testing.assert_array_equal(skipped, every_row)
    assert_close(skipped, ref(x, memory, value, key_padding_mask=pad), dtype, factor=10)


def test_a_cache_keeps_the_padded_keys(row_skip):
    """With a cache the padded keys are stored (later steps read them): never skipped."""
    rng = np.random.default_rng(5)
    fast, _ = make_pair(rng, 32, 4)
    x = rng.standard_normal((2, 40, 32)).astype(np.float32)
    pad = np.zeros((2, 40), bool)
    pad[1, 8:] = True
    caches = []
    for flag in (False, True):
        row_skip(flag)
        cache = fast.new_cache(2, 64)
        fast(x, key_padding_mask=pad, cache=cache)
        caches.append(cache)
    np.testing.assert_array_equal(caches[1].key, caches[0].key)
    assert np.abs(caches[1].key[1, :, 8:40]).min() > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_sequence_with_every_key_padded(dtype, row_skip, path):
    """All of a sequence's K/V rows skipped: its rows get the zero context (the output bias),
    as when they are computed, and the other sequences are untouched."""
    rng = np.random.default_rng(11)
    fast, ref = make_pair(rng, 32, 4, dtype)
    x = rng.standard_normal((3, 64, 32)).astype(dtype)
    pad = np.zeros((3, 64), bool)
    pad[1] = True
    pad[2, 40:] = True
    every_row, skipped = _run_both(row_skip, lambda: fast(x, key_padding_mask=pad))
    if path == "compiled":
        assert _step_kernel._last_skipped_rows() == _skippable_rows(pad, dtype) > 0
    np.testing.assert_array_equal(skipped, every_row)
    np.testing.assert_array_equal(skipped[1], np.broadcast_to(fast.out_bias, (64, 32)))
    assert_close(skipped, ref(x, key_padding_mask=pad), dtype, factor=10)
