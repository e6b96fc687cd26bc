/*
 * The NEON kernel table against the portable one, as a static aarch64
 * program run under qemu-aarch64 (`make test-arm`): every kernel on random
 * inputs, every tail length, -inf, NaN, every float16, int8 and fp8 value. Exact
 * kernels (conversions, packing, row max) must match bit for bit; the
 * others within a rounding bound of the terms' magnitudes. Also checks that
 * dispatch picks NEON by default on aarch64.
 *
 * Prints one line per failure (at most a few per kernel) and a summary;
 * exits 1 on any failure.
 */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if !CA_HAVE_NEON_KERNELS
#error "build for aarch64 with NEON"
#endif

static const ca_kernels *REF = &ca_kernels_baseline;
static const ca_kernels *NEON = &ca_kernels_neon;

static const char *current;
static int failures, failures_here, checks;

#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        ++checks;                                                          \
        if (!(cond)) {                                                     \
            ++failures;                                                    \
            if (failures_here++ < 5) {                                     \
                printf("FAIL %s: ", current);                              \
                printf(__VA_ARGS__);                                       \
                printf("\n");                                              \
            }                                                              \
        }                                                                  \
    } while (0)

static void begin(const char *name)
{
    current = name;
    failures_here = 0;
}

/* ---- random numbers and comparisons ---- */

static uint64_t rng = 0x243F6A8885A308D3u;

static double uniform(void) /* [0, 1) */
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (double)(rng >> 11) * 0x1.0p-53;
}

static double normal(void) /* about N(0, 1) */
{
    return (uniform() + uniform() + uniform() + uniform() - 2.0) * 1.7320508;
}

static void *alloc(size_t n_bytes)
{
    void *p = calloc(1, n_bytes + 64);
    if (p == NULL) {
        printf("out of memory\n");
        exit(2);
    }
    return p;
}

/* equal bit for bit, any NaN equal to any NaN */
static int same_f64(double a, double b)
{
    return (isnan(a) && isnan(b)) || memcmp(&a, &b, sizeof a) == 0;
}

static int same_f32(float a, float b)
{
    return (isnan(a) && isnan(b)) || memcmp(&a, &b, sizeof a) == 0;
}

/* |a - b| <= bound, or the same non-finite value */
static int close_to(double a, double b, double bound)
{
    if (isnan(a) || isnan(b))
        return isnan(a) && isnan(b);
    if (isinf(a) || isinf(b))
        return a == b;
    return fabs(a - b) <= bound;
}

/* ---- the kernels of both element types ---- */

#define DEFINE_TYPED_CHECKS(T, SFX, PANEL, EPS)                                          \
static void check_score_##SFX(void)                                                       \
{                                                                                         \
    begin("score_" #SFX);                                                                 \
    /* 130: three runs of features (CA_SUM_FEATURES), the last of two */                  \
    const int depths[] = {1, 5, 17, 130};                                                 \
    for (int di = 0; di < 4; ++di)                                                        \
        for (int n_cols = PANEL; n_cols <= 3 * PANEL; n_cols += PANEL)                    \
            for (int n_rows = 1; n_rows <= 25; n_rows += n_rows < 13 ? 1 : 11) {          \
                const int d_k = depths[di], ldq = d_k + 3, lds = n_cols + 5;              \
                const ptrdiff_t stride = (ptrdiff_t)d_k * PANEL + 16;                     \
                T *q = alloc(sizeof(T) * n_rows * ldq);                                   \
                T *k = alloc(sizeof(T) * n_cols * d_k);                                   \
                T *kt = alloc(sizeof(T) * (n_cols / PANEL) * stride);                     \
                T *s_ref = alloc(sizeof(T) * n_rows * lds);                               \
                T *s_neon = alloc(sizeof(T) * n_rows * lds);                              \
                for (int i = 0; i < n_rows * ldq; ++i)                                    \
                    q[i] = (T)normal();                                                   \
                if (n_rows == 7)                                                          \
                    q[3 * ldq] = NAN;                                                     \
                for (int j = 0; j < n_cols; ++j)                                          \
                    for (int c = 0; c < d_k; ++c) {                                       \
                        k[j * d_k + c] = (T)normal();                                     \
                        kt[(j / PANEL) * stride + c * PANEL + j % PANEL] = k[j * d_k + c]; \
                    }                                                                     \
                for (int i = 0; i < n_rows * lds; ++i)                                    \
                    s_ref[i] = s_neon[i] = (T)-7;                                         \
                const T factor = (T)0.37;                                                 \
                REF->score_##SFX(q, ldq, n_rows, kt, stride, n_cols, d_k, factor, s_ref,  \
                                 lds, kt, 256);                                           \
                NEON->score_##SFX(q, ldq, n_rows, kt, stride, n_cols, d_k, factor,        \
                                  s_neon, lds, kt, 256);                                  \
                for (int i = 0; i < n_rows; ++i)                                          \
                    for (int j = 0; j < lds; ++j) {                                       \
                        double magnitude = 0;                                             \
                        for (int c = 0; j < n_cols && c < d_k; ++c)                       \
                            magnitude += fabs((double)q[i * ldq + c] * k[j * d_k + c]);   \
                        CHECK(close_to(s_neon[i * lds + j], s_ref[i * lds + j],           \
                                       2 * (d_k + 1) * EPS * magnitude * factor),         \
                              "d_k=%d n_cols=%d n_rows=%d at (%d, %d): %g vs %g", d_k,    \
                              n_cols, n_rows, i, j, (double)s_neon[i * lds + j],          \
                              (double)s_ref[i * lds + j]);                                \
                    }                                                                     \
                free(q); free(k); free(kt); free(s_ref); free(s_neon);                    \
            }                                                                             \
}                                                                                         \
                                                                                          \
