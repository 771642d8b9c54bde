"""No leaked BLAS count (concurrent threadpool_limits, fork during a call) and no hang in a
fork child of a parent whose GNU OpenMP pool was started by someone else. Every wait bounded."""
import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from mha_cy._openmp_helpers import openmp_enabled
from mha_cy._threads import _scipy_blas, blas_single_threaded

TIMEOUT = 10


def _scipy_lib():
    lib = _scipy_blas.load().controller
    if lib is None or lib.threading_layer == "openmp" or _scipy_blas.get is None:
        return None
    return lib


needs_scipy_blas = pytest.mark.skipif(_scipy_lib() is None,
                                      reason="scipy does not bundle its own pthreads BLAS here")
needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")


def _scipy_threads():
    return _scipy_blas.get()


@pytest.fixture
def scipy_blas_two_threads():
    before = _scipy_blas.get()
    _scipy_blas.set(2)
    yield
    _scipy_blas.set(before)


@needs_scipy_blas
def test_change_by_another_thread_during_the_hold_is_not_overwritten(scipy_blas_two_threads):
    # T: threadpool_limits(3) in; we: hold in (saves 3); T: out (back to 2); we: out. The
    # hold used to restore its stale 3 over T's restore, leaving the process at 3.
    t_in, hold_in, t_out = threading.Event(), threading.Event(), threading.Event()
    errors = []

    def other():
        try:
            with threadpool_limits(limits={_scipy_lib().filepath: 3}):
                t_in.set()
                assert hold_in.wait(TIMEOUT)
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)
        finally:
            t_in.set()
            t_out.set()

    worker = threading.Thread(target=other)
    worker.start()
    assert t_in.wait(TIMEOUT)
    assert _scipy_threads() == 3
    with blas_single_threaded():
        assert _scipy_threads() == 1
        hold_in.set()
        assert t_out.wait(TIMEOUT)
    worker.join(TIMEOUT)
    assert not errors, errors
    assert _scipy_threads() == 2


@needs_scipy_blas
def test_limits_entered_before_and_left_during_the_hold(scipy_blas_two_threads):
    limiter = threadpool_limits(limits={_scipy_lib().filepath: 1})
    with blas_single_threaded():
        limiter.restore_original_limits()          # someone else's 1 -> 2 while we hold
    assert _scipy_threads() == 2


# -- fork --------------------------------------------------------------------------------


def _child_blas_threads(_):
    before = _scipy_threads()
    with blas_single_threaded():
        inside = _scipy_threads()
    return before, inside, _scipy_threads()


@needs_scipy_blas
@needs_fork
def test_fork_during_a_hold_gives_the_child_its_blas_count_back(scipy_blas_two_threads):
    with blas_single_threaded():                   # a call in progress at fork time
        pool = multiprocessing.get_context("fork").Pool(1)
    try:
        result = pool.map_async(_child_blas_threads, [0]).get(timeout=60)[0]
    finally:
        pool.terminate()
        pool.join()
    assert result == (2, 1, 2)                     # used to be (1, 1, 1): stuck for good
    assert _scipy_threads() == 2


_FOREIGN_OPENMP_PARENT = textwrap.dedent(
    """
    import ctypes, ctypes.util, multiprocessing, sys, warnings
    import numpy as np
    import mha_cy

    # Start libgomp's pool from outside mha_cy: GOMP_parallel(free, NULL, 2 threads).
    gomp = [line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line][0]
    gomp = ctypes.CDLL(gomp)
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    gomp.GOMP_parallel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    gomp.GOMP_parallel(ctypes.cast(libc.free, ctypes.c_void_p), None, 2, 0)

    def child(_):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with mha_cy.threads(2):
                m = mha_cy.MultiHeadAttention(64, 4, seed=0)
                x = np.ones((4, 300, 64), np.float32)
                out = m(x)
                n = mha_cy.get_num_threads()
        return bool(np.isfinite(out).all()), n, [str(w.message) for w in caught]

    if __name__ == "__main__":
        pool = multiprocessing.get_context("fork").Pool(1)
        try:
            ok, n, messages = pool.map_async(child, [0]).get(timeout=60)[0]
        except multiprocessing.TimeoutError:
            print("HANG")
            sys.exit(3)
        finally:
            pool.terminate()
        print(ok, n, any("forked" in m for m in messages))
    """
)


@needs_fork
@pytest.mark.skipif(not openmp_enabled() or not sys.platform.startswith("linux"),
                    reason="needs GNU OpenMP on Linux")
def test_fork_child_of_a_foreign_openmp_pool_runs_single_threaded(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(_FOREIGN_OPENMP_PARENT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=180, env=env, cwd=root)
    assert "HANG" not in result.stdout, "the fork child hung in libgomp"
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "1", "True"]
