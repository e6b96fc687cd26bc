/*
 * AVX2 + FMA (+ F16C) kernels (Haswell and later, Zen and later).
 *
 * Every function carries a target attribute instead of the file being built
 * with -mavx2, so the extension as a whole still runs on any x86-64 and these
 * are only called after dispatch.c has checked CPUID and XGETBV.
 *
 * Register tiles are fixed-size code: a tile of R rows (R <= 6) times two
 * vectors, written once as an always-inline function and instantiated with
 * constant R, so the 12 accumulators stay in registers (AVX2 has 16).
 */
#include "kernels.h"

#if CA_HAVE_X86_KERNELS

#include <immintrin.h>
#include <math.h>

#include "exp_poly.h"

#define CA_AVX2 __attribute__((target("avx2,fma,f16c")))
#define CA_TILE static inline __attribute__((always_inline)) CA_AVX2

#define MR 6

/* Prefetch into L2 of the block the next call reads (see kernels.h), a
   share of it before each register tile so that the requests spread over
   the call instead of queueing at its start. */
typedef struct {
    const char *next;
    ptrdiff_t left;         /* bytes still to prefetch */
    ptrdiff_t per_tile;     /* bytes before each tile, whole cache lines */
} ca_ahead;

CA_TILE ca_ahead ahead_start(const void *ahead, ptrdiff_t ahead_bytes, ptrdiff_t n_tiles)
{
    ca_ahead a = {(const char *)ahead, ahead == NULL ? 0 : ahead_bytes, 0};
    if (a.left > 0 && n_tiles > 0)
        a.per_tile = ((a.left + n_tiles - 1) / n_tiles + 63) & ~(ptrdiff_t)63;
    else
        a.left = 0;
    return a;
}

CA_TILE void ahead_step(ca_ahead *a)
{
    if (a->left <= 0)
        return;
    const ptrdiff_t n = a->per_tile < a->left ? a->per_tile : a->left;
    for (ptrdiff_t b = 0; b < n; b += 64)
        _mm_prefetch(a->next + b, _MM_HINT_T1);
    a->next += n;
    a->left -= n;
}

/* ---- float32 -------------------------------------------------------- */

/* s[0..R) x [0..16) = q[0..R) . kt[:, 0..16) */
CA_TILE void score_tile_f32(const float *q, ptrdiff_t ldq, const float *kt,
                            ptrdiff_t ldkt, ptrdiff_t d_k, float factor,
                            float *s, ptrdiff_t lds, const int R)
{
    __m256 acc_lo[MR], acc_hi[MR];
    for (int r = 0; r < R; ++r) {
        acc_lo[r] = _mm256_setzero_ps();
        acc_hi[r] = _mm256_setzero_ps();
    }
    for (ptrdiff_t c = 0; c < d_k; ++c) {
        const __m256 k_lo = _mm256_loadu_ps(kt + c * ldkt);
        const __m256 k_hi = _mm256_loadu_ps(kt + c * ldkt + 8);
        for (int r = 0; r < R; ++r) {
            const __m256 q_rc = _mm256_broadcast_ss(q + r * ldq + c);
            acc_lo[r] = _mm256_fmadd_ps(q_rc, k_lo, acc_lo[r]);
            acc_hi[r] = _mm256_fmadd_ps(q_rc, k_hi, acc_hi[r]);
        }
    }
    const __m256 factor_v = _mm256_set1_ps(factor);
    for (int r = 0; r < R; ++r) {
        _mm256_storeu_ps(s + r * lds, _mm256_mul_ps(acc_lo[r], factor_v));
        _mm256_storeu_ps(s + r * lds + 8, _mm256_mul_ps(acc_hi[r], factor_v));
    }
}

CA_AVX2 static void score_f32(const float *q, ptrdiff_t ldq, ptrdiff_t n_rows,
                              const float *kt, ptrdiff_t kt_panel_stride, ptrdiff_t n_cols,
                              ptrdiff_t d_k, float factor, float *s, ptrdiff_t lds,
                              const void *ahead, ptrdiff_t ahead_bytes)
{
    ca_ahead next = ahead_start(ahead, ahead_bytes,
                                (n_cols / CA_PANEL_F32) * ((n_rows + MR - 1) / MR));
    for (ptrdiff_t j = 0; j < n_cols; j += CA_PANEL_F32) {
        const float *panel = kt + (j / CA_PANEL_F32) * kt_panel_stride;
        ptrdiff_t i = 0;
        for (; i + MR <= n_rows; i += MR, ahead_step(&next))
            score_tile_f32(q + i * ldq, ldq, panel, CA_PANEL_F32, d_k, factor, s + i * lds + j, lds, MR);
        const float *q_tail = q + i * ldq;
        float *s_tail = s + i * lds + j;
        switch (n_rows - i) {
        case 5: score_tile_f32(q_tail, ldq, panel, CA_PANEL_F32, d_k, factor, s_tail, lds, 5); break;
        case 4: score_tile_f32(q_tail, ldq, panel, CA_PANEL_F32, d_k, factor, s_tail, lds, 4); break;
        case 3: score_tile_f32(q_tail, ldq, panel, CA_PANEL_F32, d_k, factor, s_tail, lds, 3); break;
        case 2: score_tile_f32(q_tail, ldq, panel, CA_PANEL_F32, d_k, factor, s_tail, lds, 2); break;
        case 1: score_tile_f32(q_tail, ldq, panel, CA_PANEL_F32, d_k, factor, s_tail, lds, 1); break;
        default: break;
        }
        if (i < n_rows)
            ahead_step(&next);
    }
}

/* acc[0..R) x [0..16) += p[0..R) x [0..n_keys) . v[0..n_keys) x [0..16) */
CA_TILE void pv_tile_f32(const float *p, ptrdiff_t ldp, const float *v,
                         ptrdiff_t ldv, ptrdiff_t n_keys, float *acc,
                         ptrdiff_t ldacc, const int R)
{
    /* sum this block of keys from zero and add it to acc once: chains of
       at most one block of terms instead of all S keep float32 near NumPy */
    __m256 acc_lo[MR], acc_hi[MR];
    for (int r = 0; r < R; ++r) {
        acc_lo[r] = _mm256_setzero_ps();
        acc_hi[r] = _mm256_setzero_ps();
    }
    for (ptrdiff_t j = 0; j < n_keys; ++j) {
        const __m256 v_lo = _mm256_loadu_ps(v + j * ldv);
        const __m256 v_hi = _mm256_loadu_ps(v + j * ldv + 8);
        for (int r = 0; r < R; ++r) {
            const __m256 p_rj = _mm256_broadcast_ss(p + r * ldp + j);
            acc_lo[r] = _mm256_fmadd_ps(p_rj, v_lo, acc_lo[r]);
            acc_hi[r] = _mm256_fmadd_ps(p_rj, v_hi, acc_hi[r]);
        }
    }
    for (int r = 0; r < R; ++r) {
        _mm256_storeu_ps(acc + r * ldacc,
                          _mm256_add_ps(_mm256_loadu_ps(acc + r * ldacc), acc_lo[r]));
        _mm256_storeu_ps(acc + r * ldacc + 8,
                          _mm256_add_ps(_mm256_loadu_ps(acc + r * ldacc + 8), acc_hi[r]));
    }
}

