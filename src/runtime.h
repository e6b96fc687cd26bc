/*
 * What the driver needs from its surroundings, beside the kernels: the
 * compiler that built it and the run-time type numbers of bfloat16 and fp8
 * (build_info.c), fork safety (fork_safety.c), and per-thread scratch and
 * aligned memory (scratch.c).
 */
#ifndef CATTENTION_RUNTIME_H
#define CATTENTION_RUNTIME_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Compiler that built the extension, e.g. "GCC 12.2.0". */
const char *ca_compiler_version(void);

/* NumPy's type number of ml_dtypes.bfloat16, or -1 until the Python layer
   has met it: the type is registered when ml_dtypes is imported, so the
   driver is told its number. An operand of it is stored as bfloat16 and
   computed in float32. */
extern int ca_bfloat16_type;
void ca_set_bfloat16_type(int type_num);

/* Likewise NumPy's type numbers of ml_dtypes.float8_e4m3fn and
   float8_e5m2 (-1 until met): K and V of them are fp8 caches, widened to
   float32 as they are read. */
extern int ca_e4m3fn_type;
extern int ca_e5m2_type;
void ca_set_fp8_types(int e4m3fn, int e5m2);

/* Fork safety. GNU OpenMP cannot start a parallel region in a child forked
   after the parent ran one (the child inherits a thread pool whose threads
   do not exist, and waits for them forever). ca_note_parallel_region() is
   called before every parallel region; in a child forked after one,
   ca_forked_after_parallel() is nonzero and calls run on one thread. */
void ca_note_parallel_region(void);
int ca_forked_after_parallel(void);

/* Per-thread scratch kept between calls (scratch.c): a 64-byte aligned
   buffer of at least n_bytes for this thread's use of the slot, NULL on
   failure; hand it back with ca_scratch_release(slot, ptr). */
#define CA_SCRATCH_SLOTS 4
#define CA_SCRATCH_WORKSPACE 0   /* each thread's tiles and accumulators */
#define CA_SCRATCH_PACKED 1      /* the calling thread's packed K and V */
#define CA_SCRATCH_PARTIAL 2     /* the calling thread's split-key partials */
void *ca_scratch_acquire(int slot, size_t n_bytes);
void ca_scratch_release(int slot, void *ptr);

/* 64-byte aligned memory; NULL on failure. */
void *ca_aligned_alloc(size_t n_bytes);
void ca_aligned_free(void *ptr);

#ifdef __cplusplus
}
#endif

#endif /* CATTENTION_RUNTIME_H */
