/*
 * Micro-kernels of cattention: the pieces of flash-style attention that run
 * per tile and decide the speed (score tile, P.V tile, row max, exp-and-sum).
 *
 * The Cython driver owns the blocking, masking, online-softmax bookkeeping and
 * OpenMP; these functions know nothing of Python, of masks or of threads.
 * Every instruction set provides the same table (ca_kernels); one is chosen at
 * import after a CPUID/XGETBV check and may be forced with CATTENTION_SIMD.
 * The portable table is plain C (kernels_baseline.c); the SIMD tables are one
 * source (kernels_simd.h) compiled over each instruction set's vocabulary
 * (simd_<isa>.h) by its kernels_<isa>.c, and listed in dispatch.c.
 *
 * Layouts (allocated and packed by the driver):
 *   q   n_rows x d_k, row-major, leading dimension ldq
 *   kt  K transposed in panels of CA_PANEL keys: panel p holds keys
 *       p*CA_PANEL.. as d_k rows of CA_PANEL contiguous values, and starts
 *       at kt + p * kt_panel_stride. Keys past the real ones are zero.
 *   v   V in panels of CA_PANEL columns: panel p holds columns p*CA_PANEL..
 *       as n_keys rows of CA_PANEL contiguous values, starting at
 *       v + p * v_panel_stride. Columns past d_v are zero.
 *   s   n_rows x n_cols, row-major, leading dimension lds
 *   acc n_rows x n_vcols, row-major, leading dimension ldacc
 * Panels make every kernel stream contiguous memory: a plain row-major K^T
 * with 256 keys a row puts successive rows 1 KiB apart, so a 16-key strip
 * maps onto a quarter of the L1 sets and is evicted before it is reused.
 * n_cols and n_vcols are multiples of CA_PANEL.
 */
#ifndef CATTENTION_KERNELS_H
#define CATTENTION_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "scalar.h"

/* Panel width of the packed layout every table reads (and the driver
   writes): one 64-byte cache line of floats or doubles. A table whose
   vectors hold a whole panel tiles two panels side by side. */
#define CA_PANEL_F32 16
#define CA_PANEL_F64 8

/* Every table's P.V kernels sum runs of this many keys from zero: float32
   rounding chains of 64 products, not of every key of a 256-key block
   (a chain over the whole block roughly doubled the P.V step's error
   against NumPy's). The tile adds a block's runs together before they
   join the accumulator, so that the accumulator's own chain stays one
   addition per block. */
#define CA_SUM_KEYS 64

/* ...and every table's score tiles sum runs of this many features of a
   dot product from zero, the runs added in order: one float32 chain over
   all d_k = 256 features had about twice the rounding error of runs of 64
   (and of NumPy's dot product of one row). Every table's feature chunk
   (CA_SCORE_CHUNK: 128 or 512) is a multiple of it, so a dot product has
   the same runs whether or not its features are split into chunks. */
#define CA_SUM_FEATURES 64

/* Bring the cache line at address into L1 (a hint; no fault anywhere). The
   driver uses it for the first rows of its next kernel call. */
static inline void ca_prefetch_l1(const void *address)
{
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(address, 0, 3);
#else
    (void)address;
#endif
}

/* Every table's register tile has a number of rows that divides this; the
   driver's blocks of query rows (Q_BLOCK = 96 and ROW_GROUP = 24 in
   cattention/_problem.pxd) are multiples of it, so only the last rows of a
   call take a smaller tail tile. */
#define CA_ROW_QUANTUM 24

/* Precision levels of a 16-bit (bfloat16, float16) result (the Python
   layer's precision=): what its value before its one rounding must be.
   HIGHEST: float32-accurate. HIGH: each weight of P within 2^-15 of
   itself in P.V (two bfloat16 parts of P hold it to 2^-16), so the
   rounded value is one of the two neighbours of the exact one up to the
   conditioning of the weighted sum. MEDIUM: P rounded once to bfloat16
   for P.V (PyTorch's, oneDNN's and vLLM's bfloat16 numerics). float32 and
   float64 results take HIGHEST whatever is asked; a table may run a level
   as a higher one (bf16_pv_parts). */
