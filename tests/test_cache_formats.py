"""float16 and int8 KV caches (new_cache(dtype=...), mha_cy/_cache_formats.py, src/kv_format.c).

Exactness is checked against the reference computed on the values the cache holds (the
fast cache's own decoded keys/values: float16-rounded, or int8 * scale), at the float32
tolerance; the storage error itself against a float32 cache, within the bounds stated in
the README: float16 FP16_BOUND, int8 INT8_BOUND (times max |output|)."""
import pickle

import numpy as np
import pytest

import mha_cy
from mha_cy import _attention_kernel, reference
from mha_cy._cache_formats import Int8Format
from mha_cy._cpu_features import int8_dot as _int8_dot
from mha_cy.attention import _attend

from conftest import assert_close, make_pair

FORMATS = [np.float16, "int8"]
# storage error of the module output against a float32 cache, times max |output| (random
# weights as in conftest, unit-normal inputs; measured ~4x below these on every case here)
FP16_BOUND = 4e-3
INT8_BOUND = 4e-2


# Where the CPU has AVX512-VNNI, an int8 cache's decode tasks multiply in integers
# (src/kv_int8_dot_impl.h): q and each tile's probabilities rounded to 16 bits put them within
# INT8_DOT_BOUND of max |V| (kernel calls; measured <= 3e-5) or of max |output| (modules;
# measured <= 6e-5) of the float computation on the cache's values, not within float32
# rounding. Every other path stays at float32 rounding.
INT8_DOT = _int8_dot() == "vnni"
INT8_DOT_BOUND = 1e-4


def is_int8(fmt):
    return fmt is not None and np.dtype(fmt) == np.int8


def assert_exact(actual, expected, fmt, scale=None, err_msg=""):
    """actual == expected (the reference on the values the cache holds) within float32
    rounding, or within INT8_DOT_BOUND * scale (default max |expected|; kernel calls pass
    max |V|) where int8 runs the integer products."""
    if INT8_DOT and is_int8(fmt):
        assert not np.isnan(actual).any(), f"NaN in the result {err_msg}"
        scale = np.abs(expected).max() if scale is None else scale
        np.testing.assert_allclose(actual, expected, rtol=0, atol=INT8_DOT_BOUND * scale,
                                   err_msg=err_msg)
    else:
        assert_close(actual, expected, np.float32, err_msg=err_msg)


def storage_bound(fmt):
    return FP16_BOUND if fmt is np.float16 else INT8_BOUND


def expected_sequence(ref, tokens, key, value):
    """One causal pass of reference module `ref` over tokens (L, E) with the given decoded
    keys/values (Hkv, L, D) in place of its own: what a cache holding them must give."""
    L = tokens.shape[0]
    q = tokens @ ref.q_weight.T
    if ref.q_bias is not None:
        q = q + ref.q_bias
    q = q.reshape(1, L, ref.num_heads, ref.head_dim).transpose(0, 2, 1, 3)
    if ref.rope is not None:
        q = reference._rotate(q, np.arange(L)[None], ref.rope)
    ctx = reference._attention(q, key[None], value[None], None, None, True,
                               1.0 / np.sqrt(ref.head_dim), ref.window, ref._kv_index)[0]
    out = ctx.transpose(0, 2, 1, 3).reshape(L, -1) @ ref.out_weight.T
    return out if ref.out_bias is None else out + ref.out_bias


def run_cache(mha, prompts, steps, fmt, lengths=None):
    """Prefill prompts (B, P, E) (with lengths) then one token per step; (outs, cache)."""
    B, P, _ = prompts.shape
    cache = mha.new_cache(B, P + steps.shape[1] + 3, dtype=fmt)
    first = mha(prompts, cache=cache, lengths=lengths)
    outs = [mha(steps[:, t:t + 1], cache=cache) for t in range(steps.shape[1])]
    return first, np.concatenate(outs, axis=1), cache


def snapshot(cache):
    arrays = [cache.key, cache.value, cache.key_scale, cache.value_scale]
    return cache.lengths, [None if a is None else a.copy() for a in arrays]


