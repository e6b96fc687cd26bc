/*
 * bfloat16 tiles over AVX-512 (kernels.h: "bfloat16 tiles"): the packing of
 * K^T into pair panels, shared by every table that multiplies bfloat16
 * pairs, and the score tile of AVX512-BF16 (VDPBF16PS: per lane, the two
 * products of a pair added to a float32 sum, each step rounded to nearest
 * even). Included after simd_avx512.h and kernels_simd.h by the tables
 * that have bfloat16 tiles (kernels_avx512bf16.c, kernels_amx.c).
 *
 * A product of two bfloat16 values is exact in float32, so the logits are
 * float32 sums of exact products, as in the float32 tables; they differ in
 * the order of the sums and in two points of VDPBF16PS (and TDPBF16PS):
 * bfloat16 inputs below float32's normal range (denormals, 2^-126) are
 * read as 0, and sums that fall below it are flushed to 0. A logit is
 * thereby off by at most d_k * 2^-126 times the scale, far below its own
 * float32 rounding unless every product is that small.
 */

#define CA_BF16_TARGET \
    __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,avx512bf16")))

/* pairs of features a key's K^T panel row holds: d_k padded to align */
static inline ptrdiff_t bf16_pairs(ptrdiff_t d_k, ptrdiff_t align)
{
    return (d_k + align - 1) / align * align / 2;
}

/* K^T in pair panels (kernels.h), features padded with zeros to a multiple
   of align. A pair of bfloat16 is 32 bits: with an even d_k and row stride
   the pairs are 32-bit elements of the rows, and the float32 panel packing
   (16 x 16 transposes, no arithmetic) lays them out; otherwise pair by pair. */
static inline void bf16_pack_kt_aligned(const uint16_t *k, ptrdiff_t ldk, ptrdiff_t n_keys,
                                        ptrdiff_t d_k, uint16_t *kt,
                                        ptrdiff_t kt_panel_stride, ptrdiff_t align)
{
    const ptrdiff_t n_pairs = bf16_pairs(d_k, align);
    const ptrdiff_t panels = (n_keys + 15) / 16;
    ptrdiff_t packed_pairs = 0;
    if (d_k % 2 == 0 && ldk % 2 == 0 && ((uintptr_t)k & 3) == 0) {
        pack_kt_f32((const float *)k, ldk / 2, n_keys, d_k / 2, (float *)kt,
                    kt_panel_stride / 2);
        packed_pairs = d_k / 2;
    }
    for (ptrdiff_t p = 0; p < panels; ++p) {
        uint16_t *panel = kt + p * kt_panel_stride;
        for (ptrdiff_t c = packed_pairs; c < n_pairs; ++c)
            for (ptrdiff_t l = 0; l < 16; ++l) {
                const ptrdiff_t j = p * 16 + l;
                const int real = j < n_keys;
                panel[c * 32 + 2 * l] = real && 2 * c < d_k ? k[j * ldk + 2 * c] : 0;
                panel[c * 32 + 2 * l + 1] = real && 2 * c + 1 < d_k ? k[j * ldk + 2 * c + 1] : 0;
            }
    }
}

/* V in pair panels, what TDPBF16PS (as B) and VDPBF16PS multiply: panel c
   holds value columns c*16 .. c*16+15; its row kp holds keys 2kp and
   2kp+1 of each column side by side (64 bytes), keys from n_keys up to the
   next multiple of key_align (even) and columns past d_v zero. A NaN or
   infinity is left 0 (the driver adds it back where its weight is not 0),
   as pack_v_f32. */
