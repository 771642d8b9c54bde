/* Body of kv_format.c, included once per SIMD level (simd_isas.h); see kv_format.h.
 * One body for both stored formats: every function takes the format as a compile-time
 * constant `fmt` and is always_inline, so each exported function is specialized for its
 * format; the format enters only through how 8 stored values become a vector of floats. */

#define MHA_CAT_(a, b) a##b
#define MHA_CAT(a, b) MHA_CAT_(a, b)
#define FN(name) MHA_CAT(name, SUFFIX)

#include "decode_blocks.h"
#include "softmax_row_impl.h"

#define W 8            /* lanes of a 256-bit vector of floats */
#define NK MHA_KV_NK
#define VEC FN(kvvec_)

typedef float VEC __attribute__((vector_size(W * sizeof(float)), aligned(sizeof(float)),
                                 may_alias));
typedef signed char FN(kvbytes_) __attribute__((vector_size(W), aligned(1), may_alias));
typedef int FN(kvmask_) __attribute__((vector_size(W * sizeof(float))));

/* The vectors of the P V products, and since c189bf3 of the score products too (kv_scores_):
 * the widest of the SIMD level (512-bit at AVX-512). A P V lane is its own sum over the keys,
 * so that width changed no bit (output hash of f16 / int8 prefill and decode calls, head dims
 * 24-128, unchanged); a score lane is a partial sum of one dot product, so the scores' width
 * moved the AVX-512 level's bits (not the other levels'). The P V products on Intel Xeon, a
 * hot decode step (4 x 1 over 1024 cached, 32 / 8 heads, D 128), min of 4 interleaved runs,
 * 256 -> 512-bit, 1 thread (2): float16 1762 -> 1649 us (935 -> 828), int8 1662 -> 1492 (901
 * -> 839); from DRAM (decode_cache_*) within the noise. Neither change was measured on Zen 4,
 * which splits a 512-bit operation in two (an earlier 512-bit score product had made float16
 * slower there). */
#define WP (MHA_ISA_WIDE_BYTES / (int)sizeof(float))
#define VECP FN(kvvecp_)
typedef float VECP __attribute__((vector_size(WP * sizeof(float)), aligned(sizeof(float)),
                                  may_alias));

/* Stored values i .. i + 7 of `base` as floats (int8: unscaled). */
static inline __attribute__((always_inline)) VEC FN(kv_load8_)(const int fmt, const void *base,
                                                                ptrdiff_t i)
{
    if (fmt == MHA_KV_F16) {
#ifdef __F16C__
        return (VEC)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)));
#else
        VEC r;
        for (int t = 0; t < W; t++)
            r[t] = mha_half_to_float(((const uint16_t *)base)[i + t]);
        return r;
#endif
    }
#ifdef __AVX2__
    return (VEC)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
        _mm_loadl_epi64((const __m128i *)((const signed char *)base + i))));
#else
    return __builtin_convertvector(*(const FN(kvbytes_) *)((const signed char *)base + i), VEC);
#endif
}

static inline __attribute__((always_inline)) float FN(kv_load1_)(const int fmt,
                                                                  const void *base, ptrdiff_t i)
{
    if (fmt == MHA_KV_F16)
        return mha_half_to_float(((const uint16_t *)base)[i]);
    return (float)((const signed char *)base)[i];
}

/* Stored values i .. i + WP - 1 of `base` as floats (int8: unscaled). */
static inline __attribute__((always_inline)) VECP FN(kv_loadp_)(const int fmt, const void *base,
                                                                 ptrdiff_t i)
{
#if MHA_ISA_WIDE_BYTES == 64
    if (fmt == MHA_KV_F16)
        return (VECP)_mm512_cvtph_ps(
            _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i)));
    return (VECP)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128((const __m128i *)((const signed char *)base + i))));
#else
    return FN(kv_load8_)(fmt, base, i);
#endif
}

