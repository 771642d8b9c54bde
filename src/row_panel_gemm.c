/* Projections of a moderate number of token rows: see row_panel_gemm.h.
 *
 * The micro-kernel is compiled three times per type, for AVX-512, AVX2 + FMA and the x86-64
 * baseline, each with vector types of its own register width, and picked once by the CPU
 * (gcc's target_clones cannot do that: its clones share one source, hence one vector width).
 * Other compilers and CPUs, and -march=native builds, get the baseline code built for the
 * compile target. */
#include <string.h>

#include "row_panel_gemm.h"

#include "simd_dispatch.h"

#ifdef MHA_SIMD_DISPATCH
#define MHA_PANEL_DISPATCH 1
#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")))
#define TARGET_AVX2 __attribute__((target("avx2,fma")))
#include "transpose_store_avx512.h"
#endif

/* A vector type of BYTES bytes and its unaligned, aliasing twin for loads from the panels. */
#define MHA_VECTOR_TYPES(REAL, BYTES, NAME)                                                 \
    typedef REAL NAME __attribute__((vector_size(BYTES)));                                  \
    typedef REAL NAME##_u __attribute__((vector_size(BYTES), aligned(sizeof(REAL)), may_alias))

MHA_VECTOR_TYPES(float, 16, mha_f32_v16);
MHA_VECTOR_TYPES(float, 32, mha_f32_v32);
MHA_VECTOR_TYPES(float, 64, mha_f32_v64);
MHA_VECTOR_TYPES(double, 16, mha_f64_v16);
MHA_VECTOR_TYPES(double, 32, mha_f64_v32);
MHA_VECTOR_TYPES(double, 64, mha_f64_v64);

#define REAL float
#define SUFFIX f32
#define PR MHA_PANEL_ROWS_F32
#define VTYPE(bytes) mha_f32_v##bytes
#ifdef MHA_PANEL_DISPATCH
#define PANEL_STORE_ROWS_AVX512 mha_store_rows_f32_avx512
#endif
#include "row_panel_gemm_isas.h"
#undef PANEL_STORE_ROWS_AVX512
#undef REAL
#undef SUFFIX
#undef PR
#undef VTYPE

#define REAL double
#define SUFFIX f64
#define PR MHA_PANEL_ROWS_F64
#define VTYPE(bytes) mha_f64_v##bytes
#include "row_panel_gemm_isas.h"
#undef REAL
#undef SUFFIX
#undef PR
#undef VTYPE

