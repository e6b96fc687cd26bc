/*
 * The AVX512-BF16 table (Zen 4, Cooper Lake, Sapphire Rapids and later):
 * the AVX-512 table, with bfloat16 q and K multiplied as they are by
 * VDPBF16PS (kernels_bf16.h); V and P.V stay float32.
 */
#include "kernels.h"

#if CA_HAVE_X86_KERNELS

#include "simd_avx512.h"
#include "kernels_simd.h"
#define CA_WITH_VDPBF16PS
#include "kernels_bf16.h"

static void pack_kt_bf16(const uint16_t *k, ptrdiff_t ldk, ptrdiff_t n_keys, ptrdiff_t d_k,
                         uint16_t *kt, ptrdiff_t kt_panel_stride)
{
    bf16_pack_kt_aligned(k, ldk, n_keys, d_k, kt, kt_panel_stride, 2);
}

#undef CA_BF16_TILE_ENTRIES
#define CA_BF16_TILE_ENTRIES \
        .bf16_k_align = 2, .pack_kt_bf16 = pack_kt_bf16, .score_bf16 = score_bf16_vdp, \
        .pack_v_bf16 = NULL, .pv_bf16 = NULL, .end_of_thread = NULL,

CA_DEFINE_KERNEL_TABLE(ca_kernels_avx512bf16, "avx512bf16");

#endif /* CA_HAVE_X86_KERNELS */
