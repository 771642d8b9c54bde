/* Fused attention tile kernel: see attention_microkernel.h. */

#include <math.h>

#include "attention_microkernel.h"
#include "attention_tile.h"
#include "fast_exp.h"
#include "simd_dispatch.h"

/* The masks and the online softmax of a row are attention_tile.c's, shared with the BLAS
 * path (the same mask and NaN semantics). */
#define RB 4           /* query rows per register block */

#define REAL float
#define SUFFIX f32
#define VL 16          /* lanes of one 512-bit vector */
#define SOFTMAX_ROW mha_online_softmax_row_f32
#include "attention_microkernel_impl.h"
#undef REAL
#undef SUFFIX
#undef VL
#undef SOFTMAX_ROW

#define REAL double
#define SUFFIX f64
#define VL 8
#define SOFTMAX_ROW mha_online_softmax_row_f64
#include "attention_microkernel_impl.h"
#undef REAL
#undef SUFFIX
#undef VL
#undef SOFTMAX_ROW
