/*
 * The AVX-512 table: the kernels of kernels_simd.h over the vocabulary of
 * simd_avx512.h (F, BW, DQ, VL).
 */
#include "kernels.h"

#if CA_HAVE_X86_KERNELS

#include "simd_avx512.h"
#include "kernels_simd.h"

CA_DEFINE_KERNEL_TABLE(ca_kernels_avx512, "avx512");

#endif /* CA_HAVE_X86_KERNELS */
