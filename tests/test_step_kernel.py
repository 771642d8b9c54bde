"""The compiled decode step (mha_cy/_step_kernel.pyx) is a pure speed-up: for every step it
takes, output and cache equal the general path's bit for bit, and it steps aside (returning
None) for the shapes it does not reproduce.

The general path is reached through the public API with lengths= (every sequence appending
all of its tokens: the same uniform plan, by CachePlan and _forward).
"""
import numpy as np
import pytest

import mha_cy
from mha_cy import _attention_kernel, _linear_kernel, _step_kernel, reference
from mha_cy._pruning import regroup
from conftest import DTYPES, assert_close

# (embed_dim, num_heads, num_kv_heads, head_dim): MHA, GQA, MQA; head dims below and above
# the direct kernel's minimum (32), where a GQA group's rows take the packed or direct kernel
GEOMETRIES = [(64, 4, 4, 16), (64, 4, 2, 16), (64, 4, 1, 16), (128, 4, 2, 32),
              (96, 3, 3, 32), (64, 2, 1, 64)]
ROPES = {"none": None, "half_split": mha_cy.RoPE(), "gptj_partial": mha_cy.RoPE(dim=8, interleaved=True)}


def _module(rng, geometry, dtype, rope, window, bias=True):
    embed, heads, kv_heads, d = geometry
    return mha_cy.MultiHeadAttention(embed, heads, num_kv_heads=kv_heads, head_dim=d,
                                     bias=bias, dtype=dtype, seed=int(rng.integers(1 << 30)),
                                     rope=rope, window=window)


def _run_both(mha, batch, prompt, steps, step_len, rng, dtype, ragged=False):
    """Prefill `prompt` tokens (ragged: right-padded prompts of different lengths), then
    `steps` calls of step_len tokens, once by the fast path (mha(x, cache=...)) and once by
    the general path (lengths=); return both runs' outputs and caches."""
    fast = mha.new_cache(batch, prompt + steps * step_len)
    general = mha.new_cache(batch, prompt + steps * step_len)
    full = lambda n: np.full(batch, n)
    prompt_lengths = (np.arange(batch) * 3 + prompt) % (prompt + 1) if ragged else full(prompt)
    x = rng.standard_normal((batch, prompt, mha.embed_dim)).astype(dtype)
    outs_fast = [mha(x, cache=fast, lengths=prompt_lengths)]
    outs_general = [mha(x, cache=general, lengths=prompt_lengths)]
    for _ in range(steps):
        x = rng.standard_normal((batch, step_len, mha.embed_dim)).astype(dtype)
        outs_fast.append(mha(x, cache=fast))
        outs_general.append(mha(x, cache=general, lengths=full(step_len)))
    return outs_fast, outs_general, fast, general


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[str(g) for g in GEOMETRIES])
@pytest.mark.parametrize("rope", list(ROPES), ids=list(ROPES))
@pytest.mark.parametrize("window", [None, 5])
def test_steps_equal_the_general_path_bitwise(rng, dtype, geometry, rope, window):
    mha = _module(rng, geometry, dtype, ROPES[rope], window)
    for batch, step_len, ragged in ((1, 1, False), (3, 1, False), (2, 3, False),
                                    (3, 1, True), (2, 3, True)):
        outs_fast, outs_general, fast, general = _run_both(mha, batch, 7, 12, step_len, rng,
                                                           dtype, ragged)
        for a, b in zip(outs_fast, outs_general):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(fast.lengths, general.lengths)
        stop = fast.length
        np.testing.assert_array_equal(fast.key[:, :, :stop], general.key[:, :, :stop])
        np.testing.assert_array_equal(fast.value[:, :, :stop], general.value[:, :, :stop])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_threads", [1, 2, 4])
