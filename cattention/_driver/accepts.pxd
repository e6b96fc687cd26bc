# cython: language_level=3, boundscheck=False, wraparound=False
# cython: cdivision=True, initializedcheck=False
"""What the compiled shortcuts (shortcuts.pxd) accept: arrays of the kinds,
layouts and dtypes the driver reads as they are, and writes that certainly
touch nothing they read. Each test answers yes or no; none raises (a no
sends the call to the general path, which names what is wrong)."""

cimport numpy as cnp
from libc.math cimport fabs
from cattention._driver.from_arrays cimport fill_strided
from cattention._driver.kernel_table cimport ca_bfloat16_type, intp_t


cdef inline bint usable_input(cnp.ndarray arr, int type_num) noexcept:
    """Aligned, in native byte order, of type_num, every stride a multiple
    of the itemsize."""
    cdef int d
    cdef Py_ssize_t itemsize
    if (cnp.PyArray_TYPE(arr) != type_num or not cnp.PyArray_ISALIGNED(arr)
            or not cnp.PyArray_ISNOTSWAPPED(arr)):
        return False
    itemsize = cnp.PyArray_ITEMSIZE(arr)
    for d in range(cnp.PyArray_NDIM(arr)):
        if cnp.PyArray_STRIDE(arr, d) % itemsize != 0:
            return False
    return True


cdef inline bint are_ndarrays(object a, object b, object c) noexcept:
    return type(a) is cnp.ndarray and type(b) is cnp.ndarray and type(c) is cnp.ndarray


cdef inline void byte_span(cnp.ndarray arr, char **low, char **high) noexcept:
    """The bytes [low, high) that the elements of the nonempty arr lie in."""
    cdef char *data = <char *>cnp.PyArray_DATA(arr)
    cdef Py_ssize_t below = 0
    cdef Py_ssize_t above = cnp.PyArray_ITEMSIZE(arr)
    cdef Py_ssize_t d, extent
    for d in range(cnp.PyArray_NDIM(arr)):
        extent = cnp.PyArray_STRIDE(arr, d) * (cnp.PyArray_DIM(arr, d) - 1)
        if extent < 0:
            below += extent
        else:
            above += extent
    low[0] = data + below
    high[0] = data + above


cdef inline bint apart(cnp.ndarray a, cnp.ndarray b) noexcept:
    """a and b certainly share no memory: their byte spans do not meet.
    (Spans that meet may still interleave without sharing an element; the
    general path decides those exactly.)"""
    cdef char *a_low
    cdef char *a_high
    cdef char *b_low
    cdef char *b_high
    byte_span(a, &a_low, &a_high)
    byte_span(b, &b_low, &b_high)
    return a_high <= b_low or b_high <= a_low


cdef inline bint without_self_overlap(cnp.ndarray arr) noexcept:
    """No two elements of arr share memory: along its axes by increasing
    stride, each stride clears the extent of the axes before it. (A
    broadcast or as_strided array that fails this is written by the general
    path, element by element in NumPy's order.)"""
    cdef Py_ssize_t stride[8]
    cdef Py_ssize_t extent[8]
    cdef Py_ssize_t n = 0
    cdef Py_ssize_t d, i, j, s, e
    cdef Py_ssize_t covered = cnp.PyArray_ITEMSIZE(arr)
    for d in range(cnp.PyArray_NDIM(arr)):
        if cnp.PyArray_DIM(arr, d) > 1:
            stride[n] = abs(cnp.PyArray_STRIDE(arr, d))
            extent[n] = stride[n] * (cnp.PyArray_DIM(arr, d) - 1)
            n += 1
    # insertion sort of at most 4 axes by stride
    for i in range(1, n):
        s, e = stride[i], extent[i]
        j = i - 1
        while j >= 0 and stride[j] > s:
            stride[j + 1], extent[j + 1] = stride[j], extent[j]
            j -= 1
        stride[j + 1], extent[j + 1] = s, e
    for i in range(n):
        if stride[i] < covered:
            return False
        covered += extent[i]
    return True


