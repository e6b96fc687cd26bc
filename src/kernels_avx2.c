/*
 * The AVX2 + FMA (+ F16C) table: the kernels of kernels_simd.h over the
 * vocabulary of simd_avx2.h (Haswell and later, Zen and later).
 */
#include "kernels.h"

#if CA_HAVE_X86_KERNELS

#include "simd_avx2.h"
#include "kernels_simd.h"

CA_DEFINE_KERNEL_TABLE(ca_kernels_avx2, "avx2");

#endif /* CA_HAVE_X86_KERNELS */
