"""The compiled small call on a team of threads (mha_cy/_step_kernel.pyx): above the serial
bound (MAX_SERIAL_FLOPS) and up to MAX_TEAM_FLOPS a call with more than one thread runs its
stages in one parallel region. It must give the general path's bits, and the same bits on any
thread count: the projections' column tiles and the attention tasks are fixed by the shape.

The general path is reached with _set_max_team_flops(0) (the call then declines), one thread
with mha_cy.threads(1) (the serial small call).
"""
import contextlib

import numpy as np
import pytest

import mha_cy
from mha_cy import _step_kernel
from conftest import DTYPES
from test_step_kernel import ROPES, _attn_masks, _module

# (embed_dim, num_heads, num_kv_heads, head_dim): GQA with rows for small_gemm (<= 8 tokens)
# and for the panels, MHA, MQA, and a head dim the direct kernel takes with one row only
GEOMETRIES = [(512, 8, 2, 64), (256, 8, 8, 32), (256, 8, 1, 32), (512, 8, 4, 16)]
SHAPES = [(1, 8), (2, 40), (3, 33)]    # (batch, tokens): small_gemm (8 rows), panels, a part panel


@contextlib.contextmanager
def _general_path():
    previous = _step_kernel._set_max_team_flops(0)
    try:
        yield
    finally:
        _step_kernel._set_max_team_flops(previous)


def _three_ways(taken, call, n_threads):
    """call() on the team (checked taken), on the general path and on one thread."""
    taken.clear()
    with mha_cy.threads(n_threads):
        team = call()
        assert taken == [True], "the team did not run"
        with _general_path():
            general = call()
    with mha_cy.threads(1):
        serial = call()
    assert taken[1:] == [False, True]
    return team, general, serial


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[str(g) for g in GEOMETRIES])
@pytest.mark.parametrize("rope", list(ROPES), ids=list(ROPES))
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 6)],
                         ids=["encoder", "causal", "window"])
@pytest.mark.parametrize("n_threads", [2, 3, 4])
def test_team_self_attention_equals_the_general_path_and_one_thread(
        rng, taken, dtype, geometry, rope, causal, window, n_threads):
    mha = _module(rng, geometry, dtype, ROPES[rope], window)
    for batch, length in SHAPES:
        x = rng.standard_normal((batch, length, geometry[0])).astype(dtype)
        team, general, serial = _three_ways(taken, lambda: mha(x, is_causal=causal), n_threads)
        np.testing.assert_array_equal(team, general, err_msg=str((batch, length)))
        np.testing.assert_array_equal(team, serial, err_msg=str((batch, length)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_team_calls_with_masks_equal_the_general_path(rng, taken, dtype, causal):
    """Key padding (padded ends are skipped) and every attn_mask shape, on 3 threads."""
    heads = 8
    mha = _module(rng, (256, heads, 2, 32), dtype, None, None)
    batch, length = 3, 24
    x = rng.standard_normal((batch, length, 256)).astype(dtype)
    pad = np.zeros((batch, length), bool)
    pad[0, -5:] = True
    pad[1, :3] = True
    for mask in [None, *_attn_masks(rng, batch, heads, length, dtype)]:
        for kpm in (None, pad):
            team, general, serial = _three_ways(
                taken, lambda: mha(x, is_causal=causal, attn_mask=mask, key_padding_mask=kpm),
                3)
            shape = None if mask is None else mask.shape
            np.testing.assert_array_equal(team, general, err_msg=str(shape))
            np.testing.assert_array_equal(team, serial, err_msg=str(shape))


@pytest.mark.parametrize("fmt", [np.float64, np.float32, np.float16, "int8"],
                         ids=["f64", "f32", "f16", "i8"])
@pytest.mark.parametrize("geometry", [(512, 8, 2, 64), (512, 8, 8, 64)],
                         ids=["gqa", "mha"])
@pytest.mark.parametrize("n_threads", [2, 4])
def test_team_decode_steps_equal_the_general_path_and_one_thread(rng, taken, fmt, geometry,
                                                                 n_threads):
    """A prefill and decode steps of 1 and 3 tokens through a cache in each format: the
    outputs and everything stored, on the team, on the general path and on one thread."""
    dtype = np.float64 if fmt is np.float64 else np.float32
    mha = _module(rng, geometry, dtype, mha_cy.RoPE(), None)
    batch = 2
    runs = {}
    for way in ("team", "general", "serial"):
        call_rng = np.random.default_rng(7)
        cache = mha.new_cache(batch, 40, dtype=None if fmt in (np.float64, np.float32) else fmt)
        outs = []
        for tokens in (30, 1, 3, 1):
            x = call_rng.standard_normal((batch, tokens, geometry[0])).astype(dtype)
            taken.clear()
            with mha_cy.threads(1 if way == "serial" else n_threads):
                if way == "general":
                    with _general_path():
                        outs.append(mha(x, cache=cache))
                else:
                    outs.append(mha(x, cache=cache))
            assert taken == [way != "general"], (way, tokens)
        runs[way] = (outs, cache)
    for way in ("general", "serial"):
        for a, b in zip(runs["team"][0], runs[way][0]):
            np.testing.assert_array_equal(a, b, err_msg=way)
        stored, other = runs["team"][1], runs[way][1]
        np.testing.assert_array_equal(stored.lengths, other.lengths)
        for name in ("key", "value", "key_scale", "value_scale"):
            mine, theirs = getattr(stored, name), getattr(other, name)
            if mine is not None:
                np.testing.assert_array_equal(mine, theirs, err_msg=f"{way} {name}")


def test_calls_above_the_team_bound_take_the_general_path(rng, taken):
    mha = _module(rng, (256, 8, 2, 32), np.float32, None, None)
    x = rng.standard_normal((2, 40, 256)).astype(np.float32)
    with mha_cy.threads(2):
        mha(x)
        previous = _step_kernel._set_max_team_flops(1e6)   # below this call's work
        try:
            mha(x)
        finally:
            _step_kernel._set_max_team_flops(previous)
    assert taken == [True, False]


@pytest.mark.parametrize("fmt", [None, "int8"], ids=["f32", "i8"])
def test_team_calls_of_uneven_groups_equal_the_general_path(rng, taken, fmt):
    """A pruned module's uneven GQA groups (K/V heads of 3 and 4 query heads): mha(x) and a
    cached prefill + step on 3 threads, against the general path and one thread."""
    mha = _module(rng, (512, 8, 2, 64), np.float32, None, None).prune_heads([0])
    assert mha.num_heads == 7 and mha._kv_index is not None
    x = rng.standard_normal((2, 40, 512)).astype(np.float32)
    team, general, serial = _three_ways(taken, lambda: mha(x, is_causal=True), 3)
    np.testing.assert_array_equal(team, general)
    np.testing.assert_array_equal(team, serial)
    runs = []
    for n_threads, team_flops in ((3, None), (3, 0), (1, None)):
        cache = mha.new_cache(2, 41, dtype=fmt)
        with mha_cy.threads(n_threads), (_general_path() if team_flops == 0
                                         else contextlib.nullcontext()):
            runs.append((mha(x, cache=cache), mha(x[:, :1], cache=cache), cache.key.copy(),
                         cache.value.copy()))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(a, b)
