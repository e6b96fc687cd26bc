# cython: language_level=3, boundscheck=False, wraparound=False
# cython: cdivision=True, initializedcheck=False
"""The problem description every path reads: tuning constants, how an
operand's rows are reached (Operand), the options every row obeys
(RowOptions), the Problem, and its builder (problem_init zero-initialises
and takes the row options, problem_finish derives the packed K/V layout).
Every entry builds its Problem this way: from arrays (from_arrays.pxd) or
from an entry table (from_entries.pxd)."""

from libc.math cimport cbrt, ceil
from libc.stdint cimport uint8_t, uint16_t
from libc.string cimport memset
from cattention._driver.kernel_table cimport (
    CA_FP8_E4M3FN, CA_FP8_E5M2, CA_PRECISION_HIGHEST, ca_kernels, intp_t)


cdef enum:
    # Rows per work item: a multiple of the 6-row register tile, small enough
    # that T = 1024 with a few heads still gives both threads many items.
    Q_BLOCK = 96
    # Keys per streamed block: K^T, V and the score tile of one block stay in L2.
    K_BLOCK = 256
    # Rows per score/P.V call on a block that some rows see only in part
    # (the causal diagonal): each group computes only the key panels its
    # last row sees. A multiple of the 6-row register tile.
    ROW_GROUP = 24
    # Row padding of packed V and accumulators: a multiple of both panel
    # widths, so one workspace layout serves float and double.
    PAD = 16
    # At most this many query rows (decode, speculative decode) take the
    # direct path: K and V are read where they are, not packed, and the keys
    # may be split across threads. Grouped-query heads are stacked as rows
    # of their K/V head up to this many rows.
    DIRECT_ROWS = 8
    # The direct path steps through keys this many at a time: score, softmax
    # and P.V of one step touch K and V rows close together, so both stream
    # from memory at once (steps of a whole K_BLOCK read all of a block's K,
    # then all of its V, and the two streams no longer overlap). Divides
    # K_BLOCK, which split chunks are multiples of.
    DIRECT_KEYS = 32
    # A direct work item takes up to this many batch entries whose K/V rows
    # lie side by side (the K/V heads of a paged cache share each page) and
    # steps them through the keys together: it reads a page's heads in
    # order, where one head at a time would read small pieces far apart.
    DIRECT_GROUP = 8
    # ...but smaller groups when the threads would get fewer items than this
    # each (the dynamic schedule balances items of different lengths).
    GROUP_ITEMS_PER_THREAD = 4
    # Before each kernel call of a group, this many rows of the next call are
    # brought into L1 (the kernels prefetch only within their own call).
    NEXT_CALL_ROWS = 8
    # The direct path splits the keys until there are this many work items...
    SPLIT_TARGET_ITEMS = 16
    # ...but never into chunks below this many keys (a multiple of K_BLOCK).
    SPLIT_MIN_KEYS = 512
    # Fewer floating-point operations than this per thread and another thread
    # costs more to start and join than it saves (a few microseconds).
    MIN_FLOPS_PER_THREAD = 1 << 18
    # A work item is a whole batch entry (see schedule_packed) when entries
    # have at most this many query blocks (and 4 entries per thread)...
    PER_ENTRY_MAX_BLOCKS = 4
    # ...or, whatever their length, when there are this many entries per
    # thread: the dynamic schedule's last item is then at most a sixteenth of
    # a thread's work, and packing entry by entry keeps each entry's K/V in
    # cache, where a packed copy of every entry first would go out to memory
    # and come back...
    PER_ENTRY_MIN_ENTRIES = 16
    # ...or when every thread gets this many entries of one length, the same
    # number each, so that no thread waits for another at the end.
    PER_ENTRY_ALIKE_ENTRIES = 4
    # The largest thread count a call accepts (OpenMP's num_threads is an int).
    MAX_THREADS = 2147483647
    # A work item of at most this many key blocks (direct path: key steps)
    # keeps its rows' sums and accumulators in one running state; a longer
    # one folds that state into totals every fold_steps (see fold_period).
    FOLD_MIN_STEPS = 8

cdef enum MaskKind:
    MASK_NONE = 0
    MASK_BOOL = 1
    MASK_F32 = 2
    MASK_F64 = 3

cdef enum Storage:
    STORE_COMPUTE = 0            # the compute dtype, read in place
    STORE_F16 = 1                # float16 (computed in float32), converted as read
    STORE_I8 = 2                 # int8 times one float32 scale per row (K, V), likewise
    STORE_BF16 = 3               # bfloat16 (computed in float32), converted as read
    STORE_E4M3 = 4               # fp8 E4M3FN times one float32 scale per row (K, V), as int8
    STORE_E5M2 = 5               # fp8 E5M2 likewise

