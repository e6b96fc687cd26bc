/* Constants of cattention's C-level API (cattention/cython_attention.pxd).
 *
 * Cython code that cimports the API compiles against this header:
 * include_dirs=[cattention.get_include()]. The functions themselves are
 * reached through the cimport (the extension's function-pointer table), so
 * nothing is linked against.
 */
#ifndef CATTENTION_H
#define CATTENTION_H

/* flags */
#define CATTENTION_CAUSAL 1            /* query i sees keys j <= i + (n_keys - n_queries) */

/* the fp8 formats of attention_f32_fp8's K and V (ml_dtypes' names) */
#define CATTENTION_FP8_E4M3FN 0        /* bias 7, no infinities, largest 448 */
#define CATTENTION_FP8_E5M2 1          /* bias 15, the upper byte of a binary16 */

/* status codes returned by attention_f32 / attention_f64 / attention_f32_fp8 */
#define CATTENTION_OK 0
#define CATTENTION_ERR_SIZE 1          /* a size is negative */
#define CATTENTION_ERR_POINTER 2       /* a required pointer is NULL */
#define CATTENTION_ERR_STRIDE 3        /* an output row stride is below its row length */
#define CATTENTION_ERR_SCALE 4         /* scale is NaN or infinite, or (attention_f32)
                                          nonzero and outside float's range */
#define CATTENTION_ERR_FLAGS 5         /* unknown flag bits */
#define CATTENTION_ERR_NO_MEMORY 6     /* scratch memory could not be allocated */
#define CATTENTION_ERR_FORMAT 7        /* an fp8 format other than the two above */

#endif
