"""The projections of multi-head attention: out := x @ weight.T + bias, tiled over threads
(linear; linear_heads writes the same values head by head, as the attention kernel reads them).

x (M, K) rows are tokens, weight (N, K) is an nn.Linear weight. The output is cut into a grid
of tiles whose sizes depend on the shape alone (never on the thread count), and the threads
take tiles dynamically; each tile is one single-threaded BLAS call. A BLAS call's rounding
depends on its shape, so fixing the tiles by the shape makes the result bitwise the same for
any number of threads. Tiles are near-square (a tile re-reads its rows of x and of the weight:
square tiles re-read the least), except on the two paths that replace BLAS, where tiles are
column blocks over all rows (the panels: over row groups that stay in L2, once the packed x
does not; _kernel_rules.pxd, PANEL_X_GROUP_BYTES):
- up to 8 rows (decode steps), src/small_gemm.c: each thread streams only its own weight rows,
  once, and computes no padding rows;
- every other row count (up to PANEL_MAX_ROWS, unlimited by default), src/row_panel_gemm.c: x
  is packed once into panels shared by the tiles, the weight is read in place (BLAS's per-call
  costs dominate small products, and its tiles ran 2-4x slow above 256 rows: PANEL_MAX_ROWS).
BLAS tiles remain for K = 0 and when tests or tuning lower PANEL_MAX_ROWS.
The K/V heads of padded keys are read by nobody: linear_heads skips their whole panels
(skip_rows). encoder_batched (B8 L512, a quarter of half the batch padded, 1/8 of the K/V
rows) ran 127.5 -> 122 ms (Zen 4, 2 threads, interleaved runs), with the same bits.
"""
from libc.limits cimport INT_MAX
from cpython.pyport cimport PY_SSIZE_T_MAX
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy
from cython cimport floating
from cython.parallel cimport parallel, prange
import numpy as np

from ._c_kernels cimport (MHA_PANEL_ROWS_F32, MHA_PANEL_ROWS_F64, MHA_SMALL_GEMM_MAX_ROWS,
                          MHA_SMALL_GEMM_MIN_WEIGHT_BYTES, mha_small_gemm_f32, mha_small_gemm_f64,
                          mha_row_panels_size_f32, mha_row_panels_size_f64, mha_row_panel_set_isa)
from ._cython_blas cimport _gemm, NoTrans, Trans
from ._kernel_rules cimport (LINEAR_MIN_TILE_FLOPS, LINEAR_MAX_TILES, linear_tile_grid,
                             column_tile_grid)
from ._openmp_helpers cimport mha_omp_barrier
from ._panels cimport pack_panel, panel_gemm_skipping, skipped_panels
from ._aligned cimport malloc_lines

