/* The direct (decode) kernels' register blocks, shared by attention_microkernel_impl.h
 * (float32) and kv_format_impl.h (the stored formats): the P V panels' width, and the score
 * blocks, R query rows x KB keys of dot products, each a
 * vector of partial sums over the head dim, accumulated by MHA_BLOCK_STEP, then reduced all
 * at once. The reduction is written for 512-bit vectors, where a block of R rows x 16 / R
 * keys leaves 16 vectors v[0..15] of 16 lanes: MHA_REDUCE16_WITH gives the vector whose lane
 * i is the sum of v[i]'s lanes; one tree costs 15 pair steps of 2 shuffles and an add,
 * about 3 vector operations a score instead of a horizontal sum each. Each lane's sum has a
 * fixed order (within each 128-bit chunk first, then across the chunks), whatever the rows
 * and keys.
 *
 * Generic over the element type: T the vector type (16 floats or 16 int32), MT a vector of 16
 * int used for the shuffle masks. gcc lowers the float shuffles to vshufps / vshuff32x4; the
 * integer ones of the first step to vpermt2d (kv_int8_dot_impl.h writes those as vshufps). */

/* MHA_IN_REGISTER(x) keeps a vector x in a register from there on (an empty asm that gcc
 * cannot see through), where x fits one: at the AVX levels. Outside the include guard, so that
 * each SIMD level's inclusion of a kernel body (simd_isas.h, whose target pragma sets
 * __AVX__ or not) redefines it for that level. */
#undef MHA_IN_REGISTER
#if defined(__AVX__)
#define MHA_IN_REGISTER(x) __asm__("" : "+v"(x))
#else
#define MHA_IN_REGISTER(x) ((void)0)
#endif

#ifndef MHA_DECODE_BLOCKS_H
#define MHA_DECODE_BLOCKS_H

/* Vectors of sums a row in a P V panel of M rows (pv_panel_, kv_pv_panel_), at the SIMD level
 * being compiled: at least eight independent FMA chains (two FMA units of latency 4; with two
 * vectors a row, a one-row task had two); at AVX-512, whose 32 registers hold 16 sums, 16: a
 * broadcast of p, a loop step and the converted V vectors serve twice the FMAs. Zen 4, 1
 * thread, a 4-row group, D 128, 4096 keys, min of interleaved runs, 8 -> 16 sums: float16
 * 31.8 -> 28.4 ns a key in one run, 28.8 -> 28.4 in another; float32 2-3%; from DRAM
 * (decode_cache_*, 2 threads) within the noise. */
#define MHA_PV_PANEL_VECTORS(M)                                                              \
    (MHA_ISA_WIDE_BYTES == 64 ? ((M) <= 2 ? 8 : ((M) <= 4 ? 4 : 2))                          \
                              : ((M) == 1 ? 8 : ((M) == 2 ? 4 : 2)))

/* a[i * KB + u] += QV(i) * kv[u] for i < R, u < KB: one step over the head dim of a block,
 * QV(i) row i's vector of q (of type T), kv[u] key u's. Row i's vector is loaded once
 * (MHA_IN_REGISTER, above): gcc folded the load into each of the row's KB FMAs (Zen 4,
 * 8 rows x 2 keys: 18 loads per 16 FMAs instead of 10; 1 thread, 8 x 1 query over 2048 keys,
 * D 128: 58.3 -> 54.5 ns a key). */
#define MHA_BLOCK_STEP(T, R, KB, QV, kv, a)                                                  \
    do {                                                                                     \
        for (int i_ = 0; i_ < (R); i_++) {                                                   \
            T qv_ = QV(i_);                                                                  \
            MHA_IN_REGISTER(qv_);                                                            \
            for (int u_ = 0; u_ < (KB); u_++)                                                \
                (a)[i_ * (KB) + u_] += qv_ * (kv)[u_];                                       \
        }                                                                                    \
    } while (0)

/* per 128-bit chunk c: [a0 + a1, a2 + a3, b0 + b1, b2 + b3] of that chunk */
#define MHA_HADD16(MT, a, b)                                                                 \
    (__builtin_shuffle(a, b, (MT){0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30}) \
     + __builtin_shuffle(a, b, (MT){1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29,  \
                                    31}))

/* [a.c0 + a.c1, a.c2 + a.c3, b.c0 + b.c1, b.c2 + b.c3] of the 128-bit chunks */
#define MHA_HADD_CHUNKS(MT, a, b)                                                            \
    (__builtin_shuffle(a, b, (MT){0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}) \
     + __builtin_shuffle(a, b, (MT){4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,  \
                                    31}))

/* lane i = sum of the lanes of v[i], v an array of 16 vectors of type T; HADD(x, y) is the
 * first step's pair (MHA_HADD16 or an equivalent) */
#define MHA_REDUCE16_WITH(T, MT, HADD, v)                                                    \
    ({                                                                                       \
        T f_[4];                                                                             \
        for (int t_ = 0; t_ < 4; t_++)                                                       \
            f_[t_] = HADD(HADD(v[4 * t_], v[4 * t_ + 1]),                                    \
                          HADD(v[4 * t_ + 2], v[4 * t_ + 3]));                               \
        MHA_HADD_CHUNKS(MT, MHA_HADD_CHUNKS(MT, f_[0], f_[1]),                              \
                        MHA_HADD_CHUNKS(MT, f_[2], f_[3]));                                  \
    })

#endif
