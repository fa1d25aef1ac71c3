/* Two builds of the CPU kernel library against each other:
 *
 *     kernel_check LIB_A LIB_B        e.g. tokenmill-neon.so tokenmill-generic.so
 *
 * dlopens both variants side by side and runs every kernel of tokenmill.h in each on the same pseudo-random
 * inputs (several shapes per kernel, edge cases included), then compares what they return: integer outputs
 * exactly, float outputs within a tolerance scaled to their magnitude (the variants may differ in summation
 * order and in which multiply-adds are fused, nothing more). One line per check ("ok KERNEL case" or
 * "FAIL KERNEL case ..."), then "N passed, M failed"; the exit status is non-zero when anything failed.
 *
 * The layouts are tokenmill.h's own structs and the kernels are called through pointers of their declared
 * types, so nothing here restates the interface. Built without -ffast-math, so the NaN checks below hold.
 * tests/test_kernels_cross.py builds and runs it (under qemu-aarch64 for the ARM variants).
 */
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fp8.h"
#include "tokenmill.h"

/* ---- the two libraries ------------------------------------------------------------------------------------ */

typedef struct {
    const char *path;
    __typeof__(tm_isa) *isa;
    __typeof__(tm_build_hash) *build_hash;
    __typeof__(tm_qmatmul) *qmatmul;
    __typeof__(tm_pack_lanes) *pack_lanes;
    __typeof__(tm_qdequant) *qdequant;
    __typeof__(tm_gmatmul) *gmatmul;
    __typeof__(tm_gdequant) *gdequant;
    __typeof__(tm_rms_norm) *rms_norm;
    __typeof__(tm_rotary) *rotary;
    __typeof__(tm_silu_mul) *silu_mul;
    __typeof__(tm_argmax) *argmax;
    __typeof__(tm_paged_decode) *paged_decode;
    __typeof__(tm_paged_prefill) *paged_prefill;
    __typeof__(tm_write_kv) *write_kv;
    __typeof__(tm_decode_attention) *decode_attention;
    __typeof__(tm_decode_layer) *decode_layer;
    __typeof__(tm_touch_pages) *touch_pages;
} library;

static library lib[2];
static const char *const side[2] = {"A", "B"};

static void *symbol(void *handle, const char *path, const char *name) {
    void *p = dlsym(handle, name);
    if (!p) {
        fprintf(stderr, "kernel_check: %s has no %s\n", path, name);
        exit(2);
    }
    return p;
}

/* RTLD_LOCAL: each library's calls between its own kernels (tm_decode_layer -> tm_qmatmul) stay inside it,
 * never reaching the other library's symbols of the same name. */
static void open_library(library *l, const char *path) {
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "kernel_check: cannot load %s: %s\n", path, dlerror());
        exit(2);
    }
    l->path = path;
#define SYM(name) l->name = (__typeof__(l->name))symbol(h, path, "tm_" #name)
    SYM(isa);
    SYM(build_hash);
    SYM(qmatmul);
    SYM(pack_lanes);
    SYM(qdequant);
    SYM(gmatmul);
    SYM(gdequant);
    SYM(rms_norm);
    SYM(rotary);
    SYM(silu_mul);
    SYM(argmax);
    SYM(paged_decode);
    SYM(paged_prefill);
    SYM(write_kv);
    SYM(decode_attention);
    SYM(decode_layer);
    SYM(touch_pages);
#undef SYM
}

/* ---- results ---------------------------------------------------------------------------------------------- */

static int passed, failed;

static void verdict(const char *kernel, const char *name, double err, double tol) {
    if (err <= tol) {
        passed++;
        printf("ok %s %s\n", kernel, name);
    } else {
        failed++;
        printf("FAIL %s %s max_err=%.3g (tol %.3g)\n", kernel, name, err, tol);
    }
}

/* A check of several outputs, each with its own tolerance: the one nearest its tolerance decides. */
typedef struct {
    double err, tol;
} margin;

static void within(margin *m, double err, double tol) {
    if (err / tol > m->err / m->tol) *m = (margin){err, tol};
}

static void fail(const char *kernel, const char *name, const char *why) {
    failed++;
    printf("FAIL %s %s %s\n", kernel, name, why);
}

/* Both statuses are `want`; a FAIL line (and 0) otherwise. */
static int statuses(const char *kernel, const char *name, const int st[2], int want) {
    if (st[0] == want && st[1] == want) return 1;
    char why[96];
    snprintf(why, sizeof why, "status A=%d B=%d (want %d)", st[0], st[1], want);
    fail(kernel, name, why);
    return 0;
}

/* Tolerances, relative: |a - b| <= tol * (1 + |b|) unless said otherwise. */
#define TOL 1e-4          /* float32 results: the variants differ in summation order and fused multiply-adds */
#define TOL_BF16 8e-3     /* results stored as bfloat16: one rounding step apart (8 significant bits) */
#define TOL_QMATMUL 1e-4  /* of sum_k |x_k| |w_nk|: float32 sums over k in another order */
#define TOL_LAYER 1e-3    /* a whole layer: five matmuls, two norms and attention, each one's rounding carried on */

/* ---- inputs ----------------------------------------------------------------------------------------------- */

static uint64_t rng;

static void seed(uint64_t s) { rng = s * 0x9E3779B97F4A7C15ull + 12345; }