CA_AVX2 static void pv_f32(const float *p, ptrdiff_t ldp, ptrdiff_t n_rows,
                           const float *v, ptrdiff_t v_panel_stride, ptrdiff_t n_keys,
                           ptrdiff_t n_vcols, float *acc, ptrdiff_t ldacc,
                           const void *ahead, ptrdiff_t ahead_bytes)
{
    ca_ahead next = ahead_start(ahead, ahead_bytes,
                                (n_vcols / CA_PANEL_F32) * ((n_rows + MR - 1) / MR));
    for (ptrdiff_t c = 0; c < n_vcols; c += CA_PANEL_F32) {
        const float *panel = v + (c / CA_PANEL_F32) * v_panel_stride;
        ptrdiff_t i = 0;
        for (; i + MR <= n_rows; i += MR, ahead_step(&next))
            pv_tile_f32(p + i * ldp, ldp, panel, CA_PANEL_F32, n_keys, acc + i * ldacc + c, ldacc, MR);
        const float *p_tail = p + i * ldp;
        float *acc_tail = acc + i * ldacc + c;
        switch (n_rows - i) {
        case 5: pv_tile_f32(p_tail, ldp, panel, CA_PANEL_F32, n_keys, acc_tail, ldacc, 5); break;
        case 4: pv_tile_f32(p_tail, ldp, panel, CA_PANEL_F32, n_keys, acc_tail, ldacc, 4); break;
        case 3: pv_tile_f32(p_tail, ldp, panel, CA_PANEL_F32, n_keys, acc_tail, ldacc, 3); break;
        case 2: pv_tile_f32(p_tail, ldp, panel, CA_PANEL_F32, n_keys, acc_tail, ldacc, 2); break;
        case 1: pv_tile_f32(p_tail, ldp, panel, CA_PANEL_F32, n_keys, acc_tail, ldacc, 1); break;
        default: break;
        }
        if (i < n_rows)
            ahead_step(&next);
    }
}

CA_AVX2 static float row_max_f32(const float *x, ptrdiff_t n)
{
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    __m256 nan8 = _mm256_setzero_ps();
    ptrdiff_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 x8 = _mm256_loadu_ps(x + j);
        m8 = _mm256_max_ps(x8, m8);
        nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(x8, x8, _CMP_UNORD_Q));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, m8);
    float m = -INFINITY;
    int has_nan = _mm256_movemask_ps(nan8) != 0;
    for (int l = 0; l < 8; ++l)
        m = lanes[l] > m ? lanes[l] : m;
    for (; j < n; ++j) {
        m = x[j] > m ? x[j] : m;
        has_nan |= x[j] != x[j];
    }
    return has_nan ? NAN : m;
}

