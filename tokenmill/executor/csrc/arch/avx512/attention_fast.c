/* The AVX-512 decode path of the paged attention kernels (attention.c): for a work item's positions, all scores
 * first, then one exact softmax per row, then the weighted sum of V, with K and V asked for ahead of use. Every
 * cache format (tm_kv_cache.format) is read in place, 16 values at a time dequantised in registers. */
#include <float.h>
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "../../attention.h"
#include "transpose.h"

#define PF_AHEAD 16   /* positions ahead that the fast path asks for K (and its value pass for V): the blocks
                       * sit anywhere, so the hardware prefetcher loses the stream at each one */

/* out[j] = the sum of a[j]'s 16 lanes, j = 0..7: halves, then quarters, then a 4 x 4 transpose-add */
static inline __m256 reduce8(const __m512 *a) {
    __m512 u[4];
    for (int i = 0; i < 4; i++)   /* u[i]: lanes 0-7 partial sums of a[2i], lanes 8-15 of a[2i+1] */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    /* w0: 128-bit lane i holds four partial sums of a[i]; w1 of a[4 + i] */
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    const __m512 x = _mm512_add_ps(_mm512_unpacklo_ps(w0, w1), _mm512_unpackhi_ps(w0, w1));
    const __m512 y = _mm512_add_ps(x, _mm512_permute_ps(x, 0x4E));   /* lane i: [sum a[i], sum a[4+i], ...] */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, y));
}

/* byte offset of dimension d in a cache row (int4: two codes a byte) */
static inline size_t dim_bytes(int d, const int fmt) {
    return fmt == TM_KV_INT4 ? (size_t)d / 2 : (size_t)d * kv_elem_bytes(fmt);
}

/* K rows of heads h0 .. h0+NH-1 at a slot, to L1. (Asking for V here as well, to L2, ran slower; the value
 * pass asks for its own rows, prefetch_v.) */
static inline __attribute__((always_inline)) void prefetch_k(const ctx_t *c, size_t slot, int h0, int NH,
                                                             const int fmt) {
    const size_t hb = kv_head_bytes(fmt, c->D), off = (slot * c->KV + h0) * hb, bytes = (size_t)NH * hb;
    for (size_t b = 0; b < bytes; b += 64) _mm_prefetch((const char *)c->k + off + b, _MM_HINT_T0);
}

/* The DV x 16 values of V from element idx that the value pass reads PF_AHEAD positions on, to L1: that pass
 * reads one kv head's slice of each position (SmolLM2: 4 lines in every 12), a stride across blocks anywhere in
 * the pool that the hardware prefetcher follows poorly (cold, the whole kernel read ~11% slower without this).
 * Forced inline: written as a plain static inline helper, GCC left it out of decode_fast and then deleted the
 * call, a function whose only effect is a prefetch counting as one with none (objdump: 4 prefetcht0, not 52). */
static inline __attribute__((always_inline)) void prefetch_v(const ctx_t *c, size_t slot, int h, int d0, int DV,
                                                             const int fmt) {
    const char *p = (const char *)c->v + (slot * c->KV + h) * kv_head_bytes(fmt, c->D) + dim_bytes(d0, fmt);
    const int bytes = (int)dim_bytes(16 * DV, fmt);
    for (int b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

/* 16 values of kv head h's row at a slot from dimension d (a multiple of 16), as float32, from K (base c->k,
 * scales c->ks) or V: bfloat16 is the top half of a float32; int8 codes times their group's scale; an fp8 code
 * widened to the half with the same sign, exponent and mantissa (exact: e5m2 is a half's top byte, e4m3's
 * exponent sits 8 below a half's) times its head's scale; int4 nibbles times their group's d plus its m. */
static inline __attribute__((always_inline)) __m512 load_kv(const ctx_t *c, const void *base, const void *scales,
                                                            size_t slot, int h, int d, const int fmt) {
    const size_t row = slot * c->KV + h;
    const char *p = (const char *)base + row * kv_head_bytes(fmt, c->D) + dim_bytes(fmt == TM_KV_INT4 ? d & ~31 : d, fmt);
    if (fmt == TM_KV_F32) return _mm512_loadu_ps((const float *)p);
    if (fmt == TM_KV_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    if (fmt == TM_KV_INT8) {      /* d's 16 values share a group: 32 values, or the whole head */
        const int G = i8_group(c->D);
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)),
                             _mm512_set1_ps(((const float *)scales)[row * (c->D / G) + d / G]));
    }
    if (fmt == TM_KV_FP8_E5M2)
        return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8)),
                             _mm512_set1_ps(((const float *)scales)[h]));
    if (fmt == TM_KV_FP8_E4M3) {
        const __m256i w = _mm256_cvtepu8_epi16(b);
        const __m256i hbits = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), 7),
                                              _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8));
        return _mm512_mul_ps(_mm512_cvtph_ps(hbits), _mm512_set1_ps(((const float *)scales)[h] * 256.f));
    }
    /* int4: p is the group's 16 bytes; dimensions d .. d+15 are their low nibbles in the group's first half,
     * the high ones in its second */
    const __m512i w = _mm512_cvtepu8_epi32(b);
    const __m512i q = d & 16 ? _mm512_srli_epi32(w, 4) : _mm512_and_si512(w, _mm512_set1_epi32(15));
    uint32_t dm;
    memcpy(&dm, (const uint16_t *)scales + (row * (c->D / TM_KV_INT4_GROUP) + d / TM_KV_INT4_GROUP) * 2, 4);
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), _mm512_broadcastss_ps(f), _mm512_broadcastss_ps(_mm_movehdup_ps(f)));
}

