# cython: language_level=3, boundscheck=False, wraparound=False
# cython: cdivision=True, initializedcheck=False
"""Work items of the packed path: one batch entry's block of up to Q_BLOCK
query rows against its packed K/V blocks, without SCORES (attend_query_block) or
writing the SCORES rows as it goes (attend_query_block_with_scores)."""

from cython cimport floating
from libc.math cimport INFINITY
from libc.stdint cimport uint16_t
from libc.string cimport memset
from cattention._driver.kernel_table cimport (
    ca_kernels, ca_round_to_bfloat16, kernel_exp_sum, kernel_pv, kernel_pv_direct,
    kernel_row_max, kernel_score, kernel_score_direct)
from cattention._driver.problem cimport (
    K_BLOCK, Problem, ROW_GROUP, is_fp8, out_row_offset, round_up)
from cattention._driver.operands cimport rows_in_place, scale_row_offset
from cattention._driver.workspace cimport Workspace
from cattention._driver.packing cimport (
    add_nonfinite_values, bf16_query_rows, nonfinite_flag, packed_keys, packed_values,
    query_rows, panel_width)
from cattention._driver.visibility cimport mask_scores, visible_ranges
from cattention._driver.softmax cimport (
    begin_rows, begin_step, collect_totals, exp_sum_by_blocks, finish_rows, fold_sink,
    nan_rows_of_neg_inf_logits, row_sink, softmax_block, start_sums, store_lse,
    store_lse_of_empty_row)


cdef inline const floating *block_query_rows(const Problem *pb, Py_ssize_t b,
                                             Py_ssize_t row0, Py_ssize_t n_rows,
                                             floating *q_packed, Py_ssize_t *ldq) noexcept nogil:
    """The query rows the score tiles read: the compute dtype's (query_rows),
    or with bfloat16 tiles padded bfloat16 rows (bf16_query_rows) in
    q_packed, returned as the same pointer type (score_tiles reads them as
    the table's)."""
    if floating is float:
        if pb.bf16_score:
            return <const floating *>bf16_query_rows(pb, b, row0, n_rows,
                                                     <uint16_t *>q_packed, ldq)
    return query_rows(pb, b, row0, n_rows, q_packed, pb.ld_k, ldq)


cdef inline void score_tiles(const Problem *pb, const ca_kernels *kern, const floating *q_rows,
                             Py_ssize_t ldq, Py_ssize_t first_row, Py_ssize_t n_rows,
                             Py_ssize_t b, Py_ssize_t key0, Py_ssize_t n_keys,
                             const floating *kt, floating *s, Py_ssize_t lds,
                             const void *ahead=NULL, Py_ssize_t ahead_bytes=0) noexcept nogil:
    """Logits of rows first_row.. (of block_query_rows) against keys key0..
    of entry b, a packed K^T block: the table's bfloat16 tiles, or its score
    kernel. Columns past n_keys up to the block's last panel are written
    too (masked later)."""
    cdef Py_ssize_t P = panel_width(kt)
    cdef Py_ssize_t i, j
    cdef float key_scales[K_BLOCK]
    cdef float factor = <float>pb.scale
    cdef bint per_key = False
    if floating is float:
        if pb.bf16_score:
            if is_fp8(pb.k.storage) and n_keys > 0:
                # the tiles multiply the codes: the keys' scales join their
                # logits, folded into the factor where the block's keys share
                # one (a scale per tensor, or per entry and head: a pass
                # over the block's logits less)
                if pb.k.scale_stride == 0 and pb.k.scale_page_stride == 0:
                    factor = <float>(pb.scale * pb.k.scale[scale_row_offset(&pb.k, b, key0)])
                else:
                    per_key = True
            kern.score_bf16(<const uint16_t *>q_rows + first_row * ldq, ldq, n_rows,
                            <const uint16_t *>kt, pb.ld_k * 2 * P, round_up(n_keys, P),
                            pb.d_k, factor, s, lds, ahead, ahead_bytes)
            if per_key:
                # (scale * q.code) * key_scale, as the direct kernels
                for j in range(n_keys):
                    key_scales[j] = pb.k.scale[scale_row_offset(&pb.k, b, key0 + j)]
                for i in range(n_rows):
                    for j in range(n_keys):
                        s[i * lds + j] *= key_scales[j]
            return
    kernel_score(kern, q_rows + first_row * ldq, ldq, n_rows, kt, pb.ld_k * P,
                 round_up(n_keys, P), pb.d_k, pb.scale, s, lds, ahead, ahead_bytes)


