# cython: language_level=3, boundscheck=False, wraparound=False
# cython: cdivision=True, initializedcheck=False
"""The compiled shortcut of each layout (dense, contiguous KV cache, paged
KV cache): the one place that decides whether a call is the common case,
and for it does what the general path (``_prepare``) would, with no Python
in between. A shortcut accepts, it never refuses: an array of another
kind, another layout or a value the general path must look at returns None
before anything is written, and the general path then checks and runs the
call. The options a shortcut takes are checked by the general path's own
checks (checks.pxd); the Problem and the entry tables are built by the same
builders (from_arrays.pxd, from_entries.pxd), and new rows written by the
same appends (appends.pxd), so a call gives the same bits either way."""

cimport numpy as cnp
from libc.stdlib cimport calloc, free, malloc
from cattention._driver.kernel_table cimport ca_kernels, intp_t
from cattention._driver.accepts cimport (
    apart, are_ndarrays, compute_type, entry_positions, entry_reals, half_holds,
    new_rows_shaped, out_usable, output_fits, plain_lengths, serving_step_arrays,
    serving_step_dtypes, step_arrays_fit, usable_input, writes_apart)
from cattention._driver.problem cimport (
    Problem, Rotary, RowOptions, direct_rows, plain_row_options)
from cattention._driver.checks cimport (
    check_alibi_slopes, check_flag, check_key_positions, check_scale, check_sinks,
    check_precision, check_softcap, check_window, resolve_threads)
from cattention._driver.from_arrays cimport problem_from_arrays, set_kv_lengths
from cattention._driver.from_entries cimport EntryPlan, Place, stacks_grouped_rows
from cattention._driver.appends cimport (
    CacheRows, NewRows, append_rows, cache_rows_of, load_length, new_rows_of, store_lengths)
from cattention._driver.rotary cimport rotary_step_usable, rotated_new_rows, step_rotary
from cattention._driver.runs cimport run_dense, run_plan, run_then_free
from cattention._driver.results cimport rounded_to_bfloat16


cdef inline cnp.ndarray np_empty4(Py_ssize_t n0, Py_ssize_t n1, Py_ssize_t n2, Py_ssize_t n3,
                                  int type_num):
    """An uninitialised C-contiguous 4-D output."""
    cdef cnp.npy_intp dims[4]
    dims[0], dims[1], dims[2], dims[3] = n0, n1, n2, n3
    return cnp.PyArray_EMPTY(4, dims, type_num, 0)


# ------------------------------------------------------------------ dense

cdef inline object view_as(object arr, tuple shape):
    """A view of arr (of arr.size elements) in the given shape, or None
    where its strides have no view of that shape (a reshape would copy):
    reshape(copy=False) on NumPy 2.1 and later; setting the shape of a view
    before (NumPy 2.5 deprecates that). _prepare.arrays.view_as calls it
    (extension.view_as)."""
    try:
        return arr.reshape(shape, copy=False)
    except ValueError:
        return None
    except TypeError:
        pass  # NumPy before 2.1: reshape takes no copy=
    view = arr.view()
    try:
        view.shape = shape
    except AttributeError:
        return None
    return view


cdef struct EntryOptions:
    # the per-entry options of a dense call, one value per batch entry of
    # q's batch (NULL: not given), in one allocation (storage)
    intp_t *lengths
    intp_t *starts
    double *slopes
    double *sinks
    bint alike                   # lengths and starts alike within a group of
                                 # query heads (as the general path tells it)
    void *storage


cdef inline bint grouped_alike(cnp.ndarray given, Py_ssize_t n_batch_dims) noexcept:
    """kv_lengths or kv_starts that cannot differ within a group of query
    heads (the general path's test, on the array as given): a 0-d array,
    a last axis of 1, or a 1-D array the general path reads per sequence."""
    cdef int ndim = cnp.PyArray_NDIM(given)
    return (ndim == 0 or cnp.PyArray_DIM(given, ndim - 1) == 1
            or (ndim == 1 and n_batch_dims >= 2))


