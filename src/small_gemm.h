/* Projections of a few rows (decode steps): out = x @ w^T + bias when x has a handful of rows.
 *
 * BLAS GEMM is built for many rows; with a few rows it streams the weight matrix far below the
 * memory bandwidth (measured, 1 thread, 4096 x 6144 weight: 4 rows in 20.7 ms with OpenBLAS,
 * 7.3 ms here). Here weight rows are read from memory once, in panels that stay in L2 while
 * every group of 4 rows of x passes over them, each vector of x and w loaded once per block
 * of accumulators. With more rows BLAS catches up (16 rows: 25.7 ms in BLAS, 23.6 ms here;
 * 32 rows: 33 ms against 45 ms). Zen 1 (AVX2), 1 thread, CPU time, same weight: 1 row 5.6 ms
 * (18 GB/s, the core's read rate), 4 rows 8.1 ms, 8 rows 12.9 ms (they were 17.5 and 34.5 ms
 * before the accumulators became register-sized vector types). */
#ifndef MHA_SMALL_GEMM_H
#define MHA_SMALL_GEMM_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Up to this many rows of x the small-m path runs, whatever the weight's size. Against BLAS it
 * won only for weights too large for L2 (1 x 256 @ 256 x 768: 12 us in BLAS, 18 us here), but
 * the alternative is now row_panel_gemm.c, which computes whole panels of 16 rows: for one row
 * that is 16x the work. Measured (Zen 1, 1 thread, float32, us, panels -> here):
 *   1 x 64 @ 64 x 192     13.5 -> 3.8       1 x 256 @ 256 x 768   169 -> 21
 *   4 x 256 @ 256 x 768    172 -> 61        8 x 256 @ 256 x 768   174 -> 118
 *   8 x 512 @ 512 x 1536   427 -> 423      12 rows 675 -> 623, 16 rows 686 -> 846 (panels win)
 * A weight-size floor stays as a tuning knob (_set_small_gemm_rule), 0 by default. */
#define MHA_SMALL_GEMM_MAX_ROWS 8
#define MHA_SMALL_GEMM_MIN_WEIGHT_BYTES 0

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
