/* Build facts the run-time report shows (runtime.h). */
#include "runtime.h"

const char *ca_compiler_version(void)
{
#if defined(__clang__)
    return "Clang " __clang_version__;
#elif defined(__GNUC__)
    return "GCC " __VERSION__;
#elif defined(_MSC_VER)
    return "MSVC";
#else
    return "unknown";
#endif
}
