/* The int8 cache's direct kernel with integer products: included by kv_format_impl.h at the
 * AVX512-VNNI level only (MHA_KV_INT8_DOT), whose kv_block_ calls these in place of the
 * float products when its `dot` is set.
 *
 * Why: on Zen 4 the float kernel is bound by its FMAs, not by memory (a block of 4 query rows
 * does 2 x 4 x D FMA lanes a key, and the int8 key costs ~28 ns from L2 where reading its
 * bytes takes ~13). vpdpwssd multiplies 32 pairs of int16 and adds them into 16 int32 lanes
 * at the rate of a 16-lane FMA (Zen 4: 3.6 G/s each, and the two share their pipes), so
 * products of int16 halve the multiply instructions:
 * - scores: each query row is rounded to int16 once per call (q16 = round(q / sq), sq =
 *   max|q| / 32767) and the int8 key, sign-extended to int16, is multiplied exactly in int32;
 *   score = sq * (q16 . k) * scale * k_scale.
 * - P V: each row's probabilities of a key tile (the value scales folded in) are rounded to
 *   int16 (p16 = round(p / sp), sp = max p / 32767), and the V rows of two keys are
 *   interleaved byte by byte so one vpdpwssd adds p_j v_j + p_j+1 v_j+1 per column.
 * The int32 sums are exact (|q16 . k| <= 32767 * 127 * D < 2^31 for D <= MHA_KV_DOT_MAX_D; a
 * tile's P V <= 32767 * 127 * 64). What rounds: q and p, each to 2^-16 of their row's (the
 * tile's) largest value, 256 times finer than the cache's own 8 bits; so this path is not
 * bitwise the float path. The rounding of p dominates: measured within 3e-5 of max |V| (6e-5
 * of max |output| through a module) of the float computation on the dequantized cache, where
 * the int8 storage error itself is ~1e-2 (README; tests/test_cache_int8_dot.py holds 1e-4).
 * A tile whose probabilities are not all finite (NaN or inf in the cache: a NaN scale) runs
 * the float P V, so NaN propagates as in the float path; a query row that is not finite runs
 * the float kernel. */

#define KV_DOT_P_STRIDE (NK + 2)     /* int16 probabilities of a row (a tile, padded even) */
/* The smallest nonzero row maximum rounded to 16 bits: 2^-96, so that 32767 / max fits in
 * float32 (it overflows below ~1e-34, and every value would round to -32768) and max / 32767
 * stays a normal float (full precision). Rows below it run the float products: a query that
 * small against keys that large, values that small, or a tile whose scores all lie some 60
 * or more below the running maximum. */
#define KV_DOT_MIN_MAX 0x1p-96f

typedef int FN(kvint_) __attribute__((vector_size(64)));

/* MHA_HADD16 on int32 lanes, its two shuffles written as vshufps: gcc lowers the generic
 * integer shuffle to vpermt2d, whose index vectors (two per pair) it spilled and reloaded */
static inline __attribute__((always_inline)) FN(kvint_) FN(kv_hadd16i_)(FN(kvint_) a,
                                                                        FN(kvint_) b)
{
    __m512 x = _mm512_castsi512_ps((__m512i)a), y = _mm512_castsi512_ps((__m512i)b);
    return (FN(kvint_))_mm512_castps_si512(_mm512_shuffle_ps(x, y, 0x88))
         + (FN(kvint_))_mm512_castps_si512(_mm512_shuffle_ps(x, y, 0xdd));
}

/* lane i = sum of the lanes of v[i], i < 16 (decode_blocks.h's tree) */
static inline __attribute__((always_inline)) FN(kvint_) FN(kv_reducei_)(const FN(kvint_) *v)
{
    return MHA_REDUCE16_WITH(FN(kvint_), FN(kvmaskp_), FN(kv_hadd16i_), v);
}