static void check_pv_##SFX(void)                                                          \
{                                                                                         \
    begin("pv_" #SFX);                                                                    \
    const int key_counts[] = {1, 7, 33, 70}; /* 70: a run of 64 keys and a short one */   \
    for (int ki = 0; ki < 4; ++ki)                                                        \
        for (int n_vcols = PANEL; n_vcols <= 3 * PANEL; n_vcols += PANEL)                 \
            for (int n_rows = 1; n_rows <= 25; n_rows += n_rows < 13 ? 1 : 11) {          \
                const int n_keys = key_counts[ki], ldp = n_keys + 2, ldacc = n_vcols + 3; \
                const ptrdiff_t stride = (ptrdiff_t)n_keys * PANEL + 8;                   \
                T *p = alloc(sizeof(T) * n_rows * ldp);                                   \
                T *v = alloc(sizeof(T) * n_keys * n_vcols);                               \
                T *vp = alloc(sizeof(T) * (n_vcols / PANEL) * stride);                    \
                T *acc_ref = alloc(sizeof(T) * n_rows * ldacc);                           \
                T *acc_neon = alloc(sizeof(T) * n_rows * ldacc);                          \
                for (int i = 0; i < n_rows * ldp; ++i) {                                  \
                    const double x = uniform();                                           \
                    p[i] = (T)(x < 0.2 ? 0 : x);                                          \
                }                                                                         \
                for (int j = 0; j < n_keys; ++j)                                          \
                    for (int c = 0; c < n_vcols; ++c) {                                   \
                        v[j * n_vcols + c] = (T)normal();                                 \
                        vp[(c / PANEL) * stride + j * PANEL + c % PANEL] = v[j * n_vcols + c]; \
                    }                                                                     \
                for (int i = 0; i < n_rows * ldacc; ++i)                                  \
                    acc_ref[i] = acc_neon[i] = (T)normal();                               \
                REF->pv_##SFX(p, ldp, n_rows, vp, stride, n_keys, n_vcols, acc_ref, ldacc, \
                              NULL, 0);                                                   \
                NEON->pv_##SFX(p, ldp, n_rows, vp, stride, n_keys, n_vcols, acc_neon,     \
                               ldacc, NULL, 0);                                           \
                for (int i = 0; i < n_rows; ++i)                                          \
                    for (int c = 0; c < ldacc; ++c) {                                     \
                        double magnitude = fabs((double)acc_ref[i * ldacc + c]);          \
                        for (int j = 0; c < n_vcols && j < n_keys; ++j)                   \
                            magnitude += fabs((double)p[i * ldp + j] * v[j * n_vcols + c]); \
                        CHECK(close_to(acc_neon[i * ldacc + c], acc_ref[i * ldacc + c],   \
                                       2 * (n_keys + 2) * EPS * magnitude),               \
                              "n_keys=%d n_vcols=%d n_rows=%d at (%d, %d)", n_keys,       \
                              n_vcols, n_rows, i, c);                                     \
                    }                                                                     \
                free(p); free(v); free(vp); free(acc_ref); free(acc_neon);                \
            }                                                                             \
}                                                                                         \
                                                                                          \
/* a row of n: variant 0 plain, 1 with -inf entries, 2 all -inf, 3 with a NaN */          \
static void fill_row_##SFX(T *x, int n, int variant)                                      \
{                                                                                         \
    for (int j = 0; j < n; ++j) {                                                         \
        x[j] = (T)(4 * normal());                                                         \
        if ((variant == 1 && uniform() < 0.4) || variant == 2)                            \
            x[j] = -INFINITY;                                                             \
    }                                                                                     \
    if (variant == 3 && n > 0)                                                            \
        x[(int)(uniform() * n)] = NAN;                                                    \
}                                                                                         \
                                                                                          \
static void check_row_max_exp_sum_##SFX(void)                                             \
{                                                                                         \
    begin("row_max_" #SFX " / exp_sum_" #SFX);                                            \
    for (int n = 0; n <= 40; ++n)                                                         \
        for (int variant = 0; variant < 4; ++variant) {                                   \
            T *x = alloc(sizeof(T) * (n + 1)), *y_ref = alloc(sizeof(T) * (n + 1));      \
            T *y_neon = alloc(sizeof(T) * (n + 1));                                       \
            fill_row_##SFX(x, n, variant);                                                \
            const T max_ref = REF->row_max_##SFX(x, n);                                   \
            const T max_neon = NEON->row_max_##SFX(x, n);                                 \
            CHECK(same_f64(max_neon, max_ref), "row max n=%d variant=%d: %g vs %g", n,    \
                  variant, (double)max_neon, (double)max_ref);                            \
            const T shifts[2] = {isinf(max_ref) ? 0 : max_ref, (T)NAN};                   \
            for (int si = 0; si < 2; ++si) {                                              \
                memcpy(y_ref, x, sizeof(T) * n);                                          \
                memcpy(y_neon, x, sizeof(T) * n);                                         \
                const T sum_ref = REF->exp_sum_##SFX(y_ref, n, shifts[si]);               \
                const T sum_neon = NEON->exp_sum_##SFX(y_neon, n, shifts[si]);            \
                double magnitude = 0;                                                     \
                for (int j = 0; j < n; ++j) {                                             \
                    CHECK(close_to(y_neon[j], y_ref[j], 4 * EPS * fabs((double)y_ref[j])), \
                          "exp n=%d variant=%d at %d: %g vs %g", n, variant, j,           \
                          (double)y_neon[j], (double)y_ref[j]);                           \
                    magnitude += isnan(y_ref[j]) ? 0 : fabs((double)y_ref[j]);            \
                }                                                                         \
                CHECK(close_to(sum_neon, sum_ref, (n + 4) * 4 * EPS * magnitude),         \
                      "sum n=%d variant=%d: %g vs %g", n, variant, (double)sum_neon,      \
                      (double)sum_ref);                                                   \
            }                                                                             \
            free(x); free(y_ref); free(y_neon);                                           \
        }                                                                                 \
}                                                                                         \
                                                                                          \
static void check_divide_rows_##SFX(void)                                                 \
{                                                                                         \
    /* bitwise the portable division, every tail length, rows ld apart; the               \
       last two rows' values and divisors lie across both edges of the ranges             \
       where quotients come from multiplies (kernels_simd_typed.h) */                     \
    begin("divide_rows_" #SFX);                                                           \
    enum { ROWS = 5, LD_ACC = 48, LD_OUT = 45 };                                          \
    const double b_range = sizeof(T) == 4 ? 0x1p20 : 0x1p200;                             \
    const double log_q = sizeof(T) == 4 ? 40 : 400;                                       \
    int outcomes = 0;                                                                     \
    for (int n = 0; n <= 40; ++n) {                                                       \
        T acc[ROWS * LD_ACC], out_ref[ROWS * LD_OUT], out_neon[ROWS * LD_OUT];            \
        const T divisor[ROWS] = {(T)(1 + uniform()), (T)3, (T)1e-38,                      \
                                 (T)(b_range * (1 - uniform() / 4)),                      \
                                 (T)(-b_range * (1 + uniform()))};                        \
        for (int i = 0; i < ROWS * LD_ACC; ++i)                                           \
            acc[i] = (T)normal();                                                         \
        for (int i = 3 * LD_ACC; i < ROWS * LD_ACC; ++i)                                  \
            acc[i] = (T)(acc[i] * exp2((2 * uniform() - 1) * 1.2 * log_q));               \
        if (n > 2) {                                                                      \
            acc[LD_ACC] = (T)INFINITY;                                                    \
            acc[LD_ACC + 1] = (T)NAN;                                                     \
            acc[LD_ACC + 2] = (T)-0.0;                                                    \
        }                                                                                 \
        if (n % 3 == 2) {                                                                 \
            /* quotients all finite: no inf or NaN, and row 2 (divisor near               \
               the smallest normal number) kept small */                                  \
            for (int i = 0; i < LD_ACC; ++i) {                                            \
                if (!isfinite(acc[LD_ACC + i]))                                           \
                    acc[LD_ACC + i] = 0;                                                  \
                acc[2 * LD_ACC + i] = (T)(fmax(-1, fmin(1, acc[2 * LD_ACC + i]))          \
                                          * (sizeof(T) == 4 ? 1 : 1e-3));                 \
            }                                                                             \
        }                                                                                 \
        for (int i = 0; i < ROWS * LD_OUT; ++i)                                           \
            out_ref[i] = out_neon[i] = (T)5;                                              \
        const int flag_ref = REF->divide_rows_##SFX(acc, LD_ACC, ROWS, n, divisor,        \
                                                    out_ref, LD_OUT);                     \
        const int flag_neon = NEON->divide_rows_##SFX(acc, LD_ACC, ROWS, n, divisor,      \
                                                      out_neon, LD_OUT);                  \
        int nonfinite = 0;                                                                \
        for (int i = 0; i < ROWS * LD_OUT; ++i) {                                         \
            CHECK(same_f64(out_neon[i], out_ref[i]), "n=%d at %d: %g vs %g", n, i,        \
                  (double)out_neon[i], (double)out_ref[i]);                               \
            nonfinite |= i % LD_OUT < n && !isfinite(out_ref[i]);                         \
        }                                                                                 \
        /* nonzero exactly when a quotient is inf or NaN */                               \
        CHECK(!flag_neon == !nonfinite && !flag_ref == !nonfinite,                        \
              "n=%d: returned %d (portable %d) with%s inf or NaN quotients", n,           \
              flag_neon, flag_ref, nonfinite ? "" : " no");                               \
        outcomes |= nonfinite ? 2 : 1;                                                    \
    }                                                                                     \
    CHECK(outcomes == 3, "cases with and without inf or NaN quotients: %d", outcomes);    \
}                                                                                         \
                                                                                          \
