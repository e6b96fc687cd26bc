/*
 * The SIMD vocabulary of aarch64 Advanced SIMD (NEON), read by the kernels
 * in kernels_simd.h. NEON is part of the aarch64 base instruction set, so
 * no target attribute is needed. The names and their meaning are those of
 * simd_avx2.h; where NEON's instructions mean something else (FMAX/FMIN on
 * NaN and signed zero), the mapping spells out the x86 meaning so that
 * every table computes the same numbers. NEON has no masked loads: a
 * partial vector is gathered lane by lane (only at row tails).
 */
#ifndef CATTENTION_SIMD_NEON_H
#define CATTENTION_SIMD_NEON_H

#include <arm_neon.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "exp_poly.h"

#define CA_SIMD_TARGET

/* 32 registers of 4 floats: 6 rows times one panel (4 vectors) keeps 24
   accumulators, the panel's 4 vectors and a broadcast in registers. */
#define CA_TILE_ROWS 6
#define CA_TILE_VECS 4
/* Decode (score_direct): rows keep no query features in registers across
   a call (0, 0: the kernel's general loop; holding them was measured on
   x86 cores only) */
#define CA_DIRECT_ROW_VECS 0
#define CA_DIRECT_PAIR_VECS 0

#define CA_LANES_F32 4
#define CA_LANES_F64 2

typedef float32x4_t vf32;
typedef ptrdiff_t mf32;         /* how many leading lanes */
typedef uint32x4_t pf32;
typedef float64x2_t vf64;
typedef ptrdiff_t mf64;
typedef uint64x2_t pf64;

#define CA_SIMD_INLINE static inline __attribute__((always_inline))

/* ---- float32 ---- */

CA_SIMD_INLINE vf32 vf32_zero(void) { return vdupq_n_f32(0.0f); }
CA_SIMD_INLINE vf32 vf32_set1(float x) { return vdupq_n_f32(x); }
CA_SIMD_INLINE vf32 vf32_load(const float *p) { return vld1q_f32(p); }
CA_SIMD_INLINE void vf32_store(float *p, vf32 x) { vst1q_f32(p, x); }
CA_SIMD_INLINE vf32 vf32_broadcast(const float *p) { return vld1q_dup_f32(p); }
CA_SIMD_INLINE mf32 vf32_lanes(ptrdiff_t n) { return n; }
CA_SIMD_INLINE vf32 vf32_load_lanes(const float *p, mf32 n)
{
    float lanes[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (ptrdiff_t l = 0; l < n; ++l)
        lanes[l] = p[l];
    return vld1q_f32(lanes);
}

CA_SIMD_INLINE vf32 vf32_add(vf32 a, vf32 b) { return vaddq_f32(a, b); }
CA_SIMD_INLINE vf32 vf32_sub(vf32 a, vf32 b) { return vsubq_f32(a, b); }
CA_SIMD_INLINE vf32 vf32_mul(vf32 a, vf32 b) { return vmulq_f32(a, b); }
CA_SIMD_INLINE vf32 vf32_div(vf32 a, vf32 b) { return vdivq_f32(a, b); }
CA_SIMD_INLINE vf32 vf32_fmadd(vf32 a, vf32 b, vf32 c) { return vfmaq_f32(c, a, b); }
CA_SIMD_INLINE vf32 vf32_fnmadd(vf32 a, vf32 b, vf32 c) { return vfmsq_f32(c, a, b); }
/* a > b ? a : b (FMAX would return NaN for a NaN b, and +0 for (-0, +0)) */
CA_SIMD_INLINE vf32 vf32_max(vf32 a, vf32 b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
CA_SIMD_INLINE vf32 vf32_min(vf32 a, vf32 b) { return vbslq_f32(vcltq_f32(a, b), a, b); }
CA_SIMD_INLINE vf32 vf32_abs(vf32 x) { return vabsq_f32(x); }
CA_SIMD_INLINE vf32 vf32_or_sign(vf32 x, vf32 y)
{
    const uint32x4_t sign = vandq_u32(vreinterpretq_u32_f32(y), vdupq_n_u32(0x80000000u));
    return vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(x), sign));
}
CA_SIMD_INLINE vf32 vf32_pow2_rounded(vf32 t)
{
    return vreinterpretq_f32_u32(vshlq_n_u32(vreinterpretq_u32_f32(t), 23));
}

