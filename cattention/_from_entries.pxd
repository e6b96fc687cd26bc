# cython: language_level=3, boundscheck=False, wraparound=False
# cython: cdivision=True, initializedcheck=False
"""From an entry table to a Problem: batch entries of their own lengths and
places, as packed variable-length sequences and paged KV caches need them.

Each entry is one (sequence, query head), or one (sequence, K/V head) with
its grouped query heads stacked as rows. Python (``_entries.py``) computes,
per entry, where its query rows, K/V rows, ATTN and LSE rows start and how
many there are; the operands (``_entries.Rows``) give the strides and, for a
paged cache, the page table. The table's arrays have a fixed layout (intp,
one value per entry), so they arrive as typed memoryviews."""

cimport numpy as cnp
from libc.stdlib cimport malloc
from cattention._kernel_table cimport intp_t
from cattention._problem cimport (
    STORE_COMPUTE, STORE_F16, STORE_I8, Operand, Problem, problem_finish, problem_init,
    set_operand)


cdef inline void set_rows_operand(Operand *op, object rows, const intp_t[::1] offsets,
                                  const intp_t[::1] page_ids, const intp_t[::1] page_first,
                                  Py_ssize_t page_size):
    """An operand from an ``_entries.Rows``: rows of entry b start at
    offsets[b] (elements from the array's data), or, paged, in the pages the
    table gives (page_ids None: not paged)."""
    cdef cnp.ndarray arr = rows.array
    cdef cnp.ndarray scale = rows.scale
    cdef const intp_t[::1] scale_offsets
    set_operand(op, cnp.PyArray_DATA(arr), &offsets[0], rows.row_stride, rows.col_stride)
    cdef int type_num = cnp.PyArray_TYPE(arr)
    op.storage = STORE_COMPUTE
    if type_num == cnp.NPY_FLOAT16:
        op.storage = STORE_F16
    elif type_num == cnp.NPY_INT8:
        op.storage = STORE_I8
        scale_offsets = rows.scale_offset
        op.scale = <const float *>cnp.PyArray_DATA(scale)
        op.scale_offset = &scale_offsets[0]
        op.scale_stride = rows.scale_stride
        op.scale_page_stride = rows.scale_page_stride
    if page_ids is not None:
        op.page_ids = &page_ids[0]
        op.page_first = &page_first[0]
        op.page_size = page_size
        op.page_stride = rows.page_stride


cdef inline intp_t *problem_from_entries(Problem *pb, object q, object k, object v,
                                         object entries, bint causal,
                                         double scale) except? NULL:
    """problem_init and the operands of an ``_entries.Entries`` table.
    Returns the K/V sharing index it builds (kv_source and kv_extent of
    each packed K/V entry), for the caller to free() after the call."""
    cdef const intp_t[::1] q_offset = entries.q_offset
    cdef const intp_t[::1] k_offset = entries.k_offset
    cdef const intp_t[::1] v_offset = entries.v_offset
    cdef const intp_t[::1] kv_index = entries.kv_index
    cdef const intp_t[::1] kv_length = entries.kv_length
    cdef const intp_t[::1] out_offset = entries.out_offset
    cdef const intp_t[::1] q_rows = entries.q_rows
    cdef const intp_t[::1] lse_offset = entries.lse_offset
    cdef const intp_t[::1] page_ids = entries.page_ids
    cdef const intp_t[::1] page_first = entries.page_first
    cdef Py_ssize_t n_entries = kv_index.shape[0]
    cdef Py_ssize_t n_kv = entries.n_kv
    cdef Py_ssize_t b, kv
    cdef cnp.ndarray q_array = q.array
    cdef cnp.ndarray v_array = v.array
    # (the module is compiled with wraparound=False: no negative indices)
    problem_init(pb, n_entries, entries.n_queries, entries.n_keys,
                 cnp.PyArray_DIM(q_array, cnp.PyArray_NDIM(q_array) - 1),
                 cnp.PyArray_DIM(v_array, cnp.PyArray_NDIM(v_array) - 1), causal, scale)
    set_rows_operand(&pb.q, q, q_offset, None, None, 0)
    set_rows_operand(&pb.k, k, k_offset, page_ids, page_first, entries.page_size)
    set_rows_operand(&pb.v, v, v_offset, page_ids, page_first, entries.page_size)
    pb.kv_length = &kv_length[0]
    if q_rows is not None:
        pb.q_length = &q_rows[0]
    pb.out_offset = &out_offset[0]
    pb.ld_out = entries.ld_out
    if lse_offset is not None:
        pb.lse_offset = &lse_offset[0]
        pb.ld_lse = entries.ld_lse
    if entries.query_period > 0:
        pb.query_period = entries.query_period
    # entries reading the same K/V (grouped query heads) share one packed
    # copy, packed up to the longest length any of them sees
    cdef intp_t *index = <intp_t *>malloc(2 * max(n_kv, 1) * sizeof(intp_t))
    if index == NULL:
        raise MemoryError()
    cdef intp_t *kv_source = index
    cdef intp_t *kv_extent = index + n_kv
    for kv in range(n_kv):
        kv_source[kv] = -1
        kv_extent[kv] = 0
    for b in range(n_entries):
        kv = kv_index[b]
        if kv_source[kv] < 0:
            kv_source[kv] = b
        if kv_length[b] > kv_extent[kv]:
            kv_extent[kv] = kv_length[b]
    pb.n_kv = n_kv
    pb.kv_of_batch = &kv_index[0]
    pb.kv_source = kv_source
    pb.kv_extent = kv_extent
    problem_finish(pb)
    return index
