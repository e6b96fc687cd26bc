/*
 * The AMX table (Sapphire Rapids and later): the AVX512-BF16 table, with
 * the scores and P.V of bfloat16 q, K and V in AMX tiles (tiles_amx.h).
 *
 * Scores: q rows (padded to 32 features) times K^T pair panels, 32 rows x
 * 32 keys per pass, summed in runs of CA_SUM_FEATURES features from zero
 * as the float32 tiles sum them, then scaled.
 *
 * P.V keeps float32's accuracy: P is float32, so each weight p is split
 * into three bfloat16 parts, p = hi + mid + lo (hi = p's leading 16 bits,
 * mid the leading 16 bits of p - hi, lo = what is left: 3 x 8 significant
 * bits, every bit of p's 24 for a normal float, each difference exact),
 * and P.V is the sum of the three tile products, each exact per product
 * and summed in float32, in runs of CA_SUM_KEYS keys from zero as the
 * float32 tiles sum them. (Only weights below 2^-110 lose their low part
 * to bfloat16's flushing of denormals: at most 2^-126 |v| each.)
 */
#include "kernels.h"

#if CA_HAVE_X86_KERNELS

#include "simd_avx512.h"
#include "kernels_simd.h"
#include "kernels_bf16.h"
#include "tiles_amx.h"

/* features of q and K^T a tile step takes: 16 pairs */
#define AMX_STEP_FEATURES 32
/* keys of P and V a tile step takes */
#define AMX_STEP_KEYS 32

static void pack_kt_bf16(const uint16_t *k, ptrdiff_t ldk, ptrdiff_t n_keys, ptrdiff_t d_k,
                         uint16_t *kt, ptrdiff_t kt_panel_stride)
{
    bf16_pack_kt_aligned(k, ldk, n_keys, d_k, kt, kt_panel_stride, AMX_STEP_FEATURES);
}

/* rows [0, n_rows) x 16 columns of a stored 16 x 16 float32 tile into s:
   the first run of a sum stored, later ones added, the last one scaled */
CA_AMX_TARGET static inline void amx_tile_into(const float *tile, ptrdiff_t n_rows, float *s,
                                               ptrdiff_t lds, int first, int last,
                                               __m512 factor)
{
    for (ptrdiff_t r = 0; r < n_rows; ++r) {
        __m512 x = _mm512_loadu_ps(tile + r * 16);
        if (!first)
            x = _mm512_add_ps(_mm512_loadu_ps(s + r * lds), x);
        if (last)
            x = _mm512_mul_ps(x, factor);
        _mm512_storeu_ps(s + r * lds, x);
    }
}

/* s = factor * (q . kt): q rows of padded bfloat16 (ldq a multiple of 32,
   rows readable up to the next multiple of 16: the driver's padded query
   block), n_cols a multiple of 16 */
