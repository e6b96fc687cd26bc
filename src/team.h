/*
 * How many threads a call starts, beyond what the caller allows: a rule for
 * calls made between the calls of other libraries (a NumPy pipeline).
 *
 * After a parallel region our idle OpenMP threads spin only briefly (see
 * cattention/_native.py), then sleep. Inside a pipeline the call before
 * ours is usually a BLAS call that outlasts that spin, and OpenBLAS's own
 * workers keep spinning for about 0.1 s after it, holding a core. Waking our
 * sleeping worker and sharing that core with the spinner then costs more
 * than the worker saves (the spinner makes no system call, so the woken
 * worker runs only once the scheduler preempts it, and the call waits for
 * it at its end): calls of up to about a millisecond of one-thread work
 * ran as fast or faster on one thread there (BENCHMARKS.md). Back to back, our workers are still spinning and two threads halve the
 * time. So: a call that follows our previous call within CA_TEAM_AWAKE_NS,
 * or whose one-thread work is estimated above CA_TEAM_WORTH_WAKING_NS,
 * runs with the threads it was given; any other runs on one thread.
 * Results are bitwise the same for any thread count, so the rule changes
 * speed only.
 */
#ifndef CATTENTION_TEAM_H
#define CATTENTION_TEAM_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Workers idle for less than this are still spinning (GOMP_SPINCOUNT=1000). */
#define CA_TEAM_AWAKE_NS 50000
/* One-thread work above which waking the workers pays even beside a spinner. */
#define CA_TEAM_WORTH_WAKING_NS 1500000.0
/* The cost model behind the estimate: one core's float32 rate on the packed
   path and the rate at which a decode step streams K and V (Zen 3, AVX2;
   float64 counts its FLOPs twice). Only the order of magnitude matters. */
#define CA_TEAM_FLOPS_PER_NS 50.0
#define CA_TEAM_BYTES_PER_NS 20.0

/* Monotonic clock in nanoseconds. */
int64_t ca_now_ns(void);
/* Threads for a call of the given estimated one-thread time (ns) that may
   use up to n_threads. */
int ca_team_size(int n_threads, double serial_ns);
/* Called when a call given more than one thread ends (whatever number it
   ran with); a call given one thread starts no team and does not count. */
void ca_team_call_ended(void);

#ifdef __cplusplus
}
#endif

#endif /* CATTENTION_TEAM_H */
