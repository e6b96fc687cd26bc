/*
 * The decode kernels (few query rows, K and V read where they lie), written
 * once for K and V stored in the compute type or narrower: included by
 * kernels_simd_typed.h for float32 and float64 (K and V of that type) and
 * by kernels_simd.h for float32 with float16 K and V. Its parameters, which
 * it undefines at its end, besides kernels_simd_typed.h's:
 *   CA_KV_T                 the element type of K and V as stored
 *   CA_KV_LOAD(p)           CA_LANES elements at p as a CA_VEC
 *   CA_KV_LOAD_LANES(p, m)  the leading lanes m of them, the others 0
 *   CA_DIRECT_NAME(x)       the name of kernel x for this pair of types
 *   CA_KV_SHARED_ROWS       (defined or not) P.V widens each vector of V
 *                           once for several rows (types narrower than the
 *                           compute type)
 *   CA_KV_LOAD_PAIR(p, a, b) (optional) 2 * CA_LANES elements at p as two
 *                           CA_VECs in the mapping's pair order: P.V reads
 *                           whole pairs of V's vectors so, and puts its
 *                           sums back in order (CA_V(pair_in_order))
 *                           before they join acc; every column's sum takes
 *                           the same steps, so the bits are the same. A
 *                           held query (score_rows_held) of an even number
 *                           of vectors reads its keys in pairs too, its
 *                           own features put in that order.
 * A narrower type is converted exactly in registers, so each kernel gives
 * the bits of converting K and V first and calling the compute type's
 * (but for the logits of keys read in pairs, whose lanes sum other
 * features).
 */

/* score_direct for ROWS (1 or 2) rows whose d_k = NV * CA_LANES features
   stay in registers for the whole call: each key's row of K is read in
   order, one after the other, and q is never loaded again. Every dot
   product takes the FMAs of the loop in score_direct, in the same order
   (features ascending, one accumulator per key), so the bits are the same.
   `prefetch` says whether these rows issue the keys' prefetches into L2
   (the first rows of a call do, once per key). */
CA_SIMD_INLINE void CA_DIRECT_NAME(score_rows_held)(
    const CA_T *q, ptrdiff_t ldq, const CA_KV_T *k, ptrdiff_t ldk, ptrdiff_t n_keys,
    CA_T factor, CA_T *s, ptrdiff_t lds, int prefetch, const void *ahead,
    ptrdiff_t ahead_stride, ptrdiff_t ahead_bytes, const int NV, const int ROWS)
{
    _Static_assert(CA_DIRECT_ROW_VECS <= 8 && CA_DIRECT_PAIR_VECS <= CA_DIRECT_ROW_VECS,
                   "a held row has at most 8 vectors, a pair's rows no more than one's");
    CA_VEC q_v[2][8];
    for (int i = 0; i < ROWS; ++i)
        for (int x = 0; x < NV; ++x)
            q_v[i][x] = CA_V(load)(q + i * ldq + x * CA_LANES);
#ifdef CA_KV_LOAD_PAIR
    /* keys read in pairs of vectors, q's features in the same order
       (CA_V(pair_in_order) is its own inverse): a lane sums other
       features than the loop below does, so these logits' bits are their
       own (P.V's are not changed by pairs) */
    const int PAIRS = NV % 2 == 0;
    if (PAIRS)
        for (int i = 0; i < ROWS; ++i)
            for (int x = 0; x < NV; x += 2)
                CA_V(pair_in_order)(&q_v[i][x], &q_v[i][x + 1]);
#else
    const int PAIRS = 0;
#endif
    for (ptrdiff_t j = 0; j < n_keys; j += 4) {
        const ptrdiff_t n_group = n_keys - j < 4 ? n_keys - j : 4;
        const CA_KV_T *rows[4];
        rows[0] = k + j * ldk;
        for (int l = 1; l < 4; ++l)
            rows[l] = rows[0] + (n_group > l ? l * ldk : 0);
        if (prefetch)
            for (ptrdiff_t l = 0; l < n_group; ++l)
                prefetch_ahead(ahead, ahead_stride, ahead_bytes, j + l);
        CA_VEC dot[2][4];
        for (int l = 0; l < 4; ++l) {
            CA_VEC a0 = CA_V(zero)(), a1 = CA_V(zero)();
            for (int x = 0; x < NV; x += 1 + PAIRS) {
#ifdef CA_KV_LOAD_PAIR
                if (PAIRS) {
                    CA_VEC k_a, k_b;
                    CA_KV_LOAD_PAIR(rows[l] + x * CA_LANES, k_a, k_b);
                    a0 = CA_V(fmadd)(q_v[0][x], k_a, a0);
                    if (ROWS == 2)
                        a1 = CA_V(fmadd)(q_v[1][x], k_a, a1);
                    a0 = CA_V(fmadd)(q_v[0][x + 1], k_b, a0);
                    if (ROWS == 2)
                        a1 = CA_V(fmadd)(q_v[1][x + 1], k_b, a1);
                    continue;
                }
#endif
                const CA_VEC k_x = CA_KV_LOAD(rows[l] + x * CA_LANES);
                a0 = CA_V(fmadd)(q_v[0][x], k_x, a0);
                if (ROWS == 2)
                    a1 = CA_V(fmadd)(q_v[1][x], k_x, a1);
            }
            dot[0][l] = a0;
            dot[1][l] = a1;
        }
        for (int i = 0; i < ROWS; ++i) {
            CA_T dots[4];
            CA_V(sum4)(dot[i][0], dot[i][1], dot[i][2], dot[i][3], dots);
            for (ptrdiff_t l = 0; l < n_group; ++l)
                s[i * lds + j + l] = dots[l] * factor;
        }
    }
}

