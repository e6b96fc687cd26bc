# cython: language_level=3, boundscheck=False, wraparound=False
# cython: cdivision=True, initializedcheck=False
"""Schedulers: how work items are spread over OpenMP threads (prange), for
the packed path (pack everything, then query blocks; or one packed K/V
entry and its readers per item: many short sequences, one thread, heads of
one length) and the direct path (entries x key chunk, then the merge), and
the thread count of a call (src/team.h).

The verbs, from the call down: compute_problem (a call: its thread count
and path) -> schedule_packed / schedule_decode (work items over threads) ->
compute_whole_entry / compute_query_block (one K/V entry and the batch
entries that read it, one query block) -> attend_query_block[_with_scores]
/ attend_key_chunk (the attention of one work item, in _item_packed and
_item_direct)."""

from cython cimport floating
from cython.parallel cimport parallel, prange
from libc.stdint cimport uint8_t, uint16_t
from cattention._driver.kernel_table cimport (
    CA_SCRATCH_PACKED, CA_SCRATCH_PARTIAL, ca_forked_after_parallel, ca_kernels,
    ca_note_parallel_region, ca_round_to_bfloat16, ca_scratch_acquire, ca_scratch_release,
    intp_t)
from libc.math cimport ldexp
from libc.stdlib cimport free, malloc, qsort
from cattention._driver.problem cimport (
    DIRECT_GROUP, DIRECT_ROWS, GROUP_ITEMS_PER_THREAD, K_BLOCK, MIN_FLOPS_PER_THREAD,
    PER_ENTRY_ALIKE_ENTRIES, PER_ENTRY_MAX_BLOCKS, PER_ENTRY_MIN_ENTRIES, Operand, Problem,
    Q_BLOCK, SPLIT_MIN_KEYS, SPLIT_TARGET_ITEMS, STORE_BF16, direct_rows, entry_rows,
    fold_period, is_fp8, key_extent, out_row_offset, round_up)
from cattention._driver.operands cimport operand_itemsize, rows_span
from cattention._driver.workspace cimport (
    Workspace, packed_k_bytes, packed_v_bytes, workspace_delete, workspace_new,
    workspace_new_group, workspace_new_per_entry)
from cattention._driver.packing cimport pack_block, packed_keys
from cattention._driver.softmax cimport merge_splits, row_is_finite
from cattention._driver.item_packed cimport attend_query_block, attend_query_block_with_scores
from cattention._driver.item_direct cimport attend_key_chunk, direct_key_step
from cattention._driver.visibility cimport first_visible_key


cdef extern from "team.h" nogil:
    double CA_TEAM_FLOPS_PER_NS
    double CA_TEAM_BYTES_PER_NS
    int ca_team_size(int n_threads, double serial_ns)
    void ca_team_call_ended()


cdef extern from "openmp_shim.h" nogil:
    int omp_get_max_threads()
    int omp_get_num_procs()
    int CA_HAVE_OPENMP
    int CA_OPENMP_VERSION
    const char *ca_openmp_runtime()


cdef inline void thread_done(const ca_kernels *kern) noexcept nogil:
    """A thread has done its part of a call: the table gives up its
    per-thread state (AMX's tiles), if it keeps any."""
    if kern.end_of_thread != NULL:
        kern.end_of_thread()


cdef inline Py_ssize_t item_rows(const Problem *pb, Py_ssize_t item,
                                 Py_ssize_t n_query_blocks, Py_ssize_t *b,
                                 Py_ssize_t *row0) noexcept nogil:
    """Batch entry, first row and row count (<= 0: none) of a work item of
    the packed path.

    One batch entry's query blocks follow each other, so the entry's
    packed K/V stay in cache from one to the next. Within an entry the
    last query blocks, which see the most keys under a causal mask, come
    first, so the dynamic schedule ends with cheap ones."""
    cdef Py_ssize_t n_rows
    b[0] = item // n_query_blocks
    row0[0] = (n_query_blocks - 1 - item % n_query_blocks) * Q_BLOCK
    n_rows = entry_rows(pb, b[0]) - row0[0]
    return Q_BLOCK if n_rows > Q_BLOCK else n_rows