static void check_direct_##SFX(void)                                                      \
{                                                                                         \
    begin("score_direct_" #SFX " / pv_direct_" #SFX);                                     \
    const int key_counts[] = {1, 2, 3, 4, 5, 9, 70};                                      \
    for (int width = 1; width <= 135; width += width < 35 ? 1 : 31)                       \
        for (int ki = 0; ki < 7; ++ki) {                                                  \
            const int n_keys = key_counts[ki], n_rows = 3, ld = width + 3;                \
            const int lds = n_keys + 2, ldacc = (width + 15) / 16 * 16 + 16;             \
            T *q = alloc(sizeof(T) * n_rows * ld), *k = alloc(sizeof(T) * n_keys * ld);   \
            T *s_ref = alloc(sizeof(T) * n_rows * lds), *s_neon = alloc(sizeof(T) * n_rows * lds); \
            T *acc_ref = alloc(sizeof(T) * n_rows * ldacc);                               \
            T *acc_neon = alloc(sizeof(T) * n_rows * ldacc);                              \
            for (int i = 0; i < n_rows * ld; ++i)                                         \
                q[i] = (T)normal();                                                       \
            for (int i = 0; i < n_keys * ld; ++i)                                         \
                k[i] = (T)normal();                                                       \
            const T factor = (T)-0.61;                                                    \
            REF->score_direct_##SFX(q, ld, n_rows, k, ld, n_keys, width, factor, s_ref, lds, \
                                    k, ld * (ptrdiff_t)sizeof(T), 64);                    \
            NEON->score_direct_##SFX(q, ld, n_rows, k, ld, n_keys, width, factor, s_neon, \
                                     lds, k, ld * (ptrdiff_t)sizeof(T), 64);              \
            for (int r = 0; r < n_rows; ++r)                                              \
                for (int j = 0; j < n_keys; ++j) {                                        \
                    double magnitude = 0;                                                 \
                    for (int c = 0; c < width; ++c)                                       \
                        magnitude += fabs((double)q[r * ld + c] * k[j * ld + c]);         \
                    CHECK(close_to(s_neon[r * lds + j], s_ref[r * lds + j],               \
                                   2 * (width + 2) * EPS * magnitude * 0.61),             \
                          "score d_k=%d n_keys=%d at (%d, %d)", width, n_keys, r, j);     \
                }                                                                         \
            /* P.V: q as the weights (with zeros), k as the values; a value row         \
               whose weights are all 0 takes no part, NaN or not */                      \
            T *p = alloc(sizeof(T) * n_rows * n_keys);                                    \
            for (int i = 0; i < n_rows * n_keys; ++i) {                                   \
                const double x = uniform();                                               \
                p[i] = (T)(x < 0.25 || i % n_keys == 0 ? 0 : x);                          \
            }                                                                             \
            for (int c = 0; c < ld; ++c)                                                  \
                k[c] = NAN;                                                               \
            for (int i = 0; i < n_rows * ldacc; ++i)                                      \
                acc_ref[i] = acc_neon[i] = (T)normal();                                   \
            REF->pv_direct_##SFX(p, n_keys, n_rows, k, ld, n_keys, width, acc_ref, ldacc, \
                                 NULL, 0, 0);                                             \
            NEON->pv_direct_##SFX(p, n_keys, n_rows, k, ld, n_keys, width, acc_neon,      \
                                  ldacc, k, ld * (ptrdiff_t)sizeof(T), 64);               \
            for (int r = 0; r < n_rows; ++r)                                              \
                for (int c = 0; c < ldacc; ++c) {                                         \
                    if (c >= width && c < (width + 15) / 16 * 16)                         \
                        continue; /* may be rewritten with its own value */               \
                    double magnitude = fabs((double)acc_ref[r * ldacc + c]);              \
                    for (int j = 1; c < width && j < n_keys; ++j)                         \
                        magnitude += fabs((double)p[r * n_keys + j] * k[j * ld + c]);     \
                    CHECK(close_to(acc_neon[r * ldacc + c], acc_ref[r * ldacc + c],       \
                                   2 * (n_keys + 2) * EPS * magnitude),                   \
                          "pv d_v=%d n_keys=%d at (%d, %d): %g vs %g", width, n_keys, r, c, \
                          (double)acc_neon[r * ldacc + c], (double)acc_ref[r * ldacc + c]); \
                }                                                                         \
            free(q); free(k); free(s_ref); free(s_neon); free(acc_ref); free(acc_neon);   \
            free(p);                                                                      \
        }                                                                                 \
}

