/* Paged attention for CPU, reading keys and values in place from the paged cache through block tables (no
 * gather copy). The entry points (tokenmill.h) share one core (attend_rows):
 *   tm_paged_decode   one query token per request; a prefix of blocks that every request shares (prefix
 *                     caching) can be attended once for the whole batch (cascade attention) and merged with
 *                     each request's own suffix;
 *   tm_paged_prefill  several query tokens per request over a context already in the cache (a prefix-cache
 *                     hit, a later chunk of a chunked prefill), causal;
 *   tm_write_kv       the step's K/V into their slots;
 *   tm_decode_attention  rotary + KV write + paged decode of fused qkv rows, for the one-call decode layer.
 * Math in float32 whatever the storage types: q and out float32 or bfloat16 (q_bf16), the cache float32,
 * bfloat16, int8 with a scale per 32 values of a kv head, int4 in groups of 32, or fp8 (e4m3, e5m2) with a scale per
 * kv head (tm_kv_cache.format, kv_cache_dtype). With AVX-512 and D a multiple of 16, paged_decode
 * runs its items through decode_fast (arch/avx512/attention_fast.c) instead: a request's own positions (one query token per
 * head: little arithmetic per byte, where decode_fast's two passes spend about half of attend_rows'
 * instructions) and the cascade's shared prefix (a tile's 48 rows, without per-chunk rescaling); so does
 * paged_prefill (a tile of 16 tokens x G rows, causal masks in the softmax; contexts past FAST_N in parts whose
 * softmaxes are merged).
 *
 *   q      [B, H, D]            out [B, H, D]      (q's rows q_stride elements apart: a view into fused qkv)
 *   k, v   [slots, KV, D]       slot = tables[b][pos / block_size] * block_size + pos % block_size
 *   starts [B], lens [B]        attend positions start..len-1 (start > 0 under a sliding window)
 * A soft cap (Gemma 2) turns each score s into cap * tanh(s / cap) before the softmax, on every path; a model
 * whose layers have windows of their own calls once per KV group, each with its group's window. A head's sink
 * (gpt-oss) is one more score in each of its rows' softmax, with no value: it joins where a row is normalised.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "fp8.h"
#include "half.h"

typedef float v8 __attribute__((vector_size(32)));


/* Query row `idx` (D values) of q, scaled, as float32 into dst. */
static inline void load_q(float *dst, const void *q, int bf16, size_t idx, int D, float scale) {
    if (bf16)
        for (int d = 0; d < D; d++) dst[d] = bf16_to_f32(((const uint16_t *)q)[idx * D + d]) * scale;
    else
        for (int d = 0; d < D; d++) dst[d] = ((const float *)q)[idx * D + d] * scale;
}

/* Eight horizontal sums at once: r[j] = sum of a[j]'s lanes. Three rounds of pairwise adds on shuffles that map
 * to single instructions (vshufps, vperm2f128), instead of a scalar reduction per dot product. */
static inline v8 hsum8(const v8 *a) {
#define EVEN(x, y) __builtin_shufflevector(x, y, 0, 2, 8, 10, 4, 6, 12, 14)
#define ODD(x, y) __builtin_shufflevector(x, y, 1, 3, 9, 11, 5, 7, 13, 15)
    v8 x[4];
    for (int i = 0; i < 4; i++) x[i] = EVEN(a[2 * i], a[2 * i + 1]) + ODD(a[2 * i], a[2 * i + 1]);
    const v8 y0 = EVEN(x[0], x[1]) + ODD(x[0], x[1]);   /* a0..a3 per lane */
    const v8 y1 = EVEN(x[2], x[3]) + ODD(x[2], x[3]);   /* a4..a7 */
#undef EVEN
#undef ODD
    return __builtin_shufflevector(y0, y1, 0, 1, 2, 3, 8, 9, 10, 11)
           + __builtin_shufflevector(y0, y1, 4, 5, 6, 7, 12, 13, 14, 15);
}

/* Scores of NR (1 or 2) query rows against 8 key rows: out[r][j] = q_r . k_j. The NR rows share each key load;
 * 8 * NR independent FMA chains keep the FMA units busy. NR is a constant at each call site. */
static inline __attribute__((always_inline)) void score8(const float *const *q, int NR, const float *const *kr,
                                                         int D, float *const *out) {
    v8 acc[2][8];
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < 8; j++) acc[r][j] = (v8){0};
    for (int d = 0; d < D; d += 8) {
        v8 x[2];
        for (int r = 0; r < NR; r++) memcpy(&x[r], q[r] + d, 32);
        for (int j = 0; j < 8; j++) {
            v8 y;
            memcpy(&y, kr[j] + d, 32);
            for (int r = 0; r < NR; r++) acc[r][j] += x[r] * y;
        }
    }
    for (int r = 0; r < NR; r++) {
        const v8 s = hsum8(acc[r]);
        memcpy(out[r], &s, 32);
    }
}

/* acc_r[d0 .. d0 + 8 NV) += sum_j p_r[j] * v_j[...] over n value rows, for NR rows sharing each value load; the
 * accumulators stay in registers for the whole run of positions. NR and NV are constants at each call site. */
static inline __attribute__((always_inline)) void wsum(float *const *acc, const float *const *p, int NR,
                                                       const float *const *vr, int n, int d0, int NV) {
    v8 a[2][8];
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < NV; i++) memcpy(&a[r][i], acc[r] + d0 + 8 * i, 32);
    for (int j = 0; j < n; j++)
        for (int i = 0; i < NV; i++) {
            v8 y;
            memcpy(&y, vr[j] + d0 + 8 * i, 32);
            for (int r = 0; r < NR; r++) a[r][i] += p[r][j] * y;
        }
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < NV; i++) memcpy(acc[r] + d0 + 8 * i, &a[r][i], 32);
}

/* Fold one chunk's scores s[0 .. n) of a row into its online-softmax state (running max m, sum l, unnormalised
 * acc), attending only positions lo .. hi-1 of the chunk. Leaves s as the weights e^(s - m_new) (0 outside
 * lo .. hi-1) and rescales acc by e^(m_old - m_new). Returns 0 when the row attends nothing here. */
