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
#define MAX_H 128   /* query heads */
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

/* Ask for the cache rows (heads h0 .. h0+NH-1) of position `pos` ahead of use. Blocks sit anywhere in the
 * pool, so the hardware prefetcher, which stops at page edges, loses the stream at each block; without this a
 * core waits on DRAM latency and reads K/V at ~6 GB/s. */
#define PREFETCH_AHEAD 16   /* positions: about 12 KB of K or V in flight for 3 heads of 64 */
static inline void prefetch_row(const void *base, const int32_t *table, int pos, int bs_shift, int bs_mask,
                                int KV, int h0, int NH, int D, int bf16) {
    const size_t slot = ((size_t)table[pos >> bs_shift] << bs_shift) + (pos & bs_mask);
    const size_t es = bf16 ? 2 : 4;
    const char *p = (const char *)base + (slot * KV + h0) * D * es;
    for (size_t off = 0; off < (size_t)NH * D * es; off += 64) __builtin_prefetch(p + off, 0, 3);
}

/* Slots of positions start+i .. start+i+3 (the last real one repeated past n: its weight is zero), asking for
 * base's rows PREFETCH_AHEAD positions further on. */
static inline void slots4(size_t *slot, const void *base, const int32_t *table, int start, int i, int n,
                          int bs_shift, int bs_mask, int KV, int h0, int NH, int D, int bf16) {
    for (int j = 0; j < 4; j++) {
        const int pos = start + (i + j < n ? i + j : n - 1);
        slot[j] = ((size_t)table[pos >> bs_shift] << bs_shift) + (pos & bs_mask);
        if (i + j + PREFETCH_AHEAD < n)
            prefetch_row(base, table, start + i + j + PREFETCH_AHEAD, bs_shift, bs_mask, KV, h0, NH, D, bf16);
    }
}

/* Request b, kv heads h0 .. h1-1. Each group of four positions is read for all those heads together: with
 * h0 = 0, h1 = KV that walks each cache row (KV * D values) front to back, one contiguous stream per block,
 * instead of one strided pass per head (at 64 requests the strided order ran at a third of the bandwidth). */
static void attend(const void *q, int q_stride, const void *k, const void *v, int bf16, const int32_t *table,
                   int start, int n, int b, int h0, int h1, int KV, int D, int G, int bs_shift, int bs_mask,
                   float scale, float *scores, float (*qf)[MAX_D], float (*acc)[MAX_D], float *mx, float *sum) {
    /* Positions start .. start+n-1 only: leaves acc = sum_i e_i v_i unnormalised, with mx (the max score) and
     * sum (of e_i = exp(score_i - mx)) per query head, so parts of one context can be merged (combine()). */
    const int NH = h1 - h0;               /* kv heads in this item; query heads (h, g) sit at (h - h0) * G + g */
    const size_t n4 = ((size_t)n + 3) / 4 * 4;
    float buf[4][MAX_D];
    for (int h = h0; h < h1; h++)
        for (int g = 0; g < G; g++) {
            const int r = (h - h0) * G + g;
            const void *qb = (const char *)q + (size_t)b * q_stride * (bf16 ? 2 : 4);
            const float *qr = row(qb, (size_t)h * G + g, D, bf16, buf[0]);
            for (int d = 0; d < D; d++) qf[r][d] = qr[d] * scale;
            mx[r] = -FLT_MAX;
        }
    size_t slot[4];
    for (int j = 0; j < PREFETCH_AHEAD && j < n; j++)
        prefetch_row(k, table, start + j, bs_shift, bs_mask, KV, h0, NH, D, bf16);
    for (int i = 0; i < n; i += 4) {      /* scores = q . k, four positions at a time */
        slots4(slot, k, table, start, i, n, bs_shift, bs_mask, KV, h0, NH, D, bf16);
        for (int h = h0; h < h1; h++) {
            const float *kr[4];
            float s4[MAX_G * 4];
            for (int j = 0; j < 4; j++) kr[j] = row(k, slot[j] * KV + h, D, bf16, buf[j]);
            float(*qh)[MAX_D] = qf + (h - h0) * G;
#define SCORE(GC) score4(qh, kr, D, GC, s4)
            BY_G(SCORE)
#undef SCORE
            for (int g = 0; g < G; g++) {
                const int r = (h - h0) * G + g;
                for (int j = 0; j < 4 && i + j < n; j++) {
                    scores[r * n4 + i + j] = s4[g * 4 + j];
                    if (s4[g * 4 + j] > mx[r]) mx[r] = s4[g * 4 + j];
                }
            }
        }
    }
    for (int r = 0; r < NH * G; r++) {    /* softmax numerators */
        float t = 0.f;
        for (int i = 0; i < n; i++) {
            const float e = expf(scores[r * n4 + i] - mx[r]);
            scores[r * n4 + i] = e;
            t += e;
        }
        for (size_t i = n; i < n4; i++) scores[r * n4 + i] = 0.f;   /* padding rows weigh nothing */
        sum[r] = t;
        memset(acc[r], 0, sizeof(float) * D);
    }
    for (int j = 0; j < PREFETCH_AHEAD && j < n; j++)   /* V's first rows, while the softmax runs */
        prefetch_row(v, table, start + j, bs_shift, bs_mask, KV, h0, NH, D, bf16);
    for (int i = 0; i < n; i += 4) {      /* weighted sum of values, four positions at a time */
        slots4(slot, v, table, start, i, n, bs_shift, bs_mask, KV, h0, NH, D, bf16);
        for (int h = h0; h < h1; h++) {
            const float *vr[4];
            for (int j = 0; j < 4; j++) vr[j] = row(v, slot[j] * KV + h, D, bf16, buf[j]);
            float(*ah)[MAX_D] = acc + (h - h0) * G;
            const float *sh = scores + (size_t)(h - h0) * G * n4 + i;
#define WSUM(GC) axpy4(ah, sh, (int)n4, vr, D, GC)
            BY_G(WSUM)
#undef WSUM
        }
    }
}

