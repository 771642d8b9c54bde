/* Projections of a few rows: see small_gemm.h. */
#include "small_gemm.h"
#include "simd_dispatch.h"

#define MHA_IMPL "small_gemm_impl.h"
#define MAX_NB 8       /* weight rows per block, at most */

/* 32-byte vectors: a ymm register on AVX2 and AVX-512, two xmm on the baseline. */
typedef float mha_sg_f32 __attribute__((vector_size(32)));
typedef float mha_sg_f32_u __attribute__((vector_size(32), aligned(4), may_alias));
typedef double mha_sg_f64 __attribute__((vector_size(32)));
typedef double mha_sg_f64_u __attribute__((vector_size(32), aligned(8), may_alias));

#define REAL float
#define TYPE_SUFFIX f32
#define VEC mha_sg_f32
#define VEC_U mha_sg_f32_u
#define VL 8
#include "simd_isas.h"
#undef REAL
#undef TYPE_SUFFIX
#undef VL
#undef VEC
#undef VEC_U

#define REAL double
#define TYPE_SUFFIX f64
#define VEC mha_sg_f64
#define VEC_U mha_sg_f64_u
#define VL 4
#include "simd_isas.h"
#undef REAL
#undef TYPE_SUFFIX
#undef VL
#undef VEC
#undef VEC_U

#ifdef MHA_SIMD_DISPATCH
#define DEFINE_DISPATCH(REAL, SFX)                                                           \
    void mha_small_gemm_##SFX(const REAL *x, ptrdiff_t ldx, const REAL *w, ptrdiff_t ldw,     \
                              const REAL *bias, REAL *out, ptrdiff_t ldo,                    \
                              ptrdiff_t m, ptrdiff_t n, ptrdiff_t k)                         \
    {                                                                                        \
        MHA_SIMD_CALL(mha_small_gemm_##SFX, (x, ldx, w, ldw, bias, out, ldo, m, n, k))       \
    }
DEFINE_DISPATCH(float, f32)
DEFINE_DISPATCH(double, f64)
#endif
