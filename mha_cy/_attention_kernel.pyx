"""Fused scaled dot-product attention over all (batch, head) pairs, nogil and OpenMP-parallel.

For each head: out = softmax(scale * Q K^T + mask) V, with Q (Lq, D), K (Lk, D), V (Lk, Dv).
Operands are strided 4-D views (B, H, L, D) whose last axis is contiguous, so the heads of one
fused QKV projection (B*L, (Hq + 2 Hkv) * D) are read in place and each head writes its own
columns of the context (B*L, Hq * Dv): the concatenation of the heads costs nothing.

Work is cut into tasks, shared dynamically by the threads (causal tasks differ in size):
- normal: one task = one block of BLOCK_Q query rows of one (batch, query head);
- decode (Lq == 1 with grouped K/V): one task = one (batch, KV head), its rows the query heads
  of the group, so the shared K/V head is streamed once for all of them (uneven groups of a
  pruned module too: kv_index).
A task walks K/V in tiles of BLOCK_K keys: S = scale * Q K^T (BLAS), then per row the masks and
the online softmax (src/attention_tile.c), then acc += P V (BLAS). Only one S tile per thread
exists at a time: extra memory is O(threads * BLOCK_Q * BLOCK_K), not O(Lq * Lk).
Where it is faster (_use_fused), the fused tile kernel of src/attention_microkernel.c does the
same work without BLAS: scores, masks, softmax and P V per small tile in registers and L1.
With fewer than ATTN_MIN_PARALLEL_TASKS tasks (one sequence decoding with one K/V head, say), each
task's keys are split into parts that run in parallel, and their partial softmax states are
merged afterwards (split-K), so that every core streams a share of the cache.
With weights requested, the rows of the (B, H, Lq, Lk) weights array serve as the score
buffer instead and the softmax is done exactly over whole rows.

Tasks address rows generically: row r of a task is (head h0 + r*dh, query i0 + r*di), so
one pointer and one row stride per operand describe both kinds of task to BLAS.
"""
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy, memset
from libc.limits cimport INT_MAX
from libc.math cimport INFINITY, exp, signbit, sqrt
from cython cimport floating
from cython.parallel cimport parallel, prange

import numpy as np
cimport numpy as cnp
from ._ndarray_checks cimport c_contiguous

cnp.import_array()

from ._aligned cimport malloc_lines
from ._cython_blas cimport _gemm, NoTrans, Trans
from ._c_kernels cimport (mha_online_softmax_row_f32, mha_online_softmax_row_f64,
                          mha_softmax_row_f32, mha_softmax_row_f64, mha_finish_rows_f32,
                          mha_finish_rows_f64, MHA_FUSED_MAX_HEAD_DIM, MHA_FUSED_DIRECT_MAX_ROWS,
                          MHA_FUSED_DIRECT_MIN_HEAD_DIM, mha_fused_scratch_f32,
                          mha_fused_scratch_f64, mha_fused_attend_f32, mha_fused_attend_f64,
                          mha_fused_attend_direct_f32, mha_fused_attend_direct_f64,
                          MHA_KV_F16, MHA_KV_I8, mha_kv_direct_scratch,
                          mha_kv_attend_f32, mha_kv_itemsize, mha_kv_load_f16_f32,
                          mha_kv_load_i8_f32)
from ._kernel_rules cimport (ATTN_BLOCK_Q, ATTN_BLOCK_K, ATTN_MIN_FLOPS_PER_THREAD,
                             attention_flops, direct_rows, largest_group,
                             skip_end_padding, split_k_parts)

# The thread and split-K rules and their constants (ATTN_MIN_FLOPS_PER_THREAD,
# ATTN_MIN_PARALLEL_TASKS) are in _kernel_rules.pxd, shared with _step_kernel.

# Query rows per task and keys per score tile (defaults in _kernel_rules.pxd); changed only
# by _set_tile_sizes, for tuning and for the tests that results do not depend on them.
cdef Py_ssize_t BLOCK_Q = ATTN_BLOCK_Q
cdef Py_ssize_t BLOCK_K = ATTN_BLOCK_K

# Which tile kernel the online path runs: the rule of _use_fused, or one forced by
# _set_tile_kernel (for the tests and for measuring the crossover).
cdef enum TileKernel:
    TILE_AUTO, TILE_FUSED, TILE_BLAS
cdef TileKernel TILE_KERNEL = TILE_AUTO
_TILE_KERNEL_NAMES = {"auto": TILE_AUTO, "fused": TILE_FUSED, "blas": TILE_BLAS}
# Tasks of at most FUSED_DIRECT_ROWS rows run the fused kernel's direct variant (no packed
# keys, see attention_microkernel.h) when they have one row or head dims of at least
# FUSED_DIRECT_MIN_D; changed only by _set_fused_direct (tests, measurements).
cdef Py_ssize_t FUSED_DIRECT_ROWS = MHA_FUSED_DIRECT_MAX_ROWS
cdef Py_ssize_t FUSED_DIRECT_MIN_D = MHA_FUSED_DIRECT_MIN_HEAD_DIM


cdef struct Problem:
    Py_ssize_t batch, q_heads, kv_heads, group, q_len, k_len, d, dv
    # element strides of the (B, H, L) axes of each operand (the last axis is contiguous)
    Py_ssize_t qb, qh, ql, kb, kh, kl, vb, vh, vl, ob, oh, ol, wb, wh, wl
    # additive mask strides, (B, H, Lq, Lk) axes, 0 where broadcast; key padding row stride
    Py_ssize_t mb, mh, ml, mk, pb
    const unsigned char *pad      # key padding (B, Lk), nonzero = ignore the key; or NULL
    bint causal
    Py_ssize_t causal_offset      # Lk - Lq: query i sees keys j <= i + causal_offset
    Py_ssize_t window             # > 0 (causal only): and keys j > i + causal_offset - window
    # ragged batches (a cache whose sequences have different lengths), or NULL: sequence b
    # has q_lens[b] query rows (rows past it are left alone), k_lens[b] keys and its own
    # causal offset offsets[b]
    const Py_ssize_t *q_lens
    const Py_ssize_t *k_lens
    const Py_ssize_t *offsets
    bint heads_as_rows            # decode tasks (see module docstring)
    Py_ssize_t block_q, block_k   # query rows per normal task, keys per score tile
    Py_ssize_t q_blocks           # query blocks per (batch, head) in normal tasks
    # Uneven groups (a pruned GQA module): query head h reads K/V head kv_index[h], and K/V
    # head g's query heads are [group_start[g], group_start[g + 1]) (decode tasks). NULL:
    # the even groups of GQA, h // group (no lookup on the common path).
    const Py_ssize_t *kv_index
    const Py_ssize_t *group_start
    # K/V stored as float16 or int8 (a KV cache of that dtype, see _stored_attend_task):
    # kv_fmt MHA_KV_F16 / MHA_KV_I8, 0 for K/V of the compute dtype. k_raw, v_raw: the
    # storage (element strides kb.. / vb.. as above, in stored elements); k_scale, v_scale:
    # int8 only, (B, Hkv, Lk) float32 with strides sb, sh and contiguous keys
    int kv_fmt
    const void *k_raw
    const void *v_raw
    const float *k_scale
    const float *v_scale
    Py_ssize_t sb, sh


cdef struct Task:
    Py_ssize_t b, h0, i0, rows, dh, di, kv_head
    Py_ssize_t k_begin, k_end     # the keys any row of the task may see: [k_begin, k_end)
    # element offsets of the task's first row in each operand (mask: -1 when there is none)
    Py_ssize_t q_off, k_off, v_off, o_off, w_off, m_off, pad_off
    # element strides from one row of the task to the next (BLAS leading dimensions)
    Py_ssize_t q_rs, o_rs, w_rs, m_rs


