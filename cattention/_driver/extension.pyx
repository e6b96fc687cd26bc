# cython: language_level=3, boundscheck=False, wraparound=False
# cython: cdivision=True, initializedcheck=False
"""The compiled driver's module: the entries the Python layer calls, the
C-level API (extension.pxd, exported through ``cattention.cython_attention``),
and run-time introspection (kernel tables, OpenMP). Each entry is thin; the
algorithm lives in the headers it cimports, read in order:

    kernel_table.pxd  the C kernel table (src/kernels.h) and its trampolines
    problem.pxd       tuning constants, Operand, RowOptions, Problem
    operands.pxd      how an operand's rows are reached (in place or copied)
    workspace.pxd     per-thread scratch of a work item
    packing.pxd       Q rows, K^T panels and V rows packed block by block
    visibility.pxd    the keys each row sees, masking of a score tile
    softmax.pxd       online-softmax state, LSE, merge of split-key partials
    item_packed.pxd   packed-path work items (without and with SCORES)
    item_direct.pxd   direct-path (decode) work items
    schedule.pxd      work items over OpenMP threads, the thread count
    from_arrays.pxd   NumPy arrays (dense calls) to a Problem
    from_entries.pxd  sequences of their own lengths to entry tables and Problems
    runs.pxd          a Problem run without the GIL
    checks.pxd        the checks of scalar options, for both ways in
    appends.pxd       new rows written into a KV cache, the cache lengths
    rotary.pxd        rotary embeddings (q's rows as read, new keys into scratch)
    accepts.pxd       what a compiled shortcut takes as it is
    shortcuts.pxd     the compiled shortcut of each layout

Each work item is one (batch entry, block of up to ``Q_BLOCK`` query rows)
and is computed by exactly one thread with block boundaries that depend only
on the problem shape, so the result is bitwise the same for any thread
count. Everything below the entries runs without the GIL on raw pointers;
the Python layer (``_prepare``) has checked shapes and dtypes, made the
inputs aligned and native, and allocated the outputs, or a shortcut has
found them so.

The helpers are ``cdef inline`` functions in ``.pxd`` files, compiled into
this one extension, so splitting the driver costs no call. Operands are raw
pointers with element strides rather than typed memoryviews: they may be
broadcast (stride 0), strided or transposed, float16 or int8, and are
reached per batch entry through offset tables, which a memoryview does not
express.
"""

cimport numpy as cnp
from libc.math cimport isfinite
from libc.stdint cimport uint8_t, uint64_t
from libc.stdlib cimport free
from cattention._driver.kernel_table cimport (
    CA_FP8_E4M3FN, CA_FP8_E5M2, ca_available_kernels, ca_compiler_version, ca_default_kernels,
    ca_float_to_fp8, ca_forked_after_parallel, ca_kernels, ca_kernels_by_name, ca_read_words,
    ca_set_bfloat16_type, ca_set_fp8_types, ca_simd_note, intp_t)
from cattention._driver.problem cimport Problem, Rotary, RowOptions, plain_row_options
from cattention._driver.results cimport rounded_to_bfloat16
from cattention._driver.schedule cimport (
    CA_HAVE_OPENMP, CA_OPENMP_VERSION, ca_openmp_runtime, ca_team_size, compute_problem,
    omp_get_max_threads)
from cattention._driver.checks cimport (
    check_alibi_slopes as _check_alibi_slopes, check_flag as _check_flag,
    check_key_positions as _check_key_positions, check_num_threads as _check_num_threads,
    check_precision as _check_precision, check_scale as _check_scale,
    check_sinks as _check_sinks, check_softcap as _check_softcap,
    check_window as _check_window, holds, resolve_threads as _resolve_threads)
from cattention._driver.from_entries cimport (
    PLACE_E4M3FN, PLACE_E5M2, EntryPlan, EntryTable, Place, free_tables, plan_entries,
    problem_from_table,
    stacks_grouped_rows as _stacks_grouped_rows)
from cattention._driver.runs cimport run_dense, run_plan
from cattention._driver.appends cimport (
    CacheRows, NewRows, append_rows as _append_rows, cache_rows_of)
from cattention._driver.rotary cimport rotary_of, rotated as _rotated
from cattention._driver.shortcuts cimport (
    attention_shortcut as _attention_shortcut, kvcache_shortcut as _kvcache_shortcut,
    paged_shortcut as _paged_shortcut, view_as as _view_as)

