# cython: language_level=3, boundscheck=False, wraparound=False
# cython: cdivision=True, initializedcheck=False
"""The driver's entry points: the C-level API (``_attention.pxd``, exported
through ``cython_attention``), run-time introspection (kernel tables,
OpenMP), and the Python entries ``attention_into`` with its fast shortcut
``attention_fast``, and ``attention_entries_into`` for entries of their own
lengths (packed variable-length sequences, paged caches).

The algorithm lives in the headers this module cimports, read in order:

    _kernel_table.pxd   the C kernel table (src/kernels.h) and its trampolines
    _problem.pxd        tuning constants, Operand, Problem and its builder
    _operands.pxd       how an operand's rows are reached (in place or copied)
    _workspace.pxd      per-thread scratch of a work item
    _packing.pxd        Q rows, K^T panels and V rows packed block by block
    _visibility.pxd     the keys each row sees, masking of a score tile
    _softmax.pxd        online-softmax state, LSE, merge of split-key partials
    _item_packed.pxd    packed-path work items (without and with SCORES)
    _item_direct.pxd    direct-path (decode) work items
    _schedule.pxd       work items over OpenMP threads, the thread count
    _from_arrays.pxd    NumPy arrays to a Problem, the run without the GIL
    _from_entries.pxd   an entry table (varlen sequences, paged caches) to a Problem

Each work item is one (batch entry, block of up to ``Q_BLOCK`` query rows) and
is computed by exactly one thread with block boundaries that depend only on
the problem shape, so the result is bitwise the same for any thread count.
Everything below this module runs without the GIL on raw pointers; the
Python layer (``_api.py``) has already validated shapes and dtypes, made the
inputs aligned and native, and allocated the outputs.

The helpers are ``cdef inline`` functions in ``.pxd`` files, compiled into
this one extension, so splitting the driver costs no call. Operands are raw
pointers with element strides rather than typed memoryviews: they may be
broadcast (stride 0), strided or transposed, float16, and are reached per
batch entry through offset tables, which a memoryview does not express.
"""

import numpy as np
cimport numpy as cnp
from cython cimport floating
from cpython.long cimport PyLong_AsLongLongAndOverflow
from libc.float cimport FLT_MAX
from libc.math cimport fabs, isfinite, sqrt
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy

from cattention._kernel_table cimport (
    ca_available_kernels, ca_compiler_version, ca_default_kernels,
    ca_forked_after_parallel, ca_kernels, ca_kernels_by_name, intp_t)
# The table's register tile and the list of tables compiled in: only this
# module's introspection reads them, so they are declared here rather than
# in _kernel_table.pxd (ca_kernel_tile is ca_kernels seen through these
# fields alone).
cdef extern from "kernels.h" nogil:
    int ca_compiled_kernels(const char **names, int capacity)
    ctypedef struct ca_kernel_tile "ca_kernels":
        int tile_rows
        int tile_cols_f32
        int tile_cols_f64

from cattention._problem cimport (
    DIRECT_ROWS, MAX_THREADS, Problem, problem_finish, problem_init, set_operand)
from cattention._schedule cimport (
    CA_HAVE_OPENMP, CA_OPENMP_VERSION, ca_openmp_runtime, ca_team_size,
    omp_get_max_threads, compute_problem)
from cattention._from_arrays cimport problem_from_arrays, run_on_outputs, set_kv_lengths
from cattention._from_entries cimport EntryTable, RowsSpec, problem_from_entries, problem_from_table

cnp.import_array()


cdef extern from "<float.h>" nogil:
    const float FLT_TRUE_MIN   # C11: the smallest positive (subnormal) float


# ------------------------------------------------ C-level API (_attention.pxd)

cdef inline bint float_holds(double value) noexcept nogil:
    """value is 0 or of a magnitude float can hold: a float32 call
    multiplies by it in float, and one beyond would make every logit inf
    (NaN weights) or 0 (uniform weights)."""
    return value == 0 or FLT_TRUE_MIN <= fabs(value) <= FLT_MAX


cdef inline bint missing(const void *data, Py_ssize_t n_rows,
                         Py_ssize_t n_features) noexcept nogil:
    return data == NULL and n_rows > 0 and n_features > 0


cdef int c_level_attention(Py_ssize_t n_queries, Py_ssize_t n_keys, Py_ssize_t d_k,
                           Py_ssize_t d_v,
                           const floating *q, Py_ssize_t q_row_stride,
                           const floating *k, Py_ssize_t k_row_stride,
                           const floating *v, Py_ssize_t v_row_stride,
                           double scale, int flags,
                           floating *out, Py_ssize_t out_row_stride,
                           floating *scores, Py_ssize_t scores_row_stride,
                           floating *lse, int n_threads) noexcept nogil:
    """One head through the same driver as the Python API (batch of one)."""
    cdef intp_t zero[1]
    cdef Problem pb
    if n_queries < 0 or n_keys < 0 or d_k < 0 or d_v < 0:
        return CATTENTION_ERR_SIZE
    if flags & ~CATTENTION_CAUSAL:
        return CATTENTION_ERR_FLAGS
    if not isfinite(scale):
        return CATTENTION_ERR_SCALE
    if floating is float and not float_holds(scale):
        return CATTENTION_ERR_SCALE
    if out == NULL and scores == NULL:
        return CATTENTION_ERR_POINTER
    if (missing(q, n_queries, d_k) or missing(k, n_keys, d_k)
            or (out != NULL and (missing(v, n_keys, d_v) or missing(out, n_queries, d_v)))):
        return CATTENTION_ERR_POINTER
    if ((out != NULL and out_row_stride < d_v)
            or (scores != NULL and scores_row_stride < n_keys)):
        return CATTENTION_ERR_STRIDE
    if n_queries == 0:
        return CATTENTION_OK
    zero[0] = 0
    problem_init(&pb, 1, n_queries, n_keys, d_k, d_v if out != NULL else 0,
                 (flags & CATTENTION_CAUSAL) != 0, scale)
    set_operand(&pb.q, q, zero, q_row_stride, 1)
    set_operand(&pb.k, k, zero, k_row_stride, 1)
    if out != NULL:
        set_operand(&pb.v, v, zero, v_row_stride, 1)
    else:
        pb.v = pb.k
    pb.lse = lse
    pb.ld_out = out_row_stride
    pb.ld_scores = scores_row_stride
    pb.kv_of_batch = zero
    pb.kv_source = zero
    problem_finish(&pb)
    if n_threads < 1:
        n_threads = 1
    if compute_problem(&pb, _kernels, n_threads, out, scores) != 0:
        return CATTENTION_ERR_NO_MEMORY
    return CATTENTION_OK


cdef int attention_f32(Py_ssize_t n_queries, Py_ssize_t n_keys, Py_ssize_t d_k,
                       Py_ssize_t d_v,
                       const float *q, Py_ssize_t q_row_stride,
                       const float *k, Py_ssize_t k_row_stride,
                       const float *v, Py_ssize_t v_row_stride,
                       double scale, int flags,
                       float *out, Py_ssize_t out_row_stride,
                       float *scores, Py_ssize_t scores_row_stride,
                       float *lse, int n_threads) noexcept nogil:
    return c_level_attention(n_queries, n_keys, d_k, d_v, q, q_row_stride, k, k_row_stride,
                             v, v_row_stride, scale, flags, out, out_row_stride,
                             scores, scores_row_stride, lse, n_threads)


