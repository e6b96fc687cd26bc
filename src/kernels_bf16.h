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

#endif /* CA_WITH_VDPBF16PS */