cdef struct Operand:
    const char *data
    const intp_t *batch_offset   # element offset of each flattened batch entry
    Py_ssize_t row_stride        # elements
    Py_ssize_t col_stride        # elements
    int storage                  # Storage of q, K and V (the mask: STORE_COMPUTE)
    const float *scale           # int8 and fp8: the scale of each row, at
    const intp_t *scale_offset   # scale + scale_offset[b] + row * scale_stride
    Py_ssize_t scale_stride
    # A paged K or V (NULL page_ids: rows at batch_offset[b] + row * row_stride):
    # row p of entry b lies in page page_ids[page_first[b] + p // page_size],
    # at batch_offset[b] + page * page_stride + (p % page_size) * row_stride,
    # and its int8 / fp8 scale at the same place with scale_page_stride, scale_stride
    const intp_t *page_ids
    const intp_t *page_first
    Py_ssize_t page_size
    Py_ssize_t page_stride
    Py_ssize_t scale_page_stride


cdef inline bint is_fp8(int storage) noexcept nogil:
    return storage == STORE_E4M3 or storage == STORE_E5M2


cdef inline int fp8_format(int storage) noexcept nogil:
    """The kernels' name (scalar.h) of an fp8 storage's format."""
    return CA_FP8_E4M3FN if storage == STORE_E4M3 else CA_FP8_E5M2


cdef inline bint is_one_byte(int storage) noexcept nogil:
    """int8 or fp8: codes of one byte times a scale per row."""
    return storage == STORE_I8 or is_fp8(storage)


cdef struct Rotary:
    # Rotary embedding tables (rotary.pxd): the cos and sin of position p are
    # row p - first of cos and sin, of the compute dtype, half values each
    # (byte strides of rows and columns); pairs of features interleaved or
    # split in halves
    const char *cos
    const char *sin
    Py_ssize_t cos_row, cos_col, sin_row, sin_col
    Py_ssize_t first, half
    bint interleaved


cdef struct RowOptions:
    # What every row of a call obeys, whatever the layout (the driver's
    # side of _prepare/options.py's RowOptions; the thread count is the
    # schedule's, not a row's)
    bint causal
    double scale                 # multiplies q.k
    Py_ssize_t window_left       # sliding window: keys at most this far before
    Py_ssize_t window_right      # / after the query's position; -1: unbounded
    double softcap               # logits -> softcap * tanh(logits / softcap); 0: off
    const double *alibi_slope    # per group of query_period rows, or NULL
    const double *sink           # per group of query_period rows, or NULL
    const Rotary *rotary         # query rows rotated at their positions, or NULL
    int precision                # CA_PRECISION_* of a 16-bit result (HIGHEST
                                 # for float32 and float64 ones)


