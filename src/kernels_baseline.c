/*
 * Portable kernels: plain C that any x86-64 (or other) CPU runs, compiled
 * with the default flags. The compiler may vectorise them with the baseline
 * instruction set. Also the reference the SIMD kernels are tested beside.
 */
#include <math.h>
#include <stdlib.h>

#include "kernels.h"
#include "exp_poly.h"

/* the loops below compute one row of one panel at a time */
#define CA_TILE_ROWS 1
#define CA_TILE_VECS 1
#define CA_LANES_F32 CA_PANEL_F32
#define CA_LANES_F64 CA_PANEL_F64

#define CA_DEFINE_PORTABLE_KERNELS(T, SUFFIX, EXP, PANEL)                     \
static void score_##SUFFIX(const T *q, ptrdiff_t ldq, ptrdiff_t n_rows,         \
                           const T *kt, ptrdiff_t kt_panel_stride,              \
                           ptrdiff_t n_cols, ptrdiff_t d_k, T factor, T *s,     \
                           ptrdiff_t lds, const void *ahead,                    \
                           ptrdiff_t ahead_bytes)                               \
{                                                                               \
    (void)ahead; (void)ahead_bytes; /* prefetching is left to the hardware */  \
    for (ptrdiff_t i = 0; i < n_rows; ++i) {                                    \
        for (ptrdiff_t j0 = 0; j0 < n_cols; j0 += PANEL) {                      \
            const T *panel = kt + (j0 / PANEL) * kt_panel_stride;               \
            /* runs of CA_SUM_FEATURES features from zero (as the SIMD      \
               tiles), added in order */                                        \
            T dot[PANEL];                                                       \
            for (int l = 0; l < PANEL; ++l)                                     \
                dot[l] = 0;                                                     \
            for (ptrdiff_t c0 = 0; c0 < d_k; c0 += CA_SUM_FEATURES) {           \
                const ptrdiff_t c_end = d_k - c0 < CA_SUM_FEATURES              \
                                        ? d_k : c0 + CA_SUM_FEATURES;           \
                T run_dot[PANEL];                                               \
                for (int l = 0; l < PANEL; ++l)                                 \
                    run_dot[l] = 0;                                             \
                for (ptrdiff_t c = c0; c < c_end; ++c) {                        \
                    const T q_ic = q[i * ldq + c];                              \
                    for (int l = 0; l < PANEL; ++l)                             \
                        run_dot[l] += q_ic * panel[c * PANEL + l];              \
                }                                                               \
                for (int l = 0; l < PANEL; ++l)                                 \
                    dot[l] = c0 == 0 ? run_dot[l] : dot[l] + run_dot[l];        \
            }                                                                   \
            for (int l = 0; l < PANEL; ++l)                                     \
                s[i * lds + j0 + l] = dot[l] * factor;                          \
        }                                                                       \
    }                                                                           \
}                                                                               \
                                                                                \
static void pv_##SUFFIX(const T *p, ptrdiff_t ldp, ptrdiff_t n_rows,            \
                        const T *v, ptrdiff_t v_panel_stride, ptrdiff_t n_keys, \
                        ptrdiff_t n_vcols, T *acc, ptrdiff_t ldacc,             \
                        const void *ahead, ptrdiff_t ahead_bytes)               \
{                                                                               \
    (void)ahead; (void)ahead_bytes;                                             \
    /* runs of CA_SUM_KEYS keys summed from zero, the runs into block_sum,      \
       the block added to acc once (as the SIMD kernels) */                     \
    for (ptrdiff_t i = 0; i < n_rows; ++i) {                                    \
        for (ptrdiff_t c0 = 0; c0 < n_vcols; c0 += PANEL) {                     \
            const T *panel = v + (c0 / PANEL) * v_panel_stride;                 \
            T block_sum[PANEL];                                                 \
            for (ptrdiff_t j0 = 0; j0 < n_keys; j0 += CA_SUM_KEYS) {            \
                const ptrdiff_t j_end = n_keys - j0 < CA_SUM_KEYS               \
                                        ? n_keys : j0 + CA_SUM_KEYS;            \
                T run_sum[PANEL];                                               \
                for (int l = 0; l < PANEL; ++l)                                 \
                    run_sum[l] = 0;                                             \
                for (ptrdiff_t j = j0; j < j_end; ++j) {                        \
                    const T p_ij = p[i * ldp + j];                              \
                    for (int l = 0; l < PANEL; ++l)                             \
                        run_sum[l] += p_ij * panel[j * PANEL + l];              \
                }                                                               \
                for (int l = 0; l < PANEL; ++l)                                 \
                    block_sum[l] = j0 == 0 ? run_sum[l]                         \
                                           : block_sum[l] + run_sum[l];         \
            }                                                                   \
            if (n_keys > 0)                                                     \
                for (int l = 0; l < PANEL; ++l)                                 \
                    acc[i * ldacc + c0 + l] += block_sum[l];                    \
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
        x[j] = EXP(x[j] - shift);                                                \
        partial[j & 7] += x[j];                                                 \
    }                                                                           \
    return ((partial[0] + partial[1]) + (partial[2] + partial[3])) +            \
           ((partial[4] + partial[5]) + (partial[6] + partial[7]));             \
}                                                                               \
                                                                                \
static int divide_rows_##SUFFIX(const T *acc, ptrdiff_t ldacc, ptrdiff_t n_rows, \
                                ptrdiff_t n_cols, const T *divisor, T *out,     \
                                ptrdiff_t ld_out)                               \
{                                                                               \
    /* x - x is 0 for finite x, NaN for inf and NaN */                         \
    int nonfinite = 0;                                                          \
    for (ptrdiff_t i = 0; i < n_rows; ++i) {                                    \
        const T d = divisor[i];                                                 \
        for (ptrdiff_t c = 0; c < n_cols; ++c) {                                \
            const T q = acc[i * ldacc + c] / d;                                 \
            out[i * ld_out + c] = q;                                            \
            nonfinite |= q - q != 0;                                            \
        }                                                                       \
    }                                                                           \
    return nonfinite;                                                           \
}