CA_SIMD_TARGET static void CA_DIRECT_NAME(score_direct)(
    const CA_T *q, ptrdiff_t ldq, ptrdiff_t n_rows, const CA_KV_T *k, ptrdiff_t ldk,
    ptrdiff_t n_keys, ptrdiff_t d_k, CA_T factor, CA_T *s, ptrdiff_t lds, const void *ahead,
    ptrdiff_t ahead_stride, ptrdiff_t ahead_bytes)
{
    const ptrdiff_t n_vecs = d_k / CA_LANES;
    /* q held in registers where its features fill whole vectors and fit:
       one row (decode), or rows in pairs (grouped heads, several queries)
       where a pair fits, so that a key's vectors are loaded once and meet
       the query in registers (the same bits as the loop below). Several
       rows each held alone would read the step's keys once per row, where
       the loop below reads them once per pair, so they take the loop. */
    if (d_k % CA_LANES == 0 && n_vecs >= 1 && n_vecs <= CA_DIRECT_ROW_VECS
        && (n_rows == 1 || n_vecs <= CA_DIRECT_PAIR_VECS)) {
        ptrdiff_t r = 0;
        /* (NV above the mapping's limit is never taken: such cases
           instantiate the kernel for one vector) */
#define CA_SCORE_HELD(NV, ROWS, LIMIT) \
        CA_DIRECT_NAME(score_rows_held)(q + r * ldq, ldq, k, ldk, n_keys, factor, s + r * lds, \
                                        lds, r == 0, ahead, ahead_stride, ahead_bytes, \
                                        (NV) <= (LIMIT) ? (NV) : 1, ROWS)
#define CA_SCORE_HELD_PAIR(NV) CA_SCORE_HELD(NV, 2, CA_DIRECT_PAIR_VECS)
#define CA_SCORE_HELD_ROW(NV) CA_SCORE_HELD(NV, 1, CA_DIRECT_ROW_VECS)
        if (n_vecs <= CA_DIRECT_PAIR_VECS)
            for (; r + 2 <= n_rows; r += 2)
                CA_SWITCH_DIRECT_VECS(n_vecs, CA_SCORE_HELD_PAIR)
        for (; r < n_rows; ++r)
            CA_SWITCH_DIRECT_VECS(n_vecs, CA_SCORE_HELD_ROW)
#undef CA_SCORE_HELD_ROW
#undef CA_SCORE_HELD_PAIR
#undef CA_SCORE_HELD
        return;
    }
    const ptrdiff_t d_main = d_k & ~(ptrdiff_t)(CA_LANES - 1);
    const CA_MASK tail = CA_V(lanes)(d_k - d_main);
    /* no L1 prefetch of the keys' own rows: but for a chunk's first step,
       P.V of the step before brought them into L2 (prefetch_ahead), and
       prefetching them into L1 too takes load slots the loads need (one
       prefetch per line of K: as many as the vector loads of K with
       AVX-512, half as many with AVX2). int8's kernel keeps its own */
    for (ptrdiff_t j = 0; j < n_keys; j += 4) {
        /* four keys at a time share one horizontal reduction */
        const ptrdiff_t n_group = n_keys - j < 4 ? n_keys - j : 4;
        const CA_KV_T *k0 = k + j * ldk;
        const CA_KV_T *k1 = k0 + (n_group > 1 ? ldk : 0);
        const CA_KV_T *k2 = k0 + (n_group > 2 ? 2 * ldk : 0);
        const CA_KV_T *k3 = k0 + (n_group > 3 ? 3 * ldk : 0);
        for (ptrdiff_t l = 0; l < n_group; ++l)
            prefetch_ahead(ahead, ahead_stride, ahead_bytes, j + l);
        ptrdiff_t r = 0;
        /* rows in pairs (grouped heads, several queries): each key vector
           loaded once for both, and eight chains of FMAs in flight, not
           four; a row's dot products take the same steps either way */
        for (; r + 2 <= n_rows; r += 2) {
            const CA_T *q_r = q + r * ldq;
            const CA_T *q_n = q_r + ldq;
            CA_VEC a0 = CA_V(zero)(), a1 = CA_V(zero)();
            CA_VEC a2 = CA_V(zero)(), a3 = CA_V(zero)();
            CA_VEC b0 = CA_V(zero)(), b1 = CA_V(zero)();
            CA_VEC b2 = CA_V(zero)(), b3 = CA_V(zero)();
            ptrdiff_t c = 0;
            for (; c < d_main; c += CA_LANES) {
                const CA_VEC q_c = CA_V(load)(q_r + c);
                const CA_VEC q_d = CA_V(load)(q_n + c);
                CA_VEC k_c = CA_KV_LOAD(k0 + c);
                a0 = CA_V(fmadd)(q_c, k_c, a0);
                b0 = CA_V(fmadd)(q_d, k_c, b0);
                k_c = CA_KV_LOAD(k1 + c);
                a1 = CA_V(fmadd)(q_c, k_c, a1);
                b1 = CA_V(fmadd)(q_d, k_c, b1);
                k_c = CA_KV_LOAD(k2 + c);
                a2 = CA_V(fmadd)(q_c, k_c, a2);
                b2 = CA_V(fmadd)(q_d, k_c, b2);
                k_c = CA_KV_LOAD(k3 + c);
                a3 = CA_V(fmadd)(q_c, k_c, a3);
                b3 = CA_V(fmadd)(q_d, k_c, b3);
            }
            if (c < d_k) {
                const CA_VEC q_c = CA_V(load_lanes)(q_r + c, tail);
                const CA_VEC q_d = CA_V(load_lanes)(q_n + c, tail);
                CA_VEC k_c = CA_KV_LOAD_LANES(k0 + c, tail);
                a0 = CA_V(fmadd)(q_c, k_c, a0);
                b0 = CA_V(fmadd)(q_d, k_c, b0);
                k_c = CA_KV_LOAD_LANES(k1 + c, tail);
                a1 = CA_V(fmadd)(q_c, k_c, a1);
                b1 = CA_V(fmadd)(q_d, k_c, b1);
                k_c = CA_KV_LOAD_LANES(k2 + c, tail);
                a2 = CA_V(fmadd)(q_c, k_c, a2);
                b2 = CA_V(fmadd)(q_d, k_c, b2);
                k_c = CA_KV_LOAD_LANES(k3 + c, tail);
                a3 = CA_V(fmadd)(q_c, k_c, a3);
                b3 = CA_V(fmadd)(q_d, k_c, b3);
            }
            CA_T dots[4], dots_n[4];
            CA_V(sum4)(a0, a1, a2, a3, dots);
            CA_V(sum4)(b0, b1, b2, b3, dots_n);
            for (ptrdiff_t l = 0; l < n_group; ++l) {
                s[r * lds + j + l] = dots[l] * factor;
                s[(r + 1) * lds + j + l] = dots_n[l] * factor;
            }
        }
        for (; r < n_rows; ++r) {
            const CA_T *q_r = q + r * ldq;
            CA_VEC a0 = CA_V(zero)(), a1 = CA_V(zero)();
            CA_VEC a2 = CA_V(zero)(), a3 = CA_V(zero)();
            ptrdiff_t c = 0;
            for (; c < d_main; c += CA_LANES) {
                const CA_VEC q_c = CA_V(load)(q_r + c);
                a0 = CA_V(fmadd)(q_c, CA_KV_LOAD(k0 + c), a0);
                a1 = CA_V(fmadd)(q_c, CA_KV_LOAD(k1 + c), a1);
                a2 = CA_V(fmadd)(q_c, CA_KV_LOAD(k2 + c), a2);
                a3 = CA_V(fmadd)(q_c, CA_KV_LOAD(k3 + c), a3);
            }
            if (c < d_k) {
                const CA_VEC q_c = CA_V(load_lanes)(q_r + c, tail);
                a0 = CA_V(fmadd)(q_c, CA_KV_LOAD_LANES(k0 + c, tail), a0);
                a1 = CA_V(fmadd)(q_c, CA_KV_LOAD_LANES(k1 + c, tail), a1);
                a2 = CA_V(fmadd)(q_c, CA_KV_LOAD_LANES(k2 + c, tail), a2);
                a3 = CA_V(fmadd)(q_c, CA_KV_LOAD_LANES(k3 + c, tail), a3);
            }
            CA_T dots[4];
            CA_V(sum4)(a0, a1, a2, a3, dots);
            for (ptrdiff_t l = 0; l < n_group; ++l)
                s[r * lds + j + l] = dots[l] * factor;
        }
    }
}

