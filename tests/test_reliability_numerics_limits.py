"""Numerics at the edges and resource limits (reliability pass, stop 38).

Area 1: magnitudes near the dtype limits (subnormals, scores overflowing to +-inf in some rows
only), extreme scales and additive masks (+-inf, NaN, finfo.min/max), all-equal scores over
100k keys, long key sequences against the float64 reference, head dims 1..3 and above 256
(BLAS tiles), Dv != D, causal with Lq > Lk and Lq < Lk, windows of 1 and beyond Lk, mixed
input dtypes, and float16 / int8 caches at extreme magnitudes.
Area 2: need_weights on shapes whose weights would need TiBs (MemoryError, fast, cache
unchanged), huge batch x heads with tiny dims, caches of max_len 1, truncate(0), steps that
exactly fit or overflow by one, odd OMP_NUM_THREADS, threads() nesting and Python threads.

Tolerances: float32 1e-5 of max |expected| (1e-4 for int8 cache decode steps, whose VNNI path
rounds q and P to 16 bits: README, KV cache dtypes), float64 1e-12.
"""
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import mha_cy
from mha_cy import reference

SDPA = mha_cy.scaled_dot_product_attention
REF = reference.scaled_dot_product_attention
TOL = {np.float32: 1e-5, np.float64: 1e-12}