static uint64_t next64(void) {   /* splitmix64 */
    uint64_t z = (rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static float uni(float lo, float hi) { return lo + (hi - lo) * (float)((next64() >> 40) / 16777216.0); }
static int below(int n) { return (int)(next64() % (uint64_t)n); }

static void fill(float *x, size_t n, float lo, float hi) {
    for (size_t i = 0; i < n; i++) x[i] = uni(lo, hi);
}

static void shuffle(int *a, int n) {
    for (int i = n - 1; i > 0; i--) {
        const int j = below(i + 1), t = a[i];
        a[i] = a[j];
        a[j] = t;
    }
}

/* Every buffer of a case comes from here, zeroed, and release() frees them all when the case is done. */
static void *held[1024];
static int nheld;

static void *alloc(size_t bytes) {
    void *p = calloc(1, bytes ? bytes : 1);
    if (!p || nheld == (int)(sizeof held / sizeof *held)) {
        fprintf(stderr, "kernel_check: out of memory or buffers\n");
        exit(2);
    }
    return held[nheld++] = p;
}

static void release(void) {
    while (nheld) free(held[--nheld]);
}

#define NEW(T, n) ((T *)alloc(sizeof(T) * (size_t)(n)))

static void *copy_of(const void *p, size_t bytes) { return memcpy(alloc(bytes), p, bytes); }

static float from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint16_t to_bf16(float f) {   /* to nearest even, as torch converts */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

static float bits_float(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* element i of a float32 or bfloat16 buffer */
static float get(const void *p, int bf16, size_t i) {
    return bf16 ? from_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
static void put(void *p, int bf16, size_t i, float x) {
    if (bf16) ((uint16_t *)p)[i] = to_bf16(x);
    else ((float *)p)[i] = x;
}

/* n random values in [lo, hi) as float32 or bfloat16 */
static void *random_values(size_t n, int bf16, float lo, float hi) {
    void *p = alloc(n * (bf16 ? 2 : 4));
    for (size_t i = 0; i < n; i++) put(p, bf16, i, uni(lo, hi));
    return p;
}

/* The worst |a - b| / (1 + |b|) over n values (or / scale[i] when scale is given); infinite where only one side
 * is NaN or infinite. */
static double rel_err(const void *pa, const void *pb, int bf16, size_t n, const double *scale) {
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        const float a = get(pa, bf16, i), b = get(pb, bf16, i);
        if (isnan(a) || isnan(b)) {
            if (isnan(a) && isnan(b)) continue;
            return INFINITY;
        }
        if (a == b) continue;
        if (isinf(a) || isinf(b)) return INFINITY;
        const double e = fabs((double)a - (double)b) / (scale ? scale[i] : 1.0 + fabs((double)b));
        if (e > worst) worst = e;
    }
    return worst;
}

static double max2(double a, double b) { return a > b ? a : b; }

/* cos and sin tables [rows, dim] of the "rotate half" form: both halves of a row hold the same angles */
static void rotary_tables(float *cos_t, float *sin_t, int rows, int dim) {
    for (int t = 0; t < rows; t++)
        for (int i = 0; i < dim / 2; i++) {
            const float angle = uni(-3.2f, 3.2f);
            cos_t[(size_t)t * dim + i] = cos_t[(size_t)t * dim + i + dim / 2] = cosf(angle);
            sin_t[(size_t)t * dim + i] = sin_t[(size_t)t * dim + i + dim / 2] = sinf(angle);
        }
}

/* ---- tm_qmatmul, tm_pack_lanes ---------------------------------------------------------------------------- */

/* A random [n, k] weight in 32-wide blocks, and its dequantised values (for the tolerance). 4-bit: byte j of a
 * block holds code j in its low nibble and code j + 16 in its high one, weight d * code + m; 8-bit: d * code. */
typedef struct {
    tm_qweight w;
    float *dense;   /* [n, k] */
} qmat;

static qmat random_qweight(int bits, int n, int k, float spread) {
    const int nb = k / 32;
    qmat q = {.w = {.bits = bits, .n = n, .k = k}, .dense = NEW(float, (size_t)n * k)};
    float *scale = NEW(float, (size_t)n * nb), *offset = bits == 4 ? NEW(float, (size_t)n * nb) : NULL;
    if (bits == 4) {
        uint8_t *codes = NEW(uint8_t, (size_t)n * k / 2);
        for (int r = 0; r < n; r++)
            for (int i = 0; i < nb; i++) {
                const float d = uni(0.2f, 1.f) * spread, m = -7.5f * d + uni(-0.5f, 0.5f) * d;
                scale[r * nb + i] = d;
                offset[r * nb + i] = m;
                for (int j = 0; j < 16; j++) {
                    const uint8_t c = (uint8_t)below(256);
                    codes[(size_t)r * k / 2 + i * 16 + j] = c;
                    q.dense[(size_t)r * k + 32 * i + j] = d * (c & 15) + m;
                    q.dense[(size_t)r * k + 32 * i + j + 16] = d * (c >> 4) + m;
                }
            }
        q.w.codes = codes;
    } else {
        int8_t *codes = NEW(int8_t, (size_t)n * k);
        for (int r = 0; r < n; r++)
            for (int i = 0; i < nb; i++) {
                const float d = uni(0.2f, 1.f) * spread / 16;
                scale[r * nb + i] = d;
                for (int j = 0; j < 32; j++) {
                    const int8_t c = (int8_t)(below(255) - 127);
                    codes[(size_t)r * k + 32 * i + j] = c;
                    q.dense[(size_t)r * k + 32 * i + j] = d * c;
                }
            }
        q.w.codes = codes;
    }
    q.w.scale = scale;
    q.w.offset = offset;
    return q;
}

/* y [rows, n] of both libraries within TOL_QMATMUL of sum_k |x[b][k]| |w[n][k]| */
static double qmatmul_err(const qmat *q, const float *x, int rows, float *const y[2]) {
    const int n = q->w.n, k = q->w.k;
    double *scale = NEW(double, (size_t)rows * n);
    for (int b = 0; b < rows; b++)
        for (int j = 0; j < n; j++) {
            double s = 1e-30;
            for (int i = 0; i < k; i++) s += fabs((double)x[(size_t)b * k + i] * q->dense[(size_t)j * k + i]);
            scale[(size_t)b * n + j] = s;
        }
    return rel_err(y[0], y[1], 0, (size_t)rows * n, scale);
}

static void check_qmatmul(void) {
    static const int shapes[][2] = {{48, 64}, {37, 96}, {130, 160}, {1, 32}, {16, 32}};
    /* up to 20 rows: the dot-product kernel, in passes of up to 8 inputs (4 on AVX2 and generic), each
     * pass size its own unrolled code; above: the GEMM, 16 inputs to a vector and 2, 3 or 4 vectors */
    static const int row_counts[] = {1, 2, 3, 4, 5, 6, 7, 8, 12, 17, 20, 21, 33, 48, 64};
    int case_no = 0;
    for (int bits = 4; bits <= 8; bits += 4)
        for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++)
            for (size_t r = 0; r < sizeof row_counts / sizeof *row_counts; r++) {
                const int n = shapes[s][0], k = shapes[s][1], rows = row_counts[r];
                char name[64];
                snprintf(name, sizeof name, "q%d n%d k%d rows%d", bits, n, k, rows);
                seed(100 + case_no++);
                const qmat q = random_qweight(bits, n, k, 0.1f);
                float *x = NEW(float, (size_t)rows * k), *y[2];
                fill(x, (size_t)rows * k, -1.f, 1.f);
                int st[2];
                for (int v = 0; v < 2; v++) {
                    y[v] = NEW(float, (size_t)rows * n);
                    const tm_qmatmul_args a = {.w = &q.w, .x = x, .y = y[v], .rows = rows, .num_threads = 1 + rows % 3};
                    st[v] = lib[v].qmatmul(&a);
                }
                if (statuses("qmatmul", name, st, 0)) verdict("qmatmul", name, qmatmul_err(&q, x, rows, y), TOL_QMATMUL);
                release();
            }

    /* outside the limits: k not a multiple of 32, too many rows, none, 4-bit without offsets */
    seed(99);
    const qmat q = random_qweight(4, 8, 64, 0.1f);
    float *x = NEW(float, 65 * 64), *y = NEW(float, 65 * 64);
    tm_qweight odd_k = q.w, no_offset = q.w;
    odd_k.k = 48;
    no_offset.offset = NULL;
    const struct { const char *name; const tm_qweight *w; int rows; } bad[] = {
        {"limits k48", &odd_k, 1}, {"limits rows65", &q.w, 65}, {"limits rows0", &q.w, 0},
        {"limits q4 without offset", &no_offset, 1},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        int st[2];
        for (int v = 0; v < 2; v++) {
            const tm_qmatmul_args a = {.w = bad[i].w, .x = x, .y = y, .rows = bad[i].rows, .num_threads = 1};
            st[v] = lib[v].qmatmul(&a);
        }
        if (statuses("qmatmul", bad[i].name, st, -1)) verdict("qmatmul", bad[i].name, 0, 0);
    }
    release();
}

/* tm_pack_lanes: a variant with a lanes kernel (AVX-512) packs the weight and runs its matmuls through it (9 to
 * 40 rows, n a multiple of 16); one without returns -1 and keeps the row layout. Either way both variants'
 * results must agree. */
static void check_pack_lanes(void) {
    static const int shapes[][2] = {{48, 64}, {96, 160}};
    static const int row_counts[] = {9, 16, 21, 33, 40};
    int case_no = 0, any = 0;
    for (int bits = 4; bits <= 8; bits += 4)
        for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
            const int n = shapes[s][0], k = shapes[s][1];
            seed(200 + case_no++);
            const qmat q = random_qweight(bits, n, k, 0.1f);
            tm_qweight w[2] = {q.w, q.w};
            int packed[2], st[2];
            for (int v = 0; v < 2; v++) {
                const size_t code_bytes = (size_t)n * k / (bits == 4 ? 2 : 1), nb = (size_t)n * k / 32;
                w[v].lanes_codes = alloc(code_bytes);
                w[v].lanes_scale = NEW(float, nb);
                w[v].lanes_offset = q.w.offset ? NEW(float, nb) : NULL;
                st[v] = lib[v].pack_lanes(&w[v]);
                packed[v] = st[v] == 0;
                if (!packed[v]) w[v].lanes_codes = w[v].lanes_scale = w[v].lanes_offset = NULL;
            }
            char name[64];
            snprintf(name, sizeof name, "q%d n%d k%d", bits, n, k);
            if ((st[0] != 0 && st[0] != -1) || (st[1] != 0 && st[1] != -1)) {
                statuses("pack_lanes", name, st, 0);
                release();
                continue;
            }
            if (!packed[0] && !packed[1]) {
                release();
                continue;
            }
            any = 1;
            for (size_t r = 0; r < sizeof row_counts / sizeof *row_counts; r++) {
                const int rows = row_counts[r];
                snprintf(name, sizeof name, "q%d n%d k%d rows%d lanes:%s%s", bits, n, k, rows,
                         packed[0] ? "A" : "", packed[1] ? "B" : "");
                float *x = NEW(float, (size_t)rows * k), *y[2];
                fill(x, (size_t)rows * k, -1.f, 1.f);
                for (int v = 0; v < 2; v++) {
                    y[v] = NEW(float, (size_t)rows * n);
                    const tm_qmatmul_args a = {.w = &w[v], .x = x, .y = y[v], .rows = rows, .num_threads = 2};
                    st[v] = lib[v].qmatmul(&a);
                }
                if (statuses("pack_lanes", name, st, 0))
                    verdict("pack_lanes", name, qmatmul_err(&q, x, rows, y), TOL_QMATMUL);
            }
            release();
        }
    if (!any) {   /* neither has a lanes kernel: both must refuse, and nothing else to compare */
        verdict("pack_lanes", "refused by both (no lanes kernel in either variant)", 0, 0);
    }
    /* n not a multiple of 16: refused by every variant */
    seed(299);
    const qmat q = random_qweight(4, 37, 64, 0.1f);
    tm_qweight w = q.w;
    w.lanes_codes = alloc(37 * 32);
    w.lanes_scale = NEW(float, 37 * 2);
    w.lanes_offset = NEW(float, 37 * 2);
    int st[2];
    for (int v = 0; v < 2; v++) st[v] = lib[v].pack_lanes(&w);
    if (statuses("pack_lanes", "limits n37", st, -1)) verdict("pack_lanes", "limits n37", 0, 0);
    release();
}

/* ---- the small ops ---------------------------------------------------------------------------------------- */

static void check_rms_norm(void) {
    static const int row_counts[] = {1, 3, 70}, dims[] = {64, 200, 576};   /* 70 rows: split over threads */
    int case_no = 0;
    for (size_t r = 0; r < 3; r++)
        for (size_t d = 0; d < 3; d++)
            for (int add = 0; add <= 1; add++) {
                const int rows = row_counts[r], dim = dims[d];
                const size_t n = (size_t)rows * dim;
                char name[64];
                snprintf(name, sizeof name, "rows%d dim%d add%d", rows, dim, add);
                seed(300 + case_no++);
                float *x = NEW(float, n), *res0 = NEW(float, n), *weight = NEW(float, dim), *res[2], *out[2];
                fill(x, n, -2.f, 2.f);
                fill(res0, n, -3.f, 3.f);
                fill(weight, dim, 0.5f, 1.5f);
                int st[2];
                for (int v = 0; v < 2; v++) {
                    res[v] = add ? copy_of(res0, n * 4) : x;   /* add 0: residual is x itself */
                    out[v] = NEW(float, n);
                    const tm_rms_norm_args a = {.x = x, .residual = res[v], .weight = weight, .out = out[v],
                                                .rows = rows, .dim = dim, .eps = 1e-5f, .add = add, .num_threads = 2};
                    st[v] = lib[v].rms_norm(&a);
                }
                if (statuses("rms_norm", name, st, 0))   /* the output, and the residual it added x into */
                    verdict("rms_norm", name, max2(rel_err(out[0], out[1], 0, n, NULL),
                                                   rel_err(res[0], res[1], 0, n, NULL)), TOL);
                release();
            }
}

static void check_rotary(void) {
    static const int row_counts[] = {1, 4, 70}, heads_[] = {1, 3}, dims[] = {24, 64, 128};
    int case_no = 0;
    for (size_t r = 0; r < 3; r++)
        for (size_t h = 0; h < 2; h++)
            for (size_t d = 0; d < 3; d++) {
                const int rows = row_counts[r], heads = heads_[h], dim = dims[d];
                /* rows wider than the rotated heads (q and k inside a fused qkv row): the rest must stay as it was */
                const int stride = heads * dim + (case_no % 2 ? 40 : 0);
                const size_t n = (size_t)rows * stride;
                char name[64];
                snprintf(name, sizeof name, "rows%d heads%d dim%d stride%d", rows, heads, dim, stride);
                seed(400 + case_no++);
                float *x0 = NEW(float, n), *cos_t = NEW(float, (size_t)rows * dim), *sin_t = NEW(float, (size_t)rows * dim);
                float *x[2];
                fill(x0, n, -2.f, 2.f);
                rotary_tables(cos_t, sin_t, rows, dim);
                int st[2];
                for (int v = 0; v < 2; v++) {
                    x[v] = copy_of(x0, n * 4);
                    const tm_rotary_args a = {.x = x[v], .cos = cos_t, .sin = sin_t, .rows = rows, .heads = heads,
                                              .dim = dim, .row_stride = stride, .num_threads = 2};
                    st[v] = lib[v].rotary(&a);
                }
                if (statuses("rotary", name, st, 0)) verdict("rotary", name, rel_err(x[0], x[1], 0, n, NULL), TOL);
                release();
            }
    /* outside the limits: an odd dim, a row stride narrower than the heads */
    float *x = NEW(float, 64), *t = NEW(float, 64);
    const tm_rotary_args bad[] = {
        {.x = x, .cos = t, .sin = t, .rows = 1, .heads = 1, .dim = 7, .row_stride = 7, .num_threads = 1},
        {.x = x, .cos = t, .sin = t, .rows = 1, .heads = 2, .dim = 16, .row_stride = 24, .num_threads = 1},
    };
    const char *names[] = {"limits dim7", "limits stride24 heads2 dim16"};
    for (int i = 0; i < 2; i++) {
        int st[2];
        for (int v = 0; v < 2; v++) st[v] = lib[v].rotary(&bad[i]);
        if (statuses("rotary", names[i], st, -1)) verdict("rotary", names[i], 0, 0);
    }
    release();
}

static void check_silu_mul(void) {
    static const int row_counts[] = {1, 5, 64}, inters[] = {17, 128, 1536};
    int case_no = 0;
    for (size_t r = 0; r < 3; r++)
        for (size_t i = 0; i < 3; i++) {
            const int rows = row_counts[r], inter = inters[i];
            char name[64];
            snprintf(name, sizeof name, "rows%d inter%d", rows, inter);
            seed(500 + case_no++);
            float *gate_up = NEW(float, (size_t)rows * 2 * inter), *out[2];
            fill(gate_up, (size_t)rows * 2 * inter, -8.f, 8.f);
            for (int e = 0; e < rows; e++) {   /* a few gates far out on either side (silu ~ 0 and ~ gate) */
                gate_up[(size_t)e * 2 * inter + below(inter)] = 80.f;
                gate_up[(size_t)e * 2 * inter + below(inter)] = -80.f;
            }
            int st[2];
            for (int v = 0; v < 2; v++) {
                out[v] = NEW(float, (size_t)rows * inter);
                const tm_silu_mul_args a = {.gate_up = gate_up, .out = out[v], .rows = rows, .inter = inter,
                                            .num_threads = 2};
                st[v] = lib[v].silu_mul(&a);
            }
            if (statuses("silu_mul", name, st, 0))
                verdict("silu_mul", name, rel_err(out[0], out[1], 0, (size_t)rows * inter, NULL), TOL);
            release();
        }
}

/* torch.argmax's answer: the first NaN if there is one, else the first index of the largest value */
static int64_t argmax_expected(const float *x, int n) {
    int64_t best = 0;
    for (int i = 0; i < n; i++) {
        if (isnan(x[i])) return i;
        if (x[i] > x[best]) best = i;
    }
    return best;
}

static void check_argmax(void) {
    static const struct { const char *name; int rows, n; } cases[] = {
        {"random", 3, 1000}, {"n1", 2, 1}, {"n17", 4, 17}, {"ties", 4, 100}, {"nan", 5, 77},
        {"inf", 4, 40}, {"signed zeros", 2, 33}, {"vocab", 4, 49152},
    };
    const float nan_ = bits_float(0x7fc00000u), neg_nan = bits_float(0xffc00000u), inf = INFINITY;
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const char *name = cases[c].name;
        const int rows = cases[c].rows, n = cases[c].n;
        seed(600 + c);
        float *x = NEW(float, (size_t)rows * n);
        fill(x, (size_t)rows * n, -5.f, 5.f);
#define X(r, i) x[(size_t)(r) * n + (i)]
        if (!strcmp(name, "ties")) {   /* the first of equal maxima, also when they sit in the same vector lane */
            X(0, 5) = X(0, 37) = X(0, 99) = 9.f;
            X(1, 83) = X(1, 20) = X(1, 4) = 9.f;
            for (int i = 0; i < n; i++) X(2, i) = 0.5f;
            X(3, 98) = X(3, 99) = 9.f;
        } else if (!strcmp(name, "nan")) {   /* a NaN wins over any number, the first NaN over later ones */
            X(0, 10) = 9.f;
            X(0, 50) = nan_;
            X(1, n - 1) = nan_;
            X(2, 70) = nan_;
            X(2, 30) = nan_;
            X(3, 0) = nan_;
            X(4, 40) = neg_nan;
        } else if (!strcmp(name, "inf")) {
            X(0, 7) = X(0, 9) = inf;
            for (int i = 0; i < n; i++) X(1, i) = X(2, i) = -inf;
            X(2, 33) = -1e30f;
            X(3, 3) = inf;
            X(3, 39) = nan_;
        } else if (!strcmp(name, "signed zeros")) {   /* -0 == +0: the first one */
            for (int i = 0; i < n; i++) X(0, i) = X(1, i) = (i % 2) ? 0.f : -0.f;
            X(1, 0) = -1.f;
        } else if (!strcmp(name, "vocab")) {
            X(2, n - 1) = 9.f;
            X(3, 16000) = X(3, 48000) = 9.f;
        }
#undef X
        int64_t *out[2];
        int st[2];
        for (int v = 0; v < 2; v++) {
            out[v] = NEW(int64_t, rows);
            for (int r = 0; r < rows; r++) out[v][r] = -7;
            const tm_argmax_args a = {.x = x, .out = out[v], .rows = rows, .n = n, .num_threads = 2};
            st[v] = lib[v].argmax(&a);
        }
        if (statuses("argmax", name, st, 0)) {
            int bad = -1;
            for (int r = 0; r < rows && bad < 0; r++) {
                const int64_t want = argmax_expected(x + (size_t)r * n, n);
                if (out[0][r] != want || out[1][r] != want) bad = r;
            }
            if (bad < 0) verdict("argmax", name, 0, 0);
            else {
                char why[128];
                snprintf(why, sizeof why, "row %d: A=%lld B=%lld expected %lld", bad, (long long)out[0][bad],
                         (long long)out[1][bad], (long long)argmax_expected(x + (size_t)bad * n, n));
                fail("argmax", name, why);
            }
        }
        release();
    }
    float x = 1.f;
    int64_t out;
    const tm_argmax_args a = {.x = &x, .out = &out, .rows = 1, .n = 0, .num_threads = 1};
    int st[2] = {lib[0].argmax(&a), lib[1].argmax(&a)};
    if (statuses("argmax", "limits n0", st, -1)) verdict("argmax", "limits n0", 0, 0);
}

static void check_touch_pages(void) {
    const int64_t bytes = 3 * 4096 + 100;
    void *bufs[2] = {alloc(bytes), alloc(bytes)};
    for (int stop = 0; stop <= 1; stop++) {
        int64_t done[2];
        for (int v = 0; v < 2; v++) {
            const tm_touch_pages_args a = {.bufs = bufs, .n = 2, .bytes = bytes, .chunk = 4096, .stop = &stop};
            done[v] = lib[v].touch_pages(&a);
        }
        const char *name = stop ? "stopped" : "whole";
        const int64_t want = stop ? 0 : bytes;
        if (done[0] == want && done[1] == want) verdict("touch_pages", name, 0, 0);
        else {
            char why[96];
            snprintf(why, sizeof why, "A=%lld B=%lld bytes (want %lld)", (long long)done[0], (long long)done[1],
                     (long long)want);
            fail("touch_pages", name, why);
        }
    }
    release();
}

/* ---- the paged KV cache ----------------------------------------------------------------------------------- */

/* B contexts in one paged cache of format fmt (TM_KV_*). Each context's blocks are scattered over the pool
 * (shuffled ids, a few spare blocks nobody owns); the first `shared_blocks` blocks of every table are the same
 * (cascade). Blocks wholly before starts[b] (a sliding window) and padding entries are block 0, as the backend
 * passes freed and padding entries. The cache's values are random, unused slots included: float values, or
 * random codes with random scales (fp8: codes of values in [-1, 1], subnormals among them; from all codes,
 * values up to 448 give scores whose float32 rounding alone exceeds the tolerances). */
typedef struct {
    int B, KV, D, bs, fmt, max_blocks;
    int32_t *lens, *starts, *tables;
    int64_t num_slots;
    tm_kv_cache kv;
} context;

/* bytes of one kv head's codes at a slot, and of a cache's scales (k's or v's) */
static size_t head_bytes(int fmt, int D) {
    return fmt == TM_KV_F32 ? 4 * (size_t)D : fmt == TM_KV_BF16 ? 2 * (size_t)D : fmt == TM_KV_INT4 ? (size_t)D / 2 : (size_t)D;
}
static size_t scale_bytes(int fmt, int64_t slots, int KV, int D) {
    if (fmt == TM_KV_INT8) return (size_t)slots * KV * (D % TM_KV_INT8_GROUP ? 1 : D / TM_KV_INT8_GROUP) * 4;
    if (fmt == TM_KV_INT4) return (size_t)slots * KV * (D / TM_KV_INT4_GROUP) * 4;
    return fmt >= TM_KV_FP8_E4M3 ? (size_t)KV * 4 : 0;
}

static void *random_codes(int fmt, int64_t slots, int KV, int D) {
    const size_t n = (size_t)slots * KV * head_bytes(fmt, D);
    if (fmt <= TM_KV_BF16) return random_values(n / head_bytes(fmt, 1), fmt == TM_KV_BF16, -1.f, 1.f);
    uint8_t *p = NEW(uint8_t, n);
    for (size_t i = 0; i < n; i++)
        p[i] = fmt >= TM_KV_FP8_E4M3 ? tm_f32_to_fp8(uni(-1.f, 1.f), fmt == TM_KV_FP8_E5M2) : (uint8_t)below(256);
    return p;
}

static void *random_scales(int fmt, int64_t slots, int KV, int D) {
    const size_t n = scale_bytes(fmt, slots, KV, D) / 4;
    if (!n) return NULL;
    if (fmt != TM_KV_INT4) {
        float *f = NEW(float, n);
        fill(f, n, fmt == TM_KV_INT8 ? 0.004f : 0.5f, fmt == TM_KV_INT8 ? 0.012f : 2.f);
        return f;
    }
    uint16_t *dm = NEW(uint16_t, 2 * n);   /* (d, m) pairs: codes * d + m spans about [-1, 1] */
    for (size_t i = 0; i < n; i++) {
        dm[2 * i] = tm_f32_to_half(uni(0.05f, 0.14f));
        dm[2 * i + 1] = tm_f32_to_half(uni(-1.1f, -0.9f));
    }
    return dm;
}

static context make_context(int B, const int *lens, const int *starts, int KV, int D, int bs, int fmt,
                            int shared_blocks) {
    context c = {.B = B, .KV = KV, .D = D, .bs = bs, .fmt = fmt};
    c.lens = NEW(int32_t, B);
    c.starts = NEW(int32_t, B);
    int blocks = shared_blocks + 3;
    for (int b = 0; b < B; b++) {
        c.lens[b] = lens[b];
        c.starts[b] = starts ? starts[b] : 0;
        const int need = (lens[b] + bs - 1) / bs;
        if (need > c.max_blocks) c.max_blocks = need;
        blocks += need > shared_blocks ? need - shared_blocks : 0;
    }
    c.max_blocks += 1;   /* a padding column */
    int *ids = NEW(int, blocks);
    for (int i = 0; i < blocks; i++) ids[i] = i;
    shuffle(ids, blocks);
    c.tables = NEW(int32_t, (size_t)B * c.max_blocks);
    int next = shared_blocks;
    for (int b = 0; b < B; b++) {
        const int need = (lens[b] + bs - 1) / bs;
        for (int j = 0; j < need; j++) {
            const int id = j < shared_blocks ? ids[j] : ids[next++];
            c.tables[(size_t)b * c.max_blocks + j] = (j + 1) * bs <= c.starts[b] ? 0 : id;
        }
    }
    c.num_slots = (int64_t)blocks * bs;
    c.kv = (tm_kv_cache){.k = random_codes(fmt, c.num_slots, KV, D), .v = random_codes(fmt, c.num_slots, KV, D),
                         .k_scale = random_scales(fmt, c.num_slots, KV, D),
                         .v_scale = random_scales(fmt, c.num_slots, KV, D), .num_slots = c.num_slots,
                         .kv_heads = KV, .head_dim = D, .format = fmt};
    return c;
}

static size_t cache_values(const context *c) { return (size_t)c->num_slots * c->KV * c->D; }
static size_t code_bytes(const context *c) { return (size_t)c->num_slots * c->KV * head_bytes(c->fmt, c->D); }

/* A second cache with the same contents (scales too), for a kernel that writes into it. */
static tm_kv_cache copy_cache(const context *c) {
    tm_kv_cache kv = c->kv;
    const size_t bytes = code_bytes(c), sb = scale_bytes(c->fmt, c->num_slots, c->KV, c->D);
    kv.k = copy_of(c->kv.k, bytes);
    kv.v = copy_of(c->kv.v, bytes);
    if (sb) {
        kv.k_scale = copy_of(c->kv.k_scale, sb);
        kv.v_scale = copy_of(c->kv.v_scale, sb);
    }
    return kv;
}

/* two caches of a context hold the same bytes, codes and scales */
static int same_cache(const context *c, const tm_kv_cache *a, const tm_kv_cache *b) {
    const size_t bytes = code_bytes(c), sb = scale_bytes(c->fmt, c->num_slots, c->KV, c->D);
    return !memcmp(a->k, b->k, bytes) && !memcmp(a->v, b->v, bytes)
           && (!sb || (!memcmp(a->k_scale, b->k_scale, sb) && !memcmp(a->v_scale, b->v_scale, sb)));
}

static int64_t slot_of(const context *c, int b, int pos) {
    return (int64_t)c->tables[(size_t)b * c->max_blocks + pos / c->bs] * c->bs + pos % c->bs;
}

static double cache_err(const context *c, const tm_kv_cache kv[2]) {
    const size_t n = cache_values(c);
    return max2(rel_err(kv[0].k, kv[1].k, c->fmt, n, NULL), rel_err(kv[0].v, kv[1].v, c->fmt, n, NULL));
}

/* ---- tm_write_kv ------------------------------------------------------------------------------------------ */

static void check_write_kv(void) {
    /* values where float32 -> bfloat16 rounding has something to decide: halfway (to even, both ways), just
     * above halfway, the largest float (rounds to infinity), infinities, NaNs, a subnormal */
    static const uint32_t special[] = {0x3f808000u, 0x3f818000u, 0x3f808001u, 0x7f7fffffu, 0x7f800000u,
                                       0xff800000u, 0x7fc00000u, 0xffc00001u, 0x00000001u, 0x80000000u};
    static const char *const fmt_names[] = {"f32", "bf16", "int8", "int4", "fp8e4m3", "fp8e5m2"};
    int case_no = 0;
    for (int fmt = TM_KV_F32; fmt <= TM_KV_FP8_E5M2; fmt++)
        for (int rows = 1; rows <= 5; rows += 4) {
            char name[64];
            snprintf(name, sizeof name, "%s rows%d", fmt_names[fmt], rows);
            seed(700 + case_no++);
            const int lens[1] = {64};
            const context c = make_context(1, lens, NULL, 2, fmt == TM_KV_INT4 ? 64 : 24, 16, fmt, 0);
            const int width = c.KV * c.D, stride = width + 8;   /* rows of a wider source (fused qkv) */
            float *k = NEW(float, (size_t)rows * stride), *v = NEW(float, (size_t)rows * stride);
            fill(k, (size_t)rows * stride, -3.f, 3.f);
            fill(v, (size_t)rows * stride, -3.f, 3.f);
            if (fmt >= TM_KV_FP8_E4M3)   /* past e4m3's largest code (clamped), and into both subnormal ranges */
                for (int i = 0; i < width; i += 3) k[i] *= i % 2 ? 300.f : 1e-4f;
            for (size_t i = 0; fmt <= TM_KV_BF16 && i < sizeof special / sizeof *special; i++) {
                k[i] = bits_float(special[i]);
                v[(size_t)(rows - 1) * stride + i] = bits_float(special[i]);
            }
            int *perm = NEW(int, c.num_slots);
            for (int i = 0; i < c.num_slots; i++) perm[i] = i;
            shuffle(perm, (int)c.num_slots);
            int64_t *slots = NEW(int64_t, rows);
            for (int t = 0; t < rows; t++) slots[t] = perm[t];   /* distinct, anywhere in the cache */
            tm_kv_cache kv[2];
            int st[2];
            for (int x = 0; x < 2; x++) {
                kv[x] = copy_cache(&c);
                const tm_write_kv_args a = {.kv = &kv[x], .k = k, .v = v, .src_stride = stride, .slots = slots,
                                            .rows = rows};
                st[x] = lib[x].write_kv(&a);
            }
            /* a copy or the same quantisation: equal bits, NaN payloads and scales and all */
            if (statuses("write_kv", name, st, 0)) {
                if (same_cache(&c, &kv[0], &kv[1])) verdict("write_kv", name, 0, 0);
                else fail("write_kv", name, "caches differ");
            }
            /* a slot outside the cache: -3, and nothing written (not even the rows before it) */
            snprintf(name, sizeof name, "%s rows%d slot outside the cache", fmt_names[fmt], rows);
            slots[rows - 1] = c.num_slots;
            for (int x = 0; x < 2; x++) {
                kv[x] = copy_cache(&c);
                const tm_write_kv_args a = {.kv = &kv[x], .k = k, .v = v, .src_stride = stride, .slots = slots,
                                            .rows = rows};
                st[x] = lib[x].write_kv(&a);
            }
            if (statuses("write_kv", name, st, -3)) {
                int same = 1;
                for (int x = 0; x < 2; x++) same &= same_cache(&c, &kv[x], &c.kv);
                if (same) verdict("write_kv", name, 0, 0);
                else fail("write_kv", name, "wrote into the cache");
            }
            release();
        }
}

/* ---- tm_paged_decode -------------------------------------------------------------------------------------- */

typedef struct {
    const char *name;
    int KV, G, D, bs, fmt, B;   /* fmt: the cache's TM_KV_* (0 float32, 1 bfloat16) */
    int lens[8];
    int window;       /* > 0: request b attends only its last `window` positions (starts > 0) */
    int shared_len;   /* cascade: every table starts with the same blocks, every start is 0 */
    int q_bf16;       /* q and out bfloat16 */
    int strided;      /* q rows (H + 2 KV) D apart: a view into fused qkv rows */
} decode_case;

static const decode_case decode_cases[] = {
    {"f32 d64 g1 bs16", 2, 1, 64, 16, 0, 3, {1, 17, 100}},
    {"f32 d24 g3 bs8 strided", 2, 3, 24, 8, 0, 5, {1, 9, 40, 77, 90}, .strided = 1},
    {"bf16 d80 g8 bs32", 1, 8, 80, 32, 1, 4, {3, 64, 65, 200}},
    {"f32 d128 g8 kv2", 2, 8, 128, 16, 0, 2, {64, 129}},
    {"bf16 d256 g3", 1, 3, 256, 16, 1, 3, {5, 33, 77}},
    {"f32 d64 g3 batch6", 2, 3, 64, 16, 0, 6, {12, 1, 70, 33, 128, 5}},
    {"bf16 d128 g1 kv4 batch8", 4, 1, 128, 16, 1, 8, {1, 2, 3, 15, 16, 17, 63, 200}, .strided = 1},
    {"f32 d64 g16", 1, 16, 64, 16, 0, 2, {40, 90}},
    {"f32 d40 g3 bs1", 1, 3, 40, 1, 0, 2, {3, 9}},
    {"bf16 d64 g3 bs64", 2, 3, 64, 64, 1, 3, {63, 64, 130}},
    {"window f32 d64 g3", 2, 3, 64, 16, 0, 4, {10, 40, 90, 33}, .window = 32},
    {"window bf16 d80 g8 bs8", 1, 8, 80, 8, 1, 5, {7, 8, 9, 100, 64}, .window = 20},
    {"window f32 d24 g1 batch6", 3, 1, 24, 16, 0, 6, {300, 17, 64, 65, 1, 120}, .window = 48},
    {"cascade f32 d64 g3", 2, 3, 64, 16, 0, 5, {65, 94, 164, 64, 71}, .shared_len = 64},
    /* shared_len capped at the shortest context, inside the last shared block (as the backend caps it) */
    {"cascade bf16 d128 g8 partial block", 1, 8, 128, 16, 1, 6, {72, 81, 100, 150, 96, 200}, .shared_len = 72},
    {"cascade f32 d24 g1 bs8", 4, 1, 24, 8, 0, 4, {70, 64, 99, 65}, .shared_len = 64, .strided = 1},
    {"cascade f32 d80 g16 batch2", 1, 16, 80, 32, 0, 2, {96, 97}, .shared_len = 96},
    /* longer than 1024 positions: split into parts merged after (flash-decoding) */
    {"long f32 d64 g1 batch1", 2, 1, 64, 16, 0, 1, {1500}},
    {"long bf16 d128 g3 batch2", 2, 3, 128, 32, 1, 2, {1100, 2100}},
    {"long f32 d80 g8 batch5", 1, 8, 80, 16, 0, 5, {1300, 20, 1025, 700, 1024}},
    {"long cascade f32 d64 g3", 1, 3, 64, 16, 0, 4, {1400, 1200, 1100, 1090}, .shared_len = 1088},
    {"long cascade bf16 d64 g3 three parts", 1, 3, 64, 16, 1, 4, {2300, 2250, 2210, 2400}, .shared_len = 2208},
    {"q bf16 f32 cache d64 g3", 2, 3, 64, 16, 0, 3, {5, 50, 120}, .q_bf16 = 1, .strided = 1},
    {"q bf16 bf16 cache d128 g8", 1, 8, 128, 16, 1, 2, {33, 1200}, .q_bf16 = 1},
    /* quantised caches: both variants read the same codes, so float32 tolerances */
    {"int8 d64 g3 batch6", 2, 3, 64, 16, TM_KV_INT8, 6, {12, 1, 70, 33, 128, 5}, .strided = 1},
    {"int8 d24 g16", 1, 16, 24, 16, TM_KV_INT8, 2, {40, 90}},
    {"int4 d64 g3", 2, 3, 64, 16, TM_KV_INT4, 3, {1, 17, 100}},
    {"int4 d128 g8 cascade", 1, 8, 128, 16, TM_KV_INT4, 6, {72, 81, 100, 150, 96, 200}, .shared_len = 72},
    {"fp8e4m3 d80 g8 window", 1, 8, 80, 8, TM_KV_FP8_E4M3, 5, {7, 8, 9, 100, 64}, .window = 20},
    {"fp8e4m3 long d64 g3", 2, 3, 64, 16, TM_KV_FP8_E4M3, 2, {1100, 2100}, .q_bf16 = 1},
    {"fp8e5m2 d128 g1 kv4", 4, 1, 128, 16, TM_KV_FP8_E5M2, 8, {1, 2, 3, 15, 16, 17, 63, 200}},
    {"int8 cascade d64 g3 bs8", 2, 3, 64, 8, TM_KV_INT8, 5, {65, 94, 164, 64, 71}, .shared_len = 64},
};

static void check_paged_decode(void) {
    for (size_t ci = 0; ci < sizeof decode_cases / sizeof *decode_cases; ci++) {
        const decode_case *dc = &decode_cases[ci];
        seed(800 + ci);
        const int B = dc->B, H = dc->KV * dc->G, D = dc->D;
        int starts[8] = {0};
        for (int b = 0; b < B; b++) starts[b] = dc->window && dc->lens[b] > dc->window ? dc->lens[b] - dc->window : 0;
        const context c = make_context(B, dc->lens, starts, dc->KV, D, dc->bs, dc->fmt,
                                       (dc->shared_len + dc->bs - 1) / dc->bs);
        const int q_stride = (dc->strided ? H + 2 * dc->KV : H) * D;
        const void *q = random_values((size_t)B * q_stride, dc->q_bf16, -4.f, 4.f);
        const tm_decode_step step = {.tables = c.tables, .max_blocks = c.max_blocks, .starts = c.starts,
                                     .lens = c.lens, .shared_len = dc->shared_len, .batch = B,
                                     .block_size = dc->bs, .num_threads = 2};
        void *out[2];
        int st[2];
        for (int v = 0; v < 2; v++) {
            out[v] = alloc((size_t)B * H * D * (dc->q_bf16 ? 2 : 4));
            const tm_paged_decode_args a = {.step = &step, .kv = &c.kv, .q = q, .q_stride = q_stride,
                                            .q_bf16 = dc->q_bf16, .out = out[v], .heads = H,
                                            .scale = 1.f / sqrtf((float)D)};
            st[v] = lib[v].paged_decode(&a);
        }
        if (statuses("paged_decode", dc->name, st, 0))
            verdict("paged_decode", dc->name, rel_err(out[0], out[1], dc->q_bf16, (size_t)B * H * D, NULL),
                    dc->q_bf16 ? TOL_BF16 : TOL);
        release();
    }

    /* outside the limits: head_dim not a multiple of 8, more than 16 query heads per kv head, a block size that
     * is not a power of two */
    seed(899);
    const int lens[1] = {20};
    context c = make_context(1, lens, NULL, 1, 24, 16, 0, 0);
    const float *q = random_values(17 * 24, 0, -1.f, 1.f);
    float *out = NEW(float, 17 * 24);
    const struct { const char *name; int D, H, bs; } bad[] = {
        {"limits d20", 20, 1, 16}, {"limits g17", 24, 17, 16}, {"limits bs12", 24, 1, 12},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        tm_kv_cache kv = c.kv;
        kv.head_dim = bad[i].D;
        const tm_decode_step step = {.tables = c.tables, .max_blocks = c.max_blocks, .starts = c.starts,
                                     .lens = c.lens, .batch = 1, .block_size = bad[i].bs,
                                     .num_threads = 1};
        const tm_paged_decode_args a = {.step = &step, .kv = &kv, .q = q, .q_stride = bad[i].H * bad[i].D,
                                        .out = out, .heads = bad[i].H, .scale = 0.2f};
        int st[2] = {lib[0].paged_decode(&a), lib[1].paged_decode(&a)};
        if (statuses("paged_decode", bad[i].name, st, -1)) verdict("paged_decode", bad[i].name, 0, 0);
    }
    release();
}

/* ---- tm_paged_prefill ------------------------------------------------------------------------------------- */

typedef struct {
    const char *name;
    int KV, G, D, bs, fmt, R;
    int count[4];      /* query tokens of each request */
    int computed[4];   /* positions already in the cache before them */
    int window;
    int q_bf16, strided;
} prefill_case;

static const prefill_case prefill_cases[] = {
    {"f32 d64 g3 bs16", 2, 3, 64, 16, 0, 2, {5, 20}, {0, 30}},
    /* g1: 48 tokens a tile, so 60 tokens take two */
    {"bf16 d80 g1 bs8", 2, 1, 80, 8, 1, 3, {1, 60, 7}, {100, 0, 12}},
    {"f32 d128 g8 window", 1, 8, 128, 16, 0, 2, {16, 40}, {50, 10}, .window = 24},
    {"window bf16 d64 g3 bs32", 2, 3, 64, 32, 1, 3, {9, 30, 2}, {70, 0, 200}, .window = 48, .strided = 1},
    {"f32 d24 g16", 1, 16, 24, 16, 0, 2, {7, 4}, {3, 60}},
    {"f32 d256 g1", 1, 1, 256, 16, 0, 2, {3, 17}, {20, 5}},
    {"long f32 d64 g3", 2, 3, 64, 16, 0, 2, {10, 3}, {1200, 1030}},
    {"long window f32 d64 g1", 1, 1, 64, 16, 0, 1, {50}, {1500}, .window = 100},
    /* past 1024 positions: parts merged after, a short causal last part */
    {"long int8 d64 g3 three parts", 2, 3, 64, 16, TM_KV_INT8, 2, {40, 17}, {2500, 2100}},
    {"long bf16 d128 g1 window across parts", 1, 1, 128, 16, 1, 1, {64}, {3000}, .window = 2000},
    {"q bf16 d64 g3", 2, 3, 64, 16, 0, 2, {6, 13}, {40, 0}, .q_bf16 = 1, .strided = 1},
    {"int8 d64 g3", 2, 3, 64, 16, TM_KV_INT8, 2, {5, 20}, {0, 30}},
    {"int4 d64 g1 bs8", 2, 1, 64, 8, TM_KV_INT4, 3, {1, 60, 7}, {100, 0, 12}},
    {"fp8e4m3 d128 g8 window", 1, 8, 128, 16, TM_KV_FP8_E4M3, 2, {16, 40}, {50, 10}, .window = 24},
    {"fp8e5m2 d24 g16", 1, 16, 24, 16, TM_KV_FP8_E5M2, 2, {7, 4}, {3, 60}},
};

static void check_paged_prefill(void) {
    for (size_t ci = 0; ci < sizeof prefill_cases / sizeof *prefill_cases; ci++) {
        const prefill_case *pc = &prefill_cases[ci];
        seed(900 + ci);
        const int R = pc->R, H = pc->KV * pc->G, D = pc->D;
        int lens[4], starts[4];
        int32_t *row0 = NEW(int32_t, R), *count = NEW(int32_t, R), *computed = NEW(int32_t, R);
        int tokens = 0;
        for (int i = 0; i < R; i++) {
            lens[i] = pc->computed[i] + pc->count[i];   /* the chunk's own K/V are in the cache already */
            starts[i] = pc->window && pc->computed[i] - pc->window + 1 > 0 ? pc->computed[i] - pc->window + 1 : 0;
            row0[i] = tokens;
            count[i] = pc->count[i];
            computed[i] = pc->computed[i];
            tokens += pc->count[i];
        }
        const context c = make_context(R, lens, starts, pc->KV, D, pc->bs, pc->fmt, 0);
        const int q_stride = (pc->strided ? H + 2 * pc->KV : H) * D;
        const void *q = random_values((size_t)tokens * q_stride, pc->q_bf16, -4.f, 4.f);
        void *out[2];
        int st[2];
        for (int v = 0; v < 2; v++) {
            out[v] = alloc((size_t)tokens * H * D * (pc->q_bf16 ? 2 : 4));
            const tm_paged_prefill_args a = {
                .kv = &c.kv, .q = q, .q_stride = q_stride, .q_bf16 = pc->q_bf16, .out = out[v],
                .tables = c.tables, .max_blocks = c.max_blocks, .row0 = row0, .count = count,
                .computed = computed, .reqs = R, .heads = H, .block_size = pc->bs, .window = pc->window,
                .scale = 1.f / sqrtf((float)D), .num_threads = 2};
            st[v] = lib[v].paged_prefill(&a);
        }
        if (statuses("paged_prefill", pc->name, st, 0))
            verdict("paged_prefill", pc->name, rel_err(out[0], out[1], pc->q_bf16, (size_t)tokens * H * D, NULL),
                    pc->q_bf16 ? TOL_BF16 : TOL);
        release();
    }
}

/* ---- tm_decode_attention ---------------------------------------------------------------------------------- */

static void check_decode_attention(void) {
    static const decode_case cases[] = {
        {"f32 d64 g3", 2, 3, 64, 16, 0, 3, {1, 20, 70}},
        {"bf16 d128 g8 batch5", 1, 8, 128, 16, 1, 5, {16, 17, 1, 200, 31}},
        {"f32 d24 g1 bs8 batch6", 3, 1, 24, 8, 0, 6, {2, 9, 64, 65, 33, 5}},
        {"window f32 d80 g1", 2, 1, 80, 16, 0, 3, {10, 50, 99}, .window = 32},
        {"window bf16 d64 g16 bs8", 1, 16, 64, 8, 1, 2, {30, 70}, .window = 24},
        /* the new tokens lie past the shared blocks: a shared block is full and nobody writes into it */
        {"cascade f32 d64 g3", 2, 3, 64, 16, 0, 5, {65, 94, 164, 70, 71}, .shared_len = 64},
        {"long f32 d64 g3", 1, 3, 64, 16, 0, 2, {1500, 40}},
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases + 1; ci++) {
        /* the last round: case 0 again with a slot outside the cache, which is refused (-3) */
        const int outside = ci == sizeof cases / sizeof *cases;
        const decode_case *dc = &cases[outside ? 0 : ci];
        char name[80];
        snprintf(name, sizeof name, "%s%s", dc->name, outside ? " slot outside the cache" : "");
        seed(1000 + ci);
        const int B = dc->B, H = dc->KV * dc->G, D = dc->D, width = (H + 2 * dc->KV) * D, stride = width + 8;
        int starts[8] = {0};
        for (int b = 0; b < B; b++) starts[b] = dc->window && dc->lens[b] > dc->window ? dc->lens[b] - dc->window : 0;
        const context c = make_context(B, dc->lens, starts, dc->KV, D, dc->bs, dc->fmt,
                                       (dc->shared_len + dc->bs - 1) / dc->bs);
        float *qkv0 = NEW(float, (size_t)B * stride), *cos_t = NEW(float, (size_t)B * D), *sin_t = NEW(float, (size_t)B * D);
        int64_t *slots = NEW(int64_t, B);
        fill(qkv0, (size_t)B * stride, -2.f, 2.f);
        rotary_tables(cos_t, sin_t, B, D);
        for (int b = 0; b < B; b++) slots[b] = slot_of(&c, b, dc->lens[b] - 1);   /* the new token: the last position */
        if (outside) slots[B - 1] = c.num_slots;
        const tm_decode_step step = {.tables = c.tables, .max_blocks = c.max_blocks, .starts = c.starts,
                                     .lens = c.lens, .shared_len = dc->shared_len, .batch = B,
                                     .block_size = dc->bs, .cos = cos_t, .sin = sin_t,
                                     .slots = slots, .num_threads = 2};
        float *qkv[2], *out[2];
        tm_kv_cache kv[2];
        int st[2];
        for (int v = 0; v < 2; v++) {
            qkv[v] = copy_of(qkv0, (size_t)B * stride * 4);
            out[v] = NEW(float, (size_t)B * H * D);
            kv[v] = copy_cache(&c);
            const tm_decode_attention_args a = {.step = &step, .kv = &kv[v], .qkv = qkv[v], .qkv_stride = stride,
                                                .out = out[v], .heads = H, .scale = 1.f / sqrtf((float)D)};
            st[v] = lib[v].decode_attention(&a);
        }
        if (!statuses("decode_attention", name, st, outside ? -3 : 0)) {
            release();
            continue;
        }
        /* q and k rotated in place, k and v written into the cache, the output. Into a bfloat16 cache the new
         * values may round one step apart, and the output moves with them. */
        const double tol = dc->fmt == TM_KV_BF16 ? TOL_BF16 : TOL;
        margin m = {0, 1};
        within(&m, rel_err(qkv[0], qkv[1], 0, (size_t)B * stride, NULL), TOL);
        within(&m, cache_err(&c, kv), tol);
        if (!outside) within(&m, rel_err(out[0], out[1], 0, (size_t)B * H * D, NULL), tol);
        verdict("decode_attention", name, m.err, m.tol);
        release();
    }
}

/* ---- tm_decode_layer -------------------------------------------------------------------------------------- */

static void check_decode_layer(void) {
    static const struct { const char *name; int B, add, bf16; int lens[24]; } cases[] = {
        {"q4 batch1 add0", 1, 0, 0, {37}},
        {"q4 batch3 add1", 3, 1, 0, {1, 16, 90}},
        {"q4 batch3 add1 bf16 cache", 3, 1, 1, {5, 17, 60}},
        /* more than 20 rows: the matmuls take the GEMM path */
        {"q4 batch24 add1", 24, 1, 0, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 30, 40, 50, 60}},
    };
    const int hidden = 64, heads = 4, kv_heads = 2, head_dim = 16, inter = 96, bs = 16;
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
        const int B = cases[ci].B, add = cases[ci].add, bf16 = cases[ci].bf16;
        seed(1100 + ci);
        const qmat qkv = random_qweight(4, (heads + 2 * kv_heads) * head_dim, hidden, 0.04f);
        const qmat o = random_qweight(4, hidden, heads * head_dim, 0.04f);
        const qmat gate_up = random_qweight(4, 2 * inter, hidden, 0.04f);
        const qmat down = random_qweight(4, hidden, inter, 0.04f);
        float *input_norm = NEW(float, hidden), *post_norm = NEW(float, hidden);
        fill(input_norm, hidden, 0.5f, 1.5f);
        fill(post_norm, hidden, 0.5f, 1.5f);
        const tm_matrix m_qkv = {.q = &qkv.w}, m_o = {.q = &o.w}, m_gate_up = {.q = &gate_up.w}, m_down = {.q = &down.w};
        const tm_layer layer = {.input_norm = input_norm, .post_norm = post_norm, .eps = 1e-5f, .hidden = hidden,
                                .heads = heads, .kv_heads = kv_heads, .head_dim = head_dim, .inter = inter,
                                .scale = 1.f / sqrtf((float)head_dim), .qkv = &m_qkv, .o = &m_o,
                                .gate_up = &m_gate_up, .down = &m_down};
        const context c = make_context(B, cases[ci].lens, NULL, kv_heads, head_dim, bs, bf16, 0);
        float *x0 = NEW(float, (size_t)B * hidden), *res0 = NEW(float, (size_t)B * hidden);
        float *cos_t = NEW(float, (size_t)B * head_dim), *sin_t = NEW(float, (size_t)B * head_dim);
        int64_t *slots = NEW(int64_t, B);
        fill(x0, (size_t)B * hidden, -2.f, 2.f);
        fill(res0, (size_t)B * hidden, -2.f, 2.f);
        rotary_tables(cos_t, sin_t, B, head_dim);
        for (int b = 0; b < B; b++) slots[b] = slot_of(&c, b, c.lens[b] - 1);
        const tm_decode_step step = {.tables = c.tables, .max_blocks = c.max_blocks, .starts = c.starts,
                                     .lens = c.lens, .batch = B, .block_size = bs,
                                     .cos = cos_t, .sin = sin_t, .slots = slots, .num_threads = 2};
        float *x[2], *res[2], *out[2];
        tm_kv_cache kv[2];
        int st[2];
        for (int v = 0; v < 2; v++) {
            x[v] = copy_of(x0, (size_t)B * hidden * 4);
            res[v] = add ? copy_of(res0, (size_t)B * hidden * 4) : x[v];   /* add 0: the residual is x itself */
            out[v] = NEW(float, (size_t)B * hidden);
            kv[v] = copy_cache(&c);
            const tm_decode_layer_args a = {.layer = &layer, .step = &step, .kv = &kv[v], .x = x[v],
                                            .residual = res[v], .add = add, .out = out[v]};
            st[v] = lib[v].decode_layer(&a);
        }
        const char *name = cases[ci].name;
        if (statuses("decode_layer", name, st, 0)) {
            /* the output, the residual, the new K/V in the cache (into bfloat16: maybe one rounding step apart,
             * carried on through attention and the MLP) */
            const size_t n = (size_t)B * hidden;
            const double tol = bf16 ? TOL_BF16 : TOL_LAYER;
            margin m = {0, 1};
            within(&m, rel_err(out[0], out[1], 0, n, NULL), tol);
            within(&m, rel_err(res[0], res[1], 0, n, NULL), tol);
            within(&m, cache_err(&c, kv), tol);
            verdict("decode_layer", name, m.err, m.tol);
        }
        release();
    }
}

