/* Paged decode attention for CPU: one query token per request, keys and values read in place from the
 * paged cache through each request's block table (no gather copy). Parallel over (request, kv head);
 * the G = heads / kv_heads query heads sharing a kv head are done together, so each K/V row is read once.
 * Math in float32 whatever the storage type (float32 or bfloat16).
 *
 *   q      [B, H, D]            out [B, H, D]
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

/* Scores of G query heads against one key row, D a multiple of 8. G is a compile-time constant at every call
 * (see SCORE_CASES) so the G accumulators live in registers: G independent FMA chains instead of one. */
static inline __attribute__((always_inline)) void score_row(const float (*qf)[MAX_D], const float *kr, int D,
                                                            int G, float *out) {
    v8 acc[MAX_G];
    for (int g = 0; g < G; g++) acc[g] = (v8){0};
    for (int d = 0; d < D; d += 8) {
        v8 y;
        memcpy(&y, kr + d, 32);
        for (int g = 0; g < G; g++) {
            v8 x;
            memcpy(&x, qf[g] + d, 32);
            acc[g] += x * y;
        }
    }
    for (int g = 0; g < G; g++)
        out[g] = ((acc[g][0] + acc[g][4]) + (acc[g][1] + acc[g][5])) + ((acc[g][2] + acc[g][6]) + (acc[g][3] + acc[g][7]));
}

static inline void axpy(float *acc, float p, const float *x, int D) {
    for (int d = 0; d < D; d += 8) {
        v8 a, b;
        memcpy(&a, acc + d, 32);
        memcpy(&b, x + d, 32);
        a += p * b;
        memcpy(acc + d, &a, 32);
    }
}

int paged_decode(const void *q, const void *k, const void *v, void *out, int bf16, const int32_t *tables,
                 int max_blocks, const int32_t *starts, const int32_t *lens, int B, int H, int KV, int D,
                 int block_size, float scale, int max_len, int num_threads) {
    const int G = H / KV;
    if (G > MAX_G || D > MAX_D || D % 8 != 0 || H % KV != 0) return -1;
    int status = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)G * (size_t)max_len);
        if (!scores) status = -2;
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < B * KV; item++) {
            if (!scores) continue;
            const int b = item / KV, h = item % KV, start = starts[b], n = lens[b] - starts[b];
            const int32_t *table = tables + (size_t)b * max_blocks;
            float qf[MAX_G][MAX_D], acc[MAX_G][MAX_D], buf[MAX_D], mx[MAX_G], sum[MAX_G];
            for (int g = 0; g < G; g++) {
                const float *qr = row(q, (size_t)b * H + h * G + g, D, bf16, buf);
                for (int d = 0; d < D; d++) qf[g][d] = qr[d] * scale;
                mx[g] = -FLT_MAX;
            }
            for (int i = 0; i < n; i++) {         /* scores = q . k for every position */
                const int pos = start + i;
                const size_t slot = (size_t)table[pos / block_size] * block_size + pos % block_size;
                const float *kr = row(k, slot * KV + h, D, bf16, buf);
                float s[MAX_G];
                switch (G) {   /* constant G per case: the accumulators stay in registers */
                    case 1: score_row(qf, kr, D, 1, s); break;
                    case 2: score_row(qf, kr, D, 2, s); break;
                    case 3: score_row(qf, kr, D, 3, s); break;
                    case 4: score_row(qf, kr, D, 4, s); break;
                    case 5: score_row(qf, kr, D, 5, s); break;
                    case 6: score_row(qf, kr, D, 6, s); break;
                    case 7: score_row(qf, kr, D, 7, s); break;
                    case 8: score_row(qf, kr, D, 8, s); break;
                    default: score_row(qf, kr, D, G, s);
                }
                for (int g = 0; g < G; g++) {
                    scores[g * n + i] = s[g];
                    if (s[g] > mx[g]) mx[g] = s[g];
                }
            }
            for (int g = 0; g < G; g++) {         /* softmax numerators */
                float t = 0.f;
                for (int i = 0; i < n; i++) {
                    const float e = expf(scores[g * n + i] - mx[g]);
                    scores[g * n + i] = e;
                    t += e;
                }
                sum[g] = t;
                memset(acc[g], 0, sizeof(float) * D);
            }
            for (int i = 0; i < n; i++) {         /* weighted sum of values */
                const int pos = start + i;
                const size_t slot = (size_t)table[pos / block_size] * block_size + pos % block_size;
                const float *vr = row(v, slot * KV + h, D, bf16, buf);
                for (int g = 0; g < G; g++) axpy(acc[g], scores[g * n + i], vr, D);
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
