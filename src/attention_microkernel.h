/* Fused attention tile kernel: one task's online-softmax attention without BLAS.
 *
 * The BLAS path (mha_cy/_attention_kernel.pyx) computes a 256 x 256 score tile with one sgemm,
 * writes it to memory, softmaxes it row by row and multiplies it into V with a second sgemm.
 * For short sequences the calls' fixed cost (packing, dispatch) and the round trips of S
 * through L2 dominate, and the speed depends on the OpenBLAS kernel picked at run time. Here a
 * tile of keys (128 float32 / 64 float64, or half that where a causal limit or a window cuts
 * the tile: attention_microkernel_impl.h's NK) is packed transposed (D x keys) once and
 * reused by every row of the task; blocks of 6 query rows (12 at AVX-512, whose 32 vector
 * registers hold them: attention_microkernel_impl.h's RB) get their scores from FMAs over the
 * packed tile (vectorized over keys), the masks and the online softmax of attention_tile.c
 * (the same function as the BLAS path: the same mask and NaN semantics), and acc += P V with p_j
 * broadcast against the contiguous rows of V; a block's scores live in a rows x keys L1 buffer.
 * 6 rows x 16 keys = 12 ymm accumulators (no spills on AVX2) against 8 with blocks of 4 rows
 * measured (Zen 1, float32, SDPA, same run, 1 / 2 threads), blocks of 4 -> 6 rows:
 *   (1, 8, 4096, 64) causal          20.4 -> 26.0 / 41.0 -> 49.9 GFLOP/s
 *   (8, 12, 512, 64) padding mask    20.6 -> 25.7 / 40.5 -> 50.9 GFLOP/s
 *
 * Crossover (the rule: _use_fused in _attention_kernel.pyx, fused up to head dims of
 * MHA_FUSED_MAX_HEAD_DIM). Measured on AMD EPYC (Zen 1, AVX2 clone, OpenBLAS 0.3.30 Haswell
 * kernel), 1 thread, float32, SDPA time in ms, fused / BLAS; the BLAS path here ran with the
 * same vectorized softmax as the fused one, so the numbers compare the products only:
 *   self-attention (1, H, L, D)      D=16        D=64         D=128        D=256
 *     H=64 L=64                   1.5 / 2.9   4.4 / 8.9   11.8 / 11.0   21.5 / 30.2
 *     H=16 L=256                  9.3 / 11.2  21.4 / 33.3  37.4 / 66.3   70.3 / 175
 *     H=2  L=1024                14.2 / 21.9  47.7 / 82.0  69.4 / 128    135 / 348
 *   decode, Lk = 2048, (4, 32, 1, D), KV heads 8 (4 rows a task) / 1 (32 rows):
 *     4 rows                                  10.9 / 14.8  24.7 / 34.6   55.2 / 62.9
 *     32 rows                                  4.5 / 9.4   11.2 / 16.3   22.9 / 41.2
 *   beyond D = 256 BLAS wins: (1, 4, 256, D) D=384 28.6 / 22.4, D=512 36.5 / 29.1; decode
 *     4 rows D=384 8.1 / 8.2, D=512 9.3 / 7.4 (the packed tile, D x 256 bytes, leaves L1).
 * The number of rows did not move the crossover (256-row tasks gain the most); the one loss
 * below D = 256 (L = 64, D = 128: 7%, reproduced) is not worth a rule of its own. (Before the
 * build had -fno-trapping-math, the softmax's exp stayed scalar on AVX2 and the fused kernel
 * was 1.5-2.8x faster than BLAS at every D <= 256.) Not measured: AVX-512 machines.
 *
 * Direct variant (mha_fused_attend_direct_*, no packed keys; the rule: _fused_attend in
 * _attention_kernel.pyx, tasks of <= MHA_FUSED_DIRECT_MAX_ROWS rows with D >=
 * MHA_FUSED_DIRECT_MIN_HEAD_DIM, or of one row). Measured on the same Zen 1, 1 thread,
 * float32, decode (2, 8 * rows, 1, D) over (2, 8, 2048, D) (one task per KV head, `rows`
 * rows), ms, packed (blocks of 6 rows) / direct, same run, machine shared:
 *   rows      D=8        D=16       D=24       D=32       D=48       D=64       D=128      D=256
 *     1    0.64/0.58       -      1.18/0.82  1.32/0.92  2.30/1.84  2.99/2.54  5.89/4.27      -
 *     2        -           -          -          -          -      2.82/2.15  6.71/5.69      -
 *     4    1.45/1.74  1.11/1.24  2.18/2.14  2.15/1.65  2.69/1.99  3.61/2.41  8.24/4.43  20.2/13.3
 *     8    2.62/3.27  1.78/2.26  3.64/3.94  2.85/2.89  5.48/5.25  4.80/4.29  11.2/7.49  25.1/18.5
 *    16        -      3.04/4.24      -          -          -      7.42/7.90  14.8/13.5  33.4/28.8
 * Below D = 32 the direct kernel's reduction (one per 8 scores, over d / 8 vectors) costs more
 * than packing saves, except for one row; at 16 rows the two are even (the direct kernel reads
 * the tile once per block of 4 rows; score blocks of up to 8 rows x 1 key measured no better
 * for 5..8 rows). SDPA, 2 threads, before (packed, blocks of 4 rows) -> now, ms (GB/s of K+V):
 *   (4, 32, 1, 128) over (4, 8, 2048, 128)      8.02 (8.4) -> 5.24 (12.8)
 *   (1, 32, 1, 128) over (1, 8, 8192, 128)      8.20 (8.2) -> 4.75 (14.1)
 *   (1, 8, 1, 128) over (1, 1, 32768, 128)      5.81 (5.8) -> 4.00 (8.4)   (split-K)
 * The read roof (~24 GB/s) is not reached: the kernel is compute bound (as fast from L2:
 * ~136 ns of CPU per key per 4-row task); the FMAs of the scores take one load each (10 per
 * 8 FMAs: gcc folds the q loads into them) and Zen 1 loads one 256-bit vector per cycle.
 * P V keeps 8 / rows column vectors of sums per row (8 independent FMA chains): with 2 per
 * row a one-row task had 2 chains in flight. Zen 3 (family 25), 1 thread, keys in L2, min
 * ns per key, before -> after: float16 cache 1 row 27-34 -> 17-24, int8 1-2 rows ~12% less;
 * float32 within the noise. Tasks of 8 rows as one block (8 rows x 1 key per score block)
 * measured no faster than two blocks of 4 beyond L3 and were not kept; they made gcc drop
 * the prefetches (a prefetch helper it did not inline has no side effect), hence the
 * always_inline on those helpers. With AVX-512's 32 registers, 8 rows are one block of
 * 8 rows x 2 keys (16 sums): attention_microkernel_impl.h's DRB, with its figures.
 */