/* ---- main ------------------------------------------------------------------------------------------------- */

/* "tokenmill-neon.so" -> "neon"; NULL for a name of another form */
static const char *isa_from_name(const char *path, char *buf, size_t size) {
    const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    const size_t len = strlen(base);
    if (strncmp(base, "tokenmill-", 10) || len < 14 || strcmp(base + len - 3, ".so")) return NULL;
    snprintf(buf, size, "%.*s", (int)(len - 13), base + 10);
    return buf;
}

/* ---- tm_gmatmul, tm_gdequant (a GGUF matrix in its own blocks), tm_qdequant ---------------------------------- */

/* ggml type id, weights and bytes per block, and where its fp16 scales sit in a block (-1: none further) */
static const struct { int id, block, bytes, scales[2]; const char *name; } GTYPES[] = {
    {2, 32, 18, {0, -1}, "Q4_0"}, {3, 32, 20, {0, 2}, "Q4_1"},   {6, 32, 22, {0, -1}, "Q5_0"},
    {7, 32, 24, {0, 2}, "Q5_1"},  {8, 32, 34, {0, -1}, "Q8_0"},  {10, 256, 84, {80, 82}, "Q2_K"},
    {11, 256, 110, {108, -1}, "Q3_K"}, {12, 256, 144, {0, 2}, "Q4_K"}, {13, 256, 176, {0, 2}, "Q5_K"},
    {14, 256, 210, {208, -1}, "Q6_K"}, {1, 32, 64, {-1, -1}, "F16"}, {30, 32, 64, {-1, -1}, "BF16"},
};

