/* Body of attention_microkernel.c for one floating type: included with REAL = float and with
 * REAL = double, once per SIMD level (simd_isas.h). Defines needed: REAL, SUFFIX, VL (lanes of
 * a 512-bit vector), RB, DRB_WIDE, EXP and EXP_C (as attention_tile_impl.h). The rows' online
 * softmax is attention_tile.c's, inlined (softmax_row_impl.h).
 * The register blocks are GNU C vectors, which gcc lowers at every SIMD level of
 * simd_isas.h; the block functions are always_inline with a constant row count so the
 * M x 2 vectors of sums stay in registers. Plain lane loops (as in small_gemm_impl.h) did not
 * work here: gcc vectorized the loop over d instead, gathering q with shuffles and spilling
 * the sums (3.5 GFLOP/s on Zen 1 AVX2). */

#define MHA_CAT_(a, b) a##b
#define MHA_CAT(a, b) MHA_CAT_(a, b)
#define FN(name) MHA_CAT(name, SUFFIX)

#include "decode_blocks.h"
#include "softmax_row_impl.h"

/* Keys per tile. NK is the most (the row stride of the packed tile and of the scores); the
 * packed kernel's tiles are that wide when no row's keys end at a causal limit or a window
 * (a full tile halves the per-tile costs of the online softmax: the rows' max and sum
 * reductions, the rescaling of acc, the loads and stores of acc around P V), and NK_EDGE wide
 * otherwise, where a wider tile computes more scores above the diagonal that causality hides;
 * the direct kernel's tiles (decode) are NK_EDGE wide. Which width a call takes depends on its
 * arguments alone (never on the thread count). Zen 5, SDPA float32, 2 threads, min of 3
 * interleaved runs, NK_EDGE -> NK for every tile: (8, 12, 512, 64) padding mask 17.1-17.6 ->
 * 16.1-16.8 ms; (1, 12, 128, 64) 141-144 -> 131-140 us; (1, 8, 4096, 64) causal 45.7 ->
 * 44.6-46.0; (2, 32 / 8, 512, 128) causal 12.9-13.1 -> 14.0-14.7 (hence NK_EDGE there); D 128
 * and 256 unmasked, decode: within the noise. */
#define NK (8 * VL)
#define NK_EDGE (4 * VL)
#define VEC FN(vec_)

#define W (VL / 2)     /* lanes of a 256-bit vector: a block's sums are 2 vectors per row */

/* The packed kernel's rows per block. 12 at AVX-512: a step of the scores (or of P V) loads 2
 * vectors and broadcasts 12 values for 24 FMAs, where 6 rows loaded 8 for 12. Each score is
 * one chain over d, each output one chain over the keys, whatever the rows per block: the same
 * bits. Intel Xeon (two 512-bit FMA units), SDPA float32 D 64, min of 3 interleaved runs,
 * 6 -> 12 rows, 2 threads (1): (1, 12, 128) 274 -> 253 us (531 -> 483); (8, 12, 512) 34.1 ->
 * 32.0 ms (65.3 -> 60.8); (1, 8, 4096) causal 84.8 -> 79.8 ms (160 -> 156). */
#if MHA_ISA_WIDE_BYTES == 64
#define RB RB_WIDE
#else
#define RB RB_NARROW
#endif

/* The direct kernel's blocks: up to DRB query rows, up to DSUMS vectors of score sums. With
 * AVX-512's 32 vector registers, 8 rows (an MQA group) are one block of 8 rows x 2 keys: each
 * K and V row is read once, not once per 4 rows, and a block loads 10 vectors per 16 FMAs.
 * Zen 4, 1 thread, (1, 8, 1, 128) over 4096 cached keys: 79-90 -> 63-69 ns a key. Blocks of
 * 4 rows x 4 keys were faster in cache too (44-49 -> 38-42 ns a key) but slower from DRAM
 * (decode_dram's shapes, 2 threads: 2.3-2.7 -> 2.9-3.3 ms), also with their prefetches spread
 * over the dot products: 4 rows keep 2 keys a block. */
#if MHA_ISA_WIDE_BYTES == 64
#define DSUMS (2 * W)
#define DRB 8
#else
#define DSUMS W
#define DRB 4
#endif

/* 256 bits, the widest vector gcc lowers well at every level (512-bit ones went through the
 * integer registers on AVX2); unaligned, and allowed to alias REAL */
typedef REAL VEC __attribute__((vector_size(W * sizeof(REAL)), aligned(sizeof(REAL)),
                                may_alias));

/* The products' vectors (Q K^T of the packed kernel, P V of both): the widest of the SIMD
 * level (simd_isas.h); every lane is its own sum, so the width changes no bit. Half the
 * instructions at AVX-512: the same speed on Zen 4, which splits a 512-bit operation in two
 * (one thread, L = 128, D = 64, 12 heads: 690-860 us either way, host noise), for the cores
 * that run it whole (Zen 5, Intel). The exp stays 256-bit: 512-bit measured 3-10% slower
 * on Zen 4 (its compares become mask registers, expanded again to vectors). */
#define WP (MHA_ISA_WIDE_BYTES / (int)sizeof(REAL))
#define KSTEP (2 * WP)  /* keys per register block of the packed scores */
typedef REAL FN(vecp_) __attribute__((vector_size(WP * sizeof(REAL)), aligned(sizeof(REAL)),
                                      may_alias));
