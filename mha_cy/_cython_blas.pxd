# Row-major BLAS for the kernels, over scipy.linalg.cython_blas (no Python, nogil).
from cython cimport floating

cpdef enum BLAS_Trans:
    NoTrans = 110  # 'n'
    Trans = 116    # 't'

cdef void _gemm(BLAS_Trans ta, BLAS_Trans tb, int m, int n, int k, floating alpha,
                const floating *A, int lda, const floating *B, int ldb, floating beta,
                floating *C, int ldc) noexcept nogil
