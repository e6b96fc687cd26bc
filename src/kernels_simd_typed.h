/*
 * The SIMD kernels that exist for both float32 and float64, written once
 * for one element type. kernels_simd.h includes this file twice, with
 *   CA_T        the element type (float, double)
 *   CA_NAME(x)  x with the type's suffix (score -> score_f32)
 *   CA_V(op)    the mapping's operation on that type (load -> vf32_load)
 *   CA_VEC, CA_MASK, CA_PRED, CA_LANES, CA_PANEL, the e^x constants and
 *   the ranges of the quotient by multiplies (CA_DIV_B_RANGE, CA_DIV_Q_RANGE)
 * defined, and the mapping (simd_<isa>.h) already included; it undefines
 * them at its end, ready for the next type.
 */

/* vectors of a register tile that share one panel of the packed layout;
   a tile spans whole panels side by side (several when the vector holds a
   whole panel, so that a row of the tile is still a few vectors wide) */
#define CA_VECS_PER_PANEL (CA_PANEL / CA_LANES)
_Static_assert(CA_PANEL % CA_LANES == 0, "a panel holds whole vectors");
_Static_assert(CA_TILE_VECS % CA_VECS_PER_PANEL == 0, "a register tile spans whole panels");

/* ---- score and P.V tiles (packed operands) ------------------------- */

/* acc[0..R) x [0..NV) += a[0..R) x [j0..j1) . b[j0..j1) x [0..NV lanes), b
   packed in panels (vector x of a row in panel x / CA_VECS_PER_PANEL, one
   row of a panel per j): the loop both register tiles run, as rank-1
   updates of broadcast a[r][j] times the row b[j] */
CA_SIMD_INLINE void CA_NAME(tile_update)(CA_VEC acc[CA_TILE_ROWS][CA_TILE_VECS],
                                         const CA_T *a, ptrdiff_t lda, const CA_T *b,
                                         ptrdiff_t b_panel_stride, ptrdiff_t j0,
                                         ptrdiff_t j1, const int R, const int NV)
{
    for (ptrdiff_t j = j0; j < j1; ++j) {
        CA_VEC b_j[CA_TILE_VECS];
        for (int x = 0; x < NV; ++x)
            b_j[x] = CA_V(load)(b + (x / CA_VECS_PER_PANEL) * b_panel_stride
                                + j * CA_PANEL + (x % CA_VECS_PER_PANEL) * CA_LANES);
        for (int r = 0; r < R; ++r) {
            const CA_VEC a_rj = CA_V(broadcast)(a + r * lda + j);
            for (int x = 0; x < NV; ++x)
                acc[r][x] = CA_V(fmadd)(a_rj, b_j[x], acc[r][x]);
        }
    }
}

/* s[0..R) x [0..NV lanes) = factor * (q[0..R) . kt[:, 0..NV lanes)); vector
   x of a row lies in panel x / CA_VECS_PER_PANEL. The features c0 .. c1 of
   the dot products, in runs of CA_SUM_FEATURES summed from zero: the first
   run (at feature 0) stores its sums in s, each later one adds them to the
   sums s holds, and the last (ending at d_k) scales them. A float stored
   and loaded again is the same float, so chunks give the bits of one pass. */
CA_SIMD_INLINE void CA_NAME(score_tile)(const CA_T *q, ptrdiff_t ldq, const CA_T *kt,
                                        ptrdiff_t kt_panel_stride, ptrdiff_t c0,
                                        ptrdiff_t c1, ptrdiff_t d_k, CA_T factor, CA_T *s,
                                        ptrdiff_t lds, const int R, const int NV)
{
    CA_VEC acc[CA_TILE_ROWS][CA_TILE_VECS];
    /* one run at least: d_k = 0 writes zeros */
    for (ptrdiff_t r0 = c0; r0 == c0 || r0 < c1; r0 += CA_SUM_FEATURES) {
        const ptrdiff_t r1 = c1 - r0 > CA_SUM_FEATURES ? r0 + CA_SUM_FEATURES : c1;
        for (int r = 0; r < R; ++r)
            for (int x = 0; x < NV; ++x)
                acc[r][x] = CA_V(zero)();
        CA_NAME(tile_update)(acc, q, ldq, kt, kt_panel_stride, r0, r1, R, NV);
        if (r0 > 0)
            for (int r = 0; r < R; ++r)
                for (int x = 0; x < NV; ++x)
                    acc[r][x] = CA_V(add)(CA_V(load)(s + r * lds + x * CA_LANES), acc[r][x]);
        if (r1 < d_k) {
            for (int r = 0; r < R; ++r)
                for (int x = 0; x < NV; ++x)
                    CA_V(store)(s + r * lds + x * CA_LANES, acc[r][x]);
            continue;
        }
        /* read from memory after the loop: held in a register across it, GCC
           12 spilled an operand vector of a 6 x 4 tile instead (24 accumulators,
           4 operands and a broadcast leave 3 of 32 registers free) */
        volatile CA_T factor_in_memory = factor;
        const CA_VEC factor_v = CA_V(set1)(factor_in_memory);
        for (int r = 0; r < R; ++r)
            for (int x = 0; x < NV; ++x)
                CA_V(store)(s + r * lds + x * CA_LANES, CA_V(mul)(acc[r][x], factor_v));
    }
}

