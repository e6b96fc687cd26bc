/*
 * The SIMD vocabulary of AVX2 + FMA + F16C (Haswell and later, Zen and
 * later), read by the kernels in kernels_simd.h.
 *
 * Every instruction set defines the same names (simd_avx512.h, simd_neon.h):
 *   vf32 / vf64    a vector of CA_LANES_F32 floats / CA_LANES_F64 doubles
 *   mf32 / mf64    which leading lanes a partial load reads (vf32_lanes(n))
 *   pf32 / pf64    a per-lane truth value from a comparison
 * and the same operations on them, each with the meaning written beside the
 * AVX2 form below. Where the other sets differ in corner cases (NaN and
 * signed zero in max/min), their mappings follow the meaning given here, so
 * that every table computes the same numbers.
 *
 * The functions carry a target attribute instead of the file being built
 * with -mavx2, so the extension as a whole still runs on any x86-64 and the
 * table is only used after dispatch.c has checked CPUID and XGETBV.
 */
#ifndef CATTENTION_SIMD_AVX2_H
#define CATTENTION_SIMD_AVX2_H

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#include "exp_poly.h"

#define CA_SIMD_TARGET __attribute__((target("avx2,fma,f16c")))

/* Register tile of the score and P.V kernels: CA_TILE_ROWS query rows times
   CA_TILE_VECS vectors. 6 x 2 accumulators, two operand vectors and one
   broadcast fill 15 of the 16 registers. */
#define CA_TILE_ROWS 6
#define CA_TILE_VECS 2
/* Decode (score_direct): the most vectors of query features a row keeps
   in registers for a whole call, alone (8, with its four dot products) and
   in a pair of rows (3 each: eight dot products and a key vector fill the
   other 10 of 16 registers) */
#define CA_DIRECT_ROW_VECS 8
#define CA_DIRECT_PAIR_VECS 3

#define CA_LANES_F32 8
#define CA_LANES_F64 4

typedef __m256 vf32;
typedef __m256i mf32;
typedef __m256 pf32;
typedef __m256d vf64;
typedef __m256i mf64;
typedef __m256d pf64;

#define CA_SIMD_INLINE static inline __attribute__((always_inline)) CA_SIMD_TARGET

/* ---- float32 ---- */

CA_SIMD_INLINE vf32 vf32_zero(void) { return _mm256_setzero_ps(); }
CA_SIMD_INLINE vf32 vf32_set1(float x) { return _mm256_set1_ps(x); }
/* unaligned load and store of all lanes */
CA_SIMD_INLINE vf32 vf32_load(const float *p) { return _mm256_loadu_ps(p); }
CA_SIMD_INLINE void vf32_store(float *p, vf32 x) { _mm256_storeu_ps(p, x); }
/* *p in every lane */
CA_SIMD_INLINE vf32 vf32_broadcast(const float *p) { return _mm256_broadcast_ss(p); }
/* the first n lanes (0 <= n <= CA_LANES_F32); a load under it reads no
   element past them and sets the other lanes to 0 */
CA_SIMD_INLINE mf32 vf32_lanes(ptrdiff_t n)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
CA_SIMD_INLINE vf32 vf32_load_lanes(const float *p, mf32 m) { return _mm256_maskload_ps(p, m); }

CA_SIMD_INLINE vf32 vf32_add(vf32 a, vf32 b) { return _mm256_add_ps(a, b); }
CA_SIMD_INLINE vf32 vf32_sub(vf32 a, vf32 b) { return _mm256_sub_ps(a, b); }
CA_SIMD_INLINE vf32 vf32_mul(vf32 a, vf32 b) { return _mm256_mul_ps(a, b); }
CA_SIMD_INLINE vf32 vf32_div(vf32 a, vf32 b) { return _mm256_div_ps(a, b); }
/* a * b + c and c - a * b, one rounding */
CA_SIMD_INLINE vf32 vf32_fmadd(vf32 a, vf32 b, vf32 c) { return _mm256_fmadd_ps(a, b, c); }
CA_SIMD_INLINE vf32 vf32_fnmadd(vf32 a, vf32 b, vf32 c) { return _mm256_fnmadd_ps(a, b, c); }
/* a > b ? a : b and a < b ? a : b lane by lane: b when either is NaN */
CA_SIMD_INLINE vf32 vf32_max(vf32 a, vf32 b) { return _mm256_max_ps(a, b); }
CA_SIMD_INLINE vf32 vf32_min(vf32 a, vf32 b) { return _mm256_min_ps(a, b); }
/* |x|, and x with the sign bit of y or-ed in */
CA_SIMD_INLINE vf32 vf32_abs(vf32 x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }
CA_SIMD_INLINE vf32 vf32_or_sign(vf32 x, vf32 y)
{
    return _mm256_or_ps(x, _mm256_and_ps(_mm256_set1_ps(-0.0f), y));
}
/* 2^n, where t = n + CA_ROUND_MAGIC_BIASED_F32 holds n's biased exponent in
   its low mantissa bits (see exp_poly.h) */
