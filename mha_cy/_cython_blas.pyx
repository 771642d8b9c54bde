"""Row-major BLAS routines over scipy.linalg.cython_blas, callable without the GIL.

BLAS is column-major; a row-major matrix is the transpose of a column-major one, so the
row-major product C = op(A) op(B) is computed as the column-major C^T = op(B)^T op(A)^T by
swapping the operands. The `_memview` shims exist for the tests only.
"""
from scipy.linalg.cython_blas cimport sgemm, dgemm

cdef void _gemm(BLAS_Trans ta, BLAS_Trans tb, int m, int n, int k, floating alpha,
                const floating *A, int lda, const floating *B, int ldb, floating beta,
                floating *C, int ldc) noexcept nogil:
    """C := alpha * op(A).op(B) + beta * C   (row-major; C is m x n, op(A) m x k, op(B) k x n)

    With IEEE arithmetic for alpha = 0 too: BLAS does not read A and B then (C := beta * C),
    so a NaN or inf in them would not reach C (the attention's scores at scale=0). That case
    (beta = 0, the only one the kernels use) multiplies by 1, then C by alpha."""
    cdef char ta_c = ta, tb_c = tb
    cdef floating one = 1
    cdef Py_ssize_t i, j
    if alpha == 0 and beta == 0 and k > 0:
        _gemm(ta, tb, m, n, k, one, A, lda, B, ldb, beta, C, ldc)
        for i in range(m):
            for j in range(n):
                C[i * ldc + j] = C[i * ldc + j] * alpha
        return
    if floating is float:
        sgemm(&tb_c, &ta_c, &n, &m, &k, &alpha, <float *> B, &ldb, <float *> A, &lda,
              &beta, C, &ldc)
    else:
        dgemm(&tb_c, &ta_c, &n, &m, &k, &alpha, <double *> B, &ldb, <double *> A, &lda,
              &beta, C, &ldc)


def _gemm_memview(BLAS_Trans ta, BLAS_Trans tb, floating alpha, const floating[:, ::1] A,
                  const floating[:, ::1] B, floating beta, floating[:, ::1] C):
    """Test shim: C := alpha * op(A).op(B) + beta * C on C-contiguous arrays."""
    cdef int m = C.shape[0], n = C.shape[1]
    cdef int k = A.shape[1] if ta == NoTrans else A.shape[0]
    with nogil:
        _gemm(ta, tb, m, n, k, alpha, &A[0, 0], <int> A.shape[1], &B[0, 0], <int> B.shape[1],
              beta, &C[0, 0], <int> C.shape[1])