cdef inline bint writes_apart(cnp.ndarray k_cache, cnp.ndarray v_cache, cnp.ndarray lengths,
                              cnp.ndarray q, cnp.ndarray k_new, cnp.ndarray v_new) noexcept:
    """Whether a step may append to k_cache and v_cache and advance lengths in
    place: each writable, no element of one overlapping another of itself,
    and the three apart from each other and from q, k_new and v_new."""
    return (cnp.PyArray_ISWRITEABLE(k_cache) and cnp.PyArray_ISWRITEABLE(v_cache)
            and cnp.PyArray_ISWRITEABLE(lengths)
            and without_self_overlap(k_cache) and without_self_overlap(v_cache)
            and without_self_overlap(lengths)
            and apart(k_cache, v_cache) and apart(k_cache, lengths) and apart(v_cache, lengths)
            and apart(k_cache, q) and apart(v_cache, q) and apart(lengths, q)
            and apart(k_cache, k_new) and apart(v_cache, k_new) and apart(lengths, k_new)
            and apart(k_cache, v_new) and apart(v_cache, v_new) and apart(lengths, v_new))


cdef inline bint half_holds(cnp.ndarray rows) noexcept:
    """Every element of the 4-D float32 array rows is finite and rounds to a
    finite float16 (below 65520 in magnitude): converting it neither
    overflows nor warns (the general path refuses the others by name)."""
    cdef char *data = <char *>cnp.PyArray_DATA(rows)
    cdef Py_ssize_t b, h, t, i
    cdef const char *row
    for b in range(cnp.PyArray_DIM(rows, 0)):
        for h in range(cnp.PyArray_DIM(rows, 1)):
            for t in range(cnp.PyArray_DIM(rows, 2)):
                row = (data + b * cnp.PyArray_STRIDE(rows, 0) + h * cnp.PyArray_STRIDE(rows, 1)
                       + t * cnp.PyArray_STRIDE(rows, 2))
                for i in range(cnp.PyArray_DIM(rows, 3)):
                    # false for NaN too
                    if not fabs((<const float *>(row + i * cnp.PyArray_STRIDE(rows, 3)))[0]) \
                            < 65520.0:
                        return False
    return True


cdef inline bint output_fits(double n_values, Py_ssize_t itemsize) noexcept:
    """An output of n_values an array can hold (else the general path names it)."""
    return n_values * itemsize < 9.2e18


cdef inline bint serving_step_arrays(object q, object k_cache, object v_cache, object lengths,
                                     object k_new, object v_new) noexcept:
    """A serving step's arrays are ndarrays, k_new and v_new both given or
    both None."""
    if not are_ndarrays(q, k_cache, v_cache) or type(lengths) is not cnp.ndarray:
        return False
    if (k_new is None) != (v_new is None):
        return False
    return k_new is None or (type(k_new) is cnp.ndarray and type(v_new) is cnp.ndarray)


cdef inline int compute_type(int type_num) noexcept:
    """The type a shortcut computes arrays of type_num in: float32 and
    float64 their own, bfloat16 float32; -1 for any other (the general path
    takes float16 and mixed dtypes)."""
    if type_num == cnp.NPY_FLOAT32 or type_num == cnp.NPY_FLOAT64:
        return type_num
    if type_num == ca_bfloat16_type and type_num >= 0:
        return cnp.NPY_FLOAT32
    return -1


cdef inline bint serving_step_dtypes(int q_type, int cache_type) noexcept:
    """q float32, float64 or bfloat16 and caches of q's type, or float16 or
    bfloat16 caches beside a float32 q: the element types a compiled step
    computes."""
    if compute_type(q_type) < 0:
        return False
    return cache_type == q_type or (q_type == cnp.NPY_FLOAT32 and (
        cache_type == cnp.NPY_FLOAT16 or cache_type == ca_bfloat16_type))


cdef inline bint plain_lengths(cnp.ndarray lengths, Py_ssize_t capacity) noexcept:
    """cache_lengths a compiled step reads and writes: int64, or int32 when
    it holds every position."""
    return usable_input(lengths, cnp.NPY_INT64) or (
        usable_input(lengths, cnp.NPY_INT32) and capacity <= 2147483647)