#define VECP FN(vecp_)

/* Elements of a V row copied onto cache lines (VCOPY_ROW: dv rounded up to whole lines). */
#define LINE_REALS (64 / (ptrdiff_t)sizeof(REAL))
#define VCOPY_ROW(dv) (((ptrdiff_t)(dv) + LINE_REALS - 1) / LINE_REALS * LINE_REALS)

ptrdiff_t FN(mha_fused_scratch_)(int d, int dv)
{
    /* the packed tile, the scores and a tile of V rows on cache lines (the direct kernel
     * needs only the scores) */
    return (ptrdiff_t)(d > 0 ? d : 1) * NK + (RB_WIDE > DRB_WIDE ? RB_WIDE : DRB_WIDE) * NK
           + NK * VCOPY_ROW(dv > 0 ? dv : 1);
}

/* shuffle masks of VEC (lane indices, of the same width as REAL) */
#if W == 8
typedef int FN(mask_) __attribute__((vector_size(W * sizeof(REAL))));
#elif W == 4
typedef long long FN(mask_) __attribute__((vector_size(W * sizeof(REAL))));
#endif
#define MASK(...) ((FN(mask_)){__VA_ARGS__})

/* r[j] <- the lanes j of r[0 .. W) (a W x W transpose in registers, unpack / shuffle /
 * permute stages). */
static inline __attribute__((always_inline)) void FN(transpose_)(VEC *r)
{
#if W == 8
    VEC t[8], u[8];
    for (int i = 0; i < 8; i += 2) {    /* t[i]: lanes 0,1 | 4,5 of r[i], r[i+1] interleaved */
        t[i] = __builtin_shuffle(r[i], r[i + 1], MASK(0, 8, 1, 9, 4, 12, 5, 13));
        t[i + 1] = __builtin_shuffle(r[i], r[i + 1], MASK(2, 10, 3, 11, 6, 14, 7, 15));
    }
    for (int i = 0; i < 8; i += 4)      /* u[i + c]: lanes c and c + 4 of four rows */
        for (int h = 0; h < 2; h++) {
            u[i + 2 * h] = __builtin_shuffle(t[i + h], t[i + h + 2],
                                             MASK(0, 1, 8, 9, 4, 5, 12, 13));
            u[i + 2 * h + 1] = __builtin_shuffle(t[i + h], t[i + h + 2],
                                                 MASK(2, 3, 10, 11, 6, 7, 14, 15));
        }
    for (int c = 0; c < 4; c++) {
        r[c] = __builtin_shuffle(u[c], u[c + 4], MASK(0, 1, 2, 3, 8, 9, 10, 11));
        r[c + 4] = __builtin_shuffle(u[c], u[c + 4], MASK(4, 5, 6, 7, 12, 13, 14, 15));
    }
#else
    VEC t[4];
    for (int i = 0; i < 4; i += 2) {
        t[i] = __builtin_shuffle(r[i], r[i + 1], MASK(0, 4, 2, 6));
        t[i + 1] = __builtin_shuffle(r[i], r[i + 1], MASK(1, 5, 3, 7));
    }
    for (int h = 0; h < 2; h++) {
        r[h] = __builtin_shuffle(t[h], t[h + 2], MASK(0, 1, 4, 5));
        r[h + 2] = __builtin_shuffle(t[h], t[h + 2], MASK(2, 3, 6, 7));
    }
#endif
}

/* kt[p * NK + u] = k[u * k_rs + p]: the tile transposed, keys nk..nkp-1 zero; W x W blocks
 * in registers (the scalar loop was about 4% of a short attention call, this about 2%: Zen 4,
 * perf, L = 128, D = 64, one thread). */
static inline void FN(pack_keys_)(const REAL *k, ptrdiff_t k_rs, int d, int nk, int nkp,
                                  REAL *kt)
{
    const ptrdiff_t dw = (ptrdiff_t)d / W * W, nw = (ptrdiff_t)nk / W * W;
    for (ptrdiff_t u = 0; u < nw; u += W)
        for (ptrdiff_t p = 0; p < dw; p += W) {
            VEC r[W];
            for (int i = 0; i < W; i++)
                r[i] = *(const VEC *)(k + (u + i) * k_rs + p);
            FN(transpose_)(r);
            for (int j = 0; j < W; j++)
                *(VEC *)(kt + (p + j) * NK + u) = r[j];
        }
    for (ptrdiff_t u = 0; u < nk; u++)          /* the dims and keys no block covers */
        for (ptrdiff_t p = u < nw ? dw : 0; p < d; p++)
            kt[p * NK + u] = k[u * k_rs + p];
    for (ptrdiff_t p = 0; p < d; p++)
        for (ptrdiff_t u = nk; u < nkp; u++)
            kt[p * NK + u] = 0;
}
#undef MASK

/* a0[i], a1[i] += sum_t x[i * x_rs + t] * b[t * b_rs + (0 .. 2W)] for i < M, t < n: the
 * register block of the packed kernel's scores (x = Q, b = the packed keys), one vector load
 * of b per t serving M rows (pv_panel_ is the same loop for P V, with NV vectors a row). */
