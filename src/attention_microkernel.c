/* Fused attention tile kernel: see attention_microkernel.h. */

#include <math.h>

#include "attention_microkernel.h"
#include "attention_tile.h"
#include "fast_exp.h"
#include "simd_dispatch.h"

/* The masks and the online softmax of a row are attention_tile.c's, shared with the BLAS
 * path (the same mask and NaN semantics). */
#define RB 6           /* query rows per register block of the packed kernel: 6 x 2 vectors of
                          sums, 12 of the 16 ymm registers on AVX2 */
#define DRB 4          /* query rows per block of the direct kernel (at most the lanes of a
                          256-bit vector of doubles) */

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