def assert_unchanged(cache, snap):
    lengths, arrays = snap
    np.testing.assert_array_equal(cache.lengths, lengths)
    for a, b in zip([cache.key, cache.value, cache.key_scale, cache.value_scale], arrays):
        if b is None:
            assert a is None
        else:
            np.testing.assert_array_equal(a, b)


# ---- the formats -------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,stored,has_scales", [(None, np.float32, False),
                                                   (np.float32, np.float32, False),
                                                   (np.float16, np.float16, False),
                                                   ("float16", np.float16, False),
                                                   ("int8", np.int8, True),
                                                   (np.int8, np.int8, True)])
def test_new_cache_storage(fmt, stored, has_scales):
    mha = mha_cy.MultiHeadAttention(32, 4, num_kv_heads=2, seed=0)
    cache = mha.new_cache(3, 10, dtype=fmt)
    assert cache.key.shape == cache.value.shape == (3, 2, 10, 8)
    assert cache.dtype == stored and cache.compute_dtype == np.float32
    assert f"dtype={np.dtype(stored)}" in repr(cache)
    elements = 2 * 3 * 2 * 10 * 8
    if has_scales:
        assert cache.key_scale.shape == cache.value_scale.shape == (3, 2, 10)
        assert cache.key_scale.dtype == np.float32
        assert cache.nbytes == elements + 2 * 3 * 2 * 10 * 4
    else:
        assert cache.key_scale is None and cache.value_scale is None
        assert cache.nbytes == elements * np.dtype(stored).itemsize


@pytest.mark.parametrize("bad,error", [("int4", TypeError), ("float8", TypeError),
                                       (3, TypeError), (np.float64, ValueError),
                                       (np.int16, ValueError), ("bfloat16", TypeError)])
def test_bad_dtype(bad, error):
    mha = mha_cy.MultiHeadAttention(16, 2, seed=0)
    with pytest.raises(error, match="dtype"):
        mha.new_cache(1, 4, dtype=bad)


@pytest.mark.parametrize("fmt", FORMATS)
def test_float64_module_refuses_quantized_caches(fmt):
    mha = mha_cy.MultiHeadAttention(16, 2, dtype=np.float64, seed=0)
    with pytest.raises(ValueError, match="float32 module"):
        mha.new_cache(1, 4, dtype=fmt)
    assert mha.new_cache(1, 4, dtype=np.float64).dtype == np.float64


def test_int8_encoding():
    fmt = Int8Format()
    x = np.array([[127.0, 0.5, 1.5, -2.5, -127.0, 3.49],     # scale 1: halves to even
                  [0, 0, 0, 0, 0, 0],                       # zero row: scale 0
                  [1, np.nan, 0, 0, 0, 0],                  # NaN: scale NaN, values 0
                  [1, 2, -np.inf, 0, 0, 0]], np.float32)
    q, s = fmt.encode(x)
    assert q.dtype == np.int8 and s.dtype == np.float32
    np.testing.assert_array_equal(q[0], [127, 0, 2, -2, -127, 3])
    assert s[0] == 1 and s[1] == 0 and (q[1:] == 0).all()
    assert np.isnan(s[2]) and np.isnan(s[3])
    back = fmt.decode(q, s)
    np.testing.assert_array_equal(back[1], 0)
    assert np.isnan(back[2:]).all()                         # never silently finite
    rng = np.random.default_rng(0)
    y = rng.standard_normal((50, 64)).astype(np.float32) * rng.uniform(1e-3, 1e3, (50, 1))
    qy, sy = fmt.encode(y)
    assert (np.abs(fmt.decode(qy, sy) - y) <= sy[:, None] * 0.5 * (1 + 1e-5)).all()
    assert (np.abs(qy).max(axis=1) == 127).all()


