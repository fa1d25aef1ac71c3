"""Memory planning: weight bytes at each precision, KV bytes per token at each cache dtype, and how many
sequences of N tokens fit in M GB once the weights are loaded (`tokenmill kv-calc`, alias `mem-plan`).

KV arithmetic: 2 (K and V) × layers × kv_heads × head_dim × bytes per token. Context is never free: every
token of every running sequence holds this much memory until the sequence ends. GQA/MQA shrink it by sharing
K/V heads; a sliding-window layer stops growing at its window; DeepSeek's latent attention (MLA) keeps one vector
per layer, the latent and the rotary key (kv_lora_rank + qk_rope_head_dim), for K and V of every head. A linear-
attention layer (Qwen3.5's and Qwen3-Next's Gated DeltaNet) keeps no KV at all but a fixed state per sequence:
its recurrent state (value heads x key dim x value dim, float32, as transformers computes it) and its causal
convolution's last kernel - 1 inputs (the q, k and v widths, in the model's 2-byte dtype). DeepSeek-V3.2 keeps MLA's
latent and its sparse attention's indexer key (index_head_dim) per token per layer. DeepSeek-V4 keeps, per layer,
a sliding window of raw keys (keys and values one vector) and one pooled entry per compress_rate tokens (4 for
compressed sparse attention, which also keeps an indexer key per entry; 128 for heavily compressed attention).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from ..layout import sliding_layers, sparse_layers
from .workload import read_json

GB = 1e9  # decimal, as memory is sold; GiB figures are printed alongside


@dataclass(frozen=True)
class KVFormat:
    """How a cache dtype stores one token's K (or V) vector of one head: codes, plus scales when quantised."""
    bits: int                    # per element
    group: Optional[int] = None  # elements sharing one set of scales; None: the whole head vector
    scale_bytes: int = 0         # per group; 0 for plain floats

    def code_bytes(self, head_dim: int) -> int:
        return -(-head_dim * self.bits // 8)

    def scale_bytes_per_head(self, head_dim: int) -> int:
        # a head that is not whole groups takes one scale for all of it (the int8 cache's rule; int4 refuses it)
        groups = 1 if self.group is None or head_dim % self.group else head_dim // self.group
        return groups * self.scale_bytes

    def head_bytes(self, head_dim: int) -> int:
        return self.code_bytes(head_dim) + self.scale_bytes_per_head(head_dim)


KV_FORMATS = {
    "fp32": KVFormat(32), "bf16": KVFormat(16), "fp16": KVFormat(16), "fp8": KVFormat(8),
    "int8": KVFormat(8, 32, 4),    # per 32 elements one float32 scale
    "int4": KVFormat(4, 32, 4),    # per 32 elements one fp16 scale and one fp16 offset
}
KV_TABLE = ("fp32", "bf16", "fp8", "int8", "int4")  # the planner's columns; fp16 costs what bf16 does
_DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
                  "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}


def kv_format(kv_dtype: str) -> tuple[str, KVFormat]:
    """(canonical name, format); ValueError naming the choices for anything else."""
    d = _DTYPE_ALIASES.get(kv_dtype, kv_dtype)
    if d not in KV_FORMATS:
        raise ValueError(f"unknown KV dtype {kv_dtype!r}; choose one of {sorted(KV_FORMATS)}")
    return d, KV_FORMATS[d]


def dtype_bytes(kv_dtype: str) -> float:
    """Bytes of one element's code (int4: 0.5); quantised dtypes add their scales per head vector."""
    bits = kv_format(kv_dtype)[1].bits
    return bits // 8 if bits % 8 == 0 else bits / 8  # whole bytes stay ints, as the JSON always had them


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_windows: tuple[Optional[int], ...]  # per attention layer: None = full attention, else its window
    latent_dim: Optional[int] = None          # MLA: the one vector a token keeps per layer (head_dim is it then)
    linear_layers: int = 0                    # of num_layers, those with a fixed state instead of KV
    state_bytes: int = 0                      # their states, per sequence, whatever its length
    index_dim: int = 0                        # V3.2 / V4: an indexer key kept beside each (indexed) entry
    # V4: per layer, tokens per pooled entry (its window of raw keys is layer_windows'); empty: every token kept
    layer_rates: tuple[int, ...] = ()
    indexed_rate: int = 0                     # V4: the rate whose entries carry indexer keys

    @property
    def attention(self) -> str:
        if self.layer_rates:
            return "compressed (CSA/HCA)"
        if self.latent_dim is not None:
            return "MLA + indexer" if self.index_dim else "MLA"
        return "MHA" if self.num_kv_heads == self.num_heads else "MQA" if self.num_kv_heads == 1 else "GQA"

    @property
    def vectors(self) -> int:
        """Vectors a token keeps per layer: K and V of each kv head, or MLA's one latent (V4's one key = value)."""
        return 1 if self.latent_dim is not None or self.layer_rates else 2 * self.num_kv_heads

    def head_bytes(self, kv_dtype: str = "bf16") -> int:
        """One token's K (or V) for one head, scales included."""
        return kv_format(kv_dtype)[1].head_bytes(self.head_dim)

    @property
    def kv_layers(self) -> int:
        return self.num_layers - self.linear_layers

    def index_bytes(self, kv_dtype: str = "bf16") -> int:
        return kv_format(kv_dtype)[1].head_bytes(self.index_dim) if self.index_dim else 0

    def entry_bytes(self, rate: int, kv_dtype: str = "bf16") -> int:
        """V4: one pooled entry of a layer of this rate, its indexer key included."""
        return self.head_bytes(kv_dtype) + (self.index_bytes(kv_dtype) if rate == self.indexed_rate else 0)

    def bytes_per_token(self, kv_dtype: str = "bf16") -> float:
        """Full-attention cost of one more token (before any window caps it); V4: what its pooled entries add,
        on average."""
        if self.layer_rates:
            grow = sum(self.entry_bytes(r, kv_dtype) / r for r in self.layer_rates)
            return int(grow) if grow == int(grow) else grow
        return self.kv_layers * (self.vectors * self.head_bytes(kv_dtype) + self.index_bytes(kv_dtype))

    def bytes_per_seq(self, context: int, kv_dtype: str = "bf16") -> int:
        """One sequence of `context` tokens: each attention layer keeps min(context, its window) tokens; linear
        layers their fixed state; V4's layers their window and one entry per full group of `rate` tokens."""
        kept = sum(context if w is None else min(context, w) for w in self.layer_windows)
        if self.layer_rates:
            return self.head_bytes(kv_dtype) * kept + sum(context // r * self.entry_bytes(r, kv_dtype)
                                                          for r in self.layer_rates)
        return (self.vectors * self.head_bytes(kv_dtype) + self.index_bytes(kv_dtype)) * kept + self.state_bytes


def _get(cfg: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = cfg.get(n) if isinstance(cfg, dict) else getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def kv_shape(cfg: Any) -> KVShape:
    """From an HF-style config (dict or object); handles MHA/GQA/MQA defaults and sliding-window layouts."""
    cfg = _get(cfg, "text_config", default=cfg)  # multimodal wrappers keep the LM under text_config
    layers = _get(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _get(cfg, "num_attention_heads", "n_head")
    if layers is None or heads is None:
        raise ValueError("config needs num_hidden_layers and num_attention_heads")
    kv = _get(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv",
              default=1 if _get(cfg, "multi_query") else heads)
    types = tuple(_get(cfg, "layer_types") or ())
    if _get(cfg, "kv_lora_rank"):          # latent attention: one latent and one rotary key per token per layer
        latent = int(_get(cfg, "kv_lora_rank") + _get(cfg, "qk_rope_head_dim", default=0))
        index = int(_get(cfg, "index_head_dim", default=0)) if "indexed_attention" in types else 0
        return KVShape(int(layers), int(heads), 1, latent, (None,) * int(layers), latent, index_dim=index)
    rates = _get(cfg, "compress_rates")
    if rates and types:                    # DeepSeek-V4
        known = {"compressed_sparse_attention", "heavily_compressed_attention"}
        if set(types) - known or len(types) != int(layers):
            raise ValueError(f"DeepSeek-V4 layer types {sorted(set(types) - known) or types} are not ones kv-calc "
                             f"counts ({', '.join(sorted(known))}, one per layer)")
        window = int(_get(cfg, "sliding_window"))
        return KVShape(int(layers), int(heads), 1, int(_get(cfg, "head_dim")), (window,) * int(layers),
                       index_dim=int(_get(cfg, "index_head_dim")),
                       layer_rates=tuple(int(rates[t]) for t in types),
                       indexed_rate=int(rates["compressed_sparse_attention"]))
    head_dim = _get(cfg, "head_dim")
    if head_dim is None:
        hidden = _get(cfg, "hidden_size", "n_embd")
        if hidden is None:
            raise ValueError("config needs head_dim or hidden_size")
        head_dim = hidden // heads
    windows = _layer_windows(cfg, int(layers))
    linear = [t == "linear_attention" for t in types]
    if any(linear):
        if len(linear) != int(layers):
            raise ValueError(f"layer_types names {len(linear)} layers, the config {layers}")
        return KVShape(int(layers), int(heads), int(kv), int(head_dim),
                       tuple(w for w, lin in zip(windows, linear) if not lin), None, sum(linear),
                       sum(linear) * linear_state_bytes(cfg))
    return KVShape(int(layers), int(heads), int(kv), int(head_dim), windows)


def _linear_dims(cfg: Any) -> tuple[int, int, int, int, int]:
    """A Gated DeltaNet layer's (key heads, value heads, key dim, value dim, convolution kernel)."""
    names = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
             "linear_conv_kernel_dim")
    missing = [n for n in names if _get(cfg, n) is None]
    if missing:
        raise ValueError(f"a linear-attention layer needs {', '.join(missing)} in the config")
    kh, vh, kd, vd, kernel = (int(_get(cfg, n)) for n in names)
    return kh, vh, kd, vd, kernel


def linear_state_bytes(cfg: Any) -> int:
    """One Gated DeltaNet layer's state for one sequence: the recurrent state, float32 [value heads, key dim,
    value dim], and the convolution's last kernel - 1 inputs, [kernel - 1, 2 x key width + value width] at 2 bytes."""
    kh, vh, kd, vd, kernel = _linear_dims(cfg)
    return vh * kd * vd * 4 + (kernel - 1) * (2 * kh * kd + vh * vd) * 2


def _layer_windows(cfg: Any, layers: int) -> tuple[Optional[int], ...]:
    sw = _get(cfg, "sliding_window")
    if not sw or _get(cfg, "use_sliding_window") is False:  # Qwen2 ships a window it does not use
        return (None,) * layers
    return tuple(sw if s else None for s in sliding_layers(cfg, layers))


def kv_calc(cfg: Any, context: int = 4096, kv_dtype: str = "bf16",
            memory_gb: Optional[float] = None) -> dict[str, Any]:
    """Bytes per token and per sequence, and how many sequences of `context` fit in `memory_gb` (1e9 B)."""
    _check_context(context)
    s = kv_shape(cfg)
    per_seq = s.bytes_per_seq(context, kv_dtype)
    out: dict[str, Any] = {
        **asdict(s), "layer_windows": list(s.layer_windows), "layer_rates": list(s.layer_rates),
        "attention": s.attention, "kv_layers": s.kv_layers,
        "kv_dtype": kv_format(kv_dtype)[0], "dtype_bytes": dtype_bytes(kv_dtype),
        "head_bytes": s.head_bytes(kv_dtype), "context": context, "bytes_per_token": s.bytes_per_token(kv_dtype),
        "bytes_per_seq": per_seq, "avg_bytes_per_token": per_seq / context,
    }
    if memory_gb is not None:
        mem = _check_memory(memory_gb) * GB
        out.update(memory_gb=memory_gb, max_seqs=int(mem // per_seq),
                   max_tokens_full_attention=int(mem // out["bytes_per_token"]))
    return out


def _check_context(context: int) -> int:
    if context < 1:
        raise ValueError(f"context must be >= 1, got {context}")
    return context


def _check_memory(memory_gb: float) -> float:
    if memory_gb <= 0:
        raise ValueError(f"memory_gb must be > 0, got {memory_gb}")
    return memory_gb


def _human(n: float) -> str:
    return f"{n / GB:.3f} GB ({n / 2**30:.3f} GiB)" if n >= 1e8 else f"{n / 1e6:.2f} MB ({n / 2**20:.2f} MiB)"


def format_report(r: dict[str, Any], label: str = "") -> str:
    windows = {w for w in r["layer_windows"] if w is not None}
    slide = (f", sliding window {sorted(windows)} on {sum(w is not None for w in r['layer_windows'])} of "
             f"{r['kv_layers']} layers" if windows else "")
    linear = r["linear_layers"]
    hybrid = f" ({r['kv_layers']} attention, {linear} linear attention)" if linear else ""
    lines = [
        f"model: {label}" if label else "",
        f"shape: {r['num_layers']} layers{hybrid}, {r['num_heads']} query heads, {r['num_kv_heads']} KV heads "
        f"({r['attention']}), head_dim {r['head_dim']}{slide}",
        f"KV dtype: {r['kv_dtype']} ({r['dtype_bytes']:g} B{_scales_note(r['kv_dtype'], ' + ')})",
        _per_token_line(r),
        f"fixed per sequence: {r['state_bytes']:,} B = {linear} linear-attention layers x "
        f"{r['state_bytes'] // linear:,} B of recurrent and convolution state" if linear else "",
        f"per sequence of {r['context']:,} tokens: {r['bytes_per_seq']:,} B = {_human(r['bytes_per_seq'])}",
    ]
    if windows:
        lines.append(f"  (windows cap it: {r['avg_bytes_per_token']:,.0f} B per token on average at this context)")
    if "max_seqs" in r:
        lines.append(f"fits in {r['memory_gb']:g} GB: {r['max_seqs']:,} sequences of {r['context']:,} tokens "
                     f"({r['max_tokens_full_attention']:,} tokens at full attention), weights and activations not counted")
    return "\n".join(x for x in lines if x)


def _per_token_line(r: dict[str, Any]) -> str:
    index = f" + indexer key ({r['index_dim']} x {r['dtype_bytes']:g} B)" if r["index_dim"] else ""
    if r["layer_rates"]:
        rates = sorted(set(r["layer_rates"]))
        parts = " + ".join(f"{r['layer_rates'].count(k)} layers x (1 key=value"
                           f"{index if k == r['indexed_rate'] else ''}) / {k} tokens" for k in rates)
        return (f"per token: {r['bytes_per_token']:,} B = {parts}, key=value {_head_formula(r)}; each layer's last "
                f"{r['layer_windows'][0]} raw keys besides (the group still being pooled not counted)")
    if r["latent_dim"] is not None:
        return (f"per token: {r['bytes_per_token']:,} B = {r['num_layers']} layers x (1 latent (K and V of every head)"
                f" x {_head_formula(r)}{index})")
    return (f"per token: {r['bytes_per_token']:,} B = 2 x {r['kv_layers']} layers x {r['num_kv_heads']} kv_heads"
            f" x {_head_formula(r)}")


def _scales_note(kv_dtype: str, prefix: str) -> str:
    f = KV_FORMATS[kv_dtype]
    if not f.scale_bytes:
        return ""
    per = "per token per head" if f.group is None else f"per {f.group} elements"
    return f"{prefix}{f.scale_bytes} B of scales {per}"


def _head_formula(r: dict[str, Any]) -> str:
    codes = f"{r['head_dim']} head_dim x {r['dtype_bytes']:g} B"
    scales = KV_FORMATS[r["kv_dtype"]].scale_bytes_per_head(r["head_dim"])
    return f"({codes} + {scales} B scales)" if scales else codes


# ---- weights: parameter count and bytes at each precision ----

VECTOR_BYTES = 4  # norms and biases: kept float32 at every precision (tokenmill and llama.cpp alike)
# name -> the ggml type whose (block size, bytes per block) sets its size; int8/int4 are tokenmill's
# load-time quantisation, stored in Q8_0 and Q4_1 blocks
WEIGHT_TYPES = {
    "fp32": "F32", "bf16": "BF16", "fp16": "F16", "Q8_0": "Q8_0", "int8": "Q8_0", "Q6_K": "Q6_K",
    "Q5_K": "Q5_K", "Q4_1": "Q4_1", "int4": "Q4_1", "Q4_K": "Q4_K", "Q4_0": "Q4_0", "Q3_K": "Q3_K", "Q2_K": "Q2_K",
}
# GPTQ, AWQ and compressed-tensors folders: integer codes with an fp16 scale and an integer zero point per group
# (GPTQ stores zero points even when symmetric), as (weights, bytes) of a whole number of groups; fp8: one byte a
# weight (its scale per row not counted)
GROUP_SIZES = {"w4a16-g32": (64, 37), "w4a16-g64": (128, 69), "w4a16-g128": (256, 133),
               "w8a16-g128": (128, 131), "fp8": (1, 1)}
WEIGHT_TABLE = tuple(p for p in WEIGHT_TYPES if p != "fp16") + tuple(GROUP_SIZES)  # fp16 costs what bf16 does
GGUF_WEIGHTS = "gguf"  # the precision name of a GGUF file's own bytes
# gpt-oss as published: its experts' matrices in MXFP4 blocks (17 bytes a 32 weights), the other matrices bf16
MXFP4_EXPERTS = "mxfp4"
_WEIGHT_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "f32": "fp32",
                   "f16": "fp16"}


def weight_precision(name: str, gguf_ok: bool = False) -> str:
    """Canonical name ("q4_k" -> "Q4_K"); ValueError naming the choices for anything else."""
    lower = name.lower()
    if lower == GGUF_WEIGHTS and gguf_ok:
        return GGUF_WEIGHTS
    if lower == MXFP4_EXPERTS:
        return MXFP4_EXPERTS
    lower = _WEIGHT_ALIASES.get(lower, lower)
    for p in (*WEIGHT_TYPES, *GROUP_SIZES):
        if p.lower() == lower:
            return p
    choices = list(WEIGHT_TYPES) + list(GROUP_SIZES) + [MXFP4_EXPERTS] + ([GGUF_WEIGHTS] if gguf_ok else [])
    why = " (only for a .gguf model)" if lower == GGUF_WEIGHTS else ""
    raise ValueError(f"unknown weight precision {name!r}{why}; choose one of {', '.join(choices)}")


def quant_size(precision: str) -> tuple[int, int]:
    """(weights per block, bytes per block) from gguf's table, so new block formats need no edit here."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    name = weight_precision(precision)
    if name in GROUP_SIZES:
        return GROUP_SIZES[name]
    return GGML_QUANT_SIZES[GGMLQuantizationType[WEIGHT_TYPES[weight_precision(precision)]]]


def bits_per_weight(precision: str) -> float:
    block, size = quant_size(precision)
    return 8 * size / block


@dataclass(frozen=True)
class ParamCount:
    """A decoder's parameters by role; the matrices are what a precision shrinks."""
    embedding: int
    attention: int  # q/k/v/o matrices, all layers
    mlp: int        # gate/up/down matrices, all layers
    lm_head: int    # 0 when tied to the embedding
    vectors: int    # norms and biases

    @property
    def matrices(self) -> int:
        return self.embedding + self.attention + self.mlp + self.lm_head

    @property
    def total(self) -> int:
        return self.matrices + self.vectors


def param_count(cfg: Any) -> ParamCount:
    """Llama-family decoder (Llama, Mistral, Qwen2/3 and their MoE kin): GQA k/v widths, explicit head_dim, biases,
    q/k norms, experts."""
    cfg = _get(cfg, "text_config", default=cfg)
    s = kv_shape(cfg)
    vocab, hidden, ffn = _get(cfg, "vocab_size"), _get(cfg, "hidden_size", "n_embd"), _get(cfg, "intermediate_size")
    missing = [n for n, v in (("vocab_size", vocab), ("hidden_size", hidden), ("intermediate_size", ffn)) if v is None]
    if missing:
        raise ValueError(f"counting weights needs {', '.join(missing)} in the config")
    q, kv, layers = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_layers
    tied = bool(_get(cfg, "tie_word_embeddings", default=False))  # Llama/Mistral/Qwen default to untied
    if s.latent_dim is not None:
        return _latent_params(cfg, s, vocab, hidden, ffn, tied)
    if s.linear_layers:
        return _hybrid_params(cfg, s, vocab, hidden, ffn, tied)
    return ParamCount(embedding=vocab * hidden, attention=layers * (hidden * (q + 2 * kv) + q * hidden),
                      mlp=_mlp_params(cfg, hidden, ffn, layers), lm_head=0 if tied else vocab * hidden,
                      vectors=layers * (2 * hidden + _layer_extras(cfg, s, hidden, ffn)) + hidden)


def _hybrid_params(cfg: Any, s: KVShape, vocab: int, hidden: int, ffn: int, tied: bool) -> ParamCount:
    """Qwen3.5 / Qwen3-Next: gated attention layers (q_proj gives the query and its output gate) and Gated DeltaNet
    layers (q/k/v, z, the a and b gates in; the value width out; a depthwise convolution over q/k/v)."""
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    kh, vh, kd, vd, kernel = _linear_dims(cfg)
    keys, values = kh * kd, vh * vd
    attention = s.kv_layers * (hidden * (2 * q + 2 * kv) + q * hidden) \
        + s.linear_layers * (hidden * (2 * keys + 2 * values + 2 * vh) + values * hidden)
    per_linear = (2 * keys + values) * kernel + 2 * vh + vd        # convolution, dt bias and A, the gated norm
    return ParamCount(embedding=vocab * hidden, attention=attention, mlp=_mlp_params(cfg, hidden, ffn, s.num_layers),
                      lm_head=0 if tied else vocab * hidden,
                      vectors=s.num_layers * 2 * hidden + s.kv_layers * 2 * s.head_dim
                      + s.linear_layers * per_linear + hidden)


def _latent_params(cfg: Any, s: KVShape, vocab: int, hidden: int, ffn: int, tied: bool) -> ParamCount:
    """DeepSeek-V2/V3: latent attention's projections, dense layers before first_k_dense_replace, then routed
    experts with their router and ungated shared experts."""
    heads, layers, rank = s.num_heads, s.num_layers, _get(cfg, "kv_lora_rank")
    nope, rope, v = (_get(cfg, n) for n in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    q_rank = _get(cfg, "q_lora_rank")
    q = hidden * q_rank + q_rank * heads * (nope + rope) if q_rank else hidden * heads * (nope + rope)
    attention = q + hidden * (rank + rope) + rank * heads * (nope + v) + heads * v * hidden
    dense = min(_get(cfg, "first_k_dense_replace", default=0), layers)
    experts, inter = _get(cfg, "n_routed_experts", default=0), _get(cfg, "moe_intermediate_size", default=0)
    shared = inter * (_get(cfg, "n_shared_experts", default=0) or 0)
    per_sparse = experts * (3 * hidden * inter + hidden) + 3 * hidden * shared
    norms = 2 * hidden + rank + (q_rank or 0)
    return ParamCount(embedding=vocab * hidden, attention=layers * attention,
                      mlp=dense * 3 * hidden * ffn + (layers - dense) * per_sparse,
                      lm_head=0 if tied else vocab * hidden, vectors=layers * norms + hidden)


def _mlp_params(cfg: Any, hidden: int, ffn: int, layers: int) -> int:
    """gate/up/down of every layer; a Mixture-of-Experts layer's are every expert's, with its router (and Qwen2-MoE's
    shared expert and gate). Which layers are sparse follows transformers' rule (config.py)."""
    experts = _get(cfg, "num_experts", "num_local_experts", default=0) or 0
    if not experts:
        return layers * 3 * hidden * ffn
    if _get(cfg, "model_type", default="") in ("mixtral", "gpt_oss"):     # every layer sparse, experts of ffn
        sparse, inter, shared = layers, ffn, 0
    else:
        sparse = len(sparse_layers(layers, _get(cfg, "decoder_sparse_step"), _get(cfg, "mlp_only_layers")))
        inter = _get(cfg, "moe_intermediate_size")
        shared = _get(cfg, "shared_expert_intermediate_size", default=0) or 0
    per_sparse = experts * (3 * hidden * inter + hidden) + (3 * hidden * shared + hidden if shared else 0)
    return (layers - sparse) * 3 * hidden * ffn + sparse * per_sparse


def _layer_extras(cfg: Any, s: KVShape, hidden: int, ffn: int) -> int:
    """Per layer vectors beyond the two RMSNorms: attention/MLP biases, Qwen3's per-head q/k norms, gpt-oss's sinks
    and expert biases."""
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    kind = _get(cfg, "model_type", default="")
    qwen2 = kind in ("qwen2", "qwen2_moe")
    n = q + 2 * kv if qwen2 else 0  # Qwen2 always biases q/k/v, never o
    if not qwen2 and _get(cfg, "attention_bias"):
        n += q + 2 * kv + hidden
    if _get(cfg, "mlp_bias"):
        n += 2 * ffn + hidden
    if kind in ("qwen3", "qwen3_moe", "gemma3_text"):
        n += 2 * s.head_dim
    if kind in ("gemma2", "gemma3_text"):         # the norms before and after the MLP
        n += 2 * hidden
    if kind == "gpt_oss":                         # each head's sink, the router's bias, every expert's biases
        experts = _get(cfg, "num_local_experts", "num_experts", default=0) or 0
        n += s.num_heads + experts * (1 + 2 * ffn + hidden)
    return n


def config_precision(cfg: Any) -> Optional[str]:
    """The planner's precision for a GPTQ/AWQ/compressed-tensors folder's own format; None for a float one."""
    qc = _get(cfg, "quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    if qc.get("quant_method") == "mxfp4":
        return MXFP4_EXPERTS
    groups = qc.get("config_groups") or {}
    w = next(iter(groups.values()), {}).get("weights") or {} if groups else qc
    if w.get("type") == "float":
        return "fp8"
    bits = w.get("num_bits", w.get("bits", w.get("w_bit")))
    group = w.get("group_size", w.get("q_group_size"))
    name = f"w{bits}a16-g{group}"
    return name if name in GROUP_SIZES else "w8a16-g128" if bits == 8 else None


def weight_bytes(params: ParamCount, precision: str) -> int:
    """Matrices at `precision` (whole blocks, rounded up) plus the float32 vectors."""
    if precision == MXFP4_EXPERTS:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType.MXFP4]
        experts = -(-params.mlp * size // block)
        return experts + (params.matrices - params.mlp) * 2 + params.vectors * VECTOR_BYTES
    block, size = quant_size(precision)
    return -(-params.matrices * size // block) + params.vectors * VECTOR_BYTES


@dataclass(frozen=True)
class GGUFWeights:
    """What a GGUF file actually holds: llama.cpp mixes types, so this beats any single-precision estimate."""
    n_bytes: int
    n_params: int
    types: tuple[tuple[str, int], ...]  # (ggml type, bytes), largest first

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.n_bytes / max(self.n_params, 1)

    def mix(self) -> str:
        shares = ((t, 100 * b / self.n_bytes) for t, b in self.types)
        return ", ".join(f"{t} {s:.0f}%" if s >= 1 else f"{t} {s:.2g}%" for t, s in shares)  # norms are tiny


# ---- the plan ----


@dataclass(frozen=True)
class WeightOption:
    precision: str
    bits_per_weight: float  # of the matrices; for the GGUF file, over all its parameters
    bytes: int


@dataclass(frozen=True)
class KVOption:
    kv_dtype: str
    bytes_per_token: int  # at full attention
    bytes_per_seq: int    # of `context` tokens, windows applied


@dataclass(frozen=True)
class MemoryPlan:
    context: int
    memory_gb: Optional[float]
    batch: Optional[int]                  # sequences drawn by --plot; None: as many as fit at the chosen pair
    highlight: Optional[str]              # the chosen weight precision; None when weights are unknown
    kv_dtype: str                         # the chosen cache dtype
    params: Optional[ParamCount]
    gguf: Optional[GGUFWeights]
    weights: tuple[WeightOption, ...]     # empty when the config cannot be counted
    kv: tuple[KVOption, ...]
    note: str = ""                        # why weights are missing, if they are

    def weight(self, precision: str) -> WeightOption:
        return next(w for w in self.weights if w.precision == precision)

    def kv_option(self, kv_dtype: str) -> KVOption:
        return next(k for k in self.kv if k.kv_dtype == kv_dtype)

    def fits(self, precision: str, kv_dtype: str) -> Optional[int]:
        """Sequences of `context` tokens that fit beside the weights; None without a memory budget."""
        if self.memory_gb is None:
            return None
        free = self.memory_gb * GB - self.weight(precision).bytes
        return max(0, int(free // self.kv_option(kv_dtype).bytes_per_seq))

    def plot_batch(self) -> int:
        """Sequences drawn in the plot: the batch asked for, else as many as fit at the chosen pair."""
        if self.batch is not None or self.memory_gb is None or self.highlight is None:
            return self.batch or 1
        return max(1, self.fits(self.highlight, self.kv_dtype) or 0)

    def stacks(self) -> dict[str, tuple[int, int]]:
        """Per weight precision: (weight bytes, KV bytes of plot_batch() sequences at the chosen dtype)."""
        kv = self.plot_batch() * self.kv_option(self.kv_dtype).bytes_per_seq
        return {weight_label(w.precision): (w.bytes, kv) for w in self.weights}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "plot_batch": self.plot_batch(), "weights_precision": self.highlight, "vector_bytes": VECTOR_BYTES,
            "params": None if self.params is None else {**asdict(self.params), "matrices": self.params.matrices,
                                                        "total": self.params.total},
            "gguf": None if self.gguf is None else {"n_bytes": self.gguf.n_bytes, "n_params": self.gguf.n_params,
                                                    "types": dict(self.gguf.types)},
            "weights": {w.precision: {"bits_per_weight": w.bits_per_weight, "bytes": w.bytes} for w in self.weights},
            "kv": {k.kv_dtype: {"bytes_per_token": k.bytes_per_token, "bytes_per_seq": k.bytes_per_seq}
                   for k in self.kv},
        }
        if self.note:
            out["weights_note"] = self.note
        if self.memory_gb is not None and self.weights:
            out["fits"] = {w.precision: {k.kv_dtype: self.fits(w.precision, k.kv_dtype) for k in self.kv}
                           for w in self.weights}
        return out


def memory_plan(cfg: Any, context: int = 4096, memory_gb: Optional[float] = None, weights: Optional[str] = None,
                kv_dtype: str = "bf16", gguf: Optional[GGUFWeights] = None, batch: Optional[int] = None) -> MemoryPlan:
    """Every precision and cache dtype for one model; `weights` picks the one to highlight (default: the
    GGUF file's own bytes, else bf16)."""
    _check_context(context)
    if memory_gb is not None:
        _check_memory(memory_gb)
    if batch is not None and batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    kv_dtype = kv_format(kv_dtype)[0]
    s = kv_shape(cfg)
    kv = tuple(KVOption(d, s.bytes_per_token(d), s.bytes_per_seq(context, d))
               for d in dict.fromkeys((*KV_TABLE, kv_dtype)))
    highlight = weight_precision(weights, gguf is not None) if weights else GGUF_WEIGHTS if gguf else \
        config_precision(cfg) or "bf16"
    highlight = "bf16" if highlight == "fp16" else highlight  # same bytes; the table's row is "bf16/fp16"
    try:
        params: Optional[ParamCount] = param_count(cfg)
        note = ""
    except ValueError as e:
        if highlight != GGUF_WEIGHTS and weights:  # asked for a precision the config cannot size
            raise
        params, note = None, str(e)
    rows = _weight_rows(params, gguf, highlight)
    chosen = highlight if any(w.precision == highlight for w in rows) else None
    return MemoryPlan(context, memory_gb, batch, chosen, kv_dtype, params, gguf, rows, kv, note)


def _weight_rows(params: Optional[ParamCount], gguf: Optional[GGUFWeights],
                 highlight: str) -> tuple[WeightOption, ...]:
    """The GGUF file's own bytes first (when there is one), then every precision the config can size."""
    rows = [WeightOption(GGUF_WEIGHTS, gguf.bits_per_weight, gguf.n_bytes)] if gguf else []
    if params is not None:
        for p in dict.fromkeys((*WEIGHT_TABLE, highlight)):
            if p == GGUF_WEIGHTS:
                continue
            b = weight_bytes(params, p)
            bits = 8 * (b - params.vectors * VECTOR_BYTES) / params.matrices if p == MXFP4_EXPERTS else \
                bits_per_weight(p)
            rows.append(WeightOption(p, bits, b))
    return tuple(rows)


def weight_label(p: str) -> str:
    return {"bf16": "bf16/fp16", "int8": "int8 (=Q8_0)", "int4": "int4 (=Q4_1)", GGUF_WEIGHTS: "GGUF file"}.get(p, p)


def format_plan(plan: MemoryPlan) -> str:
    """The planner's tables: weights by precision, KV by cache dtype, and sequences that fit."""
    lines = [_format_params(plan.params)] if plan.params else [f"parameters: not counted ({plan.note})"]
    if plan.gguf:
        lines.append(f"GGUF file: {plan.gguf.n_bytes:,} B = {_human(plan.gguf.n_bytes)}, {plan.gguf.n_params:,} "
                     f"params, {plan.gguf.bits_per_weight:.2f} bits/weight; types by bytes: {plan.gguf.mix()}")
    if plan.weights:
        vectors = f": {plan.params.vectors:,} params x {VECTOR_BYTES} B" if plan.params else ""
        lines += ["", f"weights by precision (norms and biases stay float32 at every precision{vectors}):",
                  f"  {'precision':<14}{'bits/weight':>12}  {'bytes':>15}  size"]
        lines += [f"{'*' if w.precision == plan.highlight else ' '} {weight_label(w.precision):<14}"
                  f"{w.bits_per_weight:>12.5g}  {w.bytes:>15,}  {_human(w.bytes)}" for w in plan.weights]
    lines += ["", f"KV cache by dtype (per token at full attention; per sequence of {plan.context:,} tokens):"]
    lines += [f"{'*' if k.kv_dtype == plan.kv_dtype else ' '} {k.kv_dtype:<6}{k.bytes_per_token:>10,} B/token  "
              f"{_human(k.bytes_per_seq)} per sequence{_scales_note(k.kv_dtype, ', incl. ')}" for k in plan.kv]
    if plan.memory_gb is not None and plan.weights:
        lines += ["", *_format_fits(plan)]
    return "\n".join(lines)


def _format_params(p: ParamCount) -> str:
    head = "tied to the embedding" if p.lm_head == 0 else f"{p.lm_head:,}"
    return (f"parameters: {p.total:,} = embedding {p.embedding:,} + attention {p.attention:,} + mlp {p.mlp:,}"
            f" + lm_head {head} + norms/biases {p.vectors:,}")


def _format_fits(plan: MemoryPlan) -> list[str]:
    """Sequences of `context` tokens that fit in the budget after the weights, precision x KV dtype."""
    head = f"  {'weights/KV':<14}" + "".join(f"{k.kv_dtype:>9}" for k in plan.kv)
    rows = [f"{'*' if w.precision == plan.highlight else ' '} {weight_label(w.precision):<14}"
            + "".join(f"{plan.fits(w.precision, k.kv_dtype):>9,}" for k in plan.kv) for w in plan.weights]
    w, k = plan.highlight, plan.kv_dtype
    size = _human(plan.weight(w).bytes)
    summary = (f"with {weight_label(w)} weights of {size} and a {k} cache: {plan.fits(w, k):,} sequences of "
               f"{plan.context:,} tokens fit in {plan.memory_gb:g} GB" if plan.weight(w).bytes < plan.memory_gb * GB
               else f"{weight_label(w)} weights of {size} alone exceed {plan.memory_gb:g} GB")
    return [f"sequences of {plan.context:,} tokens that fit in {plan.memory_gb:g} GB after the weights "
            f"(activations and allocator slack not counted; * = chosen):", head, *rows, summary]


def plot_plan(plan: MemoryPlan, path: str | Path, label: str = "") -> Path:
    """Weights + KV of plot_batch() sequences per precision, against the budget (matplotlib loads only here)."""
    from .plots import plot_memory_plan

    if not plan.weights:
        raise ValueError(f"--plot needs the weights: {plan.note}")
    n = plan.plot_batch()
    title = f"{label + ': ' if label else ''}{n:,} sequences x {plan.context:,} tokens, {plan.kv_dtype} KV cache"
    return plot_memory_plan(plan.stacks(), path, plan.memory_gb, weight_label(plan.highlight),
                            kv_label=f"KV cache ({plan.kv_dtype})", title=title)


# ---- where configs come from ----


def load_config(model: Optional[str] = None, config: Optional[str] = None) -> tuple[dict[str, Any], str]:
    """(HF-style config dict, label) from a config.json, an HF folder, a .gguf file, or the bundled model."""
    if config is not None:
        return read_json(Path(config)), str(config)
    from tokenmill.executor.loader import default_model_path
    path = Path(model) if model else Path(default_model_path())
    if path.is_dir():
        return read_json(path / "config.json"), str(path)
    if path.suffix == ".gguf" and path.is_file():
        return gguf_config(path), str(path)
    if path.suffix == ".json" and path.is_file():
        return read_json(path), str(path)
    raise ValueError(f"{path}: not a Hugging Face folder, a config.json or a .gguf file")


@dataclass(frozen=True)
class ModelSource:
    config: dict[str, Any]
    label: str
    gguf: Optional[GGUFWeights]  # a .gguf model's actual tensors; None for configs and HF folders


def load_model(model: Optional[str] = None, config: Optional[str] = None) -> ModelSource:
    """load_config, plus the file's real weight bytes when the model is a GGUF."""
    cfg, label = load_config(model, config)
    path = Path(label)
    return ModelSource(cfg, label, gguf_weights(path) if config is None and path.suffix == ".gguf" else None)


def gguf_weights(path: Path) -> GGUFWeights:
    """Sum the tensor table's byte counts by type (header only; no tensor data is read)."""
    from tokenmill.executor.loader.gguf import open_gguf
    infos = list(open_gguf(path).tensors.values())
    by_type: dict[str, int] = {}
    for t in infos:
        by_type[t.type_name] = by_type.get(t.type_name, 0) + t.n_bytes
    return GGUFWeights(sum(by_type.values()), sum(math.prod(t.shape) for t in infos),
                       tuple(sorted(by_type.items(), key=lambda tb: -tb[1])))


def gguf_config(path: Path) -> dict[str, Any]:
    """The HF-style config of a GGUF file, from the engine's reader (metadata only; tensors stay unread)."""
    from tokenmill.executor.loader.gguf import read_gguf
    return dict(read_gguf(str(path)).config)
