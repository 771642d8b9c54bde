"""One thread-count contract for the whole API, and BLAS kept single-threaded.

Thread count
------------
``get_num_threads()`` is the number of OpenMP threads every kernel uses.  By
default it is the number of cores this process may really use:

    min(CPUs in the affinity mask (os.sched_getaffinity),
        the cgroup CPU quota (containers: cpu.max / cpu.cfs_quota_us),
        OMP_NUM_THREADS (its first entry, when set to a positive integer),
        omp_get_max_threads() (which also follows omp_set_num_threads(), e.g.
                               threadpoolctl's threadpool_limits(n, "openmp")))

and always 1 in a build without OpenMP (``build_info()['openmp']`` is False).
The affinity, the cgroup quota and OMP_NUM_THREADS are read once, at the first
call (as the OpenMP runtime itself reads OMP_NUM_THREADS once, at start-up);
change the count at run time with ``set_num_threads``.

``set_num_threads(n)`` sets the default for the whole process (an int from 1
to ``MAX_NUM_THREADS``, not clamped to the core count: asking for more threads
than cores is allowed, it oversubscribes); ``set_num_threads(None)`` goes back
to the automatic default.  Larger n raise ValueError: ``MAX_NUM_THREADS`` =
max(64, 4 x os.cpu_count()), since more threads can only oversubscribe, and a
team the system cannot create makes libgomp exit the process
("Thread creation failed") instead of raising.

``threads(n)`` overrides that for the duration of a ``with`` block and then
restores the previous setting, also when the block raises.  It is a context
variable (contextvars): it applies to the Python thread, or asyncio task, that
entered the block, so blocks that overlap in several Python threads or tasks
never see or undo each other's setting.  A new Python thread starts with the
process-wide ``set_num_threads`` value.

BLAS
----
Our kernels call BLAS (through ``scipy.linalg.cython_blas``) from inside their
own OpenMP parallel regions, so BLAS itself must run on one thread or the cores
get N x M threads.  ``blas_single_threaded()`` is the context manager every
forward call is wrapped in: it sets the thread count of *scipy's* BLAS (the
library cython_blas calls; scipy's wheels bundle their own OpenBLAS, a library
separate from the one NumPy's wheels bundle) to 1 and restores it at the end.
NumPy's BLAS is never touched.  It is cheap (well under a microsecond when the
count is already 1, about a microsecond when it has to change it) because it
calls the BLAS's own get/set functions directly rather than going through
``threadpoolctl.threadpool_limits`` (tens of microseconds).

It is reentrant and safe across Python threads: nested or concurrent forward
calls share one "hold" (a counter under a lock); the first one in saves the
previous count and sets 1, the last one out restores it, unless someone else
changed the count meanwhile (their value then stays).  If the count is already
1 it does nothing.  BLAS libraries threaded with OpenMP (rather than pthreads,
as in scipy's wheels) are left alone: OpenMP does not nest by default, so their
calls from inside our parallel regions already run serially.

The count is process-wide state (OpenBLAS's ``openblas_set_num_threads_local``
is no way out: in pthreads builds, scipy's 0.3.30 included, it sets the global
count too, and OpenBLAS only runs serially inside an OpenMP region when it is
itself built with OpenMP).  So one race is left that no holder can fix: a
``threadpool_limits`` entered in another thread *during* a hold saves our
temporary 1 and, if it leaves after the hold, restores that 1.
"""

import contextvars
import math
import operator
import os
import threading
import warnings

from ._openmp_helpers import openmp_enabled, openmp_max_threads

__all__ = [
    "MAX_NUM_THREADS",
    "blas_single_threaded",
    "get_num_threads",
    "set_num_threads",
    "threads",
]

_lock = threading.Lock()
_user_num_threads = None  # set_num_threads(): None = the automatic default
# threads(n) blocks: per Python thread / asyncio task; _UNSET = use _user_num_threads.
_UNSET = object()
_context_num_threads = contextvars.ContextVar("mha_cy_num_threads", default=_UNSET)
# Above this, a request can only oversubscribe, and libgomp exits the process when it
# cannot create the team: refuse it up front (see the module docstring).
MAX_NUM_THREADS = max(64, 4 * (os.cpu_count() or 1))
_cpu_limit = None  # affinity / cgroup / OMP_NUM_THREADS bound, read once
_OPENMP = openmp_enabled()

