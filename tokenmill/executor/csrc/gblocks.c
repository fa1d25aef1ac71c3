/* Matmul and dequantisation over a GGUF matrix in its file's own blocks (tokenmill.h: tm_gweight), read where
 * the file is mapped: F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants Q2_K .. Q6_K and MXFP4.
 *
 * Each type is one function that dequantises one block into floats, with the arithmetic and order of llama.cpp's
 * reference dequantiser (ggml-quants.c, and gguf-py's numpy port, the tests' oracle). The matmul dequantises a
 * row's blocks one at a time into L1 and multiplies each into every input; prefill-sized batches instead
 * dequantise tiles of rows (tm_gdequant) for a float GEMM, so a block is decoded once for all the batch's rows.
 */
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#include "half.h"
#include "simd.h"
#include "tokenmill.h"

#define QK_K 256

/* GGUF's little-endian half */
TM_INLINE float fp16(const uint8_t *p) {
    return tm_half_to_f32((uint16_t)(p[0] | (p[1] << 8)));
}

/* ---- one block of each type -------------------------------------------------------------------------------- */
static void dq_f16(const uint8_t *b, float *y) {
    for (int j = 0; j < 32; j++) y[j] = fp16(b + 2 * j);
}

static void dq_bf16(const uint8_t *b, float *y) {
    for (int j = 0; j < 32; j++) y[j] = tm_f32_bits((uint32_t)(b[2 * j] | (b[2 * j + 1] << 8)) << 16);
}

static void dq_q4_0(const uint8_t *b, float *y) {   /* d, then 16 bytes: code j low, code j + 16 high */
    const float d = fp16(b);
    for (int j = 0; j < 16; j++) {
        y[j] = ((b[2 + j] & 15) - 8) * d;
        y[j + 16] = ((b[2 + j] >> 4) - 8) * d;
    }
}

static void dq_q4_1(const uint8_t *b, float *y) {   /* d, m, 16 bytes */
    const float d = fp16(b), m = fp16(b + 2);
    for (int j = 0; j < 16; j++) {
        y[j] = (b[4 + j] & 15) * d + m;
        y[j + 16] = (b[4 + j] >> 4) * d + m;
    }
}

static void dq_q5_0(const uint8_t *b, float *y) {   /* d, 32 high bits, 16 bytes of low nibbles */
    const float d = fp16(b);
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    for (int j = 0; j < 16; j++) {
        const int hi0 = ((qh >> j) << 4) & 0x10, hi1 = (qh >> (j + 12)) & 0x10;
        y[j] = (((b[6 + j] & 15) | hi0) - 16) * d;
        y[j + 16] = (((b[6 + j] >> 4) | hi1) - 16) * d;
    }
}

static void dq_q5_1(const uint8_t *b, float *y) {   /* d, m, 32 high bits, 16 bytes */
    const float d = fp16(b), m = fp16(b + 2);
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    for (int j = 0; j < 16; j++) {
        const int hi0 = ((qh >> j) << 4) & 0x10, hi1 = (qh >> (j + 12)) & 0x10;
        y[j] = ((b[8 + j] & 15) | hi0) * d + m;
        y[j + 16] = ((b[8 + j] >> 4) | hi1) * d + m;
    }
}

static void dq_q8_0(const uint8_t *b, float *y) {   /* d, 32 signed bytes */
    const float d = fp16(b);
    for (int j = 0; j < 32; j++) y[j] = (int8_t)b[2 + j] * d;
}

/* Q4_K and Q5_K: 8 sub-blocks of 32, each a 6-bit scale and min packed into 12 bytes */
TM_INLINE void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* the eight sub-blocks' d * scale and dmin * min of a Q4_K or Q5_K super-block (d, dmin, scales[12] first) */
TM_INLINE void k4_scales(const uint8_t *blk, float *ds, float *ms) {
    const float d = fp16(blk), dmin = fp16(blk + 2);
    for (int j = 0; j < 8; j++) {
        int sc, m;
        scale_min_k4(j, blk + 4, &sc, &m);
        ds[j] = d * sc;
        ms[j] = dmin * m;
    }
}

/* MXFP4 (gpt-oss's experts): an E8M0 exponent e, then 16 bytes of e2m1 codes (code j low, code j + 16 high); a
 * code's value doubled, an integer, times 2^(e - 128), ggml's e8m0_to_fp32_half (exact, as each product is) */
static const float MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static void dq_mxfp4(const uint8_t *b, float *y) {
    const uint32_t e = b[0];
    const float d = tm_f32_bits(e < 2 ? 0x00200000u << e : (e - 1) << 23);
    for (int j = 0; j < 16; j++) {
        y[j] = MXFP4_VALUES[b[1 + j] & 15] * d;
        y[j + 16] = MXFP4_VALUES[b[1 + j] >> 4] * d;
    }
}

static void dq_q2_k(const uint8_t *b, float *y) {   /* scales[16], qs[64], d, dmin */
    const uint8_t *scales = b, *q = b + 16;
    const float d = fp16(b + 80), dmin = fp16(b + 82);
    int is = 0;
    for (int n = 0; n < QK_K; n += 128, q += 32)
        for (int shift = 0; shift < 8; shift += 2)
            for (int half = 0; half < 2; half++) {
                const int sc = scales[is++];
                const float dl = d * (sc & 15), ml = dmin * (sc >> 4);
                for (int l = 0; l < 16; l++) *y++ = dl * ((q[l + 16 * half] >> shift) & 3) - ml;
            }
}