static inline __attribute__((always_inline)) void
FN(outer_block_)(const int M, const REAL *x, ptrdiff_t x_rs, const REAL *b, ptrdiff_t b_rs,
                 ptrdiff_t n, VECP *a0, VECP *a1)
{
    for (ptrdiff_t t = 0; t < n; t++) {
        VECP b0 = *(const VECP *)(b + t * b_rs), b1 = *(const VECP *)(b + t * b_rs + WP);
        for (int i = 0; i < M; i++) {
            REAL xi = x[i * x_rs + t];
            a0[i] += xi * b0;
            a1[i] += xi * b1;
        }
    }
}

/* s[i * NK + c] = scale * q_i . k_c for i < M, c < nkp, KSTEP keys at a time. */
static inline __attribute__((always_inline)) void
FN(scores_block_)(const int M, const REAL *q, ptrdiff_t q_rs, int d, const REAL *kt, int nkp,
                  REAL scale, REAL *s)
{
    for (ptrdiff_t c = 0; c < nkp; c += KSTEP) {
        VECP a0[RB], a1[RB];
        for (int i = 0; i < M; i++)
            a0[i] = a1[i] = (VECP){0};
        FN(outer_block_)(M, q, q_rs, kt + c, NK, d, a0, a1);
        for (int i = 0; i < M; i++) {
            *(VECP *)(s + i * NK + c) = scale * a0[i];
            *(VECP *)(s + i * NK + c + WP) = scale * a1[i];
        }
    }
}

/* acc[i * dv + e] += sum_j s[i * NK + j] v[j * v_rs + e] for i < M, e in [e0, e1), skipping
 * the hidden keys (probability -0.0, attention_tile.h): their V is never read. The slow path
 * of pv_panel_, and the columns no panel covers. */
static void FN(pv_exact_)(int M, const REAL *s, int nk, const REAL *v, ptrdiff_t v_rs,
                          REAL *acc, int dv, ptrdiff_t e0, ptrdiff_t e1)
{
    for (int i = 0; i < M; i++)
        for (ptrdiff_t j = 0; j < nk; j++) {
            REAL p = s[i * NK + j];
            if (p == 0 && signbit(p))
                continue;
            for (ptrdiff_t e = e0; e < e1; e++)
                acc[i * dv + e] += p * v[j * v_rs + e];
        }
}

/* acc[i * dv + e0 + (0 .. NV * WP)) += sum_{t < n} s[i * NK + t] v[t * v_rs + e0 + ...] for
 * i < M, in registers over every key (V finite: a hidden key's -0.0 adds nothing): M x NV
 * vectors of sums. The direct kernel takes NV = MHA_PV_PANEL_VECTORS(M) (decode_blocks.h),
 * the packed one NV = 2. check: unless the sums come out
 * finite (x * 0 is NaN just for an inf or NaN x: a NaN or inf in V, maybe at a hidden key),
 * redo the columns by pv_exact_ from acc, still unchanged. The direct kernel checks so (2 M
 * NV vector operations per nk keys; checking its V tile first would cost as much as its P V
 * of 1-4 rows); the packed kernel checks each V tile once for all its row blocks instead
 * (this check cost it 10-20%: registers). pf != NULL (the direct kernel): also prefetch the
 * panel's columns of the pf_n rows at pf, the next tile's V, a row per key. */
static inline __attribute__((always_inline)) void
FN(pv_panel_)(const int M, const int NV, const REAL *s, int n, const REAL *v, ptrdiff_t v_rs,
              REAL *acc, int dv, ptrdiff_t e0, const int check, const REAL *pf, int pf_n)
{
    VECP a[2 * RB > 2 * DRB_WIDE ? 2 * RB : 2 * DRB_WIDE];
    for (int i = 0; i < M; i++)
        for (int c = 0; c < NV; c++)
            a[i * NV + c] = *(VECP *)(acc + i * dv + e0 + c * WP);
    for (ptrdiff_t t = 0; t < n; t++) {
        if (pf != NULL && t < pf_n) {
            const REAL *x = pf + t * v_rs + e0;
            for (int c = 0; c < NV; c++)
                __builtin_prefetch(x + c * WP, 0, 2);
            __builtin_prefetch(x + NV * WP - 1, 0, 2);
        }
        VECP b[8];
        for (int c = 0; c < NV; c++)
            b[c] = *(const VECP *)(v + t * v_rs + e0 + c * WP);
        for (int i = 0; i < M; i++) {
            REAL x = s[i * NK + t];
            for (int c = 0; c < NV; c++)
                a[i * NV + c] += x * b[c];
        }
    }
    int non_finite = 0;
    if (check) {
        VECP bad = (VECP){0};
        for (int u = 0; u < M * NV; u++)
            bad += a[u] * 0;
        for (int u = 0; u < WP; u++)
            non_finite |= bad[u] != bad[u];
    }
    if (__builtin_expect(non_finite, 0)) {
        FN(pv_exact_)(M, s, n, v, v_rs, acc, dv, e0, e0 + NV * WP);
        return;
    }
    for (int i = 0; i < M; i++)
        for (int c = 0; c < NV; c++)
            *(VECP *)(acc + i * dv + e0 + c * WP) = a[i * NV + c];
}

/* What every block of the packed kernel does once its M rows of scores for keys
 * [j0, j0 + nk) are in s: the rows' softmax, then acc += P V over the tile's rows of V (vt:
 * key j0's),
 * never reading V at a hidden key. v_finite: the caller found the V tile finite (else every
 * column takes pv_exact_). */
