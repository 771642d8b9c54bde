/* cpu_features.h -- what this build and this CPU can do.
 *
 * Plain C, no Python.  Compiled into every extension module of mha_cy (see
 * setup.py), with hidden visibility, so each module has its own private copy.
 */
#ifndef MHA_CY_CPU_FEATURES_H
#define MHA_CY_CPU_FEATURES_H

#ifdef __cplusplus
extern "C" {
#endif

/* The widest x86-64 SIMD level the run-time dispatch (gcc target_clones) will
 * pick on this CPU: "avx512f", "avx2" (AVX2 *and* FMA), "sse2" (the x86-64
 * baseline), or "generic" on other architectures / compilers without
 * __builtin_cpu_supports.  The string is static: never free it. */
const char *mha_simd_level(void);

/* 1 when built with MHA_CY_NATIVE=1 (-march=native, not portable), else 0. */
int mha_native_build(void);

/* Compiler identification (e.g. "gcc 12.2.0") and the extra flags setup.py
 * passed ("unknown" / "" when not recorded).  Static strings. */
const char *mha_compiler_version(void);
const char *mha_build_flags(void);

#ifdef __cplusplus
}
#endif

#endif /* MHA_CY_CPU_FEATURES_H */
