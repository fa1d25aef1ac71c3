/* Paged decode attention for CPU: one query token per request, keys and values read in place from the
 * paged cache through each request's block table (no gather copy). Parallel over (request, kv head);
 * the G = heads / kv_heads query heads sharing a kv head are done together, so each K/V row is read once.
 * Math in float32 whatever the storage type (float32 or bfloat16).
 *
 *   q      [B, H, D]            out [B, H, D]      (q's rows q_stride elements apart: a view into fused qkv)
 *   k, v   [slots, KV, D]       slot = tables[b][pos / block_size] * block_size + pos % block_size
 *   starts [B], lens [B]        attend positions start..len-1 (start > 0 under a sliding window)
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_G 16
#define MAX_D 256

typedef float v8 __attribute__((vector_size(32)));

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fff + ((u >> 16) & 1);                                           /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* Row `idx` (D elements) of a float32 or bfloat16 tensor as float32: in place, or converted into buf. */
static inline const float *row(const void *base, size_t idx, int D, int bf16, float *buf) {
    if (!bf16) return (const float *)base + idx * D;
    const uint16_t *r = (const uint16_t *)base + idx * D;
    for (int d = 0; d < D; d++) buf[d] = bf16_to_f32(r[d]);
    return buf;
}

/* Four key rows at once against G query heads: 4 * G independent FMA chains, so the loop runs at the FMA
 * units' throughput instead of their latency. G is a compile-time constant at each call site (the switch
 * below), which keeps the accumulators in registers. out[g * 4 + j] = q_g . k_j. D is a multiple of 8. */
static inline __attribute__((always_inline)) void score4(const float (*qf)[MAX_D], const float *const *kr, int D,
                                                         int G, float *out) {
    v8 acc[MAX_G][4];
    for (int g = 0; g < G; g++)
        for (int j = 0; j < 4; j++) acc[g][j] = (v8){0};
    for (int d = 0; d < D; d += 8) {
        v8 y[4];
        for (int j = 0; j < 4; j++) memcpy(&y[j], kr[j] + d, 32);
        for (int g = 0; g < G; g++) {
            v8 x;
            memcpy(&x, qf[g] + d, 32);
            for (int j = 0; j < 4; j++) acc[g][j] += x * y[j];
        }
    }
    for (int g = 0; g < G; g++)
        for (int j = 0; j < 4; j++) {
            v8 t = acc[g][j];
            out[g * 4 + j] = ((t[0] + t[4]) + (t[1] + t[5])) + ((t[2] + t[6]) + (t[3] + t[7]));
        }
}

/* acc_g += sum_j p[g][j] * v_j over four value rows: one load and store of acc per 4 rows. */
static inline __attribute__((always_inline)) void axpy4(float (*acc)[MAX_D], const float *p, int n,
                                                        const float *const *vr, int D, int G) {
    for (int d = 0; d < D; d += 8) {
        v8 y[4];
        for (int j = 0; j < 4; j++) memcpy(&y[j], vr[j] + d, 32);
        for (int g = 0; g < G; g++) {
            v8 a;
            memcpy(&a, acc[g] + d, 32);
            const float *pg = p + (size_t)g * n;
            a += pg[0] * y[0] + pg[1] * y[1] + pg[2] * y[2] + pg[3] * y[3];
            memcpy(acc[g] + d, &a, 32);
        }
    }
}

#define BY_G(CALL)                                                                                  \
    switch (G) { /* constant G per case: the accumulators stay in registers */                      \
        case 1: CALL(1); break;                                                                     \
        case 2: CALL(2); break;                                                                     \
        case 3: CALL(3); break;                                                                     \
        case 4: CALL(4); break;                                                                     \
        case 6: CALL(6); break;                                                                     \
        case 8: CALL(8); break;                                                                     \
        default: CALL(G);                                                                           \
    }

int paged_decode(const void *q, int q_stride, const void *k, const void *v, void *out, int bf16, const int32_t *tables,
                 int max_blocks, const int32_t *starts, const int32_t *lens, int B, int H, int KV, int D,
                 int block_size, float scale, int max_len, int num_threads) {
    const int G = H / KV;
    if (G > MAX_G || D > MAX_D || D % 8 != 0 || H % KV != 0) return -1;
    int status = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)G * ((size_t)max_len + 4));
        if (!scores) status = -2;
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < B * KV; item++) {
            if (!scores) continue;
            const int b = item / KV, h = item % KV, start = starts[b], n = lens[b] - starts[b];
            const int32_t *table = tables + (size_t)b * max_blocks;
            float qf[MAX_G][MAX_D], acc[MAX_G][MAX_D], buf[4][MAX_D], mx[MAX_G], sum[MAX_G];
            for (int g = 0; g < G; g++) {
                const void *qb = (const char *)q + (size_t)b * q_stride * (bf16 ? 2 : 4);
                const float *qr = row(qb, (size_t)h * G + g, D, bf16, buf[0]);
                for (int d = 0; d < D; d++) qf[g][d] = qr[d] * scale;
                mx[g] = -FLT_MAX;
            }
            const size_t n4 = ((size_t)n + 3) / 4 * 4;
            for (int i = 0; i < n; i += 4) {      /* scores = q . k, four positions at a time */
                const float *kr[4];
                float s4[MAX_G * 4];
                for (int j = 0; j < 4; j++) {
                    const int pos = start + (i + j < n ? i + j : n - 1);
                    const size_t slot = (size_t)table[pos / block_size] * block_size + pos % block_size;
                    kr[j] = row(k, slot * KV + h, D, bf16, buf[j]);
                }
#define SCORE(GC) score4(qf, kr, D, GC, s4)
                BY_G(SCORE)
#undef SCORE
                for (int g = 0; g < G; g++)
                    for (int j = 0; j < 4 && i + j < n; j++) {
                        scores[g * n4 + i + j] = s4[g * 4 + j];
                        if (s4[g * 4 + j] > mx[g]) mx[g] = s4[g * 4 + j];
                    }
            }
            for (int g = 0; g < G; g++) {         /* softmax numerators */
                float t = 0.f;
                for (int i = 0; i < n; i++) {
                    const float e = expf(scores[g * n4 + i] - mx[g]);
                    scores[g * n4 + i] = e;
                    t += e;
                }
                for (size_t i = n; i < n4; i++) scores[g * n4 + i] = 0.f;   /* padding rows weigh nothing */
                sum[g] = t;
                memset(acc[g], 0, sizeof(float) * D);
            }
            for (int i = 0; i < n; i += 4) {      /* weighted sum of values, four positions at a time */
                const float *vr[4];
                for (int j = 0; j < 4; j++) {
                    const int pos = start + (i + j < n ? i + j : n - 1);
                    const size_t slot = (size_t)table[pos / block_size] * block_size + pos % block_size;
                    vr[j] = row(v, slot * KV + h, D, bf16, buf[j]);
                }
#define WSUM(GC) axpy4(acc, scores + i, (int)n4, vr, D, GC)
                BY_G(WSUM)
#undef WSUM
            }
            for (int g = 0; g < G; g++) {
                const float inv = 1.f / sum[g];
                const size_t o = ((size_t)b * H + h * G + g) * D;
                for (int d = 0; d < D; d++) {
                    if (bf16) ((uint16_t *)out)[o + d] = f32_to_bf16(acc[g][d] * inv);
                    else ((float *)out)[o + d] = acc[g][d] * inv;
                }
            }
        }
        free(scores);
    }
    return status;
}
