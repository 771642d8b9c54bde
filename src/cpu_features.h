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

/* The SIMD level at which the run-time dispatch (gcc target_clones, see
 * attention_tile.c) runs the kernels' C on this CPU: "avx512" (x86-64-v4:
 * AVX-512 F/BW/CD/DQ/VL), "avx2" (x86-64-v3: AVX2, FMA, ...), "sse2" (the
 * x86-64 baseline), "native" for a -march=native build (no dispatch), or
 * "generic" where there is no dispatch.  Static string: never free it. */
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
