/*
 * The AVX512-BF16 table (Zen 4, Cooper Lake, Sapphire Rapids and later):
 * the AVX-512 table, with bfloat16 q and K multiplied as they are by
 * VDPBF16PS (kernels_bf16.h); P.V of float32 weights, or at the medium
 * precision of P rounded to bfloat16, by VDPBF16PS.
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

static int pack_v_bf16(const uint16_t *v, ptrdiff_t ldv, ptrdiff_t n_keys, ptrdiff_t d_v,
                       uint16_t *v_packed, ptrdiff_t v_panel_stride)
{
    return bf16_pack_v_pairs(v, ldv, n_keys, d_v, v_packed, v_panel_stride, 2);
}

/* P.V by level: float32 weights (pv_f32) at the highest and high levels
   (two bfloat16 parts would be no faster: kernels_bf16.h), P rounded to
   bfloat16 at medium (the engines' numerics). */
#undef CA_BF16_TILE_ENTRIES
#define CA_BF16_TILE_ENTRIES \
        .bf16_k_align = 2, .pack_kt_bf16 = pack_kt_bf16, .score_bf16 = score_bf16_vdp, \
        .pack_v_bf16 = pack_v_bf16, .pv_bf16 = pv_bf16_vdp, .bf16_pv_parts = {0, 0, 1}, \
        .end_of_thread = NULL,

CA_DEFINE_KERNEL_TABLE(ca_kernels_avx512bf16, "avx512bf16");

#endif /* CA_HAVE_X86_KERNELS */