#ifdef CA_KV_LOAD_PAIR
/* whether vectors x and x + 1 (x even) of a pass over NV vectors are read
   as a pair: both whole (the last one is when LAST_FULL). NV and LAST_FULL
   are constants of the instantiation, so that the vectors stay in
   registers (a condition known only at run time, measured, made grouped
   decodes a third slower) */
#define CA_PAIRED(x, NV, LAST_FULL) ((x) + 1 < (NV) - 1 || ((x) + 1 == (NV) - 1 && (LAST_FULL)))

/* the NV vectors of a row of V, whole pairs in pair order, the last vector
   masked by tail */
CA_SIMD_INLINE void CA_DIRECT_NAME(v_row)(const CA_KV_T *v_j, CA_MASK tail, CA_VEC *v_x,
                                          const int NV, const int LAST_FULL)
{
    for (int x = 0; x < NV; x += 2) {
        if (CA_PAIRED(x, NV, LAST_FULL)) {
            CA_KV_LOAD_PAIR(v_j + CA_LANES * x, v_x[x], v_x[x + 1]);
        } else if (x == NV - 1) {
            v_x[x] = CA_KV_LOAD_LANES(v_j + CA_LANES * x, tail);
        } else {
            v_x[x] = CA_KV_LOAD(v_j + CA_LANES * x);
            v_x[x + 1] = CA_KV_LOAD_LANES(v_j + CA_LANES * (x + 1), tail);
        }
    }
}