/* KV_T: K and V as stored; LOAD_KV(x): one of them as a T */
#define CA_DEFINE_PORTABLE_DIRECT_KERNELS(T, KV_T, LOAD_KV, SUFFIX)           \
static void score_direct_##SUFFIX(const T *q, ptrdiff_t ldq, ptrdiff_t n_rows,  \
                                  const KV_T *k, ptrdiff_t ldk, ptrdiff_t n_keys, \
                                  ptrdiff_t d_k, T factor, T *s, ptrdiff_t lds, \
                                  const void *ahead, ptrdiff_t ahead_stride,    \
                                  ptrdiff_t ahead_bytes)                        \
{                                                                               \
    (void)ahead; (void)ahead_stride; (void)ahead_bytes;                         \
    for (ptrdiff_t r = 0; r < n_rows; ++r)                                      \
        for (ptrdiff_t j = 0; j < n_keys; ++j) {                                \
            /* eight partial sums, as a vector unit would keep them */         \
            T partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};                            \
            for (ptrdiff_t c = 0; c < d_k; ++c)                                 \
                partial[c & 7] += q[r * ldq + c] * LOAD_KV(k[j * ldk + c]);     \
            T dot = ((partial[0] + partial[1]) + (partial[2] + partial[3])) +   \
                    ((partial[4] + partial[5]) + (partial[6] + partial[7]));    \
            s[r * lds + j] = dot * factor;                                      \
        }                                                                       \
}                                                                               \
                                                                                \
static void pv_direct_##SUFFIX(const T *p, ptrdiff_t ldp, ptrdiff_t n_rows,     \
                               const KV_T *v, ptrdiff_t ldv, ptrdiff_t n_keys,  \
                               ptrdiff_t d_v, T *acc, ptrdiff_t ldacc,          \
                               const void *ahead, ptrdiff_t ahead_stride,       \
                               ptrdiff_t ahead_bytes)                           \
{                                                                               \
    (void)ahead; (void)ahead_stride; (void)ahead_bytes;                         \
    /* runs of CA_SUM_KEYS keys summed from zero, then added (as the SIMD       \
       kernels); columns 64 at a time */                                        \
    for (ptrdiff_t r = 0; r < n_rows; ++r)                                      \
        for (ptrdiff_t c0 = 0; c0 < d_v; c0 += 64) {                            \
            const ptrdiff_t n_c = d_v - c0 < 64 ? d_v - c0 : 64;                \
            T run[64];                                                          \
            for (ptrdiff_t j0 = 0; j0 < n_keys; j0 += CA_SUM_KEYS) {            \
                for (ptrdiff_t c = 0; c < n_c; ++c)                             \
                    run[c] = 0;                                                 \
                const ptrdiff_t j_end = n_keys - j0 < CA_SUM_KEYS               \
                                        ? n_keys : j0 + CA_SUM_KEYS;            \
                for (ptrdiff_t j = j0; j < j_end; ++j) {                        \
                    const T p_rj = p[r * ldp + j];                              \
                    if (p_rj == 0)                                              \
                        continue;                                               \
                    for (ptrdiff_t c = 0; c < n_c; ++c)                         \
                        run[c] += p_rj * LOAD_KV(v[j * ldv + c0 + c]);          \
                }                                                               \
                for (ptrdiff_t c = 0; c < n_c; ++c)                             \
                    acc[r * ldacc + c0 + c] += run[c];                          \
            }                                                                   \
        }                                                                       \
}

