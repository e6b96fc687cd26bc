/*
 * The SIMD kernels of every instruction set, written once. A table's file
 * (kernels_<isa>.c) includes its mapping (simd_<isa>.h: vector types,
 * operations, register-tile shape) and then this file, which defines a
 * static function for each entry of the table (kernels.h); the file then
 * lists them with CA_DEFINE_KERNEL_TABLE.
 *
 * Register tiles are fixed-size code: a tile of R rows (R <= CA_TILE_ROWS)
 * times NV vectors, written once as an always-inline function and called
 * with constant R and NV, so the accumulators stay in registers.
 *
 * Each kernel takes the steps of the portable one (kernels_baseline.c) lane
 * by lane, with fused multiply-adds; sums are split across lanes and joined
 * as the comments say.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "exp_poly.h"
#include "kernels.h"

_Static_assert(CA_ROW_QUANTUM % CA_TILE_ROWS == 0,
               "the driver's row blocks are whole register tiles");


/* keys ahead of the one in use whose rows are prefetched: memory-bound
   decode otherwise waits on each row as it streams in */
#define PREFETCH_KEYS 16
/* the float P.V decode kernel brings V rows the score kernel prefetched
   into L2 (prefetch_ahead) into L1 this many keys ahead, at most
   PREFETCH_KEYS (the score kernel leaves its K rows to L2): half
   the call's keys. A paged cache hands them a page at a time (16 rows for
   page_size 16), where PREFETCH_KEYS ahead would never be inside the call */
#define DIRECT_PREFETCH_KEYS(n_keys) ((n_keys) / 2 < PREFETCH_KEYS ? (n_keys) / 2 : PREFETCH_KEYS)
/* vectors whose e^x exp_sum computes side by side (see exp_vecs) */
#define CA_EXP_VECS 4
/* vectors of columns per pass of the direct P.V kernels: 8 accumulators,
   the other registers for operands */
#define DIRECT_VECS 8
/* accumulators of the direct P.V kernels whose rows share each widened
   vector of V (CA_KV_SHARED_ROWS), 2 or 4 rows of DIRECT_VECS at most:
   as many as DIRECT_VECS, or more where the mapping has the registers */
#ifndef CA_DIRECT_SHARED_VECS
#define CA_DIRECT_SHARED_VECS DIRECT_VECS
#endif
_Static_assert(CA_DIRECT_SHARED_VECS / 2 <= DIRECT_VECS,
               "two rows of shared accumulators fit one row's operands");

/* `CALL(k)` for the constant k == n, for the row counts 1 .. CA_TILE_ROWS - 1
   of a tail tile; cases at or above CA_TILE_ROWS are dead code */
#define CA_ROW_CASE(k, CALL) \
    case k: if ((k) < CA_TILE_ROWS) { CALL(((k) < CA_TILE_ROWS ? (k) : 1)); } break;
#define CA_SWITCH_TAIL_ROWS(n, CALL) \
    switch (n) { \
    CA_ROW_CASE(15, CALL) CA_ROW_CASE(14, CALL) CA_ROW_CASE(13, CALL) \
    CA_ROW_CASE(12, CALL) CA_ROW_CASE(11, CALL) CA_ROW_CASE(10, CALL) \
    CA_ROW_CASE(9, CALL) CA_ROW_CASE(8, CALL) CA_ROW_CASE(7, CALL) \
    CA_ROW_CASE(6, CALL) CA_ROW_CASE(5, CALL) CA_ROW_CASE(4, CALL) \
    CA_ROW_CASE(3, CALL) CA_ROW_CASE(2, CALL) CA_ROW_CASE(1, CALL) \
    default: break; \
    }
_Static_assert(CA_TILE_ROWS <= 16, "CA_SWITCH_TAIL_ROWS lists tails up to 15 rows");

/* `CALL(k)` for the constant k == n, for the vector counts 1 ..
   CA_TILE_VECS - 1 of the last columns of a tile, whole panels of the type
   in use (CA_VECS_PER_PANEL); other cases are dead code */