static inline __attribute__((always_inline)) void
FN(softmax_and_pv_)(const int M, REAL *s, int nk, const REAL *vt, ptrdiff_t v_rs, int dv,
                    ptrdiff_t j0, const REAL *add, ptrdiff_t add_rs, ptrdiff_t add_ks,
                    const unsigned char *pad, ptrdiff_t limit, ptrdiff_t limit_step,
                    ptrdiff_t window,
                    REAL *m, REAL *l, REAL *acc, const int v_finite)
{
    FN(online_softmax_rows_)(M, s, NK, nk, dv, j0, add, add_rs, add_ks, pad, limit, limit_step,
                             window, m, l, acc);
    ptrdiff_t e = 0;
    for (; v_finite && e + 2 * WP <= dv; e += 2 * WP)
        FN(pv_panel_)(M, 2, s, nk, vt, v_rs, acc, dv, e, 0, NULL, 0);
    if (v_finite && e + WP <= dv) {
        FN(pv_panel_)(M, 1, s, nk, vt, v_rs, acc, dv, e, 0, NULL, 0);
        e += WP;
    }
    if (e < dv)
        FN(pv_exact_)(M, s, nk, vt, v_rs, acc, dv, e, dv);
}

/* Whether the nk rows of dv values at v (row stride v_rs) are all finite: once per tile of
 * the packed kernel, for all its row blocks. x * 0 is NaN for an inf or NaN only, and NaN !=
 * 0: the flags of the product's lanes are ORed into an integer vector (no chain of float
 * latencies). Their float sum instead (bad += x * 0, gcc's loop of it) was 2-4% of an SDPA
 * call: Intel Xeon, float32 D 64, 2 threads, the check skipped: (1, 12, 128) 267-275 -> 256-265
 * us. */
typedef EXP_C(INT) FN(vecpi_) __attribute__((vector_size(WP * sizeof(REAL))));
static int FN(all_finite_)(const REAL *v, ptrdiff_t v_rs, int nk, int dv)
{
    FN(vecpi_) bad = {0};
    int bad_tail = 0;
    for (ptrdiff_t j = 0; j < nk; j++) {
        ptrdiff_t e = 0;
        for (; e + WP <= dv; e += WP)
            bad |= *(const VECP *)(v + j * v_rs + e) * 0 != 0;
        for (; e < dv; e++)
            bad_tail |= v[j * v_rs + e] * 0 != 0;
    }
    for (int u = 0; u < WP; u++)
        bad_tail |= bad[u] != 0;
    return !bad_tail;
}

/* One block of M rows against the packed tile of keys [j0, j0 + nk). */
static inline __attribute__((always_inline)) void
FN(block_)(const int M, const REAL *q, ptrdiff_t q_rs, int d, const REAL *kt, int nk, int nkp,
           const REAL *vt, ptrdiff_t v_rs, int dv, ptrdiff_t j0, REAL scale,
           const REAL *add, ptrdiff_t add_rs, ptrdiff_t add_ks, const unsigned char *pad,
           ptrdiff_t limit, ptrdiff_t limit_step,
           ptrdiff_t window, REAL *m, REAL *l, REAL *acc, REAL *s, int v_finite)
{
    FN(scores_block_)(M, q, q_rs, d, kt, nkp, scale, s);
    FN(softmax_and_pv_)(M, s, nk, vt, v_rs, dv, j0, add, add_rs, add_ks, pad, limit,
                        limit_step, window, m, l, acc, v_finite);
}

#define BLOCK(M)                                                                             \
    FN(block_)((M), q + r * q_rs, q_rs, d, kt, nk, nkp, vt, vt_rs, dv, j0, scale,           \
               add == NULL ? NULL : add + r * add_rs, add_rs, add_ks, pad,                   \
               limit + r * limit_step, limit_step, window, m + r, l + r, acc + r * dv, s,     \
               v_finite)

