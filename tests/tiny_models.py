"""Tiny random models of each supported architecture, and transformers' greedy continuation as the oracle."""
from __future__ import annotations

import random
from pathlib import Path

import torch

VOCAB = 320


def _configs() -> dict:
    from transformers import (DeepseekV2Config, DeepseekV3Config, Gemma2Config, Gemma3TextConfig, GptOssConfig,
                              LlamaConfig, MistralConfig, MixtralConfig, Phi3Config, Qwen2Config, Qwen2MoeConfig,
                              Qwen3Config, Qwen3MoeConfig)
    from transformers.models.qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_next import Qwen3NextConfig
    common = dict(vocab_size=VOCAB, max_position_embeddings=512, eos_token_id=None, bos_token_id=None,
                  pad_token_id=None, initializer_range=0.1)
    return {
        # GQA, uneven sizes, llama3 rope scaling
        "llama": lambda: LlamaConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
                                     num_key_value_heads=2, rope_theta=500000.0,
                                     rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                     **common),
        # MQA, tied embeddings, linear rope scaling
        "llama_mqa_tied": lambda: LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
                                              rope_scaling={"rope_type": "linear", "factor": 2.0}, **common),
        # yarn rope scaling
        "llama_yarn": lambda: LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2,
                                          rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                        "original_max_position_embeddings": 128}, **common),
        "mistral": lambda: MistralConfig(hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                                         num_attention_heads=8, num_key_value_heads=2, sliding_window=None, **common),
        # a window shorter than the prompts, so attention past the window is exercised
        "mistral_sw": lambda: MistralConfig(hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                                            num_attention_heads=4, num_key_value_heads=2, sliding_window=24,
                                            **common),
        "qwen2": lambda: Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                                     num_key_value_heads=2, tie_word_embeddings=False, **common),
        # explicit head_dim unequal to hidden / heads, q/k norm
        # the CPU kernels' edges: 144 query heads in groups of 8, and head_dim 256
        "heads144": lambda: LlamaConfig(hidden_size=144, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=144, num_key_value_heads=18, head_dim=16, **common),
        "head_dim256": lambda: LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=256, **common),
        # Phi-3 / Phi-4-mini: fused qkv and gate_up in the checkpoint, longrope, rotary on 3/4 of each head
        "phi3": lambda: Phi3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, original_max_position_embeddings=128,
                                   partial_rotary_factor=0.75, tie_word_embeddings=True,
                                   rope_scaling={"rope_type": "longrope",
                                                 "short_factor": [1.0 + 0.1 * i for i in range(6)],
                                                 "long_factor": [2.0 + 0.5 * i for i in range(6)]}, **common),
        # Gemma 2: soft-capped scores and logits, every other layer local with a window shorter than the prompts
        "gemma2": lambda: Gemma2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
                                       sliding_window=16, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                       **common),
        # Gemma 3: q/k norms, 5 local layers (base 10000, unscaled) to 1 global (base 1e6, linear x8), head_dim 64
        "gemma3": lambda: Gemma3TextConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=7,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                           sliding_window=16, rope_scaling={"rope_type": "linear", "factor": 8.0},
                                           **common),
        # Mixture-of-Experts: top-2 of 4 experts (renormalised); a window shorter than the prompts
        "mixtral": lambda: MixtralConfig(hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                         sliding_window=None, **common),
        # top-2 of 6 without renormalising, a shared expert behind its gate, and a dense first layer
        "qwen2_moe": lambda: Qwen2MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                            shared_expert_intermediate_size=80, num_hidden_layers=3,
                                            num_attention_heads=4, num_key_value_heads=2, num_experts=6,
                                            num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[0],
                                            tie_word_embeddings=False, **common),
        # top-3 of 8, renormalised, q/k norm, every second layer sparse
        "qwen3_moe": lambda: Qwen3MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=24, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True,
                                            decoder_sparse_step=2, tie_word_embeddings=False, **common),
        "qwen3": lambda: Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=24, tie_word_embeddings=False, **common),
        # gpt-oss: sinks (build_tiny makes them and the experts' biases random), every other layer local with a
        # window shorter than the prompts, top-2 of 4 biased experts whose SwiGLU clamps at 1 (of values about that
        # size) and whose sizes are whole MXFP4 groups of 32, yarn rope that does not truncate its correction range
        "gpt_oss": lambda: GptOssConfig(
            hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
            # transformers before 5.2x (the GPU image's 5.17) clamps at 7 whatever the config says
            swiglu_limit=1.0 if hasattr(GptOssConfig, "swiglu_limit") else 7.0,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 128, "rope_theta": 150000.0},
            **common),
        # Qwen3.5: linear-attention (Gated DeltaNet) layers around one gated full-attention layer, 2 q/k heads serving
        # 4 value heads, a quarter of each attending head rotated
        "qwen3_5": lambda: Qwen3_5TextConfig(
            hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=8, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"], **common),
        # Qwen3-Next: Qwen3.5's layers with q/k/v/z and b/a projected grouped by key head, and top-2 of 4 experts
        # beside a gated shared expert (the first layer's MLP dense)
        "qwen3_next": lambda: Qwen3NextConfig(
            hidden_size=64, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0], num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"], **common),
        # Qwen3.5-MoE: Qwen3.5's layers, every MLP top-2 of 4 experts (always renormalised) and a gated shared one
        "qwen3_5_moe": lambda: Qwen3_5MoeTextConfig(
            hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
            num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"], **common),
        # latent attention without a query bottleneck; top-2 of 8 experts within the best 1 of 2 groups (softmax,
        # not renormalised), one shared expert, a dense first layer; layer norms' eps 1e-5 (the latent's stay 1e-6)
        "deepseek_v2": lambda: DeepseekV2Config(
            hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=24,
            v_head_dim=20, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
            topk_method="group_limited_greedy", n_group=2, topk_group=1, routed_scaling_factor=2.0,
            tie_word_embeddings=False, rms_norm_eps=1e-5, **common),
        # a query bottleneck, interleaved rope with yarn scaling (its softmax mscale), sigmoid routing with a bias
        # (build_tiny makes it random) over the best 2 of 4 groups, renormalised and scaled
        "deepseek_v3": lambda: DeepseekV3Config(
            hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=24,
            v_head_dim=20, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
            n_group=4, topk_group=2, routed_scaling_factor=2.5, tie_word_embeddings=False,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                          "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}, **common),
    }


ARCHS = ["llama", "llama_mqa_tied", "llama_yarn", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mixtral",
         "qwen2_moe", "qwen3_moe", "gpt_oss"]


def build_tiny(kind: str, path: Path, seed: int = 0):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    cfg = _configs()[kind]()
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):      # zeros at init: random, so that the choice uses it
            buf.copy_(torch.rand_like(buf) * 0.5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):              # about the scores' size, so each takes a real share
                p.copy_(torch.rand_like(p) * 3 - 1)
            elif name.endswith(("gate_up_proj_bias", "down_proj_bias")):   # zeros at init
                p.copy_(torch.randn_like(p) * 0.2)
            elif kind in ("qwen3_5", "qwen3_next", "qwen3_5_moe") and name.endswith("norm.weight"):
                p.copy_(torch.randn_like(p) * 0.2)      # zero-centred norms: 0 is the identity
    model.save_pretrained(path)
    return str(path), model


def mxfp4_checkpoint(src: str, dst: Path) -> str:
    """The float gpt-oss folder src with its experts' matrices in MXFP4, as gpt-oss is published: `<name>_blocks`
    [E, out, in / 32, 16] (two e2m1 codes a byte, the low nibble first) and `<name>_scales` [E, out, in / 32]
    (E8M0), rounded by gguf-py's MXFP4 quantiser (llama.cpp's)."""
    import json
    import shutil

    import gguf
    import numpy as np
    from safetensors.torch import load_file, save_file
    dst.mkdir(parents=True, exist_ok=True)
    out = {}
    for f in sorted(Path(src).iterdir()):
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
            continue
        for name, t in load_file(f).items():
            if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                out[name] = t
                continue
            w = t.transpose(1, 2).contiguous().numpy()                  # [E, out, in]
            E, n, k = w.shape
            raw = np.asarray(gguf.quants.quantize(w.reshape(E * n, k), gguf.GGMLQuantizationType.MXFP4))
            raw = raw.reshape(E, n, k // 32, 17)                        # ggml: e, then codes j | j + 16 << 4
            codes = np.stack([raw[..., 1:] & 15, raw[..., 1:] >> 4], axis=-2).reshape(E, n, k // 32, 32)
            out[name + "_blocks"] = torch.from_numpy(np.ascontiguousarray(codes[..., 0::2] | codes[..., 1::2] << 4))
            out[name + "_scales"] = torch.from_numpy(np.ascontiguousarray(raw[..., 0]))
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def random_prompts(lengths, seed: int = 0) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(VOCAB) for _ in range(n)] for n in lengths]


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def hf_logprobs(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """log p(generated[i] | prefix) under transformers, for each i (one full forward)."""
    ids = torch.tensor([prompt + generated])
    logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(generated))
    return lp[pos, torch.tensor(generated)]