@pytest.mark.parametrize("cached", [0, 255, 256, 600, 1100])
def test_long_caches_and_threads_bitwise(rng, dtype, n_threads, cached):
    """Across the key-tile size (256) and where the general kernel splits the keys (split-K:
    the step kernel declines there), for any thread count."""
    mha = _module(rng, (64, 4, 2, 16), dtype, mha_cy.RoPE(), None, bias=False)
    x_prompt = rng.standard_normal((1, cached + 1, 64)).astype(dtype)
    x_step = rng.standard_normal((1, 1, 64)).astype(dtype)
    results = []
    for general in (False, True):
        cache = mha.new_cache(1, cached + 2)
        mha(x_prompt, cache=cache)
        with mha_cy.threads(n_threads):
            kw = {"lengths": np.ones(1, int)} if general else {}
            results.append((mha(x_step, cache=cache, **kw), cache.key.copy()))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_steps_match_the_reference(rng, dtype):
    """A prefill and steps through the compiled step equal one causal pass of the reference."""
    mha = _module(rng, (64, 4, 2, 16), dtype, None, None)
    ref = reference.MultiHeadAttention.from_weights(
        mha.q_weight, mha.k_weight, mha.v_weight, mha.out_weight, num_heads=4,
        num_kv_heads=2, q_bias=mha.q_bias, k_bias=mha.k_bias, v_bias=mha.v_bias,
        out_bias=mha.out_bias, dtype=dtype)
    x = rng.standard_normal((2, 20, 64)).astype(dtype)
    cache = mha.new_cache(2, 20)
    outs = [mha(x[:, :4], cache=cache)] + [mha(x[:, i:i + 1], cache=cache) for i in range(4, 20)]
    assert_close(np.concatenate(outs, axis=1), ref(x, is_causal=True), dtype)


def test_the_compiled_step_runs_for_small_steps_and_declines_otherwise(rng):
    """It must actually be taken for a small model's step (else the tests above compare the
    general path with itself), and decline a long cache (split-K) and too many rows."""
    mha = _module(rng, (64, 4, 2, 16), np.float32, None, None)
    cache = mha.new_cache(2, 2048)
    mha(rng.standard_normal((2, 16, 64)).astype(np.float32), cache=cache)

    def step(x, start):
        return _step_kernel.decode_step(x, start, cache.key, cache.value, None, None,
                                        mha.in_proj_weight, mha.in_proj_bias, mha.out_weight,
                                        mha.out_bias, 4, 2, None, 0, None, False, 1)
    assert step(np.zeros((2, 1, 64), np.float32), 16) is not None
    assert step(np.zeros((2, 5, 64), np.float32), 16) is not None     # 10 rows: the panels
    one = mha_cy.MultiHeadAttention(64, 4, num_kv_heads=1, head_dim=16, seed=0)
    long_cache = one.new_cache(1, 4096)
    # 1 task over 2001 keys: split-K
    assert _step_kernel.decode_step(np.zeros((1, 1, 64), np.float32), 2000, long_cache.key,
                                    long_cache.value, None, None, one.in_proj_weight,
                                    one.in_proj_bias, one.out_weight, one.out_bias, 4, 1, None,
                                    0, None, False, 1) is None


