# cython: language_level=3, boundscheck=False, wraparound=False
# cython: cdivision=True, initializedcheck=False
"""Work items of the direct (decode) path: up to DIRECT_ROWS query rows of a
few batch entries against one chunk of keys, reading K and V where they are
(copied only when their features are strided; a paged cache page by page).
The entries of an item step through the keys together (see
rows_side_by_side in _schedule)."""

from cython cimport floating
from libc.stdint cimport int8_t, uint8_t, uint16_t
from cattention._driver.kernel_table cimport (
    ca_kernels, ca_prefetch_l1, kernel_pv_direct, kernel_score_direct)
from cattention._driver.problem cimport (
    DIRECT_GROUP, DIRECT_KEYS, K_BLOCK, NEXT_CALL_ROWS, STORE_BF16, STORE_F16, STORE_I8, Operand,
    Problem, entry_rows, fp8_format, is_fp8, is_one_byte, out_row_offset)
from cattention._driver.operands cimport (
    byte_rows_for_kernel, contiguous_run, contiguous_rows, features_contiguous, operand_itemsize,
    row_offset, row_scales, rows_in_place)
from cattention._driver.workspace cimport Workspace
from cattention._driver.packing cimport pack_queries
from cattention._driver.visibility cimport mask_scores
from cattention._driver.softmax cimport begin_rows, collect_totals, finish_rows, softmax_block


cdef inline void prefetch_first_rows(const Problem *pb, const Operand *op, Py_ssize_t b,
                                     Py_ssize_t key, Py_ssize_t n_keys,
                                     Py_ssize_t n_features) noexcept nogil:
    """Bring the first rows (at most NEXT_CALL_ROWS) of the n_keys rows of
    entry b from ``key`` into L1, for the kernel call after the one about
    to run (the kernels bring rows into L1 only ahead within their call)."""
    cdef const char *row = contiguous_rows(pb, op, b, key, n_keys, n_features)
    cdef Py_ssize_t row_bytes = n_features * operand_itemsize(pb, op)
    cdef Py_ssize_t stride = op.row_stride * operand_itemsize(pb, op)
    cdef Py_ssize_t i, at
    if row == NULL:
        return
    for i in range(n_keys if n_keys < NEXT_CALL_ROWS else NEXT_CALL_ROWS):
        at = 0
        while at < row_bytes:
            ca_prefetch_l1(row + i * stride + at)
            at += 64


cdef inline Py_ssize_t direct_key_step(const Problem *pb) noexcept nogil:
    # int8 and fp8 rows are a quarter of float32's: twice the keys per step
    # keep the step's K and V in L1 and halve the per-step bookkeeping (the
    # float paths keep DIRECT_KEYS, and so their results)
    if is_one_byte(pb.k.storage) and is_one_byte(pb.v.storage):
        return 2 * DIRECT_KEYS
    return DIRECT_KEYS


cdef inline void begin_chunk(const Problem *pb, Workspace *ws, Py_ssize_t b, Py_ssize_t split,
                             floating *acc, Py_ssize_t *first_key,
                             Py_ssize_t *last_key) noexcept nogil:
    """A fresh state for the rows of entry b in ws (accumulator acc, ws's),
    and the keys of chunk ``split`` they see (none when last_key <=
    first_key); their query rows are packed when they see some."""
    cdef Py_ssize_t n_rows = entry_rows(pb, b)
    cdef Py_ssize_t chunk_lo = split * pb.split_keys
    cdef Py_ssize_t chunk_hi = chunk_lo + pb.split_keys
    first_key[0] = 0
    last_key[0] = 0
    if n_rows == 0:
        return
    begin_rows(pb, ws, b, 0, n_rows, acc, first_key, last_key)
    if first_key[0] < chunk_lo:
        first_key[0] = chunk_lo
    if last_key[0] > chunk_hi:
        last_key[0] = chunk_hi
    if last_key[0] > first_key[0]:
        pack_queries(pb, b, 0, n_rows, <floating *>ws.base + ws.off_q, pb.ld_k)


