/* Projections of a few rows: see small_gemm.h. */
#include "small_gemm.h"
#include "simd_dispatch.h"

#define MAX_NB 8       /* weight rows per block, at most */

#define REAL float
#define SUFFIX f32
#define VL 16
#include "small_gemm_impl.h"
#undef REAL
#undef SUFFIX
#undef VL

#define REAL double
#define SUFFIX f64
#define VL 8
#include "small_gemm_impl.h"
#undef REAL
#undef SUFFIX
#undef VL
