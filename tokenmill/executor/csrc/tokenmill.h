/* tokenmill's CPU kernel library: the one interface between the kernels and Python.
 *
 * executor/kernels/abi.py reads this file to build its ctypes structs, so the layout is written once, here.
 * Its rules: one field per line; pointers to float, int32_t, int64_t, uint8_t, int8_t, void or a tm_ struct;
 * each kernel takes one struct and returns a status: 0, -1 for arguments outside its limits, -2 when memory ran
 * out, -3 for a KV slot outside the cache. A kernel's limits are the TM_ defines beside it.
 */
#ifndef TOKENMILL_H
#define TOKENMILL_H
#include <stdint.h>

#define TM_API __attribute__((visibility("default")))

/* ---- the library ------------------------------------------------------------------------------------------ */
TM_API const char *tm_isa(void);          /* the variant this build is: avx512, avx2, neon or generic */
TM_API const char *tm_build_hash(void);   /* hash of the sources it was built from (build.py) */

/* ---- matmul over llama.cpp's 32-wide quantised blocks (qmatmul.c; lanes layout: arch/avx512/) -------------- */
#define TM_QMATMUL_BLOCK 32       /* weights per block along k */
#define TM_QMATMUL_MAX_ROWS 64    /* rows of x per call */
#define TM_QMATMUL_INT8_MAX_ROWS 16   /* rows of x the int8 route takes (int8_x); more run in float */

/* W [n, k]: W[r][32i + j] = scale[r][i] * code + offset[r][i] */
typedef struct {
    int bits;                     /* 4: codes uint8 [n, k/2], two per byte; 8: codes int8 [n, k] */
    const void *codes;
    const float *scale;           /* [n, k/32] */
    const float *offset;          /* [n, k/32], or NULL for zero (Q8_0) */
    void *lanes_codes;            /* the same blocks 16 rows interleaved (tm_pack_lanes), or NULL */
    float *lanes_scale;
    float *lanes_offset;
    int n;
    int k;
} tm_qweight;

typedef struct {
    const tm_qweight *w;
    const float *x;               /* [rows, k] */
    float *y;                     /* [rows, n] */
    int rows;
    int int8_x;                   /* 1: on x86 (AVX2 and up), x rounded to int8 per 32 (llama.cpp's Q8_0/Q8_1) */
    int num_threads;
} tm_qmatmul_args;
TM_API int tm_qmatmul(const tm_qmatmul_args *a);

/* Fills w's lanes arrays (the caller's, sized as codes, scale and offset) from its rows; -1 where this variant
 * has no lanes kernel or n is not a multiple of 16. */
TM_API int tm_pack_lanes(const tm_qweight *w);

/* Dequantises w's rows row0 .. row0+rows-1 into out [rows, k] (a prefill tile for a float GEMM). */
typedef struct {
    const tm_qweight *w;
    int row0;
    int rows;
    float *out;
    int num_threads;
} tm_qdequant_args;
TM_API int tm_qdequant(const tm_qdequant_args *a);

/* ---- a GGUF matrix in its file's own blocks (gblocks.c) --------------------------------------------------- */
#define TM_GMATMUL_MAX_ROWS 16    /* rows of x per tm_gmatmul call; more dequantise tiles for a float GEMM */

/* W [n, k] as the file stores it: each row row_bytes bytes of blocks of ggml type `type` (1 F16, 30 BF16,
 * 2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0, 10 Q2_K, 11 Q3_K, 12 Q4_K, 13 Q5_K, 14 Q6_K); k a multiple of the
 * type's block (32; 256 for the K-quants). A matrix stored in row parts (q, k and v; gate and up), each in its
 * own type, is a chain: `next` is the part whose rows follow, NULL at the last; tm_gmatmul multiplies the whole
 * chain in one call, as one [sum of n, k] matrix. */
#define TM_GWEIGHT_MAX_PARTS 8
typedef struct tm_gweight {
    int type;
    const uint8_t *data;
    int64_t row_bytes;
    int n;
    int k;
    const struct tm_gweight *next;
} tm_gweight;

