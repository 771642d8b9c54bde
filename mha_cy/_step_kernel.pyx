"""A small call in one compiled call: projections, RoPE, the cache write (decode steps),
attention and the output projection, with no Python in between.

For a small model the general path (mha_cy/attention.py: one kernel call per stage, each with
its argument parsing, memoryview acquisitions and temporaries) cost about 60 us of a 64 us
decode step (E = 64, 4 heads, 16 cached tokens; the kernels themselves take a few), and most
of a tiny layer's self-attention. Here the stages are the same C functions, called on raw
pointers of arrays that the caller has checked.

It computes exactly what the general path computes, bit for bit, which is what makes it a
pure speed-up (tests/test_step_kernel.py checks it):
- the projections are src/small_gemm.c for up to MHA_SMALL_GEMM_MAX_ROWS rows, else
  src/row_panel_gemm.c, over all columns (the general path's column tiles call the same
  functions; each output is one chain of FMAs whatever the tile);
- RoPE is src/rope.c, a table per sequence's positions, as _rope_kernel computes row by row;
- attention reproduces _attention_kernel's tasks for the shape (a GQA group's heads as the
  rows of one task for a one-token step, else one task per query head; a pruned module's
  uneven groups as that kernel forms them from kv_index) and calls the same
  fused kernel with the same arguments; it declines (returns None) where that kernel would
  split the keys (split-K), take more than one block of query rows, run BLAS tiles or use
  threads, and wherever tuning knobs moved a rule.
Work that would not pay for threads (or with one thread asked) runs on the calling thread.
Above that (MAX_SERIAL_FLOPS) and up to MAX_TEAM_FLOPS, the stages run on a team of threads in
one parallel region, with a barrier between them: the projections in the general path's
column tiles (column_tile_grid), RoPE and the cache write on one thread, the attention tasks
shared dynamically. Every output is computed as on one thread, so the bits do not depend on
the team's size (tests/test_step_kernel_team.py). The general path's three kernel calls,
each a parallel region of its own, cost more: measured on Zen 2, 2 threads, the same
process, alternating rounds (team / general path, us): a MiniLM-size layer (E 384, 12 heads)
of 12 tokens 156 / 217, of 32 tokens 306 / 329, of 64 tokens 630 / 672; a BERT-base layer of
128 tokens 4513 / 4599; decode steps (batch 4, 32 / 8 heads, D 128, 2047 cached, d_model 256)
over a float16 cache 2832 / 3118, an int8 cache 2394 / 2725, a float32 one 5835 / 5958.

float16 and int8 caches (mha_cy/_cache_formats.py) take it too: the new keys and values are
encoded into the storage by src/kv_encode.c (which the general path's cache write also runs),
and each task reads the stored format as _attention_kernel's _stored_attend_task does: the
kv_format direct kernel for few rows, else converted key tiles through the fused kernel.
Measured (E = 64, 4 heads, 16 cached tokens, one decode step, 1 thread, CPU time, loaded
2-core Zen 1): float32 / float16 / int8 cache 14 / 15 / 15 us here; the general path took
120 / 230 us for float16 / int8 before (107 / 117 with its encode in C). A pruned module (the
same without head 0: K/V groups of 1 and 2 heads) took the general path before: step 110 ->
22 us, mha(x) of 16 tokens 80 -> 32 us (wall time, step including a truncate). Key padding
(mha(x, key_padding_mask=...)) is skipped at either end of each sequence's keys as
_attention_kernel's _task skips it: that layer's padded call 117 -> 36 us
(the general path / this, in alternating rounds; unpadded: 35 us). An attn_mask (additive, of
the module dtype, any broadcast shape and strides; attention.py makes a bool one additive as
the general path does) is read through its (B, H, Lq, Lk) strides as _task addresses it:
mha(x, attn_mask=...) of a tiny layer (E = 64, 4 heads, 16 tokens, 2 threads allowed, Zen 2)
65 -> 20 us.
"""
cimport numpy as cnp
from ._ndarray_checks cimport c_contiguous
from libc.math cimport INFINITY, sqrt
from libc.stdint cimport int64_t
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy, memset
from cython cimport floating
from cython.parallel cimport parallel, prange

import numpy as np

from . import _attention_kernel, _linear_kernel
from ._openmp_helpers cimport mha_omp_barrier, mha_omp_get_thread_num
from ._panels cimport pack_panel, panel_gemm_rows
from ._aligned cimport line_round, malloc_lines
from ._c_kernels cimport (MHA_SMALL_GEMM_MAX_ROWS, MHA_PANEL_ROWS_F32, MHA_PANEL_ROWS_F64,
                          mha_small_gemm_f32, mha_small_gemm_f64,
                          mha_row_panels_size_f32, mha_row_panels_size_f64,
                          mha_pack_row_panels_f32, mha_pack_row_panels_f64,
                          mha_row_panel_gemm_f32, mha_row_panel_gemm_f64, mha_rope_table_f32,
                          mha_rope_table_f64, mha_rope_rotate_f32, mha_rope_rotate_f64,
                          mha_finish_rows_f32, mha_finish_rows_f64, MHA_FUSED_MAX_HEAD_DIM,
                          MHA_FUSED_DIRECT_MAX_ROWS, MHA_FUSED_DIRECT_MIN_HEAD_DIM,
                          mha_fused_scratch_f32, mha_fused_scratch_f64, mha_fused_attend_f32,
                          mha_fused_attend_f64, mha_fused_attend_direct_f32,
                          mha_fused_attend_direct_f64, MHA_KV_F16, MHA_KV_I8,
                          mha_kv_direct_scratch, mha_kv_attend_f32, mha_kv_itemsize,
                          mha_kv_encode_f16_f32, mha_kv_encode_i8_f32)
from ._kernel_rules cimport (ATTN_BLOCK_Q, ATTN_BLOCK_K, PANEL_TILE_WEIGHT_BYTES,
                             LINEAR_MIN_TILE_FLOPS, LINEAR_MAX_TILES, column_tile_grid,
                             panel_group_rows, column_block_width, attention_flops,
                             direct_rows, largest_group, skip_end_padding, split_k_parts)

