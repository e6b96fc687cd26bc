/*
 * The SIMD vocabulary of AVX-512 F, BW, DQ and VL (Skylake-SP, Ice Lake,
 * Sapphire Rapids, Zen 4 and later), read by the kernels in kernels_simd.h.
 * The names and their meaning are those of simd_avx2.h; lane masks and
 * comparison results are opmask registers.
 */
#ifndef CATTENTION_SIMD_AVX512_H
#define CATTENTION_SIMD_AVX512_H

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#include "exp_poly.h"

#define CA_SIMD_TARGET \
    __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))

/* 32 registers: a tile of 6 rows times four vectors (four panels side by
   side) keeps 24 accumulators, four operand vectors and a broadcast in
   registers: 10 loads per 24 FMAs, where 12 rows times two vectors take 14
   (fewer loads for two FMA ports to wait on; the float64 tile is 32
   columns wide instead of 16). */
#define CA_TILE_ROWS 6
#define CA_TILE_VECS 4
/* Decode (score_direct): the most vectors of query features a row keeps
   in registers for a whole call, alone and in a pair of rows (8 each: two
   rows' 16, eight dot products and a key vector in 32 registers; a row
   alone holding 16 leaves too few registers for the keys in flight). */
#define CA_DIRECT_ROW_VECS 8
#define CA_DIRECT_PAIR_VECS 8
/* rows sharing each widened vector of V in P.V: 16 accumulators (4 rows
   of 4 vectors, 2 of 8) beside the vectors and weights, of 32 registers */
#define CA_DIRECT_SHARED_VECS 16

#define CA_LANES_F32 16
#define CA_LANES_F64 8

typedef __m512 vf32;
typedef __mmask16 mf32;
typedef __mmask16 pf32;
typedef __m512d vf64;
typedef __mmask8 mf64;
typedef __mmask8 pf64;

#define CA_SIMD_INLINE static inline __attribute__((always_inline)) CA_SIMD_TARGET

/* ---- float32 ---- */

CA_SIMD_INLINE vf32 vf32_zero(void) { return _mm512_setzero_ps(); }
CA_SIMD_INLINE vf32 vf32_set1(float x) { return _mm512_set1_ps(x); }
CA_SIMD_INLINE vf32 vf32_load(const float *p) { return _mm512_loadu_ps(p); }
CA_SIMD_INLINE void vf32_store(float *p, vf32 x) { _mm512_storeu_ps(p, x); }
CA_SIMD_INLINE vf32 vf32_broadcast(const float *p) { return _mm512_set1_ps(*p); }
/* masked-off lanes are neither read (no fault) nor kept */
CA_SIMD_INLINE mf32 vf32_lanes(ptrdiff_t n) { return (mf32)((1u << n) - 1u); }
CA_SIMD_INLINE vf32 vf32_load_lanes(const float *p, mf32 m) { return _mm512_maskz_loadu_ps(m, p); }

CA_SIMD_INLINE vf32 vf32_add(vf32 a, vf32 b) { return _mm512_add_ps(a, b); }
CA_SIMD_INLINE vf32 vf32_sub(vf32 a, vf32 b) { return _mm512_sub_ps(a, b); }
CA_SIMD_INLINE vf32 vf32_mul(vf32 a, vf32 b) { return _mm512_mul_ps(a, b); }
CA_SIMD_INLINE vf32 vf32_div(vf32 a, vf32 b) { return _mm512_div_ps(a, b); }
CA_SIMD_INLINE vf32 vf32_fmadd(vf32 a, vf32 b, vf32 c) { return _mm512_fmadd_ps(a, b, c); }
CA_SIMD_INLINE vf32 vf32_fnmadd(vf32 a, vf32 b, vf32 c) { return _mm512_fnmadd_ps(a, b, c); }
/* vmaxps / vminps return the second operand when either is NaN, as in AVX2 */
CA_SIMD_INLINE vf32 vf32_max(vf32 a, vf32 b) { return _mm512_max_ps(a, b); }
CA_SIMD_INLINE vf32 vf32_min(vf32 a, vf32 b) { return _mm512_min_ps(a, b); }
CA_SIMD_INLINE vf32 vf32_abs(vf32 x) { return _mm512_andnot_ps(_mm512_set1_ps(-0.0f), x); }
CA_SIMD_INLINE vf32 vf32_or_sign(vf32 x, vf32 y)
{
    return _mm512_or_ps(x, _mm512_and_ps(_mm512_set1_ps(-0.0f), y));
}
CA_SIMD_INLINE vf32 vf32_pow2_rounded(vf32 t)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(t), 23));
}

