"""Frozen configuration: the model (from HF config.json or GGUF metadata), the KV cache, the scheduler."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from tokenmill.layout import KVGroups, kv_groups, sliding_layers, sparse_layers

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "MixtralForCausalLM",
                           "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM",
                           "DeepseekV3ForCausalLM", "GptOssForCausalLM", "Qwen3_5ForCausalLM",
                           "Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM")
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
ROPE_TYPES = ("linear", "llama3", "yarn", "longrope")      # besides the default (layers/rotary.py)
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM",
                     "Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM")
LINEAR_ATTENTION_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM")
# vision-language checkpoints whose language model is served alone (their vision tower's weights skipped)
MULTIMODAL_TEXT = {"Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
                   "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM"}
# experts beside a shared expert behind a sigmoid gate
SHARED_EXPERT_ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM")
DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
TOPK_METHODS = ("greedy", "group_limited_greedy")        # DeepSeek-V2's routings (V3 always routes by groups)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 2048
    partial_rotary_factor: float = 1.0      # Phi-4-mini: rotary embeddings on the first 3/4 of each head only
    tie_word_embeddings: bool = False
    attention_bias: bool = False      # Qwen2: bias on q/k/v
    qk_norm: bool = False             # Qwen3: RMSNorm on q and k per head
    sliding_window: Optional[int] = None
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture-of-Experts: the layers whose MLP is num_experts experts of moe_intermediate_size, of which a router
    # picks num_experts_per_tok per token (their weights renormalised to sum 1 when norm_topk_prob); Qwen2-MoE adds
    # a shared expert of shared_expert_intermediate_size behind a sigmoid gate
    # Gemma 2/3: norms of (1 + w) before and after attention and the MLP, embeddings times sqrt(hidden), a query
    # scale of query_pre_attn_scalar ** -0.5, tanh soft-capping of attention scores and of the final logits, and
    # per-layer sliding windows (layer_windows: each layer's window, None for a global layer); Gemma 3's local
    # layers turn their rotary embeddings at rope_local_theta, unscaled
    hidden_act: str = "silu"
    gemma: bool = False
    query_pre_attn_scalar: Optional[float] = None
    attn_logit_softcapping: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    layer_windows: tuple[Optional[int], ...] = ()
    rope_local_theta: Optional[float] = None
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    # DeepSeek's routing: softmax or sigmoid scores (V3, plus a per-expert bias for the choice only), experts
    # picked among the topk_group best of n_group groups (V2's group_limited_greedy: a group's best score; V3: its
    # best two), the weights times routed_scaling_factor; its shared experts have no gate
    moe_scoring: str = "softmax"
    router_bias: bool = False         # gpt-oss: the router's logits have a bias
    router_float32: bool = False      # DeepSeek: router logits from float32 activations and weights
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_gated: bool = True
    # DeepSeek's Multi-head Latent Attention (kv_lora_rank > 0): the cache holds per token the normalised latent
    # (kv_lora_rank) and one rotary key (qk_rope_head_dim) shared by all heads; queries are of qk_nope_head_dim +
    # qk_rope_head_dim per head (through a q_lora_rank bottleneck, or none), values of v_head_dim; rope_interleave:
    # the rotary dims come as interleaved pairs
    kv_lora_rank: int = 0
    q_lora_rank: Optional[int] = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # gpt-oss: a learned logit per query head that joins every softmax of its scores and takes its share of the
    # weight (attention sinks), bias on o_proj and on every expert's matrices, and the experts' clamped SwiGLU
    # (hidden_act "swigluoai", vLLM's name): gate clamped above and up on both sides at swiglu_limit, then
    # (up + 1) * gate * sigmoid(swiglu_alpha * gate)
    attention_sinks: bool = False
    o_proj_bias: bool = False
    expert_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # Qwen3.5: hybrid linear attention. linear_layers are Gated DeltaNet layers (a fixed state a request, no KV
    # cache: a causal depthwise conv of linear_conv_kernel_dim over q/k/v, then the gated delta rule over
    # linear_num_key_heads q/k heads of linear_key_head_dim and linear_num_value_heads value heads of
    # linear_value_head_dim); the other layers attend, their output gated by a sigmoid of a second half of q_proj
    # (attn_output_gate); every RMSNorm but the gated one scales by (1 + w) (zero_centered_norms)
    linear_layers: tuple[int, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    attn_output_gate: bool = False
    zero_centered_norms: bool = False
    # value heads in tiled order (head p reads q/k head p mod linear_num_key_heads), as llama.cpp's converter
    # reorders Qwen3.5's; grouped by key head (p // heads per key head) in HF checkpoints
    linear_value_heads_tiled: bool = False

    @staticmethod
    def from_hf_dict(cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch in MULTIMODAL_TEXT:     # a vision-language checkpoint: its language model's config, text only
            # the head is tied by the top-level key alone (transformers' rule), untied where it is absent
            cfg = {**cfg["text_config"], "architectures": [MULTIMODAL_TEXT[arch]],
                   "tie_word_embeddings": cfg.get("tie_word_embeddings", False)}
            arch = MULTIMODAL_TEXT[arch]
        if arch not in SUPPORTED_ARCHITECTURES:
            what = repr(arch) if arch else f"(none named; model_type {cfg.get('model_type')!r})"
            raise ValueError(
                f"unsupported architecture {what}; tokenmill supports {', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        # transformers 5 keeps rope settings in rope_parameters; older configs in rope_theta + rope_scaling
        rope = dict(cfg.get("rope_parameters") or {})
        family = _gemma_fields(arch, cfg, rope)
        if "full_attention" in rope:             # transformers 5's per-layer-type rope (Gemma 3): the global one here
            rope = dict(rope["full_attention"])
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        partial = float(rope.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or 1.0)
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
        if scaling is None and cfg.get("rope_scaling"):
            scaling = dict(cfg["rope_scaling"])
        if scaling is not None:
            scaling["rope_type"] = scaling.get("rope_type", scaling.get("type"))
            if scaling["rope_type"] in (None, "default"):
                scaling = None
        if scaling is not None and scaling["rope_type"] == "longrope":     # Phi-3 keeps this beside rope_scaling
            scaling.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
            missing = [k for k in ("original_max_position_embeddings", "long_factor", "short_factor")
                       if scaling.get(k) is None]
            if missing:
                raise ValueError(f"longrope needs {', '.join(missing)} in the config")
        if scaling is not None and scaling["rope_type"] not in ROPE_TYPES:
            raise ValueError(f"rope type {scaling['rope_type']!r} is not implemented; tokenmill's are "
                             f"{', '.join(ROPE_TYPES)}")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        sliding = cfg.get("sliding_window") if arch in ("MistralForCausalLM", "MixtralForCausalLM",
                                                        "Phi3ForCausalLM") else None
        if arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM") and cfg.get("use_sliding_window"):
            sliding = cfg.get("sliding_window")
        types = cfg.get("layer_types")
        if sliding is not None and types is not None and "full_attention" in types and arch not in GEMMA_ARCHITECTURES:
            # transformers slides only some of these layers (Qwen's max_window_layers): one window for all is wrong
            raise ValueError(f"{arch}: sliding windows on some layers only (layer_types) are implemented for Gemma, "
                             f"not here; set use_sliding_window false or use a config without mixed layer_types")
        moe = _moe_fields(arch, cfg) if arch not in DEEPSEEK_ARCHITECTURES else _deepseek_fields(arch, cfg)
        if arch == "GptOssForCausalLM":
            family = _gpt_oss_fields(cfg)
        if arch in LINEAR_ATTENTION_ARCHITECTURES:
            family = _linear_attention_fields(arch, cfg)
        return ModelConfig(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            # Qwen3.5-MoE: every layer's MLP is experts, and its config has no dense size
            intermediate_size=cfg.get("intermediate_size") or cfg["moe_intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("qk_rope_head_dim", 64) if arch in DEEPSEEK_ARCHITECTURES else
            cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            partial_rotary_factor=partial,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            # transformers' default where the key is absent: Gemma ties, the others do not
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch in GEMMA_ARCHITECTURES)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("qkv_bias", True) if arch == "Qwen2MoeForCausalLM"
                                                              else cfg.get("attention_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM",
                             *LINEAR_ATTENTION_ARCHITECTURES),
            sliding_window=sliding,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **moe,
            **family,
        )

    @staticmethod
    def from_path(path: str) -> "ModelConfig":
        with open(os.path.join(path, "config.json")) as f:
            return ModelConfig.from_hf_dict(json.load(f))

    # HF-like aliases so tools can read either spelling
    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def kv_groups(self) -> KVGroups:
        """How the attending layers share the KV cache's blocks (layout.py): one group, or Gemma's global and local
        ones. Indexed by attention layer (attention_index): a linear-attention layer keeps no KV."""
        return kv_groups(self.layer_windows, self.num_hidden_layers - len(self.linear_layers), self.sliding_window)

    def attention_index(self, layer: int) -> Optional[int]:
        """Layer's place among the layers that keep KV (its cache tensor and group), None for a linear one."""
        if layer in self.linear_layers:
            return None
        return layer - sum(1 for i in self.linear_layers if i < layer)

    @property
    def norm_offset(self) -> float:
        """What an RMSNorm adds to its weight: 1 where the norms are zero-centred (Gemma, Qwen3.5), else 0."""
        return 1.0 if self.gemma or self.zero_centered_norms else 0.0

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def cache_kv_heads(self) -> int:
        """The KV cache's heads per token: the model's kv heads, or latent attention's one latent."""
        return 1 if self.mla else self.num_key_value_heads

    @property
    def cache_head_dim(self) -> int:
        """The KV cache's dims per head: head_dim, or the latent and the rotary key (its value is the latent)."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def cache_value_dim(self) -> Optional[int]:
        """Latent attention's values: the first kv_lora_rank dims of each cached key (None: K and V apart)."""
        return self.kv_lora_rank if self.mla else None

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head that rotary embeddings turn (transformers' int(head_dim * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_cost_per_position(self) -> float:
        """What a prompt token's attention to one cached position costs, relative to the rest of its work (the
        projections and the MLP; multiply-adds, the active experts only): a token at depth d costs 1 + d * this.
        Layers with a sliding window count for nothing (their span stops growing); latent attention counts its
        latent and rotary dims."""
        H, hid = self.num_attention_heads, self.hidden_size
        if self.mla:
            qd = self.qk_nope_head_dim + self.qk_rope_head_dim
            per_pos = H * (self.kv_lora_rank + self.qk_rope_head_dim) + H * self.kv_lora_rank
            q = hid * self.q_lora_rank + self.q_lora_rank * H * qd if self.q_lora_rank else hid * H * qd
            attn_proj = q + hid * (self.kv_lora_rank + self.qk_rope_head_dim) \
                + self.kv_lora_rank * H * (self.qk_nope_head_dim + self.v_head_dim) + H * self.v_head_dim * hid
        else:
            per_pos = 2 * H * self.head_dim
            attn_proj = 2 * hid * H * self.head_dim + 2 * hid * self.num_key_value_heads * self.head_dim
        dense_mlp = 3 * hid * self.intermediate_size
        moe_mlp = 3 * hid * (self.num_experts_per_tok * self.moe_intermediate_size
                             + self.shared_expert_intermediate_size)
        moe = set(self.moe_layers)
        windows = self.layer_windows or (None,) * self.num_hidden_layers
        work = sum(attn_proj + (moe_mlp if i in moe else dense_mlp) for i in range(self.num_hidden_layers))
        attending = sum(per_pos for w in windows if w is None)
        return attending / work


KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8", "int4", "fp8", "fp8_e4m3", "fp8_e5m2")


def _gemma_fields(arch: str, cfg: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's Gemma fields (none for another architecture); which layers slide follows layout.py."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    allowed = ACTIVATIONS if arch in GEMMA_ARCHITECTURES else ("silu",)
    if act not in allowed:
        raise ValueError(f"{arch}: hidden activation {act!r} is not implemented; tokenmill's are {', '.join(allowed)}")
    if arch not in GEMMA_ARCHITECTURES:
        return {}
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{arch}: use_bidirectional_attention is not implemented (tokenmill's attention is causal)")
    local_rope = rope.get("sliding_attention") or {}
    if local_rope.get("rope_type", "default") != "default":
        raise ValueError(f"{arch}: rope type {local_rope['rope_type']!r} on the local layers is not implemented "
                         f"(tokenmill turns them unscaled)")
    unknown = sorted(set(cfg.get("layer_types") or ()) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(f"{arch}: layer type(s) {', '.join(unknown)} are not implemented")
    window = cfg.get("sliding_window")
    local = rope.get("sliding_attention", {}).get("rope_theta") if "sliding_attention" in rope else \
        cfg.get("rope_local_base_freq")
    return dict(hidden_act=act, gemma=True, query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
                attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
                final_logit_softcapping=cfg.get("final_logit_softcapping"),
                layer_windows=tuple(window if s else None for s in sliding_layers(
                    {**cfg, "model_type": "gemma2" if arch == "Gemma2ForCausalLM" else "gemma3_text"},
                    cfg["num_hidden_layers"])),
                rope_local_theta=float(local) if arch == "Gemma3ForCausalLM" and local else None)


def _gpt_oss_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's gpt-oss fields: sinks, biases, the clamped SwiGLU and each layer's window from layer_types."""
    unknown = sorted(set(cfg.get("layer_types") or ()) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(f"GptOssForCausalLM: layer type(s) {', '.join(unknown)} are not implemented")
    method = (cfg.get("quantization_config") or {}).get("quant_method", "mxfp4")
    if method != "mxfp4":
        raise ValueError(f"GptOssForCausalLM: {method!r} quantised experts are not implemented; load the published "
                         f"MXFP4 checkpoint or a dequantised (bfloat16) one")
    window = cfg.get("sliding_window")
    windows = tuple(window if s else None for s in sliding_layers({**cfg, "model_type": "gpt_oss"},
                                                                   cfg["num_hidden_layers"]))
    return dict(attention_sinks=True, o_proj_bias=bool(cfg.get("attention_bias", True)), expert_bias=True,
                hidden_act="swigluoai", swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
                layer_windows=windows if window is not None else ())


def _linear_attention_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's Qwen3.5 / Qwen3-Next fields: which layers are linear (layer_types, else every
    full_attention_interval-th layer attends, transformers' default) and the linear layers' sizes."""
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % cfg.get("full_attention_interval", 4) == 0
                                       else "linear_attention" for i in range(layers)]
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown or len(types) != layers:
        raise ValueError(f"{arch}: layer_types must be {layers} of linear_attention / full_attention; "
                         f"got {', '.join(unknown) or len(types)}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{arch}: hidden activation {act!r} is not implemented; tokenmill's is silu")
    return dict(linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
                linear_num_key_heads=cfg.get("linear_num_key_heads", 16),
                linear_num_value_heads=cfg.get("linear_num_value_heads", 32),
                linear_key_head_dim=cfg.get("linear_key_head_dim", 128),
                linear_value_head_dim=cfg.get("linear_value_head_dim", 128),
                linear_conv_kernel_dim=cfg.get("linear_conv_kernel_dim", 4), attn_output_gate=True,
                zero_centered_norms=True, linear_value_heads_tiled=bool(cfg.get("linear_value_heads_tiled", False)))


def _moe_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's Mixture-of-Experts fields from an HF config (none for a dense architecture). Mixtral's every
    layer is sparse and always renormalises; Qwen's layers are sparse every decoder_sparse_step-th layer but for
    mlp_only_layers (transformers' rule)."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    top_k = cfg.get("num_experts_per_tok") or 0
    if not 1 <= top_k <= experts:
        raise ValueError(f"{arch}: num_experts_per_tok={top_k} must be in [1, num_experts={experts}]")
    layers = cfg["num_hidden_layers"]
    if arch == "MixtralForCausalLM":
        return dict(moe_layers=tuple(range(layers)), num_experts=experts, num_experts_per_tok=top_k,
                    moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)
    if arch == "GptOssForCausalLM":       # a softmax over the top k logits only (those of the router's bias added)
        return dict(moe_layers=tuple(range(layers)), num_experts=experts, num_experts_per_tok=top_k,
                    moe_intermediate_size=cfg["intermediate_size"], moe_scoring="topk_softmax", router_bias=True)
    return dict(moe_layers=sparse_layers(layers, cfg.get("decoder_sparse_step"), cfg.get("mlp_only_layers")),
                num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=cfg["moe_intermediate_size"],
                # Qwen3.5-MoE always renormalises (its config has no key for it); Qwen3-Next does by default
                norm_topk_prob=arch == "Qwen3_5MoeForCausalLM" or bool(cfg.get("norm_topk_prob",
                                                                                arch == "Qwen3NextForCausalLM")),
                shared_expert_intermediate_size=(cfg.get("shared_expert_intermediate_size") or 0)
                if arch in SHARED_EXPERT_ARCHITECTURES else 0)


# transformers' DeepseekV2Config / DeepseekV3Config defaults, for keys a config.json leaves out
_DEEPSEEK_DEFAULTS = {
    "DeepseekV2ForCausalLM": dict(n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, q_lora_rank=1536,
                                  kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                  moe_intermediate_size=1407, first_k_dense_replace=0, routed_scaling_factor=1.0,
                                  topk_method="greedy", n_group=None, topk_group=None),
    "DeepseekV3ForCausalLM": dict(n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, q_lora_rank=1536,
                                  kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                  moe_intermediate_size=2048, first_k_dense_replace=3, routed_scaling_factor=2.5,
                                  norm_topk_prob=True, n_group=8, topk_group=4, rope_interleave=True),
}


def _deepseek_fields(arch: str, hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's latent attention and routing fields of DeepSeek-V2/V3, as transformers reads them (its
    defaults for keys left out): the layers from first_k_dense_replace on are sparse; V2 never renormalises its
    top-k weights; routers score in float32."""
    v3 = arch == "DeepseekV3ForCausalLM"
    cfg = {**_DEEPSEEK_DEFAULTS[arch], **hf}
    experts = cfg["n_routed_experts"] or 0
    top_k = cfg.get("num_experts_per_tok") or 0
    if not 1 <= top_k <= experts:
        raise ValueError(f"{arch}: num_experts_per_tok={top_k} must be in [1, n_routed_experts={experts}]")
    method = "group_limited_greedy" if v3 else cfg.get("topk_method") or "greedy"
    if method not in TOPK_METHODS:
        raise ValueError(f"{arch}: topk_method {method!r} is not implemented; tokenmill's are {', '.join(TOPK_METHODS)}")
    groups, topk_group = (cfg.get("n_group") or 1, cfg.get("topk_group") or 1) if method != "greedy" else (1, 1)
    if experts % groups or not 1 <= topk_group <= groups:
        raise ValueError(f"{arch}: n_group={groups} must divide n_routed_experts={experts}, and topk_group="
                         f"{topk_group} be in [1, n_group]")
    if not cfg.get("kv_lora_rank"):
        raise ValueError(f"{arch}: kv_lora_rank is required (latent attention)")
    layers = cfg["num_hidden_layers"]
    return dict(moe_layers=tuple(range(cfg.get("first_k_dense_replace") or 0, layers)), num_experts=experts,
                num_experts_per_tok=top_k, moe_intermediate_size=cfg["moe_intermediate_size"],
                norm_topk_prob=bool(cfg.get("norm_topk_prob")) and v3,
                shared_expert_intermediate_size=cfg["moe_intermediate_size"] * (cfg.get("n_shared_experts") or 0),
                shared_expert_gated=False, moe_scoring="sigmoid" if v3 else "softmax", router_float32=True,
                topk_method=method,
                n_group=groups, topk_group=topk_group, routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1)),
                kv_lora_rank=cfg["kv_lora_rank"], q_lora_rank=cfg.get("q_lora_rank"),
                qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                v_head_dim=cfg["v_head_dim"], rope_interleave=bool(cfg.get("rope_interleave", True)) or not v3)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_gb: Optional[float] = None   # None: a share of free memory
    memory_utilization: float = 0.3              # the share of free memory used when no size is given
    # vLLM's gpu_memory_utilization: the share of the device's whole memory this engine may hold; the KV cache gets
    # what it leaves after the memory already in use (the weights, the runner's own). None: memory_utilization
    gpu_memory_utilization: Optional[float] = None
    enable_prefix_caching: bool = True
    # vLLM's kv_cache_dtype: "auto" stores K/V in the model's dtype (token-exact with the float32 reference);
    # "bfloat16" halves the cache's bytes (twice the tokens in the same memory, half the bytes decode reads),
    # K/V rounded to bfloat16 while the math stays float32; "int8" stores int8 codes with a float32 scale per 32
    # values of a token's kv head (a quarter of float32's bytes plus the scales); "int4" 4-bit codes per group of
    # 32 with a half scale and min (llama.cpp's q4_1 layout: 5 bits a value); "fp8" (= "fp8_e4m3") and "fp8_e5m2"
    # 8-bit floats times a scale per kv head for the whole layer (vLLM's fp8 cache)
    cache_dtype: str = "auto"
    # vLLM's calculate_kv_scales: an fp8 cache's scales from the data (the first step's K/V, a fixed passage run at
    # start-up), not 1.0
    calculate_kv_scales: bool = False

    def __post_init__(self) -> None:
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.cache_dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.calculate_kv_scales and self.cache_dtype not in ("fp8", "fp8_e4m3", "fp8_e5m2"):
            raise ValueError(f"calculate_kv_scales=True computes an fp8 cache's scales, and kv_cache_dtype is "
                             f"{self.cache_dtype!r}; set kv_cache_dtype='fp8_e4m3' (or 'fp8_e5m2'), or leave it off")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    use_kv_cache: bool = True       # False: recompute the whole sequence every step (the seeds' O(n^2) baseline)
    # vLLM's async_scheduling: a step is scheduled and launched before the last one's tokens are back (they feed it
    # on the device); its tokens, stops and outputs are processed one step later
    async_scheduling: bool = False
    # Fair prefill, vLLM's knobs. A prompt with more than long_prefill_token_threshold tokens left to compute is
    # long, and no request computes more than that many in a step: a long prompt leaves the rest of the budget to
    # others and keeps each step short, so a request that arrives mid-step waits little (0: no cap; with
    # max_num_partial_prefills > 1, 0 means 4% of max_model_len, as in vLLM).
    long_prefill_token_threshold: int = 0
    # With max_num_partial_prefills > 1, at most that many prompts are left part-computed by a step, at most
    # max_long_partial_prefills of them long: a long prompt waits while one is prefilling and shorter ones pass it.
    # 1 (vLLM's default): no such limit, waiting prompts take what the budget leaves in arrival order.
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    # Beyond vLLM, for a device where a step costs what it computes (a CPU): with the threshold set, a long prompt's
    # chunk is threshold / (2 * (1 + depth * prefill_depth_cost)) tokens (at least 16), so its steps cost about what
    # half the threshold at the start does, whatever its depth (ModelConfig.attention_cost_per_position); and a
    # step in which a short prompt (all of it within the threshold) can start leaves out the long prompts' chunks,
    # never two steps running, so the short one's first token costs it one step of its own.
    prefill_depth_cost: float = 0.0
    short_prompts_first: bool = False
    # LoRA: the most adapters the running requests may use at once (0: no adapters); a request whose adapter
    # would be one more waits
    max_loras: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_num_partial_prefills"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0 (0: no cap on a prompt's tokens per step), "
                             f"got {self.long_prefill_token_threshold}")
        if self.prefill_depth_cost < 0:
            raise ValueError(f"prefill_depth_cost must be >= 0, got {self.prefill_depth_cost}")
        if not 1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills:
            raise ValueError(f"max_long_partial_prefills must be between 1 and max_num_partial_prefills "
                             f"({self.max_num_partial_prefills}), got {self.max_long_partial_prefills}; lower it or "
                             f"raise max_num_partial_prefills")
        if self.max_num_partial_prefills > 1:
            if self.long_prefill_token_threshold == 0:
                object.__setattr__(self, "long_prefill_token_threshold", max(1, int(self.max_model_len * 0.04)))
            if self.long_prefill_token_threshold > self.max_model_len:
                raise ValueError(f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) exceeds "
                                 f"max_model_len ({self.max_model_len}), so no prompt would count as long; lower it, "
                                 f"or set max_num_partial_prefills=1")

    CPU_LONG_PREFILL_TOKEN_THRESHOLD = 64

    @staticmethod
    def default_long_prefill_token_threshold(device_type: str, use_kv_cache: bool = True) -> int:
        """The engine's long_prefill_token_threshold when none is given (a server's: the offline LLM, whose requests
        are all there from the start, passes 0). On a CPU a prompt token costs milliseconds, so a step holding a
        whole budget of a long prompt keeps a newcomer waiting for seconds: the cap is small, yet holds a short chat
        (its template and system prompt included) whole, so that it starts and answers in one step. A GPU keeps
        vLLM's default (no cap); so does recompute mode (a cap would split every recompute)."""
        return SchedulerConfig.CPU_LONG_PREFILL_TOKEN_THRESHOLD if device_type == "cpu" and use_kv_cache else 0


CUDAGRAPH_MODES = ("NONE", "FULL_DECODE_ONLY")
MAX_CAPTURE_SIZE = 512


@dataclass(frozen=True)
class CompilationConfig:
    """vLLM's compilation_config, its CUDA-graph part. cudagraph_mode FULL_DECODE_ONLY captures the whole forward
    (embedding to logits) of a decode-only step for each of cudagraph_capture_sizes (rows) at start, and a step
    replays the smallest that holds it; NONE runs every step eagerly (enforce_eager). None: FULL_DECODE_ONLY on a
    GPU, NONE on a CPU (where a graph is a traced stand-in that checks graph safety, not a speed-up). The sizes
    default to vLLM's scheme up to max_cudagraph_capture_size (max_num_seqs, at most 512)."""
    cudagraph_mode: Optional[str] = None
    cudagraph_capture_sizes: Optional[tuple[int, ...]] = None
    max_cudagraph_capture_size: Optional[int] = None

    def __post_init__(self) -> None:
        if self.cudagraph_mode is not None and self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"compilation_config.cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}, got "
                             f"{self.cudagraph_mode!r}")
        sizes = self.cudagraph_capture_sizes
        if sizes is not None:
            if isinstance(sizes, (str, bytes)) or not all(isinstance(n, int) and not isinstance(n, bool)
                                                          for n in sizes):
                raise ValueError(f"compilation_config.cudagraph_capture_sizes must be a list of integers, got "
                                 f"{sizes!r}")
            bad = [n for n in sizes if n < 1]
            if bad:
                raise ValueError(f"compilation_config.cudagraph_capture_sizes must be positive; {bad} are not")
            object.__setattr__(self, "cudagraph_capture_sizes", tuple(sorted(set(sizes))))
        m = self.max_cudagraph_capture_size
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"compilation_config.max_cudagraph_capture_size must be a positive integer, got {m!r}")

    @staticmethod
    def of(value: Union["CompilationConfig", dict, None]) -> "CompilationConfig":
        if value is None:
            return CompilationConfig()
        if isinstance(value, CompilationConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"compilation_config must be a dict or a CompilationConfig, got {type(value).__name__}")
        known = {"cudagraph_mode", "cudagraph_capture_sizes", "max_cudagraph_capture_size"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"compilation_config has unknown keys {unknown}; tokenmill takes {sorted(known)}")
        return CompilationConfig(**value)

    def mode(self, device: torch.device, enforce_eager: bool) -> str:
        if enforce_eager:
            return "NONE"
        if self.cudagraph_mode is not None:
            return self.cudagraph_mode
        return "FULL_DECODE_ONLY" if device.type == "cuda" else "NONE"

    def capture_sizes(self, max_num_seqs: int) -> tuple[int, ...]:
        """The batch sizes (rows) to capture: the configured ones, which must not exceed max_num_seqs, else vLLM's
        1, 2, 4, then every 8 to 256 and every 16 past it, up to max_cudagraph_capture_size."""
        if self.cudagraph_capture_sizes is not None:
            over = [n for n in self.cudagraph_capture_sizes if n > max_num_seqs]
            if over:
                raise ValueError(f"compilation_config.cudagraph_capture_sizes {over} exceed max_num_seqs="
                                 f"{max_num_seqs}; lower them or raise max_num_seqs")
            return self.cudagraph_capture_sizes
        cap = min(self.max_cudagraph_capture_size or MAX_CAPTURE_SIZE, max_num_seqs)
        sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, MAX_CAPTURE_SIZE + 1, 16))
        return tuple(n for n in sizes if n <= cap) or (cap,)


