/* Fused attention tile kernel: see attention_microkernel.h. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attention_microkernel.h"
#include "attention_tile.h"
#include "fast_exp.h"
#include "simd_dispatch.h"

/* The masks and the online softmax of a row are attention_tile.c's (softmax_row_impl.h,
 * inlined), shared with the BLAS path (the same mask and NaN semantics). */
/* Query rows per register block of the packed kernel: with 2 vectors of sums a row, 6 rows take
 * 12 of AVX2's 16 registers; AVX-512's 32 hold 12 rows (attention_microkernel_impl.h: RB). */
#define RB_NARROW 6
#define RB_WIDE 12
#define DRB_WIDE 8     /* the most query rows per block of the direct kernel (its DRB: 8 at
                          AVX-512, 4 below) */

#define MHA_IMPL "attention_microkernel_impl.h"

#define REAL float
#define TYPE_SUFFIX f32
#define VL 16          /* lanes of one 512-bit vector */
#define EXP mha_exp_f32
#define EXP_C(name) MHA_EXP_F32_##name
#include "simd_isas.h"
#undef REAL
#undef TYPE_SUFFIX
#undef VL
#undef EXP
#undef EXP_C

#define REAL double
#define TYPE_SUFFIX f64
#define VL 8
#define EXP mha_exp_f64
#define EXP_C(name) MHA_EXP_F64_##name
#include "simd_isas.h"
#undef REAL
#undef TYPE_SUFFIX
#undef VL
#undef EXP
#undef EXP_C

#ifdef MHA_SIMD_DISPATCH
/* The scratch size is the same at every level. */
#define DEFINE_DISPATCH(REAL, SFX, FUNC)                                                     \
    void FUNC##SFX(const REAL *q, ptrdiff_t q_rs, int rows, int d, const REAL *k,            \
                   ptrdiff_t k_rs, const REAL *v, ptrdiff_t v_rs, int dv, ptrdiff_t k_begin, \
                   ptrdiff_t k_end, REAL scale, const REAL *add, ptrdiff_t add_rs,           \
                   ptrdiff_t add_ks, const unsigned char *pad, ptrdiff_t limit,              \
                   ptrdiff_t limit_step, ptrdiff_t window, REAL *m, REAL *l, REAL *acc,      \
                   REAL *work)                                                               \
    {                                                                                        \
        MHA_SIMD_CALL(FUNC##SFX, (q, q_rs, rows, d, k, k_rs, v, v_rs, dv, k_begin, k_end,   \
                                  scale, add, add_rs, add_ks, pad, limit, limit_step,        \
                                  window, m, l, acc, work))                                  \
    }
DEFINE_DISPATCH(float, f32, mha_fused_attend_)
DEFINE_DISPATCH(double, f64, mha_fused_attend_)
DEFINE_DISPATCH(float, f32, mha_fused_attend_direct_)
DEFINE_DISPATCH(double, f64, mha_fused_attend_direct_)
ptrdiff_t mha_fused_scratch_f32(int d, int dv) { return mha_fused_scratch_f32_base(d, dv); }
ptrdiff_t mha_fused_scratch_f64(int d, int dv) { return mha_fused_scratch_f64_base(d, dv); }
#endif
