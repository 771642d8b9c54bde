# What the compiled calls (_step_kernel, _attention_kernel.sdpa) check before they read an
# array through its raw pointer; shared here so that both take exactly the same arrays.
cimport numpy as cnp


cdef inline bint c_contiguous(object a, int typenum) noexcept:
    """a is a C-contiguous, aligned array of that type in native byte order (the kernels'
    loads assume aligned native elements: an array at an odd byte offset, or a big-endian
    '>f4' one, whose type number is still NPY_FLOAT32, takes the general path, which
    converts it)."""
    return (isinstance(a, cnp.ndarray) and cnp.PyArray_TYPE(<cnp.ndarray> a) == typenum
            and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray> a)
            and cnp.PyArray_ISALIGNED(<cnp.ndarray> a)
            and cnp.PyArray_ISNOTSWAPPED(<cnp.ndarray> a))
