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
#if defined(MHA_CY_NATIVE_BUILD) && MHA_CY_NATIVE_BUILD
    return "native";            /* -march=native: no run-time dispatch */
#elif MHA_HAVE_CPU_SUPPORTS && defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
    /* The same predicates as the ifunc resolvers of attention_tile.c's target_clones. Needed
     * only before constructors ran (e.g. in an ifunc resolver), harmless otherwise. */
    __builtin_cpu_init();
    if (__builtin_cpu_supports("x86-64-v4"))
        return "avx512";
    if (__builtin_cpu_supports("x86-64-v3"))
        return "avx2";
    return "sse2";
#else
    return "generic";           /* no run-time dispatch with this compiler / architecture */
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