def assert_matches(actual, expected, tol):
    """Same shape, same NaN and inf pattern (and signs of the infs), finite values within
    tol x max |expected finite|."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected), "NaN pattern")
    np.testing.assert_array_equal(actual[np.isinf(expected)], expected[np.isinf(expected)])
    finite = np.isfinite(expected)
    assert np.isfinite(actual[finite]).all()
    exp = expected[finite].astype(np.float64)
    scale = float(np.abs(exp).max(initial=0.0))
    err = float(np.abs(actual[finite].astype(np.float64) - exp).max(initial=0.0))
    assert err <= tol * max(scale, 1e-300), (err, scale)


def randn(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


# -- Area 1: numerics -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("d", [3, 16, 300])
@pytest.mark.parametrize("lq, lk", [(1, 4096), (5, 300)])
def test_scores_overflowing_in_some_rows_only(rng, dtype, d, lq, lk, tile_kernel):
    """Products of one sign only, so that IEEE leaves no choice: +inf scores make their row NaN,
    -inf scores hide their keys (the row then equals the attention over the other keys), and
    every other row is untouched."""
    big = dtype(1e20 if dtype == np.float32 else 1e160)
    q, k, v = (randn(rng, (1, 2, lq, d), dtype), randn(rng, (1, 1, lk, d), dtype),
               randn(rng, (1, 1, lk, d), dtype))
    hot = np.arange(0, lk, 3)
    k[0, 0, hot] = np.abs(k[0, 0, hot]) * big
    q[0, 0, lq - 1] = np.abs(q[0, 0, lq - 1]) * big         # +inf at the hot keys: NaN row
    q[0, 1, 0] = -np.abs(q[0, 1, 0]) * big                  # -inf at the hot keys: hidden
    with np.errstate(over="ignore", invalid="ignore"):
        out = SDPA(q, k, v)
        causal = SDPA(q, k, v, is_causal=True)
        masked = REF(q[:, 1:, :1], k, v, attn_mask=allowed_first_row(hot, lk))
        visible = np.arange(lk) <= lk - lq                     # causal, row 0
        masked_causal = REF(q[:, 1:, :1], k, v,
                            attn_mask=allowed_first_row(hot, lk) & visible)
    assert np.isnan(out[0, 0, lq - 1]).all()
    assert not np.isnan(out[0, 0, :lq - 1]).any() and not np.isnan(out[0, 1]).any()
    assert_matches(out[:, 1:, :1], masked, TOL[dtype])
    finite_q = q.copy()
    finite_q[0, 0, lq - 1] = 0
    finite_q[0, 1, 0] = 0
    plain = REF(finite_q, k, v)
    assert_matches(out[0, 0, :lq - 1], plain[0, 0, :lq - 1], TOL[dtype])
    assert_matches(out[0, 1, 1:], plain[0, 1, 1:], TOL[dtype])
    assert np.isnan(causal[0, 0, lq - 1]).all()          # the last row sees a hot key
    assert_matches(causal[:, 1:, :1], masked_causal, TOL[dtype])


def allowed_first_row(hidden, lk):
    """A (1, Lk) bool mask hiding the given keys."""
    allowed = np.ones((1, lk), bool)
    allowed[0, hidden] = False
    return allowed


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("d", [3, 300])
@pytest.mark.parametrize("lq, lk", [(1, 5000), (4, 300), (7, 3)])
def test_extreme_masks_and_scales_match_the_reference(rng, dtype, d, lq, lk, tile_kernel):
    fi = np.finfo(dtype)
    q, k, v = (randn(rng, (2, 2, lq, d), dtype), randn(rng, (2, 1, lk, d), dtype),
               randn(rng, (2, 1, lk, d), dtype))
    masks = []
    m = np.zeros((lq, lk), dtype)
    m[:, ::2] = fi.min                                   # finite, but beyond any score
    masks.append(m)
    masks.append(np.full((lq, lk), fi.min, dtype))       # every key at finfo.min: uniform-ish
    m = np.full((lq, lk), -np.inf, dtype)
    m[:, lk - 1] = 0                                     # one visible key per row
    masks.append(m)
    m = np.zeros((lq, lk), dtype)
    m[0, lk // 2] = fi.max                               # one score near the top of the range
    m[lq - 1, 0] = np.inf
    masks.append(m)
    m = np.zeros((lq, lk), dtype)
    m[:, 0] = 1e4                                        # one huge score among many
    m[-1] = np.nan
    masks.append(m)
    for mask in masks:
        for scale in (None, 1e30, -1.0):
            for causal in (False, True):
                with np.errstate(over="ignore", invalid="ignore"):
                    expected = REF(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
                    out = SDPA(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
                assert_matches(out, expected, TOL[dtype])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("lq, hkv", [(1, 1), (3, 1), (1, 4)])
def test_all_equal_scores_over_100k_keys_give_the_mean(rng, dtype, lq, hkv, tile_kernel):
    """q = 0: every weight is 1 / Lk, the output the mean of V (the online softmax's sums over
    100k keys, split-K included)."""
    lk, d = 100_000, 8
    q = np.zeros((1, 4, lq, d), dtype)
    k = randn(rng, (1, hkv, lk, d), dtype)
    v = (rng.standard_normal((1, hkv, lk, d)) + 3).astype(dtype)
    mean = np.repeat(v.astype(np.float64).mean(axis=2, keepdims=True), 4 // hkv, axis=1)
    assert_matches(SDPA(q, k, v), np.broadcast_to(mean, (1, 4, lq, d)), TOL[dtype])
    causal = SDPA(q, k, v, is_causal=True)
    assert_matches(causal[:, :, -1:], mean, TOL[dtype])


@pytest.mark.parametrize("lq, lk, d, causal, window", [
    (1, 20001, 3, False, None), (300, 30000, 64, True, None), (3, 50000, 8, True, 7000)])
def test_long_key_sequences_float32_against_the_float64_reference(rng, lq, lk, d, causal,
                                                                   window):
    q = randn(rng, (1, 2, lq, d), np.float32, 3.0)
    k, v = randn(rng, (1, 1, lk, d), np.float32), randn(rng, (1, 1, lk, d), np.float32)
    expected = REF(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                   is_causal=causal, window=window)
    assert_matches(SDPA(q, k, v, is_causal=causal, window=window), expected, 1e-5)
    assert_matches(SDPA(q.astype(np.float64), k, v, is_causal=causal, window=window),
                   expected, 1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("d, dv", [(1, 1), (2, 5), (3, 1), (257, 3), (3, 513)])
@pytest.mark.parametrize("lq, lk, hq, hkv", [(9, 4, 3, 1), (3, 7, 2, 2), (1, 1, 1, 1),
                                             (5, 600, 4, 2)])
def test_odd_head_dims_causal_offsets_and_windows(rng, dtype, d, dv, lq, lk, hq, hkv,
                                                  tile_kernel):
    """Dv != D, head dims 1-3 and above 256, Lq > Lk (leading rows see no key: zeros),
    Lq < Lk, windows of 1 and beyond Lk; against the float64 reference."""
    q, k, v = (randn(rng, (1, hq, lq, d), dtype), randn(rng, (1, hkv, lk, d), dtype),
               randn(rng, (1, hkv, lk, dv), dtype))
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    for causal, window in ((False, None), (True, None), (True, 1), (True, lk + 5)):
        out = SDPA(q, k, v, is_causal=causal, window=window)
        assert out.dtype == dtype and out.shape == (1, hq, lq, dv)
        assert_matches(out, REF(q64, k64, v64, is_causal=causal, window=window),
                       3 * TOL[dtype])
        if causal and lq > lk:
            np.testing.assert_array_equal(out[:, :, :lq - lk], 0)


def test_mixed_input_dtypes_compute_in_the_widest(rng):
    q, k, v = (rng.standard_normal((1, 2, 3, 8)), rng.standard_normal((1, 2, 5, 8)),
               rng.standard_normal((1, 2, 5, 8)))
    q32 = q.astype(np.float32)
    expected = REF(q32.astype(np.float64), k, v)
    for args in ((q32, k, v), (q32, k.astype(np.float32), v), (k[:, :, :3], q32[:, :, :3], q32)):
        out = SDPA(*args)
        assert out.dtype == np.float64
    assert_matches(SDPA(q32, k, v), expected, 1e-12)
    half = [x.astype(np.float16) for x in (q, k, v)]
    out = SDPA(*half)
    assert out.dtype == np.float32
    assert_matches(out, REF(*[x.astype(np.float64) for x in half]), 1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("x_scale, w_scale", [(1e-38, 1.0), (1.0, 1e-20), (1.0, 1.0)])
@pytest.mark.parametrize("e, h, hkv, d", [(12, 4, 2, 3), (8, 8, 8, 1), (600, 2, 1, 300)])
def test_module_tiny_magnitudes_on_every_path(rng, dtype, x_scale, w_scale, e, h, hkv, d):
    """Subnormal inputs and tiny weights through the compiled small call, the general path
    (masks, padding, need_weights) and the big-call path, against the reference module."""
    def w(rows, cols):
        return rng.standard_normal((rows, cols)) / np.sqrt(cols) * w_scale
    weights = [w(h * d, e), w(hkv * d, e), w(hkv * d, e), w(e, h * d)]
    fast = mha_cy.MultiHeadAttention.from_weights(*weights, num_heads=h, num_kv_heads=hkv,
                                                  dtype=dtype)
    ref = reference.MultiHeadAttention.from_weights(*weights, num_heads=h, num_kv_heads=hkv,
                                                    dtype=dtype)
    for b, length in ((1, 1), (2, 7), (1, 300)):
        x = randn(rng, (b, length, e), dtype) * dtype(x_scale)
        for kw in ({}, {"is_causal": True}, {"attn_mask": np.zeros((length, length), dtype)},
                   {"key_padding_mask": np.zeros((b, length), bool)}):
            assert_matches(fast(x, **kw), ref(x, **kw), 10 * TOL[dtype])
        out, weights_ = fast(x, need_weights=True)
        out_r, weights_r = ref(x, need_weights=True)
        assert_matches(out, out_r, 10 * TOL[dtype])
        assert_matches(weights_, weights_r, TOL[dtype])


def _identity_module(d, scales=(1.0, 1.0, 1.0)):
    """One head, no biases, q/k/v = x times the scales exactly: a fast and a reference module
    write the same cache bits, so the float64 attention over the dequantized cache is the
    oracle of every cache format."""
    eye = np.eye(d, dtype=np.float32)
    return mha_cy.MultiHeadAttention.from_weights(*(eye * np.float32(s) for s in scales), eye,
                                                  num_heads=1)


def _cache_oracle(x_new, cache, q_scale=1.0):
    keys, values = (a.astype(np.float64) for a in cache.dequantize(cache.length))
    q = (x_new.astype(np.float64) * np.float32(q_scale))[:, None]
    return REF(q, keys, values, is_causal=True)[:, 0]


@pytest.mark.parametrize("fmt", [None, np.float16, "int8"])
@pytest.mark.parametrize("d", [1, 3, 64, 300])
def test_cache_edges_max_len_one_truncate_zero_and_exact_fit(rng, fmt, d):
    tol = 1e-4 if fmt == "int8" else 1e-5
    mha = _identity_module(d)
    cache = mha.new_cache(2, 1, dtype=fmt)
    x = randn(rng, (2, 1, d), np.float32)
    assert_matches(mha(x, cache=cache), _cache_oracle(x, cache), tol)
    stored = cache.key.copy()
    with pytest.raises(ValueError, match=r"1 cached \+ 1 new tokens > max_len 1"):
        mha(x, cache=cache)
    assert cache.length == 1 and np.array_equal(cache.key, stored)
    cache.truncate(0)
    y = randn(rng, (2, 1, d), np.float32)
    assert_matches(mha(y, cache=cache), _cache_oracle(y, cache), tol)
    for start, step in ((5, 3), (0, 8), (7, 1)):
        cache = mha.new_cache(2, 8, dtype=fmt)
        if start:
            mha(randn(rng, (2, start, d), np.float32), cache=cache)
        before = (cache.key.copy(), cache.value.copy())
        with pytest.raises(ValueError, match="cache overflow"):
            mha(randn(rng, (2, step + 1, d), np.float32), cache=cache)
        assert cache.length == start
        assert np.array_equal(cache.key, before[0]) and np.array_equal(cache.value, before[1])
        s = randn(rng, (2, step, d), np.float32)
        assert_matches(mha(s, cache=cache), _cache_oracle(s, cache), tol)
        assert cache.length == 8
        cache.truncate(0)
        t = randn(rng, (2, 1, d), np.float32)
        assert_matches(mha(t, cache=cache), _cache_oracle(t, cache), tol)


@pytest.mark.parametrize("fmt", [np.float16, "int8"])
@pytest.mark.parametrize("d", [8, 256])
@pytest.mark.parametrize("scales", [(1e30, 1e-30, 1.0), (2.0 ** -100, 2.0 ** 100, 1.0),
                                    (1e-35, 1e35, 1e-35), (1.0, 1.0, 1e36), (1.0, 1e-40, 1.0)])
def test_quantized_caches_at_extreme_magnitudes(rng, fmt, d, scales):
    """int8 scales near the float32 limits (q tiny or huge, a row below 2**-96 takes the float
    products), float16 within its range; the float64 attention over the stored values."""
    if fmt is np.float16 and not all(1e-4 <= s <= 1e4 for s in scales[1:]):
        scales = (scales[0], 1.0, 1.0)
    mha = _identity_module(d, scales)
    for start, step in ((30, 1), (30, 8), (0, 5)):
        cache = mha.new_cache(2, 64, dtype=fmt)
        x = randn(rng, (2, start + step, d), np.float32, 3.0)
        if start:
            mha(x[:, :start], cache=cache)
        out = mha(x[:, start:], cache=cache)
        assert_matches(out, _cache_oracle(x[:, start:], cache, scales[0]), 2e-4)


# -- Area 2: resources and limits -------------------------------------------------------------


def _run(code, env=None, timeout=120):
    """code in a fresh interpreter limited to 4 GiB of address space (so that nothing huge is
    ever really allocated, whatever the machine's overcommit policy); its stdout."""
    prelude = ("import resource\nresource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n")
    result = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)],
                            capture_output=True, text=True, timeout=timeout,
                            env=env, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_need_weights_of_tebibytes_raises_memory_error_fast():
    out = _run("""
        import time
        import numpy as np
        import mha_cy
        mha = mha_cy.MultiHeadAttention(8, 2, seed=0)
        x = np.zeros((1, 2 ** 20, 8), np.float32)      # weights: 2 x 2**40 floats = 8 TiB
        cases = [dict(), dict(is_causal=True), dict(key_padding_mask=np.zeros((1, 2 ** 20), bool))]
        for kw in cases:
            start = time.perf_counter()
            try:
                mha(x, need_weights=True, **kw)
                raise AssertionError("no MemoryError")
            except MemoryError as exc:
                assert "TiB" in str(exc) and "1048576" in str(exc), exc
            assert time.perf_counter() - start < 20
        cache = mha.new_cache(1, 2 ** 20)
        try:
            mha(x, cache=cache, need_weights=True)
            raise AssertionError("no MemoryError")
        except MemoryError:
            pass
        assert cache.length == 0                         # the failed call changed nothing
        y = np.ones((1, 1, 8), np.float32)
        assert np.isfinite(mha(y, cache=cache)).all() and cache.length == 1
        print("ok")
    """)
    assert out.strip() == "ok"


