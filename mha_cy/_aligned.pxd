# Buffers that the SIMD kernels read with whole-vector loads start on a cache line. glibc
# serves a large malloc by mmap, 16 bytes past a page boundary, which puts every 64-byte load
# of a row panel across two cache lines (row_panel_gemm from a 16-byte offset: Intel Xeon,
# one thread, 128 x 768 -> 2304 in the library's tiles 125-139 -> 137 GFLOP/s; one 12-column
# block from L1 141-143 -> 145-147). Release with free() (posix_memalign: Linux and macOS).
from posix.stdlib cimport posix_memalign

cdef enum:
    CACHE_LINE_BYTES = 64


cdef inline void *malloc_lines(size_t size) noexcept nogil:
    """size bytes (at least 1) from a cache-line boundary, or NULL; free() releases them."""
    cdef void *p = NULL
    if posix_memalign(&p, CACHE_LINE_BYTES, size if size > 0 else 1) != 0:
        return NULL
    return p


cdef inline Py_ssize_t line_round(Py_ssize_t n, size_t itemsize) noexcept nogil:
    """n items of itemsize bytes (a power of two, at most a line) rounded up to whole lines:
    the next section of a buffer that starts on a line starts on one too."""
    cdef Py_ssize_t per_line = CACHE_LINE_BYTES // itemsize
    return (n + per_line - 1) // per_line * per_line