CA_TILE __m256 exp_f32x8(__m256 x)
{
    const __m256 magic = _mm256_set1_ps(CA_ROUND_MAGIC_F32);
    /* operand order makes NaN pass through the clamps */
    x = _mm256_max_ps(_mm256_set1_ps(CA_EXPF_MIN), x);
    x = _mm256_min_ps(_mm256_set1_ps(CA_EXPF_MAX), x);
    const __m256 t = _mm256_fmadd_ps(x, _mm256_set1_ps(CA_LOG2E_F32), magic);
    const __m256 n = _mm256_sub_ps(t, magic);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(CA_LN2_HI_F32), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(CA_LN2_LO_F32), r);
    __m256 p = _mm256_set1_ps(CA_EXPF_C6);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(CA_EXPF_C5));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(CA_EXPF_C4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(CA_EXPF_C3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(CA_EXPF_C2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_castps_si256(magic));
    e = _mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

CA_AVX2 static float exp_sum_f32(float *x, ptrdiff_t n, float shift)
{
    const __m256 shift8 = _mm256_set1_ps(shift);
    __m256 sum8 = _mm256_setzero_ps();
    ptrdiff_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp_f32x8(_mm256_sub_ps(_mm256_loadu_ps(x + j), shift8));
        _mm256_storeu_ps(x + j, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    if (j < n) {
        /* the tail goes through the same vector code on a padded copy */
        float tail[8];
        const ptrdiff_t n_tail = n - j;
        for (int l = 0; l < 8; ++l)
            tail[l] = l < n_tail ? x[j + l] : -INFINITY;
        const __m256 e = exp_f32x8(_mm256_sub_ps(_mm256_loadu_ps(tail), shift8));
        _mm256_storeu_ps(tail, e);
        for (ptrdiff_t l = 0; l < n_tail; ++l)
            x[j + l] = tail[l];
        sum8 = _mm256_add_ps(sum8, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, sum8);
    return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
           ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

/* ---- float64 -------------------------------------------------------- */

CA_TILE void score_tile_f64(const double *q, ptrdiff_t ldq, const double *kt,
                            ptrdiff_t ldkt, ptrdiff_t d_k, double factor,
                            double *s, ptrdiff_t lds, const int R)
{
    __m256d acc_lo[MR], acc_hi[MR];
    for (int r = 0; r < R; ++r) {
        acc_lo[r] = _mm256_setzero_pd();
        acc_hi[r] = _mm256_setzero_pd();
    }
    for (ptrdiff_t c = 0; c < d_k; ++c) {
        const __m256d k_lo = _mm256_loadu_pd(kt + c * ldkt);
        const __m256d k_hi = _mm256_loadu_pd(kt + c * ldkt + 4);
        for (int r = 0; r < R; ++r) {
            const __m256d q_rc = _mm256_broadcast_sd(q + r * ldq + c);
            acc_lo[r] = _mm256_fmadd_pd(q_rc, k_lo, acc_lo[r]);
            acc_hi[r] = _mm256_fmadd_pd(q_rc, k_hi, acc_hi[r]);
        }
    }
    const __m256d factor_v = _mm256_set1_pd(factor);
    for (int r = 0; r < R; ++r) {
        _mm256_storeu_pd(s + r * lds, _mm256_mul_pd(acc_lo[r], factor_v));
        _mm256_storeu_pd(s + r * lds + 4, _mm256_mul_pd(acc_hi[r], factor_v));
    }
}

CA_AVX2 static void score_f64(const double *q, ptrdiff_t ldq, ptrdiff_t n_rows,
                              const double *kt, ptrdiff_t kt_panel_stride, ptrdiff_t n_cols,
                              ptrdiff_t d_k, double factor, double *s, ptrdiff_t lds,
                              const void *ahead, ptrdiff_t ahead_bytes)
{
    ca_ahead next = ahead_start(ahead, ahead_bytes,
                                (n_cols / CA_PANEL_F64) * ((n_rows + MR - 1) / MR));
    for (ptrdiff_t j = 0; j < n_cols; j += CA_PANEL_F64) {
        const double *panel = kt + (j / CA_PANEL_F64) * kt_panel_stride;
        ptrdiff_t i = 0;
        for (; i + MR <= n_rows; i += MR, ahead_step(&next))
            score_tile_f64(q + i * ldq, ldq, panel, CA_PANEL_F64, d_k, factor, s + i * lds + j, lds, MR);
        const double *q_tail = q + i * ldq;
        double *s_tail = s + i * lds + j;
        switch (n_rows - i) {
        case 5: score_tile_f64(q_tail, ldq, panel, CA_PANEL_F64, d_k, factor, s_tail, lds, 5); break;
        case 4: score_tile_f64(q_tail, ldq, panel, CA_PANEL_F64, d_k, factor, s_tail, lds, 4); break;
        case 3: score_tile_f64(q_tail, ldq, panel, CA_PANEL_F64, d_k, factor, s_tail, lds, 3); break;
        case 2: score_tile_f64(q_tail, ldq, panel, CA_PANEL_F64, d_k, factor, s_tail, lds, 2); break;
        case 1: score_tile_f64(q_tail, ldq, panel, CA_PANEL_F64, d_k, factor, s_tail, lds, 1); break;
        default: break;
        }
        if (i < n_rows)
            ahead_step(&next);
    }
}

CA_TILE void pv_tile_f64(const double *p, ptrdiff_t ldp, const double *v,
                         ptrdiff_t ldv, ptrdiff_t n_keys, double *acc,
                         ptrdiff_t ldacc, const int R)
{
    /* sum this block of keys from zero and add it to acc once: chains of
       at most one block of terms instead of all S keep float32 near NumPy */
    __m256d acc_lo[MR], acc_hi[MR];
    for (int r = 0; r < R; ++r) {
        acc_lo[r] = _mm256_setzero_pd();
        acc_hi[r] = _mm256_setzero_pd();
    }
    for (ptrdiff_t j = 0; j < n_keys; ++j) {
        const __m256d v_lo = _mm256_loadu_pd(v + j * ldv);
        const __m256d v_hi = _mm256_loadu_pd(v + j * ldv + 4);
        for (int r = 0; r < R; ++r) {
            const __m256d p_rj = _mm256_broadcast_sd(p + r * ldp + j);
            acc_lo[r] = _mm256_fmadd_pd(p_rj, v_lo, acc_lo[r]);
            acc_hi[r] = _mm256_fmadd_pd(p_rj, v_hi, acc_hi[r]);
        }
    }
    for (int r = 0; r < R; ++r) {
        _mm256_storeu_pd(acc + r * ldacc,
                          _mm256_add_pd(_mm256_loadu_pd(acc + r * ldacc), acc_lo[r]));
        _mm256_storeu_pd(acc + r * ldacc + 4,
                          _mm256_add_pd(_mm256_loadu_pd(acc + r * ldacc + 4), acc_hi[r]));
    }
}

CA_AVX2 static void pv_f64(const double *p, ptrdiff_t ldp, ptrdiff_t n_rows,
                           const double *v, ptrdiff_t v_panel_stride, ptrdiff_t n_keys,
                           ptrdiff_t n_vcols, double *acc, ptrdiff_t ldacc,
                           const void *ahead, ptrdiff_t ahead_bytes)
{
    ca_ahead next = ahead_start(ahead, ahead_bytes,
                                (n_vcols / CA_PANEL_F64) * ((n_rows + MR - 1) / MR));
    for (ptrdiff_t c = 0; c < n_vcols; c += CA_PANEL_F64) {
        const double *panel = v + (c / CA_PANEL_F64) * v_panel_stride;
        ptrdiff_t i = 0;
        for (; i + MR <= n_rows; i += MR, ahead_step(&next))
            pv_tile_f64(p + i * ldp, ldp, panel, CA_PANEL_F64, n_keys, acc + i * ldacc + c, ldacc, MR);
        const double *p_tail = p + i * ldp;
        double *acc_tail = acc + i * ldacc + c;
        switch (n_rows - i) {
        case 5: pv_tile_f64(p_tail, ldp, panel, CA_PANEL_F64, n_keys, acc_tail, ldacc, 5); break;
        case 4: pv_tile_f64(p_tail, ldp, panel, CA_PANEL_F64, n_keys, acc_tail, ldacc, 4); break;
        case 3: pv_tile_f64(p_tail, ldp, panel, CA_PANEL_F64, n_keys, acc_tail, ldacc, 3); break;
        case 2: pv_tile_f64(p_tail, ldp, panel, CA_PANEL_F64, n_keys, acc_tail, ldacc, 2); break;
        case 1: pv_tile_f64(p_tail, ldp, panel, CA_PANEL_F64, n_keys, acc_tail, ldacc, 1); break;
        default: break;
        }
        if (i < n_rows)
            ahead_step(&next);
    }
}

CA_AVX2 static double row_max_f64(const double *x, ptrdiff_t n)
{
    __m256d m4 = _mm256_set1_pd(-INFINITY);
    __m256d nan4 = _mm256_setzero_pd();
    ptrdiff_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const __m256d x4 = _mm256_loadu_pd(x + j);
        m4 = _mm256_max_pd(x4, m4);
        nan4 = _mm256_or_pd(nan4, _mm256_cmp_pd(x4, x4, _CMP_UNORD_Q));
    }
    double lanes[4];
    _mm256_storeu_pd(lanes, m4);
    double m = -INFINITY;
    int has_nan = _mm256_movemask_pd(nan4) != 0;
    for (int l = 0; l < 4; ++l)
        m = lanes[l] > m ? lanes[l] : m;
    for (; j < n; ++j) {
        m = x[j] > m ? x[j] : m;
        has_nan |= x[j] != x[j];
    }
    return has_nan ? NAN : m;
}

CA_TILE __m256d exp_f64x4(__m256d x)
{
    const __m256d magic = _mm256_set1_pd(CA_ROUND_MAGIC_F64);
    x = _mm256_max_pd(_mm256_set1_pd(CA_EXPD_MIN), x);
    x = _mm256_min_pd(_mm256_set1_pd(CA_EXPD_MAX), x);
    const __m256d t = _mm256_fmadd_pd(x, _mm256_set1_pd(CA_LOG2E_F64), magic);
    const __m256d n = _mm256_sub_pd(t, magic);
    __m256d r = _mm256_fnmadd_pd(n, _mm256_set1_pd(CA_LN2_HI_F64), x);
    r = _mm256_fnmadd_pd(n, _mm256_set1_pd(CA_LN2_LO_F64), r);
    __m256d p = _mm256_set1_pd(ca_expd_coef[13]);
    for (int k = 12; k >= 0; --k)
        p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(ca_expd_coef[k]));
    __m256i e = _mm256_sub_epi64(_mm256_castpd_si256(t), _mm256_castpd_si256(magic));
    e = _mm256_slli_epi64(_mm256_add_epi64(e, _mm256_set1_epi64x(1023)), 52);
    return _mm256_mul_pd(p, _mm256_castsi256_pd(e));
}

CA_AVX2 static double exp_sum_f64(double *x, ptrdiff_t n, double shift)
{
    const __m256d shift4 = _mm256_set1_pd(shift);
    __m256d sum4 = _mm256_setzero_pd();
    ptrdiff_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const __m256d e = exp_f64x4(_mm256_sub_pd(_mm256_loadu_pd(x + j), shift4));
        _mm256_storeu_pd(x + j, e);
        sum4 = _mm256_add_pd(sum4, e);
    }
    if (j < n) {
        double tail[4];
        const ptrdiff_t n_tail = n - j;
        for (int l = 0; l < 4; ++l)
            tail[l] = l < n_tail ? x[j + l] : -INFINITY;
        const __m256d e = exp_f64x4(_mm256_sub_pd(_mm256_loadu_pd(tail), shift4));
        _mm256_storeu_pd(tail, e);
        for (ptrdiff_t l = 0; l < n_tail; ++l)
            x[j + l] = tail[l];
        sum4 = _mm256_add_pd(sum4, e);
    }
    double lanes[4];
    _mm256_storeu_pd(lanes, sum4);
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}

/* ---- few query rows, K and V read in place (decode) ------------------ */

/* keys ahead of the one in use whose rows are prefetched: memory-bound
   decode otherwise waits on each row as it streams in */
#define PREFETCH_KEYS 16
/* keys summed from zero before joining the accumulator (see pv_direct) */
#define SUM_KEYS 64

CA_TILE __m256i lane_mask_f32(ptrdiff_t n)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

CA_TILE __m256i lane_mask_f64(ptrdiff_t n)
{
    return _mm256_cmpgt_epi64(_mm256_set1_epi64x(n), _mm256_setr_epi64x(0, 1, 2, 3));
}

CA_TILE void prefetch_row(const void *row, ptrdiff_t n_bytes)
{
    for (ptrdiff_t b = 0; b < n_bytes; b += 64)
        _mm_prefetch((const char *)row + b, _MM_HINT_T0);
}

/* the other operand's row j, into L2 for the next kernel */
CA_TILE void prefetch_ahead(const void *ahead, ptrdiff_t ahead_stride,
                            ptrdiff_t ahead_bytes, ptrdiff_t j)
{
    if (ahead == NULL)
        return;
    const char *row = (const char *)ahead + j * ahead_stride;
    for (ptrdiff_t b = 0; b < ahead_bytes; b += 64)
        _mm_prefetch(row + b, _MM_HINT_T1);
}

/* {sum(a0), sum(a1), sum(a2), sum(a3)} */
CA_TILE __m128 hsum4_f32(__m256 a0, __m256 a1, __m256 a2, __m256 a3)
{
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

CA_TILE __m256d hsum4_f64(__m256d a0, __m256d a1, __m256d a2, __m256d a3)
{
    const __m256d t0 = _mm256_hadd_pd(a0, a1);
    const __m256d t1 = _mm256_hadd_pd(a2, a3);
    return _mm256_add_pd(_mm256_permute2f128_pd(t0, t1, 0x20),
                         _mm256_permute2f128_pd(t0, t1, 0x31));
}

CA_AVX2 static void score_direct_f32(const float *q, ptrdiff_t ldq, ptrdiff_t n_rows,
                                     const float *k, ptrdiff_t ldk, ptrdiff_t n_keys,
                                     ptrdiff_t d_k, float factor, float *s, ptrdiff_t lds,
                                     const void *ahead, ptrdiff_t ahead_stride,
                                     ptrdiff_t ahead_bytes)
{
    const ptrdiff_t d_main = d_k & ~(ptrdiff_t)7;
    const __m256i tail = lane_mask_f32(d_k - d_main);
    for (ptrdiff_t j = 0; j < n_keys; j += 4) {
        /* four keys at a time share one horizontal reduction */
        const ptrdiff_t n_group = n_keys - j < 4 ? n_keys - j : 4;
        const float *k0 = k + j * ldk;
        const float *k1 = k0 + (n_group > 1 ? ldk : 0);
        const float *k2 = k0 + (n_group > 2 ? 2 * ldk : 0);
        const float *k3 = k0 + (n_group > 3 ? 3 * ldk : 0);
        if (j + PREFETCH_KEYS + 4 <= n_keys)
            for (int l = 0; l < 4; ++l)
                prefetch_row(k + (j + PREFETCH_KEYS + l) * ldk, d_k * 4);
        for (ptrdiff_t l = 0; l < n_group; ++l)
            prefetch_ahead(ahead, ahead_stride, ahead_bytes, j + l);
        for (ptrdiff_t r = 0; r < n_rows; ++r) {
            const float *q_r = q + r * ldq;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
            ptrdiff_t c = 0;
            for (; c < d_main; c += 8) {
                const __m256 q8 = _mm256_loadu_ps(q_r + c);
                a0 = _mm256_fmadd_ps(q8, _mm256_loadu_ps(k0 + c), a0);
                a1 = _mm256_fmadd_ps(q8, _mm256_loadu_ps(k1 + c), a1);
                a2 = _mm256_fmadd_ps(q8, _mm256_loadu_ps(k2 + c), a2);
                a3 = _mm256_fmadd_ps(q8, _mm256_loadu_ps(k3 + c), a3);
            }
            if (c < d_k) {
                const __m256 q8 = _mm256_maskload_ps(q_r + c, tail);
                a0 = _mm256_fmadd_ps(q8, _mm256_maskload_ps(k0 + c, tail), a0);
                a1 = _mm256_fmadd_ps(q8, _mm256_maskload_ps(k1 + c, tail), a1);
                a2 = _mm256_fmadd_ps(q8, _mm256_maskload_ps(k2 + c, tail), a2);
                a3 = _mm256_fmadd_ps(q8, _mm256_maskload_ps(k3 + c, tail), a3);
            }
            float dots[4];
            _mm_storeu_ps(dots, _mm_mul_ps(hsum4_f32(a0, a1, a2, a3), _mm_set1_ps(factor)));
            for (ptrdiff_t l = 0; l < n_group; ++l)
                s[r * lds + j + l] = dots[l];
        }
    }
}

/* acc[0..8*NV) += sum_j p[j] v_j[0..8*NV), the last vector masked by tail */
CA_TILE void pv_direct_cols_f32(const float *p, const float *v, ptrdiff_t ldv,
                                ptrdiff_t n_keys, ptrdiff_t n_bytes_row,
                                int prefetch, const void *ahead, ptrdiff_t ahead_stride,
                                ptrdiff_t ahead_bytes, __m256i tail, float *acc,
                                const int NV)
{
    /* runs of SUM_KEYS keys are summed from zero and then added to acc:
       rounding chains of SUM_KEYS terms, not of every key in the split */
    __m256 a[8];
    for (int x = 0; x < NV; ++x)
        a[x] = _mm256_setzero_ps();
    for (ptrdiff_t j = 0; j < n_keys; ++j) {
        if (j % SUM_KEYS == 0) {
            if (j > 0)
                for (int x = 0; x < NV; ++x)
                    _mm256_storeu_ps(acc + 8 * x, _mm256_add_ps(_mm256_loadu_ps(acc + 8 * x), a[x]));
            for (int x = 0; x < NV; ++x)
                a[x] = _mm256_setzero_ps();
        }
        if (prefetch) {
            if (j + PREFETCH_KEYS < n_keys)
                prefetch_row(v + (j + PREFETCH_KEYS) * ldv, n_bytes_row);
            prefetch_ahead(ahead, ahead_stride, ahead_bytes, j);
        }
        if (p[j] == 0)
            continue;
        const __m256 p_j = _mm256_set1_ps(p[j]);
        const float *v_j = v + j * ldv;
        for (int x = 0; x < NV - 1; ++x)
            a[x] = _mm256_fmadd_ps(p_j, _mm256_loadu_ps(v_j + 8 * x), a[x]);
        a[NV - 1] = _mm256_fmadd_ps(p_j, _mm256_maskload_ps(v_j + 8 * (NV - 1), tail),
                                    a[NV - 1]);
    }
    if (n_keys > 0)
        for (int x = 0; x < NV; ++x)
            _mm256_storeu_ps(acc + 8 * x, _mm256_add_ps(_mm256_loadu_ps(acc + 8 * x), a[x]));
}

CA_AVX2 static void pv_direct_f32(const float *p, ptrdiff_t ldp, ptrdiff_t n_rows,
                                  const float *v, ptrdiff_t ldv, ptrdiff_t n_keys,
                                  ptrdiff_t d_v, float *acc, ptrdiff_t ldacc,
                                  const void *ahead, ptrdiff_t ahead_stride,
                                  ptrdiff_t ahead_bytes)
{
    for (ptrdiff_t r = 0; r < n_rows; ++r) {
        /* up to 64 columns per pass: 8 accumulators, the rest for operands */
        for (ptrdiff_t c = 0; c < d_v; c += 64) {
            const ptrdiff_t width = d_v - c < 64 ? d_v - c : 64;
            const int n_vec = (int)((width + 7) / 8);
            const __m256i tail = lane_mask_f32(width - 8 * (n_vec - 1));
            /* the first pass over V brings its rows in for the others */
            const int prefetch = r == 0 && c == 0;
            const float *p_r = p + r * ldp;
            float *acc_rc = acc + r * ldacc + c;
            switch (n_vec) {
            case 8: pv_direct_cols_f32(p_r, v + c, ldv, n_keys, d_v * 4, prefetch, ahead, ahead_stride, ahead_bytes, tail, acc_rc, 8); break;
            case 7: pv_direct_cols_f32(p_r, v + c, ldv, n_keys, d_v * 4, prefetch, ahead, ahead_stride, ahead_bytes, tail, acc_rc, 7); break;
            case 6: pv_direct_cols_f32(p_r, v + c, ldv, n_keys, d_v * 4, prefetch, ahead, ahead_stride, ahead_bytes, tail, acc_rc, 6); break;
            case 5: pv_direct_cols_f32(p_r, v + c, ldv, n_keys, d_v * 4, prefetch, ahead, ahead_stride, ahead_bytes, tail, acc_rc, 5); break;
            case 4: pv_direct_cols_f32(p_r, v + c, ldv, n_keys, d_v * 4, prefetch, ahead, ahead_stride, ahead_bytes, tail, acc_rc, 4); break;
            case 3: pv_direct_cols_f32(p_r, v + c, ldv, n_keys, d_v * 4, prefetch, ahead, ahead_stride, ahead_bytes, tail, acc_rc, 3); break;
            case 2: pv_direct_cols_f32(p_r, v + c, ldv, n_keys, d_v * 4, prefetch, ahead, ahead_stride, ahead_bytes, tail, acc_rc, 2); break;
            default: pv_direct_cols_f32(p_r, v + c, ldv, n_keys, d_v * 4, prefetch, ahead, ahead_stride, ahead_bytes, tail, acc_rc, 1); break;
            }
        }
    }
}

CA_AVX2 static void score_direct_f64(const double *q, ptrdiff_t ldq, ptrdiff_t n_rows,
                                     const double *k, ptrdiff_t ldk, ptrdiff_t n_keys,
                                     ptrdiff_t d_k, double factor, double *s, ptrdiff_t lds,
                                     const void *ahead, ptrdiff_t ahead_stride,
                                     ptrdiff_t ahead_bytes)
{
    const ptrdiff_t d_main = d_k & ~(ptrdiff_t)3;
    const __m256i tail = lane_mask_f64(d_k - d_main);
    for (ptrdiff_t j = 0; j < n_keys; j += 4) {
        const ptrdiff_t n_group = n_keys - j < 4 ? n_keys - j : 4;
        const double *k0 = k + j * ldk;
        const double *k1 = k0 + (n_group > 1 ? ldk : 0);
        const double *k2 = k0 + (n_group > 2 ? 2 * ldk : 0);
        const double *k3 = k0 + (n_group > 3 ? 3 * ldk : 0);
        if (j + PREFETCH_KEYS + 4 <= n_keys)
            for (int l = 0; l < 4; ++l)
                prefetch_row(k + (j + PREFETCH_KEYS + l) * ldk, d_k * 8);
        for (ptrdiff_t l = 0; l < n_group; ++l)
            prefetch_ahead(ahead, ahead_stride, ahead_bytes, j + l);
        for (ptrdiff_t r = 0; r < n_rows; ++r) {
            const double *q_r = q + r * ldq;
            __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
            __m256d a2 = _mm256_setzero_pd(), a3 = _mm256_setzero_pd();
            ptrdiff_t c = 0;
            for (; c < d_main; c += 4) {
                const __m256d q4 = _mm256_loadu_pd(q_r + c);
                a0 = _mm256_fmadd_pd(q4, _mm256_loadu_pd(k0 + c), a0);
                a1 = _mm256_fmadd_pd(q4, _mm256_loadu_pd(k1 + c), a1);
                a2 = _mm256_fmadd_pd(q4, _mm256_loadu_pd(k2 + c), a2);
                a3 = _mm256_fmadd_pd(q4, _mm256_loadu_pd(k3 + c), a3);
            }
            if (c < d_k) {
                const __m256d q4 = _mm256_maskload_pd(q_r + c, tail);
                a0 = _mm256_fmadd_pd(q4, _mm256_maskload_pd(k0 + c, tail), a0);
                a1 = _mm256_fmadd_pd(q4, _mm256_maskload_pd(k1 + c, tail), a1);
                a2 = _mm256_fmadd_pd(q4, _mm256_maskload_pd(k2 + c, tail), a2);
                a3 = _mm256_fmadd_pd(q4, _mm256_maskload_pd(k3 + c, tail), a3);
            }
            double dots[4];
            _mm256_storeu_pd(dots, _mm256_mul_pd(hsum4_f64(a0, a1, a2, a3), _mm256_set1_pd(factor)));
            for (ptrdiff_t l = 0; l < n_group; ++l)
                s[r * lds + j + l] = dots[l];
        }
    }
}

CA_TILE void pv_direct_cols_f64(const double *p, const double *v, ptrdiff_t ldv,
                                ptrdiff_t n_keys, ptrdiff_t n_bytes_row,
                                int prefetch, const void *ahead, ptrdiff_t ahead_stride,
                                ptrdiff_t ahead_bytes, __m256i tail, double *acc,
                                const int NV)
{
    /* runs of SUM_KEYS keys are summed from zero and then added to acc:
       rounding chains of SUM_KEYS terms, not of every key in the split */
    __m256d a[8];
    for (int x = 0; x < NV; ++x)
        a[x] = _mm256_setzero_pd();
    for (ptrdiff_t j = 0; j < n_keys; ++j) {
        if (j % SUM_KEYS == 0) {
            if (j > 0)
                for (int x = 0; x < NV; ++x)
                    _mm256_storeu_pd(acc + 4 * x, _mm256_add_pd(_mm256_loadu_pd(acc + 4 * x), a[x]));
            for (int x = 0; x < NV; ++x)
                a[x] = _mm256_setzero_pd();
        }
        if (prefetch) {
            if (j + PREFETCH_KEYS < n_keys)
                prefetch_row(v + (j + PREFETCH_KEYS) * ldv, n_bytes_row);
            prefetch_ahead(ahead, ahead_stride, ahead_bytes, j);
        }
        if (p[j] == 0)
            continue;
        const __m256d p_j = _mm256_set1_pd(p[j]);
        const double *v_j = v + j * ldv;
        for (int x = 0; x < NV - 1; ++x)
            a[x] = _mm256_fmadd_pd(p_j, _mm256_loadu_pd(v_j + 4 * x), a[x]);
        a[NV - 1] = _mm256_fmadd_pd(p_j, _mm256_maskload_pd(v_j + 4 * (NV - 1), tail),
                                    a[NV - 1]);
    }
    if (n_keys > 0)
        for (int x = 0; x < NV; ++x)
            _mm256_storeu_pd(acc + 4 * x, _mm256_add_pd(_mm256_loadu_pd(acc + 4 * x), a[x]));
}

CA_AVX2 static void pv_direct_f64(const double *p, ptrdiff_t ldp, ptrdiff_t n_rows,
                                  const double *v, ptrdiff_t ldv, ptrdiff_t n_keys,
                                  ptrdiff_t d_v, double *acc, ptrdiff_t ldacc,
                                  const void *ahead, ptrdiff_t ahead_stride,
                                  ptrdiff_t ahead_bytes)
{
    for (ptrdiff_t r = 0; r < n_rows; ++r) {
        for (ptrdiff_t c = 0; c < d_v; c += 32) {
            const ptrdiff_t width = d_v - c < 32 ? d_v - c : 32;
            const int n_vec = (int)((width + 3) / 4);
            const __m256i tail = lane_mask_f64(width - 4 * (n_vec - 1));
            const int prefetch = r == 0 && c == 0;
            const double *p_r = p + r * ldp;
            double *acc_rc = acc + r * ldacc + c;
            switch (n_vec) {
            case 8: pv_direct_cols_f64(p_r, v + c, ldv, n_keys, d_v * 8, prefetch, ahead, ahead_stride, ahead_bytes, tail, acc_rc, 8); break;
            case 7: pv_direct_cols_f64(p_r, v + c, ldv, n_keys, d_v * 8, prefetch, ahead, ahead_stride, ahead_bytes, tail, acc_rc, 7); break;
            case 6: pv_direct_cols_f64(p_r, v + c, ldv, n_keys, d_v * 8, prefetch, ahead, ahead_stride, ahead_bytes, tail, acc_rc, 6); break;
            case 5: pv_direct_cols_f64(p_r, v + c, ldv, n_keys, d_v * 8, prefetch, ahead, ahead_stride, ahead_bytes, tail, acc_rc, 5); break;
            case 4: pv_direct_cols_f64(p_r, v + c, ldv, n_keys, d_v * 8, prefetch, ahead, ahead_stride, ahead_bytes, tail, acc_rc, 4); break;
            case 3: pv_direct_cols_f64(p_r, v + c, ldv, n_keys, d_v * 8, prefetch, ahead, ahead_stride, ahead_bytes, tail, acc_rc, 3); break;
            case 2: pv_direct_cols_f64(p_r, v + c, ldv, n_keys, d_v * 8, prefetch, ahead, ahead_stride, ahead_bytes, tail, acc_rc, 2); break;
            default: pv_direct_cols_f64(p_r, v + c, ldv, n_keys, d_v * 8, prefetch, ahead, ahead_stride, ahead_bytes, tail, acc_rc, 1); break;
            }
        }
    }
}

CA_AVX2 static void half_rows_to_f32(const uint16_t *src, ptrdiff_t src_row,
                                     ptrdiff_t src_col, ptrdiff_t n_rows, ptrdiff_t n_cols,
                                     float *dst, ptrdiff_t ld_dst)
{
    for (ptrdiff_t r = 0; r < n_rows; ++r) {
        const uint16_t *row = src + r * src_row;
        float *out = dst + r * ld_dst;
        ptrdiff_t c = 0;
        if (src_col == 1) {
            if (r + PREFETCH_KEYS < n_rows)
                prefetch_row(src + (r + PREFETCH_KEYS) * src_row, n_cols * 2);
            for (; c + 8 <= n_cols; c += 8)
                _mm256_storeu_ps(out + c,
                                 _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + c))));
        }
        for (; c < n_cols; ++c)
            out[c] = ca_half_to_float(row[c * src_col]);
    }
}

