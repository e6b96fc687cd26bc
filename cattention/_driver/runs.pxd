# cython: language_level=3, boundscheck=False, wraparound=False
# cython: cdivision=True, initializedcheck=False
"""Running a built Problem: with the GIL released, on float32 or float64
outputs, its batch index freed afterwards; and the run of every table of an
entry plan."""

cimport numpy as cnp
from libc.stdlib cimport free
from libc.stdint cimport uint16_t
from cattention._driver.kernel_table cimport ca_bfloat16_type, ca_kernels, intp_t
from cattention._driver.problem cimport Problem, RowOptions
from cattention._driver.schedule cimport compute_problem
from cattention._driver.from_entries cimport (
    EntryPlan, EntryTable, free_tables, plan_entries, problem_from_table)
from cattention._driver.from_arrays cimport (
    problem_from_arrays, set_kv_lengths, set_kv_starts, set_out_offsets, set_query_offset)


cdef inline int run_on_outputs(Problem *pb, const ca_kernels *kern, Py_ssize_t n_threads,
                               cnp.ndarray out, cnp.ndarray scores):
    """Run with the GIL released on float or double outputs (either may be
    None), or a bfloat16 out without scores on the packed path (rounded as
    its rows are finished: Problem.out_bf16); 0, or -1 if memory ran out."""
    cdef int status
    cdef int threads = <int>n_threads if n_threads < 1 << 30 else 1 << 30
    cdef float *out_f32 = NULL
    cdef float *scores_f32 = NULL
    cdef double *out_f64 = NULL
    cdef double *scores_f64 = NULL
    cdef cnp.ndarray any_output = out if out is not None else scores
    if cnp.PyArray_TYPE(any_output) == cnp.NPY_FLOAT64:
        if out is not None:
            out_f64 = <double *>cnp.PyArray_DATA(out)
        if scores is not None:
            scores_f64 = <double *>cnp.PyArray_DATA(scores)
        with nogil:
            status = compute_problem(pb, kern, threads, out_f64, scores_f64)
    else:
        if out is not None and cnp.PyArray_TYPE(out) == ca_bfloat16_type:
            pb.out_bf16 = <uint16_t *>cnp.PyArray_DATA(out)
        elif out is not None:
            out_f32 = <float *>cnp.PyArray_DATA(out)
        if scores is not None:
            scores_f32 = <float *>cnp.PyArray_DATA(scores)
        with nogil:
            status = compute_problem(pb, kern, threads, out_f32, scores_f32)
    return status


cdef inline int run_then_free(Problem *pb, intp_t *index, const ca_kernels *kern,
                              Py_ssize_t n_threads, cnp.ndarray out,
                              cnp.ndarray scores) except -1:
    """Run the Problem, then free the batch index its builder returned;
    MemoryError if the scratch could not be allocated."""
    cdef int status
    try:
        status = run_on_outputs(pb, kern, n_threads, out, scores)
    finally:
        free(index)
    if status == -2:
        raise RuntimeError("cattention: a bfloat16 ATTN on a path that does not round "
                           "its rows (the direct path, or SCORES)")
    if status != 0:
        raise MemoryError("cattention: could not allocate scratch memory")
    return 0


cdef inline int run_dense(cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, cnp.ndarray mask,
                          cnp.ndarray k_scale, cnp.ndarray v_scale, Py_ssize_t n_batch_dims,
                          const Py_ssize_t *batch_shape, Py_ssize_t kv_group,
                          Py_ssize_t query_period, const intp_t *kv_lengths,
                          const intp_t *kv_starts, const RowOptions *row,
                          const ca_kernels *kern, Py_ssize_t n_threads, cnp.ndarray out,
                          cnp.ndarray scores, cnp.ndarray lse,
                          const intp_t *query_offset=NULL) except -1:
    """Build and run a dense call's Problem (problem_from_arrays): its rows
    stacked groups of query_period positions when that is > 0, kv_lengths
    and kv_starts one per batch entry or NULL, ATTN into out as it lies (C
    contiguous, or any non-negative strides with contiguous features), C
    contiguous scores and lse, any of the three None; query_offset the key
    position of each batch entry's query row 0, or NULL (bottom-right)."""
    cdef Problem pb
    cdef intp_t *index = problem_from_arrays(&pb, q, k, v, mask, k_scale, v_scale,
                                             n_batch_dims, batch_shape, kv_group, row)
    pb.lse = cnp.PyArray_DATA(lse) if lse is not None else NULL
    if query_period > 0:
        pb.query_period = query_period
    if kv_lengths != NULL:
        set_kv_lengths(&pb, kv_lengths, index)
    if kv_starts != NULL:
        set_kv_starts(&pb, kv_starts)
    if query_offset != NULL:
        set_query_offset(&pb, query_offset)
    if out is not None and not cnp.PyArray_IS_C_CONTIGUOUS(out):
        set_out_offsets(&pb, out, n_batch_dims, batch_shape, index)
    return run_then_free(&pb, index, kern, n_threads, out, scores)


cdef inline int run_plan(const EntryPlan *plan, const RowOptions *row, const ca_kernels *kern,
                         Py_ssize_t n_threads, cnp.ndarray out) except -1:
    """Run every table of an entry plan into out (and the plan's LSE)."""
    cdef EntryTable tables[2]
    cdef Py_ssize_t n_tables = 0
    cdef Py_ssize_t i
    cdef Problem pb
    cdef intp_t *index
    if plan_entries(plan, tables, &n_tables) != 0:
        raise MemoryError("cattention: could not allocate scratch memory")
    try:
        for i in range(n_tables):
            index = problem_from_table(&pb, &tables[i], plan, row)
            if index == NULL:
                raise MemoryError("cattention: could not allocate scratch memory")
            run_then_free(&pb, index, kern, n_threads, out, None)
    finally:
        free_tables(tables, n_tables)
    return 0