typedef struct {
    const tm_gweight *w;          /* a chain of row parts with one k; y's row is the chain's rows, in order */
    const float *x;               /* [rows, k] */
    float *y;                     /* [rows, sum of the parts' n] */
    int rows;
    int int8_x;                   /* 1: Q4_K/Q6_K on x86 multiply x rounded to int8 per 256 (llama.cpp's way) */
    int num_threads;
} tm_gmatmul_args;
TM_API int tm_gmatmul(const tm_gmatmul_args *a);

/* Dequantises rows ids[0 .. rows-1] (an embedding lookup), or row0 .. row0+rows-1 when ids is NULL, into
 * out [rows, k]; -3 for an id outside w. */
typedef struct {
    const tm_gweight *w;
    const int64_t *ids;
    int row0;
    int rows;
    float *out;
    int num_threads;
} tm_gdequant_args;
TM_API int tm_gdequant(const tm_gdequant_args *a);

/* ---- small per-layer ops, float32 (ops.c) ----------------------------------------------------------------- */
typedef struct {
    const float *x;               /* [rows, dim] */
    float *residual;              /* [rows, dim]: residual += x when add; x itself when not */
    const float *weight;          /* [dim] */
    float *out;                   /* [rows, dim] = weight * residual / rms(residual) */
    int rows;
    int dim;
    float eps;
    int add;
    int num_threads;
} tm_rms_norm_args;
TM_API int tm_rms_norm(const tm_rms_norm_args *a);

/* the first `heads` vectors of each row rotated in place, "rotate half" form */
typedef struct {
    float *x;                     /* [rows, >= heads * dim], rows row_stride floats apart */
    const float *cos;             /* [rows, dim] */
    const float *sin;
    int rows;
    int heads;
    int dim;
    int row_stride;
    int num_threads;
} tm_rotary_args;
TM_API int tm_rotary(const tm_rotary_args *a);

typedef struct {
    const float *gate_up;         /* [rows, 2 * inter], gate first */
    float *out;                   /* [rows, inter] = silu(gate) * up */
    int rows;
    int inter;
    int num_threads;
} tm_silu_mul_args;
TM_API int tm_silu_mul(const tm_silu_mul_args *a);
/* the same with gelu(gate, tanh approximation) * up (Gemma's GeGLU), torch's formula */
TM_API int tm_gelu_tanh_mul(const tm_silu_mul_args *a);

/* One token of the gated delta rule (Qwen3.5's linear attention) for each row, its state read and written in place
 * at the row's slot: S = exp(g) S; S += k (beta (v - S^T k))^T; out = S^T q. float32 throughout. */
#define TM_DELTA_RULE_MAX_DV 512      /* a value head's width */
typedef struct {
    const float *q;               /* [rows, heads, dk], normalised and scaled */
    const float *k;               /* [rows, heads, dk], normalised */
    const float *v;               /* [rows, heads, dv] */
    const float *g;               /* [rows, heads]: the log decay */
    const float *beta;            /* [rows, heads] */
    float *state;                 /* [slots, heads, dk, dv] */
    const int64_t *slot;          /* [rows], each row's own */
    float *out;                   /* [rows, heads, dv] */
    int rows;
    int heads;
    int dk;
    int dv;
    int num_threads;
} tm_delta_rule_step_args;
TM_API int tm_delta_rule_step(const tm_delta_rule_step_args *a);

/* torch.argmax's rules: the first index on ties, a NaN the largest */
typedef struct {
    const float *x;               /* [rows, n] */
    int64_t *out;                 /* [rows] */
    int rows;
    int n;
    int num_threads;
} tm_argmax_args;
TM_API int tm_argmax(const tm_argmax_args *a);

/* LoRA's shrink-expand, each row with its own adapter's slot (the Punica BGMV shape): y[t] += (x[t] a[s]) b[s] for
 * s = row_slot[t] >= 0; rows with -1 are untouched. x, y float32 or bfloat16 (bf16), in float32 math, y rounded
 * once. */
#define TM_LORA_MAX_RANK_COLS 1536    /* r: a fused projection's shards' ranks side by side (3 x 512) */
typedef struct {
    const void *x;                /* [rows, x_stride] (the first n_in columns) */
    void *y;                      /* [rows, y_stride] (the first n_out columns) */
    const float *a;               /* [slots, n_in, r] */
    const float *b;               /* [slots, r, n_out] */
    const int32_t *row_slot;      /* [rows] */
    int rows;
    int n_in;
    int r;
    int n_out;
    int x_stride;
    int y_stride;
    int bf16;
    int num_threads;
} tm_lora_args;
TM_API int tm_lora(const tm_lora_args *a);

