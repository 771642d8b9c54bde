/* Compile a kernel body once per SIMD level (see simd_dispatch.h). Defines needed: MHA_IMPL,
 * the body's header name, and TYPE_SUFFIX (f32 / f64). The body names its functions
 * FN(name) = name SUFFIX: here SUFFIX is TYPE_SUFFIX followed by _avx512, _avx2 or _base, under
 * the matching gcc target (the body's static helpers too, so they inline at that level);
 * without dispatch the body is compiled once with SUFFIX = TYPE_SUFFIX. MHA_ISA_WIDE_BYTES is the
 * width of the widest vectors a body should use at that level: 64 with AVX-512 (its 32
 * registers of 64 bytes), else 32 (gcc lowers a 32-byte GNU vector to two SSE registers at the
 * baseline). No include guard: included once per type. */
#ifdef MHA_SIMD_DISPATCH
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
#define SUFFIX MHA_ISA_CAT(TYPE_SUFFIX, _avx512)
#define MHA_ISA_WIDE_BYTES 64
#include MHA_IMPL
#undef MHA_ISA_WIDE_BYTES
#undef SUFFIX
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")
#define SUFFIX MHA_ISA_CAT(TYPE_SUFFIX, _avx2)
#define MHA_ISA_WIDE_BYTES 32
#include MHA_IMPL
#undef MHA_ISA_WIDE_BYTES
#undef SUFFIX
#pragma GCC pop_options

#define SUFFIX MHA_ISA_CAT(TYPE_SUFFIX, _base)
#define MHA_ISA_WIDE_BYTES 32
#include MHA_IMPL
#undef MHA_ISA_WIDE_BYTES
#undef SUFFIX
#else
#define SUFFIX TYPE_SUFFIX
#define MHA_ISA_WIDE_BYTES 32
#include MHA_IMPL
#undef MHA_ISA_WIDE_BYTES
#undef SUFFIX
#endif
