"""Decode steps over float16 and int8 caches through the compiled step (mha_cy/_step_kernel.pyx)
equal the general path bit for bit: outputs, stored keys and values, int8 scales. And the C
encode both paths write with (src/kv_encode.c) equals the NumPy definition of the formats
(_numpy_f16 / _numpy_i8 below, the rules mha_cy/_cache_formats.py documents), edge cases
included, on every SIMD path this CPU runs.

The general path is reached with lengths= (every sequence appending all of its tokens), as in
tests/test_step_kernel.py.
"""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mha_cy
from mha_cy import _kv_encode
from test_step_kernel import _module, ROPES

FORMATS = {"float16": np.float16, "int8": "int8"}


# ---- the encode ---------------------------------------------------------------------------

def _numpy_f16(x):
    """The float16 format's definition: NumPy's cast (round to nearest even, inf past 65504)."""
    with np.errstate(over="ignore"):
        return x.astype(np.float16)


def _numpy_i8(x):
    """The int8 format's definition in NumPy: scale = max|x| / 127 per row, round half even,
    clip to +-127; zero, NaN and inf rows stored as zeros, scale 0 / NaN / NaN."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(invalid="ignore"):
        scale = np.asarray(np.abs(x).max(axis=-1) / np.float32(127))
        usable = (scale > 0) & (scale < np.inf)
    q = np.zeros(x.shape, dtype=np.float32)
    np.divide(x, scale[..., None], out=q, where=usable[..., None])
    np.rint(q, out=q)
    np.clip(q, -127, 127, out=q)
    scale[scale == np.inf] = np.nan
    return q.astype(np.int8), scale


def _bits(*values):
    return np.array(values, dtype=np.uint32).view(np.float32)


def _f16_cases():
    """float32 values whose float16 rounding is delicate, and a sample of every bit pattern."""
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    h = h[np.isfinite(h)].astype(np.float32)
    mids = (h[:-1].astype(np.float64) + h[1:]) / 2          # ties between neighbours (exact)
    mids = mids[np.abs(mids) < 3e38].astype(np.float32)
    near = np.concatenate([np.nextafter(mids, np.float32(np.inf)),
                           np.nextafter(mids, np.float32(-np.inf))])
    special = np.concatenate([
        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 65504, 65519.996, 65520,
                  65536, 3.4e38, -3.4e38, 2.0 ** -24, 2.0 ** -25, 1.5 * 2.0 ** -25,
                  2.0 ** -14, 2.0 ** -14 - 2.0 ** -25, 1e-45, -1e-45, 1e-40, 1e-38],
                 dtype=np.float32),
        _bits(0x7f800001, 0xff800001, 0x7fa00000, 0x7fbfffff, 0x7fc00000, 0xffc00000,
              0x7fc00001, 0x7f802000, 0x7fffffff, 0x00000001, 0x80000001, 0x007fffff)])
    sample = np.arange(0, 1 << 32, 4099, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return np.concatenate([special, h, mids, near, sample])


def _i8_rows(rng):
    """(rows, 16) float32 rows: zeros, NaN, inf, huge, tiny, subnormal and tie rows."""
    rows = [np.zeros(16), -np.zeros(16), np.full(16, 1e-45), np.full(16, 1e-40),
            np.full(16, 3e38), np.full(16, -3.4e38), np.linspace(-1, 1, 16)]
    for bad in (np.nan, -np.nan, np.inf, -np.inf):
        r = rng.standard_normal(16)
        r[5] = bad
        rows.append(r)
    r = rng.standard_normal(16)
    r[[2, 9]] = [np.inf, np.nan]
    rows.append(r)
    ties = np.arange(-8, 8) + 0.5         # x / scale lands on k + 0.5 for scale 1
    ties[0] = 127.0
    rows += [ties, ties * 2.0 ** -120, ties * 2.0 ** 100]
    for exponent in (-149, -140, -130, -126, -100, -10, 0, 10, 100, 120):
        rows.append(rng.standard_normal(16) * 2.0 ** exponent)
    rows.append(np.array([1e-38] + [3e-39] * 15))    # a subnormal scale: x / scale above 127
    out = np.array(rows, dtype=np.float32)
    return np.concatenate([out, rng.standard_normal((200, 16)).astype(np.float32)])


def _check_encode():
    """Assert the C encode equals the NumPy definition on the cases above (also run in the
    children of test_encode_on_every_simd_path)."""
    x = _f16_cases()
    for n in (x.size, 7, 8, 9, 15):       # the 8-value blocks and the tails
        got, want = _kv_encode.encode_f16(x[:n]), _numpy_f16(x[:n])
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    strided = np.stack([x[:4096], x[4096:8192]], axis=-1)[..., 0]      # a strided view
    np.testing.assert_array_equal(_kv_encode.encode_f16(strided).view(np.uint16),
                                  _numpy_f16(strided).view(np.uint16))
    rows = _i8_rows(np.random.default_rng(7))
    for d in (16, 5, 64):
        r = rows[:, :d] if d <= 16 else np.tile(rows, 4)
        (q, s), (q_want, s_want) = _kv_encode.encode_i8(r), _numpy_i8(r)
        np.testing.assert_array_equal(q, q_want)
        np.testing.assert_array_equal(s.view(np.uint32), s_want.view(np.uint32))


def test_encode_equals_numpy_bitwise():
    _check_encode()


def test_encode_f16_of_other_dtypes_rounds_once():
    x = np.array([1 + 2.0 ** -11 + 2.0 ** -40, 70000.0, -1e-300], np.float64)   # a tie in
    np.testing.assert_array_equal(_kv_encode.encode_f16(x).view(np.uint16),    # float32 only
                                  _numpy_f16(x).view(np.uint16))


def test_encode_edge_cases_mean_what_the_formats_say():
    q, s = _kv_encode.encode_i8(np.array([[0, 0, 0], [1, -np.inf, 2], [1, np.nan, 2],
                                          [127, -63.5, 0.5], [-254, 1, 3]], np.float32))
    np.testing.assert_array_equal(q, [[0, 0, 0], [0, 0, 0], [0, 0, 0], [127, -64, 0],
                                      [-127, 0, 2]])
    np.testing.assert_array_equal(s, np.array([0, np.nan, np.nan, 1, 2], np.float32))
    f = _kv_encode.encode_f16(np.array([65519.996, 65520, 2.0 ** -25, 3 * 2.0 ** -25,
                                        np.nan], np.float32))
    np.testing.assert_array_equal(f, np.array([65504, np.inf, 0, 2 * 2.0 ** -24, np.nan],
                                              np.float16))


CHILD = textwrap.dedent(
    """\
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import mha_cy
    import test_step_kernel_formats as t
    t._check_encode()
    print(json.dumps({"simd": mha_cy.build_info()["simd"], "file": mha_cy.__file__}))
    """
)


@pytest.mark.parametrize("request_value,level", [("portable", "sse2"), ("avx2", "avx2"),
                                                 ("avx512", "avx512")])
def test_encode_on_every_simd_path(request_value, level):
    """The F16C path and the portable conversion give the same bits (MHA_CY_SIMD is read
    when the modules load: each path in a fresh interpreter)."""
    rank = {"sse2": 0, "avx2": 1, "avx512": 2}
    cpu = mha_cy.build_info()["simd_cpu"]
    if cpu not in rank:
        pytest.skip(f"no run-time SIMD dispatch in this build (simd {cpu!r})")
    if rank[level] > rank[cpu]:
        pytest.skip(f"this CPU cannot run the {level} path (its best is {cpu!r})")
    env = dict(os.environ, MHA_CY_SIMD=request_value)
    proc = subprocess.run([sys.executable, "-c", CHILD, os.path.dirname(__file__)], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    assert child["simd"] == level
    assert os.path.dirname(child["file"]) == os.path.dirname(mha_cy.__file__)


# ---- decode steps over the stored formats ---------------------------------------------------

# (embed_dim, num_heads, num_kv_heads, head_dim): MHA, GQA, MQA; head dims below and above the
# direct kernel's minimum (32): tasks of a few rows take the direct kernel or converted tiles
GEOMETRIES = [(64, 4, 4, 16), (64, 4, 2, 16), (64, 4, 1, 16), (128, 4, 2, 32), (64, 2, 1, 64)]


def _assert_same_cache(fast, general):
    np.testing.assert_array_equal(fast.lengths, general.lengths)
    stop = fast.length
    for name in ("key", "value", "key_scale", "value_scale"):
        a, b = getattr(fast, name), getattr(general, name)
        if a is None:
            assert b is None
            continue
        a, b = a[:, :, :stop], b[:, :, :stop]
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=name)


def _run_both(mha, fmt, batch, prompt, steps, step_len, rng, ragged=False, scale=1.0):
    """Prefill `prompt` tokens (ragged: right-padded prompts of different lengths), then `steps`
    calls of step_len tokens, by the fast path and by the general path (lengths=); both runs'
    outputs and caches."""
    size = prompt + steps * step_len
    fast, general = (mha.new_cache(batch, size, dtype=fmt) for _ in range(2))
    full = np.full(batch, prompt)
    lengths = (np.arange(batch) * 3 + prompt) % (prompt + 1) if ragged else full
    x = (rng.standard_normal((batch, prompt, mha.embed_dim)) * scale).astype(np.float32)
    outs = [(mha(x, cache=fast, lengths=lengths), mha(x, cache=general, lengths=lengths))]
    for _ in range(steps):
        x = (rng.standard_normal((batch, step_len, mha.embed_dim)) * scale).astype(np.float32)
        outs.append((mha(x, cache=fast), mha(x, cache=general,
                                             lengths=np.full(batch, step_len))))
    return outs, fast, general


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[str(g) for g in GEOMETRIES])
@pytest.mark.parametrize("rope", list(ROPES), ids=list(ROPES))
@pytest.mark.parametrize("window", [None, 5])
def test_stored_steps_equal_the_general_path_bitwise(rng, taken, fmt, geometry, rope, window):
    """Decode steps (1 token) and short prefills (3 and 10 tokens: the direct kernel and
    converted tiles), equal and ragged lengths, with and without biases. One thread: with more,
    the larger calls here are the general path's (threads pay), see the long caches below."""
    with mha_cy.threads(1):
        _stored_steps(rng, taken, fmt, geometry, rope, window)