#define CA_PRECISION_HIGHEST 0
#define CA_PRECISION_HIGH 1
#define CA_PRECISION_MEDIUM 2
#define CA_PRECISION_LEVELS 3

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ca_kernels {
    const char *name;
    /* The register tile of score and P.V: rows of q, and columns (keys or
       value columns) of float32 / float64 (the driver's row blocks are
       multiples of the rows, see CA_ROW_QUANTUM). */
    int tile_rows;
    int tile_cols_f32;
    int tile_cols_f64;
    /* s = factor * (q . kt)  (overwrites s); factor is the softmax scale.
       Scaling the finished dot product rather than q keeps one rounding
       out of every logit.
       Both packed kernels also prefetch into L2, spread over their tiles,
       the ahead_bytes at ahead (may be NULL): the packed block the next call
       reads. Packed blocks come from L3 once per block of query rows; the
       hardware prefetcher stops at page boundaries, and a P.V kernel
       streaming its V block from L3 ran about a fifth slower than on one in
       L2 (measured alone; in the driver the prefetch gains 1-5%). */
    void (*score_f32)(const float *q, ptrdiff_t ldq, ptrdiff_t n_rows,
                      const float *kt, ptrdiff_t kt_panel_stride, ptrdiff_t n_cols,
                      ptrdiff_t d_k, float factor, float *s, ptrdiff_t lds,
                      const void *ahead, ptrdiff_t ahead_bytes);
    void (*score_f64)(const double *q, ptrdiff_t ldq, ptrdiff_t n_rows,
                      const double *kt, ptrdiff_t kt_panel_stride, ptrdiff_t n_cols,
                      ptrdiff_t d_k, double factor, double *s, ptrdiff_t lds,
                      const void *ahead, ptrdiff_t ahead_bytes);

    /* acc += p . v  over n_keys keys (accumulates into acc) */
    void (*pv_f32)(const float *p, ptrdiff_t ldp, ptrdiff_t n_rows,
                   const float *v, ptrdiff_t v_panel_stride, ptrdiff_t n_keys,
                   ptrdiff_t n_vcols, float *acc, ptrdiff_t ldacc,
                   const void *ahead, ptrdiff_t ahead_bytes);
    void (*pv_f64)(const double *p, ptrdiff_t ldp, ptrdiff_t n_rows,
                   const double *v, ptrdiff_t v_panel_stride, ptrdiff_t n_keys,
                   ptrdiff_t n_vcols, double *acc, ptrdiff_t ldacc,
                   const void *ahead, ptrdiff_t ahead_bytes);

    /* max(x[0..n)); -inf when n == 0 or every entry is -inf; NaN if any
       entry is NaN (a NaN logit must make its row NaN, not empty). */
    float (*row_max_f32)(const float *x, ptrdiff_t n);
    double (*row_max_f64)(const double *x, ptrdiff_t n);

    /* x[j] = e^(x[j] - shift) in place; returns the sum. shift is finite
       or NaN. e^(-inf) is exactly 0. */
    float (*exp_sum_f32)(float *x, ptrdiff_t n, float shift);
    double (*exp_sum_f64)(double *x, ptrdiff_t n, double shift);

    /* out[r * ld_out + c] = acc[r * ldacc + c] / divisor[r] for c < n_cols:
       the finished rows of ATTN, a run of rows per call (divided, not
       multiplied by a reciprocal, so every table gives the bits of the
       plain division; the driver's own loop ran at SSE2 width). Returns
       nonzero if any quotient is inf or NaN (an accumulator may have
       passed the dtype's range: the driver then looks at those rows). */
    int (*divide_rows_f32)(const float *acc, ptrdiff_t ldacc, ptrdiff_t n_rows,
                           ptrdiff_t n_cols, const float *divisor, float *out,
                           ptrdiff_t ld_out);
    int (*divide_rows_f64)(const double *acc, ptrdiff_t ldacc, ptrdiff_t n_rows,
                           ptrdiff_t n_cols, const double *divisor, double *out,
                           ptrdiff_t ld_out);

    /* Kernels for few query rows (decode), reading K and V where the caller
       keeps them, rows contiguous: packing would cost as much as the work.
       Both are memory-bound, so each also prefetches into L2, at its own
       pace, n_keys rows of `ahead_bytes` bytes at `ahead` + j * ahead_stride
       (bytes): the block the other kernel reads next (ahead may be NULL).
       s[r, j] = factor * (q_r . k_j) with k_j = k + j * ldk; */
    void (*score_direct_f32)(const float *q, ptrdiff_t ldq, ptrdiff_t n_rows,
                             const float *k, ptrdiff_t ldk, ptrdiff_t n_keys,
                             ptrdiff_t d_k, float factor, float *s, ptrdiff_t lds,
                             const void *ahead, ptrdiff_t ahead_stride,
                             ptrdiff_t ahead_bytes);
    void (*score_direct_f64)(const double *q, ptrdiff_t ldq, ptrdiff_t n_rows,
                             const double *k, ptrdiff_t ldk, ptrdiff_t n_keys,
                             ptrdiff_t d_k, double factor, double *s, ptrdiff_t lds,
                             const void *ahead, ptrdiff_t ahead_stride,
                             ptrdiff_t ahead_bytes);
    /* acc[r, c] += sum_j p[r, j] * v[j * ldv + c] for c < d_v, skipping keys
       of weight exactly 0 (so a NaN or Inf in a value that takes no part
       never reaches acc; for finite values skipping changes no bit).
       ldacc >= d_v rounded up to 16 elements. */
    void (*pv_direct_f32)(const float *p, ptrdiff_t ldp, ptrdiff_t n_rows,
                          const float *v, ptrdiff_t ldv, ptrdiff_t n_keys,
                          ptrdiff_t d_v, float *acc, ptrdiff_t ldacc,
                          const void *ahead, ptrdiff_t ahead_stride,
                          ptrdiff_t ahead_bytes);
    void (*pv_direct_f64)(const double *p, ptrdiff_t ldp, ptrdiff_t n_rows,
                          const double *v, ptrdiff_t ldv, ptrdiff_t n_keys,
                          ptrdiff_t d_v, double *acc, ptrdiff_t ldacc,
                          const void *ahead, ptrdiff_t ahead_stride,
                          ptrdiff_t ahead_bytes);

    /* float16 K/V (caches), converted block by block as they are read:
       dst[r * ld_dst + c] = src[r * src_row + c * src_col] for c < n_cols
       (strides in elements; exact, IEEE half to single). */
    void (*half_rows_to_f32)(const uint16_t *src, ptrdiff_t src_row, ptrdiff_t src_col,
                             ptrdiff_t n_rows, ptrdiff_t n_cols, float *dst,
                             ptrdiff_t ld_dst);

    /* x[j] = cap * tanh(x[j] / cap) in place (logit soft-capping; float64
       uses ca_softcap_f64). */
    void (*softcap_f32)(float *x, ptrdiff_t n, float cap);

    /* Packing of one key block into the layouts above, from rows with
       contiguous features (float32; float64 and strided features are packed
       by the driver). With S = 128 the packing costs as much as a sixth of
       the call when done element by element.
       kt: key j, feature c at kt[(j / 16) * kt_panel_stride + c * 16 + j % 16];
       keys n_keys.. up to the next multiple of 16 are 0. */
    void (*pack_kt_f32)(const float *k, ptrdiff_t ldk, ptrdiff_t n_keys, ptrdiff_t d_k,
                        float *kt, ptrdiff_t kt_panel_stride);
    /* v: key j, column c at v_packed[(c / 16) * v_panel_stride + j * 16 + c % 16],
       columns d_v.. up to the next multiple of 16 are 0. Returns nonzero if
       any value copied is NaN or infinite (the driver then zeroes them). */
    int (*pack_v_f32)(const float *v, ptrdiff_t ldv, ptrdiff_t n_keys, ptrdiff_t d_v,
                      float *v_packed, ptrdiff_t v_panel_stride);

    /* int8 K/V (quantized caches) with one float32 scale per row, converted
       block by block as they are read: dst[r * ld_dst + c] =
       (float)src[r * src_row + c * src_col] * scale[r * scale_stride], one
       rounding, as NumPy's k_int8 * k_scale[..., None] in float32. */
    void (*int8_rows_to_f32)(const int8_t *src, ptrdiff_t src_row, ptrdiff_t src_col,
                             ptrdiff_t n_rows, ptrdiff_t n_cols, const float *scale,
                             ptrdiff_t scale_stride, float *dst, ptrdiff_t ld_dst);

    /* The direct (decode) path on int8 K and V read where they are (rows
       with contiguous features), the row scales applied on the fly:
       s[r * lds + j] = factor * scale[j * scale_stride]
                        * sum_c q[r * ldq + c] * k[j * ldk + c], and
       acc[r * ldacc + c] += sum_j (p[r * ldp + j] * scale[j * scale_stride])
                             * v[j * ldv + c].
       Decode is memory-bound: reading a quarter of float32's bytes and
       converting in registers, with no row copy, is what makes int8 pay. */
    void (*score_direct_i8)(const float *q, ptrdiff_t ldq, ptrdiff_t n_rows,
                            const int8_t *k, ptrdiff_t ldk, ptrdiff_t n_keys, ptrdiff_t d_k,
                            float factor, const float *scale, ptrdiff_t scale_stride,
                            float *s, ptrdiff_t lds);
    void (*pv_direct_i8)(const float *p, ptrdiff_t ldp, ptrdiff_t n_rows, const int8_t *v,
                         ptrdiff_t ldv, ptrdiff_t n_keys, ptrdiff_t d_v, const float *scale,
                         ptrdiff_t scale_stride, float *acc, ptrdiff_t ldacc);

    /* fp8 K/V (8-bit float caches, format CA_FP8_E4M3FN or CA_FP8_E5M2 of
       scalar.h) with one float32 scale per row (scale_stride 0: one for
       every row), as int8's: fp8_rows_to_f32 gives each value times its
       scale, one rounding; the direct kernels read the codes where they
       lie, widen them exactly in registers (E5M2 is the upper byte of a
       binary16; E4M3FN is moved into a binary16 by shifts and its NaN
       codes made NaN) and apply the scales outside the products:
       s[r * lds + j] = (factor * sum_c q[r * ldq + c] * k_j[c])
                        * scale[j * scale_stride], and
       acc[r * ldacc + c] += sum_j (p[r * ldp + j] * scale[j * scale_stride])
                             * v_j[c], keys of weight 0 skipped. The
       prefetches as score_direct_f32's and pv_direct_f32's. */
    void (*fp8_rows_to_f32)(const uint8_t *src, ptrdiff_t src_row, ptrdiff_t src_col,
                            ptrdiff_t n_rows, ptrdiff_t n_cols, int format,
                            const float *scale, ptrdiff_t scale_stride, float *dst,
                            ptrdiff_t ld_dst);
    void (*score_direct_fp8)(const float *q, ptrdiff_t ldq, ptrdiff_t n_rows,
                             const uint8_t *k, ptrdiff_t ldk, ptrdiff_t n_keys,
                             ptrdiff_t d_k, int format, float factor, const float *scale,
                             ptrdiff_t scale_stride, float *s, ptrdiff_t lds,
                             const void *ahead, ptrdiff_t ahead_stride,
                             ptrdiff_t ahead_bytes);
    void (*pv_direct_fp8)(const float *p, ptrdiff_t ldp, ptrdiff_t n_rows,
                          const uint8_t *v, ptrdiff_t ldv, ptrdiff_t n_keys,
                          ptrdiff_t d_v, int format, const float *scale,
                          ptrdiff_t scale_stride, float *acc, ptrdiff_t ldacc,
                          const void *ahead, ptrdiff_t ahead_stride,
                          ptrdiff_t ahead_bytes);

    /* score_direct_f32 and pv_direct_f32 with float16 K or V, read where
       they lie and converted in registers (ldk, ldv in elements): the bits
       of converting the rows to float32 first and calling those. */
    void (*score_direct_f16)(const float *q, ptrdiff_t ldq, ptrdiff_t n_rows,
                             const uint16_t *k, ptrdiff_t ldk, ptrdiff_t n_keys,
                             ptrdiff_t d_k, float factor, float *s, ptrdiff_t lds,
                             const void *ahead, ptrdiff_t ahead_stride,
                             ptrdiff_t ahead_bytes);
    void (*pv_direct_f16)(const float *p, ptrdiff_t ldp, ptrdiff_t n_rows,
                          const uint16_t *v, ptrdiff_t ldv, ptrdiff_t n_keys,
                          ptrdiff_t d_v, float *acc, ptrdiff_t ldacc,
                          const void *ahead, ptrdiff_t ahead_stride,
                          ptrdiff_t ahead_bytes);

    /* bfloat16 q, K and V (the upper halves of float32 values), as
       half_rows_to_f32, score_direct_f16 and pv_direct_f16: converted
       exactly as they are read, never copied to float32 whole. */
    void (*bf16_rows_to_f32)(const uint16_t *src, ptrdiff_t src_row, ptrdiff_t src_col,
                             ptrdiff_t n_rows, ptrdiff_t n_cols, float *dst,
                             ptrdiff_t ld_dst);
    void (*score_direct_bf16)(const float *q, ptrdiff_t ldq, ptrdiff_t n_rows,
                              const uint16_t *k, ptrdiff_t ldk, ptrdiff_t n_keys,
                              ptrdiff_t d_k, float factor, float *s, ptrdiff_t lds,
                              const void *ahead, ptrdiff_t ahead_stride,
                              ptrdiff_t ahead_bytes);
    void (*pv_direct_bf16)(const float *p, ptrdiff_t ldp, ptrdiff_t n_rows,
                           const uint16_t *v, ptrdiff_t ldv, ptrdiff_t n_keys,
                           ptrdiff_t d_v, float *acc, ptrdiff_t ldacc,
                           const void *ahead, ptrdiff_t ahead_stride,
                           ptrdiff_t ahead_bytes);

    /* bfloat16 tiles: tables whose instructions multiply pairs of bfloat16
       (AVX512-BF16's VDPBF16PS, AMX's TDPBF16PS) take bfloat16 q and K as
       they are, products exact in float32 and sums in float32; the other
       tables leave these NULL and convert to float32 (the driver then
       packs and multiplies float32).
       K^T of a key block in pair panels: panel p holds keys p*16 .. p*16+15,
       pair c (features 2c, 2c+1) of key j at
       kt[p * kt_panel_stride + c * 32 + 2 * (j % 16) + (0 or 1)] (uint16);
       features are padded with zeros to a multiple of bf16_k_align, keys
       to the panel's end. Q rows are bfloat16 with that padding too. */
    ptrdiff_t bf16_k_align;
    void (*pack_kt_bf16)(const uint16_t *k, ptrdiff_t ldk, ptrdiff_t n_keys, ptrdiff_t d_k,
                         uint16_t *kt, ptrdiff_t kt_panel_stride);
    /* s = factor * (q . kt) as score_f32, q rows of padded bfloat16 */
    void (*score_bf16)(const uint16_t *q, ptrdiff_t ldq, ptrdiff_t n_rows,
                       const uint16_t *kt, ptrdiff_t kt_panel_stride, ptrdiff_t n_cols,
                       ptrdiff_t d_k, float factor, float *s, ptrdiff_t lds,
                       const void *ahead, ptrdiff_t ahead_bytes);
    /* V of a key block in the table's own bfloat16 layout, and acc += p . v
       as pv_f32 with p float32 taken as the table's bfloat16 parts
       (bf16_pv_parts), each part's products exact and summed in float32
       (see the table); NULL: V is packed as float32 and P.V takes pv_f32.
       pack_v_bf16 returns nonzero if any value is NaN or infinite (it
       leaves them 0, as pack_v_f32). */
    int (*pack_v_bf16)(const uint16_t *v, ptrdiff_t ldv, ptrdiff_t n_keys, ptrdiff_t d_v,
                       uint16_t *v_packed, ptrdiff_t v_panel_stride);
    void (*pv_bf16)(const float *p, ptrdiff_t ldp, ptrdiff_t n_rows, const uint16_t *v,
                    ptrdiff_t v_panel_stride, ptrdiff_t n_keys, ptrdiff_t n_vcols,
                    float *acc, ptrdiff_t ldacc, const void *ahead,
                    ptrdiff_t ahead_bytes);
    /* At each precision level (CA_PRECISION_*) of a bfloat16 result with
       bfloat16 V: the parts of P the table's pv_bf16 splits it into, where
       that level takes pv_bf16; 0 where it takes V packed as float32 and
       pv_f32 (float32 weights, the highest level's). */
    int bf16_pv_parts[CA_PRECISION_LEVELS];
    /* Called by each thread when it has done its part of a call: a table
       with per-thread state (AMX's tile configuration) gives it up; NULL
       for the others. */
    void (*end_of_thread)(void);

    /* The table's fastest multiply-add loop, n_steps times over data that
       stays in registers (vector FMAs into independent sums; AMX: tile
       products into four accumulator tiles), for the benchmark's share of
       it. Returns the floating-point operations done. */
    double (*loop_flops)(long n_steps);
} ca_kernels;

