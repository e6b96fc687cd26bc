/*
 * Runtime choice of the kernel table: CPUID says what the CPU decodes, XGETBV
 * says whether the OS saves the wider registers on a context switch; both must
 * hold before a SIMD table is used (on aarch64, NEON is part of the base
 * instruction set). CATTENTION_SIMD=<name> asks for a table by
 * name (an unknown or unsupported name falls back to the best one; the Python
 * layer reports which table is in use).
 *
 * All tables compiled in are listed once, in `registry`, each with the check
 * that says whether this CPU runs it; adding an instruction set adds a line
 * there.
 */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if CA_HAVE_X86_KERNELS
#if defined(_MSC_VER)
#include <intrin.h>
#else
#include <cpuid.h>
#endif

static void cpuid_count(unsigned leaf, unsigned sub, unsigned regs[4])
{
#if defined(_MSC_VER)
    int r[4];
    __cpuidex(r, (int)leaf, (int)sub);
    for (int i = 0; i < 4; ++i)
        regs[i] = (unsigned)r[i];
#else
    __cpuid_count(leaf, sub, regs[0], regs[1], regs[2], regs[3]);
#endif
}

static unsigned long long xgetbv0(void)
{
#if defined(_MSC_VER)
    return _xgetbv(0);
#else
    unsigned eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((unsigned long long)edx << 32) | eax;
#endif
}

/* XCR0: the register state the OS saves, so that a thread may use it */
#define XCR0_XMM_YMM 0x6ull         /* bits 1-2: SSE, AVX */
#define XCR0_ZMM 0xe0ull            /* bits 5-7: opmask, ZMM_Hi256, Hi16_ZMM */
#define XCR0_TILE 0x60000ull        /* bits 17-18: tile configuration, tile data */

static int cpu_has_avx2_fma(void) /* and F16C, which every AVX2 CPU has */
{
    unsigned regs[4];
    cpuid_count(0, 0, regs);
    if (regs[0] < 7)
        return 0;
    cpuid_count(1, 0, regs);
    const int has_fma = (regs[2] >> 12) & 1;
    const int has_osxsave = (regs[2] >> 27) & 1;
    const int has_avx = (regs[2] >> 28) & 1;
    const int has_f16c = (regs[2] >> 29) & 1;
    if (!(has_fma && has_osxsave && has_avx && has_f16c))
        return 0;
    if ((xgetbv0() & XCR0_XMM_YMM) != XCR0_XMM_YMM)
        return 0;
    cpuid_count(7, 0, regs);
    return (regs[1] >> 5) & 1; /* EBX bit 5: AVX2 */
}

/* AVX-512 F, DQ, BW and VL (Skylake-SP and later, Zen 4 and later), on
   top of AVX2, with the opmask and ZMM state enabled by the OS */
static int cpu_has_avx512(void)
{
    if (!cpu_has_avx2_fma())
        return 0;
    if ((xgetbv0() & (XCR0_XMM_YMM | XCR0_ZMM)) != (XCR0_XMM_YMM | XCR0_ZMM))
        return 0;
    unsigned regs[4];
    cpuid_count(7, 0, regs);
    /* EBX bits 16 F, 17 DQ, 30 BW, 31 VL */
    const unsigned needed = (1u << 16) | (1u << 17) | (1u << 30) | (1u << 31);
    return (regs[1] & needed) == needed;
}
/* AVX512-BF16 (VDPBF16PS) on top of AVX-512: CPUID leaf 7, subleaf 1, EAX
   bit 5 */
static int cpu_has_avx512_bf16(void)
{
    if (!cpu_has_avx512())
        return 0;
    unsigned regs[4];
    cpuid_count(0, 0, regs);
    if (regs[0] < 7)
        return 0;
    cpuid_count(7, 1, regs);
    return (regs[0] >> 5) & 1;
}

/* Why the AMX table is not in use ("" when it is usable), for show_config */
static const char *amx_refusal = "";

/* AMX-TILE and AMX-BF16 (CPUID leaf 7 EDX bits 24 and 22) on top of
   AVX512-BF16, the tile state enabled by the OS (XCR0), and Linux's leave
   to use it: the process asks once (arch_prctl ARCH_REQ_XCOMP_PERM for
   XFEATURE_XTILEDATA); without it the first tile instruction would kill the
   process. The answer is kept. */
static int cpu_has_amx(void)
{
    static int answer = -1;
    if (answer >= 0)
        return answer;
    answer = 0;
    unsigned regs[4];
    if (!cpu_has_avx512_bf16()) {
        amx_refusal = "this CPU has no AVX512-BF16";
        return answer;
    }
    cpuid_count(7, 0, regs);
    if (!((regs[3] >> 24) & 1) || !((regs[3] >> 22) & 1)) {
        amx_refusal = "this CPU has no AMX-BF16";
        return answer;
    }
    if ((xgetbv0() & XCR0_TILE) != XCR0_TILE) {
        amx_refusal = "the operating system does not enable the tile state (XCR0)";
        return answer;
    }
#if defined(__linux__) && defined(SYS_arch_prctl)
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
        amx_refusal = "Linux refused the tile state (arch_prctl ARCH_REQ_XCOMP_PERM)";
        return answer;
    }
    answer = 1;
#else
    amx_refusal = "asking for the tile state is only implemented for Linux";
#endif
    return answer;
}
#endif

const char *ca_simd_note(void)
{
#if CA_HAVE_X86_KERNELS
    if (!cpu_has_amx() && amx_refusal[0] != '\0' && cpu_has_avx512_bf16())
        return amx_refusal;
#endif
    return "";
}

static int runs_everywhere(void) { return 1; }

/* Every table compiled in, best last, with the check that this CPU runs it. */
static const struct {
    const ca_kernels *table;
    int (*runs_here)(void);
} registry[] = {
    {&ca_kernels_baseline, runs_everywhere},
#if CA_HAVE_X86_KERNELS
    {&ca_kernels_avx2, cpu_has_avx2_fma},
    {&ca_kernels_avx512, cpu_has_avx512},
    {&ca_kernels_avx512bf16, cpu_has_avx512_bf16},
    {&ca_kernels_amx, cpu_has_amx},
#endif
#if CA_HAVE_NEON_KERNELS
    {&ca_kernels_neon, runs_everywhere},    /* NEON is part of aarch64 */
#endif
};

#define N_TABLES ((int)(sizeof registry / sizeof registry[0]))

const ca_kernels *ca_kernels_by_name(const char *name)
{
    if (name == NULL)
        return NULL;
    for (int i = 0; i < N_TABLES; ++i)
        if (strcmp(name, registry[i].table->name) == 0)
            return registry[i].runs_here() ? registry[i].table : NULL;
    return NULL;
}

int ca_available_kernels(const char **names, int capacity)
{
    int n = 0;
    for (int i = 0; i < N_TABLES && n < capacity; ++i)
        if (registry[i].runs_here())
            names[n++] = registry[i].table->name;
    return n;
}

int ca_compiled_kernels(const char **names, int capacity)
{
    int n = 0;
    for (int i = 0; i < N_TABLES && n < capacity; ++i)
        names[n++] = registry[i].table->name;
    return n;
}

const ca_kernels *ca_default_kernels(void)
{
    const ca_kernels *forced = ca_kernels_by_name(getenv("CATTENTION_SIMD"));
    if (forced != NULL)
        return forced;
    for (int i = N_TABLES - 1; i > 0; --i)
        if (registry[i].runs_here())
            return registry[i].table;
    return &ca_kernels_baseline;
}
