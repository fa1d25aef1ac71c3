/* The lanes layout: output rows along the vector lanes, so no input is padded (AVX-512).
 * qgemm16() (qmatmul_gemm.c) keeps 16 inputs in a vector and computes whole vectors: 33 inputs cost 48, 49 cost 64.
 * Here the 16 lanes hold 16 outputs and each input is a broadcast, so B inputs cost B. The blocks are re-laid
 * out once at load time (tm_pack_lanes) so that one 16-byte load holds a position's codes for 16 rows:
 *   q4: row tile t (rows 16t .. 16t+15), block i: 16 x 16 bytes, byte [j][r] = c_j | c_{j+16} << 4 of row 16t+r
 *   q8: 32 x 16 bytes, byte [j][r] = c_j of row 16t + r
 *   scale and offset [N/16][K/32][16]
 * A thread dequantises a panel of LANES_NP rows over all of K into ws [K][LANES_NP] and runs every input over
 * it, LANES_RB at a time; sums run over k in order as in qgemm16, from the same dequantised values (equal bits).
 * Above 40 inputs qgemm16 wins: its padding is small there, and it dequantises into L1 alongside its FMAs where
 * this kernel dequantises a whole panel first (BENCHMARKS.md). */
#include <immintrin.h>
#include <stdlib.h>

#include "../../qmatmul.h"
#include "../../simd.h"

#define LANES_NP 48   /* outputs per panel, 3 vectors: divides SmolLM2's 576, 960, 3072 and 49152 */
#define LANES_RB 8    /* inputs per register block: 8 x 3 accumulators */

/* 16 bytes of q4 codes for 16 rows as d * code + m (per lane), low nibbles into lo and high into hi; 16 q8 codes
 * as d * code: the arithmetic of simd.h's q4_block / q8_block, with d and m per lane */
TM_INLINE void q4_16(const uint8_t *codes, vf d, vf m, vf *lo, vf *hi) {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes));
    *lo = (vf)_mm512_cvtepi32_ps(_mm512_and_si512(c, _mm512_set1_epi32(15))) * d + m;
    *hi = (vf)_mm512_cvtepi32_ps(_mm512_srli_epi32(c, 4)) * d + m;
}
TM_INLINE vf q8_16(const int8_t *codes, vf d) {
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)codes))) * d;
}

TM_API int tm_pack_lanes(const tm_qweight *w) {
    const int K = w->k, N = w->n, q4 = w->bits == 4;
    if (K % QK != 0 || N % 16 != 0 || !w->lanes_codes || !w->lanes_scale || (w->offset && !w->lanes_offset))
        return -1;
    const int nb = K / QK;
    const size_t row_bytes = q4 ? (size_t)K / 2 : (size_t)K, bb = q4 ? 16 : 32;
    const uint8_t *codes = w->codes;
    uint8_t *lcodes = w->lanes_codes;
    for (int t = 0; t < N / 16; t++)
        for (int i = 0; i < nb; i++) {
            uint8_t *o = lcodes + ((size_t)t * nb + i) * 16 * bb;
            const size_t s0 = ((size_t)t * nb + i) * 16;
            for (int r = 0; r < 16; r++) {
                const size_t n = (size_t)t * 16 + r;
                const uint8_t *c = codes + n * row_bytes + (size_t)i * bb;
                for (size_t j = 0; j < bb; j++) o[j * 16 + r] = c[j];
                w->lanes_scale[s0 + r] = w->scale[n * nb + i];
                if (w->offset) w->lanes_offset[s0 + r] = w->offset[n * nb + i];
            }
        }
    return 0;
}