cdef struct Problem:
    Py_ssize_t n_batch
    Py_ssize_t n_queries
    Py_ssize_t n_keys
    Py_ssize_t d_k
    Py_ssize_t d_v
    Operand q
    Operand k
    Operand v
    Operand mask
    int mask_kind
    bint causal
    double scale                 # multiplies q.k
    const intp_t *kv_length      # valid keys of each batch entry, or NULL (all S)
    const intp_t *kv_start       # and the first of them (left padding), or NULL (0)
    const intp_t *query_offset   # key position of each batch entry's query row 0
                                 # (query_offset=), or NULL: bottom-right, the
                                 # end of the valid keys (see query_position_offset)
    Py_ssize_t query_period      # query rows are positions 0..period-1 repeated
                                 # (grouped-query heads stacked as rows); = T
    Py_ssize_t window_left       # sliding window: keys at most this far before
    Py_ssize_t window_right      # / after the query's position; -1: unbounded
    double softcap               # logits -> softcap * tanh(logits / softcap); 0: off
    const double *sink           # attention sinks: one logit with no value in each
                                 # row's softmax, of query head row // query_period
                                 # (rows counted b * T + r), -inf: none; NULL: none
    const double *alibi_slope    # -slope * |position - j| added to the logits,
                                 # the slope of query head row // query_period as
                                 # for the sinks; NULL: none
    const Rotary *rotary         # query rows (of the compute dtype) rotated at
                                 # their positions as they are read; NULL: none
    void *lse                    # (n_batch, T) log-sum-exp of each row, or NULL
    # Entries of their own lengths (packed variable-length sequences, paged
    # caches; NULL: every entry has T rows, at b * T * ld_out in ATTN and
    # b * T in LSE): entry b has q_length[b] <= T query rows, its ATTN row r
    # at out_offset[b] + r * ld_out, its LSE at lse_offset[b] + r * ld_lse,
    # and only its first kv_extent[kv] keys are ever read (packed or direct)
    const intp_t *q_length
    const intp_t *out_offset
    const intp_t *lse_offset
    Py_ssize_t ld_lse
    const intp_t *kv_extent
    # ...and no entry reads its keys before kv_first[kv] (a sliding window's
    # start), or NULL: from 0
    const intp_t *kv_first
    # row strides (elements) of ATTN (n_batch, T, d_v) and SCORES (n_batch, T,
    # S): d_v and S from Python, any row stride through the C-level API
    Py_ssize_t ld_out
    Py_ssize_t ld_scores
    # ATTN of bfloat16 (float32 computations, no SCORES, the packed path):
    # each block's rows are rounded into it as they are finished, at the
    # offsets above, instead of into the float32 out; NULL: out
    uint16_t *out_bf16
    # K^T and V are packed once per distinct K/V batch entry, shared by every
    # query block that reads them (a K/V broadcast over heads is packed once)
    Py_ssize_t n_kv              # distinct K/V batch entries
    const intp_t *kv_of_batch    # batch entry -> packed index
    const intp_t *kv_source      # packed index -> a batch entry holding it
    Py_ssize_t n_key_blocks
    Py_ssize_t block_keys        # key capacity of a packed block: K_BLOCK, or
                                 # S rounded up to PAD when S is smaller
    Py_ssize_t ld_k              # rows of a packed K^T block: max(d_k, 1)
    Py_ssize_t ld_v              # length of a packed V row: d_v padded to PAD
    void *packed_k               # blocks of ld_k x K_BLOCK, (kv, key block) order
    void *packed_v               # K_BLOCK rows of ld_v per (kv, key block)
    uint8_t *value_nonfinite     # per (kv, key block): V held NaN or Inf
    bint direct                  # few query rows: K and V read in place
    # packed path of bfloat16 q and K (V) on a table with bfloat16 tiles: K^T
    # (V) packed in the table's bfloat16 layout, the scores (P.V) its tiles'
    # (kernels.h); q rows packed as padded bfloat16
    bint bf16_score
    bint bf16_pv
    int precision                # CA_PRECISION_* (RowOptions)
    Py_ssize_t itemsize          # of the compute dtype
    const ca_kernels *kern       # conversions while packing, the final division of ATTN rows
    # direct path: keys split into chunks of split_keys (a multiple of
    # K_BLOCK), fixed by the shape alone so results do not depend on threads
    Py_ssize_t n_splits
    Py_ssize_t split_keys
    # every this many key blocks (direct path: key steps) of a work item,
    # its rows' running sums and accumulators join their totals (fold_period)
    Py_ssize_t fold_steps
    # Without SCORES: set to 1 by a row of finite maximum whose ATTN came out
    # non-finite (NULL: not watched), and the weights P.V takes scaled by
    # 2^-weight_shift (0: as the softmax gives them) when the call runs again
    # for such rows (see _schedule.redo_rows_beyond_range)
    int *nonfinite_out
    int weight_shift