# The table's register tile and the list of tables compiled in: only this
# module's introspection reads them, so they are declared here rather than
# in kernel_table.pxd (ca_kernel_tile is ca_kernels seen through these
# fields alone).
cdef extern from "kernels.h" nogil:
    int ca_compiled_kernels(const char **names, int capacity)
    ctypedef struct ca_kernel_tile "ca_kernels":
        int tile_rows
        int tile_cols_f32
        int tile_cols_f64

cnp.import_array()

cdef const ca_kernels *_kernels = ca_default_kernels()


# ------------------------------------------- C-level API (extension.pxd)

cdef inline bint missing(const void *data, Py_ssize_t n_rows,
                         Py_ssize_t n_features) noexcept nogil:
    return data == NULL and n_rows > 0 and n_features > 0


cdef inline void head_place(Place *place, const void *data, int type_num,
                            const intp_t *zero, Py_ssize_t row_stride) noexcept nogil:
    place.data = <const char *>data
    place.type_num = type_num
    place.seq_offset = zero
    place.t_stride = row_stride
    place.h_stride = 0
    place.col_stride = 1
    place.page_stride = 0


cdef int head_attention(const HeadCall *call) noexcept nogil:
    """One head through the same driver as the Python API: a plan of one
    sequence and one head."""
    cdef bint in_float32 = call.type_num == cnp.NPY_FLOAT32
    cdef int kv_type = call.type_num
    cdef float one = 1
    cdef intp_t zero[1]
    cdef intp_t n_rows[1]
    cdef intp_t n_valid[1]
    cdef EntryPlan plan
    cdef EntryTable tables[2]
    cdef Py_ssize_t n_tables = 0
    cdef RowOptions row
    cdef Problem pb
    cdef intp_t *index
    cdef int status
    cdef bint with_out = call.out != NULL
    if call.n_queries < 0 or call.n_keys < 0 or call.d_k < 0 or call.d_v < 0:
        return CATTENTION_ERR_SIZE
    if call.flags & ~CATTENTION_CAUSAL:
        return CATTENTION_ERR_FLAGS
    if call.fp8_format == CATTENTION_FP8_E4M3FN:
        kv_type = PLACE_E4M3FN
    elif call.fp8_format == CATTENTION_FP8_E5M2:
        kv_type = PLACE_E5M2
    elif call.fp8_format != -1:
        return CATTENTION_ERR_FORMAT
    if not isfinite(call.scale) or not holds(call.scale, in_float32):
        return CATTENTION_ERR_SCALE
    if not with_out and call.scores == NULL:
        return CATTENTION_ERR_POINTER
    if (missing(call.q, call.n_queries, call.d_k) or missing(call.k, call.n_keys, call.d_k)
            or (with_out and (missing(call.v, call.n_keys, call.d_v)
                              or missing(call.out, call.n_queries, call.d_v)))):
        return CATTENTION_ERR_POINTER
    if ((with_out and call.out_row_stride < call.d_v)
            or (call.scores != NULL and call.scores_row_stride < call.n_keys)):
        return CATTENTION_ERR_STRIDE
    if call.n_queries == 0:
        return CATTENTION_OK
    zero[0] = 0
    n_rows[0] = call.n_queries
    n_valid[0] = call.n_keys
    plain_row_options(&row, (call.flags & CATTENTION_CAUSAL) != 0, call.scale)
    plan.n_seq, plan.n_heads, plan.n_kv_heads = 1, 1, 1
    plan.d_k = call.d_k
    plan.d_v = call.d_v if with_out else 0
    plan.q_lengths = n_rows
    plan.kv_lengths = n_valid
    plan.kv_starts = NULL
    head_place(&plan.q, call.q, call.type_num, zero, call.q_row_stride)
    head_place(&plan.k, call.k, kv_type, zero, call.k_row_stride)
    # SCORES alone: V is not read
    head_place(&plan.v, call.v if with_out else call.k, kv_type, zero,
               call.v_row_stride if with_out else call.k_row_stride)
    head_place(&plan.out, call.out, call.type_num, zero, call.out_row_stride)
    head_place(&plan.lse, call.lse, call.type_num, zero, 1)
    plan.k_scale.data = NULL
    plan.v_scale.data = NULL
    if kv_type != call.type_num:
        # fp8 rows times their scales (none given: 1 for every row)
        head_place(&plan.k_scale, call.k_scale if call.k_scale != NULL else &one,
                   cnp.NPY_FLOAT32, zero, call.k_scale_stride if call.k_scale != NULL else 0)
        if with_out:
            head_place(&plan.v_scale, call.v_scale if call.v_scale != NULL else &one,
                       cnp.NPY_FLOAT32, zero,
                       call.v_scale_stride if call.v_scale != NULL else 0)
        else:
            plan.v_scale = plan.k_scale
    plan.alibi = NULL
    plan.sinks = NULL
    plan.page_ids = NULL
    plan.pages_per_seq = 0
    plan.page_size = 0
    if plan_entries(&plan, tables, &n_tables) != 0:
        return CATTENTION_ERR_NO_MEMORY
    index = problem_from_table(&pb, &tables[0], &plan, &row)
    if index == NULL:
        free_tables(tables, n_tables)
        return CATTENTION_ERR_NO_MEMORY
    pb.ld_scores = call.scores_row_stride
    if in_float32:
        status = compute_problem(&pb, _kernels, call.n_threads if call.n_threads >= 1 else 1,
                                 <float *>call.out, <float *>call.scores)
    else:
        status = compute_problem(&pb, _kernels, call.n_threads if call.n_threads >= 1 else 1,
                                 <double *>call.out, <double *>call.scores)
    free(index)
    free_tables(tables, n_tables)
    return CATTENTION_ERR_NO_MEMORY if status != 0 else CATTENTION_OK


