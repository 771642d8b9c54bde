"""Thread-count contract (mha_cy._threads) and BLAS single-threading."""

import multiprocessing
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import scipy.linalg.cython_blas  # noqa: F401  (loads scipy's BLAS)
from threadpoolctl import ThreadpoolController

import mha_cy

from mha_cy._openmp_helpers import (
    _parallel_team_size,
    openmp_enabled,
    openmp_max_threads,
)
from mha_cy._threads import (
    _cgroup_cpu_quota,
    blas_single_threaded,
    get_num_threads,
    set_num_threads,
    threads,
)


@pytest.fixture(autouse=True)
def _reset_num_threads():
    set_num_threads(None)
    yield
    set_num_threads(None)


def _usable_cpus():
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count()
    quota = _cgroup_cpu_quota()  # containers with a CPU quota
    return n if quota is None else min(n, quota)


def _run_python(code, **env):
    """Run code in a fresh interpreter; return its stripped stdout."""
    full_env = {**os.environ, **env}
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=full_env,
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.strip()


# -- default and explicit thread counts ---------------------------------------------


def test_default_is_usable_cores():
    n = get_num_threads()
    assert isinstance(n, int)
    if openmp_enabled():
        assert n == min(_usable_cpus(), openmp_max_threads())
    else:
        assert n == 1


@pytest.mark.skipif(not openmp_enabled(), reason="serial build")
def test_default_honours_omp_num_threads():
    out = _run_python(
        "from mha_cy._threads import get_num_threads; print(get_num_threads())",
        OMP_NUM_THREADS="1",
    )
    assert out == "1"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no affinity API")
@pytest.mark.skipif(_usable_cpus() < 2, reason="needs 2 usable cores")
def test_default_honours_cpu_affinity():
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from mha_cy._threads import get_num_threads; print(get_num_threads())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "1"


@pytest.mark.skipif(not openmp_enabled(), reason="serial build")
def test_openmp_team_really_parallel():
    # -fopenmp reached both compile (pragmas) and link (runtime): a region asked
    # for 2 threads gets 2, even on a 1-core machine.
    assert _parallel_team_size(2) == 2
    assert _parallel_team_size(1) == 1


def test_set_get_round_trip():
    expected = (lambda n: n) if openmp_enabled() else (lambda n: 1)
    for n in (1, 2, 3, 7):
        set_num_threads(n)
        assert get_num_threads() == expected(n)
    set_num_threads(np.int64(2))  # numpy integers are integers
    assert get_num_threads() == expected(2)
    assert type(get_num_threads()) is int
    default = min(_usable_cpus(), openmp_max_threads()) if openmp_enabled() else 1
    set_num_threads(None)
    assert get_num_threads() == default


def test_threads_context_restores():
    expected = (lambda n: n) if openmp_enabled() else (lambda n: 1)
    default = get_num_threads()
    with threads(3) as n:
        assert n == get_num_threads() == expected(3)
        with threads(1):
            assert get_num_threads() == 1
        assert get_num_threads() == expected(3)
    assert get_num_threads() == default

    set_num_threads(2)
    with threads(None):
        assert get_num_threads() == default
    assert get_num_threads() == expected(2)


def test_threads_context_restores_on_exception():
    set_num_threads(2)
    with pytest.raises(RuntimeError, match="boom"):
        with threads(5):
            raise RuntimeError("boom")
    assert get_num_threads() == (2 if openmp_enabled() else 1)


def test_one_threads_block_cannot_be_entered_twice():
    """contextlib's AttributeError ('... has no attribute args') named no cause."""
    set_num_threads(2)
    block = threads(1)
    with block:
        with pytest.raises(RuntimeError, match=r"threads\(\) block is already open"):
            with block:
                pass  # pragma: no cover
        assert get_num_threads() == 1
    assert get_num_threads() == (2 if openmp_enabled() else 1)
    with block:                 # closed again: it may be reused
        assert get_num_threads() == 1


@pytest.mark.parametrize("bad", [0, -1, -100])
def test_bad_value_raises_value_error_naming_n(bad):
    with pytest.raises(ValueError, match=rf"\bn\b.*>= 1.*got {bad}"):
        set_num_threads(bad)
    with pytest.raises(ValueError, match=r"\bn\b"):
        with threads(bad):
            pass  # pragma: no cover


@pytest.mark.parametrize("bad", [1.0, 2.5, "2", True, [2]])
def test_bad_type_raises_type_error_naming_n(bad):
    with pytest.raises(TypeError, match=rf"\bn\b must be an int.*got {type(bad).__name__}"):
        set_num_threads(bad)


def test_bad_value_leaves_setting_alone():
    set_num_threads(2)
    with pytest.raises(ValueError):
        set_num_threads(0)
    assert get_num_threads() == (2 if openmp_enabled() else 1)


def test_setting_is_process_wide():
    set_num_threads(1)
    seen = []
    worker = threading.Thread(target=lambda: seen.append(get_num_threads()))
    worker.start()
    worker.join()
    assert seen == [1]


# -- BLAS single-threading -------------------------------------------------------------


def _is_under(filepath, package):
    parts = os.path.dirname(os.path.realpath(filepath)).split(os.sep)
    return any(p == package or p.startswith(package + ".") for p in parts)


def _blas_libs():
    blas = [
        lib for lib in ThreadpoolController().lib_controllers if lib.user_api == "blas"
    ]
    scipy_libs = [lib for lib in blas if _is_under(lib.filepath, "scipy")]
    numpy_libs = [lib for lib in blas if _is_under(lib.filepath, "numpy")]
    return scipy_libs, numpy_libs