cdef inline Py_ssize_t _offset(const Problem *p, Py_ssize_t b) noexcept nogil:
    """The causal offset of sequence b: its query i sees keys j <= i + offset."""
    return p.causal_offset if p.offsets == NULL else p.offsets[b]


cdef inline void _task(const Problem *p, Py_ssize_t t, Task *task) noexcept nogil:
    """Which rows task t covers, where they are, and which keys they may look at."""
    cdef Py_ssize_t rem, last_i, k_len, offset
    cdef const unsigned char *pad_row
    if p.heads_as_rows:
        task.b = t // p.kv_heads
        task.kv_head = t % p.kv_heads
        if p.group_start == NULL:
            task.h0 = task.kv_head * p.group
            task.rows = p.group
        else:
            task.h0 = p.group_start[task.kv_head]
            task.rows = p.group_start[task.kv_head + 1] - task.h0
        task.i0 = 0
        task.dh = 1
        task.di = 0
    else:
        task.b = t // (p.q_heads * p.q_blocks)
        rem = t % (p.q_heads * p.q_blocks)
        task.h0 = rem // p.q_blocks
        # causal: a head's last query blocks see the most keys; handing them out first leaves
        # the short tasks to even out the threads at the end (the order changes no bit)
        task.i0 = ((p.q_blocks - 1 - rem % p.q_blocks if p.causal else rem % p.q_blocks)
                   * p.block_q)
        task.rows = min(p.block_q, p.q_len - task.i0)
        task.dh = 0
        task.di = 1
        task.kv_head = task.h0 // p.group if p.kv_index == NULL else p.kv_index[task.h0]
    k_len = p.k_len
    if p.q_lens != NULL:      # a ragged batch: this sequence's rows and keys only
        if p.heads_as_rows:   # (rows are heads of its one query)
            task.rows = task.rows if p.q_lens[task.b] > 0 else 0
        else:
            task.rows = max(<Py_ssize_t> 0, min(task.rows, p.q_lens[task.b] - task.i0))
        k_len = p.k_lens[task.b]
    task.k_begin, task.k_end = 0, k_len
    if p.causal:
        offset = _offset(p, task.b)
        last_i = task.i0 + (task.rows - 1) * task.di
        task.k_end = max(<Py_ssize_t> 0, min(k_len, last_i + offset + 1))
        if p.window > 0:      # keys before the first row's window: skipped, never read
            task.k_begin = min(task.k_end, max(<Py_ssize_t> 0, task.i0 + offset + 1 - p.window))
    if task.rows == 0:
        task.k_begin = task.k_end = 0
    if p.pad != NULL:     # padded keys at either end (right- or left-padded batches): skip them
        pad_row = p.pad + task.b * p.pb
        skip_end_padding(pad_row, &task.k_begin, &task.k_end)

    task.q_off = task.b * p.qb + task.h0 * p.qh + task.i0 * p.ql
    task.k_off = task.b * p.kb + task.kv_head * p.kh
    task.v_off = task.b * p.vb + task.kv_head * p.vh
    task.o_off = task.b * p.ob + task.h0 * p.oh + task.i0 * p.ol
    task.w_off = task.b * p.wb + task.h0 * p.wh + task.i0 * p.wl
    task.m_off = task.b * p.mb + task.h0 * p.mh + task.i0 * p.ml
    task.pad_off = task.b * p.pb
    task.q_rs = task.dh * p.qh + task.di * p.ql
    task.o_rs = task.dh * p.oh + task.di * p.ol
    task.w_rs = task.dh * p.wh + task.di * p.wl
    task.m_rs = task.dh * p.mh + task.di * p.ml
    if task.rows == 1:   # BLAS wants leading dimensions >= the row length, even for one row
        task.q_rs, task.o_rs, task.w_rs = p.d, p.dv, p.k_len


cdef inline Py_ssize_t _n_valid(const Problem *p, const Task *task, Py_ssize_t r,
                                Py_ssize_t j0, Py_ssize_t n) noexcept nogil:
    """Keys of the tile starting at key j0 that row r may see (the causal limit)."""
    if not p.causal:
        return n
    return max(<Py_ssize_t> 0,
               min(n, task.i0 + r * task.di + _offset(p, task.b) + 1 - j0))


cdef inline Py_ssize_t _n_skip(const Problem *p, const Task *task, Py_ssize_t r,
                               Py_ssize_t j0, Py_ssize_t n) noexcept nogil:
    """Keys at the start of the tile at j0 before row r's sliding window (0 without one)."""
    if p.window <= 0:
        return 0
    return max(<Py_ssize_t> 0,
               min(n, task.i0 + r * task.di + _offset(p, task.b) + 1 - p.window - j0))


cdef inline void _row_softmax_online(floating *s, Py_ssize_t n, const floating *add,
                                     Py_ssize_t add_stride, const unsigned char *pad,
                                     Py_ssize_t n_skip, Py_ssize_t n_valid, floating *m,
                                     floating *l, floating *acc, Py_ssize_t dv) noexcept nogil:
    if floating is float:
        mha_online_softmax_row_f32(s, <int> n, add, add_stride, pad, <int> n_skip,
                                   <int> n_valid, m, l, acc, <int> dv)
    else:
        mha_online_softmax_row_f64(s, <int> n, add, add_stride, pad, <int> n_skip,
                                   <int> n_valid, m, l, acc, <int> dv)


cdef inline void _row_softmax(floating *s, Py_ssize_t n, const floating *add,
                              Py_ssize_t add_stride, const unsigned char *pad,
                              Py_ssize_t n_skip, Py_ssize_t n_valid) noexcept nogil:
    if floating is float:
        mha_softmax_row_f32(s, <int> n, add, add_stride, pad, <int> n_skip, <int> n_valid)
    else:
        mha_softmax_row_f64(s, <int> n, add, add_stride, pad, <int> n_skip, <int> n_valid)


cdef inline void _rows_finish(const floating *acc, const floating *l, Py_ssize_t rows,
                              Py_ssize_t dv, floating *out, Py_ssize_t out_rs) noexcept nogil:
    """out row r (out_rs apart) := acc row r (dv apart) / l[r], for rows rows."""
    if floating is float:
        mha_finish_rows_f32(acc, l, <int> rows, <int> dv, out, out_rs)
    else:
        mha_finish_rows_f64(acc, l, <int> rows, <int> dv, out, out_rs)


cdef bint _all_finite(const floating *x, Py_ssize_t rows, Py_ssize_t n,
                      Py_ssize_t rs) noexcept nogil:
    """Whether rows x n values (row stride rs) are all finite."""
    cdef Py_ssize_t r, j
    cdef int bad = 0
    for r in range(rows):
        for j in range(n):      # (an integer OR: vectorizes, unlike a float reduction)
            bad |= not (x[r * rs + j] - x[r * rs + j] == 0)    # NaN for inf and NaN
    return not bad


cdef void _pv_exact(const floating *p, Py_ssize_t p_rs, Py_ssize_t rows, Py_ssize_t n,
                    const floating *v, Py_ssize_t v_rs, floating *acc, Py_ssize_t acc_rs,
                    Py_ssize_t dv) noexcept nogil:
    """acc += P V skipping the hidden keys (probability -0.0, src/attention_tile.h): their V
    is never read, so a NaN or inf there cannot reach a row through 0 * NaN. The slow path of
    the BLAS P V products, taken only when those come out non-finite."""
    cdef Py_ssize_t r, j, e
    cdef floating x
    for r in range(rows):
        for j in range(n):
            x = p[r * p_rs + j]
            if x == 0 and signbit(x):
                continue
            for e in range(dv):
                acc[r * acc_rs + e] += x * v[j * v_rs + e]


cdef inline Py_ssize_t _fused_scratch(const Problem *p, bint fused, floating dummy) noexcept nogil:
    """Elements of the fused kernel's scratch (0 when it does not run)."""
    if not fused:
        return 0
    if floating is float:
        return mha_fused_scratch_f32(<int> p.d, <int> p.dv)
    else:
        return mha_fused_scratch_f64(<int> p.d, <int> p.dv)


