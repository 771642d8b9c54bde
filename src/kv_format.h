/* Attention over a KV cache stored as float16 or as int8 with one float32 scale per key
 * (mha_cy/_cache_formats.py), read in the stored format: the values are converted to float32
 * in registers (F16C vcvtph2ps, or sign extension and vcvtdq2ps for int8; a portable
 * conversion at the baseline SIMD level), never copied to a dequantized cache.
 *
 * Formats (`fmt` below): MHA_KV_F16, IEEE binary16 bit patterns; MHA_KV_I8, signed bytes x
 * with the key's value x * scale[j] (symmetric, scale = max|row| / 127; a NaN scale marks a
 * row that held NaN or inf and makes every value of it NaN).
 *
 * Direct kernel (mha_kv_attend_direct_*): the direct kernel of attention_microkernel.h for
 * tasks of few query rows (decode steps, a GQA group's heads), with K and V in the stored
 * format. The int8 scales are folded out of the products: score_j = scale * s_k[j] *
 * (q . k_int8[j]), and P V adds (p_j * s_v[j]) * v_int8[j]. Arguments as in
 * mha_fused_attend_direct_f32, plus k_scale / v_scale (key j's scale at k_scale[j], int8
 * only; NULL for float16); work: mha_kv_direct_scratch() floats.
 *
 * Tile conversion (mha_kv_load_*): n rows of d stored values (row j at src + j * src_rs)
 * to float32 rows (dst + j * dst_rs): what the many-row paths (prefill over a cache, the
 * weights path, head dims above the fused kernels' limit) do with one key or value tile of
 * a per-thread scratch buffer before running the float32 tile kernels on it. The int8
 * values are x * scale[j] rounded once, exactly the dequantized cache.
 *
 * Measured (AMD EPYC Zen 1, AVX2 + F16C, 1 thread, CPU time, machine shared and loaded),
 * decode q (B, Hq, 1, 128) over a (B, Hkv, Lk, 128) cache, ms, float32 / float16 / int8:
 *   B4 Hq32 Hkv8 Lk2048 (4-row tasks)       8.8-9.6 / 7.4-7.5 / 7.4-7.7   (1.2-1.3x)
 *   B4 Hq16 Hkv8 Lk2048 (2-row tasks)       9.9 / 5.0 / 4.8               (2.0x)
 *   B4 Hq8  Hkv8 Lk2048 (1-row tasks)       7.3 / 6.8 / 3.7               (1.1x / 2.0x)
 *   B1 Hq8  Hkv1 Lk32768 (split-K, 8 rows)  7.0-7.5 / 7.2 / 7.2-7.4       (1.0x)
 * float32 streams ~7 GB/s from one core, so where a task has few rows the smaller cache
 * wins; with 4 or 8 rows per converted key the FMAs and the conversions bound both formats
 * at ~18 GFLOP/s (float16 with one row is bound by vcvtph2ps itself: 8 per 8 FMAs). Blocks
 * of 8 rows (each key converted once per 8 rows instead of twice) measured no faster on
 * the 8-row MQA task (7.24 vs 7.16 ms) and were not kept. */
#ifndef MHA_KV_FORMAT_H
#define MHA_KV_FORMAT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MHA_KV_F16 1
#define MHA_KV_I8 2

ptrdiff_t mha_kv_direct_scratch(void);

/* Bytes of one stored element of format fmt. */
static inline size_t mha_kv_itemsize(int fmt) { return fmt == MHA_KV_F16 ? 2 : 1; }

void mha_kv_attend_direct_f16_f32(const float *q, ptrdiff_t q_rs, int rows, int d,
                                  const uint16_t *k, ptrdiff_t k_rs, const uint16_t *v,
                                  ptrdiff_t v_rs, int dv, ptrdiff_t k_begin, ptrdiff_t k_end,
                                  float scale, const float *add, ptrdiff_t add_rs,
                                  ptrdiff_t add_ks, const unsigned char *pad, ptrdiff_t limit,
                                  ptrdiff_t limit_step, ptrdiff_t window, float *m, float *l,
                                  float *acc, float *work);
void mha_kv_attend_direct_i8_f32(const float *q, ptrdiff_t q_rs, int rows, int d,
                                 const int8_t *k, ptrdiff_t k_rs, const float *k_scale,
                                 const int8_t *v, ptrdiff_t v_rs, const float *v_scale, int dv,
                                 ptrdiff_t k_begin, ptrdiff_t k_end, float scale,
                                 const float *add, ptrdiff_t add_rs, ptrdiff_t add_ks,
                                 const unsigned char *pad, ptrdiff_t limit,
                                 ptrdiff_t limit_step, ptrdiff_t window, float *m, float *l,
                                 float *acc, float *work);

void mha_kv_load_f16_f32(const uint16_t *src, ptrdiff_t src_rs, int n, int d, float *dst,
                         ptrdiff_t dst_rs);
void mha_kv_load_i8_f32(const int8_t *src, ptrdiff_t src_rs, const float *scale, int n, int d,
                        float *dst, ptrdiff_t dst_rs);

/* One task's attention over a stored K/V head, as the fused kernels run it: the direct
 * kernel above where `direct` (the callers' rule for few rows), else one tile of block_k keys
 * at a time converted by mha_kv_load_* into conv (block_k * (d + dv) floats: keys, then
 * values) and run through mha_fused_attend_f32 (attention_microkernel.h), its key counts
 * shifted to the tile. The other arguments are mha_kv_attend_direct_*'s, k and v pointing at
 * the head's key 0 (fmt: MHA_KV_F16 or MHA_KV_I8; the scales NULL for float16); work:
 * max(mha_kv_direct_scratch(), mha_fused_scratch_f32(d, dv)) floats. Shared by the general
 * attention kernel and the compiled step, so both give the same bits. */
void mha_kv_attend_f32(int fmt, int direct, const float *q, ptrdiff_t q_rs, int rows, int d,
                       const void *k, ptrdiff_t k_rs, const float *k_scale, const void *v,
                       ptrdiff_t v_rs, const float *v_scale, int dv, ptrdiff_t k_begin,
                       ptrdiff_t k_end, float scale, const float *add, ptrdiff_t add_rs,
                       ptrdiff_t add_ks, const unsigned char *pad, ptrdiff_t limit,
                       ptrdiff_t limit_step, ptrdiff_t window, float *m, float *l, float *acc,
                       float *work, float *conv, ptrdiff_t block_k);

#ifdef __cplusplus
}
#endif

#endif