#define CA_VECS_CASE(k, CALL) \
    case k: \
        if ((k) < CA_TILE_VECS && (k) % CA_VECS_PER_PANEL == 0) { \
            CALL(((k) < CA_TILE_VECS && (k) % CA_VECS_PER_PANEL == 0 ? (k) : CA_TILE_VECS)); \
        } \
        break;
#define CA_SWITCH_TAIL_VECS(n, CALL) \
    switch (n) { \
    CA_VECS_CASE(7, CALL) CA_VECS_CASE(6, CALL) CA_VECS_CASE(5, CALL) \
    CA_VECS_CASE(4, CALL) CA_VECS_CASE(3, CALL) CA_VECS_CASE(2, CALL) \
    CA_VECS_CASE(1, CALL) \
    default: break; \
    }
_Static_assert(CA_TILE_VECS <= 8, "CA_SWITCH_TAIL_VECS lists tails up to 7 vectors");

/* `CALL(k)` for the constant k == n in 1 .. DIRECT_VECS (n < 1 as 1) */
#define CA_SWITCH_DIRECT_VECS(n, CALL) \
    switch (n) { \
    case 8: CALL(8); break; case 7: CALL(7); break; case 6: CALL(6); break; \
    case 5: CALL(5); break; case 4: CALL(4); break; case 3: CALL(3); break; \
    case 2: CALL(2); break; default: CALL(1); break; \
    }

/* Prefetch into L2 of the block the next call reads (see kernels.h), a
   share of it before each register tile so that the requests spread over
   the call instead of queueing at its start. */
typedef struct {
    const char *next;
    ptrdiff_t left;         /* bytes still to prefetch */
    ptrdiff_t per_tile;     /* bytes before each tile, whole cache lines */
} ca_ahead;

CA_SIMD_INLINE ca_ahead ahead_start(const void *ahead, ptrdiff_t ahead_bytes, ptrdiff_t n_tiles)
{
    ca_ahead a = {(const char *)ahead, ahead == NULL ? 0 : ahead_bytes, 0};
    if (a.left > 0 && n_tiles > 0)
        a.per_tile = ((a.left + n_tiles - 1) / n_tiles + 63) & ~(ptrdiff_t)63;
    else
        a.left = 0;
    return a;
}

/* __builtin_prefetch locality 2 is a prefetch into L2 (prefetcht1 on x86,
   pldl2keep on aarch64), locality 3 into L1 */
CA_SIMD_INLINE void ahead_step(ca_ahead *a)
{
    if (a->left <= 0)
        return;
    const ptrdiff_t n = a->per_tile < a->left ? a->per_tile : a->left;
    for (ptrdiff_t b = 0; b < n; b += 64)
        __builtin_prefetch(a->next + b, 0, 2);
    a->next += n;
    a->left -= n;
}

CA_SIMD_INLINE void prefetch_row(const void *row, ptrdiff_t n_bytes)
{
    for (ptrdiff_t b = 0; b < n_bytes; b += 64)
        __builtin_prefetch((const char *)row + b, 0, 3);
}

/* the other operand's row j, into L2 for the next kernel. Every line of
   the row, and for every key: a decode step reads K and V from memory (a
   service reads each layer's cache once per token, after all the others),
   and the hardware prefetcher alone leaves the step waiting on rows that
   stream in; fewer lines per row or fewer rows left it waiting again. */
CA_SIMD_INLINE void prefetch_ahead(const void *ahead, ptrdiff_t ahead_stride,
                               ptrdiff_t ahead_bytes, ptrdiff_t j)
{
    if (ahead == NULL)
        return;
    const char *row = (const char *)ahead + j * ahead_stride;
    for (ptrdiff_t b = 0; b < ahead_bytes; b += 64)
        __builtin_prefetch(row + b, 0, 2);
}

/* ---- the kernels of both element types ----------------------------- */

/* the parameters of kernels_simd_typed.h (which undefines them at its end) */

