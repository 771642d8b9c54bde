/* The output step of row_panel_gemm's AVX-512 float32 micro-kernel: a block's accumulators
 * hold one weight row's outputs for 16 token rows each (column vectors), and the output wants
 * each token row's outputs side by side. A 16 x 16 transpose in registers (64 shuffles) and one
 * masked store a row replace 16 x nb scalar stores through a buffer (the stores and their
 * reloads cost 10-15% of a block of K 192 to 768; Intel Xeon, a loop from L1: 147 -> 173
 * GFLOP/s at K 192). Only data moves: the values are the accumulators' bits.
 * Include after defining TARGET_AVX512 (a gcc target attribute with avx512f). */
#ifndef MHA_TRANSPOSE_STORE_AVX512_H
#define MHA_TRANSPOSE_STORE_AVX512_H

#include <immintrin.h>
#include <stddef.h>

/* In place: r[i] lane j := r[j] lane i. */
static inline __attribute__((always_inline)) TARGET_AVX512 void
mha_transpose16_f32_avx512(__m512 r[16])
{
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {         /* pairs of rows interleaved by element */
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {         /* then by pairs of elements */
        __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
        __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    /* r[4 g + s], 128-bit lane L: rows 4 g .. 4 g + 3 of column 4 L + s; gather the lanes */
    for (int s = 0; s < 4; s++) {
        __m512 ab0 = _mm512_shuffle_f32x4(r[s], r[4 + s], 0x44);
        __m512 ab1 = _mm512_shuffle_f32x4(r[s], r[4 + s], 0xEE);
        __m512 cd0 = _mm512_shuffle_f32x4(r[8 + s], r[12 + s], 0x44);
        __m512 cd1 = _mm512_shuffle_f32x4(r[8 + s], r[12 + s], 0xEE);
        t[s] = _mm512_shuffle_f32x4(ab0, cd0, 0x88);
        t[4 + s] = _mm512_shuffle_f32x4(ab0, cd0, 0xDD);
        t[8 + s] = _mm512_shuffle_f32x4(ab1, cd1, 0x88);
        t[12 + s] = _mm512_shuffle_f32x4(ab1, cd1, 0xDD);
    }
    for (int i = 0; i < 16; i++)
        r[i] = t[i];
}

/* out[row(i) + j + b] := cols[b] lane i for i < rows (<= 16), b < nb (<= 16); row(i) is
 * row_off[i] when row_off is not NULL, else i * ldo. */
static inline __attribute__((always_inline)) TARGET_AVX512 void
mha_store_rows_f32_avx512(const __m512 *cols, int nb, ptrdiff_t rows, float *out,
                          ptrdiff_t ldo, const ptrdiff_t *row_off, ptrdiff_t j)
{
    __m512 r[16];
    for (int b = 0; b < 16; b++)
        r[b] = b < nb ? cols[b] : _mm512_setzero_ps();
    mha_transpose16_f32_avx512(r);
    __mmask16 mask = (__mmask16)((1u << nb) - 1);
    for (ptrdiff_t i = 0; i < rows; i++)
        _mm512_mask_storeu_ps(out + (row_off != NULL ? row_off[i] : i * ldo) + j, mask, r[i]);
}

#endif