# ------------------------------------------------------------ introspection

def get_simd():
    """Name of the kernel table in use."""
    return (<bytes>_kernels.name).decode()


def available_simd():
    """Names of the kernel tables this CPU can run, best last."""
    cdef const char *names[8]
    cdef int n = ca_available_kernels(names, 8)
    return [(<bytes>names[i]).decode() for i in range(n)]


def compiled_simd():
    """Names of the kernel tables compiled in, whether this CPU runs them or
    not, best last."""
    cdef const char *names[8]
    cdef int n = ca_compiled_kernels(names, 8)
    return [(<bytes>names[i]).decode() for i in range(n)]


def simd_tile():
    """The register tile of the table in use: (rows, float32 columns,
    float64 columns)."""
    cdef const ca_kernel_tile *tile = <const ca_kernel_tile *>_kernels
    return (tile.tile_rows, tile.tile_cols_f32, tile.tile_cols_f64)


def bf16_pv_parts():
    """The parts of P the table in use takes for P.V of bfloat16 V at each
    precision level (highest, high, medium); 0: float32 weights."""
    return tuple(_kernels.bf16_pv_parts[level] for level in range(3))


def loop_flops(long n_steps):
    """Run the multiply-add loop of the table in use n_steps times on this
    thread (the benchmark times it: the rate no kernel of the table can
    pass); returns the floating-point operations done."""
    cdef double flops
    with nogil:
        flops = _kernels.loop_flops(n_steps)
    return flops


def read_loop(cnp.ndarray words):
    """Read every byte of ``words`` (a C-contiguous uint64 array) once on
    this thread, without the GIL (the benchmark's read loop: the rate of
    the memory the bytes come from); returns their exclusive or."""
    cdef const uint64_t *data = <const uint64_t *>cnp.PyArray_DATA(words)
    cdef size_t n = cnp.PyArray_SIZE(words)
    cdef uint64_t total
    if cnp.PyArray_TYPE(words) != cnp.NPY_UINT64 or not cnp.PyArray_IS_C_CONTIGUOUS(words):
        raise TypeError("read_loop takes a C-contiguous uint64 array")
    with nogil:
        total = ca_read_words(data, n)
    return total


def set_simd(name):
    """Use the kernel table called ``name`` (for tests and benchmarks).

    Not thread-safe against concurrent calls; raises ValueError if this CPU
    cannot run it."""
    global _kernels
    cdef bytes encoded = str(name).encode()
    cdef const ca_kernels *kern = ca_kernels_by_name(encoded)
    if kern == NULL:
        raise ValueError(
            f"SIMD level {name!r} is not available on this CPU; "
            f"available: {available_simd()}")
    _kernels = kern


