/* Rotary position embeddings (RoPE, Su et al. 2021): the q and k heads of self-attention are
 * rotated, pair of features by pair, by angles that grow with the token's position, so that
 * q_m . k_n depends on m - n only.
 *
 * For frequency i < half (half = rotated features / 2) and position p the angle is
 * p * inv_freq[i]; the pair (a, b) becomes (a cos - b sin, b cos + a sin). The pairs are
 * (i, i + half) in the half-split layout (HF Llama, GPT-NeoX: rotate_half) or (2i, 2i + 1) in the
 * interleaved one (GPT-J). Features from 2 * half on are left alone (partial rotary).
 *
 * The angles, and their cos and sin, are computed in double whatever the data type: a float32
 * angle at position 1e5 is off by up to 1e5 * 2**-24 ~ 6e-3 rad. A caller computes the cos/sin
 * table of a block of token rows once (mha_rope_table_*) and rotates every head of those rows
 * with it (mha_rope_rotate_*). Each row is rotated by the same code whatever the blocks, so the
 * result does not depend on how rows are shared among threads. */
#ifndef MHA_ROPE_H
#define MHA_ROPE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* cos_out[r * half + i] = cos(positions[r] * inv_freq[i]), sin_out likewise, for r < rows,
 * i < half, computed in double and rounded once to the output type. */
void mha_rope_table_f32(const int64_t *positions, ptrdiff_t rows, const double *inv_freq,
                        ptrdiff_t half, float *cos_out, float *sin_out);
void mha_rope_table_f64(const int64_t *positions, ptrdiff_t rows, const double *inv_freq,
                        ptrdiff_t half, double *cos_out, double *sin_out);

/* Rotate in place the first 2 * half features of `heads` heads of `rows` token rows: head h of
 * row r starts at x + r * row_stride + h * head_stride (strides in elements) and is rotated with
 * cos[r * half ...], sin[r * half ...] (a table as above). interleaved: pairs (2i, 2i + 1), else
 * (i, i + half). */
void mha_rope_rotate_f32(float *x, ptrdiff_t rows, ptrdiff_t row_stride, ptrdiff_t heads,
                         ptrdiff_t head_stride, const float *cos, const float *sin,
                         ptrdiff_t half, int interleaved);
void mha_rope_rotate_f64(double *x, ptrdiff_t rows, ptrdiff_t row_stride, ptrdiff_t heads,
                         ptrdiff_t head_stride, const double *cos, const double *sin,
                         ptrdiff_t half, int interleaved);

#ifdef __cplusplus
}
#endif

#endif