cdef inline void fetch_after(const Problem *pb, Workspace *ws, Py_ssize_t next_item,
                             Py_ssize_t n_query_blocks, bint next_entry_kv) noexcept nogil:
    """Have the item about to run fetch into L2 what next_item (the item this
    thread likely runs next; -1: none) reads first from the caller's arrays:
    its query rows, and with next_entry_kv the K and V rows of its entry
    instead (which a whole-entry item packs first)."""
    cdef Py_ssize_t b, row0, n_rows, kv_b, n_keys
    ws.after_score_bytes = 0
    ws.after_pv_bytes = 0
    if next_item < 0 or next_item >= pb.n_batch * n_query_blocks:
        return
    n_rows = item_rows(pb, next_item, n_query_blocks, &b, &row0)
    if next_entry_kv:
        n_keys = key_extent(pb, pb.kv_of_batch[b])
        kv_b = pb.kv_source[pb.kv_of_batch[b]]
        ws.after_score_bytes = rows_span(pb, &pb.k, kv_b, 0, n_keys, pb.d_k, &ws.after_score)
        ws.after_pv_bytes = rows_span(pb, &pb.v, kv_b, 0, n_keys, pb.d_v, &ws.after_pv)
    else:
        ws.after_score_bytes = rows_span(pb, &pb.q, b, row0, n_rows, pb.d_k, &ws.after_score)


cdef inline void compute_query_block(const Problem *pb, const ca_kernels *kern, Workspace *ws,
                                     Py_ssize_t item, Py_ssize_t n_query_blocks, floating *out,
                                     floating *scores) noexcept nogil:
    cdef Py_ssize_t b, row0
    cdef Py_ssize_t n_rows = item_rows(pb, item, n_query_blocks, &b, &row0)
    if n_rows <= 0:
        # past the rows of an entry shorter than the longest
        return
    if scores != NULL:
        attend_query_block_with_scores(pb, kern, ws, b, row0, n_rows, out, scores)
    else:
        attend_query_block(pb, kern, ws, b, row0, n_rows, out)


cdef inline void compute_whole_entry(Problem *pb, const ca_kernels *kern, Workspace *ws,
                                     Py_ssize_t b, Py_ssize_t n_entries,
                                     Py_ssize_t n_query_blocks, Py_ssize_t next_b,
                                     floating *out, floating *scores) noexcept nogil:
    """Pack the K/V that batch entries b .. b + n_entries - 1 read (one
    packed entry that no other batch entry reads: theirs, or their group's
    under grouped-query heads), then compute all their query blocks, in the
    order compute_query_block gives them. Each block fetches the next one's
    query rows, and the last the K and V rows of entry next_b (the one this
    thread likely takes next; -1: none), which packing reads first, often
    from memory."""
    cdef Py_ssize_t key_block, item, packed_block
    cdef Py_ssize_t last_item = (b + n_entries) * n_query_blocks
    for key_block in range(pb.n_key_blocks):
        packed_block = pb.kv_of_batch[b] * pb.n_key_blocks + key_block
        pack_block(pb, ws, packed_block, <floating *>packed_keys(pb, ws, packed_block))
    for item in range(b * n_query_blocks, last_item):
        if item + 1 < last_item:
            fetch_after(pb, ws, item + 1, n_query_blocks, False)
        else:
            fetch_after(pb, ws, next_b * n_query_blocks if next_b >= 0 else -1,
                        n_query_blocks, True)
        compute_query_block(pb, kern, ws, item, n_query_blocks, out, scores)
    fetch_after(pb, ws, -1, n_query_blocks, False)


cdef inline Py_ssize_t entries_per_kv(const Problem *pb) noexcept nogil:
    """G when each packed K/V entry is read by G batch entries that follow
    each other (kv_of_batch[b] == b // G: grouped-query heads, G = 1 for
    entries with K/V of their own); 0 otherwise (a K/V broadcast over a
    leading batch dimension)."""
    cdef Py_ssize_t group, b
    if pb.n_kv <= 0 or pb.n_batch % pb.n_kv != 0:
        return 0
    group = pb.n_batch // pb.n_kv
    for b in range(pb.n_batch):
        if pb.kv_of_batch[b] != b // group:
            return 0
    return group


