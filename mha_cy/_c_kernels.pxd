# The C kernels of src/ (compiled once into the static library every extension links),
# declared once for the Cython modules that call them: `from ._c_kernels cimport ...`.
from libc.stdint cimport int64_t

cdef extern from "small_gemm.h" nogil:
    enum: MHA_SMALL_GEMM_MAX_ROWS
    enum: MHA_SMALL_GEMM_MIN_WEIGHT_BYTES
    void mha_small_gemm_f32(const float *x, Py_ssize_t ldx, const float *w, Py_ssize_t ldw,
                            const float *bias, float *out, Py_ssize_t ldo,
                            Py_ssize_t m, Py_ssize_t n, Py_ssize_t k)
    void mha_small_gemm_f64(const double *x, Py_ssize_t ldx, const double *w, Py_ssize_t ldw,
                            const double *bias, double *out, Py_ssize_t ldo,
                            Py_ssize_t m, Py_ssize_t n, Py_ssize_t k)

cdef extern from "row_panel_gemm.h" nogil:
    Py_ssize_t mha_row_panels_size_f32(Py_ssize_t m, Py_ssize_t k)
    Py_ssize_t mha_row_panels_size_f64(Py_ssize_t m, Py_ssize_t k)
    void mha_pack_row_panels_f32(const float *x, Py_ssize_t ldx, Py_ssize_t m, Py_ssize_t k,
                                 float *packed)
    void mha_pack_row_panels_f64(const double *x, Py_ssize_t ldx, Py_ssize_t m, Py_ssize_t k,
                                 double *packed)
    void mha_row_panel_gemm_f32(const float *packed, Py_ssize_t m, Py_ssize_t k, const float *w,
                                Py_ssize_t ldw, const float *bias, float *out, Py_ssize_t ldo,
                                Py_ssize_t j0, Py_ssize_t j1)
    void mha_row_panel_gemm_f64(const double *packed, Py_ssize_t m, Py_ssize_t k,
                                const double *w, Py_ssize_t ldw, const double *bias,
                                double *out, Py_ssize_t ldo, Py_ssize_t j0, Py_ssize_t j1)
    int mha_row_panel_set_isa(int level)

cdef extern from "rope.h" nogil:
    void mha_rope_table_f32(const int64_t *positions, Py_ssize_t rows, const double *inv_freq,
                            Py_ssize_t half, float *cos_out, float *sin_out)
    void mha_rope_table_f64(const int64_t *positions, Py_ssize_t rows, const double *inv_freq,
                            Py_ssize_t half, double *cos_out, double *sin_out)
    void mha_rope_rotate_f32(float *x, Py_ssize_t rows, Py_ssize_t row_stride, Py_ssize_t heads,
                             Py_ssize_t head_stride, const float *cos, const float *sin,
                             Py_ssize_t half, int interleaved)
    void mha_rope_rotate_f64(double *x, Py_ssize_t rows, Py_ssize_t row_stride,
                             Py_ssize_t heads, Py_ssize_t head_stride, const double *cos,
                             const double *sin, Py_ssize_t half, int interleaved)
