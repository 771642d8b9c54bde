/* Per-row softmax work of the attention kernels: see attention_tile.h. */
#include <math.h>

#include "attention_tile.h"
#include "fast_exp.h"

/* Run-time SIMD dispatch: gcc compiles each function once per level and an ifunc resolver picks
 * one at load time (mha_simd_level() in cpu_features.c reports which). A native build
 * (-march=native) needs no clones. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(MHA_CY_NATIVE_BUILD)
#define MHA_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MHA_SIMD_CLONES
#endif

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
