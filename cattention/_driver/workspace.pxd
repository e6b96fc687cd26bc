# cython: language_level=3, boundscheck=False, wraparound=False
# cython: cdivision=True, initializedcheck=False
"""Per-thread scratch of a work item (Workspace: packed query rows, score
tile, accumulators, running row maximum and sum) and the byte sizes of the
packed K^T and V blocks."""

from libc.stdint cimport uint8_t
from cattention._driver.kernel_table cimport (
    CA_SCRATCH_PACKED, CA_SCRATCH_WORKSPACE, ca_scratch_acquire, ca_scratch_release,
    intp_t)
from cattention._driver.problem cimport (
    DIRECT_ROWS, K_BLOCK, STORE_COMPUTE, Problem, Q_BLOCK, round_up)


cdef struct Workspace:
    void *base
    intp_t *row_lo               # first visible key of each row in the item
    intp_t *row_hi               # one past the last visible key
    # typed pointers are cast from these offsets for float or double
    Py_ssize_t off_q, off_s, off_acc, off_max, off_sum
    # the rows' totals of accumulator and sum (see fold_period), and the
    # key blocks (steps) folded into the running state since the last fold
    Py_ssize_t off_acc_total, off_sum_total
    Py_ssize_t steps_since_fold
    bint has_totals
    # K and V rows copied when their features are strided (direct path),
    # converted (float16, int8) or gathered from pages
    Py_ssize_t off_k_rows, off_v_rows
    # when a work item is a whole batch entry (compute_whole_entry): this thread's own
    # packed K^T and V blocks of the entry and their non-finite flags, which
    # stay in cache between packing and use; NULL: the problem's shared ones
    void *own_k
    void *own_v
    uint8_t *own_nonfinite
    # memory the thread reads after this work item (the next item's query
    # rows, or the next entry's K and V rows), fetched into L2 by the score
    # and P.V kernels of the item's last key block; 0 bytes: none
    const void *after_score
    const void *after_pv
    Py_ssize_t after_score_bytes, after_pv_bytes


cdef inline Workspace *workspace_new(const Problem *pb, size_t itemsize) noexcept nogil:
    """Lay out and allocate one thread's scratch; NULL if there is no memory."""
    return workspace_new_group(pb, itemsize, 1)