def _stored_steps(rng, taken, fmt, geometry, rope, window):
    for bias in (True, False):
        mha = _module(rng, geometry, np.float32, ROPES[rope], window, bias=bias)
        for batch, step_len, ragged in ((1, 1, False), (3, 1, False), (2, 3, False),
                                        (3, 1, True), (2, 3, True), (2, 10, False)):
            taken.clear()
            outs, fast, general = _run_both(mha, FORMATS[fmt], batch, 7, 4, step_len, rng,
                                            ragged)
            assert taken == [True] * 4, (batch, step_len, ragged)     # the compiled step ran
            for a, b in outs:
                np.testing.assert_array_equal(a, b)
            _assert_same_cache(fast, general)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("cached,step_len", [(255, 1), (300, 10), (600, 1), (1100, 1)])
def test_long_stored_caches_bitwise(rng, fmt, n_threads, cached, step_len):
    """Across the key-tile size (256; a 10-token step converts several tiles) and where the
    general kernel splits the keys (split-K: the compiled step declines), any thread count."""
    mha = _module(rng, (64, 4, 2, 16), np.float32, mha_cy.RoPE(), None, bias=False)
    x_prompt = rng.standard_normal((1, cached, 64)).astype(np.float32)
    x_step = rng.standard_normal((1, step_len, 64)).astype(np.float32)
    results = []
    for general in (False, True):
        cache = mha.new_cache(1, cached + step_len, dtype=FORMATS[fmt])
        mha(x_prompt, cache=cache)
        with mha_cy.threads(n_threads):
            kw = {"lengths": [step_len]} if general else {}
            results.append((mha(x_step, cache=cache, **kw), cache))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    _assert_same_cache(results[0][1], results[1][1])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_non_finite_and_huge_values_bitwise(rng, fmt):
    """Inputs large enough for float16 to overflow to inf (and int8 rows to hold inf/NaN):
    the same non-finite outputs and the same stored bits and scales."""
    mha = _module(rng, (64, 4, 2, 16), np.float32, None, None)
    for scale in (1e3, 1e5, 1e30):
        outs, fast, general = _run_both(mha, FORMATS[fmt], 2, 5, 3, 1, rng, scale=scale)
        for a, b in outs:
            np.testing.assert_array_equal(a, b)
        _assert_same_cache(fast, general)
    x = rng.standard_normal((2, 1, 64)).astype(np.float32)
    x[0, 0, 3] = np.nan
    x[1, 0, 7] = np.inf
    for cache_pair in ([mha.new_cache(2, 4, dtype=FORMATS[fmt]) for _ in range(2)],):
        fast, general = cache_pair
        np.testing.assert_array_equal(mha(x, cache=fast), mha(x, cache=general, lengths=[1, 1]))
        _assert_same_cache(fast, general)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_failed_stored_step_changes_nothing(rng, fmt):
    mha = _module(rng, (64, 4, 2, 16), np.float32, None, None)
    cache = mha.new_cache(2, 4, dtype=FORMATS[fmt])
    mha(rng.standard_normal((2, 4, 64)).astype(np.float32), cache=cache)
    before = cache.copy()
    with pytest.raises(ValueError, match="cache overflow"):
        mha(rng.standard_normal((2, 1, 64)).astype(np.float32), cache=cache)
    _assert_same_cache(cache, before)
    np.testing.assert_array_equal(cache.key.view(np.uint8), before.key.view(np.uint8))