/* sums of v_row's vectors back in the columns' order */
CA_SIMD_INLINE void CA_DIRECT_NAME(in_order)(CA_VEC *sums, const int NV, const int LAST_FULL)
{
    for (int x = 0; x + 1 < NV; x += 2)
        if (CA_PAIRED(x, NV, LAST_FULL))
            CA_V(pair_in_order)(&sums[x], &sums[x + 1]);
}
#define CA_RUNS_IN_ORDER(sums, NV) CA_DIRECT_NAME(in_order)(sums, NV, LAST_FULL)
#else
#define CA_RUNS_IN_ORDER(sums, NV) (void)LAST_FULL
#endif

/* acc[0..NV vectors) += sum_j p[j] v_j[...], the last vector masked by tail
   (whole when LAST_FULL) */
CA_SIMD_INLINE void CA_DIRECT_NAME(pv_direct_cols)(
    const CA_T *p, const CA_KV_T *v, ptrdiff_t ldv, ptrdiff_t n_keys, ptrdiff_t n_bytes_row,
    int prefetch, const void *ahead, ptrdiff_t ahead_stride, ptrdiff_t ahead_bytes,
    CA_MASK tail, CA_T *acc, const int NV, const int LAST_FULL)
{
    /* runs of CA_SUM_KEYS keys are summed from zero and then added to acc */
    CA_VEC run[DIRECT_VECS];
    const ptrdiff_t keys_ahead = DIRECT_PREFETCH_KEYS(n_keys);
    for (int x = 0; x < NV; ++x)
        run[x] = CA_V(zero)();
    for (ptrdiff_t j = 0; j < n_keys; ++j) {
        if (j % CA_SUM_KEYS == 0) {
            if (j > 0) {
                CA_RUNS_IN_ORDER(run, NV);
                for (int x = 0; x < NV; ++x) {
                    CA_T *acc_x = acc + CA_LANES * x;
                    CA_V(store)(acc_x, CA_V(add)(CA_V(load)(acc_x), run[x]));
                }
            }
            for (int x = 0; x < NV; ++x)
                run[x] = CA_V(zero)();
        }
        if (prefetch) {
            if (j + keys_ahead < n_keys)
                prefetch_row(v + (j + keys_ahead) * ldv, n_bytes_row);
            prefetch_ahead(ahead, ahead_stride, ahead_bytes, j);
        }
        if (p[j] == 0)
            continue;
        const CA_VEC p_j = CA_V(set1)(p[j]);
        const CA_KV_T *v_j = v + j * ldv;
#ifdef CA_KV_LOAD_PAIR
        CA_VEC v_x[DIRECT_VECS];
        CA_DIRECT_NAME(v_row)(v_j, tail, v_x, NV, LAST_FULL);
        for (int x = 0; x < NV; ++x)
            run[x] = CA_V(fmadd)(p_j, v_x[x], run[x]);
#else
        for (int x = 0; x < NV - 1; ++x)
            run[x] = CA_V(fmadd)(p_j, CA_KV_LOAD(v_j + CA_LANES * x), run[x]);
        run[NV - 1] = CA_V(fmadd)(p_j, CA_KV_LOAD_LANES(v_j + CA_LANES * (NV - 1), tail),
                                  run[NV - 1]);
#endif
    }
    if (n_keys > 0) {
        CA_RUNS_IN_ORDER(run, NV);
        for (int x = 0; x < NV; ++x) {
            CA_T *acc_x = acc + CA_LANES * x;
            CA_V(store)(acc_x, CA_V(add)(CA_V(load)(acc_x), run[x]));
        }
    }
}