static inline __attribute__((always_inline)) void
FN(kv_load_)(const int fmt, const void *src, ptrdiff_t src_rs, const float *scale, int n, int d,
             float *dst, ptrdiff_t dst_rs)
{
    for (ptrdiff_t j = 0; j < n; j++) {
        float *o = dst + j * dst_rs;
        ptrdiff_t p = 0, row = j * src_rs;
        if (fmt == MHA_KV_I8) {
            float sj = scale[j];
            for (; p + W <= d; p += W)
                *(VEC *)(o + p) = FN(kv_load8_)(fmt, src, row + p) * sj;
            for (; p < d; p++)
                o[p] = FN(kv_load1_)(fmt, src, row + p) * sj;
        } else {
            for (; p + W <= d; p += W)
                *(VEC *)(o + p) = FN(kv_load8_)(fmt, src, row + p);
            for (; p < d; p++)
                o[p] = FN(kv_load1_)(fmt, src, row + p);
        }
    }
}

#ifndef MHA_KV_INT8_DOT    /* the VNNI level exports the int8 direct kernel only */
void FN(mha_kv_load_f16_)(const uint16_t *src, ptrdiff_t src_rs, int n, int d, float *dst,
                          ptrdiff_t dst_rs)
{
    FN(kv_load_)(MHA_KV_F16, src, src_rs, NULL, n, d, dst, dst_rs);
}

void FN(mha_kv_load_i8_)(const int8_t *src, ptrdiff_t src_rs, const float *scale, int n, int d,
                         float *dst, ptrdiff_t dst_rs)
{
    FN(kv_load_)(MHA_KV_I8, src, src_rs, scale, n, d, dst, dst_rs);
}
#endif

/* [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7] */
static inline VEC FN(kv_hadd_)(VEC a, VEC b)
{
    return __builtin_shuffle(a, b, (FN(kvmask_)){0, 2, 8, 10, 4, 6, 12, 14})
         + __builtin_shuffle(a, b, (FN(kvmask_)){1, 3, 9, 11, 5, 7, 13, 15});
}

/* lane i = sum of the lanes of v[i] */
static inline __attribute__((always_inline)) VEC FN(kv_reduce_)(const VEC *v)
{
    VEC f = FN(kv_hadd_)(FN(kv_hadd_)(v[0], v[1]), FN(kv_hadd_)(v[2], v[3]));
    VEC g = FN(kv_hadd_)(FN(kv_hadd_)(v[4], v[5]), FN(kv_hadd_)(v[6], v[7]));
    return __builtin_shuffle(f, g, (FN(kvmask_)){0, 1, 2, 3, 8, 9, 10, 11})
         + __builtin_shuffle(f, g, (FN(kvmask_)){4, 5, 6, 7, 12, 13, 14, 15});
}

#if MHA_ISA_WIDE_BYTES == 64
typedef int FN(kvmaskp_) __attribute__((vector_size(WP * sizeof(float))));

/* the first step of decode_blocks.h's tree on floats (vshufps) */
#define KV_HADD16(a, b) MHA_HADD16(FN(kvmaskp_), a, b)

static inline __attribute__((always_inline)) VECP FN(kv_reducep_)(const VECP *v)
{
    return MHA_REDUCE16_WITH(VECP, FN(kvmaskp_), KV_HADD16, v);
}

/* stored values i .. i + n - 1 of `base` (n < 16) as floats, the other lanes 0 */
static inline __attribute__((always_inline)) VECP FN(kv_loadp_tail_)(const int fmt,
                                                                      const void *base,
                                                                      ptrdiff_t i, int n)
{
    __mmask16 m = (__mmask16)((1u << n) - 1);
    if (fmt == MHA_KV_F16)
        return (VECP)_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)base + i));
    return (VECP)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_maskz_loadu_epi8(m, (const signed char *)base + i)));
}
#else
#define kv_reducep_ kv_reduce_
#endif