/* ---- paged attention (attention.c; the AVX-512 decode path: arch/avx512/) --------------------------------- */
#define TM_ATTN_MAX_GROUP 16          /* query heads per kv head */
#define TM_ATTN_MAX_HEADS 1024
#define TM_ATTN_MAX_HEAD_DIM 256
#define TM_ATTN_HEAD_DIM_MULTIPLE 8
/* block_size must be a power of two */

/* how a paged cache stores K and V (kv_cache_dtype) */
#define TM_KV_F32 0
#define TM_KV_BF16 1
#define TM_KV_INT8 2              /* int8 codes, symmetric, a float32 scale per group of a (slot, kv head) */
#define TM_KV_INT8_GROUP 32       /* values an int8 scale covers; the whole head where head_dim is not a multiple */
#define TM_KV_INT4 3              /* 4-bit codes per group of 32 with a half scale d and min m: code * d + m */
#define TM_KV_INT4_GROUP 32       /* head_dim a multiple of this for an int4 cache */
#define TM_KV_FP8_E4M3 4          /* 8-bit floats (OCP E4M3FN) times a float32 scale per kv head: code * scale */
#define TM_KV_FP8_E5M2 5          /* the same with E5M2 codes */

/* one layer's paged cache: slot = block * block_size + offset */
typedef struct {
    void *k;                      /* [num_slots, kv_heads, head_dim] in `format`; int4: [.., head_dim / 2] bytes,
                                   * a group's byte j holding code j (low nibble) and code j + 16 (high) */
    void *v;
    const void *k_scale;          /* TM_KV_INT8: float32 [num_slots, kv_heads, head_dim / its group];
                                   * TM_KV_INT4: half (d, m) pairs
                                   * [num_slots, kv_heads, head_dim / 32]; TM_KV_FP8_*: float32 [kv_heads], the
                                   * same for every slot; else NULL */
    const void *v_scale;
    int64_t num_slots;
    int kv_heads;
    int head_dim;
    int format;                   /* TM_KV_* */
} tm_kv_cache;

/* a decode step's requests, the same for every layer (built once a step) */
typedef struct {
    const int32_t *tables;        /* [batch, max_blocks] block tables */
    int max_blocks;
    const int32_t *starts;        /* [batch] first attended position (> 0 under a sliding window) */
    const int32_t *lens;          /* [batch] context length */
    int shared_len;               /* positions every request reads from the same blocks (cascade), or 0 */
    int batch;
    int block_size;
    const float *cos;             /* [batch, head_dim] rotary tables, for tm_decode_attention */
    const float *sin;
    const int64_t *slots;         /* [batch] where the new K/V go, for tm_decode_attention */
    int num_threads;
} tm_decode_step;

/* one query token per request */
typedef struct {
    const tm_decode_step *step;
    const tm_kv_cache *kv;
    const void *q;                /* [batch, heads, head_dim], rows q_stride elements apart */
    int q_stride;
    int q_bf16;
    void *out;                    /* [batch, heads, head_dim], q's dtype */
    int heads;
    float scale;
    float softcap;                /* > 0: each score s becomes softcap * tanh(s / softcap) (Gemma 2); 0: none */
    const float *sinks;           /* [heads]: each head's sink logit, one more score in its softmax with no value
                                   * (gpt-oss); NULL: none */
} tm_paged_decode_args;
TM_API int tm_paged_decode(const tm_paged_decode_args *a);

/* several query tokens per request over a context already in the cache, causal */
typedef struct {
    const tm_kv_cache *kv;
    const void *q;                /* [tokens, heads, head_dim], rows q_stride elements apart */
    int q_stride;
    int q_bf16;
    void *out;                    /* [tokens, heads, head_dim] contiguous, q's dtype */
    const int32_t *tables;        /* [reqs, max_blocks] */
    int max_blocks;
    const int32_t *row0;          /* [reqs] request i's rows: row0[i] .. row0[i] + count[i] - 1 */
    const int32_t *count;
    const int32_t *computed;      /* [reqs] position of its first row */
    int reqs;
    int heads;
    int block_size;
    int window;                   /* sliding window, 0 for none */
    float scale;
    float softcap;                /* as tm_paged_decode_args.softcap */
    const float *sinks;           /* as tm_paged_decode_args.sinks */
    int num_threads;
} tm_paged_prefill_args;
TM_API int tm_paged_prefill(const tm_paged_prefill_args *a);

