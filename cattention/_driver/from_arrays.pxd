# cython: language_level=3, boundscheck=False, wraparound=False
# cython: cdivision=True, initializedcheck=False
"""From NumPy arrays to a Problem: batch offsets of broadcast operands,
grouped-query heads (query head h reads K/V head h // G), and shared K/V
found from the broadcast strides."""

cimport numpy as cnp
from libc.stdlib cimport malloc
from cattention._driver.kernel_table cimport (
    ca_bfloat16_type, ca_e4m3fn_type, ca_e5m2_type, intp_t)
from cattention._driver.problem cimport (
    MASK_BOOL, MASK_F32, MASK_F64, STORE_BF16, STORE_COMPUTE, STORE_E4M3, STORE_E5M2, STORE_F16,
    STORE_I8, Operand, Problem, RowOptions, problem_finish, problem_init, set_operand)


cdef inline void set_array_operand(Operand *op, cnp.ndarray arr, const intp_t *offsets):
    """An operand of the last two axes of arr, in elements; a size-1 axis
    steps by 0, as broadcasting does."""
    cdef Py_ssize_t itemsize = cnp.PyArray_ITEMSIZE(arr)
    cdef int ndim = cnp.PyArray_NDIM(arr)
    set_operand(op, cnp.PyArray_DATA(arr), offsets,
                cnp.PyArray_STRIDE(arr, ndim - 2) // itemsize
                if cnp.PyArray_DIM(arr, ndim - 2) != 1 else 0,
                cnp.PyArray_STRIDE(arr, ndim - 1) // itemsize
                if cnp.PyArray_DIM(arr, ndim - 1) != 1 else 0)


cdef inline Py_ssize_t batch_stride(cnp.ndarray arr, Py_ssize_t d, Py_ssize_t n_batch_dims):
    """Element stride of arr along batch dimension d of the broadcast batch
    (aligned on the right), 0 where arr lacks it or has size 1."""
    cdef Py_ssize_t a = d - (n_batch_dims - (cnp.PyArray_NDIM(arr) - 2))
    if a < 0 or cnp.PyArray_DIM(arr, a) == 1:
        return 0
    return cnp.PyArray_STRIDE(arr, a) // cnp.PyArray_ITEMSIZE(arr)


cdef inline void fill_strided(Py_ssize_t n_batch_dims, const Py_ssize_t *batch_shape,
                              const Py_ssize_t *stride, intp_t *out) noexcept:
    """out[i] = sum_d index_d(i) * stride[d] for every entry i of the batch in
    C order: an odometer over the batch index, last dimension fastest."""
    cdef Py_ssize_t n_batch = 1
    cdef Py_ssize_t d, i, offset = 0
    cdef Py_ssize_t index[64]
    for d in range(n_batch_dims):
        n_batch *= batch_shape[d]
        index[d] = 0
    for i in range(n_batch):
        out[i] = offset
        d = n_batch_dims - 1
        while d >= 0:
            index[d] += 1
            offset += stride[d]
            if index[d] < batch_shape[d]:
                break
            offset -= stride[d] * batch_shape[d]
            index[d] = 0
            d -= 1


cdef inline void fill_batch_offsets(cnp.ndarray arr, Py_ssize_t n_batch_dims,
                                    const Py_ssize_t *batch_shape, intp_t *out):
    """Element offset of each entry of the broadcast batch, in C order.

    A dimension arr lacks or has of size 1 advances by 0, so shared K/V are
    never copied."""
    cdef Py_ssize_t d
    cdef Py_ssize_t stride[64]
    for d in range(n_batch_dims):
        stride[d] = batch_stride(arr, d, n_batch_dims)
    fill_strided(n_batch_dims, batch_shape, stride, out)


cdef inline bint advances(cnp.ndarray arr, Py_ssize_t d, Py_ssize_t n_batch_dims):
    return arr is not None and batch_stride(arr, d, n_batch_dims) != 0


cdef inline Py_ssize_t fill_shared_kv(cnp.ndarray k, cnp.ndarray v, cnp.ndarray k_scale,
                                      cnp.ndarray v_scale, Py_ssize_t n_batch_dims,
                                      const Py_ssize_t *batch_shape, intp_t *kv_of_batch,
                                      intp_t *kv_source):
    """Batch entries that read the same K and V (a K/V broadcast over heads)
    share one packed copy: kv_of_batch[b] is entry b's packed index, numbered
    in order of first appearance, kv_source[i] the first entry of index i
    (kv_source must hold -1 on entry). Returns the number of packed copies.
    A batch dimension along which neither K nor V (nor their int8 scales)
    advances is shared; v and the scales may be None."""
    cdef Py_ssize_t n_batch = 1
    cdef Py_ssize_t n_kv = 1
    cdef Py_ssize_t d, b
    cdef Py_ssize_t kv_stride[64]   # packed-index stride of each batch dimension
    for d in range(n_batch_dims - 1, -1, -1):
        n_batch *= batch_shape[d]
        if not (advances(k, d, n_batch_dims) or advances(v, d, n_batch_dims)
                or advances(k_scale, d, n_batch_dims) or advances(v_scale, d, n_batch_dims)):
            kv_stride[d] = 0
        else:
            kv_stride[d] = n_kv
            n_kv *= batch_shape[d]
    # the packed index is the C-order index over the dimensions not shared
    fill_strided(n_batch_dims, batch_shape, kv_stride, kv_of_batch)
    for b in range(n_batch):
        if kv_source[kv_of_batch[b]] < 0:
            kv_source[kv_of_batch[b]] = b
    return n_kv


