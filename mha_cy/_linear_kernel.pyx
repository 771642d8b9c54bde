"""The projections of multi-head attention: out := x @ weight.T + bias, tiled over threads.

x (M, K) rows are tokens, weight (N, K) is an nn.Linear weight. The output is cut into a grid
of tiles whose sizes depend on the shape alone (never on the thread count), and the threads
take tiles dynamically; each tile is one single-threaded BLAS call. A BLAS call's rounding
depends on its shape, so fixing the tiles by the shape makes the result bitwise the same for
any number of threads. Tiles are near-square (a tile re-reads its rows of x and of the weight:
square tiles re-read the least), except for decode steps: with a handful of rows against a
weight larger than L2, tiles are column blocks (each thread streams only its own weight rows)
computed by src/small_gemm.c instead of BLAS.
"""
from libc.math cimport sqrt
from cython cimport floating
from cython.parallel cimport parallel, prange

from ._cython_blas cimport _gemm, NoTrans, Trans

cdef extern from "small_gemm.h" nogil:
    enum: MHA_SMALL_GEMM_MAX_ROWS
    enum: MHA_SMALL_GEMM_MIN_WEIGHT_BYTES
    void mha_small_gemm_f32(const float *x, Py_ssize_t ldx, const float *w, Py_ssize_t ldw,
                            const float *bias, float *out, Py_ssize_t ldo,
                            Py_ssize_t m, Py_ssize_t n, Py_ssize_t k)
    void mha_small_gemm_f64(const double *x, Py_ssize_t ldx, const double *w, Py_ssize_t ldw,
                            const double *bias, double *out, Py_ssize_t ldo,
                            Py_ssize_t m, Py_ssize_t n, Py_ssize_t k)

# A tile is worth a thread's wake-up and its re-reads of x and w from about this much work.
cdef double MIN_TILE_FLOPS = 16e6
# At most this many tiles: enough to share among many cores and to even out 2 or 3 threads,
# few enough that re-reading x and w per tile stays a few percent of the work.
cdef Py_ssize_t MAX_TILES = 64
# Tile edges are multiples of these (column tiles start on cache-line-friendly offsets).
cdef Py_ssize_t COL_ALIGN = 16
cdef Py_ssize_t ROW_ALIGN = 8


cdef inline Py_ssize_t _round_up(Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    return (a + b - 1) // b * b


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


cdef void _tile_grid(Py_ssize_t M, Py_ssize_t N, Py_ssize_t K, bint few_rows,
                     Py_ssize_t *tile_rows, Py_ssize_t *tile_cols) noexcept nogil:
    """Tile sizes for an (M, N) output with inner size K: a function of the shape only.
    About `target` tiles of near-square shape: the grid has round(M / side) x round(N / side)
    tiles (at least 1 each way) for side = sqrt(M N / target)."""
    cdef double flops = 2.0 * M * N * K
    cdef double target = max(1.0, min(<double> MAX_TILES, flops / MIN_TILE_FLOPS))
    cdef double side = sqrt(<double> M * N / target)
    cdef Py_ssize_t row_tiles = 1 if few_rows else max(1, <Py_ssize_t> (M / side + 0.5))
    cdef Py_ssize_t col_tiles = max(1, <Py_ssize_t> (target / row_tiles + 0.5))
    tile_rows[0] = min(M, _round_up((M + row_tiles - 1) // row_tiles, ROW_ALIGN))
    tile_cols[0] = min(N, _round_up((N + col_tiles - 1) // col_tiles, COL_ALIGN))


def tile_grid(M, N, K, few_rows=False):
    """(tile_rows, tile_cols) the kernel uses for that shape (for tests and tuning)."""
    cdef Py_ssize_t tr, tc
    _tile_grid(M, N, K, few_rows, &tr, &tc)
    return tr, tc


def linear(const floating[:, ::1] x, const floating[:, ::1] weight, bias,
           floating[:, ::1] out, int n_threads):
    """out := x @ weight.T + bias (bias: None or a (N,) array of x's dtype).

    Shapes are checked by the caller (mha_cy.attention); this only asserts consistency.
    """
    cdef Py_ssize_t M = x.shape[0], K = x.shape[1], N = weight.shape[0]
    if weight.shape[1] != K or out.shape[0] != M or out.shape[1] != N:
        raise ValueError("linear: inconsistent shapes")
    cdef const floating[::1] bias_view
    cdef const floating *bias_ptr = NULL
    if bias is not None:
        bias_view = bias
        if bias_view.shape[0] != N:
            raise ValueError("linear: bias length differs from weight rows")
        bias_ptr = &bias_view[0]
    if M == 0 or N == 0:
        return out

    cdef const floating *x_ptr = &x[0, 0]
    cdef const floating *w_ptr = &weight[0, 0]
    cdef floating *o_ptr = &out[0, 0]
    cdef Py_ssize_t ldx = max(K, 1), ldo = N
    # decode steps: a few rows against a weight larger than L2 (small_gemm.h)
    cdef bint few_rows = (M <= MHA_SMALL_GEMM_MAX_ROWS
                          and N * K * sizeof(floating) >= MHA_SMALL_GEMM_MIN_WEIGHT_BYTES)
    cdef Py_ssize_t tile_rows, tile_cols
    _tile_grid(M, N, K, few_rows, &tile_rows, &tile_cols)
    cdef Py_ssize_t row_tiles = (M + tile_rows - 1) // tile_rows
    cdef Py_ssize_t col_tiles = (N + tile_cols - 1) // tile_cols
    cdef Py_ssize_t n_tiles = row_tiles * col_tiles
    cdef int team = <int> max(1, min(<Py_ssize_t> n_threads, n_tiles))
    cdef Py_ssize_t t, r0, c0

    if team == 1:        # no parallel region: it costs microseconds even for one thread
        with nogil:
            for t in range(n_tiles):
                r0 = (t // col_tiles) * tile_rows
                c0 = (t % col_tiles) * tile_cols
                _linear_block(x_ptr + r0 * ldx, ldx, w_ptr + c0 * ldx, ldx,
                              NULL if bias_ptr == NULL else bias_ptr + c0,
                              o_ptr + r0 * ldo + c0, ldo, min(tile_rows, M - r0),
                              min(tile_cols, N - c0), K, few_rows)
        return out
    with nogil, parallel(num_threads=team):
        for t in prange(n_tiles, schedule='dynamic'):
            r0 = (t // col_tiles) * tile_rows
            c0 = (t % col_tiles) * tile_cols
            _linear_block(x_ptr + r0 * ldx, ldx, w_ptr + c0 * ldx, ldx,
                          NULL if bias_ptr == NULL else bias_ptr + c0, o_ptr + r0 * ldo + c0,
                          ldo, min(tile_rows, M - r0), min(tile_cols, N - c0), K, few_rows)
    return out


def _set_tiling(min_tile_flops, max_tiles):
    """Set MIN_TILE_FLOPS and MAX_TILES (tests: many tiles on small shapes); return the old pair."""
    global MIN_TILE_FLOPS, MAX_TILES
    if min_tile_flops <= 0 or max_tiles < 1:
        raise ValueError(f"need min_tile_flops > 0 and max_tiles >= 1; got "
                         f"({min_tile_flops}, {max_tiles})")
    previous = (MIN_TILE_FLOPS, MAX_TILES)
    MIN_TILE_FLOPS, MAX_TILES = min_tile_flops, max_tiles
    return previous
