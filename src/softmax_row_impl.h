/* The steps of one row's softmax (masks and max, exp and sum, the online update), as static
 * inline functions of one floating type and SIMD level: included by attention_tile_impl.h
 * (the public row functions) and by the fused kernels' bodies (attention_microkernel_impl.h,
 * kv_format_impl.h), which inline them instead of calling attention_tile.c once per row and
 * key tile (the call and mask_and_max_'s were 4.5% of the samples of a causal prefill; Zen 4,
 * 1 thread, (1, 8, 4096, 64): 229-265 -> 222-233 ms in interleaved runs, the same bits).
 * Defines needed: REAL, FN(name), EXP (the scalar exp of fast_exp.h), EXP_C(NAME) (its
 * constants). No include guard: included once per type and level. Loop indices are
 * ptrdiff_t, as in attention_tile_impl.h. */

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>     /* the AVX-512 exp below (an include guard of its own) */
#endif

/* Without -ffast-math gcc vectorizes no reduction on its own (it may not reorder one running
 * result): the max gets an OpenMP SIMD reduction (-fopenmp-simd; measured 0.52 -> 0.42
 * ns/key per softmax row), the sum, whose loop also holds the exp, VX_BLOCK partial sums, which
 * vectorized better there than the pragma did. A NaN score still ends in a NaN output. */

/* Pass 1 of every row, its masks: add the additive mask, then mark the keys that causality,
 * the sliding window or padding hide with -inf (after the addition, so that a +inf or NaN in
 * the additive mask at a hidden key cannot turn it into NaN). */
static inline __attribute__((always_inline)) void
FN(mask_row_)(REAL *s, int n, const REAL *add, ptrdiff_t add_stride, const unsigned char *pad,
              int n_skip, int n_valid)
{
    if (add != NULL) {  /* -inf hides the key whatever its score (NaN or +inf - inf: NaN) */
        if (add_stride == 1)
            for (ptrdiff_t j = 0; j < n; j++)
                s[j] = add[j] == -INFINITY ? -INFINITY : s[j] + add[j];
        else
            for (ptrdiff_t j = 0; j < n; j++)
                s[j] = add[j * add_stride] == -INFINITY ? -INFINITY : s[j] + add[j * add_stride];
    }
    if (n_valid < n)
        for (ptrdiff_t j = (n_valid > 0 ? n_valid : 0); j < n; j++)
            s[j] = -INFINITY;
    for (ptrdiff_t j = 0; j < (n_skip < n ? n_skip : n); j++)
        s[j] = -INFINITY;
    if (pad != NULL)
        for (ptrdiff_t j = 0; j < n; j++)
            s[j] = pad[j] ? -INFINITY : s[j];
}

/* Pass 1 whole: the masks, then the row max, or NaN when a visible score is NaN. The max skips
 * NaN, so without that flag a row whose scores are all NaN would look fully masked and give
 * zeros: a NaN (or a +inf, whose exp(inf - inf) is NaN) that reaches a row's scores makes the
 * whole row NaN, as in NumPy and torch. */
static inline REAL FN(mask_and_max_)(REAL *s, int n, const REAL *add, ptrdiff_t add_stride,
                                     const unsigned char *pad, int n_skip, int n_valid)
{
    FN(mask_row_)(s, n, add, add_stride, pad, n_skip, n_valid);
    REAL mx = -INFINITY;
    int nan_seen = 0;
#pragma omp simd reduction(max : mx) reduction(| : nan_seen)
    for (ptrdiff_t j = 0; j < n; j++) {
        mx = s[j] > mx ? s[j] : mx;
        nan_seen |= s[j] != s[j];
    }
    return nan_seen ? (REAL)NAN : mx;
}

