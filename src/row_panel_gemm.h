/* Projections of a moderate number of token rows: out = x @ w^T + bias, without BLAS.
 *
 * For a few dozen rows OpenBLAS pays a fixed cost per call (buffers, packing both operands)
 * that dominates: 16 x 64 @ 64 x 192 ran at 10 GFLOP/s where large products reach 33-38
 * (one Zen 1 core). Here only x is packed, transposed into panels of MHA_PANEL_ROWS rows
 * (k-major: panel[k][r] = x[r][k]), which costs m * k, nothing next to the m * n * k product;
 * the weight is read in place, in its nn.Linear layout (n rows of k), so there is no packed
 * copy of it to go stale when the user edits the weights. The micro-kernel holds a block of
 * weight rows x panels in registers: per k it broadcasts each weight row's value and multiplies
 * it by the panels' rows of x (AVX2: 6 weight rows x one panel, two vectors of 8 floats;
 * AVX-512: 12 weight rows x two panels, a vector of 16 floats each). On AVX2 a
 * last panel of at most half its rows (8 floats, 4 doubles) runs a half-width kernel instead,
 * one vector against 12 weight rows: the padding rows of a whole panel cost as much as real
 * ones.
 * Each output is one chain of FMAs over k in order: the result does not depend on how the
 * columns are split among threads.
 *
 * Measured against OpenBLAS 0.3.30 (Haswell kernels), one core of a Zen 1 EPYC, float32,
 * CPU time, GFLOP/s blas -> here: 16x64 @ 64x192 (a tiny layer's QKV) 10.2 -> 25.4;
 * 16x768 @ 768x2304 11.7 -> 35.4; 128x768 @ 768x2304 (a BERT encoder call) 32.8 -> 37.4;
 * 256 rows 30.8 -> 38.1; 1024 rows 34.2 -> 36.2. mha_cy/_linear_kernel.pyx uses it for every
 * row count: its BLAS tiles above 256 rows ran 2-4x slower than that (PANEL_MAX_ROWS there). */
#ifndef MHA_ROW_PANEL_GEMM_H
#define MHA_ROW_PANEL_GEMM_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Rows of x per panel: 64 bytes of floats (one AVX-512 vector, two AVX2 ones). */
#define MHA_PANEL_ROWS_F32 16
#define MHA_PANEL_ROWS_F64 8

/* Elements of the packed x: ceil(m / panel rows) * panel rows * k. */
ptrdiff_t mha_row_panels_size_f32(ptrdiff_t m, ptrdiff_t k);
ptrdiff_t mha_row_panels_size_f64(ptrdiff_t m, ptrdiff_t k);

/* packed := x (m rows of k, row stride ldx) in transposed panels, the last one zero-padded. */
void mha_pack_row_panels_f32(const float *x, ptrdiff_t ldx, ptrdiff_t m, ptrdiff_t k,
                             float *packed);
void mha_pack_row_panels_f64(const double *x, ptrdiff_t ldx, ptrdiff_t m, ptrdiff_t k,
                             double *packed);

/* out[i, j] = sum_p x[i, p] w[j, p] + bias[j] for i < m, j0 <= j < j1, from the packed x.
 * w: rows of k values, row stride ldw; bias: NULL or per column; out: row i at out + i * ldo,
 * or at out + row_off[i] when row_off is not NULL (m offsets: rows written to a layout of the
 * caller's, such as one head's rows of each sequence; the values are the same). */
void mha_row_panel_gemm_f32(const float *packed, ptrdiff_t m, ptrdiff_t k, const float *w,
                            ptrdiff_t ldw, const float *bias, float *out, ptrdiff_t ldo,
                            const ptrdiff_t *row_off, ptrdiff_t j0, ptrdiff_t j1);
void mha_row_panel_gemm_f64(const double *packed, ptrdiff_t m, ptrdiff_t k, const double *w,
                            ptrdiff_t ldw, const double *bias, double *out, ptrdiff_t ldo,
                            const ptrdiff_t *row_off, ptrdiff_t j0, ptrdiff_t j1);

/* Which compiled micro-kernel runs: 2 AVX-512, 1 AVX2 + FMA, 0 the baseline; a level above
 * what the CPU has (or < 0) means the best it has. Returns the previous level. For tests (every
 * level this CPU can run gives the same results up to rounding) and measurements. Not thread
 * safe: set it before computing. */
int mha_row_panel_set_isa(int level);

#ifdef __cplusplus
}
#endif

#endif