/* Into L2 (prefetcht1), as attention_microkernel_impl.h's prefetch_row_ does, and why; how
 * far ahead: kv_prefetch_keys_. (Zen 4, 2 threads, decode_cache_*, medians of 3 interleaved
 * runs, a tile ahead -> 16 keys: float16 2.43 -> 2.10 ms, int8 1.78 -> 1.90: the int8 loss,
 * then read as noise, is what kv_prefetch_keys_ gives back.) */
static inline __attribute__((always_inline)) void FN(kv_prefetch_)(const char *x, ptrdiff_t bytes)
{
#pragma GCC unroll 4
    for (ptrdiff_t e = 0; e < bytes; e += 64)
        __builtin_prefetch(x + e, 0, 2);
    __builtin_prefetch(x + bytes - 1, 0, 2);
}

/* s[i * NK + u] = t[i * KB + u] for i < R, u < left: a row's KB sums in one store of a
 * full block (a lane at a time cost about 25 instructions a key at R = 4). */
static inline __attribute__((always_inline)) void
FN(kv_store_block_)(const int R, const int KB, VECP t, float *s, int left)
{
    if (left == KB)
        for (int i = 0; i < R; i++)
            memcpy(s + i * NK, (const float *)&t + i * KB, KB * sizeof(float));
    else
        for (int i = 0; i < R; i++)
            for (int u = 0; u < left; u++)
                s[i * NK + u] = t[i * KB + u];
}

/* s[j] *= scale * ks[j] for j < n (the product of the two scales first, as a lane would). */
static inline __attribute__((always_inline)) void
FN(kv_times_)(float *s, const float *ks, float scale, int n)
{
    int j = 0;
    for (; j + W <= n; j += W)
        *(VEC *)(s + j) *= scale * *(const VEC *)(ks + j);
    for (; j < n; j++)
        s[j] *= scale * ks[j];
}

/* How many keys ahead kv_scores_ prefetches: MHA_KV_PREFETCH_BYTES of K rows (the float32
 * kernel's 16 keys at head dim 128), at least MHA_DECODE_PREFETCH_KEYS, at most a tile. A lead
 * counted in keys shrinks with the stored format: 16 int8 keys of 128 are 2 KiB, under 0.3 us
 * of this kernel, too little for DRAM's latency under load. Zen 4, decode_cache_* (8 rotated
 * caches, 2 threads), the three formats interleaved (cache_formats_interleaved.py), one build
 * with the lead read at run time, 6 runs of 100 rounds each: int8 at 16 keys 0.905-1.069 ms,
 * at 32 0.932-0.993, at 64 (8 KiB) 0.819-0.947; float16 at 16 keys 1.194-1.451, at 32 (8 KiB)
 * 1.236-1.373 (within the noise). */
#define MHA_KV_PREFETCH_BYTES 8192
static inline __attribute__((always_inline)) ptrdiff_t FN(kv_prefetch_keys_)(ptrdiff_t esz,
                                                                             int d)
{
    ptrdiff_t keys = MHA_KV_PREFETCH_BYTES / (esz * (d > 0 ? d : 1));
    return keys < MHA_DECODE_PREFETCH_KEYS ? MHA_DECODE_PREFETCH_KEYS : keys > NK ? NK : keys;
}

/* kv_scores_'s prefetches for its block of KB keys from key c: the K rows kv_prefetch_keys_
 * ahead (those below n_avail: the tile's and the next tile's), and on a task's `first` tile
 * the V rows too (esz: bytes per stored value). */
