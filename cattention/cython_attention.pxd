# cython: language_level=3
"""The public C-level API of cattention, for other Cython code (SciPy's
cython_blas is the model): attention on raw pointers, without the GIL or any
Python object. This file is the stable contract; the modules behind it may
change.

    from cattention.cython_attention cimport attention_f32, CATTENTION_OK, CATTENTION_CAUSAL

Compile the cimporting extension with ``include_dirs=[cattention.get_include()]``.

One call computes one head: Q is n_queries x d_k, K is n_keys x d_k, V is
n_keys x d_v, each with contiguous features and the given row stride in
elements (any value, so a (T, heads, d) layout is a row stride of heads * d).
OUT (n_queries x d_v) and, if not NULL, SCORES (n_queries x n_keys) are
written with their row strides, which must be at least the row length. OUT
may be NULL when SCORES is not (the weights alone; V is then not read and
may be NULL too). LSE, if not NULL, receives each row's log-sum-exp (-inf
for a row that sees no key). OUT, SCORES and LSE must not overlap each
other or Q, K and V: the call writes them while it still reads its inputs.
``scale`` multiplies Q.K (pass 1 / sqrt(d_k) for the usual attention; it
must be finite, and for attention_f32 0 or of a magnitude float can hold);
``flags`` is 0 or CATTENTION_CAUSAL (bottom-right aligned, as in
``cattention.attention``). Rows that see no key give zeros.

``n_threads`` threads work on the call (capped by its size and the CPUs the
process may run on); inside a prange
over heads pass 1. Results are bitwise the same for any thread count and are
those of ``cattention.attention`` on the same head alone (a call on many
heads at once may split the keys of a decode step differently, which rounds
differently). The return value is
CATTENTION_OK or one of the CATTENTION_ERR_* codes of cattention.h. A call
with invalid arguments writes nothing; after CATTENTION_ERR_NO_MEMORY the
outputs are undefined.
"""

# the flags and status codes (cattention.h), as the driver declares them
from libc.stdint cimport uint8_t
from cattention._driver.extension cimport (
    CATTENTION_CAUSAL, CATTENTION_ERR_FLAGS, CATTENTION_ERR_FORMAT, CATTENTION_ERR_NO_MEMORY,
    CATTENTION_ERR_POINTER, CATTENTION_ERR_SCALE, CATTENTION_ERR_SIZE, CATTENTION_ERR_STRIDE,
    CATTENTION_FP8_E4M3FN, CATTENTION_FP8_E5M2, CATTENTION_OK)

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

# float32 q over fp8 K and V (KV caches of 8-bit floats): K and V hold
# codes of fp8_format (CATTENTION_FP8_E4M3FN or CATTENTION_FP8_E5M2), each
# row standing for its codes times its float32 scale, k_scale[j *
# k_scale_stride] for key j (a stride of 0: one scale for all; NULL: 1),
# likewise V. Each scale must be finite, >= 0 and at most float's largest
# value over the format's largest (448, 57344): they are not checked, and
# another gives NaN or infinities. The codes are widened exactly as they
# are read; the result is that of attention_f32 over K and V holding codes
# times scales, to float32 rounding. An unknown format returns
# CATTENTION_ERR_FORMAT; the rest as attention_f32.
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
                           float *lse, int n_threads) noexcept nogil