CA_SIMD_INLINE pf32 pf32_none(void) { return vdupq_n_u32(0); }
CA_SIMD_INLINE pf32 vf32_unordered(vf32 a, vf32 b)
{
    return vmvnq_u32(vandq_u32(vceqq_f32(a, a), vceqq_f32(b, b)));
}
CA_SIMD_INLINE pf32 vf32_less(vf32 a, vf32 b) { return vcltq_f32(a, b); }
/* x < lo, x > hi, or x NaN (neither comparison holds for a NaN) */
CA_SIMD_INLINE pf32 vf32_outside(vf32 x, vf32 lo, vf32 hi)
{
    return vmvnq_u32(vandq_u32(vcgeq_f32(x, lo), vcleq_f32(x, hi)));
}
CA_SIMD_INLINE pf32 pf32_or(pf32 a, pf32 b) { return vorrq_u32(a, b); }
CA_SIMD_INLINE int pf32_any(pf32 p) { return vmaxvq_u32(p) != 0; }
CA_SIMD_INLINE vf32 vf32_select(pf32 p, vf32 if_true, vf32 if_false)
{
    return vbslq_f32(p, if_true, if_false);
}

/* pairwise adds are the tree (x0 + x1) + (x2 + x3) */
CA_SIMD_INLINE void vf32_sum4(vf32 a0, vf32 a1, vf32 a2, vf32 a3, float dots[4])
{
    vst1q_f32(dots, vpaddq_f32(vpaddq_f32(a0, a1), vpaddq_f32(a2, a3)));
}

/* The lanes reduced: the sum as the pairwise tree (x0 + x1) + (x2 + x3);
   the max as a scan that keeps the first of equal lanes (x holds no NaN) */
CA_SIMD_INLINE float vf32_sum_lanes(vf32 x)
{
    const float32x2_t pairs = vpadd_f32(vget_low_f32(x), vget_high_f32(x));
    return vget_lane_f32(pairs, 0) + vget_lane_f32(pairs, 1);
}
CA_SIMD_INLINE float vf32_max_lanes(vf32 x)
{
    float m = vgetq_lane_f32(x, 0);
    m = vgetq_lane_f32(x, 1) > m ? vgetq_lane_f32(x, 1) : m;
    m = vgetq_lane_f32(x, 2) > m ? vgetq_lane_f32(x, 2) : m;
    return vgetq_lane_f32(x, 3) > m ? vgetq_lane_f32(x, 3) : m;
}

CA_SIMD_INLINE vf32 vf32_load_half(const uint16_t *p)
{
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
}
/* the leading n of them, the others 0 */
CA_SIMD_INLINE vf32 vf32_load_half_lanes(const uint16_t *p, mf32 n)
{
    if (n == 4)
        return vf32_load_half(p);
    uint16_t lanes[4] = {0, 0, 0, 0};
    for (ptrdiff_t l = 0; l < n; ++l)
        lanes[l] = p[l];
    return vf32_load_half(lanes);
}
/* bfloat16 values are the upper halves of float32 ones: widened and
   shifted, exactly */
CA_SIMD_INLINE vf32 vf32_load_bf16(const uint16_t *p)
{
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
}
CA_SIMD_INLINE vf32 vf32_load_bf16_lanes(const uint16_t *p, mf32 n)
{
    if (n == 4)
        return vf32_load_bf16(p);
    uint16_t lanes[4] = {0, 0, 0, 0};
    for (ptrdiff_t l = 0; l < n; ++l)
        lanes[l] = p[l];
    return vf32_load_bf16(lanes);
}
/* fp8 codes (4 bytes) as float32 lanes, through binary16 (see
   simd_avx2.h: E5M2 exactly, E4M3FN as 2^-8 times its value, NaN codes
   NaN); the _lanes forms read the leading n and give 0 for the others */
