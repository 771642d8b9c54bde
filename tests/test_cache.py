"""KVCache and incremental decoding: new_cache, prefill + token-by-token decode, failures."""
import numpy as np
import pytest

import mha_cy
from mha_cy import KVCache, reference

from conftest import DTYPES, assert_close, make_pair, random_padding

IMPLS = ["fast", "reference"]


def pick(pair, impl):
    return pair[0] if impl == "fast" else pair[1]


def decode(mha, x, prefill, max_len=None, padding=None, need_weights=False, chunk=1):
    """Run x (B, L, E) through a cache: `prefill` tokens at once, then `chunk` at a time.
    Returns the concatenated outputs (and the list of weights)."""
    B, L, _ = x.shape
    cache = mha.new_cache(B, max_len or L)
    outs, weights = [], []
    start = 0
    for stop in [prefill] + list(range(prefill + chunk, L, chunk)) + [L]:
        if stop <= start:
            continue
        kpm = None if padding is None else padding[:, :stop]
        res = mha(x[:, start:stop], key_padding_mask=kpm, need_weights=need_weights,
                  cache=cache)
        if need_weights:
            res, w = res
            weights.append(w)
        outs.append(res)
        start = stop
        assert cache.length == stop
    return np.concatenate(outs, axis=1), weights


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("padded", [False, True])
def test_prefill_then_decode_equals_one_causal_pass(rng, impl, dtype, heads, kv_heads, padded):
    fast, ref = make_pair(rng, 32, heads, dtype, num_kv_heads=kv_heads)
    mha = pick((fast, ref), impl)
    B, L = 3, 80
    x = rng.standard_normal((B, L, 32)).astype(dtype)
    padding = random_padding(rng, B, L) if padded else None
    full = mha(x, is_causal=True, key_padding_mask=padding)
    for prefill in (1, 70):
        out, _ = decode(mha, x, prefill, max_len=L + 5, padding=padding)
        assert out.dtype == dtype
        assert_close(out, full, dtype)
    # the fast path's decode agrees with the reference's one pass too
    assert_close(out, ref(x, is_causal=True, key_padding_mask=padding), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_long_cache_crosses_key_tiles(rng, dtype):
    """A cache longer than the kernel's 256-key tiles; GQA decode (grouped heads together)."""
    fast, ref = make_pair(rng, 32, 8, dtype, num_kv_heads=2)
    x = rng.standard_normal((2, 520, 32)).astype(dtype)
    out, _ = decode(fast, x, prefill=510)
    assert_close(out, ref(x, is_causal=True), dtype)
    out, _ = decode(fast, x, prefill=100, chunk=150)          # chunked prefill
    assert_close(out, ref(x, is_causal=True), dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cache_contents_are_the_projected_keys_values(rng, impl, dtype):
    mha = pick(make_pair(rng, 16, 4, dtype, num_kv_heads=2), impl)
    x = rng.standard_normal((2, 6, 16)).astype(dtype)
    cache = mha.new_cache(2, 10)
    assert isinstance(cache, KVCache)
    assert cache.key.shape == cache.value.shape == (2, 2, 10, 4)
    assert (cache.batch_size, cache.num_kv_heads, cache.max_len, cache.head_dim) == (2, 2, 10, 4)
    assert cache.dtype == dtype and cache.length == 0
    mha(x, cache=cache)
    k = (x @ mha.k_weight.T + mha.k_bias).reshape(2, 6, 2, 4).transpose(0, 2, 1, 3)
    v = (x @ mha.v_weight.T + mha.v_bias).reshape(2, 6, 2, 4).transpose(0, 2, 1, 3)
    assert_close(cache.key[:, :, :6], k, dtype)
    assert_close(cache.value[:, :, :6], v, dtype)
    assert "length=6" in repr(cache)


@pytest.mark.parametrize("impl", IMPLS)
def test_unbatched_decode(rng, impl):
    mha = pick(make_pair(rng, 16, 2, np.float64), impl)
    x = rng.standard_normal((5, 16))
    cache = mha.new_cache(1, 5)
    outs = [mha(x[:2], cache=cache)] + [mha(x[i:i + 1], cache=cache) for i in range(2, 5)]
    assert outs[0].shape == (2, 16) and outs[1].shape == (1, 16)
    assert_close(np.concatenate(outs), mha(x, is_causal=True))


def snapshot(cache):
    return cache.length, cache.key.copy(), cache.value.copy()


def assert_unchanged(cache, snap):
    length, key, value = snap
    assert cache.length == length
    np.testing.assert_array_equal(cache.key[:, :, :length], key[:, :, :length])
    np.testing.assert_array_equal(cache.value[:, :, :length], value[:, :, :length])


@pytest.mark.parametrize("impl", IMPLS)
def test_overflow_raises_and_leaves_the_cache_unchanged(rng, impl):
    fast, ref = make_pair(rng, 16, 4, np.float32, num_kv_heads=2)
    mha = pick((fast, ref), impl)
    x = rng.standard_normal((2, 8, 16)).astype(np.float32)
    cache = mha.new_cache(2, 6)
    mha(x[:, :5], cache=cache)
    snap = snapshot(cache)
    with pytest.raises(ValueError, match=r"cache overflow.*5 cached \+ 2 new.*max_len 6"):
        mha(x[:, 5:7], cache=cache)
    assert_unchanged(cache, snap)
    np.testing.assert_array_equal(cache.key, snap[1])       # not even scratch was written
    # the cache still works: the last free slot, then a full cache overflows with one token
    out = mha(x[:, 5:6], cache=cache)
    assert_close(out, mha(x[:, :6], is_causal=True)[:, 5:6])
    with pytest.raises(ValueError, match="cache overflow"):
        mha(x[:, 6:7], cache=cache)
    assert cache.length == 6
    with pytest.raises(ValueError, match="cache overflow"):
        mha(x, cache=mha.new_cache(2, 7))                   # a prefill too long


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bad", ["padding_shape", "padding_dtype", "mask_shape", "mask_dtype",
                                 "is_causal", "need_weights", "query_dim", "query_rank",
                                 "key_given", "batch"])
