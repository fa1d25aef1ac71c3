/* Matmul against weights kept in llama.cpp's 32-wide quantised blocks, for the few rows of a decode step:
 * there the step is bound by reading the weights, and 4-bit codes are 1/8 of float32's bytes.
 *
 *   x [B, K] float32      y [B, N] float32      y[b][n] = sum_k x[b][k] * w[n][k]
 *   block i of row n:     w[n][32i + j] = d[n][i] * c_j + m[n][i]
 *   q4 codes [N, K/2]:    16 bytes a block; byte j holds c_j (low nibble) and c_{j+16} (high nibble)
 *   q8 codes [N, K]:      32 signed bytes a block; no m
 *
 * Each block is dequantised in registers (d * c + m, as llama.cpp's reference dequantiser does) and multiplied
 * into float32 x, so the result differs from x @ dequantised(w)^T only in summation order.
 * Written with GCC vector extensions plus AVX-512 widening where -march=native has it. K is a multiple of 32.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32
#define MAX_B 8      /* inputs per pass over a row group (accumulators in registers) */
#define MAX_ROWS 64  /* inputs per call */
#define PREFETCH_ROWS 16

typedef float v16f __attribute__((vector_size(64)));

static inline v16f load16(const float *p) {
    v16f v;
    memcpy(&v, p, 64);
    return v;
}

/* The two halves (weights 0-15 and 16-31) of a block, dequantised to float32: d * code (+ m for q4). GCC turns a generic byte-to-float
 * __builtin_convertvector into scalar code, so the widening is spelled out per instruction set. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline __attribute__((always_inline)) void q4_block(const uint8_t *codes, float d, float m, v16f *lo, v16f *hi) {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes));
    *lo = (v16f)_mm512_cvtepi32_ps(_mm512_and_si512(c, _mm512_set1_epi32(15))) * d + m;
    *hi = (v16f)_mm512_cvtepi32_ps(_mm512_srli_epi32(c, 4)) * d + m;
}
static inline __attribute__((always_inline)) void q8_block(const int8_t *codes, float d, v16f *lo, v16f *hi) {
    *lo = (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)codes))) * d;
    *hi = (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + 16)))) * d;
}
/* Horizontal sum as a shuffle tree. (A memcpy-based version made GCC keep every accumulator on the stack.) */
static inline float hsum(v16f v) { return _mm512_reduce_add_ps((__m512)v); }

/* acc + a * b as one fused op: -ffast-math would otherwise regroup two FMAs into mul + fma + add */
static inline v16f fma16(v16f a, v16f b, v16f acc) { return (v16f)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc); }
#else
static inline v16f fma16(v16f a, v16f b, v16f acc) { return a * b + acc; }
static inline float hsum(v16f v) {
    float s = 0.f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}
static inline __attribute__((always_inline)) void q4_block(const uint8_t *codes, float d, float m, v16f *lo,
                                                           v16f *hi) {
    for (int j = 0; j < 16; j++) {
        (*lo)[j] = (float)(codes[j] & 15) * d + m;
        (*hi)[j] = (float)(codes[j] >> 4) * d + m;
    }
}
static inline __attribute__((always_inline)) void q8_block(const int8_t *codes, float d, v16f *lo, v16f *hi) {
    for (int j = 0; j < 16; j++) {
        (*lo)[j] = (float)codes[j] * d;
        (*hi)[j] = (float)codes[j + 16] * d;
    }
}
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
    v16f acc[4][MAX_B];   /* fully unrolled below, so these live in registers */
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int b = 0; b < B; b++) acc[r][b] = (v16f){0};
    for (int i = 0; i < nb; i++) {
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const size_t n = (size_t)n0 + r;
            v16f lo, hi;
            if (q4) q4_block(codes + n * row_bytes + (size_t)i * 16, d[n * nb + i], m[n * nb + i], &lo, &hi);
            else q8_block((const int8_t *)codes + n * row_bytes + (size_t)i * 32, d[n * nb + i], &lo, &hi);
#pragma GCC unroll 8
            for (int b = 0; b < B; b++) {
                const float *xb = x + ((size_t)i * XB + b) * QK;  /* x blocked as [K/32][XB][32] */
                acc[r][b] = fma16(hi, load16(xb + 16), fma16(lo, load16(xb), acc[r][b]));
            }
        }
    }
    for (int r = 0; r < R; r++) {
        const size_t n = (size_t)n0 + r;
        for (int b = 0; b < B; b++) y[(size_t)b * N + n] = hsum(acc[r][b]);
    }
}

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
            case 5: rows(q4, xc, XB, 5, K, N, codes, d, m, yc, n, RC, c0 == 0); break;              \
            case 6: rows(q4, xc, XB, 6, K, N, codes, d, m, yc, n, RC, c0 == 0); break;              \
            case 7: rows(q4, xc, XB, 7, K, N, codes, d, m, yc, n, RC, c0 == 0); break;              \
            default: rows(q4, xc, XB, 8, K, N, codes, d, m, yc, n, RC, c0 == 0); break;             \
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

/* y = x @ w^T for B <= MAX_ROWS rows of x. Returns 0, or a negative status for arguments it cannot take. */
int qmatmul(int q4, const float *x, int B, int K, int N, const uint8_t *codes, const float *d, const float *m,
            float *y, int num_threads) {
    if (B < 1 || B > MAX_ROWS || K % QK != 0 || N < 1) return -1;
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