CA_BF16_TARGET static int bf16_pack_v_pairs(const uint16_t *v, ptrdiff_t ldv, ptrdiff_t n_keys,
                                            ptrdiff_t d_v, uint16_t *v_packed,
                                            ptrdiff_t v_panel_stride, ptrdiff_t key_align)
{
    /* lane 2c takes column c of the first key, lane 2c + 1 of the second */
    static const uint16_t interleave[32] = {
        0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
        8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i order = _mm512_loadu_si512(interleave);
    const __m512i exponent = _mm512_set1_epi16(0x7F80);
    const ptrdiff_t padded_keys = (n_keys + key_align - 1) / key_align * key_align;
    __mmask32 nonfinite = 0;
    for (ptrdiff_t c0 = 0; c0 < d_v; c0 += 16) {
        const __mmask16 cols = (__mmask16)(d_v - c0 >= 16 ? 0xFFFFu
                                                          : (1u << (d_v - c0)) - 1u);
        uint16_t *panel = v_packed + (c0 / 16) * v_panel_stride;
        for (ptrdiff_t j = 0; j < padded_keys; j += 2) {
            const __m512i first = j < n_keys
                ? _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(cols, v + j * ldv + c0))
                : _mm512_setzero_si512();
            const __m512i second = j + 1 < n_keys
                ? _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(cols, v + (j + 1) * ldv + c0))
                : _mm512_setzero_si512();
            __m512i pair = _mm512_permutex2var_epi16(first, order, second);
            const __mmask32 bad = _mm512_cmpeq_epi16_mask(_mm512_and_si512(pair, exponent),
                                                         exponent);
            if (bad) {
                pair = _mm512_maskz_mov_epi16(~bad, pair);
                nonfinite |= bad;
            }
            _mm512_storeu_si512(panel + (j / 2) * 32, pair);
        }
    }
    return nonfinite != 0;
}

/* ---- AVX512-BF16: the score tile ------------------------------------- */

#ifdef CA_WITH_VDPBF16PS

#define BF16_TILE_ROWS 6
#define BF16_TILE_PANELS 4
/* pairs in a run: CA_SUM_FEATURES features summed from zero, as the
   float32 tiles sum them */
#define BF16_RUN_PAIRS (CA_SUM_FEATURES / 2)

/* s[0..R) x [0..NP panels) = factor * (q . kt): runs of BF16_RUN_PAIRS
   pairs from zero, the first run stored, later ones added, the last one
   scaled (as score_tile of kernels_simd_typed.h) */
CA_SIMD_INLINE CA_BF16_TARGET void bf16_score_tile(
    const uint16_t *q, ptrdiff_t ldq, const uint16_t *kt, ptrdiff_t kt_panel_stride,
    ptrdiff_t n_pairs, float factor, float *s, ptrdiff_t lds, const int R, const int NP)
{
    __m512 acc[BF16_TILE_ROWS][BF16_TILE_PANELS];
    for (ptrdiff_t c0 = 0; c0 == 0 || c0 < n_pairs; c0 += BF16_RUN_PAIRS) {
        const ptrdiff_t c1 = n_pairs - c0 > BF16_RUN_PAIRS ? c0 + BF16_RUN_PAIRS : n_pairs;
        for (int r = 0; r < R; ++r)
            for (int x = 0; x < NP; ++x)
                acc[r][x] = _mm512_setzero_ps();
        for (ptrdiff_t c = c0; c < c1; ++c) {
            __m512i k_c[BF16_TILE_PANELS];
            for (int x = 0; x < NP; ++x)
                k_c[x] = _mm512_loadu_si512(kt + x * kt_panel_stride + c * 32);
            for (int r = 0; r < R; ++r) {
                uint32_t pair;
                __builtin_memcpy(&pair, q + r * ldq + 2 * c, 4);
                const __m512bh q_rc = (__m512bh)_mm512_set1_epi32((int)pair);
                for (int x = 0; x < NP; ++x)
                    acc[r][x] = _mm512_dpbf16_ps(acc[r][x], q_rc, (__m512bh)k_c[x]);
            }
        }
        if (c0 > 0)
            for (int r = 0; r < R; ++r)
                for (int x = 0; x < NP; ++x)
                    acc[r][x] = _mm512_add_ps(_mm512_loadu_ps(s + r * lds + x * 16), acc[r][x]);
        if (c1 < n_pairs) {
            for (int r = 0; r < R; ++r)
                for (int x = 0; x < NP; ++x)
                    _mm512_storeu_ps(s + r * lds + x * 16, acc[r][x]);
            continue;
        }
        volatile float factor_in_memory = factor;
        const __m512 factor_v = _mm512_set1_ps(factor_in_memory);
        for (int r = 0; r < R; ++r)
            for (int x = 0; x < NP; ++x)
                _mm512_storeu_ps(s + r * lds + x * 16, _mm512_mul_ps(acc[r][x], factor_v));
    }
}

