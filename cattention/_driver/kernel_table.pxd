# cython: language_level=3, boundscheck=False, wraparound=False
# cython: cdivision=True, initializedcheck=False
"""The C library as the driver sees it: the table of micro-kernels one
instruction set provides and its selection (src/kernels.h), the scalar
helpers (src/scalar.h), scratch memory and fork safety (src/runtime.h), and
the fused trampolines that call a table's float32 or float64 entry."""

cimport numpy as cnp
from cython cimport floating
from libc.stdint cimport int8_t, uint8_t, uint16_t, uint64_t

ctypedef cnp.intp_t intp_t


cdef extern from "kernels.h" nogil:
    void ca_prefetch_l1(const void *address)
    ctypedef struct ca_kernels:
        const char *name
        void (*score_f32)(const float *q, Py_ssize_t ldq, Py_ssize_t n_rows,
                          const float *kt, Py_ssize_t kt_panel_stride, Py_ssize_t n_cols,
                          Py_ssize_t d_k, float factor, float *s, Py_ssize_t lds,
                          const void *ahead, Py_ssize_t ahead_bytes) noexcept nogil
        void (*score_f64)(const double *q, Py_ssize_t ldq, Py_ssize_t n_rows,
                          const double *kt, Py_ssize_t kt_panel_stride, Py_ssize_t n_cols,
                          Py_ssize_t d_k, double factor, double *s, Py_ssize_t lds,
                          const void *ahead, Py_ssize_t ahead_bytes) noexcept nogil
        void (*pv_f32)(const float *p, Py_ssize_t ldp, Py_ssize_t n_rows,
                       const float *v, Py_ssize_t v_panel_stride, Py_ssize_t n_keys,
                       Py_ssize_t n_vcols, float *acc, Py_ssize_t ldacc,
                       const void *ahead, Py_ssize_t ahead_bytes) noexcept nogil
        void (*pv_f64)(const double *p, Py_ssize_t ldp, Py_ssize_t n_rows,
                       const double *v, Py_ssize_t v_panel_stride, Py_ssize_t n_keys,
                       Py_ssize_t n_vcols, double *acc, Py_ssize_t ldacc,
                       const void *ahead, Py_ssize_t ahead_bytes) noexcept nogil
        float (*row_max_f32)(const float *x, Py_ssize_t n) noexcept nogil
        double (*row_max_f64)(const double *x, Py_ssize_t n) noexcept nogil
        float (*exp_sum_f32)(float *x, Py_ssize_t n, float shift) noexcept nogil
        double (*exp_sum_f64)(double *x, Py_ssize_t n, double shift) noexcept nogil
        int (*divide_rows_f32)(const float *acc, Py_ssize_t ldacc, Py_ssize_t n_rows,
                               Py_ssize_t n_cols, const float *divisor, float *out,
                               Py_ssize_t ld_out) noexcept nogil
        int (*divide_rows_f64)(const double *acc, Py_ssize_t ldacc, Py_ssize_t n_rows,
                               Py_ssize_t n_cols, const double *divisor, double *out,
                               Py_ssize_t ld_out) noexcept nogil
        void (*score_direct_f32)(const float *q, Py_ssize_t ldq, Py_ssize_t n_rows,
                                 const float *k, Py_ssize_t ldk, Py_ssize_t n_keys,
                                 Py_ssize_t d_k, float factor, float *s,
                                 Py_ssize_t lds, const void *ahead,
                                 Py_ssize_t ahead_stride,
                                 Py_ssize_t ahead_bytes) noexcept nogil
        void (*score_direct_f64)(const double *q, Py_ssize_t ldq, Py_ssize_t n_rows,
                                 const double *k, Py_ssize_t ldk, Py_ssize_t n_keys,
                                 Py_ssize_t d_k, double factor, double *s,
                                 Py_ssize_t lds, const void *ahead,
                                 Py_ssize_t ahead_stride,
                                 Py_ssize_t ahead_bytes) noexcept nogil
        void (*pv_direct_f32)(const float *p, Py_ssize_t ldp, Py_ssize_t n_rows,
                              const float *v, Py_ssize_t ldv, Py_ssize_t n_keys,
                              Py_ssize_t d_v, float *acc, Py_ssize_t ldacc,
                              const void *ahead, Py_ssize_t ahead_stride,
                              Py_ssize_t ahead_bytes) noexcept nogil
        void (*half_rows_to_f32)(const uint16_t *src, Py_ssize_t src_row, Py_ssize_t src_col,
                                 Py_ssize_t n_rows, Py_ssize_t n_cols, float *dst,
                                 Py_ssize_t ld_dst) noexcept nogil
        void (*softcap_f32)(float *x, Py_ssize_t n, float cap) noexcept nogil
        void (*int8_rows_to_f32)(const int8_t *src, Py_ssize_t src_row, Py_ssize_t src_col,
                                 Py_ssize_t n_rows, Py_ssize_t n_cols, const float *scale,
                                 Py_ssize_t scale_stride, float *dst,
                                 Py_ssize_t ld_dst) noexcept nogil
        void (*score_direct_i8)(const float *q, Py_ssize_t ldq, Py_ssize_t n_rows,
                                const int8_t *k, Py_ssize_t ldk, Py_ssize_t n_keys,
                                Py_ssize_t d_k, float factor, const float *scale,
                                Py_ssize_t scale_stride, float *s,
                                Py_ssize_t lds) noexcept nogil
        void (*pv_direct_i8)(const float *p, Py_ssize_t ldp, Py_ssize_t n_rows,
                             const int8_t *v, Py_ssize_t ldv, Py_ssize_t n_keys,
                             Py_ssize_t d_v, const float *scale, Py_ssize_t scale_stride,
                             float *acc, Py_ssize_t ldacc) noexcept nogil
        void (*fp8_rows_to_f32)(const uint8_t *src, Py_ssize_t src_row, Py_ssize_t src_col,
                                Py_ssize_t n_rows, Py_ssize_t n_cols, int format,
                                const float *scale, Py_ssize_t scale_stride, float *dst,
                                Py_ssize_t ld_dst) noexcept nogil
        void (*score_direct_fp8)(const float *q, Py_ssize_t ldq, Py_ssize_t n_rows,
                                 const uint8_t *k, Py_ssize_t ldk, Py_ssize_t n_keys,
                                 Py_ssize_t d_k, int format, float factor, const float *scale,
                                 Py_ssize_t scale_stride, float *s, Py_ssize_t lds,
                                 const void *ahead, Py_ssize_t ahead_stride,
                                 Py_ssize_t ahead_bytes) noexcept nogil
        void (*pv_direct_fp8)(const float *p, Py_ssize_t ldp, Py_ssize_t n_rows,
                              const uint8_t *v, Py_ssize_t ldv, Py_ssize_t n_keys,
                              Py_ssize_t d_v, int format, const float *scale,
                              Py_ssize_t scale_stride, float *acc, Py_ssize_t ldacc,
                              const void *ahead, Py_ssize_t ahead_stride,
                              Py_ssize_t ahead_bytes) noexcept nogil
        void (*score_direct_f16)(const float *q, Py_ssize_t ldq, Py_ssize_t n_rows,
                                 const uint16_t *k, Py_ssize_t ldk, Py_ssize_t n_keys,
                                 Py_ssize_t d_k, float factor, float *s, Py_ssize_t lds,
                                 const void *ahead, Py_ssize_t ahead_stride,
                                 Py_ssize_t ahead_bytes) noexcept nogil
        void (*pv_direct_f16)(const float *p, Py_ssize_t ldp, Py_ssize_t n_rows,
                              const uint16_t *v, Py_ssize_t ldv, Py_ssize_t n_keys,
                              Py_ssize_t d_v, float *acc, Py_ssize_t ldacc,
                              const void *ahead, Py_ssize_t ahead_stride,
                              Py_ssize_t ahead_bytes) noexcept nogil
        void (*pack_kt_f32)(const float *k, Py_ssize_t ldk, Py_ssize_t n_keys,
                            Py_ssize_t d_k, float *kt,
                            Py_ssize_t kt_panel_stride) noexcept nogil
        int (*pack_v_f32)(const float *v, Py_ssize_t ldv, Py_ssize_t n_keys,
                          Py_ssize_t d_v, float *v_packed,
                          Py_ssize_t v_panel_stride) noexcept nogil
        void (*pv_direct_f64)(const double *p, Py_ssize_t ldp, Py_ssize_t n_rows,
                              const double *v, Py_ssize_t ldv, Py_ssize_t n_keys,
                              Py_ssize_t d_v, double *acc, Py_ssize_t ldacc,
                              const void *ahead, Py_ssize_t ahead_stride,
                              Py_ssize_t ahead_bytes) noexcept nogil
        void (*bf16_rows_to_f32)(const uint16_t *src, Py_ssize_t src_row, Py_ssize_t src_col,
                                 Py_ssize_t n_rows, Py_ssize_t n_cols, float *dst,
                                 Py_ssize_t ld_dst) noexcept nogil
        void (*score_direct_bf16)(const float *q, Py_ssize_t ldq, Py_ssize_t n_rows,
                                  const uint16_t *k, Py_ssize_t ldk, Py_ssize_t n_keys,
                                  Py_ssize_t d_k, float factor, float *s, Py_ssize_t lds,
                                  const void *ahead, Py_ssize_t ahead_stride,
                                  Py_ssize_t ahead_bytes) noexcept nogil
        void (*pv_direct_bf16)(const float *p, Py_ssize_t ldp, Py_ssize_t n_rows,
                               const uint16_t *v, Py_ssize_t ldv, Py_ssize_t n_keys,
                               Py_ssize_t d_v, float *acc, Py_ssize_t ldacc,
                               const void *ahead, Py_ssize_t ahead_stride,
                               Py_ssize_t ahead_bytes) noexcept nogil
        Py_ssize_t bf16_k_align
        void (*pack_kt_bf16)(const uint16_t *k, Py_ssize_t ldk, Py_ssize_t n_keys,
                             Py_ssize_t d_k, uint16_t *kt,
                             Py_ssize_t kt_panel_stride) noexcept nogil
        void (*score_bf16)(const uint16_t *q, Py_ssize_t ldq, Py_ssize_t n_rows,
                           const uint16_t *kt, Py_ssize_t kt_panel_stride, Py_ssize_t n_cols,
                           Py_ssize_t d_k, float factor, float *s, Py_ssize_t lds,
                           const void *ahead, Py_ssize_t ahead_bytes) noexcept nogil
        int (*pack_v_bf16)(const uint16_t *v, Py_ssize_t ldv, Py_ssize_t n_keys,
                           Py_ssize_t d_v, uint16_t *v_packed,
                           Py_ssize_t v_panel_stride) noexcept nogil
        void (*pv_bf16)(const float *p, Py_ssize_t ldp, Py_ssize_t n_rows, const uint16_t *v,
                        Py_ssize_t v_panel_stride, Py_ssize_t n_keys, Py_ssize_t n_vcols,
                        float *acc, Py_ssize_t ldacc, const void *ahead,
                        Py_ssize_t ahead_bytes) noexcept nogil
        int bf16_pv_parts[3]
        void (*end_of_thread)() noexcept nogil
        double (*loop_flops)(long n_steps) noexcept nogil

    enum: CA_PANEL_F32
    enum: CA_PANEL_F64
    enum: CA_PRECISION_HIGHEST
    enum: CA_PRECISION_HIGH
    enum: CA_PRECISION_MEDIUM
    const ca_kernels *ca_default_kernels()
    const ca_kernels *ca_kernels_by_name(const char *name)
    int ca_available_kernels(const char **names, int capacity)
    const char *ca_simd_note()