@dataclass(frozen=True)
class LoRAConfig:
    """vLLM's engine options: adapters in one step (max_loras, each in a slot of the stacks), their largest rank
    (max_lora_rank: the stacks' width), and adapters kept loaded in host memory (max_cpu_loras)."""
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None

    def __post_init__(self):
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank must be in [1, 512] (vLLM's range), got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    dtype: torch.dtype
    device: torch.device
    attention_backend: str = "auto"   # "auto" | "torch" (reference) | "batched" | "cpu" (C kernel) | "triton"
    # a GGUF's matrices stay in their quantised blocks on CPU, read by the kernels (layers/quant.py); False
    # dequantises them to float at load (the plain path the kernels are tested against)
    quantized_kernels: bool = True
    # the CPU kernel library's variant: "auto" (TOKENMILL_CPU_ISA, else the best this CPU runs), "avx512", "avx2",
    # "neon", "generic", or "reference" (plain torch for every op)
    cpu_kernels: str = "auto"
    seed: int = 0
    # compute threads: None = the cores this process may use (affinity, cgroup quota), fewer while other
    # processes hold some of them (executor/cpus.py); N = exactly N
    num_threads: Optional[int] = None
    # the graph captures ("NONE": every step eager) and their sizes (rows)
    cudagraph_mode: str = "NONE"
    cudagraph_capture_sizes: tuple[int, ...] = ()
    lora_config: Optional[LoRAConfig] = None      # None: no adapters (enable_lora=False)

    @property
    def kv_cache_dtype(self) -> str:
        """The KV cache's dtype by name (cache_config.cache_dtype; "auto": the model's dtype)."""
        cache_dtype = self.cache_config.cache_dtype
        if cache_dtype == "auto":
            return str(self.dtype).removeprefix("torch.")
        return "fp8_e4m3" if cache_dtype == "fp8" else cache_dtype


def default_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return gpu_half_dtype(torch.cuda.is_bf16_supported())
    # bfloat16 pays on CPUs with native support (AVX512-BF16 / AMX); emulated bf16 is slower than fp32
    return torch.bfloat16 if _cpu_has_bf16() else torch.float32


def _cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
        return "avx512_bf16" in flags or "amx_bf16" in flags
    except OSError:
        return False


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default_dtype(device)
    if isinstance(dtype, torch.dtype):
        out = dtype
    elif dtype in _DTYPES:
        out = _DTYPES[dtype]
    else:
        raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {dtype!r}")
    if device.type == "cpu" and out == torch.float16:
        raise ValueError("dtype float16 is not supported on CPU; use float32 or bfloat16")
    if device.type == "cuda" and out == torch.bfloat16:
        return gpu_half_dtype(torch.cuda.is_bf16_supported())
    return out


def gpu_half_dtype(bf16_supported: bool) -> torch.dtype:
    """bfloat16 where the GPU computes it (Ampere and later), else float16, said once."""
    if bf16_supported:
        return torch.bfloat16
    logging.getLogger("tokenmill").warning("this GPU has no bfloat16 (it needs compute capability 8.0, Ampere); "
                                           "the model runs in float16")
    return torch.float16
