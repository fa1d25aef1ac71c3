/* Matmul against weights kept in llama.cpp's 32-wide quantised blocks, for the few rows of a decode step:
 * there the step is bound by reading the weights, and 4-bit codes are 1/8 of float32's bytes.
 *
 *   x [B, K] float32      y [B, N] float32      y[b][n] = sum_k x[b][k] * w[n][k]
 *   block i of row n:     w[n][32i + j] = d[n][i] * c_j + m[n][i]      (tokenmill.h: tm_qweight)
 *
 * With several inputs each block is dequantised in registers (simd.h's q4_block / q8_block, d * c + m as
 * llama.cpp's reference dequantiser does) and multiplied into every input; with one (gemv) a block's codes meet
 * x and its scale and offset come in once, d * sum(c x) + m * sum(x). Either way the activations stay float32,
 * and the result differs from x @ dequantised(w)^T only by float32 rounding. Written once over simd.h's vectors;
 * AVX-512 adds the lanes kernel (arch/avx512/). With int8_x, up to TM_QMATMUL_INT8_MAX_ROWS inputs take the int8
 * route instead (qmatmul_int8.c, x86): x rounded to int8 per 32, as llama.cpp does.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qmatmul.h"

/* inputs per pass over a row group (accumulators in registers): R rows x MAX_B inputs of vf, with 32 vector
 * registers (AVX-512, NEON) or 16 (AVX2, SSE) */
#if defined(__AVX512F__) || defined(__ARM_NEON)
#define MAX_B 8
#else
#define MAX_B 4
#endif
#define PREFETCH_ROWS 16
/* Above this many inputs, the many-row kernel (qgemm); AVX-512's and AVX2's cross over there (BENCHMARKS.md) */
#define GEMM_MIN_ROWS 20

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


/* One input (a single sequence's decode step). With no other input to share a dequantised block, a block's codes
 * meet x as they are and its scale and offset come in once, d * sum(c x) + m * sum(x), with sum(x) per block
 * precomputed (xs): half the vector work of dequantising first. The two terms partly cancel (m is near -8d), so
 * the rounding error is a few ulps of sum(|x| (d c + |m|)) rather than of the result; centring the codes would
 * cost 15% of the matmul (BENCHMARKS.md). GR weight rows at a time share each block's input vectors, with two
 * accumulators a row over alternate blocks: few live registers and one short loop (the row-group kernel's
 * pointers spill at B = 1, and its long body ran up to 1.7x slower with nothing but its code alignment changed). */
static inline __attribute__((always_inline)) void dot_rows(int q4, int GR, const float *x, const float *xs,
                                                           int nb, size_t row_bytes, const uint8_t *c,
                                                           const float *d, const float *m, float *y) {
    vf acc[2][2];
#pragma GCC unroll 4
    for (int r = 0; r < GR; r++) acc[r][0] = acc[r][1] = (vf){0};
#pragma GCC unroll 2
    for (int i = 0; i < nb; i++) {
        const float *xb = x + (size_t)i * QK;
        vf xv[QV];
#pragma GCC unroll 8
        for (int v = 0; v < QV; v++) xv[v] = vload(xb + v * VL);
#pragma GCC unroll 4
        for (int r = 0; r < GR; r++) {
            vf w[QV];
            if (q4) q4_codes(c + r * row_bytes + (size_t)i * 16, w);
            else q8_codes((const int8_t *)c + r * row_bytes + (size_t)i * 32, w);
            vf t = w[0] * xv[0];
#pragma GCC unroll 8
            for (int v = 1; v < QV; v++) t = vfma(w[v], xv[v], t);
            acc[r][i & 1] = vfma(vset1(d[(size_t)r * nb + i]), t, acc[r][i & 1]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < GR; r++) {
        float off = 0.f;
        if (q4)
            for (int i = 0; i < nb; i++) off += m[(size_t)r * nb + i] * xs[i];
        y[r] = vhsum(acc[r][0] + acc[r][1]) + off;
    }
}

static void gemv(int q4, const float *x, const float *xs, int K, int N, const uint8_t *codes, const float *d,
                 const float *m, float *y, int num_threads) {
    const int nb = K / QK;
    const size_t row_bytes = q4 ? (size_t)K / 2 : (size_t)K;
    const int GR = q4 ? 2 : 1;   /* Q4: two rows share the input loads; Q8's wider codes fill the registers alone */
    const int groups = N / GR;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int g = 0; g < groups; g++) {
            const size_t n = (size_t)g * GR, a = n + PREFETCH_ROWS;
            if (a + GR <= (size_t)N) {
                for (size_t off = 0; off < GR * row_bytes; off += 64)
                    __builtin_prefetch((const char *)codes + a * row_bytes + off, 0, 3);
                __builtin_prefetch(d + a * nb, 0, 3);
                if (q4) __builtin_prefetch(m + a * nb, 0, 3);
            }
            if (q4) dot_rows(1, 2, x, xs, nb, row_bytes, codes + n * row_bytes, d + n * nb, m + n * nb, y + n);
            else dot_rows(0, 1, x, xs, nb, row_bytes, codes + n * row_bytes, d + n * nb, NULL, y + n);
        }
#pragma omp single
        for (int n = groups * GR; n < N; n++)   /* the last rows, fewer than GR */
            row_range(q4, x, 1, K, N, codes, d, m, y, n, 1);
    }
}

