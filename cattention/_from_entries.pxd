# cython: language_level=3, boundscheck=False, wraparound=False
# cython: cdivision=True, initializedcheck=False
"""From an entry table to a Problem: batch entries of their own lengths and
places, as packed variable-length sequences and paged KV caches need them.

Each entry is one (sequence, query head), or one (sequence, K/V head) with
its grouped query heads stacked as rows. Python (``_entries.py``) computes,
per entry, where its query rows, K/V rows, ATTN and LSE rows start and how
many there are; the operands (``_entries.Rows``) give the strides and, for a
paged cache, the page table. The table's arrays have a fixed layout (intp,
one value per entry): problem_from_table takes them as C arrays (the
compiled paged step builds them so), problem_from_entries from the Python
table as typed memoryviews."""

cimport numpy as cnp
from libc.stdlib cimport malloc
from cattention._kernel_table cimport intp_t
from cattention._problem cimport (
    STORE_COMPUTE, STORE_F16, STORE_I8, Operand, Problem, problem_finish, problem_init,
    set_operand)


cdef struct RowsSpec:
    # an operand as the driver reads it (the fields of an ``_entries.Rows``)
    const char *data
    int type_num                 # NPY_FLOAT32, NPY_FLOAT64, NPY_FLOAT16 or NPY_INT8
    Py_ssize_t row_stride, col_stride, page_stride
    const float *scale           # int8: the row scales, at scale_offset of
    const intp_t *scale_offset   # each entry (the table's), else NULL
    Py_ssize_t scale_stride, scale_page_stride


cdef struct EntryTable:
    # an ``_entries.Entries`` table: intp arrays of one value per entry
    # (q_rows and lse_offset may be NULL; page_ids NULL: not paged)
    Py_ssize_t n_entries, n_queries, n_keys, d_k, d_v, n_kv
    const intp_t *q_offset
    const intp_t *k_offset
    const intp_t *v_offset
    const intp_t *kv_index
    const intp_t *kv_length
    const intp_t *out_offset
    const intp_t *q_rows
    const intp_t *lse_offset
    Py_ssize_t ld_out, ld_lse, query_period
    const intp_t *page_ids
    const intp_t *page_first
    Py_ssize_t page_size


cdef inline void set_rows_operand(Operand *op, const RowsSpec *rows, const intp_t *offsets,
                                  const intp_t *page_ids, const intp_t *page_first,
                                  Py_ssize_t page_size) noexcept nogil:
    """An operand: rows of entry b start at offsets[b] (elements from the
    data), or, paged, in the pages page_ids gives (NULL: not paged)."""
    set_operand(op, rows.data, offsets, rows.row_stride, rows.col_stride)
    op.storage = STORE_COMPUTE
    if rows.type_num == cnp.NPY_FLOAT16:
        op.storage = STORE_F16
    elif rows.type_num == cnp.NPY_INT8:
        op.storage = STORE_I8
        op.scale = rows.scale
        op.scale_offset = rows.scale_offset
        op.scale_stride = rows.scale_stride
        op.scale_page_stride = rows.scale_page_stride
    if page_ids != NULL:
        op.page_ids = page_ids
        op.page_first = page_first
        op.page_size = page_size
        op.page_stride = rows.page_stride