DEFINE_TYPED_CHECKS(float, f32, CA_PANEL_F32, 0x1.0p-23)
DEFINE_TYPED_CHECKS(double, f64, CA_PANEL_F64, 0x1.0p-52)

/* ---- float32 only ---- */

/* float16 or bfloat16 rows converted to float32: every 16-bit value, in
   rows of 32, then random rows, contiguous and strided */
typedef void (*rows_to_f32)(const uint16_t *, ptrdiff_t, ptrdiff_t, ptrdiff_t, ptrdiff_t,
                            float *, ptrdiff_t);

static void check_rows_16(const char *name, rows_to_f32 ref, rows_to_f32 neon)
{
    begin(name);
    uint16_t *every = alloc(sizeof(uint16_t) * 65536);
    float *dst_ref = alloc(sizeof(float) * 65536 * 2), *dst_neon = alloc(sizeof(float) * 65536 * 2);
    for (int i = 0; i < 65536; ++i)
        every[i] = (uint16_t)i;
    ref(every, 32, 1, 2048, 32, dst_ref, 32);
    neon(every, 32, 1, 2048, 32, dst_neon, 32);
    for (int i = 0; i < 65536; ++i)
        CHECK(same_f32(dst_neon[i], dst_ref[i]), "value %#06x: %g vs %g", i,
              (double)dst_neon[i], (double)dst_ref[i]);
    for (int n_cols = 1; n_cols <= 40; ++n_cols)
        for (int src_col = 1; src_col <= 2; ++src_col) {
            const int n_rows = 3, src_row = 2 * n_cols + 1, ld = n_cols + 1;
            for (int i = 0; i < n_rows * src_row; ++i)
                every[i] = (uint16_t)(uniform() * 65536);
            for (int i = 0; i < n_rows * ld; ++i)
                dst_ref[i] = dst_neon[i] = 9.0f;
            ref(every, src_row, src_col, n_rows, n_cols, dst_ref, ld);
            neon(every, src_row, src_col, n_rows, n_cols, dst_neon, ld);
            for (int i = 0; i < n_rows * ld; ++i)
                CHECK(same_f32(dst_neon[i], dst_ref[i]), "n_cols=%d src_col=%d at %d", n_cols,
                      src_col, i);
        }
    free(every); free(dst_ref); free(dst_neon);
}

/* float16 or bfloat16 K and V read in place: for each table, the bits of
   its float32 kernels on the converted rows (random values, some of them
   NaN, inf, subnormal or zero) */
static void check_direct_16(int bfloat16)
{
    begin(bfloat16 ? "score_direct_bf16 / pv_direct_bf16"
                   : "score_direct_f16 / pv_direct_f16");
    const ca_kernels *tables[2] = {REF, NEON};
    const int key_counts[] = {1, 3, 4, 5, 9, 70};
    /* +inf, NaN, a subnormal, -0, then ordinary values around 1 */
    const uint16_t edges[2][4] = {{0x7C00, 0x7E00, 0x0003, 0x8000},
                                  {0x7F80, 0x7FC0, 0x0003, 0x8000}};
    for (int width = 1; width <= 135; width += width < 35 ? 1 : 31)
        for (int ki = 0; ki < 6; ++ki) {
            const int n_keys = key_counts[ki], n_rows = 3, ld = width + 3;
            const int lds = n_keys + 2, ldacc = (width + 15) / 16 * 16 + 16;
            float *q = alloc(sizeof(float) * n_rows * ld), *p = alloc(sizeof(float) * n_rows * n_keys);
            uint16_t *kv = alloc(sizeof(uint16_t) * n_keys * ld);
            float *kv32 = alloc(sizeof(float) * n_keys * ld);
            float *s16 = alloc(sizeof(float) * n_rows * lds), *s32 = alloc(sizeof(float) * n_rows * lds);
            float *acc16 = alloc(sizeof(float) * n_rows * ldacc);
            float *acc32 = alloc(sizeof(float) * n_rows * ldacc);
            for (int i = 0; i < n_rows * ld; ++i)
                q[i] = (float)normal();
            for (int i = 0; i < n_keys * ld; ++i) {
                const double u = uniform();
                const int ordinary = bfloat16 ? 0x3F00 + (int)(uniform() * 0x100)
                                              : 0x3000 + (int)(uniform() * 0x1800);
                kv[i] = u < 0.02 ? edges[bfloat16][0] : u < 0.04 ? edges[bfloat16][1]
                        : u < 0.06 ? edges[bfloat16][2] : u < 0.08 ? edges[bfloat16][3]
                        : (uint16_t)ordinary;
                kv32[i] = bfloat16 ? ca_bfloat16_to_float(kv[i]) : ca_half_to_float(kv[i]);
            }
            for (int i = 0; i < n_rows * n_keys; ++i) {
                const double x = uniform();
                p[i] = (float)(x < 0.25 || i % n_keys == 0 ? 0 : x);
            }
            for (int t = 0; t < 2; ++t) {
                const ca_kernels *kern = tables[t];
                (bfloat16 ? kern->score_direct_bf16 : kern->score_direct_f16)(
                    q, ld, n_rows, kv, ld, n_keys, width, -0.61f, s16, lds, kv, ld * 2, 64);
                kern->score_direct_f32(q, ld, n_rows, kv32, ld, n_keys, width, -0.61f, s32, lds,
                                       kv32, ld * 4, 64);
                for (int i = 0; i < n_rows * lds; ++i)
                    CHECK(same_f32(s16[i], s32[i]), "%s score d_k=%d n_keys=%d at %d: %g vs %g",
                          kern->name, width, n_keys, i, (double)s16[i], (double)s32[i]);
                for (int i = 0; i < n_rows * ldacc; ++i)
                    acc16[i] = acc32[i] = (float)(i % 7) - 3.0f;
                (bfloat16 ? kern->pv_direct_bf16 : kern->pv_direct_f16)(
                    p, n_keys, n_rows, kv, ld, n_keys, width, acc16, ldacc, kv, ld * 2, 64);
                kern->pv_direct_f32(p, n_keys, n_rows, kv32, ld, n_keys, width, acc32, ldacc,
                                    kv32, ld * 4, 64);
                for (int i = 0; i < n_rows * ldacc; ++i)
                    CHECK(same_f32(acc16[i], acc32[i]), "%s pv d_v=%d n_keys=%d at %d: %g vs %g",
                          kern->name, width, n_keys, i, (double)acc16[i], (double)acc32[i]);
            }
            free(q); free(p); free(kv); free(kv32); free(s16); free(s32); free(acc16);
            free(acc32);
        }
}