/* The loop_flops of a table: a table file with another loop defines
   CA_LOOP_FLOPS before it lists its table. */
#ifndef CA_LOOP_FLOPS
#define CA_LOOP_FLOPS loop_flops
#endif

/* The bfloat16 tile entries of a table that has none (the default of
   CA_DEFINE_KERNEL_TABLE): a table file that has them defines
   CA_BF16_TILE_ENTRIES before it lists its table. */
#ifndef CA_BF16_TILE_ENTRIES
#define CA_BF16_TILE_ENTRIES \
        .bf16_k_align = 0, .pack_kt_bf16 = NULL, .score_bf16 = NULL, \
        .pack_v_bf16 = NULL, .pv_bf16 = NULL, .bf16_pv_parts = {0, 0, 0}, \
        .end_of_thread = NULL,
#endif

/* The table of one instruction set, from the file that defines a static
   function of each entry's name and its register tile (CA_TILE_ROWS rows
   of CA_TILE_VECS vectors of CA_LANES_F32 / CA_LANES_F64 lanes): every
   table lists the same entries, so a new entry is added here once
   (designated, so none can shift). */
#define CA_DEFINE_KERNEL_TABLE(table, label) \
    const ca_kernels table = { \
        .name = label, \
        .tile_rows = CA_TILE_ROWS, \
        .tile_cols_f32 = CA_TILE_VECS * CA_LANES_F32, \
        .tile_cols_f64 = CA_TILE_VECS * CA_LANES_F64, \
        .score_f32 = score_f32, \
        .score_f64 = score_f64, \
        .pv_f32 = pv_f32, \
        .pv_f64 = pv_f64, \
        .row_max_f32 = row_max_f32, \
        .row_max_f64 = row_max_f64, \
        .exp_sum_f32 = exp_sum_f32, \
        .exp_sum_f64 = exp_sum_f64, \
        .divide_rows_f32 = divide_rows_f32, \
        .divide_rows_f64 = divide_rows_f64, \
        .score_direct_f32 = score_direct_f32, \
        .score_direct_f64 = score_direct_f64, \
        .pv_direct_f32 = pv_direct_f32, \
        .pv_direct_f64 = pv_direct_f64, \
        .half_rows_to_f32 = half_rows_to_f32, \
        .softcap_f32 = softcap_f32, \
        .pack_kt_f32 = pack_kt_f32, \
        .pack_v_f32 = pack_v_f32, \
        .int8_rows_to_f32 = int8_rows_to_f32, \
        .score_direct_i8 = score_direct_i8, \
        .pv_direct_i8 = pv_direct_i8, \
        .fp8_rows_to_f32 = fp8_rows_to_f32, \
        .score_direct_fp8 = score_direct_fp8, \
        .pv_direct_fp8 = pv_direct_fp8, \
        .score_direct_f16 = score_direct_f16, \
        .pv_direct_f16 = pv_direct_f16, \
        .bf16_rows_to_f32 = bf16_rows_to_f32, \
        .score_direct_bf16 = score_direct_bf16, \
        .pv_direct_bf16 = pv_direct_bf16, \
        CA_BF16_TILE_ENTRIES \
        .loop_flops = CA_LOOP_FLOPS, \
    }