/* K^T features per pass over the rows: the tile's strip of K^T, d_k rows
   of its panels, stays in L1 while every row tile reads it (32 KiB) */
#define CA_SCORE_CHUNK (32768 / (CA_TILE_VECS / CA_VECS_PER_PANEL * CA_PANEL * (ptrdiff_t)sizeof(CA_T)))

/* the score tiles of every row for the NV vectors of columns at kt,
   CA_SCORE_CHUNK features at a time */
CA_SIMD_INLINE void CA_NAME(score_columns)(const CA_T *q, ptrdiff_t ldq, ptrdiff_t n_rows,
                                           const CA_T *kt, ptrdiff_t kt_panel_stride,
                                           ptrdiff_t d_k, CA_T factor, CA_T *s, ptrdiff_t lds,
                                           ca_ahead *next, const int NV)
{
    /* one pass at least: d_k = 0 writes zeros */
    for (ptrdiff_t c0 = 0; c0 == 0 || c0 < d_k; c0 += CA_SCORE_CHUNK) {
        const ptrdiff_t c1 = d_k - c0 > CA_SCORE_CHUNK ? c0 + CA_SCORE_CHUNK : d_k;
        ptrdiff_t i = 0;
        for (; i + CA_TILE_ROWS <= n_rows; i += CA_TILE_ROWS, ahead_step(next))
            CA_NAME(score_tile)(q + i * ldq, ldq, kt, kt_panel_stride, c0, c1, d_k, factor,
                                s + i * lds, lds, CA_TILE_ROWS, NV);
        const CA_T *q_tail = q + i * ldq;
        CA_T *s_tail = s + i * lds;
#define CA_SCORE_TAIL(R) \
    CA_NAME(score_tile)(q_tail, ldq, kt, kt_panel_stride, c0, c1, d_k, factor, s_tail, lds, R, NV)
        CA_SWITCH_TAIL_ROWS(n_rows - i, CA_SCORE_TAIL)
#undef CA_SCORE_TAIL
        if (i < n_rows)
            ahead_step(next);
    }
}

CA_SIMD_TARGET static void CA_NAME(score)(const CA_T *q, ptrdiff_t ldq, ptrdiff_t n_rows,
                                          const CA_T *kt, ptrdiff_t kt_panel_stride,
                                          ptrdiff_t n_cols, ptrdiff_t d_k, CA_T factor,
                                          CA_T *s, ptrdiff_t lds, const void *ahead,
                                          ptrdiff_t ahead_bytes)
{
    const ptrdiff_t tile_cols = CA_TILE_VECS * CA_LANES;
    ca_ahead next = ahead_start(ahead, ahead_bytes,
                                ((n_cols + tile_cols - 1) / tile_cols)
                                * ((n_rows + CA_TILE_ROWS - 1) / CA_TILE_ROWS)
                                * (d_k > CA_SCORE_CHUNK ? (d_k + CA_SCORE_CHUNK - 1) / CA_SCORE_CHUNK : 1));
    for (ptrdiff_t j = 0; j < n_cols; j += tile_cols) {
        const CA_T *panel = kt + (j / CA_PANEL) * kt_panel_stride;
        /* n_cols is a multiple of the panel: a tile of several panels may
           find fewer left */
        if (n_cols - j >= tile_cols) {
            CA_NAME(score_columns)(q, ldq, n_rows, panel, kt_panel_stride, d_k, factor,
                                   s + j, lds, &next, CA_TILE_VECS);
        } else {
#define CA_SCORE_VECS(NV) \
    CA_NAME(score_columns)(q, ldq, n_rows, panel, kt_panel_stride, d_k, factor, s + j, lds, \
                           &next, NV)
            CA_SWITCH_TAIL_VECS((n_cols - j) / CA_LANES, CA_SCORE_VECS)
#undef CA_SCORE_VECS
        }
    }
}