/* Pass 2: s_j <- exp(s_j - mx), and -0.0 for a hidden key (s_j = -inf: masked, or -inf
 * from the data; NaN stays NaN); return the sum. The sign marks the keys whose V the P V
 * products must not read (attention_tile.h). The exp runs on 256-bit GNU vectors (512-bit at
 * AVX-512 for float, below), VX_BLOCK of them at a time, each step of the polynomial over all
 * of them before the next (gcc keeps that order: it does not reschedule on x86), so VX_BLOCK
 * chains of dependent FMAs are in flight. The loop gcc vectorized by itself (16 lanes of the
 * scalar EXP) ran its two chains almost one after the other: Zen 1, one row of 64 / 256
 * scores, 2.7 / 2.2 -> 2.2 / 1.6 ns a score; the fused kernel, 256 rows, D = 64: 4% faster
 * (the same run, 1 thread). A call for a block's rows at once (its passes over every row
 * before the next) measured no faster. */
typedef REAL FN(vreal_) __attribute__((vector_size(32), aligned(sizeof(REAL)), may_alias));
typedef EXP_C(INT) FN(vint_) __attribute__((vector_size(32)));
#define VR FN(vreal_)
#define VI FN(vint_)
#define VN ((ptrdiff_t)(32 / sizeof(REAL)))
#define VX_BLOCK 4

#define VX_FOR for (int u = 0; u < nv; u++)

/* x[u] <- EXP(x[u] - mx) for u < nv <= VX_BLOCK (the operations of fast_exp.h in the same
 * order: the same bits), -0.0 where x[u] is -inf and a sign-flipped NaN where it is NaN, as
 * the scalar form gives; part[u] += the result. */
static inline __attribute__((always_inline)) void FN(vexp_block_)(const int nv, VR *x, REAL mx,
                                                                  VR *part)
{
    const VI sign = (VI){0} + ((EXP_C(INT))1 << (8 * sizeof(REAL) - 1));
    VI under[VX_BLOCK], hidden[VX_BLOCK];
    VR xc[VX_BLOCK], t[VX_BLOCK], nn[VX_BLOCK], r[VX_BLOCK], p[VX_BLOCK];
    VX_FOR hidden[u] = ~(x[u] > (REAL)-INFINITY);
    VX_FOR xc[u] = x[u] - mx;
    VX_FOR under[u] = xc[u] < (REAL)EXP_C(UNDERFLOW);
    VX_FOR xc[u] = (VR)((VI)xc[u] & ~under[u]);
    VX_FOR t[u] = xc[u] * (REAL)EXP_C(LOG2E) + (REAL)EXP_C(ROUND_MAGIC);
    VX_FOR nn[u] = t[u] - (REAL)EXP_C(ROUND_MAGIC);
    VX_FOR r[u] = xc[u] - nn[u] * (REAL)EXP_C(LN2_HI);
    VX_FOR r[u] = r[u] - nn[u] * (REAL)EXP_C(LN2_LO);
    EXP_C(POLY_STEPS)(VX_FOR, p, r);
    VX_FOR t[u] = (VR)(((VI)t[u] - EXP_C(MAGIC_BITS) + EXP_C(BIAS)) << EXP_C(MANT_BITS));
    VX_FOR p[u] = (VR)(((VI)(p[u] * t[u]) & ~under[u]) ^ (hidden[u] & sign));
    VX_FOR part[u] += p[u];
    VX_FOR x[u] = p[u];
}

#if MHA_ISA_WIDE_BYTES == 64 && EXP_C(AVX512_BODY)
/* AVX-512 (float): 16 lanes a vector, the masks in mask registers, 2^n by vscalefps (exact,
 * as the multiplication by 2^n it replaces: the same values), and a row's last n % 16 scores
 * in one masked vector instead of a scalar loop: about 19 instructions per 16 scores where
 * the 8-lane code below takes about 48 (as GNU vectors of 16 lanes its compares went through
 * mask registers and back to vectors: 3-10% slower). The sum's order differs from the 8-lane
 * code's (other bits at this level only). Zen 4, 1 thread, exp_and_sum_'s share of a causal
 * prefill's kernel samples 17.6% -> 14.8%; medians of interleaved runs, (1, 8, 4096, 64)
 * causal 255 -> 232 ms, (8, 12, 512, 64) 90.4 -> 85.7 ms, (1, 12, 128, 64) unchanged. */
