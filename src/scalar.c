/* The scalar helpers of scalar.h. */
#include <math.h>
#include <string.h>

#include "exp_poly.h"
#include "scalar.h"

void ca_softcap_f64(double *x, ptrdiff_t n, double cap)
{
    for (ptrdiff_t j = 0; j < n; ++j)
        x[j] = cap * tanh(x[j] / cap);
}

float ca_bfloat16_to_float(uint16_t b)
{
    return ca_f32_from_bits((uint32_t)b << 16);
}

void ca_round_to_bfloat16(const float *src, uint16_t *dst, ptrdiff_t n)
{
    /* branch-free, so that the compiler vectorises it: the rounding is
       memory-bound, where NumPy's cast through ml_dtypes takes a few
       nanoseconds an element */
    for (ptrdiff_t i = 0; i < n; ++i) {
        uint32_t bits;
        memcpy(&bits, src + i, 4);
        const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
        const uint32_t quiet_nan = ((bits >> 16) & 0x8000u) | 0x7FC0u;
        dst[i] = (uint16_t)((bits & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded);
    }
}

float ca_half_to_float(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1fu;
    uint32_t mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0x1fu) {
        bits = sign | 0x7f800000u | (mantissa << 13);      /* inf, NaN */
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;                                        /* +-0 */
    } else {
        /* subnormal half: normalise (its value is mantissa * 2^-24) */
        uint32_t shift = 0;
        while ((mantissa & 0x400u) == 0) {
            mantissa <<= 1;
            ++shift;
        }
        bits = sign | ((113u - shift) << 23) | ((mantissa & 0x3ffu) << 13);
    }
    return ca_f32_from_bits(bits);
}

float ca_e4m3fn_to_float(uint8_t code)
{
    const uint32_t sign = (uint32_t)(code & 0x80u) << 24;
    const uint32_t exponent = (code >> 3) & 0xfu;
    const uint32_t mantissa = code & 0x7u;
    if ((code & 0x7fu) == 0x7fu)
        return ca_f32_from_bits(sign | 0x7fc00000u);           /* NaN */
    if (exponent == 0) {
        /* subnormal (or zero): mantissa * 2^-9, exact in binary32 */
        const float magnitude = (float)mantissa * 0x1p-9f;
        return sign ? -magnitude : magnitude;
    }
    return ca_f32_from_bits(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

float ca_e5m2_to_float(uint8_t code)
{
    return ca_half_to_float((uint16_t)(code << 8));
}

void ca_float_to_fp8(const float *src, uint8_t *dst, ptrdiff_t n, float divisor, int format)
{
    const int e4m3 = format == CA_FP8_E4M3FN;
    const float largest = e4m3 ? 448.0f : 57344.0f;
    const uint32_t mantissa_bits = e4m3 ? 3u : 2u, bias = e4m3 ? 7u : 15u;
    const uint32_t nan_code = e4m3 ? 0x7fu : 0x7eu;
    const uint32_t drop = 23u - mantissa_bits;
    /* below the smallest normal (2^(1 - bias)) the codes step by the
       subnormal quantum 2^(1 - bias - mantissa_bits): adding a float whose
       unit in the last place is that quantum rounds to nearest even in the
       hardware, and the low bits left are the code */
    const uint32_t smallest_normal = (128u - bias) << 23;
    const uint32_t subnormal_magic = (127u - bias + drop + 1u) << 23;
    for (ptrdiff_t i = 0; i < n; ++i) {
        float value = src[i] / divisor;
        /* saturated (a NaN fails both tests and stays) */
        if (value > largest)
            value = largest;
        else if (value < -largest)
            value = -largest;
        uint32_t bits;
        memcpy(&bits, &value, sizeof bits);
        const uint32_t sign = (bits >> 24) & 0x80u;
        uint32_t magnitude = bits & 0x7fffffffu;
        uint32_t code;
        if (magnitude > 0x7f800000u) {
            code = nan_code;
        } else if (magnitude < smallest_normal) {
            const float sum = ca_f32_from_bits(magnitude) + ca_f32_from_bits(subnormal_magic);
            uint32_t sum_bits;
            memcpy(&sum_bits, &sum, sizeof sum_bits);
            code = sum_bits - subnormal_magic;
        } else {
            /* rebias the exponent, then round the dropped bits to nearest
               even: add half a step less one, plus the kept bit's parity */
            const uint32_t odd = (magnitude >> drop) & 1u;
            magnitude += ((bias - 127u) << 23) + (1u << (drop - 1u)) - 1u + odd;
            code = magnitude >> drop;
        }
        dst[i] = (uint8_t)(sign | code);
    }
}

uint64_t ca_read_words(const uint64_t *words, size_t n)
{
    /* eight independent lanes of sums, so that no chain of additions
       bounds the loop and the compiler vectorises it */
    uint64_t lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; ++l)
            lanes[l] ^= words[i + l];
    for (; i < n; ++i)
        lanes[0] ^= words[i];
    uint64_t total = 0;
    for (int l = 0; l < 8; ++l)
        total ^= lanes[l];
    return total;
}
