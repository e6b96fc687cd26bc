# cython: language_level=3, boundscheck=False, wraparound=False
# cython: cdivision=True, initializedcheck=False
"""Results back in the caller's dtype: a float32 result rounded once to
bfloat16 (to nearest even, bit for bit as ml_dtypes rounds) by a compiled
loop, where NumPy's cast goes through ml_dtypes' loop at a few nanoseconds a
value (up to a quarter of a bfloat16 prompt call's time). The compiled
shortcuts' prompt calls (dense and cache calls) need neither: the driver
rounds their rows as it finishes them (Problem.out_bf16)."""

cimport numpy as cnp
from libc.stdint cimport uint16_t
from cattention._driver.kernel_table cimport ca_bfloat16_type, ca_round_to_bfloat16


cdef inline object rounded_to_bfloat16(cnp.ndarray result, object into):
    """The float32 array ``result`` rounded to bfloat16: into ``into`` (an
    array of its shape, or None for a new C-ordered one), which is
    returned."""
    cdef cnp.ndarray dst
    if (cnp.PyArray_TYPE(result) != cnp.NPY_FLOAT32
            or not cnp.PyArray_IS_C_CONTIGUOUS(result)):
        # not the driver's own result: NumPy's cast (ml_dtypes' rounding)
        if into is None:
            return cnp.PyArray_Cast(result, ca_bfloat16_type)
        cnp.PyArray_CopyInto(<cnp.ndarray>into, result)
        return into
    if (into is not None and cnp.PyArray_TYPE(<cnp.ndarray>into) == ca_bfloat16_type
            and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>into)
            and cnp.PyArray_SIZE(<cnp.ndarray>into) == cnp.PyArray_SIZE(result)):
        dst = <cnp.ndarray>into
    else:
        dst = cnp.PyArray_EMPTY(cnp.PyArray_NDIM(result), cnp.PyArray_DIMS(result),
                                ca_bfloat16_type, 0)
    cdef const float *src_data = <const float *>cnp.PyArray_DATA(result)
    cdef uint16_t *dst_data = <uint16_t *>cnp.PyArray_DATA(dst)
    cdef Py_ssize_t n = cnp.PyArray_SIZE(result)
    with nogil:
        ca_round_to_bfloat16(src_data, dst_data, n)
    if into is not None and dst is not into:
        # a strided out=: the rounded values copied into it as they are
        cnp.PyArray_CopyInto(<cnp.ndarray>into, dst)
        return into
    return dst