static inline __attribute__((always_inline)) void
FN(kv_prefetch_ahead_)(const ptrdiff_t esz, const void *k, ptrdiff_t k_rs, int d,
                       const void *pf_v, ptrdiff_t v_rs, int dv, ptrdiff_t c, const int KB,
                       ptrdiff_t n_avail, const int first)
{
    const ptrdiff_t ahead = FN(kv_prefetch_keys_)(esz, d) + c;
    const char *pv = (const char *)pf_v + ahead * v_rs * esz;
    const char *pk = (const char *)k + ahead * k_rs * esz;
    if (v_rs == dv && k_rs == d && dv == d && ahead + KB <= n_avail) {
        /* contiguous rows: the V and K rows of the block's keys, that far ahead, as
         * two spans, a line of each in turn (the per-row loops cost about 35
         * instructions a key for int8 rows of two lines) */
        const ptrdiff_t span = KB * d * esz;
        for (ptrdiff_t e = 0; e < span; e += 64) {
            if (first)
                __builtin_prefetch(pv + e, 0, 2);
            __builtin_prefetch(pk + e, 0, 2);
        }
        if (first)
            __builtin_prefetch(pv + span - 1, 0, 2);
        __builtin_prefetch(pk + span - 1, 0, 2);
    } else
        for (int u = 0; u < KB && ahead + u < n_avail; u++) {
            if (first)
                FN(kv_prefetch_)(pv + u * v_rs * esz, dv * esz);
            FN(kv_prefetch_)(pk + u * k_rs * esz, d * esz);
        }
}

/* s[i * NK + c] = scale * s_k[c] * (q_i . k_c) for i < R, c < nk: blocks of R rows x KB = WP / R
 * keys, whose WP vectors of partial sums one shuffle tree reduces (each K row is loaded, and
 * converted, once per block of rows). On the level's widest vectors: at AVX-512 a step of 16
 * values halves the conversions and FMAs of 8-value steps, and the head dim's tail is a masked
 * load. Intel Xeon, decode_cache_* shapes, min of 2 interleaved runs, 256 -> 512-bit: from L3
 * (2 caches), 1 thread: float16 3.64 -> 3.40 ms, int8 2.90 -> 2.42; from DRAM (24 caches),
 * 2 threads: float16 2.41 -> 2.26, int8 1.93 -> 1.82. With pf_v: prefetch the K rows
 * kv_prefetch_keys_ ahead (those that exist: nk_next, the next tile's keys), and on a
 * task's `first` tile the V rows too (pf_v: this tile's V; esz: bytes per stored value); the
 * later tiles' V rows come from kv_pv_panel_ of the tile before (direct_scores_ in
 * attention_microkernel_impl.h says why, with figures). */
static inline __attribute__((always_inline)) void
FN(kv_scores_)(const int fmt, const int R, const float *q, ptrdiff_t q_rs, int d,
               const void *k, ptrdiff_t k_rs, const float *ks, int nk, float scale, float *s,
               const void *pf_v, ptrdiff_t v_rs, int dv, int nk_next, const int first)
{
    const int KB = WP / R;
    const ptrdiff_t esz = fmt == MHA_KV_F16 ? 2 : 1;
    const ptrdiff_t dvec = (ptrdiff_t)d / WP * WP;
    for (ptrdiff_t c = 0; c < nk; c += KB) {
        ptrdiff_t kr[WP];
        for (int u = 0; u < KB; u++)    /* keys past the tile: recompute key c, unused */
            kr[u] = (c + u < nk ? c + u : c) * k_rs;
        if (pf_v != NULL)
            FN(kv_prefetch_ahead_)(esz, k, k_rs, d, pf_v, v_rs, dv, c, KB, nk + nk_next, first);
        VECP a[WP];
        for (int i = 0; i < WP; i++)
            a[i] = (VECP){0};
        for (ptrdiff_t p = 0; p < dvec; p += WP) {
            VECP kv[WP];
            for (int u = 0; u < KB; u++)
                kv[u] = FN(kv_loadp_)(fmt, k, kr[u] + p);
#define QV(i) (*(const VECP *)(q + (i) * q_rs + p))
            MHA_BLOCK_STEP(VECP, R, KB, QV, kv, a);
#undef QV
        }
#if MHA_ISA_WIDE_BYTES == 64
        if (dvec < d) {
            const int n = (int)(d - dvec);
            VECP kv[WP];
            for (int u = 0; u < KB; u++)
                kv[u] = FN(kv_loadp_tail_)(fmt, k, kr[u] + dvec, n);
#define QV(i) ((VECP)_mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), q + (i) * q_rs + dvec))
            MHA_BLOCK_STEP(VECP, R, KB, QV, kv, a);
#undef QV
        }
#endif
        VECP t = FN(kv_reducep_)(a);
        if (WP == W && dvec < d)       /* the 256-bit levels' tail, a value at a time */
            for (int i = 0; i < R; i++)
                for (int u = 0; u < KB; u++) {
                    float x = 0;
                    for (ptrdiff_t p = dvec; p < d; p++)
                        x += q[i * q_rs + p] * FN(kv_load1_)(fmt, k, kr[u] + p);
                    t[i * KB + u] += x;
                }
        if (fmt != MHA_KV_I8)
            t *= scale;         /* int8: times scale * ks[j], a pass over the tile below */
        FN(kv_store_block_)(R, KB, t, s + c, (int)(nk - c < KB ? nk - c : KB));
    }
    if (fmt == MHA_KV_I8)
        for (int i = 0; i < R; i++)
            FN(kv_times_)(s + i * NK, ks, scale, nk);
}