void FN(mha_fused_attend_)(const REAL *q, ptrdiff_t q_rs, int rows, int d,
                           const REAL *k, ptrdiff_t k_rs, const REAL *v, ptrdiff_t v_rs, int dv,
                           ptrdiff_t k_begin, ptrdiff_t k_end, REAL scale,
                           const REAL *add, ptrdiff_t add_rs, ptrdiff_t add_ks,
                           const unsigned char *pad, ptrdiff_t limit, ptrdiff_t limit_step,
                           ptrdiff_t window,
                           REAL *m, REAL *l, REAL *acc, REAL *work)
{
    REAL *kt = work, *s = work + (ptrdiff_t)(d > 0 ? d : 1) * NK;
    REAL *vcopy = s + (RB_WIDE > DRB_WIDE ? RB_WIDE : DRB_WIDE) * NK;
    /* V rows that do not start on cache lines (NumPy's large arrays start 16 bytes past one)
     * split every vector load in two; when more than one row block reads them, each tile's
     * rows are copied onto lines first. The same values: the same bits. SDPA (1, 12, 128, 64)
     * on arrays 16 bytes past a line, Intel Xeon, interleaved runs (min / median of 8): 2
     * threads 330 / 337 -> 315 / 319 us, 1 thread 583 / 635 -> 579 / 598; (8, 12, 512, 64)
     * within the host's noise. */
    const int copy_v = rows > RB && ((uintptr_t)v % 64 != 0 || v_rs * sizeof(REAL) % 64 != 0);
    /* every row sees every key up to k_end (no causal limit inside, no window): wide tiles */
    const int tile = window <= 0 && limit + (rows - 1) * limit_step >= k_end && limit >= k_end
                         ? NK : NK_EDGE;
    for (ptrdiff_t j0 = k_begin; j0 < k_end; j0 += tile) {
        int nk = (int)(k_end - j0 < tile ? k_end - j0 : tile);
        int nkp = (nk + KSTEP - 1) / KSTEP * KSTEP;
        FN(pack_keys_)(k + j0 * k_rs, k_rs, d, nk, nkp, kt);
        const REAL *vt = v + j0 * v_rs;
        ptrdiff_t vt_rs = v_rs;
        if (copy_v) {
            for (int j = 0; j < nk; j++)
                memcpy(vcopy + j * VCOPY_ROW(dv), vt + j * v_rs, (size_t)dv * sizeof(REAL));
            vt = vcopy;
            vt_rs = VCOPY_ROW(dv);
        }
        int v_finite = FN(all_finite_)(vt, vt_rs, nk, dv);
        for (ptrdiff_t r = 0; r < rows; r += RB) {
            int left = (int)(rows - r);
            /* rows that see no key of the tile (above the causal diagonal) are left as they
             * are: their softmax would add p = 0 everywhere */
            if (limit + (r + (left < RB ? left : RB) - 1) * limit_step <= j0)
                continue;
            /* nor those whose windows all start after the tile (the first row's starts first) */
            if (window > 0 && limit + r * limit_step - window >= j0 + nk)
                continue;
            switch (left < RB ? left : RB) {
            case 1: BLOCK(1); break;
            case 2: BLOCK(2); break;
            case 3: BLOCK(3); break;
            case 4: BLOCK(4); break;
            case 5: BLOCK(5); break;
#if RB > 6
            case 6: BLOCK(6); break;
            case 7: BLOCK(7); break;
            case 8: BLOCK(8); break;
            case 9: BLOCK(9); break;
            case 10: BLOCK(10); break;
            case 11: BLOCK(11); break;
#endif
            default: BLOCK(RB); break;
            }
        }
    }
}

#undef BLOCK

/* ---- The direct kernel (few rows: decode) ------------------------------------------------
 * No packing: the scores are dot products over d on the K rows as they lie in memory, in
 * blocks of R rows x KB keys (W / R, or DSUMS / R for more than 4 rows) whose vectors of
 * partial sums are reduced W at a time by one shuffle tree (lane i of the result = the sum of
 * vector i), so a reduction costs about 2 vector operations per score instead of a horizontal
 * sum each. Each K row is loaded once per block of R <= DRB rows. Then the same row softmax
 * and P V as the packed kernel. */

#if W == 8
/* [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7] (vhaddps) */
static inline VEC FN(hadd_)(VEC a, VEC b)
{
    return __builtin_shuffle(a, b, (FN(mask_)){0, 2, 8, 10, 4, 6, 12, 14})
         + __builtin_shuffle(a, b, (FN(mask_)){1, 3, 9, 11, 5, 7, 13, 15});
}
/* lane i = sum of the lanes of v[i] */
static inline __attribute__((always_inline)) VEC FN(reduce_)(const VEC *v)
{
    VEC f = FN(hadd_)(FN(hadd_)(v[0], v[1]), FN(hadd_)(v[2], v[3]));
    VEC g = FN(hadd_)(FN(hadd_)(v[4], v[5]), FN(hadd_)(v[6], v[7]));
    return __builtin_shuffle(f, g, (FN(mask_)){0, 1, 2, 3, 8, 9, 10, 11})
         + __builtin_shuffle(f, g, (FN(mask_)){4, 5, 6, 7, 12, 13, 14, 15});
}
#elif W == 4
/* [a0+a1, b0+b1 | a2+a3, b2+b3] (vhaddpd) */
static inline VEC FN(hadd_)(VEC a, VEC b)
{
    return __builtin_shuffle(a, b, (FN(mask_)){0, 4, 2, 6})
         + __builtin_shuffle(a, b, (FN(mask_)){1, 5, 3, 7});
}
static inline __attribute__((always_inline)) VEC FN(reduce_)(const VEC *v)
{
    VEC f = FN(hadd_)(v[0], v[1]), g = FN(hadd_)(v[2], v[3]);
    return __builtin_shuffle(f, g, (FN(mask_)){0, 1, 4, 5})
         + __builtin_shuffle(f, g, (FN(mask_)){2, 3, 6, 7});
}
#else
#error "the direct kernel's reduction is written for vectors of 4 or 8 lanes"
#endif

/* Prefetch the n values at x into L2 (prefetcht1), not L1: an L1 prefetch holds one of L1's
 * few miss buffers until the line arrives, which capped a thread's stream from DRAM. Zen 4,
 * decode_dram's shapes (64 MiB caches, rotated): 2 threads 18.9 -> 30-32 GB/s, one thread
 * 9.8 -> 16.0 (np.max: 29 and 25); prefetching two or more tiles ahead, or into every level
 * (prefetcht2), measured slower.
 * MHA_DECODE_PREFETCH_KEYS keys ahead, not a tile (NK_EDGE): enough lead for DRAM's latency (16
 * keys are 1-2 us of this kernel), fewer lines in flight. Zen 4, 1 thread, the same shapes,
 * medians of 4 interleaved runs: 4.12 ms a tile ahead, 3.74 at 16 keys, 3.68 at 8. At 2
 * threads within the host's noise (2.60 / 2.61 / 2.64), and MQA (1, 8, 1, 128) over 32k keys
 * 1.71 / 1.61 / 1.39. */
