# cython: language_level=3, boundscheck=False, wraparound=False
# cython: cdivision=True, initializedcheck=False
"""How the rows of an operand are reached: through its batch offsets, or a
page table for a paged K/V cache (rows contiguous within a page); in place
when its features are contiguous and its dtype is the compute dtype, else
copied (strided features, rows of several pages) or converted (float16 and
bfloat16 q, K and V, int8 and fp8 K/V times their row scales) into scratch
rows, a block at a time."""

from cython cimport floating
from libc.stdint cimport int8_t, uint8_t, uint16_t
from cattention._driver.kernel_table cimport intp_t
from cattention._driver.problem cimport (
    STORE_BF16, STORE_COMPUTE, STORE_F16, STORE_I8, Operand, Problem, fp8_format, is_fp8,
    is_one_byte)


cdef inline Py_ssize_t entry_row_offset(const Operand *op, const intp_t *start,
                                        Py_ssize_t stride, Py_ssize_t page_stride,
                                        Py_ssize_t b, Py_ssize_t row) noexcept nogil:
    """Offset of row ``row`` of entry b in an array whose entry b starts at
    start[b] and whose rows are ``stride`` apart, paged as op is (then each
    page id steps page_stride): the rows of op, or their int8 / fp8 scales."""
    if op.page_ids == NULL:
        return start[b] + row * stride
    return (start[b] + op.page_ids[op.page_first[b] + row // op.page_size] * page_stride
            + (row % op.page_size) * stride)


cdef inline Py_ssize_t row_offset(const Operand *op, Py_ssize_t b,
                                  Py_ssize_t row) noexcept nogil:
    """Element offset from op.data of row ``row`` of batch entry b."""
    return entry_row_offset(op, op.batch_offset, op.row_stride, op.page_stride, b, row)


cdef inline Py_ssize_t scale_row_offset(const Operand *op, Py_ssize_t b,
                                        Py_ssize_t row) noexcept nogil:
    """Offset from op.scale of the int8 / fp8 scale of row ``row`` of entry b."""
    return entry_row_offset(op, op.scale_offset, op.scale_stride, op.scale_page_stride, b, row)


cdef inline Py_ssize_t contiguous_run(const Operand *op, Py_ssize_t row,
                                      Py_ssize_t n_rows) noexcept nogil:
    """How many of the n_rows rows from ``row`` are row_stride apart: all,
    unless the operand is paged (then up to the end of row's page)."""
    cdef Py_ssize_t left
    if op.page_ids == NULL:
        return n_rows
    left = op.page_size - row % op.page_size
    return left if left < n_rows else n_rows


cdef inline bint features_contiguous(const Operand *op, Py_ssize_t n_features) noexcept nogil:
    """Whether a row's n_features features lie next to each other."""
    return op.col_stride == 1 or n_features <= 1


cdef inline const floating *rows_in_place(const Problem *pb, const Operand *op, Py_ssize_t b,
                                          Py_ssize_t key0, Py_ssize_t n_keys,
                                          Py_ssize_t n_features, floating *copy,
                                          Py_ssize_t ld_copy, Py_ssize_t *ld,
                                          Py_ssize_t *col) noexcept nogil:
    """Rows key0.. of K or V as compute-dtype values (row stride in *ld):
    where the caller keeps them, or copied into ``copy`` (rows ld_copy apart,
    features contiguous) when they are float16, int8 or fp8 (converted), span
    pages (gathered) or are strided and col is NULL. With col, strided rows
    in one run may stay where they are, and *col is the feature stride of
    the rows returned (1 for a copy). The kernels see the same values
    either way, so every layout gives the same bits."""
    cdef Py_ssize_t j, run
    if col != NULL:
        col[0] = 1
    if contiguous_run(op, key0, n_keys) < n_keys:
        # a paged operand, rows from several pages: page by page into copy
        j = 0
        while j < n_keys:
            run = contiguous_run(op, key0 + j, n_keys - j)
            copy_rows(pb, op, b, key0 + j, run, n_features, copy + j * ld_copy, ld_copy)
            j += run
        ld[0] = ld_copy
        return copy
    if op.storage == STORE_COMPUTE and (col != NULL or features_contiguous(op, n_features)):
        ld[0] = op.row_stride
        if col != NULL:
            col[0] = op.col_stride
        return <const floating *>op.data + row_offset(op, b, key0)
    copy_rows(pb, op, b, key0, n_keys, n_features, copy, ld_copy)
    ld[0] = ld_copy
    return copy


cdef inline void copy_rows(const Problem *pb, const Operand *op, Py_ssize_t b,
                           Py_ssize_t key0, Py_ssize_t n_keys, Py_ssize_t n_features,
                           floating *copy, Py_ssize_t ld_copy) noexcept nogil:
    """Rows key0.. (row_stride apart) as compute-dtype values into copy."""
    cdef Py_ssize_t at = row_offset(op, b, key0)
    cdef const floating *row
    cdef Py_ssize_t j, c
    if op.storage == STORE_F16:
        if floating is float:
            pb.kern.half_rows_to_f32(<const uint16_t *>op.data + at, op.row_stride,
                                     op.col_stride, n_keys, n_features, copy, ld_copy)
        return
    if op.storage == STORE_BF16:
        if floating is float:
            pb.kern.bf16_rows_to_f32(<const uint16_t *>op.data + at, op.row_stride,
                                     op.col_stride, n_keys, n_features, copy, ld_copy)
        return
    if op.storage == STORE_I8:
        if floating is float:
            pb.kern.int8_rows_to_f32(<const int8_t *>op.data + at, op.row_stride,
                                     op.col_stride, n_keys, n_features,
                                     op.scale + scale_row_offset(op, b, key0),
                                     op.scale_stride, copy, ld_copy)
        return
    if is_fp8(op.storage):
        if floating is float:
            pb.kern.fp8_rows_to_f32(<const uint8_t *>op.data + at, op.row_stride,
                                    op.col_stride, n_keys, n_features, fp8_format(op.storage),
                                    op.scale + scale_row_offset(op, b, key0),
                                    op.scale_stride, copy, ld_copy)
        return
    for j in range(n_keys):
        row = <const floating *>op.data + at + j * op.row_stride
        if op.col_stride == 1:
            for c in range(n_features):
                copy[j * ld_copy + c] = row[c]
        else:
            for c in range(n_features):
                copy[j * ld_copy + c] = row[c * op.col_stride]


cdef inline const char *contiguous_rows(const Problem *pb, const Operand *op,
                                        Py_ssize_t b, Py_ssize_t key0, Py_ssize_t n_keys,
                                        Py_ssize_t n_features) noexcept nogil:
    """Address of row key0 of K or V when its features are contiguous and
    its rows key0..key0 + n_keys lie row_stride apart (within one page of a
    paged operand), else NULL (for prefetching: rows are operand_itemsize *
    row_stride bytes apart)."""
    if features_contiguous(op, n_features) and contiguous_run(op, key0, n_keys) == n_keys:
        return (<const char *>op.data + row_offset(op, b, key0) * operand_itemsize(pb, op))
    return NULL


cdef inline Py_ssize_t operand_itemsize(const Problem *pb, const Operand *op) noexcept nogil:
    """Bytes per element as stored."""
    if op.storage == STORE_F16 or op.storage == STORE_BF16:
        return 2
    if is_one_byte(op.storage):
        return 1
    return pb.itemsize


cdef inline Py_ssize_t rows_span(const Problem *pb, const Operand *op, Py_ssize_t b,
                                 Py_ssize_t row0, Py_ssize_t n_rows, Py_ssize_t n_features,
                                 const void **start) noexcept nogil:
    """Bytes of rows row0 .. row0 + n_rows of entry b of q, K or V when they
    lie back to back in the caller's array (start: their first byte), or 0:
    paged, strided, or rows apart (prefetching the span would fetch others)."""
    if (op.page_ids != NULL or n_rows <= 0
            or not features_contiguous(op, n_features)
            or (op.row_stride != n_features and n_rows > 1)):
        return 0
    start[0] = op.data + row_offset(op, b, row0) * operand_itemsize(pb, op)
    return n_rows * n_features * operand_itemsize(pb, op)


cdef inline const int8_t *int8_rows(const Operand *op, Py_ssize_t b,
                                    Py_ssize_t key0) noexcept nogil:
    return <const int8_t *>op.data + row_offset(op, b, key0)


cdef inline const int8_t *byte_rows_for_kernel(const Operand *op, Py_ssize_t b,
                                               Py_ssize_t key0, Py_ssize_t n_keys,
                                               Py_ssize_t n_features, int8_t *copy,
                                               Py_ssize_t *ld) noexcept nogil:
    """int8 or fp8 rows key0.. (within one page) with contiguous features,
    for the direct int8 and fp8 kernels (row stride in *ld): where they are,
    or their bytes gathered into ``copy`` when the features are strided.
    Dequantizing strided rows instead would round differently from the
    direct kernels, and every layout must give the bits of a contiguous
    copy."""
    cdef const int8_t *rows = int8_rows(op, b, key0)
    # strides in locals: byte stores may alias anything, *op included
    cdef Py_ssize_t row_stride = op.row_stride
    cdef Py_ssize_t col_stride = op.col_stride
    cdef Py_ssize_t j, c
    cdef const int8_t *row
    cdef int8_t *out
    if col_stride == 1 or n_features <= 1:
        ld[0] = row_stride
        return rows
    for j in range(n_keys):
        row = rows + j * row_stride
        out = copy + j * n_features
        for c in range(n_features):
            out[c] = row[c * col_stride]
    ld[0] = n_features
    return copy


cdef inline const float *row_scales(const Operand *op, Py_ssize_t b,
                                    Py_ssize_t key0) noexcept nogil:
    return op.scale + scale_row_offset(op, b, key0)