/* acc[i * dv + e] += sum_j s[i * NK + j] v[j * v_rs + e] for i < M, e in [e0, e1), never
 * reading the V of a key whose probability is -0.0 (hidden by a mask, the convention of
 * attention_tile.h where it has one): the slow path when the fast sums come out non-finite
 * (a NaN or inf in V, e.g. a float16 overflow), and the last dv % W columns. */
static void FN(kv_pv_exact_)(const int fmt, int M, const float *s, int nk, const void *v,
                             ptrdiff_t v_rs, float *acc, int dv, ptrdiff_t e0, ptrdiff_t e1)
{
    for (int i = 0; i < M; i++)
        for (ptrdiff_t j = 0; j < nk; j++) {
            float p = s[i * NK + j];
            if (p == 0 && signbit(p))
                continue;
            for (ptrdiff_t e = e0; e < e1; e++)
                acc[i * dv + e] += p * FN(kv_load1_)(fmt, v, j * v_rs + e);
        }
}

/* Whether every lane of the M x n vectors is finite (x - x is NaN for inf and NaN). */
static inline __attribute__((always_inline)) int FN(kv_finite_)(const int M, const VECP *a)
{
    VECP bad = (VECP){0};
    for (int i = 0; i < M; i++)
        bad += a[i] - a[i];
    for (int t = 0; t < WP; t++)
        if (bad[t] != 0 || bad[t] != bad[t])
            return 0;
    return 1;
}

/* acc[i * dv + e0 + (0 .. NV * W)) += sum_j s[i * NK + j] v[j * v_rs + e0 + ...] for i < M:
 * the M x NV sums in registers (MHA_PV_PANEL_VECTORS), each V row converted once;
 * sums that come out non-finite are redone by kv_pv_exact_ (acc still holds the old ones).
 * With pf != NULL, the panel's bytes of the pf_n rows at pf (the next tile's V) are
 * prefetched, a row per key. The float32 kernel's pv_panel_ (attention_microkernel_impl.h) is
 * this loop with plain loads. */
static inline __attribute__((always_inline)) void
FN(kv_pv_panel_)(const int fmt, const int M, const int NV, const float *s, int nk,
                 const void *v, ptrdiff_t v_rs, float *acc, int dv, ptrdiff_t e0,
                 const void *pf, int pf_n)
{
    const ptrdiff_t esz = fmt == MHA_KV_F16 ? 2 : 1;
    VECP a[16];
    for (int i = 0; i < M; i++)
        for (int c = 0; c < NV; c++)
            a[i * NV + c] = *(VECP *)(acc + i * dv + e0 + c * WP);
    for (ptrdiff_t j = 0; j < nk; j++) {
        if (pf != NULL && j < pf_n) {   /* this panel's bytes of the next tile's V row j */
            const char *x = (const char *)pf + (j * v_rs + e0) * esz;
            __builtin_prefetch(x, 0, 2);
            __builtin_prefetch(x + NV * WP * esz - 1, 0, 2);
        }
        VECP b[8];
        for (int c = 0; c < NV; c++)
            b[c] = FN(kv_loadp_)(fmt, v, j * v_rs + e0 + c * WP);
        for (int i = 0; i < M; i++) {
            float p = s[i * NK + j];
            for (int c = 0; c < NV; c++)
                a[i * NV + c] += p * b[c];
        }
    }
    if (!FN(kv_finite_)(M * NV, a)) {
        FN(kv_pv_exact_)(fmt, M, s, nk, v, v_rs, acc, dv, e0, e0 + NV * WP);
        return;
    }
    for (int i = 0; i < M; i++)
        for (int c = 0; c < NV; c++)
            *(VECP *)(acc + i * dv + e0 + c * WP) = a[i * NV + c];
}