_SCIPY_LIBS, _NUMPY_LIBS = _blas_libs()
needs_scipy_blas = pytest.mark.skipif(
    len(_SCIPY_LIBS) != 1 or _SCIPY_LIBS[0].threading_layer == "openmp",
    reason="scipy does not bundle its own pthreads BLAS here",
)


def _scipy_threads():
    return _SCIPY_LIBS[0].get_num_threads()


def _numpy_threads():
    return [lib.get_num_threads() for lib in _NUMPY_LIBS]


@pytest.fixture
def scipy_blas_two_threads():
    """scipy's BLAS on 2 threads for the test (whatever the core count), then as before."""
    lib = _SCIPY_LIBS[0]
    before = lib.get_num_threads()
    lib.set_num_threads(2)
    assert lib.get_num_threads() == 2
    yield
    lib.set_num_threads(before)
    if hasattr(type(lib), "clear_controlling_thread"):  # threadpoolctl >= 3.8
        type(lib).clear_controlling_thread(force=True)


@needs_scipy_blas
def test_blas_single_threaded_sets_and_restores(scipy_blas_two_threads):
    numpy_before = _numpy_threads()
    with blas_single_threaded():
        assert _scipy_threads() == 1
        assert _numpy_threads() == numpy_before  # numpy's own BLAS is untouched
        with blas_single_threaded():  # reentrant
            assert _scipy_threads() == 1
        assert _scipy_threads() == 1  # inner exit does not restore early
    assert _scipy_threads() == 2
    assert _numpy_threads() == numpy_before


@needs_scipy_blas
def test_blas_single_threaded_restores_on_exception(scipy_blas_two_threads):
    with pytest.raises(KeyError):
        with blas_single_threaded():
            assert _scipy_threads() == 1
            raise KeyError("x")
    assert _scipy_threads() == 2


@needs_scipy_blas
def test_blas_single_threaded_noop_when_already_one():
    lib = _SCIPY_LIBS[0]
    before = lib.get_num_threads()
    lib.set_num_threads(1)
    try:
        with blas_single_threaded():
            assert _scipy_threads() == 1
        assert _scipy_threads() == 1
    finally:
        lib.set_num_threads(before)


@needs_scipy_blas
def test_blas_single_threaded_overlapping_python_threads(scipy_blas_two_threads):
    # A enters, B enters, A leaves (B still inside: must stay 1), B leaves.
    a_in, b_in, a_out, b_may_leave = (threading.Event() for _ in range(4))
    seen = {}

    def thread_a():
        with blas_single_threaded():
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def thread_b():
        a_in.wait(5)
        with blas_single_threaded():
            b_in.set()
            a_out.wait(5)
            seen["b_after_a_left"] = _scipy_threads()
            b_may_leave.wait(5)

    workers = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for w in workers:
        w.start()
    a_out.wait(5)
    b_may_leave.set()
    for w in workers:
        w.join(5)
    assert seen == {"b_after_a_left": 1}
    assert _scipy_threads() == 2


@needs_scipy_blas
def test_blas_single_threaded_when_another_thread_controls_openblas(
    scipy_blas_two_threads,
):
    # threadpoolctl lets only one Python thread at a time set a pthreads
    # OpenBLAS's thread count.  Make another, still-alive thread the controller
    # and check that blas_single_threaded works anyway from this one.
    lib = _SCIPY_LIBS[0]
    taken, release = threading.Event(), threading.Event()

    def controller_thread():
        if hasattr(type(lib), "clear_controlling_thread"):
            type(lib).clear_controlling_thread(force=True)
        lib.set_num_threads(2)  # becomes the controlling thread
        taken.set()
        release.wait(5)

    worker = threading.Thread(target=controller_thread)
    worker.start()
    try:
        taken.wait(5)
        with blas_single_threaded():
            assert _scipy_threads() == 1
        assert _scipy_threads() == 2
    finally:
        release.set()
        worker.join(5)


@needs_scipy_blas
def test_blas_single_threaded_from_worker_thread(scipy_blas_two_threads):
    seen = []

    def work():
        with blas_single_threaded():
            seen.append(_scipy_threads())

    worker = threading.Thread(target=work)
    worker.start()
    worker.join(5)
    assert seen == [1]
    assert _scipy_threads() == 2


# -- fork ------------------------------------------------------------------------

_FORK_MODULE = _FORK_INPUT = None     # set by the test before forking, read by the child
_OPENMP = openmp_enabled()


def _forward_in_child(_):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _FORK_MODULE(_FORK_INPUT)
        n = mha_cy.get_num_threads()
    return out, n, [str(w.message) for w in caught]


@pytest.mark.skipif(not hasattr(os, "fork") or not _OPENMP, reason="needs fork and OpenMP")
def test_forked_child_runs_single_threaded_instead_of_hanging():
    """GNU OpenMP hangs in a child forked after the parent started OpenMP threads (the default
    start method of multiprocessing on Linux): such a child must run on one thread, warn, and
    give the parent's result."""
    global _FORK_MODULE, _FORK_INPUT
    _FORK_MODULE = mha_cy.MultiHeadAttention(64, 4, seed=0)
    _FORK_INPUT = np.random.default_rng(0).standard_normal((2, 300, 64)).astype(np.float32)
    with mha_cy.threads(2):
        expected = _FORK_MODULE(_FORK_INPUT)        # starts the OpenMP thread pool
        pool = multiprocessing.get_context("fork").Pool(1)
        try:
            out, n, messages = pool.map_async(_forward_in_child, [0]).get(timeout=120)[0]
        finally:
            pool.terminate()
    assert n == 1
    assert any("forked" in m for m in messages)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
