/* The many-row quantised matmul for AVX-512 (qmatmul.c serves up to GEMM_MIN_ROWS inputs with its row kernel):
 * simd.h's 16-float vectors, all of a call's inputs (up to 4 vectors) in one tile of accumulators. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../qmatmul.h"
#include "transpose.h"

/* ---- many rows: dequantise a few weight rows into L1, then a register-blocked GEMM over all inputs ---------
 * Above ~20 inputs the row kernel (qmatmul.c's rows()) runs out of registers (it re-dequantises every row for each 8
 * inputs and reloads x from L2 per FMA pair). Here NR weight rows are dequantised KC positions at a time into
 * a float32 scratch ws [NR][KC] (L1), x is turned round (by each thread) to xT [K][16 * MV] (zero-padded), and
 * the inner loop keeps NR x MV accumulators of 16 inputs each: per k it loads MV vectors of x and broadcasts NR
 * weights, NR * MV FMAs for NR + MV loads. Sums run over k in order, so results differ from
 * x @ dequantised(w)^T only in summation order, as above. */
/* Outputs n0 .. n0+count-1 for all inputs, into rows 0 .. count-1 of yT: the accumulators stay in registers
 * over all of K while the weights arrive KC positions at a time (ws stays in L1 next to the slice of xT being
 * read). */
static inline __attribute__((always_inline)) void gemm_tile(int q4, const uint8_t *codes, const float *d,
                                                            const float *m, const float *xT, int K, float *ws,
                                                            int NR, int MV, float *yT, int n0, int count) {
    vf acc[12][4];
#pragma GCC unroll 12
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int j = 0; j < MV; j++) acc[r][j] = (vf){0};
    const int BP = 16 * MV;
    for (int k0 = 0; k0 < K; k0 += KC) {
        const int kc = K - k0 < KC ? K - k0 : KC;
        dequant_rows(q4, K, codes, d, m, n0, count, NR, k0, kc, ws);
        for (int k = 0; k < kc; k++) {
            vf xv[4];
#pragma GCC unroll 4
            for (int j = 0; j < MV; j++) xv[j] = vload(xT + (size_t)(k0 + k) * BP + 16 * j);
#pragma GCC unroll 12
            for (int r = 0; r < NR; r++) {
                const vf wb = vset1(ws[(size_t)r * KC + k]);
#pragma GCC unroll 4
                for (int j = 0; j < MV; j++) acc[r][j] = vfma(wb, xv[j], acc[r][j]);
            }
        }
    }
    /* acc[r][j] holds y[16j .. 16j+15][n0 + r]: kept transposed, and turned round by transpose_out() */
#pragma GCC unroll 12
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int j = 0; j < MV; j++)
            if (r < count) memcpy(yT + (size_t)r * BP + 16 * j, &acc[r][j], 64);
}

/* y [B][N], outputs n0 .. n0+count-1, from their rows of yT [count][BP]: 16 x 16 squares turned round in L1,
 * so each row of y gets whole 64-byte stores (scattered single floats into y cost more than the FMAs at
 * K = 128) */

static void transpose_out(const float *yT, int BP, float *y, int B, int N, int n0, int count) {
    for (int i0 = 0; i0 < count; i0 += 16) {
        const int nn = count - i0 < 16 ? count - i0 : 16;
        for (int b0 = 0; b0 < B; b0 += 16) {
            __m512 r[16];
            for (int i = 0; i < 16; i++)
                r[i] = i < nn ? _mm512_loadu_ps(yT + (size_t)(i0 + i) * BP + b0) : _mm512_setzero_ps();
            transpose16(r);
            const __mmask16 mask = (__mmask16)((1u << nn) - 1);
            for (int l = 0; l < 16 && b0 + l < B; l++)
                _mm512_mask_storeu_ps(y + (size_t)(b0 + l) * N + n0 + i0, mask, r[l]);
        }
    }
}