/* tanh without a libm call per element, branch-free so it vectorises:
   |y| < 1/2: odd Taylor series to y^17 (truncation below 1e-9);
   otherwise (1 - e) / (1 + e) with e = e^(-2|y|) <= 0.37, free of
   cancellation. About 2 ulp. */
static inline float tanh_f32(float y)
{
    const float a = fabsf(y);
    const float y2 = y * y;
    float p = 0.000590027440945586f;
    p = p * y2 - 0.0014558343870513183f;
    p = p * y2 + 0.003592128036572481f;
    p = p * y2 - 0.008863235529902197f;
    p = p * y2 + 0.021869488536155203f;
    p = p * y2 - 0.05396825396825397f;
    p = p * y2 + 0.13333333333333333f;
    p = p * y2 - 0.3333333333333333f;
    const float small = y + y * (y2 * p);
    const float e = ca_expf_scalar(-2.0f * a);
    const float large = copysignf((1.0f - e) / (1.0f + e), y);
    return a < 0.5f ? small : large;
}

static void softcap_f32(float *x, ptrdiff_t n, float cap)
{
    for (ptrdiff_t j = 0; j < n; ++j)
        x[j] = cap * tanh_f32(x[j] / cap);
}


static void int8_rows_to_f32(const int8_t *src, ptrdiff_t src_row, ptrdiff_t src_col,
                             ptrdiff_t n_rows, ptrdiff_t n_cols, const float *scale,
                             ptrdiff_t scale_stride, float *dst, ptrdiff_t ld_dst)
{
    for (ptrdiff_t r = 0; r < n_rows; ++r) {
        const float row_scale = scale[r * scale_stride];
        for (ptrdiff_t c = 0; c < n_cols; ++c)
            dst[r * ld_dst + c] = (float)src[r * src_row + c * src_col] * row_scale;
    }
}

static void score_direct_i8(const float *q, ptrdiff_t ldq, ptrdiff_t n_rows,
                            const int8_t *k, ptrdiff_t ldk, ptrdiff_t n_keys, ptrdiff_t d_k,
                            float factor, const float *scale, ptrdiff_t scale_stride,
                            float *s, ptrdiff_t lds)
{
    for (ptrdiff_t r = 0; r < n_rows; ++r)
        for (ptrdiff_t j = 0; j < n_keys; ++j) {
            /* eight partial sums, as score_direct_f32 keeps them */
            float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (ptrdiff_t c = 0; c < d_k; ++c)
                partial[c & 7] += q[r * ldq + c] * (float)k[j * ldk + c];
            const float dot = ((partial[0] + partial[1]) + (partial[2] + partial[3])) +
                              ((partial[4] + partial[5]) + (partial[6] + partial[7]));
            s[r * lds + j] = factor * (scale[j * scale_stride] * dot);
        }
}

static void pv_direct_i8(const float *p, ptrdiff_t ldp, ptrdiff_t n_rows, const int8_t *v,
                         ptrdiff_t ldv, ptrdiff_t n_keys, ptrdiff_t d_v, const float *scale,
                         ptrdiff_t scale_stride, float *acc, ptrdiff_t ldacc)
{
    /* runs of CA_SUM_KEYS keys summed from zero, then added, as pv_direct_f32 */
    for (ptrdiff_t r = 0; r < n_rows; ++r)
        for (ptrdiff_t c0 = 0; c0 < d_v; c0 += 64) {
            const ptrdiff_t n_c = d_v - c0 < 64 ? d_v - c0 : 64;
            float run[64];
            for (ptrdiff_t j0 = 0; j0 < n_keys; j0 += CA_SUM_KEYS) {
                for (ptrdiff_t c = 0; c < n_c; ++c)
                    run[c] = 0;
                const ptrdiff_t j_end = n_keys - j0 < CA_SUM_KEYS ? n_keys : j0 + CA_SUM_KEYS;
                for (ptrdiff_t j = j0; j < j_end; ++j) {
                    const float weight = p[r * ldp + j] * scale[j * scale_stride];
                    if (weight == 0)
                        continue;
                    for (ptrdiff_t c = 0; c < n_c; ++c)
                        run[c] += weight * (float)v[j * ldv + c0 + c];
                }
                for (ptrdiff_t c = 0; c < n_c; ++c)
                    acc[r * ldacc + c0 + c] += run[c];
            }
        }
}

/* float16 and bfloat16 rows, converted exactly */
#define CA_DEFINE_ROWS_TO_F32(name, SCALAR) \
    static void name(const uint16_t *src, ptrdiff_t src_row, ptrdiff_t src_col, \
                     ptrdiff_t n_rows, ptrdiff_t n_cols, float *dst, ptrdiff_t ld_dst) \
    { \
        for (ptrdiff_t r = 0; r < n_rows; ++r) \
            for (ptrdiff_t c = 0; c < n_cols; ++c) \
                dst[r * ld_dst + c] = SCALAR(src[r * src_row + c * src_col]); \
    }