CA_SIMD_INLINE vf32 vf32_pow2_rounded(vf32 t)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(t), 23));
}

CA_SIMD_INLINE pf32 pf32_none(void) { return _mm256_setzero_ps(); }
CA_SIMD_INLINE pf32 vf32_unordered(vf32 a, vf32 b) { return _mm256_cmp_ps(a, b, _CMP_UNORD_Q); }
CA_SIMD_INLINE pf32 vf32_less(vf32 a, vf32 b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
/* x < lo, x > hi, or x NaN */
CA_SIMD_INLINE pf32 vf32_outside(vf32 x, vf32 lo, vf32 hi)
{
    return _mm256_or_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), _mm256_cmp_ps(x, hi, _CMP_NLE_UQ));
}
CA_SIMD_INLINE pf32 pf32_or(pf32 a, pf32 b) { return _mm256_or_ps(a, b); }
CA_SIMD_INLINE int pf32_any(pf32 p) { return _mm256_movemask_ps(p) != 0; }
/* p ? if_true : if_false lane by lane */
CA_SIMD_INLINE vf32 vf32_select(pf32 p, vf32 if_true, vf32 if_false)
{
    return _mm256_blendv_ps(if_false, if_true, p);
}

/* dots[l] = the sum of the lanes of a_l, each as the pairwise tree
   ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)) */
CA_SIMD_INLINE void vf32_sum4(vf32 a0, vf32 a1, vf32 a2, vf32 a3, float dots[4])
{
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    _mm_storeu_ps(dots, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}

/* The lanes reduced in registers, lane 0 ending with the result. Sum: the
   pairwise tree ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)): each
   step adds to every lane its neighbour at distance 1, 2, 4. Max: the same
   steps with max(neighbour above, lane), so that among equal lanes the
   lowest wins, as a scan that keeps the first of equal values (x holds no
   NaN). */
CA_SIMD_INLINE float vf32_sum_lanes(vf32 x)
{
    x = _mm256_add_ps(x, _mm256_permute_ps(x, 0xB1));
    x = _mm256_add_ps(x, _mm256_permute_ps(x, 0x4E));
    x = _mm256_add_ps(x, _mm256_permute2f128_ps(x, x, 0x01));
    return _mm256_cvtss_f32(x);
}
CA_SIMD_INLINE float vf32_max_lanes(vf32 x)
{
    x = vf32_max(_mm256_permute_ps(x, 0xB1), x);
    x = vf32_max(_mm256_permute_ps(x, 0x4E), x);
    x = vf32_max(_mm256_permute2f128_ps(x, x, 0x01), x);
    return _mm256_cvtss_f32(x);
}

/* CA_LANES_F32 float16 or int8 values, exactly as float32 lanes */
CA_SIMD_INLINE vf32 vf32_load_half(const uint16_t *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
/* the leading lanes m of them, the others 0. AVX2 has no 16-bit masked
   load: a partial vector goes through a zeroed copy, out of line, so that
   the common whole vector (the last of a row of 8k values) costs a load */
__attribute__((noinline)) CA_SIMD_TARGET static vf32 load_half_part(const uint16_t *p, int n)
{
    uint16_t lanes[CA_LANES_F32] = {0};
    for (int l = 0; l < n; ++l)
        lanes[l] = p[l];
    return vf32_load_half(lanes);
}
CA_SIMD_INLINE vf32 vf32_load_half_lanes(const uint16_t *p, mf32 m)
{
    const unsigned lanes = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(m));
    if (lanes == 0xFFu)
        return vf32_load_half(p);
    return load_half_part(p, __builtin_popcount(lanes));
}
/* bfloat16 values are the upper halves of float32 ones: widened and
   shifted, exactly */
CA_SIMD_INLINE vf32 vf32_load_bf16(const uint16_t *p)
{
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
__attribute__((noinline)) CA_SIMD_TARGET static vf32 load_bf16_part(const uint16_t *p, int n)
{
    uint16_t lanes[CA_LANES_F32] = {0};
    for (int l = 0; l < n; ++l)
        lanes[l] = p[l];
    return vf32_load_bf16(lanes);
}
CA_SIMD_INLINE vf32 vf32_load_bf16_lanes(const uint16_t *p, mf32 m)
{
    const unsigned lanes = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(m));
    if (lanes == 0xFFu)
        return vf32_load_bf16(p);
    return load_bf16_part(p, __builtin_popcount(lanes));
}
CA_SIMD_INLINE vf32 vf32_load_i8(const int8_t *p)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
/* fp8 codes (8 bytes) as float32 lanes, through binary16: an E5M2 code is
   the upper byte of a binary16, exactly. An E4M3FN code moved into a
   binary16 (sign kept, exponent and mantissa one bit lower) is its value
   times 2^-8 (the binary16 bias is 8 above E4M3FN's), subnormals
   included; its NaN codes (S.1111.111, which no finite value reaches
   above 448 = S.1111.110) are set to all ones, a NaN. */
CA_SIMD_INLINE __m128i fp8_codes_high(const uint8_t *p)
{
    return _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64((const __m128i *)p));
}
CA_SIMD_INLINE vf32 vf32_load_e5m2(const uint8_t *p)
{
    return _mm256_cvtph_ps(fp8_codes_high(p));
}
CA_SIMD_INLINE __m128i e4m3_as_half(const uint8_t *p)
{
    return _mm_and_si128(_mm_srai_epi16(fp8_codes_high(p), 1), _mm_set1_epi16((short)0xBFFF));
}
CA_SIMD_INLINE vf32 vf32_load_e4m3(const uint8_t *p)
{
    const __m128i half = e4m3_as_half(p);
    const __m128i nan = _mm_cmpgt_epi16(_mm_and_si128(half, _mm_set1_epi16(0x7FFF)),
                                        _mm_set1_epi16(0x3F00));
    return _mm256_cvtph_ps(_mm_or_si128(half, nan));
}
/* E4M3FN codes known to hold no NaN code as float32 lanes 2^-120 below
   their values (CA_E4M3_FINITE_UNIT), in three integer steps and no
   conversion: simd_avx512.h says how, and kernels_fp8.h when */
