/* Writing keys and values into a float16 or int8 KV cache: the encode of
 * mha_cy/_cache_formats.py (Float16Format.encode, Int8Format.encode) in C, bit for bit, for
 * the compiled decode step (mha_cy/_step_kernel.pyx), which writes its new keys and values
 * straight into the cache's storage.
 *
 * float16 (mha_kv_encode_f16_f32): NumPy's astype(np.float16): round to nearest even,
 * subnormal results included; finite values from 65520 on (the rounding boundary above
 * 65504) become +-inf; NaN stays NaN with NumPy's bits: sign and the top 10 payload bits kept
 * (a signalling NaN stays signalling), a payload that would vanish becomes 1. F16C's
 * vcvtps2ph (immediate 0: round to nearest even) gives the same bits for every non-NaN input,
 * so 8 values at a time go through it at the AVX2 and AVX-512 levels, a block holding a NaN
 * through the portable conversion (vcvtps2ph would set the quiet bit).
 *
 * int8 (mha_kv_encode_i8_f32), one row of d values: scale = max|x| / 127 in float32 (NaN if
 * the row holds a NaN: its first NaN, sign cleared, as np.abs(x).max() propagates it);
 * x_int8 = rint(x / scale) (round half to even), clipped to [-127, 127], when 0 < scale < inf;
 * else every value is 0 and a scale of +inf (an inf in the row) becomes NaN (0x7fc00000, NumPy's
 * np.nan as float32); scale 0 (a zero row, or max|x| below 127 * 2**-150) is kept. */
#ifndef MHA_KV_ENCODE_H
#define MHA_KV_ENCODE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* out[i] = the float16 bits of x[i], i < n. */
void mha_kv_encode_f16_f32(const float *x, ptrdiff_t n, uint16_t *out);

/* out[0 .. d - 1] and *scale: the int8 encoding of the row x[0 .. d - 1]. */
void mha_kv_encode_i8_f32(const float *x, ptrdiff_t d, int8_t *out, float *scale);

#ifdef __cplusplus
}
#endif

#endif