static int fold(float *s, int n, int lo, int hi, float *m, float *l, float *acc, int D) {
    if (lo >= hi) return 0;
    float cm = -FLT_MAX;
    for (int j = lo; j < hi; j++) cm = s[j] > cm ? s[j] : cm;
    const float mn = cm > *m ? cm : *m;
    float t = 0.f;
#pragma omp simd reduction(+ : t)
    for (int j = 0; j < n; j++) {   /* one vector exp (libmvec) over the chunk; masked lanes weigh 0 */
        const float e = expf(s[j] - mn);
        s[j] = (j >= lo && j < hi) ? e : 0.f;
        t += s[j];
    }
    if (mn > *m) {
        const float alpha = *m == -FLT_MAX ? 0.f : expf(*m - mn);
        for (int d = 0; d < D; d++) acc[d] *= alpha;
        *l *= alpha;
        *m = mn;
    }
    *l += t;
    return 1;
}

/* One kv head's int4 codes (D / 2 bytes) and its groups' half (d, m) pairs, as D floats: code * d + m */
static inline void dequant_row_i4(const uint8_t *q, const uint16_t *dm, float *out, int D) {
    for (int g = 0; g < D / TM_KV_INT4_GROUP; g++, q += 16, out += 32) {
        const float d = tm_half_to_f32(dm[2 * g]), m = tm_half_to_f32(dm[2 * g + 1]);
        for (int i = 0; i < 16; i++) {
            out[i] = (float)(q[i] & 15) * d + m;
            out[i + 16] = (float)(q[i] >> 4) * d + m;
        }
    }
}

/* Each fp8 code's value, e4m3's then e5m2's: a read is one L1 lookup. Filled as the library loads. */
static float fp8_values[2][256];

__attribute__((constructor)) static void fill_fp8_values(void) {
    for (int c = 0; c < 256; c++) {
        fp8_values[0][c] = tm_fp8_to_f32((uint8_t)c, 0);
        fp8_values[1][c] = tm_fp8_to_f32((uint8_t)c, 1);
    }
}

/* Pointers to the K and V rows of kv head h at the chunk's slots (n8 of them, padded slots repeat a real one);
 * rows of the other formats are converted into kbuf/vbuf (a chunk's rows, L1-resident: no float copy of the cache). */
static void chunk_rows(const ctx_t *c, const size_t *slot, int n8, int h, const float **kr, const float **vr,
                       float (*kbuf)[MAX_D], float (*vbuf)[MAX_D]) {
    const int D = c->D;
    for (int j = 0; j < n8; j++) {
        const size_t row = slot[j] * c->KV + h, idx = row * D;
        if (c->fmt == TM_KV_F32) {
            kr[j] = (const float *)c->k + idx;
            vr[j] = (const float *)c->v + idx;
            continue;
        }
        if (c->fmt == TM_KV_BF16) {
            for (int d = 0; d < D; d++) {
                kbuf[j][d] = bf16_to_f32(((const uint16_t *)c->k)[idx + d]);
                vbuf[j][d] = bf16_to_f32(((const uint16_t *)c->v)[idx + d]);
            }
        } else if (c->fmt == TM_KV_INT8) {
            const int8_t *kq = (const int8_t *)c->k + idx, *vq = (const int8_t *)c->v + idx;
            const int G = i8_group(D);
            const float *ks = (const float *)c->ks + row * (D / G), *vs = (const float *)c->vs + row * (D / G);
            for (int d = 0; d < D; d++) {
                kbuf[j][d] = (float)kq[d] * ks[d / G];
                vbuf[j][d] = (float)vq[d] * vs[d / G];
            }
        } else if (c->fmt >= TM_KV_FP8_E4M3) {
            const uint8_t *kq = (const uint8_t *)c->k + idx, *vq = (const uint8_t *)c->v + idx;
            const float *lut = fp8_values[c->fmt == TM_KV_FP8_E5M2];
            const float ks = ((const float *)c->ks)[h], vs = ((const float *)c->vs)[h];
            for (int d = 0; d < D; d++) {
                kbuf[j][d] = lut[kq[d]] * ks;
                vbuf[j][d] = lut[vq[d]] * vs;
            }
        } else {
            dequant_row_i4((const uint8_t *)c->k + row * (D / 2), (const uint16_t *)c->ks + row * (D / 16), kbuf[j], D);
            dequant_row_i4((const uint8_t *)c->v + row * (D / 2), (const uint16_t *)c->vs + row * (D / 16), vbuf[j], D);
        }
        kr[j] = kbuf[j];
        vr[j] = vbuf[j];
    }
}

/* Ask for the K or V rows (heads h0 .. h0+NH-1) of positions p .. p+n-1 ahead of use. Blocks sit anywhere in
 * the pool, so the hardware prefetcher, which stops at page edges, loses the stream at each block; without
 * this a core waits on DRAM latency (it read K/V at ~6 GB/s). Forced inline, as every prefetch helper here:
 * GCC deletes a call to a function that only prefetches, as having no effect (see prefetch_v). */
static inline __attribute__((always_inline)) void prefetch_rows(const ctx_t *c, int p, int n, int h0, int NH) {
    const size_t hb = kv_head_bytes(c->fmt, c->D), bytes = (size_t)NH * hb;
    for (int j = 0; j < n; j++) {
        const size_t off = (slot_of(c, p + j) * c->KV + h0) * hb;
        for (size_t b = 0; b < bytes; b += 64) {
            __builtin_prefetch((const char *)c->k + off + b, 0, 2);
            __builtin_prefetch((const char *)c->v + off + b, 0, 2);
        }
    }
}

/* The core. Query rows against positions p0 .. p1-1 of one context, kv heads h0 .. h0+NH-1: row (h-h0)*RG + i
 * is qs[that row] (scaled q) and attends positions [begin[i], end[i]) (all of p0 .. p1-1 where begin is NULL).
 * Updates each row's online-softmax state m, l, acc. Chunk by chunk, all heads of a chunk together, so the
 * cache rows (KV * D values) are walked front to back; row pairs share each K and V load. */