def compiler():
    return (<bytes>ca_compiler_version()).decode()


def simd_note():
    """Why a table this CPU has the instructions for is not available
    (the AMX table when the OS or Linux refuses the tile state), or ""."""
    return (<bytes>ca_simd_note()).decode()


def register_bfloat16(int type_num):
    """Tell the driver NumPy's type number of ml_dtypes.bfloat16 (assigned
    when ml_dtypes is imported): operands of it are stored as bfloat16 and
    computed in float32, and the shortcuts take them."""
    ca_set_bfloat16_type(type_num)


def register_fp8(int e4m3fn, int e5m2):
    """Tell the driver NumPy's type numbers of ml_dtypes.float8_e4m3fn and
    float8_e5m2: K and V of them are fp8 caches, read with their scales."""
    ca_set_fp8_types(e4m3fn, e5m2)


def view_as(arr, tuple shape):
    """A view of arr in shape, or None where a reshape would copy (the one
    rule the shortcuts and _prepare share)."""
    return _view_as(arr, shape)


def round_to_bfloat16(cnp.ndarray result, into=None):
    """A float32 result rounded once to bfloat16 (nearest even, as
    ml_dtypes rounds), into ``into`` (a bfloat16 array of its shape) or a
    new array; returns it."""
    return rounded_to_bfloat16(result, into)


def float32_to_fp8(cnp.ndarray values, cnp.ndarray codes, float divisor, bint e4m3fn):
    """Float32 values / divisor (in float32) into fp8 codes (a uint8 array
    of their size; E4M3FN or E5M2): saturated to the format's finite range
    (NaN stays NaN) and rounded to nearest even as ml_dtypes casts them,
    without the GIL."""
    cdef Py_ssize_t n = cnp.PyArray_SIZE(values)
    if (cnp.PyArray_TYPE(values) != cnp.NPY_FLOAT32 or cnp.PyArray_TYPE(codes) != cnp.NPY_UINT8
            or not cnp.PyArray_IS_C_CONTIGUOUS(values)
            or not cnp.PyArray_IS_C_CONTIGUOUS(codes) or cnp.PyArray_SIZE(codes) != n):
        raise TypeError("float32_to_fp8 takes C-contiguous float32 values and uint8 codes "
                        "of their size")
    cdef const float *src = <const float *>cnp.PyArray_DATA(values)
    cdef uint8_t *dst = <uint8_t *>cnp.PyArray_DATA(codes)
    cdef int fmt = CA_FP8_E4M3FN if e4m3fn else CA_FP8_E5M2
    with nogil:
        ca_float_to_fp8(src, dst, n, divisor, fmt)


def openmp_enabled():
    return bool(CA_HAVE_OPENMP)


def openmp_version():
    return int(CA_OPENMP_VERSION)


def openmp_runtime():
    """Path of the loaded OpenMP runtime library ("" for a serial build or
    when the platform cannot tell)."""
    return (<bytes>ca_openmp_runtime()).decode(errors="replace")


def max_threads():
    """OpenMP's current maximum for a parallel region started by this thread,
    or 1 in a child forked after a parallel region (calls run serially there)."""
    if ca_forked_after_parallel():
        return 1
    return omp_get_max_threads()


def team_size(int n_threads, double serial_ns):
    """Threads a call of estimated one-thread time serial_ns (in ns) allowed
    n_threads would start now (src/team.h); for tests."""
    return ca_team_size(n_threads, serial_ns)


def forked_after_parallel():
    """True in a child process forked after a parallel region had run."""
    return bool(ca_forked_after_parallel())


# ------------------------------------------------- the checks of options
# (checks.pxd), for the general path

def check_flag(value, str name):
    return _check_flag(value, name)


def check_scale(scale, Py_ssize_t d_k, bint in_float32):
    return _check_scale(scale, d_k, in_float32)


def check_softcap(softcap, bint in_float32):
    return _check_softcap(softcap, in_float32)


def check_precision(precision, bint half_result):
    return _check_precision(precision, half_result)


def check_window(window, bint causal):
    cdef Py_ssize_t left, right
    _check_window(window, causal, &left, &right)
    return left, right


def check_num_threads(n, str name="num_threads"):
    return _check_num_threads(n, name)