/* Output rows b * H + qh0 + r (r < rows) from `parts` partial results of the same query heads over disjoint
 * position ranges: part p's row r is at p * rows + r. Each part is rescaled by exp(mx_p - M) to the common max
 * M, as in flash-decoding. With one part this is just acc / sum. */
static void combine(void *out, int bf16, int b, int qh0, int rows, int H, int D, int parts, float (*acc)[MAX_D],
                    const float *mx, const float *sum) {
    for (int r = 0; r < rows; r++) {
        float M = -FLT_MAX, total = 0.f, o[MAX_D];
        memset(o, 0, sizeof(float) * D);
        for (int p = 0; p < parts; p++)
            if (sum[p * rows + r] > 0.f && mx[p * rows + r] > M) M = mx[p * rows + r];
        for (int p = 0; p < parts; p++) {
            const int pr = p * rows + r;
            if (sum[pr] <= 0.f) continue;     /* a part with no positions */
            const float w = expf(mx[pr] - M);
            total += w * sum[pr];
            for (int d = 0; d < D; d++) o[d] += w * acc[pr][d];
        }
        const float inv = 1.f / total;
        const size_t row = (size_t)b * H + qh0 + r;
        for (int d = 0; d < D; d++) {
            if (bf16) ((uint16_t *)out)[row * D + d] = f32_to_bf16(o[d] * inv);
            else ((float *)out)[row * D + d] = o[d] * inv;
        }
    }
}

