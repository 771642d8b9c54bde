/* Per-row softmax work of the attention kernels: see attention_tile.h. */
#include <math.h>

#include "attention_tile.h"
#include "fast_exp.h"
#include "simd_dispatch.h"

#define MHA_IMPL "attention_tile_impl.h"

/* EXP_C(NAME): fast_exp.h's constant MHA_EXP_<type>_NAME, for the vector exp of the body */
#define REAL float
#define TYPE_SUFFIX f32
#define EXP mha_exp_f32
#define EXP_C(name) MHA_EXP_F32_##name
#include "simd_isas.h"
#undef REAL
#undef TYPE_SUFFIX
#undef EXP
#undef EXP_C

#define REAL double
#define TYPE_SUFFIX f64
#define EXP mha_exp_f64
#define EXP_C(name) MHA_EXP_F64_##name
#include "simd_isas.h"
#undef REAL
#undef TYPE_SUFFIX
#undef EXP
#undef EXP_C

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
    void mha_finish_rows_##SFX(const REAL *acc, const REAL *l, int rows, int dv, REAL *out,  \
                               ptrdiff_t out_rs)                                             \
    {                                                                                        \
        MHA_SIMD_CALL(mha_finish_rows_##SFX, (acc, l, rows, dv, out, out_rs))                \
    }
DEFINE_DISPATCH(float, f32)
DEFINE_DISPATCH(double, f64)
#endif