cdef int attention_f64(Py_ssize_t n_queries, Py_ssize_t n_keys, Py_ssize_t d_k,
                       Py_ssize_t d_v,
                       const double *q, Py_ssize_t q_row_stride,
                       const double *k, Py_ssize_t k_row_stride,
                       const double *v, Py_ssize_t v_row_stride,
                       double scale, int flags,
                       double *out, Py_ssize_t out_row_stride,
                       double *scores, Py_ssize_t scores_row_stride,
                       double *lse, int n_threads) noexcept nogil:
    return c_level_attention(n_queries, n_keys, d_k, d_v, q, q_row_stride, k, k_row_stride,
                             v, v_row_stride, scale, flags, out, out_row_stride,
                             scores, scores_row_stride, lse, n_threads)


# ---------------------------------------------------------------- Python side

cdef const ca_kernels *_kernels = ca_default_kernels()


# Query rows up to which K and V are read in place rather than packed; the
# Python layer stacks grouped-query heads as rows within this many.
DIRECT_QUERY_ROWS = DIRECT_ROWS
MAX_NUM_THREADS = MAX_THREADS


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


cdef inline void set_row_options(Problem *pb, cnp.ndarray lse, Py_ssize_t window_left,
                                 Py_ssize_t window_right, double softcap):
    """The options both Python entries pass the same way: where the rows'
    log-sum-exp goes (None: nowhere), the sliding window, the softcap."""
    pb.lse = cnp.PyArray_DATA(lse) if lse is not None else NULL
    pb.window_left = window_left
    pb.window_right = window_right
    pb.softcap = softcap


cdef inline int run_then_free(Problem *pb, intp_t *index, Py_ssize_t num_threads,
                              cnp.ndarray out, cnp.ndarray scores) except -1:
    """Run the Problem without the GIL, then free the batch index its builder
    returned; MemoryError if the scratch could not be allocated."""
    cdef int status
    try:
        status = run_on_outputs(pb, _kernels, num_threads, out, scores)
    finally:
        free(index)
    if status != 0:
        raise MemoryError("cattention: could not allocate scratch memory")
    return 0


def attention_into(cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, object mask,
                   tuple batch_shape, bint causal, double scale,
                   cnp.ndarray out, cnp.ndarray scores, int num_threads,
                   cnp.ndarray lse=None, const intp_t[::1] kv_lengths=None,
                   Py_ssize_t query_period=0, Py_ssize_t window_left=-1,
                   Py_ssize_t window_right=-1, double softcap=0,
                   const double[::1] alibi_slopes=None, const double[::1] sinks=None,
                   cnp.ndarray k_scale=None, cnp.ndarray v_scale=None):
    """Compute into preallocated C-contiguous ``out`` (n_batch, T, d_v) and/or
    ``scores`` (n_batch, T, S) of the compute dtype; either may be None.

    Preconditions (checked by the caller): q, k, v share the compute dtype
    (or k and v are both float16 with a float32 q), are in native byte
    order, aligned, their strides are multiples of the itemsize, their
    leading dimensions broadcast to ``batch_shape``; ``mask`` is None or an
    aligned native bool/float32/float64 array of ndim >= 2 broadcastable to
    batch + (T, S). ``v`` may be None when ``out`` is None. ``lse``, if
    given, is a C-contiguous (n_batch, T) array of the compute dtype for the
    rows' log-sum-exp. ``kv_lengths``, if given, is a C-contiguous intp array
    of n_batch valid key counts in [0, S]. ``query_period`` > 0 says the T
    rows of q are ``T // query_period`` stacked groups of query_period
    positions (grouped-query heads), for causal alignment. ``window_left`` /
    ``window_right`` bound a sliding window (-1: unbounded), ``softcap`` > 0
    caps logits, ``alibi_slopes`` is a C-contiguous float64 array of n_batch
    slopes. ``sinks``, if given, is a C-contiguous float64 array of the sink
    logit of each group of query_period rows (n_batch * T // query_period
    values), -inf for none. ``k_scale`` / ``v_scale`` are the float32 row
    scales of int8 ``k`` / ``v``, of their shape with a last axis of size 1,
    aligned.

    The per-batch-entry options, whose layout is fixed, arrive as typed
    memoryviews; the operands stay ndarrays because they may be broadcast
    (stride 0), strided, transposed, float16 or int8, and are reached per
    batch entry through offset tables (see _from_arrays.pxd)."""
    cdef Problem pb
    cdef Py_ssize_t n_batch_dims = len(batch_shape)
    cdef Py_ssize_t shape[64]
    cdef Py_ssize_t d
    for d in range(n_batch_dims):
        shape[d] = batch_shape[d]
    cdef intp_t *index = problem_from_arrays(&pb, q, k, v, mask, k_scale, v_scale,
                                             n_batch_dims, shape,
                                             causal, scale)
    set_row_options(&pb, lse, window_left, window_right, softcap)
    if query_period > 0:
        pb.query_period = query_period
    if alibi_slopes is not None and alibi_slopes.shape[0] > 0:
        pb.alibi_slope = &alibi_slopes[0]
    if sinks is not None and sinks.shape[0] > 0:
        pb.sink = &sinks[0]
    if kv_lengths is not None and kv_lengths.shape[0] > 0:
        set_kv_lengths(&pb, &kv_lengths[0], index)
    run_then_free(&pb, index, num_threads, out, scores)


def attention_entries_into(object q, object k, object v, object entries, bint causal,
                           double scale, cnp.ndarray out, cnp.ndarray lse, int num_threads,
                           Py_ssize_t window_left=-1, Py_ssize_t window_right=-1,
                           double softcap=0):
    """Compute the entries of an ``_entries.Entries`` table (batch entries of
    their own lengths: packed variable-length sequences, paged caches) into
    ``out`` (and ``lse``, or None), arrays of the compute dtype that the
    table's output offsets index.

    Preconditions (checked by ``_entries``): q, k, v (``_entries.Rows``)
    hold arrays of the compute dtype (or float16 / int8 k and v with a
    float32 q) in native byte order, aligned; every offset, length and page
    id of the table lies within them; ``entries.alibi`` (float64 per entry)
    and ``entries.sinks`` (float64 per group of query_period rows) are None
    or C-contiguous."""
    cdef Problem pb
    cdef const double[::1] alibi = entries.alibi
    cdef const double[::1] sinks = entries.sinks
    cdef intp_t *index = problem_from_entries(&pb, q, k, v, entries, causal, scale)
    set_row_options(&pb, lse, window_left, window_right, softcap)
    if alibi is not None:
        pb.alibi_slope = &alibi[0]
    if sinks is not None:
        pb.sink = &sinks[0]
    run_then_free(&pb, index, num_threads, out, None)