CA_SIMD_INLINE uint16x4_t fp8_codes_high(const uint8_t *p)
{
    uint32_t word;
    memcpy(&word, p, 4);
    return vget_low_u16(vshll_n_u8(vreinterpret_u8_u32(vdup_n_u32(word)), 8));
}
CA_SIMD_INLINE vf32 vf32_load_e5m2(const uint8_t *p)
{
    return vcvt_f32_f16(vreinterpret_f16_u16(fp8_codes_high(p)));
}
CA_SIMD_INLINE uint16x4_t e4m3_as_half(const uint8_t *p)
{
    return vand_u16(vreinterpret_u16_s16(vshr_n_s16(vreinterpret_s16_u16(fp8_codes_high(p)), 1)),
                    vdup_n_u16(0xBFFF));
}
/* codes known to hold no NaN code: half the work */
CA_SIMD_INLINE vf32 vf32_load_e4m3_finite(const uint8_t *p)
{
    return vcvt_f32_f16(vreinterpret_f16_u16(e4m3_as_half(p)));
}
CA_SIMD_INLINE vf32 vf32_load_e4m3(const uint8_t *p)
{
    const uint16x4_t half = e4m3_as_half(p);
    const uint16x4_t nan = vcgt_u16(vand_u16(half, vdup_n_u16(0x7FFF)), vdup_n_u16(0x3F00));
    return vcvt_f32_f16(vreinterpret_f16_u16(vorr_u16(half, nan)));
}
CA_SIMD_INLINE vf32 load_fp8_lanes(const uint8_t *p, mf32 n, int e4m3)
{
    uint8_t lanes[4] = {0, 0, 0, 0};
    const uint8_t *codes = p;
    if (n < 4) {
        for (ptrdiff_t l = 0; l < n; ++l)
            lanes[l] = p[l];
        codes = lanes;
    }
    return e4m3 ? vf32_load_e4m3(codes) : vf32_load_e5m2(codes);
}
CA_SIMD_INLINE vf32 vf32_load_e5m2_lanes(const uint8_t *p, mf32 n)
{
    return load_fp8_lanes(p, n, 0);
}
CA_SIMD_INLINE vf32 vf32_load_e4m3_lanes(const uint8_t *p, mf32 n)
{
    return load_fp8_lanes(p, n, 1);
}
CA_SIMD_INLINE vf32 vf32_load_i8(const int8_t *p)
{
    int32_t word;
    memcpy(&word, p, 4);
    const int16x8_t wide = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(word)));
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(wide)));
}

/* rows r[0..4) of a 4 x 4 block become its columns */
CA_SIMD_INLINE void vf32_transpose(vf32 r[4])
{
    const float64x2_t t0 = vreinterpretq_f64_f32(vtrn1q_f32(r[0], r[1]));
    const float64x2_t t1 = vreinterpretq_f64_f32(vtrn2q_f32(r[0], r[1]));
    const float64x2_t t2 = vreinterpretq_f64_f32(vtrn1q_f32(r[2], r[3]));
    const float64x2_t t3 = vreinterpretq_f64_f32(vtrn2q_f32(r[2], r[3]));
    r[0] = vreinterpretq_f32_f64(vtrn1q_f64(t0, t2));
    r[1] = vreinterpretq_f32_f64(vtrn1q_f64(t1, t3));
    r[2] = vreinterpretq_f32_f64(vtrn2q_f64(t0, t2));
    r[3] = vreinterpretq_f32_f64(vtrn2q_f64(t1, t3));
}

/* ---- float64 ---- */