static void dq_q3_k(const uint8_t *b, float *y) {   /* hmask[32], qs[64], scales[12], d */
    const uint8_t *hm = b, *q = b + 32, *s = b + 96;
    const float d = fp16(b + 108);
    int8_t scales[16];
    for (int j = 0; j < 16; j++) {   /* 6-bit scales: low 4 bits from s[0..7], high 2 from s[8..11] */
        const int lo = j < 8 ? s[j] & 15 : s[j - 8] >> 4;
        const int hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        scales[j] = (int8_t)((lo | (hi << 4)) - 32);
    }
    int is = 0;
    uint8_t m = 1;
    for (int n = 0; n < QK_K; n += 128, q += 32)
        for (int shift = 0; shift < 8; shift += 2, m <<= 1)
            for (int half = 0; half < 2; half++) {
                const float dl = d * scales[is++];
                for (int l = 16 * half; l < 16 * half + 16; l++)
                    *y++ = dl * ((int8_t)((q[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4));
            }
}

static void dq_q4_k(const uint8_t *b, float *y) {   /* d, dmin, scales[12], qs[128] */
    float ds[8], ms[8];
    k4_scales(b, ds, ms);
    const uint8_t *q = b + 16;
    for (int j = 0; j < 4; j++, q += 32) {
        for (int l = 0; l < 32; l++) y[64 * j + l] = ds[2 * j] * (q[l] & 15) - ms[2 * j];
        for (int l = 0; l < 32; l++) y[64 * j + 32 + l] = ds[2 * j + 1] * (q[l] >> 4) - ms[2 * j + 1];
    }
}

static void dq_q5_k(const uint8_t *b, float *y) {   /* d, dmin, scales[12], qh[32], qs[128] */
    float ds[8], ms[8];
    k4_scales(b, ds, ms);
    const uint8_t *qh = b + 16, *q = b + 48;
    for (int j = 0; j < 4; j++, q += 32) {
        const uint8_t u1 = (uint8_t)(1 << (2 * j)), u2 = (uint8_t)(2 << (2 * j));
        for (int l = 0; l < 32; l++) y[64 * j + l] = ds[2 * j] * ((q[l] & 15) + (qh[l] & u1 ? 16 : 0)) - ms[2 * j];
        for (int l = 0; l < 32; l++)
            y[64 * j + 32 + l] = ds[2 * j + 1] * ((q[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - ms[2 * j + 1];
    }
}

static void dq_q6_k(const uint8_t *b, float *y) {   /* ql[128], qh[64], scales[16] (int8), d */
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = fp16(b + 208);
    for (int n = 0; n < QK_K; n += 128, y += 128, ql += 64, qh += 32, sc += 8)
        for (int l = 0; l < 32; l++) {
            const int is = l / 16;
            const int q1 = ((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32;
            const int q2 = ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l] = d * sc[is] * q1;
            y[l + 32] = d * sc[is + 2] * q2;
            y[l + 64] = d * sc[is + 4] * q3;
            y[l + 96] = d * sc[is + 6] * q4;
        }
}

/* ---- the types: ggml's type ids, elements and bytes per block ---------------------------------------------- */
typedef void (*dq_fn)(const uint8_t *, float *);
typedef struct {
    int id, block, bytes;
    dq_fn dq;
} gtype;

static const gtype TYPES[] = {
    {1, 32, 64, dq_f16},     {30, 32, 64, dq_bf16},   {2, 32, 18, dq_q4_0},    {3, 32, 20, dq_q4_1},
    {6, 32, 22, dq_q5_0},    {7, 32, 24, dq_q5_1},    {8, 32, 34, dq_q8_0},    {10, QK_K, 84, dq_q2_k},
    {11, QK_K, 110, dq_q3_k}, {12, QK_K, 144, dq_q4_k}, {13, QK_K, 176, dq_q5_k}, {14, QK_K, 210, dq_q6_k},
    {39, 32, 17, dq_mxfp4},
};

static const gtype *find_type(const tm_gweight *w) {
    for (size_t i = 0; i < sizeof TYPES / sizeof TYPES[0]; i++)
        if (TYPES[i].id == w->type) {
            const gtype *t = &TYPES[i];
            if (w->k < 1 || w->k % t->block || w->n < 1 || w->row_bytes != (int64_t)(w->k / t->block) * t->bytes)
                return NULL;
            return t;
        }
    return NULL;
}

/* ---- dequantise rows (prefill tiles, embedding lookups) ---------------------------------------------------- */
TM_API int tm_gdequant(const tm_gdequant_args *a) {
    const tm_gweight *w = a->w;
    const gtype *t = find_type(w);
    if (!t || a->rows < 0 || (!a->ids && (a->row0 < 0 || (int64_t)a->row0 + a->rows > w->n))) return -1;
    if (a->ids)
        for (int r = 0; r < a->rows; r++)
            if (a->ids[r] < 0 || a->ids[r] >= w->n) return -3;
    const int nb = w->k / t->block;
#pragma omp parallel for schedule(static) num_threads(a->rows > 8 ? a->num_threads : 1)
    for (int r = 0; r < a->rows; r++) {
        const int64_t n = a->ids ? a->ids[r] : (int64_t)a->row0 + r;
        const uint8_t *row = w->data + n * w->row_bytes;
        float *out = a->out + (size_t)r * w->k;
        for (int i = 0; i < nb; i++) t->dq(row + (size_t)i * t->bytes, out + (size_t)i * t->block);
    }
    return 0;
}

/* ---- matmul for a few rows of x -------------------------------------------------------------------------- */
/* One weight row against B inputs: each block dequantised once into buf (L1), then multiplied into all B. Two
 * accumulators an input keep two FMA chains in flight. BLOCK is a constant at each call (the switch below). */
TM_INLINE void row_dot(dq_fn dq, int BLOCK, int BYTES, const uint8_t *row, int nb, const float *x, int K, int B,
                       float *y, size_t ystride) {
    float buf[QK_K] __attribute__((aligned(64)));
    vf acc[TM_GMATMUL_MAX_ROWS][2];
    for (int b = 0; b < B; b++) acc[b][0] = acc[b][1] = (vf){0};
    for (int i = 0; i < nb; i++) {
        dq(row + (size_t)i * BYTES, buf);
        for (int b = 0; b < B; b++) {
            const float *xb = x + (size_t)b * K + (size_t)i * BLOCK;
            vf a0 = acc[b][0], a1 = acc[b][1];
            for (int v = 0; v < BLOCK / VL; v += 2) {
                a0 = vfma(vload(buf + v * VL), vload(xb + v * VL), a0);
                a1 = vfma(vload(buf + (v + 1) * VL), vload(xb + (v + 1) * VL), a1);
            }
            acc[b][0] = a0;
            acc[b][1] = a1;
        }
    }
    for (int b = 0; b < B; b++) y[(size_t)b * ystride] = vhsum(acc[b][0] + acc[b][1]);
}

/* ---- Q4_K and Q6_K, the types of the Q4_K_M files most people run: their own matmul -------------------------
 * Decode reads each weight once for few inputs, so converting codes is most of the work: a sub-block's codes are
 * turned to floats once and meet every input, and its scale (and Q4_K's min) come in once a sub-block,
 * d1 * sum(q x) - m1 * sum(x), with the inputs' sums per 32 (xs) computed once a call. */
typedef int32_t vi __attribute__((vector_size(VL * 4)));

TM_INLINE vi load_u8(const uint8_t *p) {   /* VL bytes widened to VL int32 (GCC's own conversion goes byte by byte) */
#if defined(__AVX512F__)
    return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif VL == 8 && defined(__AVX2__)
    return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#elif defined(__ARM_NEON)
    uint8x8_t b = vdup_n_u8(0);
    memcpy(&b, p, 4);
    return (vi)vmovl_u16(vget_low_u16(vmovl_u8(b)));
#else
    vi v;
    for (int j = 0; j < VL; j++) v[j] = p[j];
    return v;
#endif
}
TM_INLINE vf to_f(vi v) { return __builtin_convertvector(v, vf); }

#define SUB (32 / VL)    /* vectors in 32 weights */

/* Q4_K's mins times the inputs' sums per 32 (xs [B][K/32]) for super-block i, into each input's offset */
TM_INLINE void add_mins(const float *ms, const float *xs, int K, int i, int B, float *off) {
    for (int b = 0; b < B; b++) {
        const float *s = xs + (size_t)b * (K / 32) + (size_t)i * 8;
        float o = 0.f;
        for (int j = 0; j < 8; j++) o += ms[j] * s[j];
        off[b] += o;
    }
}

/* One Q4_K row against B inputs; B a constant at each call site (gmatmul_kquant), so one input keeps its
 * accumulators in registers, two of them to halve the chain of dependent FMAs. */
TM_INLINE void q4k_row(const uint8_t *row, int nsb, const float *x, const float *xs, int K, int B, float *y,
                       size_t ystride) {
    vf acc[TM_GMATMUL_MAX_ROWS][2];
    float off[TM_GMATMUL_MAX_ROWS];
    for (int b = 0; b < B; b++) acc[b][0] = acc[b][1] = (vf){0}, off[b] = 0.f;
    for (int i = 0; i < nsb; i++) {
        const uint8_t *blk = row + (size_t)i * 144, *q = blk + 16;
        float ds[8], ms[8];
        k4_scales(blk, ds, ms);
        add_mins(ms, xs, K, i, B, off);
        for (int j = 0; j < 4; j++, q += 32) {
            vf lo[SUB], hi[SUB];
            for (int v = 0; v < SUB; v++) {
                const vi c = load_u8(q + v * VL);
                lo[v] = to_f(c & 15);
                hi[v] = to_f(c >> 4);
            }
            const vf d1 = vset1(ds[2 * j]), d2 = vset1(ds[2 * j + 1]);
            for (int b = 0; b < B; b++) {
                const float *xb = x + (size_t)b * K + (size_t)i * QK_K + 64 * j;
                vf t1 = lo[0] * vload(xb), t2 = hi[0] * vload(xb + 32);
                for (int v = 1; v < SUB; v++) {
                    t1 = vfma(lo[v], vload(xb + v * VL), t1);
                    t2 = vfma(hi[v], vload(xb + 32 + v * VL), t2);
                }
                acc[b][0] = vfma(d1, t1, acc[b][0]);
                acc[b][1] = vfma(d2, t2, acc[b][1]);
            }
        }
    }
    for (int b = 0; b < B; b++) y[(size_t)b * ystride] = vhsum(acc[b][0] + acc[b][1]) - off[b];
}

/* Q6_K's 6-bit codes are put together a byte at a time, 32 positions in one vector op, then widened: the same
 * work on 32-bit lanes took 4x the integer ops. A 16-position group's scale comes in once, d * sc * (sum(q x)
 * - 32 sum(x)), with the inputs' sums per 16 (xs16) computed once a call. */
typedef uint8_t vb32 __attribute__((vector_size(32)));

TM_INLINE void widen16(const uint8_t *p, vf *out) {   /* 16 bytes -> 16 / VL float vectors */
    for (int v = 0; v < 16 / VL; v++) out[v] = to_f(load_u8(p + v * VL));
}

TM_INLINE void q6k_row(const uint8_t *row, int nsb, const float *x, const float *xs16, int K, int B, float *y,
                       size_t ystride) {
    vf acc[TM_GMATMUL_MAX_ROWS];
    float off[TM_GMATMUL_MAX_ROWS];
    for (int b = 0; b < B; b++) acc[b] = (vf){0}, off[b] = 0.f;
    for (int i = 0; i < nsb; i++) {
        const uint8_t *blk = row + (size_t)i * 210;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = fp16(blk + 208);
        float ds[16];
        for (int j = 0; j < 16; j++) ds[j] = d * sc[j];
        if (B == 1) {
            const float *s = xs16 + (size_t)i * 16;
            float o = 0.f;
            for (int j = 0; j < 16; j++) o += ds[j] * s[j];
            off[0] += 32.f * o;
        }
        for (int n = 0; n < 2; n++) {
            vb32 a, c, h;
            memcpy(&a, blk + 64 * n, 32);
            memcpy(&c, blk + 64 * n + 32, 32);
            memcpy(&h, blk + 128 + 32 * n, 32);
            uint8_t q[4][32] __attribute__((aligned(32)));
            const vb32 q0 = (a & 15) | ((h << 4) & 0x30), q1 = (c & 15) | ((h << 2) & 0x30);
            const vb32 q2 = (a >> 4) | (h & 0x30), q3 = (c >> 4) | ((h >> 2) & 0x30);
            memcpy(q[0], &q0, 32);
            memcpy(q[1], &q1, 32);
            memcpy(q[2], &q2, 32);
            memcpy(q[3], &q3, 32);
            if (B == 1) {
                for (int r = 0; r < 4; r++)          /* positions 128n + 32r + l */
                    for (int g = 0; g < 2; g++) {    /* l = 16g .. 16g + 15: one scale */
                        vf w[16 / VL];
                        widen16(q[r] + 16 * g, w);
                        const float *xb = x + (size_t)i * QK_K + 128 * n + 32 * r + 16 * g;
                        vf t = w[0] * vload(xb);
                        for (int v = 1; v < 16 / VL; v++) t = vfma(w[v], vload(xb + v * VL), t);
                        acc[0] = vfma(vset1(ds[8 * n + 2 * r + g]), t, acc[0]);
                    }
                continue;
            }
            /* several inputs: the half's 128 weights dequantised once into L1, (q - 32) * d * sc as the reference
             * computes them, then each input's sum in registers */
            float wf[128] __attribute__((aligned(64)));
            for (int r = 0; r < 4; r++)
                for (int g = 0; g < 2; g++) {
                    vf w[16 / VL];
                    widen16(q[r] + 16 * g, w);
                    const float dsc = ds[8 * n + 2 * r + g];
                    for (int v = 0; v < 16 / VL; v++) vstore(wf + 32 * r + 16 * g + v * VL, (w[v] - 32.f) * dsc);
                }
            for (int b = 0; b < B; b++) {
                const float *xb = x + (size_t)b * K + (size_t)i * QK_K + 128 * n;
                vf a0 = acc[b], a1 = (vf){0};
                for (int v = 0; v < 128 / VL; v += 2) {
                    a0 = vfma(vload(wf + v * VL), vload(xb + v * VL), a0);
                    a1 = vfma(vload(wf + (v + 1) * VL), vload(xb + (v + 1) * VL), a1);
                }
                acc[b] = a0 + a1;
            }
        }
    }
    for (int b = 0; b < B; b++) y[(size_t)b * ystride] = vhsum(acc[b]) - off[b];
}

#if defined(__AVX2__)
/* The int8 route, llama.cpp's for the K-quants: x rounded to int8 per 256 (xq, one scale dx a super-block, the
 * sums of xq per 16 in bs16), the codes meeting xq in integer multiply-adds (32 products a maddubs), each
 * sub-block's integer scale applied in the next multiply-add, and floats entered once a super-block. The result
 * equals the dequantised weights times the rounded x to float32 rounding; the rounding of x itself is the cost. */
typedef struct {
    const int8_t *xq;       /* [B, K] */
    const float *dx;        /* [B, K / 256] */
    const int16_t *bs16;    /* [B, K / 16] */
} x8;

TM_INLINE float hsum8(__m256 a) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 t = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

/* a Q4_K super-block's 6-bit scales (sc) and mins (m) as bytes, four to a 32-bit word: the 12 packed bytes
 * are words a, b, c; sub-blocks 0-3 are the low six bits of a (scales) and b (mins), sub-blocks 4-7 take their
 * low four bits from c's nibbles and their top two from a's and b's top bits */
TM_INLINE void k4_scales_u8(const uint8_t *blk, uint8_t sc[8], uint8_t m[8]) {
    uint32_t a, b, c;
    memcpy(&a, blk + 4, 4), memcpy(&b, blk + 8, 4), memcpy(&c, blk + 12, 4);
    const uint32_t s[2] = {a & 0x3f3f3f3fu, (c & 0x0f0f0f0fu) | (((a >> 6) & 0x03030303u) << 4)};
    const uint32_t n[2] = {b & 0x3f3f3f3fu, ((c >> 4) & 0x0f0f0f0fu) | (((b >> 6) & 0x03030303u) << 4)};
    memcpy(sc, s, 8), memcpy(m, n, 8);
}

/* a Q4_K super-block's d and dmin (F16C, one conversion for both) and its scales and mins as bytes */
TM_INLINE void k4_head(const uint8_t *blk, float *d, float *dmin, uint8_t sc8[8], uint8_t m8[8]) {
    uint32_t dm;
    memcpy(&dm, blk, 4);
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
    *d = _mm_cvtss_f32(f);
    *dmin = _mm_cvtss_f32(_mm_movehdup_ps(f));
    k4_scales_u8(blk, sc8, m8);
}

/* off + dmin * dx * (each sub-block's min times its two 16-sums of xq), four lanes to sum at the end */
TM_INLINE __m128 k4_mins(__m128 off, __m128i mins, const int16_t *bs16, float dmin_dx) {
    const __m256i bs = _mm256_loadu_si256((const __m256i *)bs16);
    const __m128i bs32 = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
    return _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_madd_epi16(mins, bs32)), _mm_set1_ps(dmin_dx), off);
}

#if !defined(__AVX512BW__)
/* Q4_K on the int8 route, and Q5_K (q5, a constant at each call: Q4_K's layout with each code's fifth bit in qh,
 * sub-block s's in bit s of its byte, put in at bit 4 before the multiply-adds; codes 0..31) */
TM_INLINE void k45_row_i8(const uint8_t *row, int nsb, x8 x, int K, int B, float *y, size_t ystride, const int q5) {
    __m256 acc[TM_GMATMUL_MAX_ROWS];
    __m128 off[TM_GMATMUL_MAX_ROWS];
    const __m256i low = _mm256_set1_epi8(15), bit4 = _mm256_set1_epi8(0x10);
    for (int b = 0; b < B; b++) acc[b] = _mm256_setzero_ps(), off[b] = _mm_setzero_ps();
    for (int i = 0; i < nsb; i++) {
        const uint8_t *blk = row + (size_t)i * (q5 ? 176 : 144), *q = blk + (q5 ? 48 : 16);
        float d, dmin;
        uint8_t sc8[8], m8[8];
        k4_head(blk, &d, &dmin, sc8, m8);
        /* sub-block j's scale in every 16-bit lane: a byte shuffle of the eight widened scales */
        const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sc8)));
        __m256i scale[8];
        for (int j = 0; j < 8; j++) scale[j] = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((short)(0x0100 + 0x0202 * j)));
        __m256i c[8];    /* sub-block 2j in the low nibbles of bytes 32j.., 2j + 1 in the high */
        for (int j = 0; j < 4; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 32 * j));
            c[2 * j] = _mm256_and_si256(v, low);
            c[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            if (q5) {   /* bit s of each byte to bit 4: shifts stay inside 16-bit lanes, each byte keeps its own */
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
                const __m256i h0 = j < 2 ? _mm256_slli_epi16(qh, 4 - 2 * j) : _mm256_srli_epi16(qh, 2 * j - 4);
                const __m256i h1 = j < 2 ? _mm256_slli_epi16(qh, 3 - 2 * j) : _mm256_srli_epi16(qh, 2 * j - 3);
                c[2 * j] = _mm256_or_si256(c[2 * j], _mm256_and_si256(h0, bit4));
                c[2 * j + 1] = _mm256_or_si256(c[2 * j + 1], _mm256_and_si256(h1, bit4));
            }
        }
        const __m128i mins = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)m8));
        for (int b = 0; b < B; b++) {
            const int8_t *xb = x.xq + (size_t)b * K + (size_t)i * QK_K;
            __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
            for (int j = 0; j < 8; j += 2) {
                const __m256i p0 = _mm256_maddubs_epi16(c[j], _mm256_loadu_si256((const __m256i *)(xb + 32 * j)));
                const __m256i p1 = _mm256_maddubs_epi16(c[j + 1], _mm256_loadu_si256((const __m256i *)(xb + 32 * j + 32)));
                s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(p0, scale[j]));
                s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(p1, scale[j + 1]));
            }
            const float dx = x.dx[(size_t)b * (K / QK_K) + i];
            acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), _mm256_set1_ps(d * dx), acc[b]);
            off[b] = k4_mins(off[b], mins, x.bs16 + (size_t)b * (K / 16) + (size_t)i * 16, dmin * dx);
        }
    }
    for (int b = 0; b < B; b++) {
        const __m128 o = _mm_add_ps(off[b], _mm_movehl_ps(off[b], off[b]));
        y[(size_t)b * ystride] = hsum8(acc[b]) - _mm_cvtss_f32(_mm_add_ss(o, _mm_movehdup_ps(o)));
    }
}

