/* float16 / int8 KV cache kernels: see kv_format.h. */

#include <math.h>
#include <string.h>

#include "attention_microkernel.h"
#include "attention_tile.h"
#include "fast_exp.h"
#include "kv_format.h"
#include "simd_dispatch.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

/* float16 bits -> float32, exact (subnormals, inf and NaN included): the portable conversion
 * of the baseline level and of the head-dim tails. */
static inline float mha_half_to_float(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, em = h & 0x7fffu, bits;
    float f;
    if (em >= 0x7c00u)                      /* inf, NaN (payload kept) */
        bits = sign | 0x7f800000u | ((em & 0x3ffu) << 13);
    else if (em >= 0x0400u)                 /* normal: rebias the exponent */
        bits = sign | ((em << 13) + ((uint32_t)(127 - 15) << 23));
    else {                                  /* subnormal or zero: em * 2**-24, exact */
        f = (float)em * 5.9604644775390625e-08f;
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    memcpy(&f, &bits, sizeof f);
    return f;
}

#define DRB 4          /* query rows per block of the direct kernel, as attention_microkernel.c */
#define MHA_KV_NK 64   /* keys per tile of the direct kernel (its scores: DRB x NK floats) */
/* The integer products' limits (kv_int8_dot_impl.h): rows rounded at once (the direct rule's),
 * and head dims (the fused kernels'; q16 . k stays within int32 up to 516). Tasks beyond them
 * run the float products. */
#define MHA_KV_DOT_MAX_ROWS MHA_FUSED_DIRECT_MAX_ROWS
#define MHA_KV_DOT_MAX_D MHA_FUSED_MAX_HEAD_DIM
#if MHA_KV_DOT_MAX_D > 516
#error "q16 . k must stay within int32: head dims up to 516"
#endif
#define MHA_IMPL "kv_format_impl.h"
#define TYPE_SUFFIX f32
#define REAL float     /* the type of the queries, scores and outputs (softmax_row_impl.h) */
#define EXP mha_exp_f32
#define EXP_C(name) MHA_EXP_F32_##name
#include "simd_isas.h"
#ifdef MHA_SIMD_DISPATCH
/* The int8 direct kernel once more, with AVX512-VNNI's integer products (kv_int8_dot_impl.h),
 * for CPUs that have them (mha_int8_dot()). */
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4,avx512vnni")
#define SUFFIX MHA_ISA_CAT(TYPE_SUFFIX, _vnni)
#define MHA_ISA_WIDE_BYTES 64
#define MHA_KV_INT8_DOT 1
#include MHA_IMPL
#undef MHA_KV_INT8_DOT
#undef MHA_ISA_WIDE_BYTES
#undef SUFFIX
#pragma GCC pop_options
#endif
#undef TYPE_SUFFIX
#undef REAL
#undef EXP
#undef EXP_C

ptrdiff_t mha_kv_direct_scratch(void) { return DRB * MHA_KV_NK; }

#ifdef MHA_SIMD_DISPATCH
void mha_kv_attend_direct_f16_f32(const float *q, ptrdiff_t q_rs, int rows, int d,
                                  const uint16_t *k, ptrdiff_t k_rs, const uint16_t *v,
                                  ptrdiff_t v_rs, int dv, ptrdiff_t k_begin, ptrdiff_t k_end,
                                  float scale, const float *add, ptrdiff_t add_rs,
                                  ptrdiff_t add_ks, const unsigned char *pad, ptrdiff_t limit,
                                  ptrdiff_t limit_step, ptrdiff_t window, float *m, float *l,
                                  float *acc, float *work)
{
    MHA_SIMD_CALL(mha_kv_attend_direct_f16_f32, (q, q_rs, rows, d, k, k_rs, v, v_rs, dv,
                  k_begin, k_end, scale, add, add_rs, add_ks, pad, limit, limit_step, window,
                  m, l, acc, work))
}
void mha_kv_attend_direct_i8_f32(const float *q, ptrdiff_t q_rs, int rows, int d,
                                 const int8_t *k, ptrdiff_t k_rs, const float *k_scale,
                                 const int8_t *v, ptrdiff_t v_rs, const float *v_scale, int dv,
                                 ptrdiff_t k_begin, ptrdiff_t k_end, float scale,
                                 const float *add, ptrdiff_t add_rs, ptrdiff_t add_ks,
                                 const unsigned char *pad, ptrdiff_t limit,
                                 ptrdiff_t limit_step, ptrdiff_t window, float *m, float *l,
                                 float *acc, float *work)
{
    if (mha_int8_dot()) {
        mha_kv_attend_direct_i8_f32_vnni(q, q_rs, rows, d, k, k_rs, k_scale, v, v_rs, v_scale,
                                         dv, k_begin, k_end, scale, add, add_rs, add_ks, pad,
                                         limit, limit_step, window, m, l, acc, work);
        return;
    }
    MHA_SIMD_CALL(mha_kv_attend_direct_i8_f32, (q, q_rs, rows, d, k, k_rs, k_scale, v, v_rs,
                  v_scale, dv, k_begin, k_end, scale, add, add_rs, add_ks, pad, limit,
                  limit_step, window, m, l, acc, work))
}
void mha_kv_load_f16_f32(const uint16_t *src, ptrdiff_t src_rs, int n, int d, float *dst,
                         ptrdiff_t dst_rs)
{
    MHA_SIMD_CALL(mha_kv_load_f16_f32, (src, src_rs, n, d, dst, dst_rs))
}
void mha_kv_load_i8_f32(const int8_t *src, ptrdiff_t src_rs, const float *scale, int n, int d,
                        float *dst, ptrdiff_t dst_rs)
{
    MHA_SIMD_CALL(mha_kv_load_i8_f32, (src, src_rs, scale, n, d, dst, dst_rs))
}
#endif

void mha_kv_attend_f32(int fmt, int direct, const float *q, ptrdiff_t q_rs, int rows, int d,
                       const void *k, ptrdiff_t k_rs, const float *k_scale, const void *v,
                       ptrdiff_t v_rs, const float *v_scale, int dv, ptrdiff_t k_begin,
                       ptrdiff_t k_end, float scale, const float *add, ptrdiff_t add_rs,
                       ptrdiff_t add_ks, const unsigned char *pad, ptrdiff_t limit,
                       ptrdiff_t limit_step, ptrdiff_t window, float *m, float *l, float *acc,
                       float *work, float *conv, ptrdiff_t block_k)
{
    if (direct) {
        if (fmt == MHA_KV_F16)
            mha_kv_attend_direct_f16_f32(q, q_rs, rows, d, (const uint16_t *)k, k_rs,
                                         (const uint16_t *)v, v_rs, dv, k_begin, k_end, scale,
                                         add, add_rs, add_ks, pad, limit, limit_step, window,
                                         m, l, acc, work);
        else
            mha_kv_attend_direct_i8_f32(q, q_rs, rows, d, (const int8_t *)k, k_rs, k_scale,
                                        (const int8_t *)v, v_rs, v_scale, dv, k_begin, k_end,
                                        scale, add, add_rs, add_ks, pad, limit, limit_step,
                                        window, m, l, acc, work);
        return;
    }
    float *kt = conv, *vt = conv + block_k * d;
    for (ptrdiff_t j0 = k_begin; j0 < k_end; j0 += block_k) {
        int nk = (int)(k_end - j0 < block_k ? k_end - j0 : block_k);
        if (fmt == MHA_KV_F16) {
            mha_kv_load_f16_f32((const uint16_t *)k + j0 * k_rs, k_rs, nk, d, kt, d);
            mha_kv_load_f16_f32((const uint16_t *)v + j0 * v_rs, v_rs, nk, dv, vt, dv);
        } else {
            mha_kv_load_i8_f32((const int8_t *)k + j0 * k_rs, k_rs, k_scale + j0, nk, d, kt, d);
            mha_kv_load_i8_f32((const int8_t *)v + j0 * v_rs, v_rs, v_scale + j0, nk, dv, vt,
                               dv);
        }
        /* the tile's keys are 0 .. nk - 1 to the kernel: shift what counts keys */
        mha_fused_attend_f32(q, q_rs, rows, d, kt, d, vt, dv, dv, 0, nk, scale,
                             add == NULL ? NULL : add + j0 * add_ks, add_rs, add_ks,
                             pad == NULL ? NULL : pad + j0, limit - j0, limit_step, window, m,
                             l, acc, work);
    }
}