static void attend_rows(const ctx_t *c, int h0, int NH, int RG, float (*qs)[MAX_D], const int *begin,
                        const int *end, int p0, int p1, float *m, float *l, float (*acc)[MAX_D],
                        float (*kbuf)[MAX_D], float (*vbuf)[MAX_D]) {
    const int D = c->D;
    size_t slot[CHUNK];
    prefetch_rows(c, p0, p1 - p0 < CHUNK ? p1 - p0 : CHUNK, h0, NH);
    const int passes = NH * ((RG + 1) / 2) * (CHUNK / 8);   /* 8-position steps a full chunk takes */
    for (int c0 = p0; c0 < p1; c0 += CHUNK) {
        const int n = p1 - c0 < CHUNK ? p1 - c0 : CHUNK, n8 = (n + 7) & ~7;
        for (int j = 0; j < n8; j++) slot[j] = slot_of(c, c0 + (j < n ? j : n - 1));
        /* the next chunk streams in while this one is computed: a few of its positions per 8-position step */
        int ahead = c0 + CHUNK;
        const int per_step = (CHUNK + passes - 1) / passes;
        for (int h = h0; h < h0 + NH; h++) {
            const float *kr[CHUNK], *vr[CHUNK];
            chunk_rows(c, slot, n8, h, kr, vr, kbuf, vbuf);
            for (int i = 0; i < RG; i += 2) {
                const int nr = RG - i >= 2 ? 2 : 1, row = (h - h0) * RG + i;
                int lo[2], hi[2], top = 0;      /* each row's window inside this chunk, and their union's end */
                for (int r = 0; r < nr; r++) {
                    const int b = begin ? begin[i + r] : p0, e = end ? end[i + r] : p1;
                    lo[r] = b > c0 ? b - c0 : 0;
                    hi[r] = e - c0 < n ? e - c0 : n;
                    if (hi[r] > lo[r] && hi[r] > top) top = hi[r];
                }
                if (top == 0) continue;         /* causal: this chunk is after both rows */
                const int top8 = (top + 7) & ~7;
                float s[2][CHUNK];
                const float *q[2] = {qs[row], qs[row + nr - 1]};
                for (int j = 0; j < top8; j += 8) {
                    if (ahead < p1 && ahead < c0 + 2 * CHUNK) {
                        const int m = p1 - ahead < per_step ? p1 - ahead : per_step;
                        prefetch_rows(c, ahead, m, h0, NH);
                        ahead += m;
                    }
                    float *o[2] = {s[0] + j, s[1] + j};
                    if (nr == 2) score8(q, 2, kr + j, D, o);
                    else score8(q, 1, kr + j, D, o);
                }
                for (int r = 0; r < nr; r++) cap_scores(s[r], top, c->cap);
                int live = 0;
                for (int r = 0; r < nr; r++)
                    live += fold(s[r], top, lo[r], hi[r], &m[row + r], &l[row + r], acc[row + r], D);
                if (!live) continue;
                if (hi[0] <= lo[0]) memset(s[0], 0, sizeof(float) * top);   /* a dead row of a pair weighs 0 */
                if (nr == 2 && hi[1] <= lo[1]) memset(s[1], 0, sizeof(float) * top);
                float *a[2] = {acc[row], acc[row + nr - 1]};
                const float *p[2] = {s[0], s[1]};
                for (int d0 = 0; d0 < D; d0 += 64) {
                    const int nv = D - d0 >= 64 ? 8 : (D - d0) / 8;
                    if (nr == 2) {
                        if (nv == 8) wsum(a, p, 2, vr, top, d0, 8);
                        else wsum(a, p, 2, vr, top, d0, nv);
                    } else {
                        if (nv == 8) wsum(a, p, 1, vr, top, d0, 8);
                        else wsum(a, p, 1, vr, top, d0, nv);
                    }
                }
            }
        }
    }
}

/* Per-thread scratch of the kernels' work items. */
typedef struct {
    float (*qs)[MAX_D], (*acc)[MAX_D], (*kbuf)[MAX_D], (*vbuf)[MAX_D];
    float *m, *l;
    int *begin, *end;
    float *sbuf, *kt;   /* decode_fast's scores [rows][FAST_N] and K turned round (NULL when not asked for) */
    size_t *slot;
    float (*acc2)[MAX_D], *m2, *l2;   /* decode_fast's result for one part of a range longer than FAST_N */
} scratch_t;

/* fast_rows > 0: decode_fast's buffers too, for work items of up to that many query rows. Returns 0 when
 * anything failed to allocate (scratch_free still frees the rest). */
static int scratch_init(scratch_t *s, int fast_rows) {
    s->qs = malloc(sizeof(float) * MAX_D * MAX_ROWS);
    s->acc = malloc(sizeof(float) * MAX_D * MAX_ROWS);
    s->kbuf = malloc(sizeof(float) * MAX_D * CHUNK);
    s->vbuf = malloc(sizeof(float) * MAX_D * CHUNK);
    s->m = malloc(sizeof(float) * MAX_ROWS);
    s->l = malloc(sizeof(float) * MAX_ROWS);
    s->begin = malloc(sizeof(int) * MAX_ROWS);
    s->end = malloc(sizeof(int) * MAX_ROWS);
    int ok = s->qs && s->acc && s->kbuf && s->vbuf && s->m && s->l && s->begin && s->end;
    s->sbuf = s->kt = s->m2 = s->l2 = NULL;
    s->slot = NULL;
    s->acc2 = NULL;
#if HAVE_FAST
    if (fast_rows > 0) {
        s->sbuf = malloc(sizeof(float) * FAST_N * (size_t)fast_rows);
        s->slot = malloc(sizeof(size_t) * FAST_N);
        s->kt = aligned_alloc(64, sizeof(float) * MAX_D * KT_POS);
        s->acc2 = malloc(sizeof(float) * MAX_D * (size_t)fast_rows);
        s->m2 = malloc(sizeof(float) * (size_t)fast_rows);
        s->l2 = malloc(sizeof(float) * (size_t)fast_rows);
        ok = ok && s->sbuf && s->slot && s->kt && s->acc2 && s->m2 && s->l2;
    }
#endif
    return ok;
}

