/* Body of row_panel_gemm.c for one floating type and one instruction set: included once per
 * (type, ISA). Defines needed: REAL, SUFFIX (type), PR (rows per panel), ISA (name suffix),
 * ISA_TARGET (a gcc target attribute, or nothing), VEC (a GCC vector type of REALs as wide as
 * that ISA's registers), VEC_U (the same, unaligned and may alias REAL), NV (vectors per panel
 * row: PR = NV * lanes of VEC), NB_MAX (weight rows per register block, <= 12: NB_MAX x NV
 * accumulators must fit the ISA's registers with room for the loads), NB_HALF (weight rows
 * per block of a half panel, <= 12, with NV / 2 vectors a row; 0: no half panels), NP_MAX
 * (panels per register block: 1, or 2 where the registers hold 2 x NB_MAX x NV accumulators);
 * optional: STORE_ROWS, a function writing one vector a panel row (transpose_store_avx512.h). */

#define MHA_CAT_(a, b) a##b
#define MHA_CAT(a, b) MHA_CAT_(a, b)
#define FN(name) MHA_CAT(MHA_CAT(name, SUFFIX), ISA)


/* out[i0 + r, j + b] for r < rows, b < NB: NP adjacent panels of x (NP * PR rows; the packed
 * panels follow one another, PR * k apart) against NB weight rows, the first NVR vectors of each
 * panel row (NV: the whole panel; NV / 2: a half panel, whose other rows are padding). NB, NP
 * and NVR are constants at every call (always_inline + the switches below), so gcc keeps the
 * NB x NP x NVR accumulators in registers: the vector types are each ISA's register width (one
 * vector type as wide as a panel row, split by gcc into two or four registers, went through
 * the stack: 6 GFLOP/s against 30). Each output is one chain of FMAs over k, the same whatever
 * NB, NP and NVR are: blocks change the speed, never the bits.
 * Half panels (NB_HALF > 0, AVX2): a last panel of at most 8 rows (float32) took the time of
 * 16: 17 rows of 384 -> 1152 ran at 54 GFLOP/s where 16 ran at 99 (Zen 2, one thread). 8 rows
 * x 12 weight rows: 72% of the FMA peak against 82% for 16 x 6 (a loop from L1, same run).
 * float64 (4 rows a vector) takes the same path.
 * Two panels (NP_MAX 2, AVX-512): each broadcast weight value feeds 2 FMAs instead of 1. */
static inline __attribute__((always_inline)) ISA_TARGET void
FN(block_)(const REAL *panel, ptrdiff_t rows, ptrdiff_t k, const REAL *w, ptrdiff_t ldw,
           const REAL *bias, REAL *out, ptrdiff_t ldo, const ptrdiff_t *row_off, ptrdiff_t j,
           const int NB, const int NP, const int NVR)
{
    VEC acc[12][NP_MAX * NV];
    for (int b = 0; b < NB; b++)
        for (int v = 0; v < NP * NVR; v++)
            acc[b][v] = (VEC){0};
    const REAL *wj = w + j * ldw;
    for (ptrdiff_t p = 0; p < k; p++) {
        const VEC_U *xp[NP_MAX];   /* direct vector loads: a memcpy to a local went through
                                      the stack, stalling the loads */
        for (int q = 0; q < NP; q++)
            xp[q] = (const VEC_U *)(panel + q * PR * k + p * PR);
        for (int b = 0; b < NB; b++) {
            REAL wv = wj[b * ldw + p];
            for (int q = 0; q < NP; q++)
                for (int v = 0; v < NVR; v++)
                    acc[b][q * NVR + v] += wv * xp[q][v];
        }
    }
#ifdef STORE_ROWS
    if (NVR == 1) {           /* one vector a panel row: transposed in registers */
        for (int q = 0; q < NP; q++) {
            VEC sums[12];
            for (int b = 0; b < NB; b++)
                sums[b] = acc[b][q] + (bias != NULL ? bias[j + b] : 0);
            ptrdiff_t rq = rows - q * PR < PR ? rows - q * PR : PR;
            STORE_ROWS(sums, NB, rq, row_off != NULL ? out : out + q * PR * ldo, ldo,
                       row_off != NULL ? row_off + q * PR : NULL, j);
        }
        return;
    }
#endif
    for (int b = 0; b < NB; b++) {
        REAL add = bias != NULL ? bias[j + b] : 0;
        REAL lanes[NP_MAX * PR];
        for (int q = 0; q < NP; q++) {
            VEC sums[NV];
            for (int v = 0; v < NVR; v++)
                sums[v] = acc[b][q * NVR + v] + add;
            memcpy(lanes + q * PR, sums, NVR * sizeof(VEC));
        }
        for (ptrdiff_t r = 0; r < rows; r++)
            out[(row_off != NULL ? row_off[r] : r * ldo) + j + b] = lanes[r];
    }
}