CA_SIMD_INLINE pf32 pf32_none(void) { return 0; }
CA_SIMD_INLINE pf32 vf32_unordered(vf32 a, vf32 b) { return _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q); }
CA_SIMD_INLINE pf32 vf32_less(vf32 a, vf32 b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
/* x < lo, x > hi, or x NaN */
CA_SIMD_INLINE pf32 vf32_outside(vf32 x, vf32 lo, vf32 hi)
{
    return (pf32)(_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ) | _mm512_cmp_ps_mask(x, hi, _CMP_NLE_UQ));
}
CA_SIMD_INLINE pf32 pf32_or(pf32 a, pf32 b) { return (pf32)(a | b); }
CA_SIMD_INLINE int pf32_any(pf32 p) { return p != 0; }
CA_SIMD_INLINE vf32 vf32_select(pf32 p, vf32 if_true, vf32 if_false)
{
    return _mm512_mask_blend_ps(p, if_false, if_true);
}

/* per 128-bit lane: {a0 + a1, a2 + a3, b0 + b1, b2 + b3} (AVX2's hadd) */
CA_SIMD_INLINE vf32 pair_sums_f32(vf32 a, vf32 b)
{
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

/* dots[l] = the lanes of a_l summed as a pairwise tree (see simd_avx2.h):
   two rounds of pair sums leave, in 128-bit lane q, the sum of elements
   4q..4q+3 of each a_l; then (lane 0 + lane 1) + (lane 2 + lane 3) */
CA_SIMD_INLINE void vf32_sum4(vf32 a0, vf32 a1, vf32 a2, vf32 a3, float dots[4])
{
    const __m512 t = pair_sums_f32(pair_sums_f32(a0, a1), pair_sums_f32(a2, a3));
    const __m256 lo = _mm512_castps512_ps256(t);
    const __m256 hi = _mm512_extractf32x8_ps(t, 1);
    const __m128 sum01 = _mm_add_ps(_mm256_castps256_ps128(lo), _mm256_extractf128_ps(lo, 1));
    const __m128 sum23 = _mm_add_ps(_mm256_castps256_ps128(hi), _mm256_extractf128_ps(hi, 1));
    _mm_storeu_ps(dots, _mm_add_ps(sum01, sum23));
}

/* The lanes reduced in registers, lane 0 ending with the result. Sum: the
   pairwise tree ((x0 + x1) + (x2 + x3)) + ...: each step adds to every
   lane its neighbour at distance 1, 2, 4, 8. Max: the same steps with
   max(neighbour above, lane), so that among equal lanes the lowest wins,
   as a scan that keeps the first of equal values (x holds no NaN). */
CA_SIMD_INLINE float vf32_sum_lanes(vf32 x)
{
    x = _mm512_add_ps(x, _mm512_permute_ps(x, 0xB1));
    x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x4E));
    x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, 0xB1));
    x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, 0x4E));
    return _mm512_cvtss_f32(x);
}
CA_SIMD_INLINE float vf32_max_lanes(vf32 x)
{
    x = vf32_max(_mm512_permute_ps(x, 0xB1), x);
    x = vf32_max(_mm512_permute_ps(x, 0x4E), x);
    x = vf32_max(_mm512_shuffle_f32x4(x, x, 0xB1), x);
    x = vf32_max(_mm512_shuffle_f32x4(x, x, 0x4E), x);
    return _mm512_cvtss_f32(x);
}

