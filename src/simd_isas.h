/* Compile a kernel body once per SIMD level (see simd_dispatch.h). Defines needed: MHA_IMPL,
 * the body's header name, and TYPE_SUFFIX (f32 / f64). The body names its functions
 * FN(name) = name SUFFIX: here SUFFIX is TYPE_SUFFIX followed by _avx512, _avx2 or _base, under
 * the matching gcc target (the body's static helpers too, so they inline at that level);
 * without dispatch the body is compiled once with SUFFIX = TYPE_SUFFIX. No include guard:
 * included once per type. */
#ifdef MHA_SIMD_DISPATCH
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
#define SUFFIX MHA_ISA_CAT(TYPE_SUFFIX, _avx512)
#include MHA_IMPL
#undef SUFFIX
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")
#define SUFFIX MHA_ISA_CAT(TYPE_SUFFIX, _avx2)
#include MHA_IMPL
#undef SUFFIX
#pragma GCC pop_options

#define SUFFIX MHA_ISA_CAT(TYPE_SUFFIX, _base)
#include MHA_IMPL
#undef SUFFIX
#else
#define SUFFIX TYPE_SUFFIX
#include MHA_IMPL
#undef SUFFIX
#endif