/* Q6_K on the int8 route: codes put together a byte at a time as in q6k_row (0..63), 32 products a maddubs, each
 * 16-position group's int8 scale in the next multiply-add, and the -32 through the 16-sums of xq */
TM_INLINE void q6k_row_i8(const uint8_t *row, int nsb, x8 x, int K, int B, float *y, size_t ystride) {
    __m256 acc[TM_GMATMUL_MAX_ROWS];
    const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
    for (int b = 0; b < B; b++) acc[b] = _mm256_setzero_ps();
    for (int i = 0; i < nsb; i++) {
        const uint8_t *blk = row + (size_t)i * 210;
        const int8_t *sc = (const int8_t *)(blk + 192);
        uint16_t dh;
        memcpy(&dh, blk + 208, 2);
        const float d = _cvtsh_ss(dh);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        int32_t pair[16];    /* each scale twice, as one 32-bit word: one broadcast fills a half's 16-bit lanes */
        for (int j = 0; j < 16; j++) pair[j] = (int32_t)(uint16_t)sc[j] * 0x10001;
        __m256i q[8], scale[8];    /* positions 32r..32r + 31, and their two groups' scales */
        for (int n = 0; n < 2; n++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(blk + 64 * n));
            const __m256i c = _mm256_loadu_si256((const __m256i *)(blk + 64 * n + 32));
            const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n));
            q[4 * n + 0] = _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m30));
            q[4 * n + 1] = _mm256_or_si256(_mm256_and_si256(c, m4), _mm256_and_si256(_mm256_slli_epi16(h, 2), m30));
            q[4 * n + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4), _mm256_and_si256(h, m30));
            q[4 * n + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), m4),
                                           _mm256_and_si256(_mm256_srli_epi16(h, 2), m30));
        }
        for (int r = 0; r < 8; r++)
            scale[r] = _mm256_inserti128_si256(_mm256_set1_epi32(pair[2 * r]), _mm_set1_epi32(pair[2 * r + 1]), 1);
        for (int b = 0; b < B; b++) {
            const int8_t *xb = x.xq + (size_t)b * K + (size_t)i * QK_K;
            __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
            for (int r = 0; r < 8; r += 2) {
                const __m256i p0 = _mm256_maddubs_epi16(q[r], _mm256_loadu_si256((const __m256i *)(xb + 32 * r)));
                const __m256i p1 = _mm256_maddubs_epi16(q[r + 1], _mm256_loadu_si256((const __m256i *)(xb + 32 * r + 32)));
                s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(p0, scale[r]));
                s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(p1, scale[r + 1]));
            }
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(x.bs16 + (size_t)b * (K / 16) + (size_t)i * 16));
            const __m256i o = _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5);    /* 32 * sc * (16-sum) */
            const __m256i s = _mm256_sub_epi32(_mm256_add_epi32(s0, s1), o);
            const float dx = x.dx[(size_t)b * (K / QK_K) + i];
            acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d * dx), acc[b]);
        }
    }
    for (int b = 0; b < B; b++) y[(size_t)b * ystride] = hsum8(acc[b]);
}