CA_AMX_TARGET static void score_bf16_amx(const uint16_t *q, ptrdiff_t ldq, ptrdiff_t n_rows,
                                         const uint16_t *kt, ptrdiff_t kt_panel_stride,
                                         ptrdiff_t n_cols, ptrdiff_t d_k, float factor,
                                         float *s, ptrdiff_t lds, const void *ahead,
                                         ptrdiff_t ahead_bytes)
{
    amx_configure();
    const ptrdiff_t n_steps = (d_k + AMX_STEP_FEATURES - 1) / AMX_STEP_FEATURES;
    const ptrdiff_t run_steps = CA_SUM_FEATURES / AMX_STEP_FEATURES;
    const __m512 factor_v = _mm512_set1_ps(factor);
    float tiles[4][16 * 16] __attribute__((aligned(64)));
    ca_ahead next = ahead_start(ahead, ahead_bytes, ((n_cols + 31) / 32) * ((n_rows + 31) / 32));
    for (ptrdiff_t j = 0; j < n_cols; j += 32, ahead_step(&next)) {
        const int two_panels = n_cols - j >= 32;
        const uint16_t *panel = kt + (j / 16) * kt_panel_stride;
        for (ptrdiff_t i = 0; i < n_rows; i += 32) {
            const int two_row_tiles = n_rows - i > 16;
            const uint16_t *q_i = q + i * ldq;
            /* one pass at least: d_k = 0 gives zeros */
            for (ptrdiff_t r0 = 0; r0 == 0 || r0 < n_steps; r0 += run_steps) {
                const ptrdiff_t r1 = n_steps - r0 > run_steps ? r0 + run_steps : n_steps;
                amx_tile_zero(AMX_C0);
                amx_tile_zero(AMX_C1);
                amx_tile_zero(AMX_C2);
                amx_tile_zero(AMX_C3);
                for (ptrdiff_t t = r0; t < r1; ++t) {
                    /* A: 16 query rows x 32 features; B: 16 pairs x 16 keys */
                    amx_tile_load(AMX_A0, q_i + t * AMX_STEP_FEATURES, ldq * 2);
                    amx_tile_load(AMX_A2, panel + t * 16 * 32, 64);
                    amx_tile_dpbf16ps(AMX_C0, AMX_A0, AMX_A2);
                    if (two_panels) {
                        amx_tile_load(AMX_B, panel + kt_panel_stride + t * 16 * 32, 64);
                        amx_tile_dpbf16ps(AMX_C1, AMX_A0, AMX_B);
                    }
                    if (two_row_tiles) {
                        amx_tile_load(AMX_A1, q_i + 16 * ldq + t * AMX_STEP_FEATURES, ldq * 2);
                        amx_tile_dpbf16ps(AMX_C2, AMX_A1, AMX_A2);
                        if (two_panels)
                            amx_tile_dpbf16ps(AMX_C3, AMX_A1, AMX_B);
                    }
                }
                amx_tile_store(AMX_C0, tiles[0], 64);
                amx_tile_store(AMX_C1, tiles[1], 64);
                amx_tile_store(AMX_C2, tiles[2], 64);
                amx_tile_store(AMX_C3, tiles[3], 64);
                const int first = r0 == 0;
                const int last = r1 >= n_steps;
                const ptrdiff_t rows0 = n_rows - i < 16 ? n_rows - i : 16;
                amx_tile_into(tiles[0], rows0, s + i * lds + j, lds, first, last, factor_v);
                if (two_panels)
                    amx_tile_into(tiles[1], rows0, s + i * lds + j + 16, lds, first, last,
                                  factor_v);
                if (two_row_tiles) {
                    const ptrdiff_t rows1 = n_rows - i - 16 < 16 ? n_rows - i - 16 : 16;
                    amx_tile_into(tiles[2], rows1, s + (i + 16) * lds + j, lds, first, last,
                                  factor_v);
                    if (two_panels)
                        amx_tile_into(tiles[3], rows1, s + (i + 16) * lds + j + 16, lds, first,
                                      last, factor_v);
                }
            }
        }
    }
}

/* V in pair panels for TDPBF16PS's B, keys padded to a whole tile step */
static int pack_v_bf16(const uint16_t *v, ptrdiff_t ldv, ptrdiff_t n_keys, ptrdiff_t d_v,
                       uint16_t *v_packed, ptrdiff_t v_panel_stride)
{
    return bf16_pack_v_pairs(v, ldv, n_keys, d_v, v_packed, v_panel_stride, AMX_STEP_KEYS);
}

/* the three bfloat16 parts of 16 rows x 32 weights (rows past n_rows and
   keys past n_keys 0), parts[t] a 16 x 32 bfloat16 tile A: each part the
   leading 16 bits of what the parts before it leave (a truncation, so its
   float32 value is those bits as they are, and the rest is exact: 8
   significant bits a part, every bit of a normal float in three) */
