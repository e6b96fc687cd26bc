# cython: language_level=3, boundscheck=False, wraparound=False
"""A downstream extension using cattention's C-level API: heads of a
(T, heads, d) layout in a prange, one call per head."""

from cython cimport floating
from cython.parallel cimport prange
from libc.stdint cimport uint8_t

from cattention.cython_attention cimport (
    CATTENTION_CAUSAL, CATTENTION_OK, attention_f32, attention_f32_fp8, attention_f64)


def heads_f32(const float[:, :, ::1] q, const float[:, :, ::1] k,
              const float[:, :, ::1] v, float[:, :, ::1] out, float[:, ::1] lse,
              double scale, bint causal, int n_threads, int call_threads=1):
    """out[:, h] = attention(q[:, h], k[:, h], v[:, h]) over a prange of
    n_threads, each call with call_threads; returns the failed calls."""
    cdef Py_ssize_t n_heads = q.shape[1], h
    cdef Py_ssize_t d_k = q.shape[2], d_v = v.shape[2]
    cdef int flags = CATTENTION_CAUSAL if causal else 0
    cdef int failures = 0
    for h in prange(n_heads, nogil=True, num_threads=n_threads, schedule="static"):
        if attention_f32(q.shape[0], k.shape[0], d_k, d_v,
                         &q[0, h, 0], n_heads * d_k, &k[0, h, 0], n_heads * d_k,
                         &v[0, h, 0], n_heads * d_v, scale, flags,
                         &out[0, h, 0], n_heads * d_v, NULL, 0,
                         &lse[h, 0], call_threads) != CATTENTION_OK:
            failures += 1
    return failures


def heads_f64(const double[:, :, ::1] q, const double[:, :, ::1] k,
              const double[:, :, ::1] v, double[:, :, ::1] out,
              double[:, :, ::1] scores, double scale, bint causal, int n_threads):
    """As heads_f32 in float64, also writing each head's weights to scores[h]."""
    cdef Py_ssize_t n_heads = q.shape[1], h
    cdef Py_ssize_t d_k = q.shape[2], d_v = v.shape[2]
    cdef int flags = CATTENTION_CAUSAL if causal else 0
    cdef int failures = 0
    for h in prange(n_heads, nogil=True, num_threads=n_threads, schedule="static"):
        if attention_f64(q.shape[0], k.shape[0], d_k, d_v,
                         &q[0, h, 0], n_heads * d_k, &k[0, h, 0], n_heads * d_k,
                         &v[0, h, 0], n_heads * d_v, scale, flags,
                         &out[0, h, 0], n_heads * d_v, &scores[h, 0, 0], scores.shape[2],
                         NULL, 1) != CATTENTION_OK:
            failures += 1
    return failures


def heads_f32_fp8(const float[:, :, ::1] q, const uint8_t[:, :, ::1] k,
                  const float[:, ::1] k_scale, const uint8_t[:, :, ::1] v,
                  const float[:, ::1] v_scale, float[:, :, ::1] out, int fp8_format,
                  bint with_scales, double scale, bint causal, int n_threads):
    """heads_f32 over fp8 codes of K and V (their bytes) with a scale per
    row of each head (k_scale[h, j]), or none (NULL) unless with_scales;
    returns the failed calls, or the first call's status when it is not
    CATTENTION_OK and n_heads is 1."""
    cdef Py_ssize_t n_heads = q.shape[1], h
    cdef Py_ssize_t d_k = q.shape[2], d_v = v.shape[2]
    cdef int flags = CATTENTION_CAUSAL if causal else 0
    cdef int failures = 0, status = CATTENTION_OK
    for h in prange(n_heads, nogil=True, num_threads=n_threads, schedule="static"):
        status = attention_f32_fp8(q.shape[0], k.shape[0], d_k, d_v,
                                   &q[0, h, 0], n_heads * d_k, &k[0, h, 0], n_heads * d_k,
                                   &k_scale[h, 0] if with_scales else NULL, 1,
                                   &v[0, h, 0], n_heads * d_v,
                                   &v_scale[h, 0] if with_scales else NULL, 1,
                                   fp8_format, scale, flags, &out[0, h, 0], n_heads * d_v,
                                   NULL, 0, NULL, 1)
        if status != CATTENTION_OK:
            failures += 1
    return status if n_heads == 1 and failures else failures