static void scratch_free(scratch_t *s) {
    free(s->qs);
    free(s->acc);
    free(s->kbuf);
    free(s->vbuf);
    free(s->m);
    free(s->l);
    free(s->begin);
    free(s->end);
    free(s->sbuf);
    free(s->kt);
    free(s->slot);
    free(s->acc2);
    free(s->m2);
    free(s->l2);
}

static void reset_rows(scratch_t *s, int rows, int D) {
    for (int r = 0; r < rows; r++) {
        s->m[r] = -FLT_MAX;
        s->l[r] = 0.f;
        memset(s->acc[r], 0, sizeof(float) * D);
    }
}

/* Row r's unnormalised result (m, l, acc) merged with another over disjoint positions (m2, l2, acc2): both
 * rescaled to the larger max. A part with no positions (l 0) leaves the other as it was. */
static void merge_rows(int rows, int D, float *m, float *l, float (*acc)[MAX_D], const float *m2, const float *l2,
                       float (*acc2)[MAX_D]) {
    for (int r = 0; r < rows; r++) {
        if (l2[r] <= 0.f) continue;
        if (l[r] <= 0.f) {
            m[r] = m2[r];
            l[r] = l2[r];
            memcpy(acc[r], acc2[r], sizeof(float) * D);
            continue;
        }
        const float M = m[r] > m2[r] ? m[r] : m2[r], a = expf(m[r] - M), b = expf(m2[r] - M);
        for (int d = 0; d < D; d++) acc[r][d] = a * acc[r][d] + b * acc2[r][d];
        l[r] = a * l[r] + b * l2[r];
        m[r] = M;
    }
}

/* A tile's `rows` query rows (s->qs) of kv head h over positions [p0, p1), row r only within [begin[r], end[r])
 * when given: a cascade tile over the shared prefix, a prompt tile. Through decode_fast when `fast` (a range
 * longer than its scratch in equal parts of at most FAST_N, merged as they come), else attend_rows; either way
 * s->m, s->l and s->acc hold the unnormalised result. */
static void attend_tile(const ctx_t *c, int h, int rows, scratch_t *s, const int *begin, const int *end, int p0,
                        int p1, int fast) {
#if HAVE_FAST
    if (fast) {
        const int parts = p1 - p0 > FAST_N ? (p1 - p0 + FAST_N - 1) / FAST_N : 1;
        const int size = p1 - p0 > FAST_N ? (p1 - p0 + parts - 1) / parts : FAST_N;
        for (int q0 = p0, part = 0; part == 0 || q0 < p1; q0 += size, part++) {
            const int n = p1 - q0 < size ? p1 - q0 : size;
            if (part == 0) {
                decode_fast_any(c, h, 1, rows, s->qs, q0, n, s->m, s->l, s->acc, s->sbuf, s->slot, s->kt, begin,
                                end, 0);
                continue;
            }
            decode_fast_any(c, h, 1, rows, s->qs, q0, n, s->m2, s->l2, s->acc2, s->sbuf, s->slot, s->kt, begin, end,
                            0);
            merge_rows(rows, c->D, s->m, s->l, s->acc, s->m2, s->l2, s->acc2);
        }
        return;
    }
#endif
    (void)fast;
    reset_rows(s, rows, c->D);
    attend_rows(c, h, 1, rows, s->qs, begin, end, p0, p1, s->m, s->l, s->acc, s->kbuf, s->vbuf);
}

/* Shapes the kernels take (tokenmill.h's TM_ATTN_ limits): block_size a power of two (slot math in shifts and
 * masks). */
static int shapes_ok(int H, int KV, int D, int block_size) {
    return KV > 0 && H % KV == 0 && H / KV <= MAX_G && H <= TM_ATTN_MAX_HEADS && D % TM_ATTN_HEAD_DIM_MULTIPLE == 0
           && D <= MAX_D && block_size > 0 && (block_size & (block_size - 1)) == 0;
}

/* What turns a row's unnormalised result (running max m, sum l) into its output: 1 / l, or with a sink logit the
 * sink's term counted in the sum, both taken to the larger of m and the sink. */
static inline float out_scale(float m, float l, const float *sink) {
    if (!sink) return 1.f / l;
    const float M = m > *sink ? m : *sink, a = expf(m - M);
    return a / (l * a + expf(*sink - M));
}

/* Output row `orow` = o * inv, as float32 or bfloat16. */
static void store_row(void *out, int bf16, size_t orow, const float *o, float inv, int D) {
    for (int d = 0; d < D; d++) {
        if (bf16) ((uint16_t *)out)[orow * D + d] = f32_to_bf16(o[d] * inv);
        else ((float *)out)[orow * D + d] = o[d] * inv;
    }
}

/* Output row `orow` from partial results of one query over disjoint position ranges (flash-decoding): part p
 * is (mx[p * step], sum[p * step], acc[p * step * D ..]); each is rescaled by exp(mx_p - M) to the common max M. An
 * optional extra part (xm, xl, xacc: the shared prefix of cascade attention) joins them, and a sink (a score with
 * no value) where given. */
static void combine(void *out, int bf16, size_t orow, int D, int parts, int step, const float *acc,
                    const float *mx, const float *sum, const float *xm, const float *xl, const float *xacc,
                    const float *sink) {
    float M = -FLT_MAX, total = 0.f, o[MAX_D];
    memset(o, 0, sizeof(float) * D);
    if (xm && *xl > 0.f) M = *xm;
    if (sink && *sink > M) M = *sink;
    for (int p = 0; p < parts; p++)
        if (sum[p * step] > 0.f && mx[p * step] > M) M = mx[p * step];
    if (sink) total += expf(*sink - M);
    if (xm && *xl > 0.f) {
        const float w = expf(*xm - M);
        total += w * *xl;
        for (int d = 0; d < D; d++) o[d] += w * xacc[d];
    }
    for (int p = 0; p < parts; p++) {
        if (sum[p * step] <= 0.f) continue;     /* a part with no positions */
        const float w = expf(mx[p * step] - M);
        total += w * sum[p * step];
        for (int d = 0; d < D; d++) o[d] += w * acc[((size_t)p * step) * D + d];
    }
    store_row(out, bf16, orow, o, 1.f / total, D);
}