#if MHA_DECODE_PREFETCH_KEYS > NK_EDGE
#error "MHA_DECODE_PREFETCH_KEYS must be at most a tile: the keys are in this tile or the next"
#endif
static inline __attribute__((always_inline)) void FN(prefetch_row_)(const REAL *x, int n)
{
    for (ptrdiff_t e = 0; e < n; e += 64 / (ptrdiff_t)sizeof(REAL))
        __builtin_prefetch(x + e, 0, 2);
    __builtin_prefetch(x + n - 1, 0, 2);
}

/* s[i * NK + u] = t[i * KB + u] for i < R, u < left (t: the block's DSUMS sums, as DSUMS / W
 * vectors): a row's KB sums in one store of a full block (a lane at a time cost about 25
 * instructions a key at R = 4). */
static inline __attribute__((always_inline)) void
FN(store_block_)(const int R, const int KB, const VEC *t, REAL *s, int left)
{
    const REAL *tl = (const REAL *)t;
    if (left == KB)
        for (int i = 0; i < R; i++)
            memcpy(s + i * NK, tl + i * KB, KB * sizeof(REAL));
    else
        for (int i = 0; i < R; i++)
            for (int u = 0; u < left; u++)
                s[i * NK + u] = tl[i * KB + u];
}

/* The prefetches of direct_scores_ for its block of KB keys from key c: with pf_v != NULL,
 * the K rows MHA_DECODE_PREFETCH_KEYS ahead (those below n_avail: this tile's and the next
 * tile's keys), and with `first` (a task's first tile) the V rows as well (pf_v is this
 * tile's V): the memory is streamed once, and latency, not bandwidth,
 * limited one thread without it. The later tiles' V rows are prefetched by the P V panels of
 * the tile before (direct_pv_), so that each phase streams what it reads next and the memory
 * is busy during P V too: with both rows here, the scores' phase asked for 2 rows a key while
 * the P V phase, half the work, asked for none. Zen 4, 2 threads, 8 caches in turn, medians of
 * 5 interleaved runs: MQA (1, 8, 1, 128) over 32k keys 1.54 -> 1.30 ms; decode_cache_f32 2.82
 * -> 2.58, float16 1.74 -> 1.53, int8 1.42 -> 1.40 (int8 is bound by its FMAs here). */
static inline __attribute__((always_inline)) void
FN(direct_prefetch_)(const int KB, const REAL *k, ptrdiff_t k_rs, int d, const REAL *pf_v,
                     ptrdiff_t v_rs, int dv, ptrdiff_t c, ptrdiff_t n_avail, const int first)
{
    for (int u = 0; pf_v != NULL && u < KB && MHA_DECODE_PREFETCH_KEYS + c + u < n_avail; u++) {
        if (first)
            FN(prefetch_row_)(pf_v + (MHA_DECODE_PREFETCH_KEYS + c + u) * v_rs, dv);
        FN(prefetch_row_)(k + (MHA_DECODE_PREFETCH_KEYS + c + u) * k_rs, d);
    }
}

/* s[i * NK + c] = scale * q_i . k_c for i < R, c < nk, from the K rows k + c * k_rs. */
#if MHA_ISA_WIDE_BYTES == 64 && W == 8
/* Float at AVX-512: the scores on 512-bit vectors, blocks of R rows x KB = 16 / R keys whose
 * 16 vectors of partial sums one tree of decode_blocks.h reduces (as kv_format_impl.h's
 * kv_scores_). At 4 rows x 4 keys, 8 loads feed 16 FMAs of 16 lanes, where the 256-bit block
 * of 4 rows x 2 keys took 6 loads (q an FMA operand) per 8 FMAs of 8 lanes. The head dim's
 * tail is a masked load (zeros add nothing). */
typedef int FN(maskp_) __attribute__((vector_size(WP * sizeof(REAL))));
#define DIRECT_HADD16(a, b) MHA_HADD16(FN(maskp_), a, b)

static inline __attribute__((always_inline)) void
FN(direct_scores_wide_)(const int R, const REAL *q, ptrdiff_t q_rs, int d,
                        const REAL *k, ptrdiff_t k_rs, int nk, REAL scale, REAL *s,
                        const REAL *pf_v, ptrdiff_t v_rs, int dv, int nk_next, const int first)
{
    const int KB = WP / R;
    const ptrdiff_t dvec = (ptrdiff_t)d / WP * WP;
    const __mmask16 tail = (__mmask16)((1u << (d - dvec)) - 1);
    for (ptrdiff_t c = 0; c < nk; c += KB) {
        const REAL *kr[WP];
        for (int u = 0; u < KB; u++)    /* keys past the tile: recompute key c, unused */
            kr[u] = k + (c + u < nk ? c + u : c) * k_rs;
        FN(direct_prefetch_)(KB, k, k_rs, d, pf_v, v_rs, dv, c, nk + nk_next, first);
        VECP a[WP];
        for (int i = 0; i < WP; i++)
            a[i] = (VECP){0};
        for (ptrdiff_t p = 0; p < dvec; p += WP) {
            VECP kv[WP];
            for (int u = 0; u < KB; u++)
                kv[u] = *(const VECP *)(kr[u] + p);
#define QV(i) (*(const VECP *)(q + (i) * q_rs + p))
            MHA_BLOCK_STEP(VECP, R, KB, QV, kv, a);
#undef QV
        }
        if (dvec < d) {
            VECP kv[WP];
            for (int u = 0; u < KB; u++)
                kv[u] = (VECP)_mm512_maskz_loadu_ps(tail, kr[u] + dvec);
#define QV(i) ((VECP)_mm512_maskz_loadu_ps(tail, q + (i) * q_rs + dvec))
            MHA_BLOCK_STEP(VECP, R, KB, QV, kv, a);
#undef QV
        }
        VECP t = MHA_REDUCE16_WITH(VECP, FN(maskp_), DIRECT_HADD16, a) * scale;
        FN(store_block_)(R, KB, (const VEC *)&t, s + c, (int)(nk - c < KB ? nk - c : KB));
    }
}
#undef DIRECT_HADD16
#endif