def test_the_compiled_step_declines_every_shape_it_does_not_fit(rng):
    """decode_step checks the shapes its raw-pointer loops rely on (the module's fast path
    leaves them to it): each mismatch returns None (the general path then names it), never
    reads or writes out of bounds."""
    mha = _module(rng, (64, 4, 2, 16), np.float32, None, None)
    cache = mha.new_cache(2, 8)
    x = np.zeros((2, 1, 64), np.float32)
    good = dict(x=x, start=4, k=cache.key, v=cache.value, w_in=mha.in_proj_weight,
                b_in=mha.in_proj_bias, w_out=mha.out_weight, b_out=mha.out_bias, kv_heads=2,
                inv_freq=None)

    def step(**changes):
        a = {**good, **changes}
        return _step_kernel.decode_step(a["x"], a["start"], a["k"], a["v"], None, None,
                                        a["w_in"], a["b_in"], a["w_out"], a["b_out"], 4,
                                        a["kv_heads"], None, 0, a["inv_freq"], False, 1)
    assert step() is not None
    before = cache.key.copy()
    for name, changes in {
            "2-D x": dict(x=np.zeros((2, 64), np.float32)),
            "batch": dict(x=np.zeros((3, 1, 64), np.float32)),
            "embed": dict(x=np.zeros((2, 1, 48), np.float32)),
            "no tokens": dict(x=np.zeros((2, 0, 64), np.float32)),
            "dtype": dict(x=x.astype(np.float64)),
            "no room": dict(start=8),
            "no room, ragged": dict(start=np.array([3, 8])),
            "kv heads": dict(kv_heads=1),
            "3-D cache": dict(k=cache.key[0], v=cache.value[0]),
            "value shape": dict(v=np.zeros((2, 2, 9, 16), np.float32)),
            "w_in": dict(w_in=np.zeros((96, 64), np.float32)),
            "b_in": dict(b_in=np.zeros(95, np.float32)),
            "w_out": dict(w_out=np.zeros((64, 32), np.float32)),
            "b_out": dict(b_out=np.zeros((1, 64), np.float32)),
            "inv_freq": dict(inv_freq=np.ones(9)),
    }.items():
        assert step(**changes) is None, name
    np.testing.assert_array_equal(cache.key, before)


def test_tuning_knobs_send_steps_to_the_general_path():
    previous = _attention_kernel._set_tile_kernel("blas")
    try:
        assert not _attention_kernel.default_rules
    finally:
        _attention_kernel._set_tile_kernel(previous)
    assert _attention_kernel.default_rules
    previous = _linear_kernel._set_small_gemm_rule(0, 0)
    try:
        assert not _linear_kernel.default_rules
    finally:
        _linear_kernel._set_small_gemm_rule(*previous)
    assert _linear_kernel.default_rules


def test_a_failed_step_changes_nothing(rng):
    mha = _module(rng, (64, 4, 2, 16), np.float32, None, None)
    cache = mha.new_cache(1, 4)
    mha(rng.standard_normal((1, 4, 64)).astype(np.float32), cache=cache)
    before = cache.copy()
    with pytest.raises(ValueError, match="cache overflow"):
        mha(rng.standard_normal((1, 1, 64)).astype(np.float32), cache=cache)
    np.testing.assert_array_equal(cache.key, before.key)
    np.testing.assert_array_equal(cache.lengths, before.lengths)


def test_the_module_takes_the_compiled_step(rng, taken):
    """mha(x, cache=...) reaches the compiled step for decode steps of every geometry above
    (so that the bitwise comparisons compare two different paths)."""
    for geometry in GEOMETRIES:
        for rope in ROPES.values():
            mha = _module(rng, geometry, np.float32, rope, 5)
            cache = mha.new_cache(2, 10)
            mha(rng.standard_normal((2, 6, geometry[0])).astype(np.float32), cache=cache,
                lengths=[6, 4])
            for even in (False, True):          # a ragged cache, then an even one
                if even:
                    cache.truncate(4)
                taken.clear()
                mha(rng.standard_normal((2, 1, geometry[0])).astype(np.float32), cache=cache)
                assert taken == [True], (geometry, rope, even)


