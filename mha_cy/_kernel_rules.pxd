# The tuning constants and shape rules of the general kernels (_attention_kernel,
# _linear_kernel), declared once: `from ._kernel_rules cimport ...`. _step_kernel reproduces
# those kernels' default rules bit for bit and declines where they would work otherwise, so it
# reads the same constants and the same rule functions, and cannot drift from them.
# (A tuning knob that moves a rule at run time is seen through each kernel's default_rules.)

cdef enum:
    # _attention_kernel's default query rows per task and keys per score tile (tuned on Zen 4,
    # see benchmarks/; its BLOCK_Q, BLOCK_K start here and _set_tile_sizes moves them)
    ATTN_BLOCK_Q = 256
    ATTN_BLOCK_K = 256
    # With fewer attention tasks than this (a decode step of one sequence with one K/V head,
    # say), the keys of each task are split into parts computed in parallel and merged
    # ("split-K"), so that all cores stream the cache. A constant, not the thread count: the
    # result must not depend on it.
    ATTN_MIN_PARALLEL_TASKS = 8
    # Waking a thread costs microseconds: give each at least this many flops (5-20 us of work:
    # short rows run at a third of the long rows' rate, their softmax costs more than their
    # products). 1e6 before kept the attention of a MiniLM-size layer (32 tokens, 12 heads of
    # 32: 1.6 MFLOP, 117 us on Zen 1) on one thread.
    ATTN_MIN_FLOPS_PER_THREAD = 250000
    # _linear_kernel: a panel tile's weight columns fill about this much of L2 at least: each
    # tile streams all of the packed x once, so narrow tiles re-read x too often (4096 x 384
    # -> 1152, one thread: 32 columns per tile 140 ms, 144 columns 109; 1024 rows: 33 -> 27).
    PANEL_TILE_WEIGHT_BYTES = 192 * 1024


cdef inline double attention_flops(Py_ssize_t batch, Py_ssize_t q_heads, Py_ssize_t q_len,
                                   Py_ssize_t k_len, Py_ssize_t d, Py_ssize_t dv, bint causal,
                                   Py_ssize_t window) noexcept nogil:
    """The attention's flops (scores and P V), halved when causal, and rows see at most window
    keys (window > 0): what the thread count is sized by (ATTN_MIN_FLOPS_PER_THREAD each)."""
    cdef double flops = 2.0 * batch * q_heads * q_len * k_len * (d + dv)
    if causal:
        flops /= 2
    if window > 0 and window < k_len:
        flops *= <double> window / k_len
    return flops


cdef inline Py_ssize_t split_k_parts(Py_ssize_t n_tasks, Py_ssize_t k_len, Py_ssize_t window,
                                     bint heads_as_rows, Py_ssize_t block_k) noexcept nogil:
    """Parts the keys of each of n_tasks attention tasks are split into (split-K): 1 from
    ATTN_MIN_PARALLEL_TASKS tasks on, else enough parts for that many in all, each at least
    two tiles of block_k keys. A task has at most k_len keys, or window (> 0) for the decode
    tasks (heads_as_rows: one query row per head). Shapes only: thread-count invariant."""
    cdef Py_ssize_t task_keys = k_len
    if window > 0 and heads_as_rows:
        task_keys = min(task_keys, window)
    if n_tasks >= ATTN_MIN_PARALLEL_TASKS or n_tasks < 1:
        return 1
    return max(<Py_ssize_t> 1, min((ATTN_MIN_PARALLEL_TASKS + n_tasks - 1) // n_tasks,
                                   task_keys // (2 * block_k)))


cdef inline bint direct_rows(Py_ssize_t rows, Py_ssize_t d, Py_ssize_t max_rows,
                             Py_ssize_t min_d) noexcept nogil:
    """Whether an attention task of `rows` rows of head dim d runs the fused kernel's direct
    variant (no packed keys): at most max_rows rows, and d >= min_d unless it has one row. The
    defaults are MHA_FUSED_DIRECT_MAX_ROWS and MHA_FUSED_DIRECT_MIN_HEAD_DIM;
    _attention_kernel's _set_fused_direct moves its own."""
    return rows <= max_rows and (rows == 1 or d >= min_d)


cdef inline Py_ssize_t largest_group(const Py_ssize_t *group_start,
                                     Py_ssize_t kv_heads) noexcept nogil:
    """The most query heads one K/V head serves, from _attention_kernel._group_starts' array
    (K/V head g's query heads are [group_start[g], group_start[g + 1])): the rows of the
    largest decode task of uneven groups."""
    cdef Py_ssize_t g, most = 1
    for g in range(kv_heads):
        most = max(most, group_start[g + 1] - group_start[g])
    return most


cdef inline void skip_end_padding(const unsigned char *pad_row, Py_ssize_t *k_begin,
                                  Py_ssize_t *k_end) noexcept nogil:
    """Narrow a task's keys [k_begin, k_end) past the padded keys (pad_row[j] nonzero) at
    either end: they are skipped, not read (right- or left-padded batches)."""
    while k_end[0] > 0 and pad_row[k_end[0] - 1]:
        k_end[0] -= 1
    while k_begin[0] < k_end[0] and pad_row[k_begin[0]]:
        k_begin[0] += 1