#ifndef MHA_ATTENTION_MICROKERNEL_H
#define MHA_ATTENTION_MICROKERNEL_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Head dims (D and Dv) up to which the fused kernel beats BLAS (above: see the crossover). */
#define MHA_FUSED_MAX_HEAD_DIM 256

/* Scratch (in elements) that mha_fused_attend_* needs for head dimensions d (keys) and dv
 * (values). */
ptrdiff_t mha_fused_scratch_f32(int d, int dv);
ptrdiff_t mha_fused_scratch_f64(int d, int dv);

/* Online-softmax attention of `rows` query rows to the keys [k_begin, k_end).
 * q          row r at q + r * q_rs, d values
 * k, v       key j at k + j * k_rs (d values), its value at v + j * v_rs (dv values)
 * add        additive mask, key j of row r at add[r * add_rs + j * add_ks]; or NULL
 * pad        key padding flags, pad[j] nonzero = ignore key j; or NULL
 * limit      row r sees only keys j < limit + r * limit_step (the causal limit; a limit
 *            >= k_end and step 0 when not causal)
 * window     > 0: row r sees only keys j >= limit + r * limit_step - window too (the sliding
 *            window); 0: no window. Row blocks whose windows all miss a tile skip it.
 * m, l, acc  running max, sum and output accumulator (rows x dv, row stride dv) of each row,
 *            as in mha_online_softmax_row_*: start at -inf, 0, 0; finish with acc / l
 * work       mha_fused_scratch_*(d, dv) elements, from a cache line (64 bytes)
 * The order of every sum depends only on the shapes (deterministic for any thread count). */