/* acc[i * dv + e] += sum_j s[i * NK + j] v[j * v_rs + e] for i < M and every e. */
static inline __attribute__((always_inline)) void
FN(kv_pv_)(const int fmt, const int M, const float *s, int nk, const void *v, ptrdiff_t v_rs,
           float *acc, int dv, const void *pf, int pf_n)
{
    const int NV = MHA_PV_PANEL_VECTORS(M);
    ptrdiff_t e = 0;
    for (; e + NV * WP <= dv; e += NV * WP)
        FN(kv_pv_panel_)(fmt, M, NV, s, nk, v, v_rs, acc, dv, e, pf, pf_n);
    /* the columns left, in narrower panels (each as many chains as it can have) */
    if (NV > 4 && e + 4 * WP <= dv) {
        FN(kv_pv_panel_)(fmt, M, 4, s, nk, v, v_rs, acc, dv, e, pf, pf_n);
        e += 4 * WP;
    }
    if (NV > 2 && e + 2 * WP <= dv) {
        FN(kv_pv_panel_)(fmt, M, 2, s, nk, v, v_rs, acc, dv, e, pf, pf_n);
        e += 2 * WP;
    }
    if (e + WP <= dv) {
        FN(kv_pv_panel_)(fmt, M, 1, s, nk, v, v_rs, acc, dv, e, pf, pf_n);
        e += WP;
    }
    if (e < dv)
        FN(kv_pv_exact_)(fmt, M, s, nk, v, v_rs, acc, dv, e, dv);
}

/* p[j] *= vs[j] for j < n, except a hidden key's -0.0 (attention_tile.h), which stays:
 * the value scales folded into the probabilities. A hidden key's row is never read even when
 * it held NaN (scale NaN), while a visible key's scale is always multiplied in, even by a
 * probability that underflowed to +0 (0 * NaN = NaN, as in the float32 path). */
static inline __attribute__((always_inline)) void FN(kv_fold_scales_)(float *p, const float *vs,
                                                                      int n)
{
    int j = 0;
    for (; j + W <= n; j += W) {
        VEC x = *(VEC *)(p + j);
        FN(kvmask_) bits = (FN(kvmask_))x, hidden = bits == (int)0x80000000u;
        *(VEC *)(p + j) = (VEC)(((FN(kvmask_))(x * *(const VEC *)(vs + j)) & ~hidden)
                                | (bits & hidden));
    }
    for (; j < n; j++)
        if (!(p[j] == 0 && signbit(p[j])))
            p[j] *= vs[j];
}

#ifdef MHA_KV_INT8_DOT
#include "kv_int8_dot_impl.h"
#endif

/* One block of M rows against the keys [j0, j0 + nk): scores, the masks and online softmax
 * of attention_tile.c per row (the float32 path's mask and NaN semantics), P V. prefetch as
 * in attention_microkernel_impl.h's direct_block_: 0 none, 1 K ahead and the next tile's V,
 * 2 the same plus this tile's V (a task's first tile). With `dot` (int8 at the VNNI level
 * only): the integer products of kv_int8_dot_impl.h, q16 / sq the block's rounded rows. */