def test_float16_encoding_overflow_and_nan():
    mha = mha_cy.MultiHeadAttention(16, 2, seed=0)
    cache = mha.new_cache(1, 4, dtype=np.float16)
    k, _ = cache._format.encode(np.array([1e5, -1e5, np.nan, 1.0], np.float32))
    assert np.isposinf(k[0]) and np.isneginf(k[1]) and np.isnan(k[2]) and k[3] == 1


# ---- prefill + steps = one causal pass ---------------------------------------------------

CONFIGS = {
    "mha": dict(E=32, H=4, Hkv=4),
    "gqa_rope": dict(E=64, H=8, Hkv=2, rope=True),
    "mqa_window_rope": dict(E=64, H=8, Hkv=1, rope=True, window=7),
    "gqa_d40": dict(E=80, H=2, Hkv=1, rope=True),            # head dim with a tail (40)
    "gqa_d128": dict(E=256, H=2, Hkv=1),
    "d20_group4": dict(E=80, H=4, Hkv=1),                    # packed kernel on tiles
}


def build(rng, cfg):
    fast, ref = make_pair(rng, cfg["E"], cfg["H"], num_kv_heads=cfg["Hkv"])
    if cfg.get("rope"):
        fast._rope = ref._rope = mha_cy.RoPE()
    fast.window = ref.window = cfg.get("window")
    return fast, ref


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_steps_equal_causal_pass(rng, fmt, name):
    cfg = CONFIGS[name]
    fast, ref = build(rng, cfg)
    B, P, S = 3, 13, 6
    x = rng.standard_normal((B, P + S, cfg["E"])).astype(np.float32)
    first, steps, cache = run_cache(fast, x[:, :P], x[:, P:], fmt)
    out = np.concatenate([first, steps], axis=1)
    key, value = cache.dequantize(P + S)
    for b in range(B):                 # exact: the reference on the cache's own values
        assert_exact(out[b], expected_sequence(ref, x[b], key[b], value[b]), fmt,
                     err_msg=f"sequence {b}")
    full = fast(x, is_causal=True)     # storage error against a float32 cache
    err = np.abs(out - full).max() / np.abs(full).max()
    assert err < storage_bound(fmt), err
    # the reference module with the same cache dtype agrees within the storage error too
    r_first, r_steps, _ = run_cache(ref, x[:, :P], x[:, P:], fmt)
    r_out = np.concatenate([r_first, r_steps], axis=1)
    assert np.abs(out - r_out).max() / np.abs(full).max() < storage_bound(fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_ragged_batch(rng, fmt):
    fast, ref = build(rng, CONFIGS["gqa_rope"])
    lengths = np.array([9, 2, 0, 5])
    B, P, S = 4, 9, 4
    prompts = rng.standard_normal((B, P, 64)).astype(np.float32)
    steps = rng.standard_normal((B, S, 64)).astype(np.float32)
    first, outs, cache = run_cache(fast, prompts, steps, fmt, lengths)
    np.testing.assert_array_equal(cache.lengths, lengths + S)
    key, value = cache.dequantize()
    for b, n in enumerate(lengths):
        tokens = np.concatenate([prompts[b, :n], steps[b]])
        exp = expected_sequence(ref, tokens, key[b, :, :n + S], value[b, :, :n + S])
        assert_close(np.concatenate([first[b, :n], outs[b]]), exp, np.float32)
        assert (first[b, n:] == 0).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_pruned_uneven_groups(rng, fmt):
    fast, ref = make_pair(rng, 64, 8, num_kv_heads=2)
    fast, ref = fast.prune_heads([1, 5, 6]), ref.prune_heads([1, 5, 6])   # groups of 3 and 2
    x = rng.standard_normal((2, 11, 64)).astype(np.float32)
    first, steps, cache = run_cache(fast, x[:, :7], x[:, 7:], fmt)
    out = np.concatenate([first, steps], axis=1)
    key, value = cache.dequantize(11)
    for b in range(2):
        assert_close(out[b], expected_sequence(ref, x[b], key[b], value[b]), np.float32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_need_weights_and_padding(rng, fmt):
    fast, ref = build(rng, CONFIGS["gqa_rope"])
    x = rng.standard_normal((2, 10, 64)).astype(np.float32)
    cache = fast.new_cache(2, 16, dtype=fmt)
    out, w = fast(x, cache=cache, need_weights=True)
    out_nw = fast.new_cache(2, 16, dtype=fmt)
    assert_close(fast(x, cache=out_nw), out, np.float32)
    key, value = cache.dequantize(10)
    for b in range(2):
        assert_close(out[b], expected_sequence(ref, x[b], key[b], value[b]), np.float32)
    np.testing.assert_allclose(w.sum(-1), 1, rtol=1e-5)
    step, w1 = fast(x[:, :1], cache=cache, need_weights=True)
    assert w1.shape == (2, 8, 1, 11)


# ---- the kernel paths, on stored K/V directly --------------------------------------------

def stored(rng, fmt, shape, dv=None):
    """Random K/V (B, Hkv, L, D) in storage format: (k, v, k_scale, v_scale, k_float,
    v_float) with the decoded values."""
    mha = mha_cy.MultiHeadAttention(8, 1, seed=0)
    f = mha.new_cache(1, 1, dtype=fmt)._format
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape[:3] + ((dv or shape[3]),)).astype(np.float32)
    (ks, kss), (vs, vss) = f.encode(k), f.encode(v)
    return ks, vs, kss, vss, f.decode(ks, kss), f.decode(vs, vss)


KERNEL_CASES = {
    # name: (B, Hq, Hkv, Lq, Lk, D, causal, window)
    "decode_gqa": (2, 8, 2, 1, 300, 64, True, None),
    "decode_mha_row": (2, 3, 3, 1, 200, 24, True, None),
    "decode_gqa_d8": (1, 8, 1, 1, 70, 8, True, None),
    # P V panels of 8 / rows column vectors, then the narrower ones of the columns left
    "decode_row_d88": (2, 2, 2, 1, 150, 88, True, None),
    "decode_pairs_d40": (1, 4, 2, 1, 130, 40, True, None),
    # head dims that leave 4 and 12 values after the score product's 16-value steps (masked
    # loads at AVX-512), for blocks of 1, 3 and 4 rows
    "decode_row_d100": (1, 2, 2, 1, 110, 100, True, None),
    "decode_three_d44": (2, 6, 2, 1, 90, 44, True, None),
    "decode_group_d36": (1, 8, 2, 1, 140, 36, True, None),
    "split_k": (1, 4, 1, 1, 1500, 64, True, None),
    "split_k_window": (1, 2, 1, 1, 2100, 32, True, 700),
    "prefill": (1, 4, 2, 40, 90, 32, True, None),
    "prefill_window": (2, 2, 1, 37, 300, 16, True, 50),
    "cross_noncausal": (2, 2, 2, 9, 33, 48, False, None),
    "d320": (1, 2, 1, 1, 40, 320, True, None),
    "d320_prefill": (1, 2, 2, 5, 40, 320, True, None),
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", sorted(KERNEL_CASES))
@pytest.mark.parametrize("weights", [False, True])
def test_kernel_against_reference(rng, tile_kernel, fmt, name, weights):
    B, Hq, Hkv, Lq, Lk, D, causal, window = KERNEL_CASES[name]
    q = rng.standard_normal((B, Hq, Lq, D)).astype(np.float32)
    k, v, ks, vs, kf, vf = stored(rng, fmt, (B, Hkv, Lk, D))
    out = np.empty((B, Hq, Lq, D), np.float32)
    w = np.empty((B, Hq, Lq, Lk), np.float32) if weights else None
    scale = 1 / np.sqrt(D)
    _attend(q, k, v, out, None, None, causal, scale, w, 1, window, k_scale=ks, v_scale=vs)
    o_r, w_r = reference._attention(q, kf, vf, None, None, causal, scale, window)
    assert_exact(out, o_r, fmt, np.abs(vf).max())
    if weights:
        assert_close(w, w_r, np.float32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_masks_ragged_kv_index(rng, fmt):
    B, Hq, Hkv, Lk, D = 3, 5, 2, 150, 32
    q = rng.standard_normal((B, Hq, 1, D)).astype(np.float32)
    k, v, ks, vs, kf, vf = stored(rng, fmt, (B, Hkv, Lk, D))
    kv_index = np.array([0, 0, 0, 1, 1], dtype=np.intp)
    mask = rng.standard_normal((B, Hq, 1, Lk)).astype(np.float32)
    mask[rng.random(mask.shape) < 0.2] = -np.inf
    pad = rng.random((B, Lk)) < 0.2
    out = np.zeros((B, Hq, 1, D), np.float32)
    _attend(q, k, v, out, mask, pad, True, 0.2, None, 2, None, kv_index=kv_index,
            k_scale=ks, v_scale=vs)
    o_r, _ = reference._attention(q, kf, vf, mask, pad, True, 0.2, None, kv_index)
    assert_exact(out, o_r, fmt, np.abs(vf).max())
    ragged = np.array([[1, 1, 0], [150, 60, 0], [149, 59, 0]], dtype=np.intp)
    out = np.zeros((B, Hq, 1, D), np.float32)
    _attend(q, k, v, out, None, None, True, 0.2, None, 2, None, ragged, kv_index, ks, vs)
    for b, n in enumerate([150, 60]):
        o_b, _ = reference._attention(q[b:b + 1], kf[b:b + 1, :, :n], vf[b:b + 1, :, :n], None,
                                      None, True, 0.2, None, kv_index)
        assert_exact(out[b:b + 1], o_b, fmt, np.abs(vf).max())
    assert (out[2] == 0).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", ["decode_gqa", "split_k", "prefill", "d320"])
def test_threads_bitwise(rng, fmt, case):
    B, Hq, Hkv, Lq, Lk, D, causal, window = KERNEL_CASES[case]
    if case == "split_k":
        Lk = 4096
    q = rng.standard_normal((B, Hq, Lq, D)).astype(np.float32)
    k, v, ks, vs, _, _ = stored(rng, fmt, (B, Hkv, Lk, D))
    results = []
    for n in (1, 2, 3, 4):
        out = np.empty((B, Hq, Lq, D), np.float32)
        _attend(q, k, v, out, None, None, causal, 0.1, None, n, window, k_scale=ks,
                v_scale=vs)
        results.append(out)
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])


@pytest.mark.parametrize("fmt", FORMATS)
def test_module_decode_threads_bitwise(rng, fmt):
    fast, _ = build(rng, CONFIGS["gqa_rope"])
    x = rng.standard_normal((1, 1100, 64)).astype(np.float32)
    results = []
    for n in (1, 2, 3, 4):
        with mha_cy.threads(n):
            cache = fast.new_cache(1, 1101, dtype=fmt)
            fast(x[:, :1099], cache=cache)
            results.append(fast(x[:, 1099:], cache=cache))
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])
    # one sequence, 1100 keys, 2 K/V heads: split-K; against the reference on the cache
    key, value = cache.dequantize(1100)
    ref = reference.MultiHeadAttention.from_weights(
        fast.q_weight, fast.k_weight, fast.v_weight, fast.out_weight, num_heads=8,
        num_kv_heads=2, q_bias=fast.q_bias, k_bias=fast.k_bias, v_bias=fast.v_bias,
        out_bias=fast.out_bias, rope=fast.rope)
    assert_close(results[0][0], expected_sequence(ref, x[0], key[0], value[0])[-1:],
                 np.float32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_nan_in_written_key_is_not_silently_finite(rng, fmt):
    fast, _ = build(rng, CONFIGS["mha"])
    x = rng.standard_normal((1, 6, 32)).astype(np.float32)
    cache = fast.new_cache(1, 8, dtype=fmt)
    fast(x[:, :5], cache=cache)
    cache.key[0, :, 2] = 0                  # as if written from a NaN / inf projection:
    if fmt == "int8":
        cache.key_scale[0, :, 2] = np.nan
    else:
        cache.key[0, :, 2] = np.inf
    out = fast(x[:, 5:], cache=cache)
    assert np.isnan(out).all()



@pytest.mark.parametrize("lk", [300, 1100])          # one task, and split-K
@pytest.mark.parametrize("fmt", FORMATS)
def test_nan_value_at_an_underflowed_key_reaches_the_row(fmt, lk):
    """A visible key whose probability underflows to +0 still multiplies its value row, as in
    the float32 path (0 * NaN = NaN): an int8 row held NaN (its scale NaN) must not vanish
    with it. A key hidden by the padding (probability -0.0) is never read."""
    rng = np.random.default_rng(7)
    q = np.zeros((1, 4, 1, 64), np.float32)
    q[..., 0] = 1
    k, v, ks, vs, kf, vf = stored(rng, fmt, (1, 1, lk, 64))
    if is_int8(fmt):
        k[0, 0, :, 0], ks[0, 0, :] = 127, 1.0
        k[0, 0, 100, 0], ks[0, 0, 100] = -127, 8.0    # score -1016 / 8: p underflows to +0
        vs[0, 0, 100] = np.nan
    else:
        k[0, 0, :, 0] = np.float16(127)
        k[0, 0, 100, 0] = np.float16(-1016)
        v[0, 0, 100, 3] = np.float16(np.nan)
    out = np.empty((1, 4, 1, 64), np.float32)
    _attend(q, k, v, out, None, None, True, 1 / 8, None, 2, None,
            **({"k_scale": ks, "v_scale": vs} if is_int8(fmt) else {}))
    if is_int8(fmt):                     # the whole row's scale is NaN
        assert np.isnan(out).all()
    else:                                # one value is NaN
        assert np.isnan(out[..., 3]).all() and np.isfinite(np.delete(out, 3, axis=-1)).all()
    pad = np.zeros((1, lk), bool)
    pad[0, 100] = True
    _attend(q, k, v, out, None, pad, True, 1 / 8, None, 2, None,
            **({"k_scale": ks, "v_scale": vs} if is_int8(fmt) else {}))
    assert np.isfinite(out).all()

# ---- cache operations --------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_truncate_reorder_copy_pickle(rng, fmt):
    fast, _ = build(rng, CONFIGS["gqa_rope"])
    x = rng.standard_normal((3, 9, 64)).astype(np.float32)
    cache = fast.new_cache(3, 12, dtype=fmt)
    fast(x[:, :8], cache=cache)
    copy = cache.copy()
    clone = pickle.loads(pickle.dumps(cache))
    for c in (copy, clone):
        assert c.dtype == cache.dtype and c.nbytes == cache.nbytes and repr(c) == repr(cache)
        assert_unchanged(c, snapshot(cache))
        assert c.key is not cache.key
    y1 = fast(x[:, 8:], cache=copy)
    y2 = fast(x[:, 8:], cache=clone)
    np.testing.assert_array_equal(y1, y2)
    assert cache.length == 8                       # the copies are independent
    # reorder moves the scales with the values
    idx = np.array([2, 0, 0])
    before = snapshot(cache)
    cache.reorder(idx)
    for a, b in zip([cache.key, cache.value, cache.key_scale, cache.value_scale], before[1]):
        if b is not None:
            np.testing.assert_array_equal(a[:, :, :8], b[idx, :, :8])
    y = fast(x[idx, 8:], cache=cache)
    np.testing.assert_array_equal(y[1], y1[0])
    np.testing.assert_array_equal(y[0], y1[2])
    cache.truncate([3, 9, 4])
    np.testing.assert_array_equal(cache.lengths, [3, 9, 4])
    cache.reset()
    assert cache.length == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_overflow_and_bad_lengths_leave_cache_unchanged(rng, fmt):
    fast, _ = build(rng, CONFIGS["gqa_rope"])
    x = rng.standard_normal((2, 6, 64)).astype(np.float32)
    cache = fast.new_cache(2, 8, dtype=fmt)
    fast(x[:, :4], cache=cache, lengths=np.array([4, 2]))
    snap = snapshot(cache)
    with pytest.raises(ValueError, match="overflow"):
        fast(x[:, :5], cache=cache)
    assert_unchanged(cache, snap)
    with pytest.raises(ValueError, match="lengths"):
        fast(x[:, :3], cache=cache, lengths=np.array([1, 7]))
    assert_unchanged(cache, snap)
    with pytest.raises(ValueError):
        fast(x[:, :3, :32], cache=cache)
    assert_unchanged(cache, snap)


def test_cache_dtype_must_match_module(rng):
    fast, _ = build(rng, CONFIGS["gqa_rope"])
    other = mha_cy.MultiHeadAttention(64, 8, num_kv_heads=4, seed=0)
    cache = other.new_cache(1, 4, dtype="int8")
    with pytest.raises(ValueError, match="num_kv_heads"):
        fast(np.zeros((1, 1, 64), np.float32), cache=cache)
    wide = mha_cy.MultiHeadAttention(64, 8, num_kv_heads=2, dtype=np.float64, seed=0)
    with pytest.raises(ValueError, match="dtype"):
        wide(np.zeros((1, 1, 64)), cache=fast.new_cache(1, 4, dtype=np.float16))


def test_kernel_rejects_inconsistent_stored_operands(rng):
    k, v, ks, vs, _, _ = stored(rng, "int8", (1, 1, 10, 8))
    q = np.zeros((1, 1, 1, 8), np.float32)
    out = np.empty_like(q)
    with pytest.raises(ValueError, match="k_scale"):
        _attention_kernel.attention(q, k, v, out, None, None, True, 1.0, None, 1)
    with pytest.raises(TypeError, match="same dtype"):
        _attention_kernel.attention(q, k, v.astype(np.float16), out, None, None, True, 1.0,
                                    None, 1, k_scale=ks, v_scale=vs)


# ---- every SIMD path (the portable float16 conversion included) --------------------------

SIMD_CHILD = """
import sys
import numpy as np
import mha_cy
from mha_cy.attention import _attend
data = dict(np.load(sys.argv[1]))
out = {}
for fmt in ("f16", "i8"):
    for name in ("decode", "prefill"):
        q = data[f"{name}_q"]
        k, v = data[f"{name}_{fmt}_k"], data[f"{name}_{fmt}_v"]
        ks = data.get(f"{name}_{fmt}_ks")
        vs = data.get(f"{name}_{fmt}_vs")
        o = np.empty(q.shape, np.float32)
        _attend(q, k, v, o, None, None, True, 0.125, None, 2, None, k_scale=ks, v_scale=vs)
        out[f"{name}_{fmt}"] = o
np.savez(sys.argv[2], **out)
print(mha_cy.build_info()["simd"])
"""


@pytest.mark.parametrize("level", ["portable", "avx2", "avx512"])
def test_every_simd_level(rng, tmp_path, level):
    import os
    import subprocess
    import sys
    rank = {"sse2": 0, "avx2": 1, "avx512": 2}
    cpu = mha_cy.build_info()["simd_cpu"]
    if cpu not in rank:
        pytest.skip("no run-time SIMD dispatch in this build")
    if rank[{"portable": "sse2"}.get(level, level)] > rank[cpu]:
        pytest.skip(f"this CPU cannot run {level}")
    arrays, expected = {}, {}
    for name, (Hq, Lq, Lk, D) in {"decode": (8, 1, 300, 40), "prefill": (2, 20, 90, 24)}.items():
        q = rng.standard_normal((1, Hq, Lq, D)).astype(np.float32)
        arrays[f"{name}_q"] = q
        for short, fmt in (("f16", np.float16), ("i8", "int8")):
            k, v, ks, vs, kf, vf = stored(rng, fmt, (1, 2, Lk, D))
            arrays.update({f"{name}_{short}_k": k, f"{name}_{short}_v": v})
            if ks is not None:
                arrays.update({f"{name}_{short}_ks": ks, f"{name}_{short}_vs": vs})
            expected[f"{name}_{short}"] = reference._attention(q, kf, vf, None, None, True,
                                                               0.125)[0]
    np.savez(tmp_path / "in.npz", **arrays)
    env = dict(os.environ, MHA_CY_SIMD=level)
    proc = subprocess.run([sys.executable, "-c", SIMD_CHILD, str(tmp_path / "in.npz"),
                           str(tmp_path / "out.npz")], env=env, capture_output=True,
                          text=True, timeout=300, check=False, cwd=os.getcwd())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-1] == {"portable": "sse2"}.get(level, level)
    got = np.load(tmp_path / "out.npz")
    for key, exp in expected.items():
        fmt = "int8" if "_i8" in key and level == "avx512" else np.float16
        assert_exact(got[key], exp, fmt, err_msg=f"{key} at {level}")


