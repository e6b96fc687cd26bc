/* The team-size rule of team.h. */
#include <time.h>

#include "team.h"

/* End of the latest call in this process (any caller), ns; 0: none yet.
   Relaxed atomics: a stale value only changes a thread count. */
static int64_t last_call_end_ns = 0;

int64_t ca_now_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
}

int ca_team_size(int n_threads, double serial_ns)
{
    int64_t last, now;
    if (n_threads <= 1 || serial_ns > CA_TEAM_WORTH_WAKING_NS)
        return n_threads;
    last = __atomic_load_n(&last_call_end_ns, __ATOMIC_RELAXED);
    now = ca_now_ns();
    if (last != 0 && now - last < CA_TEAM_AWAKE_NS)
        return n_threads;
    return 1;
}

void ca_team_call_ended(void)
{
    __atomic_store_n(&last_call_end_ns, ca_now_ns(), __ATOMIC_RELAXED);
}