static inline __attribute__((always_inline)) void FN(vexp16_block_)(const int nv, __m512 *x,
                                                                    REAL mx, __m512 *part)
{
    __mmask16 hidden[VX_BLOCK], keep[VX_BLOCK];
    __m512 xc[VX_BLOCK], t[VX_BLOCK], nn[VX_BLOCK], r[VX_BLOCK], p[VX_BLOCK];
    /* hidden: not > -inf (-inf or NaN); keep: not below the underflow (NaN too) */
    VX_FOR hidden[u] = _mm512_cmp_ps_mask(x[u], _mm512_set1_ps(-INFINITY), _CMP_NGT_UQ);
    VX_FOR xc[u] = x[u] - mx;
    VX_FOR keep[u] = _mm512_cmp_ps_mask(xc[u], _mm512_set1_ps(EXP_C(UNDERFLOW)), _CMP_NLT_UQ);
    VX_FOR xc[u] = _mm512_maskz_mov_ps(keep[u], xc[u]);
    VX_FOR t[u] = xc[u] * EXP_C(LOG2E) + EXP_C(ROUND_MAGIC);
    VX_FOR nn[u] = t[u] - EXP_C(ROUND_MAGIC);
    VX_FOR r[u] = xc[u] - nn[u] * EXP_C(LN2_HI);
    VX_FOR r[u] = r[u] - nn[u] * EXP_C(LN2_LO);
    EXP_C(POLY_STEPS)(VX_FOR, p, r);
    VX_FOR p[u] = _mm512_maskz_mov_ps(keep[u], _mm512_scalef_ps(p[u], nn[u]));
    VX_FOR p[u] = _mm512_mask_xor_ps(p[u], hidden[u], p[u], _mm512_set1_ps(-0.0f));
    VX_FOR part[u] += p[u];
    VX_FOR x[u] = p[u];
}

/* exp_and_sum_ but for the last step: the row's 16 partial sums, whose lanes the caller adds
 * (row_reduce_ for a block's rows at once). */
static inline __attribute__((always_inline)) __m512 FN(exp_and_parts_)(REAL *s, int n, REAL mx)
{
    __m512 part[VX_BLOCK], x[VX_BLOCK];
    for (int u = 0; u < VX_BLOCK; u++)
        part[u] = _mm512_setzero_ps();
    ptrdiff_t j = 0;
    for (; j + VX_BLOCK * 16 <= n; j += VX_BLOCK * 16) {
        for (int u = 0; u < VX_BLOCK; u++)
            x[u] = _mm512_loadu_ps(s + j + u * 16);
        FN(vexp16_block_)(VX_BLOCK, x, mx, part);
        for (int u = 0; u < VX_BLOCK; u++)
            _mm512_storeu_ps(s + j + u * 16, x[u]);
    }
    int left = (int)((n - j) / 16);     /* whole vectors left, fewer than VX_BLOCK */
    for (int u = 0; u < left; u++)
        x[u] = _mm512_loadu_ps(s + j + u * 16);
    switch (left) {
    case 3: FN(vexp16_block_)(3, x, mx, part); break;
    case 2: FN(vexp16_block_)(2, x, mx, part); break;
    case 1: FN(vexp16_block_)(1, x, mx, part); break;
    }
    for (int u = 0; u < left; u++)
        _mm512_storeu_ps(s + j + u * 16, x[u]);
    j += left * 16;
    if (j < n) {        /* the last n - j < 16: lanes past n read as -inf, hidden (-0.0) */
        __mmask16 k = (__mmask16)((1u << (n - j)) - 1);
        x[0] = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, s + j);
        FN(vexp16_block_)(1, x, mx, part);
        _mm512_mask_storeu_ps(s + j, k, x[0]);
    }
    return (part[0] + part[1]) + (part[2] + part[3]);
}

static inline __attribute__((always_inline)) REAL FN(exp_and_sum_)(REAL *s, int n, REAL mx)
{
    return _mm512_reduce_add_ps(FN(exp_and_parts_)(s, n, mx));
}