/* ws [K][np] = rows n0 .. n0+np-1 (np a multiple of 16), dequantised */
static void lanes_dequant(const tm_qweight *w, int n0, int np, float *ws) {
    const int K = w->k, nb = K / QK, q4 = w->bits == 4;
    const size_t bb = q4 ? 16 : 32;
    const uint8_t *lcodes = w->lanes_codes;
    for (int v = 0; v < np / 16; v++) {
        const size_t t = (size_t)n0 / 16 + v;
        for (int i = 0; i < nb; i++) {
            const uint8_t *c = lcodes + (t * nb + i) * 16 * bb;
            const vf dv = vload(w->lanes_scale + (t * nb + i) * 16);
            float *o = ws + (size_t)i * QK * np + 16 * v;
            if (q4) {
                const vf mv = vload(w->lanes_offset + (t * nb + i) * 16);
                for (int j = 0; j < 16; j++) {
                    vf lo, hi;
                    q4_16(c + 16 * j, dv, mv, &lo, &hi);
                    _mm512_store_ps(o + (size_t)j * np, (__m512)lo);
                    _mm512_store_ps(o + (size_t)(j + 16) * np, (__m512)hi);
                }
            } else {
                for (int j = 0; j < 32; j++)
                    _mm512_store_ps(o + (size_t)j * np, (__m512)q8_16((const int8_t *)c + 16 * j, dv));
            }
        }
    }
}

/* y[b][n0 .. n0+16NV) for inputs b0 .. b0+R-1 over all of K from the panel ws [K][16NV] */
TM_INLINE void lanes_rows(const float *x, int K, const float *ws, int NV, int R, float *y, int N, int b0, int n0) {
    __m512 acc[LANES_RB][3];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 3
        for (int j = 0; j < NV; j++) acc[r][j] = _mm512_setzero_ps();
    const float *xr = x + (size_t)b0 * K;
    for (int k = 0; k < K; k++) {
        __m512 w[3];
#pragma GCC unroll 3
        for (int j = 0; j < NV; j++) w[j] = _mm512_load_ps(ws + (size_t)k * 16 * NV + 16 * j);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const __m512 xb = _mm512_set1_ps(xr[(size_t)r * K + k]);
#pragma GCC unroll 3
            for (int j = 0; j < NV; j++) acc[r][j] = _mm512_fmadd_ps(xb, w[j], acc[r][j]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 3
        for (int j = 0; j < NV; j++) _mm512_storeu_ps(y + (size_t)(b0 + r) * N + n0 + 16 * j, acc[r][j]);
}

/* every input over one panel of NV vectors (R and NV constants at each call, so acc stays in registers) */
#define LANES_PANEL(NV)                                                                                 \
    for (int b0 = 0; b0 < B; b0 += LANES_RB) {                                                      \
        switch (B - b0 < LANES_RB ? B - b0 : LANES_RB) {                                            \
            case 1: lanes_rows(x, K, ws, NV, 1, y, N, b0, n0); break;                               \
            case 2: lanes_rows(x, K, ws, NV, 2, y, N, b0, n0); break;                               \
            case 3: lanes_rows(x, K, ws, NV, 3, y, N, b0, n0); break;                               \
            case 4: lanes_rows(x, K, ws, NV, 4, y, N, b0, n0); break;                               \
            case 5: lanes_rows(x, K, ws, NV, 5, y, N, b0, n0); break;                               \
            case 6: lanes_rows(x, K, ws, NV, 6, y, N, b0, n0); break;                               \
            case 7: lanes_rows(x, K, ws, NV, 7, y, N, b0, n0); break;                               \
            default: lanes_rows(x, K, ws, NV, 8, y, N, b0, n0); break;                              \
        }                                                                                           \
    }

int qgemm_lanes(const tm_qweight *w, const float *x, int B, float *y, int num_threads) {
    const int K = w->k, N = w->n;
    const int panels = (N + LANES_NP - 1) / LANES_NP;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *ws = aligned_alloc(64, sizeof(float) * (size_t)K * LANES_NP);
        if (!ws) failed = 1;
        /* dynamic: with static halves, one core running slower (a neighbour, an interrupt) left the other
         * waiting at the barrier */
#pragma omp for schedule(dynamic, 1)
        for (int p = 0; p < panels; p++) {
            if (!ws) continue;
            const int n0 = p * LANES_NP, np = N - n0 < LANES_NP ? N - n0 : LANES_NP;
            lanes_dequant(w, n0, np, ws);
            switch (np / 16) {
                case 1: LANES_PANEL(1) break;
                case 2: LANES_PANEL(2) break;
                default: LANES_PANEL(3) break;
            }
        }
        free(ws);
    }
    return failed ? -2 : 0;
}
#undef LANES_PANEL
