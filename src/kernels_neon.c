/*
 * The aarch64 NEON table: the kernels of kernels_simd.h over the vocabulary
 * of simd_neon.h.
 */
#include "kernels.h"

#if CA_HAVE_NEON_KERNELS

#include "simd_neon.h"
#include "kernels_simd.h"

CA_DEFINE_KERNEL_TABLE(ca_kernels_neon, "neon");

#endif /* CA_HAVE_NEON_KERNELS */
