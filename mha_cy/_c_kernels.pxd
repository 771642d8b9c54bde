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
    enum: MHA_PANEL_ROWS_F32
    enum: MHA_PANEL_ROWS_F64
    Py_ssize_t mha_row_panels_size_f32(Py_ssize_t m, Py_ssize_t k)
    Py_ssize_t mha_row_panels_size_f64(Py_ssize_t m, Py_ssize_t k)
    void mha_pack_row_panels_f32(const float *x, Py_ssize_t ldx, Py_ssize_t m, Py_ssize_t k,
                                 float *packed)
    void mha_pack_row_panels_f64(const double *x, Py_ssize_t ldx, Py_ssize_t m, Py_ssize_t k,
                                 double *packed)
    void mha_row_panel_gemm_f32(const float *packed, Py_ssize_t m, Py_ssize_t k, const float *w,
                                Py_ssize_t ldw, const float *bias, float *out, Py_ssize_t ldo,
                                const Py_ssize_t *row_off, Py_ssize_t j0, Py_ssize_t j1)
    void mha_row_panel_gemm_f64(const double *packed, Py_ssize_t m, Py_ssize_t k,
                                const double *w, Py_ssize_t ldw, const double *bias,
                                double *out, Py_ssize_t ldo, const Py_ssize_t *row_off,
                                Py_ssize_t j0, Py_ssize_t j1)
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

cdef extern from "attention_tile.h" nogil:
    void mha_online_softmax_row_f32(float *s, int n, const float *add, Py_ssize_t add_stride,
                                    const unsigned char *pad, int n_skip, int n_valid,
                                    float *m, float *l, float *acc, int dv)
    void mha_online_softmax_row_f64(double *s, int n, const double *add, Py_ssize_t add_stride,
                                    const unsigned char *pad, int n_skip, int n_valid,
                                    double *m, double *l, double *acc, int dv)
    void mha_softmax_row_f32(float *s, int n, const float *add, Py_ssize_t add_stride,
                             const unsigned char *pad, int n_skip, int n_valid)
    void mha_softmax_row_f64(double *s, int n, const double *add, Py_ssize_t add_stride,
                             const unsigned char *pad, int n_skip, int n_valid)
    void mha_finish_rows_f32(const float *acc, const float *l, int rows, int dv, float *out,
                             Py_ssize_t out_rs)
    void mha_finish_rows_f64(const double *acc, const double *l, int rows, int dv, double *out,
                             Py_ssize_t out_rs)

cdef extern from "attention_microkernel.h" nogil:
    int MHA_FUSED_MAX_HEAD_DIM
    Py_ssize_t mha_fused_scratch_f32(int d, int dv)
    Py_ssize_t mha_fused_scratch_f64(int d, int dv)
    void mha_fused_attend_f32(const float *q, Py_ssize_t q_rs, int rows, int d,
                              const float *k, Py_ssize_t k_rs, const float *v, Py_ssize_t v_rs,
                              int dv, Py_ssize_t k_begin, Py_ssize_t k_end, float scale,
                              const float *add, Py_ssize_t add_rs, Py_ssize_t add_ks,
                              const unsigned char *pad, Py_ssize_t limit, Py_ssize_t limit_step,
                              Py_ssize_t window,
                              float *m, float *l, float *acc, float *work)
    void mha_fused_attend_f64(const double *q, Py_ssize_t q_rs, int rows, int d,
                              const double *k, Py_ssize_t k_rs, const double *v,
                              Py_ssize_t v_rs, int dv, Py_ssize_t k_begin, Py_ssize_t k_end,
                              double scale, const double *add, Py_ssize_t add_rs,
                              Py_ssize_t add_ks, const unsigned char *pad, Py_ssize_t limit,
                              Py_ssize_t limit_step, Py_ssize_t window, double *m, double *l,
                              double *acc, double *work)
    int MHA_FUSED_DIRECT_MAX_ROWS
    int MHA_FUSED_DIRECT_MIN_HEAD_DIM
    void mha_fused_attend_direct_f32(const float *q, Py_ssize_t q_rs, int rows, int d,
                                     const float *k, Py_ssize_t k_rs, const float *v,
                                     Py_ssize_t v_rs, int dv, Py_ssize_t k_begin,
                                     Py_ssize_t k_end, float scale, const float *add,
                                     Py_ssize_t add_rs, Py_ssize_t add_ks,
                                     const unsigned char *pad, Py_ssize_t limit,
                                     Py_ssize_t limit_step, Py_ssize_t window, float *m,
                                     float *l, float *acc, float *work)
    void mha_fused_attend_direct_f64(const double *q, Py_ssize_t q_rs, int rows, int d,
                                     const double *k, Py_ssize_t k_rs, const double *v,
                                     Py_ssize_t v_rs, int dv, Py_ssize_t k_begin,
                                     Py_ssize_t k_end, double scale, const double *add,
                                     Py_ssize_t add_rs, Py_ssize_t add_ks,
                                     const unsigned char *pad, Py_ssize_t limit,
                                     Py_ssize_t limit_step, Py_ssize_t window, double *m,
                                     double *l, double *acc, double *work)

cdef extern from "kv_format.h" nogil:
    int MHA_KV_F16
    int MHA_KV_I8
    Py_ssize_t mha_kv_direct_scratch()
    size_t mha_kv_itemsize(int fmt)
    void mha_kv_attend_f32(int fmt, int direct, const float *q, Py_ssize_t q_rs, int rows,
                           int d, const void *k, Py_ssize_t k_rs, const float *k_scale,
                           const void *v, Py_ssize_t v_rs, const float *v_scale, int dv,
                           Py_ssize_t k_begin, Py_ssize_t k_end, float scale,
                           const float *add, Py_ssize_t add_rs, Py_ssize_t add_ks,
                           const unsigned char *pad, Py_ssize_t limit, Py_ssize_t limit_step,
                           Py_ssize_t window, float *m, float *l, float *acc, float *work,
                           float *conv, Py_ssize_t block_k)
    void mha_kv_load_f16_f32(const unsigned short *src, Py_ssize_t src_rs, int n, int d,
                             float *dst, Py_ssize_t dst_rs)
    void mha_kv_load_i8_f32(const signed char *src, Py_ssize_t src_rs, const float *scale,
                            int n, int d, float *dst, Py_ssize_t dst_rs)

cdef extern from "kv_encode.h" nogil:
    void mha_kv_encode_f16_f32(const float *x, Py_ssize_t n, unsigned short *out)
    void mha_kv_encode_i8_f32(const float *x, Py_ssize_t d, signed char *out, float *scale)