cdef inline void _causal_limit(const Problem *p, const Task *task, Py_ssize_t k_end,
                               Py_ssize_t *limit, Py_ssize_t *step) noexcept nogil:
    """The fused kernels' causal limit (that of _n_valid): row r of the task sees keys
    j < limit + r * step (and, with a window, j >= limit + r * step - window); not causal:
    k_end, step 0."""
    limit[0], step[0] = k_end, 0
    if p.causal:
        limit[0], step[0] = task.i0 + _offset(p, task.b) + 1, task.di


cdef inline void _fused_attend(const Problem *p, const Task *task, floating scale,
                               const floating *q0, const floating *k0, const floating *v0,
                               const floating *m0, const unsigned char *pad_row,
                               Py_ssize_t k_begin, Py_ssize_t k_end, floating *acc,
                               floating *row_max, floating *row_sum,
                               floating *work) noexcept nogil:
    """The keys [k_begin, k_end) of the task's rows with the fused tile kernel."""
    cdef Py_ssize_t limit, step
    _causal_limit(p, task, k_end, &limit, &step)
    # a rule of the shapes: thread-count invariant
    if direct_rows(task.rows, p.d, FUSED_DIRECT_ROWS, FUSED_DIRECT_MIN_D):
        if floating is float:
            mha_fused_attend_direct_f32(q0, task.q_rs, <int> task.rows, <int> p.d, k0, p.kl,
                                        v0, p.vl, <int> p.dv, k_begin, k_end, scale, m0,
                                        task.m_rs, p.mk, pad_row, limit, step, p.window,
                                        row_max, row_sum, acc, work)
        else:
            mha_fused_attend_direct_f64(q0, task.q_rs, <int> task.rows, <int> p.d, k0, p.kl,
                                        v0, p.vl, <int> p.dv, k_begin, k_end, scale, m0,
                                        task.m_rs, p.mk, pad_row, limit, step, p.window,
                                        row_max, row_sum, acc, work)
        return
    if floating is float:
        mha_fused_attend_f32(q0, task.q_rs, <int> task.rows, <int> p.d, k0, p.kl, v0, p.vl,
                             <int> p.dv, k_begin, k_end, scale, m0, task.m_rs, p.mk, pad_row,
                             limit, step, p.window, row_max, row_sum, acc, work)
    else:
        mha_fused_attend_f64(q0, task.q_rs, <int> task.rows, <int> p.d, k0, p.kl, v0, p.vl,
                             <int> p.dv, k_begin, k_end, scale, m0, task.m_rs, p.mk, pad_row,
                             limit, step, p.window, row_max, row_sum, acc, work)


