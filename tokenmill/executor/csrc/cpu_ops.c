/* The small per-layer ops of a decode step, float32 on CPU: each is a few microseconds of arithmetic, and as
 * torch ops on a 1-row batch they cost 5-30 us apiece in dispatch (rms_norm alone ~28 us). One call each here.
 * Rows are split over threads only when there are many (prefill); a decode step's few rows stay on one. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PAR_ROWS 64   /* fewer rows than this: not worth waking the thread pool */

/* residual += x (when residual is given, else residual = x is the caller's business: pass x as residual with
 * add = 0); out = weight * residual / rms(residual). x, residual, out [rows, dim]; weight [dim]. */
void add_rms_norm(float *x, float *residual, const float *weight, float *out, int rows, int dim, float eps,
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
void silu_mul(const float *gate_up, float *out, int rows, int inter, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= PAR_ROWS)
    for (int r = 0; r < rows; r++) {
        const float *g = gate_up + (size_t)r * 2 * inter, *u = g + inter;
        float *o = out + (size_t)r * inter;
        for (int i = 0; i < inter; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

