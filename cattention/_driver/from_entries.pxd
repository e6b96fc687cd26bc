# cython: language_level=3, boundscheck=False, wraparound=False
# cython: cdivision=True, initializedcheck=False
"""From sequences of their own lengths to Problems: packed variable-length
batches, paged KV caches, and one head of the C-level API.

A call over ``n_seq`` sequences and H query heads (an EntryPlan: where each
sequence's rows lie, how many query rows and valid keys it has) becomes one
or two entry tables (plan_entries), each one run of the driver:

- sequences with one new query row, when the heads are grouped (1 < G <=
  DIRECT_ROWS): one entry per (sequence, K/V head), its G query
  heads stacked as rows, so that each K/V head's keys are read once per
  decode step;
- every other sequence: one entry per (sequence, query head), its rows its
  own, reading the K/V of head h // G (entries of one K/V head share its
  packed copy).

Sequences with no query row give no entry. Where a row lives is described
per sequence (Place: an offset per sequence, element strides along the
token and head axes), so a packed ``(total, H, d)`` array and a padded
``(B, H, T, d)`` one are the same to the driver. The plan is filled from
NumPy arrays (the general path, ``_prepare/entries.py``) or by the compiled
paged step; both build the tables here."""

cimport numpy as cnp
from libc.stdlib cimport free, malloc
from cattention._driver.kernel_table cimport (
    ca_bfloat16_type, ca_e4m3fn_type, ca_e5m2_type, intp_t)
from cattention._driver.problem cimport (
    DIRECT_ROWS, STORE_BF16, STORE_COMPUTE, STORE_E4M3, STORE_E5M2, STORE_F16, STORE_I8, Operand,
    Problem, RowOptions, is_one_byte, problem_finish, problem_init, set_operand)


# the type numbers of fp8 K/V given without a registered ml_dtypes type
# (the C API's): never a NumPy type number
cdef enum:
    PLACE_E4M3FN = -2
    PLACE_E5M2 = -3


cdef struct Place:
    # an operand of a plan: row t of head h of sequence i at seq_offset[i] +
    # t * t_stride + h * h_stride elements from data (for a paged K/V,
    # seq_offset is 0 and rows are found through the pages, page_stride
    # elements per page id); features col_stride apart
    const char *data
    int type_num                 # NPY_FLOAT32, NPY_FLOAT64, NPY_FLOAT16, bfloat16's
                                 # (ca_bfloat16_type) or NPY_INT8
    const intp_t *seq_offset
    Py_ssize_t t_stride, h_stride, col_stride, page_stride


cdef struct EntryPlan:
    Py_ssize_t n_seq, n_heads, n_kv_heads, d_k, d_v
    const intp_t *q_lengths      # query rows of each sequence
    const intp_t *kv_lengths     # valid keys of each sequence...
    const intp_t *kv_starts      # ...from this one (left padding), or NULL: 0
    Place q, k, v, out
    Place lse                    # data NULL: no LSE
    Place k_scale, v_scale       # int8 K/V: their float32 row scales (data NULL: none)
    const double *alibi          # per (sequence, query head), or NULL
    const double *sinks          # per (sequence, query head), or NULL
    const intp_t *page_ids       # the block table, flattened, or NULL: not paged
    Py_ssize_t pages_per_seq, page_size


cdef struct EntryTable:
    # one driver run: intp arrays of one value per entry (q_rows and
    # lse_offset may be NULL), all in one allocation (storage)
    Py_ssize_t n_entries, n_queries, n_keys, n_kv, query_period
    intp_t *q_offset
    intp_t *k_offset
    intp_t *v_offset
    intp_t *kv_index
    intp_t *kv_length
    intp_t *out_offset
    intp_t *q_rows
    intp_t *lse_offset
    intp_t *page_first
    intp_t *k_scale_offset
    intp_t *v_scale_offset
    intp_t *kv_start
    double *alibi
    double *sinks                # per group of query_period rows
    Py_ssize_t q_row_stride, ld_out, ld_lse
    void *storage