/* How a request's own positions are split into parts that run in parallel (flash-decoding). On the fast path at
 * fixed multiples of PART_N from the first: a row's parts then depend on nothing but its own positions, so the rows
 * of one verification (a request's token and its guesses, one position apart) share every boundary but the last
 * and go through as one tile, each row still summed as a lone decode step sums it. Elsewhere into up to `most`
 * parts of >= 64 positions. */
#define PART_N 128
typedef struct {
    int most;
    int fixed;
} split_t;

static int part_size(split_t s, int n) {
    if (s.fixed) return PART_N;
    int parts = n / 64 < s.most ? n / 64 : s.most;
    if (parts < 1) parts = 1;
    return (n + parts - 1) / parts;
}

/* Whether entry b continues the verification tile that entry b0 starts: the same request (table and window
 * start) one position on */
static int same_tile(const int32_t *tables, int max_blocks, const int32_t *starts, const int32_t *lens, int b0,
                     int b) {
    return starts[b] == starts[b0] && lens[b] == lens[b - 1] + 1
           && memcmp(tables + (size_t)b * max_blocks, tables + (size_t)b0 * max_blocks, sizeof(int32_t) * max_blocks) == 0;
}

static int paged_decode(const void *q, int q_stride, const tm_kv_cache *kv, void *out, int q_bf16,
                 const int32_t *tables, int max_blocks, const int32_t *starts, const int32_t *lens, int shared_len,
                 int B, int H, int block_size, float scale, float softcap, const float *sinks, int num_threads) {
    /* shared_len > 0 (cascade): positions 0 .. shared_len-1 sit in the same blocks for every request (the
     * caller checked the tables and that no request starts later than 0); they are attended once per tile of
     * requests, and each request's items cover only shared_len .. len-1. */
    const int KV = kv->kv_heads, D = kv->head_dim;
    if (!shapes_ok(H, KV, D, block_size)) return -1;
    const int G = H / KV;
    const int bs_shift = __builtin_ctz(block_size), bs_mask = block_size - 1;
    const size_t es = q_bf16 ? 2 : 4;
    const int fast = HAVE_FAST && D % 16 == 0;
    if (softcap > 0.f) scale /= softcap;     /* the scores come divided by the cap, as cap_scores takes them */
    const split_t split = {(2 * num_threads + KV - 1) / KV, fast};
    /* Tiles: runs of entries that are one verification's rows (fast path only), up to what a work item carries */
    const int most_per_tile = H <= MAX_ROWS ? MAX_ROWS / H : MAX_ROWS / G;
    int *first = malloc(sizeof(int) * (size_t)(B + 1)), *tile_of = malloc(sizeof(int) * (size_t)B), tiles_n = 0;
    if (!first || !tile_of) {
        free(first);
        free(tile_of);
        return -2;
    }
    for (int b = 0; b < B; b++) {
        if (!(fast && b > 0 && b - first[tiles_n - 1] < most_per_tile
              && same_tile(tables, max_blocks, starts, lens, first[tiles_n - 1], b)))
            first[tiles_n++] = b;
        tile_of[b] = tiles_n - 1;
    }
    first[tiles_n] = B;
    /* Work units: with enough tiles to keep every thread busy, one per tile with all its heads; otherwise one per
     * (tile, kv head). Each unit's positions are split into parts that run in parallel and are merged after. */
    const int per_head = tiles_n < 2 * num_threads || H > MAX_ROWS;   /* a tile's heads must fit a work item */
    const int units = per_head ? KV : 1, rows = per_head ? G : H;     /* per tile; query rows per entry */
    /* per tile: its parts and its first work item; per entry: where its partial results start */
    int *parts = malloc(sizeof(int) * (size_t)tiles_n), *item0 = malloc(sizeof(int) * (size_t)(tiles_n + 1));
    size_t *at0 = malloc(sizeof(size_t) * (size_t)(B + 1));
    int status = parts && item0 && at0 ? 0 : -2;
    int items = 0, widest = rows;
    if (status == 0) {
        at0[0] = 0;
        for (int t = 0; t < tiles_n; t++) {
            const int last = first[t + 1] - 1, from = shared_len > 0 ? shared_len : starts[last];
            const int n = lens[last] - from, size = part_size(split, n);
            parts[t] = n > 0 ? (n + size - 1) / size : 1;
            item0[t] = items;
            items += units * parts[t];
            for (int b = first[t]; b <= last; b++) at0[b + 1] = at0[b] + (size_t)units * parts[t] * rows;
            if ((last - first[t] + 1) * rows > widest) widest = (last - first[t] + 1) * rows;
        }
        item0[tiles_n] = items;
    }
    /* cascade: tiles of requests whose G rows per kv head together stay within TILE_ROWS */
    const int tile = shared_len > 0 ? (TILE_ROWS / G > 0 ? TILE_ROWS / G : 1) : 0;
    const int ctiles = shared_len > 0 ? (B + tile - 1) / tile : 0;
    const size_t total = status == 0 ? at0[B] : 0;
    float *acc = status == 0 ? malloc(sizeof(float) * D * total) : NULL;   /* [total][D] */
    float *mx = status == 0 ? malloc(sizeof(float) * total) : NULL, *sum = status == 0 ? malloc(sizeof(float) * total) : NULL;
    float(*xacc)[MAX_D] = shared_len > 0 ? malloc(sizeof(float) * MAX_D * (size_t)B * H) : NULL;
    float *xm = shared_len > 0 ? malloc(sizeof(float) * (size_t)B * H) : NULL;
    float *xl = shared_len > 0 ? malloc(sizeof(float) * (size_t)B * H) : NULL;
    if (status == 0) status = (acc && mx && sum && (shared_len == 0 || (xacc && xm && xl))) ? 0 : -2;
    if (status == 0) {
#pragma omp parallel num_threads(num_threads)
        {
            scratch_t s;
            const int most = widest > tile * G ? widest : tile * G;     /* query rows of one work item */
            const int ok = scratch_init(&s, fast ? most : 0);
            if (!ok) status = -2;
            /* the shared prefix: item = (kv head, tile of requests), rows (request, g) of that head */
#pragma omp for schedule(dynamic, 1) nowait
            for (int item = 0; item < KV * ctiles; item++) {
                if (!ok) continue;
                const int h = item % KV, b0 = (item / KV) * tile, nb = B - b0 < tile ? B - b0 : tile;
                const ctx_t c = ctx_of(kv, bs_shift, bs_mask, tables, softcap);   /* request 0's table */
                for (int i = 0; i < nb; i++)
                    for (int g = 0; g < G; g++)
                        load_q(s.qs[i * G + g], (const char *)q + (size_t)(b0 + i) * q_stride * es, q_bf16,
                               (size_t)h * G + g, D, scale);
                attend_tile(&c, h, nb * G, &s, NULL, NULL, 0, shared_len, fast);
                for (int i = 0; i < nb; i++)
                    for (int g = 0; g < G; g++) {
                        const size_t at = (size_t)(b0 + i) * H + h * G + g;
                        xm[at] = s.m[i * G + g];
                        xl[at] = s.l[i * G + g];
                        memcpy(xacc[at], s.acc[i * G + g], sizeof(float) * D);
                    }
            }
            /* each tile's own positions: item = (tile, unit, part), rows (kv head, entry, g) */
#pragma omp for schedule(dynamic, 1)
            for (int item = 0; item < items; item++) {
                if (!ok) continue;
                int t = 0;                      /* the tile whose items hold this one */
                for (int lo = 0, hi = tiles_n - 1; lo <= hi;) {
                    const int mid = (lo + hi) / 2;
                    if (item0[mid] <= item) t = mid, lo = mid + 1;
                    else hi = mid - 1;
                }
                const int unit = (item - item0[t]) / parts[t], p = (item - item0[t]) % parts[t];
                const int b0 = first[t], R = first[t + 1] - b0, h0 = per_head ? unit : 0, NH = per_head ? 1 : KV;
                const int from = shared_len > 0 ? shared_len : starts[b0];
                const int n = lens[b0 + R - 1] - from, size = part_size(split, n), begin = from + p * size;
                const int count = n - p * size < size ? n - p * size : size, RG = R * G;
                for (int h = 0; h < NH; h++)
                    for (int i = 0; i < R; i++)
                        for (int g = 0; g < G; g++) {
                            const int r = h * RG + i * G + g;
                            load_q(s.qs[r], (const char *)q + (size_t)(b0 + i) * q_stride * es, q_bf16,
                                   (size_t)(h0 + h) * G + g, D, scale);
                            s.end[r] = lens[b0 + i];
                        }
                if (count > 0) {
                    const ctx_t c = ctx_of(kv, bs_shift, bs_mask, tables + (size_t)b0 * max_blocks, softcap);
#if HAVE_FAST
                    if (fast)
                        decode_fast_any(&c, h0, NH, RG, s.qs, begin, count, s.m, s.l, s.acc, s.sbuf, s.slot, s.kt,
                                        NULL, s.end, 1);
                    else
#endif
                    {
                        reset_rows(&s, NH * RG, D);
                        attend_rows(&c, h0, NH, RG, s.qs, NULL, NULL, begin, begin + count, s.m, s.l, s.acc, s.kbuf,
                                    s.vbuf);
                    }
                } else {
                    reset_rows(&s, NH * RG, D);     /* no positions (an empty context): l = 0, skipped in combine */
                }
                for (int h = 0; h < NH; h++)
                    for (int i = 0; i < R; i++)
                        for (int g = 0; g < G; g++) {
                            const int r = h * RG + i * G + g;
                            const size_t at = at0[b0 + i] + ((size_t)unit * parts[t] + p) * rows + h * G + g;
                            mx[at] = s.m[r];
                            sum[at] = s.l[r];
                            memcpy(acc + at * D, s.acc[r], sizeof(float) * D);
                        }
            }
#pragma omp for schedule(static)
            for (int b = 0; b < B; b++) {
                const int t = tile_of[b];
                for (int unit = 0; unit < units; unit++)
                    for (int r = 0; r < rows; r++) {
                        const size_t orow = (size_t)b * H + (size_t)unit * G * per_head + r;
                        const size_t at = at0[b] + (size_t)unit * parts[t] * rows + r;
                        combine(out, q_bf16, orow, D, parts[t], rows, acc + at * D, mx + at, sum + at,
                                xm ? xm + orow : NULL, xl ? xl + orow : NULL, xacc ? xacc[orow] : NULL,
                                sinks ? sinks + orow % H : NULL);
                    }
            }
            scratch_free(&s);   /* frees what scratch_init got, all or part */
        }
    }
    free(first);
    free(tile_of);
    free(parts);
    free(item0);
    free(at0);
    free(acc);
    free(mx);
    free(sum);
    free(xacc);
    free(xm);
    free(xl);
    return status;
}