/* out[i] := the sum (is_max: the max) of the 16 lanes of v[i], i < M <= 16, for the rows of
 * a block at once: pairs of rows go through each halving step together (lane j + lane j + 8,
 * then + 4, + 2, + 1: the additions of gcc's _mm512_reduce_add_ps, so the same sums, bit for
 * bit) in about 3 instructions a row instead of its 8, no chain of latencies per row. That
 * per-row reduction was 5% of an SDPA call's samples (Intel Xeon, (1, 12, 128), 1 thread).
 * The lanes of a max hold no NaN (lane_max_ flags those apart). */
static inline __attribute__((always_inline)) __m512 FN(combine_)(__m512 a, __m512 b,
                                                                  const int is_max)
{
    return is_max ? _mm512_max_ps(a, b) : _mm512_add_ps(a, b);
}

static inline __attribute__((always_inline)) void FN(row_reduce_)(const int M, const __m512 *v,
                                                                   REAL *out, const int is_max)
{
    if (M <= 2) {
        for (int i = 0; i < M; i++)
            out[i] = is_max ? _mm512_reduce_max_ps(v[i]) : _mm512_reduce_add_ps(v[i]);
        return;
    }
    const __m512 z = is_max ? _mm512_set1_ps(-INFINITY) : _mm512_setzero_ps();
    __m512 a[8], b[4], c[2];
    /* a[k]: rows 2k, 2k + 1, 8 lanes each: lanes j + j + 8 (256-bit halves) */
    for (int k = 0; k < (M + 1) / 2; k++) {
        __m512 u = v[2 * k], w = 2 * k + 1 < M ? v[2 * k + 1] : z;
        a[k] = FN(combine_)(_mm512_shuffle_f32x4(u, w, 0x44), _mm512_shuffle_f32x4(u, w, 0xEE),
                            is_max);
    }
    /* b[k]: rows 4k .. 4k + 3, a quarter each: lanes j + j + 4 (128-bit quarters) */
    for (int k = 0; k < (M + 3) / 4; k++) {
        __m512 u = a[2 * k], w = 2 * k + 1 < (M + 1) / 2 ? a[2 * k + 1] : z;
        b[k] = FN(combine_)(_mm512_shuffle_f32x4(u, w, 0x88), _mm512_shuffle_f32x4(u, w, 0xDD),
                            is_max);
    }
    /* c[k]: rows 8k .. 8k + 7, 2 lanes each (quarter q: rows 8k + q, 8k + 4 + q): j + j + 2 */
    for (int k = 0; k < (M + 7) / 8; k++) {
        __m512 u = b[2 * k], w = 2 * k + 1 < (M + 3) / 4 ? b[2 * k + 1] : z;
        c[k] = FN(combine_)(_mm512_shuffle_ps(u, w, 0x44), _mm512_shuffle_ps(u, w, 0xEE), is_max);
    }
    /* lane 4q + r: row q + 4r (q, r < 4): lane 0 + lane 1 of each row */
    __m512 w = M > 8 ? c[1] : z;
    __m512 d = FN(combine_)(_mm512_shuffle_ps(c[0], w, 0x88), _mm512_shuffle_ps(c[0], w, 0xDD),
                            is_max);
    REAL lanes[16];
    _mm512_storeu_ps(lanes, d);
    for (int i = 0; i < M; i++)
        out[i] = lanes[(i % 4) * 4 + i / 4];
}

/* The 16 lane maxes of a masked row (hidden keys -inf), NaN skipped (vmaxps(x, m) is x > m ?
 * x : m, the scalar max's step); *nan_seen: whether a score is NaN. mask_and_max_'s max but
 * for the lanes' reduction (row_reduce_, for the rows of a block at once). */
