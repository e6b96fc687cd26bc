/*
 * Scalar helpers shared by every kernel table and the driver.
 */
#ifndef CATTENTION_SCALAR_H
#define CATTENTION_SCALAR_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* x[j] = cap * tanh(x[j] / cap) in place, float64 (libm). */
void ca_softcap_f64(double *x, ptrdiff_t n, double cap);

/* IEEE binary16 to binary32, exact (subnormals, infinities and NaN kept). */
float ca_half_to_float(uint16_t h);

/* bfloat16 (the upper half of a binary32) to binary32, exact: a shift. */
float ca_bfloat16_to_float(uint16_t b);

/* The 8-bit float formats of fp8 K/V caches, as ml_dtypes names them:
   float8_e4m3fn (bias 7, no infinities, NaN at S.1111.111, largest 448)
   and float8_e5m2 (bias 15, IEEE-like: the upper byte of a binary16). */
enum { CA_FP8_E4M3FN = 0, CA_FP8_E5M2 = 1 };

/* An fp8 code of either format to binary32, exact (subnormals, the
   infinities of E5M2 and NaN kept). */
float ca_e4m3fn_to_float(uint8_t code);
float ca_e5m2_to_float(uint8_t code);

/* binary32 values divided by `divisor` (in binary32), saturated to the
   format's finite range (+-inf too; NaN stays NaN) and rounded to nearest
   even into fp8 codes of the format, bit for bit as ml_dtypes casts the
   saturated quotients: subnormals kept, -0 kept, a NaN becomes the NaN
   code of its sign (S.1111.111 for E4M3FN, S.11111.10 for E5M2). dst[i]
   for i < n. */
void ca_float_to_fp8(const float *src, uint8_t *dst, ptrdiff_t n, float divisor, int format);

/* binary32 to bfloat16, rounded to nearest even, bit for bit as ml_dtypes
   (Eigen) rounds: subnormals kept, a NaN becomes the quiet NaN of its sign
   (0x7FC0 or 0xFFC0). dst[i] for i < n. */
void ca_round_to_bfloat16(const float *src, uint16_t *dst, ptrdiff_t n);

/* The exclusive or of n words: a plain read of 8 n bytes, at the pace of
   the memory they come from (the benchmark's read loop: no kernel reads
   a cache faster). */
uint64_t ca_read_words(const uint64_t *words, size_t n);

#ifdef __cplusplus
}
#endif

#endif /* CATTENTION_SCALAR_H */
