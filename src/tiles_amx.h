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

#define CA_AMX_TARGET \
    __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,avx512bf16," \
                          "amx-tile,amx-bf16")))

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
    _tile_loadconfig(&amx_config);
    amx_configured = 1;
}

CA_AMX_TARGET static void amx_release(void)
{
    if (!amx_configured)
        return;
    _tile_release();
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