# GNU OpenMP (libgomp) cannot run a parallel region in a child forked after the parent started
# its thread pool: the child hangs (multiprocessing's default "fork" start method on Linux).
# Such a child therefore runs the kernels on one thread, with a warning.  Our own kernels are
# not the only ones that start that pool (another extension, a ctypes GOMP_parallel), and
# libgomp has no API that says whether it did, so at fork time the parent also counts its
# OS threads (/proc/self/task): any thread Python does not know about may be an OpenMP
# worker.  That is conservative (a BLAS thread pool counts too): a child slower than it
# could be, but never one that hangs.
_parallel_used = False          # a kernel may have started OpenMP threads in this process
_forked_after_parallel = False  # this process is a fork of one where that happened
_native_threads_at_fork = False  # set in the parent just before a fork


def _native_threads_running():
    """True when the process has OS threads that are not Python threads (or cannot tell)."""
    try:
        n_os = len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux: only our own kernels are known
        return False
    return n_os > threading.active_count()


def _before_fork():
    global _native_threads_at_fork
    _native_threads_at_fork = _OPENMP and _native_threads_running()


def _after_fork_in_child():
    global _forked_after_parallel, _blas_lock, _blas_depth, _blas_restore
    _forked_after_parallel = _forked_after_parallel or _parallel_used or _native_threads_at_fork
    # The holders of the parent's "BLAS on 1 thread" hold did not come along (only the forking
    # thread did): give the child its BLAS count back, and a fresh lock (it may have been
    # held by a thread that no longer exists).
    _blas_lock = threading.Lock()
    _blas_depth = 0
    if _blas_restore is not None:
        n, _blas_restore = _blas_restore, None
        if _scipy_blas.get() == 1:
            _scipy_blas.set(n)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


# -- thread count --------------------------------------------------------------


def _cgroup_cpu_quota():
    """CPUs allowed by a cgroup CPU quota (rounded up), or None when unlimited."""
    quota = period = None
    try:  # cgroup v2
        with open("/sys/fs/cgroup/cpu.max") as f:
            fields = f.read().split()
        if fields and fields[0] != "max":
            quota, period = int(fields[0]), int(fields[1])
    except (OSError, ValueError, IndexError):
        try:  # cgroup v1
            with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as f:
                quota = int(f.read())
            with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
                period = int(f.read())
        except (OSError, ValueError):
            return None
    if quota is None or period is None or quota <= 0 or period <= 0:
        return None
    return max(1, math.ceil(quota / period))