@pytest.mark.parametrize("lq", [1, 5])
def test_float16_overflow_in_v_is_not_silently_finite(rng, tile_kernel, lq):
    """A value beyond float16's range is stored as inf: the rows that see it are not finite,
    the rows of the other K/V head are untouched."""
    q = rng.standard_normal((1, 4, lq, 32)).astype(np.float32)
    k, v, _, _, kf, vf = stored(rng, np.float16, (1, 2, 40, 32))
    v[0, 0, 3, 5] = np.inf
    out = np.empty((1, 4, lq, 32), np.float32)
    _attend(q, k, v, out, None, None, True, 0.2, None, 1, None)
    assert not np.isfinite(out[0, :2]).all()
    vf[0, 0, 3, 5] = 0
    assert_close(out[0, 2:], reference._attention(q, kf, vf, None, None, True, 0.2)[0][0, 2:],
                 np.float32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("window", [None, 900])
def test_ragged_split_k(rng, fmt, window):
    """Two sequences of 3000 and 1700 cached keys, one K/V head: split-K over ragged lengths
    (and a window), every thread count bitwise equal."""
    B, Hq, Lk, D = 2, 4, 3000, 64
    q = rng.standard_normal((B, Hq, 1, D)).astype(np.float32)
    k, v, ks, vs, kf, vf = stored(rng, fmt, (B, 1, Lk, D))
    ragged = np.array([[1, 1], [3000, 1700], [2999, 1699]], dtype=np.intp)
    results = []
    for n in (1, 2, 3):
        out = np.zeros((B, Hq, 1, D), np.float32)
        _attend(q, k, v, out, None, None, True, 0.125, None, n, window, ragged, None, ks, vs)
        results.append(out)
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])
    for b, n in enumerate([3000, 1700]):
        o_b, _ = reference._attention(q[b:b + 1], kf[b:b + 1, :, :n], vf[b:b + 1, :, :n], None,
                                      None, True, 0.125, window)
        assert_exact(results[0][b:b + 1], o_b, fmt, np.abs(vf).max())


@pytest.mark.parametrize("cache_dtype", [None, np.float16, "int8"])
@pytest.mark.parametrize("kernel", ["auto", "blas"])
def test_a_nan_key_outside_the_window_never_reaches_a_row(rng, cache_dtype, kernel):
    """A token whose K/V are NaN (in any storage format) and that the window hides: decode
    steps and prefills over the cache stay finite, on the fused and on the BLAS tile path."""
    from mha_cy import _attention_kernel
    previous = _attention_kernel._set_tile_kernel(kernel)
    try:
        mha = mha_cy.MultiHeadAttention(64, 4, num_kv_heads=2, window=4, seed=0)
        cache = mha.new_cache(2, 40, dtype=cache_dtype)
        x = rng.standard_normal((2, 10, 64)).astype(np.float32)
        x[0, 1] = np.nan
        mha(x, cache=cache)
        step = mha(rng.standard_normal((2, 1, 64)).astype(np.float32), cache=cache)
        prefill = mha(rng.standard_normal((2, 12, 64)).astype(np.float32), cache=cache)
        assert np.isfinite(step).all() and np.isfinite(prefill).all()
    finally:
        _attention_kernel._set_tile_kernel(previous)