cdef inline Workspace *workspace_new_group(const Problem *pb, size_t itemsize,
                                           Py_ssize_t n_entries) noexcept nogil:
    """One thread's scratch for the direct path's items of up to n_entries
    batch entries: an array of n_entries workspaces, each with its own query
    rows, score tile, accumulators, row maximum, sum and visible ranges,
    sharing the rows copied for a kernel (used by one kernel at a time).
    Released with workspace_delete on the first; NULL if there is no memory."""
    cdef Py_ssize_t n_rows = Q_BLOCK if pb.n_queries > Q_BLOCK else pb.n_queries
    cdef Py_ssize_t n = 0
    cdef Py_ssize_t per_entry, shift, g
    cdef Workspace header
    cdef Workspace *ws = &header
    # each region starts on a 64-byte boundary (8 doubles / 16 floats)
    ws.off_q = n
    # (bfloat16 tiles read query rows 16 at a time, up to 31 past a call's
    # last row: rows they never use, but that must exist)
    n += round_up((n_rows + (32 if pb.bf16_score else 0)) * pb.ld_k, 16)
    ws.off_s = n
    n += round_up(n_rows * K_BLOCK, 16)
    ws.off_acc = n
    n += round_up(n_rows * pb.ld_v, 16)
    ws.off_max = n
    n += round_up(n_rows, 16)
    ws.off_sum = n
    n += round_up(n_rows, 16)
    ws.off_acc_total = n
    n += round_up(n_rows * pb.ld_v, 16)
    ws.off_sum_total = n
    n += round_up(n_rows, 16)
    ws.steps_since_fold = 0
    ws.has_totals = False
    # an entry's own regions, from off_q = 0 to here; the other entries'
    # follow the shared rows, laid out the same
    per_entry = n
    ws.off_k_rows = n
    ws.off_v_rows = n
    if (n_rows <= DIRECT_ROWS or pb.k.storage != STORE_COMPUTE
            or pb.v.storage != STORE_COMPUTE
            or pb.k.page_ids != NULL or pb.v.page_ids != NULL):
        n += round_up(K_BLOCK * pb.ld_k, 16)
        ws.off_v_rows = n
        n += round_up(K_BLOCK * pb.ld_v, 16)
    # one buffer: the workspaces themselves, then the regions from the next
    # 64-byte boundary, then each entry's visible ranges
    cdef size_t header_bytes = round_up(n_entries * sizeof(Workspace), 64)
    cdef Py_ssize_t n_all = n + (n_entries - 1) * per_entry
    cdef char *memory = <char *>ca_scratch_acquire(
        CA_SCRATCH_WORKSPACE,
        header_bytes + n_all * itemsize + 2 * n_entries * n_rows * sizeof(intp_t))
    if memory == NULL:
        return NULL
    ws.base = memory + header_bytes
    ws.own_k = NULL
    ws.own_v = NULL
    ws.own_nonfinite = NULL
    ws.after_score = NULL
    ws.after_pv = NULL
    ws.after_score_bytes = 0
    ws.after_pv_bytes = 0
    ws.row_lo = <intp_t *>(<char *>ws.base + n_all * itemsize)
    ws.row_hi = ws.row_lo + n_rows
    (<Workspace *>memory)[0] = header
    for g in range(1, n_entries):
        ws = <Workspace *>memory + g
        ws[0] = header
        shift = n + (g - 1) * per_entry
        ws.off_q = header.off_q + shift
        ws.off_s = header.off_s + shift
        ws.off_acc = header.off_acc + shift
        ws.off_max = header.off_max + shift
        ws.off_sum = header.off_sum + shift
        ws.off_acc_total = header.off_acc_total + shift
        ws.off_sum_total = header.off_sum_total + shift
        ws.row_lo = header.row_lo + 2 * g * n_rows
        ws.row_hi = ws.row_lo + n_rows
    return <Workspace *>memory


cdef inline void workspace_delete(Workspace *ws) noexcept nogil:
    if ws != NULL and ws.own_k != NULL:
        ca_scratch_release(CA_SCRATCH_PACKED, ws.own_k)
    ca_scratch_release(CA_SCRATCH_WORKSPACE, ws)


cdef inline size_t packed_k_bytes(const Problem *pb, Py_ssize_t n_blocks,
                                  size_t itemsize) noexcept nogil:
    """Bytes of n_blocks packed K^T blocks, rounded to a cache line (the
    V blocks follow them, then a flag per block)."""
    return round_up(n_blocks * pb.ld_k * pb.block_keys * itemsize, 64)


cdef inline size_t packed_v_bytes(const Problem *pb, Py_ssize_t n_blocks,
                                  size_t itemsize) noexcept nogil:
    return round_up(n_blocks * pb.block_keys * pb.ld_v * itemsize, 64)


cdef inline Workspace *workspace_new_per_entry(const Problem *pb, size_t itemsize) noexcept nogil:
    """A workspace with room for the packed K/V blocks of one batch entry."""
    cdef Workspace *ws = workspace_new(pb, itemsize)
    cdef size_t k_bytes = packed_k_bytes(pb, pb.n_key_blocks, itemsize)
    cdef size_t v_bytes = packed_v_bytes(pb, pb.n_key_blocks, itemsize)
    cdef char *own
    if ws == NULL:
        return NULL
    own = <char *>ca_scratch_acquire(CA_SCRATCH_PACKED, k_bytes + v_bytes + pb.n_key_blocks)
    if own == NULL:
        workspace_delete(ws)
        return NULL
    ws.own_k = own
    ws.own_v = own + k_bytes
    ws.own_nonfinite = <uint8_t *>(own + k_bytes + v_bytes)
    return ws