static inline __attribute__((always_inline)) __m512 FN(lane_max_)(const REAL *s, int n,
                                                                  int *nan_seen)
{
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 mx[2] = {ninf, ninf};
    __mmask16 nan = 0;
    int j = 0;
    for (; j + 32 <= n; j += 32)
        for (int u = 0; u < 2; u++) {
            __m512 x = _mm512_loadu_ps(s + j + 16 * u);
            nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
            mx[u] = _mm512_max_ps(x, mx[u]);
        }
    for (; j < n; j += 16) {
        __mmask16 k = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        __m512 x = _mm512_mask_loadu_ps(ninf, k, s + j);
        nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        mx[0] = _mm512_max_ps(x, mx[0]);
    }
    *nan_seen = nan != 0;
    return _mm512_max_ps(mx[0], mx[1]);
}
#else
static inline REAL FN(exp_and_sum_)(REAL *s, int n, REAL mx)
{
    VR part[VX_BLOCK], x[VX_BLOCK];
    for (int u = 0; u < VX_BLOCK; u++)
        part[u] = (VR){0};
    ptrdiff_t j = 0;
    for (; j + VX_BLOCK * VN <= n; j += VX_BLOCK * VN) {
        for (int u = 0; u < VX_BLOCK; u++)
            x[u] = *(VR *)(s + j + u * VN);
        FN(vexp_block_)(VX_BLOCK, x, mx, part);
        for (int u = 0; u < VX_BLOCK; u++)
            *(VR *)(s + j + u * VN) = x[u];
    }
    int left = (int)((n - j) / VN);     /* whole vectors left, fewer than VX_BLOCK */
    for (int u = 0; u < left; u++)
        x[u] = *(VR *)(s + j + u * VN);
    switch (left) {
    case 3: FN(vexp_block_)(3, x, mx, part); break;
    case 2: FN(vexp_block_)(2, x, mx, part); break;
    case 1: FN(vexp_block_)(1, x, mx, part); break;
    }
    for (int u = 0; u < left; u++)
        *(VR *)(s + j + u * VN) = x[u];
    j += left * VN;
    VR total = (part[0] + part[1]) + (part[2] + part[3]);
    REAL sum = 0;
    for (ptrdiff_t u = 0; u < VN; u++)
        sum += total[u];
    for (; j < n; j++) {
        REAL p = EXP(s[j] - mx);
        s[j] = s[j] > -INFINITY ? p : -p;
        sum += s[j];
    }
    return sum;
}

#endif

/* The running max of a row after a tile whose max (once masked: hidden keys -inf) is
 * tile_max, NaN when a visible score is NaN: a NaN max (a NaN score) sticks, every later tile
 * keeps it and the row ends NaN. */
static inline __attribute__((always_inline)) REAL FN(online_max_)(REAL tile_max, REAL m_old)
{
    return tile_max > m_old || tile_max != tile_max ? tile_max : m_old;
}

/* A tile's row whose running max is m_new = -inf: nothing visible yet, m = -inf, l = 0 and
 * acc = 0 stay; every key is hidden (-0.0). */
static inline __attribute__((always_inline)) void FN(hide_row_)(REAL *s, int n)
{
    for (ptrdiff_t j = 0; j < n; j++)
        s[j] = (REAL)-0.0;
}

/* The running sum and output of a row once its tile's exps (sum, against m_new > -inf) are
 * known: rescaled by exp(m_old - m_new) when the max moved. */
static inline __attribute__((always_inline)) void
FN(online_rescale_)(REAL m_new, REAL sum, REAL *m, REAL *l, REAL *acc, int dv)
{
    REAL m_old = *m;
    if (m_new != m_old) {
        REAL alpha = EXP(m_old - m_new);  /* 0 on the first visible tile (m_old = -inf) */
        for (ptrdiff_t d = 0; d < dv; d++)
            acc[d] *= alpha;
        *l = *l * alpha + sum;
    } else {
        *l += sum;
    }
    *m = m_new;
}

/* The online-softmax update of one row whose tile max is known. */
static inline __attribute__((always_inline)) void
FN(online_update_)(REAL *s, int n, REAL tile_max, REAL *m, REAL *l, REAL *acc, int dv)
{
    REAL m_new = FN(online_max_)(tile_max, *m);
    if (m_new == -INFINITY) {
        FN(hide_row_)(s, n);
        return;
    }
    FN(online_rescale_)(m_new, FN(exp_and_sum_)(s, n, m_new), m, l, acc, dv);
}

/* One row's online-softmax update against one key tile: see mha_online_softmax_row_f32 in
 * attention_tile.h. */
