/* One decoder layer of a pure decode step in a single call, for a GGUF model whose four matrices are all in
 * quantised blocks (float32 on CPU): the same kernels the Python layer calls one by one (norm, qmatmul or
 * gmatmul, decode attention, SiLU or GELU), sequenced here so a step pays one call a layer instead of about ten
 * (Gemma's sandwich about twenty), plus their tensor allocations, LoRA's per-row products after each matrix where
 * the step has adapters. No new arithmetic. Gemma's layer adds q/k norms before rotary, a soft cap on the scores,
 * a norm of the attention's output before the residual add and one of the MLP's output. */
#include <stdlib.h>

#include "tokenmill.h"

/* y = x W^T, plus each row's LoRA adapter's product where the step has adapters (slots) and W takes them */
static int mm(const tm_matrix *m, const float *x, int rows, float *y, int num_threads, const int32_t *slots) {
    int rc;
    if (m->q) {
        const tm_qmatmul_args a = {m->q, x, y, rows, m->int8_x, num_threads};
        rc = tm_qmatmul(&a);
    } else {
        const tm_gmatmul_args a = {m->g, x, y, rows, m->int8_x, num_threads};
        rc = tm_gmatmul(&a);
    }
    if (rc == 0 && slots && m->lora_a) {
        const tm_lora_args l = {x, y, m->lora_a, m->lora_b, slots, rows, m->n_in, m->lora_r, m->n_out, m->n_in,
                                m->n_out, 0, num_threads};
        rc = tm_lora(&l);
    }
    return rc;
}

static void norm(const float *x, float *residual, const float *weight, float *out, int rows, int dim, float eps,
                 int add, int num_threads) {
    const tm_rms_norm_args a = {x, residual, weight, out, rows, dim, eps, add, num_threads};
    tm_rms_norm(&a);
}

/* Each of the B rows' q heads and k heads (in the fused qkv rows) normalised in place */
static void qk_norms(const tm_layer *L, float *qkv, int B, int width) {
    const int D = L->head_dim;
    for (int b = 0; b < B; b++) {
        float *q = qkv + (size_t)b * width, *k = q + (size_t)L->heads * D;
        norm(q, q, L->q_norm, q, L->heads, D, L->eps, 0, 1);
        norm(k, k, L->k_norm, k, L->kv_heads, D, L->eps, 0, 1);
    }
}

/* Returns 0, or the first failing kernel's status. */
TM_API int tm_decode_layer(const tm_decode_layer_args *a) {
    const tm_layer *L = a->layer;
    const int B = a->step->batch, threads = a->step->num_threads;
    const int hid = L->hidden, q = L->heads * L->head_dim, kv = L->kv_heads * L->head_dim;
    const int width = q + 2 * kv;
    if (L->kv_heads != a->kv->kv_heads || L->head_dim != a->kv->head_dim) return -1;
    float *h = malloc(sizeof(float) * (size_t)B * hid), *qkv = malloc(sizeof(float) * (size_t)B * width);
    float *att = malloc(sizeof(float) * (size_t)B * q), *o = malloc(sizeof(float) * (size_t)B * hid);
    float *gu = malloc(sizeof(float) * (size_t)B * 2 * L->inter), *act = malloc(sizeof(float) * (size_t)B * L->inter);
    int rc = (h && qkv && att && o && gu && act) ? 0 : -2;
    if (rc == 0) {
        norm(a->x, a->residual, L->input_norm, h, B, hid, L->eps, a->add, threads);
        rc = mm(L->qkv, h, B, qkv, threads, a->lora_slots);
    }
    if (rc == 0 && L->q_norm) qk_norms(L, qkv, B, width);
    if (rc == 0) {
        const tm_decode_attention_args at = {a->step, a->kv, qkv, width, att, L->heads, L->scale, L->softcap, NULL};
        rc = tm_decode_attention(&at);
    }
    if (rc == 0) rc = mm(L->o, att, B, o, threads, a->lora_slots);
    if (rc == 0) {
        if (L->attn_out_norm) norm(o, o, L->attn_out_norm, o, B, hid, L->eps, 0, threads);
        norm(o, a->residual, L->post_norm, h, B, hid, L->eps, 1, threads);
        rc = mm(L->gate_up, h, B, gu, threads, a->lora_slots);
    }
    if (rc == 0) {
        const tm_silu_mul_args sm = {gu, act, B, L->inter, threads};
        if (L->gelu) tm_gelu_tanh_mul(&sm);
        else tm_silu_mul(&sm);
        rc = mm(L->down, act, B, a->out, threads, a->lora_slots);
    }
    if (rc == 0 && L->mlp_out_norm) norm(a->out, a->out, L->mlp_out_norm, a->out, B, hid, L->eps, 0, threads);
    free(h);
    free(qkv);
    free(att);
    free(o);
    free(gu);
    free(act);
    return rc;
}