/* xT [K][BP] = x [B][K] turned round, rows past B zero (K a multiple of 16). Each thread of qgemm16() turns its own
 * copy: 16 x 16 squares through registers cost less than sharing one copy would (a second parallel region, a
 * barrier, and half of every thread's xT written by the other core). A batch-64 step's 120 matrices, cold
 * weights, two threads: ~3-10% faster than the shared scalar copy it replaced. */
static void turn_inputs(const float *x, int B, int K, int BP, float *xT) {
    for (int k0 = 0; k0 < K; k0 += 16)
        for (int b0 = 0; b0 < BP; b0 += 16) {
            __m512 r[16];
            for (int i = 0; i < 16; i++)
                r[i] = b0 + i < B ? _mm512_loadu_ps(x + (size_t)(b0 + i) * K + k0) : _mm512_setzero_ps();
            transpose16(r);
            for (int j = 0; j < 16; j++) _mm512_store_ps(xT + (size_t)(k0 + j) * BP + b0, r[j]);
        }
}

/* Outputs go in groups of GROUP_N (a multiple of every NR below): a thread computes a group's tiles into its
 * own yT [GROUP_N][BP] (12 KB at 64 inputs, in L1) and turns it round into y at once. NR = rows per tile
 * for MV vectors of inputs (MV = 2..4 above GEMM_MIN_ROWS): NR * MV = 24 accumulators, with MV x vectors and
 * a broadcast, fit the 32 vector registers. A macro, not an inline function: GCC outlines an omp parallel
 * body into its own function, where NR and MV would no longer be constants, and that ran 2x slower. */
#define GROUP_N 48
#define GEMM_CASE(MV_, NR_)                                                                             \
    case MV_: {                                                                                         \
        _Pragma("omp parallel num_threads(num_threads)") {                                              \
            float *ws = aligned_alloc(64, sizeof(float) * NR_ * KC);                                    \
            float *yT = aligned_alloc(64, sizeof(float) * GROUP_N * BP);                                \
            float *xT = aligned_alloc(64, sizeof(float) * (size_t)K * BP);                              \
            const int ok = ws && yT && xT;                                                              \
            if (ok) turn_inputs(x, B, K, BP, xT);                                                       \
            else failed = 1;                                                                            \
            /* every thread meets the loop, even without its buffers: one that skipped it would leave the \
             * others waiting at its barrier */                                                         \
            _Pragma("omp for schedule(dynamic, 1)")                                                         \
            for (int g = 0; g < groups; g++) {                                                          \
                if (!ok) continue;                                                                      \
                const int g0 = g * GROUP_N, size = N - g0 < GROUP_N ? N - g0 : GROUP_N;                 \
                for (int n0 = g0; n0 < g0 + size; n0 += NR_) {                                          \
                    const int count = g0 + size - n0 < NR_ ? g0 + size - n0 : NR_;                      \
                    float *rows_out = yT + (size_t)(n0 - g0) * BP;                                      \
                    gemm_tile(q4, codes, d, m, xT, K, ws, NR_, MV_, rows_out, n0, count);               \
                }                                                                                       \
                transpose_out(yT, BP, y, B, N, g0, size);                                               \
            }                                                                                           \
            free(ws);                                                                                   \
            free(yT);                                                                                   \
            free(xT);                                                                                   \
        }                                                                                               \
        break;                                                                                          \
    }

int qgemm16(int q4, const float *x, int B, int K, int N, const uint8_t *codes, const float *d, const float *m,
            float *y, int num_threads) {
    const int MV = (B + 15) / 16, BP = 16 * MV;
    const int groups = (N + GROUP_N - 1) / GROUP_N;
    int failed = 0;
    switch (MV) {
        GEMM_CASE(2, 12)
        GEMM_CASE(3, 8)
        GEMM_CASE(4, 6)
        default: return -1;   /* 16 inputs or fewer: the row kernel's (qmatmul.c) */
    }
    return failed ? -2 : 0;
}
#undef GEMM_CASE