cdef extern from "scalar.h" nogil:
    float ca_half_to_float(uint16_t h)
    float ca_bfloat16_to_float(uint16_t b)
    float ca_e4m3fn_to_float(uint8_t code)
    float ca_e5m2_to_float(uint8_t code)
    enum: CA_FP8_E4M3FN
    enum: CA_FP8_E5M2
    void ca_round_to_bfloat16(const float *src, uint16_t *dst, Py_ssize_t n)
    void ca_float_to_fp8(const float *src, uint8_t *dst, Py_ssize_t n, float divisor,
                         int format)
    void ca_softcap_f64(double *x, Py_ssize_t n, double cap)
    uint64_t ca_read_words(const uint64_t *words, size_t n)


cdef extern from "runtime.h" nogil:
    const char *ca_compiler_version()
    int ca_bfloat16_type
    void ca_set_bfloat16_type(int type_num)
    int ca_e4m3fn_type
    int ca_e5m2_type
    void ca_set_fp8_types(int e4m3fn, int e5m2)
    void ca_note_parallel_region()
    int ca_forked_after_parallel()
    enum: CA_SCRATCH_WORKSPACE
    enum: CA_SCRATCH_PACKED
    enum: CA_SCRATCH_PARTIAL
    void *ca_scratch_acquire(int slot, size_t n_bytes)
    void ca_scratch_release(int slot, void *ptr)