cdef inline bint stacks_grouped_rows(Py_ssize_t group, Py_ssize_t n_rows,
                                     bint has_mask) noexcept nogil:
    """Whether the G query heads of a K/V head, n_rows rows each, are
    stacked as the rows of one entry (its keys then read once for all of
    them): only a decode-sized stack, and not under a mask (read per query
    head as a batch entry; ALiBi slopes and sinks are read per group of
    query_period rows, so they stack)."""
    return 1 < group and group * n_rows <= DIRECT_ROWS and not has_mask


cdef inline int table_new(EntryTable *t, Py_ssize_t n_entries, Py_ssize_t n_row_values,
                          bint with_sinks, bint with_alibi) noexcept nogil:
    """Allocate the arrays of an n_entries table (and n_row_values sinks,
    ALiBi slopes, each if asked for: one per group of query_period rows);
    0, or -1 if there is no memory."""
    cdef Py_ssize_t n = n_entries if n_entries > 0 else 1
    cdef Py_ssize_t n_sinks = n_row_values if with_sinks else 0
    cdef Py_ssize_t n_doubles = n_sinks + (n_row_values if with_alibi else 0)
    t.storage = malloc(12 * n * sizeof(intp_t) + (n_doubles + 1) * sizeof(double))
    if t.storage == NULL:
        return -1
    cdef intp_t *slots = <intp_t *>t.storage
    t.q_offset, t.k_offset, t.v_offset = slots, slots + n, slots + 2 * n
    t.kv_index, t.kv_length, t.out_offset = slots + 3 * n, slots + 4 * n, slots + 5 * n
    t.q_rows, t.lse_offset, t.page_first = slots + 6 * n, slots + 7 * n, slots + 8 * n
    t.k_scale_offset, t.v_scale_offset = slots + 9 * n, slots + 10 * n
    t.kv_start = slots + 11 * n
    t.sinks = <double *>(slots + 12 * n)
    t.alibi = t.sinks + n_sinks
    t.n_entries = n_entries
    return 0


cdef inline void set_kv_place(const EntryPlan *plan, EntryTable *t, Py_ssize_t e,
                              Py_ssize_t s, Py_ssize_t kv_head) noexcept nogil:
    """Where entry e (sequence s, K/V head kv_head) reads K, V and their scales."""
    t.k_offset[e] = plan.k.seq_offset[s] + kv_head * plan.k.h_stride
    t.v_offset[e] = plan.v.seq_offset[s] + kv_head * plan.v.h_stride
    t.kv_length[e] = plan.kv_lengths[s]
    t.kv_start[e] = plan.kv_starts[s] if plan.kv_starts != NULL else 0
    t.page_first[e] = s * plan.pages_per_seq
    if plan.k_scale.data != NULL:
        t.k_scale_offset[e] = plan.k_scale.seq_offset[s] + kv_head * plan.k_scale.h_stride
        t.v_scale_offset[e] = plan.v_scale.seq_offset[s] + kv_head * plan.v_scale.h_stride