/* 256-bit blocks of R rows x W / R keys (8 rows: 2 keys, DSUMS sums). */
static inline __attribute__((always_inline)) void
FN(direct_scores_narrow_)(const int R, const REAL *q, ptrdiff_t q_rs, int d,
                          const REAL *k, ptrdiff_t k_rs, int nk, REAL scale, REAL *s,
                          const REAL *pf_v, ptrdiff_t v_rs, int dv, int nk_next, const int first)
{
    const int KB = R > 4 ? DSUMS / R : W / R;     /* R * KB <= DSUMS sums */
    const ptrdiff_t dvec = (ptrdiff_t)d / W * W;
    for (ptrdiff_t c = 0; c < nk; c += KB) {
        const REAL *kr[W];
        for (int u = 0; u < KB; u++)    /* keys past the tile: recompute key c, unused */
            kr[u] = k + (c + u < nk ? c + u : c) * k_rs;
        FN(direct_prefetch_)(KB, k, k_rs, d, pf_v, v_rs, dv, c, nk + nk_next, first);
        VEC a[DSUMS];
        for (int i = 0; i < DSUMS; i++)
            a[i] = (VEC){0};
        for (ptrdiff_t p = 0; p < dvec; p += W) {
            VEC kv[W];
            for (int u = 0; u < KB; u++)
                kv[u] = *(const VEC *)(kr[u] + p);
#define QV(i) (*(const VEC *)(q + (i) * q_rs + p))
            MHA_BLOCK_STEP(VEC, R, KB, QV, kv, a);
#undef QV
        }
        VEC t[DSUMS / W];
        for (int h = 0; h * W < R * KB; h++)    /* one tree per W sums: each sum's own order */
            t[h] = FN(reduce_)(a + h * W);
        REAL *tl = (REAL *)t;
        if (dvec < d)
            for (int i = 0; i < R; i++)
                for (int u = 0; u < KB; u++) {
                    REAL x = 0;
                    for (ptrdiff_t p = dvec; p < d; p++)
                        x += q[i * q_rs + p] * kr[u][p];
                    tl[i * KB + u] += x;
                }
        for (int h = 0; h * W < R * KB; h++)
            t[h] *= scale;
        FN(store_block_)(R, KB, t, s + c, (int)(nk - c < KB ? nk - c : KB));
    }
}

static inline __attribute__((always_inline)) void
FN(direct_scores_)(const int R, const REAL *q, ptrdiff_t q_rs, int d, const REAL *k,
                   ptrdiff_t k_rs, int nk, REAL scale, REAL *s, const REAL *pf_v,
                   ptrdiff_t v_rs, int dv, int nk_next, const int first)
{
#if MHA_ISA_WIDE_BYTES == 64 && W == 8
    /* Blocks of 4 rows only (a GQA group of 4, the most common): Zen 4, 1 thread, rows x 1
     * query over 2048 keys (L3), D 128, min of 3 interleaved runs, ns a key, 256 -> 512-bit:
     * 4 rows 39.7 -> 31.4; 8 rows 58.6 -> 58.7, 3 rows 37.2 -> 38.8, 2 rows 28.8 -> 28.8, 1
     * row 23.3 -> 23.7 (Zen 4 splits a 512-bit shuffle of the tree in two: for the others a
     * 16-lane tree per block cost what the loads saved) */
    if (R == 4) {
        FN(direct_scores_wide_)(R, q, q_rs, d, k, k_rs, nk, scale, s, pf_v, v_rs, dv, nk_next,
                                first);
        return;
    }
#endif
    FN(direct_scores_narrow_)(R, q, q_rs, d, k, k_rs, nk, scale, s, pf_v, v_rs, dv, nk_next,
                              first);
}

/* acc += P V for the M rows of the direct kernel, NV column vectors a row at a time; with pf
 * != NULL, each panel also prefetches its columns of the pf_n rows at pf (the next tile's V). */
