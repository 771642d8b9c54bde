"""Concurrency: many Python threads on one module (and one cache per thread) give results
bitwise equal to the same calls made serially; threads(n) is per Python thread; calls inside
joblib (loky) workers and multiprocessing spawn / fork workers give the parent's results.
Every wait is bounded: a hang fails its test, it never blocks the suite."""
import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import mha_cy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_THREADS = 8
JOIN_TIMEOUT = 300


def run_in_threads(target, n=N_THREADS):
    """target(i) in n Python threads started together; their results (or exceptions)."""
    barrier = threading.Barrier(n)
    results, errors = [None] * n, []

    def body(i):
        try:
            barrier.wait(timeout=60)
            results[i] = target(i)
        except BaseException as exc:        # noqa: BLE001 (reported in the main thread)
            errors.append(exc)

    workers = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(n)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(JOIN_TIMEOUT)
    assert not any(w.is_alive() for w in workers), "a thread hung"
    if errors:
        raise errors[0]
    return results


def _calls(rng, embed_dim, n_calls):
    """A mix of calls: self-attention (causal or not), masks, cross-attention, weights."""
    calls = []
    for j in range(n_calls):
        b, lq, lk = 1 + j % 2, 1 + (7 * j) % 40, 1 + (11 * j) % 300
        x = rng.standard_normal((b, lq, embed_dim)).astype(np.float32)
        mem = rng.standard_normal((b, lk, embed_dim)).astype(np.float32)
        kind = j % 4
        if kind == 0:
            calls.append(((x,), dict(is_causal=bool(j % 3))))
        elif kind == 1:
            calls.append(((x,), dict(key_padding_mask=rng.random((b, lq)) < 0.3)))
        elif kind == 2:
            calls.append(((x, mem), dict(attn_mask=rng.random((lq, lk)) < 0.8)))
        else:
            calls.append(((x, mem), dict(need_weights=True)))
    return calls


def _run(mha, call):
    args, kwargs = call
    out = mha(*args, **kwargs)
    return out if isinstance(out, tuple) else (out,)


def _assert_bitwise(actual, expected):
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape
        assert a.tobytes() == e.tobytes()


def test_threads_on_a_shared_module_are_bitwise_serial():
    mha = mha_cy.MultiHeadAttention(64, 4, num_kv_heads=2, seed=0)
    per_thread = [_calls(np.random.default_rng(i), 64, 24) for i in range(N_THREADS)]
    serial = [[_run(mha, c) for c in calls] for calls in per_thread]
    for _ in range(2):
        results = run_in_threads(lambda i: [_run(mha, c) for c in per_thread[i]])
        for got, want in zip(results, serial):
            for g, w in zip(got, want):
                _assert_bitwise(g, w)


def _decode(mha, rng_seed, steps=20, prompt=9):
    rng = np.random.default_rng(rng_seed)
    cache = mha.new_cache(2, prompt + steps)
    outs = [mha(rng.standard_normal((2, prompt, mha.embed_dim)).astype(np.float32),
                cache=cache)]
    for _ in range(steps):
        outs.append(mha(rng.standard_normal((2, 1, mha.embed_dim)).astype(np.float32),
                        cache=cache))
    return outs, cache


def test_each_thread_with_its_own_cache_is_bitwise_serial():
    mha = mha_cy.MultiHeadAttention(64, 8, num_kv_heads=2, seed=1)
    serial = [_decode(mha, i) for i in range(N_THREADS)]
    results = run_in_threads(lambda i: _decode(mha, i))
    for (outs, cache), (want, want_cache) in zip(results, serial):
        assert cache.length == want_cache.length
        assert cache.key.tobytes() == want_cache.key.tobytes()
        for g, w in zip(outs, want):
            assert g.tobytes() == w.tobytes()


def _state(cache):
    return cache.lengths.tolist(), cache.key.tobytes(), cache.value.tobytes()