static void check_int8(void)
{
    begin("int8_rows_to_f32 / score_direct_i8 / pv_direct_i8");
    static const float scales[8] = {0.0371f, -2.5f, 0.0f, 1e-30f, 3e36f, 1.0f, 0.5f, 7.0f};
    for (int n_cols = 1; n_cols <= 40; ++n_cols)
        for (int src_col = 1; src_col <= 2; ++src_col) {
            const int n_rows = 8, src_row = 2 * n_cols + 1;
            int8_t *src = alloc((size_t)n_rows * src_row);
            float *dst_ref = alloc(sizeof(float) * n_rows * n_cols);
            float *dst_neon = alloc(sizeof(float) * n_rows * n_cols);
            for (int i = 0; i < n_rows * src_row; ++i)
                src[i] = (int8_t)(i % 256 - 128);
            REF->int8_rows_to_f32(src, src_row, src_col, n_rows, n_cols, scales, 1, dst_ref, n_cols);
            NEON->int8_rows_to_f32(src, src_row, src_col, n_rows, n_cols, scales, 1, dst_neon,
                                   n_cols);
            for (int i = 0; i < n_rows * n_cols; ++i)
                CHECK(same_f32(dst_neon[i], dst_ref[i]), "rows n_cols=%d at %d", n_cols, i);
            free(src); free(dst_ref); free(dst_neon);
        }
    /* 70 keys: P.V sums a run of CA_SUM_KEYS, then the rest */
    static const int int8_keys[] = {1, 5, 9, 70};
    for (int width = 1; width <= 135; width += width < 35 ? 1 : 31)
        for (int key_case = 0; key_case < 4; ++key_case) {
            const int n_keys = int8_keys[key_case];
            const int n_rows = 2;
            /* q, later the weights (n_rows x n_keys) */
            const int q_size = n_rows * (width > n_keys ? width : n_keys);
            float *q = alloc(sizeof(float) * q_size);
            int8_t *k = alloc((size_t)n_keys * width);
            float *scale = alloc(sizeof(float) * n_keys);
            float *s_ref = alloc(sizeof(float) * n_rows * n_keys);
            float *s_neon = alloc(sizeof(float) * n_rows * n_keys);
            float *acc_ref = alloc(sizeof(float) * n_rows * width);
            float *acc_neon = alloc(sizeof(float) * n_rows * width);
            for (int i = 0; i < q_size; ++i)
                q[i] = (float)normal();
            for (int i = 0; i < n_rows * width; ++i)
                acc_ref[i] = acc_neon[i] = (float)normal();
            for (int i = 0; i < n_keys * width; ++i)
                k[i] = (int8_t)(uniform() * 256 - 128);
            for (int j = 0; j < n_keys; ++j)
                scale[j] = (float)(uniform() * 0.05);
            REF->score_direct_i8(q, width, n_rows, k, width, n_keys, width, 0.7f, scale, 1,
                                 s_ref, n_keys);
            NEON->score_direct_i8(q, width, n_rows, k, width, n_keys, width, 0.7f, scale, 1,
                                  s_neon, n_keys);
            for (int r = 0; r < n_rows; ++r)
                for (int j = 0; j < n_keys; ++j) {
                    double magnitude = 0;
                    for (int c = 0; c < width; ++c)
                        magnitude += fabs((double)q[r * width + c] * k[j * width + c]);
                    CHECK(close_to(s_neon[r * n_keys + j], s_ref[r * n_keys + j],
                                   2 * (width + 3) * 0x1.0p-23 * magnitude * scale[j]),
                          "score d_k=%d n_keys=%d", width, n_keys);
                }
            /* weights: the first n_keys entries of q, made non-negative */
            for (int i = 0; i < n_rows * n_keys; ++i)
                q[i] = fabsf(q[i]) < 0.3f ? 0.0f : fabsf(q[i]);
            REF->pv_direct_i8(q, n_keys, n_rows, k, width, n_keys, width, scale, 1, acc_ref, width);
            NEON->pv_direct_i8(q, n_keys, n_rows, k, width, n_keys, width, scale, 1, acc_neon,
                               width);
            for (int r = 0; r < n_rows; ++r)
                for (int c = 0; c < width; ++c) {
                    double magnitude = fabs((double)acc_ref[r * width + c]);
                    for (int j = 0; j < n_keys; ++j)
                        magnitude += fabs((double)q[r * n_keys + j] * scale[j] * k[j * width + c]);
                    CHECK(close_to(acc_neon[r * width + c], acc_ref[r * width + c],
                                   2 * (n_keys + 3) * 0x1.0p-23 * magnitude),
                          "pv d_v=%d n_keys=%d", width, n_keys);
                }
            free(q); free(k); free(scale); free(s_ref); free(s_neon); free(acc_ref);
            free(acc_neon);
        }
}

/* fp8 codes widened here, not by scalar.c: E4M3FN (bias 7, subnormals of
   2^-9, no infinities, NaN at S.1111.111) and E5M2 (bias 15, the upper byte
   of a binary16) */
static float fp8_value(uint8_t code, int format)
{
    const int negative = code >> 7;
    float magnitude;
    if (format == CA_FP8_E4M3FN) {
        const int exponent = (code >> 3) & 0xF, mantissa = code & 0x7;
        if ((code & 0x7F) == 0x7F)
            return negative ? -NAN : NAN;
        magnitude = exponent == 0 ? ldexpf((float)mantissa, -9)
                                  : ldexpf(1.0f + mantissa / 8.0f, exponent - 7);
    } else {
        const int exponent = (code >> 2) & 0x1F, mantissa = code & 0x3;
        if (exponent == 31)
            magnitude = mantissa ? NAN : INFINITY;
        else
            magnitude = exponent == 0 ? ldexpf((float)mantissa, -16)
                                      : ldexpf(1.0f + mantissa / 4.0f, exponent - 15);
    }
    return negative ? -magnitude : magnitude;
}

