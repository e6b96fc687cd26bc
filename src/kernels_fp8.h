/*
 * fp8 K/V for a table (kernels.h: score_direct_fp8, pv_direct_fp8), written
 * once over the table's unscaled decode kernels of each format, which the
 * including file defines first (score_direct_e4m3 / _e5m2, pv_direct_e4m3 /
 * _e5m2: the decode kernels of kernels_simd_direct.h, or the portable
 * ones, with K and V read as CA_E4M3_UNIT times the E4M3FN value, exactly,
 * and as the E5M2 value).
 *
 * A table whose E4M3FN widening needs extra steps for NaN codes defines
 * CA_E4M3_NAN_KERNELS and a second pair, score_direct_e4m3nan and
 * pv_direct_e4m3nan, that take them; the pair without is then used only on
 * rows a scan finds free of NaN codes (every cache but one that stored a
 * NaN): the scan costs a few byte operations per 32 codes, the fixing three
 * vector operations per vector.
 *
 * The scales join outside the products, as int8's do: a key's scale
 * multiplies its finished logit, a value's scale its weight. A per-tensor
 * scale so costs nothing per feature, and a per-row one no more.
 *
 * CA_E4M3_UNIT is a power of two (a SIMD table widens E4M3FN into a
 * binary16 2^8 below its value, see vf32_load_e4m3), so dividing it out of
 * the scale is exact: every product, sum and rounding is the one of the
 * values themselves (outside float32's subnormal range). A table whose
 * kernels for rows without a NaN code read another unit defines it as
 * CA_E4M3_FINITE_UNIT (see e4m3_query_up).
 */
#ifndef CA_E4M3_UNIT
#define CA_E4M3_UNIT 1.0f
#endif
#ifndef CA_SIMD_TARGET
#define CA_SIMD_TARGET
#endif

/* rows of a P.V call whose weights one pass holds (the driver's decode
   items have at most DIRECT_ROWS = 8) */
#define CA_FP8_WEIGHT_ROWS 8

#ifdef CA_E4M3_NAN_KERNELS
/* whether any of n_rows rows of n_cols E4M3FN codes (ld apart) is a NaN
   code, S.1111.111: its low seven bits plus one carry into the eighth
   (byte arithmetic, which the compiler vectorises) */
CA_SIMD_TARGET static int e4m3_has_nan(const uint8_t *rows, ptrdiff_t ld, ptrdiff_t n_rows,
                                       ptrdiff_t n_cols)
{
    uint8_t seen = 0;
    if (ld == n_cols) {
        /* rows back to back: one run, one reduction of the vector lanes */
        n_cols *= n_rows;
        n_rows = 1;
    }
    for (ptrdiff_t r = 0; r < n_rows; ++r)
        for (ptrdiff_t c = 0; c < n_cols; ++c)
            seen |= (uint8_t)((rows[r * ld + c] & 0x7Fu) + 1u);
    return (seen & 0x80u) != 0;
}
#define CA_E4M3_HAS_NAN(codes, ld, n_rows, n_cols) e4m3_has_nan(codes, ld, n_rows, n_cols)
#define CA_E4M3_KERNEL_KEEPING_NAN pv_direct_e4m3nan
#else
/* (the table's one E4M3FN kernel keeps NaN codes) */
#define CA_E4M3_HAS_NAN(codes, ld, n_rows, n_cols) 0
#define CA_E4M3_KERNEL_KEEPING_NAN pv_direct_e4m3
#endif

#ifdef CA_E4M3_FINITE_UNIT
/* The table's kernels for E4M3FN rows without a NaN code read each code as
   CA_E4M3_FINITE_UNIT (2^-120) times its value, a float32 subnormal for the
   smallest codes: q and the weights take the 2^120 instead, exactly, so
   that every product is the one of the values and every sum and rounding
   as in the binary16 kernels (the bits do not depend on the kernel taken).
   They take it where it stays finite (|q| and weights below 2^8) and where
   this thread reads subnormals as themselves; elsewhere the binary16
   kernels (e4m3nan, CA_E4M3_UNIT) run. */
#define CA_FP8_UP (1.0f / CA_E4M3_FINITE_UNIT)
/* the largest |q| or weight that stays finite brought up: just below 2^8 */
#define CA_FP8_UP_LARGEST 0x1.fffffep7f
/* q rows one call brings up at most (8 rows of 256 features) */
#define CA_FP8_QUERY_FLOATS 2048

