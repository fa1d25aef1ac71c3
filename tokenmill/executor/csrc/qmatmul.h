/* Shared by qmatmul.c and its per-ISA kernels (arch/<isa>/qmatmul_*.c); not part of the library's interface. */
#ifndef TOKENMILL_QMATMUL_H
#define TOKENMILL_QMATMUL_H
#include "tokenmill.h"

/* The lanes kernel (arch/avx512/qmatmul_lanes.c): 16 outputs along the vector lanes, for 9 to 40 rows. */
#if defined(__AVX512F__)
#define HAVE_LANES 1
#define LANES_MIN_ROWS 9
#define LANES_MAX_ROWS 40
int qgemm_lanes(const tm_qweight *w, const float *x, int B, float *y, int num_threads);
#else
#define HAVE_LANES 0
#endif

#endif