static inline __attribute__((always_inline)) __mmask16 FN(kv_dot_mask16_)(ptrdiff_t left)
{
    return left >= 16 ? (__mmask16)0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
}

/* q16[i * dp + p] = round(q_i[p] / sq[i]) for p < d, 0 for d <= p < dp (d rounded up to a
 * multiple of 32), sq[i] = max|q_i| / 32767 (0 and zeros for a zero row). Returns 0, and
 * leaves the rest undefined, when a value is not finite. */
static int FN(kv_dot_quantize_q_)(int rows, const float *q, ptrdiff_t q_rs, int d, int dp,
                                  int16_t *q16, float *sq)
{
    for (int i = 0; i < rows; i++) {
        const float *qi = q + i * q_rs;
        __m512 mx = _mm512_setzero_ps(), bad = _mm512_setzero_ps();
        for (ptrdiff_t p = 0; p < d; p += 16) {
            __m512 x = _mm512_maskz_loadu_ps(FN(kv_dot_mask16_)(d - p), qi + p);
            bad = _mm512_add_ps(bad, _mm512_sub_ps(x, x));   /* NaN for inf and NaN */
            mx = _mm512_max_ps(mx, _mm512_abs_ps(x));
        }
        float m = _mm512_reduce_max_ps(mx);
        if (_mm512_reduce_add_ps(bad) != 0.0f || (m > 0 && m < KV_DOT_MIN_MAX))  /* NaN != 0 */
            return 0;
        float inv = m > 0 ? 32767.0f / m : 0.0f;
        sq[i] = m / 32767.0f;
        for (ptrdiff_t p = 0; p < dp; p += 16) {
            __m512 x = _mm512_maskz_loadu_ps(FN(kv_dot_mask16_)(d - p), qi + p);
            __m512i n = _mm512_cvtps_epi32(_mm512_mul_ps(x, _mm512_set1_ps(inv)));
            _mm256_storeu_si256((__m256i *)(q16 + i * dp + p), _mm512_cvtsepi32_epi16(n));
        }
    }
    return 1;
}

/* p16[i * KV_DOT_P_STRIDE + j] = round(p_ij / sp[i]) for j < nk (0 at j = nk), sp[i] = max_j
 * p_ij / 32767, from the probabilities s[i * NK + j] (>= 0 or -0.0). Returns 0 when one of
 * them is not finite. */
static inline __attribute__((always_inline)) int
FN(kv_dot_quantize_p_)(const int M, const float *s, int nk, int16_t *p16, float *sp)
{
    for (int i = 0; i < M; i++) {
        const float *si = s + i * NK;
        __m512 mx = _mm512_setzero_ps(), bad = _mm512_setzero_ps();
        for (ptrdiff_t j = 0; j < nk; j += 16) {
            __m512 x = _mm512_maskz_loadu_ps(FN(kv_dot_mask16_)(nk - j), si + j);
            bad = _mm512_add_ps(bad, _mm512_sub_ps(x, x));
            mx = _mm512_max_ps(mx, x);
        }
        float m = _mm512_reduce_max_ps(mx);
        if (_mm512_reduce_add_ps(bad) != 0.0f || (m > 0 && m < KV_DOT_MIN_MAX))
            return 0;
        float inv = m > 0 ? 32767.0f / m : 0.0f;
        sp[i] = m / 32767.0f;
        for (ptrdiff_t j = 0; j < nk + 1; j += 16) {
            __mmask16 k = FN(kv_dot_mask16_)(nk + 1 - j);
            __m512 x = _mm512_maskz_loadu_ps(FN(kv_dot_mask16_)(nk - j), si + j);
            __m512i n = _mm512_cvtps_epi32(_mm512_mul_ps(x, _mm512_set1_ps(inv)));
            _mm256_mask_storeu_epi16(p16 + i * KV_DOT_P_STRIDE + j, k,
                                     _mm512_cvtsepi32_epi16(n));
        }
    }
    return 1;
}