/* e^x for 16 floats, to about 1 ulp: x = k ln2 + r with |r| <= ln2 / 2 (ln2 split in two for an exact k ln2),
 * e^r by Cephes' expf polynomial, times 2^k by scalef. Inline, 16 wide: libmvec's expf, which GCC calls 8 wide
 * here, took ~2.5 cycles a value, as much as the 48-row score pass it follows. x below -87 gives ~0. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, k);
}

#define GEMM_ROWS 12  /* query rows of one kv head from which decode_fast takes that pass */

/* kt[d][j] = K row of kv head h at slot[j], d < D, j < nj (<= KT_POS); 16 x 16 squares turned round in
 * registers. Groups of 16 positions past nj are left as they were: their scores are never read. */
static inline __attribute__((always_inline)) void k_turned(const ctx_t *c, int h, const size_t *slot, int nj,
                                                           float *kt, const int fmt) {
    const int D = c->D;
    for (int jb = 0; jb < nj; jb += 16)
        for (int d0 = 0; d0 < D; d0 += 16) {
            __m512 r[16];
            for (int i = 0; i < 16; i++)   /* a short last group repeats its last position */
                r[i] = load_kv(c, c->k, c->ks, slot[jb + i < nj ? jb + i : nj - 1], h, d0, fmt);
            transpose16(r);
            for (int i = 0; i < 16; i++) _mm512_store_ps(kt + (size_t)(d0 + i) * KT_POS + jb, r[i]);
        }
}

/* Scores of many query rows (G >= GEMM_ROWS, one kv head h: a cascade tile, a prompt tile) against positions
 * slot[0 .. n), into sbuf [row][FAST_N], as a small GEMM over K turned round: 6 rows x 64 positions of
 * accumulators, per d four loads of kt and six broadcasts of q feed 24 FMAs, no horizontal sums. */
static inline __attribute__((always_inline)) void scores_many(const ctx_t *c, int h, int G, float (*qs)[MAX_D],
                                                               int n, float *sbuf, const size_t *slot, float *kt,
                                                               const int fmt) {
    const int D = c->D;
    for (int j0 = 0; j0 < n; j0 += KT_POS) {
        k_turned(c, h, slot + j0, n - j0 < KT_POS ? n - j0 : KT_POS, kt, fmt);
        for (int r0 = 0; r0 < G; r0 += 6) {
#define QK_GEMM(NR)                                                                                       \
            {                                                                                             \
                __m512 a[NR][4];                                                                          \
                for (int r = 0; r < NR; r++)                                                              \
                    for (int i = 0; i < 4; i++) a[r][i] = _mm512_setzero_ps();                            \
                for (int d = 0; d < D; d++) {                                                             \
                    __m512 kv[4];                                                                         \
                    for (int i = 0; i < 4; i++) kv[i] = _mm512_load_ps(kt + (size_t)d * KT_POS + 16 * i);  \
                    for (int r = 0; r < NR; r++) {                                                        \
                        const __m512 qb = _mm512_set1_ps(qs[r0 + r][d]);                                  \
                        for (int i = 0; i < 4; i++) a[r][i] = _mm512_fmadd_ps(qb, kv[i], a[r][i]);        \
                    }                                                                                     \
                }                                                                                         \
                for (int r = 0; r < NR; r++)                                                              \
                    for (int i = 0; i < 4; i++)                                                           \
                        _mm512_storeu_ps(sbuf + (size_t)(r0 + r) * FAST_N + j0 + 16 * i, a[r][i]);        \
            }
            switch (G - r0 < 6 ? G - r0 : 6) {
                case 6: QK_GEMM(6) break;
                case 5: QK_GEMM(5) break;
                case 4: QK_GEMM(4) break;
                case 3: QK_GEMM(3) break;
                case 2: QK_GEMM(2) break;
                default: QK_GEMM(1) break;
            }
#undef QK_GEMM
        }
    }
}

