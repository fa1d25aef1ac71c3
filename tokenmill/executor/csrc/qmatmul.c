/* Matmul against weights kept in llama.cpp's 32-wide quantised blocks, for the few rows of a decode step:
 * there the step is bound by reading the weights, and 4-bit codes are 1/8 of float32's bytes.
 *
 *   x [B, K] float32      y [B, N] float32      y[b][n] = sum_k x[b][k] * w[n][k]
 *   block i of row n:     w[n][32i + j] = d[n][i] * c_j + m[n][i]      (tokenmill.h: tm_qweight)
 *
 * Each block is dequantised in registers (simd.h's q4_block / q8_block, d * c + m as llama.cpp's reference
 * dequantiser does) and multiplied into float32 x, so the result differs from x @ dequantised(w)^T only in
 * summation order. Written once over simd.h's vectors; AVX-512 adds the lanes kernel (arch/avx512/).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qmatmul.h"
#include "simd.h"
#if defined(__AVX512F__)
#include "arch/avx512/transpose.h"
#endif

/* inputs per pass over a row group (accumulators in registers): R rows x MAX_B inputs of vf, with 32 vector
 * registers (AVX-512, NEON) or 16 (AVX2, SSE) */
#if defined(__AVX512F__) || defined(__ARM_NEON)
#define MAX_B 8
#else
#define MAX_B 4
#endif
#define PREFETCH_ROWS 16
/* Above this many inputs, qgemm() (BENCHMARKS.md has the crossover); its 16-input vectors are AVX-512's, and
 * narrower variants keep to the row kernel */
#if defined(__AVX512F__)
#define GEMM_MIN_ROWS 20
#else
#define GEMM_MIN_ROWS TM_QMATMUL_MAX_ROWS
#endif
#define KC 128            /* positions of weights dequantised at a time by qgemm() */

/* qgemm's vectors: 16 inputs, whatever the variant's register width (two AVX2 registers, four NEON ones) */
typedef float v16f __attribute__((vector_size(64)));

static inline v16f load16(const float *p) {
    v16f v;
    memcpy(&v, p, 64);
    return v;
}
#if defined(__AVX512F__)
static inline v16f fma16(v16f a, v16f b, v16f acc) { return (v16f)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc); }
#else
static inline v16f fma16(v16f a, v16f b, v16f acc) { return a * b + acc; }
#endif

/* R rows against B inputs: R * B independent accumulators, so a single input still keeps several FMA chains
 * in flight. R and B are compile-time constants at each call site (the switch below). */