int paged_decode(const void *q, int q_stride, const void *k, const void *v, void *out, int bf16, const int32_t *tables,
                 int max_blocks, const int32_t *starts, const int32_t *lens, int B, int H, int KV, int D,
                 int block_size, float scale, int max_len, int num_threads) {
    const int G = H / KV;
    if (G > MAX_G || D > MAX_D || D % 8 != 0 || H % KV != 0 || H > MAX_H) return -1;
    if (block_size <= 0 || (block_size & (block_size - 1))) return -1;
    /* block_size is a power of two: shifts and masks, not two integer divisions per position */
    const int bs_shift = __builtin_ctz(block_size), bs_mask = block_size - 1;
    /* Work units: with enough requests to keep every thread busy, one per request with all its heads; otherwise
     * one per (request, kv head). Too few units even so (a single stream: 1 x KV), and each unit's positions
     * are split into parts that run in parallel and are merged after (flash-decoding), parts of >= 64. */
    const int per_head = B < 2 * num_threads;
    const int units = per_head ? B * KV : B, rows = per_head ? G : H;
    int parts = units < 2 * num_threads ? (2 * num_threads + units - 1) / units : 1;
    if (parts > max_len / 64) parts = max_len / 64 > 1 ? max_len / 64 : 1;
    const int items = units * parts;
    float(*acc)[MAX_D] = malloc(sizeof(float) * MAX_D * (size_t)items * rows);
    float *mx = malloc(sizeof(float) * (size_t)items * rows), *sum = malloc(sizeof(float) * (size_t)items * rows);
    int status = (acc && mx && sum) ? 0 : -2;
    if (status == 0) {
#pragma omp parallel num_threads(num_threads)
        {
            float *scores = (float *)malloc(sizeof(float) * (size_t)rows * ((size_t)max_len + 4));
            float(*qf)[MAX_D] = malloc(sizeof(float) * MAX_D * (size_t)rows);
            if (!scores || !qf) status = -2;
#pragma omp for schedule(dynamic, 1)
            for (int item = 0; item < items; item++) {
                if (!scores || !qf) continue;
                const int unit = item / parts, p = item % parts;
                const int b = per_head ? unit / KV : unit, h0 = per_head ? unit % KV : 0;
                const int n = lens[b] - starts[b], chunk = (n + parts - 1) / parts;
                const int first = p * chunk, count = n - first < chunk ? n - first : chunk;
                const size_t at = (size_t)item * rows;
                if (count <= 0) {             /* a short context split into more parts than it fills */
                    for (int r = 0; r < rows; r++) sum[at + r] = 0.f;
                    continue;
                }
                attend(q, q_stride, k, v, bf16, tables + (size_t)b * max_blocks, starts[b] + first, count, b, h0,
                       per_head ? h0 + 1 : KV, KV, D, G, bs_shift, bs_mask, scale, scores, qf, acc + at, mx + at,
                       sum + at);
            }
#pragma omp for schedule(static)
            for (int unit = 0; unit < units; unit++) {
                const int b = per_head ? unit / KV : unit, h0 = per_head ? unit % KV : 0;
                const size_t at = (size_t)unit * parts * rows;
                combine(out, bf16, b, h0 * G, rows, H, D, parts, acc + at, mx + at, sum + at);
            }
            free(scores);
            free(qf);
        }
    }
    free(acc);
    free(mx);
    free(sum);
    return status;
}

/* cpu_ops.c */
void rotary(float *x, const float *cos, const float *sin, int rows, int heads, int dim, int row_stride,
            int num_threads);
int write_kv(const float *k, const float *v, int src_stride, float *k_cache, float *v_cache, const int64_t *slots,
             int rows, int width, int64_t num_slots);

/* A whole decode step's attention for one layer, float32, in one call: rotate q and k in place in the fused
 * qkv rows [B, (H + 2 KV) * D] (row stride qkv_stride), write k and v into their cache slots, attend.
 * Returns paged_decode's status, or write_kv's -3 for a slot outside the cache (nothing written). */
int decode_attention(float *qkv, int qkv_stride, float *out, const float *cos, const float *sin,
                     const int64_t *slots, int64_t num_slots, float *k_cache, float *v_cache, const int32_t *tables,
                     int max_blocks, const int32_t *starts, const int32_t *lens, int B, int H, int KV, int D,
                     int block_size, float scale, int max_len, int num_threads) {
    rotary(qkv, cos, sin, B, H + KV, D, qkv_stride, 1);
    const int rc = write_kv(qkv + (size_t)H * D, qkv + (size_t)(H + KV) * D, qkv_stride, k_cache, v_cache, slots,
                            B, KV * D, num_slots);
    if (rc != 0) return rc;
    return paged_decode(qkv, qkv_stride, k_cache, v_cache, out, 0, tables, max_blocks, starts, lens, B, H, KV, D,
                        block_size, scale, max_len, num_threads);
}