cdef inline int gather_entry_options(EntryOptions *opts, Py_ssize_t n_batch_dims,
                                     const Py_ssize_t *batch_shape, Py_ssize_t n_keys,
                                     object kv_lengths, object kv_starts, object alibi_slopes,
                                     object sinks, bint in_float32, RowOptions *row) except -1:
    """The per-entry options of a dense call (entry_positions, entry_reals),
    checked by checks.pxd's checks, into opts and row. 1 when the call is a
    shortcut's to run (the caller then frees opts.storage), 0 when an array
    is of another kind (nothing to free)."""
    cdef Py_ssize_t n_batch = 1
    cdef Py_ssize_t d
    for d in range(n_batch_dims):
        n_batch *= batch_shape[d]
    cdef char *values = <char *>malloc(5 * (n_batch if n_batch > 0 else 1) * sizeof(double))
    if values == NULL:
        return 0
    opts.storage = values
    opts.lengths = opts.starts = NULL
    opts.slopes = opts.sinks = NULL
    opts.alike = True
    cdef intp_t *scratch = <intp_t *>(values + 4 * n_batch * sizeof(double))
    cdef bint taken = False
    try:
        if kv_lengths is not None:
            opts.lengths = <intp_t *>values
            if not entry_positions(kv_lengths, n_batch_dims, batch_shape, opts.lengths):
                return 0
            check_key_positions(opts.lengths, n_batch, n_keys, "kv_lengths")
            opts.alike = grouped_alike(<cnp.ndarray>kv_lengths, n_batch_dims)
        if kv_starts is not None:
            opts.starts = <intp_t *>(values + n_batch * sizeof(double))
            if not entry_positions(kv_starts, n_batch_dims, batch_shape, opts.starts):
                return 0
            check_key_positions(opts.starts, n_batch, n_keys, "kv_starts")
            opts.alike = opts.alike and grouped_alike(<cnp.ndarray>kv_starts, n_batch_dims)
        if alibi_slopes is not None:
            opts.slopes = <double *>(values + 2 * n_batch * sizeof(double))
            if not entry_reals(alibi_slopes, n_batch_dims, batch_shape, scratch, opts.slopes):
                return 0
            check_alibi_slopes(opts.slopes, n_batch, in_float32)
            row.alibi_slope = opts.slopes
        if sinks is not None:
            opts.sinks = <double *>(values + 3 * n_batch * sizeof(double))
            if not entry_reals(sinks, n_batch_dims, batch_shape, scratch, opts.sinks):
                return 0
            check_sinks(opts.sinks, n_batch, in_float32)
            row.sink = opts.sinks
        taken = True
    finally:
        if not taken:
            free(values)
    return 1