def resolve_threads(num_threads, limit):
    return _resolve_threads(num_threads, limit)


def check_key_positions(const intp_t[::1] values, Py_ssize_t n_keys, str name):
    _check_key_positions(&values[0] if values.shape[0] else NULL, values.shape[0], n_keys,
                         name)


def check_alibi_slopes(const double[::1] slopes, bint in_float32):
    _check_alibi_slopes(&slopes[0] if slopes.shape[0] else NULL, slopes.shape[0], in_float32)


def check_sinks(double[::1] sinks, bint in_float32):
    _check_sinks(&sinks[0] if sinks.shape[0] else NULL, sinks.shape[0], in_float32)


def stacks_grouped_rows(Py_ssize_t group, Py_ssize_t n_rows, bint has_mask):
    return _stacks_grouped_rows(group, n_rows, has_mask)


# ------------------------------------------------------------ the runs

cdef inline void read_row_options(object options, RowOptions *row,
                                  const double[::1] alibi, const double[::1] sinks,
                                  Rotary *rotary):
    """The driver's RowOptions of a ``_prepare.options.RowOptions`` (its
    rotary tables described in ``rotary``, which the row then points to)."""
    row.causal = options.causal
    row.scale = options.scale
    row.window_left, row.window_right = options.window
    row.softcap = options.softcap
    row.precision = options.precision
    row.alibi_slope = &alibi[0] if alibi is not None and alibi.shape[0] > 0 else NULL
    row.sink = &sinks[0] if sinks is not None and sinks.shape[0] > 0 else NULL
    row.rotary = NULL
    if options.rotary is not None:
        cos, sin, first, interleaved = options.rotary
        rotary_of(rotary, cos, sin, first, interleaved)
        row.rotary = rotary


def run_arrays(cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, cnp.ndarray mask,
               cnp.ndarray k_scale, cnp.ndarray v_scale, tuple batch_shape,
               Py_ssize_t kv_group, Py_ssize_t query_period,
               const intp_t[::1] kv_lengths, const intp_t[::1] kv_starts,
               const intp_t[::1] query_offset, object options,
               cnp.ndarray out, cnp.ndarray scores, cnp.ndarray lse):
    """Run a dense call (``_prepare/dense.py``) into ``out`` (batch + (T,
    d_v): C-contiguous, or any non-negative strides with contiguous
    features), C-contiguous ``scores`` (n_batch, T, S) and ``lse`` (n_batch,
    T) of the compute dtype, any of them None.

    Preconditions (checked by the caller): q, k, v share the compute dtype
    (or k and v are float16 or int8 with a float32 q), are in native byte
    order, aligned, their strides multiples of the itemsize, their leading
    dimensions broadcast to ``batch_shape`` (k and v with H / kv_group heads
    on its last axis); ``mask`` is None or an aligned native bool, float32
    or float64 array broadcastable to batch + (T, S); ``kv_lengths`` is None
    or n_batch valid key counts in [0, S], ``kv_starts`` None or the first
    valid key of each batch entry, ``query_offset`` None or the key position
    of each batch entry's query row 0, in [-2^62, 2^62]; ``query_period`` > 0 says the
    rows are stacked groups of that many positions; the options' alibi is
    one slope per batch entry and its sinks one logit per group of
    query_period rows; ``k_scale`` / ``v_scale`` are the float32 row scales
    of int8 ``k`` / ``v``, of their shape with a last axis of size 1."""
    cdef const double[::1] alibi = options.alibi
    cdef const double[::1] sinks = options.sinks
    cdef RowOptions row
    cdef Rotary rotary
    cdef Py_ssize_t n_batch_dims = len(batch_shape)
    cdef Py_ssize_t shape[64]
    cdef Py_ssize_t d
    for d in range(n_batch_dims):
        shape[d] = batch_shape[d]
    read_row_options(options, &row, alibi, sinks, &rotary)
    run_dense(q, k, v, mask, k_scale, v_scale, n_batch_dims, shape, kv_group, query_period,
              &kv_lengths[0] if kv_lengths is not None and kv_lengths.shape[0] > 0 else NULL,
              &kv_starts[0] if kv_starts is not None and kv_starts.shape[0] > 0 else NULL,
              &row, _kernels, options.threads, out, scores, lse,
              &query_offset[0] if query_offset is not None and query_offset.shape[0] > 0
              else NULL)