cdef inline bint bfloat16_row_is_finite(const uint16_t *row, Py_ssize_t n) noexcept nogil:
    """Whether no value of a bfloat16 row is inf or NaN (exponent all ones)."""
    cdef Py_ssize_t c
    for c in range(n):
        if (row[c] & 0x7F80) == 0x7F80:
            return False
    return True


cdef inline int redo_rows_beyond_range(Problem *pb, const ca_kernels *kern, int n_threads,
                                       floating *out) noexcept nogil:
    """ATTN rows that came out inf or NaN although their logits are finite.
    Without SCORES a row's weighted values are summed before the division
    by its sum of weights, and with |V| near the dtype's largest value that
    sum can pass it (two keys of 2e38 in float32) while the answer, a
    weighted mean of V, does not. The call runs again into a scratch ATTN
    with the weights P.V takes scaled by 2^-k, 2^k at least twice the keys
    a row can see, so that no sum passes max |V|; each row of out that is not
    finite takes its row from there, times 2^k. Both scalings are exact
    (short of subnormals), so such a row has the bits of a run without the
    overflow; rows that are NaN or inf for their own reasons (a NaN or inf
    in V) come out the same again. Other rows and the LSE keep the first
    run's bits. Returns 0, or -1 if memory ran out."""
    cdef Py_ssize_t b, i, c, n_rows, row_end
    cdef Py_ssize_t extent = 0
    cdef int shift = 1
    cdef int status
    cdef void *lse = pb.lse
    cdef floating *scratch
    cdef floating *out_row
    cdef floating *redone
    cdef floating factor
    for b in range(pb.n_batch):
        n_rows = entry_rows(pb, b)
        if n_rows > 0:
            row_end = out_row_offset(pb, b, n_rows - 1) + pb.d_v
            if row_end > extent:
                extent = row_end
    scratch = <floating *>malloc(extent * sizeof(floating) if extent > 0 else 1)
    if scratch == NULL:
        return -1
    # 2^shift >= 2 n_keys: the scaled weights sum to at most 1/2, so even
    # roundings leave the sums below max |V|; and a float32 weight (at least
    # 2^-127) stays above 0 up to 2^21 keys, so a key whose value is inf
    # still makes its row inf
    while shift < 62 and (<Py_ssize_t>1 << shift) < 2 * pb.n_keys:
        shift += 1
    pb.weight_shift = shift
    pb.lse = NULL
    # the second run writes float32 rows into the scratch, bfloat16 ATTN or not
    cdef uint16_t *out_bf16 = pb.out_bf16
    pb.out_bf16 = NULL
    if pb.direct:
        status = schedule_decode(pb, kern, n_threads, scratch)
    else:
        status = schedule_packed(pb, kern, n_threads, scratch, <floating *>NULL)
    pb.weight_shift = 0
    pb.lse = lse
    pb.out_bf16 = out_bf16
    factor = <floating>ldexp(1.0, shift)
    if status == 0:
        for b in range(pb.n_batch):
            for i in range(entry_rows(pb, b)):
                redone = scratch + out_row_offset(pb, b, i)
                if floating is float:
                    if out_bf16 != NULL:
                        # a bfloat16 row is inf or NaN where its float32 row
                        # was, or where that row's finite values round to inf
                        # (then the redone row rounds to inf again)
                        if not bfloat16_row_is_finite(out_bf16 + out_row_offset(pb, b, i),
                                                      pb.d_v):
                            for c in range(pb.d_v):
                                redone[c] = redone[c] * factor
                            ca_round_to_bfloat16(redone, out_bf16 + out_row_offset(pb, b, i),
                                                 pb.d_v)
                        continue
                out_row = out + out_row_offset(pb, b, i)
                if not row_is_finite(out_row, pb.d_v):
                    for c in range(pb.d_v):
                        out_row[c] = redone[c] * factor
    free(scratch)
    return status


