/* Fused attention tile kernel: see attention_microkernel.h. */

/* The exp of fast_exp.h selects 0 for underflowing inputs after a multiply that may raise a
 * floating-point flag; with trapping math gcc may not compute that multiply for every lane, so
 * on AVX2 (no masked lanes) it left the exp loops scalar. Flags are never read here: without
 * trapping math the softmax vectorizes on AVX2 too (same results; 0.36 -> 0.21 ms per
 * 128 x 1024 keys, d = 64, Zen 1). */
#pragma GCC optimize("no-trapping-math")

#include <math.h>

#include "attention_microkernel.h"
#include "fast_exp.h"
#include "simd_dispatch.h"

/* The masks and online softmax of a row: attention_tile.c's code, instantiated once more under
 * the option above (as mha_online_softmax_row_fused_f32 / _f64), so both paths share it. */
#define EXP mha_exp_f32
#define REAL float
#define SUFFIX fused_f32
#include "attention_tile_impl.h"
#undef REAL
#undef SUFFIX
#undef EXP

#define EXP mha_exp_f64
#define REAL double
#define SUFFIX fused_f64
#include "attention_tile_impl.h"
#undef REAL
#undef SUFFIX
#undef EXP

#define RB 4           /* query rows per register block */

#define REAL float
#define SUFFIX f32
#define VL 16          /* lanes of one 512-bit vector */
#define SOFTMAX_ROW mha_online_softmax_row_fused_f32
#include "attention_microkernel_impl.h"
#undef REAL
#undef SUFFIX
#undef VL
#undef SOFTMAX_ROW

#define REAL double
#define SUFFIX f64
#define VL 8
#define SOFTMAX_ROW mha_online_softmax_row_fused_f64
#include "attention_microkernel_impl.h"
#undef REAL
#undef SUFFIX
#undef VL
#undef SOFTMAX_ROW