/* s[i * NK + c] = scale * ks[c] * sq[i] * (q16_i . k_c) for i < R, c < nk: kv_scores_'s
 * blocks of R rows x KB = 16 / R keys, in int32 lanes (exact), one shuffle tree per block;
 * prefetches as kv_scores_. */
static inline __attribute__((always_inline)) void
FN(kv_dot_scores_)(const int R, const int16_t *q16, int dp, const float *sq, int d,
                   const int8_t *k, ptrdiff_t k_rs, const float *ks, int nk, float scale,
                   float *s, const void *pf_v, ptrdiff_t v_rs, int dv, int nk_next,
                   const int first)
{
    const int KB = 16 / R;
    const ptrdiff_t dfull = (ptrdiff_t)d / 32 * 32;
    VECP sqv;
    for (int t = 0; t < 16; t++)
        sqv[t] = t < R * KB ? sq[t / KB] : 0.0f;
    for (ptrdiff_t c = 0; c < nk; c += KB) {
        ptrdiff_t kr[16];
        for (int u = 0; u < KB; u++)    /* keys past the tile: recompute key c, unused */
            kr[u] = (c + u < nk ? c + u : c) * k_rs;
        if (pf_v != NULL)
            FN(kv_prefetch_ahead_)(1, k, k_rs, d, pf_v, v_rs, dv, c, KB, nk + nk_next, first);
        FN(kvint_) a[16];
        for (int t = 0; t < 16; t++)
            a[t] = (FN(kvint_)){0};
        for (ptrdiff_t p = 0; p < dp; p += 32) {
            __m512i kw[16];
            for (int u = 0; u < KB; u++)
                kw[u] = _mm512_cvtepi8_epi16(
                    p < dfull ? _mm256_loadu_si256((const __m256i *)(k + kr[u] + p))
                              : _mm256_maskz_loadu_epi8((__mmask32)((1ull << (d - p)) - 1),
                                                        k + kr[u] + p));
            for (int i = 0; i < R; i++) {
                __m512i qv = _mm512_loadu_si512(q16 + i * dp + p);
                for (int u = 0; u < KB; u++)
                    a[i * KB + u] = (FN(kvint_))_mm512_dpwssd_epi32((__m512i)a[i * KB + u], qv,
                                                                    kw[u]);
            }
        }
        VECP t = (VECP)_mm512_cvtepi32_ps((__m512i)FN(kv_reducei_)(a)) * sqv;
        FN(kv_store_block_)(R, KB, t, s + c, (int)(nk - c < KB ? nk - c : KB));
    }
    for (int i = 0; i < R; i++)
        FN(kv_times_)(s + i * NK, ks, scale, nk);
}

/* acc[i * dv + e0 + (0 .. 32 NV)) += sp[i] * sum_j p16[i][j] v[j][e0 + ...] for i < M, the
 * columns below `cols` (the rest of the panel is the head dim's tail: masked). Two keys a
 * step: their V bytes interleaved (vpunpck{l,h}bw), so the int32 lanes of w[2c] hold the
 * columns 0-7 and 16-23 of the chunk c, w[2c + 1] 8-15 and 24-31; the sums are put back in
 * column order once per tile. Prefetches pf's rows (the next tile's V) as kv_pv_panel_. */