/* a random code of the format that is neither NaN nor infinite */
static uint8_t fp8_finite_code(int format)
{
    for (;;) {
        const uint8_t code = (uint8_t)(uniform() * 256);
        if (isfinite(fp8_value(code, format)))
            return code;
    }
}

/* fp8 K/V: fp8_rows_to_f32 bit for bit the portable table's and the exact
   product of the widened code and its row's scale (every code of both
   formats times scales of every kind, every tail, contiguous and strided,
   one scale for all rows and one per row); the direct kernels within a
   rounding bound of the portable ones, NaN codes (and E5M2's infinities)
   giving NaN and infinities in the same places, keys of weight 0 (by the
   weight or by the scale) skipped, NaN codes or not, nothing written past
   n_keys or past d_v rounded up to 16, codes past d_k / d_v never read */
static void check_fp8(void)
{
    begin("fp8_rows_to_f32 / score_direct_fp8 / pv_direct_fp8");
    static const char *const format_names[2] = {"e4m3fn", "e5m2"};
    static const float largest[2] = {448.0f, 57344.0f};
    /* NaN in both formats (S.1111.111), and E5M2's infinities */
    static const uint8_t nan_codes[2] = {0x7F, 0xFF}, inf_codes[2] = {0x7C, 0xFC};
    for (int format = 0; format < 2; ++format) {
        const char *fmt = format_names[format];
        /* the codes themselves */
        for (int code = 0; code < 256; ++code) {
            const float got = ca_e4m3fn_to_float((uint8_t)code);
            const float got5 = ca_e5m2_to_float((uint8_t)code);
            CHECK(same_f32(format ? got5 : got, fp8_value((uint8_t)code, format)),
                  "%s code %#04x widens to %g, not %g", fmt, code,
                  (double)(format ? got5 : got), (double)fp8_value((uint8_t)code, format));
        }
        const float scales[16] = {0.0371f, -2.5f, 0.0f, -0.0f, 1e-40f, 0x1p-149f, 0x1p-126f,
                                  1e-30f, FLT_MAX / largest[format],
                                  -(FLT_MAX / largest[format]), 3e33f, 1.0f, 0.5f, 7.0f,
                                  1.7e-38f, 0x1p-140f};
        /* every code (a row of each) times every scale, then random rows of
           every tail length */
        enum { MAX_COLS = 256 };
        uint8_t *src = alloc(16 * 2 * MAX_COLS + 16);
        float *scale = alloc(sizeof(float) * 16 * 3);
        float *dst_ref = alloc(sizeof(float) * 16 * (MAX_COLS + 1));
        float *dst_neon = alloc(sizeof(float) * 16 * (MAX_COLS + 1));
        for (int n_cols = 1; n_cols <= 41; ++n_cols)
            for (int src_col = 1; src_col <= 2; ++src_col)
                for (int stride = 0; stride <= 3; stride += 3) {
                    /* n_cols 41: the 256 codes in each of 16 rows */
                    const int every = n_cols == 41;
                    if (every && src_col == 2)
                        continue;
                    const int cols = every ? 256 : n_cols;
                    const int n_rows = every ? 16 : 3, src_row = 2 * cols + 1, ld = cols + 1;
                    for (int r = 0; r < n_rows; ++r)
                        for (int c = 0; c < src_row; ++c)
                            src[r * src_row + c] = every ? (uint8_t)(c / src_col)
                                                         : (uint8_t)(uniform() * 256);
                    for (int i = 0; i < 16 * 3; ++i)
                        scale[i] = scales[(i / 3 + n_cols) % 16];
                    for (int i = 0; i < n_rows * ld; ++i)
                        dst_ref[i] = dst_neon[i] = 9.0f;
                    REF->fp8_rows_to_f32(src, src_row, src_col, n_rows, cols, format, scale,
                                         stride, dst_ref, ld);
                    NEON->fp8_rows_to_f32(src, src_row, src_col, n_rows, cols, format, scale,
                                          stride, dst_neon, ld);
                    for (int r = 0; r < n_rows; ++r)
                        for (int c = 0; c < ld; ++c) {
                            const uint8_t code = src[r * src_row + c * src_col];
                            const float row_scale = scale[r * stride];
                            const float exact = c < cols ? fp8_value(code, format) * row_scale
                                                         : 9.0f;
                            const int i = r * ld + c;
                            CHECK(same_f32(dst_ref[i], exact),
                                  "portable rows %s n_cols=%d src_col=%d scale_stride=%d "
                                  "at (%d, %d) code %#04x scale %g: %g vs %g", fmt, cols,
                                  src_col, stride, r, c, code, (double)row_scale,
                                  (double)dst_ref[i], (double)exact);
                            CHECK(same_f32(dst_neon[i], exact),
                                  "rows %s n_cols=%d src_col=%d scale_stride=%d at (%d, %d) "
                                  "code %#04x scale %g: %g vs %g", fmt, cols, src_col, stride,
                                  r, c, code, (double)row_scale, (double)dst_neon[i],
                                  (double)exact);
                        }
                }
        free(src); free(scale); free(dst_ref); free(dst_neon);

        /* score_direct_fp8 */
        static const int score_keys[5] = {1, 3, 4, 5, 9};
        static const int score_widths[3] = {64, 127, 128};     /* after 1 .. 35 */
        int score_case = 0;
        for (int wi = 0; wi < 35 + 3; ++wi)
            for (int ki = 0; ki < 5; ++ki)
                for (int n_rows = 1; n_rows <= 3; ++n_rows) {
                    const int d_k = wi < 35 ? wi + 1 : score_widths[wi - 35];
                    const int n_keys = score_keys[ki], ldq = d_k + 1, ldk = d_k + 3;
                    const int lds = n_keys + 2;
                    const int stride = ++score_case % 4 == 0 ? 0 : 2;
                    float *q = alloc(sizeof(float) * n_rows * ldq);
                    uint8_t *k = alloc((size_t)n_keys * ldk);
                    float *key_scale = alloc(sizeof(float) * 2 * n_keys);
                    float *s_ref = alloc(sizeof(float) * n_rows * lds);
                    float *s_neon = alloc(sizeof(float) * n_rows * lds);
                    for (int i = 0; i < n_rows * ldq; ++i)
                        q[i] = (float)normal();
                    for (int j = 0; j < n_keys; ++j)
                        for (int c = 0; c < ldk; ++c)
                            k[j * ldk + c] = c < d_k ? fp8_finite_code(format) : 0x7F;
                    if (n_keys >= 3 && score_case % 3 == 0) {
                        k[ldk + (int)(uniform() * d_k)] = nan_codes[score_case % 2];
                        if (format == CA_FP8_E5M2)
                            k[2 * ldk + (int)(uniform() * d_k)] = inf_codes[score_case % 2];
                    }
                    for (int i = 0; i < 2 * n_keys; ++i)
                        key_scale[i] = (float)(uniform() * 0.05 + 1e-3);
                    if (n_keys == 9 && stride)
                        key_scale[2 * stride] = 0.0f;   /* a key of scale 0 */
                    for (int i = 0; i < n_rows * lds; ++i)
                        s_ref[i] = s_neon[i] = 5.0f;
                    const void *ahead = score_case % 2 ? k : NULL;
                    REF->score_direct_fp8(q, ldq, n_rows, k, ldk, n_keys, d_k, format, -0.61f,
                                          key_scale, stride, s_ref, lds, ahead, ldk, 64);
                    NEON->score_direct_fp8(q, ldq, n_rows, k, ldk, n_keys, d_k, format, -0.61f,
                                           key_scale, stride, s_neon, lds, ahead, ldk, 64);
                    for (int r = 0; r < n_rows; ++r)
                        for (int j = 0; j < lds; ++j) {
                            const int i = r * lds + j;
                            if (j >= n_keys) {
                                CHECK(same_f32(s_neon[i], 5.0f) && same_f32(s_ref[i], 5.0f),
                                      "score %s d_k=%d n_keys=%d: wrote s past n_keys", fmt,
                                      d_k, n_keys);
                                continue;
                            }
                            double magnitude = 0;
                            for (int c = 0; c < d_k; ++c) {
                                const float x = fp8_value(k[j * ldk + c], format);
                                magnitude += isfinite(x) ? fabs((double)q[r * ldq + c] * x) : 0;
                            }
                            magnitude *= 0.61 * key_scale[j * stride];
                            CHECK(close_to(s_neon[i], s_ref[i],
                                           2 * (d_k + 3) * 0x1.0p-23 * magnitude),
                                  "score %s d_k=%d n_keys=%d n_rows=%d scale_stride=%d at "
                                  "(%d, %d): %g vs %g", fmt, d_k, n_keys, n_rows, stride, r, j,
                                  (double)s_neon[i], (double)s_ref[i]);
                        }
                    free(q); free(k); free(key_scale); free(s_ref); free(s_neon);
                }

        /* pv_direct_fp8; 70 keys: a run of CA_SUM_KEYS, then the rest; 9
           rows: past the rows of weights the wrapper holds at a time */
        static const int pv_keys[3] = {1, 6, 70};
        static const int pv_widths[4] = {127, 128, 129, 200};  /* after 1 .. 35 */
        int pv_case = 0;
        for (int wi = 0; wi < 35 + 4; ++wi)
            for (int ki = 0; ki < 3; ++ki)
                for (int n_rows = 2; n_rows <= 9; n_rows = n_rows == 2 ? 8 : n_rows + 1) {
                    const int d_v = wi < 35 ? wi + 1 : pv_widths[wi - 35];
                    if (n_rows == 9 && d_v != 33 && d_v != 129)
                        continue;
                    const int n_keys = pv_keys[ki], ldv = d_v + 1;
                    const int rounded = (d_v + 15) / 16 * 16, ldacc = rounded + 16;
                    const int stride = ++pv_case % 3 == 0 ? 0 : 1;
                    float *p = alloc(sizeof(float) * n_rows * n_keys);
                    uint8_t *v = alloc((size_t)n_keys * ldv);
                    float *key_scale = alloc(sizeof(float) * n_keys);
                    float *acc0 = alloc(sizeof(float) * n_rows * ldacc);
                    float *acc_ref = alloc(sizeof(float) * n_rows * ldacc);
                    float *acc_neon = alloc(sizeof(float) * n_rows * ldacc);
                    for (int i = 0; i < n_rows * n_keys; ++i) {
                        const double x = uniform();
                        /* key 0 has weight 0 in every row */
                        p[i] = (float)(x < 0.25 || i % n_keys == 0 ? 0 : x);
                    }
                    for (int j = 0; j < n_keys; ++j)
                        for (int c = 0; c < ldv; ++c)
                            v[j * ldv + c] = j == 0 ? nan_codes[pv_case % 2]
                                             : c < d_v ? fp8_finite_code(format) : 0x7F;
                    for (int j = 0; j < n_keys; ++j)
                        key_scale[j] = (float)(uniform() * 0.05 + 1e-3);
                    if (n_keys >= 6 && stride) {
                        /* weight 0 by its scale: a NaN code there takes no part */
                        key_scale[2] = 0.0f;
                        v[2 * ldv + (int)(uniform() * d_v)] = nan_codes[pv_case % 2];
                        if (format == CA_FP8_E5M2)
                            v[4 * ldv + (int)(uniform() * d_v)] = inf_codes[pv_case % 2];
                    }
                    for (int i = 0; i < n_rows * ldacc; ++i)
                        acc0[i] = acc_ref[i] = acc_neon[i] = (float)normal();
                    const void *ahead = pv_case % 2 ? v : NULL;
                    REF->pv_direct_fp8(p, n_keys, n_rows, v, ldv, n_keys, d_v, format,
                                       key_scale, stride, acc_ref, ldacc, ahead, ldv, 64);
                    NEON->pv_direct_fp8(p, n_keys, n_rows, v, ldv, n_keys, d_v, format,
                                        key_scale, stride, acc_neon, ldacc, ahead, ldv, 64);
                    for (int r = 0; r < n_rows; ++r)
                        for (int c = 0; c < ldacc; ++c) {
                            const int i = r * ldacc + c;
                            if (c >= d_v && c < rounded)
                                continue; /* may be rewritten */
                            if (c >= rounded) {
                                CHECK(same_f32(acc_neon[i], acc0[i])
                                      && same_f32(acc_ref[i], acc0[i]),
                                      "pv %s d_v=%d n_keys=%d: wrote past d_v rounded up", fmt,
                                      d_v, n_keys);
                                continue;
                            }
                            double magnitude = fabs((double)acc0[i]);
                            for (int j = 0; j < n_keys; ++j) {
                                const float x = fp8_value(v[j * ldv + c], format);
                                const float w = p[r * n_keys + j] * key_scale[j * stride];
                                magnitude += w != 0 && isfinite(x) ? fabs((double)w * x) : 0;
                            }
                            CHECK(close_to(acc_neon[i], acc_ref[i],
                                           2 * (n_keys + 3) * 0x1.0p-23 * magnitude),
                                  "pv %s d_v=%d n_keys=%d n_rows=%d scale_stride=%d at "
                                  "(%d, %d): %g vs %g", fmt, d_v, n_keys, n_rows, stride, r, c,
                                  (double)acc_neon[i], (double)acc_ref[i]);
                        }
                    free(p); free(v); free(key_scale); free(acc0); free(acc_ref);
                    free(acc_neon);
                }
    }
}

