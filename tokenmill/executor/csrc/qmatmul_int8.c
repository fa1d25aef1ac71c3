/* The int8 route over llama.cpp's 32-wide blocks (Q4_0, Q4_1, Q8_0) for decode-sized batches, as llama.cpp
 * multiplies them: each 32 of x rounded to int8 with its own scale (dx = max|x| / 127, its Q8_0/Q8_1), the codes
 * meeting xq in integer multiply-adds, and each block's d * dx entered once in float; Q4's offset m comes in
 * through the blocks' sums, m * dx * sum(xq). The result equals the dequantised weights times the rounded x, to
 * float32 rounding. Integer work per weight is a fraction of the float route's dequantise-then-FMA, so a few
 * inputs (a verification step's rows) cost far less than as many one-input calls.
 *
 * Each input's arithmetic is the same whatever the batch and the threads: row b of y depends on row b of x only,
 * so a step of several rows gives every row the bits a step of one gives it.
 *
 * x86 only (AVX2 and AVX-512BW); the other variants keep the float route (HAVE_QMATMUL_INT8 in qmatmul.h). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qmatmul.h"

#if HAVE_QMATMUL_INT8
/* Integer vectors are the variant's; float ones simd.h's vf. W: bytes in an integer vector; G: its 128-bit lanes, the Q4 blocks whose codes fill it (G / 2 Q8 blocks do) */
#if defined(__AVX512BW__)
#define W 64
typedef __m512i vi8;
#define I8_MAX_B 8          /* inputs a pass keeps accumulators for: 32 registers */
#else
#define W 32
typedef __m256i vi8;
#define I8_MAX_B 4          /* 16 registers */
#endif
#define G (W / 16)
#define LANES (W / 4)       /* int32 lanes, and simd.h's float vector vf */
_Static_assert(LANES == VL, "an integer vector's int32 lanes are simd.h's float lanes");

/* ---- the vector operations, per instruction set ------------------------------------------------------------- */
#if W == 64
TM_INLINE vi8 load_bytes(const void *p, int bytes) {   /* the first bytes (0 .. W), the rest zero */
    return bytes == W ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8((1ULL << bytes) - 1, p);
}
TM_INLINE vf load_floats(const float *p, int n) {   /* n floats, the rest zero */
    return (vf)(n == LANES ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p));
}
TM_INLINE vi8 low_nibbles(vi8 v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
TM_INLINE vi8 high_nibbles(vi8 v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
/* Q8_0's signed codes for an unsigned-by-signed multiply: |w| into u, and x with w's sign into s */
TM_INLINE void sign_apart(vi8 w, vi8 x, vi8 *u, vi8 *s) {
    *u = _mm512_abs_epi8(w);
    *s = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
}
TM_INLINE vf spread8(const float *d, int n) {
    return (vf)_mm512_insertf32x8(_mm512_set1_ps(d[0]), _mm256_set1_ps(n == 2 ? d[1] : 0.f), 1);
}
/* four vectors' dwords turned round within each 128-bit lane: out[k] holds dword k of in[0..3] */
TM_INLINE void transpose4(const vi8 in[4], vi8 out[4]) {
    const vi8 t0 = _mm512_unpacklo_epi32(in[0], in[1]), t1 = _mm512_unpackhi_epi32(in[0], in[1]);
    const vi8 t2 = _mm512_unpacklo_epi32(in[2], in[3]), t3 = _mm512_unpackhi_epi32(in[2], in[3]);
    out[0] = _mm512_unpacklo_epi64(t0, t2), out[1] = _mm512_unpackhi_epi64(t0, t2);
    out[2] = _mm512_unpacklo_epi64(t1, t3), out[3] = _mm512_unpackhi_epi64(t1, t3);
}
TM_INLINE vi8 maddubs(vi8 u, vi8 s) { return _mm512_maddubs_epi16(u, s); }
TM_INLINE vi8 add16(vi8 a, vi8 b) { return _mm512_add_epi16(a, b); }
TM_INLINE vi8 widen_sum16(vi8 a) { return _mm512_madd_epi16(a, _mm512_set1_epi16(1)); }
/* a group's LANES block scales, lane L taking block lane_block(L) */
TM_INLINE vf group_scales(const float *d, int n) {
    return (vf)_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15),
                                     (__m512)load_floats(d, n));
}
/* n blocks' scales, block a across 128-bit lane a */
TM_INLINE vf lane_scales(const float *d, int n) {
    return (vf)_mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                     (__m512)load_floats(d, n));
}
TM_INLINE vf to_float(vi8 v) { return (vf)_mm512_cvtepi32_ps(v); }
/* lane r of the result: the sum of v[r]'s lanes, for LANES vectors at once (a tree of shuffles, a few operations a
 * vector where a lone sum takes eight); each lane's sum is taken in the same order whatever its r */
