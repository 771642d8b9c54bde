/* float16 / int8 KV cache encode: see kv_encode.h. */

#include <math.h>
#include <string.h>

#include "kv_encode.h"
#include "simd_dispatch.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

/* float32 -> float16 bits, the portable conversion (NumPy's results, see kv_encode.h). */
static inline uint16_t mha_float_to_half(float f)
{
    uint32_t bits, a;
    memcpy(&bits, &f, sizeof bits);
    uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    a = bits & 0x7fffffffu;
    if (a >= 0x7f800000u) {                 /* inf, NaN: the payload's top bits, never 0 */
        uint16_t h = (uint16_t)(0x7c00u | ((a & 0x7fffffu) >> 13));
        return (uint16_t)(sign | (a > 0x7f800000u && h == 0x7c00u ? 0x7c01u : h));
    }
    if (a >= 0x477ff000u)                   /* rounds past 65504 (65520 itself: a tie, to even) */
        return (uint16_t)(sign | 0x7c00u);
    if (a >= 0x38800000u) {                 /* a normal float16: rebias, round the 13 low bits */
        uint32_t h = (a - ((uint32_t)(127 - 15) << 23)) >> 13, rest = a & 0x1fffu;
        h += rest > 0x1000u || (rest == 0x1000u && (h & 1u));   /* a carry is still right */
        return (uint16_t)(sign | h);
    }
    int e = (int)(a >> 23);                 /* a float16 subnormal (or 0): units of 2**-24 */
    if (e < 102)                            /* below 2**-25: rounds to 0 */
        return sign;
    uint32_t m = (a & 0x7fffffu) | 0x800000u, shift = (uint32_t)(126 - e);   /* 14 .. 24 */
    uint32_t h = m >> shift, rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    h += rest > half || (rest == half && (h & 1u));            /* 1024 = the smallest normal */
    return (uint16_t)(sign | h);
}

#define MHA_IMPL "kv_encode_impl.h"
#define TYPE_SUFFIX f32
#include "simd_isas.h"
#undef TYPE_SUFFIX

#ifdef MHA_SIMD_DISPATCH
void mha_kv_encode_f16_f32(const float *x, ptrdiff_t n, uint16_t *out)
{
    MHA_SIMD_CALL(mha_kv_encode_f16_f32, (x, n, out))
}
void mha_kv_encode_i8_f32(const float *x, ptrdiff_t d, int8_t *out, float *scale)
{
    MHA_SIMD_CALL(mha_kv_encode_i8_f32, (x, d, out, scale))
}
#endif