/* Scores of a few rows per kv head (NH heads from h0, G rows each: a request's heads) against positions
 * slot[0 .. n): 8 positions x up to 3 rows per register block, so each K row is loaded once per 3 query rows,
 * with K asked for PF_AHEAD positions ahead. */
static inline __attribute__((always_inline)) void scores_few(const ctx_t *c, int h0, int NH, int G,
                                                              float (*qs)[MAX_D], int n, float *sbuf,
                                                              const size_t *slot, const int fmt) {
    const int D = c->D;
    for (int j = 0; j < PF_AHEAD && j < n; j++) prefetch_k(c, slot[j], h0, NH, fmt);
    for (int j0 = 0; j0 < n; j0 += 8) {
        for (int j = j0 + PF_AHEAD; j < j0 + 8 + PF_AHEAD && j < n; j++) prefetch_k(c, slot[j], h0, NH, fmt);
        for (int h = 0; h < NH; h++) {
            size_t kr[8];   /* the 8 K rows' slots */
            for (int j = 0; j < 8; j++) kr[j] = slot[j0 + j < n ? j0 + j : n - 1];
            for (int g0 = 0; g0 < G; g0 += 3) {
                const int row = h * G + g0;
#define QK_BLOCK(NR)                                                                                      \
                {                                                                                         \
                    __m512 a[NR][8];                                                                      \
                    for (int r = 0; r < NR; r++)                                                          \
                        for (int j = 0; j < 8; j++) a[r][j] = _mm512_setzero_ps();                        \
                    for (int d = 0; d < D; d += 16) {                                                     \
                        __m512 q[NR];                                                                     \
                        for (int r = 0; r < NR; r++) q[r] = _mm512_loadu_ps(qs[row + r] + d);             \
                        for (int j = 0; j < 8; j++) {                                                     \
                            const __m512 kv = load_kv(c, c->k, c->ks, kr[j], h0 + h, d, fmt);            \
                            for (int r = 0; r < NR; r++) a[r][j] = _mm512_fmadd_ps(q[r], kv, a[r][j]);   \
                        }                                                                                 \
                    }                                                                                     \
                    for (int r = 0; r < NR; r++)                                                          \
                        _mm256_storeu_ps(sbuf + (size_t)(row + r) * FAST_N + j0, reduce8(a[r]));          \
                }
                if (G - g0 >= 3) QK_BLOCK(3)
                else if (G - g0 == 2) QK_BLOCK(2)
                else QK_BLOCK(1)
#undef QK_BLOCK
            }
        }
    }
}

/* Attention of rows (h - h0) * G + g (qs, scaled) over positions p0 .. p0+n-1 (n <= FAST_N) of a float32
 * cache of format fmt (TM_KV_*), D a multiple of 16, in two passes: all scores first (scores_few, or
 * scores_many for many rows of one kv head unless `few`), then one exact softmax per row (row r only over
 * [begin[r], end[r]) where begin/end are given: a causal prompt tile, a verification's rows), then the weighted sum
 * of V (up to 4 rows, 6 for many rows, x 64 dims of accumulators; 16-wide tails of D one vector at a time). Leaves
 * m (max), l (sum of e^(s - m)) and acc (unnormalised) as attend_rows does, so combine() merges the results the
 * same way. With `few`, a row's bits depend on its own positions only, not on the rows beside it nor on n past its
 * end (masked positions add exact zeros). */
