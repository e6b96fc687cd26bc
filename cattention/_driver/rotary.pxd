# cython: language_level=3, boundscheck=False, wraparound=False
# cython: cdivision=True, initializedcheck=False
"""Rotary position embeddings: rows of q or of new keys rotated, each at its
own position, into a new array; and what a compiled step takes of them.
Both ways in rotate here, before anything else: the general path
(``_prepare/rotary.py``) and the compiled serving steps (shortcuts.pxd,
with tables they read in place). New keys are rotated into scratch rather
than as they are stored, so that the one conversion (or quantization) of
new rows into a cache, and its checks, sees the rotated values before
anything is written.

Feature pairs (x1, x2) of a row at position p, with c = cos[p, i] and
s = sin[p, i], become

    x1 * c - x2 * s,    x2 * c + x1 * s

where x1 = x[i], x2 = x[i + half] (GPT-NeoX's half split) or x1 = x[2i],
x2 = x[2i + 1] (interleaved, GPT-J's), for i < half; features from 2 * half
on are copied. Every product and sum is rounded in the row's dtype and never
fused into a multiply-add (C compilers may contract ``a * b - c * d`` where
the instruction set has one, e.g. on aarch64), so the result is bitwise
NumPy's ``x1 * c - x2 * s`` in that dtype."""

cimport numpy as cnp
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy
from cattention._driver.kernel_table cimport intp_t
from cattention._driver.accepts cimport usable_input
from cattention._driver.appends cimport load_length

cdef extern from *:
    """
    /* the rotation of one row's first 2 * half features (x's features
       x_col elements apart, out's contiguous, the table rows' c_col and
       s_col), with contraction into fused multiply-adds off: each product
       and sum rounded on its own */
    #if defined(__clang__)
    #define CA_NO_CONTRACT
    #define CA_NO_CONTRACT_BODY _Pragma("STDC FP_CONTRACT OFF")
    #elif defined(__GNUC__)
    #define CA_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
    #define CA_NO_CONTRACT_BODY
    #else
    #define CA_NO_CONTRACT
    #define CA_NO_CONTRACT_BODY
    #endif
    #define CA_DEFINE_ROTATE(T, NAME)                                              \\
    static CA_NO_CONTRACT void NAME(const T *x, Py_ssize_t x_col, T *out,          \\
                                    const T *c, Py_ssize_t c_col, const T *s,      \\
                                    Py_ssize_t s_col, Py_ssize_t half,             \\
                                    int interleaved) {                             \\
        CA_NO_CONTRACT_BODY                                                        \\
        Py_ssize_t i;                                                              \\
        if (interleaved) {                                                         \\
            for (i = 0; i < half; i++) {                                           \\
                T x1 = x[2 * i * x_col], x2 = x[(2 * i + 1) * x_col];              \\
                T ci = c[i * c_col], si = s[i * s_col];                            \\
                T a = x1 * ci, b = x2 * si, e = x2 * ci, f = x1 * si;              \\
                out[2 * i] = a - b;                                                \\
                out[2 * i + 1] = e + f;                                            \\
            }                                                                      \\
        } else {                                                                   \\
            for (i = 0; i < half; i++) {                                           \\
                T x1 = x[i * x_col], x2 = x[(i + half) * x_col];                   \\
                T ci = c[i * c_col], si = s[i * s_col];                            \\
                T a = x1 * ci, b = x2 * si, e = x2 * ci, f = x1 * si;              \\
                out[i] = a - b;                                                    \\
                out[i + half] = e + f;                                             \\
            }                                                                      \\
        }                                                                          \\
    }
    CA_DEFINE_ROTATE(float, ca_rotate_f32)
    CA_DEFINE_ROTATE(double, ca_rotate_f64)
    """
    void ca_rotate_f32(const float *x, Py_ssize_t x_col, float *out, const float *c,
                       Py_ssize_t c_col, const float *s, Py_ssize_t s_col, Py_ssize_t half,
                       int interleaved) noexcept nogil
    void ca_rotate_f64(const double *x, Py_ssize_t x_col, double *out, const double *c,
                       Py_ssize_t c_col, const double *s, Py_ssize_t s_col, Py_ssize_t half,
                       int interleaved) noexcept nogil