cdef inline intp_t *problem_from_table(Problem *pb, const EntryTable *t, const RowsSpec *q,
                                       const RowsSpec *k, const RowsSpec *v, bint causal,
                                       double scale) noexcept nogil:
    """problem_init and the operands of an entry table. Returns the K/V
    sharing index it builds (kv_source and kv_extent of each packed K/V
    entry), for the caller to free() after the call; NULL: no memory."""
    cdef Py_ssize_t n_kv = t.n_kv
    cdef Py_ssize_t b, kv
    problem_init(pb, t.n_entries, t.n_queries, t.n_keys, t.d_k, t.d_v, causal, scale)
    set_rows_operand(&pb.q, q, t.q_offset, NULL, NULL, 0)
    set_rows_operand(&pb.k, k, t.k_offset, t.page_ids, t.page_first, t.page_size)
    set_rows_operand(&pb.v, v, t.v_offset, t.page_ids, t.page_first, t.page_size)
    pb.kv_length = t.kv_length
    if t.q_rows != NULL:
        pb.q_length = t.q_rows
    pb.out_offset = t.out_offset
    pb.ld_out = t.ld_out
    if t.lse_offset != NULL:
        pb.lse_offset = t.lse_offset
        pb.ld_lse = t.ld_lse
    if t.query_period > 0:
        pb.query_period = t.query_period
    # entries reading the same K/V (grouped query heads) share one packed
    # copy, packed up to the longest length any of them sees
    cdef intp_t *index = <intp_t *>malloc(2 * max(n_kv, 1) * sizeof(intp_t))
    if index == NULL:
        return NULL
    cdef intp_t *kv_source = index
    cdef intp_t *kv_extent = index + n_kv
    for kv in range(n_kv):
        kv_source[kv] = -1
        kv_extent[kv] = 0
    for b in range(t.n_entries):
        kv = t.kv_index[b]
        if kv_source[kv] < 0:
            kv_source[kv] = b
        if t.kv_length[b] > kv_extent[kv]:
            kv_extent[kv] = t.kv_length[b]
    pb.n_kv = n_kv
    pb.kv_of_batch = t.kv_index
    pb.kv_source = kv_source
    pb.kv_extent = kv_extent
    problem_finish(pb)
    return index


cdef inline RowsSpec rows_spec(object rows):
    """The RowsSpec of an ``_entries.Rows``."""
    cdef RowsSpec spec
    cdef const intp_t[::1] scale_offset
    cdef cnp.ndarray arr = rows.array
    cdef cnp.ndarray scale = rows.scale
    spec.data = <const char *>cnp.PyArray_DATA(arr)
    spec.type_num = cnp.PyArray_TYPE(arr)
    spec.row_stride = rows.row_stride
    spec.col_stride = rows.col_stride
    spec.page_stride = rows.page_stride
    spec.scale = NULL
    spec.scale_offset = NULL
    spec.scale_stride = 0
    spec.scale_page_stride = 0
    if spec.type_num == cnp.NPY_INT8:
        scale_offset = rows.scale_offset
        spec.scale = <const float *>cnp.PyArray_DATA(scale)
        spec.scale_offset = &scale_offset[0]
        spec.scale_stride = rows.scale_stride
        spec.scale_page_stride = rows.scale_page_stride
    return spec


cdef inline intp_t *problem_from_entries(Problem *pb, object q, object k, object v,
                                         object entries, bint causal,
                                         double scale) except? NULL:
    """problem_from_table for an ``_entries.Entries`` table and its
    ``_entries.Rows`` operands (the table's arrays must outlive the call)."""
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
    cdef cnp.ndarray q_array = q.array
    cdef cnp.ndarray v_array = v.array
    cdef EntryTable t
    cdef RowsSpec q_spec = rows_spec(q)
    cdef RowsSpec k_spec = rows_spec(k)
    cdef RowsSpec v_spec = rows_spec(v)
    t.n_entries = kv_index.shape[0]
    t.n_queries = entries.n_queries
    t.n_keys = entries.n_keys
    # (the module is compiled with wraparound=False: no negative indices)
    t.d_k = cnp.PyArray_DIM(q_array, cnp.PyArray_NDIM(q_array) - 1)
    t.d_v = cnp.PyArray_DIM(v_array, cnp.PyArray_NDIM(v_array) - 1)
    t.n_kv = entries.n_kv
    t.q_offset = &q_offset[0]
    t.k_offset = &k_offset[0]
    t.v_offset = &v_offset[0]
    t.kv_index = &kv_index[0]
    t.kv_length = &kv_length[0]
    t.out_offset = &out_offset[0]
    t.q_rows = &q_rows[0] if q_rows is not None else NULL
    t.lse_offset = &lse_offset[0] if lse_offset is not None else NULL
    t.ld_out = entries.ld_out
    t.ld_lse = entries.ld_lse
    t.query_period = entries.query_period
    t.page_ids = &page_ids[0] if page_ids is not None else NULL
    t.page_first = &page_first[0] if page_first is not None else NULL
    t.page_size = entries.page_size
    cdef intp_t *index = problem_from_table(pb, &t, &q_spec, &k_spec, &v_spec, causal, scale)
    if index == NULL:
        raise MemoryError()
    return index