cdef inline bint usable_input(cnp.ndarray arr, int type_num) noexcept:
    """Aligned, in native byte order, of type_num, every stride a multiple
    of the itemsize."""
    cdef int d
    cdef Py_ssize_t itemsize
    if (cnp.PyArray_TYPE(arr) != type_num or not cnp.PyArray_ISALIGNED(arr)
            or not cnp.PyArray_ISNOTSWAPPED(arr)):
        return False
    itemsize = cnp.PyArray_ITEMSIZE(arr)
    for d in range(cnp.PyArray_NDIM(arr)):
        if cnp.PyArray_STRIDE(arr, d) % itemsize != 0:
            return False
    return True


cdef inline bint plain_scale(object scale, Py_ssize_t d_k, bint in_float,
                             double *value):
    """The scale a fast path takes, in value: None (1 / sqrt(d_k), d_k > 0)
    or a finite Python float the compute dtype holds (in_float: float32).
    False sends the call to the general path, which names what is wrong."""
    if scale is None:
        if d_k == 0:
            return False
        value[0] = 1.0 / sqrt(<double>d_k)
        return True
    if type(scale) is not float:
        return False
    value[0] = scale
    return isfinite(value[0]) and (not in_float or float_holds(value[0]))


cdef inline Py_ssize_t plain_threads(object num_threads, object thread_limit):
    """The thread count a fast path runs with: num_threads, a Python int in
    [1, MAX_THREADS], or for None the calling thread's limit (else OpenMP's
    maximum); 0 sends the call to the general path."""
    cdef Py_ssize_t threads
    if num_threads is None:
        threads = thread_limit if thread_limit is not None else omp_get_max_threads()
        return threads if threads >= 1 else 1
    cdef int overflow = 0
    if type(num_threads) is int:
        # (read in C: a comparison of Python ints costs more than the check)
        threads = <Py_ssize_t>PyLong_AsLongLongAndOverflow(num_threads, &overflow)
        if overflow == 0 and 1 <= threads <= MAX_THREADS:
            return threads
    return 0


cdef inline bint plain_flag(object flag) noexcept:
    """flag is True or False (anything else, numpy.bool_ included, goes to
    the general path, which checks it)."""
    return flag is True or flag is False


cdef inline tuple grouped_views(cnp.ndarray q, cnp.ndarray k, cnp.ndarray v,
                                Py_ssize_t group, Py_ssize_t *batch,
                                Py_ssize_t *n_batch_dims, Py_ssize_t *query_period):
    """The views, batch and query period of _gqa.run_grouped for q (..., H,
    T, d_k) over k, v (..., H_kv, S, d) with H = group * H_kv > H_kv: a K/V
    head's G heads' decode rows stacked as its rows (its keys read once), or
    for more rows the query heads broadcast against it. batch holds q's
    leading dimensions on entry (n_batch_dims of them) and the batch on
    return; outputs of q's leading shape, C-contiguous, are the same memory
    either way."""
    cdef int ndim = cnp.PyArray_NDIM(q)
    cdef Py_ssize_t n_queries = cnp.PyArray_DIM(q, ndim - 2)
    cdef Py_ssize_t d_k = cnp.PyArray_DIM(q, ndim - 1)
    cdef Py_ssize_t n_kv_heads = batch[ndim - 3] // group
    cdef tuple leading = (<object>q).shape[:ndim - 3]
    batch[ndim - 3] = n_kv_heads
    if group * n_queries <= DIRECT_ROWS:
        query_period[0] = n_queries
        return q.reshape(leading + (n_kv_heads, group * n_queries, d_k)), k, v
    batch[ndim - 2] = group
    n_batch_dims[0] = ndim - 1
    return (q.reshape(leading + (n_kv_heads, group, n_queries, d_k)),
            k[..., None, :, :], v[..., None, :, :])


def attention_fast(object q, object k, object v, object causal_flag, object scale,
                   object num_threads, object scores_flag, object thread_limit,
                   object grouped_flag=False):
    """``attention`` for the common case with no Python-level overhead, or
    None when the general path (``_api._run``) must handle the call.

    Common: q, k, v are ndarrays of one dtype (float32 or float64) and one
    ndim, with equal leading dimensions, in native byte order, aligned,
    element-multiple strides, nonempty, no mask, the flags (causal,
    return_scores, enable_gqa) bools, and scale/num_threads of plain types.
    With ``grouped_flag`` (enable_gqa=True) the head axis (-3) of k and v
    may hold H_kv heads, H_kv dividing q's H. Anything else,
    including every error, goes to the general path. The Problem is built by
    the same problem_from_arrays, over the views _gqa.run_grouped takes."""
    if type(q) is not cnp.ndarray or type(k) is not cnp.ndarray or type(v) is not cnp.ndarray:
        return None
    if not (plain_flag(causal_flag) and plain_flag(scores_flag) and plain_flag(grouped_flag)):
        return None
    cdef bint causal = causal_flag is True
    cdef bint return_scores = scores_flag is True
    cdef bint grouped = grouped_flag is True
    cdef cnp.ndarray qa = <cnp.ndarray>q
    cdef cnp.ndarray ka = <cnp.ndarray>k
    cdef cnp.ndarray va = <cnp.ndarray>v
    cdef int type_num = cnp.PyArray_TYPE(qa)
    cdef int ndim = cnp.PyArray_NDIM(qa)
    cdef int d
    cdef Py_ssize_t n_batch = 1
    cdef Py_ssize_t shape[64]
    cdef double scale_value = 0   # set by plain_scale
    cdef Py_ssize_t threads
    if type_num != cnp.NPY_FLOAT32 and type_num != cnp.NPY_FLOAT64:
        return None
    if (ndim < (3 if grouped else 2) or cnp.PyArray_NDIM(ka) != ndim
            or cnp.PyArray_NDIM(va) != ndim):
        return None
    if not (usable_input(qa, type_num) and usable_input(ka, type_num)
            and usable_input(va, type_num)):
        return None
    cdef Py_ssize_t group = 1
    cdef Py_ssize_t n_kv_heads = 0   # set for grouped heads
    for d in range(ndim - 2):
        shape[d] = cnp.PyArray_DIM(qa, d)
        if grouped and d == ndim - 3:
            # the head axis: H query heads in groups of H / H_kv per K/V head
            n_kv_heads = cnp.PyArray_DIM(ka, d)
            if (cnp.PyArray_DIM(va, d) != n_kv_heads or n_kv_heads == 0
                    or shape[d] % n_kv_heads != 0):
                return None
            group = shape[d] // n_kv_heads
        elif cnp.PyArray_DIM(ka, d) != shape[d] or cnp.PyArray_DIM(va, d) != shape[d]:
            return None
        n_batch *= shape[d]
    cdef Py_ssize_t n_queries = cnp.PyArray_DIM(qa, ndim - 2)
    cdef Py_ssize_t d_k = cnp.PyArray_DIM(qa, ndim - 1)
    cdef Py_ssize_t n_keys = cnp.PyArray_DIM(ka, ndim - 2)
    cdef Py_ssize_t d_v = cnp.PyArray_DIM(va, ndim - 1)
    if (cnp.PyArray_DIM(ka, ndim - 1) != d_k or cnp.PyArray_DIM(va, ndim - 2) != n_keys
            or n_batch == 0 or n_queries == 0):
        return None
    # an output no array can hold: the general path names it
    if (<double>n_batch * n_queries * (n_keys if return_scores and n_keys > d_v else d_v)
            * cnp.PyArray_ITEMSIZE(qa) >= 9.2e18):
        return None
    threads = plain_threads(num_threads, thread_limit)
    if not plain_scale(scale, d_k, type_num == cnp.NPY_FLOAT32, &scale_value) or threads == 0:
        return None

    shape[ndim - 2] = n_queries
    shape[ndim - 1] = d_v
    cdef cnp.ndarray out = cnp.PyArray_EMPTY(ndim, <cnp.npy_intp *>shape, type_num, 0)
    cdef cnp.ndarray scores = None
    if return_scores:
        shape[ndim - 1] = n_keys
        scores = cnp.PyArray_EMPTY(ndim, <cnp.npy_intp *>shape, type_num, 0)
    cdef cnp.ndarray q_view = qa
    cdef cnp.ndarray k_view = ka
    cdef cnp.ndarray v_view = va
    cdef Py_ssize_t n_batch_dims = ndim - 2
    cdef Py_ssize_t query_period = 0
    if group > 1:
        q_view, k_view, v_view = grouped_views(qa, ka, va, group, shape, &n_batch_dims,
                                               &query_period)
    cdef Problem pb
    cdef intp_t *index = problem_from_arrays(&pb, q_view, k_view, v_view, None, None, None,
                                             n_batch_dims, shape, causal, scale_value)
    if query_period > 0:
        pb.query_period = query_period
    run_then_free(&pb, index, threads, out, scores)
    if return_scores:
        return out, scores
    return out