cdef inline void set_storage(Operand *op, cnp.ndarray arr, cnp.ndarray scale,
                             const intp_t *scale_offsets):
    """How q, K or V is stored: the compute dtype, float16, bfloat16, or int8
    or fp8 with its row scales
    (K or V: an array of arr's shape with the features axis of size 1, whose
    batch offsets scale_offsets holds)."""
    cdef int type_num = cnp.PyArray_TYPE(arr)
    cdef int ndim
    if type_num == cnp.NPY_FLOAT16:
        op.storage = STORE_F16
    elif type_num == ca_bfloat16_type:
        op.storage = STORE_BF16
    elif type_num == cnp.NPY_INT8 or (
            type_num >= 0 and (type_num == ca_e4m3fn_type or type_num == ca_e5m2_type)):
        op.storage = (STORE_I8 if type_num == cnp.NPY_INT8
                      else STORE_E4M3 if type_num == ca_e4m3fn_type else STORE_E5M2)
        ndim = cnp.PyArray_NDIM(scale)
        op.scale = <const float *>cnp.PyArray_DATA(scale)
        op.scale_offset = scale_offsets
        op.scale_stride = (cnp.PyArray_STRIDE(scale, ndim - 2) // cnp.PyArray_ITEMSIZE(scale)
                           if cnp.PyArray_DIM(scale, ndim - 2) != 1 else 0)
    else:
        op.storage = STORE_COMPUTE