static inline __attribute__((always_inline)) void
FN(kv_block_)(const int fmt, const int dot, const int M, const float *q, ptrdiff_t q_rs, int d,
              const int16_t *q16, int dp, const float *sq, const void *k, ptrdiff_t k_rs,
              const float *ks, int nk, const void *v, ptrdiff_t v_rs, const float *vs, int dv,
              ptrdiff_t j0, float scale, const float *add, ptrdiff_t add_rs, ptrdiff_t add_ks,
              const unsigned char *pad, ptrdiff_t limit, ptrdiff_t limit_step,
              ptrdiff_t window, float *m, float *l, float *acc, float *s, int prefetch,
              int nk_next)
{
    const ptrdiff_t esz = fmt == MHA_KV_F16 ? 2 : 1;
    const char *kt = (const char *)k + j0 * k_rs * esz, *vt = (const char *)v + j0 * v_rs * esz;
    const void *pf = prefetch && nk_next > 0 ? vt + nk * v_rs * esz : NULL;
#ifdef MHA_KV_INT8_DOT
    if (dot)
        FN(kv_dot_scores_)(M, q16, dp, sq, d, (const int8_t *)kt, k_rs, ks + j0, nk, scale, s,
                           prefetch ? vt : NULL, v_rs, dv, nk_next, prefetch == 2);
    else
#endif
        FN(kv_scores_)(fmt, M, q, q_rs, d, kt, k_rs, ks == NULL ? NULL : ks + j0, nk, scale,
                       s, prefetch ? vt : NULL, v_rs, dv, nk_next, prefetch == 2);
    FN(online_softmax_rows_)(M, s, NK, nk, dv, j0, add, add_rs, add_ks, pad, limit, limit_step,
                             window, m, l, acc);
    for (int i = 0; fmt == MHA_KV_I8 && i < M; i++)
        FN(kv_fold_scales_)(s + i * NK, vs + j0, nk);
#ifdef MHA_KV_INT8_DOT
    /* the integer P V, unless the tile's probabilities hold NaN or inf or are too small to
     * round (kv_dot_quantize_p_): the float products below then propagate them */
    int16_t p16[DRB * (NK + 2)];
    float sp[DRB];
    if (dot && FN(kv_dot_quantize_p_)(M, s, nk, p16, sp)) {
        FN(kv_dot_pv_)(M, p16, sp, nk, (const int8_t *)vt, v_rs, acc, dv, pf, nk_next);
        return;
    }
#endif
    (void)dot, (void)q16, (void)dp, (void)sq;
    FN(kv_pv_)(fmt, M, s, nk, vt, v_rs, acc, dv, pf, nk_next);
}

/* Every block of rows against every tile of [k_begin, k_end). With `dot`: q16 / sq hold every
 * row rounded (kv_dot_quantize_q_), dp int16 a row. */
static inline __attribute__((always_inline)) void
FN(kv_direct_)(const int fmt, const int dot, const int16_t *q16, int dp, const float *sq,
               const float *q, ptrdiff_t q_rs, int rows, int d, const void *k,
               ptrdiff_t k_rs, const float *ks, const void *v, ptrdiff_t v_rs, const float *vs,
               int dv, ptrdiff_t k_begin, ptrdiff_t k_end, float scale, const float *add,
               ptrdiff_t add_rs, ptrdiff_t add_ks, const unsigned char *pad, ptrdiff_t limit,
               ptrdiff_t limit_step, ptrdiff_t window, float *m, float *l, float *acc,
               float *work)
{
    float *s = work;
#define KV_BLOCK(M)                                                                          \
    FN(kv_block_)(fmt, dot, (M), q + r * q_rs, q_rs, d, q16 + r * dp, dp, sq + r, k, k_rs,  \
                  ks, nk, v, v_rs, vs, dv, j0,                                               \
                  scale, add == NULL ? NULL : add + r * add_rs, add_rs, add_ks, pad,         \
                  limit + r * limit_step, limit_step, window, m + r, l + r, acc + r * dv,   \
                  s, r == 0 ? (j0 == k_begin ? 2 : 1) : 0, nk_next)
    for (ptrdiff_t j0 = k_begin; j0 < k_end; j0 += NK) {
        int nk = (int)(k_end - j0 < NK ? k_end - j0 : NK);
        ptrdiff_t after = k_end - j0 - nk;
        int nk_next = (int)(after < NK ? after : NK);
        for (ptrdiff_t r = 0; r < rows; r += DRB) {
            int left = (int)(rows - r);
            /* rows that see no key of the tile, or whose windows all start after it */
            if (limit + (r + (left < DRB ? left : DRB) - 1) * limit_step <= j0)
                continue;
            if (window > 0 && limit + r * limit_step - window >= j0 + nk)
                continue;
            switch (left < DRB ? left : DRB) {
            case 1: KV_BLOCK(1); break;
            case 2: KV_BLOCK(2); break;
            case 3: KV_BLOCK(3); break;
            default: KV_BLOCK(DRB); break;
            }
        }
    }
#undef KV_BLOCK
}