cdef inline Py_ssize_t step_keys(const Problem *pb, Py_ssize_t key0, Py_ssize_t key_step,
                                 Py_ssize_t first_key, Py_ssize_t last_key) noexcept nogil:
    """Keys of the step from key0 an entry reads (0: none; its keys, a
    multiple of key_step from first_key, end at last_key)."""
    cdef Py_ssize_t n_keys
    if not first_key <= key0 < last_key:
        return 0
    n_keys = pb.n_keys - key0 if pb.n_keys - key0 < key_step else key_step
    if pb.kv_extent != NULL and n_keys > last_key - key0:
        # entries of their own lengths: the keys past the last one
        # visible may not exist (a paged cache, the last sequence)
        n_keys = last_key - key0
    return n_keys


cdef inline void score_run(const Problem *pb, const ca_kernels *kern, Workspace *ws,
                           Py_ssize_t b, Py_ssize_t key0, Py_ssize_t j, Py_ssize_t run,
                           floating *s) noexcept nogil:
    """Logits of entry b's rows (state in ws) for keys key0 + j.. key0 + j +
    run (rows row_stride apart) into columns j.. of its score tile s; the
    kernel prefetches the same rows of V, which P.V reads next."""
    cdef floating *q_rows = <floating *>ws.base + ws.off_q
    cdef Py_ssize_t n_rows = entry_rows(pb, b)
    cdef Py_ssize_t ld_k_rows
    cdef const floating *k_rows
    cdef const int8_t *k_int8
    cdef const char *v_rows
    cdef Py_ssize_t v_stride_bytes, v_row_bytes
    if floating is float and pb.k.storage == STORE_I8:
        # int8 keys with their scales, read where they are (gathered when
        # their features are strided)
        k_int8 = byte_rows_for_kernel(&pb.k, b, key0 + j, run, pb.d_k,
                                      <int8_t *>(<floating *>ws.base + ws.off_k_rows),
                                      &ld_k_rows)
        kern.score_direct_i8(q_rows, pb.ld_k, n_rows, k_int8, ld_k_rows, run, pb.d_k,
                             <float>pb.scale, row_scales(&pb.k, b, key0 + j),
                             pb.k.scale_stride, s + j, K_BLOCK)
        return
    v_rows = contiguous_rows(pb, &pb.v, b, key0 + j, run, pb.d_v)
    v_stride_bytes = pb.v.row_stride * operand_itemsize(pb, &pb.v)
    v_row_bytes = pb.d_v * operand_itemsize(pb, &pb.v)
    if floating is float and is_fp8(pb.k.storage):
        # fp8 keys read where they are (gathered when their features are
        # strided), widened in registers; their scales join the logits
        k_int8 = byte_rows_for_kernel(&pb.k, b, key0 + j, run, pb.d_k,
                                      <int8_t *>(<floating *>ws.base + ws.off_k_rows),
                                      &ld_k_rows)
        kern.score_direct_fp8(q_rows, pb.ld_k, n_rows, <const uint8_t *>k_int8, ld_k_rows, run,
                              pb.d_k, fp8_format(pb.k.storage), <float>pb.scale,
                              row_scales(&pb.k, b, key0 + j), pb.k.scale_stride, s + j,
                              K_BLOCK, v_rows, v_stride_bytes, v_row_bytes)
        return
    if floating is float and features_contiguous(&pb.k, pb.d_k) and (
            pb.k.storage == STORE_F16 or pb.k.storage == STORE_BF16):
        # float16 and bfloat16 keys read where they lie (the run is within
        # one page) and converted in registers: the bits of converting them
        # first
        (kern.score_direct_f16 if pb.k.storage == STORE_F16 else kern.score_direct_bf16)(
            q_rows, pb.ld_k, n_rows, <const uint16_t *>pb.k.data + row_offset(&pb.k, b, key0 + j),
            pb.k.row_stride, run, pb.d_k, <float>pb.scale, s + j, K_BLOCK, v_rows,
            v_stride_bytes, v_row_bytes)
        return
    k_rows = rows_in_place(pb, &pb.k, b, key0 + j, run, pb.d_k,
                           <floating *>ws.base + ws.off_k_rows, pb.ld_k, &ld_k_rows, NULL)
    kernel_score_direct(kern, q_rows, pb.ld_k, n_rows, k_rows, ld_k_rows, run,
                        pb.d_k, pb.scale, s + j, K_BLOCK, v_rows, v_stride_bytes, v_row_bytes)