cdef inline int stacked_table(const EntryPlan *plan, EntryTable *t,
                              Py_ssize_t n_stacked) noexcept nogil:
    """Entries (sequence, K/V head) with the G query heads of one new token
    as rows, for the sequences of one query row."""
    cdef Py_ssize_t group = plan.n_heads // plan.n_kv_heads
    cdef Py_ssize_t s, kv_head, g, head, e = 0
    if table_new(t, n_stacked * plan.n_kv_heads, n_stacked * plan.n_heads, plan.sinks != NULL,
                 plan.alibi != NULL) != 0:
        return -1
    t.n_queries = group
    t.n_keys = 0
    t.query_period = 1
    t.q_row_stride = plan.q.h_stride
    t.ld_out = plan.out.h_stride
    t.ld_lse = plan.lse.h_stride if plan.lse.data != NULL else 1
    for s in range(plan.n_seq):
        # the longest sequence of the call, stacked or not, sizes the keys
        if plan.kv_lengths[s] > t.n_keys:
            t.n_keys = plan.kv_lengths[s]
        if plan.q_lengths[s] != 1:
            continue
        for kv_head in range(plan.n_kv_heads):
            head = kv_head * group
            t.q_offset[e] = plan.q.seq_offset[s] + head * plan.q.h_stride
            t.out_offset[e] = plan.out.seq_offset[s] + head * plan.out.h_stride
            if plan.lse.data != NULL:
                t.lse_offset[e] = plan.lse.seq_offset[s] + head * plan.lse.h_stride
            t.kv_index[e] = e
            set_kv_place(plan, t, e, s, kv_head)
            for g in range(group):
                if plan.sinks != NULL:
                    t.sinks[e * group + g] = plan.sinks[s * plan.n_heads + head + g]
                if plan.alibi != NULL:
                    t.alibi[e * group + g] = plan.alibi[s * plan.n_heads + head + g]
            e += 1
    t.n_kv = t.n_entries
    return 0


cdef inline int per_head_table(const EntryPlan *plan, EntryTable *t, Py_ssize_t n_rest,
                               bint stacking) noexcept nogil:
    """Entries (sequence, query head), each with its sequence's rows, for the
    sequences not stacked."""
    cdef Py_ssize_t group = plan.n_heads // plan.n_kv_heads
    cdef Py_ssize_t s, head, at, e = 0
    cdef Py_ssize_t rest = 0
    if table_new(t, n_rest * plan.n_heads, n_rest * plan.n_heads, plan.sinks != NULL,
                 plan.alibi != NULL) != 0:
        return -1
    t.n_queries = 0
    t.n_keys = 0
    t.query_period = 0
    t.q_row_stride = plan.q.t_stride
    t.ld_out = plan.out.t_stride
    t.ld_lse = plan.lse.t_stride if plan.lse.data != NULL else 1
    for s in range(plan.n_seq):
        if plan.q_lengths[s] <= (1 if stacking else 0):
            continue
        if plan.q_lengths[s] > t.n_queries:
            t.n_queries = plan.q_lengths[s]
        if plan.kv_lengths[s] > t.n_keys:
            t.n_keys = plan.kv_lengths[s]
        for head in range(plan.n_heads):
            at = s * plan.n_heads + head
            t.q_offset[e] = plan.q.seq_offset[s] + head * plan.q.h_stride
            t.q_rows[e] = plan.q_lengths[s]
            t.out_offset[e] = plan.out.seq_offset[s] + head * plan.out.h_stride
            if plan.lse.data != NULL:
                t.lse_offset[e] = plan.lse.seq_offset[s] + head * plan.lse.h_stride
            t.kv_index[e] = rest * plan.n_kv_heads + head // group
            set_kv_place(plan, t, e, s, head // group)
            if plan.alibi != NULL:
                t.alibi[e] = plan.alibi[at]
            if plan.sinks != NULL:
                t.sinks[e] = plan.sinks[at]
            e += 1
        rest += 1
    t.n_kv = n_rest * plan.n_kv_heads
    return 0


cdef inline int plan_entries(const EntryPlan *plan, EntryTable *tables,
                             Py_ssize_t *n_tables) noexcept nogil:
    """The (up to two) tables of a plan, into tables[0..n_tables); free them
    with free_tables. 0, or -1 if there is no memory."""
    cdef Py_ssize_t group = plan.n_heads // plan.n_kv_heads
    cdef bint stacking = stacks_grouped_rows(group, 1, False)
    cdef Py_ssize_t s, n_stacked = 0, n_rest = 0
    for s in range(plan.n_seq):
        if stacking and plan.q_lengths[s] == 1:
            n_stacked += 1
        elif plan.q_lengths[s] > 0:
            n_rest += 1
    n_tables[0] = 0
    if n_stacked > 0:
        if stacked_table(plan, &tables[0], n_stacked) != 0:
            return -1
        n_tables[0] = 1
    if n_rest > 0:
        if per_head_table(plan, &tables[n_tables[0]], n_rest, stacking) != 0:
            free_tables(tables, n_tables[0])
            n_tables[0] = 0
            return -1
        n_tables[0] += 1
    return 0


cdef inline void free_tables(EntryTable *tables, Py_ssize_t n_tables) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n_tables):
        free(tables[i].storage)
        tables[i].storage = NULL