#define CA_T float
#define CA_NAME(x) x##_f32
#define CA_V(op) vf32_##op
#define CA_P(op) pf32_##op
#define CA_VEC vf32
#define CA_MASK mf32
#define CA_PRED pf32
#define CA_LANES CA_LANES_F32
#define CA_PANEL CA_PANEL_F32
#define CA_ROUND_MAGIC CA_ROUND_MAGIC_BIASED_F32
#define CA_EXP_MIN CA_EXPF_MIN
#define CA_EXP_MAX CA_EXPF_MAX
#define CA_LOG2E CA_LOG2E_F32
#define CA_LN2_HI CA_LN2_HI_F32
#define CA_LN2_LO CA_LN2_LO_F32
#define CA_EXP_COEF ca_expf_coef
#define CA_EXP_DEGREE 6
#define CA_DIV_B_RANGE 0x1p20f
#define CA_DIV_Q_RANGE 0x1p40f
#include "kernels_simd_typed.h"

#define CA_T double
#define CA_NAME(x) x##_f64
#define CA_V(op) vf64_##op
#define CA_P(op) pf64_##op
#define CA_VEC vf64
#define CA_MASK mf64
#define CA_PRED pf64
#define CA_LANES CA_LANES_F64
#define CA_PANEL CA_PANEL_F64
#define CA_ROUND_MAGIC CA_ROUND_MAGIC_BIASED_F64
#define CA_EXP_MIN CA_EXPD_MIN
#define CA_EXP_MAX CA_EXPD_MAX
#define CA_LOG2E CA_LOG2E_F64
#define CA_LN2_HI CA_LN2_HI_F64
#define CA_LN2_LO CA_LN2_LO_F64
#define CA_EXP_COEF ca_expd_coef
#define CA_EXP_DEGREE 13
#define CA_DIV_B_RANGE 0x1p200
#define CA_DIV_Q_RANGE 0x1p400
#include "kernels_simd_typed.h"

/* ---- float32 queries, float16 or bfloat16 K and V: the decode kernels */

#define CA_T float
#define CA_V(op) vf32_##op
#define CA_VEC vf32
#define CA_MASK mf32
#define CA_LANES CA_LANES_F32
#define CA_KV_T uint16_t
#define CA_KV_LOAD(p) vf32_load_half(p)
#define CA_KV_LOAD_LANES(p, m) vf32_load_half_lanes(p, m)
#define CA_KV_SHARED_ROWS
#define CA_DIRECT_NAME(x) x##_f16
#include "kernels_simd_direct.h"
#define CA_KV_T uint16_t
#define CA_KV_LOAD(p) vf32_load_bf16(p)
#define CA_KV_LOAD_LANES(p, m) vf32_load_bf16_lanes(p, m)
#define CA_KV_SHARED_ROWS
#define CA_DIRECT_NAME(x) x##_bf16
#include "kernels_simd_direct.h"
/* fp8 K and V: E4M3FN as 2^-8 times its value (vf32_load_e4m3), E5M2 as it
   is; kernels_fp8.h scales them, and picks for E4M3FN rows without a NaN
   code the kernels that skip the NaN codes' fixing (e4m3), which read
   CA_E4M3_FINITE_UNIT times the value where the mapping defines it */
#define CA_KV_T uint8_t
#define CA_KV_LOAD(p) vf32_load_e4m3_finite(p)
#ifdef CA_E4M3_FINITE_UNIT
#define CA_KV_LOAD_LANES(p, m) vf32_load_e4m3_finite_lanes(p, m)
#else
#define CA_KV_LOAD_LANES(p, m) vf32_load_e4m3_lanes(p, m)
#endif
#define CA_KV_SHARED_ROWS
#define CA_DIRECT_NAME(x) x##_e4m3
#include "kernels_simd_direct.h"
#define CA_KV_T uint8_t
#define CA_KV_LOAD(p) vf32_load_e4m3(p)
#define CA_KV_LOAD_LANES(p, m) vf32_load_e4m3_lanes(p, m)
#define CA_KV_SHARED_ROWS
#define CA_DIRECT_NAME(x) x##_e4m3nan
#include "kernels_simd_direct.h"
#define CA_E4M3_NAN_KERNELS
#define CA_KV_T uint8_t
#define CA_KV_LOAD(p) vf32_load_e5m2(p)
#define CA_KV_LOAD_LANES(p, m) vf32_load_e5m2_lanes(p, m)
#ifdef CA_HAVE_FP8_PAIRS
#define CA_KV_LOAD_PAIR(p, a, b) vf32_load_e5m2_pair(p, &(a), &(b))
#endif
#define CA_KV_SHARED_ROWS
#define CA_DIRECT_NAME(x) x##_e5m2
#include "kernels_simd_direct.h"
#undef CA_T
#undef CA_V
#undef CA_VEC
#undef CA_MASK
#undef CA_LANES