/* Several query tokens per request over a context already in the cache (their own K/V written this step):
 * request i's tokens are rows row0[i] .. row0[i]+count[i]-1 of q and out, at positions
 * computed[i] .. computed[i]+count[i]-1, each attending causally (and within `window` positions when
 * window > 0). Items are (request, kv head, tile of tokens), so each K/V chunk is loaded once per tile. */
static int paged_prefill(const void *q, int q_stride, const tm_kv_cache *kv, void *out, int q_bf16,
                  const int32_t *tables, int max_blocks, const int32_t *row0, const int32_t *count,
                  const int32_t *computed, int R, int H, int block_size, int window, float scale,
                  float softcap, const float *sinks, int num_threads) {
    const int KV = kv->kv_heads, D = kv->head_dim;
    if (!shapes_ok(H, KV, D, block_size)) return -1;
    const int G = H / KV;
    if (softcap > 0.f) scale /= softcap;     /* as paged_decode */
    const int bs_shift = __builtin_ctz(block_size), bs_mask = block_size - 1;
    const size_t es = q_bf16 ? 2 : 4;
    const int tok = TILE_ROWS / G > 0 ? TILE_ROWS / G : 1;      /* tokens per tile */
    int *first_item = malloc(sizeof(int) * ((size_t)R + 1));    /* request i's items start here */
    if (!first_item) return -2;
    first_item[0] = 0;
    for (int i = 0; i < R; i++) first_item[i + 1] = first_item[i] + KV * ((count[i] + tok - 1) / tok);
    int status = 0;
    const int fast = HAVE_FAST && D % 16 == 0;
#pragma omp parallel num_threads(num_threads)
    {
        scratch_t s;
        const int ok = scratch_init(&s, fast ? tok * G : 0);
        if (!ok) status = -2;
        int i = 0;
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < first_item[R]; item++) {
            if (!ok) continue;
            while (first_item[i + 1] <= item) i++;   /* items ascend within a thread */
            while (first_item[i] > item) i--;
            const int local = item - first_item[i], h = local % KV, t0 = (local / KV) * tok;
            const int nt = count[i] - t0 < tok ? count[i] - t0 : tok;
            const ctx_t c = ctx_of(kv, bs_shift, bs_mask, tables + (size_t)i * max_blocks, softcap);
            int p0 = 1 << 30, p1 = 0;
            for (int t = 0; t < nt; t++) {
                const int pos = computed[i] + t0 + t;
                const int b = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
                for (int g = 0; g < G; g++) {
                    const int r = t * G + g;
                    load_q(s.qs[r], (const char *)q + (size_t)(row0[i] + t0 + t) * q_stride * es, q_bf16,
                           (size_t)h * G + g, D, scale);
                    s.begin[r] = b;
                    s.end[r] = pos + 1;
                }
                if (b < p0) p0 = b;
                if (pos + 1 > p1) p1 = pos + 1;
            }
            attend_tile(&c, h, nt * G, &s, s.begin, s.end, p0, p1, fast);   /* causal masks */
            for (int t = 0; t < nt; t++)
                for (int g = 0; g < G; g++) {
                    const int r = t * G + g;
                    store_row(out, q_bf16, (size_t)(row0[i] + t0 + t) * H + h * G + g, s.acc[r],
                              out_scale(s.m[r], s.l[r], sinks ? sinks + h * G + g : NULL), D);
                }
        }
        scratch_free(&s);
    }
    free(first_item);
    return status;
}

