# cython: language_level=3
"""The driver's C-level entry point (defined in extension.pyx), cimported by
cattention/cython_attention.pyx, whose attention_f32 / attention_f64 are
what other Cython code uses (cattention/cython_attention.pxd is the
contract: arguments, strides, status codes)."""

cdef extern from "cattention.h":
    enum:
        CATTENTION_CAUSAL
        CATTENTION_FP8_E4M3FN
        CATTENTION_FP8_E5M2
        CATTENTION_ERR_FORMAT
        CATTENTION_OK
        CATTENTION_ERR_SIZE
        CATTENTION_ERR_POINTER
        CATTENTION_ERR_STRIDE
        CATTENTION_ERR_SCALE
        CATTENTION_ERR_FLAGS
        CATTENTION_ERR_NO_MEMORY


cdef struct HeadCall:
    # one head: the arguments of attention_f32 / attention_f64, with the
    # element type (NPY_FLOAT32 or NPY_FLOAT64) of every array
    int type_num
    Py_ssize_t n_queries, n_keys, d_k, d_v
    const void *q
    Py_ssize_t q_row_stride
    const void *k
    Py_ssize_t k_row_stride
    const void *v
    Py_ssize_t v_row_stride
    double scale
    int flags
    void *out
    Py_ssize_t out_row_stride
    void *scores
    Py_ssize_t scores_row_stride
    void *lse
    int n_threads
    # fp8 K and V (attention_f32_fp8): their format (-1: K and V of
    # type_num) and float32 row scales, scale_stride apart (NULL: 1)
    int fp8_format
    const float *k_scale
    Py_ssize_t k_scale_stride
    const float *v_scale
    Py_ssize_t v_scale_stride


cdef int head_attention(const HeadCall *call) noexcept nogil