cdef inline void set_place_operand(Operand *op, const Place *place, const intp_t *offsets,
                                   Py_ssize_t row_stride) noexcept nogil:
    """An operand of a plan whose entry b starts at offsets[b], rows
    row_stride apart."""
    set_operand(op, place.data, offsets, row_stride, place.col_stride)
    op.storage = STORE_COMPUTE
    if place.type_num == cnp.NPY_FLOAT16:
        op.storage = STORE_F16
    elif place.type_num == ca_bfloat16_type:
        op.storage = STORE_BF16


cdef inline void set_kv_operand(Operand *op, const Place *place, const intp_t *offsets,
                                const Place *scale, const intp_t *scale_offsets,
                                const EntryPlan *plan, const EntryTable *t) noexcept nogil:
    """K or V of a plan: its int8 or fp8 row scales, and its pages when paged."""
    set_place_operand(op, place, offsets, place.t_stride)
    if place.type_num == cnp.NPY_INT8:
        op.storage = STORE_I8
    elif place.type_num == PLACE_E4M3FN or (
            place.type_num == ca_e4m3fn_type and place.type_num >= 0):
        op.storage = STORE_E4M3
    elif place.type_num == PLACE_E5M2 or (
            place.type_num == ca_e5m2_type and place.type_num >= 0):
        op.storage = STORE_E5M2
    if is_one_byte(op.storage):
        op.scale = <const float *>scale.data
        op.scale_offset = scale_offsets
        op.scale_stride = scale.t_stride
        op.scale_page_stride = scale.page_stride
    if plan.page_ids != NULL:
        op.page_ids = plan.page_ids
        op.page_first = t.page_first
        op.page_size = plan.page_size
        op.page_stride = place.page_stride


cdef inline intp_t *problem_from_table(Problem *pb, const EntryTable *t, const EntryPlan *plan,
                                       const RowOptions *row) noexcept nogil:
    """problem_init and the operands of one entry table of a plan. Returns
    the K/V sharing index it builds (kv_source and kv_extent of each packed
    K/V entry), for the caller to free() after the call; NULL: no memory."""
    cdef Py_ssize_t n_kv = t.n_kv
    cdef Py_ssize_t b, kv
    problem_init(pb, t.n_entries, t.n_queries, t.n_keys, plan.d_k, plan.d_v, row)
    pb.alibi_slope = t.alibi if plan.alibi != NULL else NULL
    pb.sink = t.sinks if plan.sinks != NULL else NULL
    set_place_operand(&pb.q, &plan.q, t.q_offset, t.q_row_stride)
    set_kv_operand(&pb.k, &plan.k, t.k_offset, &plan.k_scale, t.k_scale_offset, plan, t)
    set_kv_operand(&pb.v, &plan.v, t.v_offset, &plan.v_scale, t.v_scale_offset, plan, t)
    pb.kv_length = t.kv_length
    if plan.kv_starts != NULL:
        pb.kv_start = t.kv_start
    if t.query_period == 0:
        pb.q_length = t.q_rows
    else:
        pb.query_period = t.query_period
    pb.out_offset = t.out_offset
    pb.ld_out = t.ld_out
    if plan.lse.data != NULL:
        pb.lse = <void *>plan.lse.data
        pb.lse_offset = t.lse_offset
        pb.ld_lse = t.ld_lse
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