CA_SIMD_INLINE vf64 vf64_zero(void) { return vdupq_n_f64(0.0); }
CA_SIMD_INLINE vf64 vf64_set1(double x) { return vdupq_n_f64(x); }
CA_SIMD_INLINE vf64 vf64_load(const double *p) { return vld1q_f64(p); }
CA_SIMD_INLINE void vf64_store(double *p, vf64 x) { vst1q_f64(p, x); }
CA_SIMD_INLINE vf64 vf64_broadcast(const double *p) { return vld1q_dup_f64(p); }
CA_SIMD_INLINE mf64 vf64_lanes(ptrdiff_t n) { return n; }
CA_SIMD_INLINE vf64 vf64_load_lanes(const double *p, mf64 n)
{
    double lanes[2] = {0.0, 0.0};
    for (ptrdiff_t l = 0; l < n; ++l)
        lanes[l] = p[l];
    return vld1q_f64(lanes);
}

CA_SIMD_INLINE vf64 vf64_add(vf64 a, vf64 b) { return vaddq_f64(a, b); }
CA_SIMD_INLINE vf64 vf64_sub(vf64 a, vf64 b) { return vsubq_f64(a, b); }
CA_SIMD_INLINE vf64 vf64_mul(vf64 a, vf64 b) { return vmulq_f64(a, b); }
CA_SIMD_INLINE vf64 vf64_div(vf64 a, vf64 b) { return vdivq_f64(a, b); }
CA_SIMD_INLINE vf64 vf64_fmadd(vf64 a, vf64 b, vf64 c) { return vfmaq_f64(c, a, b); }
CA_SIMD_INLINE vf64 vf64_fnmadd(vf64 a, vf64 b, vf64 c) { return vfmsq_f64(c, a, b); }
CA_SIMD_INLINE vf64 vf64_max(vf64 a, vf64 b) { return vbslq_f64(vcgtq_f64(a, b), a, b); }
CA_SIMD_INLINE vf64 vf64_min(vf64 a, vf64 b) { return vbslq_f64(vcltq_f64(a, b), a, b); }
CA_SIMD_INLINE vf64 vf64_abs(vf64 x) { return vabsq_f64(x); }
CA_SIMD_INLINE vf64 vf64_pow2_rounded(vf64 t)
{
    return vreinterpretq_f64_u64(vshlq_n_u64(vreinterpretq_u64_f64(t), 52));
}

CA_SIMD_INLINE pf64 pf64_none(void) { return vdupq_n_u64(0); }
CA_SIMD_INLINE pf64 vf64_unordered(vf64 a, vf64 b)
{
    const uint64x2_t ordered = vandq_u64(vceqq_f64(a, a), vceqq_f64(b, b));
    return veorq_u64(ordered, vdupq_n_u64(~(uint64_t)0));
}
CA_SIMD_INLINE pf64 vf64_outside(vf64 x, vf64 lo, vf64 hi)
{
    const uint64x2_t within = vandq_u64(vcgeq_f64(x, lo), vcleq_f64(x, hi));
    return veorq_u64(within, vdupq_n_u64(~(uint64_t)0));
}
CA_SIMD_INLINE vf64 vf64_select(pf64 p, vf64 if_true, vf64 if_false)
{
    return vbslq_f64(p, if_true, if_false);
}
CA_SIMD_INLINE pf64 pf64_or(pf64 a, pf64 b) { return vorrq_u64(a, b); }
CA_SIMD_INLINE int pf64_any(pf64 p) { return vmaxvq_u32(vreinterpretq_u32_u64(p)) != 0; }

CA_SIMD_INLINE void vf64_sum4(vf64 a0, vf64 a1, vf64 a2, vf64 a3, double dots[4])
{
    vst1q_f64(dots, vpaddq_f64(a0, a1));
    vst1q_f64(dots + 2, vpaddq_f64(a2, a3));
}

CA_SIMD_INLINE double vf64_sum_lanes(vf64 x) { return vpaddd_f64(x); }
CA_SIMD_INLINE double vf64_max_lanes(vf64 x)
{
    const double x0 = vgetq_lane_f64(x, 0), x1 = vgetq_lane_f64(x, 1);
    return x1 > x0 ? x1 : x0;
}

#endif /* CATTENTION_SIMD_NEON_H */