CA_BF16_TARGET static void score_bf16_vdp(const uint16_t *q, ptrdiff_t ldq, ptrdiff_t n_rows,
                                          const uint16_t *kt, ptrdiff_t kt_panel_stride,
                                          ptrdiff_t n_cols, ptrdiff_t d_k, float factor,
                                          float *s, ptrdiff_t lds, const void *ahead,
                                          ptrdiff_t ahead_bytes)
{
    const ptrdiff_t n_pairs = bf16_pairs(d_k, 2);
    const ptrdiff_t tile_cols = 16 * BF16_TILE_PANELS;
    ca_ahead next = ahead_start(ahead, ahead_bytes,
                                ((n_cols + tile_cols - 1) / tile_cols)
                                * ((n_rows + BF16_TILE_ROWS - 1) / BF16_TILE_ROWS));
    for (ptrdiff_t j = 0; j < n_cols; j += tile_cols) {
        const uint16_t *panel = kt + (j / 16) * kt_panel_stride;
        const int n_panels = (int)((n_cols - j) / 16 < BF16_TILE_PANELS ? (n_cols - j) / 16
                                                                        : BF16_TILE_PANELS);
        ptrdiff_t i = 0;
#define BF16_SCORE_ROWS(R) \
        switch (n_panels) { \
        case 4: bf16_score_tile(q + i * ldq, ldq, panel, kt_panel_stride, n_pairs, factor, \
                                s + i * lds + j, lds, R, 4); break; \
        case 3: bf16_score_tile(q + i * ldq, ldq, panel, kt_panel_stride, n_pairs, factor, \
                                s + i * lds + j, lds, R, 3); break; \
        case 2: bf16_score_tile(q + i * ldq, ldq, panel, kt_panel_stride, n_pairs, factor, \
                                s + i * lds + j, lds, R, 2); break; \
        default: bf16_score_tile(q + i * ldq, ldq, panel, kt_panel_stride, n_pairs, factor, \
                                 s + i * lds + j, lds, R, 1); break; \
        }
        for (; i + BF16_TILE_ROWS <= n_rows; i += BF16_TILE_ROWS, ahead_step(&next)) {
            BF16_SCORE_ROWS(BF16_TILE_ROWS)
        }
        switch (n_rows - i) {
        case 5: BF16_SCORE_ROWS(5) break;
        case 4: BF16_SCORE_ROWS(4) break;
        case 3: BF16_SCORE_ROWS(3) break;
        case 2: BF16_SCORE_ROWS(2) break;
        case 1: BF16_SCORE_ROWS(1) break;
        default: break;
        }
#undef BF16_SCORE_ROWS
    }
}

/* ---- AVX512-BF16: P.V of P rounded to bfloat16 ------------------------ */

/* One bfloat16 part of P only: two parts (P to 2^-16 of itself) take a
   VDPBF16PS per key, as many as float32 weights take FMAs, and measured
   0.95-0.98x of pv_f32 (Zen 5, d 64 and 128); the highest and high levels
   therefore keep float32 weights on this table. */

#define BF16_PV_ROWS 6
#define BF16_PV_PANELS 4
/* keys a call converts at a time (the driver's key block) */
#define BF16_PV_KEYS 256
/* pairs of keys in a run: CA_SUM_KEYS keys summed from zero, as the
   float32 P.V tiles sum them */
#define BF16_RUN_KEY_PAIRS (CA_SUM_KEYS / 2)

/* Rows [0, n_rows) x keys [0, n_keys) of P (weights in [0, 1], or NaN)
   rounded to nearest even bfloat16, w[r * BF16_PV_KEYS + k]; keys from
   n_keys to the next multiple of 32 are 0. (VCVTNE2PS2BF16 reads float32
   denormals as 0: a weight below 2^-126 is 0.) */