cnp.import_array()

# The general kernels' default rules for this shape (tile sizes, split-K, threads, panel
# blocks) come from _kernel_rules.pxd, as theirs do.
# Above this much work (all stages), or this much attention, the general path's threads pay
# for its overhead (its Python and separate kernel calls: ~50 us more than this call).
cdef double MAX_SERIAL_FLOPS = 2e6
cdef double MAX_SERIAL_ATTENTION_FLOPS = 2e6
# Above them, up to this much work, the call runs its stages on a team of threads in one
# parallel region (barriers between the stages) instead of the general path's separate calls;
# each thread gets at least MIN_TEAM_FLOPS_PER_THREAD. Past a few hundred MFLOP the two paths
# measured within 2% (E 768, 128 and 256 tokens: 1.02x, 1.01x); the bound keeps larger calls
# (long sequences in batches) on the general path, whose kernels are tuned for them.
cdef double MAX_TEAM_FLOPS = 1e9
cdef double MIN_TEAM_FLOPS_PER_THREAD = 1e6


def _set_max_team_flops(flops):
    """Set MAX_TEAM_FLOPS (tests and measurements: 0 sends every call above the serial bound
    to the general path); return the old value."""
    global MAX_TEAM_FLOPS
    previous = MAX_TEAM_FLOPS
    MAX_TEAM_FLOPS = flops
    return previous


cdef struct Step:
    Py_ssize_t batch, length, embed, n_in, heads, kv_heads, d, start, max_len, window
    bint cached               # append to the cache and attend over it (else over the call's
                              # own keys, start = 0)
    bint causal
    bint heads_as_rows
    Py_ssize_t half           # RoPE pairs per head (0: no RoPE)
    bint interleaved
    int kv_fmt                # the cache's storage: 0 (the module dtype), MHA_KV_F16, MHA_KV_I8
    Py_ssize_t block_k        # keys per tile of the general kernel (stored formats' tiles)
    # uneven groups (a pruned module), as _attention_kernel's Problem has them: query head h
    # reads K/V head kv_index[h]; K/V head g's query heads are [group_start[g],
    # group_start[g + 1]) (decode tasks). NULL: the even groups h // (heads / kv_heads).
    const Py_ssize_t *kv_index
    const Py_ssize_t *group_start
    Py_ssize_t max_group      # the most query heads of one K/V head
    const unsigned char *pad  # self-attention's key padding, (batch, length) flags; or NULL
    bint skip_padded          # the QKV projection skips padded keys' K/V rows (_linear_kernel)
    # self-attention's additive mask (attn_mask of the module dtype), or NULL; element
    # strides of its (B, H, Lq, Lk) axes, 0 where it broadcasts
    const void *mask
    Py_ssize_t mb, mh, ml, mk


