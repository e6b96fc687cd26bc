/*
 * Portable kernels: plain C that any x86-64 (or other) CPU runs, compiled
 * with the default flags. The compiler may vectorise them with the baseline
 * instruction set. Also the reference the SIMD kernels are tested beside.
 */
#include <math.h>
#include <stdlib.h>

#include "kernels.h"
#include "exp_poly.h"

/* value columns summed per pass of the portable P.V kernel */
#define CA_PV_CHUNK 64

#define CA_DEFINE_PORTABLE_KERNELS(T, SUFFIX, EXP2)                           \
static void score_##SUFFIX(const T *q, ptrdiff_t ldq, ptrdiff_t n_rows,         \
                           const T *kt, ptrdiff_t ldkt, ptrdiff_t n_cols,       \
                           ptrdiff_t d_k, T factor, T *s, ptrdiff_t lds)        \
{                                                                               \
    for (ptrdiff_t i = 0; i < n_rows; ++i) {                                    \
        T *s_row = s + i * lds;                                                 \
        for (ptrdiff_t j = 0; j < n_cols; ++j)                                  \
            s_row[j] = 0;                                                       \
        for (ptrdiff_t c = 0; c < d_k; ++c) {                                   \
            const T q_ic = q[i * ldq + c];                                      \
            const T *kt_row = kt + c * ldkt;                                    \
            for (ptrdiff_t j = 0; j < n_cols; ++j)                              \
                s_row[j] += q_ic * kt_row[j];                                   \
        }                                                                       \
        for (ptrdiff_t j = 0; j < n_cols; ++j)                                  \
            s_row[j] *= factor;                                                 \
    }                                                                           \
}                                                                               \
                                                                                \
static void pv_##SUFFIX(const T *p, ptrdiff_t ldp, ptrdiff_t n_rows,            \
                        const T *v, ptrdiff_t ldv, ptrdiff_t n_keys,            \
                        ptrdiff_t n_vcols, T *acc, ptrdiff_t ldacc)             \
{                                                                               \
    /* the block is summed from zero, then added once (as the SIMD kernels) */ \
    T block_sum[CA_PV_CHUNK];                                                   \
    for (ptrdiff_t i = 0; i < n_rows; ++i) {                                    \
        T *acc_row = acc + i * ldacc;                                           \
        for (ptrdiff_t c0 = 0; c0 < n_vcols; c0 += CA_PV_CHUNK) {               \
            const ptrdiff_t n_c = n_vcols - c0 < CA_PV_CHUNK                    \
                                      ? n_vcols - c0 : CA_PV_CHUNK;             \
            for (ptrdiff_t c = 0; c < n_c; ++c)                                 \
                block_sum[c] = 0;                                               \
            for (ptrdiff_t j = 0; j < n_keys; ++j) {                            \
                const T p_ij = p[i * ldp + j];                                  \
                const T *v_row = v + j * ldv + c0;                              \
                for (ptrdiff_t c = 0; c < n_c; ++c)                             \
                    block_sum[c] += p_ij * v_row[c];                            \
            }                                                                   \
            for (ptrdiff_t c = 0; c < n_c; ++c)                                 \
                acc_row[c0 + c] += block_sum[c];                                \
        }                                                                       \
    }                                                                           \
}                                                                               \
                                                                                \
static T row_max_##SUFFIX(const T *x, ptrdiff_t n)                              \
{                                                                               \
    T m = -INFINITY;                                                            \
    int has_nan = 0;                                                            \
    for (ptrdiff_t j = 0; j < n; ++j) {                                         \
        m = x[j] > m ? x[j] : m;                                                \
        has_nan |= x[j] != x[j];                                                \
    }                                                                           \
    return has_nan ? (T)NAN : m;                                                \
}                                                                               \
                                                                                \
static T exp_sum_##SUFFIX(T *x, ptrdiff_t n, T shift)                          \
{                                                                               \
    /* eight partial sums: shorter rounding chains, and vectorisable */        \
    T partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};                                    \
    for (ptrdiff_t j = 0; j < n; ++j) {                                         \
        x[j] = EXP2(x[j] - shift);                                              \
        partial[j & 7] += x[j];                                                 \
    }                                                                           \
    return ((partial[0] + partial[1]) + (partial[2] + partial[3])) +            \
           ((partial[4] + partial[5]) + (partial[6] + partial[7]));             \
}

CA_DEFINE_PORTABLE_KERNELS(float, f32, ca_expf_scalar)
CA_DEFINE_PORTABLE_KERNELS(double, f64, ca_expd_scalar)

const ca_kernels ca_kernels_baseline = {
    "baseline",
    1, 1,
    1, 1,
    score_f32, score_f64,
    pv_f32, pv_f64,
    row_max_f32, row_max_f64,
    exp_sum_f32, exp_sum_f64,
};
