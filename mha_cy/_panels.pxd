# Packing x into the row panels of src/row_panel_gemm.c one panel at a time, so that a team of
# threads can share the work: _linear_kernel's projections and _step_kernel's team cimport it.
from cython cimport floating

from ._c_kernels cimport mha_pack_row_panels_f32, mha_pack_row_panels_f64


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
