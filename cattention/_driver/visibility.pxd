# cython: language_level=3, boundscheck=False, wraparound=False
# cython: cdivision=True, initializedcheck=False
"""Which keys a row sees: the visible key range of each row of a work item
(causal alignment, sliding window, kv_lengths) and the masking of a score
tile (bool and additive masks, softcap, ALiBi, -inf outside the range)."""

from cython cimport floating
from libc.math cimport INFINITY
from libc.stdint cimport uint8_t
from libc.stdlib cimport labs
from cattention._driver.kernel_table cimport intp_t, kernel_softcap
from cattention._driver.problem cimport (
    MASK_BOOL, MASK_F32, MASK_NONE, Problem, query_position, query_position_offset)


cdef inline void visible_ranges(const Problem *pb, Py_ssize_t b, Py_ssize_t row0,
                                Py_ssize_t n_rows, intp_t *row_lo, intp_t *row_hi) noexcept nogil:
    """Keys each query row of batch entry b may see before the explicit mask:
    [row_lo, row_hi). Only the keys kv_start[b] .. kv_length[b] exist when
    starts and lengths are given (left and right padding, as in a batched
    KV cache); the alignment is against the end of that range unless the
    call gives each entry's query_offset (query_position_offset)."""
    cdef Py_ssize_t i, lo, hi, position
    cdef Py_ssize_t n_valid = pb.kv_length[b] if pb.kv_length != NULL else pb.n_keys
    cdef Py_ssize_t start = pb.kv_start[b] if pb.kv_start != NULL else 0
    for i in range(n_rows):
        # bottom-right (the queries are the last T positions of the valid
        # keys) unless query_offset places them
        position = query_position(pb, b, row0 + i)
        lo = start
        hi = n_valid
        # compared as position < hi - 1 - right, not position + right + 1 <
        # hi: a position near 2^62 (a query_offset far past the keys) plus a
        # window of up to 2^62 would overflow 64 bits
        if pb.causal and position < hi - 1:
            hi = position + 1
        if pb.window_right >= 0 and position < hi - 1 - pb.window_right:
            hi = position + pb.window_right + 1
        if pb.window_left >= 0 and position - pb.window_left > lo:
            lo = position - pb.window_left
        if hi < 0:
            hi = 0
        if lo > hi:
            lo = hi
        row_lo[i] = lo
        row_hi[i] = hi


cdef inline bint sees_a_key(const Problem *pb, Py_ssize_t b, Py_ssize_t row) noexcept nogil:
    """Whether query row ``row`` of batch entry b has a key that neither its
    visible range nor the mask hides (a bool mask's True, an additive
    mask's entry other than -inf in the compute dtype: with float32 inputs
    a float64 entry beyond float32's range masks), whatever its logits.
    Asked only of rows whose logits all came out -inf, so the mask's row is
    read here once."""
    cdef intp_t lo, hi
    cdef Py_ssize_t j, m_row
    cdef Py_ssize_t m_col = pb.mask.col_stride
    cdef double bias
    visible_ranges(pb, b, row, 1, &lo, &hi)
    if hi <= lo:
        return False
    if pb.mask_kind == MASK_NONE:
        return True
    m_row = pb.mask.batch_offset[b] + row * pb.mask.row_stride
    for j in range(lo, hi):
        if pb.mask_kind == MASK_BOOL:
            if (<const uint8_t *>pb.mask.data)[m_row + j * m_col]:
                return True
        elif pb.mask_kind == MASK_F32:
            if (<const float *>pb.mask.data)[m_row + j * m_col] != -INFINITY:
                return True
        else:
            bias = (<const double *>pb.mask.data)[m_row + j * m_col]
            if (<float>bias if pb.itemsize == 4 else bias) != -INFINITY:
                return True
    return False


cdef inline Py_ssize_t first_visible_key(const Problem *pb, Py_ssize_t b) noexcept nogil:
    """No query row of batch entry b sees a key before this one: its first
    valid key, or the start of its sliding window at its first position
    (visible_ranges' lo for a row at position offset) if that is later."""
    cdef Py_ssize_t start = pb.kv_start[b] if pb.kv_start != NULL else 0
    cdef Py_ssize_t first
    if pb.window_left < 0:
        return start
    # at least -2^62 - 2^62: within 64 bits
    first = query_position_offset(pb, b) - pb.window_left
    return first if first > start else start


cdef inline void mask_scores(const Problem *pb, Py_ssize_t b, Py_ssize_t row0,
                             Py_ssize_t n_rows, Py_ssize_t key0, Py_ssize_t n_keys,
                             const intp_t *row_lo, const intp_t *row_hi,
                             floating *s, Py_ssize_t lds) noexcept nogil:
    """Turn scaled logits into final ones, in place: softcap, then ALiBi, then
    the mask; invisible logits become -inf.

    Masked logits are overwritten, never added to, so a NaN or Inf computed
    from a masked-out key cannot survive. The softcap comes before the mask
    (the order ONNX settled on: capping after an additive mask would lift
    masked logits back towards the others)."""
    cdef Py_ssize_t i, j, lo, hi, position
    cdef double slope
    cdef floating *s_row
    cdef const uint8_t *mask_bool
    cdef const float *mask_f32
    cdef const double *mask_f64
    cdef Py_ssize_t m_row, m_col = pb.mask.col_stride
    cdef double bias
    for i in range(n_rows):
        s_row = s + i * lds
        # the row's visible keys within this block, clipped to it (a window
        # can start past the block's end)
        lo = row_lo[i] - key0
        hi = row_hi[i] - key0
        if lo < 0:
            lo = 0
        if lo > n_keys:
            lo = n_keys
        if hi > n_keys:
            hi = n_keys
        if hi < lo:
            hi = lo
        for j in range(lo):
            s_row[j] = -INFINITY
        for j in range(hi, n_keys):
            s_row[j] = -INFINITY
        if hi == lo:
            continue
        if pb.softcap > 0:
            kernel_softcap(pb.kern, s_row + lo, hi - lo, pb.softcap)
        if pb.alibi_slope != NULL:
            # one slope per group of query_period rows, as the sinks
            slope = pb.alibi_slope[(b * pb.n_queries + row0 + i) // pb.query_period]
            position = query_position(pb, b, row0 + i)
            for j in range(lo, hi):
                s_row[j] = s_row[j] - <floating>(slope * labs(position - (key0 + j)))
        if pb.mask_kind == MASK_NONE:
            continue
        m_row = pb.mask.batch_offset[b] + (row0 + i) * pb.mask.row_stride + key0 * m_col
        if pb.mask_kind == MASK_BOOL:
            mask_bool = <const uint8_t *>pb.mask.data + m_row
            for j in range(lo, hi):
                if not mask_bool[j * m_col]:
                    s_row[j] = -INFINITY
        elif pb.mask_kind == MASK_F32:
            mask_f32 = <const float *>pb.mask.data + m_row
            for j in range(lo, hi):
                bias = mask_f32[j * m_col]
                if bias == -INFINITY:
                    s_row[j] = -INFINITY
                else:
                    s_row[j] = s_row[j] + <floating>bias
        else:
            mask_f64 = <const double *>pb.mask.data + m_row
            for j in range(lo, hi):
                bias = mask_f64[j * m_col]
                if bias == -INFINITY:
                    s_row[j] = -INFINITY
                else:
                    s_row[j] = s_row[j] + <floating>bias
