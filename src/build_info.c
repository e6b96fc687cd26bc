/* Build facts the run-time report shows, and the run-time type number of
   bfloat16 (runtime.h). */
#include "runtime.h"

int ca_bfloat16_type = -1;

void ca_set_bfloat16_type(int type_num)
{
    ca_bfloat16_type = type_num;
}

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
