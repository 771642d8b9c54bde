"""Decode and small-call paths at unusual but legal shapes and inputs, against the oracle.

The direct decode kernels (4-row GQA blocks on 512-bit score vectors with a masked head-dim
tail, 8-row MQA blocks, the float16 / int8 cache readers) through the module API: head dims
that are not multiples of 8 or 16, groups of 1..8 query heads a K/V head, multi-token steps
(row blocks spanning queries), ragged caches with an empty sequence, windows of 1 and beyond
the cache, stale non-finite keys past a truncation, NaN / inf in one token, extreme
magnitudes, thread counts and forced SIMD levels. float32 caches are held to the float32
table of conftest; float16 / int8 caches to the oracle run on the values the cache holds
(test_cache_formats.assert_exact: float32 rounding, or INT8_DOT_BOUND on the VNNI path)."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mha_cy
from mha_cy import reference

from conftest import assert_close, random_weights
from test_cache_formats import assert_exact, expected_sequence

FORMATS = [None, np.float16, "int8"]
FORMAT_IDS = ["f32", "f16", "i8"]
RANK = {"sse2": 0, "avx2": 1, "avx512": 2}


def pair(seed, embed, heads, kv_heads, head_dim, window=None, bias=True):
    """(fast, reference) float32 modules with the same random weights."""
    w = random_weights(np.random.default_rng(seed), embed, heads, num_kv_heads=kv_heads,
                       head_dim=head_dim, bias=bias)
    return tuple(m.MultiHeadAttention.from_weights(**w, dtype=np.float32, window=window)
                 for m in (mha_cy, reference))


def prefill_and_steps(fast, x, prefill, step_len, fmt, lengths=None):
    """Prefill x[:, :prefill] (with lengths), then steps of step_len tokens: (outputs, cache)."""
    cache = fast.new_cache(x.shape[0], x.shape[1], dtype=fmt)
    outs = [fast(x[:, :prefill], cache=cache, lengths=lengths)]
    outs += [fast(x[:, t:t + step_len], cache=cache)
             for t in range(prefill, x.shape[1], step_len)]
    return np.concatenate(outs, axis=1), cache


def oracle(ref, tokens, cache, b, fmt):
    """One causal pass of the oracle over sequence b's tokens (L, E): on its own K/V for a
    float32 cache, on the values the cache holds otherwise."""
    if fmt is None:
        return ref(tokens, is_causal=True)
    key, value = cache.dequantize(tokens.shape[0])
    return expected_sequence(ref, tokens, key[b], value[b])


def oracle_tail(ref, tokens, cache, b, n):
    """The oracle's last n output rows of sequence b over the K/V the cache holds (the
    causal diagonal at the bottom right: n queries against every cached key)."""
    L = tokens.shape[0]
    key, value = cache.dequantize(L)
    q = tokens[-n:] @ ref.q_weight.T
    if ref.q_bias is not None:
        q = q + ref.q_bias
    q = q.reshape(1, n, ref.num_heads, ref.head_dim).transpose(0, 2, 1, 3)
    ctx = reference._attention(q, key[b][None], value[b][None], None, None, True,
                               1.0 / np.sqrt(ref.head_dim), ref.window, ref._kv_index)[0]
    out = ctx.transpose(0, 2, 1, 3).reshape(n, -1) @ ref.out_weight.T
    return out if ref.out_bias is None else out + ref.out_bias


def assert_format_close(got, expected, fmt, err_msg=""):
    """float32 table for a float32 cache, assert_exact for the stored formats."""
    if fmt is None:
        assert_close(got, expected, np.float32, err_msg=err_msg)
    else:
        assert_exact(got, expected, fmt, err_msg=err_msg)


def check(got, ref, x, cache, fmt, err_msg=""):
    """Every sequence of got (B, L, E) against the oracle's causal pass over x."""
    for b in range(x.shape[0]):
        assert_format_close(got[b], oracle(ref, x[b], cache, b, fmt), fmt,
                            f"{err_msg} seq {b}")


# (head_dim, query heads a K/V head, K/V heads): tails of 1..15 after the 16-wide steps,
# the 4-row wide block, the 8-row MQA block, blocks of 3 and 5..7 rows
SHAPES = [(33, 4, 1), (72, 4, 2), (100, 8, 1), (129, 4, 1), (200, 8, 1), (256, 4, 1),
          (100, 3, 1), (129, 5, 1), (47, 6, 1), (100, 7, 2), (72, 2, 2), (33, 1, 2)]


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"d{d}_g{g}_kv{k}" for d, g, k in SHAPES])
def test_odd_head_dims_prefill_then_steps(fmt, shape):
    """Prefill then one-token and two-token steps equal one causal pass of the oracle."""
    d, group, kv_heads = shape
    fast, ref = pair(d * 13 + group, 24, group * kv_heads, kv_heads, d,
                     window=None if d % 2 else 11)
    x = np.random.default_rng(d + group).standard_normal((2, 41, 24)).astype(np.float32)
    for step_len in (1, 2):
        got, cache = prefill_and_steps(fast, x, 33, step_len, fmt)
        check(got, ref, x, cache, fmt, f"step_len {step_len}")


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("shape", [(100, 4, 1), (129, 8, 1), (33, 5, 1)],
                         ids=["d100_g4", "d129_g8", "d33_g5"])
