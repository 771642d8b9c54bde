/* cpu_features.c -- see cpu_features.h. */
#include "cpu_features.h"

#if (defined(__GNUC__) || defined(__clang__)) && \
    (defined(__x86_64__) || defined(__i386__))
#define MHA_HAVE_CPU_SUPPORTS 1
#else
#define MHA_HAVE_CPU_SUPPORTS 0
#endif

const char *mha_simd_level(void)
{
#if MHA_HAVE_CPU_SUPPORTS
    /* Needed only before constructors ran (e.g. in an ifunc resolver), harmless
     * otherwise. */
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f"))
        return "avx512f";
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return "avx2";
    if (__builtin_cpu_supports("sse2"))
        return "sse2";
#endif
    return "generic";
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
