/* Per-row softmax work of the attention kernels (mha_cy/_attention_kernel.pyx).
 *
 * The Cython kernel computes a tile of scores S = scale * Q K^T with BLAS; these functions then
 * treat one query row of that tile: apply the masks, turn scores into probabilities, and keep
 * the running statistics of the online ("flash") softmax; the fused kernels inline the same
 * steps (softmax_row_impl.h, the bodies of these functions). They are plain C so that gcc can
 * vectorize them, and are compiled for several SIMD levels (picked at run time, see
 * simd_dispatch.h) because wheels must run on any x86-64 CPU.
 *
 * Mask arguments, shared by all functions (row = one query, columns = the n keys of the tile):
 *   add, add_stride  additive mask of the row (NULL: none); key j adds add[j * add_stride]
 *   pad              key padding flags of the tile's keys (NULL: none); nonzero = ignore key j
 *   n_skip           keys j < n_skip are masked (the sliding window's start; 0 without one)
 *   n_valid          keys j >= n_valid are masked (the causal limit; n when not causal)
 * A masked key gets probability exactly 0. A row whose keys are all masked gives zeros.
 * A key is hidden when its score is -inf once the masks are applied (masked, or -inf from the
 * data, so a row of -inf scores counts as fully masked); an additive -inf hides the key
 * whatever its score. A hidden key's probability is -0.0, not +0: the P V products that
 * follow must skip such keys, or a NaN or inf in V at a hidden key would reach the row
 * (0 * NaN = NaN); a visible key's V is always multiplied, even by a probability that
 * underflowed to +0. */
#ifndef MHA_ATTENTION_TILE_H
#define MHA_ATTENTION_TILE_H

#include <stddef.h>

#include "simd_dispatch.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Online-softmax update of one row against one key tile.
 * s[0:n] (in) scaled scores, (out) p_j = exp(s_j - m_new), -0.0 where hidden.
 * *m, *l  the row's running max and running sum of exp(s - m) over the keys seen so far;
 *         start them at -inf and 0.
 * acc[0:dv] the row's output accumulator (sum of p_j v_j), rescaled here by exp(m_old - m_new)
 *         so that the caller can add this tile's P V to it. */
void mha_online_softmax_row_f32(float *s, int n, const float *add, ptrdiff_t add_stride,
                                const unsigned char *pad, int n_skip, int n_valid,
                                float *m, float *l, float *acc, int dv);
void mha_online_softmax_row_f64(double *s, int n, const double *add, ptrdiff_t add_stride,
                                const unsigned char *pad, int n_skip, int n_valid,
                                double *m, double *l, double *acc, int dv);

/* Exact softmax of one whole row in place: s[0:n] becomes the attention weights (-0.0 at
 * hidden keys, as above). */
void mha_softmax_row_f32(float *s, int n, const float *add, ptrdiff_t add_stride,
                         const unsigned char *pad, int n_skip, int n_valid);
void mha_softmax_row_f64(double *s, int n, const double *add, ptrdiff_t add_stride,
                         const unsigned char *pad, int n_skip, int n_valid);

/* For r < rows: out row r (at out + r * out_rs) = acc row r (at acc + r * dv) / l[r], or
 * zeros when l[r] == 0 (every key of the row was masked); NaN l[r]: NaN. A task's rows in one
 * call: one run-time dispatch per row was 2.8% of an SDPA call's samples, (1, 12, 128), 1
 * thread. */
void mha_finish_rows_f32(const float *acc, const float *l, int rows, int dv, float *out,
                         ptrdiff_t out_rs);
void mha_finish_rows_f64(const double *acc, const double *l, int rows, int dv, double *out,
                         ptrdiff_t out_rs);

#ifdef __cplusplus
}
#endif

#endif