def test_failed_call_leaves_the_cache_unchanged(rng, impl, bad):
    mha = pick(make_pair(rng, 16, 4, np.float64, num_kv_heads=2), impl)
    x = rng.standard_normal((2, 7, 16))
    cache = mha.new_cache(2, 10)
    mha(x[:, :4], cache=cache)
    snap = snapshot(cache)
    step = x[:, 4:5]
    kwargs = {
        "padding_shape": dict(key_padding_mask=np.zeros((2, 4), bool)),    # needs (2, 5)
        "padding_dtype": dict(key_padding_mask=np.zeros((2, 5))),
        "mask_shape": dict(attn_mask=np.ones((1, 4), bool)),               # needs (1, 5)
        "mask_dtype": dict(attn_mask=np.ones((1, 5), np.int32)),
        "is_causal": dict(is_causal=1),
        "need_weights": dict(need_weights="yes"),
    }.get(bad, {})
    args = {"query_dim": (x[:, 4:5, :8],), "query_rank": (x[0, 4:5, None],),
            "key_given": (step, step), "batch": (x[:1, 4:5],)}.get(bad, (step,))
    with pytest.raises((ValueError, TypeError)):
        mha(*args, cache=cache, **kwargs)
    assert_unchanged(cache, snap)
    # and decoding goes on as if nothing had happened
    out = np.concatenate([mha(x[:, i:i + 1], cache=cache) for i in range(4, 7)], axis=1)
    assert_close(out, mha(x, is_causal=True)[:, 4:])


@pytest.mark.parametrize("impl", IMPLS)
def test_cache_of_another_module_config_raises(rng, impl):
    cls = mha_cy.MultiHeadAttention if impl == "fast" else reference.MultiHeadAttention
    mha = cls(16, 4, num_kv_heads=2, seed=0)
    x = rng.standard_normal((2, 3, 16))
    for other in (cls(16, 4, seed=0),                            # num_kv_heads 4
                  cls(16, 2, num_kv_heads=2, seed=0),             # head_dim 8
                  cls(16, 4, num_kv_heads=2, dtype=np.float64, seed=0)):
        cache = other.new_cache(2, 8)
        with pytest.raises(ValueError, match="cache"):
            mha(x, cache=cache)
        assert cache.length == 0
    with pytest.raises(TypeError, match="cache must be a KVCache"):
        mha(x, cache={"key": None})
    # a cache of the same configuration from another module is accepted (same shapes)
    twin = cls(16, 4, num_kv_heads=2, seed=1)
    cache = twin.new_cache(2, 8)
    mha(x, cache=cache)
    assert cache.length == 3


