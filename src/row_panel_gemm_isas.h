/* The micro-kernels of row_panel_gemm.c for one floating type, one per instruction set:
 * included once per type. Defines needed: REAL, SUFFIX, PR (rows per panel),
 * VTYPE(bytes), the name of the vector type of REALs of that many bytes (VTYPE(bytes)_u: its
 * unaligned twin); optional: PANEL_STORE_ROWS_AVX512, the AVX-512 kernel's output step.
 * NB_MAX: weight rows per register block, so that NB_MAX x NV accumulators leave room for the
 * loads in the ISA's registers. */

#define MHA_CAT3_(a, b, c) a##b##c
#define MHA_CAT3(a, b, c) MHA_CAT3_(a, b, c)

ptrdiff_t MHA_CAT3(mha_row_panels_size_, SUFFIX, )(ptrdiff_t m, ptrdiff_t k)
{
    return (m + PR - 1) / PR * PR * k;
}

#define ISA _base
#define ISA_TARGET
#define VEC VTYPE(16)
#define VEC_U MHA_CAT3(VTYPE(16), _u, )
#define NV (PR * (int)sizeof(REAL) / 16)
#define NB_MAX 2          /* 8 of the 16 SSE registers */
#define NB_HALF 0         /* the baseline computes whole panels */
#define NP_MAX 1
#include "row_panel_gemm_impl.h"
#undef ISA
#undef ISA_TARGET
#undef VEC
#undef VEC_U
#undef NV
#undef NB_MAX
#undef NB_HALF
#undef NP_MAX

#ifdef MHA_PANEL_DISPATCH
#define ISA _avx2
#define ISA_TARGET TARGET_AVX2
#define VEC VTYPE(32)
#define VEC_U MHA_CAT3(VTYPE(32), _u, )
#define NV (PR * (int)sizeof(REAL) / 32)
#define NB_MAX 6          /* 12 of the 16 AVX2 registers */
#define NB_HALF 12        /* 12 of the 16 AVX2 registers (NV is 2 for both types) */
#define NP_MAX 1
#include "row_panel_gemm_impl.h"
#undef ISA
#undef ISA_TARGET
#undef VEC
#undef VEC_U
#undef NV
#undef NB_MAX
#undef NB_HALF
#undef NP_MAX

#define ISA _avx512
#define ISA_TARGET TARGET_AVX512
#define VEC VTYPE(64)
#define VEC_U MHA_CAT3(VTYPE(64), _u, )
#define NV (PR * (int)sizeof(REAL) / 64)
/* 12 FMA chains, where 2 FMA units x 4 cycles of latency need 8: at 8, each FMA also waited on
 * its broadcast load (9 loads per 8 FMAs, 2 loads a cycle). The same bits (each output is one
 * chain over k either way). Intel Xeon (AVX-512, 2 FMA units), 2 threads, M 4096, K 768 ->
 * N 2304, interleaved runs: 207-212 -> 263-286 GFLOP/s (BLAS's one large sgemm: 329-374);
 * M 128 within the host's noise. Zen 4 (one 512-bit FMA a cycle): no difference. */
#define NB_MAX 12
#define NB_HALF 0         /* NV is 1: whole panels */
/* Two panels a block: one broadcast weight value feeds two FMAs, so a k step loads 2 vectors +
 * 12 broadcasts for 24 FMAs (14 loads) instead of 1 + 12 for 12. The same bits. Intel Xeon,
 * interleaved runs, GFLOP/s one panel -> two, 1 thread (2 threads): M 128, K 768 -> N 2304
 * 110-128 -> 142-153 (217-242 -> 269-294); 128, 768 -> 768 108-112 -> 135-139; 32, 384 ->
 * 1152 109-112 -> 126-131; 4096, 768 -> 2304 107-120 -> 132-138 (207-236 -> 255-267). BLAS's
 * one sgemm of the same shape: 119-128, 154-158 at 4096 rows; this core's FMA peak ~217. */
#define NP_MAX 2          /* 24 of the 32 AVX-512 registers */
#ifdef PANEL_STORE_ROWS_AVX512
#define STORE_ROWS(sums, nb, rows, out, ldo, row_off, j)                                     \
    PANEL_STORE_ROWS_AVX512((const __m512 *)(sums), nb, rows, out, ldo, row_off, j)
#endif
#include "row_panel_gemm_impl.h"
#undef STORE_ROWS
#undef ISA
#undef ISA_TARGET
#undef VEC
#undef VEC_U
#undef NV
#undef NB_MAX
#undef NB_HALF
#undef NP_MAX
#endif

#undef MHA_CAT3
#undef MHA_CAT3_
