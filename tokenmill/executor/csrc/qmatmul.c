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

#include "simd16.h"

#define QK 32
#define MAX_B 8      /* inputs per pass over a row group (accumulators in registers) */
#define MAX_ROWS 64  /* inputs per call */
#define PREFETCH_ROWS 16
/* Above this many inputs, qgemm(). SmolLM2's 120 matrices, cold, on the 2-core dev machine, row dot products
 * vs qgemm: 16 rows 23 ms either way; 17: 26 vs 33 (qgemm pads to 32); 24: 48 vs 45; 32: 49 vs 35; 64: 166
 * vs 57. (Against MKL: layers/quant.py.) */
#define GEMM_MIN_ROWS 20
#define KC 128            /* positions of weights dequantised at a time by qgemm() */

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
/* 16 bytes of q4 codes as d * code + m, low nibbles into lo and high nibbles into hi; 16 signed q8 codes as
 * d * code. The one spelling of the arithmetic, so every kernel dequantises to the same bits: d and m broadcast
 * (a block of one row) or per lane (the lanes layout's 16 rows). */
static inline __attribute__((always_inline)) void q4_16(const uint8_t *codes, v16f d, v16f m, v16f *lo, v16f *hi) {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes));
    *lo = (v16f)_mm512_cvtepi32_ps(_mm512_and_si512(c, _mm512_set1_epi32(15))) * d + m;
    *hi = (v16f)_mm512_cvtepi32_ps(_mm512_srli_epi32(c, 4)) * d + m;
}
static inline __attribute__((always_inline)) v16f q8_16(const int8_t *codes, v16f d) {
    return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)codes))) * d;
}
static inline __attribute__((always_inline)) void q4_block(const uint8_t *codes, float d, float m, v16f *lo, v16f *hi) {
    q4_16(codes, (v16f){0} + d, (v16f){0} + m, lo, hi);
}
static inline __attribute__((always_inline)) void q8_block(const int8_t *codes, float d, v16f *lo, v16f *hi) {
    *lo = q8_16(codes, (v16f){0} + d);
    *hi = q8_16(codes + 16, (v16f){0} + d);
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
            v16f lo, hi;
            if (q4) q4_block(codes + n * row_bytes + (size_t)i * 16, d[n * nb + i], m[n * nb + i], &lo, &hi);
            else q8_block((const int8_t *)codes + n * row_bytes + (size_t)i * 32, d[n * nb + i], &lo, &hi);
            memcpy(w + (size_t)i * QK - k0, &lo, 64);
            memcpy(w + (size_t)i * QK - k0 + 16, &hi, 64);
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

/* ---- the lanes layout: output rows along the vector lanes, so no input is padded ---------------------------
 * qgemm() keeps 16 inputs in a vector and computes whole vectors: 33 inputs cost 48, 49 cost 64. Here the 16
 * lanes hold 16 outputs and each input is a broadcast, so B inputs cost B. The blocks are re-laid out once at
 * load time (pack_lanes) so that one 16-byte load holds a position's codes for 16 rows:
 *   q4: row tile t (rows 16t .. 16t+15), block i: 16 x 16 bytes, byte [j][r] = c_j | c_{j+16} << 4 of row 16t+r
 *   q8: 32 x 16 bytes, byte [j][r] = c_j of row 16t + r
 *   scale and offset [N/16][K/32][16]
 * A thread dequantises a panel of LANES_NP rows over all of K into ws [K][LANES_NP] (q4_16 / q8_16, as the
 * other kernels) and runs every input over it, LANES_RB at a time; sums run over k in order as in qgemm (equal bits).
 * Above 40 inputs qgemm wins: its padding is small there, and it dequantises into L1 alongside its FMAs where
 * this kernel dequantises a whole panel first. SmolLM2's 120 matrices, cold, two threads, dev machine, medians
 * of 11 alternated runs, row dot products / qgemm vs lanes: 8 inputs 16.2 vs 15.7 ms, 9: 21.7 vs 18.7,
 * 12: 27.8 vs 22.0, 16: 33.4 vs 29.1, 20: 51.6 vs 33.5, 24: 44.4 vs 34.6, 33: 57.7 vs 50.7, 40: 70.8 vs 62.8,
 * 44: 61.5 vs 64.3, 48: 60.0 vs 63.9, 56: 69.5 vs 76.5, 64: 76.2 vs 81.3. */
#if defined(__AVX512F__)
#define LANES_NP 48   /* outputs per panel, 3 vectors: divides SmolLM2's 576, 960, 3072 and 49152 */
#define LANES_RB 8    /* inputs per register block: 8 x 3 accumulators */
#define LANES_MIN_ROWS 9
#define LANES_MAX_ROWS 40

int pack_lanes(int q4, int K, int N, const uint8_t *codes, const float *d, const float *m, uint8_t *lcodes,
               float *ld, float *lm) {
    if (K % QK != 0 || N % 16 != 0) return -1;
    const int nb = K / QK;
    const size_t row_bytes = q4 ? (size_t)K / 2 : (size_t)K, bb = q4 ? 16 : 32;
    for (int t = 0; t < N / 16; t++)
        for (int i = 0; i < nb; i++) {
            uint8_t *o = lcodes + ((size_t)t * nb + i) * 16 * bb;
            const size_t s0 = ((size_t)t * nb + i) * 16;
            for (int r = 0; r < 16; r++) {
                const size_t n = (size_t)t * 16 + r;
                const uint8_t *c = codes + n * row_bytes + (size_t)i * bb;
                for (size_t j = 0; j < bb; j++) o[j * 16 + r] = c[j];
                ld[s0 + r] = d[n * nb + i];
                if (m) lm[s0 + r] = m[n * nb + i];
            }
        }
    return 0;
}

/* ws [K][np] = rows n0 .. n0+np-1 (np a multiple of 16), dequantised */
static void lanes_dequant(int q4, int K, const uint8_t *lcodes, const float *ld, const float *lm, int n0, int np,
                          float *ws) {
    const int nb = K / QK;
    const size_t bb = q4 ? 16 : 32;
    for (int v = 0; v < np / 16; v++) {
        const size_t t = (size_t)n0 / 16 + v;
        for (int i = 0; i < nb; i++) {
            const uint8_t *c = lcodes + (t * nb + i) * 16 * bb;
            const v16f dv = load16(ld + (t * nb + i) * 16);
            float *w = ws + (size_t)i * QK * np + 16 * v;
            if (q4) {
                const v16f mv = load16(lm + (t * nb + i) * 16);
                for (int j = 0; j < 16; j++) {
                    v16f lo, hi;
                    q4_16(c + 16 * j, dv, mv, &lo, &hi);
                    _mm512_store_ps(w + (size_t)j * np, (__m512)lo);
                    _mm512_store_ps(w + (size_t)(j + 16) * np, (__m512)hi);
                }
            } else {
                for (int j = 0; j < 32; j++)
                    _mm512_store_ps(w + (size_t)j * np, (__m512)q8_16((const int8_t *)c + 16 * j, dv));
            }
        }
    }
}

/* y[b][n0 .. n0+16NV) for inputs b0 .. b0+R-1 over all of K from the panel ws [K][16NV] */
static inline __attribute__((always_inline)) void lanes_rows(const float *x, int K, const float *ws, int NV, int R,
                                                             float *y, int N, int b0, int n0) {
    __m512 acc[LANES_RB][3];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 3
        for (int j = 0; j < NV; j++) acc[r][j] = _mm512_setzero_ps();
    const float *xr = x + (size_t)b0 * K;
    for (int k = 0; k < K; k++) {
        __m512 w[3];
#pragma GCC unroll 3
        for (int j = 0; j < NV; j++) w[j] = _mm512_load_ps(ws + (size_t)k * 16 * NV + 16 * j);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const __m512 xb = _mm512_set1_ps(xr[(size_t)r * K + k]);
#pragma GCC unroll 3
            for (int j = 0; j < NV; j++) acc[r][j] = _mm512_fmadd_ps(xb, w[j], acc[r][j]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 3
        for (int j = 0; j < NV; j++) _mm512_storeu_ps(y + (size_t)(b0 + r) * N + n0 + 16 * j, acc[r][j]);
}

/* every input over one panel of NV vectors (R and NV constants at each call, so acc stays in registers) */
#define LANES_PANEL(NV)                                                                                 \
    for (int b0 = 0; b0 < B; b0 += LANES_RB) {                                                      \
        switch (B - b0 < LANES_RB ? B - b0 : LANES_RB) {                                            \
            case 1: lanes_rows(x, K, ws, NV, 1, y, N, b0, n0); break;                               \
            case 2: lanes_rows(x, K, ws, NV, 2, y, N, b0, n0); break;                               \
            case 3: lanes_rows(x, K, ws, NV, 3, y, N, b0, n0); break;                               \
            case 4: lanes_rows(x, K, ws, NV, 4, y, N, b0, n0); break;                               \
            case 5: lanes_rows(x, K, ws, NV, 5, y, N, b0, n0); break;                               \
            case 6: lanes_rows(x, K, ws, NV, 6, y, N, b0, n0); break;                               \
            case 7: lanes_rows(x, K, ws, NV, 7, y, N, b0, n0); break;                               \
            default: lanes_rows(x, K, ws, NV, 8, y, N, b0, n0); break;                              \
        }                                                                                           \
    }

static int qgemm_lanes(int q4, const float *x, int B, int K, int N, const uint8_t *lcodes, const float *ld,
                       const float *lm, float *y, int num_threads) {
    const int panels = (N + LANES_NP - 1) / LANES_NP;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *ws = aligned_alloc(64, sizeof(float) * (size_t)K * LANES_NP);
        if (!ws) failed = 1;
        /* dynamic: with static halves, one core running slower (a neighbour, an interrupt) left the other
         * waiting at the barrier, ~3.5 ms a 21-40-row step of offline-64 */
#pragma omp for schedule(dynamic, 1)
        for (int p = 0; p < panels; p++) {
            if (!ws) continue;
            const int n0 = p * LANES_NP, np = N - n0 < LANES_NP ? N - n0 : LANES_NP;
            lanes_dequant(q4, K, lcodes, ld, lm, n0, np, ws);
            switch (np / 16) {
                case 1: LANES_PANEL(1) break;
                case 2: LANES_PANEL(2) break;
                default: LANES_PANEL(3) break;
            }
        }
        free(ws);
    }
    return failed ? -2 : 0;
}
#undef LANES_PANEL
#else
int pack_lanes(int q4, int K, int N, const uint8_t *codes, const float *d, const float *m, uint8_t *lcodes,
               float *ld, float *lm) {
    return -1;   /* no lanes kernel without AVX-512: callers keep only the row layout */
}
#endif

/* y = x @ w^T for B <= MAX_ROWS rows of x; lcodes/ld/lm: the lanes layout of the same weights, or NULL. Returns
 * 0, or a negative status for arguments it cannot take. */
int qmatmul(int q4, const float *x, int B, int K, int N, const uint8_t *codes, const float *d, const float *m,
            const uint8_t *lcodes, const float *ld, const float *lm, float *y, int num_threads) {
    if (B < 1 || B > MAX_ROWS || K % QK != 0 || N < 1) return -1;
#if defined(__AVX512F__)
    if (lcodes && B >= LANES_MIN_ROWS && B <= LANES_MAX_ROWS && N % 16 == 0)
        return qgemm_lanes(q4, x, B, K, N, lcodes, ld, lm, y, num_threads);
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