@pytest.mark.parametrize("window", [None, 1, 5000])
def test_split_k_decode_odd_dims(fmt, shape, window):
    """One sequence, one K/V head over 1100 keys (split-K parts, some outside the window)."""
    d, group, kv_heads = shape
    fast, ref = pair(d + group, 16, group * kv_heads, kv_heads, d, window=window)
    x = np.random.default_rng(d).standard_normal((1, 1102, 16)).astype(np.float32)
    got, cache = prefill_and_steps(fast, x, 1100, 1, fmt)
    assert_format_close(got[0, -2:], oracle_tail(ref, x[0], cache, 0, 2), fmt)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("batch", [1, 3, 7])
@pytest.mark.parametrize("window", [None, 1, 100])
def test_ragged_with_empty_sequence(fmt, batch, window):
    """Ragged prefill where sequence 0 caches nothing, then steps: each sequence alone."""
    d, group, kv_heads = 100, 4, 2
    fast, ref = pair(batch, 24, group * kv_heads, kv_heads, d, window=window)
    rng = np.random.default_rng(batch * 7)
    prompt, steps = 9, 3
    lens = rng.integers(0, prompt + 1, batch)
    lens[0] = 0
    lens[-1] = prompt if batch > 1 else 0
    x = rng.standard_normal((batch, prompt, 24)).astype(np.float32)
    st = rng.standard_normal((batch, steps, 24)).astype(np.float32)
    cache = fast.new_cache(batch, prompt + steps, dtype=fmt)
    first = fast(x, cache=cache, lengths=lens)
    outs = np.concatenate([fast(st[:, t:t + 1], cache=cache) for t in range(steps)], axis=1)
    np.testing.assert_array_equal(cache.lengths, lens + steps)
    for b in range(batch):
        assert (first[b, lens[b]:] == 0).all(), f"padded rows of sequence {b} not zero"
        tokens = np.concatenate([x[b, :lens[b]], st[b]])
        got = np.concatenate([first[b, :lens[b]], outs[b]])
        assert_format_close(got, oracle(ref, tokens, cache, b, fmt), fmt, f"seq {b}")


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("shape", [(33, 8, 1), (100, 4, 2)], ids=["d33_g8", "d100_g4"])
@pytest.mark.parametrize("window", [None, 2])
def test_non_finite_token_stays_confined(fmt, bad, shape, window):
    """A NaN / inf in one token's x makes exactly the rows the oracle makes non-finite."""
    d, group, kv_heads = shape
    fast, ref = pair(d, 24, group * kv_heads, kv_heads, d, window=window)
    x = np.random.default_rng(d + 1).standard_normal((3, 11, 24)).astype(np.float32)
    x[1, 7, 3] = bad
    with np.errstate(all="ignore"):
        got, _ = prefill_and_steps(fast, x, 5, 1, fmt)
        expected = ref(x, is_causal=True)
    bad_got, bad_expected = ~np.isfinite(got).all(-1), ~np.isfinite(expected).all(-1)
    np.testing.assert_array_equal(bad_got, bad_expected)
    assert bad_got[1, 7] and not bad_got[[0, 2]].any()
    if window is not None:                      # the key leaves the window: finite again
        assert not bad_got[1, 9:].any()
    if fmt is None:
        assert_close(got[~bad_got], expected[~bad_expected], np.float32)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("prompt", [63, 64, 65, 1100])
def test_stale_nan_past_truncation_is_never_read(fmt, prompt):
    """NaN keys/values left past cache.truncate(n) do not reach later steps' outputs."""
    d, group, kv_heads = 129, 4, 1
    fast, ref = pair(prompt, 16, group * kv_heads, kv_heads, d)
    x = np.random.default_rng(prompt).standard_normal((1, prompt + 40, 16)).astype(np.float32)
    poisoned = x.copy()
    poisoned[:, prompt:] = np.nan
    cache = fast.new_cache(1, prompt + 40, dtype=fmt)
    with np.errstate(all="ignore"):
        fast(poisoned, cache=cache)
    cache.truncate(prompt)
    got = np.concatenate([fast(x[:, t:t + 1], cache=cache) for t in range(prompt, prompt + 3)],
                         axis=1)
    assert_format_close(got[0], oracle_tail(ref, x[0, :prompt + 3], cache, 0, 3), fmt)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("magnitude", [1e-38, 1e-30, 1e-20, 1e4])