#else
/* The same two kernels on 512-bit vectors: a register holds two sub-blocks' codes (Q4_K: a 32-byte chunk's low
 * and high nibbles; Q6_K: 64 consecutive positions), so each maddubs and multiply-add does twice the work and
 * meets 64 consecutive bytes of xq; the scales are put in place by one word permute each. */
TM_INLINE void k45_row_i8(const uint8_t *row, int nsb, x8 x, int K, int B, float *y, size_t ystride, const int q5) {
    __m512 acc[TM_GMATMUL_MAX_ROWS];
    __m128 off[TM_GMATMUL_MAX_ROWS];
    const __m512i low = _mm512_set1_epi8(15), bit4 = _mm512_set1_epi8(0x10);
    __m512i pick[4];    /* 2j in word lanes 0-15, 2j + 1 in 16-31: which scale, and (Q5_K) which bit of qh */
    for (int j = 0; j < 4; j++)
        pick[j] = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * j)), _mm256_set1_epi16((short)(2 * j + 1)), 1);
    for (int b = 0; b < B; b++) acc[b] = _mm512_setzero_ps(), off[b] = _mm_setzero_ps();
    for (int i = 0; i < nsb; i++) {
        const uint8_t *blk = row + (size_t)i * (q5 ? 176 : 144), *q = blk + (q5 ? 48 : 16);
        float d, dmin;
        uint8_t sc8[8], m8[8];
        k4_head(blk, &d, &dmin, sc8, m8);
        const __m512i sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sc8)));
        __m512i c[4], scale[4];    /* sub-blocks 2j and 2j + 1: chunk j's low nibbles, then its high */
        for (int j = 0; j < 4; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 32 * j));
            c[j] = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1), low);
            if (q5) {
                const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16)));
                c[j] = _mm512_or_si512(c[j], _mm512_and_si512(_mm512_slli_epi16(_mm512_srlv_epi16(qh, pick[j]), 4), bit4));
            }
            scale[j] = _mm512_permutexvar_epi16(pick[j], sc16);
        }
        const __m128i mins = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)m8));
        for (int b = 0; b < B; b++) {
            const int8_t *xb = x.xq + (size_t)b * K + (size_t)i * QK_K;
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
            for (int j = 0; j < 4; j += 2) {
                const __m512i p0 = _mm512_maddubs_epi16(c[j], _mm512_loadu_si512(xb + 64 * j));
                const __m512i p1 = _mm512_maddubs_epi16(c[j + 1], _mm512_loadu_si512(xb + 64 * j + 64));
                s0 = _mm512_add_epi32(s0, _mm512_madd_epi16(p0, scale[j]));
                s1 = _mm512_add_epi32(s1, _mm512_madd_epi16(p1, scale[j + 1]));
            }
            const float dx = x.dx[(size_t)b * (K / QK_K) + i];
            acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), _mm512_set1_ps(d * dx), acc[b]);
            off[b] = k4_mins(off[b], mins, x.bs16 + (size_t)b * (K / 16) + (size_t)i * 16, dmin * dx);
        }
    }
    for (int b = 0; b < B; b++) {
        const __m128 o = _mm_add_ps(off[b], _mm_movehl_ps(off[b], off[b]));
        y[(size_t)b * ystride] = _mm512_reduce_add_ps(acc[b]) - _mm_cvtss_f32(_mm_add_ss(o, _mm_movehdup_ps(o)));
    }
}

