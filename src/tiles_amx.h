/*
 * The AMX vocabulary (Sapphire Rapids and later): the tile configuration of
 * a thread and the tiles' roles, read by the AMX kernels (kernels_amx.c)
 * beside the AVX-512 vocabulary they also use. A tile holds up to 16 rows
 * of 64 bytes; TDPBF16PS adds to a 16 x 16 float32 tile C the products of
 * A (16 rows of 32 bfloat16) and B (16 rows of 16 bfloat16 pairs): C[m][n]
 * += sum over k of A[m][2k] B[k][n][0] + A[m][2k+1] B[k][n][1], each
 * product exact and each addition rounded to nearest even in float32, in
 * order of k, with bfloat16 denormals read as 0 and float32 denormal sums
 * flushed to 0 (so a tile is a chain of fused multiply-adds).
 *
 * The process asks Linux for the tile state once (dispatch.c); each thread
 * loads the configuration before its first tile instruction of a call and
 * releases the tiles when it has done its part (end_of_thread), so an idle
 * thread does not keep 8 KiB of tile state in every context switch.
 */
#ifndef CATTENTION_TILES_AMX_H
#define CATTENTION_TILES_AMX_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* The tile instructions: the compiler's intrinsics where it has them (GCC
   11, clang 11 and later); for older compilers (GCC 10 builds the portable
   wheels, on glibc 2.17-era systems) their encodings, written as bytes, so
   the assembler need not know them either. The byte forms take the address
   in rax and the row stride in rcx (SIB: base rax, index rcx, scale 1); the
   tile numbers are constants (%c0 prints one without its '$'). */
#if defined(__clang__)
#define CA_AMX_INTRINSICS (__clang_major__ >= 11)
#elif defined(__GNUC__)
#define CA_AMX_INTRINSICS (__GNUC__ >= 11)
#else
#define CA_AMX_INTRINSICS 0
#endif

#if CA_AMX_INTRINSICS
#define CA_AMX_TARGET \
    __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,avx512bf16," \
                          "amx-tile,amx-bf16")))
#define amx_load_config(config) _tile_loadconfig(config)
#define amx_tile_release() _tile_release()
#define amx_tile_zero(tile) _tile_zero(tile)
#define amx_tile_load(tile, base, stride) _tile_loadd(tile, base, stride)
#define amx_tile_store(tile, base, stride) _tile_stored(tile, base, stride)
#define amx_tile_dpbf16ps(c, a, b) _tile_dpbf16ps(c, a, b)
#else
#define CA_AMX_TARGET \
    __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,avx512bf16")))
/* LDTILECFG [rax] */
#define amx_load_config(config) \
    __asm__ volatile(".byte 0xc4,0xe2,0x78,0x49,0x00" : : "a"(config) : "memory")
/* TILERELEASE */
#define amx_tile_release() __asm__ volatile(".byte 0xc4,0xe2,0x78,0x49,0xc0")
/* TILEZERO tmm */
#define amx_tile_zero(tile) __asm__ volatile(".byte 0xc4,0xe2,0x7b,0x49,0xc0+8*%c0" : : "i"(tile))
/* TILELOADD tmm, [rax + rcx] */
#define amx_tile_load(tile, base, stride) \
    __asm__ volatile(".byte 0xc4,0xe2,0x7b,0x4b,0x04+8*%c0,0x08" \
                     : \
                     : "i"(tile), "a"(base), "c"((ptrdiff_t)(stride)) \
                     : "memory")
/* TILESTORED [rax + rcx], tmm */
#define amx_tile_store(tile, base, stride) \
    __asm__ volatile(".byte 0xc4,0xe2,0x7a,0x4b,0x04+8*%c0,0x08" \
                     : \
                     : "i"(tile), "a"(base), "c"((ptrdiff_t)(stride)) \
                     : "memory")
/* TDPBF16PS tmm_c, tmm_a, tmm_b: c in ModRM.reg, a in ModRM.rm, b in VEX.vvvv
   (stored inverted: bits 6-3 of the third byte are 15 - b) */
#define amx_tile_dpbf16ps(c, a, b) \
    __asm__ volatile(".byte 0xc4,0xe2,0x7a-8*%c2,0x5c,0xc0+8*%c0+%c1" : : "i"(c), "i"(a), "i"(b))
#endif

/* palette 1: every tile of 16 rows x 64 bytes (the largest); tails are
   handled by zero rows and columns, so one configuration serves a call */
typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} ca_tile_config;

/* whether this thread has loaded the configuration (and so holds tile state) */
static __thread int amx_configured;

/* The configuration lives in constant memory, not on the stack: gcc's
   _tile_loadconfig tells the compiler it reads 8 bytes of its operand, so
   stores into a local configuration beyond them may be dropped as dead
   (leaving the rows and widths to whatever the stack held). */
static const ca_tile_config amx_config __attribute__((aligned(64))) = {
    .palette_id = 1,
    .bytes_per_row = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

CA_AMX_TARGET static inline void amx_configure(void)
{
    if (amx_configured)
        return;
    amx_load_config(&amx_config);
    amx_configured = 1;
}

CA_AMX_TARGET static void amx_release(void)
{
    if (!amx_configured)
        return;
    amx_tile_release();
    amx_configured = 0;
}

/* tile registers by role (TDPBF16PS takes their numbers as constants) */
#define AMX_C0 0
#define AMX_C1 1
#define AMX_C2 2
#define AMX_C3 3
#define AMX_A0 4
#define AMX_A1 5
#define AMX_A2 6
#define AMX_B 7

#endif /* CATTENTION_TILES_AMX_H */