cdef inline void read_place(Place *place, object given, const intp_t[::1] seq_offset):
    """The Place of a ``_prepare.entries.Place``."""
    cdef cnp.ndarray arr = given.array
    place.data = <const char *>cnp.PyArray_DATA(arr)
    place.type_num = cnp.PyArray_TYPE(arr)
    place.seq_offset = &seq_offset[0]
    place.t_stride = given.t_stride
    place.h_stride = given.h_stride
    place.col_stride = given.col_stride
    place.page_stride = given.page_stride


def run_entries(object call):
    """Run an entries call (``_prepare/entries.py``: packed sequences, paged
    caches) into its out (and lse). Preconditions (checked by the caller):
    every offset, length and page id lies within its array, the operands
    are of the compute dtype (or float16 / int8 K and V with float32), in
    native byte order and aligned; the options' alibi and sinks are None or
    one value per (sequence, query head)."""
    cdef const double[::1] alibi = call.options.alibi
    cdef const double[::1] sinks = call.options.sinks
    cdef const intp_t[::1] q_lengths = call.q_lengths
    cdef const intp_t[::1] kv_lengths = call.kv_lengths
    cdef const intp_t[::1] kv_starts = call.kv_starts
    cdef const intp_t[::1] page_ids = call.page_ids
    # the places' offsets, held here while the plan points into them
    cdef const intp_t[::1] q_offset = call.q.seq_offset
    cdef const intp_t[::1] k_offset = call.k.seq_offset
    cdef const intp_t[::1] v_offset = call.v.seq_offset
    cdef const intp_t[::1] out_offset = call.out.seq_offset
    cdef const intp_t[::1] lse_offset = call.lse.seq_offset if call.lse is not None else None
    cdef const intp_t[::1] k_scale_offset = (call.k_scale.seq_offset if call.k_scale is not None
                                             else None)
    cdef const intp_t[::1] v_scale_offset = (call.v_scale.seq_offset if call.v_scale is not None
                                             else None)
    cdef EntryPlan plan
    cdef RowOptions row
    cdef Rotary rotary
    read_row_options(call.options, &row, None, None, &rotary)
    plan.n_seq = q_lengths.shape[0]
    plan.n_heads = call.n_heads
    plan.n_kv_heads = call.n_kv_heads
    plan.d_k = call.d_k
    plan.d_v = call.d_v
    plan.q_lengths = &q_lengths[0] if plan.n_seq > 0 else NULL
    plan.kv_lengths = &kv_lengths[0] if plan.n_seq > 0 else NULL
    plan.kv_starts = &kv_starts[0] if kv_starts is not None and plan.n_seq > 0 else NULL
    read_place(&plan.q, call.q, q_offset)
    read_place(&plan.k, call.k, k_offset)
    read_place(&plan.v, call.v, v_offset)
    read_place(&plan.out, call.out, out_offset)
    plan.lse.data = NULL
    if call.lse is not None:
        read_place(&plan.lse, call.lse, lse_offset)
    plan.k_scale.data = NULL
    plan.v_scale.data = NULL
    if call.k_scale is not None:
        read_place(&plan.k_scale, call.k_scale, k_scale_offset)
        read_place(&plan.v_scale, call.v_scale, v_scale_offset)
    plan.alibi = &alibi[0] if alibi is not None else NULL
    plan.sinks = &sinks[0] if sinks is not None else NULL
    plan.page_ids = &page_ids[0] if page_ids is not None else NULL
    plan.pages_per_seq = call.pages_per_seq
    plan.page_size = call.page_size
    run_plan(&plan, &row, _kernels, call.options.threads, call.out.array)


# ---------------------------------------------------------------- appends