TM_INLINE void q6k_row_i8(const uint8_t *row, int nsb, x8 x, int K, int B, float *y, size_t ystride) {
    __m512 acc[TM_GMATMUL_MAX_ROWS];
    const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
    /* the high bits of positions 0-31 sit in h's bits 0-1, of 32-63 in 2-3, of 64-95 in 4-5, of 96-127 in 6-7 */
    const __m512i up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i down = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    __m512i pick[4];    /* 8 word lanes each from scales 4g .. 4g + 3 */
    for (int g = 0; g < 4; g++)
        pick[g] = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_set_m128i(_mm_set1_epi16((short)(4 * g + 1)), _mm_set1_epi16((short)(4 * g)))),
            _mm256_set_m128i(_mm_set1_epi16((short)(4 * g + 3)), _mm_set1_epi16((short)(4 * g + 2))), 1);
    for (int b = 0; b < B; b++) acc[b] = _mm512_setzero_ps();
    for (int i = 0; i < nsb; i++) {
        const uint8_t *blk = row + (size_t)i * 210;
        uint16_t dh;
        memcpy(&dh, blk + 208, 2);
        const float d = _cvtsh_ss(dh);
        const __m256i sc16y = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
        const __m512i sc16 = _mm512_castsi256_si512(sc16y);
        __m512i q[4], scale[4];    /* positions 64g .. 64g + 63 */
        for (int n = 0; n < 2; n++) {
            const __m512i ac = _mm512_loadu_si512(blk + 64 * n);
            const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n)));
            q[2 * n] = _mm512_or_si512(_mm512_and_si512(ac, m4), _mm512_and_si512(_mm512_sllv_epi16(h, up), m30));
            q[2 * n + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ac, 4), m4),
                                           _mm512_and_si512(_mm512_srlv_epi16(h, down), m30));
        }
        for (int g = 0; g < 4; g++) scale[g] = _mm512_permutexvar_epi16(pick[g], sc16);
        for (int b = 0; b < B; b++) {
            const int8_t *xb = x.xq + (size_t)b * K + (size_t)i * QK_K;
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
            for (int g = 0; g < 4; g += 2) {
                const __m512i p0 = _mm512_maddubs_epi16(q[g], _mm512_loadu_si512(xb + 64 * g));
                const __m512i p1 = _mm512_maddubs_epi16(q[g + 1], _mm512_loadu_si512(xb + 64 * g + 64));
                s0 = _mm512_add_epi32(s0, _mm512_madd_epi16(p0, scale[g]));
                s1 = _mm512_add_epi32(s1, _mm512_madd_epi16(p1, scale[g + 1]));
            }
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(x.bs16 + (size_t)b * (K / 16) + (size_t)i * 16));
            const __m256i o = _mm256_slli_epi32(_mm256_madd_epi16(sc16y, bs), 5);    /* 32 * sc * (16-sum) */
            const __m512i sum = _mm512_sub_epi32(_mm512_add_epi32(s0, s1),
                                                 _mm512_inserti64x4(_mm512_setzero_si512(), o, 0));
            const float dx = x.dx[(size_t)b * (K / QK_K) + i];
            acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(d * dx), acc[b]);
        }
    }
    for (int b = 0; b < B; b++) y[(size_t)b * ystride] = _mm512_reduce_add_ps(acc[b]);
}
#endif