/* q_up = q * 2^120, rows d_k apart; whether the finite kernels may read it */
CA_SIMD_TARGET static int e4m3_query_up(const float *q, ptrdiff_t ldq, ptrdiff_t n_rows,
                                        ptrdiff_t d_k, float *q_up)
{
    if (n_rows * d_k > CA_FP8_QUERY_FLOATS || !ca_subnormals_read())
        return 0;
    const vf32 up = vf32_set1(CA_FP8_UP);
    const vf32 hi = vf32_set1(CA_FP8_UP_LARGEST), lo = vf32_set1(-CA_FP8_UP_LARGEST);
    pf32 beyond = pf32_none();
    for (ptrdiff_t r = 0; r < n_rows; ++r) {
        const float *row = q + r * ldq;
        float *out = q_up + r * d_k;
        ptrdiff_t c = 0;
        for (; c + LANES <= d_k; c += LANES) {
            const vf32 x = vf32_load(row + c);
            beyond = pf32_or(beyond, vf32_outside(x, lo, hi));
            vf32_store(out + c, vf32_mul(x, up));
        }
        for (; c < d_k; ++c) {
            /* (a NaN gives NaN logits on either route) */
            if (row[c] > CA_FP8_UP_LARGEST || row[c] < -CA_FP8_UP_LARGEST)
                return 0;
            out[c] = row[c] * CA_FP8_UP;
        }
    }
    return !pf32_any(beyond);
}
#endif

CA_SIMD_TARGET static void score_direct_fp8(const float *q, ptrdiff_t ldq, ptrdiff_t n_rows,
                                            const uint8_t *k, ptrdiff_t ldk, ptrdiff_t n_keys,
                                            ptrdiff_t d_k, int format, float factor,
                                            const float *scale, ptrdiff_t scale_stride,
                                            float *s, ptrdiff_t lds, const void *ahead,
                                            ptrdiff_t ahead_stride, ptrdiff_t ahead_bytes)
{
    float per_unit = format == CA_FP8_E4M3FN ? 1.0f / CA_E4M3_UNIT : 1.0f;
    if (format == CA_FP8_E4M3FN) {
        int finite = 1;
#ifdef CA_E4M3_FINITE_UNIT
        /* q brought up by 2^120 for the finite kernel: its logits are the
           values' own */
        float q_up[CA_FP8_QUERY_FLOATS];
        finite = e4m3_query_up(q, ldq, n_rows, d_k, q_up);
        if (finite) {
            score_direct_e4m3(q_up, d_k, n_rows, k, ldk, n_keys, d_k, factor, s, lds, ahead,
                              ahead_stride, ahead_bytes);
            per_unit = 1.0f;
        }
#else
        score_direct_e4m3(q, ldq, n_rows, k, ldk, n_keys, d_k, factor, s, lds, ahead,
                          ahead_stride, ahead_bytes);
#endif
#ifdef CA_E4M3_NAN_KERNELS
        /* the keys' scan after the kernel, which brought them in (before
           it, the scan would be their first read from memory, a third of
           a decode step measured): a NaN code, rare, takes the step again
           with the kernel that keeps it, whose logits replace these */
        if (!finite || e4m3_has_nan(k, ldk, n_keys, d_k)) {
            score_direct_e4m3nan(q, ldq, n_rows, k, ldk, n_keys, d_k, factor, s, lds,
                                 finite ? NULL : ahead, ahead_stride, ahead_bytes);
            per_unit = 1.0f / CA_E4M3_UNIT;
        }
#else
        (void)finite;
#endif
    } else
        score_direct_e5m2(q, ldq, n_rows, k, ldk, n_keys, d_k, factor, s, lds, ahead,
                          ahead_stride, ahead_bytes);
    if (scale_stride == 0) {
        /* one scale for every key (vLLM's per-tensor scale): the same
           products, a vector loop along each row */
        const float key_scale = scale[0] * per_unit;
        for (ptrdiff_t r = 0; r < n_rows; ++r)
            for (ptrdiff_t j = 0; j < n_keys; ++j)
                s[r * lds + j] *= key_scale;
        return;
    }
    for (ptrdiff_t j = 0; j < n_keys; ++j) {
        const float key_scale = scale[j * scale_stride] * per_unit;
        for (ptrdiff_t r = 0; r < n_rows; ++r)
            s[r * lds + j] *= key_scale;
    }
}

