/*
 * e^x for the softmax, shared by every instruction set so that each computes
 * the same function: n = round(x / ln2), r = x - n ln2 (Cody-Waite: ln2 split
 * in a high part with few bits, so n * LN2_HI is exact), e^x = 2^n * p(r) with
 * |r| <= ln2 / 2.
 *
 * float:  degree-6 polynomial fitted for relative error, about 1 ulp after
 *         float rounding; p(0) == 1 exactly, so a row with one visible key
 *         returns that key's value unchanged.
 * double: Taylor series to degree 13 (truncation below 1e-17).
 *
 * Logits stay in natural units (scale * q.k, plus the additive mask): folding
 * log2(e) into the scale would round every logit once more, a systematic
 * relative error that the softmax multiplies by |x - max|.
 *
 * Inputs are clamped below where 2^n has no normal bits, so -inf (a masked
 * logit) gives exactly 0; NaN propagates.
 */
#ifndef CATTENTION_EXP_POLY_H
#define CATTENTION_EXP_POLY_H

#include <stdint.h>
#include <string.h>

#define CA_LOG2E_F32 1.44269504088896341f
#define CA_LN2_HI_F32 0.693359375f
#define CA_LN2_LO_F32 (-2.12194440e-4f)
#define CA_EXPF_C2 0.4999999403953552f
#define CA_EXPF_C3 0.1666652113199234f
#define CA_EXPF_C4 0.04166838899254799f
#define CA_EXPF_C5 0.008368710055947304f
#define CA_EXPF_C6 0.001381461275741458f
/* -127 ln2: below it 2^n would need n < -127, flushed to 0 (bits all zero) */
#define CA_EXPF_MIN (-88.0296919311f)
#define CA_EXPF_MAX (88.7f)
/* adding and subtracting 1.5 * 2^23 rounds a float of magnitude < 2^22 to
   the nearest integer under the default rounding mode */
#define CA_ROUND_MAGIC_F32 12582912.0f
/* The vector forms add 1.5 * 2^23 + 127 instead, in the fused multiply-add
   t = x log2(e) + magic: t - magic is the same n, and the low mantissa bits
   of t hold n + 127, the biased exponent of 2^n, so that one shift left by
   23 makes the bits of 2^n (the higher bits shift out). The odd 127 rounds a
   tie x log2(e) = k + 1/2 to the other neighbour, but the exact product of
   x and CA_LOG2E_F32 (an odd significand times a power of two) is a
   half-integer only for |x| >= 2^22, far outside the clamps; so both give
   the same bits. Not in the scalar form: there x * CA_LOG2E_F32 may be
   rounded before the addition, and the rounded product is a half-integer
   for some x (-17.675... is one). */
#define CA_ROUND_MAGIC_BIASED_F32 12583039.0f

#define CA_LOG2E_F64 1.44269504088896340736
#define CA_LN2_HI_F64 6.93147180369123816490e-01
#define CA_LN2_LO_F64 1.90821492927058770002e-10
#define CA_EXPD_MIN (-709.0895657128241) /* -1023 ln2, flushed to 0 like the float case */
#define CA_EXPD_MAX (709.0)
#define CA_ROUND_MAGIC_F64 6755399441055744.0 /* 1.5 * 2^52 */
/* 1.5 * 2^52 + 1023, as the float case (a fused half-integer needs
   |x| >= 2^50) */
#define CA_ROUND_MAGIC_BIASED_F64 6755399441056767.0

/* The float polynomial by degree, for the vector forms (Horner from the top) */
static const float ca_expf_coef[7] = {
    1.0f, 1.0f, CA_EXPF_C2, CA_EXPF_C3, CA_EXPF_C4, CA_EXPF_C5, CA_EXPF_C6,
};

/* 1 / k!, k = 0..13 */
static const double ca_expd_coef[14] = {
    1.0,
    1.0,
    0.5,
    0.16666666666666666,
    0.041666666666666664,
    0.008333333333333333,
    0.001388888888888889,
    0.0001984126984126984,
    2.48015873015873e-05,
    2.7557319223985893e-06,
    2.755731922398589e-07,
    2.505210838544172e-08,
    2.08767569878681e-09,
    1.6059043836821613e-10,
};

static inline uint32_t ca_f32_bits(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static inline float ca_f32_from_bits(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }
static inline uint64_t ca_f64_bits(double x) { uint64_t u; memcpy(&u, &x, 8); return u; }
static inline double ca_f64_from_bits(uint64_t u) { double x; memcpy(&x, &u, 8); return x; }

/* Scalar forms; the SIMD kernels take the same steps lane by lane (with FMA). */
static inline float ca_expf_scalar(float x)
{
    /* comparisons are false for NaN, which therefore passes through */
    x = x < CA_EXPF_MIN ? CA_EXPF_MIN : x;
    x = x > CA_EXPF_MAX ? CA_EXPF_MAX : x;
    float t = x * CA_LOG2E_F32 + CA_ROUND_MAGIC_F32;
    float n = t - CA_ROUND_MAGIC_F32;
    float r = x - n * CA_LN2_HI_F32;
    r = r - n * CA_LN2_LO_F32;
    float p = CA_EXPF_C6;
    p = p * r + CA_EXPF_C5;
    p = p * r + CA_EXPF_C4;
    p = p * r + CA_EXPF_C3;
    p = p * r + CA_EXPF_C2;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    /* the low mantissa bits of t hold n; unsigned arithmetic keeps NaN
       inputs free of undefined behaviour (p is NaN then anyway) */
    uint32_t e = (ca_f32_bits(t) - ca_f32_bits(CA_ROUND_MAGIC_F32) + 127u) << 23;
    return p * ca_f32_from_bits(e);
}

static inline double ca_expd_scalar(double x)
{
    x = x < CA_EXPD_MIN ? CA_EXPD_MIN : x;
    x = x > CA_EXPD_MAX ? CA_EXPD_MAX : x;
    double t = x * CA_LOG2E_F64 + CA_ROUND_MAGIC_F64;
    double n = t - CA_ROUND_MAGIC_F64;
    double r = x - n * CA_LN2_HI_F64;
    r = r - n * CA_LN2_LO_F64;
    double p = ca_expd_coef[13];
    for (int k = 12; k >= 0; --k)
        p = p * r + ca_expd_coef[k];
    uint64_t e = (ca_f64_bits(t) - ca_f64_bits(CA_ROUND_MAGIC_F64) + 1023u) << 52;
    return p * ca_f64_from_bits(e);
}

#endif /* CATTENTION_EXP_POLY_H */