/* ---- float32 only: conversions, soft-capping, packing ---------------- */

#define LANES CA_LANES_F32
#define PANEL CA_PANEL_F32

/* float16 and bfloat16 rows, converted exactly (name: the table entry,
   LOAD: CA_LANES_F32 values as a vector, SCALAR: one value) */
#define CA_DEFINE_ROWS_TO_F32(name, LOAD, SCALAR) \
    CA_SIMD_TARGET static void name(const uint16_t *src, ptrdiff_t src_row, ptrdiff_t src_col, \
                                    ptrdiff_t n_rows, ptrdiff_t n_cols, float *dst, \
                                    ptrdiff_t ld_dst) \
    { \
        for (ptrdiff_t r = 0; r < n_rows; ++r) { \
            const uint16_t *row = src + r * src_row; \
            float *out = dst + r * ld_dst; \
            ptrdiff_t c = 0; \
            if (src_col == 1) { \
                if (r + PREFETCH_KEYS < n_rows) \
                    prefetch_row(src + (r + PREFETCH_KEYS) * src_row, n_cols * 2); \
                for (; c + LANES <= n_cols; c += LANES) \
                    vf32_store(out + c, LOAD(row + c)); \
            } \
            for (; c < n_cols; ++c) \
                out[c] = SCALAR(row[c * src_col]); \
        } \
    }
CA_DEFINE_ROWS_TO_F32(half_rows_to_f32, vf32_load_half, ca_half_to_float)
CA_DEFINE_ROWS_TO_F32(bf16_rows_to_f32, vf32_load_bf16, ca_bfloat16_to_float)
#undef CA_DEFINE_ROWS_TO_F32

/* int8 rows times their scale: lanes sign-extended, converted and
   multiplied (exact conversion, one rounding, as the portable loop) */
CA_SIMD_TARGET static void int8_rows_to_f32(const int8_t *src, ptrdiff_t src_row,
                                            ptrdiff_t src_col, ptrdiff_t n_rows,
                                            ptrdiff_t n_cols, const float *scale,
                                            ptrdiff_t scale_stride, float *dst,
                                            ptrdiff_t ld_dst)
{
    for (ptrdiff_t r = 0; r < n_rows; ++r) {
        const int8_t *row = src + r * src_row;
        float *out = dst + r * ld_dst;
        const float row_scale = scale[r * scale_stride];
        const vf32 scale_v = vf32_set1(row_scale);
        ptrdiff_t c = 0;
        if (src_col == 1) {
            if (r + PREFETCH_KEYS < n_rows)
                prefetch_row(src + (r + PREFETCH_KEYS) * src_row, n_cols);
            for (; c + LANES <= n_cols; c += LANES)
                vf32_store(out + c, vf32_mul(vf32_load_i8(row + c), scale_v));
        }
        for (; c < n_cols; ++c)
            out[c] = (float)row[c * src_col] * row_scale;
    }
}

/* fp8 rows times their scale: widened exactly in registers, then one
   rounding (E4M3FN's 2^-8 moved into the scale, exactly) */