cdef inline void pv_run(const Problem *pb, const ca_kernels *kern, Workspace *ws,
                        Py_ssize_t b, Py_ssize_t key0, Py_ssize_t j, Py_ssize_t run,
                        const floating *s, floating *acc, Py_ssize_t next_keys) noexcept nogil:
    """acc += weights j.. j + run of s times V rows key0 + j.. of entry b;
    the kernel prefetches the same rows of K at the next step (next_keys
    keys of this entry from key0 + key_step), which its scores read next."""
    cdef Py_ssize_t n_rows = entry_rows(pb, b)
    cdef Py_ssize_t ld_v_rows
    cdef const floating *v_rows
    cdef const int8_t *v_int8
    cdef const char *next_k
    cdef Py_ssize_t k_stride_bytes, k_row_bytes
    if floating is float and pb.v.storage == STORE_I8:
        v_int8 = byte_rows_for_kernel(&pb.v, b, key0 + j, run, pb.d_v,
                                      <int8_t *>(<floating *>ws.base + ws.off_v_rows),
                                      &ld_v_rows)
        kern.pv_direct_i8(s + j, K_BLOCK, n_rows, v_int8, ld_v_rows, run, pb.d_v,
                          row_scales(&pb.v, b, key0 + j), pb.v.scale_stride, acc, pb.ld_v)
        return
    # (x86 drops a prefetch past the end of K without a fault; a page
    # table is read only where the sequence has pages)
    next_k = (
        contiguous_rows(pb, &pb.k, b, key0 + direct_key_step(pb) + j, run, pb.d_k)
        if (next_keys > j if pb.k.page_ids == NULL else next_keys >= j + run) else NULL)
    k_stride_bytes = pb.k.row_stride * operand_itemsize(pb, &pb.k)
    k_row_bytes = pb.d_k * operand_itemsize(pb, &pb.k)
    if floating is float and is_fp8(pb.v.storage):
        # fp8 values likewise, their scales joining the weights
        v_int8 = byte_rows_for_kernel(&pb.v, b, key0 + j, run, pb.d_v,
                                      <int8_t *>(<floating *>ws.base + ws.off_v_rows),
                                      &ld_v_rows)
        kern.pv_direct_fp8(s + j, K_BLOCK, n_rows, <const uint8_t *>v_int8, ld_v_rows, run,
                           pb.d_v, fp8_format(pb.v.storage), row_scales(&pb.v, b, key0 + j),
                           pb.v.scale_stride, acc, pb.ld_v, next_k, k_stride_bytes,
                           k_row_bytes)
        return
    if floating is float and features_contiguous(&pb.v, pb.d_v) and (
            pb.v.storage == STORE_F16 or pb.v.storage == STORE_BF16):
        # float16 and bfloat16 values read where they lie, as score_run's keys
        (kern.pv_direct_f16 if pb.v.storage == STORE_F16 else kern.pv_direct_bf16)(
            s + j, K_BLOCK, n_rows, <const uint16_t *>pb.v.data + row_offset(&pb.v, b, key0 + j),
            pb.v.row_stride, run, pb.d_v, acc, pb.ld_v, next_k, k_stride_bytes, k_row_bytes)
        return
    v_rows = rows_in_place(pb, &pb.v, b, key0 + j, run, pb.d_v,
                           <floating *>ws.base + ws.off_v_rows, pb.ld_v, &ld_v_rows, NULL)
    kernel_pv_direct(kern, s + j, K_BLOCK, n_rows, v_rows, ld_v_rows, run, pb.d_v, acc,
                     pb.ld_v, next_k, k_stride_bytes, k_row_bytes)


cdef inline void end_chunk(const Problem *pb, Workspace *ws, Py_ssize_t b, Py_ssize_t split,
                           floating *out, floating *partial) noexcept nogil:
    """Entry b's rows from their state in ws: with one chunk the result goes
    to out; otherwise the chunk's row maximum, sum and accumulator go to
    ``partial`` for merge_splits."""
    cdef floating *acc = <floating *>ws.base + ws.off_acc
    cdef floating *row_max = <floating *>ws.base + ws.off_max
    cdef floating *row_sum = <floating *>ws.base + ws.off_sum
    cdef Py_ssize_t n_rows = entry_rows(pb, b)
    cdef Py_ssize_t i, c
    cdef floating *state
    if n_rows == 0:
        return
    if pb.n_splits == 1:
        finish_rows(pb, ws, n_rows, out + out_row_offset(pb, b, 0), pb.ld_out,
                    b * pb.n_queries)
        return
    # per row: maximum, sum, then the unnormalised accumulator
    collect_totals(pb, ws, n_rows, acc)
    state = partial + (b * pb.n_splits + split) * pb.n_queries * (pb.d_v + 2)
    for i in range(n_rows):
        state[0] = row_max[i]
        state[1] = row_sum[i]
        for c in range(pb.d_v):
            state[2 + c] = acc[i * pb.ld_v + c]
        state += pb.d_v + 2


