"""One benchmarked call per test: implementation x workload, grouped by workload.

Before anything is timed, the implementation's output is checked against the NumPy baseline
(``mha_cy.reference``) with fp32 tolerances, so a fast wrong answer fails instead of timing.
Run ``pytest benchmarks/`` (the root configuration's testpaths keep it out of the test run).
"""

from __future__ import annotations

import math
import os
import time

import numpy as np
import pytest

import implementations
import roof
from implementations import thread_limits
from workloads import make_data

# Single-precision tolerances: results of float32 products summed in different orders (blocked
# GEMMs, online softmax) differ by a few ulps of the largest partial sums.
RTOL = 1e-4
ATOL = 1e-5

SETTLE_SECONDS = 0.25

# (workload name, implementation name, threads or None) -> Prepared; holds one workload at a time.
_PREPARED: dict = {}
_BASELINE: dict = {}


def _evict_other_workloads(name):
    for store in (_PREPARED, _BASELINE):
        for key in [k for k in store if k[0] != name]:
            del store[key]


def _prepared(w, impl, threads):
    _evict_other_workloads(w.name)
    key = (w.name, impl.name, threads if impl.threads_at_prepare else None)
    if key not in _PREPARED and w.layers > 1:
        # a rotation holds several times the L3: one implementation's copies at a time
        for other in [k for k in _PREPARED if k[0] == w.name]:
            del _PREPARED[other]
    if key not in _PREPARED:
        data = make_data(w.name)
        _PREPARED[key] = (impl.prepare(w, data, threads) if w.layers == 1
                          else implementations.rotating(w, impl, data, threads))
    return _PREPARED[key]


def _baseline(w, threads):
    """The NumPy reference output of a workload (computed once)."""
    key = (w.name,)
    if key not in _BASELINE:
        _BASELINE[key] = _prepared(w, implementations.IMPLEMENTATIONS["numpy"], threads).call_once()
        _evict_other_workloads(w.name)
    return _BASELINE[key]


def _maybe_slowed(run, impl_name):
    """The deliberate regression of compare_smoke.sh: sleep before the call when asked to."""
    delay = float(os.environ.get("MHA_BENCH_SLEEP", "0") or 0)
    which = os.environ.get("MHA_BENCH_SLEEP_IMPL", "")
    if delay <= 0 or (which and impl_name not in which.split(",")):
        return run

    def slowed(*args, **kwargs):
        time.sleep(delay)
        return run(*args, **kwargs)
    return slowed


def check_output(got, expected, w, impl_name):
    assert got.shape == expected.shape, (
        f"{impl_name} on {w.name}: output shape {got.shape}, the numpy baseline's is {expected.shape}")
    assert np.isfinite(got).all(), f"{impl_name} on {w.name}: non-finite values in the output"
    np.testing.assert_allclose(
        got, expected, rtol=RTOL, atol=ATOL,
        err_msg=f"{impl_name} on {w.name}: output differs from the numpy baseline (mha_cy.reference)")


def test_attention(benchmark, case, request):
    w, threads, impl = case
    reason = impl.unavailable() or impl.unsupported_here(w)
    if reason:
        pytest.skip(reason)

    with thread_limits(threads):
        expected = _baseline(w, threads)
        prepared = _prepared(w, impl, threads)
        t0 = time.perf_counter()
        got = prepared.call_once()  # also the warm-up call
        t_call = time.perf_counter() - t0
        check_output(got, expected, w, impl.name)

        benchmark.group = w.name
        benchmark.extra_info.update(
            workload=w.name, implementation=impl.name, threads=threads, notes=prepared.notes,
            roof=roof.measure(threads), **w.info())
        if w.bound == "memory":
            benchmark.extra_info["read_gbps_near"] = roof.read_gbps_near(threads, w.name)
        run = _maybe_slowed(prepared.run, impl.name)
        # Let the previous implementation's thread pools stop spinning (OpenBLAS workers spin for
        # up to ~0.1 s after a call) so they don't steal a core from this one's first rounds.
        time.sleep(SETTLE_SECONDS)
        if prepared.setup is None:
            benchmark(run)
        else:
            # Stateful call (a KV cache): fresh state per round from setup, one call per round.
            # Rounds follow --benchmark-min-rounds / --benchmark-max-time as plain benchmarks do.
            cfg = request.config
            min_rounds = int(cfg.getoption("benchmark_min_rounds") or 5)
            max_time = float(cfg.getoption("benchmark_max_time") or 1.0)
            rounds = int(min(100, max(min_rounds, math.ceil(max_time / max(t_call, 1e-6)))))
            benchmark.pedantic(run, setup=prepared.setup, rounds=rounds, iterations=1)