cdef inline void kernel_softcap(const ca_kernels *kern, floating *x, Py_ssize_t n,
                                double cap) noexcept nogil:
    if floating is float:
        kern.softcap_f32(x, n, <float>cap)
    else:
        ca_softcap_f64(x, n, cap)


cdef inline void kernel_score(const ca_kernels *kern, const floating *q, Py_ssize_t ldq,
                              Py_ssize_t n_rows, const floating *kt, Py_ssize_t kt_panel_stride,
                              Py_ssize_t n_cols, Py_ssize_t d_k, double factor,
                              floating *s, Py_ssize_t lds, const void *ahead=NULL,
                              Py_ssize_t ahead_bytes=0) noexcept nogil:
    if floating is float:
        kern.score_f32(q, ldq, n_rows, kt, kt_panel_stride, n_cols, d_k, <float>factor, s, lds,
                       ahead, ahead_bytes)
    else:
        kern.score_f64(q, ldq, n_rows, kt, kt_panel_stride, n_cols, d_k, factor, s, lds,
                       ahead, ahead_bytes)


cdef inline void kernel_pv(const ca_kernels *kern, const floating *p,
                           Py_ssize_t ldp, Py_ssize_t n_rows, const floating *v,
                           Py_ssize_t v_panel_stride, Py_ssize_t n_keys, Py_ssize_t n_vcols,
                           floating *acc, Py_ssize_t ldacc, const void *ahead=NULL,
                           Py_ssize_t ahead_bytes=0) noexcept nogil:
    if floating is float:
        kern.pv_f32(p, ldp, n_rows, v, v_panel_stride, n_keys, n_vcols, acc, ldacc,
                    ahead, ahead_bytes)
    else:
        kern.pv_f64(p, ldp, n_rows, v, v_panel_stride, n_keys, n_vcols, acc, ldacc,
                    ahead, ahead_bytes)