cdef inline void pv_tiles(const Problem *pb, const ca_kernels *kern, const floating *p,
                          Py_ssize_t ldp, Py_ssize_t n_rows, const floating *v_packed,
                          Py_ssize_t n_keys, floating *acc, const void *ahead=NULL,
                          Py_ssize_t ahead_bytes=0) noexcept nogil:
    """acc += p . V of a packed block: the table's bfloat16 tiles, or its
    P.V kernel."""
    cdef Py_ssize_t P = panel_width(v_packed)
    if floating is float:
        if pb.bf16_pv:
            kern.pv_bf16(p, ldp, n_rows, <const uint16_t *>v_packed, pb.block_keys * 2 * P,
                         n_keys, pb.ld_v, acc, pb.ld_v, ahead, ahead_bytes)
            return
    kernel_pv(kern, p, ldp, n_rows, v_packed, pb.block_keys * P, n_keys, pb.ld_v, acc,
              pb.ld_v, ahead, ahead_bytes)


cdef inline void attend_query_block(const Problem *pb, const ca_kernels *kern, Workspace *ws,
                                    Py_ssize_t b, Py_ssize_t row0, Py_ssize_t n_rows,
                                    floating *out) noexcept nogil:
    """ATTN for one block of query rows, streaming packed key blocks."""
    cdef floating *q_packed = <floating *>ws.base + ws.off_q
    cdef const floating *q_rows
    cdef Py_ssize_t ldq
    cdef floating *s = <floating *>ws.base + ws.off_s
    cdef floating *acc = <floating *>ws.base + ws.off_acc
    cdef Py_ssize_t first_packed = pb.kv_of_batch[b] * pb.n_key_blocks
    cdef Py_ssize_t key0, n_keys, first_key, last_key, block, group0, group_rows, i
    # keys seen by each group of ROW_GROUP rows (Q_BLOCK / ROW_GROUP <= 16)
    cdef Py_ssize_t group_keys[16]
    cdef Py_ssize_t n_groups, group
    cdef const floating *kt
    cdef const floating *v_packed
    cdef const floating *next_kt
    cdef const floating *next_v
    cdef Py_ssize_t k_block_bytes = pb.ld_k * pb.block_keys * sizeof(floating)
    cdef Py_ssize_t v_block_bytes = pb.block_keys * pb.ld_v * sizeof(floating)

    begin_rows(pb, ws, b, row0, n_rows, acc, &first_key, &last_key)
    if last_key > first_key:
        q_rows = block_query_rows(pb, b, row0, n_rows, q_packed, &ldq)
        # key blocks sit on fixed multiples of K_BLOCK whatever the rows see
        key0 = (first_key // K_BLOCK) * K_BLOCK
        while key0 < last_key:
            n_keys = pb.n_keys - key0 if pb.n_keys - key0 < K_BLOCK else K_BLOCK
            if n_keys > last_key - key0:
                n_keys = last_key - key0
            block = first_packed + key0 // K_BLOCK
            kt = <const floating *>packed_keys(pb, ws, block)
            v_packed = <const floating *>packed_values(pb, ws, block)
            # the next block's K^T and V are fetched into L2 during this one
            next_kt = NULL
            next_v = NULL
            if key0 + K_BLOCK < last_key:
                next_kt = <const floating *>packed_keys(pb, ws, block + 1)
                next_v = <const floating *>packed_values(pb, ws, block + 1)
            elif ws.after_score_bytes > 0 or ws.after_pv_bytes > 0:
                # the last block: what the thread reads next (fetch_after)
                next_kt = <const floating *>ws.after_score
                next_v = <const floating *>ws.after_pv
                k_block_bytes = ws.after_score_bytes
                v_block_bytes = ws.after_pv_bytes
            # keys each group of rows can see in this block: on the causal
            # diagonal the upper rows skip the panels only lower rows see
            n_groups = (n_rows + ROW_GROUP - 1) // ROW_GROUP
            for group in range(n_groups):
                group_keys[group] = 0
            for i in range(n_rows):
                if ws.row_hi[i] - key0 > group_keys[i // ROW_GROUP]:
                    group_keys[i // ROW_GROUP] = ws.row_hi[i] - key0
            for group in range(n_groups):
                if group_keys[group] > n_keys:
                    group_keys[group] = n_keys
            if group_keys[0] == n_keys:
                # the first rows see the whole block, so all do: one call
                score_tiles(pb, kern, q_rows, ldq, 0, n_rows, b, key0, n_keys, kt, s,
                            K_BLOCK, next_kt, k_block_bytes)
            else:
                for i in range(n_groups):
                    group0 = i * ROW_GROUP
                    group_rows = min(ROW_GROUP, n_rows - group0)
                    if group_keys[i] > 0:
                        score_tiles(pb, kern, q_rows, ldq, group0, group_rows, b, key0,
                                    group_keys[i], kt, s + group0 * K_BLOCK, K_BLOCK)
            # columns a group skipped lie past its rows' visible range, so
            # masking overwrites them with -inf before anything reads them
            mask_scores(pb, b, row0, n_rows, key0, n_keys, ws.row_lo, ws.row_hi, s, K_BLOCK)
            softmax_block(pb, kern, ws, n_rows, n_keys, s)
            if group_keys[0] == n_keys:
                pv_tiles(pb, kern, s, K_BLOCK, n_rows, v_packed, n_keys, acc, next_v,
                         v_block_bytes)
            else:
                for i in range(n_groups):
                    group0 = i * ROW_GROUP
                    group_rows = min(ROW_GROUP, n_rows - group0)
                    if group_keys[i] > 0:
                        pv_tiles(pb, kern, s + group0 * K_BLOCK, K_BLOCK, group_rows,
                                 v_packed, group_keys[i], acc + group0 * pb.ld_v)
            if nonfinite_flag(pb, ws, block)[0]:
                add_nonfinite_values(pb, b, key0, n_keys, s, K_BLOCK, n_rows, acc, pb.ld_v)
            key0 += K_BLOCK
    if floating is float:
        if pb.out_bf16 != NULL:
            # bfloat16 ATTN: the rows finished in place in the accumulator,
            # then rounded into it while they are in cache (no float32 ATTN)
            finish_rows(pb, ws, n_rows, acc, pb.ld_v, b * pb.n_queries + row0)
            for i in range(n_rows):
                ca_round_to_bfloat16(acc + i * pb.ld_v,
                                     pb.out_bf16 + out_row_offset(pb, b, row0 + i), pb.d_v)
            return
    finish_rows(pb, ws, n_rows, out + out_row_offset(pb, b, row0), pb.ld_out,
                b * pb.n_queries + row0)


cdef inline void attend_query_block_with_scores(const Problem *pb, const ca_kernels *kern,
                                                Workspace *ws, Py_ssize_t b, Py_ssize_t row0,
                                                Py_ssize_t n_rows, floating *out,
                                                floating *scores) noexcept nogil:
    """SCORES and (if out is not NULL) ATTN for one block of query rows.

    The rows of the caller's SCORES array are the scratch: logits are written
    there, then turned into weights in place, then multiplied by V."""
    cdef floating *q_packed = <floating *>ws.base + ws.off_q
    cdef const floating *q_rows
    cdef Py_ssize_t ldq
    cdef floating *s = <floating *>ws.base + ws.off_s
    cdef const floating *kt
    cdef const floating *v_packed
    cdef Py_ssize_t first_packed = pb.kv_of_batch[b] * pb.n_key_blocks
    cdef floating *acc = <floating *>ws.base + ws.off_acc
    cdef floating *row_max = <floating *>ws.base + ws.off_max
    cdef Py_ssize_t P = panel_width(q_packed)
    cdef Py_ssize_t n_keys_total = pb.n_keys
    cdef Py_ssize_t ld_scores = pb.ld_scores
    cdef Py_ssize_t i, j, c, key0, n_keys, first_key, last_key, first_block
    cdef floating tile_max, row_total, weight
    cdef double sink
    cdef floating *s_row
    cdef floating *scores_row
    cdef floating *scores_block = scores + (b * pb.n_queries + row0) * ld_scores
    cdef const floating *k_rows
    cdef const floating *v_rows
    cdef Py_ssize_t ld_rows, ld_tile
    cdef floating *tile
    cdef bint in_place

    visible_ranges(pb, b, row0, n_rows, ws.row_lo, ws.row_hi)
    first_key = n_keys_total
    last_key = 0
    for i in range(n_rows):
        if ws.row_hi[i] > ws.row_lo[i]:
            if ws.row_lo[i] < first_key:
                first_key = ws.row_lo[i]
            if ws.row_hi[i] > last_key:
                last_key = ws.row_hi[i]
        row_max[i] = -INFINITY

    if last_key <= first_key:
        for i in range(n_rows):
            store_lse_of_empty_row(pb, b * pb.n_queries + row0 + i, row_max[i])
        for i in range(n_rows):
            memset(scores_block + i * ld_scores, 0, n_keys_total * sizeof(floating))
            if out != NULL:
                memset(out + out_row_offset(pb, b, row0 + i), 0,
                       pb.d_v * sizeof(floating))
        return

    first_block = (first_key // K_BLOCK) * K_BLOCK
    if pb.direct:
        q_rows = query_rows(pb, b, row0, n_rows, q_packed, pb.ld_k, &ldq)
    else:
        q_rows = block_query_rows(pb, b, row0, n_rows, q_packed, &ldq)
    # pass 1: masked logits into SCORES, keys nobody sees as zeros
    for i in range(n_rows):
        scores_row = scores_block + i * ld_scores
        memset(scores_row, 0, first_block * sizeof(floating))
        if last_key < n_keys_total:
            memset(scores_row + last_key, 0, (n_keys_total - last_key) * sizeof(floating))
    key0 = first_block
    while key0 < last_key:
        n_keys = n_keys_total - key0 if n_keys_total - key0 < K_BLOCK else K_BLOCK
        if key0 + n_keys > last_key:
            n_keys = last_key - key0
        # logits go straight into SCORES, unless the kernel would write
        # past the block (a last block whose keys are not whole panels)
        in_place = pb.direct or n_keys % P == 0
        if in_place:
            tile = scores_block + key0
            ld_tile = ld_scores
        else:
            tile = s
            ld_tile = K_BLOCK
        if pb.direct:
            # few rows: keys read in place, as on the direct path
            k_rows = rows_in_place(pb, &pb.k, b, key0, n_keys, pb.d_k,
                                   <floating *>ws.base + ws.off_k_rows, pb.ld_k, &ld_rows,
                                   NULL)
            kernel_score_direct(kern, q_rows, ldq, n_rows, k_rows, ld_rows, n_keys,
                                pb.d_k, pb.scale, tile, ld_tile, NULL, 0, 0)
        else:
            kt = <const floating *>packed_keys(pb, ws, first_packed + key0 // K_BLOCK)
            score_tiles(pb, kern, q_rows, ldq, 0, n_rows, b, key0, n_keys, kt, tile, ld_tile)
        mask_scores(pb, b, row0, n_rows, key0, n_keys, ws.row_lo, ws.row_hi, tile, ld_tile)
        for i in range(n_rows):
            s_row = tile + i * ld_tile
            if not in_place:
                scores_row = scores_block + i * ld_scores + key0
                for j in range(n_keys):
                    scores_row[j] = s_row[j]
            tile_max = kernel_row_max(kern, s_row, n_keys)
            if tile_max > row_max[i] or tile_max != tile_max:
                row_max[i] = tile_max
        key0 += K_BLOCK

    # pass 2: weights in place over the keys this item can see
    nan_rows_of_neg_inf_logits(pb, n_rows, b * pb.n_queries + row0, row_max)
    for i in range(n_rows):
        scores_row = scores_block + i * ld_scores
        if row_max[i] == -INFINITY:
            store_lse_of_empty_row(pb, b * pb.n_queries + row0 + i, row_max[i])
            memset(scores_row + first_block, 0, (last_key - first_block) * sizeof(floating))
            continue
        row_total = exp_sum_by_blocks(pb, scores_row + first_block, last_key - first_block,
                                      row_max[i])
        if row_sink(pb, b * pb.n_queries + row0 + i, &sink):
            # the weights, and so ATTN = SCORES . V, include the sink
            weight = fold_sink(&row_max[i], &row_total, sink) / row_total
            store_lse(pb, b * pb.n_queries + row0 + i, row_max[i], row_total)
            for j in range(first_block, last_key):
                scores_row[j] = scores_row[j] * weight
            continue
        store_lse(pb, b * pb.n_queries + row0 + i, row_max[i], row_total)
        for j in range(first_block, last_key):
            scores_row[j] = scores_row[j] / row_total

    if out == NULL:
        return

    # pass 3: ATTN = SCORES . V
    start_sums(pb, ws, n_rows, acc)
    key0 = first_block
    while key0 < last_key:
        n_keys = last_key - key0 if last_key - key0 < K_BLOCK else K_BLOCK
        begin_step(pb, ws, n_rows, acc)
        if pb.direct:
            v_rows = rows_in_place(pb, &pb.v, b, key0, n_keys, pb.d_v,
                                   <floating *>ws.base + ws.off_v_rows, pb.ld_v, &ld_rows,
                                   NULL)
            kernel_pv_direct(kern, scores_block + key0, ld_scores, n_rows, v_rows,
                             ld_rows, n_keys, pb.d_v, acc, pb.ld_v, NULL, 0, 0)
        else:
            v_packed = <const floating *>packed_values(pb, ws,
                                                       first_packed + key0 // K_BLOCK)
            pv_tiles(pb, kern, scores_block + key0, ld_scores, n_rows, v_packed, n_keys, acc)
            if nonfinite_flag(pb, ws, first_packed + key0 // K_BLOCK)[0]:
                add_nonfinite_values(pb, b, key0, n_keys, scores_block + key0, ld_scores,
                                     n_rows, acc, pb.ld_v)
        key0 += K_BLOCK
    collect_totals(pb, ws, n_rows, acc)
    for i in range(n_rows):
        for c in range(pb.d_v):
            out[out_row_offset(pb, b, row0 + i) + c] = acc[i * pb.ld_v + c]