/* x [B, K] rounded to int8 per 256, as llama.cpp's Q8_K: dx = max |x| / 127, xq = round(x / dx), and the sums of
 * xq per 16 */
static void quantize_x(const float *x, int B, int K, int8_t *xq, float *dx, int16_t *bs16) {
    for (int s = 0; s < B * (K / QK_K); s++) {
        const float *v = x + (size_t)s * QK_K;
        float amax = 0.f;
        for (int l = 0; l < QK_K; l++) amax = fabsf(v[l]) > amax ? fabsf(v[l]) : amax;
        const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        dx[s] = d;
        int8_t *q = xq + (size_t)s * QK_K;
        for (int l = 0; l < QK_K; l++) q[l] = (int8_t)lrintf(v[l] * id);
        for (int g = 0; g < QK_K / 16; g++) {
            int t = 0;
            for (int l = 0; l < 16; l++) t += q[16 * g + l];
            bs16[(size_t)s * (QK_K / 16) + g] = (int16_t)t;
        }
    }
}
#define HAVE_INT8_X 1
#else
#define HAVE_INT8_X 0
#endif

/* A chain's parts and the row each starts at in y, for kernels that run the whole chain in one parallel loop */
typedef struct {
    const tm_gweight *w[TM_GWEIGHT_MAX_PARTS];
    int start[TM_GWEIGHT_MAX_PARTS + 1];
    int n;
} chain;