#if NB_HALF > 0
/* Columns [j0, j1) of a panel of at most PR / 2 rows, in half blocks. */
static ISA_TARGET void
FN(half_panel_)(const REAL *panel, ptrdiff_t rows, ptrdiff_t k, const REAL *w, ptrdiff_t ldw,
                const REAL *bias, REAL *out, ptrdiff_t ldo, const ptrdiff_t *row_off,
                ptrdiff_t j0, ptrdiff_t j1)
{
    ptrdiff_t j = j0;
    for (; j + NB_HALF <= j1; j += NB_HALF)
        FN(block_)(panel, rows, k, w, ldw, bias, out, ldo, row_off, j, NB_HALF, 1, NV / 2);
    for (; j + 4 <= j1; j += 4)
        FN(block_)(panel, rows, k, w, ldw, bias, out, ldo, row_off, j, 4, 1, NV / 2);
    for (; j < j1; j++)
        FN(block_)(panel, rows, k, w, ldw, bias, out, ldo, row_off, j, 1, 1, NV / 2);
}
#endif

/* Columns [j0, j1) of NP whole panels (rows: NP * PR at most), in blocks of nearly equal
 * widths, at most NB_MAX: a head of 64 columns (linear_heads cuts the tiles at heads) runs as
 * 11, 11, 11, 11, 10, 10 instead of 5 x 12 + 4, whose last block had a third of the
 * accumulators per load. Blocks change no bit (block_). */
static inline __attribute__((always_inline)) ISA_TARGET void
FN(panels_)(const REAL *panel, ptrdiff_t rows, ptrdiff_t k, const REAL *w, ptrdiff_t ldw,
            const REAL *bias, REAL *out, ptrdiff_t ldo, const ptrdiff_t *row_off, ptrdiff_t j0,
            ptrdiff_t j1, const int NP)
{
    ptrdiff_t blocks = (j1 - j0 + NB_MAX - 1) / NB_MAX, j = j0;
    for (ptrdiff_t left = blocks; left > 0; left--) {
        int nb = (int)((j1 - j + left - 1) / left);      /* the widest of the balanced widths */
        switch (nb) {
#define MHA_PANELS_CASE(NB) \
        case NB: FN(block_)(panel, rows, k, w, ldw, bias, out, ldo, row_off, j, NB, NP, NV); break;
#if NB_MAX >= 12
        MHA_PANELS_CASE(12)
#endif
#if NB_MAX >= 11
        MHA_PANELS_CASE(11)
#endif
#if NB_MAX >= 10
        MHA_PANELS_CASE(10)
#endif
#if NB_MAX >= 9
        MHA_PANELS_CASE(9)
#endif
#if NB_MAX >= 8
        MHA_PANELS_CASE(8)
#endif
#if NB_MAX >= 7
        MHA_PANELS_CASE(7)
#endif
#if NB_MAX >= 6
        MHA_PANELS_CASE(6)
#endif
#if NB_MAX >= 5
        MHA_PANELS_CASE(5)
#endif
#if NB_MAX >= 4
        MHA_PANELS_CASE(4)
#endif
#if NB_MAX >= 3
        MHA_PANELS_CASE(3)
#endif
        MHA_PANELS_CASE(2) MHA_PANELS_CASE(1)
#undef MHA_PANELS_CASE
        default: break;
        }
        j += nb;
    }
}

static ISA_TARGET void
FN(row_panel_gemm_)(const REAL *packed, ptrdiff_t m, ptrdiff_t k, const REAL *w,
                    ptrdiff_t ldw, const REAL *bias, REAL *out, ptrdiff_t ldo,
                    const ptrdiff_t *row_off, ptrdiff_t j0, ptrdiff_t j1)
{
    ptrdiff_t i0 = 0;
    while (i0 < m) {
        const REAL *panel = packed + i0 * k;
        ptrdiff_t rows = m - i0;
        REAL *oi = row_off != NULL ? out : out + i0 * ldo;
        const ptrdiff_t *ro = row_off != NULL ? row_off + i0 : NULL;
#if NP_MAX > 1
        if (rows > PR) {        /* two panels, the second one possibly part padding */
            rows = rows < 2 * PR ? rows : 2 * PR;
            FN(panels_)(panel, rows, k, w, ldw, bias, oi, ldo, ro, j0, j1, 2);
            i0 += rows;
            continue;
        }
#endif
        rows = rows < PR ? rows : PR;
#if NB_HALF > 0
        if (rows <= PR / 2) {
            FN(half_panel_)(panel, rows, k, w, ldw, bias, oi, ldo, ro, j0, j1);
            i0 += rows;
            continue;
        }
#endif
        FN(panels_)(panel, rows, k, w, ldw, bias, oi, ldo, ro, j0, j1, 1);
        i0 += rows;
    }
}

#undef FN
#undef MHA_CAT
#undef MHA_CAT_