/* int8 rows times their scale: 8 lanes sign-extended, converted and
   multiplied (exact conversion, one rounding, as the portable loop) */
CA_AVX2 static void int8_rows_to_f32(const int8_t *src, ptrdiff_t src_row,
                                     ptrdiff_t src_col, ptrdiff_t n_rows, ptrdiff_t n_cols,
                                     const float *scale, ptrdiff_t scale_stride,
                                     float *dst, ptrdiff_t ld_dst)
{
    for (ptrdiff_t r = 0; r < n_rows; ++r) {
        const int8_t *row = src + r * src_row;
        float *out = dst + r * ld_dst;
        const float row_scale = scale[r * scale_stride];
        const __m256 scale8 = _mm256_set1_ps(row_scale);
        ptrdiff_t c = 0;
        if (src_col == 1) {
            if (r + PREFETCH_KEYS < n_rows)
                prefetch_row(src + (r + PREFETCH_KEYS) * src_row, n_cols);
            for (; c + 8 <= n_cols; c += 8) {
                const __m128i bytes = _mm_loadl_epi64((const __m128i *)(row + c));
                const __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
                _mm256_storeu_ps(out + c, _mm256_mul_ps(x, scale8));
            }
        }
        for (; c < n_cols; ++c)
            out[c] = (float)row[c * src_col] * row_scale;
    }
}