cdef inline Py_ssize_t round_up(Py_ssize_t n, Py_ssize_t m) noexcept nogil:
    return ((n + m - 1) // m) * m


cdef inline Py_ssize_t fold_period(Py_ssize_t n_steps) noexcept nogil:
    """How many key blocks (or steps) a row's running sum and accumulator
    take before they join the row's totals, for work items of up to n_steps.

    Each block adds one rounded term to a sum that grows, and those
    roundings lean one way (terms of about one size meet a sum of about one
    magnitude), so a chain's error grows with its length, not as a random
    walk. With totals every g steps, the running chains' roundings are at
    g / n of the row's scale, g^2 / n of them in all, and the totals' n / g
    at the row's: g = (n^2 / 2)^(1/3) balances the two. Items of at most
    FOLD_MIN_STEPS never fold: their state is bitwise one chain's."""
    cdef Py_ssize_t g = <Py_ssize_t>ceil(cbrt(0.5 * <double>n_steps * n_steps))
    return g if g > FOLD_MIN_STEPS else FOLD_MIN_STEPS


cdef inline void problem_init(Problem *pb, Py_ssize_t n_batch, Py_ssize_t n_queries,
                              Py_ssize_t n_keys, Py_ssize_t d_k, Py_ssize_t d_v,
                              const RowOptions *row) noexcept nogil:
    """The one way a Problem starts: every field zero, then the row options
    and the defaults of an unmasked layout (no lengths, no LSE, contiguous
    ATTN and SCORES rows). Callers then set operands and the layout and call
    problem_finish."""
    memset(pb, 0, sizeof(Problem))
    pb.n_batch = n_batch
    pb.n_queries = n_queries
    pb.n_keys = n_keys
    pb.d_k = d_k
    pb.d_v = d_v
    pb.causal = row.causal
    pb.scale = row.scale
    pb.window_left = row.window_left
    pb.window_right = row.window_right
    pb.softcap = row.softcap
    pb.alibi_slope = row.alibi_slope
    pb.sink = row.sink
    pb.rotary = row.rotary
    pb.precision = row.precision
    pb.mask_kind = MASK_NONE
    pb.query_period = n_queries
    pb.ld_out = d_v
    pb.ld_scores = n_keys
    pb.ld_lse = 1
    pb.n_kv = n_batch


cdef inline void plain_row_options(RowOptions *row, bint causal, double scale) noexcept nogil:
    """Row options with no window, softcap, ALiBi, sinks or rotary tables."""
    row.causal = causal
    row.scale = scale
    row.window_left = -1
    row.window_right = -1
    row.softcap = 0
    row.alibi_slope = NULL
    row.sink = NULL
    row.rotary = NULL
    row.precision = CA_PRECISION_HIGHEST


cdef inline void problem_finish(Problem *pb) noexcept nogil:
    """Derived sizes: the packed K/V layout."""
    pb.ld_k = pb.d_k if pb.d_k > 0 else 1
    pb.ld_v = round_up(pb.d_v, PAD) if pb.d_v > 0 else PAD
    pb.n_key_blocks = (pb.n_keys + K_BLOCK - 1) // K_BLOCK
    pb.block_keys = K_BLOCK if pb.n_keys >= K_BLOCK else round_up(pb.n_keys, PAD)
    pb.fold_steps = fold_period(pb.n_key_blocks)


cdef inline void set_operand(Operand *op, const void *data, const intp_t *batch_offset,
                             Py_ssize_t row_stride, Py_ssize_t col_stride) noexcept nogil:
    op.data = <const char *>data
    op.batch_offset = batch_offset
    op.row_stride = row_stride
    op.col_stride = col_stride


cdef inline Py_ssize_t entry_rows(const Problem *pb, Py_ssize_t b) noexcept nogil:
    """Query rows of batch entry b."""
    return pb.q_length[b] if pb.q_length != NULL else pb.n_queries


cdef inline Py_ssize_t query_period_of(const Problem *pb, Py_ssize_t b) noexcept nogil:
    """Positions of entry b's query rows before they repeat (stacked heads):
    its own row count for entries of their own lengths."""
    return pb.q_length[b] if pb.q_length != NULL else pb.query_period


cdef inline Py_ssize_t query_position_offset(const Problem *pb, Py_ssize_t b) noexcept nogil:
    """The key position of batch entry b's query row 0: row r sits at
    ``r % period + query_position_offset``. The one place the alignment is
    decided: the caller's query_offset[b] (a chunk of a longer sequence at
    its global position, cattention.dask), else bottom-right, the queries
    being the last positions of the valid keys (n_valid - T). The callers
    keep their sums within 64 bits for offsets of magnitude up to 2^62."""
    if pb.query_offset != NULL:
        return pb.query_offset[b]
    return ((pb.kv_length[b] if pb.kv_length != NULL else pb.n_keys)
            - query_period_of(pb, b))


cdef inline bint direct_rows(Py_ssize_t n_queries) noexcept nogil:
    """Whether a Problem of n_queries rows per entry takes the direct path
    (K and V read in place), as compute_problem decides it: by the shape
    alone."""
    return n_queries <= DIRECT_ROWS


cdef inline Py_ssize_t out_row_offset(const Problem *pb, Py_ssize_t b,
                                      Py_ssize_t row) noexcept nogil:
    """Element offset of ATTN row ``row`` of batch entry b."""
    if pb.out_offset != NULL:
        return pb.out_offset[b] + row * pb.ld_out
    return (b * pb.n_queries + row) * pb.ld_out


cdef inline Py_ssize_t key_extent(const Problem *pb, Py_ssize_t kv) noexcept nogil:
    """Keys of packed K/V entry kv that may be read (the rest may not exist)."""
    return pb.kv_extent[kv] if pb.kv_extent != NULL else pb.n_keys


cdef inline Py_ssize_t key_first(const Problem *pb, Py_ssize_t kv) noexcept nogil:
    """The first key of packed K/V entry kv that may be read."""
    return pb.kv_first[kv] if pb.kv_first != NULL else 0


cdef inline Py_ssize_t query_position(const Problem *pb, Py_ssize_t b,
                                      Py_ssize_t row) noexcept nogil:
    """Key position of query row ``row`` of batch entry b: the queries are
    the last positions of the entry's valid keys (bottom-right alignment,
    repeating every query_period rows when heads are stacked), the position
    the causal mask, windows and ALiBi measure from and rotary tables
    rotate at; query_offset places it elsewhere (query_position_offset)."""
    return row % query_period_of(pb, b) + query_position_offset(pb, b)