CA_SIMD_INLINE CA_BF16_TARGET void bf16_weights(const float *p, ptrdiff_t ldp, ptrdiff_t n_rows,
                                                ptrdiff_t n_keys, uint16_t *w)
{
    for (ptrdiff_t r = 0; r < n_rows; ++r)
        for (ptrdiff_t k = 0; k < n_keys; k += 32) {
            const ptrdiff_t left = n_keys - k;
            const __mmask16 low = (__mmask16)(left >= 16 ? 0xFFFFu : (1u << left) - 1u);
            const __mmask16 high = (__mmask16)(left >= 32 ? 0xFFFFu
                                               : left > 16 ? (1u << (left - 16)) - 1u : 0u);
            const __m512 x0 = _mm512_maskz_loadu_ps(low, p + r * ldp + k);
            const __m512 x1 = _mm512_maskz_loadu_ps(high, p + r * ldp + k + 16);
            _mm512_storeu_si512(w + r * BF16_PV_KEYS + k, (__m512i)_mm512_cvtne2ps_pbh(x1, x0));
        }
}

/* block_sum is read only after the block's first run wrote it (as the
   float32 pv_tile; gcc cannot see it through the unrolled loops) */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
/* acc[0..R) x [0..NP panels) += w . v over n_pairs pairs of keys, a pair of
   weights times a pair of values in one VDPBF16PS; runs of
   BF16_RUN_KEY_PAIRS pairs from zero, added in order, the block joining
   acc once (as pv_tile) */