/* block_sum is read only after the block's first run wrote it, which gcc
   cannot see through the unrolled loops (a false -Wmaybe-uninitialized) */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
/* acc[0..R) x [0..NV lanes) += p[0..R) x [0..n_keys) . v[0..n_keys) x [0..NV lanes) */
CA_SIMD_INLINE void CA_NAME(pv_tile)(const CA_T *p, ptrdiff_t ldp, const CA_T *v,
                                     ptrdiff_t v_panel_stride, ptrdiff_t n_keys, CA_T *acc,
                                     ptrdiff_t ldacc, const int R, const int NV)
{
    /* runs of CA_SUM_KEYS keys are summed from zero, the runs into
       block_sum, and the block joins acc once (see CA_SUM_KEYS) */
    CA_T block_sum[CA_TILE_ROWS * CA_TILE_VECS * CA_LANES];
    for (ptrdiff_t j0 = 0; j0 < n_keys; j0 += CA_SUM_KEYS) {
        const ptrdiff_t j_end = n_keys - j0 < CA_SUM_KEYS ? n_keys : j0 + CA_SUM_KEYS;
        CA_VEC run_sum[CA_TILE_ROWS][CA_TILE_VECS];
        for (int r = 0; r < R; ++r)
            for (int x = 0; x < NV; ++x)
                run_sum[r][x] = CA_V(zero)();
        CA_NAME(tile_update)(run_sum, p, ldp, v, v_panel_stride, j0, j_end, R, NV);
        /* the run joins block_sum or acc: one branch per run, outside the
           unrolled loops (a branch per vector made gcc keep run_sum on the
           stack) */
#define CA_EACH_VECTOR(STATEMENT) \
    for (int r = 0; r < R; ++r) \
        for (int x = 0; x < NV; ++x) { \
            CA_T *sum_rx = block_sum + (r * CA_TILE_VECS + x) * CA_LANES; \
            CA_T *acc_rx = acc + r * ldacc + x * CA_LANES; \
            (void)sum_rx; (void)acc_rx; \
            STATEMENT; \
        }
        if (j0 == 0 && j_end == n_keys)
            CA_EACH_VECTOR(CA_V(store)(acc_rx, CA_V(add)(CA_V(load)(acc_rx), run_sum[r][x])))
        else if (j0 == 0)
            CA_EACH_VECTOR(CA_V(store)(sum_rx, run_sum[r][x]))
        else if (j_end < n_keys)
            CA_EACH_VECTOR(CA_V(store)(sum_rx, CA_V(add)(CA_V(load)(sum_rx), run_sum[r][x])))
        else
            CA_EACH_VECTOR(CA_V(store)(acc_rx, CA_V(add)(CA_V(load)(acc_rx),
                                       CA_V(add)(CA_V(load)(sum_rx), run_sum[r][x]))))
#undef CA_EACH_VECTOR
    }
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

CA_SIMD_INLINE void CA_NAME(pv_columns)(const CA_T *p, ptrdiff_t ldp, ptrdiff_t n_rows,
                                        const CA_T *v, ptrdiff_t v_panel_stride,
                                        ptrdiff_t n_keys, CA_T *acc, ptrdiff_t ldacc,
                                        ca_ahead *next, const int NV)
{
    ptrdiff_t i = 0;
    for (; i + CA_TILE_ROWS <= n_rows; i += CA_TILE_ROWS, ahead_step(next))
        CA_NAME(pv_tile)(p + i * ldp, ldp, v, v_panel_stride, n_keys, acc + i * ldacc, ldacc,
                         CA_TILE_ROWS, NV);
    const CA_T *p_tail = p + i * ldp;
    CA_T *acc_tail = acc + i * ldacc;
#define CA_PV_TAIL(R) \
    CA_NAME(pv_tile)(p_tail, ldp, v, v_panel_stride, n_keys, acc_tail, ldacc, R, NV)
    CA_SWITCH_TAIL_ROWS(n_rows - i, CA_PV_TAIL)
#undef CA_PV_TAIL
    if (i < n_rows)
        ahead_step(next);
}

CA_SIMD_TARGET static void CA_NAME(pv)(const CA_T *p, ptrdiff_t ldp, ptrdiff_t n_rows,
                                       const CA_T *v, ptrdiff_t v_panel_stride,
                                       ptrdiff_t n_keys, ptrdiff_t n_vcols, CA_T *acc,
                                       ptrdiff_t ldacc, const void *ahead,
                                       ptrdiff_t ahead_bytes)
{
    const ptrdiff_t tile_cols = CA_TILE_VECS * CA_LANES;
    ca_ahead next = ahead_start(ahead, ahead_bytes,
                                ((n_vcols + tile_cols - 1) / tile_cols)
                                * ((n_rows + CA_TILE_ROWS - 1) / CA_TILE_ROWS));
    for (ptrdiff_t c = 0; c < n_vcols; c += tile_cols) {
        const CA_T *panel = v + (c / CA_PANEL) * v_panel_stride;
        if (n_vcols - c >= tile_cols) {
            CA_NAME(pv_columns)(p, ldp, n_rows, panel, v_panel_stride, n_keys, acc + c, ldacc,
                                &next, CA_TILE_VECS);
        } else {
#define CA_PV_VECS(NV) \
    CA_NAME(pv_columns)(p, ldp, n_rows, panel, v_panel_stride, n_keys, acc + c, ldacc, &next, NV)
            CA_SWITCH_TAIL_VECS((n_vcols - c) / CA_LANES, CA_PV_VECS)
#undef CA_PV_VECS
        }
    }
}

/* ---- softmax pieces ------------------------------------------------- */

CA_SIMD_TARGET static CA_T CA_NAME(row_max)(const CA_T *x, ptrdiff_t n)
{
    CA_VEC max_v = CA_V(set1)(-INFINITY);
    CA_PRED nan_v = CA_P(none)();
    ptrdiff_t j = 0;
    for (; j + CA_LANES <= n; j += CA_LANES) {
        const CA_VEC x_v = CA_V(load)(x + j);
        max_v = CA_V(max)(x_v, max_v);
        nan_v = CA_P(or)(nan_v, CA_V(unordered)(x_v, x_v));
    }
    /* max(x, max_v) keeps max_v for a NaN x: max_v holds no NaN */
    CA_T m = CA_V(max_lanes)(max_v);
    int has_nan = CA_P(any)(nan_v);
    for (; j < n; ++j) {
        m = x[j] > m ? x[j] : m;
        has_nan |= x[j] != x[j];
    }
    return has_nan ? (CA_T)NAN : m;
}

/* e^x lane by lane for N vectors, the steps of exp_poly.h's scalar form
   (fused, with the biased rounding constant that makes 2^n one shift),
   taken step by step across the vectors. Each vector's steps are one
   dependent chain (some 50 cycles of latency for float, 80 for double),
   and a core can overlap only the chains its scheduler holds at once:
   written side by side, each chain's next step comes soon after the one it
   waits for, in program order. */
CA_SIMD_INLINE void CA_NAME(exp_vecs)(CA_VEC *x, const int N)
{
    const CA_VEC magic = CA_V(set1)(CA_ROUND_MAGIC);
    CA_VEC t[CA_EXP_VECS], n[CA_EXP_VECS], r[CA_EXP_VECS], p[CA_EXP_VECS];
    /* operand order makes NaN pass through the clamps */
    for (int u = 0; u < N; ++u)
        x[u] = CA_V(min)(CA_V(set1)(CA_EXP_MAX), CA_V(max)(CA_V(set1)(CA_EXP_MIN), x[u]));
    for (int u = 0; u < N; ++u)
        t[u] = CA_V(fmadd)(x[u], CA_V(set1)(CA_LOG2E), magic);
    for (int u = 0; u < N; ++u)
        n[u] = CA_V(sub)(t[u], magic);
    for (int u = 0; u < N; ++u)
        r[u] = CA_V(fnmadd)(n[u], CA_V(set1)(CA_LN2_HI), x[u]);
    for (int u = 0; u < N; ++u)
        r[u] = CA_V(fnmadd)(n[u], CA_V(set1)(CA_LN2_LO), r[u]);
    for (int u = 0; u < N; ++u)
        p[u] = CA_V(set1)(CA_EXP_COEF[CA_EXP_DEGREE]);
    for (int k = CA_EXP_DEGREE - 1; k >= 0; --k)
        for (int u = 0; u < N; ++u)
            p[u] = CA_V(fmadd)(p[u], r[u], CA_V(set1)(CA_EXP_COEF[k]));
    for (int u = 0; u < N; ++u)
        x[u] = CA_V(mul)(p[u], CA_V(pow2_rounded)(t[u]));
}

CA_SIMD_INLINE CA_VEC CA_NAME(exp_vec)(CA_VEC x)
{
    CA_NAME(exp_vecs)(&x, 1);
    return x;
}

/* CA_EXP_VECS vectors at a time, then one at a time; the sum takes the
   values in index order either way, so the bits are those of one vector at
   a time. Independent vectors side by side let a core overlap their
   polynomials' dependency chains, where one vector at a time waits on each
   step's latency. */
CA_SIMD_TARGET static CA_T CA_NAME(exp_sum)(CA_T *x, ptrdiff_t n, CA_T shift)
{
    const CA_VEC shift_v = CA_V(set1)(shift);
    CA_VEC sum_v = CA_V(zero)();
    ptrdiff_t j = 0;
    for (; j + CA_EXP_VECS * CA_LANES <= n; j += CA_EXP_VECS * CA_LANES) {
        CA_VEC e[CA_EXP_VECS];
        for (int u = 0; u < CA_EXP_VECS; ++u)
            e[u] = CA_V(sub)(CA_V(load)(x + j + u * CA_LANES), shift_v);
        CA_NAME(exp_vecs)(e, CA_EXP_VECS);
        for (int u = 0; u < CA_EXP_VECS; ++u) {
            CA_V(store)(x + j + u * CA_LANES, e[u]);
            sum_v = CA_V(add)(sum_v, e[u]);
        }
    }
    for (; j + CA_LANES <= n; j += CA_LANES) {
        const CA_VEC e = CA_NAME(exp_vec)(CA_V(sub)(CA_V(load)(x + j), shift_v));
        CA_V(store)(x + j, e);
        sum_v = CA_V(add)(sum_v, e);
    }
    if (j < n) {
        /* the tail goes through the same vector code on a padded copy */
        CA_T tail[CA_LANES];
        const ptrdiff_t n_tail = n - j;
        for (int l = 0; l < CA_LANES; ++l)
            tail[l] = l < n_tail ? x[j + l] : -INFINITY;
        const CA_VEC e = CA_NAME(exp_vec)(CA_V(sub)(CA_V(load)(tail), shift_v));
        CA_V(store)(tail, e);
        for (ptrdiff_t l = 0; l < n_tail; ++l)
            x[j + l] = tail[l];
        sum_v = CA_V(add)(sum_v, e);
    }
    return CA_V(sum_lanes)(sum_v);
}

/* lanes of x that are inf or NaN (x - x is 0 for finite x, NaN otherwise) */
CA_SIMD_INLINE CA_PRED CA_NAME(nonfinite_lanes)(CA_VEC x)
{
    return CA_V(unordered)(CA_V(sub)(x, x), CA_V(zero)());
}

/* a / b lane by lane with the bits of IEEE division, from multiply-adds
   where it can: a vector division holds its unit as long as a dozen of
   them (on an AVX-512 Xeon 0.19 ns a float, the time of e^x, and 4-5% of a
   BERT-sized call). With y = 1/b rounded to nearest, q = a y is within an
   ulp of a / b, the residual a - b q is exact in one fused multiply-add,
   and q + (a - b q) y rounds to a / b (Markstein's theorem) provided no
   step is subnormal, infinite or NaN. That holds when b and 1/b lie within
   CA_DIV_B_RANGE and |q| within CA_DIV_Q_RANGE of 1 (a factor either way);
   other lanes take the division, zeros too (the correction can lose the
   sign of -0). Checked bit for bit against the division on 1.9 x 10^9
   quotients of each type within the ranges, half of them next to a
   rounding midpoint (there q alone was off in 27% of them). A quotient of
   finite operands in range is finite, so only the lanes that take the
   division can be inf or NaN: those are checked, into *nonfinite, on the
   branch that divides, and the common one costs nothing more. */
CA_SIMD_INLINE CA_VEC CA_NAME(quotient)(CA_VEC a, CA_VEC b, CA_VEC y, CA_VEC q_min,
                                        CA_VEC q_max, CA_PRED *nonfinite)
{
    const CA_VEC q = CA_V(mul)(a, y);
    const CA_VEC rounded = CA_V(fmadd)(CA_V(fnmadd)(q, b, a), y, q);
    const CA_PRED divide = CA_V(outside)(CA_V(abs)(q), q_min, q_max);
    if (!CA_P(any)(divide))
        return rounded;
    const CA_VEC exact = CA_V(select)(divide, CA_V(div)(a, b), rounded);
    *nonfinite = CA_P(or)(*nonfinite, CA_NAME(nonfinite_lanes)(exact));
    return exact;
}

/* the tail is divided one element at a time, with the same bits */
CA_SIMD_TARGET static int CA_NAME(divide_rows)(const CA_T *acc, ptrdiff_t ldacc,
                                               ptrdiff_t n_rows, ptrdiff_t n_cols,
                                               const CA_T *divisor, CA_T *out,
                                               ptrdiff_t ld_out)
{
    const CA_VEC q_min = CA_V(set1)((CA_T)1 / CA_DIV_Q_RANGE);
    const CA_VEC q_max = CA_V(set1)(CA_DIV_Q_RANGE);
    CA_PRED nonfinite = CA_P(none)();
    int nonfinite_tail = 0;
    for (ptrdiff_t i = 0; i < n_rows; ++i) {
        const CA_T *acc_row = acc + i * ldacc;
        CA_T *out_row = out + i * ld_out;
        const CA_T b = divisor[i];
        const CA_T b_abs = b < 0 ? -b : b;
        const CA_VEC b_v = CA_V(set1)(b);
        ptrdiff_t c = 0;
        if (b_abs >= (CA_T)1 / CA_DIV_B_RANGE && b_abs <= CA_DIV_B_RANGE) {
            const CA_VEC y_v = CA_V(set1)((CA_T)1 / b);
            for (; c + CA_LANES <= n_cols; c += CA_LANES)
                CA_V(store)(out_row + c, CA_NAME(quotient)(CA_V(load)(acc_row + c), b_v, y_v,
                                                           q_min, q_max, &nonfinite));
        } else {
            for (; c + CA_LANES <= n_cols; c += CA_LANES) {
                const CA_VEC q = CA_V(div)(CA_V(load)(acc_row + c), b_v);
                CA_V(store)(out_row + c, q);
                nonfinite = CA_P(or)(nonfinite, CA_NAME(nonfinite_lanes)(q));
            }
        }
        for (; c < n_cols; ++c) {
            out_row[c] = acc_row[c] / b;
            nonfinite_tail |= out_row[c] - out_row[c] != 0;
        }
    }
    return nonfinite_tail || CA_P(any)(nonfinite);
}

/* ---- few query rows, K and V read in place (decode) ------------------ */

#define CA_KV_T CA_T
#define CA_KV_LOAD(p) CA_V(load)(p)
#define CA_KV_LOAD_LANES(p, m) CA_V(load_lanes)(p, m)
#define CA_DIRECT_NAME(x) CA_NAME(x)
#include "kernels_simd_direct.h"

#undef CA_VECS_PER_PANEL
#undef CA_T
#undef CA_NAME
#undef CA_V
#undef CA_P
#undef CA_VEC
#undef CA_MASK
#undef CA_PRED
#undef CA_LANES
#undef CA_PANEL
#undef CA_ROUND_MAGIC
#undef CA_EXP_MIN
#undef CA_EXP_MAX
#undef CA_LOG2E
#undef CA_LN2_HI
#undef CA_LN2_LO
#undef CA_EXP_COEF
#undef CA_EXP_DEGREE
#undef CA_DIV_B_RANGE
#undef CA_DIV_Q_RANGE
