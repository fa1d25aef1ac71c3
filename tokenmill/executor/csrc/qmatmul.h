/* Shared by qmatmul.c and its per-ISA kernels (arch/<isa>/qmatmul_*.c); not part of the library's interface. */
#ifndef TOKENMILL_QMATMUL_H
#define TOKENMILL_QMATMUL_H
#include <string.h>

#include "simd.h"
#include "tokenmill.h"

#define KC 128      /* positions of weights dequantised at a time by the many-row kernels */

/* The int8 route (qmatmul_int8.c): x rounded to int8 per 32, for x86's AVX2 and up */
#if defined(__AVX2__)
#define HAVE_QMATMUL_INT8 1
int qmatmul_int8(int q4, const float *x, int B, int K, int N, const uint8_t *codes, const float *d,
                 const float *m, float *y, int num_threads);
#else
#define HAVE_QMATMUL_INT8 0
#endif

/* The lanes kernel (arch/avx512/qmatmul_lanes.c): 16 outputs along the vector lanes, for 9 to 40 rows. */
#if defined(__AVX512F__)
#define HAVE_LANES 1
#define LANES_MIN_ROWS 9
#define LANES_MAX_ROWS 40
int qgemm_lanes(const tm_qweight *w, const float *x, int B, float *y, int num_threads);
/* the many-row kernel with 16 inputs a vector (arch/avx512/qmatmul_gemm.c) */
int qgemm16(int q4, const float *x, int B, int K, int N, const uint8_t *codes, const float *d, const float *m,
            float *y, int num_threads);
#else
#define HAVE_LANES 0
#endif

/* Weight rows n0 .. n0+NR-1, positions k0 .. k0+KC-1, dequantised into ws [NR][KC]; rows past N are zeros,
 * computed and never stored. */
TM_INLINE void dequant_rows(int q4, int K, const uint8_t *codes, const float *d, const float *m, int n0, int count,
                            int NR, int k0, int kc, float *ws) {
    const int nb = K / QK;
    const size_t row_bytes = q4 ? (size_t)K / 2 : (size_t)K;
    for (int r = 0; r < NR; r++) {
        float *w = ws + (size_t)r * KC;
        if (r >= count) {
            memset(w, 0, sizeof(float) * KC);
            continue;
        }
        const size_t n = (size_t)n0 + r;
        for (int i = k0 / QK; i < (k0 + kc) / QK; i++) {
            vf q[QV];
            if (q4) q4_block(codes + n * row_bytes + (size_t)i * 16, d[n * nb + i], m[n * nb + i], q);
            else q8_block((const int8_t *)codes + n * row_bytes + (size_t)i * 32, d[n * nb + i], q);
            for (int v = 0; v < QV; v++) vstore(w + (size_t)i * QK - k0 + v * VL, q[v]);
        }
    }
}

#endif
