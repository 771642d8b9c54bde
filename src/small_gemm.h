/* Projections of a few rows (decode steps): out = x @ w^T + bias when x has a handful of rows.
 *
 * BLAS GEMM is built for many rows; with a few rows it streams the weight matrix far below the
 * memory bandwidth (measured, 1 thread, 4096 x 6144 weight: 4 rows in 20.7 ms with OpenBLAS,
 * 7.3 ms here). Here weight rows are read from memory once, in panels that stay in L2 while
 * every group of 4 rows of x passes over them, each vector of x and w loaded once per block
 * of accumulators. Above MHA_SMALL_GEMM_MAX_ROWS rows, BLAS is faster again (32 rows: 33 ms
 * against 45 ms here). */
#ifndef MHA_SMALL_GEMM_H
#define MHA_SMALL_GEMM_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Rows of x up to which the small-m path beats BLAS. */
#define MHA_SMALL_GEMM_MAX_ROWS 16

/* out[i, j] = sum_k x[i, k] w[j, k] + bias[j]  for i < m, j < n.
 * x: m rows of k values, row stride ldx; w: n rows of k values, row stride ldw;
 * bias: n values or NULL; out: m rows of n values, row stride ldo (all strides in elements). */
void mha_small_gemm_f32(const float *x, ptrdiff_t ldx, const float *w, ptrdiff_t ldw,
                        const float *bias, float *out, ptrdiff_t ldo,
                        ptrdiff_t m, ptrdiff_t n, ptrdiff_t k);
void mha_small_gemm_f64(const double *x, ptrdiff_t ldx, const double *w, ptrdiff_t ldw,
                        const double *bias, double *out, ptrdiff_t ldo,
                        ptrdiff_t m, ptrdiff_t n, ptrdiff_t k);

#ifdef __cplusplus
}
#endif

#endif