CA_SIMD_INLINE CA_BF16_TARGET void bf16_pv_tile(const uint16_t *w, const uint16_t *v,
                                                ptrdiff_t v_panel_stride, ptrdiff_t n_pairs,
                                                float *acc, ptrdiff_t ldacc, const int R,
                                                const int NP)
{
    float block_sum[BF16_PV_ROWS * BF16_PV_PANELS * 16];
    for (ptrdiff_t c0 = 0; c0 < n_pairs; c0 += BF16_RUN_KEY_PAIRS) {
        const ptrdiff_t c1 = n_pairs - c0 < BF16_RUN_KEY_PAIRS ? n_pairs : c0 + BF16_RUN_KEY_PAIRS;
        __m512 run[BF16_PV_ROWS][BF16_PV_PANELS];
        for (int r = 0; r < R; ++r)
            for (int x = 0; x < NP; ++x)
                run[r][x] = _mm512_setzero_ps();
        for (ptrdiff_t c = c0; c < c1; ++c) {
            __m512bh v_c[BF16_PV_PANELS];
            for (int x = 0; x < NP; ++x)
                v_c[x] = (__m512bh)_mm512_loadu_si512(v + x * v_panel_stride + c * 32);
            for (int r = 0; r < R; ++r) {
                uint32_t pair;
                __builtin_memcpy(&pair, w + r * BF16_PV_KEYS + 2 * c, 4);
                const __m512bh w_rc = (__m512bh)_mm512_set1_epi32((int)pair);
                for (int x = 0; x < NP; ++x)
                    run[r][x] = _mm512_dpbf16_ps(run[r][x], w_rc, v_c[x]);
            }
        }
#define BF16_EACH_VECTOR(STATEMENT) \
    for (int r = 0; r < R; ++r) \
        for (int x = 0; x < NP; ++x) { \
            float *sum_rx = block_sum + (r * BF16_PV_PANELS + x) * 16; \
            float *acc_rx = acc + r * ldacc + x * 16; \
            (void)sum_rx; (void)acc_rx; \
            STATEMENT; \
        }
        if (c0 == 0 && c1 == n_pairs)
            BF16_EACH_VECTOR(_mm512_storeu_ps(acc_rx, _mm512_add_ps(_mm512_loadu_ps(acc_rx),
                                                                    run[r][x])))
        else if (c0 == 0)
            BF16_EACH_VECTOR(_mm512_storeu_ps(sum_rx, run[r][x]))
        else if (c1 < n_pairs)
            BF16_EACH_VECTOR(_mm512_storeu_ps(sum_rx, _mm512_add_ps(_mm512_loadu_ps(sum_rx),
                                                                    run[r][x])))
        else
            BF16_EACH_VECTOR(_mm512_storeu_ps(acc_rx, _mm512_add_ps(
                _mm512_loadu_ps(acc_rx), _mm512_add_ps(_mm512_loadu_ps(sum_rx), run[r][x]))))
#undef BF16_EACH_VECTOR
    }
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

/* rows [0, R) of one row tile over every column panel */
CA_SIMD_INLINE CA_BF16_TARGET void bf16_pv_rows(const uint16_t *w, const uint16_t *v,
                                                ptrdiff_t v_panel_stride, ptrdiff_t n_pairs,
                                                ptrdiff_t n_vcols, float *acc, ptrdiff_t ldacc,
                                                const int R)
{
    ptrdiff_t c = 0;
    for (; c + 16 * BF16_PV_PANELS <= n_vcols; c += 16 * BF16_PV_PANELS)
        bf16_pv_tile(w, v + (c / 16) * v_panel_stride, v_panel_stride, n_pairs, acc + c, ldacc,
                     R, BF16_PV_PANELS);
    const uint16_t *panel = v + (c / 16) * v_panel_stride;
    switch ((n_vcols - c) / 16) {
    case 3: bf16_pv_tile(w, panel, v_panel_stride, n_pairs, acc + c, ldacc, R, 3); break;
    case 2: bf16_pv_tile(w, panel, v_panel_stride, n_pairs, acc + c, ldacc, R, 2); break;
    case 1: bf16_pv_tile(w, panel, v_panel_stride, n_pairs, acc + c, ldacc, R, 1); break;
    default: break;
    }
}

/* acc += p . v (kernels.h: pv_bf16) with P rounded to bfloat16 (one part,
   as the table's bf16_pv_parts say), V in pair panels (bf16_pack_v_pairs);
   n_vcols a multiple of 16 */
CA_BF16_TARGET static void pv_bf16_vdp(const float *p, ptrdiff_t ldp, ptrdiff_t n_rows,
                                       const uint16_t *v, ptrdiff_t v_panel_stride,
                                       ptrdiff_t n_keys, ptrdiff_t n_vcols, float *acc,
                                       ptrdiff_t ldacc, const void *ahead,
                                       ptrdiff_t ahead_bytes)
{
    uint16_t w[BF16_PV_ROWS * BF16_PV_KEYS] __attribute__((aligned(64)));
    ca_ahead next = ahead_start(ahead, ahead_bytes, (n_rows + BF16_PV_ROWS - 1) / BF16_PV_ROWS);
    for (ptrdiff_t k0 = 0; k0 < n_keys; k0 += BF16_PV_KEYS) {
        const ptrdiff_t keys = n_keys - k0 < BF16_PV_KEYS ? n_keys - k0 : BF16_PV_KEYS;
        const ptrdiff_t n_pairs = (keys + 1) / 2;
        /* pair row k0 / 2 of each panel */
        const uint16_t *v_k = v + k0 * 16;
        for (ptrdiff_t i = 0; i < n_rows; i += BF16_PV_ROWS, ahead_step(&next)) {
            const ptrdiff_t rows = n_rows - i < BF16_PV_ROWS ? n_rows - i : BF16_PV_ROWS;
            float *acc_i = acc + i * ldacc;
            bf16_weights(p + i * ldp + k0, ldp, rows, keys, w);
            switch (rows) {
            case 6: bf16_pv_rows(w, v_k, v_panel_stride, n_pairs, n_vcols, acc_i, ldacc, 6); break;
            case 5: bf16_pv_rows(w, v_k, v_panel_stride, n_pairs, n_vcols, acc_i, ldacc, 5); break;
            case 4: bf16_pv_rows(w, v_k, v_panel_stride, n_pairs, n_vcols, acc_i, ldacc, 4); break;
            case 3: bf16_pv_rows(w, v_k, v_panel_stride, n_pairs, n_vcols, acc_i, ldacc, 3); break;
            case 2: bf16_pv_rows(w, v_k, v_panel_stride, n_pairs, n_vcols, acc_i, ldacc, 2); break;
            default: bf16_pv_rows(w, v_k, v_panel_stride, n_pairs, n_vcols, acc_i, ldacc, 1); break;
            }
        }
    }
}

#endif /* CA_WITH_VDPBF16PS */
