# cython: language_level=3, boundscheck=False, wraparound=False
# cython: cdivision=True, initializedcheck=False
"""Online-softmax state of a work item: begin (running maximum -inf, sum 0),
fold in one key block (rescaling the accumulator when the maximum grows;
on long rows the running sums and accumulators join totals every
fold_steps blocks, so that no float32 rounding chain is as long as the
row), finish (fold in the row's attention sink, divide by the sum, store
the log-sum-exp); and the merge of the partial results of a decode step
split over key chunks (the log-sum-exp rule, in a fixed order)."""

from cython cimport floating
from libc.math cimport INFINITY, NAN, exp, ldexp, log
from libc.string cimport memcpy, memset
from cattention._driver.kernel_table cimport (
    ca_kernels, kernel_divide_rows, kernel_exp_sum, kernel_row_max)
from cattention._driver.problem cimport K_BLOCK, Problem, entry_rows, out_row_offset
from cattention._driver.workspace cimport Workspace
from cattention._driver.visibility cimport sees_a_key, visible_ranges


cdef inline void begin_rows(const Problem *pb, Workspace *ws, Py_ssize_t b, Py_ssize_t row0,
                            Py_ssize_t n_rows, floating *acc, Py_ssize_t *first_key,
                            Py_ssize_t *last_key) noexcept nogil:
    """Visible key ranges of the rows, the range over all of them, and a
    fresh online-softmax state (row maximum -inf, sum 0, accumulator ``acc``,
    the workspace's, 0)."""
    cdef floating *row_max = <floating *>ws.base + ws.off_max
    cdef Py_ssize_t i
    visible_ranges(pb, b, row0, n_rows, ws.row_lo, ws.row_hi)
    first_key[0] = pb.n_keys
    last_key[0] = 0
    for i in range(n_rows):
        if ws.row_hi[i] > ws.row_lo[i]:
            if ws.row_lo[i] < first_key[0]:
                first_key[0] = ws.row_lo[i]
            if ws.row_hi[i] > last_key[0]:
                last_key[0] = ws.row_hi[i]
        row_max[i] = -INFINITY
    start_sums(pb, ws, n_rows, acc)


cdef inline void start_sums(const Problem *pb, Workspace *ws, Py_ssize_t n_rows,
                            floating *acc) noexcept nogil:
    """Running sums and accumulators (acc: the workspace's) 0, no totals."""
    memset(<floating *>ws.base + ws.off_sum, 0, n_rows * sizeof(floating))
    memset(acc, 0, n_rows * pb.ld_v * sizeof(floating))
    ws.steps_since_fold = 0
    ws.has_totals = False


cdef inline void begin_step(const Problem *pb, Workspace *ws, Py_ssize_t n_rows,
                            floating *acc) noexcept nogil:
    """Before a key block (direct path: a key step) adds to the rows' sums
    and accumulators: every pb.fold_steps blocks they join the totals."""
    if ws.steps_since_fold == pb.fold_steps:
        fold_into_totals(pb, ws, n_rows, acc)
    ws.steps_since_fold += 1


cdef inline void add_state(const Problem *pb, Py_ssize_t n_rows, floating *sum_into,
                           floating *acc_into, const floating *row_sum,
                           const floating *acc) noexcept nogil:
    """sum_into += row_sum and acc_into += acc (rows ld_v apart, d_v columns):
    the running state into the totals, or the totals into it."""
    cdef Py_ssize_t i, c
    for i in range(n_rows):
        sum_into[i] += row_sum[i]
        for c in range(pb.d_v):
            acc_into[i * pb.ld_v + c] += acc[i * pb.ld_v + c]


cdef inline void fold_into_totals(const Problem *pb, Workspace *ws, Py_ssize_t n_rows,
                                  floating *acc) noexcept nogil:
    """The rows' running sums and accumulators (acc: the workspace's) join
    their totals and start again from 0 (see fold_period)."""
    cdef floating *row_sum = <floating *>ws.base + ws.off_sum
    cdef floating *acc_total = <floating *>ws.base + ws.off_acc_total
    cdef floating *sum_total = <floating *>ws.base + ws.off_sum_total
    if ws.has_totals:
        add_state(pb, n_rows, sum_total, acc_total, row_sum, acc)
    else:
        memcpy(sum_total, row_sum, n_rows * sizeof(floating))
        memcpy(acc_total, acc, n_rows * pb.ld_v * sizeof(floating))
        ws.has_totals = True
    memset(row_sum, 0, n_rows * sizeof(floating))
    memset(acc, 0, n_rows * pb.ld_v * sizeof(floating))
    ws.steps_since_fold = 0