cdef struct RotaryRows:
    # rows (a, h, t) of an (A, H, T, d) array x (byte strides, any) rotated
    # into out (C-contiguous, of x's shape and dtype), row (a, h, t) at
    # position[a * T + t], whose cos and sin are row position of the tables
    # (of x's dtype; byte strides of their rows and columns)
    const char *x
    Py_ssize_t stride[4]
    char *out
    const char *cos
    const char *sin
    Py_ssize_t cos_row, cos_col, sin_row, sin_col
    const intp_t *position
    Py_ssize_t n_lead, n_heads, n_rows, n_features, half, itemsize
    bint interleaved


cdef inline void rotate_rows(const RotaryRows *r) noexcept nogil:
    """Every row of r rotated into r.out (float32 or float64 by itemsize)."""
    cdef Py_ssize_t a, h, t, i, p
    cdef Py_ssize_t col = r.stride[3] // r.itemsize
    cdef Py_ssize_t cos_col = r.cos_col // r.itemsize
    cdef Py_ssize_t sin_col = r.sin_col // r.itemsize
    cdef Py_ssize_t row_bytes = r.n_features * r.itemsize
    cdef Py_ssize_t rotated_bytes = 2 * r.half * r.itemsize
    cdef const char *src
    cdef char *dst = r.out
    for a in range(r.n_lead):
        for h in range(r.n_heads):
            for t in range(r.n_rows):
                src = r.x + a * r.stride[0] + h * r.stride[1] + t * r.stride[2]
                p = r.position[a * r.n_rows + t]
                if r.itemsize == 4:
                    ca_rotate_f32(<const float *>src, col, <float *>dst,
                                  <const float *>(r.cos + p * r.cos_row), cos_col,
                                  <const float *>(r.sin + p * r.sin_row), sin_col,
                                  r.half, r.interleaved)
                else:
                    ca_rotate_f64(<const double *>src, col, <double *>dst,
                                  <const double *>(r.cos + p * r.cos_row), cos_col,
                                  <const double *>(r.sin + p * r.sin_row), sin_col,
                                  r.half, r.interleaved)
                # the features past the rotated ones, as they are
                if col == 1:
                    memcpy(dst + rotated_bytes, src + rotated_bytes, row_bytes - rotated_bytes)
                else:
                    for i in range(2 * r.half, r.n_features):
                        memcpy(dst + i * r.itemsize, src + i * r.stride[3], r.itemsize)
                dst += row_bytes


cdef inline cnp.ndarray rotated(cnp.ndarray x, cnp.ndarray cos, cnp.ndarray sin,
                                const intp_t *position, bint interleaved):
    """A new C-contiguous array of the 4-D x rotated, row (a, ., t) at
    position[a * T + t] (x and the tables of one float type, read in
    place: aligned, native, strides multiples of the itemsize; every
    position a row of the tables)."""
    cdef RotaryRows r
    cdef int d
    cdef cnp.ndarray out = cnp.PyArray_EMPTY(4, cnp.PyArray_DIMS(x), cnp.PyArray_TYPE(x), 0)
    r.x = <const char *>cnp.PyArray_DATA(x)
    for d in range(4):
        r.stride[d] = cnp.PyArray_STRIDE(x, d)
    r.out = <char *>cnp.PyArray_DATA(out)
    r.cos = <const char *>cnp.PyArray_DATA(cos)
    r.sin = <const char *>cnp.PyArray_DATA(sin)
    r.cos_row = cnp.PyArray_STRIDE(cos, 0)
    r.cos_col = cnp.PyArray_STRIDE(cos, 1)
    r.sin_row = cnp.PyArray_STRIDE(sin, 0)
    r.sin_col = cnp.PyArray_STRIDE(sin, 1)
    r.position = position
    r.n_lead = cnp.PyArray_DIM(x, 0)
    r.n_heads = cnp.PyArray_DIM(x, 1)
    r.n_rows = cnp.PyArray_DIM(x, 2)
    r.n_features = cnp.PyArray_DIM(x, 3)
    r.half = cnp.PyArray_DIM(cos, 1)
    r.itemsize = cnp.PyArray_ITEMSIZE(x)
    r.interleaved = interleaved
    with nogil:
        rotate_rows(&r)
    return out