cdef inline bint new_rows_shaped(cnp.ndarray k_new, cnp.ndarray v_new, Py_ssize_t n_seq,
                                 Py_ssize_t n_kv_heads, Py_ssize_t d_k,
                                 Py_ssize_t d_v) noexcept:
    """k_new and v_new of shapes (n_seq, H_kv, T_new, d_k / d_v), one T_new."""
    return (cnp.PyArray_NDIM(k_new) == 4 and cnp.PyArray_NDIM(v_new) == 4
            and cnp.PyArray_DIM(k_new, 0) == n_seq and cnp.PyArray_DIM(v_new, 0) == n_seq
            and cnp.PyArray_DIM(k_new, 1) == n_kv_heads
            and cnp.PyArray_DIM(v_new, 1) == n_kv_heads
            and cnp.PyArray_DIM(v_new, 2) == cnp.PyArray_DIM(k_new, 2)
            and cnp.PyArray_DIM(k_new, 3) == d_k and cnp.PyArray_DIM(v_new, 3) == d_v)


cdef inline bint step_arrays_fit(cnp.ndarray q, cnp.ndarray k_store, cnp.ndarray v_store,
                                 cnp.ndarray lengths, Py_ssize_t n_seq, int q_type,
                                 int store_type) noexcept:
    """A serving step's q (n_seq, H, T, d_k) and K/V storage (caches (B,
    H_kv, S_max, d) or pages (n_pages, H_kv, page_size, d)) as a compiled
    step reads them: 4-D, usable in place, of one H_kv, S_max (page size)
    and d_k, every size nonzero, H a multiple of H_kv; lengths 1-D of
    n_seq (-1: the caches' B)."""
    if (cnp.PyArray_NDIM(q) != 4 or cnp.PyArray_NDIM(k_store) != 4
            or cnp.PyArray_NDIM(v_store) != 4 or cnp.PyArray_NDIM(lengths) != 1):
        return False
    if n_seq < 0:
        n_seq = cnp.PyArray_DIM(k_store, 0)
    if not (usable_input(q, q_type) and usable_input(k_store, store_type)
            and usable_input(v_store, store_type)):
        return False
    cdef Py_ssize_t d
    for d in range(3):
        if (cnp.PyArray_DIM(v_store, d) != cnp.PyArray_DIM(k_store, d)
                or cnp.PyArray_DIM(k_store, d) == 0):
            return False
    return (cnp.PyArray_DIM(q, 0) == n_seq and cnp.PyArray_DIM(lengths, 0) == n_seq
            and n_seq > 0 and cnp.PyArray_DIM(q, 3) == cnp.PyArray_DIM(k_store, 3)
            and cnp.PyArray_DIM(q, 3) > 0 and cnp.PyArray_DIM(v_store, 3) > 0
            and cnp.PyArray_DIM(q, 1) > 0 and cnp.PyArray_DIM(q, 2) > 0
            and cnp.PyArray_DIM(q, 1) % cnp.PyArray_DIM(k_store, 1) == 0)