TM_INLINE int part_of(const chain *c, int row) {
    int p = 0;
    while (row >= c->start[p + 1]) p++;
    return p;
}

/* Q4_K and Q6_K parts (and Q5_K ones on the int8 route) in one parallel loop over all their rows: x's sums per
 * group (and on the int8 route x's rounding) made once for the chain */
static int gmatmul_kquant(const chain *c, const float *x, int B, float *y, size_t ystride, int int8_x,
                          int num_threads) {
    const int K = c->w[0]->k, nsb = K / QK_K, N = c->start[c->n];
#if HAVE_INT8_X
    if (int8_x) {
        int8_t *xq = (int8_t *)malloc((size_t)B * K);
        float *dx = (float *)malloc(sizeof(float) * (size_t)B * (K / QK_K));
        int16_t *bs16 = (int16_t *)malloc(sizeof(int16_t) * (size_t)B * (K / 16));
        if (!xq || !dx || !bs16) {
            free(xq), free(dx), free(bs16);
            return -2;
        }
        quantize_x(x, B, K, xq, dx, bs16);
        const x8 xr = {xq, dx, bs16};
        /* no software prefetch: each thread streams a contiguous range, which the hardware prefetcher follows;
         * prefetching whole rows ahead cost a fifth of the bandwidth */
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int n = 0; n < N; n++) {
            const int p = part_of(c, n);
            const tm_gweight *w = c->w[p];
            const uint8_t *row = w->data + (size_t)(n - c->start[p]) * w->row_bytes;
            if (w->type == 12 && B == 1) k45_row_i8(row, nsb, xr, K, 1, y + n, ystride, 0);
            else if (w->type == 12) k45_row_i8(row, nsb, xr, K, B, y + n, ystride, 0);
            else if (w->type == 13 && B == 1) k45_row_i8(row, nsb, xr, K, 1, y + n, ystride, 1);
            else if (w->type == 13) k45_row_i8(row, nsb, xr, K, B, y + n, ystride, 1);
            else if (B == 1) q6k_row_i8(row, nsb, xr, K, 1, y + n, ystride);
            else q6k_row_i8(row, nsb, xr, K, B, y + n, ystride);
        }
        free(xq), free(dx), free(bs16);
        return 0;
    }
#endif
    /* the inputs' sums per group: Q4_K's mins (per 32) and Q6_K's -32 (per 16) come in once a group */
    float *xs32 = (float *)malloc(sizeof(float) * (size_t)B * (K / 32));
    float *xs16 = (float *)malloc(sizeof(float) * (size_t)B * (K / 16));
    if (!xs32 || !xs16) {
        free(xs32), free(xs16);
        return -2;
    }
    for (int s = 0; s < B * (K / 16); s++) {
        float t = 0.f;
        for (int l = 0; l < 16; l++) t += x[(size_t)s * 16 + l];
        xs16[s] = t;
    }
    for (int s = 0; s < B * (K / 32); s++) xs32[s] = xs16[2 * s] + xs16[2 * s + 1];
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int n = 0; n < N; n++) {
        const int p = part_of(c, n);
        const tm_gweight *w = c->w[p];
        const uint8_t *row = w->data + (size_t)(n - c->start[p]) * w->row_bytes;
        if (w->type == 12 && B == 1) q4k_row(row, nsb, x, xs32, K, 1, y + n, ystride);
        else if (w->type == 12) q4k_row(row, nsb, x, xs32, K, B, y + n, ystride);
        else if (B == 1) q6k_row(row, nsb, x, xs16, K, 1, y + n, ystride);
        else q6k_row(row, nsb, x, xs16, K, B, y + n, ystride);
    }
    free(xs32), free(xs16);
    return 0;
}