/* ---- packing and dispatch, per type ---- */
#define DEFINE_PACK_AND_DISPATCH(REAL, SUFFIX, PR)                                            \
    static void pack_row_panels_scalar_##SUFFIX(const REAL *x, ptrdiff_t ldx, ptrdiff_t m,   \
                                                ptrdiff_t k, REAL *packed)                  \
    {                                                                                        \
        for (ptrdiff_t i0 = 0; i0 < m; i0 += PR) {                                           \
            REAL *panel = packed + i0 * k;                                                   \
            ptrdiff_t rows = m - i0 < PR ? m - i0 : PR;                                      \
            for (ptrdiff_t p = 0; p < k; p++) {                                              \
                for (ptrdiff_t r = 0; r < rows; r++)                                         \
                    panel[p * PR + r] = x[(i0 + r) * ldx + p];                               \
                for (ptrdiff_t r = rows; r < PR; r++)                                        \
                    panel[p * PR + r] = 0;                                                   \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
    void mha_row_panel_gemm_##SUFFIX(const REAL *packed, ptrdiff_t m, ptrdiff_t k,           \
                                     const REAL *w, ptrdiff_t ldw, const REAL *bias,         \
                                     REAL *out, ptrdiff_t ldo, const ptrdiff_t *row_off,     \
                                     ptrdiff_t j0, ptrdiff_t j1)                             \
    {                                                                                        \
        DISPATCH(SUFFIX)(packed, m, k, w, ldw, bias, out, ldo, row_off, j0, j1);             \
    }

#ifdef MHA_PANEL_DISPATCH
/* The best level that may run: 2 AVX-512, 1 AVX2 + FMA, 0 the baseline: the common level of
 * every kernel (the CPU's, or the one MHA_CY_SIMD forces), whose values are the same. */
static int mha_panel_cpu_isa(void)
{
    return mha_simd_isa();
}

static int mha_panel_level = -1;     /* chosen at the first call; tests may lower it */

static int mha_panel_isa(void)
{
    if (mha_panel_level < 0)
        mha_panel_level = mha_panel_cpu_isa();
    return mha_panel_level;
}

int mha_row_panel_set_isa(int level)
{
    int previous = mha_panel_isa(), best = mha_panel_cpu_isa();
    mha_panel_level = level < 0 || level > best ? best : level;
    return previous;
}
#define DISPATCH(SUFFIX)                                                                     \
    (mha_panel_isa() == 2 ? row_panel_gemm_##SUFFIX##_avx512                                 \
     : mha_panel_isa() == 1 ? row_panel_gemm_##SUFFIX##_avx2 : row_panel_gemm_##SUFFIX##_base)
#else
#define DISPATCH(SUFFIX) row_panel_gemm_##SUFFIX##_base
int mha_row_panel_set_isa(int level) { (void)level; return 0; }
#endif

DEFINE_PACK_AND_DISPATCH(float, f32, MHA_PANEL_ROWS_F32)
DEFINE_PACK_AND_DISPATCH(double, f64, MHA_PANEL_ROWS_F64)

#ifdef MHA_PANEL_DISPATCH
#if MHA_PANEL_ROWS_F32 != 16
#error "pack_row_panels_f32_avx512 transposes blocks of 16 rows"
#endif
/* The float32 panels at AVX-512: blocks of 16 rows x 16 values of x, transposed in registers
 * (16 loads, 64 shuffles, 16 stores) instead of a scalar load and store each. Only data
 * moves: the bytes are the scalar loop's. The scalar pack took 3.5% of a BERT-base encoder
 * call (B 1, L 128, d 768, 2 threads, Zen 4 profile). Zen 4, 128 x 768 from L2, min of 2000:
 * 43 -> 20 us. */
static TARGET_AVX512 void pack_row_panels_f32_avx512(const float *x, ptrdiff_t ldx,
                                                     ptrdiff_t m, ptrdiff_t k, float *packed)
{
    for (ptrdiff_t i0 = 0; i0 < m; i0 += 16) {
        float *panel = packed + i0 * k;
        ptrdiff_t rows = m - i0 < 16 ? m - i0 : 16;
        for (ptrdiff_t p = 0; p < k; p += 16) {
            int n = k - p < 16 ? (int)(k - p) : 16;
            __mmask16 mask = (__mmask16)((1u << n) - 1);
            __m512 r[16];
            for (int i = 0; i < 16; i++)     /* rows past x: the zeros of the last panel */
                r[i] = i < rows ? _mm512_maskz_loadu_ps(mask, x + (i0 + i) * ldx + p)
                                : _mm512_setzero_ps();
            mha_transpose16_f32_avx512(r);
            for (int j = 0; j < n; j++)      /* r[j]: value p + j of the 16 rows */
                _mm512_storeu_ps(panel + (p + j) * 16, r[j]);
        }
    }
}
#endif

void mha_pack_row_panels_f32(const float *x, ptrdiff_t ldx, ptrdiff_t m, ptrdiff_t k,
                             float *packed)
{
#ifdef MHA_PANEL_DISPATCH
    if (mha_panel_isa() == 2) {
        pack_row_panels_f32_avx512(x, ldx, m, k, packed);
        return;
    }
#endif
    pack_row_panels_scalar_f32(x, ldx, m, k, packed);
}

void mha_pack_row_panels_f64(const double *x, ptrdiff_t ldx, ptrdiff_t m, ptrdiff_t k,
                             double *packed)
{
    pack_row_panels_scalar_f64(x, ldx, m, k, packed);
}