def test_extreme_magnitudes_in_steps(fmt, magnitude):
    """x scaled to 1e-38 .. 1e4 without biases (subnormal int8 scales, sharp softmax)."""
    d, group, kv_heads = 72, 4, 1
    fast, ref = pair(7, 24, group * kv_heads, kv_heads, d, bias=False)
    x = np.random.default_rng(3).standard_normal((2, 10, 24)) * magnitude
    x = x.astype(np.float32)
    got, cache = prefill_and_steps(fast, x, 6, 1, fmt)
    assert np.isfinite(got).all()
    check(got, ref, x, cache, fmt)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("shape", [(100, 4, 1), (129, 8, 1), (33, 5, 1), (200, 4, 2)],
                         ids=["d100_g4", "d129_g8", "d33_g5", "d200_g4_kv2"])
def test_thread_counts_give_the_same_bits(fmt, shape):
    """1, 2 and 3 threads: bitwise equal outputs and caches (split-K and ragged batches)."""
    d, group, kv_heads = shape
    fast, _ = pair(d, 32, group * kv_heads, kv_heads, d, window=17)
    rng = np.random.default_rng(d + group)
    for batch, prompt in ((1, 1200), (3, 40), (7, 3)):
        x = rng.standard_normal((batch, prompt + 3, 32)).astype(np.float32)
        lens = None if batch == 1 else rng.integers(0, prompt + 1, batch)
        runs = []
        for n in (1, 2, 3):
            with mha_cy.threads(n):
                runs.append(prefill_and_steps(fast, x, prompt, 1, fmt, lens))
        for out, cache in runs[1:]:
            np.testing.assert_array_equal(out, runs[0][0])
            np.testing.assert_array_equal(cache.key, runs[0][1].key)
            np.testing.assert_array_equal(cache.value, runs[0][1].value)


SIMD_CHILD = textwrap.dedent(
    """\
    import sys
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    import mha_cy
    import test_reliability_decode_shapes as t
    out = {}
    for name, (fmt, d, group, kv_heads) in t.SIMD_CASES.items():
        fast, _ = t.pair(d + group, 24, group * kv_heads, kv_heads, d)
        got, cache = t.prefill_and_steps(fast, t.simd_input(d), 30, 1, fmt)
        key, value = cache.dequantize(cache.length)
        out[name], out[name + "_k"], out[name + "_v"] = got, key, value
    np.savez(sys.argv[2], **out)
    print(mha_cy.build_info()["simd"])
    """
)
SIMD_CASES = {f"{fid}_d{d}_g{g}": (fmt, d, g, kv)
              for fmt, fid in zip(FORMATS, FORMAT_IDS)
              for d, g, kv in [(33, 4, 1), (100, 8, 1), (129, 3, 2), (72, 4, 2)]}


def simd_input(d):
    return np.random.default_rng(d).standard_normal((2, 34, 24)).astype(np.float32)


@pytest.mark.parametrize("level", ["avx2", "portable"])
def test_forced_simd_level_decode_odd_dims(tmp_path, level):
    """MHA_CY_SIMD=avx2 / portable: odd-head-dim GQA / MQA decode steps equal the oracle."""
    want = {"portable": "sse2"}.get(level, level)
    cpu = mha_cy.build_info()["simd_cpu"]
    if cpu not in RANK or RANK[want] > RANK[cpu]:
        pytest.skip(f"this CPU cannot run {level}")
    env = dict(os.environ, MHA_CY_SIMD=level)
    path = tmp_path / "out.npz"
    proc = subprocess.run([sys.executable, "-c", SIMD_CHILD, os.path.dirname(__file__),
                           str(path)], env=env, capture_output=True, text=True, timeout=300,
                          check=False, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-1] == want
    got = np.load(path)
    for name, (fmt, d, group, kv_heads) in SIMD_CASES.items():
        _, ref = pair(d + group, 24, group * kv_heads, kv_heads, d)
        x = simd_input(d)
        for b in range(x.shape[0]):
            if fmt is None:
                expected = ref(x[b], is_causal=True)
                assert_close(got[name][b], expected, np.float32, err_msg=name)
            else:
                expected = expected_sequence(ref, x[b], got[name + "_k"][b],
                                             got[name + "_v"][b])
                # no integer products below AVX-512: float32 rounding for every format
                assert_close(got[name][b], expected, np.float32, err_msg=name)
