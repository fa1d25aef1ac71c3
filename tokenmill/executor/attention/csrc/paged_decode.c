/* Paged decode attention for CPU: one query token per request, keys and values read in place from the
 * paged cache through each request's block table (no gather copy). Parallel over (request, kv head);
 * the G = heads / kv_heads query heads that share a kv head are done together, so each K/V row is
 * loaded once. Math in float32 whatever the storage type.
 *
 *   q      [B, H, D]            out [B, H, D]
 *   k, v   [slots, KV, D]       slot = block_tables[b][pos / block_size] * block_size + pos % block_size
 *   starts [B], lens [B]        attend positions start..len-1 (start > 0 under a sliding window)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_load(const uint16_t *p) {
    uint32_t u = (uint32_t)(*p) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fff + ((u >> 16) & 1);                                           /* round to nearest even */
    return (uint16_t)(u >> 16);
}

#define MAX_G 16
#define MAX_D 256

#define DEFINE_KERNEL(NAME, T, LOAD, STORE)                                                               \
int NAME(const T *q, const T *k, const T *v, T *out, const int32_t *tables, int max_blocks,                  \
         const int32_t *starts, const int32_t *lens, int B, int H, int KV, int D, int block_size,            \
         float scale, int max_len, int num_threads) {                                                      \
    const int G = H / KV;                                                                                  \
    if (G > MAX_G || D > MAX_D) return -1;                                                                 \
    int status = 0;                                                                                        \
    _Pragma("omp parallel num_threads(num_threads)")                                                       \
    {                                                                                                      \
        float *scores = (float *)malloc(sizeof(float) * (size_t)G * (size_t)max_len);                      \
        if (!scores) status = -2;                                                                          \
        _Pragma("omp for schedule(dynamic, 1)")                                                            \
        for (int item = 0; item < B * KV; item++) {                                                        \
            if (!scores) continue;                                                                         \
            const int b = item / KV, h = item % KV, start = starts[b], len = lens[b], n = len - start;     \
            const int32_t *table = tables + (size_t)b * max_blocks;                                        \
            float qf[MAX_G][MAX_D], acc[MAX_G][MAX_D], kf[MAX_D];                                          \
            for (int g = 0; g < G; g++)                                                                    \
                for (int d = 0; d < D; d++) qf[g][d] = LOAD(&q[((size_t)b * H + h * G + g) * D + d]) * scale; \
            float mx[MAX_G];                                                                               \
            for (int g = 0; g < G; g++) mx[g] = -INFINITY;                                                 \
            for (int i = 0; i < n; i++) {                                                                  \
                const int pos = start + i;                                                                 \
                const size_t slot = (size_t)table[pos / block_size] * block_size + pos % block_size;       \
                const T *kr = k + (slot * KV + h) * D;                                                     \
                for (int d = 0; d < D; d++) kf[d] = LOAD(&kr[d]);                                          \
                for (int g = 0; g < G; g++) {                                                              \
                    float s = 0.f;                                                                         \
                    _Pragma("omp simd reduction(+:s)")                                                     \
                    for (int d = 0; d < D; d++) s += qf[g][d] * kf[d];                                     \
                    scores[g * n + i] = s;                                                                 \
                    if (s > mx[g]) mx[g] = s;                                                              \
                }                                                                                          \
            }                                                                                              \
            float sum[MAX_G];                                                                              \
            for (int g = 0; g < G; g++) {                                                                  \
                float t = 0.f;                                                                             \
                for (int i = 0; i < n; i++) { float e = expf(scores[g * n + i] - mx[g]); scores[g * n + i] = e; t += e; } \
                sum[g] = t;                                                                                \
                for (int d = 0; d < D; d++) acc[g][d] = 0.f;                                               \
            }                                                                                              \
            for (int i = 0; i < n; i++) {                                                                  \
                const int pos = start + i;                                                                 \
                const size_t slot = (size_t)table[pos / block_size] * block_size + pos % block_size;       \
                const T *vr = v + (slot * KV + h) * D;                                                     \
                for (int d = 0; d < D; d++) kf[d] = LOAD(&vr[d]);                                          \
                for (int g = 0; g < G; g++) {                                                              \
                    const float p = scores[g * n + i];                                                     \
                    _Pragma("omp simd")                                                                    \
                    for (int d = 0; d < D; d++) acc[g][d] += p * kf[d];                                    \
                }                                                                                          \
            }                                                                                              \
            for (int g = 0; g < G; g++) {                                                                  \
                const float inv = 1.f / sum[g];                                                            \
                T *o = out + ((size_t)b * H + h * G + g) * D;                                              \
                for (int d = 0; d < D; d++) STORE(&o[d], acc[g][d] * inv);                                 \
            }                                                                                              \
        }                                                                                                  \
        free(scores);                                                                                      \
    }                                                                                                      \
    return status;                                                                                         \
}

#define F32_LOAD(p) (*(p))
#define F32_STORE(p, x) (*(p) = (x))
#define BF16_STORE(p, x) (*(p) = bf16_round(x))

DEFINE_KERNEL(paged_decode_f32, float, F32_LOAD, F32_STORE)
DEFINE_KERNEL(paged_decode_bf16, uint16_t, bf16_load, BF16_STORE)