CA_DEFINE_ROWS_TO_F32(half_rows_to_f32, ca_half_to_float)
CA_DEFINE_ROWS_TO_F32(bf16_rows_to_f32, ca_bfloat16_to_float)
#undef CA_DEFINE_ROWS_TO_F32

static void pack_kt_f32(const float *k, ptrdiff_t ldk, ptrdiff_t n_keys, ptrdiff_t d_k,
                        float *kt, ptrdiff_t kt_panel_stride)
{
    const ptrdiff_t P = CA_PANEL_F32;
    for (ptrdiff_t j0 = 0; j0 < n_keys; j0 += P) {
        float *panel = kt + (j0 / P) * kt_panel_stride;
        for (ptrdiff_t c = 0; c < d_k; ++c)
            for (ptrdiff_t l = 0; l < P; ++l)
                panel[c * P + l] = j0 + l < n_keys ? k[(j0 + l) * ldk + c] : 0.0f;
    }
}

static int pack_v_f32(const float *v, ptrdiff_t ldv, ptrdiff_t n_keys, ptrdiff_t d_v,
                      float *v_packed, ptrdiff_t v_panel_stride)
{
    const ptrdiff_t P = CA_PANEL_F32;
    /* x - x is 0 for finite x and NaN otherwise: one sum per lane, so the
       check vectorises where a branch would not */
    float probe[CA_PANEL_F32] = {0};
    for (ptrdiff_t j = 0; j < n_keys; ++j) {
        const float *v_row = v + j * ldv;
        for (ptrdiff_t c0 = 0; c0 < d_v; c0 += P) {
            float *dst = v_packed + (c0 / P) * v_panel_stride + j * P;
            for (ptrdiff_t l = 0; l < P; ++l) {
                const float x = c0 + l < d_v ? v_row[c0 + l] : 0.0f;
                probe[l] += x - x;
                dst[l] = x;
            }
        }
    }
    float total = 0;
    for (ptrdiff_t l = 0; l < P; ++l)
        total += probe[l];
    return total != total;
}

CA_DEFINE_PORTABLE_KERNELS(float, f32, ca_expf_scalar, CA_PANEL_F32)
CA_DEFINE_PORTABLE_KERNELS(double, f64, ca_expd_scalar, CA_PANEL_F64)
#define CA_AS_IS(x) (x)
CA_DEFINE_PORTABLE_DIRECT_KERNELS(float, float, CA_AS_IS, f32)
CA_DEFINE_PORTABLE_DIRECT_KERNELS(double, double, CA_AS_IS, f64)
CA_DEFINE_PORTABLE_DIRECT_KERNELS(float, uint16_t, ca_half_to_float, f16)
CA_DEFINE_PORTABLE_DIRECT_KERNELS(float, uint16_t, ca_bfloat16_to_float, bf16)
CA_DEFINE_PORTABLE_DIRECT_KERNELS(float, uint8_t, ca_e4m3fn_to_float, e4m3)
CA_DEFINE_PORTABLE_DIRECT_KERNELS(float, uint8_t, ca_e5m2_to_float, e5m2)
#include "kernels_fp8.h"

/* fp8 rows times their scale: exact widening, one rounding */
static void fp8_rows_to_f32(const uint8_t *src, ptrdiff_t src_row, ptrdiff_t src_col,
                            ptrdiff_t n_rows, ptrdiff_t n_cols, int format,
                            const float *scale, ptrdiff_t scale_stride, float *dst,
                            ptrdiff_t ld_dst)
{
    float (*widen)(uint8_t) = format == CA_FP8_E4M3FN ? ca_e4m3fn_to_float : ca_e5m2_to_float;
    for (ptrdiff_t r = 0; r < n_rows; ++r) {
        const float row_scale = scale[r * scale_stride];
        for (ptrdiff_t c = 0; c < n_cols; ++c)
            dst[r * ld_dst + c] = widen(src[r * src_row + c * src_col]) * row_scale;
    }
}

/* the multiply-add loop (kernels.h: loop_flops) in plain C: what the
   compiler makes of independent scalar multiply-adds */
static double loop_flops(long n_steps)
{
    float sum[8];
    for (int i = 0; i < 8; ++i)
        sum[i] = (float)i;
    for (long s = 0; s < n_steps; ++s)
        for (int i = 0; i < 8; ++i)
            sum[i] = sum[i] * 0.5f + 0.5f;
    volatile float keep = sum[0] + sum[7];
    (void)keep;
    return 2.0 * 8 * (double)n_steps;
}

CA_DEFINE_KERNEL_TABLE(ca_kernels_baseline, "baseline");
