"""Shared fixtures and helpers of the mha_cy tests.

- ``assert_close(actual, expected, dtype)``: the tolerance table below, with an absolute
  tolerance relative to the scale of ``expected`` (attention outputs are O(1) but masks and
  extreme inputs move them around), and no NaN allowed anywhere.
- ``random_weights`` / ``make_pair``: a fast and a reference module with the same weights
  (random non-zero biases included, so that every bias is exercised).
- ``random_bool_mask`` / ``random_float_mask``: masks in any (broadcastable) shape.
- ``rng``: a seeded generator, a different but fixed seed per test.
- ``fuzz_settings`` / ``fuzz_budget``: the hypothesis profile of the differential fuzz tests
  (MHA_CY_FUZZ_PROFILE = quick (default), ci or sanitize) and its time budget.
"""
import contextlib
import json
import os
import time
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import mha_cy
from mha_cy import _attention_kernel, reference

DTYPES = [np.float32, np.float64]
# float32: the kernels sum in another order than NumPy and use a vectorized exp (~1 ulp).
RTOL = {np.float32: 1e-5, np.float64: 1e-12}
ATOL = {np.float32: 2e-6, np.float64: 1e-13}      # times max |expected|


def _dtype_key(dtype):
    return np.dtype(dtype).type


def assert_close(actual, expected, dtype=None, factor=1.0, err_msg=""):
    """actual == expected within the tolerance table of dtype (default: expected's dtype)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    key = _dtype_key(expected.dtype if dtype is None else dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert not np.isnan(actual).any(), f"NaN in the result {err_msg}"
    scale = float(np.abs(expected).max(initial=0.0))
    np.testing.assert_allclose(actual, expected, rtol=RTOL[key] * factor,
                               atol=ATOL[key] * factor * max(scale, 1e-30),
                               equal_nan=False, err_msg=err_msg)


@pytest.fixture
def rng(request):
    """A seeded generator: fixed per test (seed from the test id), different across tests."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def _default_threads():
    """No test leaks a thread-count setting into the next one."""
    yield
    mha_cy.set_num_threads(None)


def random_weights(rng, embed_dim, num_heads, num_kv_heads=None, head_dim=None, kdim=None,
                   vdim=None, bias=True):
    """from_weights keyword arguments: random weights (and biases) in nn.Linear layout."""
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    head_dim = embed_dim // num_heads if head_dim is None else head_dim
    kdim = embed_dim if kdim is None else kdim
    vdim = embed_dim if vdim is None else vdim
    n_q, n_kv = num_heads * head_dim, num_kv_heads * head_dim

    def w(rows, cols):
        return rng.standard_normal((rows, cols)) / np.sqrt(cols)

    kw = dict(q_weight=w(n_q, embed_dim), k_weight=w(n_kv, kdim), v_weight=w(n_kv, vdim),
              out_weight=w(embed_dim, n_q), num_heads=num_heads, num_kv_heads=num_kv_heads)
    if bias:
        kw.update(q_bias=0.1 * rng.standard_normal(n_q), k_bias=0.1 * rng.standard_normal(n_kv),
                  v_bias=0.1 * rng.standard_normal(n_kv),
                  out_bias=0.1 * rng.standard_normal(embed_dim))
    return kw


def make_pair(rng, embed_dim, num_heads, dtype=np.float32, **kwargs):
    """(fast, reference) MultiHeadAttention built from the same random weights."""
    weights = random_weights(rng, embed_dim, num_heads, **kwargs)
    fast = mha_cy.MultiHeadAttention.from_weights(**weights, dtype=dtype)
    ref = reference.MultiHeadAttention.from_weights(**weights, dtype=dtype)
    return fast, ref


def random_bool_mask(rng, shape, p_allowed=0.7):
    """A bool "may attend" mask (True with probability p_allowed)."""
    return rng.random(shape) < p_allowed


def random_float_mask(rng, shape, p_blocked=0.2):
    """An additive mask: small random biases, -inf with probability p_blocked."""
    mask = rng.standard_normal(shape)
    mask[rng.random(shape) < p_blocked] = -np.inf
    return mask


def random_padding(rng, batch, k_len, p_pad=0.25):
    """A key_padding_mask (True = padding) with at least one real key per sequence."""
    pad = rng.random((batch, k_len)) < p_pad
    pad[:, rng.integers(k_len)] = False
    return pad