cdef inline void collect_totals(const Problem *pb, Workspace *ws, Py_ssize_t n_rows,
                                floating *acc) noexcept nogil:
    """The rows' whole sums and accumulators (acc: the workspace's) back in
    the running state, for finish_rows or a split's partial result."""
    if ws.has_totals:
        add_state(pb, n_rows, <floating *>ws.base + ws.off_sum, acc,
                  <floating *>ws.base + ws.off_sum_total,
                  <floating *>ws.base + ws.off_acc_total)
        ws.has_totals = False


cdef inline void rescale_row(floating *acc_row, Py_ssize_t d_v, floating alpha) noexcept nogil:
    """acc_row *= alpha, the factor e^(old max - new max) of a row whose
    maximum grew. When it is 0 every earlier key's weight is now exactly 0:
    they leave the row (an inf or overflowed sum among their values would
    give 0 * inf = NaN)."""
    cdef Py_ssize_t c
    if alpha == 0:
        memset(acc_row, 0, d_v * sizeof(floating))
    else:
        for c in range(d_v):
            acc_row[c] *= alpha


cdef inline bint row_is_finite(const floating *x, Py_ssize_t n) noexcept nogil:
    """No inf or NaN among x[0..n) (x - x is 0 for finite x, NaN otherwise;
    an integer OR, so the loop vectorises without reordering a float sum)."""
    cdef Py_ssize_t c
    cdef int nonfinite = 0
    for c in range(n):
        nonfinite |= (x[c] - x[c]) != <floating>0
    return not nonfinite


cdef inline void watch_row(const Problem *pb, floating row_max,
                           const floating *out_row) noexcept nogil:
    """Note a row whose maximum is finite but whose ATTN is not: its running
    sum of weighted values may have passed the dtype's range (see
    _schedule.redo_rows_beyond_range). A NaN maximum is a NaN row anyway."""
    if (pb.nonfinite_out != NULL and row_max - row_max == 0
            and not row_is_finite(out_row, pb.d_v)):
        pb.nonfinite_out[0] = 1


cdef inline void softmax_block(const Problem *pb, const ca_kernels *kern, Workspace *ws,
                               Py_ssize_t n_rows, Py_ssize_t n_keys,
                               floating *s) noexcept nogil:
    """Online softmax over one key block of masked logits s (rows K_BLOCK
    apart): update each row's maximum and sum, rescale its accumulator (and
    totals) when the maximum grows, and leave the block's weights
    e^(s - max) in s (first, every pb.fold_steps blocks, the state joins
    the totals: begin_step)."""
    cdef floating *acc = <floating *>ws.base + ws.off_acc
    cdef floating *row_max = <floating *>ws.base + ws.off_max
    cdef floating *row_sum = <floating *>ws.base + ws.off_sum
    cdef floating *acc_total = <floating *>ws.base + ws.off_acc_total
    cdef floating *sum_total = <floating *>ws.base + ws.off_sum_total
    cdef Py_ssize_t i
    cdef floating tile_max, alpha
    cdef floating *s_row
    begin_step(pb, ws, n_rows, acc)
    for i in range(n_rows):
        s_row = s + i * K_BLOCK
        tile_max = kernel_row_max(kern, s_row, n_keys)
        if tile_max == -INFINITY:
            # nothing visible in this block: weights exactly zero
            memset(s_row, 0, n_keys * sizeof(floating))
            continue
        if tile_max != tile_max:
            # a NaN logit where a key is visible: the row is NaN, as in the
            # reference (and stays NaN through later blocks)
            row_max[i] = tile_max
        elif tile_max > row_max[i]:
            if row_max[i] != -INFINITY:
                alpha = <floating>exp(row_max[i] - tile_max)
                row_sum[i] *= alpha
                rescale_row(acc + i * pb.ld_v, pb.d_v, alpha)
                if ws.has_totals:
                    sum_total[i] *= alpha
                    rescale_row(acc_total + i * pb.ld_v, pb.d_v, alpha)
            row_max[i] = tile_max
        row_sum[i] += kernel_exp_sum(kern, s_row, n_keys, row_max[i])
        if pb.weight_shift != 0:
            # the weights P.V takes, not the sum (redo_rows_beyond_range);
            # the factor, a power of two, is never 0
            rescale_row(s_row, n_keys, <floating>ldexp(1.0, -pb.weight_shift))


