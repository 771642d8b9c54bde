"""The projections of multi-head attention: out := x @ weight.T + bias, split over threads.

x (M, K) rows are tokens, weight (N, K) is an nn.Linear weight. The work is cut into one
block per thread, each one single-threaded BLAS call on disjoint output: by output columns
when N is wide enough (each thread then reads only its own rows of the weight, which matters
for decode steps where M is tiny and the weight dominates the traffic), else by rows. With a
handful of rows against a weight larger than L2 (decode steps), a block is computed by
src/small_gemm.c instead of BLAS.
"""
from cython cimport floating
from cython.parallel cimport parallel, prange

from ._cython_blas cimport _gemm, NoTrans, Trans

cdef extern from "small_gemm.h" nogil:
    enum: MHA_SMALL_GEMM_MAX_ROWS
    enum: MHA_SMALL_GEMM_MIN_WEIGHT_BYTES
    void mha_small_gemm_f32(const float *x, Py_ssize_t ldx, const float *w, Py_ssize_t ldw,
                            const float *bias, float *out, Py_ssize_t ldo,
                            Py_ssize_t m, Py_ssize_t n, Py_ssize_t k)
    void mha_small_gemm_f64(const double *x, Py_ssize_t ldx, const double *w, Py_ssize_t ldw,
                            const double *bias, double *out, Py_ssize_t ldo,
                            Py_ssize_t m, Py_ssize_t n, Py_ssize_t k)

# Column blocks narrower than this make BLAS inefficient: split rows instead.
cdef Py_ssize_t MIN_COLS_PER_THREAD = 128
# Waking a thread costs microseconds: give each at least this many flops (~10 us of work).
cdef double MIN_FLOPS_PER_THREAD = 1e6


cdef void _linear_block(const floating *x, Py_ssize_t ldx, const floating *w, Py_ssize_t ldw,
                        const floating *bias, floating *out, Py_ssize_t ldo,
                        Py_ssize_t m, Py_ssize_t n, Py_ssize_t k, bint few_rows) noexcept nogil:
    """out[m, n] := x[m, k] @ w[n, k]^T + bias[n] (bias may be NULL); few_rows: use
    src/small_gemm.c instead of BLAS."""
    cdef Py_ssize_t i, j
    cdef floating beta = 0
    if m <= 0 or n <= 0:
        return
    if few_rows:
        if floating is float:
            mha_small_gemm_f32(x, ldx, w, ldw, bias, out, ldo, m, n, k)
        else:
            mha_small_gemm_f64(x, ldx, w, ldw, bias, out, ldo, m, n, k)
        return
    if bias != NULL:
        for i in range(m):
            for j in range(n):
                out[i * ldo + j] = bias[j]
        beta = 1
    if k == 0:
        if bias == NULL:
            for i in range(m):
                for j in range(n):
                    out[i * ldo + j] = 0
        return
    _gemm(NoTrans, Trans, <int> m, <int> n, <int> k, <floating> 1, x, <int> ldx, w, <int> ldw,
          beta, out, <int> ldo)


def linear(const floating[:, ::1] x, const floating[:, ::1] weight, bias,
           floating[:, ::1] out, int n_threads):
    """out := x @ weight.T + bias (bias: None or a (N,) array of x's dtype).

    Shapes are checked by the caller (mha_cy.attention); this only asserts consistency.
    """
    cdef Py_ssize_t M = x.shape[0], K = x.shape[1], N = weight.shape[0]
    if weight.shape[1] != K or out.shape[0] != M or out.shape[1] != N:
        raise ValueError("linear: inconsistent shapes")
    cdef const floating[::1] bias_view
    cdef const floating *bias_ptr = NULL
    if bias is not None:
        bias_view = bias
        if bias_view.shape[0] != N:
            raise ValueError("linear: bias length differs from weight rows")
        bias_ptr = &bias_view[0]
    if M == 0 or N == 0:
        return out

    cdef const floating *x_ptr = &x[0, 0]
    cdef const floating *w_ptr = &weight[0, 0]
    cdef floating *o_ptr = &out[0, 0]
    cdef Py_ssize_t ldx = max(K, 1), ldo = N
    cdef double flops = 2.0 * M * N * K
    cdef Py_ssize_t n_useful = max(1, min(<Py_ssize_t> n_threads,
                                          <Py_ssize_t> (flops / MIN_FLOPS_PER_THREAD)))
    # decode steps: a few rows against a weight larger than L2 (small_gemm.h)
    cdef bint few_rows = (M <= MHA_SMALL_GEMM_MAX_ROWS
                          and N * K * sizeof(floating) >= MHA_SMALL_GEMM_MIN_WEIGHT_BYTES)
    cdef bint by_columns = N >= MIN_COLS_PER_THREAD * n_useful or M < n_useful or few_rows
    cdef Py_ssize_t extent = N if by_columns else M
    cdef Py_ssize_t n_blocks = min(n_useful, extent)
    # block size rounded up to 16 so column blocks start on cache-line-friendly offsets
    cdef Py_ssize_t block = (extent + n_blocks - 1) // n_blocks
    block = (block + 15) // 16 * 16
    n_blocks = (extent + block - 1) // block
    cdef Py_ssize_t t, start, size

    with nogil, parallel(num_threads=n_blocks):
        for t in prange(n_blocks, schedule='static'):
            start = t * block
            size = min(block, extent - start)
            if by_columns:
                _linear_block(x_ptr, ldx, w_ptr + start * ldx,
                              ldx, NULL if bias_ptr == NULL else bias_ptr + start,
                              o_ptr + start, ldo, M, size, K, few_rows)
            else:
                _linear_block(x_ptr + start * ldx, ldx, w_ptr, ldx, bias_ptr,
                              o_ptr + start * ldo, ldo, size, N, K, few_rows)
    return out