CA_SIMD_INLINE vf32 vf32_load_half(const uint16_t *p)
{
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
/* the leading lanes m of them, the others 0 */
CA_SIMD_INLINE vf32 vf32_load_half_lanes(const uint16_t *p, mf32 m)
{
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
/* bfloat16 values are the upper halves of float32 ones: widened and
   shifted, exactly */
CA_SIMD_INLINE vf32 vf32_load_bf16(const uint16_t *p)
{
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
CA_SIMD_INLINE vf32 vf32_load_bf16_lanes(const uint16_t *p, mf32 m)
{
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
CA_SIMD_INLINE vf32 vf32_load_i8(const int8_t *p)
{
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* fp8 codes (16 bytes) as float32 lanes, through binary16 (see
   simd_avx2.h: E5M2 exactly, E4M3FN as 2^-8 times its value, NaN codes
   NaN); the masked form reads only the leading lanes m */
CA_SIMD_INLINE vf32 fp8_e5m2_from_bytes(__m128i bytes)
{
    return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8));
}
CA_SIMD_INLINE __m256i e4m3_as_half(__m128i bytes)
{
    /* sign-extended, the sign lands on bits 15 and 14 of the shifted code:
       one shift and one mask, where a zero-extended code takes two shifts */
    return _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7),
                            _mm256_set1_epi16((short)0xBFFF));
}
CA_SIMD_INLINE vf32 fp8_e4m3_from_bytes(__m128i bytes)
{
    const __m256i half = e4m3_as_half(bytes);
    const __mmask16 nan = _mm256_cmpgt_epi16_mask(
        _mm256_and_si256(half, _mm256_set1_epi16(0x7FFF)), _mm256_set1_epi16(0x3F00));
    return _mm512_cvtph_ps(_mm256_mask_mov_epi16(half, nan, _mm256_set1_epi16(-1)));
}
CA_SIMD_INLINE vf32 vf32_load_e5m2(const uint8_t *p)
{
    return fp8_e5m2_from_bytes(_mm_loadu_si128((const __m128i *)p));
}
CA_SIMD_INLINE vf32 vf32_load_e5m2_lanes(const uint8_t *p, mf32 m)
{
    return fp8_e5m2_from_bytes(_mm_maskz_loadu_epi8(m, p));
}
CA_SIMD_INLINE vf32 vf32_load_e4m3(const uint8_t *p)
{
    return fp8_e4m3_from_bytes(_mm_loadu_si128((const __m128i *)p));
}
CA_SIMD_INLINE vf32 vf32_load_e4m3_lanes(const uint8_t *p, mf32 m)
{
    return fp8_e4m3_from_bytes(_mm_maskz_loadu_epi8(m, p));
}
/* E4M3FN codes known to hold no NaN code, in order, as float32 lanes 2^-120
   below their values (CA_E4M3_FINITE_UNIT): the sign-extended code shifted
   so that its exponent and mantissa are float32's low exponent bits and
   high mantissa bits (an E4M3FN subnormal a float32 one, exactly), the
   sign's copies above them cleared. Three integer steps and no conversion,
   where the binary16 route takes three and the conversion: measured in L1
   on a Zen 5 core with the FMA that uses them, 1.33 cycles per 16 codes
   against 1.75.
   kernels_fp8.h gives q and the weights the 2^120 back (exactly, where they
   stay finite), and keeps to the binary16 route where the thread reads
   subnormal inputs as zero (MXCSR.DAZ, ca_subnormals_read). */
#define CA_E4M3_FINITE_UNIT 0x1p-120f
CA_SIMD_INLINE vf32 e4m3_finite_from_bytes(__m128i bytes)
{
    return _mm512_castsi512_ps(_mm512_and_si512(
        _mm512_slli_epi32(_mm512_cvtepi8_epi32(bytes), 20), _mm512_set1_epi32((int)0x87FFFFFF)));
}
CA_SIMD_INLINE vf32 vf32_load_e4m3_finite(const uint8_t *p)
{
    return e4m3_finite_from_bytes(_mm_loadu_si128((const __m128i *)p));
}
CA_SIMD_INLINE vf32 vf32_load_e4m3_finite_lanes(const uint8_t *p, mf32 m)
{
    return e4m3_finite_from_bytes(_mm_maskz_loadu_epi8(m, p));
}
/* whether this thread's arithmetic reads float32 subnormals as themselves
   (MXCSR.DAZ clear: a library built with -ffast-math, or
   torch.set_flush_denormal, sets it for the threads it runs on) */
CA_SIMD_INLINE int ca_subnormals_read(void)
{
    return (_mm_getcsr() & 0x0040u) == 0;
}
/* 32 codes as two vectors in the order in-lane unpacking leaves them:
   *a holds codes 0-7 and 16-23, *b codes 8-15 and 24-31 (vf32_pair_in_order
   puts sums of them back in order). Unpacking each byte under a zero byte
   makes the binary16 of an E5M2 code in one instruction, where widening
   16 codes in order takes a cross-lane widening and a shift: measured in
   L1 on a Zen 5 core, a dot product over E5M2 codes ran at 64 GB/s of
   codes against 39. */
#define CA_HAVE_FP8_PAIRS 1
CA_SIMD_INLINE void vf32_load_e5m2_pair(const uint8_t *p, vf32 *a, vf32 *b)
{
    const __m256i codes = _mm256_loadu_si256((const __m256i *)p);
    *a = _mm512_cvtph_ps(_mm256_unpacklo_epi8(_mm256_setzero_si256(), codes));
    *b = _mm512_cvtph_ps(_mm256_unpackhi_epi8(_mm256_setzero_si256(), codes));
}
/* lanes of a pair's order (columns 0-7, 16-23 | 8-15, 24-31) back to
   columns 0-15 | 16-31 */
CA_SIMD_INLINE void vf32_pair_in_order(vf32 *a, vf32 *b)
{
    const vf32 first = _mm512_shuffle_f32x4(*a, *b, 0x44);
    *b = _mm512_shuffle_f32x4(*a, *b, 0xEE);
    *a = first;
}

/* rows r[0..16) of a 16 x 16 block become its columns: 4 x 4 transposes
   within each 128-bit lane, then a 4 x 4 transpose of the lanes */
CA_SIMD_INLINE void vf32_transpose(vf32 r[16])
{
    __m512 t[16], u[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    /* u[4i + k], lane q: element 4q + k of rows 4i..4i+3 */
    for (int i = 0; i < 4; ++i) {
        u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int k = 0; k < 4; ++k) {
        const __m512 v0 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x44);
        const __m512 v1 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xEE);
        const __m512 v2 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x44);
        const __m512 v3 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xEE);
        r[k] = _mm512_shuffle_f32x4(v0, v2, 0x88);
        r[4 + k] = _mm512_shuffle_f32x4(v0, v2, 0xDD);
        r[8 + k] = _mm512_shuffle_f32x4(v1, v3, 0x88);
        r[12 + k] = _mm512_shuffle_f32x4(v1, v3, 0xDD);
    }
}