#ifdef CA_KV_SHARED_ROWS
/* pv_direct_cols for ROWS rows at once (ROWS * NV <= CA_DIRECT_SHARED_VECS
   accumulators), for K/V stored narrower than the compute type: each
   vector of V is widened once for every row, where rows one at a time
   widen it once each (grouped heads stack 4 or more rows on one K/V head,
   and the widening, not the memory, bounds such a step). Every row's sums
   take the steps they take alone: its keys of weight 0 are skipped, the
   others added in order, in runs of CA_SUM_KEYS. */
CA_SIMD_INLINE void CA_DIRECT_NAME(pv_direct_rows_cols)(
    const CA_T *p, ptrdiff_t ldp, const CA_KV_T *v, ptrdiff_t ldv, ptrdiff_t n_keys,
    ptrdiff_t n_bytes_row, int prefetch, const void *ahead, ptrdiff_t ahead_stride,
    ptrdiff_t ahead_bytes, CA_MASK tail, CA_T *acc, ptrdiff_t ldacc, const int NV,
    const int ROWS, const int LAST_FULL)
{
    CA_VEC run[4][DIRECT_VECS];
    const ptrdiff_t keys_ahead = DIRECT_PREFETCH_KEYS(n_keys);
    for (int i = 0; i < ROWS; ++i)
        for (int x = 0; x < NV; ++x)
            run[i][x] = CA_V(zero)();
    for (ptrdiff_t j = 0; j < n_keys; ++j) {
        if (j % CA_SUM_KEYS == 0 && j > 0)
            for (int i = 0; i < ROWS; ++i) {
                CA_RUNS_IN_ORDER(run[i], NV);
                for (int x = 0; x < NV; ++x) {
                    CA_T *acc_x = acc + i * ldacc + CA_LANES * x;
                    CA_V(store)(acc_x, CA_V(add)(CA_V(load)(acc_x), run[i][x]));
                    run[i][x] = CA_V(zero)();
                }
            }
        if (prefetch) {
            if (j + keys_ahead < n_keys)
                prefetch_row(v + (j + keys_ahead) * ldv, n_bytes_row);
            prefetch_ahead(ahead, ahead_stride, ahead_bytes, j);
        }
        int used = 0;
        for (int i = 0; i < ROWS; ++i)
            used |= p[i * ldp + j] != 0;
        if (!used)
            continue;
        const CA_KV_T *v_j = v + j * ldv;
        CA_VEC v_x[DIRECT_VECS];
#ifdef CA_KV_LOAD_PAIR
        CA_DIRECT_NAME(v_row)(v_j, tail, v_x, NV, LAST_FULL);
#else
        for (int x = 0; x < NV - 1; ++x)
            v_x[x] = CA_KV_LOAD(v_j + CA_LANES * x);
        v_x[NV - 1] = CA_KV_LOAD_LANES(v_j + CA_LANES * (NV - 1), tail);
#endif
        for (int i = 0; i < ROWS; ++i) {
            if (p[i * ldp + j] == 0)
                continue;
            const CA_VEC p_j = CA_V(set1)(p[i * ldp + j]);
            for (int x = 0; x < NV; ++x)
                run[i][x] = CA_V(fmadd)(p_j, v_x[x], run[i][x]);
        }
    }
    if (n_keys > 0)
        for (int i = 0; i < ROWS; ++i) {
            CA_RUNS_IN_ORDER(run[i], NV);
            for (int x = 0; x < NV; ++x) {
                CA_T *acc_x = acc + i * ldacc + CA_LANES * x;
                CA_V(store)(acc_x, CA_V(add)(CA_V(load)(acc_x), run[i][x]));
            }
        }
}