def check_modules(fast, ref, query, key=None, value=None, dtype=None, factor=1.0, **kwargs):
    """Run both modules with need_weights True and False; assert they agree. Returns ref's
    (out, weights)."""
    dtype = fast.dtype if dtype is None else dtype
    out_f, w_f = fast(query, key, value, need_weights=True, **kwargs)
    out_r, w_r = ref(query, key, value, need_weights=True, **kwargs)
    out_nw = fast(query, key, value, **kwargs)
    assert out_f.dtype == out_nw.dtype == w_f.dtype == np.dtype(dtype)
    assert out_r.dtype == w_r.dtype == np.dtype(dtype)     # the oracle keeps the dtype too
    assert_close(out_f, out_r, dtype, factor, "output (need_weights=True)")
    assert_close(out_nw, out_r, dtype, factor, "output (need_weights=False)")
    assert_close(w_f, w_r, dtype, factor, "weights")
    return out_r, w_r


@pytest.fixture(params=["fused", "blas"])
def tile_kernel(request):
    """Each test once per tile kernel: the fused kernel and the BLAS path it replaces."""
    previous = _attention_kernel._set_tile_kernel(request.param)
    yield request.param
    _attention_kernel._set_tile_kernel(previous)


# -- differential fuzzing profiles (tests/test_fuzz_differential.py) -----------------------
# examples per fuzz test, and seconds per fuzz test after which further examples are skipped
# (CI's time budget: a loaded machine runs fewer examples, never a longer step).
FUZZ_PROFILES = {"quick": (20, None), "ci": (5000, 120.0), "sanitize": (2000, 60.0)}
FUZZ_PROFILE = os.environ.get("MHA_CY_FUZZ_PROFILE", "quick")
if FUZZ_PROFILE not in FUZZ_PROFILES:
    raise ValueError(f"MHA_CY_FUZZ_PROFILE must be one of {sorted(FUZZ_PROFILES)}; "
                     f"got {FUZZ_PROFILE!r}")
for _name, (_examples, _budget) in FUZZ_PROFILES.items():
    # derandomized (the same examples in every run of one version of the strategies, so a
    # CI result is reproducible); MHA_CY_FUZZ_RANDOM=1 draws fresh ones
    settings.register_profile(
        f"mha_cy_fuzz_{_name}", max_examples=_examples, deadline=None,
        derandomize=os.environ.get("MHA_CY_FUZZ_RANDOM") != "1", database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.filter_too_much])
_FUZZ_TRIED = {}    # test name -> [run, skipped past the budget, seconds, start, failed]


def fuzz_settings():
    return settings(settings.get_profile(f"mha_cy_fuzz_{FUZZ_PROFILE}"))


@contextlib.contextmanager
def fuzz_budget(name):
    """``with fuzz_budget(name) as go: if go: run(example)``: go is False once the profile's
    time budget for this test is spent; the counts go to MHA_CY_FUZZ_REPORT at the end."""
    tried = _FUZZ_TRIED.setdefault(name, [0, 0, 0.0, time.monotonic(), False])
    budget = FUZZ_PROFILES[FUZZ_PROFILE][1]
    # after a failure every example runs again: hypothesis must be able to shrink it
    if budget is not None and not tried[4] and time.monotonic() - tried[3] > budget:
        tried[1] += 1
        yield False
        return
    start = time.monotonic()
    try:
        yield True
    except BaseException:
        tried[4] = True
        raise
    finally:
        tried[0] += 1
        tried[2] += time.monotonic() - start


def pytest_sessionfinish(session):
    path = os.environ.get("MHA_CY_FUZZ_REPORT")
    if path and _FUZZ_TRIED:
        report = {name: {"examples_run": n, "skipped_past_budget": skipped,
                         "seconds_in_examples": round(sec, 1)}
                  for name, (n, skipped, sec, _, _) in _FUZZ_TRIED.items()}
        with open(path, "w") as f:
            json.dump({"profile": FUZZ_PROFILE, "tests": report}, f, indent=1)


@pytest.fixture
def taken(monkeypatch):
    """A list that records, for each call into _step_kernel from mha_cy.attention, whether
    the compiled call ran (True) or declined (False)."""
    from mha_cy import _step_kernel, attention
    record = []

    def counting(function):
        def call(*args):
            out = function(*args)
            record.append(out is not None)
            return out
        return staticmethod(call)

    class Counting:
        decode_step = counting(_step_kernel.decode_step)
        self_attention = counting(_step_kernel.self_attention)
    monkeypatch.setattr(attention, "_step_kernel", Counting)
    return record