/* ---- float64 ---- */

CA_SIMD_INLINE vf64 vf64_zero(void) { return _mm512_setzero_pd(); }
CA_SIMD_INLINE vf64 vf64_set1(double x) { return _mm512_set1_pd(x); }
CA_SIMD_INLINE vf64 vf64_load(const double *p) { return _mm512_loadu_pd(p); }
CA_SIMD_INLINE void vf64_store(double *p, vf64 x) { _mm512_storeu_pd(p, x); }
CA_SIMD_INLINE vf64 vf64_broadcast(const double *p) { return _mm512_set1_pd(*p); }
CA_SIMD_INLINE mf64 vf64_lanes(ptrdiff_t n) { return (mf64)((1u << n) - 1u); }
CA_SIMD_INLINE vf64 vf64_load_lanes(const double *p, mf64 m) { return _mm512_maskz_loadu_pd(m, p); }

CA_SIMD_INLINE vf64 vf64_add(vf64 a, vf64 b) { return _mm512_add_pd(a, b); }
CA_SIMD_INLINE vf64 vf64_sub(vf64 a, vf64 b) { return _mm512_sub_pd(a, b); }
CA_SIMD_INLINE vf64 vf64_mul(vf64 a, vf64 b) { return _mm512_mul_pd(a, b); }
CA_SIMD_INLINE vf64 vf64_div(vf64 a, vf64 b) { return _mm512_div_pd(a, b); }
CA_SIMD_INLINE vf64 vf64_fmadd(vf64 a, vf64 b, vf64 c) { return _mm512_fmadd_pd(a, b, c); }
CA_SIMD_INLINE vf64 vf64_fnmadd(vf64 a, vf64 b, vf64 c) { return _mm512_fnmadd_pd(a, b, c); }
CA_SIMD_INLINE vf64 vf64_max(vf64 a, vf64 b) { return _mm512_max_pd(a, b); }
CA_SIMD_INLINE vf64 vf64_min(vf64 a, vf64 b) { return _mm512_min_pd(a, b); }
CA_SIMD_INLINE vf64 vf64_abs(vf64 x) { return _mm512_andnot_pd(_mm512_set1_pd(-0.0), x); }
CA_SIMD_INLINE vf64 vf64_pow2_rounded(vf64 t)
{
    return _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_castpd_si512(t), 52));
}