#endif

/* rows rows of pv_direct from row r: one, DIRECT_VECS vectors of columns
   per pass, or (CA_KV_SHARED_ROWS) 2 or 4 sharing each widened V vector,
   CA_DIRECT_SHARED_VECS / rows */
CA_SIMD_INLINE void CA_DIRECT_NAME(pv_direct_group)(
    const CA_T *p, ptrdiff_t ldp, ptrdiff_t r, const int rows, const CA_KV_T *v, ptrdiff_t ldv,
    ptrdiff_t n_keys, ptrdiff_t d_v, CA_T *acc, ptrdiff_t ldacc, const void *ahead,
    ptrdiff_t ahead_stride, ptrdiff_t ahead_bytes)
{
    const ptrdiff_t pass_cols = ((rows > 1 ? CA_DIRECT_SHARED_VECS : DIRECT_VECS) / rows) * CA_LANES;
    for (ptrdiff_t c = 0; c < d_v; c += pass_cols) {
        const ptrdiff_t width = d_v - c < pass_cols ? d_v - c : pass_cols;
        const int n_vec = (int)((width + CA_LANES - 1) / CA_LANES);
        const CA_MASK tail = CA_V(lanes)(width - CA_LANES * (n_vec - 1));
        /* the first pass over V brings its rows in for the others */
        const int prefetch = r == 0 && c == 0;
        const CA_T *p_r = p + r * ldp;
        CA_T *acc_rc = acc + r * ldacc + c;
        const ptrdiff_t row_bytes = d_v * (ptrdiff_t)sizeof(CA_KV_T);
        /* (NV above CA_DIRECT_SHARED_VECS / ROWS is never taken: such
           cases instantiate the pass for one vector) */
#define CA_PV_SHARED_PASS(NV, ROWS, LAST_FULL) \
        CA_DIRECT_NAME(pv_direct_rows_cols)(p_r, ldp, v + c, ldv, n_keys, row_bytes, prefetch, \
                                            ahead, ahead_stride, ahead_bytes, tail, acc_rc, \
                                            ldacc, (NV) * (ROWS) <= CA_DIRECT_SHARED_VECS ? (NV) : 1, \
                                            ROWS, LAST_FULL)
#define CA_PV_QUAD(NV) CA_PV_SHARED_PASS(NV, 4, CA_LAST_FULL)
#define CA_PV_PAIR(NV) CA_PV_SHARED_PASS(NV, 2, CA_LAST_FULL)
#define CA_PV_ONE(NV) \
        CA_DIRECT_NAME(pv_direct_cols)(p_r, v + c, ldv, n_keys, row_bytes, prefetch, ahead, \
                                       ahead_stride, ahead_bytes, tail, acc_rc, NV, CA_LAST_FULL)
#ifdef CA_KV_SHARED_ROWS
#define CA_PV_PASS \
        if (rows == 4) \
            CA_SWITCH_DIRECT_VECS(n_vec, CA_PV_QUAD) \
        else if (rows == 2) \
            CA_SWITCH_DIRECT_VECS(n_vec, CA_PV_PAIR) \
        else \
            CA_SWITCH_DIRECT_VECS(n_vec, CA_PV_ONE)
#else
#define CA_PV_PASS CA_SWITCH_DIRECT_VECS(n_vec, CA_PV_ONE)
#endif
#ifdef CA_KV_LOAD_PAIR
        /* a whole last vector joins a pair: its own instantiation */
        if (width == CA_LANES * n_vec) {
#define CA_LAST_FULL 1
            CA_PV_PASS
#undef CA_LAST_FULL
            continue;
        }
#endif
#define CA_LAST_FULL 0
        CA_PV_PASS
#undef CA_LAST_FULL
#undef CA_PV_PASS
#undef CA_PV_ONE
#undef CA_PV_PAIR
#undef CA_PV_QUAD
#undef CA_PV_SHARED_PASS
    }
}