@pytest.mark.parametrize("cls", [mha_cy.MultiHeadAttention, mha_cy.reference.MultiHeadAttention])
@pytest.mark.parametrize("fmt", [None, np.float16, "int8"], ids=["f32", "f16", "i8"])
def test_a_cache_in_use_by_another_thread_refuses_and_stays_unchanged(cls, fmt):
    """Two threads stepping one cache both passed its room check, and its length went past
    max_len. A cache serves one call at a time: while another thread holds it, every call and
    method that uses it raises RuntimeError and changes nothing."""
    mha = cls(16, 4, num_kv_heads=2, seed=0)
    rng = np.random.default_rng(0)
    cache = mha.new_cache(2, 8, dtype=fmt)
    x = rng.standard_normal((2, 3, 16)).astype(np.float32)
    mha(x, cache=cache)
    before = _state(cache)
    held, done = threading.Event(), threading.Event()

    def hold():
        guard = cache._claim()
        held.set()
        done.wait(60)
        guard.release()
    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(60)
    try:
        step = x[:, :1]
        for use in (lambda: mha(step, cache=cache),                 # the compiled step
                    lambda: mha(step, cache=cache, need_weights=True),  # the general path
                    lambda: mha(step, cache=cache, lengths=[1, 0]),
                    lambda: cache.truncate(1), lambda: cache.reorder([1, 0]),
                    lambda: cache.reset(), lambda: cache.copy()):
            with pytest.raises(RuntimeError, match="in use by a call in another thread"):
                use()
            assert _state(cache) == before
    finally:
        done.set()
        holder.join(60)
    out = mha(x[:, :1], cache=cache)        # free again; the compiled step's fallback to the
    assert cache.length == 4                # general path re-enters the same claim
    assert np.isfinite(out).all()


def test_threads_racing_on_one_cache_never_pass_max_len():
    """Stress: threads stepping one cache get outputs or RuntimeError / overflow errors, and
    the cache's length never passes max_len."""
    mha = mha_cy.MultiHeadAttention(32, 4, seed=0)
    x = np.random.default_rng(1).standard_normal((1, 1, 32)).astype(np.float32)
    for _ in range(30):
        cache = mha.new_cache(1, 4)
        mha(np.repeat(x, 3, axis=1), cache=cache)

        def step(i):
            try:
                mha(x, cache=cache)
                return "ok"
            except RuntimeError:
                return "busy"
            except ValueError as exc:
                assert "cache overflow" in str(exc)
                return "full"
        results = run_in_threads(step, n=4)
        assert cache.length <= cache.max_len == 4
        assert results.count("ok") == cache.length - 3


def test_threads_n_is_per_thread_and_never_changes_results():
    mha = mha_cy.MultiHeadAttention(64, 4, seed=2)
    x = np.random.default_rng(2).standard_normal((2, 200, 64)).astype(np.float32)
    with mha_cy.threads(1):
        expected = mha(x, is_causal=True)
    mha_cy.set_num_threads(2)

    def body(i):
        want = 1 + i % 3
        seen = []
        with mha_cy.threads(want):
            for _ in range(10):
                seen.append(mha_cy.get_num_threads())
                out = mha(x, is_causal=True)
                assert out.tobytes() == expected.tobytes()
        seen.append(mha_cy.get_num_threads())          # back to the process-wide setting
        return seen

    openmp = mha_cy.get_num_threads() == 2           # else a serial build: always 1
    for i, seen in enumerate(run_in_threads(body)):
        assert seen == [1 + i % 3 if openmp else 1] * 10 + [2 if openmp else 1]


# -- worker processes ---------------------------------------------------------------------

def _worker_call(seed):
    """Runs in a worker process: the result of a fixed call and the worker's thread count."""
    import mha_cy as m    # noqa: PLC0415  (a spawned worker imports it here)
    mha = m.MultiHeadAttention(32, 4, seed=seed)
    x = np.random.default_rng(seed).standard_normal((2, 150, 32)).astype(np.float32)
    return mha(x, is_causal=True), m.get_num_threads()


def _expected(seed):
    return _worker_call(seed)[0]


