/* Shared by attention.c and its per-ISA paths (arch/<isa>/attention_*.c); not part of the library's interface. */
#ifndef TOKENMILL_ATTENTION_H
#define TOKENMILL_ATTENTION_H
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "tokenmill.h"

#define MAX_G TM_ATTN_MAX_GROUP
#define MAX_D TM_ATTN_MAX_HEAD_DIM
#define MAX_ROWS 128 /* query rows one attend_rows call carries: a request's heads, or a tile of requests/tokens */
#define CHUNK 64     /* positions per online-softmax step: 16 KB of K (or V) per head of 64, L1-resident */
#define TILE_ROWS 48 /* rows per cascade / prefill work item: each K/V chunk is loaded once for this many queries */

/* Where one context's K/V rows live. */
typedef struct {
    const void *k, *v;
    const void *ks, *vs;                  /* the quantised formats' scales (tm_kv_cache.k_scale) */
    int fmt, KV, D, bs_shift, bs_mask;    /* fmt: TM_KV_*; block_size = 1 << bs_shift */
    const int32_t *table;
    float cap;                            /* the soft cap (0: none); q comes scaled by 1 / cap as well */
} ctx_t;

static inline ctx_t ctx_of(const tm_kv_cache *kv, int bs_shift, int bs_mask, const int32_t *table, float cap) {
    const ctx_t c = {kv->k, kv->v, kv->k_scale, kv->v_scale, kv->format, kv->kv_heads, kv->head_dim, bs_shift,
                     bs_mask, table, cap};
    return c;
}

/* Soft-capped scores: s[j] holds q.k * scale / cap, and becomes cap * tanh(s[j]) (transformers' Gemma 2 order:
 * scale, divide, tanh, multiply). Nothing without a cap. */
static inline void cap_scores(float *s, int n, float cap) {
    if (cap <= 0.f) return;
#pragma omp simd
    for (int j = 0; j < n; j++) s[j] = cap * tanhf(s[j]);
}

/* bytes of one cached value (int4: see kv_head_bytes) */
static inline size_t kv_elem_bytes(int fmt) {
    return fmt == TM_KV_F32 ? 4 : fmt == TM_KV_BF16 ? 2 : 1;
}

/* bytes of one kv head's codes at a slot */
static inline size_t kv_head_bytes(int fmt, int D) {
    return fmt == TM_KV_INT4 ? (size_t)D / 2 : kv_elem_bytes(fmt) * D;
}

/* the values one int8 scale covers at head_dim D (TM_KV_INT8_GROUP, or the whole head) */
static inline int i8_group(int D) {
    return D % TM_KV_INT8_GROUP ? D : TM_KV_INT8_GROUP;
}

static inline size_t slot_of(const ctx_t *c, int pos) {
    return ((size_t)c->table[pos >> c->bs_shift] << c->bs_shift) + (pos & c->bs_mask);
}

/* The AVX-512 decode path (arch/avx512/attention_fast.c): two passes over a work item's positions instead of
 * attend_rows' online softmax, for D a multiple of 16. */
#if defined(__AVX512F__)
#define HAVE_FAST 1
#define FAST_N 1024   /* positions per work item on the fast decode path: the scores scratch is rows x FAST_N */
#define KT_POS 64     /* positions of K turned round at a time for the many-row score pass: kt [D][64] */
void decode_fast_any(const ctx_t *c, int h0, int NH, int G, float (*qs)[MAX_D], int p0, int n, float *m,
                     float *l, float (*acc)[MAX_D], float *sbuf, size_t *slot, float *kt, const int *begin,
                     const int *end, int few);   /* few: each row's scores summed as for a lone row */
#else
#define HAVE_FAST 0
#endif

#endif
