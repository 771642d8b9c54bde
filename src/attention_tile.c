/* Per-row softmax work of the attention kernels: see attention_tile.h. */
#include <math.h>

#include "attention_tile.h"
#include "fast_exp.h"
#include "simd_dispatch.h"

#define REAL float
#define SUFFIX f32
#define EXP mha_exp_f32
#include "attention_tile_impl.h"
#undef REAL
#undef SUFFIX
#undef EXP

#define REAL double
#define SUFFIX f64
#define EXP mha_exp_f64
#include "attention_tile_impl.h"
#undef REAL
#undef SUFFIX
#undef EXP
