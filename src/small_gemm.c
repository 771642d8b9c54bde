/* Projections of a few rows: see small_gemm.h. */
#include "small_gemm.h"
#include "simd_dispatch.h"

#define MAX_NB 8       /* weight rows per block, at most */

/* 32-byte vectors: a ymm register on AVX2 and AVX-512, two xmm on the baseline. */
typedef float mha_sg_f32 __attribute__((vector_size(32)));
typedef float mha_sg_f32_u __attribute__((vector_size(32), aligned(4), may_alias));
typedef double mha_sg_f64 __attribute__((vector_size(32)));
typedef double mha_sg_f64_u __attribute__((vector_size(32), aligned(8), may_alias));

#define REAL float
#define SUFFIX f32
#define VEC mha_sg_f32
#define VEC_U mha_sg_f32_u
#define VL 8
#include "small_gemm_impl.h"
#undef REAL
#undef SUFFIX
#undef VL
#undef VEC
#undef VEC_U

#define REAL double
#define SUFFIX f64
#define VEC mha_sg_f64
#define VEC_U mha_sg_f64_u
#define VL 4
#include "small_gemm_impl.h"
#undef REAL
#undef SUFFIX
#undef VL
#undef VEC
#undef VEC_U
