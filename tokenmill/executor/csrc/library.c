/* Which variant this build is, and what it was built from (build.py defines both). */
#include "tokenmill.h"

#ifndef TM_ISA_NAME
#error "build.py defines TM_ISA_NAME for each variant"
#endif
#ifndef TM_BUILD_HASH
#define TM_BUILD_HASH "unknown"
#endif

TM_API const char *tm_isa(void) { return TM_ISA_NAME; }
TM_API const char *tm_build_hash(void) { return TM_BUILD_HASH; }