cdef inline void _start_part(const Problem *p, Py_ssize_t t, Py_ssize_t n_parts, Task *task,
                             floating *acc, floating *row_max, floating *row_sum) noexcept nogil:
    """The prologue of _attend_task and _stored_attend_task: task t // n_parts, its keys
    [k_begin, k_end) narrowed to part t % n_parts (whole tiles per part), and its rows'
    accumulators emptied (acc: rows x dv zeros; running max -inf, sum 0)."""
    _task(p, t // n_parts, task)
    cdef Py_ssize_t r, part_len
    if n_parts > 1:
        part_len = (task.k_end - task.k_begin + n_parts - 1) // n_parts
        part_len = (part_len + p.block_k - 1) // p.block_k * p.block_k
        task.k_begin = min(task.k_end, task.k_begin + (t % n_parts) * part_len)
        task.k_end = min(task.k_end, task.k_begin + part_len)
    memset(acc, 0, task.rows * p.dv * sizeof(floating))
    for r in range(task.rows):
        row_max[r] = -INFINITY
        row_sum[r] = 0


cdef void _attend_task(const Problem *p, Py_ssize_t t, Py_ssize_t n_parts, floating scale,
                       const floating *q, const floating *k, const floating *v, floating *out,
                       const floating *mask, const unsigned char *pad,
                       floating *scores, floating *acc, floating *row_max,
                       floating *row_sum, bint finish, bint fused,
                       floating *saved) noexcept nogil:
    """Part t % n_parts of the keys of task t // n_parts, flash style: tiles of block_k keys,
    online softmax, O(tile) memory. scores: rows x block_k (BLAS) or the fused kernel's
    scratch; acc: rows x dv; row_max, row_sum: rows. finish: write the normalized rows to out;
    else leave acc, row_max and row_sum for _merge_parts. fused: use the fused tile kernel.
    saved: rows x dv, acc before each BLAS P V (to redo it by _pv_exact if non-finite)."""
    cdef Task task
    _start_part(p, t, n_parts, &task, acc, row_max, row_sum)
    cdef Py_ssize_t r, j0, nk
    cdef Py_ssize_t k_begin = task.k_begin, k_end = task.k_end
    cdef const floating *q0 = q + task.q_off
    cdef const floating *k0 = k + task.k_off
    cdef const floating *v0 = v + task.v_off
    cdef floating *o0 = out + task.o_off
    cdef const floating *m0 = NULL if mask == NULL else mask + task.m_off
    cdef const unsigned char *pad_row = NULL if pad == NULL else pad + task.pad_off

    if fused:
        _fused_attend(p, &task, scale, q0, k0, v0, m0, pad_row, k_begin, k_end, acc, row_max,
                      row_sum, scores)
        j0 = k_end               # (no BLAS tiles)
    else:
        j0 = k_begin
    while j0 < k_end:
        nk = min(p.block_k, k_end - j0)
        _gemm(NoTrans, Trans, <int> task.rows, <int> nk, <int> p.d, scale, q0, <int> task.q_rs,
              k0 + j0 * p.kl, <int> p.kl, <floating> 0, scores, <int> p.block_k)
        for r in range(task.rows):
            _row_softmax_online(scores + r * p.block_k, nk,
                                NULL if m0 == NULL else m0 + r * task.m_rs + j0 * p.mk, p.mk,
                                NULL if pad_row == NULL else pad_row + j0,
                                _n_skip(p, &task, r, j0, nk), _n_valid(p, &task, r, j0, nk),
                                &row_max[r], &row_sum[r], acc + r * p.dv, p.dv)
        # BLAS would multiply a hidden key's NaN V by its 0: when the sums come out
        # non-finite (a NaN or inf in V, or in a row that is NaN anyway) redo them exactly.
        # Costs 2 passes over acc per tile of block_k keys.
        memcpy(saved, acc, task.rows * p.dv * sizeof(floating))
        _gemm(NoTrans, NoTrans, <int> task.rows, <int> p.dv, <int> nk, <floating> 1, scores,
              <int> p.block_k, v0 + j0 * p.vl, <int> p.vl, <floating> 1, acc, <int> p.dv)
        if not _all_finite(acc, task.rows, p.dv, p.dv):
            memcpy(acc, saved, task.rows * p.dv * sizeof(floating))
            _pv_exact(scores, p.block_k, task.rows, nk, v0 + j0 * p.vl, p.vl, acc, p.dv, p.dv)
        j0 += nk
    if finish:
        _rows_finish(acc, row_sum, task.rows, p.dv, o0, task.o_rs)


cdef void _merge_parts(const Problem *p, Py_ssize_t base, Py_ssize_t n_parts,
                       const floating *parts, Py_ssize_t part_size, Py_ssize_t max_rows,
                       floating *out) noexcept nogil:
    """out rows of task `base` from the (acc, max, sum) its n_parts parts left in `parts`:
    out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s with M = max_s m_s. A part that
    saw a NaN score has m_s = NaN: M is then NaN too, and so is the row (as without split-K)."""
    cdef Task task
    _task(p, base, &task)
    cdef Py_ssize_t r, s, d
    cdef const floating *part
    cdef floating m, m_s, total, weight
    cdef floating *o
    for r in range(task.rows):
        o = out + task.o_off + r * task.o_rs
        m = -INFINITY
        for s in range(n_parts):
            m_s = parts[(base * n_parts + s) * part_size + max_rows * p.dv + r]
            if m_s > m or m_s != m_s:       # a NaN sticks (max() would skip it)
                m = m_s
        total = 0
        for d in range(p.dv):
            o[d] = 0
        if m == -INFINITY:          # every key of the row masked: zeros
            continue
        for s in range(n_parts):
            part = parts + (base * n_parts + s) * part_size
            if part[max_rows * p.dv + r] == -INFINITY:
                continue
            weight = exp(part[max_rows * p.dv + r] - m)
            total += weight * part[max_rows * (p.dv + 1) + r]
            for d in range(p.dv):
                o[d] += weight * part[r * p.dv + d]
        for d in range(p.dv):       # total >= 1 for a finite M, NaN for a NaN row
            o[d] = o[d] / total


cdef inline void _plus_zero(floating *x, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t j
    for j in range(n):
        x[j] = x[j] + 0     # -0.0 + 0 = +0; anything else unchanged


cdef void _weights_task(const Problem *p, Py_ssize_t t, floating scale,
                        const floating *q, const floating *k, const floating *v, floating *out,
                        const floating *mask, const unsigned char *pad,
                        floating *weights) noexcept nogil:
    """One task with the weights kept: whole score rows in `weights`, exact softmax."""
    cdef Task task
    _task(p, t, &task)
    cdef Py_ssize_t r
    cdef Py_ssize_t q_rs = task.q_rs, o_rs = task.o_rs, w_rs = task.w_rs, m_rs = task.m_rs
    cdef const floating *q0 = q + task.q_off
    cdef const floating *k0 = k + task.k_off
    cdef const floating *v0 = v + task.v_off
    cdef floating *o0 = out + task.o_off
    cdef floating *w0 = weights + task.w_off
    cdef const floating *m0 = NULL if mask == NULL else mask + task.m_off
    cdef const unsigned char *pad_row = NULL if pad == NULL else pad + task.pad_off

    cdef Py_ssize_t kb = task.k_begin, n = task.k_end - task.k_begin   # the keys to compute
    for r in range(task.rows):   # weights of the keys no row may see
        memset(w0 + r * w_rs, 0, kb * sizeof(floating))
        memset(w0 + r * w_rs + task.k_end, 0, (p.k_len - task.k_end) * sizeof(floating))
    if n <= 0:
        for r in range(task.rows):
            memset(w0 + r * w_rs, 0, p.k_len * sizeof(floating))
            memset(o0 + r * o_rs, 0, p.dv * sizeof(floating))
        return
    w0 += kb
    _gemm(NoTrans, Trans, <int> task.rows, <int> n, <int> p.d, scale, q0, <int> q_rs,
          k0 + kb * p.kl, <int> p.kl, <floating> 0, w0, <int> w_rs)
    for r in range(task.rows):
        _row_softmax(w0 + r * w_rs, n, NULL if m0 == NULL else m0 + r * m_rs + kb * p.mk, p.mk,
                     NULL if pad_row == NULL else pad_row + kb, _n_skip(p, &task, r, kb, n),
                     _n_valid(p, &task, r, kb, n))
    _gemm(NoTrans, NoTrans, <int> task.rows, <int> p.dv, <int> n, <floating> 1, w0,
          <int> w_rs, v0 + kb * p.vl, <int> p.vl, <floating> 0, o0, <int> o_rs)
    if not _all_finite(o0, task.rows, p.dv, o_rs):      # see _attend_task
        for r in range(task.rows):
            memset(o0 + r * o_rs, 0, p.dv * sizeof(floating))
        _pv_exact(w0, w_rs, task.rows, n, v0 + kb * p.vl, p.vl, o0, o_rs, p.dv)
    for r in range(task.rows):   # the hidden keys' -0.0 weights become +0
        _plus_zero(w0 + r * w_rs, n)


# ---- K/V stored as float16 or int8 (KV caches of those dtypes) ----------------------------
# One body for both formats: the format enters only where keys/values are read. Tasks of
# few rows (decode) run the direct kernel of src/kv_format.c, which converts in registers;
# every other path converts one tile of keys and values at a time into the thread's scratch
# (the float32 values the cache means, exactly) and runs the float32 tile kernel on it.

cdef inline void _load_tile(const Problem *p, const void *raw, Py_ssize_t off, Py_ssize_t rs,
                            const float *scales, Py_ssize_t j0, Py_ssize_t n, Py_ssize_t d,
                            float *dst) noexcept nogil:
    """Rows j0 .. j0 + n - 1 of one stored K or V head (element offset off, row stride rs)
    as float32 rows of d values at dst."""
    if p.kv_fmt == MHA_KV_F16:
        mha_kv_load_f16_f32(<const unsigned short *> raw + off + j0 * rs, rs, <int> n, <int> d,
                            dst, d)
    else:
        mha_kv_load_i8_f32(<const signed char *> raw + off + j0 * rs, rs, scales + j0, <int> n,
                           <int> d, dst, d)


cdef inline const void *_stored_at(const Problem *p, const void *raw,
                                   Py_ssize_t off) noexcept nogil:
    """The address of stored element off (float16: 2 bytes, int8: 1)."""
    return <const char *> raw + off * mha_kv_itemsize(p.kv_fmt)


cdef void _stored_attend_task(const Problem *p, Py_ssize_t t, Py_ssize_t n_parts, float scale,
                              const float *q, float *out, const float *mask,
                              const unsigned char *pad, float *scores, float *conv,
                              float *acc, float *row_max, float *row_sum, bint finish,
                              bint fused, float *saved) noexcept nogil:
    """_attend_task with stored K/V. conv: block_k * (d + dv) floats (one converted tile);
    saved: rows x dv, acc before each BLAS P V (as in _attend_task)."""
    cdef Task task
    _start_part(p, t, n_parts, &task, acc, row_max, row_sum)
    cdef Py_ssize_t r, j0, nk
    cdef Py_ssize_t k_begin = task.k_begin, k_end = task.k_end
    cdef const float *q0 = q + task.q_off
    cdef float *o0 = out + task.o_off
    cdef const float *m0 = NULL if mask == NULL else mask + task.m_off
    cdef const unsigned char *pad_row = NULL if pad == NULL else pad + task.pad_off
    cdef Py_ssize_t s_off = task.b * p.sb + task.kv_head * p.sh
    cdef const float *ks = NULL if p.k_scale == NULL else p.k_scale + s_off
    cdef const float *vs = NULL if p.v_scale == NULL else p.v_scale + s_off
    cdef float *kt = conv
    cdef float *vt = conv + p.block_k * p.d
    cdef Py_ssize_t limit, step
    _causal_limit(p, &task, k_end, &limit, &step)

    if fused:           # (src/kv_format.c: the direct kernel or converted tiles)
        mha_kv_attend_f32(p.kv_fmt, direct_rows(task.rows, p.d, FUSED_DIRECT_ROWS,
                                                FUSED_DIRECT_MIN_D),
                          q0, task.q_rs, <int> task.rows, <int> p.d,
                          _stored_at(p, p.k_raw, task.k_off), p.kl, ks,
                          _stored_at(p, p.v_raw, task.v_off), p.vl, vs,
                          <int> p.dv, k_begin, k_end, scale, m0, task.m_rs, p.mk, pad_row,
                          limit, step, p.window, row_max, row_sum, acc, scores, conv,
                          p.block_k)
        k_end = k_begin          # (done)
    j0 = k_begin
    while j0 < k_end:           # BLAS tiles
        nk = min(p.block_k, k_end - j0)
        _load_tile(p, p.k_raw, task.k_off, p.kl, ks, j0, nk, p.d, kt)
        _load_tile(p, p.v_raw, task.v_off, p.vl, vs, j0, nk, p.dv, vt)
        _gemm(NoTrans, Trans, <int> task.rows, <int> nk, <int> p.d, scale, q0,
              <int> task.q_rs, kt, <int> p.d, <float> 0, scores, <int> p.block_k)
        for r in range(task.rows):
            _row_softmax_online(scores + r * p.block_k, nk,
                                NULL if m0 == NULL else m0 + r * task.m_rs + j0 * p.mk,
                                p.mk, NULL if pad_row == NULL else pad_row + j0,
                                _n_skip(p, &task, r, j0, nk), _n_valid(p, &task, r, j0, nk),
                                &row_max[r], &row_sum[r], acc + r * p.dv, p.dv)
        memcpy(saved, acc, task.rows * p.dv * sizeof(float))     # see _attend_task
        _gemm(NoTrans, NoTrans, <int> task.rows, <int> p.dv, <int> nk, <float> 1, scores,
              <int> p.block_k, vt, <int> p.dv, <float> 1, acc, <int> p.dv)
        if not _all_finite(acc, task.rows, p.dv, p.dv):
            memcpy(acc, saved, task.rows * p.dv * sizeof(float))
            _pv_exact(scores, p.block_k, task.rows, nk, vt, p.dv, acc, p.dv, p.dv)
        j0 += nk
    if finish:
        _rows_finish(acc, row_sum, task.rows, p.dv, o0, task.o_rs)


cdef void _stored_weights_task(const Problem *p, Py_ssize_t t, float scale, const float *q,
                               float *out, const float *mask, const unsigned char *pad,
                               float *weights, float *conv) noexcept nogil:
    """_weights_task with stored K/V, one converted tile (block_k x max(d, dv) floats in
    conv) at a time: scores tile by tile into the weight rows, the exact softmax, then the
    P V products tile by tile."""
    cdef Task task
    _task(p, t, &task)
    cdef Py_ssize_t r, j0, nk
    cdef Py_ssize_t q_rs = task.q_rs, o_rs = task.o_rs, w_rs = task.w_rs, m_rs = task.m_rs
    cdef const float *q0 = q + task.q_off
    cdef float *o0 = out + task.o_off
    cdef float *w0 = weights + task.w_off
    cdef const float *m0 = NULL if mask == NULL else mask + task.m_off
    cdef const unsigned char *pad_row = NULL if pad == NULL else pad + task.pad_off
    cdef Py_ssize_t s_off = task.b * p.sb + task.kv_head * p.sh
    cdef const float *ks = NULL if p.k_scale == NULL else p.k_scale + s_off
    cdef const float *vs = NULL if p.v_scale == NULL else p.v_scale + s_off

    cdef Py_ssize_t kb = task.k_begin, n = task.k_end - task.k_begin
    for r in range(task.rows):
        memset(w0 + r * w_rs, 0, kb * sizeof(float))
        memset(w0 + r * w_rs + task.k_end, 0, (p.k_len - task.k_end) * sizeof(float))
    if n <= 0:
        for r in range(task.rows):
            memset(w0 + r * w_rs, 0, p.k_len * sizeof(float))
            memset(o0 + r * o_rs, 0, p.dv * sizeof(float))
        return
    j0 = kb
    while j0 < task.k_end:
        nk = min(p.block_k, task.k_end - j0)
        _load_tile(p, p.k_raw, task.k_off, p.kl, ks, j0, nk, p.d, conv)
        _gemm(NoTrans, Trans, <int> task.rows, <int> nk, <int> p.d, scale, q0, <int> q_rs,
              conv, <int> p.d, <float> 0, w0 + j0, <int> w_rs)
        j0 += nk
    for r in range(task.rows):
        _row_softmax(w0 + r * w_rs + kb, n,
                     NULL if m0 == NULL else m0 + r * m_rs + kb * p.mk, p.mk,
                     NULL if pad_row == NULL else pad_row + kb, _n_skip(p, &task, r, kb, n),
                     _n_valid(p, &task, r, kb, n))
    j0 = kb
    while j0 < task.k_end:
        nk = min(p.block_k, task.k_end - j0)
        _load_tile(p, p.v_raw, task.v_off, p.vl, vs, j0, nk, p.dv, conv)
        _gemm(NoTrans, NoTrans, <int> task.rows, <int> p.dv, <int> nk, <float> 1, w0 + j0,
              <int> w_rs, conv, <int> p.dv, <float> (0 if j0 == kb else 1), o0, <int> o_rs)
        j0 += nk
    if not _all_finite(o0, task.rows, p.dv, o_rs):      # see _weights_task: redo exactly
        for r in range(task.rows):
            memset(o0 + r * o_rs, 0, p.dv * sizeof(float))
        j0 = kb
        while j0 < task.k_end:
            nk = min(p.block_k, task.k_end - j0)
            _load_tile(p, p.v_raw, task.v_off, p.vl, vs, j0, nk, p.dv, conv)
            _pv_exact(w0 + j0, w_rs, task.rows, nk, conv, p.dv, o0, o_rs, p.dv)
            j0 += nk
    for r in range(task.rows):   # the hidden keys' -0.0 weights become +0
        _plus_zero(w0 + r * w_rs + kb, n)


cdef inline bint _use_fused(const Problem *p) noexcept nogil:
    """Whether the online path runs the fused tile kernel (see src/attention_microkernel.h):
    a rule of the shapes only, so the result does not depend on the thread count."""
    if TILE_KERNEL != TILE_AUTO:
        return TILE_KERNEL == TILE_FUSED
    # measured (the table in attention_microkernel.h): faster for every row count and length
    # up to head dims of 256, slower above
    return max(p.d, p.dv) <= MHA_FUSED_MAX_HEAD_DIM


cdef inline Py_ssize_t _elem(Py_ssize_t stride_bytes, Py_ssize_t itemsize) noexcept:
    return stride_bytes // itemsize


cdef inline int _team(int n_threads, Py_ssize_t n_tasks, double flops) noexcept:
    """Threads for n_tasks tasks of `flops` in all: no more than the tasks, nor than the work
    pays for (ATTN_MIN_FLOPS_PER_THREAD each), nor than asked; at least 1."""
    return <int> max(1, min(<Py_ssize_t> n_threads, n_tasks,
                            <Py_ssize_t> (flops / ATTN_MIN_FLOPS_PER_THREAD)))


def _group_starts(const Py_ssize_t[::1] kv_index, Py_ssize_t q_heads, Py_ssize_t kv_heads):
    """Check kv_index (a K/V head in [0, kv_heads) per query head); return the first query
    head of each K/V head and q_heads after them, (kv_heads + 1,), when each K/V head's query
    heads are consecutive and in order (a pruned module's are); else None."""
    cdef Py_ssize_t h, g
    if kv_index.shape[0] != q_heads:
        raise ValueError(f"kv_index has {kv_index.shape[0]} entries; expected one per query "
                         f"head ({q_heads})")
    for h in range(q_heads):
        if not 0 <= kv_index[h] < kv_heads:
            raise ValueError(f"kv_index[{h}] = {kv_index[h]} is not a K/V head in "
                             f"[0, {kv_heads})")
    starts = np.zeros(kv_heads + 1, dtype=np.intp)
    cdef Py_ssize_t[::1] s = starts
    g = 0           # the K/V head of query head h must be g (same) or g + 1 (next)
    for h in range(q_heads):
        if kv_index[h] == g + 1 and h > 0:
            g += 1
            s[g] = h
        elif kv_index[h] != g:
            return None
    if g != kv_heads - 1:
        return None
    s[kv_heads] = q_heads
    return starts


cdef Py_ssize_t _stored_format(Problem *p, k, v, k_scale, v_scale,
                               Py_ssize_t isz) except -1:
    """Set p.kv_fmt, p.k_raw, p.v_raw and the int8 scales from k, v (and k_scale, v_scale);
    return the itemsize of the stored K/V (isz for K/V of the compute dtype)."""
    p.kv_fmt = 0
    p.k_raw = p.v_raw = NULL
    p.k_scale = p.v_scale = NULL
    p.sb = p.sh = 0
    kind = getattr(k, "dtype", None)
    if kind is None or kind not in (np.float16, np.int8):
        if k_scale is not None or v_scale is not None:
            raise ValueError("attention: k_scale / v_scale are for int8 K/V only")
        return isz
    if v.dtype != kind:
        raise TypeError(f"attention: k and v must have the same dtype; got {kind}, {v.dtype}")
    cdef const unsigned short[:, :, :, :] k16
    cdef const unsigned short[:, :, :, :] v16
    cdef const signed char[:, :, :, :] k8
    cdef const signed char[:, :, :, :] v8
    cdef const float[:, :, :] ks
    cdef const float[:, :, :] vs
    if kind == np.float16:
        if k_scale is not None or v_scale is not None:
            raise ValueError("attention: k_scale / v_scale are for int8 K/V only")
        p.kv_fmt = MHA_KV_F16
        k16, v16 = k.view(np.uint16), v.view(np.uint16)
        if k16.size and v16.size:
            p.k_raw, p.v_raw = &k16[0, 0, 0, 0], &v16[0, 0, 0, 0]
        return 2
    if k_scale is None or v_scale is None:
        raise ValueError("attention: int8 K/V need k_scale and v_scale")
    p.kv_fmt = MHA_KV_I8
    ks, vs = k_scale, v_scale
    if (tuple(k_scale.shape) != tuple(k.shape[:3]) or tuple(v_scale.shape) != tuple(k.shape[:3])
            or ks.strides[0] != vs.strides[0] or ks.strides[1] != vs.strides[1]
            or (ks.shape[2] > 1 and (ks.strides[2] != 4 or vs.strides[2] != 4))):
        raise ValueError("attention: k_scale, v_scale must be (B, Hkv, Lk) with equal strides "
                         "and a contiguous last axis")
    k8, v8 = k, v
    if k8.size and v8.size:
        p.k_raw, p.v_raw = &k8[0, 0, 0, 0], &v8[0, 0, 0, 0]
        p.k_scale, p.v_scale = &ks[0, 0, 0], &vs[0, 0, 0]
    p.sb, p.sh = ks.strides[0] // 4, ks.strides[1] // 4
    return 1


cdef void _stored_weights(const Problem *p, int team, Py_ssize_t n_tasks, float scale,
                          const float *q, float *out, const float *mask,
                          const unsigned char *pad, float *weights) except *:
    """The weights path over stored K/V: one converted tile of scratch per thread."""
    cdef Py_ssize_t t
    cdef float *conv
    cdef int failed = 0
    cdef int *failed_ptr = &failed
    cdef Py_ssize_t conv_size = p.block_k * max(p.d, p.dv)
    with nogil, parallel(num_threads=team):
        conv = <float *> malloc(conv_size * sizeof(float))
        if conv == NULL:
            failed_ptr[0] = 1
        for t in prange(n_tasks, schedule='dynamic'):
            if conv != NULL:
                _stored_weights_task(p, t, scale, q, out, mask, pad, weights, conv)
        free(conv)
    if failed:
        raise MemoryError("attention: could not allocate the per-thread key tiles")


def attention(const floating[:, :, :, :] q, k, v, floating[:, :, :, :] out,
              mask, pad, bint causal, floating scale, weights, int n_threads,
              Py_ssize_t window=0, ragged=None, kv_index=None, k_scale=None, v_scale=None):
    """out := softmax(scale * q k^T + mask) v per (batch, head), in place.

    q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), out (B, Hq, Lq, Dv): strided views
    with a contiguous last axis and row strides >= the row length (mha_cy.attention checks
    everything; the kernel trusts it). mask: None or an additive (B, Hq, Lq, Lk) view of q's
    dtype, broadcast with zero strides. pad: None or uint8 (B, Lk), nonzero = ignore the key.
    causal: query i sees keys j <= i + Lk - Lq. weights: None or a contiguous (B, Hq, Lq, Lk)
    array that receives the attention weights. n_threads: OpenMP threads (>= 1).
    window: > 0 (with causal): query i sees only keys i + Lk - Lq - window < j <= i + Lk - Lq;
    key tiles outside every row's window are never read. ragged: None or an intp (3, B) array
    of each sequence's query rows, keys and causal offset (a ragged cache batch): sequence b
    then reads only its first keys, and its query rows past its count are not written.
    kv_index: None (query head h reads K/V head h // (Hq / Hkv)) or an intp (Hq,) array of
    K/V head indices (uneven groups, a pruned module); when it is non-decreasing and uses
    every K/V head, decode steps still stream each K/V head once for its query heads.
    k, v may instead be the float16 or int8 storage of a KV cache (float32 q only; int8
    with k_scale, v_scale: (B, Hkv, Lk) float32, contiguous last axis, the same strides):
    they are read in that format (see _stored_attend_task).
    """
    cdef Problem p
    cdef Py_ssize_t isz = sizeof(floating)
    cdef Py_ssize_t ksz = _stored_format(&p, k, v, k_scale, v_scale, isz)
    # (a memoryview spec cannot say "only the last axis contiguous": check it here; the
    # stride of an axis of length 1 is never used, and NumPy may report any value for it)
    if not ((q.shape[3] == 1 or q.strides[3] == isz) and (k.shape[3] == 1 or k.strides[3] == ksz)
            and (v.shape[3] == 1 or v.strides[3] == ksz)
            and (out.shape[3] == 1 or out.strides[3] == isz)):
        raise ValueError("attention: q, k, v and out need a contiguous last axis")
    p.batch, p.q_heads, p.q_len, p.d = q.shape[0], q.shape[1], q.shape[2], q.shape[3]
    p.kv_heads, p.k_len, p.dv = k.shape[1], k.shape[2], v.shape[3]
    p.group = p.q_heads // p.kv_heads
    p.qb, p.qh, p.ql = _elem(q.strides[0], isz), _elem(q.strides[1], isz), _elem(q.strides[2], isz)
    p.kb, p.kh, p.kl = _elem(k.strides[0], ksz), _elem(k.strides[1], ksz), _elem(k.strides[2], ksz)
    p.vb, p.vh, p.vl = _elem(v.strides[0], ksz), _elem(v.strides[1], ksz), _elem(v.strides[2], ksz)
    if floating is double:
        if p.kv_fmt != 0:
            raise TypeError("attention: float16 / int8 K/V need float32 q")
    p.ob, p.oh, p.ol = (_elem(out.strides[0], isz), _elem(out.strides[1], isz),
                        _elem(out.strides[2], isz))
    p.causal = causal
    p.causal_offset = p.k_len - p.q_len
    p.window = window if causal else 0
    cdef const Py_ssize_t[:, ::1] ragged_view
    p.q_lens = p.k_lens = p.offsets = NULL
    if ragged is not None:
        ragged_view = ragged
        if ragged_view.shape[0] != 3 or ragged_view.shape[1] != p.batch:
            raise ValueError("attention: ragged must be (3, batch)")
        p.q_lens = &ragged_view[0, 0]
        p.k_lens = &ragged_view[1, 0]
        p.offsets = &ragged_view[2, 0]
    p.kv_index = p.group_start = NULL
    cdef const Py_ssize_t[::1] kv_view
    cdef Py_ssize_t[::1] starts
    cdef Py_ssize_t max_group = p.group
    if kv_index is not None:
        kv_view = kv_index
        starts = _group_starts(kv_view, p.q_heads, p.kv_heads)
        p.kv_index = &kv_view[0]
        max_group = 1
        if starts is not None:
            p.group_start = &starts[0]
            max_group = largest_group(p.group_start, p.kv_heads)
    p.heads_as_rows = p.q_len == 1 and max_group > 1
    # tiles no larger than the problem: short sequences get small per-thread scratch
    p.block_q, p.block_k = min(BLOCK_Q, max(p.q_len, 1)), min(BLOCK_K, max(p.k_len, 1))
    p.q_blocks = (p.q_len + p.block_q - 1) // p.block_q

    cdef const floating[:, :, :, :] mask_view
    cdef const floating *mask_ptr = NULL
    p.mb = p.mh = p.ml = p.mk = 0
    if mask is not None:
        mask_view = mask
        # the kernel indexes both by (batch, head, row, key) / (batch, key) without bounds: a
        # (B, 1) padding made of a key-size-1 mask once read past its end
        expected = (p.batch, p.q_heads, p.q_len, p.k_len)
        if tuple(mask.shape) != expected:
            raise ValueError(f"attention: mask must be (B, Hq, Lq, Lk) = {expected}; got "
                             f"{tuple(mask.shape)}")
        mask_ptr = &mask_view[0, 0, 0, 0]
        p.mb, p.mh = _elem(mask_view.strides[0], isz), _elem(mask_view.strides[1], isz)
        p.ml, p.mk = _elem(mask_view.strides[2], isz), _elem(mask_view.strides[3], isz)

    cdef const unsigned char[:, ::1] pad_view
    cdef const unsigned char *pad_ptr = NULL
    p.pb = 0
    if pad is not None:
        pad_view = pad
        if pad_view.shape[0] != p.batch or pad_view.shape[1] != p.k_len:
            raise ValueError(f"attention: key padding must be (B, Lk) = {(p.batch, p.k_len)}; "
                             f"got {tuple(pad.shape)}")
        pad_ptr = &pad_view[0, 0]
        p.pb = pad_view.strides[0]
    p.pad = pad_ptr

    cdef floating[:, :, :, ::1] w_view       # C-contiguous
    cdef floating *w_ptr = NULL
    p.wb = p.wh = p.wl = 0
    if weights is not None:
        w_view = weights
        w_ptr = &w_view[0, 0, 0, 0]
        p.wb, p.wh = _elem(w_view.strides[0], isz), _elem(w_view.strides[1], isz)
        p.wl = _elem(w_view.strides[2], isz)

    if p.batch * p.q_heads * p.q_blocks == 0:     # no task (and no element to point at)
        return out
    cdef const floating *q_ptr = &q[0, 0, 0, 0]
    cdef const floating[:, :, :, :] k_view
    cdef const floating[:, :, :, :] v_view
    cdef const floating *k_ptr = NULL
    cdef const floating *v_ptr = NULL
    if p.kv_fmt == 0:
        k_view, v_view = k, v
        k_ptr, v_ptr = &k_view[0, 0, 0, 0], &v_view[0, 0, 0, 0]
    _run(&p, max_group, scale, q_ptr, k_ptr, v_ptr, &out[0, 0, 0, 0], mask_ptr, pad_ptr, w_ptr,
         n_threads)
    return out


cdef int _run(Problem *p, Py_ssize_t max_group, floating scale, const floating *q_ptr,
              const floating *k_ptr, const floating *v_ptr, floating *o_ptr,
              const floating *mask_ptr, const unsigned char *pad_ptr, floating *w_ptr,
              int n_threads) except -1:
    """The attention of a set-up problem (attention and sdpa set p up) on raw pointers (k_ptr,
    v_ptr: NULL for K/V stored as float16 / int8, p.k_raw and p.v_raw); -1 with MemoryError."""
    cdef Py_ssize_t n_tasks = (p.batch * p.kv_heads if p.heads_as_rows
                               else p.batch * p.q_heads * p.q_blocks)
    if n_tasks == 0:
        return 0
    cdef double flops = attention_flops(p.batch, p.q_heads, p.q_len, p.k_len, p.d, p.dv,
                                        p.causal, p.window)
    cdef int team = _team(n_threads, n_tasks, flops)
    cdef Py_ssize_t max_rows = max_group if p.heads_as_rows else p.block_q
    cdef Py_ssize_t bk = p.block_k
    cdef Py_ssize_t t
    cdef floating *scratch
    cdef int failed = 0

    if w_ptr != NULL and p.kv_fmt != 0:
        _stored_weights(p, team, n_tasks, <float> scale, <const float *> q_ptr,
                        <float *> o_ptr, <const float *> mask_ptr, pad_ptr, <float *> w_ptr)
        return 0
    if w_ptr != NULL:
        with nogil, parallel(num_threads=team):
            for t in prange(n_tasks, schedule='dynamic'):
                _weights_task(p, t, scale, q_ptr, k_ptr, v_ptr, o_ptr, mask_ptr, pad_ptr, w_ptr)
        return 0

    # split-K (see ATTN_MIN_PARALLEL_TASKS): parts of at least two tiles each
    cdef Py_ssize_t n_parts = split_k_parts(n_tasks, p.k_len, p.window, p.heads_as_rows, bk)
    team = _team(n_threads, n_tasks * n_parts, flops)
    # acc (max_rows x dv), then running max and sum (max_rows each): after the score tile in
    # each thread's scratch, or per part in `parts` when the keys are split
    cdef Py_ssize_t part_size = max_rows * (p.dv + 2)
    cdef floating *parts = NULL
    cdef floating *acc
    if n_parts > 1:
        parts = <floating *> malloc_lines(n_tasks * n_parts * part_size * sizeof(floating))
        if parts == NULL:
            raise MemoryError("attention: could not allocate the split-K partial results")

    cdef bint fused = _use_fused(p)
    # the score tile, or the fused kernel's packed keys and scores, before the accumulators
    cdef Py_ssize_t tile_size = max(max_rows * bk, _fused_scratch(p, fused, scale))
    # stored K/V: one converted key and value tile after the accumulators
    cdef Py_ssize_t conv_size = 0 if p.kv_fmt == 0 else bk * (p.d + p.dv)
    if p.kv_fmt != 0:       # the direct kernel's scores
        tile_size = max(tile_size, mha_kv_direct_scratch())
    cdef float *conv
    # and, for the BLAS P V, a copy of acc (see _attend_task)
    cdef Py_ssize_t saved_size = 0 if fused else max_rows * p.dv
    cdef int *failed_ptr = &failed     # shared; a thread-private copy would be lost
    with nogil, parallel(num_threads=team):
        # per-thread scratch: one score tile, the accumulators, running max and sum, the
        # saved accumulators, the converted tiles
        # (from a cache line: the packed keys are read in whole vectors, _aligned.pxd)
        scratch = <floating *> malloc_lines((tile_size + max_rows * (p.dv + 2) + saved_size
                                             + conv_size) * sizeof(floating))
        if scratch == NULL:
            failed_ptr[0] = 1
        # every thread must reach the worksharing loop, even one without scratch
        for t in prange(n_tasks * n_parts, schedule='dynamic'):
            if scratch != NULL:
                acc = scratch + tile_size if n_parts == 1 else parts + t * part_size
                if p.kv_fmt != 0:
                    conv = <float *> (scratch + tile_size + max_rows * (p.dv + 2) + saved_size)
                    _stored_attend_task(p, t, n_parts, <float> scale, <const float *> q_ptr,
                                        <float *> o_ptr, <const float *> mask_ptr, pad_ptr,
                                        <float *> scratch, conv, <float *> acc,
                                        <float *> (acc + max_rows * p.dv),
                                        <float *> (acc + max_rows * (p.dv + 1)), n_parts == 1,
                                        fused,
                                        <float *> (scratch + tile_size + max_rows * (p.dv + 2)))
                else:
                    _attend_task(p, t, n_parts, scale, q_ptr, k_ptr, v_ptr, o_ptr, mask_ptr,
                                 pad_ptr, scratch, acc, acc + max_rows * p.dv,
                                 acc + max_rows * (p.dv + 1), n_parts == 1, fused,
                                 scratch + tile_size + max_rows * (p.dv + 2))
        free(scratch)
    if n_parts > 1:
        if not failed:
            with nogil, parallel(num_threads=min(team, <int> n_tasks)):
                for t in prange(n_tasks, schedule='static'):
                    _merge_parts(p, t, n_parts, parts, part_size, max_rows, o_ptr)
        free(parts)
    if failed:
        raise MemoryError("attention: could not allocate the per-thread score tiles")
    return 0


cdef inline bint _plain_operand(object a, int typenum) noexcept:
    """a is an exact ndarray (no subclass), 4-D, and c_contiguous (_ndarray_checks.pxd)."""
    return (cnp.PyArray_CheckExact(a) and c_contiguous(a, typenum)
            and cnp.PyArray_NDIM(<cnp.ndarray> a) == 4)


def sdpa(object q, object k, object v, bint causal, int n_threads):
    """scaled_dot_product_attention(q, k, v, is_causal=causal) at the default scale, for the
    common call, as one compiled call: the checks of mha_cy.attention's general path reduced
    to what plain operands need, and no memoryview or fused-type argument handling. Intel
    Xeon, 2 threads, float32, interleaved runs against the Python checks + attention():
    (1, 4, 16, 16) 9.3-9.6 -> 4.7-4.8 us, (1, 8, 32, 64) 21-24 -> 18-19 us.
    Plain operands: exact, C-contiguous, aligned, native float32 or float64 ndarrays of one
    dtype, q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), Hq a multiple of Hkv, no
    empty axis, with the default tile rules and head dims the fused kernel takes (no BLAS
    call to hold). Returns the (B, Hq, Lq, Dv) output, or None for anything else (the
    general path then checks it and names what is wrong)."""
    if not cnp.PyArray_Check(q):
        return None
    cdef int typenum = cnp.PyArray_TYPE(<cnp.ndarray> q)
    if typenum != cnp.NPY_FLOAT32 and typenum != cnp.NPY_FLOAT64:
        return None
    if not (_plain_operand(q, typenum) and _plain_operand(k, typenum)
            and _plain_operand(v, typenum) and default_rules):
        return None
    cdef cnp.npy_intp *qs = cnp.PyArray_DIMS(<cnp.ndarray> q)
    cdef cnp.npy_intp *ks = cnp.PyArray_DIMS(<cnp.ndarray> k)
    cdef cnp.npy_intp *vs = cnp.PyArray_DIMS(<cnp.ndarray> v)
    cdef Py_ssize_t b = qs[0], hq = qs[1], lq = qs[2], d = qs[3]
    cdef Py_ssize_t hkv = ks[1], lk = ks[2], dv = vs[3]
    if not (ks[0] == b and vs[0] == b and ks[3] == d and vs[1] == hkv and vs[2] == lk
            and hkv > 0 and hq % hkv == 0 and b > 0 and hq > 0 and lq > 0 and d > 0
            and lk > 0 and dv > 0 and lk <= INT_MAX
            and max(d, dv) <= MHA_FUSED_MAX_HEAD_DIM):
        return None
    cdef Problem p
    memset(&p, 0, sizeof(Problem))    # no mask, padding, weights, ragged rows or kv_index
    p.batch, p.q_heads, p.q_len, p.d = b, hq, lq, d
    p.kv_heads, p.k_len, p.dv, p.group = hkv, lk, dv, hq // hkv
    # element strides of C-contiguous arrays (the row stride is a row even for one row)
    p.ql, p.qh, p.qb = d, lq * d, hq * lq * d
    p.kl, p.kh, p.kb = d, lk * d, hkv * lk * d
    p.vl, p.vh, p.vb = dv, lk * dv, hkv * lk * dv
    p.ol, p.oh, p.ob = dv, lq * dv, hq * lq * dv
    p.causal = causal
    p.causal_offset = lk - lq
    p.heads_as_rows = lq == 1 and p.group > 1
    p.block_q, p.block_k = min(BLOCK_Q, lq), min(BLOCK_K, lk)
    p.q_blocks = (lq + p.block_q - 1) // p.block_q
    cdef cnp.npy_intp dims[4]
    dims[0], dims[1], dims[2], dims[3] = b, hq, lq, dv
    cdef cnp.ndarray out = cnp.PyArray_EMPTY(4, dims, typenum, 0)
    cdef double scale = 1.0 / sqrt(<double> d)     # (what math.sqrt gives the general path)
    if typenum == cnp.NPY_FLOAT32:
        _run(&p, p.group, <float> scale, <const float *> cnp.PyArray_DATA(<cnp.ndarray> q),
             <const float *> cnp.PyArray_DATA(<cnp.ndarray> k),
             <const float *> cnp.PyArray_DATA(<cnp.ndarray> v),
             <float *> cnp.PyArray_DATA(out), NULL, NULL, NULL, n_threads)
    else:
        _run(&p, p.group, scale, <const double *> cnp.PyArray_DATA(<cnp.ndarray> q),
             <const double *> cnp.PyArray_DATA(<cnp.ndarray> k),
             <const double *> cnp.PyArray_DATA(<cnp.ndarray> v),
             <double *> cnp.PyArray_DATA(out), NULL, NULL, NULL, n_threads)
    return out


FUSED_MAX_HEAD_DIM = MHA_FUSED_MAX_HEAD_DIM      # (for mha_cy.attention)

# Whether every rule above has its default value: mha_cy/_step_kernel.pyx reproduces the
# default rules for decode steps, and steps aside when a test or a tuning run moves one.
default_rules = True


def _note_rules():
    global default_rules
    default_rules = ((BLOCK_Q, BLOCK_K, TILE_KERNEL, FUSED_DIRECT_ROWS, FUSED_DIRECT_MIN_D)
                     == (ATTN_BLOCK_Q, ATTN_BLOCK_K, TILE_AUTO, MHA_FUSED_DIRECT_MAX_ROWS,
                         MHA_FUSED_DIRECT_MIN_HEAD_DIM))


def _set_tile_sizes(block_q, block_k):
    """Set the query rows per task and keys per score tile; return the previous pair."""
    global BLOCK_Q, BLOCK_K
    if block_q < 1 or block_k < 1:
        raise ValueError(f"tile sizes must be >= 1; got ({block_q}, {block_k})")
    previous = (BLOCK_Q, BLOCK_K)
    BLOCK_Q, BLOCK_K = block_q, block_k
    _note_rules()
    return previous



def _set_tile_kernel(name):
    """Force the online path's tile kernel: "fused", "blas" or "auto" (the measured rule of
    _use_fused); return the previous setting."""
    global TILE_KERNEL
    if name not in _TILE_KERNEL_NAMES:
        raise ValueError(f"tile kernel must be one of {sorted(_TILE_KERNEL_NAMES)}; got {name!r}")
    previous = next(n for n, k in _TILE_KERNEL_NAMES.items() if k == TILE_KERNEL)
    TILE_KERNEL = _TILE_KERNEL_NAMES[name]
    _note_rules()
    return previous


def _set_fused_direct(rows, min_head_dim):
    """Tasks of at most `rows` rows (0: none) with one row or head dims >= min_head_dim run
    the fused kernel's direct variant; return the previous (rows, min_head_dim)."""
    global FUSED_DIRECT_ROWS, FUSED_DIRECT_MIN_D
    if rows < 0 or min_head_dim < 0:
        raise ValueError(f"rows and min_head_dim must be >= 0; got {rows}, {min_head_dim}")
    previous = (FUSED_DIRECT_ROWS, FUSED_DIRECT_MIN_D)
    FUSED_DIRECT_ROWS, FUSED_DIRECT_MIN_D = rows, min_head_dim
    _note_rules()
    return previous
