# cython: language_level=3, boundscheck=False, wraparound=False
# cython: cdivision=True, initializedcheck=False
"""Rotary position embeddings: one row rotated at its position
(rotate_row); query rows are rotated so as they are read, into the
workspace rows the kernels read anyway (packing.pxd), so no rotated copy
of q is made; new keys, and 16-bit q that must be rounded back to their
dtype, are rotated into a new array (rotated) before anything is written,
so that the one conversion (or quantization) of new rows into a cache,
and its checks, sees the rotated values. And what a compiled step takes
of them (shortcuts.pxd).

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
from cattention._driver.problem cimport Rotary

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


cdef inline void rotary_of(Rotary *r, cnp.ndarray cos, cnp.ndarray sin, Py_ssize_t first,
                           bint interleaved) noexcept:
    """The Rotary of 2-D tables of one shape and float type, read in place
    (aligned, native, strides multiples of the itemsize), whose row p -
    first holds position p."""
    r.cos = <const char *>cnp.PyArray_DATA(cos)
    r.sin = <const char *>cnp.PyArray_DATA(sin)
    r.cos_row = cnp.PyArray_STRIDE(cos, 0)
    r.cos_col = cnp.PyArray_STRIDE(cos, 1)
    r.sin_row = cnp.PyArray_STRIDE(sin, 0)
    r.sin_col = cnp.PyArray_STRIDE(sin, 1)
    r.first = first
    r.half = cnp.PyArray_DIM(cos, 1)
    r.interleaved = interleaved


cdef inline void rotate_row(const Rotary *r, const char *x, Py_ssize_t x_col, char *out,
                            Py_ssize_t position, Py_ssize_t n_features,
                            Py_ssize_t itemsize) noexcept nogil:
    """Row x (features x_col elements apart; float32 or float64 by
    itemsize) rotated at position into out (contiguous), its features from
    2 * half on copied."""
    cdef Py_ssize_t p = position - r.first
    cdef Py_ssize_t rotated_bytes = 2 * r.half * itemsize
    cdef Py_ssize_t i
    if itemsize == 4:
        ca_rotate_f32(<const float *>x, x_col, <float *>out,
                      <const float *>(r.cos + p * r.cos_row), r.cos_col // 4,
                      <const float *>(r.sin + p * r.sin_row), r.sin_col // 4, r.half,
                      r.interleaved)
    else:
        ca_rotate_f64(<const double *>x, x_col, <double *>out,
                      <const double *>(r.cos + p * r.cos_row), r.cos_col // 8,
                      <const double *>(r.sin + p * r.sin_row), r.sin_col // 8, r.half,
                      r.interleaved)
    if x_col == 1:
        memcpy(out + rotated_bytes, x + rotated_bytes, n_features * itemsize - rotated_bytes)
    else:
        for i in range(2 * r.half, n_features):
            memcpy(out + i * itemsize, x + i * x_col * itemsize, itemsize)


cdef inline cnp.ndarray rotated(cnp.ndarray x, const Rotary *r, const intp_t *position):
    """A new C-contiguous array of the 4-D x (A, H, T, d) rotated, row (a,
    h, t) at position[a * T + t] (x of the tables' float type, aligned,
    native, strides multiples of the itemsize; every position one the
    tables hold)."""
    cdef cnp.ndarray out = cnp.PyArray_EMPTY(4, cnp.PyArray_DIMS(x), cnp.PyArray_TYPE(x), 0)
    cdef const char *data = <const char *>cnp.PyArray_DATA(x)
    cdef char *dst = <char *>cnp.PyArray_DATA(out)
    cdef Py_ssize_t itemsize = cnp.PyArray_ITEMSIZE(x)
    cdef Py_ssize_t n_lead = cnp.PyArray_DIM(x, 0)
    cdef Py_ssize_t n_heads = cnp.PyArray_DIM(x, 1)
    cdef Py_ssize_t n_rows = cnp.PyArray_DIM(x, 2)
    cdef Py_ssize_t n_features = cnp.PyArray_DIM(x, 3)
    cdef Py_ssize_t s0 = cnp.PyArray_STRIDE(x, 0)
    cdef Py_ssize_t s1 = cnp.PyArray_STRIDE(x, 1)
    cdef Py_ssize_t s2 = cnp.PyArray_STRIDE(x, 2)
    cdef Py_ssize_t col = cnp.PyArray_STRIDE(x, 3) // itemsize
    cdef Py_ssize_t a, h, t
    with nogil:
        for a in range(n_lead):
            for h in range(n_heads):
                for t in range(n_rows):
                    rotate_row(r, data + a * s0 + h * s1 + t * s2, col, dst,
                               position[a * n_rows + t], n_features, itemsize)
                    dst += n_features * itemsize
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
    the compute type (q is then rotated as it is read, the new keys before
    they are stored, each rounded once where it goes), the tables usable in
    place, and rotary_interleaved a bool."""
    return ((interleaved_flag is True or interleaved_flag is False)
            and cnp.PyArray_TYPE(q) == compute
            and (k_new is None or cnp.PyArray_TYPE(k_new) == compute)
            and tables_usable(cos, sin, compute, d_k))


cdef inline bint step_rotary(Rotary *r, object cos, object sin, object interleaved_flag,
                             cnp.ndarray lengths, Py_ssize_t n_seq, Py_ssize_t n_queries,
                             Py_ssize_t n_new) noexcept:
    """The Rotary of a step's tables (tables_usable) appending n_new rows to
    each of n_seq sequences with n_queries queries, if every position it
    rotates is one the tables hold: sequence s's queries are the last
    n_queries of its lengths[s] + n_new positions (the plain cache_lengths
    before the step), its new keys those from lengths[s]. False otherwise
    (the general path names the position)."""
    cdef Py_ssize_t s, start
    cdef Py_ssize_t n_positions = cnp.PyArray_DIM(<cnp.ndarray>cos, 0)
    for s in range(n_seq):
        start = load_length(lengths, s)
        if start + n_new - n_queries < 0 or start + n_new > n_positions:
            return False
    rotary_of(r, <cnp.ndarray>cos, <cnp.ndarray>sin, 0, interleaved_flag is True)
    return True


cdef inline object rotated_new_rows(cnp.ndarray k_new, const Rotary *r, cnp.ndarray lengths):
    """k_new (n_seq, H_kv, n_new, d) rotated at positions lengths[s] + t (a
    step step_rotary accepted), or None if memory ran out."""
    cdef Py_ssize_t n_seq = cnp.PyArray_DIM(k_new, 0)
    cdef Py_ssize_t n_new = cnp.PyArray_DIM(k_new, 2)
    cdef Py_ssize_t s, t, start
    cdef intp_t *position = <intp_t *>malloc((n_seq * n_new + 1) * sizeof(intp_t))
    if position == NULL:
        return None
    for s in range(n_seq):
        start = load_length(lengths, s)
        for t in range(n_new):
            position[s * n_new + t] = start + t
    try:
        return rotated(k_new, r, position)
    finally:
        free(position)