/* 8 int8 features as float32 lanes */
CA_TILE __m256 load_i8_f32x8(const int8_t *x)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)x)));
}

/* int8 keys read in place: four keys share one horizontal reduction, as in
   score_direct_f32; the row scale multiplies each dot product */
CA_AVX2 static void score_direct_i8(const float *q, ptrdiff_t ldq, ptrdiff_t n_rows,
                                    const int8_t *k, ptrdiff_t ldk, ptrdiff_t n_keys,
                                    ptrdiff_t d_k, float factor, const float *scale,
                                    ptrdiff_t scale_stride, float *s, ptrdiff_t lds)
{
    const ptrdiff_t d_main = d_k & ~(ptrdiff_t)7;
    for (ptrdiff_t j = 0; j < n_keys; j += 4) {
        const ptrdiff_t n_group = n_keys - j < 4 ? n_keys - j : 4;
        const int8_t *k0 = k + j * ldk;
        const int8_t *k1 = k0 + (n_group > 1 ? ldk : 0);
        const int8_t *k2 = k0 + (n_group > 2 ? 2 * ldk : 0);
        const int8_t *k3 = k0 + (n_group > 3 ? 3 * ldk : 0);
        if (j + PREFETCH_KEYS + 4 <= n_keys)
            for (int l = 0; l < 4; ++l)
                prefetch_row(k + (j + PREFETCH_KEYS + l) * ldk, d_k);
        for (ptrdiff_t r = 0; r < n_rows; ++r) {
            const float *q_r = q + r * ldq;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
            for (ptrdiff_t c = 0; c < d_main; c += 8) {
                const __m256 q8 = _mm256_loadu_ps(q_r + c);
                a0 = _mm256_fmadd_ps(q8, load_i8_f32x8(k0 + c), a0);
                a1 = _mm256_fmadd_ps(q8, load_i8_f32x8(k1 + c), a1);
                a2 = _mm256_fmadd_ps(q8, load_i8_f32x8(k2 + c), a2);
                a3 = _mm256_fmadd_ps(q8, load_i8_f32x8(k3 + c), a3);
            }
            float dots[4];
            _mm_storeu_ps(dots, hsum4_f32(a0, a1, a2, a3));
            const int8_t *rows[4] = {k0, k1, k2, k3};
            for (ptrdiff_t l = 0; l < n_group; ++l) {
                float dot = dots[l];
                for (ptrdiff_t c = d_main; c < d_k; ++c)
                    dot += q_r[c] * (float)rows[l][c];
                s[r * lds + j + l] = factor * (scale[(j + l) * scale_stride] * dot);
            }
        }
    }
}

