# Packing x into the row panels of src/row_panel_gemm.c one panel at a time, so that a team of
# threads can share the work, and computing from them with the rows of padded keys skipped:
# _linear_kernel's projections and _step_kernel's cimport it.
from cython cimport floating
from libc.string cimport memset

from ._c_kernels cimport (mha_pack_row_panels_f32, mha_pack_row_panels_f64, MHA_PANEL_ROWS_F32,
                          MHA_PANEL_ROWS_F64, mha_row_panel_gemm_f32, mha_row_panel_gemm_f64)


cdef inline void pack_panel(Py_ssize_t p, Py_ssize_t panel_rows, const floating *x,
                            Py_ssize_t ldx, Py_ssize_t M, Py_ssize_t K,
                            floating *packed) noexcept nogil:
    """Panel p of x (M rows of K, row stride ldx; rows p * panel_rows ..) into its place in
    packed: panels are independent, so packing them one by one gives the bytes
    mha_pack_row_panels gives for all of x."""
    cdef Py_ssize_t r0 = p * panel_rows
    if floating is float:
        mha_pack_row_panels_f32(x + r0 * ldx, ldx, min(panel_rows, M - r0), K, packed + r0 * K)
    else:
        mha_pack_row_panels_f64(x + r0 * ldx, ldx, min(panel_rows, M - r0), K, packed + r0 * K)


cdef inline Py_ssize_t skipped_panels(const unsigned char *skip_rows, Py_ssize_t M,
                                      Py_ssize_t panel_rows, unsigned char *flags) noexcept nogil:
    """flags[p] = 1 where every row of panel p (of M rows) is flagged in skip_rows, else 0;
    returns how many are."""
    cdef Py_ssize_t p, i, n = 0
    for p in range((M + panel_rows - 1) // panel_rows):
        flags[p] = 1
        for i in range(p * panel_rows, min((p + 1) * panel_rows, M)):
            if not skip_rows[i]:
                flags[p] = 0
                break
        n += flags[p]
    return n


cdef inline void panel_gemm(Py_ssize_t r0, Py_ssize_t m, Py_ssize_t c0, Py_ssize_t c1,
                            const floating *packed, Py_ssize_t K, const floating *w,
                            Py_ssize_t ldw, const floating *bias, floating *out, Py_ssize_t ldo,
                            const Py_ssize_t *row_off) noexcept nogil:
    """Columns [c0, c1) of rows r0 .. r0 + m (r0 at a panel's start) from the packed panels,
    out row i at out + i * ldo, or at out + row_off[i]."""
    cdef floating *o = out if row_off != NULL else out + r0 * ldo
    if row_off != NULL:
        row_off = row_off + r0
    if floating is float:
        mha_row_panel_gemm_f32(packed + r0 * K, m, K, w, ldw, bias, o, ldo, row_off, c0, c1)
    else:
        mha_row_panel_gemm_f64(packed + r0 * K, m, K, w, ldw, bias, o, ldo, row_off, c0, c1)


cdef inline void panel_gemm_skipping(Py_ssize_t r0, Py_ssize_t m, Py_ssize_t c0, Py_ssize_t c1,
                                     const floating *packed, Py_ssize_t K, const floating *w,
                                     Py_ssize_t ldw, const floating *bias, floating *out,
                                     Py_ssize_t ldo, const Py_ssize_t *row_off,
                                     const unsigned char *skip_panel,
                                     Py_ssize_t skip_from) noexcept nogil:
    """panel_gemm, except that from column skip_from on the rows of the panels flagged in
    skip_panel (skipped_panels; NULL: none) get 0 instead of their products: the K and V of
    padded keys, which no kernel reads. Each output is the same chain of FMAs however the
    rows are grouped: every computed value keeps its bits."""
    cdef Py_ssize_t pr = MHA_PANEL_ROWS_F32 if floating is float else MHA_PANEL_ROWS_F64
    cdef Py_ssize_t end = r0 + m, a = r0, b, i
    cdef bint skip
    if skip_panel == NULL or c1 <= skip_from:
        panel_gemm(r0, m, c0, c1, packed, K, w, ldw, bias, out, ldo, row_off)
        return
    if c0 < skip_from:
        panel_gemm(r0, m, c0, skip_from, packed, K, w, ldw, bias, out, ldo, row_off)
        c0 = skip_from
    while a < end:                      # runs of computed panels, runs of skipped ones
        skip = skip_panel[a // pr]
        b = a + pr
        while b < end and skip_panel[b // pr] == skip:
            b += pr
        b = min(b, end)
        if not skip:
            panel_gemm(a, b - a, c0, c1, packed, K, w, ldw, bias, out, ldo, row_off)
        else:
            for i in range(a, b):
                memset(out + (row_off[i] if row_off != NULL else i * ldo) + c0, 0,
                       (c1 - c0) * sizeof(floating))
        a = b


cdef inline void panel_gemm_rows(Py_ssize_t r0, Py_ssize_t m, Py_ssize_t c0, Py_ssize_t c1,
                                 const floating *packed, Py_ssize_t K, const floating *w,
                                 Py_ssize_t ldw, const floating *bias, floating *out,
                                 Py_ssize_t ldo, const Py_ssize_t *row_off, Py_ssize_t kv_rows,
                                 Py_ssize_t kv_from) noexcept nogil:
    """panel_gemm, except that its columns from kv_from on are computed for the packed rows
    below kv_rows only (a multiple of the panel rows; < 0: all): rows packed with the padded
    keys last, whose K and V nobody reads. The same bits for every row computed."""
    if kv_rows < 0 or c1 <= kv_from or r0 + m <= kv_rows:
        panel_gemm(r0, m, c0, c1, packed, K, w, ldw, bias, out, ldo, row_off)
        return
    if c0 < kv_from:
        panel_gemm(r0, m, c0, kv_from, packed, K, w, ldw, bias, out, ldo, row_off)
        c0 = kv_from
    if kv_rows > r0:
        panel_gemm(r0, kv_rows - r0, c0, c1, packed, K, w, ldw, bias, out, ldo, row_off)
