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
#else
#define CA_HAVE_OPENMP 0
#define CA_OPENMP_VERSION 0
static inline int omp_get_max_threads(void) { return 1; }
static inline int omp_get_thread_num(void) { return 0; }
#endif

#endif /* CATTENTION_OPENMP_SHIM_H */