/* int8 values read in place: each key's weight times its row scale, then
   up to 64 columns of eight float32 accumulators per pass */
CA_AVX2 static void pv_direct_i8(const float *p, ptrdiff_t ldp, ptrdiff_t n_rows,
                                 const int8_t *v, ptrdiff_t ldv, ptrdiff_t n_keys,
                                 ptrdiff_t d_v, const float *scale, ptrdiff_t scale_stride,
                                 float *acc, ptrdiff_t ldacc)
{
    const ptrdiff_t d_main = d_v & ~(ptrdiff_t)7;
    for (ptrdiff_t r = 0; r < n_rows; ++r) {
        const float *p_r = p + r * ldp;
        float *acc_r = acc + r * ldacc;
        for (ptrdiff_t c = 0; c < d_main; c += 64) {
            const int n_vec = (int)((d_main - c) / 8 < 8 ? (d_main - c) / 8 : 8);
            __m256 sum[8];
            for (int t = 0; t < n_vec; ++t)
                sum[t] = _mm256_loadu_ps(acc_r + c + 8 * t);
            for (ptrdiff_t j = 0; j < n_keys; ++j) {
                const float weight = p_r[j] * scale[j * scale_stride];
                if (weight == 0)
                    continue;
                const __m256 w8 = _mm256_set1_ps(weight);
                const int8_t *v_j = v + j * ldv + c;
                if (r == 0 && j + PREFETCH_KEYS < n_keys)
                    prefetch_row(v + (j + PREFETCH_KEYS) * ldv + c, 8 * n_vec);
                for (int t = 0; t < n_vec; ++t)
                    sum[t] = _mm256_fmadd_ps(w8, load_i8_f32x8(v_j + 8 * t), sum[t]);
            }
            for (int t = 0; t < n_vec; ++t)
                _mm256_storeu_ps(acc_r + c + 8 * t, sum[t]);
        }
        for (ptrdiff_t j = 0; d_main < d_v && j < n_keys; ++j) {
            const float weight = p_r[j] * scale[j * scale_stride];
            if (weight == 0)
                continue;
            for (ptrdiff_t c = d_main; c < d_v; ++c)
                acc_r[c] += weight * (float)v[j * ldv + c];
        }
    }
}