def test_huge_batch_times_heads_with_tiny_dims(rng):
    """Millions of tasks of one key: each output row is its key/value head's V row."""
    for b, hq, hkv, lq, d in ((20000, 32, 32, 1, 1), (2048, 64, 1, 2, 3)):
        q = randn(rng, (b, hq, lq, d), np.float32)
        k, v = randn(rng, (b, hkv, 1, d), np.float32), randn(rng, (b, hkv, 1, d), np.float32)
        expected = np.broadcast_to(np.repeat(v, hq // hkv, axis=1), (b, hq, lq, d))
        np.testing.assert_array_equal(SDPA(q, k, v), expected)
        causal = SDPA(q, k, v, is_causal=True)     # only the last query row sees the key
        np.testing.assert_array_equal(causal[:, :, -1], expected[:, :, -1])
        np.testing.assert_array_equal(causal[:, :, :-1], 0)


def test_odd_omp_num_threads_values_fall_back_and_compute():
    code = """
        import numpy as np
        import mha_cy
        n = mha_cy.get_num_threads()
        assert 1 <= n <= (len(__import__("os").sched_getaffinity(0))), n
        mha = mha_cy.MultiHeadAttention(16, 2, seed=0)
        x = np.ones((2, 300, 16), np.float32)
        with mha_cy.threads(1):
            serial = mha(x)
        assert np.array_equal(mha(x), serial)
        print(n)
    """
    for value in ("0", "abc", "2,1", "1000000"):
        env = dict(os.environ, OMP_NUM_THREADS=value)
        assert int(_run(code, env=env).strip()) >= 1
    env = dict(os.environ, OMP_NUM_THREADS="1")
    assert _run(code, env=env).strip() == "1"


def test_threads_blocks_nest_restore_on_exceptions_and_do_not_reach_new_threads(rng):
    mha = mha_cy.MultiHeadAttention(16, 2, seed=0)
    x = randn(rng, (2, 300, 16), np.float32)
    default = mha_cy.get_num_threads()
    with pytest.raises(KeyError):
        with mha_cy.threads(1):
            with mha_cy.threads(3):
                assert mha_cy.get_num_threads() == 3
                raise KeyError("inside")
    assert mha_cy.get_num_threads() == default
    seen = {}

    def worker():
        seen["default"] = mha_cy.get_num_threads()
        seen["out"] = mha(x)
        with mha_cy.threads(2):
            seen["inner"] = mha_cy.get_num_threads()
            seen["out2"] = mha(x)

    with mha_cy.threads(1):
        serial = mha(x)
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join(60)
        assert not thread.is_alive()
        assert mha_cy.get_num_threads() == 1
    assert seen["default"] == default and seen["inner"] == 2
    assert np.array_equal(seen["out"], serial) and np.array_equal(seen["out2"], serial)
    with mha_cy.threads(64):                    # oversubscribed, bits unchanged
        assert np.array_equal(mha(x), serial)
