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

static inline float mha_exp_f32(float x)
{
    const float log2e = 1.44269504088896341f;
    const float ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    const float round_magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    int underflow = x < -87.33654f;        /* exp(x) < FLT_MIN, also x = -inf */
    float xc = underflow ? 0.0f : x;

    float t = xc * log2e + round_magic;
    float n = t - round_magic;
    float r = xc - n * ln2_hi - n * ln2_lo;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;

    int32_t ti, n_int, bits;
    memcpy(&ti, &t, sizeof ti);
    n_int = ti - 0x4B400000;                /* the integer n out of t's mantissa */
    bits = (n_int + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return underflow ? 0.0f : p * two_n;
}

static inline double mha_exp_f64(double x)
{
    const double log2e = 1.4426950408889634074;
    const double ln2_hi = 6.93147180369123816490e-01, ln2_lo = 1.90821492927058770002e-10;
    const double round_magic = 6755399441055744.0; /* 1.5 * 2^52 */
    int underflow = x < -708.3964185322641;        /* exp(x) < DBL_MIN, also x = -inf */
    double xc = underflow ? 0.0 : x;

    double t = xc * log2e + round_magic;
    double n = t - round_magic;
    double r = xc - n * ln2_hi - n * ln2_lo;
    double p = 1.0 / 479001600.0;                  /* 1/12! */
    p = p * r + 1.0 / 39916800.0;
    p = p * r + 1.0 / 3628800.0;
    p = p * r + 1.0 / 362880.0;
    p = p * r + 1.0 / 40320.0;
    p = p * r + 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;

    int64_t ti, n_int, bits;
    memcpy(&ti, &t, sizeof ti);
    n_int = ti - 0x4338000000000000LL;
    bits = (n_int + 1023) << 52;
    double two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return underflow ? 0.0 : p * two_n;
}

#endif