cdef inline int compute_problem(Problem *pb, const ca_kernels *kern, int n_threads,
                                floating *out, floating *scores) noexcept nogil:
    """Returns 0, -1 if memory ran out, or -2 if pb.out_bf16 is set for a
    path that does not round into it (the direct path, SCORES)."""
    cdef double flops = (2.0 * pb.n_batch * pb.n_queries * pb.n_keys
                         * (pb.d_k + pb.d_v + 1))
    cdef int n_procs
    cdef bint team_rule = n_threads > 1   # a call given one thread reads no clock
    if ca_forked_after_parallel():
        # GNU OpenMP would wait forever for the parent's threads (src/fork_safety.c)
        n_threads = 1
    if n_threads > 1 and flops < n_threads * <double>MIN_FLOPS_PER_THREAD:
        n_threads = <int>(flops / MIN_FLOPS_PER_THREAD)
        if n_threads < 1:
            n_threads = 1
    if n_threads > 1:
        # threads beyond the CPUs this process may run on would only take
        # turns on them, each with its own stack (thousands of threads can
        # exhaust the address space, and the OpenMP runtime then aborts)
        n_procs = omp_get_num_procs()
        if n_threads > n_procs:
            n_threads = n_procs
    pb.itemsize = sizeof(floating)
    pb.kern = kern
    # the path depends on the shape alone, never on the layout or threads
    pb.direct = direct_rows(pb.n_queries)
    if pb.out_bf16 != NULL and (floating is double or pb.direct or scores != NULL):
        # only the packed path without SCORES rounds its rows into bfloat16
        # (the callers ask for it only there)
        return -2
    # bfloat16 q and K (V) on a table with bfloat16 tiles: the packed path
    # multiplies them as they are (decode reads its rows in place); packed
    # K^T rows and query rows hold the padded pairs. fp8 keys go in as
    # their codes, which bfloat16 holds exactly, their scales applied to
    # the logits
    pb.bf16_score = (floating is float and not pb.direct and kern.score_bf16 != NULL
                     and pb.q.storage == STORE_BF16
                     and (pb.k.storage == STORE_BF16 or is_fp8(pb.k.storage))
                     and pb.d_k > 0)
    # ...and P.V of bfloat16 V in the table's parts of P where the call's
    # level takes them (else float32 weights)
    pb.bf16_pv = (floating is float and not pb.direct and kern.pv_bf16 != NULL
                  and kern.bf16_pv_parts[pb.precision] > 0
                  and pb.v.storage == STORE_BF16 and pb.d_v > 0)
    if pb.bf16_score:
        pb.ld_k = max(pb.ld_k, round_up(pb.d_k, kern.bf16_k_align) // 2)
    cdef double kv_bytes = 0
    cdef int status
    if n_threads > 1:
        if pb.direct:
            # a decode step streams its K and V from memory
            kv_bytes = (<double>pb.n_kv * pb.n_keys
                        * (pb.d_k * operand_itemsize(pb, &pb.k)
                           + pb.d_v * operand_itemsize(pb, &pb.v)))
        n_threads = ca_team_size(
            n_threads, flops * (sizeof(floating) // 4) / CA_TEAM_FLOPS_PER_NS
            + kv_bytes / CA_TEAM_BYTES_PER_NS)
    cdef int nonfinite_out = 0
    # with SCORES, ATTN is SCORES . V, weights that sum to 1: no sum of
    # weighted values passes max |V|
    pb.nonfinite_out = &nonfinite_out if scores == NULL else NULL
    if scores == NULL and pb.direct:
        status = schedule_decode(pb, kern, n_threads, out)
    else:
        status = schedule_packed(pb, kern, n_threads, out, scores)
    pb.nonfinite_out = NULL
    if status == 0 and nonfinite_out:
        status = redo_rows_beyond_range(pb, kern, n_threads, out)
    if team_rule:
        ca_team_call_ended()
    return status


cdef inline bint rows_side_by_side(const Operand *op, Py_ssize_t b0,
                                   Py_ssize_t b) noexcept nogil:
    """Whether entry b's rows of a K or V lie among entry b0's: the same
    rows, another head of the same pages, or rows interleaved with b0's
    (heads of one token adjacent, as in (B, S, H, d))."""
    cdef Py_ssize_t apart = op.batch_offset[b] - op.batch_offset[b0]
    if op.page_ids != NULL:
        return op.page_first[b] == op.page_first[b0] and 0 <= apart < op.page_stride
    return apart == 0 or 0 < apart < op.row_stride


cdef inline Py_ssize_t group_entries(const Problem *pb, Py_ssize_t max_group,
                                     intp_t *group_first) noexcept nogil:
    """Split the batch entries into runs of at most max_group consecutive
    entries whose K and V rows lie side by side (rows_side_by_side); the
    runs start at group_first[0..n), group_first[n] = n_batch. Returns n.
    Each entry's arithmetic is the same in any group, so the grouping may
    depend on the thread count."""
    cdef Py_ssize_t n_groups = 0
    cdef Py_ssize_t b = 0
    cdef Py_ssize_t b0
    while b < pb.n_batch:
        b0 = b
        group_first[n_groups] = b0
        n_groups += 1
        b += 1
        while (b < pb.n_batch and b - b0 < max_group
               and rows_side_by_side(&pb.k, b0, b) and rows_side_by_side(&pb.v, b0, b)):
            b += 1
    group_first[n_groups] = pb.n_batch
    return n_groups


cdef struct GroupOrder:
    intp_t n_keys                # keys of the group's first entry
    intp_t group


cdef inline int longer_first(const void *a, const void *b) noexcept nogil:
    cdef const GroupOrder *x = <const GroupOrder *>a
    cdef const GroupOrder *y = <const GroupOrder *>b
    if x.n_keys != y.n_keys:
        return -1 if x.n_keys > y.n_keys else 1
    return -1 if x.group < y.group else (1 if x.group > y.group else 0)


cdef inline void order_longest_first(const Problem *pb, const intp_t *group_first,
                                     Py_ssize_t n_groups, GroupOrder *order) noexcept nogil:
    """The groups in the order their items are taken: when groups hold
    several entries (coarse items), those with the most keys first, so that
    the dynamic schedule ends on short items (shortest first would leave one
    thread its longest sequence alone at the end). Items of one entry each
    keep the batch order, whose neighbours share pages and cache lines. The
    order does not change results."""
    cdef Py_ssize_t group
    for group in range(n_groups):
        order[group].group = group
        order[group].n_keys = (pb.kv_length[group_first[group]] if pb.kv_length != NULL
                               else pb.n_keys)
    if pb.kv_length != NULL and n_groups < pb.n_batch:
        qsort(order, n_groups, sizeof(GroupOrder), longer_first)


cdef inline int schedule_decode(Problem *pb, const ca_kernels *kern, int n_threads,
                                floating *out) noexcept nogil:
    """Few query rows: items are (group of batch entries, key chunk), K/V
    read in place."""
    cdef Py_ssize_t n_splits = 1
    cdef Py_ssize_t n_items, item, b, group, n_groups
    cdef Py_ssize_t max_group = DIRECT_GROUP
    cdef Workspace *ws = NULL
    cdef floating *partial = NULL
    cdef intp_t *group_first = NULL
    cdef GroupOrder *order = NULL
    cdef int status = 0
    cdef int *status_ptr = &status
    cdef int n_workers = n_threads
    if pb.n_batch < SPLIT_TARGET_ITEMS:
        n_splits = (SPLIT_TARGET_ITEMS + pb.n_batch - 1) // pb.n_batch
        if n_splits > (pb.n_keys + SPLIT_MIN_KEYS - 1) // SPLIT_MIN_KEYS:
            n_splits = (pb.n_keys + SPLIT_MIN_KEYS - 1) // SPLIT_MIN_KEYS
        if n_splits < 1:
            n_splits = 1
    pb.split_keys = round_up((pb.n_keys + n_splits - 1) // n_splits, K_BLOCK)
    if pb.split_keys == 0:
        pb.split_keys = K_BLOCK
    pb.n_splits = (pb.n_keys + pb.split_keys - 1) // pb.split_keys
    if pb.n_splits < 1:
        pb.n_splits = 1
    # a chunk's rows fold their state by key steps, not blocks
    pb.fold_steps = fold_period(pb.split_keys // direct_key_step(pb))
    # the splits depend on the shape alone (the results do not depend on the
    # thread count); the groups only on how many items the threads need
    while max_group > 1 and n_workers > 1 and (
            pb.n_batch * pb.n_splits < GROUP_ITEMS_PER_THREAD * n_workers * max_group):
        max_group //= 2
    group_first = <intp_t *>malloc((pb.n_batch + 1) * sizeof(intp_t)
                                   + pb.n_batch * sizeof(GroupOrder))
    if group_first == NULL:
        return -1
    order = <GroupOrder *>(group_first + pb.n_batch + 1)
    n_groups = group_entries(pb, max_group, group_first)
    # workspaces for the largest group there is
    max_group = 1
    for group in range(n_groups):
        if group_first[group + 1] - group_first[group] > max_group:
            max_group = group_first[group + 1] - group_first[group]
    order_longest_first(pb, group_first, n_groups, order)
    n_items = n_groups * pb.n_splits
    if n_workers > n_items:
        n_workers = <int>n_items
    if pb.n_splits > 1:
        partial = <floating *>ca_scratch_acquire(
            CA_SCRATCH_PARTIAL, pb.n_batch * pb.n_splits * pb.n_queries * (pb.d_v + 2)
            * sizeof(floating))
        if partial == NULL:
            free(group_first)
            return -1
    if n_workers <= 1:
        ws = workspace_new_group(pb, sizeof(floating), max_group)
        if ws == NULL:
            status = -1
        else:
            for item in range(n_items):
                group = order[item // pb.n_splits].group
                attend_key_chunk(pb, kern, ws, group_first[group],
                                 group_first[group + 1] - group_first[group],
                                 item % pb.n_splits, out, partial)
            workspace_delete(ws)
            thread_done(kern)
        if status == 0 and pb.n_splits > 1:
            for b in range(pb.n_batch):
                merge_splits(pb, b, partial, out)
    else:
        ca_note_parallel_region()
        with parallel(num_threads=n_workers):
            ws = workspace_new_group(pb, sizeof(floating), max_group)
            if ws == NULL:
                status_ptr[0] = -1
            for item in prange(n_items, schedule='dynamic'):
                if ws != NULL:
                    group = order[item // pb.n_splits].group
                    attend_key_chunk(pb, kern, ws, group_first[group],
                                     group_first[group + 1] - group_first[group],
                                     item % pb.n_splits, out, partial)
            workspace_delete(ws)
            thread_done(kern)
            if pb.n_splits > 1:
                for b in prange(pb.n_batch, schedule='static'):
                    if status_ptr[0] == 0:
                        merge_splits(pb, b, partial, out)
    ca_scratch_release(CA_SCRATCH_PARTIAL, partial)
    free(group_first)
    return status


cdef inline int schedule_packed(Problem *pb, const ca_kernels *kern, int n_threads,
                                floating *out, floating *scores) noexcept nogil:
    """Pack K/V once, then blocks of query rows across threads."""
    cdef Py_ssize_t n_query_blocks = (pb.n_queries + Q_BLOCK - 1) // Q_BLOCK
    cdef Py_ssize_t n_items = n_query_blocks * pb.n_batch
    # with few query rows K and V are read in place, not packed
    cdef Py_ssize_t n_packed = 0 if pb.direct else pb.n_kv * pb.n_key_blocks
    cdef Py_ssize_t item, packed_block, b
    cdef Workspace *ws = NULL
    cdef int status = 0
    cdef int *status_ptr = &status
    cdef size_t itemsize = sizeof(floating)
    cdef int n_workers = n_threads
    if n_items == 0:
        return 0
    if n_workers > n_items:
        n_workers = <int>n_items
    # Each packed K/V entry read by one batch entry, or by a run of them
    # (grouped-query heads), and one thread, or few query blocks per entry,
    # or many K/V entries per thread (many short sequences, as in a BERT
    # batch, or many heads), or as many K/V entries of one length for each
    # thread: a work item is a K/V entry with its readers, which packs it
    # and at once computes their query blocks while the packed blocks are
    # still in cache (packing every entry first writes them all out to L3
    # or memory and reads them back). Otherwise everything is
    # packed first, then query blocks are spread over the threads, which
    # balances them where entries are few or differ in length.
    cdef Py_ssize_t group = entries_per_kv(pb) if n_packed > 0 else 0
    cdef bint entries_alike = (pb.q_length == NULL and pb.kv_length == NULL
                               and pb.kv_extent == NULL)
    cdef bint per_entry = (group > 0 and (
        n_workers == 1
        or (n_query_blocks * group <= PER_ENTRY_MAX_BLOCKS and pb.n_kv >= 4 * n_workers)
        or pb.n_kv >= PER_ENTRY_MIN_ENTRIES * n_workers
        or (entries_alike and pb.n_kv % n_workers == 0
            and pb.n_kv >= PER_ENTRY_ALIKE_ENTRIES * n_workers)))
    if per_entry:
        # each thread packs into its own blocks (compute_whole_entry)
        n_packed = 0
    cdef size_t k_bytes = packed_k_bytes(pb, n_packed, itemsize)
    cdef size_t v_bytes = packed_v_bytes(pb, n_packed, itemsize)
    cdef char *packed = NULL
    if not per_entry:
        packed = <char *>ca_scratch_acquire(CA_SCRATCH_PACKED, k_bytes + v_bytes + n_packed)
        if packed == NULL:
            return -1
    pb.packed_k = packed
    pb.packed_v = packed + k_bytes
    pb.value_nonfinite = <uint8_t *>(packed + k_bytes + v_bytes)
    # with a sliding window or left padding, the key blocks before every
    # reader's first key are not packed (a prompt chunk at the end of a long
    # cache, the padding of a batch)
    cdef intp_t *kv_first = NULL
    cdef Py_ssize_t kv, first
    if (pb.window_left >= 0 or pb.kv_start != NULL) and not pb.direct:
        kv_first = <intp_t *>malloc(pb.n_kv * sizeof(intp_t))
        if kv_first == NULL:
            ca_scratch_release(CA_SCRATCH_PACKED, packed)
            return -1
        for kv in range(pb.n_kv):
            kv_first[kv] = pb.n_keys
        for b in range(pb.n_batch):
            first = first_visible_key(pb, b)
            if first < kv_first[pb.kv_of_batch[b]]:
                kv_first[pb.kv_of_batch[b]] = first
        pb.kv_first = kv_first
    if per_entry and n_workers <= 1:
        ws = workspace_new_per_entry(pb, itemsize)
        if ws == NULL:
            status = -1
        else:
            for kv in range(pb.n_kv):
                compute_whole_entry(pb, kern, ws, kv * group, group, n_query_blocks,
                                    (kv + 1) * group, out, scores)
            workspace_delete(ws)
            thread_done(kern)
    elif n_workers <= 1:
        ws = workspace_new(pb, itemsize)
        if ws == NULL:
            status = -1
        else:
            for packed_block in range(n_packed):
                pack_block(pb, ws, packed_block, <floating *>packed_keys(pb, ws, packed_block))
            for item in range(n_items):
                fetch_after(pb, ws, item + 1, n_query_blocks, False)
                compute_query_block(pb, kern, ws, item, n_query_blocks, out, scores)
            workspace_delete(ws)
            thread_done(kern)
    elif per_entry:
        ca_note_parallel_region()
        with parallel(num_threads=n_workers):
            ws = workspace_new_per_entry(pb, itemsize)
            if ws == NULL:
                status_ptr[0] = -1
            for kv in prange(pb.n_kv, schedule='dynamic'):
                if ws != NULL:
                    # the dynamic schedule hands out entries in turn
                    compute_whole_entry(pb, kern, ws, kv * group, group, n_query_blocks,
                                        (kv + n_workers) * group, out, scores)
            workspace_delete(ws)
            thread_done(kern)
    else:
        ca_note_parallel_region()
        with parallel(num_threads=n_workers):
            # assigned inside the parallel block, so private to each thread
            ws = workspace_new(pb, itemsize)
            if ws == NULL:
                status_ptr[0] = -1
            for packed_block in prange(n_packed, schedule='static'):
                if ws != NULL:
                    pack_block(pb, ws, packed_block,
                               <floating *>packed_keys(pb, ws, packed_block))
            # (the end of a prange is a barrier: every block is packed here)
            for item in prange(n_items, schedule='dynamic'):
                if ws != NULL:
                    # the dynamic schedule hands out items in turn
                    fetch_after(pb, ws, item + n_workers, n_query_blocks, False)
                    compute_query_block(pb, kern, ws, item, n_query_blocks, out, scores)
            workspace_delete(ws)
            thread_done(kern)
    pb.kv_first = NULL
    free(kv_first)
    ca_scratch_release(CA_SCRATCH_PACKED, packed)
    return status