static void check_softcap(void)
{
    begin("softcap_f32");
    static const float edges[] = {0.0f, -0.0f, 0.3f, -0.49f, 0.5f, -0.51f, 1e-30f, INFINITY,
                                  -INFINITY, NAN, 80.0f, -80.0f, 3e38f};
    for (int n = 0; n <= 40; ++n)
        for (int ci = 0; ci < 2; ++ci) {
            const float cap = ci ? 30.0f : 2.5f;
            float *x_ref = alloc(sizeof(float) * (n + 1)), *x_neon = alloc(sizeof(float) * (n + 1));
            for (int j = 0; j < n; ++j)
                x_ref[j] = x_neon[j] = j < 13 && (n + j) % 3 == 0 ? edges[j]
                                                                  : (float)(6 * normal());
            REF->softcap_f32(x_ref, n, cap);
            NEON->softcap_f32(x_neon, n, cap);
            for (int j = 0; j < n; ++j)
                CHECK(close_to(x_neon[j], x_ref[j], 8 * 0x1.0p-23 * cap),
                      "n=%d cap=%g at %d: %g vs %g", n, (double)cap, j, (double)x_neon[j],
                      (double)x_ref[j]);
            free(x_ref); free(x_neon);
        }
}

static void check_packing(void)
{
    begin("pack_kt_f32 / pack_v_f32");
    for (int n_keys = 1; n_keys <= 40; ++n_keys)
        for (int width = 1; width <= 40; ++width) {
            const int ld = width + 2;
            float *k = alloc(sizeof(float) * n_keys * ld);
            for (int i = 0; i < n_keys * ld; ++i)
                k[i] = (float)normal();
            const ptrdiff_t kt_stride = (ptrdiff_t)width * 16 + 4;
            const size_t kt_size = (size_t)((n_keys + 15) / 16) * kt_stride;
            float *kt_ref = alloc(sizeof(float) * kt_size), *kt_neon = alloc(sizeof(float) * kt_size);
            for (size_t i = 0; i < kt_size; ++i)
                kt_ref[i] = kt_neon[i] = -3.0f;
            REF->pack_kt_f32(k, ld, n_keys, width, kt_ref, kt_stride);
            NEON->pack_kt_f32(k, ld, n_keys, width, kt_neon, kt_stride);
            CHECK(memcmp(kt_ref, kt_neon, sizeof(float) * kt_size) == 0,
                  "pack_kt n_keys=%d d_k=%d", n_keys, width);
            if ((n_keys + width) % 5 == 0)
                k[(int)(uniform() * n_keys) * ld + (int)(uniform() * width)] =
                    width % 3 == 0 ? NAN : width % 3 == 1 ? INFINITY : -INFINITY;
            if (width % 7 == 0)
                for (int j = 0; j < n_keys; ++j)
                    k[j * ld + width] = NAN;    /* past d_v: never read */
            const ptrdiff_t v_stride = (ptrdiff_t)n_keys * 16 + 4;
            const size_t v_size = (size_t)((width + 15) / 16) * v_stride;
            float *v_ref = alloc(sizeof(float) * v_size), *v_neon = alloc(sizeof(float) * v_size);
            for (size_t i = 0; i < v_size; ++i)
                v_ref[i] = v_neon[i] = -3.0f;
            const int flag_ref = REF->pack_v_f32(k, ld, n_keys, width, v_ref, v_stride);
            const int flag_neon = NEON->pack_v_f32(k, ld, n_keys, width, v_neon, v_stride);
            int same = 1;
            for (size_t i = 0; i < v_size; ++i)
                same &= same_f32(v_ref[i], v_neon[i]);
            CHECK(same, "pack_v n_keys=%d d_v=%d", n_keys, width);
            CHECK(!flag_ref == !flag_neon, "pack_v flag n_keys=%d d_v=%d: %d vs %d", n_keys,
                  width, flag_neon, flag_ref);
            free(k); free(kt_ref); free(kt_neon); free(v_ref); free(v_neon);
        }
}