static inline __attribute__((always_inline)) void decode_fast(const ctx_t *c, int h0, int NH, int G,
                                                               float (*qs)[MAX_D], int p0, int n, float *m,
                                                               float *l, float (*acc)[MAX_D], float *sbuf,
                                                               size_t *slot, float *kt, const int *begin,
                                                               const int *end, int few, const int fmt) {
    const int D = c->D;
    for (int j = 0; j < n; j++) slot[j] = slot_of(c, p0 + j);
    const int many = !few && NH == 1 && G >= GEMM_ROWS;
    if (many) scores_many(c, h0, G, qs, n, sbuf, slot, kt, fmt);
    else scores_few(c, h0, NH, G, qs, n, sbuf, slot, fmt);
    for (int r = 0; r < NH * G; r++) cap_scores(sbuf + (size_t)r * FAST_N, n, c->cap);
    /* One exact softmax per row over the positions it attends, [lo, hi) of the n (row r's [begin, end) where
     * given, as a causal prompt tile has; the rest weigh 0), 16 at a time */
    const int rows = NH * G;
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int r = 0; r < rows; r++) {
        float *s = sbuf + (size_t)r * FAST_N;
        const int lo = begin && begin[r] > p0 ? begin[r] - p0 : 0;
        const int hi = end && end[r] - p0 < n ? end[r] - p0 : n;
        const __m512i lov = _mm512_set1_epi32(lo), hiv = _mm512_set1_epi32(hi);
        __m512 mv = _mm512_set1_ps(-FLT_MAX), tv = _mm512_setzero_ps();
#define LIVE(j) (_mm512_cmpge_epi32_mask(_mm512_add_epi32(iota, _mm512_set1_epi32(j)), lov) &                \
                 _mm512_cmplt_epi32_mask(_mm512_add_epi32(iota, _mm512_set1_epi32(j)), hiv))
        for (int j = lo & ~15; j < hi; j += 16) mv = _mm512_mask_max_ps(mv, LIVE(j), mv, _mm512_loadu_ps(s + j));
        const float mx = _mm512_reduce_max_ps(mv);
        const __m512 mxv = _mm512_set1_ps(mx);
        for (int j = 0; j < n; j += 16) {   /* every position up to n: the value pass reads them all */
            const __mmask16 live = LIVE(j);
            const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mxv)));
            _mm512_storeu_ps(s + j, e);
            tv = _mm512_add_ps(tv, e);
        }
#undef LIVE
        m[r] = mx;
        l[r] = _mm512_reduce_add_ps(tv);
    }
    const int pv_rows = many ? 6 : 4;   /* many rows: 6 per pass over V (24 accumulators) */
    for (int h = 0; h < NH; h++)
        for (int g0 = 0; g0 < G; g0 += pv_rows) {
            const int row = h * G + g0, nr = G - g0 < pv_rows ? G - g0 : pv_rows;
#define PV_BLOCK(NR, DV)                                                                                  \
            {                                                                                             \
                __m512 a[NR][DV];                                                                         \
                for (int r = 0; r < NR; r++)                                                              \
                    for (int i = 0; i < DV; i++) a[r][i] = _mm512_setzero_ps();                           \
                for (int j = 0; j < n; j++) {                                                             \
                    if (j + PF_AHEAD < n) prefetch_v(c, slot[j + PF_AHEAD], h0 + h, d0, DV, fmt);         \
                    for (int i = 0; i < DV; i++) {                                                        \
                        const __m512 vv = load_kv(c, c->v, c->vs, slot[j], h0 + h, d0 + 16 * i, fmt);    \
                        for (int r = 0; r < NR; r++)                                                      \
                            a[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(sbuf[(size_t)(row + r) * FAST_N + j]), \
                                                      vv, a[r][i]);                                       \
                    }                                                                                     \
                }                                                                                         \
                for (int r = 0; r < NR; r++)                                                              \
                    for (int i = 0; i < DV; i++) _mm512_storeu_ps(acc[row + r] + d0 + 16 * i, a[r][i]);  \
            }
#define PV_ROWS(DV)                                                                                       \
            switch (nr) {                                                                                 \
                case 6: PV_BLOCK(6, DV) break;                                                            \
                case 5: PV_BLOCK(5, DV) break;                                                            \
                case 4: PV_BLOCK(4, DV) break;                                                            \
                case 3: PV_BLOCK(3, DV) break;                                                            \
                case 2: PV_BLOCK(2, DV) break;                                                            \
                default: PV_BLOCK(1, DV) break;                                                           \
            }
            for (int d0 = 0; d0 < D;) {
                if (D - d0 >= 64) {
                    PV_ROWS(4)
                    d0 += 64;
                } else {
                    PV_ROWS(1)
                    d0 += 16;
                }
            }
#undef PV_ROWS
#undef PV_BLOCK
        }
}

/* decode_fast for the cache's format (a constant in each call, so the loads compile without a branch) */
void decode_fast_any(const ctx_t *c, int h0, int NH, int G, float (*qs)[MAX_D], int p0, int n, float *m,
                            float *l, float (*acc)[MAX_D], float *sbuf, size_t *slot, float *kt, const int *begin,
                            const int *end, int few) {
#define FAST(FMT) decode_fast(c, h0, NH, G, qs, p0, n, m, l, acc, sbuf, slot, kt, begin, end, few, FMT)
    switch (c->fmt) {
        case TM_KV_F32: FAST(TM_KV_F32); break;
        case TM_KV_BF16: FAST(TM_KV_BF16); break;
        case TM_KV_INT8: FAST(TM_KV_INT8); break;
        case TM_KV_INT4: FAST(TM_KV_INT4); break;
        case TM_KV_FP8_E4M3: FAST(TM_KV_FP8_E4M3); break;
        default: FAST(TM_KV_FP8_E5M2); break;
    }
#undef FAST
}