/* ops.c */
void rotary(float *x, const float *cos, const float *sin, int rows, int heads, int dim, int row_stride,
            int num_threads);

/* One row of width values into an int8 cache row: scale = max |x| * (1 / 127), code = round(x * (1 / scale)), half
 * to even; the same float32 operations as tokenmill's torch path, so both write the same bytes (a multiply, not a
 * division by 127: -ffast-math would turn that into this multiply anyway). */
static void quantize_row_i8(const float *x, int8_t *q, float *scale, int width) {
    float amax = 0.f;
    for (int i = 0; i < width; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    const float d = amax * (1.f / 127.f), inv = d != 0.f ? 1.f / d : 0.f;
    *scale = d;
    for (int i = 0; i < width; i++) q[i] = (int8_t)lrintf(x[i] * inv);
}

/* One row of D values (D a multiple of 32) into int4 codes, a group of 32 at a time: m = min, d = (max - min) *
 * (1 / 15), both rounded to half; code = round((x - m) * (1 / d)) clamped to 0..15, with the rounded d and m so
 * the codes fit what is read back. The same float32 operations as the torch path: both write the same bytes. */
static void quantize_row_i4(const float *x, uint8_t *q, uint16_t *dm, int D) {
    for (int g = 0; g < D / TM_KV_INT4_GROUP; g++, x += 32, q += 16) {
        float lo = x[0], hi = x[0];
        for (int i = 1; i < 32; i++) {
            lo = x[i] < lo ? x[i] : lo;
            hi = x[i] > hi ? x[i] : hi;
        }
        dm[2 * g] = tm_f32_to_half((hi - lo) * (1.f / 15.f));
        dm[2 * g + 1] = tm_f32_to_half(lo);
        const float d = tm_half_to_f32(dm[2 * g]), m = tm_half_to_f32(dm[2 * g + 1]);
        const float inv = d != 0.f ? 1.f / d : 0.f;
        uint8_t c[32];
        for (int i = 0; i < 32; i++) {
            const long v = lrintf((x[i] - m) * inv);
            c[i] = (uint8_t)(v < 0 ? 0 : v > 15 ? 15 : v);
        }
        for (int i = 0; i < 16; i++) q[i] = (uint8_t)(c[i] | (c[i + 16] << 4));
    }
}

/* One row of width values into fp8 codes of a kv head with scale `scale`: code = fp8(clamp(x * (1 / scale))), to
 * nearest even; the same float32 operations as the torch path, so both write the same bytes. */
static void quantize_row_fp8(const float *x, uint8_t *q, float scale, int width, int e5m2) {
    const float inv = 1.f / scale, hi = TM_FP8_MAX(e5m2);
    for (int i = 0; i < width; i++) {
        const float y = x[i] * inv;
        q[i] = tm_f32_to_fp8(y > hi ? hi : y < -hi ? -hi : y, e5m2);
    }
}

/* k_cache[slots[t]] = k[t] and v_cache[slots[t]] = v[t] for t < rows: KV * D float32 values per row, source rows
 * src_stride apart (views into fused qkv); stored in the cache's format (bfloat16 rounded to nearest even, as
 * torch converts; int8 a kv head at a time). Returns -3, writing nothing, for a slot outside the cache. */
static int write_kv(const float *k, const float *v, int src_stride, const tm_kv_cache *kv, const int64_t *slots,
                    int rows) {
    const int KV = kv->kv_heads, D = kv->head_dim, width = KV * D;
    for (int t = 0; t < rows; t++)
        if (slots[t] < 0 || slots[t] >= kv->num_slots) return -3;
    for (int t = 0; t < rows; t++) {
        const float *ks = k + (size_t)t * src_stride, *vs = v + (size_t)t * src_stride;
        const size_t at = (size_t)slots[t] * width;
        if (kv->format == TM_KV_F32) {
            memcpy((float *)kv->k + at, ks, sizeof(float) * width);
            memcpy((float *)kv->v + at, vs, sizeof(float) * width);
        } else if (kv->format == TM_KV_BF16) {
            for (int i = 0; i < width; i++) {
                ((uint16_t *)kv->k)[at + i] = f32_to_bf16(ks[i]);
                ((uint16_t *)kv->v)[at + i] = f32_to_bf16(vs[i]);
            }
        } else if (kv->format == TM_KV_INT8) {
            const int G = i8_group(D);
            for (int h = 0; h < KV; h++) {
                const size_t row = (size_t)slots[t] * KV + h;
                for (int g = 0; g < D; g += G) {
                    quantize_row_i8(ks + h * D + g, (int8_t *)kv->k + row * D + g,
                                    (float *)kv->k_scale + row * (D / G) + g / G, G);
                    quantize_row_i8(vs + h * D + g, (int8_t *)kv->v + row * D + g,
                                    (float *)kv->v_scale + row * (D / G) + g / G, G);
                }
            }
        } else if (kv->format >= TM_KV_FP8_E4M3) {
            const int e5m2 = kv->format == TM_KV_FP8_E5M2;
            for (int h = 0; h < KV; h++) {
                const size_t row = (size_t)slots[t] * KV + h;
                quantize_row_fp8(ks + h * D, (uint8_t *)kv->k + row * D, ((const float *)kv->k_scale)[h], D, e5m2);
                quantize_row_fp8(vs + h * D, (uint8_t *)kv->v + row * D, ((const float *)kv->v_scale)[h], D, e5m2);
            }
        } else {
            for (int h = 0; h < KV; h++) {
                const size_t row = (size_t)slots[t] * KV + h;
                quantize_row_i4(ks + h * D, (uint8_t *)kv->k + row * (D / 2), (uint16_t *)kv->k_scale + row * (D / 16), D);
                quantize_row_i4(vs + h * D, (uint8_t *)kv->v + row * (D / 2), (uint16_t *)kv->v_scale + row * (D / 16), D);
            }
        }
    }
    return 0;
}

/* A whole decode step's attention for one layer, float32 activations, in one call: rotate q and k in place in the
 * fused qkv rows [B, (H + 2 KV) * D] (row stride qkv_stride), write k and v into their cache slots, attend.
 * Returns paged_decode's status, or write_kv's -3 for a slot outside the cache (nothing written). */
static int decode_attention(float *qkv, int qkv_stride, float *out, const float *cos, const float *sin,
                            const int64_t *slots, const tm_kv_cache *kv, const int32_t *tables, int max_blocks,
                            const int32_t *starts, const int32_t *lens, int shared_len, int B, int H, int block_size,
                            float scale, float softcap, const float *sinks, int num_threads) {
    const int KV = kv->kv_heads, D = kv->head_dim;
    rotary(qkv, cos, sin, B, H + KV, D, qkv_stride, 1);
    const int rc = write_kv(qkv + (size_t)H * D, qkv + (size_t)(H + KV) * D, qkv_stride, kv, slots, B);
    if (rc != 0) return rc;
    return paged_decode(qkv, qkv_stride, kv, out, 0, tables, max_blocks, starts, lens, shared_len, B, H, block_size,
                        scale, softcap, sinks, num_threads);
}


/* ---- the library's entry points (tokenmill.h) ---- */
static int kv_ok(const tm_kv_cache *kv) {
    return kv->format == TM_KV_F32 || kv->format == TM_KV_BF16
           || ((kv->format == TM_KV_INT8 || kv->format == TM_KV_FP8_E4M3 || kv->format == TM_KV_FP8_E5M2)
               && kv->k_scale && kv->v_scale)
           || (kv->format == TM_KV_INT4 && kv->k_scale && kv->v_scale && kv->head_dim % TM_KV_INT4_GROUP == 0);
}

TM_API int tm_paged_decode(const tm_paged_decode_args *a) {
    const tm_decode_step *s = a->step;
    if (!kv_ok(a->kv)) return -1;
    return paged_decode(a->q, a->q_stride, a->kv, a->out, a->q_bf16, s->tables, s->max_blocks, s->starts, s->lens,
                        s->shared_len, s->batch, a->heads, s->block_size, a->scale, a->softcap, a->sinks,
                        s->num_threads);
}

TM_API int tm_paged_prefill(const tm_paged_prefill_args *a) {
    if (!kv_ok(a->kv)) return -1;
    return paged_prefill(a->q, a->q_stride, a->kv, a->out, a->q_bf16, a->tables, a->max_blocks, a->row0, a->count,
                         a->computed, a->reqs, a->heads, a->block_size, a->window, a->scale, a->softcap,
                         a->sinks, a->num_threads);
}

TM_API int tm_write_kv(const tm_write_kv_args *a) {
    if (!kv_ok(a->kv)) return -1;
    return write_kv(a->k, a->v, a->src_stride, a->kv, a->slots, a->rows);
}

TM_API int tm_decode_attention(const tm_decode_attention_args *a) {
    const tm_decode_step *s = a->step;
    if (!s->cos || !s->sin || !s->slots || !kv_ok(a->kv)) return -1;
    return decode_attention(a->qkv, a->qkv_stride, a->out, s->cos, s->sin, s->slots, a->kv, s->tables, s->max_blocks,
                            s->starts, s->lens, s->shared_len, s->batch, a->heads, s->block_size, a->scale,
                            a->softcap, a->sinks, s->num_threads);
}