void mha_fused_attend_f32(const float *q, ptrdiff_t q_rs, int rows, int d,
                          const float *k, ptrdiff_t k_rs, const float *v, ptrdiff_t v_rs, int dv,
                          ptrdiff_t k_begin, ptrdiff_t k_end, float scale,
                          const float *add, ptrdiff_t add_rs, ptrdiff_t add_ks,
                          const unsigned char *pad, ptrdiff_t limit, ptrdiff_t limit_step,
                          ptrdiff_t window,
                          float *m, float *l, float *acc, float *work);
void mha_fused_attend_f64(const double *q, ptrdiff_t q_rs, int rows, int d,
                          const double *k, ptrdiff_t k_rs, const double *v, ptrdiff_t v_rs,
                          int dv, ptrdiff_t k_begin, ptrdiff_t k_end, double scale,
                          const double *add, ptrdiff_t add_rs, ptrdiff_t add_ks,
                          const unsigned char *pad, ptrdiff_t limit, ptrdiff_t limit_step,
                          ptrdiff_t window,
                          double *m, double *l, double *acc, double *work);

/* The same without packing the keys (the direct kernel): for tasks of few rows (decode),
 * where packing each key tile costs more than the scores it serves. Same arguments; work:
 * mha_fused_scratch_*(d, dv) elements too. Used for tasks of at most MHA_FUSED_DIRECT_MAX_ROWS
 * rows (see the crossover above). */
#define MHA_FUSED_DIRECT_MAX_ROWS 8
#define MHA_FUSED_DIRECT_MIN_HEAD_DIM 32   /* (tasks of one row: any head dim) */
/* How many keys ahead the decode kernels prefetch K and V rows into L2; at most a tile (64
 * float32 / 32 float64 keys). The measurements are at attention_microkernel_impl.h's
 * prefetch_row_. kv_format.h's kernels go as many bytes ahead as 16 float32 keys of head dim
 * 128, so more of their narrower keys (kv_prefetch_keys_ in kv_format_impl.h). */
#define MHA_DECODE_PREFETCH_KEYS 16
void mha_fused_attend_direct_f32(const float *q, ptrdiff_t q_rs, int rows, int d,
                                 const float *k, ptrdiff_t k_rs, const float *v, ptrdiff_t v_rs,
                                 int dv, ptrdiff_t k_begin, ptrdiff_t k_end, float scale,
                                 const float *add, ptrdiff_t add_rs, ptrdiff_t add_ks,
                                 const unsigned char *pad, ptrdiff_t limit, ptrdiff_t limit_step,
                                 ptrdiff_t window,
                                 float *m, float *l, float *acc, float *work);
void mha_fused_attend_direct_f64(const double *q, ptrdiff_t q_rs, int rows, int d,
                                 const double *k, ptrdiff_t k_rs, const double *v,
                                 ptrdiff_t v_rs, int dv, ptrdiff_t k_begin, ptrdiff_t k_end,
                                 double scale, const double *add, ptrdiff_t add_rs,
                                 ptrdiff_t add_ks, const unsigned char *pad, ptrdiff_t limit,
                                 ptrdiff_t limit_step, ptrdiff_t window, double *m, double *l,
                                 double *acc, double *work);

#ifdef __cplusplus
}
#endif

#endif