CA_SIMD_INLINE pf64 pf64_none(void) { return 0; }
CA_SIMD_INLINE pf64 vf64_unordered(vf64 a, vf64 b) { return _mm512_cmp_pd_mask(a, b, _CMP_UNORD_Q); }
CA_SIMD_INLINE pf64 vf64_outside(vf64 x, vf64 lo, vf64 hi)
{
    return (pf64)(_mm512_cmp_pd_mask(x, lo, _CMP_LT_OQ) | _mm512_cmp_pd_mask(x, hi, _CMP_NLE_UQ));
}
CA_SIMD_INLINE pf64 pf64_or(pf64 a, pf64 b) { return (pf64)(a | b); }
CA_SIMD_INLINE int pf64_any(pf64 p) { return p != 0; }
CA_SIMD_INLINE vf64 vf64_select(pf64 p, vf64 if_true, vf64 if_false)
{
    return _mm512_mask_blend_pd(p, if_false, if_true);
}

/* per 128-bit lane q: {a_2q + a_2q+1, b_2q + b_2q+1} */
CA_SIMD_INLINE vf64 pair_sums_f64(vf64 a, vf64 b)
{
    return _mm512_add_pd(_mm512_unpacklo_pd(a, b), _mm512_unpackhi_pd(a, b));
}

/* {sum(a), sum(b)} from their pair sums t: (lane 0 + lane 1) + (lane 2 + lane 3) */
CA_SIMD_INLINE __m128d lane_tree_f64(vf64 t)
{
    const __m256d lo = _mm512_castpd512_pd256(t);
    const __m256d hi = _mm512_extractf64x4_pd(t, 1);
    return _mm_add_pd(_mm_add_pd(_mm256_castpd256_pd128(lo), _mm256_extractf128_pd(lo, 1)),
                      _mm_add_pd(_mm256_castpd256_pd128(hi), _mm256_extractf128_pd(hi, 1)));
}

CA_SIMD_INLINE void vf64_sum4(vf64 a0, vf64 a1, vf64 a2, vf64 a3, double dots[4])
{
    _mm_storeu_pd(dots, lane_tree_f64(pair_sums_f64(a0, a1)));
    _mm_storeu_pd(dots + 2, lane_tree_f64(pair_sums_f64(a2, a3)));
}

/* as vf32_sum_lanes and vf32_max_lanes: neighbours at distance 1, 2, 4 */
CA_SIMD_INLINE double vf64_sum_lanes(vf64 x)
{
    x = _mm512_add_pd(x, _mm512_permute_pd(x, 0x55));
    x = _mm512_add_pd(x, _mm512_shuffle_f64x2(x, x, 0xB1));
    x = _mm512_add_pd(x, _mm512_shuffle_f64x2(x, x, 0x4E));
    return _mm512_cvtsd_f64(x);
}
CA_SIMD_INLINE double vf64_max_lanes(vf64 x)
{
    x = vf64_max(_mm512_permute_pd(x, 0x55), x);
    x = vf64_max(_mm512_shuffle_f64x2(x, x, 0xB1), x);
    x = vf64_max(_mm512_shuffle_f64x2(x, x, 0x4E), x);
    return _mm512_cvtsd_f64(x);
}

#endif /* CATTENTION_SIMD_AVX512_H */
