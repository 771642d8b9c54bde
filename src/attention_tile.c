/* Per-row softmax work of the attention kernels: see attention_tile.h. */
#include <math.h>

#include "attention_tile.h"
#include "fast_exp.h"
#include "simd_dispatch.h"

#define MHA_IMPL "attention_tile_impl.h"

#define REAL float
#define TYPE_SUFFIX f32
#define EXP mha_exp_f32
#define EXP_INT int32_t
#define EXP_UNDERFLOW MHA_EXP_F32_UNDERFLOW
#define EXP_LOG2E MHA_EXP_F32_LOG2E
#define EXP_ROUND_MAGIC MHA_EXP_F32_ROUND_MAGIC
#define EXP_LN2_HI MHA_EXP_F32_LN2_HI
#define EXP_LN2_LO MHA_EXP_F32_LN2_LO
#define EXP_POLY_STEPS MHA_EXP_F32_POLY_STEPS
#define EXP_MAGIC_BITS MHA_EXP_F32_MAGIC_BITS
#define EXP_BIAS 127
#define EXP_MANT_BITS 23
#include "simd_isas.h"
#undef REAL
#undef TYPE_SUFFIX
#undef EXP
#undef EXP_INT
#undef EXP_UNDERFLOW
#undef EXP_LOG2E
#undef EXP_ROUND_MAGIC
#undef EXP_LN2_HI
#undef EXP_LN2_LO
#undef EXP_POLY_STEPS
#undef EXP_MAGIC_BITS
#undef EXP_BIAS
#undef EXP_MANT_BITS

#define REAL double
#define TYPE_SUFFIX f64
#define EXP mha_exp_f64
#define EXP_INT int64_t
#define EXP_UNDERFLOW MHA_EXP_F64_UNDERFLOW
#define EXP_LOG2E MHA_EXP_F64_LOG2E
#define EXP_ROUND_MAGIC MHA_EXP_F64_ROUND_MAGIC
#define EXP_LN2_HI MHA_EXP_F64_LN2_HI
#define EXP_LN2_LO MHA_EXP_F64_LN2_LO
#define EXP_POLY_STEPS MHA_EXP_F64_POLY_STEPS
#define EXP_MAGIC_BITS MHA_EXP_F64_MAGIC_BITS
#define EXP_BIAS 1023
#define EXP_MANT_BITS 52
#include "simd_isas.h"
#undef REAL
#undef TYPE_SUFFIX
#undef EXP
#undef EXP_INT
#undef EXP_UNDERFLOW
#undef EXP_LOG2E
#undef EXP_ROUND_MAGIC
#undef EXP_LN2_HI
#undef EXP_LN2_LO
#undef EXP_POLY_STEPS
#undef EXP_MAGIC_BITS
#undef EXP_BIAS
#undef EXP_MANT_BITS

#ifdef MHA_SIMD_DISPATCH
#define DEFINE_DISPATCH(REAL, SFX)                                                           \
    void mha_online_softmax_row_##SFX(REAL *s, int n, const REAL *add, ptrdiff_t add_stride,  \
                                      const unsigned char *pad, int n_skip, int n_valid,     \
                                      REAL *m, REAL *l, REAL *acc, int dv)                   \
    {                                                                                        \
        MHA_SIMD_CALL(mha_online_softmax_row_##SFX,                                          \
                      (s, n, add, add_stride, pad, n_skip, n_valid, m, l, acc, dv))                  \
    }                                                                                        \
    void mha_softmax_row_##SFX(REAL *s, int n, const REAL *add, ptrdiff_t add_stride,         \
                               const unsigned char *pad, int n_skip, int n_valid)            \
    {                                                                                        \
        MHA_SIMD_CALL(mha_softmax_row_##SFX, (s, n, add, add_stride, pad, n_skip, n_valid))          \
    }                                                                                        \
    void mha_finish_row_##SFX(const REAL *acc, REAL l, REAL *out, int dv)                    \
    {                                                                                        \
        MHA_SIMD_CALL(mha_finish_row_##SFX, (acc, l, out, dv))                               \
    }
DEFINE_DISPATCH(float, f32)
DEFINE_DISPATCH(double, f64)
#endif