cdef int _linear(const floating *x, Py_ssize_t m, Py_ssize_t k, const floating *w,
                 const floating *bias, floating *out, Py_ssize_t n,
                 const Py_ssize_t *row_off=NULL, Py_ssize_t kv_rows=-1,
                 Py_ssize_t kv_from=0) noexcept nogil:
    """out (m, n) = x (m, k) @ w (n, k)^T + bias, as _linear_kernel.linear computes it by
    default; 0, or -1 when out of memory. row_off: NULL, or where row i of x goes in out
    (element offsets, panels only); kv_rows >= 0: the columns from kv_from on only for the
    rows below it (panel_gemm_rows)."""
    cdef floating *packed
    if m <= MHA_SMALL_GEMM_MAX_ROWS:
        if floating is float:
            mha_small_gemm_f32(x, k, w, k, bias, out, n, m, n, k)
        else:
            mha_small_gemm_f64(x, k, w, k, bias, out, n, m, n, k)
        return 0
    if floating is float:
        packed = <floating *> malloc_lines(mha_row_panels_size_f32(m, k) * sizeof(floating))
    else:
        packed = <floating *> malloc_lines(mha_row_panels_size_f64(m, k) * sizeof(floating))
    if packed == NULL:
        return -1
    if floating is float:
        mha_pack_row_panels_f32(x, k, m, k, packed)
    else:
        mha_pack_row_panels_f64(x, k, m, k, packed)
    # row groups that stay in L2 with column blocks whose weight rows do too (as the general
    # path's tiles: PANEL_X_GROUP_BYTES, PANEL_TILE_WEIGHT_BYTES), whole register blocks wide
    # (column_block_width); the blocks do not change any output's sum
    cdef Py_ssize_t cols = column_block_width(PANEL_TILE_WEIGHT_BYTES // (k * sizeof(floating)), 1)
    cdef Py_ssize_t group = panel_group_rows(
        m, k, sizeof(floating), MHA_PANEL_ROWS_F32 if floating is float else MHA_PANEL_ROWS_F64)
    cdef Py_ssize_t r0 = 0, j0
    while r0 < m:
        j0 = 0
        while j0 < n:
            panel_gemm_rows(r0, min(group, m - r0), j0, min(n, j0 + cols), packed, k, w, k,
                            bias, out, n, row_off, kv_rows, kv_from)
            j0 += cols
        r0 += group
    free(packed)
    return 0


cdef inline bint _direct_rows(Py_ssize_t rows, Py_ssize_t d) noexcept nogil:
    """Whether a task of `rows` rows runs the fused kernel's direct variant (the general
    kernel's default rule)."""
    return direct_rows(rows, d, MHA_FUSED_DIRECT_MAX_ROWS, MHA_FUSED_DIRECT_MIN_HEAD_DIM)


cdef bint _any_tile_task(const Step *s) noexcept nogil:
    """Whether some task of the step does not take the direct kernel (a stored format's
    tasks then need converted key and value tiles)."""
    cdef Py_ssize_t g
    if not s.heads_as_rows:
        return not _direct_rows(s.length, s.d)
    if s.group_start == NULL:
        return not _direct_rows(s.max_group, s.d)
    for g in range(s.kv_heads):
        if not _direct_rows(s.group_start[g + 1] - s.group_start[g], s.d):
            return True
    return False


cdef inline void _store(int kv_fmt, const floating *src, void *cache, float *scales,
                        Py_ssize_t dst, Py_ssize_t d) noexcept nogil:
    """One new key or value row (d values at src) into the cache at element dst, in the
    cache's format: src/kv_encode.c encodes as mha_cy._cache_formats does (int8: its scale
    at position dst // d of scales)."""
    if floating is float:
        if kv_fmt == MHA_KV_F16:
            mha_kv_encode_f16_f32(src, d, <unsigned short *> cache + dst)
            return
        if kv_fmt == MHA_KV_I8:
            mha_kv_encode_i8_f32(src, d, <signed char *> cache + dst, scales + dst // d)
            return
    memcpy(<floating *> cache + dst, src, d * sizeof(floating))


cdef void _rope_and_store(const Step *s, const int64_t *starts, floating *qkv, floating *cos,
                          floating *sin, int64_t *positions, const double *inv_freq,
                          void *cache_k, void *cache_v, float *k_scale,
                          float *v_scale) noexcept nogil:
    """RoPE on the query and key heads at positions start .., then (cached) append the new
    keys and values."""
    cdef Py_ssize_t b, h, i, start, kv_off, row, d = s.d
    cdef Py_ssize_t seq = s.length * s.n_in          # one sequence's rows of qkv
    cdef Py_ssize_t kh = s.max_len * d, kb = s.kv_heads * kh
    if s.half > 0:
        for b in range(s.batch):
            if b == 0 or starts != NULL:      # one table per sequence when they differ
                start = s.start if starts == NULL else starts[b]
                for i in range(s.length):
                    positions[i] = start + i
                if floating is float:
                    mha_rope_table_f32(positions, s.length, inv_freq, s.half, cos, sin)
                else:
                    mha_rope_table_f64(positions, s.length, inv_freq, s.half, cos, sin)
            if floating is float:
                mha_rope_rotate_f32(qkv + b * seq, s.length, s.n_in, s.heads + s.kv_heads, d,
                                    cos, sin, s.half, s.interleaved)
            else:
                mha_rope_rotate_f64(qkv + b * seq, s.length, s.n_in, s.heads + s.kv_heads, d,
                                    cos, sin, s.half, s.interleaved)
    for b in range(s.batch if s.cached else 0):
        start = s.start if starts == NULL else starts[b]
        for h in range(s.kv_heads):
            for i in range(s.length):
                kv_off = b * kb + h * kh + (start + i) * d
                row = b * seq + i * s.n_in + (s.heads + h) * d
                _store(s.kv_fmt, qkv + row, cache_k, k_scale, kv_off, d)
                _store(s.kv_fmt, qkv + row + s.kv_heads * d, cache_v, v_scale, kv_off, d)


cdef void _attend_task(const Step *s, Py_ssize_t t, const int64_t *starts,
                       const floating *qkv, floating *ctx, const void *cache_k,
                       const void *cache_v, const float *k_scale, const float *v_scale,
                       floating scale, floating *scratch) noexcept nogil:
    """Attention task t, as _attention_kernel runs it (causal offset = start: a sequence's
    last row sees all of its k_len = start + L keys), into ctx. scratch: the task's acc, row
    max, row sum, work and conv (_task_scratch_size elements)."""
    cdef Py_ssize_t d = s.d, n_q = s.heads * d, group = s.heads // s.kv_heads
    cdef Py_ssize_t task_rows = s.max_group if s.heads_as_rows else s.length
    cdef floating *acc = scratch
    cdef floating *row_max = acc + task_rows * d
    cdef floating *row_sum = row_max + task_rows
    cdef floating *work = row_sum + task_rows
    cdef floating *conv = work + _work_size(s, floating is double)
    cdef Py_ssize_t b, g, h0, r, start, k_len, limit, k_begin, k_end, step, kv_off
    cdef Py_ssize_t rows_t = task_rows
    cdef Py_ssize_t q_rs = d if s.heads_as_rows else s.n_in
    cdef Py_ssize_t o_rs = d if s.heads_as_rows else n_q
    if task_rows == 1:
        q_rs, o_rs = d, d
    cdef const unsigned char *pad_row = NULL
    cdef const floating *m0 = NULL
    cdef Py_ssize_t m_rs = 0
    cdef Py_ssize_t kv_isz = mha_kv_itemsize(s.kv_fmt)     # a stored element's bytes
    cdef Py_ssize_t seq = s.length * s.n_in          # one sequence's rows of qkv
    # where K/V head g of sequence b starts, and the stride of its keys
    cdef Py_ssize_t kh = s.max_len * d, kb = s.kv_heads * kh, kl = d
    cdef const floating *k0 = NULL
    cdef const floating *v0 = NULL
    if not s.cached:                                  # the call's own keys, in qkv
        kh, kb, kl = d, seq, s.n_in
    if s.heads_as_rows:
        b, g = t // s.kv_heads, t % s.kv_heads
        h0 = g * group
        if s.group_start != NULL:
            h0 = s.group_start[g]
            rows_t = s.group_start[g + 1] - h0
    else:
        b, h0 = t // s.heads, t % s.heads
        g = h0 // group if s.kv_index == NULL else s.kv_index[h0]
    start = s.start if starts == NULL else starts[b]
    k_len, limit, k_begin = start + s.length, start + 1, 0
    step = 0 if s.heads_as_rows else 1
    if s.causal and s.window > 0:
        k_begin = min(k_len, max(<Py_ssize_t> 0, start + 1 - s.window))
    k_end = k_len
    if s.pad != NULL:         # padded keys at either end are skipped, as _task skips them
        pad_row = s.pad + b * s.length
        skip_end_padding(pad_row, &k_begin, &k_end)
    if not s.causal:
        limit, step = k_end, 0
    if s.mask != NULL:        # the mask rows of the task's rows, as _task addresses them
        m0 = <const floating *> s.mask + b * s.mb + h0 * s.mh
        m_rs = s.mh if s.heads_as_rows else s.ml
    if s.cached:
        if s.kv_fmt == 0:
            k0 = <const floating *> cache_k + b * kb + g * kh
            v0 = <const floating *> cache_v + b * kb + g * kh
    else:
        k0 = qkv + b * seq + (s.heads + g) * d
        v0 = qkv + b * seq + (s.heads + s.kv_heads + g) * d
    cdef const floating *q0 = qkv + b * seq + h0 * d
    cdef floating *o0 = ctx + b * s.length * n_q + h0 * d
    memset(acc, 0, rows_t * d * sizeof(floating))
    for r in range(rows_t):
        row_max[r] = -INFINITY
        row_sum[r] = 0
    if s.kv_fmt != 0:
        if floating is float:             # (stored formats: float32 modules only)
            kv_off = b * kb + g * kh
            # as _attention_kernel's _stored_attend_task runs it without masks or split-K
            mha_kv_attend_f32(s.kv_fmt, _direct_rows(rows_t, d), q0, q_rs, <int> rows_t,
                              <int> d, <const char *> cache_k + kv_off * kv_isz, d,
                              k_scale + kv_off // d if k_scale != NULL else NULL,
                              <const char *> cache_v + kv_off * kv_isz, d,
                              v_scale + kv_off // d if v_scale != NULL else NULL, <int> d,
                              k_begin, k_end, scale, NULL, 0, 0, pad_row, limit, step,
                              s.window, row_max, row_sum, acc, work, conv, s.block_k)
    elif _direct_rows(rows_t, d):
        if floating is float:
            mha_fused_attend_direct_f32(q0, q_rs, <int> rows_t, <int> d,
                                        k0, kl, v0, kl, <int> d, k_begin,
                                        k_end, scale, m0, m_rs, s.mk, pad_row, limit, step,
                                        s.window, row_max, row_sum, acc, work)
        else:
            mha_fused_attend_direct_f64(q0, q_rs, <int> rows_t, <int> d,
                                        k0, kl, v0, kl, <int> d, k_begin,
                                        k_end, scale, m0, m_rs, s.mk, pad_row, limit, step,
                                        s.window, row_max, row_sum, acc, work)
    else:
        if floating is float:
            mha_fused_attend_f32(q0, q_rs, <int> rows_t, <int> d,
                                 k0, kl, v0, kl, <int> d, k_begin, k_end, scale, m0, m_rs,
                                 s.mk, pad_row, limit, step, s.window, row_max, row_sum, acc,
                                 work)
        else:
            mha_fused_attend_f64(q0, q_rs, <int> rows_t, <int> d,
                                 k0, kl, v0, kl, <int> d, k_begin, k_end, scale, m0, m_rs,
                                 s.mk, pad_row, limit, step, s.window, row_max, row_sum, acc,
                                 work)
    if floating is float:
        mha_finish_rows_f32(acc, row_sum, <int> rows_t, <int> d, o0, o_rs)
    else:
        mha_finish_rows_f64(acc, row_sum, <int> rows_t, <int> d, o0, o_rs)


cdef inline Py_ssize_t _work_size(const Step *s, bint is_double) noexcept nogil:
    """Elements of the fused (or stored-format direct) kernel's work buffer."""
    if is_double:
        return mha_fused_scratch_f64(<int> s.d, <int> s.d)
    cdef Py_ssize_t size = mha_fused_scratch_f32(<int> s.d, <int> s.d)
    if s.kv_fmt != 0:
        size = max(size, mha_kv_direct_scratch())
    return size


cdef Py_ssize_t _task_scratch_size(const Step *s, bint is_double) noexcept nogil:
    """Elements of one thread's task scratch (_attend_task), rounded up to whole cache lines
    so that the threads' blocks share none."""
    cdef Py_ssize_t task_rows = s.max_group if s.heads_as_rows else s.length
    cdef Py_ssize_t work = _work_size(s, is_double)
    # a stored format's converted key and value tiles, where the tasks take them
    cdef Py_ssize_t conv = 2 * s.block_k * s.d if s.kv_fmt != 0 and _any_tile_task(s) else 0
    cdef Py_ssize_t size = task_rows * (s.d + 2) + work + conv
    return line_round(size, sizeof(double) if is_double else sizeof(float))


cdef inline void _project_tile(Py_ssize_t t, Py_ssize_t col_tiles, Py_ssize_t tile_rows,
                               Py_ssize_t tile_cols, const floating *x, Py_ssize_t m,
                               Py_ssize_t k, const floating *w, const floating *bias,
                               floating *out, Py_ssize_t n, const floating *packed,
                               const Py_ssize_t *row_off=NULL, Py_ssize_t kv_rows=-1,
                               Py_ssize_t kv_from=0) noexcept nogil:
    """Tile t (row-major order) of out (m, n) = x (m, k) @ w (n, k)^T + bias, as
    _linear_kernel cuts it: small_gemm for up to MHA_SMALL_GEMM_MAX_ROWS rows (packed NULL,
    one row tile), else from the packed panels of x (tile_rows: whole panels), skipping as
    _linear does; each output is the same chain of FMAs whatever the tile."""
    cdef Py_ssize_t r0 = (t // col_tiles) * tile_rows, c0 = (t % col_tiles) * tile_cols
    cdef Py_ssize_t c1 = min(n, c0 + tile_cols), rows = min(tile_rows, m - r0)
    if packed == NULL:
        if floating is float:
            mha_small_gemm_f32(x, k, w + c0 * k, k, NULL if bias == NULL else bias + c0,
                               out + c0, n, m, c1 - c0, k)
        else:
            mha_small_gemm_f64(x, k, w + c0 * k, k, NULL if bias == NULL else bias + c0,
                               out + c0, n, m, c1 - c0, k)
    else:
        panel_gemm_rows(r0, rows, c0, c1, packed, k, w, k, bias, out, n, row_off, kv_rows,
                        kv_from)


# How many token rows' K/V the last small call's QKV projection skipped (tests: that the
# compiled path skips padded keys' K/V rows, which changes no output bit; racy across threads).
cdef Py_ssize_t last_skipped_rows = 0


def _last_skipped_rows():
    return last_skipped_rows


cdef Py_ssize_t _unpadded_first(const unsigned char *pad, Py_ssize_t rows, Py_ssize_t pr,
                                Py_ssize_t n, Py_ssize_t *row_off) noexcept nogil:
    """row_off[j] = n * (the j-th row in the order: unpadded rows, then padded ones, each in
    order); returns the rows to compute K/V for: the unpadded ones, up to whole panels of pr."""
    cdef Py_ssize_t i, j = 0, valid
    for i in range(rows):
        if not pad[i]:
            row_off[j] = i * n
            j += 1
    valid = j
    for i in range(rows):
        if pad[i]:
            row_off[j] = i * n
            j += 1
    return min(rows, (valid + pr - 1) // pr * pr)


cdef int _run(const Step *s, const int64_t *starts, const floating *x, const floating *w_in,
              const floating *b_in, const floating *w_out, const floating *b_out,
              void *cache_k, void *cache_v, float *k_scale, float *v_scale,
              const double *inv_freq, floating scale, floating *out, int team) noexcept nogil:
    """The step on raw pointers, on `team` threads; 0, or -1 when out of memory (nothing
    written then). starts: each sequence's cached length (a ragged cache), or NULL: all at
    s.start. cache_k, cache_v: the storage in the format s.kv_fmt (int8: with k_scale,
    v_scale)."""
    cdef Py_ssize_t rows = s.batch * s.length, n_q = s.heads * s.d
    # each section a whole number of cache lines (the buffer starts on one: every section
    # does, and the attention kernel reads its q, k, v rows in whole vectors)
    cdef Py_ssize_t qkv_size = line_round(rows * s.n_in, sizeof(floating))
    cdef Py_ssize_t ctx_size = line_round(rows * n_q, sizeof(floating))
    cdef Py_ssize_t rope_size = 2 * line_round(s.length * s.half, sizeof(floating))
    cdef Py_ssize_t task_size = _task_scratch_size(s, floating is double)
    # the team's projections pack x (and then ctx) into panels shared by its tiles; one
    # thread packs inside _linear
    cdef Py_ssize_t packed_size = 0
    if team > 1:
        if floating is float:
            packed_size = max(mha_row_panels_size_f32(rows, s.embed),
                              mha_row_panels_size_f32(rows, n_q))
        else:
            packed_size = max(mha_row_panels_size_f64(rows, s.embed),
                              mha_row_panels_size_f64(rows, n_q))
    packed_size = line_round(packed_size, sizeof(floating))
    cdef floating *buf = <floating *> malloc_lines(
        (qkv_size + ctx_size + rope_size + packed_size + team * task_size) * sizeof(floating))
    cdef int64_t *positions = <int64_t *> malloc((s.length + 1) * sizeof(int64_t))
    if buf == NULL or positions == NULL:
        free(buf)
        free(positions)
        return -1
    cdef floating *qkv = buf
    cdef floating *ctx = qkv + qkv_size
    cdef floating *cos = ctx + ctx_size
    cdef floating *sin = cos + rope_size // 2
    cdef floating *packed = cos + rope_size
    # whole lines each: the threads' task blocks share no cache line
    cdef floating *tasks = packed + packed_size
    cdef Py_ssize_t n_tasks = s.batch * (s.kv_heads if s.heads_as_rows else s.heads)
    cdef Py_ssize_t t, p, tid
    cdef int status = 0
    cdef Py_ssize_t in_rows, out_rows, in_cols, out_cols, in_tiles, out_tiles
    cdef Py_ssize_t in_cols_n, out_cols_n
    # the projections' row panels of x (and then ctx); 0: small_gemm reads them in place
    cdef Py_ssize_t pr = MHA_PANEL_ROWS_F32 if floating is float else MHA_PANEL_ROWS_F64
    cdef Py_ssize_t n_panels = 0 if rows <= MHA_SMALL_GEMM_MAX_ROWS else (rows + pr - 1) // pr
    # The rows of padded keys: x is packed with them last (xg), each row written back to its
    # place (row_off), and their K/V columns get 0 instead of products (every other value
    # keeps its bits). Without the memory, every row is computed.
    global last_skipped_rows
    cdef Py_ssize_t *row_off = NULL
    cdef floating *xg = NULL
    cdef const floating *x_in = x
    cdef Py_ssize_t kv_rows = -1, i
    last_skipped_rows = 0
    if s.pad != NULL and s.skip_padded and not s.cached and rows > MHA_SMALL_GEMM_MAX_ROWS:
        row_off = <Py_ssize_t *> malloc(rows * sizeof(Py_ssize_t))
        xg = <floating *> malloc(rows * s.embed * sizeof(floating))
        if row_off != NULL and xg != NULL:
            kv_rows = _unpadded_first(s.pad, rows, pr, s.n_in, row_off)
        if kv_rows < 0 or kv_rows == rows:       # nothing to skip (or no memory)
            free(row_off)
            free(xg)
            row_off, xg, kv_rows = NULL, NULL, -1
        else:
            last_skipped_rows = rows - kv_rows
            for i in range(rows):
                memcpy(xg + i * s.embed, x + (row_off[i] // s.n_in) * s.embed,
                       s.embed * sizeof(floating))
                if i >= kv_rows:
                    memset(qkv + row_off[i] + n_q, 0, (s.n_in - n_q) * sizeof(floating))
            x_in = xg
    if team == 1:
        status = _linear(x_in, rows, s.embed, w_in, b_in, qkv, s.n_in, row_off, kv_rows, n_q)
        if status == 0:
            _rope_and_store(s, starts, qkv, cos, sin, positions, inv_freq, cache_k, cache_v,
                            k_scale, v_scale)
            for t in range(n_tasks):
                _attend_task(s, t, starts, qkv, ctx, cache_k, cache_v, k_scale, v_scale,
                             scale, tasks)
            status = _linear(ctx, rows, n_q, w_out, b_out, out, s.embed)
    else:
        # the general path's tiles (_linear_kernel), each stage after a barrier
        column_tile_grid(rows, s.n_in, s.embed, sizeof(floating), pr if n_panels else 0,
                         LINEAR_MIN_TILE_FLOPS, LINEAR_MAX_TILES, &in_rows, &in_cols)
        column_tile_grid(rows, s.embed, n_q, sizeof(floating), pr if n_panels else 0,
                         LINEAR_MIN_TILE_FLOPS, LINEAR_MAX_TILES, &out_rows, &out_cols)
        in_cols_n = (s.n_in + in_cols - 1) // in_cols
        out_cols_n = (s.embed + out_cols - 1) // out_cols
        in_tiles = (rows + in_rows - 1) // in_rows * in_cols_n
        out_tiles = (rows + out_rows - 1) // out_rows * out_cols_n
        with nogil, parallel(num_threads=team):
            tid = mha_omp_get_thread_num()
            for p in prange(n_panels, schedule='static'):
                pack_panel(p, pr, x_in, s.embed, rows, s.embed, packed)
            mha_omp_barrier()
            for t in prange(in_tiles, schedule='dynamic'):
                _project_tile(t, in_cols_n, in_rows, in_cols, x, rows, s.embed, w_in, b_in, qkv,
                              s.n_in, packed if n_panels else NULL, row_off, kv_rows, n_q)
            mha_omp_barrier()
            if tid == 0:
                _rope_and_store(s, starts, qkv, cos, sin, positions, inv_freq, cache_k,
                                cache_v, k_scale, v_scale)
            mha_omp_barrier()
            for t in prange(n_tasks, schedule='dynamic'):
                _attend_task(s, t, starts, qkv, ctx, cache_k, cache_v, k_scale, v_scale,
                             scale, tasks + tid * task_size)
            mha_omp_barrier()
            for p in prange(n_panels, schedule='static'):
                pack_panel(p, pr, ctx, n_q, rows, n_q, packed)
            mha_omp_barrier()
            for t in prange(out_tiles, schedule='dynamic'):
                _project_tile(t, out_cols_n, out_rows, out_cols, ctx, rows, n_q, w_out, b_out,
                              out, s.embed, packed if n_panels else NULL)
    free(buf)
    free(positions)
    free(row_off)
    free(xg)
    return status


cdef inline bint _writeable(object a) noexcept:
    """a (an ndarray) may be written: the step stores the new keys/values through raw
    pointers, which would ignore a cleared WRITEABLE flag (or fault on read-only memory)."""
    return cnp.PyArray_ISWRITEABLE(<cnp.ndarray> a)


cdef inline Py_ssize_t _shape_0(object a) noexcept:
    return cnp.PyArray_DIMS(<cnp.ndarray> a)[0]


cdef inline bint _shape_1d(object a, Py_ssize_t n) noexcept:
    """a (an ndarray) has shape (n,)."""
    return cnp.PyArray_NDIM(<cnp.ndarray> a) == 1 and _shape_0(a) == n


cdef inline bint _shape_2d(object a, Py_ssize_t n0, Py_ssize_t n1) noexcept:
    """a (an ndarray) has shape (n0, n1)."""
    return (cnp.PyArray_NDIM(<cnp.ndarray> a) == 2 and _shape_0(a) == n0
            and cnp.PyArray_DIMS(<cnp.ndarray> a)[1] == n1)


cdef inline void *_data(object a) noexcept:
    return NULL if a is None else cnp.PyArray_DATA(<cnp.ndarray> a)


def decode_step(cnp.ndarray x, object start, object cache_k, object cache_v,
                object k_scale, object v_scale, object w_in, object b_in, object w_out,
                object b_out, Py_ssize_t heads, Py_ssize_t kv_heads, object kv_index,
                Py_ssize_t window, object inv_freq, bint interleaved, int n_threads):
    """The step's output (B, L, E), having appended the L new keys/values of each sequence to
    the cache at position start; or None, changing nothing, when this shape is not this
    kernel's (the caller then takes the general path). start: an int (every sequence's
    cached length) or an int64 (B,) array of them (a ragged cache).

    Expected (anything else returns None): x (B, L, E) of the module dtype, L >= 1; cache_k,
    cache_v (B, kv_heads, max_len, D) of that dtype, or float16 / int8 (a float32 module's
    cache in that format: mha_cy._cache_formats; int8 with its k_scale, v_scale (B,
    kv_heads, max_len) float32, else None), with start + L <= max_len (an overflow too
    goes to the general path, which raises it); w_in (heads * D + 2 * kv_heads * D, E)
    (in_proj_weight), w_out (E, heads * D); biases None or 1-D; inv_freq None (no RoPE) or
    float64 (pairs <= D / 2,); all C-contiguous. The caller has checked: window 0 (none) or >= 1; kv_index None
    (even groups) or the module's intp (heads,) K/V head of each query head (a pruned
    module's uneven groups)."""
    cdef const int64_t *starts = NULL
    cdef Py_ssize_t max_start
    if isinstance(start, int):
        max_start = start
    else:
        if not (c_contiguous(start, cnp.NPY_INT64)
                and cnp.PyArray_SIZE(<cnp.ndarray> start) == x.shape[0]):
            return None
        starts = <const int64_t *> cnp.PyArray_DATA(<cnp.ndarray> start)
        max_start = max(start)
    cdef int typenum = cnp.PyArray_TYPE(x), stored, kv_fmt = 0
    if not isinstance(cache_k, cnp.ndarray):
        return None
    stored = cnp.PyArray_TYPE(<cnp.ndarray> cache_k)
    if stored != typenum:                 # a float16 / int8 cache of a float32 module
        if typenum != cnp.NPY_FLOAT32:
            return None
        if stored == cnp.NPY_FLOAT16:
            kv_fmt = MHA_KV_F16
        elif stored == cnp.NPY_INT8:
            kv_fmt = MHA_KV_I8
        else:
            return None
    if not (c_contiguous(cache_k, stored) and c_contiguous(cache_v, stored)
            and _writeable(cache_k) and _writeable(cache_v)):
        return None                       # (a read-only cache: the general path raises)
    cdef cnp.npy_intp *cshape = cnp.PyArray_DIMS(<cnp.ndarray> cache_k)
    cdef cnp.npy_intp *vshape = cnp.PyArray_DIMS(<cnp.ndarray> cache_v)
    # the cache's geometry (the module's fast path leaves it to this check)
    if not (cnp.PyArray_NDIM(x) == 3 and cnp.PyArray_NDIM(<cnp.ndarray> cache_k) == 4
            and cnp.PyArray_NDIM(<cnp.ndarray> cache_v) == 4
            and cshape[0] == vshape[0] == x.shape[0] and cshape[1] == vshape[1] == kv_heads
            and cshape[2] == vshape[2] and cshape[3] == vshape[3]
            and x.shape[0] >= 1 and x.shape[1] >= 1 and max_start + x.shape[1] <= cshape[2]):
        return None
    cdef Py_ssize_t positions = cshape[0] * cshape[1] * cshape[2]
    if kv_fmt == MHA_KV_I8:
        if not (c_contiguous(k_scale, cnp.NPY_FLOAT32)
                and c_contiguous(v_scale, cnp.NPY_FLOAT32)
                and cnp.PyArray_SIZE(<cnp.ndarray> k_scale) == positions
                and cnp.PyArray_SIZE(<cnp.ndarray> v_scale) == positions
                and _writeable(k_scale) and _writeable(v_scale)):
            return None
    else:
        k_scale = v_scale = None
    return _call(x, True, True, max_start, starts, cache_k, cache_v, kv_fmt, k_scale, v_scale,
                 cshape[3], cshape[2], w_in, b_in, w_out, b_out, heads, kv_heads, kv_index,
                 window, inv_freq, interleaved, n_threads)


cdef bint _mask_strides(object mask, int typenum, Py_ssize_t batch, Py_ssize_t heads,
                        Py_ssize_t length, Py_ssize_t *strides) noexcept:
    """Whether mask is an aligned native array of that type, (L, L), (B, L, L) or (B, H, L, L)
    with each axis that size or 1 (as check_attn_mask accepts them); if so, strides gets the
    element strides of its (B, H, Lq, Lk) axes, 0 where it broadcasts (as np.broadcast_to)."""
    if not (isinstance(mask, cnp.ndarray) and cnp.PyArray_TYPE(<cnp.ndarray> mask) == typenum
            and cnp.PyArray_ISALIGNED(<cnp.ndarray> mask)
            and cnp.PyArray_ISNOTSWAPPED(<cnp.ndarray> mask)):
        return False
    cdef int ndim = cnp.PyArray_NDIM(<cnp.ndarray> mask), axis, a
    if ndim < 2 or ndim > 4:
        return False
    cdef Py_ssize_t full[4]
    full[0], full[1], full[2], full[3] = batch, heads, length, length
    cdef Py_ssize_t item = cnp.PyArray_ITEMSIZE(<cnp.ndarray> mask), n, st
    for axis in range(4):
        strides[axis] = 0
    for a in range(ndim):        # the mask's axes, right-aligned; a 3-D one has no H axis
        axis = 4 - ndim + a if ndim != 3 or a > 0 else 0
        n = cnp.PyArray_DIMS(<cnp.ndarray> mask)[a]
        st = cnp.PyArray_STRIDES(<cnp.ndarray> mask)[a]
        if (n != 1 and n != full[axis]) or st % item != 0:
            return False
        strides[axis] = 0 if n == 1 else st // item
    return True


def self_attention(cnp.ndarray x, bint causal, object key_padding, object attn_mask,
                   object w_in, object b_in, object w_out, object b_out, Py_ssize_t heads,
                   Py_ssize_t kv_heads, object kv_index, Py_ssize_t head_dim, Py_ssize_t window,
                   object inv_freq, bint interleaved, int n_threads):
    """mha(x) (or mha(x, is_causal=True), with or without key_padding_mask= and attn_mask=)
    of a small call, or None where this kernel does not apply. x (B, L, E) of the module
    dtype, L >= 1; key_padding None or a C-contiguous bool (B, L) array (True = padding);
    attn_mask None or an additive mask of x's dtype, any strides, shaped as _mask_strides
    takes it; weights as for decode_step; window only with causal; RoPE at positions
    0 .. L - 1."""
    if key_padding is not None and not (
            c_contiguous(key_padding, cnp.NPY_BOOL) and cnp.PyArray_NDIM(x) == 3
            and _shape_2d(key_padding, x.shape[0], x.shape[1])):
        return None
    cdef Py_ssize_t mask_strides[4]
    if attn_mask is not None and not (
            cnp.PyArray_NDIM(x) == 3
            and _mask_strides(attn_mask, cnp.PyArray_TYPE(x), x.shape[0], heads, x.shape[1],
                              mask_strides)):
        return None
    return _call(x, False, causal, 0, NULL, None, None, 0, None, None, head_dim, 0, w_in, b_in,
                 w_out, b_out, heads, kv_heads, kv_index, window if causal else 0, inv_freq,
                 interleaved, n_threads, key_padding, attn_mask, mask_strides)


cdef object _call(cnp.ndarray x, bint cached, bint causal, Py_ssize_t max_start,
                  const int64_t *starts, object cache_k, object cache_v, int kv_fmt,
                  object k_scale, object v_scale, Py_ssize_t d, Py_ssize_t max_len,
                  object w_in, object b_in, object w_out, object b_out,
                  Py_ssize_t heads, Py_ssize_t kv_heads, object kv_index, Py_ssize_t window,
                  object inv_freq, bint interleaved, int n_threads, object key_padding=None,
                  object attn_mask=None, const Py_ssize_t *mask_strides=NULL):
    if not (_attention_kernel.default_rules and _linear_kernel.default_rules):
        return None                          # tuning knobs moved a rule of the general path
    cdef int typenum = cnp.PyArray_TYPE(x)
    if typenum != cnp.NPY_FLOAT32 and typenum != cnp.NPY_FLOAT64:
        return None
    if not (c_contiguous(x, typenum) and c_contiguous(w_in, typenum)
            and c_contiguous(w_out, typenum)
            and (b_in is None or c_contiguous(b_in, typenum))
            and (b_out is None or c_contiguous(b_out, typenum))
            and (inv_freq is None or c_contiguous(inv_freq, cnp.NPY_FLOAT64))
            and cnp.PyArray_NDIM(x) == 3):
        return None
    # the shapes the raw-pointer loops rely on: a mismatch takes the general path, which
    # names it
    cdef Py_ssize_t n_in = (heads + 2 * kv_heads) * d, embed = x.shape[2]
    if not (_shape_2d(w_in, n_in, embed) and _shape_2d(w_out, embed, heads * d)
            and (b_in is None or _shape_1d(b_in, n_in))
            and (b_out is None or _shape_1d(b_out, embed))
            and (inv_freq is None or 2 * _shape_0(inv_freq) <= d)):
        return None
    cdef Step s
    s.batch, s.length, s.embed = x.shape[0], x.shape[1], embed
    s.heads, s.kv_heads, s.d = heads, kv_heads, d
    s.n_in, s.start, s.max_len, s.window = n_in, max_start, max_len, window
    s.cached, s.causal = cached, causal
    s.half = 0 if inv_freq is None else _shape_0(inv_freq)
    s.interleaved = interleaved
    s.kv_fmt = kv_fmt
    s.pad = <const unsigned char *> _data(key_padding)
    s.skip_padded = _linear_kernel.row_skip
    s.mask = _data(attn_mask)
    s.mb = s.mh = s.ml = s.mk = 0
    if attn_mask is not None:
        s.mb, s.mh, s.ml, s.mk = mask_strides[0], mask_strides[1], mask_strides[2], mask_strides[3]
    cdef Py_ssize_t rows = s.batch * s.length, k_len = max_start + s.length   # the longest
    cdef Py_ssize_t group = heads // kv_heads
    # uneven groups: the general kernel's tasks for them (_attention_kernel._group_starts)
    cdef const Py_ssize_t[::1] kv_view
    cdef const Py_ssize_t[::1] starts_view
    s.kv_index = s.group_start = NULL
    s.max_group = group
    if kv_index is not None:
        if not c_contiguous(kv_index, cnp.NPY_INTP):
            return None
        group_starts = _attention_kernel._group_starts(kv_index, heads, kv_heads)
        kv_view = kv_index
        s.kv_index = &kv_view[0]
        s.max_group = 1
        if group_starts is not None:
            starts_view = group_starts
            s.group_start = &starts_view[0]
            s.max_group = largest_group(s.group_start, kv_heads)
    s.heads_as_rows = s.length == 1 and s.max_group > 1
    if d > MHA_FUSED_MAX_HEAD_DIM or d < 1 or s.length > ATTN_BLOCK_Q or s.embed < 1:
        return None
    # where _attention_kernel would split the keys of few tasks
    cdef Py_ssize_t n_tasks = s.batch * (kv_heads if s.heads_as_rows else heads)
    cdef Py_ssize_t bk = min(<Py_ssize_t> ATTN_BLOCK_K, k_len)
    s.block_k = bk
    if split_k_parts(n_tasks, k_len, window, s.heads_as_rows, bk) > 1:
        return None
    cdef double attn_flops = attention_flops(s.batch, heads, s.length, k_len, d, d, causal,
                                             window)
    cdef double flops = attn_flops + 2.0 * rows * s.embed * (s.n_in + heads * d)
    cdef int team = 1
    if n_threads > 1 and (flops > MAX_SERIAL_FLOPS
                          or attn_flops >= MAX_SERIAL_ATTENTION_FLOPS):
        if flops > MAX_TEAM_FLOPS:
            return None
        team = <int> min(<double> n_threads, max(2.0, flops / MIN_TEAM_FLOPS_PER_THREAD))
    cdef cnp.ndarray out = cnp.PyArray_EMPTY(3, cnp.PyArray_DIMS(x), typenum, 0)
    cdef int status
    cdef void *px = cnp.PyArray_DATA(x)
    cdef void *pwi = _data(w_in)
    cdef void *pbi = _data(b_in)
    cdef void *pwo = _data(w_out)
    cdef void *pbo = _data(b_out)
    cdef void *pk = _data(cache_k)
    cdef void *pv = _data(cache_v)
    cdef float *pks = <float *> _data(k_scale)
    cdef float *pvs = <float *> _data(v_scale)
    cdef const double *pf = <const double *> _data(inv_freq)
    cdef void *po = cnp.PyArray_DATA(out)
    cdef double scale = 1.0 / sqrt(<double> d)
    if typenum == cnp.NPY_FLOAT32:
        with nogil:
            status = _run(&s, starts, <const float *> px, <const float *> pwi,
                          <const float *> pbi, <const float *> pwo, <const float *> pbo,
                          pk, pv, pks, pvs, pf, <float> scale, <float *> po, team)
    else:
        with nogil:
            status = _run(&s, starts, <const double *> px, <const double *> pwi,
                          <const double *> pbi, <const double *> pwo, <const double *> pbo,
                          pk, pv, NULL, NULL, pf, scale, <double *> po, team)
    if status != 0:
        raise MemoryError("mha_cy: could not allocate a small call's scratch")
    return out
