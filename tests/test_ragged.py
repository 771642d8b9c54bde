"""Ragged batches in a KV cache (lengths= on the call, cache.lengths per sequence): each
sequence against the reference run alone on it, prefill then steps, truncate / reorder / copy /
pickling, atomicity of failed calls, thread-count invariance of the ragged decode path."""
import pickle

import numpy as np
import pytest

import mha_cy

from conftest import DTYPES, assert_close, make_pair

IMPLS = ["fast", "reference"]


def pick(pair, impl):
    return pair[0] if impl == "fast" else pair[1]


def alone(ref, x_b):
    """The reference on one sequence's real tokens, one causal pass: (L_b, E)."""
    return ref(x_b[None], is_causal=True)[0]


def snapshot(cache):
    return cache.lengths, cache.key.copy(), cache.value.copy()


def assert_unchanged(cache, snap):
    lengths, key, value = snap
    np.testing.assert_array_equal(cache.lengths, lengths)
    np.testing.assert_array_equal(cache.key, key)           # not even scratch was written
    np.testing.assert_array_equal(cache.value, value)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,window", [(4, 4, None), (8, 2, None), (4, 1, 5),
                                                   (8, 2, 9)])
def test_ragged_prefill_then_steps_equal_each_sequence_alone(rng, impl, dtype, heads, kv_heads,
                                                             window):
    fast, ref = make_pair(rng, 32, heads, dtype, num_kv_heads=kv_heads)
    fast.window = ref.window = window
    mha = pick((fast, ref), impl)
    lengths = np.array([12, 3, 0, 7])
    B, Lq, steps = 4, 12, 6
    prompts = rng.standard_normal((B, Lq, 32)).astype(dtype)
    tokens = rng.standard_normal((B, steps, 32)).astype(dtype)
    cache = mha.new_cache(B, Lq + steps)
    out = mha(prompts, cache=cache, lengths=lengths)
    np.testing.assert_array_equal(cache.lengths, lengths)
    assert cache.lengths.dtype == np.int64 and cache.length == 12
    for b, n in enumerate(lengths):
        if n:
            assert_close(out[b, :n], alone(ref, prompts[b, :n]), dtype)
        assert (out[b, n:] == 0).all()                 # padding rows: exactly 0, no bias
    outs = [mha(tokens[:, t:t + 1], cache=cache) for t in range(steps)]
    np.testing.assert_array_equal(cache.lengths, lengths + steps)
    for b, n in enumerate(lengths):
        whole = alone(ref, np.concatenate([prompts[b, :n], tokens[b]]))
        assert_close(np.concatenate([o[b] for o in outs]), whole[n:], dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_ragged_need_weights_and_masks(rng, impl, dtype):
    fast, ref = make_pair(rng, 16, 4, dtype, num_kv_heads=2)
    mha = pick((fast, ref), impl)
    B, Lq = 3, 9
    lengths = np.array([9, 4, 6])
    x = rng.standard_normal((B, Lq, 16)).astype(dtype)
    padding = np.zeros((B, Lq), dtype=bool)
    padding[:, 0] = True                                     # every sequence ignores token 0
    cache = mha.new_cache(B, 20)
    out, w = mha(x, cache=cache, lengths=lengths, key_padding_mask=padding, need_weights=True)
    assert w.shape == (B, 4, Lq, 9)
    for b, n in enumerate(lengths):
        o_b, w_b = ref(x[b:b + 1, :n], is_causal=True, key_padding_mask=padding[b:b + 1, :n],
                       need_weights=True)
        assert_close(out[b, :n], o_b[0], dtype)
        assert_close(w[b, :, :n, :n], w_b[0], dtype)
        assert (w[b, :, :, n:] == 0).all() and (w[b, :, n:] == 0).all()
        assert (out[b, n:] == 0).all()
    # a step over the ragged cache with weights: each row over its own keys only
    step = rng.standard_normal((B, 1, 16)).astype(dtype)
    out, w = mha(step, cache=cache, need_weights=True)
    assert w.shape == (B, 4, 1, 10)
    for b, n in enumerate(lengths):
        assert (w[b, :, :, n + 1:] == 0).all()
        np.testing.assert_allclose(w[b].sum(-1), 1, rtol=1e-5)
        whole = alone(ref, np.concatenate([x[b, :n], step[b]]))
        assert_close(out[b, 0], whole[-1], dtype)


@pytest.mark.parametrize("impl", IMPLS)
def test_steps_without_lengths_go_to_each_sequences_own_position(rng, impl):
    """A ragged cache, then calls of several tokens without lengths= (all of them real)."""
    fast, ref = make_pair(rng, 16, 2, np.float64)
    mha = pick((fast, ref), impl)
    x = rng.standard_normal((2, 10, 16))
    cache = mha.new_cache(2, 16)
    mha(x[:, :5], cache=cache, lengths=[5, 2])
    more = rng.standard_normal((2, 3, 16))
    out = mha(more, cache=cache)
    np.testing.assert_array_equal(cache.lengths, [8, 5])
    for b, n in enumerate([5, 2]):
        assert_close(out[b], alone(ref, np.concatenate([x[b, :n], more[b]]))[n:])


@pytest.mark.parametrize("impl", IMPLS)
def test_truncate_per_sequence_and_reset(rng, impl):
    fast, ref = make_pair(rng, 16, 4, np.float64, num_kv_heads=1)
    mha = pick((fast, ref), impl)
    x = rng.standard_normal((3, 8, 16))
    cache = mha.new_cache(3, 12)
    mha(x, cache=cache, lengths=[8, 6, 5])
    cache.truncate([4, 6, 0])
    np.testing.assert_array_equal(cache.lengths, [4, 6, 0])
    out = mha(x[:, 4:5], cache=cache)       # token 4 of each sequence after its kept prefix
    for b, n in enumerate([4, 6, 0]):
        assert_close(out[b], alone(ref, np.concatenate([x[b, :n], x[b, 4:5]]))[-1:])
    np.testing.assert_array_equal(cache.lengths, [5, 7, 1])
    cache.truncate(1)                                          # an int: every sequence
    np.testing.assert_array_equal(cache.lengths, [1, 1, 1])
    lengths = cache.lengths
    lengths[0] = 7                                             # a copy: the cache is unchanged
    assert cache.length == 1
    with pytest.raises(ValueError, match=r"length must be in \[0, 1\].*sequence 1; got 3"):
        cache.truncate([0, 3, 0])
    np.testing.assert_array_equal(cache.lengths, [1, 1, 1])
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        cache.truncate([1, 1])
    with pytest.raises(TypeError, match="length must be an int"):
        cache.truncate([1.0, 1.0, 1.0])
    cache.reset()
    np.testing.assert_array_equal(cache.lengths, [0, 0, 0])


@pytest.mark.parametrize("impl", IMPLS)
def test_reorder_for_beam_search(rng, impl):
    fast, ref = make_pair(rng, 16, 4, np.float32, num_kv_heads=2)
    mha = pick((fast, ref), impl)
    x = rng.standard_normal((3, 6, 16)).astype(np.float32)
    cache = mha.new_cache(3, 10)
    mha(x, cache=cache, lengths=[6, 4, 5])
    before = cache.copy()
    cache.reorder([2, 2, 0])                                # repeats allowed; 1 is dropped
    np.testing.assert_array_equal(cache.lengths, [5, 5, 6])
    for b, old in enumerate([2, 2, 0]):
        n = before.lengths[old]
        np.testing.assert_array_equal(cache.key[b, :, :n], before.key[old, :, :n])
        np.testing.assert_array_equal(cache.value[b, :, :n], before.value[old, :, :n])
    step = rng.standard_normal((3, 1, 16)).astype(np.float32)
    out = mha(step, cache=cache)
    for b, old in enumerate([2, 2, 0]):
        n = before.lengths[old]
        whole = alone(ref, np.concatenate([x[old, :n], step[b]]))
        assert_close(out[b], whole[-1:])
    snap = snapshot(cache)
    for bad, error in (([0, 3, 1], ValueError), ([0, -1, 1], ValueError), ([0, 1], ValueError),
                       (1, TypeError), ([0.0, 1.0, 2.0], TypeError)):
        with pytest.raises(error, match="indices"):
            cache.reorder(bad)
        assert_unchanged(cache, snap)


@pytest.mark.parametrize("dtype, read_only", [(None, "value"), (np.float16, "value"),
                                               ("int8", "value"), ("int8", "value_scale")])
def test_reorder_of_a_read_only_cache_changes_nothing(rng, dtype, read_only):
    # the keys used to move before the values' write failed: beams with mixed-up K and V
    mha = pick(make_pair(rng, 16, 4, np.float32, num_kv_heads=2), "fast")
    cache = mha.new_cache(3, 10, dtype=dtype)
    mha(rng.standard_normal((3, 6, 16)).astype(np.float32), cache=cache, lengths=[6, 4, 5])
    getattr(cache, read_only).flags.writeable = False
    snap = snapshot(cache)
    with pytest.raises(ValueError, match=f"cache.{read_only} is read-only"):
        cache.reorder([2, 2, 0])
    assert_unchanged(cache, snap)


@pytest.mark.parametrize("impl", IMPLS)
def test_copy_nbytes_and_pickling(rng, impl):
    mha = pick(make_pair(rng, 16, 4, np.float64, num_kv_heads=2), impl)
    x = rng.standard_normal((2, 5, 16))
    cache = mha.new_cache(2, 7)
    mha(x, cache=cache, lengths=[5, 3])
    assert cache.nbytes == 2 * (2 * 2 * 7 * 4) * 8
    dup = cache.copy()
    assert dup is not cache and dup.key is not cache.key
    np.testing.assert_array_equal(dup.key, cache.key)
    np.testing.assert_array_equal(dup.lengths, cache.lengths)
    step = rng.standard_normal((2, 1, 16))
    expected = mha(step, cache=dup)                     # the copy moves on alone
    np.testing.assert_array_equal(cache.lengths, [5, 3])
    np.testing.assert_array_equal(dup.lengths, [6, 4])
    back = pickle.loads(pickle.dumps(cache))
    assert type(back) is type(cache) and repr(back) == repr(cache)
    np.testing.assert_array_equal(back.lengths, cache.lengths)
    np.testing.assert_array_equal(back.key, cache.key)
    np.testing.assert_array_equal(back.value, cache.value)
    np.testing.assert_array_equal(mha(step, cache=back), expected)
    assert "lengths=[6, 4]" in repr(dup)


@pytest.mark.parametrize("impl", IMPLS)
def test_failed_calls_leave_the_cache_exactly_as_it_was(rng, impl):
    fast, ref = make_pair(rng, 16, 4, np.float32, num_kv_heads=2)
    mha = pick((fast, ref), impl)
    x = rng.standard_normal((3, 4, 16)).astype(np.float32)
    cache = mha.new_cache(3, 6)
    mha(x, cache=cache, lengths=[4, 1, 3])
    snap = snapshot(cache)
    # overflow of the middle sequence only: 1 + 4 fits, 4 + 4 and 3 + 4 do not
    with pytest.raises(ValueError, match=r"cache overflow: 4 cached \+ 4 new.*\(sequence 0\)"):
        mha(x, cache=cache)
    assert_unchanged(cache, snap)
    with pytest.raises(ValueError, match=r"cache overflow: 3 cached \+ 4 new.*\(sequence 2\)"):
        mha(x, cache=cache, lengths=[2, 4, 4])
    assert_unchanged(cache, snap)
    for bad, error, match in (([1, -1, 1], ValueError, r"lengths must be in \[0, 4\]"),
                              ([1, 5, 1], ValueError, r"got 5 for sequence 1"),
                              ([1, 1], ValueError, r"lengths must have shape \(3,\)"),
                              ([1.0, 1.0, 1.0], TypeError, "lengths must be an integer")):
        with pytest.raises(error, match=match):
            mha(x, cache=cache, lengths=bad)
        assert_unchanged(cache, snap)
    with pytest.raises(ValueError, match="attn_mask"):           # a bad mask mid-call
        mha(x, cache=cache, lengths=[2, 2, 2], attn_mask=np.ones((3, 4, 4), bool))
    assert_unchanged(cache, snap)
    # what fits still works: sequence 0 appends nothing, 1 and 2 append 2 and 3 tokens
    out = mha(x[:, :3], cache=cache, lengths=[0, 3, 3])
    np.testing.assert_array_equal(cache.lengths, [4, 4, 6])
    assert (out[0] == 0).all()
    with pytest.raises(ValueError, match="lengths= is for ragged batches"):
        mha(x, lengths=[1, 1, 1])


@pytest.mark.parametrize("impl", IMPLS)
def test_unbatched_lengths(rng, impl):
    fast, ref = make_pair(rng, 16, 2, np.float64)
    mha = pick((fast, ref), impl)
    x = rng.standard_normal((6, 16))
    cache = mha.new_cache(1, 6)
    out = mha(x, cache=cache, lengths=4)
    assert out.shape == (6, 16) and cache.length == 4 and (out[4:] == 0).all()
    assert_close(out[:4], alone(ref, x[:4]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 1200])
def test_ragged_long_decode_split_k_and_thread_invariance(rng, dtype, window):
    """Two sequences of 1100 and 1500 cached tokens, MQA: 2 tasks, split-K over each one's
    own keys (and window); the step is bitwise the same on 1 to 4 threads."""
    fast, ref = make_pair(rng, 64, 8, dtype, num_kv_heads=1)
    fast.window = ref.window = window
    lengths = np.array([1100, 1500])
    x = rng.standard_normal((2, 1501, 64)).astype(dtype)
    cache = fast.new_cache(2, 1501)
    fast(x[:, :1500], cache=cache, lengths=lengths)
    step = rng.standard_normal((2, 1, 64)).astype(dtype)
    results = []
    for n in (1, 2, 3, 4):
        with mha_cy.threads(n):
            trial = cache.copy()
            results.append(fast(step, cache=trial))
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])
    for b, n in enumerate(lengths):
        whole = alone(ref, np.concatenate([x[b, :n], step[b]]))
        assert_close(results[0][b], whole[-1:], dtype)
