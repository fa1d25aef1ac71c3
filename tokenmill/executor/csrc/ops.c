/* The small per-layer ops of a decode step, float32 on CPU: each is a few microseconds of arithmetic, and as
 * torch ops on a 1-row batch they cost 5-30 us apiece in dispatch (rms_norm alone ~28 us). One call each here.
 * Rows are split over threads only when there are many (prefill); a decode step's few rows stay on one. Also
 * the sampler's argmax over a step's logits rows (each row is a whole vocabulary, so rows go over the threads), and
 * LoRA's per-row shrink-expand. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"
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

/* out = gelu(gate) * up in torch's tanh form: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) */
static void gelu_tanh_mul(const float *gate_up, float *out, int rows, int inter, int num_threads) {
    const float beta = 0.7978845608028654f, kappa = 0.044715f;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= PAR_ROWS)
    for (int r = 0; r < rows; r++) {
        const float *g = gate_up + (size_t)r * 2 * inter, *u = g + inter;
        float *o = out + (size_t)r * inter;
        for (int i = 0; i < inter; i++) {
            const float x = g[i];
            o[i] = 0.5f * x * (1.f + tanhf(beta * (x + kappa * x * x * x))) * u[i];
        }
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

TM_API int tm_gelu_tanh_mul(const tm_silu_mul_args *a) {
    gelu_tanh_mul(a->gate_up, a->out, a->rows, a->inter, a->num_threads);
    return 0;
}

TM_API int tm_silu_mul(const tm_silu_mul_args *a) {
    silu_mul(a->gate_up, a->out, a->rows, a->inter, a->num_threads);
    return 0;
}

/* A head's state S [dk, dv] in two passes: read = S^T k (before the decay, which scales it after), then S
 * decayed and corrected row by row while out accumulates S^T q. Heads of all rows go over the threads: each is
 * dk * dv floats of its own. */
static void delta_rule_step(const tm_delta_rule_step_args *a) {
    const int H = a->heads, dk = a->dk, dv = a->dv, units = a->rows * a->heads;
#pragma omp parallel for schedule(static) num_threads(a->num_threads) if (units > 1 && (size_t)units * dk * dv >= 65536)
    for (int u = 0; u < units; u++) {
        const int r = u / H, h = u % H;
        float *restrict S = a->state + ((size_t)a->slot[r] * H + h) * dk * dv;
        const float *restrict q = a->q + (size_t)u * dk, *restrict k = a->k + (size_t)u * dk;
        const float *restrict v = a->v + (size_t)u * dv;
        float *restrict o = a->out + (size_t)u * dv;
        const float decay = expf(a->g[u]), beta = a->beta[u];
        float delta[TM_DELTA_RULE_MAX_DV];
        for (int j = 0; j < dv; j++) delta[j] = 0.f;
        for (int i = 0; i < dk; i++) {
            const float ki = k[i];
            const float *restrict Si = S + (size_t)i * dv;
            for (int j = 0; j < dv; j++) delta[j] += Si[j] * ki;
        }
        for (int j = 0; j < dv; j++) {
            delta[j] = beta * (v[j] - decay * delta[j]);
            o[j] = 0.f;
        }
        for (int i = 0; i < dk; i++) {
            const float ki = k[i], qi = q[i];
            float *restrict Si = S + (size_t)i * dv;
            for (int j = 0; j < dv; j++) {
                const float s = decay * Si[j] + ki * delta[j];
                Si[j] = s;
                o[j] += s * qi;
            }
        }
    }
}

TM_API int tm_delta_rule_step(const tm_delta_rule_step_args *a) {
    if (a->dk < 1 || a->dv < 1 || a->dv > TM_DELTA_RULE_MAX_DV) return -1;
    delta_rule_step(a);
    return 0;
}

TM_API int tm_argmax(const tm_argmax_args *a) {
    if (a->n < 1) return -1;
    argmax_rows(a->x, a->rows, a->n, a->out, a->num_threads);
    return 0;
}

/* LoRA: the rows sorted by slot and taken in tiles of up to LORA_TILE rows of one slot, so each row of a and b is
 * read once a tile and meets every row of the tile in registers: h = x a (float32 sums, 8 of a's columns at a time),
 * then y += h b (8 outputs at a time, summed over r, added to y once). Tiles go over the threads. */
#define LORA_CHUNK 512
#define LORA_TILE 4
#define LORA_OUT_VECS 4         /* outputs a pass: 4 vectors of 8, for each of a tile's rows, in registers */
typedef float lora_v8 __attribute__((vector_size(32)));

static inline lora_v8 lora_load8(const float *p) {
    lora_v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static void lora_tile(const tm_lora_args *a, const int *rows, int nr) {
    const int s = a->row_slot[rows[0]], in = a->n_in, r = a->r, out = a->n_out;
    float h[LORA_TILE][TM_LORA_MAX_RANK_COLS], xf[LORA_TILE][LORA_CHUNK];
    memset(h, 0, sizeof h);
    memset(xf, 0, sizeof xf);             /* a short tile's missing rows multiply zeros */
    const float *A = a->a + (size_t)s * in * r;
    const int r8 = r - r % 8;
    for (int i0 = 0; i0 < in; i0 += LORA_CHUNK) {
        const int n = in - i0 < LORA_CHUNK ? in - i0 : LORA_CHUNK;
        for (int k = 0; k < nr; k++) {
            const size_t at = (size_t)rows[k] * a->x_stride + i0;
            if (a->bf16)
                for (int i = 0; i < n; i++) xf[k][i] = bf16_to_f32(((const uint16_t *)a->x)[at + i]);
            else
                memcpy(xf[k], (const float *)a->x + at, n * sizeof(float));
        }
        for (int j = 0; j < r8; j += 8) {
            lora_v8 acc[LORA_TILE];
            for (int k = 0; k < LORA_TILE; k++) acc[k] = lora_load8(&h[k][j]);
            for (int i = 0; i < n; i++) {
                const lora_v8 av = lora_load8(A + (size_t)(i0 + i) * r + j);
                for (int k = 0; k < LORA_TILE; k++) acc[k] += xf[k][i] * av;
            }
            for (int k = 0; k < LORA_TILE; k++) memcpy(&h[k][j], &acc[k], sizeof acc[k]);
        }
        for (int j = r8; j < r; j++)      /* ranks that are not a multiple of 8: the last columns one by one */
            for (int i = 0; i < n; i++)
                for (int k = 0; k < nr; k++) h[k][j] += xf[k][i] * A[(size_t)(i0 + i) * r + j];
    }
    const float *B = a->b + (size_t)s * r * out;
    const int out8 = out - out % 8;
    for (int o0 = 0; o0 < out8; o0 += 8 * LORA_OUT_VECS) {
        const int nv = (out8 - o0) / 8 < LORA_OUT_VECS ? (out8 - o0) / 8 : LORA_OUT_VECS;
        lora_v8 acc[LORA_TILE][LORA_OUT_VECS];
        memset(acc, 0, sizeof acc);
        for (int j = 0; j < r; j++) {
            const float *Bj = B + (size_t)j * out + o0;
            for (int v = 0; v < nv; v++) {
                const lora_v8 bv = lora_load8(Bj + 8 * v);
                for (int k = 0; k < LORA_TILE; k++) acc[k][v] += h[k][j] * bv;
            }
        }
        for (int k = 0; k < nr; k++) {
            const size_t at = (size_t)rows[k] * a->y_stride + o0;
            const float *sum = (const float *)acc[k];
            if (a->bf16) {
                uint16_t *y = (uint16_t *)a->y + at;
                for (int q = 0; q < 8 * nv; q++) y[q] = f32_to_bf16(bf16_to_f32(y[q]) + sum[q]);
            } else {
                float *y = (float *)a->y + at;
                for (int q = 0; q < 8 * nv; q++) y[q] += sum[q];
            }
        }
    }
    for (int o = out8; o < out; o++)
        for (int k = 0; k < nr; k++) {
            float sum = 0.f;
            for (int j = 0; j < r; j++) sum += h[k][j] * B[(size_t)j * out + o];
            const size_t at = (size_t)rows[k] * a->y_stride + o;
            if (a->bf16) {
                uint16_t *y = (uint16_t *)a->y + at;
                *y = f32_to_bf16(bf16_to_f32(*y) + sum);
            } else {
                ((float *)a->y)[at] += sum;
            }
        }
}

TM_API int tm_lora(const tm_lora_args *a) {
    if (a->r < 1 || a->r > TM_LORA_MAX_RANK_COLS || a->n_in < 1 || a->n_out < 1 || a->x_stride < a->n_in
        || a->y_stride < a->n_out || a->rows < 0)
        return -1;
    /* the rows with an adapter, by slot (a stable counting sort), then cut into tiles of one slot */
    int max_slot = -1, n = 0;
    for (int t = 0; t < a->rows; t++) max_slot = a->row_slot[t] > max_slot ? a->row_slot[t] : max_slot;
    if (max_slot < 0) return 0;
    int *count = calloc((size_t)max_slot + 2, sizeof(int)), *order = malloc(sizeof(int) * (size_t)a->rows);
    int *tiles = malloc(sizeof(int) * ((size_t)a->rows + 1));
    if (!count || !order || !tiles) {
        free(count);
        free(order);
        free(tiles);
        return -2;
    }
    for (int t = 0; t < a->rows; t++)
        if (a->row_slot[t] >= 0) count[a->row_slot[t] + 1]++;
    for (int s = 0; s <= max_slot; s++) count[s + 1] += count[s];
    for (int t = 0; t < a->rows; t++)
        if (a->row_slot[t] >= 0) order[count[a->row_slot[t]]++] = t;
    n = count[max_slot];                    /* rows with an adapter */
    int num_tiles = 0;
    for (int i = 0; i < n;) {
        int j = i + 1;
        while (j < n && j - i < LORA_TILE && a->row_slot[order[j]] == a->row_slot[order[i]]) j++;
        tiles[num_tiles++] = i;
        i = j;
    }
    tiles[num_tiles] = n;
    /* threads pay for themselves past a few rows' worth of multiply-adds */
    const long work = (long)n * a->r * (a->n_in + a->n_out);
#pragma omp parallel for schedule(dynamic, 1) num_threads(a->num_threads) if (work >= (1L << 18))
    for (int k = 0; k < num_tiles; k++) lora_tile(a, order + tiles[k], tiles[k + 1] - tiles[k]);
    free(count);
    free(order);
    free(tiles);
    return 0;
}