cdef inline object run_dense_call(
        const ca_kernels *kern, cnp.ndarray qa, cnp.ndarray ka, cnp.ndarray va,
        Py_ssize_t n_batch_dims, Py_ssize_t *shape, Py_ssize_t group, EntryOptions *opts,
        RowOptions *row, Py_ssize_t threads, object out_arg, bint return_scores,
        bint return_lse, int type_num, int compute):
    """The run of a dense call a shortcut takes, and its results as
    ``attention`` returns them: q (..., H, T, d_k), K and V with H / group
    heads, the batch in shape[:n_batch_dims] (shape has two more slots),
    the per-entry options in opts and row, out_arg None or an array
    out_usable accepted."""
    cdef Py_ssize_t n_queries = cnp.PyArray_DIM(qa, n_batch_dims)
    cdef Py_ssize_t d_k = cnp.PyArray_DIM(qa, n_batch_dims + 1)
    cdef Py_ssize_t n_keys = cnp.PyArray_DIM(ka, n_batch_dims)
    cdef Py_ssize_t d_v = cnp.PyArray_DIM(va, n_batch_dims + 1)
    cdef int ndim = <int>n_batch_dims + 2
    cdef Py_ssize_t n_batch = 1
    cdef Py_ssize_t d, e
    for d in range(n_batch_dims):
        n_batch *= shape[d]
    cdef cnp.ndarray attn, written
    cdef object stacked
    cdef cnp.ndarray scores = None
    cdef cnp.ndarray lse = None
    cdef cnp.ndarray aside = None
    cdef Py_ssize_t query_period = 0
    cdef bint stacks = stacks_grouped_rows(group, n_queries, False) and opts.alike
    # bfloat16 in, without SCORES, on the packed path: the driver rounds each
    # block of rows into a bfloat16 ATTN as it finishes them (no float32 ATTN)
    cdef bint rounds_rows = (type_num != compute and not return_scores and not stacks
                             and not direct_rows(n_queries))
    # ATTN lands in the caller's out= when it takes the compute dtype (or the
    # driver rounds into it), else in a new array (rounded into out= at the
    # end)
    shape[ndim - 2] = n_queries
    shape[ndim - 1] = d_v
    if out_arg is not None and (type_num == compute or rounds_rows):
        attn = <cnp.ndarray>out_arg
    else:
        attn = cnp.PyArray_EMPTY(ndim, <cnp.npy_intp *>shape,
                                 type_num if rounds_rows else compute, 0)
    if return_scores:
        shape[ndim - 1] = n_keys
        scores = cnp.PyArray_EMPTY(ndim, <cnp.npy_intp *>shape, compute, 0)
    if return_lse:
        lse = cnp.PyArray_EMPTY(ndim - 1, <cnp.npy_intp *>shape, compute, 0)
    written = attn
    if stacks:
        # a decode step: the G query heads' rows stacked as their K/V head's
        # rows (C-contiguous outputs are the same memory either way; an out=
        # of other strides is viewed so where it can be, else ATTN is written
        # aside and copied in); lengths and starts one per K/V head
        qa = qa.reshape((<object>qa).shape[:ndim - 3]
                        + (shape[ndim - 3] // group, group * n_queries, d_k))
        if not cnp.PyArray_IS_C_CONTIGUOUS(attn):
            stacked = view_as(attn, (<object>qa).shape[:ndim - 1] + (d_v,))
            if stacked is not None:
                written = <cnp.ndarray>stacked
            else:
                aside = cnp.PyArray_EMPTY(ndim, cnp.PyArray_DIMS(attn), compute, 0)
                written = aside
        shape[ndim - 3] //= group
        n_batch //= group
        for e in range(n_batch):
            if opts.lengths != NULL:
                opts.lengths[e] = opts.lengths[e * group]
            if opts.starts != NULL:
                opts.starts[e] = opts.starts[e * group]
        query_period = n_queries
        group = 1
    run_dense(qa, ka, va, None, None, None, n_batch_dims, shape, group, query_period,
              opts.lengths, opts.starts, row, kern, threads, written, scores, lse)
    if aside is not None:
        cnp.PyArray_CopyInto(attn, aside)
    if out_arg is not None:
        if type_num != compute and not rounds_rows:
            # bfloat16: rounded once into out=
            rounded_to_bfloat16(attn, out_arg)
        attn = <cnp.ndarray>out_arg
    elif type_num != compute and not rounds_rows:
        # bfloat16 in: the results rounded once to it
        attn = rounded_to_bfloat16(attn, None)
    if return_scores and type_num != compute:
        scores = rounded_to_bfloat16(scores, None)
    if return_scores and return_lse:
        return attn, scores, lse
    if return_scores:
        return attn, scores
    if return_lse:
        return attn, lse
    return attn


cdef inline object attention_shortcut(
        const ca_kernels *kern, object q, object k, object v, object causal_flag, object mask,
        object scale, object scores_flag, object lse_flag, object gqa_flag, object kv_lengths,
        object window, object softcap, object alibi_slopes, object sinks, object k_scale,
        object v_scale, object kv_starts, object out_arg, object num_threads,
        object thread_limit, object precision):
    """``attention`` for ndarrays q, k, v of one dtype (float32, float64 or
    bfloat16) and one ndim, with equal leading dimensions (or, under
    enable_gqa, H_kv heads on axis -3 dividing q's H), aligned, native,
    element-multiple strides, nonempty; no mask and no int8 scales;
    kv_lengths and kv_starts int32 or int64 ndarrays, alibi_slopes and
    sinks float32 or float64 ndarrays, each broadcasting to the batch as
    the general path reads it (entry_positions, entry_reals); out an
    ndarray it writes (out_usable) apart from k and v. Else None."""
    if mask is not None or k_scale is not None or v_scale is not None:
        return None
    cdef bint causal = check_flag(causal_flag, "causal")
    cdef bint return_scores = check_flag(scores_flag, "return_scores")
    cdef bint return_lse = check_flag(lse_flag, "return_lse")
    cdef bint grouped = check_flag(gqa_flag, "enable_gqa")
    if not are_ndarrays(q, k, v):
        return None
    cdef cnp.ndarray qa = <cnp.ndarray>q
    cdef cnp.ndarray ka = <cnp.ndarray>k
    cdef cnp.ndarray va = <cnp.ndarray>v
    cdef int type_num = cnp.PyArray_TYPE(qa)
    cdef int compute = compute_type(type_num)
    cdef int ndim = cnp.PyArray_NDIM(qa)
    cdef int d
    cdef Py_ssize_t n_batch = 1
    cdef Py_ssize_t shape[64]
    if compute < 0:
        return None
    if (ndim < (3 if grouped else 2) or cnp.PyArray_NDIM(ka) != ndim
            or cnp.PyArray_NDIM(va) != ndim):
        return None
    if not (usable_input(qa, type_num) and usable_input(ka, type_num)
            and usable_input(va, type_num)):
        return None
    cdef Py_ssize_t group = 1
    cdef Py_ssize_t n_kv_heads
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
    if not output_fits(<double>n_batch * n_queries
                       * (n_keys if return_scores and n_keys > d_v else d_v),
                       8 if compute == cnp.NPY_FLOAT64 else 4):
        return None
    if out_arg is not None and not (out_usable(out_arg, qa, d_v, type_num)
                                    and apart(<cnp.ndarray>out_arg, ka)
                                    and apart(<cnp.ndarray>out_arg, va)):
        return None
    cdef bint in_float32 = compute == cnp.NPY_FLOAT32
    cdef RowOptions row
    plain_row_options(&row, causal, check_scale(scale, d_k, in_float32))
    check_window(window, causal, &row.window_left, &row.window_right)
    row.softcap = check_softcap(softcap, in_float32)
    row.precision = check_precision(precision, type_num != compute)
    cdef Py_ssize_t threads = resolve_threads(num_threads, thread_limit)
    cdef EntryOptions opts
    if not gather_entry_options(&opts, ndim - 2, shape, n_keys, kv_lengths, kv_starts,
                                alibi_slopes, sinks, in_float32, &row):
        return None
    try:
        return run_dense_call(kern, qa, ka, va, ndim - 2, shape, group, &opts, &row, threads,
                              out_arg, return_scores, return_lse, type_num, compute)
    finally:
        free(opts.storage)


# ----------------------------------------------------- contiguous KV cache

cdef inline object kvcache_shortcut(
        const ca_kernels *kern, object q, object k_cache, object v_cache, object cache_lengths,
        object k_new, object v_new, object causal_flag, object scale, object gqa_flag,
        object window, object softcap, object alibi_slopes, object sinks, object k_scale,
        object v_scale, object kv_starts, object out_arg, object lse_flag, object num_threads,
        object thread_limit, object rotary_cos, object rotary_sin, object interleaved_flag,
        object precision):
    """``attention_with_kvcache`` for a serving step of float caches: q
    float32, float64 or bfloat16 of shape (B, H, T, d_k), caches of q's
    dtype (or float16 or bfloat16 beside a float32 q) of shape (B, H_kv,
    S_max, d), H a multiple of H_kv, all sizes nonzero, aligned, native,
    element-multiple strides; cache_lengths int32 or int64 of shape (B,);
    k_new and v_new None or of the cache dtype (float32 into a float16
    cache: converted, no value beyond its range); every array the call
    writes certainly apart from every other one it touches, the new rows
    within S_max; no int8 scales; kv_starts an int32 or int64 ndarray (B,),
    alibi_slopes and sinks float32 or float64 ndarrays of shape (H,) or (B,
    H); out an ndarray it writes (out_usable) apart from the caches and
    lengths; rotary tables the step reads in place (rotary.pxd: q and new
    rows of the compute type, every position within the tables). Else
    None, before anything is written."""
    if k_scale is not None or v_scale is not None:
        return None
    if (not serving_step_arrays(q, k_cache, v_cache, cache_lengths, k_new, v_new)
            or not (causal_flag is True or causal_flag is False)
            or not (lse_flag is True or lse_flag is False)):
        return None
    cdef int q_type = cnp.PyArray_TYPE(<cnp.ndarray>q)
    cdef int cache_type = cnp.PyArray_TYPE(<cnp.ndarray>k_cache)
    if not serving_step_dtypes(q_type, cache_type):
        return None
    if gqa_flag is not None and gqa_flag is not True:
        return None
    cdef bint causal = causal_flag is True
    cdef bint appending = k_new is not None
    cdef cnp.ndarray qa = <cnp.ndarray>q
    cdef cnp.ndarray kc = <cnp.ndarray>k_cache
    cdef cnp.ndarray vc = <cnp.ndarray>v_cache
    cdef cnp.ndarray lengths = <cnp.ndarray>cache_lengths
    cdef cnp.ndarray kn = <cnp.ndarray>k_new if appending else None
    cdef cnp.ndarray vn = <cnp.ndarray>v_new if appending else None
    if not step_arrays_fit(qa, kc, vc, lengths, -1, q_type, cache_type):
        return None
    cdef Py_ssize_t n_batch = cnp.PyArray_DIM(kc, 0)
    cdef Py_ssize_t n_kv_heads = cnp.PyArray_DIM(kc, 1)
    cdef Py_ssize_t max_keys = cnp.PyArray_DIM(kc, 2)
    cdef Py_ssize_t d_k = cnp.PyArray_DIM(kc, 3)
    cdef Py_ssize_t d_v = cnp.PyArray_DIM(vc, 3)
    cdef Py_ssize_t n_heads = cnp.PyArray_DIM(qa, 1)
    cdef Py_ssize_t n_queries = cnp.PyArray_DIM(qa, 2)
    if not plain_lengths(lengths, max_keys):
        return None
    cdef Py_ssize_t n_new = 0
    if appending:
        if not new_rows_shaped(kn, vn, n_batch, n_kv_heads, d_k, d_v):
            return None
        n_new = cnp.PyArray_DIM(kn, 2)
        if n_new == 0 or not writes_apart(kc, vc, lengths, qa, kn, vn):
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
    if not output_fits(<double>n_batch * n_heads * n_queries * d_v, cnp.PyArray_ITEMSIZE(qa)):
        return None
    if out_arg is not None and not (out_usable(out_arg, qa, d_v, q_type)
                                    and apart(<cnp.ndarray>out_arg, kc)
                                    and apart(<cnp.ndarray>out_arg, vc)
                                    and apart(<cnp.ndarray>out_arg, lengths)
                                    and (not appending
                                         or (apart(<cnp.ndarray>out_arg, kn)
                                             and apart(<cnp.ndarray>out_arg, vn)))):
        return None
    if kv_starts is not None and not (type(kv_starts) is cnp.ndarray
                                      and cnp.PyArray_NDIM(<cnp.ndarray>kv_starts) == 1):
        return None
    cdef int compute = compute_type(q_type)
    cdef bint in_float32 = compute == cnp.NPY_FLOAT32
    cdef bint rotating = not (rotary_cos is None and rotary_sin is None
                              and interleaved_flag is False)
    if rotating and not rotary_step_usable(qa, kn, rotary_cos, rotary_sin, interleaved_flag,
                                           compute, d_k):
        return None
    cdef RowOptions row
    plain_row_options(&row, causal, check_scale(scale, d_k, in_float32))
    check_window(window, causal, &row.window_left, &row.window_right)
    row.softcap = check_softcap(softcap, in_float32)
    # a 16-bit q with caches of its dtype gives its dtype
    row.precision = check_precision(precision, q_type != compute)
    cdef Py_ssize_t threads = resolve_threads(num_threads, thread_limit)

    # everything that may decline comes before the append: the new keys
    # rotated (q is rotated as it is read), the per-entry options (the
    # lengths after the append are filled in below), float32 rows for a
    # float16 cache converted as the general path converts them
    cdef Rotary rotary
    if rotating:
        if not step_rotary(&rotary, rotary_cos, rotary_sin, interleaved_flag, lengths, n_batch,
                           n_queries, n_new):
            return None
        if appending:
            kn = rotated_new_rows(kn, &rotary, lengths)
            if kn is None:
                return None
        row.rotary = &rotary
    cdef Py_ssize_t shape[4]
    shape[0] = n_batch
    shape[1] = n_heads
    cdef EntryOptions opts
    if not gather_entry_options(&opts, 2, shape, max_keys, None, kv_starts, alibi_slopes,
                                sinks, in_float32, &row):
        return None
    cdef cnp.ndarray k_rows = kn
    cdef cnp.ndarray v_rows = vn
    if appending and cache_type != cnp.PyArray_TYPE(kn):
        if not (half_holds(kn) and half_holds(vn)):
            free(opts.storage)
            return None
        k_rows = cnp.PyArray_Cast(kn, cnp.NPY_FLOAT16)
        v_rows = cnp.PyArray_Cast(vn, cnp.NPY_FLOAT16)

    # the lengths before the call, each leaving room for the new rows, the
    # new rows' places, and the lengths after it of each batch entry (the
    # lengths' slot of opts)
    cdef intp_t *start = <intp_t *>malloc(3 * n_batch * sizeof(intp_t))
    if start == NULL:
        free(opts.storage)
        return None
    cdef intp_t *n_new_of = start + n_batch
    cdef intp_t *seq_offset = start + 2 * n_batch
    opts.lengths = <intp_t *>opts.storage
    cdef Py_ssize_t b, e
    for b in range(n_batch):
        start[b] = load_length(lengths, b)
        n_new_of[b] = n_new
        if start[b] < 0 or start[b] > max_keys - n_new:
            free(start)
            free(opts.storage)
            return None
    for e in range(n_batch * n_heads):
        opts.lengths[e] = start[e // n_heads] + n_new

    # every check has passed: append, advance the lengths, then attend
    cdef CacheRows cache
    cdef NewRows rows
    cdef int k_or_v
    if appending:
        for k_or_v in range(2):
            cache_rows_of(&cache, kc if k_or_v == 0 else vc, NULL, 0)
            new_rows_of(&rows, k_rows if k_or_v == 0 else v_rows, seq_offset)
            append_rows(&cache, &rows, start, n_new_of, n_batch, n_kv_heads,
                        d_k if k_or_v == 0 else d_v)
        store_lengths(lengths, start, n_new)
    try:
        return run_dense_call(kern, qa, kc, vc, 2, shape, n_heads // n_kv_heads, &opts, &row,
                              threads, out_arg, False, lse_flag is True, q_type, compute)
    except BaseException:
        # the computation failed (its memory): the new rows are given back,
        # their slots free again past the lengths
        if appending:
            store_lengths(lengths, start, 0)
        raise
    finally:
        free(start)
        free(opts.storage)


# ------------------------------------------------------------ paged KV cache

cdef inline intp_t table_entry(cnp.ndarray table, Py_ssize_t s, Py_ssize_t slot) noexcept:
    """block_table[s, slot] of an aligned int64 or int32 table."""
    cdef char *at = (<char *>cnp.PyArray_DATA(table) + s * cnp.PyArray_STRIDE(table, 0)
                     + slot * cnp.PyArray_STRIDE(table, 1))
    if cnp.PyArray_TYPE(table) == cnp.NPY_INT64:
        return (<long long *>at)[0]
    return (<int *>at)[0]


cdef inline bint pages_written_once(const intp_t *table, Py_ssize_t n_seq, Py_ssize_t max_pages,
                                    Py_ssize_t page_size, Py_ssize_t n_pages,
                                    const intp_t *start, const intp_t *new_length) noexcept:
    """Each page a sequence writes to is used once in the whole table's used
    entries, by that sequence's slot: then no new row lands on a row some
    sequence holds, and no two land on one row. (A page written to and used
    twice is always one or the other, the general path's to refuse.)"""
    cdef unsigned char *page_uses = <unsigned char *>calloc(n_pages, 1)
    cdef Py_ssize_t s, slot, page
    cdef bint once = True
    if page_uses == NULL:
        return False
    for s in range(n_seq):
        for slot in range(start[s] // page_size, (new_length[s] - 1) // page_size + 1):
            page_uses[table[s * max_pages + slot]] = 1
    for s in range(n_seq):
        for slot in range((new_length[s] + page_size - 1) // page_size):
            page = table[s * max_pages + slot]
            if page_uses[page] == 2:
                once = False
                break
            if page_uses[page] == 1:
                page_uses[page] = 2
        if not once:
            break
    free(page_uses)
    return once


cdef inline void set_place(Place *place, cnp.ndarray arr, const intp_t *seq_offset,
                           int t_axis, int h_axis, int page_axis) noexcept:
    """The Place of arr: element strides of its token, head, feature (last)
    and page axes (page_axis -1: not paged)."""
    cdef Py_ssize_t item = cnp.PyArray_ITEMSIZE(arr)
    place.data = <const char *>cnp.PyArray_DATA(arr)
    place.type_num = cnp.PyArray_TYPE(arr)
    place.seq_offset = seq_offset
    place.t_stride = cnp.PyArray_STRIDE(arr, t_axis) // item
    place.h_stride = cnp.PyArray_STRIDE(arr, h_axis) // item
    place.col_stride = cnp.PyArray_STRIDE(arr, cnp.PyArray_NDIM(arr) - 1) // item
    place.page_stride = cnp.PyArray_STRIDE(arr, page_axis) // item if page_axis >= 0 else 0


cdef inline object paged_shortcut(
        const ca_kernels *kern, object q, object k_pages, object v_pages, object block_table,
        object cache_lengths, object k_new, object v_new, object cu_seqlens_q,
        object causal_flag, object scale, object window, object softcap, object alibi_slopes,
        object sinks, object k_scale, object v_scale, object kv_starts, object out_arg,
        object lse_flag, object num_threads, object thread_limit, object rotary_cos,
        object rotary_sin, object interleaved_flag, object precision):
    """``attention_with_paged_kvcache`` for a decode or prefill step of float
    pages: q float32 or float64 of shape (B, H, T, d_k) (no cu_seqlens_q),
    pages of q's dtype (or float16 beside a float32 q) of shape (n_pages,
    H_kv, page_size, d), H a multiple of H_kv, all sizes nonzero, aligned,
    native, element-multiple strides; block_table int64 or int32 of shape
    (B, max_pages); cache_lengths int32 or int64 of shape (B,); k_new and
    v_new None or of the pages' dtype; every array the call writes certainly
    apart from every other one it touches; each sequence's new rows within
    its table, every page it reads a page id, and every page it writes to
    used once (pages_written_once); no int8 scales; kv_starts an int32 or
    int64 ndarray (B,), alibi_slopes and sinks float32 or float64 ndarrays
    of shape (H,); out an ndarray it writes (out_usable) apart from the
    pages, table and lengths; rotary tables the step reads in place (as for
    kvcache_shortcut). Else None, before anything is written."""
    if cu_seqlens_q is not None or k_scale is not None or v_scale is not None:
        return None
    if (not serving_step_arrays(q, k_pages, v_pages, cache_lengths, k_new, v_new)
            or type(block_table) is not cnp.ndarray
            or not (causal_flag is True or causal_flag is False)
            or not (lse_flag is True or lse_flag is False)):
        return None
    cdef int q_type = cnp.PyArray_TYPE(<cnp.ndarray>q)
    cdef int page_type = cnp.PyArray_TYPE(<cnp.ndarray>k_pages)
    if not serving_step_dtypes(q_type, page_type):
        return None
    cdef bint appending = k_new is not None
    cdef cnp.ndarray qa = <cnp.ndarray>q
    cdef cnp.ndarray kp = <cnp.ndarray>k_pages
    cdef cnp.ndarray vp = <cnp.ndarray>v_pages
    cdef cnp.ndarray table = <cnp.ndarray>block_table
    cdef cnp.ndarray lengths = <cnp.ndarray>cache_lengths
    cdef cnp.ndarray kn = <cnp.ndarray>k_new if appending else None
    cdef cnp.ndarray vn = <cnp.ndarray>v_new if appending else None
    if cnp.PyArray_NDIM(table) != 2 or not (usable_input(table, cnp.NPY_INT64)
                                            or usable_input(table, cnp.NPY_INT32)):
        return None
    if (cnp.PyArray_DIM(table, 1) == 0
            or not step_arrays_fit(qa, kp, vp, lengths, cnp.PyArray_DIM(table, 0), q_type,
                                   page_type)):
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
    # positions a sequence can hold; int32 lengths must hold every one
    if <double>max_pages * page_size > 4.0e18:
        return None
    cdef Py_ssize_t capacity = max_pages * page_size
    if not plain_lengths(lengths, capacity):
        return None
    cdef Py_ssize_t n_new = 0
    if appending:
        if not (new_rows_shaped(kn, vn, n_seq, n_kv_heads, d_k, d_v)
                and cnp.PyArray_DIM(kn, 2) == n_queries):
            return None
        n_new = n_queries
        if not (usable_input(kn, page_type) and usable_input(vn, page_type)):
            return None
        if not (writes_apart(kp, vp, lengths, qa, kn, vn)
                and apart(kp, table) and apart(vp, table) and apart(lengths, table)):
            return None
    if not output_fits(<double>n_seq * n_heads * n_queries * d_v, cnp.PyArray_ITEMSIZE(qa)):
        return None
    if out_arg is not None and not (out_usable(out_arg, qa, d_v, q_type)
                                    and apart(<cnp.ndarray>out_arg, kp)
                                    and apart(<cnp.ndarray>out_arg, vp)
                                    and apart(<cnp.ndarray>out_arg, table)
                                    and apart(<cnp.ndarray>out_arg, lengths)
                                    and (not appending
                                         or (apart(<cnp.ndarray>out_arg, kn)
                                             and apart(<cnp.ndarray>out_arg, vn)))):
        return None
    # (per head: a slope or sink per sequence is the general path's)
    for given in (alibi_slopes, sinks):
        if given is not None and not (type(given) is cnp.ndarray
                                      and cnp.PyArray_NDIM(<cnp.ndarray>given) == 1):
            return None
    cdef RowOptions row
    cdef int compute = compute_type(q_type)
    cdef bint in_float32 = compute == cnp.NPY_FLOAT32
    cdef bint causal = causal_flag is True
    cdef bint rotating = not (rotary_cos is None and rotary_sin is None
                              and interleaved_flag is False)
    if rotating and not rotary_step_usable(qa, kn, rotary_cos, rotary_sin, interleaved_flag,
                                           compute, d_k):
        return None
    plain_row_options(&row, causal, check_scale(scale, d_k, in_float32))
    check_window(window, causal, &row.window_left, &row.window_right)
    row.softcap = check_softcap(softcap, in_float32)
    # a 16-bit q with caches of its dtype gives its dtype
    row.precision = check_precision(precision, q_type != compute)
    cdef Py_ssize_t threads = resolve_threads(num_threads, thread_limit)
    cdef bint return_lse = lse_flag is True
    cdef Rotary rotary
    if rotating:
        # q is rotated as it is read, the new keys before anything else
        # allocates
        if not step_rotary(&rotary, rotary_cos, rotary_sin, interleaved_flag, lengths, n_seq,
                           n_queries, n_new):
            return None
        if appending:
            kn = rotated_new_rows(kn, &rotary, lengths)
            if kn is None:
                return None
        row.rotary = &rotary
    # the per-head options as per (sequence, head) values: the dense
    # gathering over the batch (n_seq, H)
    cdef Py_ssize_t shape[2]
    shape[0] = n_seq
    shape[1] = n_heads
    cdef EntryOptions opts
    if not gather_entry_options(&opts, 2, shape, capacity, None, None, alibi_slopes, sinks,
                                in_float32, &row):
        return None

    # one buffer: the table as intp, the old and new lengths, the query rows
    # and new rows of each sequence, and the places of q, K/V, out and the
    # new rows
    cdef intp_t *page_ids = <intp_t *>malloc((n_seq * max_pages + 10 * n_seq) * sizeof(intp_t))
    if page_ids == NULL:
        free(opts.storage)
        return None
    cdef intp_t *start = page_ids + n_seq * max_pages
    cdef intp_t *new_length = start + n_seq
    cdef intp_t *q_lengths = new_length + n_seq
    cdef intp_t *n_new_of = q_lengths + n_seq
    cdef intp_t *q_offset = n_new_of + n_seq
    cdef intp_t *zeros = q_offset + n_seq
    cdef intp_t *out_offset = zeros + n_seq
    cdef intp_t *rows_offset = out_offset + n_seq
    cdef intp_t *seq_starts = rows_offset + n_seq
    cdef intp_t *lse_offset = seq_starts + n_seq
    cdef cnp.npy_intp lse_dims[3]
    cdef Py_ssize_t s, slot, page
    cdef bint declined = False
    for s in range(n_seq):
        for slot in range(max_pages):
            page_ids[s * max_pages + slot] = table_entry(table, s, slot)
        start[s] = load_length(lengths, s)
        if start[s] < 0 or start[s] > capacity - n_new:
            declined = True
            break
        new_length[s] = start[s] + n_new
        # every page the sequence reads is a page id
        for slot in range((new_length[s] + page_size - 1) // page_size):
            page = page_ids[s * max_pages + slot]
            if page < 0 or page >= n_pages:
                declined = True
        if declined:
            break
    if not declined and appending:
        declined = not pages_written_once(page_ids, n_seq, max_pages, page_size, n_pages,
                                          start, new_length)
    if not declined and kv_starts is not None:
        # one start per sequence within the table's positions (the general
        # path names any other)
        declined = not entry_positions(kv_starts, 1, &n_seq, seq_starts)
        for s in range(n_seq if not declined else 0):
            if seq_starts[s] < 0 or seq_starts[s] > capacity:
                declined = True
    if declined:
        free(page_ids)
        free(opts.storage)
        return None

    cdef EntryPlan plan
    cdef Py_ssize_t item = cnp.PyArray_ITEMSIZE(qa)
    for s in range(n_seq):
        q_lengths[s] = n_queries
        n_new_of[s] = n_new
        q_offset[s] = s * (cnp.PyArray_STRIDE(qa, 0) // item)
        zeros[s] = 0
    plan.n_seq, plan.n_heads, plan.n_kv_heads, plan.d_k, plan.d_v = (
        n_seq, n_heads, n_kv_heads, d_k, d_v)
    plan.q_lengths = q_lengths
    plan.kv_lengths = new_length
    plan.kv_starts = seq_starts if kv_starts is not None else NULL
    set_place(&plan.q, qa, q_offset, 2, 1, -1)
    set_place(&plan.k, kp, zeros, 2, 1, 0)
    set_place(&plan.v, vp, zeros, 2, 1, 0)
    plan.lse.data = NULL
    plan.k_scale.data = NULL
    plan.v_scale.data = NULL
    plan.alibi = opts.slopes
    plan.sinks = opts.sinks
    plan.page_ids = page_ids
    plan.pages_per_seq = max_pages
    plan.page_size = page_size
    # bfloat16 q, prompt rows (the packed path): the driver rounds each
    # block of rows into a bfloat16 ATTN as it finishes them
    cdef bint rounds_rows = q_type != compute and not direct_rows(n_queries)
    # ATTN in the caller's out= when it takes the compute dtype (or the
    # driver rounds into it), else in a new array (rounded into out= at the
    # end)
    cdef cnp.ndarray out
    cdef cnp.ndarray lse = None
    try:
        if out_arg is not None and (q_type == compute or rounds_rows):
            out = <cnp.ndarray>out_arg
        else:
            out = np_empty4(n_seq, n_heads, n_queries, d_v,
                            q_type if rounds_rows else compute)
        if return_lse:
            lse_dims[0], lse_dims[1], lse_dims[2] = n_seq, n_heads, n_queries
            lse = cnp.PyArray_EMPTY(3, lse_dims, compute, 0)
    except BaseException:
        free(page_ids)
        free(opts.storage)
        raise
    for s in range(n_seq):
        out_offset[s] = s * (cnp.PyArray_STRIDE(out, 0) // cnp.PyArray_ITEMSIZE(out))
    set_place(&plan.out, out, out_offset, 2, 1, -1)
    if return_lse:
        for s in range(n_seq):
            lse_offset[s] = s * n_heads * n_queries
        set_place(&plan.lse, lse, lse_offset, 2, 1, -1)

    # every check has passed: append, advance the lengths, then attend
    cdef CacheRows cache
    cdef NewRows rows
    cdef int k_or_v
    if appending:
        for k_or_v in range(2):
            cache_rows_of(&cache, kp if k_or_v == 0 else vp, page_ids, max_pages)
            new_rows_of(&rows, kn if k_or_v == 0 else vn, rows_offset)
            append_rows(&cache, &rows, start, n_new_of, n_seq, n_kv_heads,
                        d_k if k_or_v == 0 else d_v)
        store_lengths(lengths, start, n_new)
    try:
        run_plan(&plan, &row, kern, threads, out)
    except BaseException:
        # the computation failed (its memory): the new rows are given back,
        # their slots free again past the lengths
        if appending:
            store_lengths(lengths, start, 0)
        raise
    finally:
        free(page_ids)
        free(opts.storage)
    if out_arg is not None:
        if q_type != compute and not rounds_rows:
            # bfloat16: rounded once into out=
            rounded_to_bfloat16(out, out_arg)
        out = <cnp.ndarray>out_arg
    elif q_type != compute and not rounds_rows:
        # bfloat16 in: the result rounded once to it
        out = rounded_to_bfloat16(out, None)
    if return_lse:
        return out, lse
    return out
