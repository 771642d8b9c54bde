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

/* The SIMD levels of the run-time dispatch (simd_dispatch.h). */
enum { MHA_ISA_BASE = 0, MHA_ISA_AVX2 = 1, MHA_ISA_AVX512 = 2 };

/* The level every dispatching kernel runs: the best this CPU has (x86-64-v4: AVX-512
 * F/BW/CD/DQ/VL; x86-64-v3: AVX2, FMA, ...; else the baseline), lowered to the one the
 * environment variable MHA_CY_SIMD names ("avx512", "avx2", "sse2" or "portable"; unset,
 * "auto" or any other value: no limit). Read when the module is loaded (a constructor), so
 * every module, each with its own copy of this file, sees the same level. */
int mha_simd_isa(void);

/* The best level this CPU runs, whatever MHA_CY_SIMD says. */
int mha_simd_cpu_isa(void);

/* 1 when the int8 KV cache's decode kernel multiplies in integers (kv_int8_dot_impl.h): the
 * kernels run the AVX-512 level, the CPU has AVX512-VNNI, and the environment variable
 * MHA_CY_INT8_DOT is not "float" (which keeps the float products: tests of both paths).
 * mha_int8_dot_name: "vnni" or "float". Read at load time, as mha_simd_isa. */
int mha_int8_dot(void);
const char *mha_int8_dot_name(void);

/* The name of what runs: "avx512", "avx2", "sse2" (the x86-64 baseline) where the kernels
 * dispatch (gcc, x86-64), "native" for a -march=native build (no dispatch), "generic" for
 * other compilers / CPUs. mha_simd_cpu_level: the same for the best level of the CPU.
 * Static strings: never free them. */
const char *mha_simd_level(void);
const char *mha_simd_cpu_level(void);

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