static inline __attribute__((always_inline)) void
FN(kv_dot_pv_panel_)(const int M, const int NV, const int16_t *p16, const float *sp, int nk,
                     const int8_t *v, ptrdiff_t v_rs, float *acc, int dv, ptrdiff_t e0,
                     int cols, const void *pf, int pf_n)
{
    const __mmask32 tail = cols >= 32 * NV ? ~(__mmask32)0
                                           : (__mmask32)((1ull << (cols - 32 * (NV - 1))) - 1);
    __m512i a[16];
    for (int t = 0; t < 2 * M * NV; t++)
        a[t] = _mm512_setzero_si512();
    for (ptrdiff_t j = 0; j < nk; j += 2) {
        for (ptrdiff_t u = j; pf != NULL && u < j + 2 && u < pf_n; u++) {
            const char *x = (const char *)pf + u * v_rs + e0;
            __builtin_prefetch(x, 0, 2);
            __builtin_prefetch(x + 32 * NV - 1, 0, 2);
        }
        const int8_t *va = v + j * v_rs + e0, *vb = j + 1 < nk ? va + v_rs : va;
        __m512i w[8];
        for (int c = 0; c < NV; c++) {
            __m256i x, y;
            if (c == NV - 1 && cols < 32 * NV) {
                x = _mm256_maskz_loadu_epi8(tail, va + 32 * c);
                y = _mm256_maskz_loadu_epi8(tail, vb + 32 * c);
            } else {
                x = _mm256_loadu_si256((const __m256i *)(va + 32 * c));
                y = _mm256_loadu_si256((const __m256i *)(vb + 32 * c));
            }
            w[2 * c] = _mm512_cvtepi8_epi16(_mm256_unpacklo_epi8(x, y));
            w[2 * c + 1] = _mm512_cvtepi8_epi16(_mm256_unpackhi_epi8(x, y));
        }
        for (int i = 0; i < M; i++) {
            int32_t pair;
            memcpy(&pair, p16 + i * KV_DOT_P_STRIDE + j, sizeof pair);
            __m512i pp = _mm512_set1_epi32(pair);
            for (int c = 0; c < 2 * NV; c++)
                a[i * 2 * NV + c] = _mm512_dpwssd_epi32(a[i * 2 * NV + c], w[c], pp);
        }
    }
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    for (int i = 0; i < M; i++)
        for (int c = 0; c < NV; c++) {
            __m512 x = _mm512_cvtepi32_ps(a[i * 2 * NV + 2 * c]);
            __m512 y = _mm512_cvtepi32_ps(a[i * 2 * NV + 2 * c + 1]);
            __m512 f = _mm512_set1_ps(sp[i]);
            float *o = acc + i * dv + e0 + 32 * c;
            int left = cols - 32 * c;
            __mmask16 m0 = FN(kv_dot_mask16_)(left), m1 = FN(kv_dot_mask16_)(left - 16);
            _mm512_mask_storeu_ps(o, m0, _mm512_fmadd_ps(_mm512_permutex2var_ps(x, lo, y), f,
                                                         _mm512_maskz_loadu_ps(m0, o)));
            _mm512_mask_storeu_ps(o + 16, m1,
                                  _mm512_fmadd_ps(_mm512_permutex2var_ps(x, hi, y), f,
                                                  _mm512_maskz_loadu_ps(m1, o + 16)));
        }
}

/* acc[i * dv + e] += sum_j p_ij v[j][e] for i < M, every e, with the rounded probabilities
 * (p16, sp): panels of as many 32-column chunks as keep 8 sums in flight, then the columns
 * left one chunk at a time, the last one masked. */
static inline __attribute__((always_inline)) void
FN(kv_dot_pv_)(const int M, const int16_t *p16, const float *sp, int nk, const int8_t *v,
               ptrdiff_t v_rs, float *acc, int dv, const void *pf, int pf_n)
{
    const int NV = M == 1 ? 4 : 2;
    ptrdiff_t e = 0;
    for (; e + 32 * NV <= dv; e += 32 * NV)
        FN(kv_dot_pv_panel_)(M, NV, p16, sp, nk, v, v_rs, acc, dv, e, 32 * NV, pf, pf_n);
    for (; e < dv; e += 32)
        FN(kv_dot_pv_panel_)(M, 1, p16, sp, nk, v, v_rs, acc, dv, e,
                             (int)(dv - e < 32 ? dv - e : 32), pf, pf_n);
}

#undef KV_DOT_P_STRIDE
#undef KV_DOT_MIN_MAX
