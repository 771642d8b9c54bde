/* Per-row softmax work of the attention kernels: see attention_tile.h. */
#include <math.h>

#include "attention_tile.h"
#include "fast_exp.h"

/* Run-time SIMD dispatch: gcc compiles each function once per level and an ifunc resolver picks
 * one at load time. A native build (-march=native) needs no clones. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(MHA_CY_NATIVE_BUILD)
#define MHA_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define MHA_HAVE_CLONES 1
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

const char *mha_tile_simd_level(void)
{
#if defined(MHA_HAVE_CLONES)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("x86-64-v4"))
        return "x86-64-v4";
    if (__builtin_cpu_supports("x86-64-v3"))
        return "x86-64-v3";
    return "baseline";
#elif defined(MHA_CY_NATIVE_BUILD)
    return "native";
#else
    return "baseline";
#endif
}
