# The tuning constants and shape rules of the general kernels (_attention_kernel,
# _linear_kernel), declared once: `from ._kernel_rules cimport ...`. _step_kernel reproduces
# those kernels' default rules bit for bit and declines where they would work otherwise, so it
# reads the same constants and the same rule functions, and cannot drift from them.
# (A tuning knob that moves a rule at run time is seen through each kernel's default_rules.)

from libc.math cimport sqrt


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
    # A panel tile streams all of the packed x once, so tiles are kept wide
    # (PANEL_TILE_WEIGHT_BYTES of weight columns) where the packed x is larger than this; a
    # smaller one stays in L2 (half of Zen 1's 512 KiB) while any number of tiles re-read it.
    PANEL_X_CACHED_BYTES = 256 * 1024
    # Beyond that, tiles are row groups of about this much packed x times column blocks: a
    # group stays in L2 with its tile's weight columns while they pass over it, where a
    # column block over all the rows streamed the packed x (12 MiB for 4096 rows of 768) from
    # L3 or DRAM once per tile. Zen 2, one thread, GFLOP/s, all rows -> groups of 96 rows:
    # 4096 x 768 -> 2304 71.7 -> 85.8, 4096 x 512 -> 1536 79.0 -> 86.7, 4096 x 768 -> 768
    # 75.4 -> 81.8, 4096 x 512 -> 512 59.6 -> 82.1 (groups of 32 to 128 rows: within 1%).
    PANEL_X_GROUP_BYTES = 192 * 1024
    # _linear_kernel's defaults (its MIN_TILE_FLOPS, MAX_TILES knobs start here): a tile is
    # worth a thread's wake-up and its re-reads of x and w from about this much work; at most
    # this many tiles, enough to share among many cores and to even out 2 or 3 threads, few
    # enough that re-reading x and w per tile stays a few percent of the work.
    LINEAR_MIN_TILE_FLOPS = 16000000
    LINEAR_MAX_TILES = 64
    # Column tiles (the panel and small_gemm paths) repack nothing: a tile costs a call and an
    # atomic, so they may be much smaller, which evens out the threads' shares of the mid-size
    # products of short sequences (the 16e6 / 4 of before made 3 tiles of a MiniLM layer's QKV
    # projection, 12 tokens x 384 -> 1152, on 2 threads: 1.5x one thread, and 1 tile of its
    # output projection). Measured, whole layer (E 384, 12 heads), 2 threads, Zen 1, min of
    # alternating rounds: 12 tokens 540 -> 394 us, 32 tokens 826 -> 779, 64 tokens 1670 ->
    # 1470. Their minimum is MIN_TILE_FLOPS / COLUMN_TILE_SHARE (0.5e6: ~14 us of a Zen 1
    # core, several wake-ups of a spinning OpenMP worker).
    COLUMN_TILE_SHARE = 32
    # BLAS takes 32-bit sizes: a tile's rows and columns stay far below 2**31 whatever the shape.
    MAX_TILE_EDGE = 1 << 20
    # Tile edges are multiples of these (column tiles start on cache-line-friendly offsets).
    COL_ALIGN = 16
    ROW_ALIGN = 8
    # The column tiles of the paths without BLAS are multiples of 48: whole register blocks of
    # weight rows for every micro-kernel (row panels: 6 on AVX2, 12 on AVX-512; small_gemm: 8,
    # 6, 4 or 3), 16 floats too. A tile of 32 columns ended in a block of 2 (4 independent FMA
    # chains, a third of the rate): Zen 2, one thread, 32 x 384 -> 1152 in tiles of 32 / 48
    # columns 91.4 / 99.5 GFLOP/s. Each output's chain of FMAs is the same in any block.
    COLUMN_BLOCK_ALIGN = 48