/* k_cache[slots[t]] = k[t], v_cache[slots[t]] = v[t]; nothing written when a slot is outside the cache */
typedef struct {
    const tm_kv_cache *kv;
    const float *k;               /* [rows, kv_heads * head_dim], rows src_stride floats apart */
    const float *v;
    int src_stride;
    const int64_t *slots;         /* [rows] */
    int rows;
} tm_write_kv_args;
TM_API int tm_write_kv(const tm_write_kv_args *a);

/* rotary + KV write + paged decode of a decode step's fused qkv rows */
typedef struct {
    const tm_decode_step *step;
    const tm_kv_cache *kv;
    float *qkv;                   /* [batch, (heads + 2 kv_heads) * head_dim], rows qkv_stride floats apart */
    int qkv_stride;
    float *out;                   /* [batch, heads, head_dim] */
    int heads;
    float scale;
    float softcap;                /* as tm_paged_decode_args.softcap */
    const float *sinks;           /* as tm_paged_decode_args.sinks */
} tm_decode_attention_args;
TM_API int tm_decode_attention(const tm_decode_attention_args *a);

/* ---- a decoder layer's decode step in one call (decode_layer.c) ------------------------------------------- */
/* one of the layer's matrices: the tuned repacked blocks (q), or a GGUF matrix's chain of row parts (g, at most
 * TM_GMATMUL_MAX_ROWS rows of x), the other NULL */
typedef struct {
    const tm_qweight *q;
    const tm_gweight *g;
    int int8_x;                   /* as tm_qmatmul_args.int8_x (q) or tm_gmatmul_args.int8_x (g) */
    const float *lora_a;          /* LoRA adapters' stacks (tm_lora's a and b), or NULL: none */
    const float *lora_b;
    int lora_r;
    int n_in;
    int n_out;
} tm_matrix;

typedef struct {
    const float *input_norm;      /* [hidden] */
    const float *post_norm;       /* the norm before the MLP */
    float eps;
    int hidden;
    int heads;
    int kv_heads;
    int head_dim;
    int inter;
    float scale;
    float softcap;                /* the attention scores' soft cap, 0 for none */
    int gelu;                     /* the MLP's gate: 1 GELU (tanh approximation, Gemma), 0 SiLU */
    const float *q_norm;          /* [head_dim]: each q and k head normalised before rotary (Gemma 3, Qwen3), */
    const float *k_norm;          /* or NULL */
    const float *attn_out_norm;   /* [hidden]: Gemma's norms of the attention's and the MLP's outputs, before */
    const float *mlp_out_norm;    /* they join the residual; or NULL */
    const tm_matrix *qkv;
    const tm_matrix *o;
    const tm_matrix *gate_up;
    const tm_matrix *down;
} tm_layer;

typedef struct {
    const tm_layer *layer;
    const tm_decode_step *step;
    const tm_kv_cache *kv;
    const float *x;               /* [batch, hidden]: the previous layer's MLP output */
    float *residual;              /* [batch, hidden], updated in place; x itself when add is 0 */
    int add;
    float *out;                   /* [batch, hidden]: this layer's MLP output */
    const int32_t *lora_slots;    /* [batch]: each row's LoRA slot (-1: none), or NULL: no row has an adapter */
} tm_decode_layer_args;
TM_API int tm_decode_layer(const tm_decode_layer_args *a);

/* ---- faulting in fresh memory (pages.c) ------------------------------------------------------------------- */
typedef struct {
    void *bufs;                   /* void *[n]: equal-sized buffers (their contents are kept) */
    int n;
    int64_t start;                /* the offset to resume from: what an earlier call returned */
    int64_t bytes;
    int64_t chunk;
    int *stop;                    /* checked before each chunk */
} tm_touch_pages_args;
/* returns the offset reached: every buffer is faulted in below it */
TM_API int64_t tm_touch_pages(const tm_touch_pages_args *a);

#endif