# Up to this many rows src/row_panel_gemm.c replaces BLAS (row_panel_gemm.h: measurements):
# every row count, since single-threaded OpenBLAS tiles are unreliable here. OpenBLAS 0.3.30
# (scipy's, Haswell sgemm kernel, GEMM_P = GEMM_Q = 320 in its gotoblas table) ran our tiles
# (sgemm 'T','N': BLAS's M = the tile's weight rows, N = its token rows) at 4-10 GFLOP/s
# against 35 for one large call (Zen 1, one thread, CPU time): 376 rows x 384 cols x K 384,
# 27 ms; 288 x 384, 15 ms; 384 x 288, 8.6 ms; and in the 'N','T' layout a call of <= 320 rows
# runs 2.8x slower until one call of more rows (and >= 24 columns) has run in the process, for
# good (the pages past the packed-B slab of its buffer, which only such calls write, lazily
# mapped: consistent with the kernel reading ahead into unmapped pages). One run of
# benchmarks/linear_paths.py (a fresh process per figure, CPU time, loaded machine; ms, BLAS
# tiles above 256 rows -> panels, numpy's one large sgemm; 1 thread, then 2):
#   M, K -> N            1 thread               2 threads (total CPU)
#   4096, 768 -> 2304    420 -> 403, 385        445 -> 414, 456
#   4096, 512 -> 1536    688 -> 186, 180        701 -> 199, 218
#   512, 384 -> 1152     34.0 -> 13.0, 14.1     35.7 -> 19.7, 23.8
#   257, 384 -> 1152     18.7 -> 6.8, 7.3       21.1 -> 16.0, 18.3
#   300, 384 -> 1152     18.9 -> 7.6, 8.5       23.5 -> 10.2, 24.0
#   1024, 384 -> 1152    64.0 -> 26.3, 26.3     61.9 -> 25.6, 37.4
#   4096, 384 -> 1152    327 -> 103, 101        327 -> 116, 115
# (128 rows, on panels before too: 768 -> 2304 12.3, 768 -> 768 4.2.)
cdef Py_ssize_t PANEL_MAX_ROWS = PY_SSIZE_T_MAX
# Where src/small_gemm.c replaces BLAS (small_gemm.h has the measurements); variables so that
# tuning and tests can move the crossover (_set_small_gemm_rule).
cdef Py_ssize_t SMALL_GEMM_MAX_ROWS = MHA_SMALL_GEMM_MAX_ROWS
cdef Py_ssize_t SMALL_GEMM_MIN_WEIGHT_BYTES = MHA_SMALL_GEMM_MIN_WEIGHT_BYTES
# The tile grid's rule and constants are in _kernel_rules.pxd (the compiled small call's team
# cuts its projections the same way); these two are knobs for tests (_set_tiling).
cdef double MIN_TILE_FLOPS = LINEAR_MIN_TILE_FLOPS
cdef Py_ssize_t MAX_TILES = LINEAR_MAX_TILES


cdef void _linear_block(const floating *x, Py_ssize_t ldx, const floating *w, Py_ssize_t ldw,
                        const floating *bias, floating *out, Py_ssize_t ldo,
                        Py_ssize_t m, Py_ssize_t n, Py_ssize_t k, bint few_rows) noexcept nogil:
    """out[m, n] := x[m, k] @ w[n, k]^T + bias[n] (bias may be NULL); few_rows: use
    src/small_gemm.c instead of BLAS."""
    cdef Py_ssize_t i, j
    cdef floating beta = 0
    if m <= 0 or n <= 0:
        return
    if few_rows:
        if floating is float:
            mha_small_gemm_f32(x, ldx, w, ldw, bias, out, ldo, m, n, k)
        else:
            mha_small_gemm_f64(x, ldx, w, ldw, bias, out, ldo, m, n, k)
        return
    if bias != NULL:
        for i in range(m):
            for j in range(n):
                out[i * ldo + j] = bias[j]
        beta = 1
    if k == 0:
        if bias == NULL:
            for i in range(m):
                for j in range(n):
                    out[i * ldo + j] = 0
        return
    _gemm(NoTrans, Trans, <int> m, <int> n, <int> k, <floating> 1, x, <int> ldx, w, <int> ldw,
          beta, out, <int> ldo)