static void check_dispatch(void)
{
    begin("dispatch");
    const char *names[8];
    const int n = ca_available_kernels(names, 8);
    CHECK(n >= 2 && strcmp(names[n - 1], "neon") == 0, "neon is not the best available table");
    CHECK(ca_kernels_by_name("neon") == NEON, "CATTENTION_SIMD=neon would not select it");
    if (getenv("CATTENTION_SIMD") == NULL)
        CHECK(ca_default_kernels() == NEON, "the default table is %s", ca_default_kernels()->name);
    CHECK(NEON->tile_rows > 0 && CA_ROW_QUANTUM % NEON->tile_rows == 0,
          "tile rows %d do not divide %d", NEON->tile_rows, CA_ROW_QUANTUM);
}

int main(void)
{
    check_score_f32();
    check_score_f64();
    check_pv_f32();
    check_pv_f64();
    check_row_max_exp_sum_f32();
    check_row_max_exp_sum_f64();
    check_divide_rows_f32();
    check_divide_rows_f64();
    check_direct_f32();
    check_direct_f64();
    check_rows_16("half_rows_to_f32", REF->half_rows_to_f32, NEON->half_rows_to_f32);
    check_rows_16("bf16_rows_to_f32", REF->bf16_rows_to_f32, NEON->bf16_rows_to_f32);
    check_direct_16(0);
    check_direct_16(1);
    check_int8();
    check_fp8();
    check_softcap();
    check_packing();
    check_dispatch();
    printf("neon against baseline: %d checks, %d failed\n", checks, failures);
    return failures != 0;
}
