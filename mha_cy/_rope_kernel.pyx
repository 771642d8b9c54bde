"""Rotary position embeddings, in place, over OpenMP threads (the C is src/rope.c).

x is a (B, H, L, D) view with a contiguous last axis: on the fast path the query and key heads
of the QKV projection, rows one QKV row width apart. positions is int64 (P, L) with P = B, or
P = 1 when the batch shares them. A task is ROWS_PER_TASK token rows of one positions row: it
computes their cos/sin once (double precision, the costly part) and rotates every head of those
rows, of every sequence using that positions row. Tasks depend on the shape only, and a row is
rotated by the same code whatever task holds it: the result is bitwise the same for any thread
count.
"""
from libc.stdint cimport int64_t
from libc.stdlib cimport malloc, free
from cython cimport floating
from cython.parallel cimport parallel, prange

from ._c_kernels cimport (mha_rope_table_f32, mha_rope_table_f64, mha_rope_rotate_f32,
                          mha_rope_rotate_f64)
from ._openmp_helpers cimport mha_omp_get_thread_num

# Token rows per task: their cos/sin table (2 * 16 * D/2 values) stays in L1 while every head
# of those rows is rotated. Measured (Zen 1, 1 thread, CPU time, loaded machine), L = 4096,
# 8 + 8 q/k heads of 64, float32: 7.0 ms (interleaved 7.6 ms), of which the cos/sin table in
# double is 4.2 ms (32 ns per position and frequency); the QKV projection it follows took
# 580 ms, so RoPE costs about 1% of a prefill.
cdef Py_ssize_t ROWS_PER_TASK = 16
# Below this many cos/sin pairs plus rotated pairs, one thread: a decode step's few hundred
# pairs take about a microsecond, less than waking a team (a whole call of one token, 16
# heads of 64, costs ~3 us, mostly argument handling).
cdef Py_ssize_t MIN_PARALLEL_PAIRS = 1 << 14


cdef void _rope_task(floating *x, Py_ssize_t sb, Py_ssize_t sh, Py_ssize_t sl, Py_ssize_t B,
                     Py_ssize_t H, Py_ssize_t L, const int64_t *positions, Py_ssize_t P,
                     Py_ssize_t blocks, Py_ssize_t t, const double *inv_freq, Py_ssize_t half,
                     bint interleaved, floating *scratch) noexcept nogil:
    """Task t: rows l0 .. l0 + rows - 1 of positions row p, for batch p (or all when P == 1)."""
    cdef Py_ssize_t p = t // blocks, l0 = (t % blocks) * ROWS_PER_TASK
    cdef Py_ssize_t rows = min(ROWS_PER_TASK, L - l0), b, b0 = p, b1 = p + 1
    cdef floating *cos = scratch
    cdef floating *sin = scratch + ROWS_PER_TASK * half
    if P == 1:
        b0, b1 = 0, B
    if floating is float:
        mha_rope_table_f32(positions + p * L + l0, rows, inv_freq, half, cos, sin)
    else:
        mha_rope_table_f64(positions + p * L + l0, rows, inv_freq, half, cos, sin)
    for b in range(b0, b1):
        if floating is float:
            mha_rope_rotate_f32(x + b * sb + l0 * sl, rows, sl, H, sh, cos, sin, half,
                                interleaved)
        else:
            mha_rope_rotate_f64(x + b * sb + l0 * sl, rows, sl, H, sh, cos, sin, half,
                                interleaved)


def rope(floating[:, :, :, :] x, const int64_t[:, ::1] positions,
         const double[::1] inv_freq, bint interleaved, int n_threads):
    """Rotate the first 2 * len(inv_freq) features of every head of x in place: row l of
    sequence b at the angles positions[b or 0, l] * inv_freq (pairs (i, i + half), or (2i,
    2i + 1) when interleaved). x: a strided (B, H, L, D) view with a contiguous last axis, rows
    and heads not overlapping (a view of a projection). Arguments are checked by the caller
    (mha_cy.rope, mha_cy.attention); this asserts consistency."""
    cdef Py_ssize_t B = x.shape[0], H = x.shape[1], L = x.shape[2], D = x.shape[3]
    cdef Py_ssize_t P = positions.shape[0], half = inv_freq.shape[0]
    if positions.shape[1] != L or P not in (1, B) or 2 * half > D:
        raise ValueError("rope: inconsistent shapes")
    if D > 1 and x.strides[3] != sizeof(floating):
        raise ValueError("rope: the last axis of x must be contiguous")
    if B == 0 or H == 0 or L == 0 or half == 0:
        return
    cdef Py_ssize_t item = sizeof(floating)
    cdef Py_ssize_t sb = x.strides[0] // item, sh = x.strides[1] // item
    cdef Py_ssize_t sl = x.strides[2] // item
    cdef Py_ssize_t blocks = (L + ROWS_PER_TASK - 1) // ROWS_PER_TASK, n_tasks = P * blocks
    cdef Py_ssize_t pairs = P * L * half + B * H * L * half
    cdef int team = <int> max(1, min(<Py_ssize_t> n_threads, n_tasks))
    if pairs < MIN_PARALLEL_PAIRS:
        team = 1
    cdef Py_ssize_t scratch_size = 2 * ROWS_PER_TASK * half
    cdef floating *scratch = <floating *> malloc(team * scratch_size * item)
    if scratch == NULL:
        raise MemoryError("rope: could not allocate the cos/sin tables")
    cdef floating *x_ptr = &x[0, 0, 0, 0]
    cdef const int64_t *pos_ptr = &positions[0, 0]
    cdef const double *freq_ptr = &inv_freq[0]
    cdef Py_ssize_t t
    cdef int tid = 0
    try:
        if team == 1:        # no parallel region: it costs microseconds even for one thread
            with nogil:
                for t in range(n_tasks):
                    _rope_task(x_ptr, sb, sh, sl, B, H, L, pos_ptr, P, blocks, t, freq_ptr,
                               half, interleaved, scratch)
        else:
            with nogil, parallel(num_threads=team):
                tid = mha_omp_get_thread_num()
                for t in prange(n_tasks, schedule='static'):
                    _rope_task(x_ptr, sb, sh, sl, B, H, L, pos_ptr, P, blocks, t, freq_ptr,
                               half, interleaved, scratch + tid * scratch_size)
    finally:
        free(scratch)


def _set_partition(rows_per_task, min_parallel_pairs):
    """Set ROWS_PER_TASK and MIN_PARALLEL_PAIRS (tests: many tasks and threads on small
    shapes); return the old pair."""
    global ROWS_PER_TASK, MIN_PARALLEL_PAIRS
    if rows_per_task < 1 or min_parallel_pairs < 0:
        raise ValueError(f"need rows_per_task >= 1 and min_parallel_pairs >= 0; got "
                         f"({rows_per_task}, {min_parallel_pairs})")
    previous = (ROWS_PER_TASK, MIN_PARALLEL_PAIRS)
    ROWS_PER_TASK, MIN_PARALLEL_PAIRS = rows_per_task, min_parallel_pairs
    return previous