TM_INLINE vf sum_each(const vf v[LANES]) {
    __m512 h[8], q[4];
    for (int i = 0; i < 8; i++)     /* halves added: a | b, 8 lanes each */
        h[i] = _mm512_add_ps(_mm512_shuffle_f32x4((__m512)v[2 * i], (__m512)v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4((__m512)v[2 * i], (__m512)v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)     /* quarters added: 128-bit lane c holds vector 4i + c's 4 lanes */
        q[i] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], 0xDD));
    const __m512 s0 = _mm512_add_ps(_mm512_unpacklo_ps(q[0], q[1]), _mm512_unpackhi_ps(q[0], q[1]));
    const __m512 s1 = _mm512_add_ps(_mm512_unpacklo_ps(q[2], q[3]), _mm512_unpackhi_ps(q[2], q[3]));
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(s0, s1, 0x44), _mm512_shuffle_ps(s0, s1, 0xEE));
    /* lane 4c + i now holds vector 4i + c */
    return (vf)_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}
TM_INLINE void store_floats(float *p, vf v, int n) {   /* the first n lanes */
    if (n == LANES) _mm512_storeu_ps(p, (__m512)v);
    else _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), (__m512)v);
}
#else
TM_INLINE vi8 load_bytes(const void *p, int bytes) {   /* W, 16 or none */
    return bytes == W    ? _mm256_loadu_si256((const __m256i *)p)
           : bytes == 16 ? _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)p))
                         : _mm256_setzero_si256();
}
TM_INLINE vf load_floats(const float *p, int n) {
    return (vf)(n == LANES ? _mm256_loadu_ps(p)
                           : _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n),
                                                                      _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))));
}
TM_INLINE vi8 low_nibbles(vi8 v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
TM_INLINE vi8 high_nibbles(vi8 v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
TM_INLINE void sign_apart(vi8 w, vi8 x, vi8 *u, vi8 *s) {
    *u = _mm256_sign_epi8(w, w);
    *s = _mm256_sign_epi8(x, w);
}
TM_INLINE vf spread8(const float *d, int n) { return vset1(d[0]); }
TM_INLINE void transpose4(const vi8 in[4], vi8 out[4]) {
    const vi8 t0 = _mm256_unpacklo_epi32(in[0], in[1]), t1 = _mm256_unpackhi_epi32(in[0], in[1]);
    const vi8 t2 = _mm256_unpacklo_epi32(in[2], in[3]), t3 = _mm256_unpackhi_epi32(in[2], in[3]);
    out[0] = _mm256_unpacklo_epi64(t0, t2), out[1] = _mm256_unpackhi_epi64(t0, t2);
    out[2] = _mm256_unpacklo_epi64(t1, t3), out[3] = _mm256_unpackhi_epi64(t1, t3);
}
TM_INLINE vi8 maddubs(vi8 u, vi8 s) { return _mm256_maddubs_epi16(u, s); }
TM_INLINE vi8 add16(vi8 a, vi8 b) { return _mm256_add_epi16(a, b); }
TM_INLINE vi8 widen_sum16(vi8 a) { return _mm256_madd_epi16(a, _mm256_set1_epi16(1)); }
TM_INLINE vf group_scales(const float *d, int n) {
    return (vf)_mm256_permutevar8x32_ps((__m256)load_floats(d, n), _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
}
TM_INLINE vf lane_scales(const float *d, int n) {
    return (vf)_mm256_permutevar8x32_ps((__m256)load_floats(d, n), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}
TM_INLINE vf to_float(vi8 v) { return (vf)_mm256_cvtepi32_ps(v); }
TM_INLINE vf sum_each(const vf v[LANES]) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps((__m256)v[0], (__m256)v[1]),
                                    _mm256_hadd_ps((__m256)v[2], (__m256)v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps((__m256)v[4], (__m256)v[5]),
                                    _mm256_hadd_ps((__m256)v[6], (__m256)v[7]));
    /* a: vectors 0..3's low-half sums, then their high-half sums; b: 4..7's */
    return (vf)_mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
TM_INLINE void store_floats(float *p, vf v, int n) {
    if (n == LANES) _mm256_storeu_ps(p, (__m256)v);
    else _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
                             (__m256)v);
}
#endif

/* int32 lanes: sums of four u8 x s8 products (Q8_0's signed codes split by sign_apart first) */
TM_INLINE vi8 dot_s8s8(vi8 w, vi8 x) {
    vi8 u, s;
    sign_apart(w, x, &u, &s);
    return widen_sum16(maddubs(u, s));
}

/* ---- x rounded, laid out as the codes will meet it ----------------------------------------------------------
 * q4 goes a group of LANES blocks at a time, one block a lane, so that a block's 32 products add up in one lane in
 * integers and its scales come in once: the group's codes (4 vectors, 128-bit lane a of vector s holding block
 * G * s + a) are turned round so that vector k holds every block's bytes 4k .. 4k+3 (transpose4), and lane L = 4a + s
 * then takes block G * (L % 4) + L / 4 (lane_block). x is laid out to match: per group, for k = 0..3, W bytes of
 * each lane's block positions 4k .. 4k+3, then W of positions 16 + 4k ...
 * A short tail of blocks (up to TAIL_MAX; K = 576 leaves 2 past 16) would cost a whole group, so it goes as the
 * codes lie, G blocks a vector, a block a 128-bit lane: per tail vector, W bytes of each block's positions 0 .. 15,
 * then W of 16 .. 31, matching the low and high nibbles.
 * q8 goes a vector of codes (G / 2 blocks, 8 lanes each) at a time, x in its own order.
 * dxs: per step (q4: group or tail vector), each lane's block dx (zero past the last block); sx (q4): per step,
 * dx * sum(xq) of each lane's block where its codes begin (a group's every lane, a tail block's first of 4 lanes),
 * zero elsewhere, so that Q4's offsets m enter beside the scales, once a block. */
#define TAIL_MAX (2 * G)

typedef struct {
    int8_t *xq;         /* [B][bytes] */
    float *dxs;         /* [B][steps * LANES] */
    float *sx;          /* [B][steps * LANES] (q4) */
    int groups, steps;  /* q4: whole (or masked) groups, then steps - groups tail vectors; q8: steps vectors */
    size_t group_bytes, bytes;  /* a group's (q4) or a step's (q8); all of an input's */
} xint8;

TM_INLINE int lane_block(int L) { return G * (L % 4) + L / 4; }
/* where step's x starts for input b: q4's groups take 8 W bytes each and its tail vectors 2 W, q8's steps W */
TM_INLINE int8_t *xq_at(const xint8 *x, int b, int step) {
    const size_t at = step <= x->groups ? (size_t)step * x->group_bytes
                                        : (size_t)x->groups * x->group_bytes + (size_t)(step - x->groups) * 2 * W;
    return x->xq + (size_t)b * x->bytes + at;
}

static int round_x(int q4, const float *x, int B, int K, xint8 *r) {
    const int nb = K / QK, tail = q4 ? nb % LANES : 0, natural = tail > 0 && tail <= TAIL_MAX;
    if (q4) {
        r->groups = natural ? nb / LANES : (nb + LANES - 1) / LANES;
        r->steps = r->groups + (natural ? (tail + G - 1) / G : 0);
        r->group_bytes = 8 * W;
        r->bytes = (size_t)r->groups * 8 * W + (size_t)(r->steps - r->groups) * 2 * W;
    } else {
        r->groups = r->steps = (nb + G / 2 - 1) / (G / 2);
        r->group_bytes = W;
        r->bytes = (size_t)r->steps * W;
    }
    r->xq = calloc((size_t)B * r->bytes, 1);
    r->dxs = calloc((size_t)B * r->steps * LANES, sizeof(float));
    r->sx = q4 ? calloc((size_t)B * r->steps * LANES, sizeof(float)) : NULL;
    if (!r->xq || !r->dxs || (q4 && !r->sx)) return -2;
    int lane_of[LANES];     /* the lane each block of a q4 group takes */
    for (int L = 0; L < LANES; L++) lane_of[lane_block(L)] = L;
    const int grouped = q4 ? (natural ? nb / LANES * LANES : nb) : 0;   /* blocks before the q4 tail */
    for (int b = 0; b < B; b++) {
        float *dxs = r->dxs + (size_t)b * r->steps * LANES, *sx = r->sx + (size_t)b * r->steps * LANES;
        for (int i = 0; i < nb; i++) {
            const float *v = x + (size_t)b * K + (size_t)i * QK;
            float amax = 0.f;
            for (int j = 0; j < QK; j++) amax = v[j] > amax ? v[j] : -v[j] > amax ? -v[j] : amax;
            const float dx = amax / 127.f, id = dx != 0.f ? 1.f / dx : 0.f;
            int8_t q[QK];
            int sum = 0;
            for (int j = 0; j < QK; j++) {
                q[j] = (int8_t)__builtin_rintf(v[j] * id);    /* nearest, ties to even */
                sum += q[j];
            }
            if (q4 && i < grouped) {
                const int step = i / LANES, L = lane_of[i % LANES];
                int8_t *o = xq_at(r, b, step);
                for (int k = 0; k < 4; k++) {
                    memcpy(o + (size_t)(2 * k) * W + 4 * L, q + 4 * k, 4);
                    memcpy(o + (size_t)(2 * k + 1) * W + 4 * L, q + 16 + 4 * k, 4);
                }
                dxs[(size_t)step * LANES + L] = dx;
                sx[(size_t)step * LANES + L] = dx * (float)sum;
            } else if (q4) {
                const int step = r->groups + (i - grouped) / G, a = (i - grouped) % G;
                int8_t *o = xq_at(r, b, step);
                memcpy(o + 16 * a, q, 16);
                memcpy(o + W + 16 * a, q + 16, 16);
                for (int l = 0; l < 4; l++) dxs[(size_t)step * LANES + 4 * a + l] = dx;
                sx[(size_t)step * LANES + 4 * a] = dx * (float)sum;
            } else {
                const int step = i / (G / 2), at = i % (G / 2);
                memcpy(xq_at(r, b, step) + 32 * at, q, 32);
                for (int l = 0; l < 8; l++) dxs[(size_t)step * LANES + 8 * at + l] = dx;
            }
        }
    }
    return 0;
}

/* ---- one weight row against B inputs (B a constant at each call site: accumulators in registers) --------
 * Each input's LANES partial sums go to out (a vector every ostride floats), to be added up with a task's other
 * rows (sum_each). */
TM_INLINE void row_q4(const uint8_t *codes, const float *d, const float *m, int nb, const xint8 *x, int b0, int B,
                      float *out, size_t ostride) {
    vf acc[I8_MAX_B];
#pragma GCC unroll 8
    for (int b = 0; b < B; b++) acc[b] = (vf){0};
    for (int g = 0; g < x->groups; g++) {   /* whole groups, then perhaps a partial one (loads masked to its blocks) */
        const int blocks = nb - g * LANES < LANES ? nb - g * LANES : LANES;
        vi8 raw[4], c[4];
        for (int v = 0; v < 4; v++) {
            const int left = 16 * blocks - v * W;
            raw[v] = load_bytes(codes + (size_t)g * 4 * W + (size_t)v * W, left >= W ? W : left > 0 ? left : 0);
        }
        transpose4(raw, c);
        const vf dw = group_scales(d + (size_t)g * LANES, blocks), mw = group_scales(m + (size_t)g * LANES, blocks);
        vi8 lo[4], hi[4];
        for (int k = 0; k < 4; k++) lo[k] = low_nibbles(c[k]), hi[k] = high_nibbles(c[k]);
#pragma GCC unroll 8
        for (int b = 0; b < B; b++) {
            const int8_t *xq = xq_at(x, b0 + b, g);
            /* 16 products in a 16-bit lane at most: 16 * 15 * 127 < 2^15 */
            vi8 t = maddubs(lo[0], load_bytes(xq, W));
            t = add16(t, maddubs(hi[0], load_bytes(xq + W, W)));
            for (int k = 1; k < 4; k++) {
                t = add16(t, maddubs(lo[k], load_bytes(xq + 2 * k * W, W)));
                t = add16(t, maddubs(hi[k], load_bytes(xq + (2 * k + 1) * W, W)));
            }
            t = widen_sum16(t);
            const size_t at = ((size_t)(b0 + b) * x->steps + g) * LANES;
            acc[b] = vfma(to_float(t), dw * load_floats(x->dxs + at, LANES), acc[b]);
            acc[b] = vfma(mw, load_floats(x->sx + at, LANES), acc[b]);
        }
    }
    for (int v = x->groups; v < x->steps; v++) {   /* the tail as the codes lie, a block a 128-bit lane */
        const int first = x->groups * LANES + (v - x->groups) * G, blocks = nb - first < G ? nb - first : G;
        const vi8 c = load_bytes(codes + (size_t)first * 16, 16 * blocks);
        const vi8 lo = low_nibbles(c), hi = high_nibbles(c);
        const vf dw = lane_scales(d + first, blocks), mw = lane_scales(m + first, blocks);
#pragma GCC unroll 8
        for (int b = 0; b < B; b++) {
            const int8_t *xq = xq_at(x, b0 + b, v);
            const vi8 t = widen_sum16(add16(maddubs(lo, load_bytes(xq, W)), maddubs(hi, load_bytes(xq + W, W))));
            const size_t at = ((size_t)(b0 + b) * x->steps + v) * LANES;
            acc[b] = vfma(to_float(t), dw * load_floats(x->dxs + at, LANES), acc[b]);
            acc[b] = vfma(mw, load_floats(x->sx + at, LANES), acc[b]);
        }
    }
#pragma GCC unroll 8
    for (int b = 0; b < B; b++) vstore(out + (size_t)b * ostride, acc[b]);
}

TM_INLINE void row_q8(const int8_t *codes, const float *d, int nb, const xint8 *x, int b0, int B, float *out,
                      size_t ostride) {
    vf acc[I8_MAX_B];
#pragma GCC unroll 8
    for (int b = 0; b < B; b++) acc[b] = (vf){0};
    const int per = G / 2, full = nb / per;
    for (int v = 0; v <= full; v++) {
        const int blocks = v < full ? per : nb - full * per;
        if (blocks == 0) break;
        const vi8 c = load_bytes(codes + (size_t)v * W, 32 * blocks);
        const vf dw = spread8(d + (size_t)v * per, blocks);
#pragma GCC unroll 8
        for (int b = 0; b < B; b++) {
            const int8_t *xq = xq_at(x, b0 + b, v);
            const vf dx = load_floats(x->dxs + ((size_t)(b0 + b) * x->steps + v) * LANES, LANES);
            acc[b] = vfma(to_float(dot_s8s8(c, load_bytes(xq, W))), dw * dx, acc[b]);
        }
    }
#pragma GCC unroll 8
    for (int b = 0; b < B; b++) vstore(out + (size_t)b * ostride, acc[b]);
}

#define PF_ROWS 8           /* rows ahead whose blocks are asked for */
#define ROWS_PER_TASK 16    /* whole rows a task takes: their codes stay in L1 while every chunk of inputs passes */
_Static_assert(ROWS_PER_TASK % LANES == 0, "a task's rows are added up LANES at a time");

int qmatmul_int8(int q4, const float *x, int B, int K, int N, const uint8_t *codes, const float *d,
                 const float *m, float *y, int num_threads) {
    xint8 xr;
    int rc = round_x(q4, x, B, K, &xr);
    if (rc == 0) {
        const int nb = K / QK;
        const size_t row_bytes = q4 ? (size_t)K / 2 : (size_t)K;
        const int tasks = (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int t = 0; t < tasks; t++) {
            const int n0 = t * ROWS_PER_TASK, n1 = n0 + ROWS_PER_TASK < N ? n0 + ROWS_PER_TASK : N;
            /* each input's partial sums of the task's rows, [input][row][LANES]; rows past N stay zero */
            float tile[I8_MAX_B * ROWS_PER_TASK * LANES] __attribute__((aligned(64)));
            if (n1 - n0 < ROWS_PER_TASK) memset(tile, 0, sizeof tile);
            for (int b0 = 0; b0 < B; b0 += I8_MAX_B) {
                const int bc = B - b0 < I8_MAX_B ? B - b0 : I8_MAX_B;
                for (int n = n0; n < n1; n++) {
                    if (n + PF_ROWS < N) {   /* rows sit back to back: ask for a later row's blocks ahead of use */
                        const uint8_t *pc = codes + (size_t)(n + PF_ROWS) * row_bytes;
                        for (size_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(pc + o, 0, 3);
                        for (size_t o = 0; o < (size_t)nb * 4; o += 64) {
                            __builtin_prefetch((const char *)(d + (size_t)(n + PF_ROWS) * nb) + o, 0, 3);
                            if (q4) __builtin_prefetch((const char *)(m + (size_t)(n + PF_ROWS) * nb) + o, 0, 3);
                        }
                    }
                    const uint8_t *c = codes + (size_t)n * row_bytes;
                    const float *dn = d + (size_t)n * nb, *mn = q4 ? m + (size_t)n * nb : NULL;
                    float *out = tile + (size_t)(n - n0) * LANES;
                    const size_t os = (size_t)ROWS_PER_TASK * LANES;
#define ROW(BC) (q4 ? row_q4(c, dn, mn, nb, &xr, b0, BC, out, os) \
                    : row_q8((const int8_t *)c, dn, nb, &xr, b0, BC, out, os))
                    switch (bc) {
                        case 1: ROW(1); break;
                        case 2: ROW(2); break;
                        case 3: ROW(3); break;
#if I8_MAX_B == 8
                        case 4: ROW(4); break;
                        case 5: ROW(5); break;
                        case 6: ROW(6); break;
                        case 7: ROW(7); break;
#endif
                        default: ROW(I8_MAX_B); break;
                    }
#undef ROW
                }
                for (int b = 0; b < bc; b++)
                    for (int r = 0; r < n1 - n0; r += LANES) {
                        vf v[LANES];
                        for (int i = 0; i < LANES; i++)
                            v[i] = vload(tile + ((size_t)b * ROWS_PER_TASK + r + i) * LANES);
                        const int rows = n1 - n0 - r < LANES ? n1 - n0 - r : LANES;
                        store_floats(y + (size_t)(b0 + b) * N + n0 + r, sum_each(v), rows);
                    }
            }
        }
    }
    free(xr.xq);
    free(xr.dxs);
    free(xr.sx);
    return rc;
}
#endif
