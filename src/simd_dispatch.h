/* Run-time SIMD dispatch for the hot C loops: gcc compiles a function marked MHA_SIMD_CLONES once
 * per level (x86-64-v4: AVX-512, x86-64-v3: AVX2 + FMA, and the baseline) and an ifunc resolver
 * picks one at load time, so a wheel runs on any x86-64 CPU and still uses the wide vectors
 * where they exist. mha_simd_level() (cpu_features.c) reports the level picked. A native build
 * (-march=native) and other compilers get plain functions. */
#ifndef MHA_SIMD_DISPATCH_H
#define MHA_SIMD_DISPATCH_H

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(MHA_CY_NATIVE_BUILD)
#define MHA_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MHA_SIMD_CLONES
#endif

#endif
