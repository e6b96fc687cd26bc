/*
 * The few OpenMP calls the driver makes, with serial stand-ins when the
 * extension is built without OpenMP (setup.py falls back to that and says so).
 */
#ifndef CATTENTION_OPENMP_SHIM_H
#define CATTENTION_OPENMP_SHIM_H

#ifdef _OPENMP
#include <omp.h>
#define CA_HAVE_OPENMP 1
#define CA_OPENMP_VERSION _OPENMP
#if defined(__unix__) || defined(__APPLE__)
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
/* File of the OpenMP runtime this extension calls (libgomp, libomp, or the
 * copy a repaired wheel carries), or "" when the platform cannot say. */
static inline const char *ca_openmp_runtime(void) {
    Dl_info info;
    if (dladdr((void *)&omp_get_max_threads, &info) && info.dli_fname)
        return info.dli_fname;
    return "";
}
#else
static inline const char *ca_openmp_runtime(void) { return ""; }
#endif
#else
#define CA_HAVE_OPENMP 0
#define CA_OPENMP_VERSION 0
static inline int omp_get_max_threads(void) { return 1; }
static inline int omp_get_num_procs(void) { return 1; }
static inline int omp_get_thread_num(void) { return 0; }
static inline const char *ca_openmp_runtime(void) { return ""; }
#endif

#endif /* CATTENTION_OPENMP_SHIM_H */
