/* Body of small_gemm.c for one floating type: included with REAL = float and with REAL =
 * double, once per SIMD level (simd_isas.h). Defines needed: REAL, SUFFIX, VEC (a GCC vector of 32 bytes of REAL), VEC_U
 * (the same, unaligned and may alias REAL), VL (its lanes). */

#define MHA_CAT_(a, b) a##b
#define MHA_CAT(a, b) MHA_CAT_(a, b)
#define FN(name) MHA_CAT(name, SUFFIX)

/* out[i, j0 + jj] for i < M <= 4, jj < NB: M rows of x against NB rows of w, in one pass
 * over k. Each vector of w is loaded once for M rows of x and each vector of x once for NB
 * rows of w; the M * NB accumulators are independent FMA chains. M and NB are constants at
 * every call (always_inline + the switch below). The accumulators are GCC vectors of 32 bytes
 * (VEC, VL lanes), which every clone keeps in registers (one ymm each on AVX2 and AVX-512):
 * arrays of lanes sized for 512 bits went to the stack on AVX2 (4 rows ran at 12 GFLOP/s).
 * The block also prefetches the next block's first pf_rows weight rows into L2 (prefetcht1;
 * the hardware prefetcher alone left a thread short of DRAM's bandwidth: decode_proj, Zen 4,
 * 2 threads, 8.6-9.1 -> 6.6-8.4 ms). */
static inline __attribute__((always_inline)) void
FN(rows_block_)(const REAL *x, ptrdiff_t ldx, const REAL *w, ptrdiff_t ldw, const REAL *bias,
                REAL *out, ptrdiff_t ldo, const int M, const int NB, ptrdiff_t j0, ptrdiff_t k,
                int pf_rows)
{
    VEC acc[4][MAX_NB];
    for (int i = 0; i < M; i++)
        for (int jj = 0; jj < NB; jj++)
            acc[i][jj] = (VEC){0};
    const REAL *wj = w + j0 * ldw;
    ptrdiff_t p = 0;
    for (; p + VL <= k; p += VL) {
        VEC xv[4];
        for (int i = 0; i < M; i++)
            xv[i] = *(const VEC_U *)(x + i * ldx + p);
        for (int jj = 0; jj < pf_rows; jj++)
            __builtin_prefetch(wj + (NB + jj) * ldw + p, 0, 2);
        for (int jj = 0; jj < NB; jj++) {
            VEC wv = *(const VEC_U *)(wj + jj * ldw + p);
            for (int i = 0; i < M; i++)
                acc[i][jj] += xv[i] * wv;
        }
    }
    for (int i = 0; i < M; i++)
        for (int jj = 0; jj < NB; jj++) {
            REAL sum = bias != NULL ? bias[j0 + jj] : 0;
            for (ptrdiff_t q = p; q < k; q++)
                sum += x[i * ldx + q] * wj[jj * ldw + q];
            for (int u = 0; u < VL; u++)
                sum += acc[i][jj][u];
            out[i * ldo + j0 + jj] = sum;
        }
}

/* Columns [j_begin, j_end) for a constant M: blocks of NB weight rows, then single rows. */
#define ROWS(M, NB)                                                                          \
    do {                                                                                     \
        ptrdiff_t j = j_begin;                                                               \
        for (; j + (NB) <= j_end; j += (NB))                                                 \
            FN(rows_block_)(xi, ldx, w, ldw, bias, oi, ldo, (M), (NB), j, k,                  \
                            n - j - (NB) >= (NB) ? (NB) : (int)(n - j - (NB)));              \
        for (; j < j_end; j++)                                                               \
            FN(rows_block_)(xi, ldx, w, ldw, bias, oi, ldo, (M), 1, j, k, 0);                 \
    } while (0)

void FN(mha_small_gemm_)(const REAL *x, ptrdiff_t ldx, const REAL *w, ptrdiff_t ldw,
                         const REAL *bias, REAL *out, ptrdiff_t ldo,
                         ptrdiff_t m, ptrdiff_t n, ptrdiff_t k)
{
    /* Weight rows go in panels of about 256 KiB: read from memory for the first 4 rows of x,
     * from L2 for the next ones. Per group of M <= 4 rows of x, NB keeps M * NB <= 12
     * accumulators: with the M vectors of x, within AVX2's 16 registers. */
    ptrdiff_t panel = (ptrdiff_t)(256 * 1024 / sizeof(REAL)) / (k > 0 ? k : 1);
    panel = panel < 8 ? 8 : panel;
    for (ptrdiff_t j_begin = 0; j_begin < n; j_begin += panel) {
        ptrdiff_t j_end = j_begin + panel < n ? j_begin + panel : n;
        for (ptrdiff_t i = 0; i < m; i += 4) {
            const REAL *xi = x + i * ldx;
            REAL *oi = out + i * ldo;
            switch (m - i < 4 ? m - i : 4) {
            case 1: ROWS(1, 8); break;
            case 2: ROWS(2, 6); break;
            case 3: ROWS(3, 4); break;
            default: ROWS(4, 3); break;
            }
        }
    }
}

#undef ROWS
#undef FN
#undef MHA_CAT
#undef MHA_CAT_