cdef inline Py_ssize_t _round_up(Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    return (a + b - 1) // b * b


cdef inline Py_ssize_t column_block_width(Py_ssize_t cols, Py_ssize_t min_cols) noexcept nogil:
    """A column block of the paths without BLAS about cols wide: the nearest multiple of
    COLUMN_BLOCK_ALIGN (rounding up could nearly halve the tiles), at least min_cols."""
    return max(_round_up(max(<Py_ssize_t> 1, min_cols), COLUMN_BLOCK_ALIGN),
               (cols + COLUMN_BLOCK_ALIGN // 2) // COLUMN_BLOCK_ALIGN * COLUMN_BLOCK_ALIGN)


cdef inline void linear_tile_grid(Py_ssize_t M, Py_ssize_t N, Py_ssize_t K, bint column_blocks,
                                  double min_tile_flops, Py_ssize_t max_tiles,
                                  Py_ssize_t *tile_rows, Py_ssize_t *tile_cols,
                                  Py_ssize_t min_cols) noexcept nogil:
    """_linear_kernel's tile sizes for an (M, N) output with inner size K: a function of the
    shape only. BLAS tiles: about `target` tiles of near-square shape, side = sqrt(M N /
    target): about N / side columns of tiles and target / that many rows (at least 1 each way).
    Column blocks (the paths without BLAS): a tile repacks nothing, so tiles may be
    COLUMN_TILE_SHARE times smaller, which evens out the threads' shares of small products;
    min_cols bounds their width from below."""
    cdef double flops = 2.0 * M * N * K
    cdef double min_flops = min_tile_flops / COLUMN_TILE_SHARE if column_blocks else min_tile_flops
    cdef double target = max(1.0, min(<double> max_tiles, flops / min_flops))
    cdef double side = sqrt(<double> M * N / target)
    cdef Py_ssize_t col_tiles = max(1, <Py_ssize_t> (N / side + 0.5))
    cdef Py_ssize_t row_tiles = 1 if column_blocks else max(1, <Py_ssize_t> (target / col_tiles + 0.5))
    col_tiles = max(1, <Py_ssize_t> (target / row_tiles + 0.5))
    col_tiles = min(col_tiles, max(1, N // max(1, min_cols)))     # tiles of >= min_cols columns
    tile_rows[0] = min(M, _round_up((M + row_tiles - 1) // row_tiles, ROW_ALIGN), MAX_TILE_EDGE)
    cdef Py_ssize_t cols = (N + col_tiles - 1) // col_tiles
    if column_blocks:
        cols = column_block_width(cols, min_cols)
    else:
        cols = _round_up(cols, COL_ALIGN)
    tile_cols[0] = min(N, cols, MAX_TILE_EDGE)



cdef inline Py_ssize_t panel_min_cols(Py_ssize_t M, Py_ssize_t K, Py_ssize_t itemsize) noexcept nogil:
    """The narrowest panel tile (min_cols of linear_tile_grid) for M rows of K values: wide
    (PANEL_TILE_WEIGHT_BYTES of weight columns) when the packed x is larger than
    PANEL_X_CACHED_BYTES, else 1."""
    if M * K * itemsize > PANEL_X_CACHED_BYTES:
        return PANEL_TILE_WEIGHT_BYTES // (K * itemsize)
    return 1


cdef inline Py_ssize_t panel_group_rows(Py_ssize_t M, Py_ssize_t K, Py_ssize_t itemsize,
                                        Py_ssize_t panel_rows) noexcept nogil:
    """Rows of a panel tile (a multiple of panel_rows, or M): all M while the packed x stays
    in L2 (PANEL_X_CACHED_BYTES), else groups of about PANEL_X_GROUP_BYTES of it."""
    if M * K * itemsize <= PANEL_X_CACHED_BYTES:
        return M
    cdef Py_ssize_t rows = PANEL_X_GROUP_BYTES // max(<Py_ssize_t> 1, K * itemsize)
    return min(M, max(panel_rows, rows // panel_rows * panel_rows))



cdef inline void column_tile_grid(Py_ssize_t M, Py_ssize_t N, Py_ssize_t K,
                                  Py_ssize_t itemsize, Py_ssize_t panel_rows,
                                  double min_tile_flops, Py_ssize_t max_tiles,
                                  Py_ssize_t *tile_rows, Py_ssize_t *tile_cols) noexcept nogil:
    """The tiles of the projections without BLAS: panel_rows > 0, the row panels (tiles at
    least panel_min_cols wide, in row groups of panel_group_rows); 0, small_gemm (column
    blocks over all rows)."""
    linear_tile_grid(M, N, K, True, min_tile_flops, max_tiles, tile_rows, tile_cols,
                     panel_min_cols(M, K, itemsize) if panel_rows > 0 else 1)
    if panel_rows > 0:
        tile_rows[0] = panel_group_rows(M, K, itemsize, panel_rows)

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