@pytest.mark.parametrize("case", ["split_k", "unaligned", "knob_moved"])
def test_a_declined_step_equals_the_general_path_bitwise(rng, taken, case):
    """Where the compiled step declines on an equal-length cache, mha(x, cache=...) takes the
    general path: the same output and cache (keys, values, lengths) as a call with lengths=."""
    mha = _module(rng, (64, 4, 2, 16), np.float32, mha_cy.RoPE(), None)
    prompt = 1100 if case == "split_k" else 6
    x_prompt = rng.standard_normal((1, prompt, 64)).astype(np.float32)
    x_step = rng.standard_normal((1, 2, 64)).astype(np.float32)
    caches, outs = [], []
    previous = _attention_kernel._set_tile_kernel("fused") if case == "knob_moved" else None
    try:
        for general in (False, True):
            cache = mha.new_cache(1, prompt + 2)
            mha(x_prompt, cache=cache)
            taken.clear()
            if general:
                outs.append(mha(x_step, cache=cache, lengths=[2]))
            else:
                outs.append(mha(_unaligned(x_step) if case == "unaligned" else x_step,
                                cache=cache))
                assert taken == [False], case        # it declined
            caches.append(cache)
    finally:
        if previous is not None:
            _attention_kernel._set_tile_kernel(previous)
    np.testing.assert_array_equal(outs[0], outs[1])
    fast, general = caches
    assert fast.length == general.length == prompt + 2
    np.testing.assert_array_equal(fast.lengths, general.lengths)
    np.testing.assert_array_equal(fast.key, general.key)
    np.testing.assert_array_equal(fast.value, general.value)


# Modules with uneven groups (kv_index): pruned GQA modules whose decode tasks have different
# row counts (groups of 3 and 2 query heads; 1, 2, 2, 2 at head dim 32, the direct kernel; 9
# and 10, the packed one), and K/V heads shared out of order (a loaded kv_head_index: one task
# per query head)
UNEVEN = {
    "groups_3_2": lambda rng, dtype: _module(rng, (64, 8, 2, 8), dtype, mha_cy.RoPE(),
                                             None).prune_heads([1, 5, 6]),
    "groups_1_2_2_2": lambda rng, dtype: _module(rng, (128, 8, 4, 32), dtype, None,
                                                 4).prune_heads([0]),
    "groups_9_10": lambda rng, dtype: _module(rng, (64, 20, 2, 16), dtype, None,
                                              None).prune_heads([0]),
    "out_of_order": lambda rng, dtype: regroup(_module(rng, (64, 4, 4, 16), dtype,
                                                       mha_cy.RoPE(), None), [1, 0, 1, 0]),
}


@pytest.mark.parametrize("dtype,fmt", [(np.float64, None), (np.float32, None),
                                       (np.float32, np.float16), (np.float32, "int8")],
                         ids=["float64", "float32", "float16_cache", "int8_cache"])
@pytest.mark.parametrize("case", list(UNEVEN))
def test_uneven_groups_take_the_compiled_calls_bitwise(rng, taken, dtype, fmt, case):
    """Decode steps (1 and 3 tokens) and small self-attention calls of such modules run
    compiled and equal the general path bit for bit: outputs and caches."""
    mha = UNEVEN[case](rng, dtype)
    assert mha._kv_index is not None
    for batch, step_len in ((1, 1), (3, 1), (2, 3)):
        caches = [mha.new_cache(batch, 7 + 4 * step_len, dtype=fmt or dtype) for _ in range(2)]
        x = rng.standard_normal((batch, 7, mha.embed_dim)).astype(dtype)
        for cache in caches:
            mha(x, cache=cache)
        for _ in range(4):
            x = rng.standard_normal((batch, step_len, mha.embed_dim)).astype(dtype)
            taken.clear()
            fast = mha(x, cache=caches[0])
            assert taken == [True], (batch, step_len)
            np.testing.assert_array_equal(fast, mha(x, cache=caches[1],
                                                    lengths=np.full(batch, step_len)))
        for name in ("key", "value", "key_scale", "value_scale"):
            a, b = getattr(caches[0], name), getattr(caches[1], name)
            assert (a is None) == (b is None)
            if a is not None:
                np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), name)
    ones = np.ones(mha.num_heads, dtype)
    for causal in (False, True) if mha.window is None else (True,):   # (a window: causal)
        x = rng.standard_normal((2, 5, mha.embed_dim)).astype(dtype)
        taken.clear()
        fast = mha(x, is_causal=causal)
        assert taken == [True]
        np.testing.assert_array_equal(fast, mha(x, is_causal=causal, head_mask=ones))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[str(g) for g in GEOMETRIES])
