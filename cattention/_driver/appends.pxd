# cython: language_level=3, boundscheck=False, wraparound=False
# cython: cdivision=True, initializedcheck=False
"""Writing a step's new rows into a KV cache in place, contiguous or paged:
the one implementation both the general path (``_prepare/caches.py``, after
every check) and the compiled steps (shortcuts.pxd) write with; and the
compiled steps' reading and writing of native int32 / int64 lengths.
Callers check everything first: every index here lies within its array and
the rows are of the cache's dtype."""

cimport numpy as cnp
from libc.string cimport memcpy
from cattention._driver.kernel_table cimport intp_t


cdef struct CacheRows:
    # where position p of head h of sequence s lies: contiguous, at
    # data + s * seq_stride + h * head_stride + p * row_stride; paged
    # (page_ids not NULL), in page page_ids[s * pages_per_seq + p //
    # page_size] at data + page * seq_stride + h * head_stride + (p %
    # page_size) * row_stride. Strides in bytes; features col_stride apart.
    char *data
    Py_ssize_t itemsize, seq_stride, head_stride, row_stride, col_stride
    const intp_t *page_ids
    Py_ssize_t pages_per_seq, page_size


cdef struct NewRows:
    # row t of head h of sequence s at data + seq_offset[s] + t * row_stride +
    # h * head_stride (bytes), features col_stride apart
    const char *data
    const intp_t *seq_offset
    Py_ssize_t head_stride, row_stride, col_stride


cdef inline void cache_rows_of(CacheRows *cache, cnp.ndarray arr, const intp_t *page_ids,
                               Py_ssize_t pages_per_seq) noexcept:
    """The CacheRows of a 4-D cache (B, H, S_max, d) or pages (n_pages, H,
    page_size, d) with their flattened block table (page_ids not NULL)."""
    cache.data = <char *>cnp.PyArray_DATA(arr)
    cache.itemsize = cnp.PyArray_ITEMSIZE(arr)
    cache.seq_stride = cnp.PyArray_STRIDE(arr, 0)
    cache.head_stride = cnp.PyArray_STRIDE(arr, 1)
    cache.row_stride = cnp.PyArray_STRIDE(arr, 2)
    cache.col_stride = cnp.PyArray_STRIDE(arr, 3)
    cache.page_ids = page_ids
    cache.pages_per_seq = pages_per_seq
    cache.page_size = cnp.PyArray_DIM(arr, 2)


cdef inline void new_rows_of(NewRows *rows, cnp.ndarray arr, intp_t *seq_offset) noexcept:
    """The NewRows of a 4-D (n_seq, H, T, d) array (seq_offset: n_seq slots)."""
    cdef Py_ssize_t s
    for s in range(cnp.PyArray_DIM(arr, 0)):
        seq_offset[s] = s * cnp.PyArray_STRIDE(arr, 0)
    rows.data = <const char *>cnp.PyArray_DATA(arr)
    rows.seq_offset = seq_offset
    rows.head_stride = cnp.PyArray_STRIDE(arr, 1)
    rows.row_stride = cnp.PyArray_STRIDE(arr, 2)
    rows.col_stride = cnp.PyArray_STRIDE(arr, 3)


cdef inline void append_rows(const CacheRows *cache, const NewRows *rows, const intp_t *start,
                             const intp_t *n_new, Py_ssize_t n_seq, Py_ssize_t n_heads,
                             Py_ssize_t n_features) noexcept nogil:
    """Position start[s] + t of sequence s takes new row t, for t < n_new[s],
    every head."""
    cdef Py_ssize_t itemsize = cache.itemsize
    cdef bint whole_rows = cache.col_stride == itemsize and rows.col_stride == itemsize
    cdef Py_ssize_t s, t, h, i, position
    cdef char *dst
    cdef const char *src
    for s in range(n_seq):
        for t in range(n_new[s]):
            position = start[s] + t
            if cache.page_ids != NULL:
                dst = (cache.data + cache.page_ids[s * cache.pages_per_seq
                                                   + position // cache.page_size]
                       * cache.seq_stride + (position % cache.page_size) * cache.row_stride)
            else:
                dst = cache.data + s * cache.seq_stride + position * cache.row_stride
            src = rows.data + rows.seq_offset[s] + t * rows.row_stride
            for h in range(n_heads):
                if whole_rows:
                    memcpy(dst + h * cache.head_stride, src + h * rows.head_stride,
                           n_features * itemsize)
                else:
                    for i in range(n_features):
                        memcpy(dst + h * cache.head_stride + i * cache.col_stride,
                               src + h * rows.head_stride + i * rows.col_stride, itemsize)


cdef inline intp_t load_length(cnp.ndarray lengths, Py_ssize_t s) noexcept:
    """lengths[s] of an aligned native int64 or int32 cache_lengths."""
    cdef char *at = <char *>cnp.PyArray_DATA(lengths) + s * cnp.PyArray_STRIDE(lengths, 0)
    if cnp.PyArray_ITEMSIZE(lengths) == 8:
        return (<long long *>at)[0]
    return (<int *>at)[0]


cdef inline void store_lengths(cnp.ndarray lengths, const intp_t *start,
                               Py_ssize_t n_new) noexcept:
    """lengths[s] = start[s] + n_new for every s, in an aligned native int64
    or int32 cache_lengths (each fits: at most its capacity)."""
    cdef char *at
    cdef Py_ssize_t s
    for s in range(cnp.PyArray_DIM(lengths, 0)):
        at = <char *>cnp.PyArray_DATA(lengths) + s * cnp.PyArray_STRIDE(lengths, 0)
        if cnp.PyArray_ITEMSIZE(lengths) == 8:
            (<long long *>at)[0] = start[s] + n_new
        else:
            (<int *>at)[0] = <int>(start[s] + n_new)