@pytest.mark.parametrize("impl", IMPLS)
def test_batch_mismatch_raises(rng, impl):
    mha = pick(make_pair(rng, 16, 4, np.float32), impl)
    cache = mha.new_cache(3, 8)
    with pytest.raises(ValueError, match=r"cache has batch_size 3 but query has batch 2"):
        mha(rng.standard_normal((2, 1, 16)), cache=cache)
    with pytest.raises(ValueError, match=r"cache has batch_size 3 but query has batch 1 \(an "
                                         r"unbatched query is batch 1\)"):
        mha(rng.standard_normal((1, 16)), cache=cache)          # unbatched = batch 1
    assert cache.length == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_cross_attention_with_cache_raises(rng, impl):
    mha = pick(make_pair(rng, 16, 4, np.float32), impl)
    cache = mha.new_cache(1, 8)
    x = rng.standard_normal((1, 2, 16))
    with pytest.raises(ValueError, match="cache"):
        mha(x, x, cache=cache)
    assert cache.length == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_truncate_and_reset(rng, impl):
    mha = pick(make_pair(rng, 16, 4, np.float64, num_kv_heads=1), impl)
    x = rng.standard_normal((2, 9, 16))
    draft = rng.standard_normal((2, 3, 16))
    cache = mha.new_cache(2, 12)
    mha(x[:, :6], cache=cache)
    mha(draft, cache=cache)                          # a rejected draft of 3 tokens
    assert cache.length == 9
    cache.truncate(6)
    assert cache.length == 6
    out = np.concatenate([mha(x[:, i:i + 1], cache=cache) for i in range(6, 9)], axis=1)
    assert_close(out, mha(x, is_causal=True)[:, 6:])
    cache.truncate(np.int64(9))                      # no-op
    cache.truncate(0)
    assert cache.length == 0
    cache.reset()
    assert cache.length == 0 and cache.max_len == 12
    assert_close(mha(x, cache=cache), mha(x, is_causal=True))
    cache.reset()
    assert cache.length == 0
    assert_close(mha(x[:, :2], cache=cache), mha(x[:, :2], is_causal=True))
    with pytest.raises(ValueError, match=r"length must be in \[0, 2\]"):
        cache.truncate(3)
    with pytest.raises(ValueError, match="length"):
        cache.truncate(-1)
    for bad in (1.0, True, "1", None):
        with pytest.raises(TypeError, match="length must be an int"):
            cache.truncate(bad)
    assert cache.length == 2
    # beyond int64: OverflowError from np.full; a uint64 wrapped to -1 in the message
    for bad in (2 ** 70, -2 ** 70, np.array([2 ** 64 - 1, 0], np.uint64),
                np.array([2 ** 64 - 1, 0], ">u8")):
        with pytest.raises(ValueError, match=r"length is out of range; got (-?1180|18446)"):
            cache.truncate(bad)
    with pytest.raises(ValueError, match="indices is out of range; got 18446"):
        cache.reorder(np.full(x.shape[0], 2 ** 64 - 1, np.uint64))
    assert cache.length == 2


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cache_with_need_weights(rng, impl, dtype):
    fast, ref = make_pair(rng, 16, 4, dtype, num_kv_heads=2)
    mha = pick((fast, ref), impl)
    x = rng.standard_normal((2, 8, 16)).astype(dtype)
    padding = random_padding(rng, 2, 8)
    out, weights = decode(mha, x, prefill=5, padding=padding, need_weights=True)
    assert [w.shape for w in weights] == [(2, 4, 5, 5), (2, 4, 1, 6), (2, 4, 1, 7),
                                          (2, 4, 1, 8)]
    full_out, full_w = ref(x, is_causal=True, key_padding_mask=padding, need_weights=True)
    assert_close(out, full_out, dtype)
    assert_close(weights[0], full_w[:, :, :5, :5], dtype)
    for i, w in enumerate(weights[1:]):
        assert_close(w, full_w[:, :, 5 + i:6 + i, :6 + i], dtype)
    # is_causal is implied by the cache
    cache = mha.new_cache(2, 8)
    out2 = mha(x, cache=cache, is_causal=False)
    assert_close(out2, ref(x, is_causal=True), dtype)