CA_AMX_TARGET static inline void split_weights(const float *p, ptrdiff_t ldp, ptrdiff_t n_rows,
                                               ptrdiff_t n_keys, uint16_t *parts,
                                               ptrdiff_t part_stride)
{
    const __mmask16 low = (__mmask16)(n_keys >= 16 ? 0xFFFFu : (1u << n_keys) - 1u);
    const __mmask16 high = (__mmask16)(n_keys >= 32 ? 0xFFFFu
                                       : n_keys > 16 ? (1u << (n_keys - 16)) - 1u : 0u);
    const __m512i leading = _mm512_set1_epi32((int)0xFFFF0000u);
    /* the upper halves of 32 floats, in order */
    static const uint16_t upper_halves[32] = {
        1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
        33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
    const __m512i gather = _mm512_loadu_si512(upper_halves);
    for (ptrdiff_t r = 0; r < 16; ++r) {
        __m512 x0 = _mm512_setzero_ps(), x1 = _mm512_setzero_ps();
        if (r < n_rows) {
            x0 = _mm512_maskz_loadu_ps(low, p + r * ldp);
            x1 = _mm512_maskz_loadu_ps(high, p + r * ldp + 16);
        }
        for (int t = 0; t < 3; ++t) {
            const __m512 part0 = _mm512_castsi512_ps(
                _mm512_and_si512(_mm512_castps_si512(x0), leading));
            const __m512 part1 = _mm512_castsi512_ps(
                _mm512_and_si512(_mm512_castps_si512(x1), leading));
            _mm512_storeu_si512(parts + t * part_stride + r * 32,
                                _mm512_permutex2var_epi16(_mm512_castps_si512(part0), gather,
                                                          _mm512_castps_si512(part1)));
            x0 = _mm512_sub_ps(x0, part0);
            x1 = _mm512_sub_ps(x1, part1);
        }
    }
}

/* the most value columns one pass of P.V sums (the columns' runs kept in a
   buffer on the stack) */
#define AMX_PV_COLS 256

/* one step of 32 keys for 32 rows x 32 value columns: the two column
   panels (B) loaded once, then for each of the three parts the two row
   tiles (A), four accumulators interleaved (a tile register is not
   renamed, and an accumulator's next product waits for its last) */
#define AMX_PV_STEP(parts0, parts1, part_stride, b0, b1, two_rows, two_cols) \
    amx_tile_load(AMX_A2, (b0), 64); \
    if (two_cols) \
        amx_tile_load(AMX_B, (b1), 64); \
    for (int part_ = 0; part_ < 3; ++part_) { \
        amx_tile_load(AMX_A0, (parts0) + part_ * (part_stride), 64); \
        amx_tile_dpbf16ps(AMX_C0, AMX_A0, AMX_A2); \
        if (two_cols) \
            amx_tile_dpbf16ps(AMX_C1, AMX_A0, AMX_B); \
        if (two_rows) { \
            amx_tile_load(AMX_A1, (parts1) + part_ * (part_stride), 64); \
            amx_tile_dpbf16ps(AMX_C2, AMX_A1, AMX_A2); \
            if (two_cols) \
                amx_tile_dpbf16ps(AMX_C3, AMX_A1, AMX_B); \
        } \
    }

/* acc += p . v over n_keys keys: 32 rows at a time, runs of CA_SUM_KEYS
   keys from zero (the parts of a run split once, then every pair of value
   panels), the runs added in order, then joining acc */
CA_AMX_TARGET static void pv_bf16_amx(const float *p, ptrdiff_t ldp, ptrdiff_t n_rows,
                                      const uint16_t *v, ptrdiff_t v_panel_stride,
                                      ptrdiff_t n_keys, ptrdiff_t n_vcols, float *acc,
                                      ptrdiff_t ldacc, const void *ahead,
                                      ptrdiff_t ahead_bytes)
{
    amx_configure();
    enum { STEPS = CA_SUM_KEYS / AMX_STEP_KEYS, PART = 16 * 32 };
    /* [row tile][step][part] 16 x 32 bfloat16 */
    uint16_t parts[2][STEPS][3 * PART] __attribute__((aligned(64)));
    float tiles[4][16 * 16] __attribute__((aligned(64)));
    float block[32 * AMX_PV_COLS] __attribute__((aligned(64)));
    ca_ahead next = ahead_start(ahead, ahead_bytes, (n_rows + 31) / 32);
    for (ptrdiff_t i = 0; i < n_rows; i += 32, ahead_step(&next)) {
        const ptrdiff_t rows = n_rows - i < 32 ? n_rows - i : 32;
        const int two_rows = rows > 16;
        for (ptrdiff_t c_chunk = 0; c_chunk < n_vcols; c_chunk += AMX_PV_COLS) {
            const ptrdiff_t chunk_cols = n_vcols - c_chunk < AMX_PV_COLS ? n_vcols - c_chunk
                                                                           : AMX_PV_COLS;
            for (ptrdiff_t k0 = 0; k0 < n_keys; k0 += CA_SUM_KEYS) {
                const ptrdiff_t run_keys = n_keys - k0 < CA_SUM_KEYS ? n_keys - k0 : CA_SUM_KEYS;
                const ptrdiff_t steps = (run_keys + AMX_STEP_KEYS - 1) / AMX_STEP_KEYS;
                for (ptrdiff_t t = 0; t < steps; ++t)
                    for (int h = 0; h < 1 + two_rows; ++h)
                        split_weights(p + (i + 16 * h) * ldp + k0 + t * AMX_STEP_KEYS, ldp,
                                      rows - 16 * h, run_keys - t * AMX_STEP_KEYS,
                                      parts[h][t], PART);
                for (ptrdiff_t c0 = 0; c0 < chunk_cols; c0 += 32) {
                    const int two_cols = chunk_cols - c0 > 16;
                    const uint16_t *panel = v + ((c_chunk + c0) / 16) * v_panel_stride;
                    amx_tile_zero(AMX_C0);
                    amx_tile_zero(AMX_C1);
                    amx_tile_zero(AMX_C2);
                    amx_tile_zero(AMX_C3);
                    for (ptrdiff_t t = 0; t < steps; ++t) {
                        const ptrdiff_t pair_row = (k0 + t * AMX_STEP_KEYS) / 2;
                        AMX_PV_STEP(parts[0][t], parts[1][t], PART, panel + pair_row * 32,
                                    panel + v_panel_stride + pair_row * 32, two_rows,
                                    two_cols)
                    }
                    amx_tile_store(AMX_C0, tiles[0], 64);
                    amx_tile_store(AMX_C1, tiles[1], 64);
                    amx_tile_store(AMX_C2, tiles[2], 64);
                    amx_tile_store(AMX_C3, tiles[3], 64);
                    for (int x = 0; x < 4; ++x) {
                        const int row_tile = x / 2, col = x % 2;
                        if (col && !two_cols)
                            continue;
                        const ptrdiff_t n = rows - 16 * row_tile;
                        for (ptrdiff_t r = 0; r < (n < 16 ? n : 16); ++r) {
                            float *sum = block + (16 * row_tile + r) * AMX_PV_COLS + c0 + 16 * col;
                            __m512 run = _mm512_load_ps(tiles[x] + r * 16);
                            if (k0 > 0)
                                run = _mm512_add_ps(_mm512_load_ps(sum), run);
                            _mm512_store_ps(sum, run);
                        }
                    }
                }
            }
            /* the block's runs join the accumulator: one addition per block */
            for (ptrdiff_t r = 0; r < rows; ++r)
                for (ptrdiff_t c = 0; c < chunk_cols; c += 16) {
                    float *a = acc + (i + r) * ldacc + c_chunk + c;
                    _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a),
                                                      _mm512_load_ps(block + r * AMX_PV_COLS + c)));
                }
        }
    }
}
#undef AMX_PV_STEP

