/* The small per-layer ops of a decode step, float32 on CPU: each is a few microseconds of arithmetic, and as
 * torch ops on a 1-row batch they cost 5-30 us apiece in dispatch (rms_norm alone ~28 us). One call each here.
 * Rows are split over threads only when there are many (prefill); a decode step's few rows stay on one. Also
 * the sampler's argmax over a step's logits rows (each row is a whole vocabulary, so rows go over the threads). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "tokenmill.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define PAR_ROWS 64   /* fewer rows than this: not worth waking the thread pool */

/* residual += x (when residual is given, else residual = x is the caller's business: pass x as residual with
 * add = 0); out = weight * residual / rms(residual). x, residual, out [rows, dim]; weight [dim]. */
static void add_rms_norm(const float *x, float *residual, const float *weight, float *out, int rows, int dim, float eps,
                  int add, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= PAR_ROWS)
    for (int r = 0; r < rows; r++) {
        float *h = residual + (size_t)r * dim;
        const float *xr = x + (size_t)r * dim;
        if (add)
            for (int i = 0; i < dim; i++) h[i] += xr[i];
        float ss = 0.f;
        for (int i = 0; i < dim; i++) ss += h[i] * h[i];
        const float inv = 1.f / sqrtf(ss / dim + eps);
        float *o = out + (size_t)r * dim;
        for (int i = 0; i < dim; i++) o[i] = weight[i] * (h[i] * inv);
    }
}

/* Rotary embedding in place, the "rotate half" form: for each of the `heads` vectors of length dim in row t,
 * x' = x * cos[t] + rotate_half(x) * sin[t], rotate_half(x) = (-x[half:], x[:half]). x [rows, heads, dim]
 * with row stride `row_stride` floats (q and k sit inside the fused qkv row); cos, sin [rows, dim]. */
void rotary(float *x, const float *cos, const float *sin, int rows, int heads, int dim, int row_stride,
            int num_threads) {
    const int half = dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= PAR_ROWS)
    for (int t = 0; t < rows; t++) {
        const float *c = cos + (size_t)t * dim, *s = sin + (size_t)t * dim;
        for (int h = 0; h < heads; h++) {
            float *v = x + (size_t)t * row_stride + (size_t)h * dim;
            for (int i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* out = silu(gate) * up, with gate_up [rows, 2 * inter] (gate first) and out [rows, inter]. */
static void silu_mul(const float *gate_up, float *out, int rows, int inter, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= PAR_ROWS)
    for (int r = 0; r < rows; r++) {
        const float *g = gate_up + (size_t)r * 2 * inter, *u = g + inter;
        float *o = out + (size_t)r * inter;
        for (int i = 0; i < inter; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

/* out[r] = the index of row r's largest value, the first one on ties, as torch.argmax: a NaN counts as the
 * largest (its first index). x [rows, n], rows split over threads. One pass: each lane keeps its largest value
 * and where it first saw it. NaNs are found from the bits (exponent all ones, mantissa non-zero), which
 * -ffast-math cannot assume away as it can float compares; a row with one is scanned again for the first. */
static int64_t argmax_row(const float *x, int n) {
    const uint32_t *bits = (const uint32_t *)x;
    int i = 0, best = 0, nan = 0;
    float m = -INFINITY;
#if defined(__AVX512F__)
    if (n >= 16) {
        __m512 mv = _mm512_loadu_ps(x);
        __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), idx = at;
        const __m512i inf = _mm512_set1_epi32(0x7f800000), abs = _mm512_set1_epi32(0x7fffffff);
        const __m512i step = _mm512_set1_epi32(16);
        __mmask16 nans = _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(mv), abs), inf);
        for (i = 16; i + 16 <= n; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + i);
            at = _mm512_add_epi32(at, step);
            nans |= _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), abs), inf);
            const __mmask16 up = _mm512_cmp_ps_mask(v, mv, _CMP_GT_OQ);   /* strictly larger: first index kept */
            mv = _mm512_mask_blend_ps(up, mv, v);
            idx = _mm512_mask_blend_epi32(up, idx, at);
        }
        nan = nans != 0;
        float vals[16];
        int32_t where[16];
        _mm512_storeu_ps(vals, mv);
        _mm512_storeu_si512(where, idx);
        m = vals[0];
        best = where[0];
        for (int l = 1; l < 16; l++)
            if (vals[l] > m || (vals[l] == m && where[l] < best)) {
                m = vals[l];
                best = where[l];
            }
    }
#endif
    for (; i < n; i++) {
        nan |= (bits[i] & 0x7fffffffu) > 0x7f800000u;
        if (x[i] > m) {
            m = x[i];
            best = i;
        }
    }
    if (nan)
        for (int j = 0; j < n; j++)
            if ((bits[j] & 0x7fffffffu) > 0x7f800000u) return j;
    return best;
}

static void argmax_rows(const float *x, int rows, int n, int64_t *out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= 2)
    for (int r = 0; r < rows; r++) out[r] = argmax_row(x + (size_t)r * n, n);
}

/* ---- the library's entry points (tokenmill.h) ---- */
TM_API int tm_rms_norm(const tm_rms_norm_args *a) {
    add_rms_norm(a->x, a->residual, a->weight, a->out, a->rows, a->dim, a->eps, a->add, a->num_threads);
    return 0;
}

TM_API int tm_rotary(const tm_rotary_args *a) {
    if (a->dim % 2 || a->row_stride < a->heads * a->dim) return -1;
    rotary(a->x, a->cos, a->sin, a->rows, a->heads, a->dim, a->row_stride, a->num_threads);
    return 0;
}

TM_API int tm_silu_mul(const tm_silu_mul_args *a) {
    silu_mul(a->gate_up, a->out, a->rows, a->inter, a->num_threads);
    return 0;
}

TM_API int tm_argmax(const tm_argmax_args *a) {
    if (a->n < 1) return -1;
    argmax_rows(a->x, a->rows, a->n, a->out, a->num_threads);
    return 0;
}