cdef inline void byte_span(cnp.ndarray arr, char **low, char **high) noexcept:
    """The bytes [low, high) that the elements of the nonempty arr lie in."""
    cdef char *data = <char *>cnp.PyArray_DATA(arr)
    cdef Py_ssize_t below = 0
    cdef Py_ssize_t above = cnp.PyArray_ITEMSIZE(arr)
    cdef Py_ssize_t d, extent
    for d in range(cnp.PyArray_NDIM(arr)):
        extent = cnp.PyArray_STRIDE(arr, d) * (cnp.PyArray_DIM(arr, d) - 1)
        if extent < 0:
            below += extent
        else:
            above += extent
    low[0] = data + below
    high[0] = data + above


cdef inline bint apart(cnp.ndarray a, cnp.ndarray b) noexcept:
    """a and b certainly share no memory: their byte spans do not meet.
    (Spans that meet may still interleave without sharing an element; the
    general path decides those exactly.)"""
    cdef char *a_low
    cdef char *a_high
    cdef char *b_low
    cdef char *b_high
    byte_span(a, &a_low, &a_high)
    byte_span(b, &b_low, &b_high)
    return a_high <= b_low or b_high <= a_low


cdef inline bint without_self_overlap(cnp.ndarray arr) noexcept:
    """No two elements of arr share memory: along its axes by increasing
    stride, each stride clears the extent of the axes before it. (A
    broadcast or as_strided array that fails this is written by the general
    path, element by element in NumPy's order.)"""
    cdef Py_ssize_t stride[8]
    cdef Py_ssize_t extent[8]
    cdef Py_ssize_t n = 0
    cdef Py_ssize_t d, i, j, s, e
    cdef Py_ssize_t covered = cnp.PyArray_ITEMSIZE(arr)
    for d in range(cnp.PyArray_NDIM(arr)):
        if cnp.PyArray_DIM(arr, d) > 1:
            stride[n] = abs(cnp.PyArray_STRIDE(arr, d))
            extent[n] = stride[n] * (cnp.PyArray_DIM(arr, d) - 1)
            n += 1
    # insertion sort of at most 4 axes by stride
    for i in range(1, n):
        s, e = stride[i], extent[i]
        j = i - 1
        while j >= 0 and stride[j] > s:
            stride[j + 1], extent[j + 1] = stride[j], extent[j]
            j -= 1
        stride[j + 1], extent[j + 1] = s, e
    for i in range(n):
        if stride[i] < covered:
            return False
        covered += extent[i]
    return True


cdef inline void append_rows(cnp.ndarray cache, cnp.ndarray rows,
                             const intp_t *start) noexcept:
    """cache[b, h, start[b] + t, :] = rows[b, h, t, :] for every (b, h, t):
    arrays of one dtype, apart, every index in range."""
    cdef Py_ssize_t itemsize = cnp.PyArray_ITEMSIZE(cache)
    cdef Py_ssize_t n_features = cnp.PyArray_DIM(rows, 3)
    cdef char *cache_data = <char *>cnp.PyArray_DATA(cache)
    cdef char *rows_data = <char *>cnp.PyArray_DATA(rows)
    cdef Py_ssize_t cache_col = cnp.PyArray_STRIDE(cache, 3)
    cdef Py_ssize_t rows_col = cnp.PyArray_STRIDE(rows, 3)
    cdef Py_ssize_t b, h, t, i
    cdef char *dst
    cdef char *src
    for b in range(cnp.PyArray_DIM(rows, 0)):
        for h in range(cnp.PyArray_DIM(rows, 1)):
            for t in range(cnp.PyArray_DIM(rows, 2)):
                dst = (cache_data + b * cnp.PyArray_STRIDE(cache, 0)
                       + h * cnp.PyArray_STRIDE(cache, 1)
                       + (start[b] + t) * cnp.PyArray_STRIDE(cache, 2))
                src = (rows_data + b * cnp.PyArray_STRIDE(rows, 0)
                       + h * cnp.PyArray_STRIDE(rows, 1) + t * cnp.PyArray_STRIDE(rows, 2))
                if cache_col == itemsize and rows_col == itemsize:
                    memcpy(dst, src, n_features * itemsize)
                else:
                    for i in range(n_features):
                        memcpy(dst + i * cache_col, src + i * rows_col, itemsize)


cdef inline bint half_holds(cnp.ndarray rows) noexcept:
    """Every element of the 4-D float32 array rows is finite and rounds to a
    finite float16 (below 65520 in magnitude): converting it neither
    overflows nor warns."""
    cdef char *data = <char *>cnp.PyArray_DATA(rows)
    cdef Py_ssize_t b, h, t, i
    cdef const char *row
    for b in range(cnp.PyArray_DIM(rows, 0)):
        for h in range(cnp.PyArray_DIM(rows, 1)):
            for t in range(cnp.PyArray_DIM(rows, 2)):
                row = (data + b * cnp.PyArray_STRIDE(rows, 0) + h * cnp.PyArray_STRIDE(rows, 1)
                       + t * cnp.PyArray_STRIDE(rows, 2))
                for i in range(cnp.PyArray_DIM(rows, 3)):
                    # false for NaN too
                    if not fabs((<const float *>(row + i * cnp.PyArray_STRIDE(rows, 3)))[0]) \
                            < 65520.0:
                        return False
    return True