def _subprocess(code, timeout=240):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")])}
    try:
        result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                                env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the worker processes hung (no result in {timeout} s)")
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_calls_inside_joblib_loky_workers():
    pytest.importorskip("joblib")
    out = _subprocess("""
        import numpy as np
        from joblib import Parallel, delayed
        import mha_cy
        from test_concurrency import _worker_call, _expected
        results = Parallel(n_jobs=2, backend="loky", timeout=180)(
            delayed(_worker_call)(s) for s in range(4))
        assert mha_cy.__file__ == %r, mha_cy.__file__   # the parent's mha_cy
        for s, (out, n) in enumerate(results):
            assert out.tobytes() == _expected(s).tobytes(), s
        print("ok", len(results))
    """ % mha_cy.__file__)
    assert out.split() == ["ok", "4"]


def test_calls_inside_multiprocessing_spawn_workers():
    out = _subprocess("""
        import multiprocessing
        from test_concurrency import _worker_call, _expected
        if __name__ == "__main__":
            with multiprocessing.get_context("spawn").Pool(2) as pool:
                results = pool.map_async(_worker_call, range(4)).get(timeout=180)
            for s, (out, n) in enumerate(results):
                assert out.tobytes() == _expected(s).tobytes(), s
            print("ok", len(results))
    """)
    assert out.split() == ["ok", "4"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_calls_inside_multiprocessing_fork_workers_after_parallel_calls():
    expected = [_expected(s) for s in range(4)]     # the parent has run parallel kernels
    with mha_cy.threads(2):
        _expected(0)
    pool = multiprocessing.get_context("fork").Pool(2)
    try:
        results = pool.map_async(_worker_call, range(4)).get(timeout=180)
    except multiprocessing.TimeoutError:
        pytest.fail("a fork worker hung")
    finally:
        pool.terminate()
        pool.join()
    for (out, n), want in zip(results, expected):
        assert out.tobytes() == want.tobytes()      # 1 thread there: the same bits
        assert n == 1 or not mha_cy.build_info()["openmp"]


def test_fork_while_other_threads_are_inside_calls():
    """A fork while 4 Python threads are in kernels (holding BLAS at 1 thread): the child
    neither hangs nor inherits the hold, and computes the same bits."""
    if not hasattr(os, "fork"):
        pytest.skip("needs fork")
    mha = mha_cy.MultiHeadAttention(64, 4, seed=3)
    x = np.random.default_rng(3).standard_normal((2, 300, 64)).astype(np.float32)
    expected = mha(x)
    stop = threading.Event()

    def busy():
        while not stop.is_set():
            mha(x)

    workers = [threading.Thread(target=busy, daemon=True) for _ in range(4)]
    for w in workers:
        w.start()
    try:
        pool = multiprocessing.get_context("fork").Pool(1)
        try:
            got, n = pool.map_async(_fork_child_call, [0]).get(timeout=180)[0]
        except multiprocessing.TimeoutError:
            pytest.fail("the fork child hung")
        finally:
            pool.terminate()
            pool.join()
    finally:
        stop.set()
        for w in workers:
            w.join(JOIN_TIMEOUT)
    assert got == expected.tobytes()
    assert n == 0                                   # the parent's holders did not come along


def _fork_child_call(_):
    from mha_cy import _threads  # noqa: PLC0415
    mha = mha_cy.MultiHeadAttention(64, 4, seed=3)
    x = np.random.default_rng(3).standard_normal((2, 300, 64)).astype(np.float32)
    return mha(x).tobytes(), _threads._blas_depth


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_fork_worker_after_torch_started_its_openmp_threads():
    """Another library's OpenMP pool (torch's intra-op threads) running in the parent: a fork
    worker neither hangs nor differs."""
    pytest.importorskip("torch")
    out = _subprocess("""
        import multiprocessing
        import torch
        from test_concurrency import _worker_call, _expected
        if __name__ == "__main__":
            torch.set_num_threads(2)
            a = torch.ones(512, 512)
            for _ in range(3):
                a = torch.tanh(a @ a / 512)          # torch's OpenMP team is up
            expected = _expected(1)
            pool = multiprocessing.get_context("fork").Pool(1)
            try:
                out, n = pool.map_async(_worker_call, [1]).get(timeout=180)[0]
            except multiprocessing.TimeoutError:
                print("HANG")
                raise SystemExit(3)
            finally:
                pool.terminate()
            assert out.tobytes() == expected.tobytes()
            print("ok", n)
    """)
    assert out.split()[0] == "ok"
