/*
 * Fork safety (runtime.h): GNU OpenMP cannot start a parallel region in a
 * child forked after the parent ran one, so the driver notes every region
 * and runs serially in such a child.
 */
#include "runtime.h"

static volatile int parallel_used = 0;
static volatile int forked_after_parallel = 0;

#if !defined(_WIN32)
#include <pthread.h>

static void mark_forked_child(void)
{
    forked_after_parallel = parallel_used;
}

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void register_atfork(void)
{
    pthread_atfork(NULL, NULL, mark_forked_child);
}
#endif

void ca_note_parallel_region(void)
{
#if !defined(_WIN32)
    pthread_once(&atfork_once, register_atfork);
#endif
    parallel_used = 1;
}

int ca_forked_after_parallel(void)
{
    return forked_after_parallel;
}