cdef inline intp_t load_length(cnp.ndarray lengths, Py_ssize_t b) noexcept:
    """lengths[b] of an aligned int64 or int32 cache_lengths."""
    cdef char *at = <char *>cnp.PyArray_DATA(lengths) + b * cnp.PyArray_STRIDE(lengths, 0)
    if cnp.PyArray_TYPE(lengths) == cnp.NPY_INT64:
        return (<long long *>at)[0]
    return (<int *>at)[0]


cdef inline void store_lengths(cnp.ndarray lengths, const intp_t *start,
                               Py_ssize_t n_new) noexcept:
    """lengths[b] = start[b] + n_new for every b (each fits: at most S_max)."""
    cdef char *at
    cdef Py_ssize_t b
    for b in range(cnp.PyArray_DIM(lengths, 0)):
        at = <char *>cnp.PyArray_DATA(lengths) + b * cnp.PyArray_STRIDE(lengths, 0)
        if cnp.PyArray_TYPE(lengths) == cnp.NPY_INT64:
            (<long long *>at)[0] = start[b] + n_new
        else:
            (<int *>at)[0] = <int>(start[b] + n_new)


cdef inline int step_types(object q, object k_cache, object v_cache, object lengths,
                           object k_new, object v_new, int *cache_type) noexcept:
    """The element type of q, and in *cache_type that of the caches, when a
    serving step's arrays are of the kinds the compiled steps take: ndarrays,
    k_new and v_new both given or both None, q float32 or float64 and caches
    of q's type or float16 beside a float32 q. Else -1 (the general path)."""
    if (type(q) is not cnp.ndarray or type(k_cache) is not cnp.ndarray
            or type(v_cache) is not cnp.ndarray or type(lengths) is not cnp.ndarray):
        return -1
    if (k_new is None) != (v_new is None):
        return -1
    if k_new is not None and (type(k_new) is not cnp.ndarray or type(v_new) is not cnp.ndarray):
        return -1
    cdef int q_type = cnp.PyArray_TYPE(<cnp.ndarray>q)
    cache_type[0] = cnp.PyArray_TYPE(<cnp.ndarray>k_cache)
    if q_type != cnp.NPY_FLOAT32 and q_type != cnp.NPY_FLOAT64:
        return -1
    if cache_type[0] != q_type and not (q_type == cnp.NPY_FLOAT32
                                        and cache_type[0] == cnp.NPY_FLOAT16):
        return -1
    return q_type


cdef inline bint writes_apart(cnp.ndarray k_cache, cnp.ndarray v_cache, cnp.ndarray lengths,
                              cnp.ndarray q, cnp.ndarray k_new, cnp.ndarray v_new) noexcept:
    """Whether a step may append to k_cache and v_cache and advance lengths in
    place: each writable, no element of one overlapping another of itself,
    and the three apart from each other and from q, k_new and v_new."""
    return (cnp.PyArray_ISWRITEABLE(k_cache) and cnp.PyArray_ISWRITEABLE(v_cache)
            and cnp.PyArray_ISWRITEABLE(lengths)
            and without_self_overlap(k_cache) and without_self_overlap(v_cache)
            and without_self_overlap(lengths)
            and apart(k_cache, v_cache) and apart(k_cache, lengths) and apart(v_cache, lengths)
            and apart(k_cache, q) and apart(v_cache, q) and apart(lengths, q)
            and apart(k_cache, k_new) and apart(v_cache, k_new) and apart(lengths, k_new)
            and apart(k_cache, v_new) and apart(v_cache, v_new) and apart(lengths, v_new))