CASES = ["ok", "negative size", "null query", "null key", "null value",
         "no output", "short output stride", "short scores stride", "nan scale",
         "unknown flag", "scores only", "scale beyond float", "scale below float",
         "float64 scale beyond float"]


cdef void prime(floating *q, floating *out, floating *scores) noexcept:
    """Inputs of ones; outputs of -7, so that a write shows."""
    cdef int i
    for i in range(4):
        q[i] = 1
        out[i] = -7
        scores[i] = -7


cdef bint kept(const floating *out, const floating *scores) noexcept:
    cdef int i
    for i in range(4):
        if out[i] != -7 or scores[i] != -7:
            return False
    return True


def status_of(str case):
    """(status code, whether OUT and SCORES kept their contents) of a 2 x 2
    call that is wrong in the named way ("ok", "scores only" and "float64
    scale beyond float" are not)."""
    cdef float q[4]
    cdef float out[4]
    cdef float scores[4]
    cdef float nan = float("nan")
    cdef int which = CASES.index(case), status = -1
    prime(q, out, scores)
    with nogil:
        if which == 0:
            status = attention_f32(2, 2, 2, 2, q, 2, q, 2, q, 2, 1.0, 0, out, 2, scores, 2, NULL, 1)
        elif which == 1:
            status = attention_f32(-1, 2, 2, 2, q, 2, q, 2, q, 2, 1.0, 0, out, 2, scores, 2, NULL, 1)  # noqa: E501 (one case per row)
        elif which == 2:
            status = attention_f32(2, 2, 2, 2, NULL, 2, q, 2, q, 2, 1.0, 0, out, 2, scores, 2, NULL, 1)  # noqa: E501 (one case per row)
        elif which == 3:
            status = attention_f32(2, 2, 2, 2, q, 2, NULL, 2, q, 2, 1.0, 0, out, 2, scores, 2, NULL, 1)  # noqa: E501 (one case per row)
        elif which == 4:
            status = attention_f32(2, 2, 2, 2, q, 2, q, 2, NULL, 2, 1.0, 0, out, 2, scores, 2, NULL, 1)  # noqa: E501 (one case per row)
        elif which == 5:
            status = attention_f32(2, 2, 2, 2, q, 2, q, 2, q, 2, 1.0, 0, NULL, 2, NULL, 0, NULL, 1)
        elif which == 6:
            status = attention_f32(2, 2, 2, 2, q, 2, q, 2, q, 2, 1.0, 0, out, 1, scores, 2, NULL, 1)
        elif which == 7:
            status = attention_f32(2, 2, 2, 2, q, 2, q, 2, q, 2, 1.0, 0, out, 2, scores, 1, NULL, 1)
        elif which == 8:
            status = attention_f32(2, 2, 2, 2, q, 2, q, 2, q, 2, nan, 0, out, 2, scores, 2, NULL, 1)
        elif which == 9:
            status = attention_f32(2, 2, 2, 2, q, 2, q, 2, q, 2, 1.0, 4, out, 2, scores, 2, NULL, 1)
        elif which == 10:
            status = attention_f32(2, 2, 2, 2, q, 2, q, 2, NULL, 0, 1.0, 0, NULL, 0, scores, 2, NULL, 1)  # noqa: E501 (one case per row)
        elif which == 11:
            status = attention_f32(2, 2, 2, 2, q, 2, q, 2, q, 2, 1e39, 0, out, 2, scores, 2, NULL, 1)  # noqa: E501 (one case per row)
        elif which == 12:
            status = attention_f32(2, 2, 2, 2, q, 2, q, 2, q, 2, 1e-46, 0, out, 2, scores, 2, NULL, 1)  # noqa: E501 (one case per row)
    if which == 13:
        # the same scale is a float64 call's to take: its outputs are written
        return status_of_f64(1e39)
    return status, kept(out, scores)


cdef status_of_f64(double scale):
    cdef double q[4]
    cdef double out[4]
    cdef double scores[4]
    cdef int status
    prime(q, out, scores)
    with nogil:
        status = attention_f64(2, 2, 2, 2, q, 2, q, 2, q, 2, scale, 0, out, 2, scores, 2, NULL, 1)
    return status, kept(out, scores)