/* cap * tanh(x / cap), the steps of the portable softcap lane by lane */
CA_AVX2 static void softcap_f32(float *x, ptrdiff_t n, float cap)
{
    static const float taylor[9] = {
        0.000590027440945586f, -0.0014558343870513183f, 0.003592128036572481f,
        -0.008863235529902197f, 0.021869488536155203f, -0.05396825396825397f,
        0.13333333333333333f, -0.3333333333333333f, 0.0f};
    const __m256 cap8 = _mm256_set1_ps(cap);
    const __m256 sign_bit = _mm256_set1_ps(-0.0f);
    const __m256 one = _mm256_set1_ps(1.0f);
    ptrdiff_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 y = _mm256_div_ps(_mm256_loadu_ps(x + j), cap8);
        const __m256 a = _mm256_andnot_ps(sign_bit, y);
        const __m256 y2 = _mm256_mul_ps(y, y);
        __m256 p = _mm256_set1_ps(taylor[0]);
        for (int t = 1; t < 8; ++t)
            p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(taylor[t]));
        const __m256 small = _mm256_fmadd_ps(y, _mm256_mul_ps(y2, p), y);
        const __m256 e = exp_f32x8(_mm256_mul_ps(_mm256_set1_ps(-2.0f), a));
        __m256 large = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
        large = _mm256_or_ps(large, _mm256_and_ps(sign_bit, y));
        const __m256 is_small = _mm256_cmp_ps(a, _mm256_set1_ps(0.5f), _CMP_LT_OQ);
        _mm256_storeu_ps(x + j, _mm256_mul_ps(cap8, _mm256_blendv_ps(large, small, is_small)));
    }
    if (j < n)
        ca_kernels_baseline.softcap_f32(x + j, n - j, cap);
}