def _omp_num_threads_env():
    """First entry of OMP_NUM_THREADS when it is a positive integer, else None."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    try:
        n = int(value.split(",")[0])
    except ValueError:
        return None
    return n if n >= 1 else None


def _cpu_limit_once():
    """min(affinity, cgroup quota, OMP_NUM_THREADS), read at the first call only."""
    global _cpu_limit
    if _cpu_limit is None:
        try:
            n = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # not on Linux
            n = os.cpu_count() or 1
        for limit in (_cgroup_cpu_quota(), _omp_num_threads_env()):
            if limit is not None:
                n = min(n, limit)
        _cpu_limit = max(1, n)
    return _cpu_limit


def _default_num_threads():
    if not _OPENMP:
        return 1
    # omp_get_max_threads() is asked every time (cheap): it follows
    # omp_set_num_threads() / threadpoolctl's limits on OpenMP.
    return max(1, min(_cpu_limit_once(), openmp_max_threads()))


def _check_num_threads(n):
    """n validated for set_num_threads / threads: None or an int in 1..MAX_NUM_THREADS."""
    if n is None:
        return None
    try:
        if isinstance(n, bool):  # an int subclass, but surely a mistake here
            raise TypeError
        n = operator.index(n)  # int, numpy integers
    except TypeError:
        raise TypeError(
            f"n must be an int >= 1 or None, got {type(n).__name__} {n!r}"
        ) from None
    if n < 1:
        raise ValueError(f"n must be an int >= 1 or None, got {n!r}")
    if n > MAX_NUM_THREADS:
        raise ValueError(
            f"n must be an int >= 1 or None, at most MAX_NUM_THREADS = {MAX_NUM_THREADS} "
            f"(4 x the CPU count, at least 64); got {n!r}")
    return n


def set_num_threads(n):
    """Set the number of threads every mha_cy kernel uses, for the whole process.

    Parameters
    ----------
    n : int in 1..MAX_NUM_THREADS, or None
        Larger n raise ValueError (see the module docstring).  None restores
        the default: the cores this process may use (affinity, cgroup quota,
        OMP_NUM_THREADS, omp_get_max_threads()).  In a build
        without OpenMP the kernels run on 1 thread whatever ``n`` is.
    """
    global _user_num_threads
    n = _check_num_threads(n)
    with _lock:
        _user_num_threads = n


def get_num_threads():
    """Number of threads the kernels will use (always 1 without OpenMP, and 1 in a process
    forked from one whose kernels had started OpenMP threads: see _after_fork_in_child)."""
    n = _context_num_threads.get()
    if n is _UNSET:
        n = _user_num_threads  # one read: no lock needed
    n = _default_num_threads() if n is None else (n if _OPENMP else 1)
    if n > 1 and _forked_after_parallel:
        _warn_forked_once()
        return 1
    return n


def kernel_threads():
    """get_num_threads(), for a kernel call about to run (which may start OpenMP threads)."""
    global _parallel_used
    n = get_num_threads()
    if n > 1:
        _parallel_used = True
    return n


_warned_forked = False


def _warn_forked_once():
    global _warned_forked
    if not _warned_forked:
        _warned_forked = True
        warnings.warn(
            "mha_cy runs single-threaded in this process: it was forked after OpenMP threads "
            "had (or may have) started in its parent, and GNU OpenMP hangs in such a child. "
            "Use the 'spawn' "
            "or 'forkserver' start method of multiprocessing for parallel kernels.",
            RuntimeWarning, stacklevel=3)


class threads:
    """``with threads(n): ...`` uses n threads inside, then restores the previous setting.

    ``n`` as for :func:`set_num_threads` (None: the automatic default).  The
    previous setting comes back also when the block raises.  The setting is a
    context variable: it applies only to the Python thread (or asyncio task)
    that entered the block, and overrides ``set_num_threads`` there.  Blocks nest
    like any context manager: one left out of order (a generator suspended inside
    one block and closed inside another) leaves the other's setting behind.  One
    ``threads(n)`` object is one block: entering it again while it is open raises
    RuntimeError (``contextlib`` named no cause).
    """

    def __init__(self, n):
        self._n = _check_num_threads(n)
        self._token = None

    def __enter__(self):
        if self._token is not None:
            raise RuntimeError("this threads() block is already open: make a new one, "
                               "mha_cy.threads(n), for a nested block")
        self._token = _context_num_threads.set(self._n)
        return get_num_threads()

    def __exit__(self, exc_type, exc, tb):
        token, self._token = self._token, None
        _context_num_threads.reset(token)
        return False


# -- scipy's BLAS ----------------------------------------------------------------


class _ScipyBlas:
    """Lazily found handle on the BLAS library scipy.linalg.cython_blas calls."""

    def __init__(self):
        self._lock = threading.Lock()
        self._loaded = False
        self.controller = None  # threadpoolctl.LibController, or None if not found
        self.get = None  # fast get_num_threads() -> int
        self.set = None  # fast set_num_threads(int)

    def load(self):
        if self._loaded:
            return self
        with self._lock:
            if not self._loaded:
                self._find()
                self._loaded = True
        return self

    @staticmethod
    def _is_scipys(filepath):
        # scipy's wheels keep their BLAS in site-packages/scipy.libs (Linux),
        # scipy/.dylibs (macOS) or scipy.libs / scipy/.libs (Windows).  Look at
        # the directories only: NumPy's bundled BLAS is *named*
        # libscipy_openblas64_ but lives in numpy.libs / numpy/.dylibs.
        parts = os.path.normcase(os.path.dirname(os.path.realpath(filepath)))
        return any(
            p == "scipy" or p.startswith("scipy.") for p in parts.split(os.sep)
        )

    def _find(self):
        import scipy.linalg.cython_blas  # noqa: F401, PLC0415  (loads scipy's BLAS)
        from threadpoolctl import ThreadpoolController  # noqa: PLC0415

        blas = [
            lib
            for lib in ThreadpoolController().lib_controllers
            if lib.user_api == "blas"
        ]
        ours = [lib for lib in blas if self._is_scipys(lib.filepath)]
        if not ours and len(blas) == 1:
            # scipy linked against a system / conda BLAS; with a single BLAS in
            # the process it is the one (and NumPy shares it: nothing to keep apart).
            ours = blas
        if not ours:
            return
        lib = ours[0]
        self.controller = lib
        if getattr(lib, "threading_layer", None) == "openmp":
            return  # see module docstring: nothing to do, leave get/set None
        get = set_ = None
        get_symbol = getattr(lib, "_get_symbol", None)  # threadpoolctl >= 3.2
        if lib.internal_api == "openblas" and get_symbol is not None:
            # The raw OpenBLAS entry points (ctypes, ~0.2 us a call).  Going
            # through lib.set_num_threads() would hit threadpoolctl's
            # "controlling thread" rule for pthreads OpenBLAS, under which calls
            # from any Python thread but the first one are silently ignored.
            get = get_symbol("openblas_get_num_threads")
            set_ = get_symbol("openblas_set_num_threads")
        if get is None or set_ is None:
            get, set_ = lib.get_num_threads, lib.set_num_threads
        self.get, self.set = get, set_

    def info(self):
        """threadpoolctl's info dict of scipy's BLAS, or None when not found."""
        self.load()
        if self.controller is None:
            return None
        return self.controller.info()


_scipy_blas = _ScipyBlas()


# State of the process-wide "scipy's BLAS on 1 thread" hold: how many holders
# are inside, and the thread count to restore when the last one leaves (None
# when there is nothing to restore: it was 1 already, or no BLAS was found).
_blas_lock = threading.Lock()
_blas_depth = 0
_blas_restore = None


class _BlasSingleThreaded:
    """Reentrant, thread-safe context manager; one instance serves the process."""

    __slots__ = ()

    def __enter__(self):
        global _blas_depth, _blas_restore
        with _blas_lock:
            if _blas_depth == 0:
                blas = _scipy_blas if _scipy_blas._loaded else _scipy_blas.load()
                if blas.get is not None:
                    n = blas.get()
                    if n is not None and n != 1:
                        blas.set(1)
                        _blas_restore = n
            _blas_depth += 1
        return self

    def __exit__(self, exc_type, exc, tb):
        global _blas_depth, _blas_restore
        with _blas_lock:
            # max(): a hold entered before a fork leaves in the child, whose depth restarted at 0
            _blas_depth = max(0, _blas_depth - 1)
            if _blas_depth == 0 and _blas_restore is not None:
                n, _blas_restore = _blas_restore, None
                # Restore only our own 1: a count someone else set during the hold (e.g.
                # another thread's threadpool_limits leaving) is theirs and must stay.
                if _scipy_blas.get() == 1:
                    _scipy_blas.set(n)
        return False


_BLAS_SINGLE_THREADED = _BlasSingleThreaded()


def blas_single_threaded():
    """Context manager: scipy's BLAS runs on 1 thread inside, as before outside.

    Wrap every call into a kernel that calls BLAS from OpenMP threads::

        with blas_single_threaded():
            _kernel(..., n_threads=get_num_threads())

    Reentrant and safe to use from several Python threads at once; leaves
    NumPy's BLAS alone; does nothing if scipy's BLAS already runs on 1 thread.
    """
    return _BLAS_SINGLE_THREADED


def _scipy_blas_info():
    """threadpoolctl info dict of scipy's BLAS (for build_info), or None."""
    return _scipy_blas.info()