#define CA_E4M3_FINITE_UNIT 0x1p-120f
CA_SIMD_INLINE vf32 vf32_load_e4m3_finite(const uint8_t *p)
{
    const __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_castsi256_ps(
        _mm256_and_si256(_mm256_slli_epi32(wide, 20), _mm256_set1_epi32((int)0x87FFFFFF)));
}
/* whether this thread's arithmetic reads float32 subnormals as themselves
   (MXCSR.DAZ clear) */
CA_SIMD_INLINE int ca_subnormals_read(void)
{
    return (_mm_getcsr() & 0x0040u) == 0;
}
/* the leading lanes m of them, the others 0, through a zeroed copy: E5M2
   (format 0), E4M3FN (1), E4M3FN without NaN codes (2) */
__attribute__((noinline)) CA_SIMD_TARGET static vf32 load_fp8_part(const uint8_t *p, mf32 m,
                                                                   int format)
{
    uint8_t lanes[CA_LANES_F32] = {0};
    const int n = __builtin_popcount((unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(m)));
    for (int l = 0; l < n; ++l)
        lanes[l] = p[l];
    return format == 2 ? vf32_load_e4m3_finite(lanes)
         : format == 1 ? vf32_load_e4m3(lanes) : vf32_load_e5m2(lanes);
}
CA_SIMD_INLINE int all_lanes(mf32 m)
{
    return _mm256_movemask_ps(_mm256_castsi256_ps(m)) == 0xFF;
}
CA_SIMD_INLINE vf32 vf32_load_e5m2_lanes(const uint8_t *p, mf32 m)
{
    return all_lanes(m) ? vf32_load_e5m2(p) : load_fp8_part(p, m, 0);
}
CA_SIMD_INLINE vf32 vf32_load_e4m3_lanes(const uint8_t *p, mf32 m)
{
    return all_lanes(m) ? vf32_load_e4m3(p) : load_fp8_part(p, m, 1);
}
CA_SIMD_INLINE vf32 vf32_load_e4m3_finite_lanes(const uint8_t *p, mf32 m)
{
    return all_lanes(m) ? vf32_load_e4m3_finite(p) : load_fp8_part(p, m, 2);
}

/* rows r[0..8) of an 8 x 8 block become its columns */
CA_SIMD_INLINE void vf32_transpose(vf32 r[8])
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

/* ---- float64: the same operations ---- */

