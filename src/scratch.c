/*
 * Per-thread scratch memory kept between calls.
 *
 * A call needs a few hundred KiB per thread (score tiles, accumulators) and a
 * packed copy of K and V. Allocated afresh, blocks that large come from mmap
 * and every call pays a page fault per 4 KiB touched, a tenth of the time of
 * a BERT-sized call. Each thread (calling thread or OpenMP worker) keeps its
 * buffers instead; they are freed when the thread exits, and any buffer over
 * CA_SCRATCH_KEEP_BYTES is freed after each use so that one long-context
 * call does not pin its memory.
 */
#include <stdlib.h>

#include "runtime.h"

#define CA_SCRATCH_KEEP_BYTES ((size_t)64 << 20)

typedef struct {
    void *ptr[CA_SCRATCH_SLOTS];   /* buffer owned by the slot, or NULL */
    size_t size[CA_SCRATCH_SLOTS];
    int lent[CA_SCRATCH_SLOTS];    /* handed out and not yet released */
} scratch_set;

#if defined(_WIN32)
/* No destructor hook used on Windows: fall back to allocate-per-use. */
void *ca_scratch_acquire(int slot, size_t n_bytes)
{
    (void)slot;
    return ca_aligned_alloc(n_bytes);
}

void ca_scratch_release(int slot, void *ptr)
{
    (void)slot;
    ca_aligned_free(ptr);
}
#else
#include <pthread.h>

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static int scratch_key_ok = 0;

static void scratch_free_set(void *data)
{
    scratch_set *set = (scratch_set *)data;
    for (int i = 0; i < CA_SCRATCH_SLOTS; ++i)
        ca_aligned_free(set->ptr[i]);
    free(set);
}

static void scratch_make_key(void)
{
    scratch_key_ok = pthread_key_create(&scratch_key, scratch_free_set) == 0;
}

static scratch_set *scratch_this_thread(void)
{
    pthread_once(&scratch_once, scratch_make_key);
    if (!scratch_key_ok)
        return NULL;
    scratch_set *set = (scratch_set *)pthread_getspecific(scratch_key);
    if (set == NULL) {
        set = (scratch_set *)calloc(1, sizeof(scratch_set));
        if (set == NULL)
            return NULL;
        if (pthread_setspecific(scratch_key, set) != 0) {
            free(set);
            return NULL;
        }
    }
    return set;
}

void *ca_scratch_acquire(int slot, size_t n_bytes)
{
    scratch_set *set = scratch_this_thread();
    if (set == NULL || slot < 0 || slot >= CA_SCRATCH_SLOTS || set->lent[slot])
        return ca_aligned_alloc(n_bytes);
    if (set->ptr[slot] == NULL || set->size[slot] < n_bytes) {
        ca_aligned_free(set->ptr[slot]);
        set->ptr[slot] = ca_aligned_alloc(n_bytes);
        set->size[slot] = set->ptr[slot] != NULL ? n_bytes : 0;
        if (set->ptr[slot] == NULL)
            return NULL;
    }
    set->lent[slot] = 1;
    return set->ptr[slot];
}

void ca_scratch_release(int slot, void *ptr)
{
    if (ptr == NULL)
        return;
    scratch_set *set = scratch_this_thread();
    if (set == NULL || slot < 0 || slot >= CA_SCRATCH_SLOTS || set->ptr[slot] != ptr) {
        /* not the slot's own buffer: it was allocated for this use alone */
        ca_aligned_free(ptr);
        return;
    }
    set->lent[slot] = 0;
    if (set->size[slot] > CA_SCRATCH_KEEP_BYTES) {
        ca_aligned_free(set->ptr[slot]);
        set->ptr[slot] = NULL;
        set->size[slot] = 0;
    }
}
#endif

/* ---- 64-byte aligned memory ---------------------------------------------- */

void *ca_aligned_alloc(size_t n_bytes)
{
    void *ptr = NULL;
    if (n_bytes == 0)
        n_bytes = 64;
#if defined(_MSC_VER)
    ptr = _aligned_malloc(n_bytes, 64);
#else
    if (posix_memalign(&ptr, 64, n_bytes) != 0)
        ptr = NULL;
#endif
    return ptr;
}

void ca_aligned_free(void *ptr)
{
#if defined(_MSC_VER)
    _aligned_free(ptr);
#else
    free(ptr);
#endif
}
