/* Run-time SIMD dispatch for the hot C loops. With gcc on x86-64 (not -march=native), a kernel
 * .c compiles its body once per SIMD level (simd_isas.h: x86-64-v4 = AVX-512, x86-64-v3 = AVX2
 * + FMA, and the baseline), and each public function calls the copy of the level
 * mha_simd_isa() (cpu_features.c) picks: the best this CPU runs, or the lower one that
 * MHA_CY_SIMD asks for. So a wheel runs on any x86-64 CPU, still uses the wide vectors where
 * they exist, and one variable forces every kernel onto one path (tests of each path).
 * gcc's target_clones would pick per function by itself, at load time, with no way to override
 * it. A native build and other compilers or CPUs compile the body once, without suffix. */
#ifndef MHA_SIMD_DISPATCH_H
#define MHA_SIMD_DISPATCH_H

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(MHA_CY_NATIVE_BUILD)
#define MHA_SIMD_DISPATCH 1
#endif

#define MHA_ISA_CAT_(a, b) a##b
#define MHA_ISA_CAT(a, b) MHA_ISA_CAT_(a, b)

#ifdef MHA_SIMD_DISPATCH
#include "cpu_features.h"

/* The body of a void public function NAME: call NAME_avx512 / NAME_avx2 / NAME_base (ARGS: the
 * parenthesized arguments). */
#define MHA_SIMD_CALL(name, args)                                                            \
    switch (mha_simd_isa()) {                                                                \
    case MHA_ISA_AVX512: name##_avx512 args; break;                                          \
    case MHA_ISA_AVX2: name##_avx2 args; break;                                              \
    default: name##_base args; break;                                                        \
    }
#endif

#endif