static uint16_t to_fp16(float f) {   /* a normal, positive value: enough for scales */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((((u >> 23) & 0xff) - 112) << 10 | ((u >> 13) & 0x3ff));
}

static void check_gmatmul(void) {
    static const int row_counts[] = {1, 2, 3, 5, 8, 16};
    int case_no = 0;
    for (size_t t = 0; t < sizeof GTYPES / sizeof *GTYPES; t++) {
        const int n = 37, k = 2 * GTYPES[t].block * (GTYPES[t].block == 32 ? 4 : 1);
        const int64_t row_bytes = (int64_t)(k / GTYPES[t].block) * GTYPES[t].bytes;
        seed(700 + case_no++);
        uint8_t *data = NEW(uint8_t, (size_t)n * row_bytes);
        for (size_t i = 0; i < (size_t)n * row_bytes; i++) data[i] = (uint8_t)below(256);
        for (int64_t b = 0; b < (int64_t)n * row_bytes / GTYPES[t].bytes; b++)
            for (int s = 0; s < 2 && GTYPES[t].scales[s] >= 0; s++) {
                const uint16_t h = to_fp16(uni(0.002f, 0.01f));
                memcpy(data + b * GTYPES[t].bytes + GTYPES[t].scales[s], &h, 2);
            }
        if (GTYPES[t].id == 1 || GTYPES[t].id == 30)
            for (size_t i = 0; i < (size_t)n * k; i++) {
                const float v = uni(-1.f, 1.f);
                const uint16_t h = GTYPES[t].id == 1 ? (uint16_t)(to_fp16(fabsf(v) + 0.001f) | (v < 0 ? 0x8000 : 0))
                                                     : to_bf16(v);
                memcpy(data + 2 * i, &h, 2);
            }
        const tm_gweight w = {.type = GTYPES[t].id, .data = data, .row_bytes = row_bytes, .n = n, .k = k};
        float *dense[2];
        int st[2];
        char name[64];
        for (int v = 0; v < 2; v++) {
            dense[v] = NEW(float, (size_t)n * k);
            const tm_gdequant_args a = {.w = &w, .ids = NULL, .row0 = 0, .rows = n, .out = dense[v], .num_threads = 2};
            st[v] = lib[v].gdequant(&a);
        }
        snprintf(name, sizeof name, "%s n%d k%d", GTYPES[t].name, n, k);
        if (statuses("gdequant", name, st, 0))   /* the same arithmetic in every variant: bit for bit */
            verdict("gdequant", name, memcmp(dense[0], dense[1], sizeof(float) * n * k) ? 1.0 : 0.0, 0.0);
        const qmat q = {.w = {.n = n, .k = k}, .dense = dense[0]};
        for (size_t r = 0; r < sizeof row_counts / sizeof *row_counts; r++) {
            const int rows = row_counts[r];
            float *x = NEW(float, (size_t)rows * k), *y[2];
            fill(x, (size_t)rows * k, -1.f, 1.f);
            for (int v = 0; v < 2; v++) {
                y[v] = NEW(float, (size_t)rows * n);
                const tm_gmatmul_args a = {.w = &w, .x = x, .y = y[v], .rows = rows, .num_threads = 1 + rows % 2};
                st[v] = lib[v].gmatmul(&a);
            }
            snprintf(name, sizeof name, "%s n%d k%d rows%d", GTYPES[t].name, n, k, rows);
            if (statuses("gmatmul", name, st, 0)) verdict("gmatmul", name, qmatmul_err(&q, x, rows, y), TOL_QMATMUL);
        }
        release();
    }
    /* tm_qdequant: the repacked blocks, bit for bit across variants */
    for (int bits = 4; bits <= 8; bits += 4) {
        seed(800 + bits);
        const qmat q = random_qweight(bits, 21, 96, 0.1f);
        float *out[2];
        int st[2];
        for (int v = 0; v < 2; v++) {
            out[v] = NEW(float, 21 * 96);
            const tm_qdequant_args a = {.w = &q.w, .row0 = 0, .rows = 21, .out = out[v], .num_threads = 2};
            st[v] = lib[v].qdequant(&a);
        }
        char name[32];
        snprintf(name, sizeof name, "q%d n21 k96", bits);
        double err = 0, top = 1e-30;   /* d * c + m: one fused operation in some variants, two in others */
        for (int i = 0; i < 21 * 96; i++) {
            err = max2(err, fabs((double)out[0][i] - out[1][i]));
            top = max2(top, fabs((double)out[0][i]));
        }
        if (statuses("qdequant", name, st, 0)) verdict("qdequant", name, err / top, 1e-6);
        release();
    }
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s LIB_A LIB_B   (two variants of the kernel library, e.g. tokenmill-neon.so "
                        "tokenmill-generic.so)\n", argv[0]);
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);   /* every line out before a crash, if one comes */
    for (int v = 0; v < 2; v++) open_library(&lib[v], argv[1 + v]);

    /* each library is the variant its file name says, and both were built from the same sources */
    for (int v = 0; v < 2; v++) {
        char buf[64], name[96];
        const char *want = isa_from_name(lib[v].path, buf, sizeof buf);
        printf("library %s: %s isa=%s build_hash=%s\n", side[v], lib[v].path, lib[v].isa(), lib[v].build_hash());
        snprintf(name, sizeof name, "%s isa %s", side[v], lib[v].isa());
        if (!want || !strcmp(want, lib[v].isa())) verdict("library", name, 0, 0);
        else {
            char why[96];
            snprintf(why, sizeof why, "(the file name says %s)", want);
            fail("library", name, why);
        }
    }
    if (!strcmp(lib[0].build_hash(), lib[1].build_hash())) verdict("library", "same build_hash", 0, 0);
    else fail("library", "same build_hash", "(built from different sources: rebuild both)");

    check_qmatmul();
    check_pack_lanes();
    check_gmatmul();
    check_rms_norm();
    check_rotary();
    check_silu_mul();
    check_argmax();
    check_touch_pages();
    check_write_kv();
    check_paged_decode();
    check_paged_prefill();
    check_decode_attention();
    check_decode_layer();

    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