cdef inline bint entry_offsets(object given, Py_ssize_t n_batch_dims,
                               const Py_ssize_t *batch_shape, bint per_sequence,
                               intp_t *offsets) noexcept:
    """The byte offset in the ndarray given of each batch entry's value (C
    order over batch_shape), where given broadcasts to batch_shape by
    NumPy's rule (its axes the trailing ones); with per_sequence, a 1-D
    given whose length is the batch's first axis (and not 1) instead holds
    one value per index of that axis, as the general path reads
    kv_lengths. False for anything else."""
    if type(given) is not cnp.ndarray:
        return False
    cdef cnp.ndarray arr = <cnp.ndarray>given
    cdef int ndim = cnp.PyArray_NDIM(arr)
    cdef Py_ssize_t n_batch = 1
    cdef Py_ssize_t d, e, per_index
    cdef Py_ssize_t stride[64]
    for d in range(n_batch_dims):
        n_batch *= batch_shape[d]
    if (per_sequence and ndim == 1 and n_batch_dims >= 2
            and cnp.PyArray_DIM(arr, 0) != 1):
        if cnp.PyArray_DIM(arr, 0) != batch_shape[0]:
            return False
        per_index = n_batch // batch_shape[0]
        for e in range(n_batch):
            offsets[e] = (e // per_index) * cnp.PyArray_STRIDE(arr, 0)
        return True
    if ndim > n_batch_dims:
        return False
    for d in range(n_batch_dims):
        stride[d] = 0
        if d >= n_batch_dims - ndim:
            if cnp.PyArray_DIM(arr, d - (n_batch_dims - ndim)) == batch_shape[d]:
                stride[d] = cnp.PyArray_STRIDE(arr, d - (n_batch_dims - ndim))
            elif cnp.PyArray_DIM(arr, d - (n_batch_dims - ndim)) != 1:
                return False
    fill_strided(n_batch_dims, batch_shape, stride, offsets)
    return True


cdef inline bint entry_positions(object given, Py_ssize_t n_batch_dims,
                                 const Py_ssize_t *batch_shape, intp_t *values) noexcept:
    """kv_lengths or kv_starts as the general path reads them (per_sequence
    in entry_offsets), one per batch entry, from an int32 or int64 ndarray
    usable in place; False for anything else."""
    if type(given) is not cnp.ndarray:
        return False
    cdef cnp.ndarray arr = <cnp.ndarray>given
    cdef int type_num = cnp.PyArray_TYPE(arr)
    if not (usable_input(arr, cnp.NPY_INT64) or usable_input(arr, cnp.NPY_INT32)):
        return False
    if not entry_offsets(arr, n_batch_dims, batch_shape, True, values):
        return False
    cdef const char *data = <const char *>cnp.PyArray_DATA(arr)
    cdef Py_ssize_t n_batch = 1
    cdef Py_ssize_t d, e
    for d in range(n_batch_dims):
        n_batch *= batch_shape[d]
    for e in range(n_batch):
        if type_num == cnp.NPY_INT64:
            values[e] = <intp_t>(<const long long *>(data + values[e]))[0]
        else:
            values[e] = (<const int *>(data + values[e]))[0]
    return True


cdef inline bint entry_reals(object given, Py_ssize_t n_batch_dims,
                             const Py_ssize_t *batch_shape, intp_t *scratch,
                             double *values) noexcept:
    """ALiBi slopes or sinks, one per batch entry, from a float32 or float64
    ndarray usable in place that broadcasts to batch_shape (scratch: room
    for the offsets); False for anything else."""
    if type(given) is not cnp.ndarray:
        return False
    cdef cnp.ndarray arr = <cnp.ndarray>given
    cdef int type_num = cnp.PyArray_TYPE(arr)
    if not (usable_input(arr, cnp.NPY_FLOAT64) or usable_input(arr, cnp.NPY_FLOAT32)):
        return False
    if not entry_offsets(arr, n_batch_dims, batch_shape, False, scratch):
        return False
    cdef const char *data = <const char *>cnp.PyArray_DATA(arr)
    cdef Py_ssize_t n_batch = 1
    cdef Py_ssize_t d, e
    for d in range(n_batch_dims):
        n_batch *= batch_shape[d]
    for e in range(n_batch):
        if type_num == cnp.NPY_FLOAT64:
            values[e] = (<const double *>(data + scratch[e]))[0]
        else:
            values[e] = (<const float *>(data + scratch[e]))[0]
    return True


cdef inline bint out_usable(object given, cnp.ndarray like, Py_ssize_t d_v,
                            int type_num) noexcept:
    """out= a shortcut writes: an ndarray of like's shape with d_v
    features, of type_num, writable, usable in place with non-negative
    strides, contiguous features, no element twice, certainly apart from
    like (the other inputs are the caller's to test)."""
    if type(given) is not cnp.ndarray:
        return False
    cdef cnp.ndarray out = <cnp.ndarray>given
    cdef int ndim = cnp.PyArray_NDIM(out)
    cdef int d
    # (without_self_overlap looks at up to 8 axes)
    if (ndim != cnp.PyArray_NDIM(like) or ndim > 8
            or cnp.PyArray_DIM(out, ndim - 1) != d_v):
        return False
    for d in range(ndim - 1):
        if cnp.PyArray_DIM(out, d) != cnp.PyArray_DIM(like, d):
            return False
    if not (usable_input(out, type_num) and cnp.PyArray_ISWRITEABLE(out)
            and without_self_overlap(out) and apart(out, like)):
        return False
    for d in range(ndim):
        if cnp.PyArray_STRIDE(out, d) < 0:
            return False
    return d_v <= 1 or cnp.PyArray_STRIDE(out, ndim - 1) == cnp.PyArray_ITEMSIZE(out)
