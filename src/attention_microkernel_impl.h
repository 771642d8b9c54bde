/* Body of attention_microkernel.c for one floating type: included once with REAL = float and
 * once with REAL = double. Defines needed: REAL, SUFFIX, VL (lanes of a 512-bit vector), RB,
 * SOFTMAX_ROW (the online-softmax row function of attention_tile.h for REAL).
 * The register blocks are GNU C vectors, which gcc lowers at every SIMD level of
 * MHA_SIMD_CLONES; the block functions are always_inline with a constant row count so the
 * M x 2 vectors of sums stay in registers. Plain lane loops (as in small_gemm_impl.h) did not
 * work here: gcc vectorized the loop over d instead, gathering q with shuffles and spilling
 * the sums (3.5 GFLOP/s on Zen 1 AVX2). */

#define MHA_CAT_(a, b) a##b
#define MHA_CAT(a, b) MHA_CAT_(a, b)
#define FN(name) MHA_CAT(name, SUFFIX)

#define NK (4 * VL)    /* keys per tile: the packed tile is d x 256 bytes */
#define VEC FN(vec_)

#define W (VL / 2)     /* lanes of a 256-bit vector: a block's sums are 2 vectors per row */

/* 256 bits, the widest vector gcc lowers well at every level (512-bit ones went through the
 * integer registers on AVX2); unaligned, and allowed to alias REAL */
typedef REAL VEC __attribute__((vector_size(W * sizeof(REAL)), aligned(sizeof(REAL)),
                                may_alias));

ptrdiff_t FN(mha_fused_scratch_)(int d)
{
    return (ptrdiff_t)(d > 0 ? d : 1) * NK + RB * NK;
}

/* kt[p * NK + u] = k[u * k_rs + p]: the tile transposed, keys nk..nkp-1 zero. */
static inline void FN(pack_keys_)(const REAL *k, ptrdiff_t k_rs, int d, int nk, int nkp,
                                  REAL *kt)
{
    for (ptrdiff_t u = 0; u < nk; u++)
        for (ptrdiff_t p = 0; p < d; p++)
            kt[p * NK + u] = k[u * k_rs + p];
    for (ptrdiff_t p = 0; p < d; p++)
        for (ptrdiff_t u = nk; u < nkp; u++)
            kt[p * NK + u] = 0;
}

/* a0[i], a1[i] += sum_t x[i * x_rs + t] * b[t * b_rs + (0 .. 2W)] for i < M, t < n: the
 * register block of both products (scores: x = Q, b = the packed keys; P V: x = P, b = V),
 * one vector load of b per t serving M rows. */
static inline __attribute__((always_inline)) void
FN(outer_block_)(const int M, const REAL *x, ptrdiff_t x_rs, const REAL *b, ptrdiff_t b_rs,
                 ptrdiff_t n, VEC *a0, VEC *a1)
{
    for (ptrdiff_t t = 0; t < n; t++) {
        VEC b0 = *(const VEC *)(b + t * b_rs), b1 = *(const VEC *)(b + t * b_rs + W);
        for (int i = 0; i < M; i++) {
            REAL xi = x[i * x_rs + t];
            a0[i] += xi * b0;
            a1[i] += xi * b1;
        }
    }
}

/* s[i * NK + c] = scale * q_i . k_c for i < M, c < nkp, VL keys at a time. */
static inline __attribute__((always_inline)) void
FN(scores_block_)(const int M, const REAL *q, ptrdiff_t q_rs, int d, const REAL *kt, int nkp,
                  REAL scale, REAL *s)
{
    for (ptrdiff_t c = 0; c < nkp; c += VL) {
        VEC a0[RB], a1[RB];
        for (int i = 0; i < M; i++)
            a0[i] = a1[i] = (VEC){0};
        FN(outer_block_)(M, q, q_rs, kt + c, NK, d, a0, a1);
        for (int i = 0; i < M; i++) {
            *(VEC *)(s + i * NK + c) = scale * a0[i];
            *(VEC *)(s + i * NK + c + W) = scale * a1[i];
        }
    }
}

/* acc[i * dv + e] += sum_j s[i * NK + j] v[j * v_rs + e] for i < M, e in [e0, e0 + VL). */
static inline __attribute__((always_inline)) void
FN(pv_cols_)(const int M, const REAL *s, int nk, const REAL *v, ptrdiff_t v_rs, REAL *acc,
             int dv, ptrdiff_t e0)
{
    VEC a0[RB], a1[RB];
    for (int i = 0; i < M; i++) {
        a0[i] = *(VEC *)(acc + i * dv + e0);
        a1[i] = *(VEC *)(acc + i * dv + e0 + W);
    }
    FN(outer_block_)(M, s, NK, v + e0, v_rs, nk, a0, a1);
    for (int i = 0; i < M; i++) {
        *(VEC *)(acc + i * dv + e0) = a0[i];
        *(VEC *)(acc + i * dv + e0 + W) = a1[i];
    }
}

