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

/* binary32 to bfloat16, rounded to nearest even, bit for bit as ml_dtypes
   (Eigen) rounds: subnormals kept, a NaN becomes the quiet NaN of its sign
   (0x7FC0 or 0xFFC0). dst[i] for i < n. */
void ca_round_to_bfloat16(const float *src, uint16_t *dst, ptrdiff_t n);

#ifdef __cplusplus
}
#endif

#endif /* CATTENTION_SCALAR_H */