cdef inline void kernel_score_direct(const ca_kernels *kern, const floating *q,
                                     Py_ssize_t ldq, Py_ssize_t n_rows, const floating *k,
                                     Py_ssize_t ldk, Py_ssize_t n_keys, Py_ssize_t d_k,
                                     double factor, floating *s, Py_ssize_t lds,
                                     const void *ahead, Py_ssize_t ahead_stride,
                                     Py_ssize_t ahead_bytes) noexcept nogil:
    if floating is float:
        kern.score_direct_f32(q, ldq, n_rows, k, ldk, n_keys, d_k, <float>factor, s, lds,
                              ahead, ahead_stride, ahead_bytes)
    else:
        kern.score_direct_f64(q, ldq, n_rows, k, ldk, n_keys, d_k, factor, s, lds,
                              ahead, ahead_stride, ahead_bytes)


cdef inline void kernel_pv_direct(const ca_kernels *kern, const floating *p, Py_ssize_t ldp,
                                  Py_ssize_t n_rows, const floating *v, Py_ssize_t ldv,
                                  Py_ssize_t n_keys, Py_ssize_t d_v, floating *acc,
                                  Py_ssize_t ldacc, const void *ahead, Py_ssize_t ahead_stride,
                                  Py_ssize_t ahead_bytes) noexcept nogil:
    if floating is float:
        kern.pv_direct_f32(p, ldp, n_rows, v, ldv, n_keys, d_v, acc, ldacc,
                           ahead, ahead_stride, ahead_bytes)
    else:
        kern.pv_direct_f64(p, ldp, n_rows, v, ldv, n_keys, d_v, acc, ldacc,
                           ahead, ahead_stride, ahead_bytes)


cdef inline floating kernel_row_max(const ca_kernels *kern, const floating *x,
                                    Py_ssize_t n) noexcept nogil:
    if floating is float:
        return kern.row_max_f32(x, n)
    else:
        return kern.row_max_f64(x, n)


cdef inline int kernel_divide_rows(const ca_kernels *kern, const floating *acc,
                                   Py_ssize_t ldacc, Py_ssize_t n_rows, Py_ssize_t n_cols,
                                   const floating *divisor, floating *out,
                                   Py_ssize_t ld_out) noexcept nogil:
    if floating is float:
        return kern.divide_rows_f32(acc, ldacc, n_rows, n_cols, divisor, out, ld_out)
    else:
        return kern.divide_rows_f64(acc, ldacc, n_rows, n_cols, divisor, out, ld_out)


cdef inline floating kernel_exp_sum(const ca_kernels *kern, floating *x, Py_ssize_t n,
                                    floating shift) noexcept nogil:
    if floating is float:
        return kern.exp_sum_f32(x, n, shift)
    else:
        return kern.exp_sum_f64(x, n, shift)
