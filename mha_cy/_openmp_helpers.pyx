"""Python view of the OpenMP status of this build (see _openmp_helpers.pxd)."""

# The cdef names of _openmp_helpers.pxd are in scope here automatically.
from cython.parallel cimport parallel


def openmp_enabled():
    """True when this build was compiled and linked with OpenMP."""
    return bool(MHA_OPENMP_ENABLED)


def openmp_max_threads():
    """omp_get_max_threads() of the calling thread (1 in a serial build).

    Honours OMP_NUM_THREADS (as read when the OpenMP runtime started) and any
    omp_set_num_threads() call, e.g. threadpoolctl's
    ``threadpool_limits(n, user_api="openmp")``.
    """
    return int(mha_omp_get_max_threads())


def _parallel_team_size(int n_threads):
    """Size of the team a `parallel(num_threads=n_threads)` region really gets.

    Test shim: proves the OpenMP pragmas were compiled in and the runtime was
    linked (a serial build always returns 1).
    """
    if n_threads < 1:
        raise ValueError(f"n_threads must be >= 1, got {n_threads!r}")
    cdef int team_size = 0
    cdef int *team_size_ptr = &team_size    # shared: written by thread 0 only
    with nogil, parallel(num_threads=n_threads):
        if mha_omp_get_thread_num() == 0:
            team_size_ptr[0] = mha_omp_get_num_threads()
    return int(team_size)