#ifndef MHA_KV_INT8_DOT
void FN(mha_kv_attend_direct_f16_)(const float *q, ptrdiff_t q_rs, int rows, int d,
                                   const uint16_t *k, ptrdiff_t k_rs, const uint16_t *v,
                                   ptrdiff_t v_rs, int dv, ptrdiff_t k_begin, ptrdiff_t k_end,
                                   float scale, const float *add, ptrdiff_t add_rs,
                                   ptrdiff_t add_ks, const unsigned char *pad, ptrdiff_t limit,
                                   ptrdiff_t limit_step, ptrdiff_t window, float *m, float *l,
                                   float *acc, float *work)
{
    FN(kv_direct_)(MHA_KV_F16, 0, NULL, 0, NULL, q, q_rs, rows, d, k, k_rs, NULL, v, v_rs,
                   NULL, dv, k_begin, k_end, scale, add, add_rs, add_ks, pad, limit, limit_step,
                   window, m, l, acc, work);
}
#endif

void FN(mha_kv_attend_direct_i8_)(const float *q, ptrdiff_t q_rs, int rows, int d,
                                  const int8_t *k, ptrdiff_t k_rs, const float *k_scale,
                                  const int8_t *v, ptrdiff_t v_rs, const float *v_scale, int dv,
                                  ptrdiff_t k_begin, ptrdiff_t k_end, float scale,
                                  const float *add, ptrdiff_t add_rs, ptrdiff_t add_ks,
                                  const unsigned char *pad, ptrdiff_t limit,
                                  ptrdiff_t limit_step, ptrdiff_t window, float *m, float *l,
                                  float *acc, float *work)
{
#ifdef MHA_KV_INT8_DOT
    /* the integer products where their sums stay exact in int32 and q is finite */
    const int dp = (d + 31) / 32 * 32;
    int16_t q16[MHA_KV_DOT_MAX_ROWS * MHA_KV_DOT_MAX_D];
    float sq[MHA_KV_DOT_MAX_ROWS];
    if (rows <= MHA_KV_DOT_MAX_ROWS && d <= MHA_KV_DOT_MAX_D
        && FN(kv_dot_quantize_q_)(rows, q, q_rs, d, dp, q16, sq)) {
        FN(kv_direct_)(MHA_KV_I8, 1, q16, dp, sq, q, q_rs, rows, d, k, k_rs, k_scale, v, v_rs,
                       v_scale, dv, k_begin, k_end, scale, add, add_rs, add_ks, pad, limit,
                       limit_step, window, m, l, acc, work);
        return;
    }
#endif
    FN(kv_direct_)(MHA_KV_I8, 0, NULL, 0, NULL, q, q_rs, rows, d, k, k_rs, k_scale, v, v_rs,
                   v_scale, dv, k_begin, k_end, scale, add, add_rs, add_ks, pad, limit,
                   limit_step, window, m, l, acc, work);
}

#undef VEC
#undef VECP
#undef KV_HADD16
#undef kv_reducep_
#undef WP
#undef NK
#undef W
#undef FN
#undef MHA_CAT
#undef MHA_CAT_