CA_SIMD_TARGET static void CA_DIRECT_NAME(pv_direct)(
    const CA_T *p, ptrdiff_t ldp, ptrdiff_t n_rows, const CA_KV_T *v, ptrdiff_t ldv,
    ptrdiff_t n_keys, ptrdiff_t d_v, CA_T *acc, ptrdiff_t ldacc, const void *ahead,
    ptrdiff_t ahead_stride, ptrdiff_t ahead_bytes)
{
    ptrdiff_t r = 0;
#ifdef CA_KV_SHARED_ROWS
    for (; r + 4 <= n_rows; r += 4)
        CA_DIRECT_NAME(pv_direct_group)(p, ldp, r, 4, v, ldv, n_keys, d_v, acc, ldacc, ahead,
                                        ahead_stride, ahead_bytes);
    for (; r + 2 <= n_rows; r += 2)
        CA_DIRECT_NAME(pv_direct_group)(p, ldp, r, 2, v, ldv, n_keys, d_v, acc, ldacc, ahead,
                                        ahead_stride, ahead_bytes);
#endif
    for (; r < n_rows; ++r)
        CA_DIRECT_NAME(pv_direct_group)(p, ldp, r, 1, v, ldv, n_keys, d_v, acc, ldacc, ahead,
                                        ahead_stride, ahead_bytes);
}

#undef CA_RUNS_IN_ORDER
#undef CA_PAIRED
#undef CA_KV_T
#undef CA_KV_LOAD
#undef CA_KV_LOAD_LANES
#undef CA_KV_LOAD_PAIR
#undef CA_KV_SHARED_ROWS
#undef CA_DIRECT_NAME