static void end_of_thread(void)
{
    amx_release();
}

/* the tile loop (kernels.h: loop_flops): four accumulator tiles, each step
   adding the products of two A tiles and two B tiles (of zeros: the rate
   does not depend on the values) */
CA_AMX_TARGET static double amx_loop_flops(long n_steps)
{
    static const uint16_t zeros[16 * 32] __attribute__((aligned(64)));
    amx_configure();
    amx_tile_zero(AMX_C0);
    amx_tile_zero(AMX_C1);
    amx_tile_zero(AMX_C2);
    amx_tile_zero(AMX_C3);
    amx_tile_load(AMX_A0, zeros, 64);
    amx_tile_load(AMX_A1, zeros, 64);
    amx_tile_load(AMX_A2, zeros, 64);
    amx_tile_load(AMX_B, zeros, 64);
    for (long s = 0; s < n_steps; ++s) {
        amx_tile_dpbf16ps(AMX_C0, AMX_A0, AMX_B);
        amx_tile_dpbf16ps(AMX_C1, AMX_A0, AMX_A2);
        amx_tile_dpbf16ps(AMX_C2, AMX_A1, AMX_B);
        amx_tile_dpbf16ps(AMX_C3, AMX_A1, AMX_A2);
    }
    amx_release();
    /* 16 x 16 sums of 32 products each, four tiles a step */
    return 4.0 * 16 * 16 * 32 * 2 * (double)n_steps;
}
#undef CA_LOOP_FLOPS
#define CA_LOOP_FLOPS amx_loop_flops

/* P.V in three parts of P at every precision level: fewer are not yet
   measured on AMX hardware */
#undef CA_BF16_TILE_ENTRIES
#define CA_BF16_TILE_ENTRIES \
        .bf16_k_align = AMX_STEP_FEATURES, .pack_kt_bf16 = pack_kt_bf16, \
        .score_bf16 = score_bf16_amx, .pack_v_bf16 = pack_v_bf16, .pv_bf16 = pv_bf16_amx, \
        .bf16_pv_parts = {3, 3, 3}, .end_of_thread = end_of_thread,

CA_DEFINE_KERNEL_TABLE(ca_kernels_amx, "amx");

#endif /* CA_HAVE_X86_KERNELS */