def kvcache_fast(object q, object k_cache, object v_cache, object cache_lengths,
                 object k_new, object v_new, object causal_flag, object scale,
                 object num_threads, object thread_limit):
    """``attention_with_kvcache`` for the common serving call with no
    Python-level overhead, or None when the general path (``_kvcache.py``)
    must handle it. None is returned before anything is written.

    Common: ndarrays; q float32 or float64 of shape (B, H, T, d_k), caches
    of q's dtype (or float16 with a float32 q) of shape (B, H_kv, S_max, d),
    H a multiple of H_kv, all sizes nonzero, aligned, native, element-multiple
    strides; cache_lengths int32 or int64 of shape (B,); k_new and v_new None
    or of the cache dtype (float32 into a float16 cache: converted, and no
    value beyond its range), causal a bool, every array the call writes certainly apart
    from every other one it touches, the new rows within S_max; scale and
    num_threads of plain types in range. Anything else, including every
    error, goes to the general path. The Problem is the one the general path
    builds: the same views of the same arrays, the same batch shape,
    lengths and query period, so the bits are the same."""
    cdef int cache_type = 0   # set by step_types
    cdef int q_type = step_types(q, k_cache, v_cache, cache_lengths, k_new, v_new, &cache_type)
    if q_type < 0 or not plain_flag(causal_flag):
        return None
    cdef bint causal = causal_flag is True
    cdef bint appending = k_new is not None
    cdef cnp.ndarray qa = <cnp.ndarray>q
    cdef cnp.ndarray kc = <cnp.ndarray>k_cache
    cdef cnp.ndarray vc = <cnp.ndarray>v_cache
    cdef cnp.ndarray lengths = <cnp.ndarray>cache_lengths
    cdef cnp.ndarray kn = <cnp.ndarray>k_new if appending else None
    cdef cnp.ndarray vn = <cnp.ndarray>v_new if appending else None
    if (cnp.PyArray_NDIM(qa) != 4 or cnp.PyArray_NDIM(kc) != 4 or cnp.PyArray_NDIM(vc) != 4
            or cnp.PyArray_NDIM(lengths) != 1):
        return None
    if not (usable_input(qa, q_type) and usable_input(kc, cache_type)
            and usable_input(vc, cache_type)):
        return None
    cdef Py_ssize_t n_batch = cnp.PyArray_DIM(kc, 0)
    cdef Py_ssize_t n_kv_heads = cnp.PyArray_DIM(kc, 1)
    cdef Py_ssize_t max_keys = cnp.PyArray_DIM(kc, 2)
    cdef Py_ssize_t d_k = cnp.PyArray_DIM(kc, 3)
    cdef Py_ssize_t d_v = cnp.PyArray_DIM(vc, 3)
    cdef Py_ssize_t n_heads = cnp.PyArray_DIM(qa, 1)
    cdef Py_ssize_t n_queries = cnp.PyArray_DIM(qa, 2)
    if (cnp.PyArray_DIM(vc, 0) != n_batch or cnp.PyArray_DIM(vc, 1) != n_kv_heads
            or cnp.PyArray_DIM(vc, 2) != max_keys or cnp.PyArray_DIM(qa, 0) != n_batch
            or cnp.PyArray_DIM(qa, 3) != d_k or cnp.PyArray_DIM(lengths, 0) != n_batch):
        return None
    if (n_batch == 0 or n_heads == 0 or n_kv_heads == 0 or max_keys == 0 or d_k == 0
            or d_v == 0 or n_queries == 0 or n_heads % n_kv_heads != 0):
        return None
    if not (usable_input(lengths, cnp.NPY_INT64)
            or (usable_input(lengths, cnp.NPY_INT32) and max_keys <= 2147483647)):
        return None
    cdef Py_ssize_t n_new = 0
    if appending:
        # (the dimensions of an array are read only once its ndim is known)
        if cnp.PyArray_NDIM(kn) != 4 or cnp.PyArray_NDIM(vn) != 4:
            return None
        n_new = cnp.PyArray_DIM(kn, 2)
        if (n_new == 0 or cnp.PyArray_DIM(vn, 2) != n_new
                or cnp.PyArray_DIM(kn, 0) != n_batch or cnp.PyArray_DIM(vn, 0) != n_batch
                or cnp.PyArray_DIM(kn, 1) != n_kv_heads or cnp.PyArray_DIM(vn, 1) != n_kv_heads
                or cnp.PyArray_DIM(kn, 3) != d_k or cnp.PyArray_DIM(vn, 3) != d_v):
            return None
        if not writes_apart(kc, vc, lengths, qa, kn, vn):
            return None
        # new float32 rows for a float16 cache are converted as the general
        # path converts them; one beyond float16's range is its to refuse
        if cache_type == cnp.NPY_FLOAT16 and cnp.PyArray_TYPE(kn) == cnp.NPY_FLOAT32:
            if not (cnp.PyArray_TYPE(vn) == cnp.NPY_FLOAT32
                    and usable_input(kn, cnp.NPY_FLOAT32)
                    and usable_input(vn, cnp.NPY_FLOAT32)):
                return None
        elif not (usable_input(kn, cache_type) and usable_input(vn, cache_type)):
            return None

    cdef double scale_value = 0   # set by plain_scale
    cdef Py_ssize_t threads = plain_threads(num_threads, thread_limit)
    if not plain_scale(scale, d_k, q_type == cnp.NPY_FLOAT32, &scale_value) or threads == 0:
        return None

    cdef Py_ssize_t itemsize = cnp.PyArray_ITEMSIZE(qa)
    # an output no array can hold: the general path names it
    if <double>n_batch * n_heads * n_queries * d_v * itemsize >= 9.2e18:
        return None

    # everything that allocates comes before the append: the views and batch
    # of _gqa.run_grouped, the output, float32 rows for a float16 cache
    # converted as the general path converts them
    cdef Py_ssize_t group = n_heads // n_kv_heads
    cdef cnp.ndarray q_view = qa
    cdef cnp.ndarray k_view = kc
    cdef cnp.ndarray v_view = vc
    cdef Py_ssize_t query_period = 0
    cdef Py_ssize_t n_batch_dims = 2
    cdef Py_ssize_t shape[3]
    shape[0] = n_batch
    shape[1] = n_heads
    if group > 1:
        q_view, k_view, v_view = grouped_views(qa, kc, vc, group, shape, &n_batch_dims,
                                               &query_period)
    cdef cnp.ndarray out = np.empty((n_batch, n_heads, n_queries, d_v), dtype=qa.dtype)
    cdef cnp.ndarray k_rows = kn
    cdef cnp.ndarray v_rows = vn
    if appending and cache_type != cnp.PyArray_TYPE(kn):
        # a value beyond float16's range is the general path's to refuse
        if not (half_holds(kn) and half_holds(vn)):
            return None
        k_rows = kn.astype(np.float16)
        v_rows = vn.astype(np.float16)

    # the lengths before the call, each leaving room for the new rows, and
    # the lengths after it of each batch entry (sequence b's K/V heads, and
    # their query heads when broadcast)
    cdef Py_ssize_t entries_per_sequence = shape[1] * (shape[2] if n_batch_dims == 3 else 1)
    cdef intp_t *start = <intp_t *>malloc(
        (n_batch + n_batch * entries_per_sequence) * sizeof(intp_t))
    if start == NULL:
        return None
    cdef intp_t *entry_lengths = start + n_batch
    cdef Py_ssize_t b, e
    for b in range(n_batch):
        start[b] = load_length(lengths, b)
        if start[b] < 0 or start[b] > max_keys - n_new:
            free(start)
            return None
    for e in range(n_batch * entries_per_sequence):
        entry_lengths[e] = start[e // entries_per_sequence] + n_new

    # every check has passed: append, advance the lengths, then attend
    cdef Problem pb
    cdef intp_t *index
    if appending:
        append_rows(kc, k_rows, start)
        append_rows(vc, v_rows, start)
        store_lengths(lengths, start, n_new)
    try:
        index = problem_from_arrays(&pb, q_view, k_view, v_view, None, None, None,
                                    n_batch_dims, shape, causal, scale_value)
        set_row_options(&pb, None, -1, -1, 0)
        if query_period > 0:
            pb.query_period = query_period
        set_kv_lengths(&pb, entry_lengths, index)
        run_then_free(&pb, index, threads, out, None)
    except BaseException:
        # the computation failed (its memory): the new rows are given back,
        # their slots free again past the lengths
        if appending:
            store_lengths(lengths, start, 0)
        free(start)
        raise
    free(start)
    return out


cdef inline intp_t table_entry(cnp.ndarray table, Py_ssize_t s, Py_ssize_t slot) noexcept:
    """block_table[s, slot] of an aligned int64 or int32 table."""
    cdef char *at = (<char *>cnp.PyArray_DATA(table) + s * cnp.PyArray_STRIDE(table, 0)
                     + slot * cnp.PyArray_STRIDE(table, 1))
    if cnp.PyArray_TYPE(table) == cnp.NPY_INT64:
        return (<long long *>at)[0]
    return (<int *>at)[0]


cdef inline void append_to_pages(cnp.ndarray pages, cnp.ndarray rows, const intp_t *table,
                                 Py_ssize_t max_pages, const intp_t *start) noexcept:
    """pages[p, h, r, :] = rows[s, h, t, :] for every (s, h, t), where
    position start[s] + t of sequence s is row r of page p (the table's):
    arrays of one dtype, apart, every page id in range."""
    cdef Py_ssize_t itemsize = cnp.PyArray_ITEMSIZE(pages)
    cdef Py_ssize_t page_size = cnp.PyArray_DIM(pages, 2)
    cdef Py_ssize_t n_features = cnp.PyArray_DIM(rows, 3)
    cdef char *pages_data = <char *>cnp.PyArray_DATA(pages)
    cdef char *rows_data = <char *>cnp.PyArray_DATA(rows)
    cdef Py_ssize_t page_col = cnp.PyArray_STRIDE(pages, 3)
    cdef Py_ssize_t rows_col = cnp.PyArray_STRIDE(rows, 3)
    cdef Py_ssize_t s, h, t, i, position, page
    cdef char *dst
    cdef char *src
    for s in range(cnp.PyArray_DIM(rows, 0)):
        for t in range(cnp.PyArray_DIM(rows, 2)):
            position = start[s] + t
            page = table[s * max_pages + position // page_size]
            for h in range(cnp.PyArray_DIM(rows, 1)):
                dst = (pages_data + page * cnp.PyArray_STRIDE(pages, 0)
                       + h * cnp.PyArray_STRIDE(pages, 1)
                       + (position % page_size) * cnp.PyArray_STRIDE(pages, 2))
                src = (rows_data + s * cnp.PyArray_STRIDE(rows, 0)
                       + h * cnp.PyArray_STRIDE(rows, 1) + t * cnp.PyArray_STRIDE(rows, 2))
                if page_col == itemsize and rows_col == itemsize:
                    memcpy(dst, src, n_features * itemsize)
                else:
                    for i in range(n_features):
                        memcpy(dst + i * page_col, src + i * rows_col, itemsize)


def paged_fast(object q, object k_pages, object v_pages, object block_table,
               object cache_lengths, object k_new, object v_new, object causal_flag, object scale,
               object num_threads, object thread_limit):
    """``attention_with_paged_kvcache`` for the common serving call with no
    Python-level overhead, or None when the general path (``_paged.py``)
    must handle it. None is returned before anything is written.

    Common: ndarrays; q float32 or float64 of shape (B, H, T, d_k) (no
    cu_seqlens_q), pages of q's dtype (or float16 with a float32 q) of shape
    (n_pages, H_kv, page_size, d), H a multiple of H_kv, all sizes nonzero,
    aligned, native, element-multiple strides; block_table int64 or int32 of
    shape (B, max_pages); cache_lengths int32 or int64 of shape (B,); k_new
    and v_new None or of the pages' dtype; causal a bool; every array the call writes
    certainly apart from every other one it touches; each sequence's new
    rows within its table, every page it reads a page id, and every page it
    writes to listed once in the whole table's used entries (a page shared
    for a common prefix is read by several sequences, written by none);
    scale and num_threads of plain types in range. Anything else, including
    every error, goes to the general path. The entry table is the one
    ``_entries.plan`` builds for the same call (one table: every sequence
    has T rows), so the bits are the same."""
    cdef int page_type = 0   # set by step_types
    cdef int q_type = step_types(q, k_pages, v_pages, cache_lengths, k_new, v_new, &page_type)
    if q_type < 0 or type(block_table) is not cnp.ndarray or not plain_flag(causal_flag):
        return None
    cdef bint causal = causal_flag is True
    cdef bint appending = k_new is not None
    cdef cnp.ndarray qa = <cnp.ndarray>q
    cdef cnp.ndarray kp = <cnp.ndarray>k_pages
    cdef cnp.ndarray vp = <cnp.ndarray>v_pages
    cdef cnp.ndarray table = <cnp.ndarray>block_table
    cdef cnp.ndarray lengths = <cnp.ndarray>cache_lengths
    cdef cnp.ndarray kn = <cnp.ndarray>k_new if appending else None
    cdef cnp.ndarray vn = <cnp.ndarray>v_new if appending else None
    if (cnp.PyArray_NDIM(qa) != 4 or cnp.PyArray_NDIM(kp) != 4 or cnp.PyArray_NDIM(vp) != 4
            or cnp.PyArray_NDIM(table) != 2 or cnp.PyArray_NDIM(lengths) != 1):
        return None
    if not (usable_input(qa, q_type) and usable_input(kp, page_type)
            and usable_input(vp, page_type)
            and (usable_input(table, cnp.NPY_INT64) or usable_input(table, cnp.NPY_INT32))):
        return None
    cdef Py_ssize_t n_pages = cnp.PyArray_DIM(kp, 0)
    cdef Py_ssize_t n_kv_heads = cnp.PyArray_DIM(kp, 1)
    cdef Py_ssize_t page_size = cnp.PyArray_DIM(kp, 2)
    cdef Py_ssize_t d_k = cnp.PyArray_DIM(kp, 3)
    cdef Py_ssize_t d_v = cnp.PyArray_DIM(vp, 3)
    cdef Py_ssize_t n_seq = cnp.PyArray_DIM(table, 0)
    cdef Py_ssize_t max_pages = cnp.PyArray_DIM(table, 1)
    cdef Py_ssize_t n_heads = cnp.PyArray_DIM(qa, 1)
    cdef Py_ssize_t n_queries = cnp.PyArray_DIM(qa, 2)
    if (cnp.PyArray_DIM(vp, 0) != n_pages or cnp.PyArray_DIM(vp, 1) != n_kv_heads
            or cnp.PyArray_DIM(vp, 2) != page_size or cnp.PyArray_DIM(qa, 0) != n_seq
            or cnp.PyArray_DIM(qa, 3) != d_k or cnp.PyArray_DIM(lengths, 0) != n_seq):
        return None
    if (n_pages == 0 or n_kv_heads == 0 or page_size == 0 or d_k == 0 or d_v == 0
            or n_seq == 0 or max_pages == 0 or n_heads == 0 or n_queries == 0
            or n_heads % n_kv_heads != 0):
        return None
    # positions a sequence can hold; int32 lengths must hold every one
    if <double>max_pages * page_size > 4.0e18:
        return None
    cdef Py_ssize_t capacity = max_pages * page_size
    if not (usable_input(lengths, cnp.NPY_INT64)
            or (usable_input(lengths, cnp.NPY_INT32) and capacity <= 2147483647)):
        return None
    cdef Py_ssize_t n_new = 0
    if appending:
        if cnp.PyArray_NDIM(kn) != 4 or cnp.PyArray_NDIM(vn) != 4:
            return None
        n_new = n_queries
        if (cnp.PyArray_DIM(kn, 0) != n_seq or cnp.PyArray_DIM(vn, 0) != n_seq
                or cnp.PyArray_DIM(kn, 1) != n_kv_heads or cnp.PyArray_DIM(vn, 1) != n_kv_heads
                or cnp.PyArray_DIM(kn, 2) != n_new or cnp.PyArray_DIM(vn, 2) != n_new
                or cnp.PyArray_DIM(kn, 3) != d_k or cnp.PyArray_DIM(vn, 3) != d_v):
            return None
        if not (usable_input(kn, page_type) and usable_input(vn, page_type)):
            return None
        if not (writes_apart(kp, vp, lengths, qa, kn, vn)
                and apart(kp, table) and apart(vp, table) and apart(lengths, table)):
            return None

    cdef double scale_value = 0   # set by plain_scale
    cdef Py_ssize_t threads = plain_threads(num_threads, thread_limit)
    if not plain_scale(scale, d_k, q_type == cnp.NPY_FLOAT32, &scale_value) or threads == 0:
        return None
    cdef Py_ssize_t itemsize = cnp.PyArray_ITEMSIZE(qa)
    # an output no array can hold: the general path names it
    if <double>n_seq * n_heads * n_queries * d_v * itemsize >= 9.2e18:
        return None

    # the entries of _entries.plan: with one new row per sequence and
    # grouped heads, one per (sequence, K/V head), its query heads stacked
    # as rows; otherwise one per (sequence, query head)
    cdef Py_ssize_t group = n_heads // n_kv_heads
    cdef bint stacked = n_queries == 1 and 1 < group <= DIRECT_ROWS
    cdef Py_ssize_t n_entries = n_seq * (n_kv_heads if stacked else n_heads)
    # one buffer: the table as intp, the old and new lengths, then the
    # entry arrays (q_offset, k_offset, v_offset, kv_index, kv_length,
    # out_offset, page_first, q_rows)
    cdef intp_t *table_copy = <intp_t *>malloc(
        (n_seq * max_pages + 2 * n_seq + 8 * n_entries) * sizeof(intp_t))
    if table_copy == NULL:
        return None
    cdef intp_t *start = table_copy + n_seq * max_pages
    cdef intp_t *new_length = start + n_seq
    cdef intp_t *q_offset = new_length + n_seq
    cdef intp_t *k_offset = q_offset + n_entries
    cdef intp_t *v_offset = k_offset + n_entries
    cdef intp_t *kv_index = v_offset + n_entries
    cdef intp_t *kv_length = kv_index + n_entries
    cdef intp_t *out_offset = kv_length + n_entries
    cdef intp_t *page_first = out_offset + n_entries
    cdef intp_t *q_rows = page_first + n_entries
    cdef unsigned char *page_uses = NULL
    cdef Py_ssize_t s, slot, page, e, h, kv_head
    cdef Py_ssize_t n_keys = 0
    cdef bint declined = False
    for s in range(n_seq):
        for slot in range(max_pages):
            table_copy[s * max_pages + slot] = table_entry(table, s, slot)
        start[s] = load_length(lengths, s)
        if start[s] < 0 or start[s] > capacity - n_new:
            declined = True
            break
        new_length[s] = start[s] + n_new
        if new_length[s] > n_keys:
            n_keys = new_length[s]
        # every page the sequence reads is a page id
        for slot in range((new_length[s] + page_size - 1) // page_size):
            page = table_copy[s * max_pages + slot]
            if page < 0 or page >= n_pages:
                declined = True
                break
        if declined:
            break
    if appending and not declined:
        # each page a sequence writes to is used once, by that sequence's
        # slot: then no new row lands on a row some sequence holds, and no
        # two land on one row. (A page written to and used twice is always
        # one or the other: the general path's to refuse.)
        page_uses = <unsigned char *>calloc(n_pages, 1)
        if page_uses == NULL:
            declined = True
        else:
            for s in range(n_seq):
                for slot in range(start[s] // page_size, (new_length[s] - 1) // page_size + 1):
                    page_uses[table_copy[s * max_pages + slot]] = 1
            for s in range(n_seq):
                for slot in range((new_length[s] + page_size - 1) // page_size):
                    page = table_copy[s * max_pages + slot]
                    if page_uses[page] == 2:
                        declined = True
                        break
                    if page_uses[page] == 1:
                        page_uses[page] = 2
                if declined:
                    break
            free(page_uses)
    if declined:
        free(table_copy)
        return None

    cdef Py_ssize_t q_seq = cnp.PyArray_STRIDE(qa, 0) // itemsize
    cdef Py_ssize_t q_head = cnp.PyArray_STRIDE(qa, 1) // itemsize
    cdef Py_ssize_t page_itemsize = cnp.PyArray_ITEMSIZE(kp)
    cdef Py_ssize_t k_head = cnp.PyArray_STRIDE(kp, 1) // page_itemsize
    cdef Py_ssize_t v_head = cnp.PyArray_STRIDE(vp, 1) // page_itemsize
    cdef Py_ssize_t out_seq = n_heads * n_queries * d_v
    cdef Py_ssize_t out_head = n_queries * d_v
    cdef EntryTable t
    cdef RowsSpec q_spec, k_spec, v_spec
    for s in range(n_seq):
        for h in range(n_entries // n_seq):
            e = s * (n_entries // n_seq) + h
            # h is a K/V head when stacked, else a query head
            kv_head = h if stacked else h // group
            q_offset[e] = s * q_seq + (h * group if stacked else h) * q_head
            out_offset[e] = s * out_seq + (h * group if stacked else h) * out_head
            kv_index[e] = e if stacked else s * n_kv_heads + kv_head
            kv_length[e] = new_length[s]
            k_offset[e] = kv_head * k_head
            v_offset[e] = kv_head * v_head
            page_first[e] = s * max_pages
            q_rows[e] = n_queries
    t.n_entries = n_entries
    t.n_queries = group if stacked else n_queries
    t.n_keys = n_keys
    t.d_k = d_k
    t.d_v = d_v
    t.n_kv = n_entries if stacked else n_seq * n_kv_heads
    t.q_offset = q_offset
    t.k_offset = k_offset
    t.v_offset = v_offset
    t.kv_index = kv_index
    t.kv_length = kv_length
    t.out_offset = out_offset
    t.q_rows = NULL if stacked else q_rows
    t.lse_offset = NULL
    t.ld_out = out_head if stacked else d_v
    t.ld_lse = 1
    t.query_period = 1 if stacked else 0
    t.page_ids = table_copy
    t.page_first = page_first
    t.page_size = page_size
    q_spec.data = <const char *>cnp.PyArray_DATA(qa)
    q_spec.type_num = q_type
    q_spec.row_stride = q_head if stacked else cnp.PyArray_STRIDE(qa, 2) // itemsize
    q_spec.col_stride = cnp.PyArray_STRIDE(qa, 3) // itemsize
    q_spec.page_stride = 0
    q_spec.scale = NULL
    q_spec.scale_offset = NULL
    q_spec.scale_stride = 0
    q_spec.scale_page_stride = 0
    k_spec = q_spec
    k_spec.data = <const char *>cnp.PyArray_DATA(kp)
    k_spec.type_num = page_type
    k_spec.row_stride = cnp.PyArray_STRIDE(kp, 2) // page_itemsize
    k_spec.col_stride = cnp.PyArray_STRIDE(kp, 3) // page_itemsize
    k_spec.page_stride = cnp.PyArray_STRIDE(kp, 0) // page_itemsize
    v_spec = k_spec
    v_spec.data = <const char *>cnp.PyArray_DATA(vp)
    v_spec.row_stride = cnp.PyArray_STRIDE(vp, 2) // page_itemsize
    v_spec.col_stride = cnp.PyArray_STRIDE(vp, 3) // page_itemsize
    v_spec.page_stride = cnp.PyArray_STRIDE(vp, 0) // page_itemsize
    cdef cnp.ndarray out
    try:
        out = np.empty((n_seq, n_heads, n_queries, d_v), dtype=qa.dtype)
    except BaseException:
        free(table_copy)
        raise

    # every check has passed: append, advance the lengths, then attend
    cdef Problem pb
    cdef intp_t *index
    if appending:
        append_to_pages(kp, kn, table_copy, max_pages, start)
        append_to_pages(vp, vn, table_copy, max_pages, start)
        store_lengths(lengths, start, n_new)
    try:
        index = problem_from_table(&pb, &t, &q_spec, &k_spec, &v_spec, causal, scale_value)
        if index == NULL:
            raise MemoryError("cattention: could not allocate scratch memory")
        set_row_options(&pb, None, -1, -1, 0)
        run_then_free(&pb, index, threads, out, None)
    except BaseException:
        # the computation failed (its memory): the new rows are given back,
        # their slots free again past the lengths
        if appending:
            store_lengths(lengths, start, 0)
        free(table_copy)
        raise
    free(table_copy)
    return out