cdef inline void spread_over_groups(intp_t *per_kv_entry, Py_ssize_t n_batch,
                                    Py_ssize_t n_heads, Py_ssize_t group) noexcept nogil:
    """Values of the K/V batch (..., H_kv), first in per_kv_entry, spread in
    place over the query batch (..., H): entry (lead, h) takes (lead, h // G).
    From the last entry down, since an entry's source never lies after it."""
    cdef Py_ssize_t b
    cdef Py_ssize_t n_kv_heads = n_heads // group
    for b in range(n_batch - 1, -1, -1):
        per_kv_entry[b] = per_kv_entry[(b // n_heads) * n_kv_heads + (b % n_heads) // group]


cdef inline intp_t *problem_from_arrays(Problem *pb, cnp.ndarray q, cnp.ndarray k, cnp.ndarray v,
                                        cnp.ndarray mask, cnp.ndarray k_scale,
                                        cnp.ndarray v_scale, Py_ssize_t n_batch_dims,
                                        const Py_ssize_t *batch_shape, Py_ssize_t kv_group,
                                        const RowOptions *row) except? NULL:
    """problem_init and the operands of arrays whose leading dimensions
    broadcast to batch_shape (v, mask and the int8 scales may be None; a
    scale array has its K or V's shape with a features axis of size 1).
    With kv_group G > 1 (grouped-query heads), the last batch dimension is
    q's H heads and K, V (and their scales) have H / G there: query head h
    reads K/V head h // G, so K and V are never viewed or copied per query
    head. Returns the batch index the Problem points into (offsets of every
    operand, the shared K/V numbering), for the caller to free() after the
    call."""
    cdef Py_ssize_t n_batch = 1
    cdef Py_ssize_t d, b
    cdef Py_ssize_t kv_shape[64]
    for d in range(n_batch_dims):
        n_batch *= batch_shape[d]
        kv_shape[d] = batch_shape[d]
    if kv_group > 1:
        kv_shape[n_batch_dims - 1] = batch_shape[n_batch_dims - 1] // kv_group
    problem_init(pb, n_batch, cnp.PyArray_DIM(q, q.ndim - 2), cnp.PyArray_DIM(k, k.ndim - 2),
                 cnp.PyArray_DIM(q, q.ndim - 1),
                 cnp.PyArray_DIM(v, v.ndim - 1) if v is not None else 0, row)
    # offsets of q, k, v, mask, k_scale, v_scale; kv_of_batch; kv_source;
    # room for kv_extent (set_kv_lengths) (n_kv <= n_batch) and for the
    # offsets of a strided ATTN (set_out_offsets)
    cdef intp_t *index = <intp_t *>malloc(10 * max(n_batch, 1) * sizeof(intp_t))
    if index == NULL:
        raise MemoryError()
    cdef intp_t *kv_of_batch = index + 6 * n_batch
    cdef intp_t *kv_source = index + 7 * n_batch
    cdef Py_ssize_t slot
    fill_batch_offsets(q, n_batch_dims, batch_shape, index)
    set_array_operand(&pb.q, q, index)
    set_storage(&pb.q, q, None, NULL)
    if mask is not None:
        fill_batch_offsets(mask, n_batch_dims, batch_shape, index + 3 * n_batch)
        set_array_operand(&pb.mask, mask, index + 3 * n_batch)
        if cnp.PyArray_TYPE(mask) == cnp.NPY_BOOL:
            pb.mask_kind = MASK_BOOL
        elif cnp.PyArray_TYPE(mask) == cnp.NPY_FLOAT32:
            pb.mask_kind = MASK_F32
        else:
            pb.mask_kind = MASK_F64
    # K, V and their scales over the K/V batch, then spread over the query
    # heads; float16 and int8 K and V (with float32 q) are converted block
    # by block as they are read
    fill_batch_offsets(k, n_batch_dims, kv_shape, index + n_batch)
    if v is not None:
        fill_batch_offsets(v, n_batch_dims, kv_shape, index + 2 * n_batch)
    if k_scale is not None:
        fill_batch_offsets(k_scale, n_batch_dims, kv_shape, index + 4 * n_batch)
    if v_scale is not None:
        fill_batch_offsets(v_scale, n_batch_dims, kv_shape, index + 5 * n_batch)
    for b in range(n_batch):
        kv_source[b] = -1
    pb.n_kv = fill_shared_kv(k, v, k_scale, v_scale, n_batch_dims, kv_shape, kv_of_batch,
                             kv_source)
    if kv_group > 1:
        for slot in range(1, 6):
            if slot != 3:
                spread_over_groups(index + slot * n_batch, n_batch,
                                   batch_shape[n_batch_dims - 1], kv_group)
        spread_over_groups(kv_of_batch, n_batch, batch_shape[n_batch_dims - 1], kv_group)
        # the first query entry reading each packed K/V
        for b in range(n_batch):
            kv_source[b] = -1
        for b in range(n_batch):
            if kv_source[kv_of_batch[b]] < 0:
                kv_source[kv_of_batch[b]] = b
    set_array_operand(&pb.k, k, index + n_batch)
    set_storage(&pb.k, k, k_scale, index + 4 * n_batch)
    if v is not None:
        set_array_operand(&pb.v, v, index + 2 * n_batch)
        set_storage(&pb.v, v, v_scale, index + 5 * n_batch)
    else:
        pb.v = pb.k
    pb.kv_of_batch = kv_of_batch
    pb.kv_source = kv_source
    problem_finish(pb)
    return index


cdef inline void set_out_offsets(Problem *pb, cnp.ndarray out, Py_ssize_t n_batch_dims,
                                 const Py_ssize_t *batch_shape, intp_t *index):
    """ATTN rows written into out as laid out (any strides, features
    contiguous): each batch entry's rows from its offset, a row stride
    apart. index is problem_from_arrays' table (its last n_batch slots hold
    the offsets)."""
    cdef intp_t *out_offset = index + 9 * pb.n_batch
    cdef int ndim = cnp.PyArray_NDIM(out)
    fill_batch_offsets(out, n_batch_dims, batch_shape, out_offset)
    pb.out_offset = out_offset
    pb.ld_out = cnp.PyArray_STRIDE(out, ndim - 2) // cnp.PyArray_ITEMSIZE(out)


cdef inline void set_kv_starts(Problem *pb, const intp_t *kv_start) noexcept nogil:
    """Entry b's keys before kv_start[b] take no part (left padding)."""
    pb.kv_start = kv_start


cdef inline void set_query_offset(Problem *pb, const intp_t *query_offset) noexcept nogil:
    """Entry b's query row 0 sits at key position query_offset[b] (a chunk
    of a longer sequence computed at its global position), not at the end
    of its valid keys."""
    pb.query_offset = query_offset


cdef inline void set_kv_lengths(Problem *pb, const intp_t *kv_length,
                                intp_t *index) noexcept nogil:
    """Entry b sees only its first kv_length[b] keys. Each distinct K/V is
    then packed (and read) only up to the longest length an entry reading
    it sees: a short prompt in a long preallocated cache packs the prompt,
    not the cache. index is problem_from_arrays' table (its last n_batch
    slots hold the extents)."""
    cdef intp_t *kv_extent = index + 8 * pb.n_batch
    cdef Py_ssize_t b, kv
    pb.kv_length = kv_length
    for kv in range(pb.n_kv):
        kv_extent[kv] = 0
    for b in range(pb.n_batch):
        kv = pb.kv_of_batch[b]
        if kv_length[b] > kv_extent[kv]:
            kv_extent[kv] = kv_length[b]
    pb.kv_extent = kv_extent