def append_rows(cnp.ndarray cache, cnp.ndarray rows, const intp_t[::1] seq_offset,
                int row_axis, int head_axis, const intp_t[::1] start,
                const intp_t[::1] n_new, const intp_t[::1] page_ids=None,
                Py_ssize_t pages_per_seq=0):
    """Write new rows into a 4-D cache or pages in place (appends.pxd): row t
    of head h of sequence s, at byte seq_offset[s] + t * rows.strides[row_axis]
    + h * rows.strides[head_axis] of rows, goes to position start[s] + t.
    Preconditions (checked by the caller): rows of the cache's dtype, every
    position and page id within the cache, no memory shared."""
    cdef CacheRows dst
    cdef NewRows src
    cdef Py_ssize_t n_seq = start.shape[0]
    if n_seq == 0:
        return
    cache_rows_of(&dst, cache, &page_ids[0] if page_ids is not None else NULL, pages_per_seq)
    src.data = <const char *>cnp.PyArray_DATA(rows)
    src.seq_offset = &seq_offset[0]
    src.head_stride = cnp.PyArray_STRIDE(rows, head_axis)
    src.row_stride = cnp.PyArray_STRIDE(rows, row_axis)
    src.col_stride = cnp.PyArray_STRIDE(rows, cnp.PyArray_NDIM(rows) - 1)
    _append_rows(&dst, &src, &start[0], &n_new[0], n_seq, cnp.PyArray_DIM(cache, 1),
                 cnp.PyArray_DIM(cache, 3))


# ----------------------------------------------------------------- rotary

def rotate_rows(cnp.ndarray x, cnp.ndarray cos, cnp.ndarray sin, Py_ssize_t first,
                const intp_t[::1] positions, bint interleaved):
    """A new C-contiguous array of the rows of x rotated (rotary.pxd), row
    (a, h, t) at positions[a * T + t], without the GIL. Preconditions
    (checked by the caller): x 4-D (A, H, T, d) float32 or float64, and the
    tables (n_positions, half) of its dtype, each aligned, native, strides
    multiples of the itemsize, whose row p - first holds position p; 2 *
    half <= d; every position one the tables hold."""
    cdef Rotary rotary
    rotary_of(&rotary, cos, sin, first, interleaved)
    return _rotated(x, &rotary, &positions[0] if positions.shape[0] > 0 else NULL)


# -------------------------------------------------------------- shortcuts

def attention_shortcut(q, k, v, causal, mask, scale, return_scores, return_lse, enable_gqa,
                       kv_lengths, window, softcap, alibi_slopes, sinks, k_scale, v_scale,
                       kv_starts, out, num_threads, thread_limit, precision):
    """The result of ``attention`` when the call is the common case, else None
    (shortcuts.pxd)."""
    return _attention_shortcut(_kernels, q, k, v, causal, mask, scale, return_scores,
                               return_lse, enable_gqa, kv_lengths, window, softcap,
                               alibi_slopes, sinks, k_scale, v_scale, kv_starts, out,
                               num_threads, thread_limit, precision)


def kvcache_shortcut(q, k_cache, v_cache, cache_lengths, k_new, v_new, causal, scale,
                     enable_gqa, window, softcap, alibi_slopes, sinks, k_scale, v_scale,
                     kv_starts, out, return_lse, num_threads, thread_limit, rotary_cos,
                     rotary_sin, rotary_interleaved, precision):
    """The result of ``attention_with_kvcache`` for a common serving step,
    else None before anything is written (shortcuts.pxd)."""
    return _kvcache_shortcut(_kernels, q, k_cache, v_cache, cache_lengths, k_new, v_new, causal,
                             scale, enable_gqa, window, softcap, alibi_slopes, sinks, k_scale,
                             v_scale, kv_starts, out, return_lse, num_threads, thread_limit,
                             rotary_cos, rotary_sin, rotary_interleaved, precision)


def paged_shortcut(q, k_pages, v_pages, block_table, cache_lengths, k_new, v_new,
                   cu_seqlens_q, causal, scale, window, softcap, alibi_slopes, sinks, k_scale,
                   v_scale, kv_starts, out, return_lse, num_threads, thread_limit, rotary_cos,
                   rotary_sin, rotary_interleaved, precision):
    """The result of ``attention_with_paged_kvcache`` for a common serving
    step, else None before anything is written (shortcuts.pxd)."""
    return _paged_shortcut(_kernels, q, k_pages, v_pages, block_table, cache_lengths, k_new,
                           v_new, cu_seqlens_q, causal, scale, window, softcap, alibi_slopes,
                           sinks, k_scale, v_scale, kv_starts, out, return_lse, num_threads,
                           thread_limit, rotary_cos, rotary_sin, rotary_interleaved,
                           precision)