# ------------------------------------------------ what a compiled step takes

cdef inline bint tables_usable(object cos, object sin, int type_num,
                               Py_ssize_t d_k) noexcept:
    """Tables a compiled step reads in place: ndarrays of type_num (the
    compute type), 2-D, of one shape (n_positions, half) with 1 <= half and
    2 * half <= d_k, usable in place (the general path checks, converts and
    names the others)."""
    if type(cos) is not cnp.ndarray or type(sin) is not cnp.ndarray:
        return False
    cdef cnp.ndarray c = <cnp.ndarray>cos
    cdef cnp.ndarray s = <cnp.ndarray>sin
    return (cnp.PyArray_NDIM(c) == 2 and cnp.PyArray_NDIM(s) == 2
            and cnp.PyArray_DIM(c, 0) == cnp.PyArray_DIM(s, 0)
            and cnp.PyArray_DIM(c, 1) == cnp.PyArray_DIM(s, 1)
            and cnp.PyArray_DIM(c, 1) >= 1 and 2 * cnp.PyArray_DIM(c, 1) <= d_k
            and usable_input(c, type_num) and usable_input(s, type_num))


cdef inline bint rotary_step_usable(cnp.ndarray q, cnp.ndarray k_new, object cos, object sin,
                                    object interleaved_flag, int compute,
                                    Py_ssize_t d_k) noexcept:
    """A compiled step rotates q and its new keys itself when they are of
    the compute type (so that their rotation is rounded once, where it
    goes), the tables usable in place, and rotary_interleaved a bool."""
    return ((interleaved_flag is True or interleaved_flag is False)
            and cnp.PyArray_TYPE(q) == compute
            and (k_new is None or cnp.PyArray_TYPE(k_new) == compute)
            and tables_usable(cos, sin, compute, d_k))


cdef inline object rotated_step(cnp.ndarray q, cnp.ndarray k_new, cnp.ndarray cos,
                                cnp.ndarray sin, bint interleaved, cnp.ndarray lengths,
                                Py_ssize_t n_new):
    """(q, k_new) of a step appending n_new rows to each sequence (q
    (n_seq, H, T, d), k_new (n_seq, H_kv, n_new, d) or None; lengths the
    plain cache_lengths before it) rotated at their positions: sequence s's
    queries are the last T of its lengths[s] + n_new positions, its new
    keys those from lengths[s]. None when a position lies outside the
    tables (the general path names it) or memory ran out."""
    cdef Py_ssize_t n_seq = cnp.PyArray_DIM(q, 0)
    cdef Py_ssize_t n_queries = cnp.PyArray_DIM(q, 2)
    cdef Py_ssize_t s, t, start
    cdef intp_t *position = <intp_t *>malloc((n_seq * (n_queries + n_new) + 1)
                                             * sizeof(intp_t))
    if position == NULL:
        return None
    cdef intp_t *k_position = position + n_seq * n_queries
    for s in range(n_seq):
        start = load_length(lengths, s)
        if start + n_new - n_queries < 0 or start + n_new > cnp.PyArray_DIM(cos, 0):
            free(position)
            return None
        for t in range(n_queries):
            position[s * n_queries + t] = start + n_new - n_queries + t
        for t in range(n_new):
            k_position[s * n_new + t] = start + t
    try:
        q_rotated = rotated(q, cos, sin, position, interleaved)
        k_rotated = (rotated(k_new, cos, sin, k_position, interleaved)
                     if k_new is not None else None)
    finally:
        free(position)
    return q_rotated, k_rotated