@pytest.mark.parametrize("rope", list(ROPES), ids=list(ROPES))
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 6)],
                         ids=["encoder", "causal", "window"])
def test_small_self_attention_equals_the_general_path_bitwise(rng, dtype, geometry, rope,
                                                              causal, window):
    """mha(x) of a small call (compiled) against the general path (reached with a head_mask
    of ones, an exact no-op), for 1 to 40 tokens (the projections' small_gemm and panels)."""
    mha = _module(rng, geometry, dtype, ROPES[rope], window)
    ones = np.ones(geometry[1], dtype)
    for batch, length in ((1, 1), (2, 5), (1, 16), (3, 40)):
        x = rng.standard_normal((batch, length, geometry[0])).astype(dtype)
        np.testing.assert_array_equal(mha(x, is_causal=causal),
                                      mha(x, is_causal=causal, head_mask=ones))


def _padding_patterns(batch, length):
    """Key padding masks (batch, length): none padded, right- and left-padded rows, a hole in
    the middle, and (batch > 1) a row of padding only."""
    right = np.arange(length)[None] >= length - (np.arange(batch)[:, None] % length)
    middle = np.zeros((batch, length), bool)
    middle[:, length // 2] = True
    yield np.zeros((batch, length), bool)
    yield right
    yield right[:, ::-1].copy()
    yield middle
    if batch > 1:
        everything = right.copy()
        everything[-1] = True
        yield everything


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[str(g) for g in GEOMETRIES])
@pytest.mark.parametrize("rope", list(ROPES), ids=list(ROPES))
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 6)],
                         ids=["encoder", "causal", "window"])
def test_small_self_attention_with_key_padding_equals_the_general_path_bitwise(
        rng, taken, dtype, geometry, rope, causal, window):
    """mha(x, key_padding_mask=...) of a small call runs compiled and equals the general path
    (head_mask of ones) bit for bit, padded keys skipped at either end as the general kernel
    skips them; a row whose keys are all padding gives zeros there too."""
    mha = _module(rng, geometry, dtype, ROPES[rope], window)
    ones = np.ones(geometry[1], dtype)
    for batch, length in ((1, 1), (2, 5), (3, 16), (2, 40)):
        x = rng.standard_normal((batch, length, geometry[0])).astype(dtype)
        for pad in _padding_patterns(batch, length):
            taken.clear()
            with mha_cy.threads(1):     # (with more, the larger calls are the general path's)
                fast = mha(x, is_causal=causal, key_padding_mask=pad)
            assert taken == [True], (batch, length)
            np.testing.assert_array_equal(
                fast, mha(x, is_causal=causal, key_padding_mask=pad, head_mask=ones))


def _attn_masks(rng, batch, heads, length, dtype):
    """attn_masks as check_attn_mask takes them: additive and bool, 2-, 3- and 4-D, broadcast
    axes (a stride-0 view too), a strided view, rows hidden entirely."""
    L = length
    yield rng.standard_normal((L, L)).astype(dtype)
    yield np.broadcast_to(np.tril(np.ones((L, L), bool)), (batch, 1, L, L))
    hidden = rng.standard_normal((batch, heads, L, L)).astype(dtype)
    hidden[:, :, 0] = -np.inf                   # query 0 sees nothing: a zero context
    yield hidden
    yield rng.random((batch, L, L)) < 0.7
    yield rng.standard_normal((1, heads, 1, L)).astype(dtype)
    # every other head sees nothing (with one key, only hiding tells the heads' masks apart)
    yield np.broadcast_to((np.arange(heads) % 2 == 0)[None, :, None, None], (1, heads, L, L))
    yield rng.standard_normal((L, 2 * L)).astype(dtype)[:, ::2]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[str(g) for g in GEOMETRIES])