def test_cache_with_attn_mask(rng):
    """An attn_mask spans the whole cached length plus the new tokens."""
    fast, ref = make_pair(rng, 16, 4, np.float64)
    x = rng.standard_normal((2, 6, 16))
    mask = rng.standard_normal((2, 4, 6, 6))
    for mha in (fast, ref):
        cache = mha.new_cache(2, 6)
        first = mha(x[:, :4], cache=cache, attn_mask=mask[:, :, :4, :4])
        second = mha(x[:, 4:], cache=cache, attn_mask=mask[:, :, 4:, :6])
        expected = ref(x, attn_mask=mask, is_causal=True)
        assert_close(np.concatenate([first, second], axis=1), expected)


def test_new_cache_arguments():
    mha = mha_cy.MultiHeadAttention(16, 4, seed=0)
    for bad, exc in ((0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(exc, match="batch_size"):
            mha.new_cache(bad, 4)
        with pytest.raises(exc, match="max_len"):
            mha.new_cache(1, bad)
    # more elements than NumPy can address: the error names the sizes, not just "too big"
    with pytest.raises(ValueError, match=r"batch_size=1000000000, .*max_len=1000000000, "
                                         r".*too large"):
        mha.new_cache(10**9, 10**9)


def test_dequantize_checks_its_length(rng):
    """dequantize(-1) gave max_len - 1 positions and a length past max_len was cut silently
    (a slice's rules); 1.5 raised NumPy's slice error, which named no argument."""
    mha = mha_cy.MultiHeadAttention(16, 4, seed=0)
    for fmt in (None, np.float16, "int8"):
        cache = mha.new_cache(2, 5, dtype=fmt)
        mha(rng.standard_normal((2, 3, 16)).astype(np.float32), cache=cache)
        for bad, exc in ((-1, ValueError), (6, ValueError), (1.5, TypeError), (True, TypeError),
                         ("2", TypeError)):
            with pytest.raises(exc, match="length"):
                cache.dequantize(bad)
        for n in (0, 3, 5, np.int64(4)):
            key, value = cache.dequantize(n)
            assert key.shape == value.shape == (2, 4, n, 4)
        assert cache.dequantize()[0].shape == (2, 4, 5, 4)


def test_direct_construction_checks_its_sizes():
    # KVCache is public: KVCache(0, ...) raised IndexError from inside its lengths bookkeeping
    good = dict(batch_size=2, num_kv_heads=1, max_len=4, head_dim=8)
    for name in good:
        for bad, exc in ((0, ValueError), (1.5, TypeError), (True, TypeError)):
            with pytest.raises(exc, match=name):
                KVCache(**{**good, name: bad}, dtype=np.float32)
    cache = KVCache(**good, dtype=np.float32)
    assert cache.key.shape == (2, 1, 4, 8) and cache.lengths.tolist() == [0, 0]
    # dtype is the compute dtype: KVCache(..., np.float16) made a cache computing in float16,
    # which every module call refused or mishandled; new_cache(dtype=np.float16) is the way
    for bad in (np.float16, np.int8, "int8", None, "nonsense"):
        with pytest.raises(TypeError, match="new_cache"):
            KVCache(**good, dtype=bad)
    assert KVCache(**good, dtype="float64").dtype == np.float64


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", [None, np.float16, "int8"], ids=["f32", "f16", "i8"])
def test_read_only_cache_error_names_the_array(rng, impl, fmt):
    """A call through the general path (a prefill) into a cache with a read-only array raised
    NumPy's "assignment destination is read-only", which names nothing: it names the array
    now, and the cache is unchanged (and nothing is written to the read-only array)."""
    mha = pick(make_pair(rng, 16, 4, np.float32, num_kv_heads=2), impl)
    x = rng.standard_normal((2, 6, 16)).astype(np.float32)
    cache = mha.new_cache(2, 8, dtype=fmt)
    mha(x[:, :2], cache=cache)
    names = ["key", "value"] + (["key_scale", "value_scale"] if fmt == "int8" else [])
    for name in names:
        array = getattr(cache, name)
        saved = array.copy()
        array.setflags(write=False)
        with pytest.raises(ValueError, match=f"cache.{name} is read-only"):
            mha(x[:, 2:5], cache=cache)
        assert cache.length == 2
        np.testing.assert_array_equal(array, saved)
        array.setflags(write=True)
    out = mha(x[:, 2:5], cache=cache)                # and the cache still works
    assert out.shape == (2, 3, 16) and cache.length == 5