static inline __attribute__((always_inline)) void rows(int q4, const float *x, int XB, int B, int K,
                                                       int N, const uint8_t *codes, const float *d, const float *m,
                                                       float *y, int n0, int R, int prefetch) {
    const int nb = K / QK;
    const size_t row_bytes = q4 ? (size_t)K / 2 : (size_t)K;
    /* Ask for the rows PREFETCH_ROWS ahead now: one core alone only keeps ~10 misses in flight and read its
     * rows at ~6 GB/s; with the next rows already on their way it streams. Past the end of the task's range
     * this touches the next range's rows (or beyond N: a prefetch never faults). */
    if (prefetch) {
        const size_t ahead = (size_t)n0 + PREFETCH_ROWS;
        if (ahead + R <= (size_t)N) {
            const char *c = (const char *)codes + ahead * row_bytes;
            for (size_t off = 0; off < (size_t)R * row_bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
            for (size_t off = 0; off < (size_t)R * nb * 4; off += 64) {
                __builtin_prefetch((const char *)(d + ahead * nb) + off, 0, 3);
                if (m) __builtin_prefetch((const char *)(m + ahead * nb) + off, 0, 3);
            }
        }
    }
    vf acc[4][MAX_B];     /* fully unrolled below, so these live in registers */
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int b = 0; b < B; b++) acc[r][b] = (vf){0};
    for (int i = 0; i < nb; i++) {
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const size_t n = (size_t)n0 + r;
            vf w[QV];
            if (q4) q4_block(codes + n * row_bytes + (size_t)i * 16, d[n * nb + i], m[n * nb + i], w);
            else q8_block((const int8_t *)codes + n * row_bytes + (size_t)i * 32, d[n * nb + i], w);
#pragma GCC unroll 8
            for (int b = 0; b < B; b++) {
                const float *xb = x + ((size_t)i * XB + b) * QK;  /* x blocked as [K/32][XB][32] */
#pragma GCC unroll 8
                for (int v = 0; v < QV; v++) acc[r][b] = vfma(w[v], vload(xb + v * VL), acc[r][b]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        const size_t n = (size_t)n0 + r;
        for (int b = 0; b < B; b++) y[(size_t)b * N + n] = vhsum(acc[r][b]);
    }
}

#if MAX_B == 8
#define CASES_5_TO_7(RC) \
    case 5: rows(q4, xc, XB, 5, K, N, codes, d, m, yc, n, RC, c0 == 0); break;                     \
    case 6: rows(q4, xc, XB, 6, K, N, codes, d, m, yc, n, RC, c0 == 0); break;                     \
    case 7: rows(q4, xc, XB, 7, K, N, codes, d, m, yc, n, RC, c0 == 0); break;
#else
#define CASES_5_TO_7(RC)
#endif
/* One group of RC rows against all XB inputs, MAX_B at a time: the group's codes (a few KB) stay in L1 while
 * each chunk of inputs passes over them, so more inputs cost FMAs, not weight reads. */
#define GROUP(RC)                                                                                       \
    for (int c0 = 0; c0 < XB; c0 += MAX_B) {                                                        \
        const float *xc = x + (size_t)c0 * QK;                                                      \
        float *yc = y + (size_t)c0 * N;                                                             \
        switch (XB - c0 < MAX_B ? XB - c0 : MAX_B) {                                                \
            case 1: rows(q4, xc, XB, 1, K, N, codes, d, m, yc, n, RC, c0 == 0); break;              \
            case 2: rows(q4, xc, XB, 2, K, N, codes, d, m, yc, n, RC, c0 == 0); break;              \
            case 3: rows(q4, xc, XB, 3, K, N, codes, d, m, yc, n, RC, c0 == 0); break;              \
            case 4: rows(q4, xc, XB, 4, K, N, codes, d, m, yc, n, RC, c0 == 0); break;              \
            CASES_5_TO_7(RC)                                                                        \
            default: rows(q4, xc, XB, MAX_B, K, N, codes, d, m, yc, n, RC, c0 == 0); break;         \
        }                                                                                           \
    }

/* Rows n0 .. n0+count-1 for XB inputs: groups of 4 rows for one or two inputs (more FMA chains in flight),
 * of 2 otherwise (registers: 2 rows x 8 inputs of accumulators), single rows at the end. */
static inline __attribute__((always_inline)) void row_range(int q4, const float *x, int XB, int K, int N,
                                                            const uint8_t *codes, const float *d, const float *m,
                                                            float *y, int n0, int count) {
    int n = n0;
    if (XB <= 2)
        for (; n + 4 <= n0 + count; n += 4) GROUP(4)
    for (; n + 2 <= n0 + count; n += 2) GROUP(2)
    for (; n < n0 + count; n++) GROUP(1)
}
#undef GROUP

/* ---- many rows: dequantise a few weight rows into L1, then a register-blocked GEMM over all inputs ---------
 * Above ~20 inputs the dot-product scheme above runs out of registers (it re-dequantises every row for each 8
 * inputs and reloads x from L2 per FMA pair). Here NR weight rows are dequantised KC positions at a time into
 * a float32 scratch ws [NR][KC] (L1), x is turned round (by each thread) to xT [K][16 * MV] (zero-padded), and
 * the inner loop keeps NR x MV accumulators of 16 inputs each: per k it loads MV vectors of x and broadcasts NR
 * weights, NR * MV FMAs for NR + MV loads. Sums run over k in order, so results differ from
 * x @ dequantised(w)^T only in summation order, as above. */
/* Weight rows n0 .. n0+NR-1, positions k0 .. k0+KC-1, dequantised into ws [NR][KC]; rows past N are zeros,
 * computed and never stored. */
static inline __attribute__((always_inline)) void dequant_rows(int q4, int K, const uint8_t *codes,
                                                               const float *d, const float *m, int n0, int count,
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

/* Outputs n0 .. n0+count-1 for all inputs, into rows 0 .. count-1 of yT: the accumulators stay in registers
 * over all of K while the weights arrive KC positions at a time (ws stays in L1 next to the slice of xT being
 * read). */
static inline __attribute__((always_inline)) void gemm_tile(int q4, const uint8_t *codes, const float *d,
                                                            const float *m, const float *xT, int K, float *ws,
                                                            int NR, int MV, float *yT, int n0, int count) {
    v16f acc[12][4];
#pragma GCC unroll 12
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int j = 0; j < MV; j++) acc[r][j] = (v16f){0};
    const int BP = 16 * MV;
    for (int k0 = 0; k0 < K; k0 += KC) {
        const int kc = K - k0 < KC ? K - k0 : KC;
        dequant_rows(q4, K, codes, d, m, n0, count, NR, k0, kc, ws);
        for (int k = 0; k < kc; k++) {
            v16f xv[4];
#pragma GCC unroll 4
            for (int j = 0; j < MV; j++) xv[j] = load16(xT + (size_t)(k0 + k) * BP + 16 * j);
#pragma GCC unroll 12
            for (int r = 0; r < NR; r++) {
                const v16f wb = (v16f){0} + ws[(size_t)r * KC + k];    /* broadcast */
#pragma GCC unroll 4
                for (int j = 0; j < MV; j++) acc[r][j] = fma16(wb, xv[j], acc[r][j]);
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
#if defined(__AVX512F__)
            __m512 r[16];
            for (int i = 0; i < 16; i++)
                r[i] = i < nn ? _mm512_loadu_ps(yT + (size_t)(i0 + i) * BP + b0) : _mm512_setzero_ps();
            transpose16(r);
            const __mmask16 mask = (__mmask16)((1u << nn) - 1);
            for (int l = 0; l < 16 && b0 + l < B; l++)
                _mm512_mask_storeu_ps(y + (size_t)(b0 + l) * N + n0 + i0, mask, r[l]);
#else
            float t[16][16];
            for (int i = 0; i < nn; i++)
                for (int l = 0; l < 16; l++) t[l][i] = yT[(size_t)(i0 + i) * BP + b0 + l];
            for (int l = 0; l < 16 && b0 + l < B; l++)
                memcpy(y + (size_t)(b0 + l) * N + n0 + i0, t[l], sizeof(float) * nn);
#endif
        }
    }
}

/* xT [K][BP] = x [B][K] turned round, rows past B zero (K a multiple of 16). Each thread of qgemm() turns its own
 * copy: 16 x 16 squares through registers cost less than sharing one copy would (a second parallel region, a
 * barrier, and half of every thread's xT written by the other core). A batch-64 step's 120 matrices, cold
 * weights, two threads: ~3-10% faster than the shared scalar copy it replaced. */
static void turn_inputs(const float *x, int B, int K, int BP, float *xT) {
    for (int k0 = 0; k0 < K; k0 += 16)
        for (int b0 = 0; b0 < BP; b0 += 16) {
#if defined(__AVX512F__)
            __m512 r[16];
            for (int i = 0; i < 16; i++)
                r[i] = b0 + i < B ? _mm512_loadu_ps(x + (size_t)(b0 + i) * K + k0) : _mm512_setzero_ps();
            transpose16(r);
            for (int j = 0; j < 16; j++) _mm512_store_ps(xT + (size_t)(k0 + j) * BP + b0, r[j]);
#else
            for (int i = 0; i < 16; i++)
                for (int j = 0; j < 16; j++)
                    xT[(size_t)(k0 + j) * BP + b0 + i] = b0 + i < B ? x[(size_t)(b0 + i) * K + k0 + j] : 0.f;
#endif
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

static int qgemm(int q4, const float *x, int B, int K, int N, const uint8_t *codes, const float *d,
                 const float *m, float *y, int num_threads) {
    const int MV = (B + 15) / 16, BP = 16 * MV;
    const int groups = (N + GROUP_N - 1) / GROUP_N;
    int failed = 0;
    switch (MV) {
        GEMM_CASE(2, 12)
        GEMM_CASE(3, 8)
        GEMM_CASE(4, 6)
    }
    return failed ? -2 : 0;
}
#undef GEMM_CASE

#if !HAVE_LANES
TM_API int tm_pack_lanes(const tm_qweight *w) {
    (void)w;
    return -1;   /* no lanes kernel in this variant: callers keep only the row layout */
}
#endif

TM_API int tm_qmatmul(const tm_qmatmul_args *a) {
    const tm_qweight *w = a->w;
    const int B = a->rows, K = w->k, N = w->n, q4 = w->bits == 4, num_threads = a->num_threads;
    const float *x = a->x;
    float *y = a->y;
    const uint8_t *codes = w->codes;
    const float *d = w->scale, *m = w->offset;
    if (B < 1 || B > TM_QMATMUL_MAX_ROWS || K % QK != 0 || N < 1 || (w->bits != 4 && w->bits != 8)
        || (q4 && !m))
        return -1;
#if HAVE_LANES
    if (w->lanes_codes && B >= LANES_MIN_ROWS && B <= LANES_MAX_ROWS && N % 16 == 0)
        return qgemm_lanes(w, x, B, y, num_threads);
#endif
    if (B > GEMM_MIN_ROWS) return qgemm(q4, x, B, K, N, codes, d, m, y, num_threads);
    /* x as [K/32][B][32]: the B slices a block multiplies sit together instead of K floats apart (at K = 1536
     * those strides alias in L1 and B = 8 ran 3x slower) */
    float *xt = (float *)malloc(sizeof(float) * (size_t)B * K);
    if (!xt) return -2;
    for (int b = 0; b < B; b++)
        for (int i = 0; i < K / QK; i++) memcpy(xt + ((size_t)i * B + b) * QK, x + (size_t)b * K + (size_t)i * QK, QK * 4);
    const int chunk = 16;  /* rows per task: whole 4-row groups, small enough to balance two threads */
    const int tasks = (N + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int t = 0; t < tasks; t++) {
        const int n0 = t * chunk, count = n0 + chunk <= N ? chunk : N - n0;
        if (q4) row_range(1, xt, B, K, N, codes, d, m, y, n0, count);
        else row_range(0, xt, B, K, N, codes, d, m, y, n0, count);
    }
    free(xt);
    return 0;
}