cdef inline void attend_key_chunk(const Problem *pb, const ca_kernels *kern, Workspace *ws,
                                  Py_ssize_t b0, Py_ssize_t n_entries, Py_ssize_t split,
                                  floating *out, floating *partial) noexcept nogil:
    """ATTN of entries b0..b0 + n_entries (at most DIRECT_GROUP; the state of
    entry b0 + g in ws[g]) over key chunk ``split``, K and V read in place.

    The entries take each key step together: the scores of every entry over
    one run of rows (a page), then the next run, then each entry's online
    softmax, then P.V run by run likewise. Where the entries' rows lie side
    by side (the K/V heads of a page) the item so reads memory in order,
    where one entry at a time reads 8 KiB of one page, then of another.
    Each entry's arithmetic is the same as alone."""
    cdef Py_ssize_t key_step = direct_key_step(pb)
    cdef Py_ssize_t first_key[DIRECT_GROUP]
    cdef Py_ssize_t last_key[DIRECT_GROUP]
    cdef Py_ssize_t n_keys[DIRECT_GROUP]
    cdef Py_ssize_t key_lo = pb.n_keys
    cdef Py_ssize_t key_hi = 0
    cdef Py_ssize_t g, key0, j, run, step_end, next_keys
    cdef floating *s
    for g in range(n_entries):
        begin_chunk(pb, &ws[g], b0 + g, split, <floating *>ws[g].base + ws[g].off_acc,
                    &first_key[g], &last_key[g])
        if last_key[g] > first_key[g]:
            # each entry steps from a multiple of key_step, as alone
            first_key[g] = (first_key[g] // key_step) * key_step
            if first_key[g] < key_lo:
                key_lo = first_key[g]
            if last_key[g] > key_hi:
                key_hi = last_key[g]
    key0 = key_lo
    while key0 < key_hi:
        step_end = 0
        for g in range(n_entries):
            n_keys[g] = step_keys(pb, key0, key_step, first_key[g], last_key[g])
            if n_keys[g] > step_end:
                step_end = n_keys[g]
        # (runs end where pages do, at the same keys for every entry)
        j = 0
        while j < step_end:
            run = contiguous_run(&pb.k, key0 + j, step_end - j)
            for g in range(n_entries):
                if n_keys[g] > j:
                    if g + 1 < n_entries and n_keys[g + 1] > j:
                        prefetch_first_rows(pb, &pb.k, b0 + g + 1, key0 + j, run, pb.d_k)
                    score_run(pb, kern, &ws[g], b0 + g, key0, j,
                              run if n_keys[g] - j > run else n_keys[g] - j,
                              <floating *>ws[g].base + ws[g].off_s)
            j += run
        for g in range(n_entries):
            if n_keys[g] > 0:
                s = <floating *>ws[g].base + ws[g].off_s
                mask_scores(pb, b0 + g, 0, entry_rows(pb, b0 + g), key0, n_keys[g],
                            ws[g].row_lo, ws[g].row_hi, s, K_BLOCK)
                softmax_block(pb, kern, &ws[g], entry_rows(pb, b0 + g), n_keys[g], s)
        j = 0
        while j < step_end:
            run = contiguous_run(&pb.v, key0 + j, step_end - j)
            for g in range(n_entries):
                if n_keys[g] > j:
                    if g + 1 < n_entries and n_keys[g + 1] > j:
                        prefetch_first_rows(pb, &pb.v, b0 + g + 1, key0 + j, run, pb.d_v)
                    next_keys = step_keys(pb, key0 + key_step, key_step, first_key[g],
                                          last_key[g])
                    pv_run(pb, kern, &ws[g], b0 + g, key0, j,
                           run if n_keys[g] - j > run else n_keys[g] - j,
                           <floating *>ws[g].base + ws[g].off_s,
                           <floating *>ws[g].base + ws[g].off_acc, next_keys)
            j += run
        key0 += key_step
    for g in range(n_entries):
        end_chunk(pb, &ws[g], b0 + g, split, out, partial)