/* the other types, one part at a time, each into its columns of y */
#define GMATMUL(FN, BLOCK, BYTES)                                                                             \
    static void gmatmul_##FN(const tm_gweight *w, const float *x, int B, float *y, size_t ystride,           \
                             int num_threads) {                                                               \
        const int nb = w->k / BLOCK;                                                                          \
        _Pragma("omp parallel for schedule(static, 8) num_threads(num_threads)")                             \
        for (int n = 0; n < w->n; n++) {                                                                      \
            const uint8_t *row = w->data + (size_t)n * w->row_bytes;                                          \
            __builtin_prefetch(row + 8 * w->row_bytes, 0, 3);                                                 \
            row_dot(dq_##FN, BLOCK, BYTES, row, nb, x, w->k, B, y + n, ystride);                              \
        }                                                                                                     \
    }
GMATMUL(f16, 32, 64)
GMATMUL(bf16, 32, 64)
GMATMUL(q4_0, 32, 18)
GMATMUL(q4_1, 32, 20)
GMATMUL(q5_0, 32, 22)
GMATMUL(q5_1, 32, 24)
GMATMUL(q8_0, 32, 34)
GMATMUL(q2_k, QK_K, 84)
GMATMUL(q3_k, QK_K, 110)
GMATMUL(q5_k, QK_K, 176)
#undef GMATMUL

/* MXFP4 on x86: a block's 32 codes looked up as int8 values by one byte shuffle each half, widened to floats and
 * multiplied into each input; the block's sum is then taken times its power-of-two scale, which is exact, so this
 * is the dequantised product to summation order. Elsewhere the block dequantiser and row_dot. */
#if defined(__AVX512F__) || (VL == 8 && defined(__AVX2__))
static void mxfp4_row(const uint8_t *row, int nb, const float *x, int K, int B, float *y, size_t ystride) {
    const __m128i table = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i low = _mm_set1_epi8(15);
    vf acc[TM_GMATMUL_MAX_ROWS];
    for (int b = 0; b < B; b++) acc[b] = (vf){0};
    for (int i = 0; i < nb; i++) {
        const uint8_t *blk = row + (size_t)i * 17;
        const uint32_t e = blk[0];
        const vf d = vset1(tm_f32_bits(e < 2 ? 0x00200000u << e : (e - 1) << 23));
        const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + 1));
        const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(qs, low));
        const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(qs, 4), low));
#if defined(__AVX512F__)
        const vf w[2] = {(vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)),
                         (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi))};
#else
        const vf w[4] = {(vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)),
                         (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))),
                         (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)),
                         (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)))};
#endif
        for (int b = 0; b < B; b++) {
            const float *xb = x + (size_t)b * K + (size_t)i * 32;
            vf s = w[0] * vload(xb);
            for (int v = 1; v < 32 / VL; v++) s = vfma(w[v], vload(xb + v * VL), s);
            acc[b] = vfma(s, d, acc[b]);
        }
    }
    for (int b = 0; b < B; b++) y[(size_t)b * ystride] = vhsum(acc[b]);
}
#endif

static void gmatmul_mxfp4(const tm_gweight *w, const float *x, int B, float *y, size_t ystride, int num_threads) {
    const int nb = w->k / 32;
#pragma omp parallel for schedule(static, 8) num_threads(num_threads)
    for (int n = 0; n < w->n; n++) {
        const uint8_t *row = w->data + (size_t)n * w->row_bytes;
        __builtin_prefetch(row + 8 * w->row_bytes, 0, 3);
#if defined(__AVX512F__) || (VL == 8 && defined(__AVX2__))
        mxfp4_row(row, nb, x, w->k, B, y + n, ystride);
#else
        row_dot(dq_mxfp4, 32, 17, row, nb, x, w->k, B, y + n, ystride);
#endif
    }
}

static int gmatmul_part(const tm_gweight *w, const float *x, int B, float *y, size_t ystride, int num_threads) {
    switch (w->type) {
        case 1: gmatmul_f16(w, x, B, y, ystride, num_threads); break;
        case 30: gmatmul_bf16(w, x, B, y, ystride, num_threads); break;
        case 2: gmatmul_q4_0(w, x, B, y, ystride, num_threads); break;
        case 3: gmatmul_q4_1(w, x, B, y, ystride, num_threads); break;
        case 6: gmatmul_q5_0(w, x, B, y, ystride, num_threads); break;
        case 7: gmatmul_q5_1(w, x, B, y, ystride, num_threads); break;
        case 8: gmatmul_q8_0(w, x, B, y, ystride, num_threads); break;
        case 10: gmatmul_q2_k(w, x, B, y, ystride, num_threads); break;
        case 11: gmatmul_q3_k(w, x, B, y, ystride, num_threads); break;
        case 13: gmatmul_q5_k(w, x, B, y, ystride, num_threads); break;
        case 39: gmatmul_mxfp4(w, x, B, y, ystride, num_threads); break;
        default: return -1;
    }
    return 0;
}

/* the types gmatmul_kquant takes: Q5_K has its int8 kernel only */
TM_INLINE int kquant_type(int type, int int8_x) {
    return type == 12 || type == 14 || (type == 13 && int8_x && HAVE_INT8_X);
}

TM_API int tm_gmatmul(const tm_gmatmul_args *a) {
    const int B = a->rows;
    chain c = {.n = 0};
    int kquant = 1;
    c.start[0] = 0;
    for (const tm_gweight *w = a->w; w; w = w->next) {
        if (c.n == TM_GWEIGHT_MAX_PARTS || !find_type(w) || w->k != a->w->k) return -1;
        c.w[c.n] = w;
        c.start[c.n + 1] = c.start[c.n] + w->n;
        c.n++;
        kquant &= kquant_type(w->type, a->int8_x);
    }
    if (c.n == 0 || B < 1 || B > TM_GMATMUL_MAX_ROWS) return -1;
    const size_t ystride = (size_t)c.start[c.n];
    if (kquant) return gmatmul_kquant(&c, a->x, B, a->y, ystride, a->int8_x, a->num_threads);
    for (int p = 0; p < c.n; p++) {
        const tm_gweight *w = c.w[p];
        int rc = kquant_type(w->type, a->int8_x)
                     ? gmatmul_kquant(&(chain){.w = {w}, .start = {0, w->n}, .n = 1}, a->x, B, a->y + c.start[p],
                                      ystride, a->int8_x, a->num_threads)
                     : gmatmul_part(w, a->x, B, a->y + c.start[p], ystride, a->num_threads);
        if (rc) return rc;
    }
    return 0;
}