/* The same for the last dv % VL columns, e in [e0, dv). */
static inline void FN(pv_tail_)(int M, const REAL *s, int nk, const REAL *v, ptrdiff_t v_rs,
                                REAL *acc, int dv, ptrdiff_t e0)
{
    for (int i = 0; i < M; i++)
        for (ptrdiff_t j = 0; j < nk; j++)
            for (ptrdiff_t e = e0; e < dv; e++)
                acc[i * dv + e] += s[i * NK + j] * v[j * v_rs + e];
}

/* One block of M rows against the packed tile of keys [j0, j0 + nk). */
static inline __attribute__((always_inline)) void
FN(block_)(const int M, const REAL *q, ptrdiff_t q_rs, int d, const REAL *kt, int nk, int nkp,
           const REAL *v, ptrdiff_t v_rs, int dv, ptrdiff_t j0, REAL scale,
           const REAL *add, ptrdiff_t add_rs, ptrdiff_t add_ks, const unsigned char *pad,
           ptrdiff_t limit, ptrdiff_t limit_step, REAL *m, REAL *l, REAL *acc, REAL *s)
{
    FN(scores_block_)(M, q, q_rs, d, kt, nkp, scale, s);
    for (int i = 0; i < M; i++) {
        ptrdiff_t n_valid = limit + i * limit_step - j0;
        n_valid = n_valid < 0 ? 0 : (n_valid > nk ? nk : n_valid);
        SOFTMAX_ROW(s + i * NK, nk, add == NULL ? NULL : add + i * add_rs + j0 * add_ks, add_ks,
                    pad == NULL ? NULL : pad + j0, (int)n_valid, m + i, l + i, acc + i * dv,
                    dv);
    }
    const REAL *vt = v + j0 * v_rs;
    ptrdiff_t e = 0;
    for (; e + VL <= dv; e += VL)
        FN(pv_cols_)(M, s, nk, vt, v_rs, acc, dv, e);
    if (e < dv)
        FN(pv_tail_)(M, s, nk, vt, v_rs, acc, dv, e);
}

#define BLOCK(M)                                                                             \
    FN(block_)((M), q + r * q_rs, q_rs, d, kt, nk, nkp, v, v_rs, dv, j0, scale,             \
               add == NULL ? NULL : add + r * add_rs, add_rs, add_ks, pad,                   \
               limit + r * limit_step, limit_step, m + r, l + r, acc + r * dv, s)

MHA_SIMD_CLONES
void FN(mha_fused_attend_)(const REAL *q, ptrdiff_t q_rs, int rows, int d,
                           const REAL *k, ptrdiff_t k_rs, const REAL *v, ptrdiff_t v_rs, int dv,
                           ptrdiff_t k_begin, ptrdiff_t k_end, REAL scale,
                           const REAL *add, ptrdiff_t add_rs, ptrdiff_t add_ks,
                           const unsigned char *pad, ptrdiff_t limit, ptrdiff_t limit_step,
                           REAL *m, REAL *l, REAL *acc, REAL *work)
{
    REAL *kt = work, *s = work + (ptrdiff_t)(d > 0 ? d : 1) * NK;
    for (ptrdiff_t j0 = k_begin; j0 < k_end; j0 += NK) {
        int nk = (int)(k_end - j0 < NK ? k_end - j0 : NK);
        int nkp = (nk + VL - 1) / VL * VL;
        FN(pack_keys_)(k + j0 * k_rs, k_rs, d, nk, nkp, kt);
        for (ptrdiff_t r = 0; r < rows; r += RB) {
            int left = (int)(rows - r);
            /* rows that see no key of the tile (above the causal diagonal) are left as they
             * are: their softmax would add p = 0 everywhere */
            if (limit + (r + (left < RB ? left : RB) - 1) * limit_step <= j0)
                continue;
            switch (left < RB ? left : RB) {
            case 1: BLOCK(1); break;
            case 2: BLOCK(2); break;
            case 3: BLOCK(3); break;
            default: BLOCK(RB); break;
            }
        }
    }
}

#undef BLOCK
#undef VEC
#undef W
#undef NK
#undef FN
#undef MHA_CAT
#undef MHA_CAT_