/* ---- packing of a key block (float32) -------------------------------- */

/* rows r[0..8) of an 8 x 8 block become its columns */
CA_TILE void transpose8_f32(__m256 r[8])
{
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

CA_AVX2 static void pack_kt_f32(const float *k, ptrdiff_t ldk, ptrdiff_t n_keys,
                                ptrdiff_t d_k, float *kt, ptrdiff_t kt_panel_stride)
{
    /* 8 keys x 8 features at a time, transposed in registers; keys past
       n_keys read as 0, features past d_k are neither read nor written */
    for (ptrdiff_t j0 = 0; j0 < n_keys; j0 += CA_PANEL_F32) {
        float *panel = kt + (j0 / CA_PANEL_F32) * kt_panel_stride;
        /* K is read here for the first time, often from memory, and the
           transposes touch 16 rows at once: fetch the rows two panels
           ahead (5-10% faster on a BERT-like batch, where packing is a
           large share of the work) */
        for (ptrdiff_t l = 0; l < CA_PANEL_F32 && j0 + 2 * CA_PANEL_F32 + l < n_keys; ++l)
            prefetch_row(k + (j0 + 2 * CA_PANEL_F32 + l) * ldk, d_k * 4);
        for (ptrdiff_t c0 = 0; c0 < d_k; c0 += 8) {
            const ptrdiff_t n_c = d_k - c0 < 8 ? d_k - c0 : 8;
            const __m256i lanes = lane_mask_f32(n_c);
            for (int half = 0; half < 2; ++half) {
                __m256 r[8];
                for (int l = 0; l < 8; ++l) {
                    const ptrdiff_t j = j0 + 8 * half + l;
                    if (j >= n_keys)
                        r[l] = _mm256_setzero_ps();
                    else if (n_c == 8)
                        r[l] = _mm256_loadu_ps(k + j * ldk + c0);
                    else
                        r[l] = _mm256_maskload_ps(k + j * ldk + c0, lanes);
                }
                transpose8_f32(r);
                for (ptrdiff_t c = 0; c < n_c; ++c)
                    _mm256_storeu_ps(panel + (c0 + c) * CA_PANEL_F32 + 8 * half, r[c]);
            }
        }
    }
}

CA_AVX2 static int pack_v_f32(const float *v, ptrdiff_t ldv, ptrdiff_t n_keys,
                              ptrdiff_t d_v, float *v_packed, ptrdiff_t v_panel_stride)
{
    /* x - x is 0 for finite x and NaN otherwise */
    __m256 probe = _mm256_setzero_ps();
    for (ptrdiff_t j = 0; j < n_keys; ++j) {
        const float *v_row = v + j * ldv;
        /* first read of V as well: rows ahead, as for K above */
        if (j + CA_PANEL_F32 < n_keys)
            prefetch_row(v + (j + CA_PANEL_F32) * ldv, d_v * 4);
        for (ptrdiff_t c0 = 0; c0 < d_v; c0 += 8) {
            float *dst = v_packed + (c0 / CA_PANEL_F32) * v_panel_stride
                         + j * CA_PANEL_F32 + c0 % CA_PANEL_F32;
            const __m256 x = d_v - c0 >= 8 ? _mm256_loadu_ps(v_row + c0)
                                           : _mm256_maskload_ps(v_row + c0,
                                                                lane_mask_f32(d_v - c0));
            probe = _mm256_add_ps(probe, _mm256_sub_ps(x, x));
            _mm256_storeu_ps(dst, x);
        }
        if (d_v % CA_PANEL_F32 != 0 && d_v % CA_PANEL_F32 <= 8)
            /* the upper half of the last panel lies past d_v */
            _mm256_storeu_ps(v_packed + (d_v / CA_PANEL_F32) * v_panel_stride
                             + j * CA_PANEL_F32 + 8, _mm256_setzero_ps());
    }
    return _mm256_movemask_ps(_mm256_cmp_ps(probe, probe, _CMP_UNORD_Q)) != 0;
}

CA_DEFINE_KERNEL_TABLE(ca_kernels_avx2, "avx2");

#endif /* CA_HAVE_X86_KERNELS */