CA_SIMD_TARGET static void pv_direct_fp8(const float *p, ptrdiff_t ldp, ptrdiff_t n_rows,
                                         const uint8_t *v, ptrdiff_t ldv, ptrdiff_t n_keys,
                                         ptrdiff_t d_v, int format, const float *scale,
                                         ptrdiff_t scale_stride, float *acc, ptrdiff_t ldacc,
                                         const void *ahead, ptrdiff_t ahead_stride,
                                         ptrdiff_t ahead_bytes)
{
    /* the weights of CA_SUM_KEYS keys at a time: the kernel sums runs of
       that many keys from zero, so its runs are those of one call */
    float weight[CA_FP8_WEIGHT_ROWS * CA_SUM_KEYS];
    /* E4M3FN rows holding a NaN code take the kernel that keeps it */
    int finite = format == CA_FP8_E4M3FN && !CA_E4M3_HAS_NAN(v, ldv, n_keys, d_v);
#ifdef CA_E4M3_FINITE_UNIT
    finite = finite && ca_subnormals_read();
#endif
    for (ptrdiff_t r0 = 0; r0 < n_rows; r0 += CA_FP8_WEIGHT_ROWS) {
        const ptrdiff_t rows = n_rows - r0 < CA_FP8_WEIGHT_ROWS ? n_rows - r0
                                                                : CA_FP8_WEIGHT_ROWS;
        for (ptrdiff_t j0 = 0; j0 < n_keys; j0 += CA_SUM_KEYS) {
            const ptrdiff_t keys = n_keys - j0 < CA_SUM_KEYS ? n_keys - j0 : CA_SUM_KEYS;
            if (scale_stride == 0)
                /* one scale (vLLM's): a vector loop, the same products */
                for (ptrdiff_t r = 0; r < rows; ++r)
                    for (ptrdiff_t j = 0; j < keys; ++j)
                        weight[r * CA_SUM_KEYS + j] = p[(r0 + r) * ldp + j0 + j] * scale[0];
            else
                for (ptrdiff_t r = 0; r < rows; ++r)
                    for (ptrdiff_t j = 0; j < keys; ++j)
                        weight[r * CA_SUM_KEYS + j] =
                            p[(r0 + r) * ldp + j0 + j] * scale[(j0 + j) * scale_stride];
            /* the weights take the power of two the kernel's codes lack,
               exactly: E4M3FN's unit, or (CA_E4M3_FINITE_UNIT) 2^120 where
               every weight stays finite so */
            int finite_here = finite;
            float per_unit = format == CA_FP8_E4M3FN ? 1.0f / CA_E4M3_UNIT : 1.0f;
#ifdef CA_E4M3_FINITE_UNIT
            if (finite_here) {
                for (ptrdiff_t r = 0; r < rows; ++r)
                    for (ptrdiff_t j = 0; j < keys; ++j)
                        finite_here &= weight[r * CA_SUM_KEYS + j] <= CA_FP8_UP_LARGEST;
                if (finite_here)
                    per_unit = CA_FP8_UP;
            }
#endif
            if (per_unit != 1.0f)
                for (ptrdiff_t r = 0; r < rows; ++r)
                    for (ptrdiff_t j = 0; j < keys; ++j)
                        weight[r * CA_SUM_KEYS + j] *= per_unit;
            /* the first rows prefetch what the caller asked for, once */
            const void *ahead_j = r0 == 0 && ahead != NULL
                                      ? (const char *)ahead + j0 * ahead_stride : NULL;
            void (*pv)(const float *, ptrdiff_t, ptrdiff_t, const uint8_t *, ptrdiff_t,
                       ptrdiff_t, ptrdiff_t, float *, ptrdiff_t, const void *, ptrdiff_t,
                       ptrdiff_t) = format != CA_FP8_E4M3FN ? pv_direct_e5m2
                                    : finite_here          ? pv_direct_e4m3
                                                           : CA_E4M3_KERNEL_KEEPING_NAN;
            pv(weight, CA_SUM_KEYS, rows, v + j0 * ldv, ldv, keys, d_v, acc + r0 * ldacc, ldacc,
               ahead_j, ahead_stride, ahead_bytes);
        }
    }
}

#undef CA_FP8_WEIGHT_ROWS
#undef CA_E4M3_HAS_NAN
#undef CA_E4M3_KERNEL_KEEPING_NAN
#ifdef CA_E4M3_FINITE_UNIT
#undef CA_FP8_UP
#undef CA_FP8_UP_LARGEST
#undef CA_FP8_QUERY_FLOATS
#endif
