/* One decoder layer of a pure decode step in a single call, for a GGUF model whose four matrices are all in
 * quantised blocks (float32 on CPU): the same kernels the Python layer calls one by one (norm, qmatmul,
 * decode attention, SiLU), sequenced here so a step pays one ctypes call a layer instead of about ten, plus
 * their tensor allocations (~3 ms of a 14 ms single-stream step on the dev machine). No new arithmetic. */
#include <stdint.h>
#include <stdlib.h>

/* the layer's weights; Python fills one per layer at load time (models/fused_decode.py) */
typedef struct {
    int bits;                 /* 4 or 8 (qmatmul.c) */
    const void *codes;
    const float *scale, *offset;
    const void *lanes_codes;  /* the lanes layout (qmatmul.c's pack_lanes), or NULL */
    const float *lanes_scale, *lanes_offset;
} packed_t;

typedef struct {
    const float *input_norm, *post_norm;
    float eps;
    int hidden, heads, kv_heads, head_dim, inter;
    packed_t qkv, o, gate_up, down;
} layer_t;

int qmatmul(int q4, const float *x, int B, int K, int N, const uint8_t *codes, const float *d, const float *m,
            const uint8_t *lcodes, const float *ld, const float *lm, float *y, int num_threads);
void add_rms_norm(float *x, float *residual, const float *weight, float *out, int rows, int dim, float eps, int add,
                  int num_threads);
void silu_mul(const float *gate_up, float *out, int rows, int inter, int num_threads);
int decode_attention(float *qkv, int qkv_stride, float *out, const float *cos, const float *sin,
                     const int64_t *slots, int64_t num_slots, void *k_cache, void *v_cache, int kv_bf16,
                     const int32_t *tables, int max_blocks, const int32_t *starts, const int32_t *lens, int shared_len,
                     int B, int H, int KV, int D, int block_size, float scale, int max_len, int num_threads);

static int mm(const packed_t *w, const float *x, int B, int K, int N, float *y, int threads) {
    return qmatmul(w->bits == 4, x, B, K, N, (const uint8_t *)w->codes, w->scale, w->offset,
                   (const uint8_t *)w->lanes_codes, w->lanes_scale, w->lanes_offset, y, threads);
}

/* x: the previous layer's MLP output [B, hidden] (with add = 0 on the first layer: the embeddings, and then
 * residual must be x itself); residual [B, hidden] is updated in place; out [B, hidden] gets this layer's MLP
 * output. The rest is decode_attention's. Returns 0, or the first failing kernel's status. */
int decode_layer(const layer_t *L, float *x, float *residual, int add, float *out, const float *cos,
                 const float *sin, const int64_t *slots, int64_t num_slots, void *k_cache, void *v_cache, int kv_bf16,
                 const int32_t *tables, int max_blocks, const int32_t *starts, const int32_t *lens, int shared_len,
                 int B, int block_size, float scale, int max_len, int num_threads) {
    const int hid = L->hidden, q = L->heads * L->head_dim, kv = L->kv_heads * L->head_dim;
    const int width = q + 2 * kv;
    float *h = malloc(sizeof(float) * (size_t)B * hid), *qkv = malloc(sizeof(float) * (size_t)B * width);
    float *att = malloc(sizeof(float) * (size_t)B * q), *o = malloc(sizeof(float) * (size_t)B * hid);
    float *gu = malloc(sizeof(float) * (size_t)B * 2 * L->inter), *act = malloc(sizeof(float) * (size_t)B * L->inter);
    int rc = (h && qkv && att && o && gu && act) ? 0 : -2;
    if (rc == 0) {
        add_rms_norm(x, residual, L->input_norm, h, B, hid, L->eps, add, num_threads);
        rc = mm(&L->qkv, h, B, hid, width, qkv, num_threads);
    }
    if (rc == 0)
        rc = decode_attention(qkv, width, att, cos, sin, slots, num_slots, k_cache, v_cache, kv_bf16, tables,
                              max_blocks, starts, lens, shared_len, B, L->heads, L->kv_heads, L->head_dim, block_size,
                              scale, max_len, num_threads);
    if (rc == 0) rc = mm(&L->o, att, B, q, hid, o, num_threads);
    if (rc == 0) {
        add_rms_norm(o, residual, L->post_norm, h, B, hid, L->eps, 1, num_threads);
        rc = mm(&L->gate_up, h, B, hid, 2 * L->inter, gu, num_threads);
    }
    if (rc == 0) {
        silu_mul(gu, act, B, L->inter, num_threads);
        rc = mm(&L->down, act, B, L->inter, hid, out, num_threads);
    }
    free(h);
    free(qkv);
    free(att);
    free(o);
    free(gu);
    free(act);
    return rc;
}