static inline __attribute__((always_inline)) void
FN(online_softmax_row_)(REAL *s, int n, const REAL *add, ptrdiff_t add_stride,
                        const unsigned char *pad, int n_skip, int n_valid, REAL *m, REAL *l,
                        REAL *acc, int dv)
{
    REAL tile_max = FN(mask_and_max_)(s, n, add, add_stride, pad, n_skip, n_valid);
    FN(online_update_)(s, n, tile_max, m, l, acc, dv);
}

/* The keys [j0, j0 + nk) of a tile that row i of a block sees: from n_skip (the sliding
 * window, > 0) to n_valid (causality), relative to j0 and within [0, nk]. */
static inline __attribute__((always_inline)) void
FN(row_span_)(int i, int nk, ptrdiff_t j0, ptrdiff_t limit, ptrdiff_t limit_step,
              ptrdiff_t window, int *n_skip, int *n_valid)
{
    ptrdiff_t valid = limit + i * limit_step - j0;
    ptrdiff_t skip = window > 0 ? limit + i * limit_step - window - j0 : 0;
    *n_valid = (int)(valid < 0 ? 0 : (valid > nk ? nk : valid));
    *n_skip = (int)(skip < 0 ? 0 : (skip > nk ? nk : skip));
}

/* The masks and the online softmax of M rows (row i at s + i * s_rs) against the keys
 * [j0, j0 + nk): row i sees keys j < limit + i * limit_step (causal), and with window > 0
 * also j >= limit + i * limit_step - window; add (key j of row i at add[i * add_rs + j *
 * add_ks]) and pad as in attention_tile.h. The fused kernels' rows of one block. */
static inline __attribute__((always_inline)) void
FN(online_softmax_rows_)(const int M, REAL *s, ptrdiff_t s_rs, int nk, int dv, ptrdiff_t j0,
                         const REAL *add, ptrdiff_t add_rs, ptrdiff_t add_ks,
                         const unsigned char *pad, ptrdiff_t limit, ptrdiff_t limit_step,
                         ptrdiff_t window, REAL *m, REAL *l, REAL *acc)
{
#if MHA_ISA_WIDE_BYTES == 64 && EXP_C(AVX512_BODY)
    /* the same steps as below, the rows' maxes and sums of exps reduced together
     * (row_reduce_) */
    if (M <= 16) {
        __m512 parts[16];
        REAL m_new[16], sums[16];
        int nan_seen[16];
        for (int i = 0; i < M; i++) {
            int n_skip, n_valid;
            FN(row_span_)(i, nk, j0, limit, limit_step, window, &n_skip, &n_valid);
            REAL *si = s + i * s_rs;
            FN(mask_row_)(si, nk, add == NULL ? NULL : add + i * add_rs + j0 * add_ks, add_ks,
                          pad == NULL ? NULL : pad + j0, n_skip, n_valid);
            parts[i] = FN(lane_max_)(si, nk, &nan_seen[i]);
        }
        FN(row_reduce_)(M, parts, m_new, 1);
        for (int i = 0; i < M; i++) {
            REAL *si = s + i * s_rs;
            m_new[i] = FN(online_max_)(nan_seen[i] ? (REAL)NAN : m_new[i], m[i]);
            if (m_new[i] == -INFINITY) {
                FN(hide_row_)(si, nk);
                parts[i] = _mm512_setzero_ps();
            } else {
                parts[i] = FN(exp_and_parts_)(si, nk, m_new[i]);
            }
        }
        FN(row_reduce_)(M, parts, sums, 0);
        for (int i = 0; i < M; i++)
            if (m_new[i] != -INFINITY)
                FN(online_rescale_)(m_new[i], sums[i], m + i, l + i, acc + i * dv, dv);
        return;
    }
#endif
    for (int i = 0; i < M; i++) {
        int n_skip, n_valid;
        FN(row_span_)(i, nk, j0, limit, limit_step, window, &n_skip, &n_valid);
        FN(online_softmax_row_)(s + i * s_rs, nk,
                                add == NULL ? NULL : add + i * add_rs + j0 * add_ks, add_ks,
                                pad == NULL ? NULL : pad + j0, n_skip, n_valid,
                                m + i, l + i, acc + i * dv, dv);
    }
}

#undef VR
#undef VI
#undef VN
#undef VX_BLOCK
#undef VX_FOR
