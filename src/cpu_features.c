/* cpu_features.c -- see cpu_features.h. */
#include "cpu_features.h"

#include <stdlib.h>
#include <string.h>

#include "simd_dispatch.h"   /* MHA_SIMD_DISPATCH: whether the kernels dispatch */


static const char *const mha_isa_names[] = {"sse2", "avx2", "avx512"};

int mha_simd_cpu_isa(void)
{
#ifdef MHA_SIMD_DISPATCH
    /* Needed only before constructors ran, harmless otherwise. */
    __builtin_cpu_init();
    if (__builtin_cpu_supports("x86-64-v4"))
        return MHA_ISA_AVX512;
    if (__builtin_cpu_supports("x86-64-v3"))
        return MHA_ISA_AVX2;
#endif
    return MHA_ISA_BASE;
}

#ifdef MHA_SIMD_DISPATCH
/* The level MHA_CY_SIMD asks for, or -1 (no limit). */
static int mha_simd_requested(void)
{
    const char *value = getenv("MHA_CY_SIMD");
    if (value == NULL)
        return -1;
    if (strcmp(value, "avx512") == 0)
        return MHA_ISA_AVX512;
    if (strcmp(value, "avx2") == 0)
        return MHA_ISA_AVX2;
    if (strcmp(value, "sse2") == 0 || strcmp(value, "portable") == 0)
        return MHA_ISA_BASE;
    return -1;   /* "auto", or a typo that mha_cy/_simd.py reports at import */
}

static int mha_isa = -1, mha_dot = 0;

/* At load time, before any kernel can run in any thread: no lazy initialization race. */
__attribute__((constructor)) static void mha_simd_isa_init(void)
{
    int best = mha_simd_cpu_isa(), requested = mha_simd_requested();
    const char *dot = getenv("MHA_CY_INT8_DOT");
    mha_isa = requested >= 0 && requested < best ? requested : best;
    mha_dot = mha_isa == MHA_ISA_AVX512 && __builtin_cpu_supports("avx512vnni")
              && !(dot != NULL && strcmp(dot, "float") == 0);
}

int mha_simd_isa(void)
{
    if (mha_isa < 0)
        mha_simd_isa_init();
    return mha_isa;
}

int mha_int8_dot(void)
{
    if (mha_isa < 0)
        mha_simd_isa_init();
    return mha_dot;
}
#else
int mha_simd_isa(void) { return MHA_ISA_BASE; }   /* one compiled level: nothing to pick */
int mha_int8_dot(void) { return 0; }
#endif

const char *mha_int8_dot_name(void) { return mha_int8_dot() ? "vnni" : "float"; }

const char *mha_simd_level(void)
{
#if defined(MHA_CY_NATIVE_BUILD) && MHA_CY_NATIVE_BUILD
    return "native";            /* -march=native: no run-time dispatch */
#elif defined(MHA_SIMD_DISPATCH)
    return mha_isa_names[mha_simd_isa()];
#else
    return "generic";           /* no run-time dispatch with this compiler / architecture */
#endif
}

const char *mha_simd_cpu_level(void)
{
#if defined(MHA_CY_NATIVE_BUILD) && MHA_CY_NATIVE_BUILD
    return "native";
#elif defined(MHA_SIMD_DISPATCH)
    return mha_isa_names[mha_simd_cpu_isa()];
#else
    return "generic";
#endif
}

int mha_native_build(void)
{
#if defined(MHA_CY_NATIVE_BUILD) && MHA_CY_NATIVE_BUILD
    return 1;
#else
    return 0;
#endif
}

const char *mha_compiler_version(void)
{
#if defined(__clang__)
    return "clang " __clang_version__;
#elif defined(__GNUC__)
    return "gcc " __VERSION__;
#elif defined(_MSC_VER)
    return "msvc";
#else
    return "unknown";
#endif
}

const char *mha_build_flags(void)
{
#ifdef MHA_CY_BUILD_FLAGS
    return MHA_CY_BUILD_FLAGS;
#else
    return "";
#endif
}