@pytest.mark.parametrize("rope", list(ROPES), ids=list(ROPES))
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 6)],
                         ids=["encoder", "causal", "window"])
def test_small_self_attention_with_attn_mask_equals_the_general_path_bitwise(
        rng, taken, dtype, geometry, rope, causal, window):
    """mha(x, attn_mask=...) of a small call runs compiled and equals the general path (head_mask
    of ones) bit for bit: every mask shape, bool or additive, alone and with key padding; one
    query token of a GQA module (its heads as the rows of one task) included."""
    mha = _module(rng, geometry, dtype, ROPES[rope], window)
    heads = geometry[1]
    ones = np.ones(heads, dtype)
    for batch, length in ((1, 1), (2, 5), (3, 16)):
        x = rng.standard_normal((batch, length, geometry[0])).astype(dtype)
        pad = np.zeros((batch, length), bool)
        pad[0, -1] = length > 1
        for mask in _attn_masks(rng, batch, heads, length, dtype):
            for kpm in (None, pad):
                taken.clear()
                with mha_cy.threads(1):
                    fast = mha(x, is_causal=causal, attn_mask=mask, key_padding_mask=kpm)
                assert taken == [True], (batch, length, mask.shape)
                np.testing.assert_array_equal(
                    fast, mha(x, is_causal=causal, attn_mask=mask, key_padding_mask=kpm,
                              head_mask=ones), err_msg=str((batch, length, mask.shape)))


def test_attn_mask_the_compiled_call_does_not_take_goes_the_general_way(rng, taken):
    """Masks of another float dtype or a misfit shape: the compiled call declines; the general
    path converts the first and names what is wrong with the second."""
    mha = _module(rng, (64, 4, 2, 16), np.float32, None, None)
    x = rng.standard_normal((2, 6, 64)).astype(np.float32)
    mask = rng.standard_normal((6, 6))
    expected = mha(x, attn_mask=mask.astype(np.float32))
    taken.clear()
    np.testing.assert_array_equal(mha(x, attn_mask=mask), expected)     # float64: converted
    assert taken == [False]
    for bad in (np.zeros((6, 5), np.float32), np.zeros((3, 6, 6), np.float32),
                np.zeros((2, 3, 6, 6), np.float32), np.zeros(6, np.float32)):
        with pytest.raises(ValueError, match="attn_mask"):
            mha(x, attn_mask=bad)
    with pytest.raises(TypeError, match="attn_mask must be bool"):
        mha(x, attn_mask=np.zeros((6, 6), np.int32))


def test_key_padding_the_compiled_call_does_not_take_goes_the_general_way(rng, taken):
    """Masks that are not C-contiguous bool (batch, length) arrays: the compiled call
    declines, the general path converts them (or names what is wrong)."""
    mha = _module(rng, (64, 4, 2, 16), np.float32, None, None)
    x = rng.standard_normal((2, 6, 64)).astype(np.float32)
    pad = np.zeros((2, 6), bool)
    pad[:, 4:] = True
    expected = mha(x, key_padding_mask=pad)
    for other in (pad.astype(np.uint8) != 0, np.asfortranarray(pad), pad.tolist()):
        np.testing.assert_array_equal(mha(x, key_padding_mask=other), expected)
    wide = np.zeros((2, 12), bool)
    wide[:, 8:] = True                                    # every other column: pad
    taken.clear()
    np.testing.assert_array_equal(mha(x, key_padding_mask=wide[:, ::2]), expected)
    assert taken == [False]                               # a strided view: declined
    with pytest.raises(TypeError, match="key_padding_mask must be a bool"):
        mha(x, key_padding_mask=pad.astype(np.int64))
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):
        mha(x, key_padding_mask=pad[:, :5])


