"""head_mask= on the call, prune_heads, and the kernel's per-query-head K/V index.

The formulas are written out here in NumPy; the pruned module must give the output of the
original with head_mask zero at the pruned heads, on the fast path and the reference, for
MHA, even and uneven GQA groups, masks and cached decoding."""
import numpy as np
import pytest

import mha_cy
from mha_cy import _attention_kernel, reference

from conftest import (DTYPES, assert_close, check_modules, make_pair, random_padding,
                      random_weights)


def numpy_mha(weights, x, head_mask=None, kv_index=None, is_causal=False):
    """softmax(Q K^T / sqrt(D)) V per head, each head's context times head_mask, then W_O.
    weights: the from_weights keyword arguments (with biases)."""
    h = weights["num_heads"]
    q = x @ weights["q_weight"].T + weights["q_bias"]
    k = x @ weights["k_weight"].T + weights["k_bias"]
    v = x @ weights["v_weight"].T + weights["v_bias"]
    d = q.shape[-1] // h
    if kv_index is None:
        kv_index = np.arange(h) // (h // weights["num_kv_heads"])
    batch, length, _ = x.shape
    out = np.zeros((batch, length, weights["out_weight"].shape[0])) + weights["out_bias"]
    for b in range(batch):
        for head in range(h):
            g = kv_index[head]
            qh, kh, vh = q[b, :, head * d:(head + 1) * d], k[b, :, g * d:(g + 1) * d], \
                v[b, :, g * d:(g + 1) * d]
            s = qh @ kh.T / np.sqrt(d)
            if is_causal:
                s = np.where(np.tri(length, dtype=bool), s, -np.inf)
            p = np.exp(s - s.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            m = 1.0 if head_mask is None else (head_mask[head] if head_mask.ndim == 1
                                               else head_mask[b, head])
            out[b] += m * (p @ vh) @ weights["out_weight"][:, head * d:(head + 1) * d].T
    return out


def weights_of(rng, embed_dim, num_heads, num_kv_heads=None):
    return random_weights(rng, embed_dim, num_heads, num_kv_heads=num_kv_heads)


# ---------------------------------------------------------------------------- head_mask

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_heads", [None, 2, 1])
@pytest.mark.parametrize("per_sequence", [False, True])
def test_head_mask_matches_the_numpy_formula(rng, dtype, num_kv_heads, per_sequence):
    w = weights_of(rng, 32, 4, num_kv_heads)
    x = rng.standard_normal((3, 7, 32))
    mask = rng.uniform(-1, 2, size=(3, 4) if per_sequence else (4,))
    mask[..., 1] = 0.0
    expected = numpy_mha(w, x, mask)
    for cls in (mha_cy.MultiHeadAttention, reference.MultiHeadAttention):
        mha = cls.from_weights(**w, dtype=dtype)
        assert_close(mha(x, head_mask=mask), expected.astype(dtype), dtype, factor=4,
                     err_msg=cls.__module__)


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_mask_fast_equals_reference_with_masks_and_weights(rng, dtype):
    fast, ref = make_pair(rng, 48, 6, dtype, num_kv_heads=3)
    x = rng.standard_normal((2, 9, 48))
    pad = random_padding(rng, 2, 9)
    mask = rng.random((2, 6))
    out_r, w_r = check_modules(fast, ref, x, key_padding_mask=pad, is_causal=True,
                               head_mask=mask)
    # the weights are the softmax probabilities, not multiplied by head_mask
    _, w_plain = ref(x, key_padding_mask=pad, is_causal=True, need_weights=True)
    np.testing.assert_array_equal(w_r, w_plain)
    _, w_fast_plain = fast(x, key_padding_mask=pad, is_causal=True, need_weights=True)
    _, w_fast = fast(x, key_padding_mask=pad, is_causal=True, need_weights=True, head_mask=mask)
    np.testing.assert_array_equal(w_fast, w_fast_plain)


def test_head_mask_of_ones_changes_nothing(rng):
    fast, _ = make_pair(rng, 32, 4)
    x = rng.standard_normal((2, 5, 32)).astype(np.float32)
    np.testing.assert_array_equal(fast(x, head_mask=np.ones(4)), fast(x))


def test_head_mask_unbatched_and_cross_attention(rng):
    fast, ref = make_pair(rng, 32, 4, np.float64, kdim=12, vdim=20)
    x, k, v = (rng.standard_normal((5, n)) for n in (32, 12, 20))
    mask = np.array([1.0, 0.0, 0.5, 1.0])
    out = fast(x, k, v, head_mask=mask)
    assert out.shape == (5, 32)
    assert_close(out, ref(x, k, v, head_mask=mask[None]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_mask_with_a_cache(rng, dtype):
    fast, ref = make_pair(rng, 32, 4, dtype, num_kv_heads=2)
    x = rng.standard_normal((2, 6, 32))
    mask = np.array([[0.0, 1.0, 1.0, 0.3], [1.0, 0.0, 2.0, 1.0]])
    caches = fast.new_cache(2, 6), ref.new_cache(2, 6)
    outs = [[], []]
    for start, stop in ((0, 3), (3, 4), (4, 5), (5, 6)):
        for i, mha in enumerate((fast, ref)):
            outs[i].append(mha(x[:, start:stop], cache=caches[i], head_mask=mask))
    assert_close(np.concatenate(outs[0], axis=1), np.concatenate(outs[1], axis=1), dtype)
    assert_close(np.concatenate(outs[1], axis=1),
                 numpy_mha(weights_from(ref), x, mask, is_causal=True).astype(dtype), dtype,
                 factor=4)


def weights_from(mha):
    """The from_weights keyword arguments of a module (biases included)."""
    return dict(q_weight=mha.q_weight, k_weight=mha.k_weight, v_weight=mha.v_weight,
                out_weight=mha.out_weight, q_bias=mha.q_bias, k_bias=mha.k_bias,
                v_bias=mha.v_bias, out_bias=mha.out_bias, num_heads=mha.num_heads,
                num_kv_heads=mha.num_kv_heads)


@pytest.mark.parametrize("cls", [mha_cy.MultiHeadAttention, reference.MultiHeadAttention])
def test_head_mask_errors(rng, cls):
    mha = cls(16, 4, seed=0)
    x = np.zeros((2, 3, 16), np.float32)
    with pytest.raises(ValueError, match=r"head_mask must have shape \(num_heads,\) = \(4,\) "
                                         r"or \(batch, num_heads\) = \(2, 4\); got \(3,\)"):
        mha(x, head_mask=np.ones(3))
    with pytest.raises(ValueError, match=r"got \(3, 4\)"):
        mha(x, head_mask=np.ones((3, 4)))
    with pytest.raises(ValueError, match=r"got \(1, 2, 4\)"):
        mha(x, head_mask=np.ones((1, 2, 4)))
    with pytest.raises(TypeError, match="head_mask"):
        mha(x, head_mask=np.array(["a"] * 4))
    cache = mha.new_cache(2, 4)
    with pytest.raises(ValueError, match="head_mask"):
        mha(x, cache=cache, head_mask=np.ones(5))
    assert cache.length == 0                     # a failed call leaves the cache as it was


# ---------------------------------------------------------------------------- prune_heads

PRUNE_CASES = [            # (num_heads, num_kv_heads, heads to prune, kv_head_index after)
    (4, None, [1, 3], None),
    (4, None, [0], None),
    (8, 2, [1, 5, 6], [0, 0, 0, 1, 1]),          # the uneven groups of DESIGN: 3 and 2
    (8, 2, [4, 5, 6, 7], None),                  # a whole group: one K/V head left, even
    (8, 2, [0, 1, 4, 5], None),                  # two from each group: even again
    (6, 3, [0, 1, 5], [0, 0, 1]),                # K/V head 0 goes; groups of 2 and 1
    (6, 1, [2, 3], None),                        # MQA stays MQA
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, pruned, kv_index", PRUNE_CASES)
def test_pruning_equals_masking(rng, dtype, heads, kv_heads, pruned, kv_index):
    d = 8
    fast, ref = make_pair(rng, heads * d, heads, dtype, num_kv_heads=kv_heads)
    x = rng.standard_normal((2, 11, heads * d))
    pad = random_padding(rng, 2, 11)
    keep = [h for h in range(heads) if h not in pruned]
    mask = np.ones(heads)
    mask[pruned] = 0
    for mha in (fast, ref):
        small = mha.prune_heads(pruned)
        assert type(small) is type(mha)
        assert small.num_heads == len(keep)
        assert small.q_weight.shape == (len(keep) * d, heads * d)
        assert small.out_weight.shape == (heads * d, len(keep) * d)
        if kv_index is None:
            assert small._kv_index is None
        else:
            np.testing.assert_array_equal(small.kv_head_index, kv_index)
            assert f"kv_head_index={kv_index}" in repr(small)
        assert small.num_kv_heads == len(set(small.kv_head_index))
        for kwargs in ({}, {"is_causal": True}, {"key_padding_mask": pad}):
            out, w = small(x, need_weights=True, **kwargs)
            out_masked, w_full = mha(x, need_weights=True, head_mask=mask, **kwargs)
            assert_close(out, out_masked, dtype, factor=2)
            assert_close(small(x, **kwargs), out_masked, dtype, factor=2)
            assert_close(w, w_full[:, keep], dtype)
    # the fast pruned module agrees with the reference pruned module (weights and outputs)
    check_modules(fast.prune_heads(pruned), ref.prune_heads(pruned), x, is_causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pruned_uneven_groups_match_the_numpy_formula(rng, dtype):
    w = weights_of(rng, 64, 8, 2)
    x = rng.standard_normal((2, 5, 64))
    mask = np.ones(8)
    mask[[1, 5, 6]] = 0
    small = mha_cy.MultiHeadAttention.from_weights(**w, dtype=dtype).prune_heads([6, 1, 5])
    assert_close(small(x), numpy_mha(w, x, mask).astype(dtype), dtype, factor=4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, pruned, kv_index", PRUNE_CASES)
def test_pruned_module_decodes_with_a_cache(rng, dtype, heads, kv_heads, pruned, kv_index):
    d = 8
    fast, ref = make_pair(rng, heads * d, heads, dtype, num_kv_heads=kv_heads)
    x = rng.standard_normal((3, 7, heads * d))
    mask = np.ones(heads)
    mask[pruned] = 0
    for mha in (fast, ref):
        small = mha.prune_heads(pruned)
        c_small, c_full = small.new_cache(3, 7), mha.new_cache(3, 7)
        assert c_small.num_kv_heads == small.num_kv_heads
        for start, stop in ((0, 4), (4, 5), (5, 6), (6, 7)):     # prefill, then decode steps
            out = small(x[:, start:stop], cache=c_small)
            expected = mha(x[:, start:stop], cache=c_full, head_mask=mask)
            assert_close(out, expected, dtype, factor=2)


def test_pruned_decode_with_split_keys(rng):
    """One sequence, few K/V heads, long cache: the decode step splits the keys (split-K);
    the uneven groups must merge right too."""
    fast, ref = make_pair(rng, 64, 8, np.float64, num_kv_heads=2)
    small_f, small_r = fast.prune_heads([1, 5, 6]), ref.prune_heads([1, 5, 6])
    x = rng.standard_normal((1, 300, 64))
    previous = _attention_kernel._set_tile_sizes(16, 16)
    try:
        caches = small_f.new_cache(1, 301), small_r.new_cache(1, 301)
        small_f(x, cache=caches[0])
        small_r(x, cache=caches[1])
        step = rng.standard_normal((1, 1, 64))
        assert_close(small_f(step, cache=caches[0]), small_r(step, cache=caches[1]))
    finally:
        _attention_kernel._set_tile_sizes(*previous)


def test_pruning_twice_and_the_original_unchanged(rng):
    fast, _ = make_pair(rng, 64, 8, np.float64, num_kv_heads=2)
    before = [a.copy() for a in (fast.q_weight, fast.k_weight, fast.out_weight)]
    x = rng.standard_normal((2, 4, 64))
    twice = fast.prune_heads([1, 6]).prune_heads([3])          # heads 1, 6, then old head 4
    np.testing.assert_array_equal(twice.kv_head_index, [0, 0, 0, 1, 1])
    mask = np.ones(8)
    mask[[1, 4, 6]] = 0
    assert_close(twice(x), fast(x, head_mask=mask))
    for a, b in zip(before, (fast.q_weight, fast.k_weight, fast.out_weight)):
        np.testing.assert_array_equal(a, b)
    assert fast.num_heads == 8 and fast._kv_index is None


def test_pruned_results_do_not_depend_on_the_thread_count(rng):
    fast, _ = make_pair(rng, 64, 8, np.float32, num_kv_heads=2)
    small = fast.prune_heads([1, 5, 6])
    x = rng.standard_normal((2, 33, 64)).astype(np.float32)
    step = x[:, :1]
    results = []
    for n in (1, 2, 3):
        with mha_cy.threads(n):
            cache = small.new_cache(2, 34)
            small(x, cache=cache)
            results.append((small(x), small(step, cache=cache)))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("cls", [mha_cy.MultiHeadAttention, reference.MultiHeadAttention])
def test_prune_heads_errors(cls):
    mha = cls(32, 4, seed=0)
    with pytest.raises(ValueError, match="heads is empty"):
        mha.prune_heads([])
    with pytest.raises(ValueError, match=r"duplicates: \[2\]"):
        mha.prune_heads([2, 0, 2])
    with pytest.raises(ValueError, match=r"in \[0, 4\) \(num_heads = 4\); got \[4, -1\]"):
        mha.prune_heads([4, 1, -1])
    with pytest.raises(ValueError, match="all 4 query heads"):
        mha.prune_heads([0, 1, 2, 3])
    with pytest.raises(TypeError, match="sequence of head indices"):
        mha.prune_heads(1)
    with pytest.raises(TypeError, match="1-D sequence of ints"):
        mha.prune_heads([True, False])
    with pytest.raises(TypeError, match="1-D sequence of ints"):
        mha.prune_heads([0.5])
    assert mha.prune_heads(np.array([3, 0])).num_heads == 2


# ---------------------------------------------------------------------------- the kernel

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_index", [[1, 0, 1, 0, 0], [0, 0, 1, 1, 1], [2, 2, 0, 1, 2]])
@pytest.mark.parametrize("q_len", [1, 6])
def test_kernel_kv_index_matches_the_reference(rng, dtype, kv_index, q_len):
    """Any mapping: ordered ones (decode groups) and unordered ones (one task per head)."""
    kv = np.array(kv_index, dtype=np.intp)
    q = rng.standard_normal((2, 5, q_len, 8)).astype(dtype)
    k = rng.standard_normal((2, 3, 9, 8)).astype(dtype)
    v = rng.standard_normal((2, 3, 9, 8)).astype(dtype)
    out = np.empty((2, 5, q_len, 8), dtype)
    weights = np.empty((2, 5, q_len, 9), dtype)
    scale = dtype(0.3)
    for w in (None, weights):
        _attention_kernel.attention(q, k, v, out, None, None, True, scale, w, 2, kv_index=kv)
        expected, expected_w = reference._attention(q, k, v, None, None, True, 0.3, kv_index=kv)
        assert_close(out, expected, dtype)
    assert_close(weights, expected_w, dtype)


def test_kernel_kv_index_errors():
    q = np.zeros((1, 3, 2, 4))
    k = v = np.zeros((1, 2, 2, 4))
    out = np.empty_like(q)
    with pytest.raises(ValueError, match="kv_index has 2 entries; expected one per query head"):
        _attention_kernel.attention(q, k, v, out, None, None, False, 1.0, None, 1,
                                    kv_index=np.zeros(2, np.intp))
    with pytest.raises(ValueError, match=r"kv_index\[1\] = 2 is not a K/V head in \[0, 2\)"):
        _attention_kernel.attention(q, k, v, out, None, None, False, 1.0, None, 1,
                                    kv_index=np.array([0, 2, 1], np.intp))


@pytest.mark.parametrize("cls", [mha_cy.MultiHeadAttention, reference.MultiHeadAttention])
@pytest.mark.parametrize("pruned", [[1, 5, 6], [1, 2], [0, 1, 4, 5]])
def test_pruned_modules_save_load_and_pickle(rng, tmp_path, cls, pruned):
    """Uneven groups survive save/load and pickle (8 query / 2 K/V heads without heads 1 and
    2 leaves 6 and 2: divisible, but groups of 2 and 4, not 3 and 3)."""
    import pickle
    full = cls.from_weights(**weights_of(rng, 64, 8, 2), dtype=np.float64)
    small = full.prune_heads(pruned)
    x = rng.standard_normal((2, 5, 64))
    path = tmp_path / "small.npz"
    small.save(path)
    for copy in (cls.load(path), pickle.loads(pickle.dumps(small))):
        np.testing.assert_array_equal(copy.kv_head_index, small.kv_head_index)
        assert copy.num_kv_heads == small.num_kv_heads
        np.testing.assert_array_equal(copy(x), small(x))


@pytest.mark.parametrize("cls", [mha_cy.MultiHeadAttention, reference.MultiHeadAttention])
def test_pruning_a_cross_attention_module_without_bias(rng, cls):
    mha = cls(32, 4, num_kv_heads=2, kdim=12, vdim=20, bias=False, seed=0, dtype=np.float64)
    small = mha.prune_heads([1])
    assert small.out_bias is None and (small.kdim, small.vdim) == (12, 20)
    x, k, v = (rng.standard_normal((2, n, e)) for n, e in ((5, 32), (6, 12), (6, 20)))
    assert_close(small(x, k, v), mha(x, k, v, head_mask=np.array([1.0, 0.0, 1.0, 1.0])))


def test_prune_heads_takes_a_set(rng):
    """A set was refused as 'not a 1-D sequence of ints'; it names heads naturally."""
    mha = mha_cy.MultiHeadAttention(16, 4, num_kv_heads=2, seed=0)
    x = rng.standard_normal((2, 5, 16)).astype(np.float32)
    by_set, by_list = mha.prune_heads({3, 0}), mha.prune_heads([0, 3])
    assert by_set.num_heads == 2
    assert np.array_equal(by_set(x), by_list(x))
    with pytest.raises(ValueError):
        mha.prune_heads({0, 1, 2, 3})           # all of them
