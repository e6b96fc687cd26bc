/*
 * What the kernel image needs beside the kernels (tests/x86_emulator.py):
 * the C library functions the compiler or dispatch.c may call (the guest
 * has no environment, so getenv finds nothing), and where each entry of a
 * kernel table lies, so that the harness finds them without knowing the
 * struct's layout.
 */
#include <cpuid.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

void *memcpy(void *dst, const void *src, size_t n)
{
    unsigned char *d = dst;
    const unsigned char *s = src;
    while (n--)
        *d++ = *s++;
    return dst;
}

void *memmove(void *dst, const void *src, size_t n)
{
    unsigned char *d = dst;
    const unsigned char *s = src;
    if (d < s)
        while (n--)
            *d++ = *s++;
    else
        while (n--)
            d[n] = s[n];
    return dst;
}

void *memset(void *dst, int value, size_t n)
{
    unsigned char *d = dst;
    while (n--)
        *d++ = (unsigned char)value;
    return dst;
}

int strcmp(const char *a, const char *b)
{
    while (*a && *a == *b)
        ++a, ++b;
    return (unsigned char)*a - (unsigned char)*b;
}

char *getenv(const char *name)
{
    (void)name;
    return NULL;
}

/* the guest has no kernel: a system call (dispatch.c's request for AMX's
   tile state) is refused */
long syscall(long number, ...)
{
    (void)number;
    return -1;
}

/* CPUID leaf 7 ECX of the emulated CPU: the harness checks that the model
   is the one it asked for (Skylake-X has no AVX512_VBMI, ECX bit 1) */
uint32_t ca_image_cpuid7_ecx(void)
{
    unsigned eax, ebx, ecx, edx;
    __cpuid_count(7, 0, eax, ebx, ecx, edx);
    (void)eax, (void)ebx, (void)edx;
    return ecx;
}

/* byte offsets of the entries, in the order of x86_emulator.FIELDS */
const int64_t ca_image_fields[] = {
    offsetof(ca_kernels, score_f32), offsetof(ca_kernels, score_f64),
    offsetof(ca_kernels, pv_f32), offsetof(ca_kernels, pv_f64),
    offsetof(ca_kernels, row_max_f32), offsetof(ca_kernels, row_max_f64),
    offsetof(ca_kernels, exp_sum_f32), offsetof(ca_kernels, exp_sum_f64),
    offsetof(ca_kernels, score_direct_f32), offsetof(ca_kernels, score_direct_f64),
    offsetof(ca_kernels, pv_direct_f32), offsetof(ca_kernels, pv_direct_f64),
    offsetof(ca_kernels, half_rows_to_f32), offsetof(ca_kernels, softcap_f32),
    offsetof(ca_kernels, pack_kt_f32), offsetof(ca_kernels, pack_v_f32),
    offsetof(ca_kernels, int8_rows_to_f32), offsetof(ca_kernels, score_direct_i8),
    offsetof(ca_kernels, pv_direct_i8), offsetof(ca_kernels, tile_rows),
    offsetof(ca_kernels, tile_cols_f32), offsetof(ca_kernels, tile_cols_f64),
    offsetof(ca_kernels, score_direct_f16), offsetof(ca_kernels, pv_direct_f16),
    offsetof(ca_kernels, divide_rows_f32), offsetof(ca_kernels, divide_rows_f64),
    offsetof(ca_kernels, bf16_rows_to_f32), offsetof(ca_kernels, score_direct_bf16),
    offsetof(ca_kernels, pv_direct_bf16), offsetof(ca_kernels, fp8_rows_to_f32),
    offsetof(ca_kernels, score_direct_fp8), offsetof(ca_kernels, pv_direct_fp8),
};