cdef inline floating exp_sum_by_blocks(const Problem *pb, floating *x, Py_ssize_t n,
                                       floating shift) noexcept nogil:
    """x = e^(x - shift) over a whole row, returning the sum: the table's
    exp_sum a key block at a time, the blocks' sums added as the online
    softmax adds them (into a total every pb.fold_steps blocks), not in one
    call whose partial sums would each take n / lanes terms."""
    cdef floating running = 0
    cdef floating total = 0
    cdef Py_ssize_t j = 0
    cdef Py_ssize_t steps = 0
    while j < n:
        if steps == pb.fold_steps:
            total += running
            running = 0
            steps = 0
        running += kernel_exp_sum(pb.kern, x + j, n - j if n - j < K_BLOCK else K_BLOCK, shift)
        steps += 1
        j += K_BLOCK
    # (0 + running is running: a row of at most fold_steps blocks is one chain)
    return total + running


cdef inline bint row_sink(const Problem *pb, Py_ssize_t row, double *sink) noexcept nogil:
    """True, with the sink logit of global row ``row`` (b * T + r) in sink, if
    that row has one: a sink of -inf is no sink, and takes the path without
    sinks, so that its results are bitwise those of no sink."""
    if pb.sink == NULL:
        return False
    sink[0] = pb.sink[row // pb.query_period]
    return sink[0] != -INFINITY


cdef inline void nan_rows_of_neg_inf_logits(const Problem *pb, Py_ssize_t n_rows,
                                            Py_ssize_t first_row,
                                            floating *row_max) noexcept nogil:
    """A row whose maximum stayed -inf after all its keys either sees no
    key (zeros) or sees keys whose every logit came out -inf: a q.k beyond
    the dtype, an infinity in q or k. The formula makes the latter NaN
    (-inf - (-inf)), as the reference does, so its maximum becomes NaN here
    and its ATTN, SCORES and LSE follow. A sink keeps such a row a number
    (its weight takes the whole row, as in the formula). Rows counted from
    first_row = b * T + r."""
    cdef Py_ssize_t i, row
    cdef double sink
    for i in range(n_rows):
        if row_max[i] != -INFINITY:
            continue
        row = first_row + i
        if not row_sink(pb, row, &sink) and sees_a_key(pb, row // pb.n_queries,
                                                       row % pb.n_queries):
            row_max[i] = NAN


cdef inline floating fold_sink(floating *row_max, floating *row_sum,
                               double sink) noexcept nogil:
    """The sink joins the row's softmax as one more logit with no value:
    (max, sum) become those over the visible logits and the sink, so that
    p_j = e^(s_j - max) / sum and the LSE includes the sink. Returns the
    factor e^(old max - new max) that rescales the row's accumulator (0 for
    a row that sees no key: its output stays zero)."""
    cdef floating z = <floating>sink
    cdef floating top, factor
    if row_max[0] == -INFINITY:
        row_max[0] = z
        row_sum[0] = 1
        return 0
    top = row_max[0] if row_max[0] >= z else z
    factor = <floating>exp(row_max[0] - top)
    row_sum[0] = row_sum[0] * factor + <floating>exp(z - top)
    row_max[0] = top
    return factor


cdef inline void store_lse(const Problem *pb, Py_ssize_t row, floating row_max,
                           floating row_sum) noexcept nogil:
    """log-sum-exp of a row's scaled, masked logits (-inf when it sees no key)."""
    cdef floating *lse = <floating *>pb.lse
    if lse == NULL:
        return
    if pb.lse_offset != NULL:
        # row = b * T + r of an entry of its own length
        lse = lse + pb.lse_offset[row // pb.n_queries] + (row % pb.n_queries) * pb.ld_lse
    else:
        lse = lse + row
    lse[0] = row_max if row_max == -INFINITY else row_max + <floating>log(row_sum)


cdef inline void store_lse_of_empty_row(const Problem *pb, Py_ssize_t row,
                                        floating row_max) noexcept nogil:
    """The LSE of a row that sees no key (row_max: its -inf, of the row's
    dtype): -inf, or its sink alone."""
    cdef floating row_sum = 0
    cdef double sink
    if row_sink(pb, row, &sink):
        fold_sink(&row_max, &row_sum, sink)
    store_lse(pb, row, row_max, row_sum)


cdef inline void fold_sinks(const Problem *pb, Workspace *ws, Py_ssize_t n_rows,
                            Py_ssize_t first_row, floating *row_max, floating *row_sum,
                            floating *factor, floating *row_sink_logit) noexcept nogil:
    """fold_sink for every row of an item at once, with the table's
    vectorised exp and one division per item (per row, libm's exp and the
    row's head index cost 11% of a BERT-sized call): row_sink_logit[i] is
    row i's sink (-inf: none); the rows with one get (max, sum) over their
    logits and the sink, and factor[i] = e^(old max - new max) (0 for a row
    that sees no key); rows without one keep their state. Uses the score
    tile as scratch (free once the item's blocks are done)."""
    cdef floating *sink_term = <floating *>ws.base + ws.off_s
    cdef Py_ssize_t i
    cdef Py_ssize_t head = first_row // pb.query_period
    cdef Py_ssize_t position = first_row - head * pb.query_period
    cdef floating z, top
    cdef bint any_rescaled = False
    for i in range(n_rows):
        z = <floating>pb.sink[head]
        row_sink_logit[i] = z
        position += 1
        if position == pb.query_period:
            head += 1
            position = 0
        if z == -INFINITY:
            sink_term[i] = -INFINITY
            factor[i] = 0                         # e^0 below
            continue
        top = row_max[i] if row_max[i] >= z else z
        if row_max[i] == -INFINITY:
            top = z
        sink_term[i] = z - top
        factor[i] = row_max[i] - top              # -inf for a row with no key
        any_rescaled = any_rescaled or factor[i] != 0
        row_max[i] = top
    kernel_exp_sum(pb.kern, sink_term, n_rows, 0)
    if any_rescaled:
        kernel_exp_sum(pb.kern, factor, n_rows, 0)
    else:
        # every row's maximum stays (the common case): e^0 is 1
        for i in range(n_rows):
            factor[i] = 1
    for i in range(n_rows):
        if row_sink_logit[i] != -INFINITY:
            row_sum[i] = row_sum[i] * factor[i] + sink_term[i]


cdef inline void finish_rows(const Problem *pb, Workspace *ws, Py_ssize_t n_rows,
                             floating *out, Py_ssize_t ld_out, Py_ssize_t first_row) noexcept nogil:
    """out[i, :d_v] = acc[i] / sum[i]; zeros for a row that sees no key.
    Also the rows' log-sum-exp when asked, at first_row (= b * T + row0).
    With sinks, each row's sink joins its softmax first (fold_sinks)."""
    cdef floating *acc = <floating *>ws.base + ws.off_acc
    cdef floating *row_max = <floating *>ws.base + ws.off_max
    cdef floating *row_sum = <floating *>ws.base + ws.off_sum
    cdef floating *factor = <floating *>ws.base + ws.off_s + n_rows
    cdef floating *row_sink_logit = <floating *>ws.base + ws.off_s + 2 * n_rows
    cdef Py_ssize_t i, c, r, run_end
    cdef floating *out_row
    cdef floating *acc_row
    cdef floating scale
    collect_totals(pb, ws, n_rows, acc)
    nan_rows_of_neg_inf_logits(pb, n_rows, first_row, row_max)
    if pb.sink != NULL:
        fold_sinks(pb, ws, n_rows, first_row, row_max, row_sum, factor, row_sink_logit)
    i = 0
    while i < n_rows:
        out_row = out + i * ld_out
        store_lse(pb, first_row + i, row_max[i], row_sum[i])
        if pb.sink != NULL and row_sink_logit[i] != -INFINITY:
            if factor[i] == 0:
                # no visible key, or every key's weight is exactly 0
                memset(out_row, 0, pb.d_v * sizeof(floating))
            else:
                scale = factor[i] / row_sum[i]
                acc_row = acc + i * pb.ld_v
                for c in range(pb.d_v):
                    out_row[c] = acc_row[c] * scale
                watch_row(pb, row_max[i], out_row)
            i += 1
        elif row_max[i] == -INFINITY:
            # a row that sees no key gives zeros, not 0/0
            memset(out_row, 0, pb.d_v * sizeof(floating))
            i += 1
        else:
            # the run of rows from i that see keys and have no sink: one
            # kernel call divides them all
            run_end = i + 1
            while (run_end < n_rows and row_max[run_end] != -INFINITY
                   and (pb.sink == NULL or row_sink_logit[run_end] == -INFINITY)):
                store_lse(pb, first_row + run_end, row_max[run_end], row_sum[run_end])
                run_end += 1
            if kernel_divide_rows(pb.kern, acc + i * pb.ld_v, pb.ld_v, run_end - i, pb.d_v,
                                  row_sum + i, out_row, ld_out):
                for r in range(i, run_end):
                    watch_row(pb, row_max[r], out + r * ld_out)
            i = run_end


cdef inline void merge_splits(const Problem *pb, Py_ssize_t b, const floating *partial,
                              floating *out) noexcept nogil:
    """Combine the key chunks of batch entry b in chunk order (so the result
    does not depend on which thread did which chunk):
    max = max_i max_i, sum = sum_i sum_i e^(max_i - max),
    out = sum_i acc_i e^(max_i - max) / sum."""
    cdef Py_ssize_t n_rows = entry_rows(pb, b)
    cdef Py_ssize_t stride = pb.n_queries * (pb.d_v + 2)
    cdef Py_ssize_t first_row = b * pb.n_queries
    cdef const floating *first = partial + b * pb.n_splits * stride
    cdef const floating *state
    cdef floating *out_row
    cdef Py_ssize_t i, split, c
    cdef floating total_max, total_sum, weight
    cdef double sink
    cdef bint has_sink
    for i in range(n_rows):
        out_row = out + out_row_offset(pb, b, i)
        total_max = -INFINITY
        for split in range(pb.n_splits):
            state = first + split * stride + i * (pb.d_v + 2)
            if state[0] > total_max or state[0] != state[0]:
                total_max = state[0]
                if total_max != total_max:
                    break
        has_sink = row_sink(pb, first_row + i, &sink)
        if total_max == -INFINITY and not has_sink and sees_a_key(pb, b, i):
            # keys whose every logit is -inf (nan_rows_of_neg_inf_logits)
            total_max = NAN
            total_sum = 0
            store_lse(pb, first_row + i, total_max, total_sum)
            for c in range(pb.d_v):
                out_row[c] = total_max
            continue
        if total_max == -INFINITY:
            # no key: zeros, and the LSE of the sink alone if there is one
            total_sum = 0
            if has_sink:
                fold_sink(&total_max, &total_sum, sink)
            store_lse(pb, first_row + i, total_max, total_sum)
            memset(out_row, 0, pb.d_v * sizeof(floating))
            continue
        memset(out_row, 0, pb.d_v * sizeof(floating))
        total_sum = 0
        for split in range(pb.n_splits):
            state = first + split * stride + i * (pb.d_v + 2)
            if state[0] == -INFINITY:
                continue
            weight = <floating>exp(state[0] - total_max)
            if weight == 0:
                # a chunk whose keys all weigh exactly 0 takes no part
                # (0 * an inf among its values would be NaN)
                continue
            total_sum += state[1] * weight
            for c in range(pb.d_v):
                out_row[c] += state[2 + c] * weight
        if has_sink:
            weight = fold_sink(&total_max, &total_sum, sink) / total_sum
            if weight == 0:
                # the sink outweighs every key: each weight is exactly 0
                memset(out_row, 0, pb.d_v * sizeof(floating))
            else:
                for c in range(pb.d_v):
                    out_row[c] = out_row[c] * weight
        else:
            for c in range(pb.d_v):
                out_row[c] = out_row[c] / total_sum
        store_lse(pb, first_row + i, total_max, total_sum)
        watch_row(pb, total_max, out_row)
