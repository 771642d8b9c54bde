/* Vectorizable exp for the softmax of attention scores.
 *
 * The inputs are always s - max <= 0, so only the range [-inf, 0] matters; results below the
 * smallest normal number are flushed to 0 (they change a softmax sum that is >= 1 by < 1e-37).
 * The code is branch-free so gcc vectorizes the loops that call it at any SIMD width:
 *   exp(x) = 2^n * exp(r),  n = round(x / ln 2),  r = x - n ln 2 in [-ln2/2, ln2/2].
 * float: Cephes minimax polynomial, ~1 ulp. double: Taylor to degree 12, error < 2e-16.
 * NaN propagates (a NaN score gives a NaN output, as in NumPy). */
#ifndef MHA_FAST_EXP_H
#define MHA_FAST_EXP_H

#include <stdint.h>
#include <string.h>

/* The constants and polynomials, shared by the scalar functions below and the vector exp of
 * attention_tile_impl.h, so that both give the same bits. POLY_STEPS(FOR, p, r): p[u] = exp(r[u])
 * on the reduced range for every u of the loop header FOR (scalars or GNU vectors), one Horner
 * step for all u before the next, so that several chains of dependent FMAs are in flight. */
#define MHA_EXP_F32_UNDERFLOW (-87.33654f)      /* exp(x) < FLT_MIN below, also x = -inf */
#define MHA_EXP_F32_LOG2E 1.44269504088896341f
#define MHA_EXP_F32_LN2_HI 0.693359375f
#define MHA_EXP_F32_LN2_LO (-2.12194440e-4f)
#define MHA_EXP_F32_ROUND_MAGIC 12582912.0f    /* 1.5 * 2^23: adding it rounds to an integer */
#define MHA_EXP_F32_MAGIC_BITS 0x4B400000      /* its bits: t's mantissa minus them is n */
#define MHA_EXP_F32_INT int32_t                /* the integer type of a float's bits */
#define MHA_EXP_F32_BIAS 127
#define MHA_EXP_F32_MANT_BITS 23
#define MHA_EXP_F32_AVX512_BODY 1                /* softmax_row_impl.h has an AVX-512 one */
#define MHA_EXP_F32_POLY_STEPS(FOR, p, r)                                                    \
    do {                                                                                     \
        FOR p[u] = 1.9875691500e-4f * r[u] + 1.3981999507e-3f;                               \
        FOR p[u] = p[u] * r[u] + 8.3334519073e-3f;                                           \
        FOR p[u] = p[u] * r[u] + 4.1665795894e-2f;                                           \
        FOR p[u] = p[u] * r[u] + 1.6666665459e-1f;                                           \
        FOR p[u] = p[u] * r[u] + 5.0000001201e-1f;                                           \
        FOR p[u] = p[u] * r[u] * r[u] + r[u];                                                \
        FOR p[u] = p[u] + 1.0f;                                                              \
    } while (0)

#define MHA_EXP_F64_UNDERFLOW (-708.3964185322641)  /* exp(x) < DBL_MIN below, also -inf */
#define MHA_EXP_F64_LOG2E 1.4426950408889634074
#define MHA_EXP_F64_LN2_HI 6.93147180369123816490e-01
#define MHA_EXP_F64_LN2_LO 1.90821492927058770002e-10
#define MHA_EXP_F64_ROUND_MAGIC 6755399441055744.0  /* 1.5 * 2^52 */
#define MHA_EXP_F64_MAGIC_BITS 0x4338000000000000LL
#define MHA_EXP_F64_INT int64_t
#define MHA_EXP_F64_BIAS 1023
#define MHA_EXP_F64_MANT_BITS 52
#define MHA_EXP_F64_AVX512_BODY 0
#define MHA_EXP_F64_POLY_STEPS(FOR, p, r)                                                    \
    do {                                                                                     \
        FOR p[u] = 1.0 / 479001600.0 * r[u] + 1.0 / 39916800.0;                              \
        FOR p[u] = p[u] * r[u] + 1.0 / 3628800.0;                                            \
        FOR p[u] = p[u] * r[u] + 1.0 / 362880.0;                                             \
        FOR p[u] = p[u] * r[u] + 1.0 / 40320.0;                                              \
        FOR p[u] = p[u] * r[u] + 1.0 / 5040.0;                                               \
        FOR p[u] = p[u] * r[u] + 1.0 / 720.0;                                                \
        FOR p[u] = p[u] * r[u] + 1.0 / 120.0;                                                \
        FOR p[u] = p[u] * r[u] + 1.0 / 24.0;                                                 \
        FOR p[u] = p[u] * r[u] + 1.0 / 6.0;                                                  \
        FOR p[u] = p[u] * r[u] + 0.5;                                                        \
        FOR p[u] = p[u] * r[u] + 1.0;                                                        \
        FOR p[u] = p[u] * r[u] + 1.0;                                                        \
    } while (0)

static inline float mha_exp_f32(float x)
{
    int underflow = x < MHA_EXP_F32_UNDERFLOW;
    float xc = underflow ? 0.0f : x;

    float t = xc * MHA_EXP_F32_LOG2E + MHA_EXP_F32_ROUND_MAGIC;
    float n = t - MHA_EXP_F32_ROUND_MAGIC;
    float r[1] = {xc - n * MHA_EXP_F32_LN2_HI - n * MHA_EXP_F32_LN2_LO}, p[1];
    MHA_EXP_F32_POLY_STEPS(for (int u = 0; u < 1; u++), p, r);

    int32_t ti, bits;
    memcpy(&ti, &t, sizeof ti);
    bits = (ti - MHA_EXP_F32_MAGIC_BITS + MHA_EXP_F32_BIAS) << MHA_EXP_F32_MANT_BITS;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return underflow ? 0.0f : p[0] * two_n;
}

static inline double mha_exp_f64(double x)
{
    int underflow = x < MHA_EXP_F64_UNDERFLOW;
    double xc = underflow ? 0.0 : x;

    double t = xc * MHA_EXP_F64_LOG2E + MHA_EXP_F64_ROUND_MAGIC;
    double n = t - MHA_EXP_F64_ROUND_MAGIC;
    double r[1] = {xc - n * MHA_EXP_F64_LN2_HI - n * MHA_EXP_F64_LN2_LO}, p[1];
    MHA_EXP_F64_POLY_STEPS(for (int u = 0; u < 1; u++), p, r);

    int64_t ti, bits;
    memcpy(&ti, &t, sizeof ti);
    bits = (ti - MHA_EXP_F64_MAGIC_BITS + MHA_EXP_F64_BIAS) << MHA_EXP_F64_MANT_BITS;
    double two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return underflow ? 0.0 : p[0] * two_n;
}

#endif
