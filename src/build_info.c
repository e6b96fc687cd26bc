/* Build facts the run-time report shows, and the run-time type numbers of
   bfloat16 and fp8 (runtime.h). */
#include "runtime.h"

int ca_bfloat16_type = -1;

void ca_set_bfloat16_type(int type_num)
{
    ca_bfloat16_type = type_num;
}

int ca_e4m3fn_type = -1;
int ca_e5m2_type = -1;

void ca_set_fp8_types(int e4m3fn, int e5m2)
{
    ca_e4m3fn_type = e4m3fn;
    ca_e5m2_type = e5m2;
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