cdef inline void _linear_tile(Py_ssize_t t, Py_ssize_t col_tiles, Py_ssize_t tile_rows,
                             Py_ssize_t tile_cols, const floating *x, Py_ssize_t ldx,
                             const floating *w, const floating *bias, floating *out,
                             Py_ssize_t ldo, Py_ssize_t M, Py_ssize_t N, Py_ssize_t K,
                             bint few_rows, const floating *packed, const Py_ssize_t *row_off,
                             Py_ssize_t head_dim, Py_ssize_t head_shift,
                             const unsigned char *skip_panel, Py_ssize_t skip_from) noexcept nogil:
    """Tile t of the grid (row-major order of tiles); packed: x in row panels, or NULL.
    Panels only: the tile (a group of whole panels: tile_rows is a multiple of the panel
    rows, or M) is cut at multiples of head_dim (N: uncut), and column j of head
    h = j // head_dim goes head_shift * h further; row_off: out row i at out + row_off[i]
    instead of i * ldo (linear_heads), or NULL; skip_panel: NULL, or a flag per panel whose
    columns from skip_from (a multiple of head_dim) are written as 0, not computed."""
    cdef Py_ssize_t r0 = (t // col_tiles) * tile_rows, c0 = (t % col_tiles) * tile_cols
    cdef Py_ssize_t c1 = min(c0 + tile_cols, N), h, ce, m = min(tile_rows, M - r0)
    if packed != NULL:   # the tile's rows of every panel it covers, cut at heads
        while c0 < c1:
            h = c0 // head_dim
            ce = min(c1, (h + 1) * head_dim)
            panel_gemm_skipping(r0, m, c0, ce, packed, K, w, ldx, bias, out + h * head_shift,
                                ldo, row_off, skip_panel, skip_from)
            c0 = ce
        return
    _linear_block(x + r0 * ldx, ldx, w + c0 * ldx, ldx, NULL if bias == NULL else bias + c0,
                  out + r0 * ldo + c0, ldo, min(tile_rows, M - r0), c1 - c0, K, few_rows)


def tile_grid(M, N, K, column_blocks=False, min_cols=1):
    """(tile_rows, tile_cols) of _kernel_rules.linear_tile_grid for that shape (for tests and
    tuning). The paths without BLAS use column_tile_grid: its min_cols, and for the panels
    row groups (panel_group_rows) once the packed x outgrows PANEL_X_CACHED_BYTES."""
    cdef Py_ssize_t tr, tc
    linear_tile_grid(M, N, K, column_blocks, MIN_TILE_FLOPS, MAX_TILES, &tr, &tc, min_cols)
    return tr, tc


def linear(const floating[:, ::1] x, const floating[:, ::1] weight, bias,
           floating[:, ::1] out, int n_threads):
    """out := x @ weight.T + bias (bias: None or a (N,) array of x's dtype).

    Shapes are checked by the caller (mha_cy.attention); this only asserts consistency.
    """
    if out.shape[0] != x.shape[0] or out.shape[1] != weight.shape[0]:
        raise ValueError("linear: inconsistent shapes")
    if x.shape[0] and weight.shape[0]:
        _linear(x, weight, bias, &out[0, 0], weight.shape[0], 0, 0, n_threads)
    return out


def linear_heads(const floating[:, ::1] x, const floating[:, ::1] weight, bias,
                 floating[:, :, :, ::1] out, int n_threads, skip_rows=None,
                 Py_ssize_t skip_from=0):
    """linear's product, written head by head: out (B, N // D, L, D), C-contiguous, with
    out[b, h, l, e] = (x @ weight.T + bias)[b * L + l, h * D + e] for x (B * L, K).

    skip_rows: None, or a bool / uint8 (B * L,) array of rows whose heads from column skip_from
    (a multiple of D) nobody reads (the K and V of padded keys): where a whole panel of rows is
    flagged there, they are 0 instead of computed; any other row keeps its value and its bits.

    The same values as linear's, bit for bit, in the layout the attention kernel reads best:
    each head's rows of a sequence D apart. Head views of linear's (B * L, N) output have rows
    N apart, and the attention kernel's tiles of such rows conflicted in L1 (ranges of keys
    4-6 KB apart share few cache sets): q, k, v made contiguous sped up the attention of
    long_causal and encoder_batched 6-8% (Zen 1, 2 threads)."""
    cdef Py_ssize_t B = out.shape[0], L = out.shape[2], D = out.shape[3]
    if x.shape[0] != B * L or out.shape[1] * D != weight.shape[0]:
        raise ValueError("linear_heads: inconsistent shapes")
    cdef const unsigned char[::1] skip
    cdef const unsigned char *skip_ptr = NULL
    if skip_rows is not None and row_skip:
        skip = np.ascontiguousarray(skip_rows).view(np.uint8)
        if skip.shape[0] != x.shape[0] or skip_from % D or not 0 <= skip_from <= weight.shape[0]:
            raise ValueError("linear_heads: inconsistent skip_rows / skip_from")
        if skip.shape[0]:
            skip_ptr = &skip[0]
    if x.shape[0] and weight.shape[0]:     # (C-contiguous: out[b, h, l, e] is where it says)
        _linear(x, weight, bias, &out[0, 0, 0, 0], weight.shape[0], L, D, n_threads, skip_ptr,
                skip_from)
    return out


cdef object _linear(const floating[:, ::1] x, const floating[:, ::1] weight, object bias,
                    floating *o_ptr, Py_ssize_t ldo, Py_ssize_t heads_length,
                    Py_ssize_t head_dim, int n_threads, const unsigned char *skip_rows=NULL,
                    Py_ssize_t skip_from=0):
    """x @ weight.T + bias into o_ptr: rows ldo apart (head_dim 0), or head by head (rows of
    heads_length tokens per sequence, head_dim values per head: linear_heads). M, N > 0.
    skip_rows (head by head only): NULL, or linear_heads' flags (used by the panels)."""
    cdef Py_ssize_t M = x.shape[0], K = x.shape[1], N = weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError("linear: inconsistent shapes")
    cdef const floating[::1] bias_view
    cdef const floating *bias_ptr = NULL
    if bias is not None:
        bias_view = bias
        if bias_view.shape[0] != N:
            raise ValueError("linear: bias length differs from weight rows")
        bias_ptr = &bias_view[0]
    if K > INT_MAX or N > INT_MAX:      # BLAS leading dimensions are 32-bit
        raise ValueError(f"linear: in_features = {K} and out_features = {N} must each be at "
                         f"most {INT_MAX}")

    cdef const floating *x_ptr = &x[0, 0]
    cdef const floating *w_ptr = &weight[0, 0]
    cdef Py_ssize_t ldx = max(K, 1)
    # decode steps: a few rows (small_gemm.h: the panels would compute 16 rows each)
    cdef bint few_rows = (M <= SMALL_GEMM_MAX_ROWS
                          and N * K * sizeof(floating) >= SMALL_GEMM_MIN_WEIGHT_BYTES)
    # the default: x packed once into panels, shared by every column tile
    cdef bint panels = not few_rows and M <= PANEL_MAX_ROWS and K > 0
    cdef floating *packed = NULL
    cdef Py_ssize_t panel_rows = MHA_PANEL_ROWS_F32 if floating is float else MHA_PANEL_ROWS_F64
    cdef Py_ssize_t n_panels = (M + panel_rows - 1) // panel_rows if panels else 0
    # head by head: the panels write each row where row_off says; the other paths (few rows,
    # BLAS tiles) compute into rows of N (tmp), copied into the heads afterwards
    cdef Py_ssize_t *row_off = NULL
    cdef floating *tmp = NULL
    cdef floating *dest = o_ptr
    cdef Py_ssize_t i, p, head_shift = 0
    if head_dim > 0:
        if panels:
            row_off = <Py_ssize_t *> malloc(M * sizeof(Py_ssize_t))
            if row_off == NULL:
                raise MemoryError("linear: could not allocate the row offsets")
            for i in range(M):
                row_off[i] = _head_row_offset(i, heads_length, N, head_dim)
            head_shift = (heads_length - 1) * head_dim
        else:
            tmp = <floating *> malloc(M * N * sizeof(floating))
            if tmp == NULL:
                raise MemoryError("linear: could not allocate the product")
            o_ptr, ldo = tmp, N
    if panels:
        if floating is float:
            packed = <floating *> malloc_lines(mha_row_panels_size_f32(M, K) * sizeof(floating))
        else:
            packed = <floating *> malloc_lines(mha_row_panels_size_f64(M, K) * sizeof(floating))
        if packed == NULL:
            free(row_off)
            raise MemoryError("linear: could not allocate the packed rows of x")
    # panels whose rows are all flagged in skip_rows (the last one: its real rows)
    cdef unsigned char *skip_panel = NULL
    cdef Py_ssize_t n_skipped = 0
    if panels and row_off != NULL and skip_rows != NULL and skip_from < N:
        skip_panel = <unsigned char *> malloc(n_panels)
        if skip_panel == NULL:
            free(packed)
            free(row_off)
            raise MemoryError("linear: could not allocate the panel flags")
        n_skipped = skipped_panels(skip_rows, M, panel_rows, skip_panel)
        if n_skipped == 0:
            free(skip_panel)
            skip_panel = NULL
    cdef Py_ssize_t tile_rows, tile_cols
    if few_rows or panels:   # column blocks (the panels: in row groups that stay in L2)
        column_tile_grid(M, N, K, sizeof(floating), panel_rows if panels else 0,
                         MIN_TILE_FLOPS, MAX_TILES, &tile_rows, &tile_cols)
    else:
        linear_tile_grid(M, N, K, False, MIN_TILE_FLOPS, MAX_TILES, &tile_rows, &tile_cols, 1)
    cdef Py_ssize_t row_tiles = (M + tile_rows - 1) // tile_rows
    cdef Py_ssize_t col_tiles = (N + tile_cols - 1) // tile_cols
    cdef Py_ssize_t n_tiles = row_tiles * col_tiles
    cdef int team = <int> max(1, min(<Py_ssize_t> n_threads, n_tiles))
    cdef Py_ssize_t t
    cdef Py_ssize_t segment = head_dim if row_off != NULL else N   # the tiles' cuts

    if team == 1:        # no parallel region: it costs microseconds even for one thread
        with nogil:
            for p in range(n_panels):
                pack_panel(p, panel_rows, x_ptr, ldx, M, K, packed)
            for t in range(n_tiles):
                _linear_tile(t, col_tiles, tile_rows, tile_cols, x_ptr, ldx, w_ptr, bias_ptr,
                             o_ptr, ldo, M, N, K, few_rows, packed, row_off, segment,
                             head_shift, skip_panel, skip_from)
    else:
        with nogil, parallel(num_threads=team):
            # the panels are packed by the team too (one thread took 5% of a 128-row
            # projection's time); every tile reads all of them
            for p in prange(n_panels, schedule='static'):
                pack_panel(p, panel_rows, x_ptr, ldx, M, K, packed)
            mha_omp_barrier()
            for t in prange(n_tiles, schedule='dynamic'):
                _linear_tile(t, col_tiles, tile_rows, tile_cols, x_ptr, ldx, w_ptr, bias_ptr,
                             o_ptr, ldo, M, N, K, few_rows, packed, row_off, segment,
                             head_shift, skip_panel, skip_from)
    free(packed)
    free(row_off)
    free(skip_panel)
    if tmp != NULL:
        with nogil:
            _scatter_heads(tmp, dest, M, N, heads_length, head_dim)
        free(tmp)


cdef inline Py_ssize_t _head_row_offset(Py_ssize_t i, Py_ssize_t length, Py_ssize_t n,
                                        Py_ssize_t d) noexcept nogil:
    """Where row i of x (token i % length of sequence i // length) starts in head 0 of a
    (B, n // d, length, d) C-contiguous array; head h is h * length * d further."""
    return (i // length) * n * length + (i % length) * d


cdef void _scatter_heads(const floating *src, floating *dest, Py_ssize_t M, Py_ssize_t N,
                         Py_ssize_t length, Py_ssize_t d) noexcept nogil:
    """dest (B, N // d, length, d) := src (B * length, N) split into heads."""
    cdef Py_ssize_t i, h, off
    for i in range(M):
        off = _head_row_offset(i, length, N, d)
        for h in range(N // d):
            memcpy(dest + off + h * length * d, src + i * N + h * d, d * sizeof(floating))


def _set_tiling(min_tile_flops, max_tiles):
    """Set MIN_TILE_FLOPS and MAX_TILES (tests: many tiles on small shapes); return the old pair."""
    global MIN_TILE_FLOPS, MAX_TILES
    if min_tile_flops <= 0 or max_tiles < 1:
        raise ValueError(f"need min_tile_flops > 0 and max_tiles >= 1; got "
                         f"({min_tile_flops}, {max_tiles})")
    previous = (MIN_TILE_FLOPS, MAX_TILES)
    MIN_TILE_FLOPS, MAX_TILES = min_tile_flops, max_tiles
    return previous


# Whether the rules that pick small_gemm or the panels have their default values
# (mha_cy/_step_kernel.pyx reproduces them, and steps aside when a test or tuning moves one).
default_rules = True


def _note_rules():
    global default_rules
    default_rules = ((SMALL_GEMM_MAX_ROWS, SMALL_GEMM_MIN_WEIGHT_BYTES, PANEL_MAX_ROWS)
                     == (MHA_SMALL_GEMM_MAX_ROWS, MHA_SMALL_GEMM_MIN_WEIGHT_BYTES,
                         PY_SSIZE_T_MAX))


def _set_small_gemm_rule(max_rows, min_weight_bytes):
    """Use small_gemm for <= max_rows rows and weights >= min_weight_bytes; return the old pair."""
    global SMALL_GEMM_MAX_ROWS, SMALL_GEMM_MIN_WEIGHT_BYTES
    previous = (SMALL_GEMM_MAX_ROWS, SMALL_GEMM_MIN_WEIGHT_BYTES)
    SMALL_GEMM_MAX_ROWS, SMALL_GEMM_MIN_WEIGHT_BYTES = max_rows, min_weight_bytes
    _note_rules()
    return previous


# Whether linear_heads honours skip_rows, and _step_kernel skips padded keys' rows likewise
# (tests compare the results both ways: _set_row_skip).
row_skip = True


def _set_row_skip(enabled):
    """Let linear_heads skip the flagged rows (True) or compute every row; return the old value."""
    global row_skip
    previous = row_skip
    row_skip = bool(enabled)
    return previous


def _set_panel_max_rows(max_rows):
    """Use src/row_panel_gemm.c up to max_rows rows (0: never); return the old value."""
    global PANEL_MAX_ROWS
    previous = PANEL_MAX_ROWS
    PANEL_MAX_ROWS = max_rows
    _note_rules()
    return previous


def _set_panel_isa(level):
    """Run row_panel_gemm's micro-kernel for ISA level 2 (AVX-512), 1 (AVX2) or 0 (baseline),
    capped at what the CPU has (-1: the best); return the previous level. Tests only."""
    return mha_row_panel_set_isa(level)


def _pack_row_panels(const floating[:, :] x):
    """x (rows of contiguous values, any row stride) packed into src/row_panel_gemm.c's panels
    by the pack of the current ISA level (_set_panel_isa), as a flat array. Tests only."""
    cdef Py_ssize_t m = x.shape[0], k = x.shape[1]
    cdef Py_ssize_t ldx = x.strides[0] // sizeof(floating)
    import numpy as np
    if k > 1 and x.strides[1] != sizeof(floating):
        raise ValueError("x: each row's values must be contiguous")
    if floating is float:
        packed = np.full(mha_row_panels_size_f32(m, k), np.nan, np.float32)
    else:
        packed = np.full(mha_row_panels_size_f64(m, k), np.nan, np.float64)
    cdef floating[::1] out = packed
    if m > 0 and k > 0:
        pack_panel(0, m, &x[0, 0], ldx, m, k, &out[0])
    return packed