def test_mha_takes_the_compiled_call_for_a_tiny_layer(rng, taken):
    mha = mha_cy.MultiHeadAttention(64, 4, seed=0)
    x = rng.standard_normal((1, 16, 64)).astype(np.float32)
    with mha_cy.threads(2):
        mha(x)
        mha(x, is_causal=True)
        assert taken == [True, True]
        mha(rng.standard_normal((8, 512, 64)).astype(np.float32))   # too much work for 1 thread
        assert taken == [True, True, False]


def _unaligned(a):
    """A C-contiguous copy of a at an address that is not a multiple of its itemsize."""
    raw = np.zeros(a.nbytes + 1, np.uint8)
    out = np.frombuffer(raw.data, dtype=a.dtype, count=a.size, offset=1).reshape(a.shape)
    out[...] = a
    assert out.flags.c_contiguous and not out.flags.aligned
    return out


def test_unaligned_inputs_take_the_general_path(rng, taken):
    mha = _module(rng, (64, 4, 2, 16), np.float32, None, None)
    x = rng.standard_normal((1, 5, 64)).astype(np.float32)
    out = mha(_unaligned(x))
    assert taken == [False]
    np.testing.assert_array_equal(out, mha(x))
    q = rng.standard_normal((1, 4, 3, 16)).astype(np.float32)
    np.testing.assert_array_equal(
        mha_cy.scaled_dot_product_attention(_unaligned(q), q, q),
        mha_cy.scaled_dot_product_attention(q, q, q))


@pytest.mark.parametrize("dtype,fmt", [(np.float64, None), (np.float32, None),
                                       (np.float32, np.float16), (np.float32, "int8")],
                         ids=["f64", "f32", "f16", "i8"])
def test_big_endian_steps_take_the_general_path(rng, taken, dtype, fmt):
    """A '>f4' / '>f8' query has the type number of float32 / float64: the compiled step
    used to read its bytes as native ones (wrong output, garbage written to the cache)."""
    mha = _module(rng, (64, 4, 2, 16), dtype, mha_cy.RoPE(), None)
    fast, general = mha.new_cache(2, 8, dtype=fmt), mha.new_cache(2, 8, dtype=fmt)
    for n in (3, 1):
        x = rng.standard_normal((2, n, 64)).astype(dtype)
        taken.clear()
        out = mha(x.astype(x.dtype.newbyteorder(">")), cache=fast)
        assert taken == [False]                          # declined: the general path converts
        np.testing.assert_array_equal(out, mha(x, cache=general))
    np.testing.assert_array_equal(fast.key, general.key)
    np.testing.assert_array_equal(fast.value, general.value)


@pytest.mark.parametrize("fmt", [None, np.float16, "int8"], ids=["f32", "f16", "i8"])
def test_a_read_only_cache_is_not_written(rng, taken, fmt):
    """The compiled step stores through raw pointers: it used to write into a cache whose
    arrays were marked read-only (and to count the tokens), where the general path raises."""
    mha = _module(rng, (64, 4, 2, 16), np.float32, None, None)
    cache = mha.new_cache(2, 8, dtype=fmt)
    mha(rng.standard_normal((2, 3, 64)).astype(np.float32), cache=cache)
    arrays = [cache.key, cache.value] + ([] if fmt != "int8" else
                                         [cache.key_scale, cache.value_scale])
    for i in range(len(arrays)):                   # one read-only array is enough to refuse
        saved = [a.copy() for a in arrays]
        arrays[i].setflags(write=False)
        taken.clear()
        with pytest.raises(ValueError, match="read-only"):
            mha(rng.standard_normal((2, 1, 64)).astype(np.float32), cache=cache)
        assert taken == [False]
        assert cache.length == 3
        for a, b in zip(arrays, saved):       # the cached positions (the rest is scratch)
            np.testing.assert_array_equal(a[:, :, :3], b[:, :, :3])
        assert arrays[i].tobytes() == saved[i].tobytes()   # and nothing at all in that one
        arrays[i].setflags(write=True)
