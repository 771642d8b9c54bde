# The only place in mha_cy that touches the OpenMP API.
#
# Kernels `cimport` from here instead of `openmp`, so that a build without
# OpenMP (no -fopenmp, `_OPENMP` undefined) still compiles and runs serially:
# the verbatim C below is pasted into every module that cimports this file
# and falls back to "one thread, thread number 0" when `_OPENMP` is not
# defined.  (Cython's own `prange`/`parallel` need no such help: Cython guards
# its OpenMP pragmas with `#ifdef _OPENMP` itself.)
#
# Usage in a kernel:
#     from ._openmp_helpers cimport mha_omp_get_thread_num
#     with nogil, parallel(num_threads=n_threads):
#         tid = mha_omp_get_thread_num()      # index of per-thread scratch

cdef extern from *:
    """
    #ifdef _OPENMP
    #include <omp.h>
    #define MHA_OPENMP_ENABLED 1
    static inline int mha_omp_get_max_threads(void) { return omp_get_max_threads(); }
    static inline int mha_omp_get_thread_num(void) { return omp_get_thread_num(); }
    static inline int mha_omp_get_num_threads(void) { return omp_get_num_threads(); }
    static inline void mha_omp_barrier(void) {
        #pragma omp barrier
    }
    #else
    #define MHA_OPENMP_ENABLED 0
    static inline int mha_omp_get_max_threads(void) { return 1; }
    static inline int mha_omp_get_thread_num(void) { return 0; }
    static inline int mha_omp_get_num_threads(void) { return 1; }
    static inline void mha_omp_barrier(void) { }
    #endif
    """
    # 1 when compiled with OpenMP, else 0 (a compile-time constant).
    const bint MHA_OPENMP_ENABLED
    # omp_get_max_threads(): threads a new parallel region would use by default.
    int mha_omp_get_max_threads() noexcept nogil
    # omp_get_thread_num(): 0 .. team size - 1 inside a parallel region, 0 outside.
    int mha_omp_get_thread_num() noexcept nogil
    # omp_get_num_threads(): size of the current team (1 outside a parallel region).
    int mha_omp_get_num_threads() noexcept nogil
    # #pragma omp barrier: every thread of the team waits here for the others. Cython's
    # prange inside `with parallel()` ends without one (nowait); a second prange that reads
    # what the first one wrote needs it. Every thread of the team must reach it.
    void mha_omp_barrier() noexcept nogil
