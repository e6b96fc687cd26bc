# cython: language_level=3, boundscheck=False, wraparound=False
# cython: cdivision=True, initializedcheck=False
"""How the rows of an operand are reached: in place when its features are
contiguous and its dtype is the compute dtype, else copied (strided
features) or converted (float16 K/V, int8 K/V times their row scales) into
scratch rows, a block at a time."""

from cython cimport floating
from libc.stdint cimport int8_t, uint16_t
from cattention._problem cimport STORE_F16, STORE_I8, Operand, Problem


cdef inline const floating *rows_in_place(const Problem *pb, const Operand *op, Py_ssize_t b,
                                          Py_ssize_t key0, Py_ssize_t n_keys,
                                          Py_ssize_t n_features, floating *copy,
                                          Py_ssize_t ld_copy, Py_ssize_t *ld,
                                          bint strided_ok) noexcept nogil:
    """Rows key0.. of K or V as compute-dtype values with contiguous features
    (row stride in *ld): where the caller keeps them, or copied into ``copy``
    when they are float16 or int8 (converted) or, unless strided_ok,
    strided. The kernels see the same values either way, so every layout
    gives the same bits."""
    cdef const floating *base = <const floating *>op.data + op.batch_offset[b]
    cdef const floating *row
    cdef Py_ssize_t j, c
    if op.storage == STORE_F16:
        if floating is float:
            pb.kern.half_rows_to_f32(<const uint16_t *>op.data + op.batch_offset[b]
                                     + key0 * op.row_stride, op.row_stride,
                                     op.col_stride, n_keys, n_features, copy, ld_copy)
        ld[0] = ld_copy
        return copy
    if op.storage == STORE_I8:
        if floating is float:
            pb.kern.int8_rows_to_f32(<const int8_t *>op.data + op.batch_offset[b]
                                     + key0 * op.row_stride, op.row_stride,
                                     op.col_stride, n_keys, n_features,
                                     op.scale + op.scale_offset[b] + key0 * op.scale_stride,
                                     op.scale_stride, copy, ld_copy)
        ld[0] = ld_copy
        return copy
    if strided_ok or op.col_stride == 1 or n_features <= 1:
        ld[0] = op.row_stride
        return base + key0 * op.row_stride
    for j in range(n_keys):
        row = base + (key0 + j) * op.row_stride
        for c in range(n_features):
            copy[j * ld_copy + c] = row[c * op.col_stride]
    ld[0] = ld_copy
    return copy


cdef inline const char *contiguous_rows(const Problem *pb, const Operand *op,
                                        Py_ssize_t b, Py_ssize_t key0,
                                        Py_ssize_t n_features) noexcept nogil:
    """Address of row key0 of K or V when its features are contiguous, else
    NULL (for prefetching: rows are operand_itemsize * row_stride bytes
    apart)."""
    if op.col_stride == 1 or n_features <= 1:
        return (<const char *>op.data
                + (op.batch_offset[b] + key0 * op.row_stride) * operand_itemsize(pb, op))
    return NULL


cdef inline Py_ssize_t operand_itemsize(const Problem *pb, const Operand *op) noexcept nogil:
    """Bytes per element as stored."""
    if op.storage == STORE_F16:
        return 2
    if op.storage == STORE_I8:
        return 1
    return pb.itemsize


cdef inline bint int8_in_place(const Operand *op, Py_ssize_t n_features) noexcept nogil:
    """int8 rows the direct kernels read where they are (contiguous features)."""
    return op.storage == STORE_I8 and (op.col_stride == 1 or n_features <= 1)


cdef inline const int8_t *int8_rows(const Operand *op, Py_ssize_t b,
                                    Py_ssize_t key0) noexcept nogil:
    return <const int8_t *>op.data + op.batch_offset[b] + key0 * op.row_stride


cdef inline const float *row_scales(const Operand *op, Py_ssize_t b,
                                    Py_ssize_t key0) noexcept nogil:
    return op.scale + op.scale_offset[b] + key0 * op.scale_stride
