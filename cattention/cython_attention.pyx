# cython: language_level=3
"""The public C-level API (cython_attention.pxd): each function fills the
driver's HeadCall and calls its one entry (cattention._driver.extension),
which computes through the same path as cattention.attention. This module is
the binary contract other extensions link to, so the driver behind it may
move without breaking them."""

cimport numpy as cnp
from libc.stdint cimport uint8_t
from cattention._driver.extension cimport HeadCall, head_attention


cdef int attention_f32(Py_ssize_t n_queries, Py_ssize_t n_keys, Py_ssize_t d_k,
                       Py_ssize_t d_v,
                       const float *q, Py_ssize_t q_row_stride,
                       const float *k, Py_ssize_t k_row_stride,
                       const float *v, Py_ssize_t v_row_stride,
                       double scale, int flags,
                       float *out, Py_ssize_t out_row_stride,
                       float *scores, Py_ssize_t scores_row_stride,
                       float *lse, int n_threads) noexcept nogil:
    cdef HeadCall call = HeadCall(
        cnp.NPY_FLOAT32, n_queries, n_keys, d_k, d_v, q, q_row_stride, k, k_row_stride,
        v, v_row_stride, scale, flags, out, out_row_stride, scores, scores_row_stride, lse,
        n_threads, -1, NULL, 0, NULL, 0)
    return head_attention(&call)


cdef int attention_f64(Py_ssize_t n_queries, Py_ssize_t n_keys, Py_ssize_t d_k,
                       Py_ssize_t d_v,
                       const double *q, Py_ssize_t q_row_stride,
                       const double *k, Py_ssize_t k_row_stride,
                       const double *v, Py_ssize_t v_row_stride,
                       double scale, int flags,
                       double *out, Py_ssize_t out_row_stride,
                       double *scores, Py_ssize_t scores_row_stride,
                       double *lse, int n_threads) noexcept nogil:
    cdef HeadCall call = HeadCall(
        cnp.NPY_FLOAT64, n_queries, n_keys, d_k, d_v, q, q_row_stride, k, k_row_stride,
        v, v_row_stride, scale, flags, out, out_row_stride, scores, scores_row_stride, lse,
        n_threads, -1, NULL, 0, NULL, 0)
    return head_attention(&call)


cdef int attention_f32_fp8(Py_ssize_t n_queries, Py_ssize_t n_keys, Py_ssize_t d_k,
                           Py_ssize_t d_v,
                           const float *q, Py_ssize_t q_row_stride,
                           const uint8_t *k, Py_ssize_t k_row_stride,
                           const float *k_scale, Py_ssize_t k_scale_stride,
                           const uint8_t *v, Py_ssize_t v_row_stride,
                           const float *v_scale, Py_ssize_t v_scale_stride,
                           int fp8_format, double scale, int flags,
                           float *out, Py_ssize_t out_row_stride,
                           float *scores, Py_ssize_t scores_row_stride,
                           float *lse, int n_threads) noexcept nogil:
    cdef HeadCall call = HeadCall(
        cnp.NPY_FLOAT32, n_queries, n_keys, d_k, d_v, q, q_row_stride, k, k_row_stride,
        v, v_row_stride, scale, flags, out, out_row_stride, scores, scores_row_stride, lse,
        n_threads, fp8_format, k_scale, k_scale_stride, v_scale, v_scale_stride)
    return head_attention(&call)