/* ---- many rows, at the variant's own vector width (AVX-512 has its own: arch/avx512/qmatmul_gemm.c) ---------
 * Above GEMM_MIN_ROWS inputs the row kernel re-dequantises every weight row for each MAX_B inputs. Here NR weight
 * rows are dequantised KC positions at a time into ws [NR][KC] (L1), the inputs are turned round into xT [K][BP]
 * (BP: B rounded up to whole vectors, zero-padded), and a tile keeps NR x MC vectors of accumulators: per k, MC
 * loads of x and NR broadcasts of weights feed NR * MC FMAs. The inputs go MC vectors at a time, their partial
 * sums kept in yT between chunks of k; each output's sum still runs over k in order. */
#if !defined(__AVX512F__)
#if defined(__ARM_NEON)
#define G_NR 6            /* 24 accumulators + 4 inputs + a broadcast of NEON's 32 registers */
#define G_MC 4
#else
#define G_NR 4            /* 8 accumulators + 2 inputs + a broadcast of AVX2's 16 registers */
#define G_MC 2
#endif
#define G_GROUP 48        /* outputs a thread takes at a time */

TM_INLINE void tile(const float *ws, const float *xT, int BP, int k0, int kc, float *yT, int c0, int MC) {
    vf acc[G_NR][G_MC];     /* fully unrolled (MC a constant at each call), so these live in registers */
#pragma GCC unroll 8
    for (int r = 0; r < G_NR; r++)
#pragma GCC unroll 4
        for (int j = 0; j < MC; j++)
            acc[r][j] = k0 == 0 ? (vf){0} : vload(yT + (size_t)r * BP + (size_t)(c0 + j) * VL);
    for (int k = 0; k < kc; k++) {
        vf xv[G_MC];
#pragma GCC unroll 4
        for (int j = 0; j < MC; j++) xv[j] = vload(xT + (size_t)(k0 + k) * BP + (size_t)(c0 + j) * VL);
#pragma GCC unroll 8
        for (int r = 0; r < G_NR; r++) {
            const vf wb = vset1(ws[(size_t)r * KC + k]);
#pragma GCC unroll 4
            for (int j = 0; j < MC; j++) acc[r][j] = vfma(wb, xv[j], acc[r][j]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < G_NR; r++)
#pragma GCC unroll 4
        for (int j = 0; j < MC; j++) vstore(yT + (size_t)r * BP + (size_t)(c0 + j) * VL, acc[r][j]);
}

static int qgemm(int q4, const float *x, int B, int K, int N, const uint8_t *codes, const float *d,
                 const float *m, float *y, int num_threads) {
    const int nv = (B + VL - 1) / VL, BP = nv * VL;
    const int groups = (N + G_GROUP - 1) / G_GROUP;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *ws = malloc(sizeof(float) * G_NR * KC);
        float *yT = malloc(sizeof(float) * (G_GROUP + G_NR) * (size_t)BP);
        float *xT = malloc(sizeof(float) * (size_t)K * BP);
        const int ok = ws && yT && xT;
        if (!ok) failed = 1;
        else   /* each thread its own copy: cheaper than sharing one (a barrier, half of it written remotely) */
            for (int k = 0; k < K; k++)
                for (int b = 0; b < BP; b++) xT[(size_t)k * BP + b] = b < B ? x[(size_t)b * K + k] : 0.f;
        /* every thread meets the loop, even without its buffers: one that skipped it would leave the others
         * waiting at its barrier */
#pragma omp for schedule(dynamic, 1)
        for (int g = 0; g < groups; g++) {
            if (!ok) continue;
            const int g0 = g * G_GROUP, size = N - g0 < G_GROUP ? N - g0 : G_GROUP;
            for (int n0 = g0; n0 < g0 + size; n0 += G_NR) {
                const int count = g0 + size - n0 < G_NR ? g0 + size - n0 : G_NR;
                float *rows_out = yT + (size_t)(n0 - g0) * BP;
                for (int k0 = 0; k0 < K; k0 += KC) {
                    const int kc = K - k0 < KC ? K - k0 : KC;
                    dequant_rows(q4, K, codes, d, m, n0, count, G_NR, k0, kc, ws);
                    for (int c0 = 0; c0 < nv; c0 += G_MC)
                        switch (nv - c0 < G_MC ? nv - c0 : G_MC) {
                            case 1: tile(ws, xT, BP, k0, kc, rows_out, c0, 1); break;
#if G_MC > 2
                            case 2: tile(ws, xT, BP, k0, kc, rows_out, c0, 2); break;
                            case 3: tile(ws, xT, BP, k0, kc, rows_out, c0, 3); break;
#endif
                            default: tile(ws, xT, BP, k0, kc, rows_out, c0, G_MC); break;
                        }
                }
            }
            for (int b = 0; b < B; b++)
                for (int i = 0; i < size; i++) y[(size_t)b * N + g0 + i] = yT[(size_t)i * BP + b];
        }
        free(ws);
        free(yT);
        free(xT);
    }
    return failed ? -2 : 0;
}
#else
#define qgemm qgemm16
#endif

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
#if HAVE_QMATMUL_INT8
    if (a->int8_x && B <= TM_QMATMUL_INT8_MAX_ROWS) return qmatmul_int8(q4, x, B, K, N, codes, d, m, y, num_threads);
#endif
#if HAVE_LANES
    if (w->lanes_codes && B >= LANES_MIN_ROWS && B <= LANES_MAX_ROWS && N % 16 == 0)
        return qgemm_lanes(w, x, B, y, num_threads);
#endif
    if (B > GEMM_MIN_ROWS) return qgemm(q4, x, B, K, N, codes, d, m, y, num_threads);
    if (B == 1) {
        float *xs = (float *)malloc(sizeof(float) * (K / QK));
        if (!xs) return -2;
        for (int i = 0; i < K / QK; i++) {
            float s = 0.f;
            for (int j = 0; j < QK; j++) s += x[i * QK + j];
            xs[i] = s;
        }
        gemv(q4, x, xs, K, N, codes, d, m, y, num_threads);
        free(xs);
        return 0;
    }
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

TM_API int tm_qdequant(const tm_qdequant_args *a) {
    const tm_qweight *w = a->w;
    const int K = w->k, q4 = w->bits == 4;
    if (K % QK != 0 || (w->bits != 4 && w->bits != 8) || (q4 && !w->offset) || a->row0 < 0 || a->rows < 0
        || (int64_t)a->row0 + a->rows > w->n)
        return -1;
    const int nb = K / QK;
    const size_t row_bytes = q4 ? (size_t)K / 2 : (size_t)K;
    const uint8_t *codes = w->codes;
#pragma omp parallel for schedule(static) num_threads(a->rows > 8 ? a->num_threads : 1)
    for (int r = 0; r < a->rows; r++) {
        const size_t n = (size_t)a->row0 + r;
        float *out = a->out + (size_t)r * K;
        for (int i = 0; i < nb; i++) {
            vf q[QV];
            if (q4) q4_block(codes + n * row_bytes + (size_t)i * 16, w->scale[n * nb + i], w->offset[n * nb + i], q);
            else q8_block((const int8_t *)codes + n * row_bytes + (size_t)i * 32, w->scale[n * nb + i], q);
            for (int v = 0; v < QV; v++) vstore(out + (size_t)i * QK + v * VL, q[v]);
        }
    }
    return 0;
}