#define CA_E4M3_UNIT 0x1p-8f
CA_SIMD_TARGET static void fp8_rows_to_f32(const uint8_t *src, ptrdiff_t src_row,
                                           ptrdiff_t src_col, ptrdiff_t n_rows,
                                           ptrdiff_t n_cols, int format, const float *scale,
                                           ptrdiff_t scale_stride, float *dst, ptrdiff_t ld_dst)
{
    const int e4m3 = format == CA_FP8_E4M3FN;
    for (ptrdiff_t r = 0; r < n_rows; ++r) {
        const uint8_t *row = src + r * src_row;
        float *out = dst + r * ld_dst;
        const float row_scale = scale[r * scale_stride];
        ptrdiff_t c = 0;
        if (src_col == 1) {
            if (r + PREFETCH_KEYS < n_rows)
                prefetch_row(src + (r + PREFETCH_KEYS) * src_row, n_cols);
            if (e4m3) {
                const vf32 scale_v = vf32_set1(row_scale * (1.0f / CA_E4M3_UNIT));
                for (; c + LANES <= n_cols; c += LANES)
                    vf32_store(out + c, vf32_mul(vf32_load_e4m3(row + c), scale_v));
            } else {
                const vf32 scale_v = vf32_set1(row_scale);
                for (; c + LANES <= n_cols; c += LANES)
                    vf32_store(out + c, vf32_mul(vf32_load_e5m2(row + c), scale_v));
            }
        }
        for (; c < n_cols; ++c)
            out[c] = (e4m3 ? ca_e4m3fn_to_float(row[c * src_col])
                           : ca_e5m2_to_float(row[c * src_col])) * row_scale;
    }
}
#include "kernels_fp8.h"

/* int8 keys read in place: four keys share one horizontal reduction, as in
   score_direct_f32; the row scale multiplies each dot product */