static inline __attribute__((always_inline)) void
FN(direct_pv_)(const int M, const REAL *s, int nk, const REAL *v, ptrdiff_t v_rs, REAL *acc,
               int dv, const REAL *pf, int pf_n)
{
    const int NV = MHA_PV_PANEL_VECTORS(M);
    ptrdiff_t e = 0;
    for (; e + NV * WP <= dv; e += NV * WP)
        FN(pv_panel_)(M, NV, s, nk, v, v_rs, acc, dv, e, 1, pf, pf_n);
    /* the columns left, in narrower panels (each as many chains as it can have) */
    if (NV > 4 && e + 4 * WP <= dv) {
        FN(pv_panel_)(M, 4, s, nk, v, v_rs, acc, dv, e, 1, pf, pf_n);
        e += 4 * WP;
    }
    if (NV > 2 && e + 2 * WP <= dv) {
        FN(pv_panel_)(M, 2, s, nk, v, v_rs, acc, dv, e, 1, pf, pf_n);
        e += 2 * WP;
    }
    if (e + WP <= dv) {
        FN(pv_panel_)(M, 1, s, nk, v, v_rs, acc, dv, e, 1, pf, pf_n);
        e += WP;
    }
    if (e < dv)
        FN(pv_exact_)(M, s, nk, v, v_rs, acc, dv, e, dv);
}

/* One block of M rows against the keys [j0, j0 + nk). prefetch: 0 none (not the task's first
 * row block), 1 K ahead and the next tile's V, 2 the same plus this tile's V (a task's first
 * tile, which no tile before prefetched). */
static inline __attribute__((always_inline)) void
FN(direct_block_)(const int M, const REAL *q, ptrdiff_t q_rs, int d, const REAL *k,
                  ptrdiff_t k_rs, int nk, const REAL *v, ptrdiff_t v_rs, int dv, ptrdiff_t j0,
                  REAL scale, const REAL *add, ptrdiff_t add_rs, ptrdiff_t add_ks,
                  const unsigned char *pad, ptrdiff_t limit, ptrdiff_t limit_step,
                  ptrdiff_t window, REAL *m,
                  REAL *l, REAL *acc, REAL *s, int prefetch, int nk_next)
{
    FN(direct_scores_)(M, q, q_rs, d, k + j0 * k_rs, k_rs, nk, scale, s,
                       prefetch ? v + j0 * v_rs : NULL, v_rs, dv, nk_next, prefetch == 2);
    FN(online_softmax_rows_)(M, s, NK, nk, dv, j0, add, add_rs, add_ks, pad, limit, limit_step,
                             window, m, l, acc);
    FN(direct_pv_)(M, s, nk, v + j0 * v_rs, v_rs, acc, dv,
                   prefetch && nk_next > 0 ? v + (j0 + nk) * v_rs : NULL, nk_next);
}

#define DBLOCK(M)                                                                            \
    FN(direct_block_)((M), q + r * q_rs, q_rs, d, k, k_rs, nk, v, v_rs, dv, j0, scale,      \
                      add == NULL ? NULL : add + r * add_rs, add_rs, add_ks, pad,            \
                      limit + r * limit_step, limit_step, window, m + r, l + r,            \
                      acc + r * dv, s,                                                       \
                      r == 0 ? (j0 == k_begin ? 2 : 1) : 0, nk_next)

void FN(mha_fused_attend_direct_)(const REAL *q, ptrdiff_t q_rs, int rows, int d,
                                  const REAL *k, ptrdiff_t k_rs, const REAL *v, ptrdiff_t v_rs,
                                  int dv, ptrdiff_t k_begin, ptrdiff_t k_end, REAL scale,
                                  const REAL *add, ptrdiff_t add_rs, ptrdiff_t add_ks,
                                  const unsigned char *pad, ptrdiff_t limit,
                                  ptrdiff_t limit_step,
                                  ptrdiff_t window, REAL *m, REAL *l, REAL *acc,
                                  REAL *work)
{
    REAL *s = work;
    for (ptrdiff_t j0 = k_begin; j0 < k_end; j0 += NK_EDGE) {
        int nk = (int)(k_end - j0 < NK_EDGE ? k_end - j0 : NK_EDGE);
        ptrdiff_t after = k_end - j0 - nk;
        int nk_next = (int)(after < NK_EDGE ? after : NK_EDGE);
        for (ptrdiff_t r = 0, block; r < rows; r += block) {
            /* DRB rows, else what is left: one pass over the tile's K and V rows for a task of
             * up to DRB rows (a GQA group of 6 query heads took a block of 4 and one of 2).
             * Zen 4, 1 thread, rows x 1 query over 2048 keys, D 128, min of 15, ns a key:
             * 6 rows 51.3 -> 45.2, 7 rows 57.3 -> 50.3 */
            block = rows - r >= DRB ? DRB : rows - r;
            if (limit + (r + block - 1) * limit_step <= j0)
                continue;
            if (window > 0 && limit + r * limit_step - window >= j0 + nk)
                continue;
            switch (block) {
            case 1: DBLOCK(1); break;
            case 2: DBLOCK(2); break;
            case 3: DBLOCK(3); break;
#if DRB > 4
            case 4: DBLOCK(4); break;
            case 5: DBLOCK(5); break;
            case 6: DBLOCK(6); break;
            case 7: DBLOCK(7); break;
#endif
            default: DBLOCK(DRB); break;
            }
        }
    }
}

#undef DBLOCK
#undef DSUMS
#undef DRB
#undef RB
#undef VEC
#undef VECP
#undef WP
#undef KSTEP
#undef VCOPY_ROW
#undef LINE_REALS
#undef W
#undef NK
#undef NK_EDGE
#undef FN
#undef MHA_CAT
#undef MHA_CAT_
