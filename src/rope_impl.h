/* One type's RoPE functions (see rope.h); included by rope.c with REAL and SUFFIX defined. */
#define MHA_ROPE_CAT_(a, b) a##b
#define MHA_ROPE_CAT(a, b) MHA_ROPE_CAT_(a, b)
#define MHA_ROPE_FN(name) MHA_ROPE_CAT(name, SUFFIX)

void MHA_ROPE_FN(mha_rope_table_)(const int64_t *positions, ptrdiff_t rows,
                                  const double *inv_freq, ptrdiff_t half, REAL *cos_out,
                                  REAL *sin_out)
{
    for (ptrdiff_t r = 0; r < rows; r++) {
        const double p = (double)positions[r];     /* exact below 2**53 */
        for (ptrdiff_t i = 0; i < half; i++) {
            const double angle = p * inv_freq[i];
            cos_out[r * half + i] = (REAL)cos(angle);
            sin_out[r * half + i] = (REAL)sin(angle);
        }
    }
}

/* (a, b) -> (a cos - b sin, b cos + a sin) for the pairs (lo[i], hi[i]) */
static inline void MHA_ROPE_FN(rotate_split_)(REAL *restrict lo, REAL *restrict hi,
                                              const REAL *restrict c, const REAL *restrict s,
                                              ptrdiff_t half)
{
#pragma omp simd
    for (ptrdiff_t i = 0; i < half; i++) {
        const REAL a = lo[i], b = hi[i];
        lo[i] = a * c[i] - b * s[i];
        hi[i] = b * c[i] + a * s[i];
    }
}

/* the same for the pairs (x[2i], x[2i + 1]) */
static inline void MHA_ROPE_FN(rotate_interleaved_)(REAL *restrict x, const REAL *restrict c,
                                                    const REAL *restrict s, ptrdiff_t half)
{
#pragma omp simd
    for (ptrdiff_t i = 0; i < half; i++) {
        const REAL a = x[2 * i], b = x[2 * i + 1];
        x[2 * i] = a * c[i] - b * s[i];
        x[2 * i + 1] = b * c[i] + a * s[i];
    }
}

/* One baseline (SSE2) build, no per-level copies: the rotation is a few multiply-adds per
 * element it streams, about 1% of a prefill (measured), so wider vectors would not show. */
void MHA_ROPE_FN(mha_rope_rotate_)(REAL *x, ptrdiff_t rows, ptrdiff_t row_stride,
                                   ptrdiff_t heads, ptrdiff_t head_stride, const REAL *cos,
                                   const REAL *sin, ptrdiff_t half, int interleaved)
{
    for (ptrdiff_t r = 0; r < rows; r++) {
        const REAL *c = cos + r * half, *s = sin + r * half;
        for (ptrdiff_t h = 0; h < heads; h++) {
            REAL *head = x + r * row_stride + h * head_stride;
            if (interleaved)
                MHA_ROPE_FN(rotate_interleaved_)(head, c, s, half);
            else
                MHA_ROPE_FN(rotate_split_)(head, head + half, c, s, half);
        }
    }
}

#undef MHA_ROPE_FN
#undef MHA_ROPE_CAT
#undef MHA_ROPE_CAT_