CA_SIMD_INLINE vf64 vf64_zero(void) { return _mm256_setzero_pd(); }
CA_SIMD_INLINE vf64 vf64_set1(double x) { return _mm256_set1_pd(x); }
CA_SIMD_INLINE vf64 vf64_load(const double *p) { return _mm256_loadu_pd(p); }
CA_SIMD_INLINE void vf64_store(double *p, vf64 x) { _mm256_storeu_pd(p, x); }
CA_SIMD_INLINE vf64 vf64_broadcast(const double *p) { return _mm256_broadcast_sd(p); }
CA_SIMD_INLINE mf64 vf64_lanes(ptrdiff_t n)
{
    return _mm256_cmpgt_epi64(_mm256_set1_epi64x(n), _mm256_setr_epi64x(0, 1, 2, 3));
}
CA_SIMD_INLINE vf64 vf64_load_lanes(const double *p, mf64 m) { return _mm256_maskload_pd(p, m); }

CA_SIMD_INLINE vf64 vf64_add(vf64 a, vf64 b) { return _mm256_add_pd(a, b); }
CA_SIMD_INLINE vf64 vf64_sub(vf64 a, vf64 b) { return _mm256_sub_pd(a, b); }
CA_SIMD_INLINE vf64 vf64_mul(vf64 a, vf64 b) { return _mm256_mul_pd(a, b); }
CA_SIMD_INLINE vf64 vf64_div(vf64 a, vf64 b) { return _mm256_div_pd(a, b); }
CA_SIMD_INLINE vf64 vf64_fmadd(vf64 a, vf64 b, vf64 c) { return _mm256_fmadd_pd(a, b, c); }
CA_SIMD_INLINE vf64 vf64_fnmadd(vf64 a, vf64 b, vf64 c) { return _mm256_fnmadd_pd(a, b, c); }
CA_SIMD_INLINE vf64 vf64_max(vf64 a, vf64 b) { return _mm256_max_pd(a, b); }
CA_SIMD_INLINE vf64 vf64_min(vf64 a, vf64 b) { return _mm256_min_pd(a, b); }
CA_SIMD_INLINE vf64 vf64_abs(vf64 x) { return _mm256_andnot_pd(_mm256_set1_pd(-0.0), x); }
CA_SIMD_INLINE vf64 vf64_pow2_rounded(vf64 t)
{
    return _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_castpd_si256(t), 52));
}

CA_SIMD_INLINE pf64 pf64_none(void) { return _mm256_setzero_pd(); }
CA_SIMD_INLINE pf64 vf64_unordered(vf64 a, vf64 b) { return _mm256_cmp_pd(a, b, _CMP_UNORD_Q); }
CA_SIMD_INLINE pf64 vf64_outside(vf64 x, vf64 lo, vf64 hi)
{
    return _mm256_or_pd(_mm256_cmp_pd(x, lo, _CMP_LT_OQ), _mm256_cmp_pd(x, hi, _CMP_NLE_UQ));
}
CA_SIMD_INLINE pf64 pf64_or(pf64 a, pf64 b) { return _mm256_or_pd(a, b); }
CA_SIMD_INLINE int pf64_any(pf64 p) { return _mm256_movemask_pd(p) != 0; }
CA_SIMD_INLINE vf64 vf64_select(pf64 p, vf64 if_true, vf64 if_false)
{
    return _mm256_blendv_pd(if_false, if_true, p);
}

/* pairwise (x0 + x1) + (x2 + x3) of each a_l */
CA_SIMD_INLINE void vf64_sum4(vf64 a0, vf64 a1, vf64 a2, vf64 a3, double dots[4])
{
    const __m256d t0 = _mm256_hadd_pd(a0, a1);
    const __m256d t1 = _mm256_hadd_pd(a2, a3);
    _mm256_storeu_pd(dots, _mm256_add_pd(_mm256_permute2f128_pd(t0, t1, 0x20),
                                         _mm256_permute2f128_pd(t0, t1, 0x31)));
}

/* as vf32_sum_lanes and vf32_max_lanes: neighbours at distance 1, 2 */
CA_SIMD_INLINE double vf64_sum_lanes(vf64 x)
{
    x = _mm256_add_pd(x, _mm256_permute_pd(x, 0x5));
    x = _mm256_add_pd(x, _mm256_permute2f128_pd(x, x, 0x01));
    return _mm256_cvtsd_f64(x);
}
CA_SIMD_INLINE double vf64_max_lanes(vf64 x)
{
    x = vf64_max(_mm256_permute_pd(x, 0x5), x);
    x = vf64_max(_mm256_permute2f128_pd(x, x, 0x01), x);
    return _mm256_cvtsd_f64(x);
}

#endif /* CATTENTION_SIMD_AVX2_H */
