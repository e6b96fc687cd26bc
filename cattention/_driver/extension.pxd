# cython: language_level=3
"""The driver's C-level entry points (defined in extension.pyx), cimported by
cattention/cython_attention.pxd, which is what other Cython code uses (the
contract: arguments, strides, status codes)."""

cdef extern from "cattention.h":
    enum:
        CATTENTION_CAUSAL
        CATTENTION_OK
        CATTENTION_ERR_SIZE
        CATTENTION_ERR_POINTER
        CATTENTION_ERR_STRIDE
        CATTENTION_ERR_SCALE
        CATTENTION_ERR_FLAGS
        CATTENTION_ERR_NO_MEMORY

cdef int attention_f32(Py_ssize_t n_queries, Py_ssize_t n_keys, Py_ssize_t d_k,
                       Py_ssize_t d_v,
                       const float *q, Py_ssize_t q_row_stride,
                       const float *k, Py_ssize_t k_row_stride,
                       const float *v, Py_ssize_t v_row_stride,
                       double scale, int flags,
                       float *out, Py_ssize_t out_row_stride,
                       float *scores, Py_ssize_t scores_row_stride,
                       float *lse, int n_threads) noexcept nogil

cdef int attention_f64(Py_ssize_t n_queries, Py_ssize_t n_keys, Py_ssize_t d_k,
                       Py_ssize_t d_v,
                       const double *q, Py_ssize_t q_row_stride,
                       const double *k, Py_ssize_t k_row_stride,
                       const double *v, Py_ssize_t v_row_stride,
                       double scale, int flags,
                       double *out, Py_ssize_t out_row_stride,
                       double *scores, Py_ssize_t scores_row_stride,
                       double *lse, int n_threads) noexcept nogil