CA_SIMD_TARGET static void score_direct_i8(const float *q, ptrdiff_t ldq, ptrdiff_t n_rows,
                                           const int8_t *k, ptrdiff_t ldk, ptrdiff_t n_keys,
                                           ptrdiff_t d_k, float factor, const float *scale,
                                           ptrdiff_t scale_stride, float *s, ptrdiff_t lds)
{
    const ptrdiff_t d_main = d_k & ~(ptrdiff_t)(LANES - 1);
    for (ptrdiff_t j = 0; j < n_keys; j += 4) {
        const ptrdiff_t n_group = n_keys - j < 4 ? n_keys - j : 4;
        const int8_t *k0 = k + j * ldk;
        const int8_t *k1 = k0 + (n_group > 1 ? ldk : 0);
        const int8_t *k2 = k0 + (n_group > 2 ? 2 * ldk : 0);
        const int8_t *k3 = k0 + (n_group > 3 ? 3 * ldk : 0);
        if (j + PREFETCH_KEYS + 4 <= n_keys)
            for (int l = 0; l < 4; ++l)
                prefetch_row(k + (j + PREFETCH_KEYS + l) * ldk, d_k);
        const int8_t *rows[4] = {k0, k1, k2, k3};
        ptrdiff_t r = 0;
        /* rows in pairs, as in score_direct_f32: each key vector converted
           once for both; a row's dot products take the same steps */
        for (; r + 2 <= n_rows; r += 2) {
            const float *q_r = q + r * ldq;
            const float *q_n = q_r + ldq;
            vf32 a0 = vf32_zero(), a1 = vf32_zero();
            vf32 a2 = vf32_zero(), a3 = vf32_zero();
            vf32 b0 = vf32_zero(), b1 = vf32_zero();
            vf32 b2 = vf32_zero(), b3 = vf32_zero();
            for (ptrdiff_t c = 0; c < d_main; c += LANES) {
                const vf32 q_c = vf32_load(q_r + c);
                const vf32 q_d = vf32_load(q_n + c);
                vf32 k_c = vf32_load_i8(k0 + c);
                a0 = vf32_fmadd(q_c, k_c, a0);
                b0 = vf32_fmadd(q_d, k_c, b0);
                k_c = vf32_load_i8(k1 + c);
                a1 = vf32_fmadd(q_c, k_c, a1);
                b1 = vf32_fmadd(q_d, k_c, b1);
                k_c = vf32_load_i8(k2 + c);
                a2 = vf32_fmadd(q_c, k_c, a2);
                b2 = vf32_fmadd(q_d, k_c, b2);
                k_c = vf32_load_i8(k3 + c);
                a3 = vf32_fmadd(q_c, k_c, a3);
                b3 = vf32_fmadd(q_d, k_c, b3);
            }
            float dots[4], dots_n[4];
            vf32_sum4(a0, a1, a2, a3, dots);
            vf32_sum4(b0, b1, b2, b3, dots_n);
            for (ptrdiff_t l = 0; l < n_group; ++l) {
                float dot = dots[l], dot_n = dots_n[l];
                for (ptrdiff_t c = d_main; c < d_k; ++c) {
                    dot += q_r[c] * (float)rows[l][c];
                    dot_n += q_n[c] * (float)rows[l][c];
                }
                s[r * lds + j + l] = factor * (scale[(j + l) * scale_stride] * dot);
                s[(r + 1) * lds + j + l] = factor * (scale[(j + l) * scale_stride] * dot_n);
            }
        }
        for (; r < n_rows; ++r) {
            const float *q_r = q + r * ldq;
            vf32 a0 = vf32_zero(), a1 = vf32_zero();
            vf32 a2 = vf32_zero(), a3 = vf32_zero();
            for (ptrdiff_t c = 0; c < d_main; c += LANES) {
                const vf32 q_c = vf32_load(q_r + c);
                a0 = vf32_fmadd(q_c, vf32_load_i8(k0 + c), a0);
                a1 = vf32_fmadd(q_c, vf32_load_i8(k1 + c), a1);
                a2 = vf32_fmadd(q_c, vf32_load_i8(k2 + c), a2);
                a3 = vf32_fmadd(q_c, vf32_load_i8(k3 + c), a3);
            }
            float dots[4];
            vf32_sum4(a0, a1, a2, a3, dots);
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
   up to DIRECT_VECS vectors of float32 accumulators per pass; runs of
   CA_SUM_KEYS keys are summed from zero and then added to acc, as in
   pv_direct_f32 (one chain of every key into acc had twice its error) */
CA_SIMD_TARGET static void pv_direct_i8(const float *p, ptrdiff_t ldp, ptrdiff_t n_rows,
                                        const int8_t *v, ptrdiff_t ldv, ptrdiff_t n_keys,
                                        ptrdiff_t d_v, const float *scale,
                                        ptrdiff_t scale_stride, float *acc, ptrdiff_t ldacc)
{
    const ptrdiff_t d_main = d_v & ~(ptrdiff_t)(LANES - 1);
    const ptrdiff_t pass_cols = DIRECT_VECS * LANES;
    for (ptrdiff_t r = 0; r < n_rows; ++r) {
        const float *p_r = p + r * ldp;
        float *acc_r = acc + r * ldacc;
        for (ptrdiff_t c = 0; c < d_main; c += pass_cols) {
            const int n_vec = (int)((d_main - c) / LANES < DIRECT_VECS ? (d_main - c) / LANES
                                                                       : DIRECT_VECS);
            for (ptrdiff_t j0 = 0; j0 < n_keys; j0 += CA_SUM_KEYS) {
                const ptrdiff_t j_end = n_keys - j0 < CA_SUM_KEYS ? n_keys : j0 + CA_SUM_KEYS;
                vf32 run[DIRECT_VECS];
                for (int t = 0; t < n_vec; ++t)
                    run[t] = vf32_zero();
                for (ptrdiff_t j = j0; j < j_end; ++j) {
                    const float weight = p_r[j] * scale[j * scale_stride];
                    if (weight == 0)
                        continue;
                    const vf32 weight_v = vf32_set1(weight);
                    const int8_t *v_j = v + j * ldv + c;
                    if (r == 0 && j + PREFETCH_KEYS < n_keys)
                        prefetch_row(v + (j + PREFETCH_KEYS) * ldv + c, LANES * n_vec);
                    for (int t = 0; t < n_vec; ++t)
                        run[t] = vf32_fmadd(weight_v, vf32_load_i8(v_j + LANES * t), run[t]);
                }
                for (int t = 0; t < n_vec; ++t)
                    vf32_store(acc_r + c + LANES * t,
                               vf32_add(vf32_load(acc_r + c + LANES * t), run[t]));
            }
        }
        for (ptrdiff_t c = d_main; c < d_v; ++c)
            for (ptrdiff_t j0 = 0; j0 < n_keys; j0 += CA_SUM_KEYS) {
                const ptrdiff_t j_end = n_keys - j0 < CA_SUM_KEYS ? n_keys : j0 + CA_SUM_KEYS;
                float run = 0;
                for (ptrdiff_t j = j0; j < j_end; ++j) {
                    const float weight = p_r[j] * scale[j * scale_stride];
                    if (weight != 0)
                        run += weight * (float)v[j * ldv + c];
                }
                acc_r[c] += run;
            }
    }
}

/* cap * tanh(x / cap), the steps of the portable softcap lane by lane */
CA_SIMD_TARGET static void softcap_f32(float *x, ptrdiff_t n, float cap)
{
    static const float taylor[9] = {
        0.000590027440945586f, -0.0014558343870513183f, 0.003592128036572481f,
        -0.008863235529902197f, 0.021869488536155203f, -0.05396825396825397f,
        0.13333333333333333f, -0.3333333333333333f, 0.0f};
    const vf32 cap_v = vf32_set1(cap);
    const vf32 one = vf32_set1(1.0f);
    ptrdiff_t j = 0;
    for (; j + LANES <= n; j += LANES) {
        const vf32 y = vf32_div(vf32_load(x + j), cap_v);
        const vf32 a = vf32_abs(y);
        const vf32 y2 = vf32_mul(y, y);
        vf32 p = vf32_set1(taylor[0]);
        for (int t = 1; t < 8; ++t)
            p = vf32_fmadd(p, y2, vf32_set1(taylor[t]));
        const vf32 small = vf32_fmadd(y, vf32_mul(y2, p), y);
        const vf32 e = exp_vec_f32(vf32_mul(vf32_set1(-2.0f), a));
        const vf32 large = vf32_or_sign(vf32_div(vf32_sub(one, e), vf32_add(one, e)), y);
        const pf32 is_small = vf32_less(a, vf32_set1(0.5f));
        vf32_store(x + j, vf32_mul(cap_v, vf32_select(is_small, small, large)));
    }
    if (j < n)
        ca_kernels_baseline.softcap_f32(x + j, n - j, cap);
}

/* ---- packing of a key block (float32) -------------------------------- */

CA_SIMD_TARGET static void pack_kt_f32(const float *k, ptrdiff_t ldk, ptrdiff_t n_keys,
                                       ptrdiff_t d_k, float *kt, ptrdiff_t kt_panel_stride)
{
    /* LANES keys x LANES features at a time, transposed in registers; keys
       past n_keys read as 0, features past d_k are neither read nor written */
    for (ptrdiff_t j0 = 0; j0 < n_keys; j0 += PANEL) {
        float *panel = kt + (j0 / PANEL) * kt_panel_stride;
        /* K is read here for the first time, often from memory, and the
           transposes touch 16 rows at once: fetch the rows two panels
           ahead (5-10% faster on a BERT-like batch, where packing is a
           large share of the work) */
        for (ptrdiff_t l = 0; l < PANEL && j0 + 2 * PANEL + l < n_keys; ++l)
            prefetch_row(k + (j0 + 2 * PANEL + l) * ldk, d_k * 4);
        for (ptrdiff_t c0 = 0; c0 < d_k; c0 += LANES) {
            const ptrdiff_t n_c = d_k - c0 < LANES ? d_k - c0 : LANES;
            const mf32 lanes = vf32_lanes(n_c);
            for (int part = 0; part < PANEL / LANES; ++part) {
                vf32 r[LANES];
                const ptrdiff_t j_part = j0 + LANES * part;
                if (n_c == LANES && j_part + LANES <= n_keys) {
                    /* a whole block: loops of constant length, so that r
                       stays in registers (with the checks below gcc kept
                       it on the stack, and AVX-512 packing ran at two
                       thirds the speed of AVX2's) */
                    for (int l = 0; l < LANES; ++l)
                        r[l] = vf32_load(k + (j_part + l) * ldk + c0);
                    vf32_transpose(r);
                    for (int c = 0; c < LANES; ++c)
                        vf32_store(panel + (c0 + c) * PANEL + LANES * part, r[c]);
                    continue;
                }
                for (int l = 0; l < LANES; ++l) {
                    const ptrdiff_t j = j_part + l;
                    if (j >= n_keys)
                        r[l] = vf32_zero();
                    else if (n_c == LANES)
                        r[l] = vf32_load(k + j * ldk + c0);
                    else
                        r[l] = vf32_load_lanes(k + j * ldk + c0, lanes);
                }
                vf32_transpose(r);
                for (ptrdiff_t c = 0; c < n_c; ++c)
                    vf32_store(panel + (c0 + c) * PANEL + LANES * part, r[c]);
            }
        }
    }
}

CA_SIMD_TARGET static int pack_v_f32(const float *v, ptrdiff_t ldv, ptrdiff_t n_keys,
                                     ptrdiff_t d_v, float *v_packed, ptrdiff_t v_panel_stride)
{
    /* columns past d_v up to the panel's end: the vectors there are zeroed */
    const ptrdiff_t d_vectors = (d_v + LANES - 1) / LANES * LANES;
    const ptrdiff_t d_panels = (d_v + PANEL - 1) / PANEL * PANEL;
    /* x - x is 0 for finite x and NaN otherwise */
    vf32 probe = vf32_zero();
    for (ptrdiff_t j = 0; j < n_keys; ++j) {
        const float *v_row = v + j * ldv;
        /* first read of V as well: rows ahead, as for K above */
        if (j + PANEL < n_keys)
            prefetch_row(v + (j + PANEL) * ldv, d_v * 4);
        for (ptrdiff_t c0 = 0; c0 < d_v; c0 += LANES) {
            float *dst = v_packed + (c0 / PANEL) * v_panel_stride + j * PANEL + c0 % PANEL;
            const vf32 x = d_v - c0 >= LANES ? vf32_load(v_row + c0)
                                             : vf32_load_lanes(v_row + c0, vf32_lanes(d_v - c0));
            probe = vf32_add(probe, vf32_sub(x, x));
            vf32_store(dst, x);
        }
        for (ptrdiff_t c0 = d_vectors; c0 < d_panels; c0 += LANES)
            vf32_store(v_packed + (c0 / PANEL) * v_panel_stride + j * PANEL + c0 % PANEL,
                       vf32_zero());
    }
    return pf32_any(vf32_unordered(probe, probe));
}

#undef LANES
#undef PANEL


/* ---- the multiply-add loop (loop_flops) ------------------------------ */

/* sums side by side: two FMA ports of four cycles' latency keep 8 in
   flight; 12 leave room for a longer latency */
#define LOOP_SUMS 12

CA_SIMD_TARGET static double loop_flops(long n_steps)
{
    vf32 sum[LOOP_SUMS];
    const vf32 half = vf32_set1(0.5f);
    for (int i = 0; i < LOOP_SUMS; ++i)
        sum[i] = vf32_set1((float)i);
    /* x -> x / 2 + 1 / 2 stays finite and normal (it tends to 1) */
    for (long s = 0; s < n_steps; ++s)
        for (int i = 0; i < LOOP_SUMS; ++i)
            sum[i] = vf32_fmadd(sum[i], half, half);
    float out[CA_LANES_F32];
    vf32 total = sum[0];
    for (int i = 1; i < LOOP_SUMS; ++i)
        total = vf32_add(total, sum[i]);
    vf32_store(out, total);
    volatile float keep = out[0];
    (void)keep;
    return 2.0 * LOOP_SUMS * CA_LANES_F32 * (double)n_steps;
}
