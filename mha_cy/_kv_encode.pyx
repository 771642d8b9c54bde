"""The float16 / int8 encode of a KV cache write on NumPy arrays: src/kv_encode.c, the code
the compiled decode step (_step_kernel) writes with, so that the general path's cache writes
(mha_cy._cache_formats) are the same bits by construction. One C call instead of a dozen
NumPy calls: an int8 decode step's two encodes cost ~90 us in NumPy, ~4 us here."""
cimport numpy as cnp

import numpy as np

from ._c_kernels cimport mha_kv_encode_f16_f32, mha_kv_encode_i8_f32

cnp.import_array()


def encode_f16(x):
    """x.astype(np.float16), bit for bit, without NumPy's overflow warning (beyond float16's
    range: +-inf, as documented); float32 x runs src/kv_encode.c."""
    if getattr(x, "dtype", None) != np.float32:     # one rounding from any other dtype
        with np.errstate(over="ignore"):
            return np.asarray(x).astype(np.float16)
    cdef cnp.ndarray src = np.ascontiguousarray(x)
    cdef cnp.ndarray out = np.empty((<object> src).shape, dtype=np.float16)
    cdef const float *px = <const float *> cnp.PyArray_DATA(src)
    cdef unsigned short *po = <unsigned short *> cnp.PyArray_DATA(out)
    cdef Py_ssize_t n = cnp.PyArray_SIZE(src)
    with nogil:
        mha_kv_encode_f16_f32(px, n, po)
    return out


def encode_i8(x):
    """(values int8 x.shape, scales float32 x.shape[:-1]): the symmetric int8 encoding of
    each row (last axis) of float32 values x (see src/kv_encode.h)."""
    cdef cnp.ndarray src = np.ascontiguousarray(x, dtype=np.float32)
    shape = (<object> src).shape
    cdef int ndim = cnp.PyArray_NDIM(src)
    if ndim == 0:
        raise ValueError("encode_i8: x needs at least one axis (the rows' values)")
    cdef cnp.ndarray out = np.empty(shape, dtype=np.int8)
    cdef cnp.ndarray scales = np.empty(shape[:ndim - 1], dtype=np.float32)
    # (no negative indices: the module is compiled with wraparound off)
    cdef Py_ssize_t d = cnp.PyArray_DIMS(src)[ndim - 1], r
    cdef Py_ssize_t rows = 0 if d == 0 else cnp.PyArray_SIZE(src) // d
    cdef const float *px = <const float *> cnp.PyArray_DATA(src)
    cdef signed char *po = <signed char *> cnp.PyArray_DATA(out)
    cdef float *ps = <float *> cnp.PyArray_DATA(scales)
    if d == 0:
        scales.fill(0)
    with nogil:
        for r in range(rows):
            mha_kv_encode_i8_f32(px + r * d, d, po + r * d, ps + r)
    return out, scales