/* Tables, one per instruction set compiled in (listed in dispatch.c). */
extern const ca_kernels ca_kernels_baseline;
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#define CA_HAVE_X86_KERNELS 1
extern const ca_kernels ca_kernels_avx2;
extern const ca_kernels ca_kernels_avx512;
extern const ca_kernels ca_kernels_avx512bf16;
extern const ca_kernels ca_kernels_amx;
#else
#define CA_HAVE_X86_KERNELS 0
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#define CA_HAVE_NEON_KERNELS 1
extern const ca_kernels ca_kernels_neon;
#else
#define CA_HAVE_NEON_KERNELS 0
#endif

/* The best table this CPU supports, or the one CATTENTION_SIMD names. */
const ca_kernels *ca_default_kernels(void);
/* The table called name if this CPU runs it, else NULL. */
const ca_kernels *ca_kernels_by_name(const char *name);
/* Names of the tables this CPU runs, best last; returns how many. */
int ca_available_kernels(const char **names, int capacity);
/* Names of every table compiled in, runnable here or not, best last. */
int ca_compiled_kernels(const char **names, int capacity);
/* Why a table this CPU has the instructions of is not in use ("" if none
   is held back): the AMX table when the OS or Linux refuses the tiles. */
const char *ca_simd_note(void);
#ifdef __cplusplus
}
#endif

#endif /* CATTENTION_KERNELS_H */
