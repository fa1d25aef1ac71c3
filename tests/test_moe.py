"""Mixture-of-Experts (Mixtral, Qwen2-MoE, Qwen3-MoE): greedy tokens equal transformers' under chunked prefill,
prefix hits, preemption and a sliding window; the grouped expert op equals a plain per-token sum and runs each
active expert once; options outside what is implemented are refused by name. (The mixed-length batch against
transformers, with logprobs, is test_models.py's, over every family.)"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.family_checks import (PRESSURE, check_blocks_equal_dequantised, check_prefix_hits, check_under_pressure,
                                 gguf_put, gguf_shape)
from tests.tiny_models import build_tiny, hf_greedy, random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.config import ModelConfig
from tokenmill.executor.ops.reference import ReferenceOps

MOE = ["mixtral", "qwen2_moe", "qwen3_moe"]
ENGINE = dict(dtype="float32", kv_cache_memory_gb=0.02, max_model_len=512)


@pytest.fixture(scope="module", params=MOE)
def moe(request, tmp_path_factory):
    return build_tiny(request.param, tmp_path_factory.mktemp(request.param))


def test_layers_are_sparse_where_transformers_makes_them(moe):
    path, hf = moe
    ours = LLM(path, **ENGINE).llm_engine.model
    for layer, theirs in zip(ours.layers, hf.model.layers):
        assert hasattr(layer.mlp, "experts") == hasattr(theirs.mlp, "experts")
    assert any(hasattr(layer.mlp, "experts") for layer in ours.layers)


@pytest.mark.slow
@pytest.mark.parametrize("pressure", PRESSURE)
def test_greedy_matches_transformers_under_pressure(moe, pressure):
    check_under_pressure(*moe, ENGINE, pressure)


def test_prefix_hits_match_transformers(moe):
    check_prefix_hits(*moe, ENGINE)


def test_sliding_window_mixtral(tmp_path):
    """Mixtral with a window of 24 and prompts longer than it."""
    from transformers import AutoModelForCausalLM, MixtralConfig
    torch.manual_seed(3)
    cfg = MixtralConfig(vocab_size=320, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        sliding_window=24, max_position_embeddings=512, eos_token_id=None, bos_token_id=None,
                        pad_token_id=None, initializer_range=0.1)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path)
    prompts = random_prompts([60, 10, 45], seed=2)
    outs = LLM(str(tmp_path), **ENGINE).generate([{"prompt_token_ids": p} for p in prompts],
                                                SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                                                use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 30)


# ---- the grouped op ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (7, 8, 3), (50, 6, 2), (3, 64, 4)])
def test_fused_moe_equals_a_per_token_sum(T, E, k):
    """Each token's output is the weighted sum of its experts' outputs, and each expert that got tokens runs once
    (on all its tokens at once); experts that got none do not run."""
    torch.manual_seed(T * E + k)
    H = 16
    mats = [torch.randn(H, H) * 0.3 for _ in range(E)]
    runs: list[tuple[int, int]] = []

    def expert(e):
        def run(rows):
            runs.append((e, rows.shape[0]))
            return torch.tanh(rows @ mats[e])
        return run

    x = torch.randn(T, H)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    weights = torch.rand(T, k)
    got = ReferenceOps().fused_moe(x, weights, ids, [expert(e) for e in range(E)])
    want = torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            want[t] += weights[t, j] * torch.tanh(x[t] @ mats[int(ids[t, j])])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert sorted(runs) == sorted(Counter(ids.flatten().tolist()).items())


# ---- bad input ---------------------------------------------------------------------------------------------------
def _moe_config(**over) -> dict:
    cfg = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=32, hidden_size=16, intermediate_size=32,
               moe_intermediate_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
               num_experts=4, num_experts_per_tok=2)
    return {**cfg, **over}


def test_unimplemented_options_are_named():
    assert ModelConfig.from_hf_dict(_moe_config()).moe_layers == (0, 1)
    with pytest.raises(ValueError, match=r"num_experts_per_tok=5 must be in \[1, num_experts=4\]"):
        ModelConfig.from_hf_dict(_moe_config(num_experts_per_tok=5))
    with pytest.raises(ValueError, match="hidden activation 'gelu' is not implemented; tokenmill's are silu"):
        ModelConfig.from_hf_dict(_moe_config(hidden_act="gelu"))
    with pytest.raises(ValueError, match="unsupported architecture 'Gemma4ForCausalLM'; tokenmill supports .*"
                                         "MixtralForCausalLM"):
        ModelConfig.from_hf_dict(_moe_config(architectures=["Gemma4ForCausalLM"]))
    # a window on some layers only (Qwen's max_window_layers) would be served wrong on all: refused
    with pytest.raises(ValueError, match="sliding windows on some layers only"):
        ModelConfig.from_hf_dict(_moe_config(use_sliding_window=True, sliding_window=64,
                                             layer_types=["full_attention", "sliding_attention"]))


def test_quantising_at_load_keeps_the_router_float(moe):
    """quantization= rounds the experts' matrices, never the router's (rounding it changes which experts run)."""
    path, _ = moe
    model = LLM(path, **ENGINE, quantization="int8").llm_engine.model
    sparse = [layer.mlp for layer in model.layers if hasattr(layer.mlp, "experts")]
    assert all(m.gate.quant is None and m.experts[0].gate_up_proj.quant is not None for m in sparse)
    assert all(m.shared_expert_gate is None or m.shared_expert_gate.quant is None for m in sparse)


def test_a_missing_expert_is_named(moe, tmp_path):
    from safetensors.torch import load_file, save_file
    import shutil
    path, _ = moe
    shutil.copytree(path, tmp_path / "m")
    tensors = load_file(str(tmp_path / "m" / "model.safetensors"))
    gone = next(n for n in tensors if ".experts.1." in n)
    del tensors[gone]
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"checkpoint is missing .*experts\.1\."):
        LLM(str(tmp_path / "m"), **ENGINE)


# ---- GGUF: llama.cpp's names, written here with gguf-py -----------------------------------------------------------
GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}


def write_moe_gguf(kind: str, hf_path: str, out, expert_type=None) -> None:
    """The tiny HF model as llama.cpp's converter writes it: a layer's experts stacked in one [experts, rows,
    columns] tensor each (ffn_gate_exps, ffn_up_exps, ffn_down_exps), the router as ffn_gate_inp, Qwen2-MoE's
    shared expert as ffn_*_shexp; llama-arch q/k rows interleaved per head. Expert tensors in expert_type (a
    gguf.GGMLQuantizationType), everything else F32."""
    import json
    import gguf
    import numpy as np
    from safetensors.numpy import load_file
    cfg = json.loads(open(f"{hf_path}/config.json").read())
    sd = load_file(f"{hf_path}/model.safetensors")
    arch = GGUF_ARCH[kind]
    L, H = cfg["num_hidden_layers"], cfg["hidden_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or H // heads
    E = cfg.get("num_experts") or cfg["num_local_experts"]
    w = gguf.GGUFWriter(str(out), arch)
    gguf_shape(w, cfg, kv)
    if head_dim != H // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_expert_count(E)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if kind != "mixtral":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if kind == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])

    def permute(x, n):
        return x.reshape(n, 2, x.shape[0] // n // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    put = gguf_put(w)

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(L):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        put(p + "attn_norm.weight", sd[h + "input_layernorm.weight"])
        q, k = sd[h + "self_attn.q_proj.weight"], sd[h + "self_attn.k_proj.weight"]
        put(p + "attn_q.weight", permute(q, heads) if arch == "llama" else q)
        put(p + "attn_k.weight", permute(k, kv) if arch == "llama" else k)
        put(p + "attn_v.weight", sd[h + "self_attn.v_proj.weight"])
        put(p + "attn_output.weight", sd[h + "self_attn.o_proj.weight"])
        for x in "qkv":
            if h + f"self_attn.{x}_proj.bias" in sd:
                put(p + f"attn_{x}.bias", sd[h + f"self_attn.{x}_proj.bias"])
        for x in "qk":
            if h + f"self_attn.{x}_norm.weight" in sd:
                put(p + f"attn_{x}_norm.weight", sd[h + f"self_attn.{x}_norm.weight"])
        put(p + "ffn_norm.weight", sd[h + "post_attention_layernorm.weight"])
        moe = h + ("block_sparse_moe." if kind == "mixtral" else "mlp.")
        if moe + "gate.weight" not in sd:                 # a dense layer
            for x in ("gate", "up", "down"):
                put(p + f"ffn_{x}.weight", sd[h + f"mlp.{x}_proj.weight"])
            continue
        put(p + "ffn_gate_inp.weight", sd[moe + "gate.weight"])
        names = {"gate": "w1", "up": "w3", "down": "w2"} if kind == "mixtral" else \
            {x: f"{x}_proj" for x in ("gate", "up", "down")}
        for x, hf_name in names.items():
            put(p + f"ffn_{x}_exps.weight", np.stack([sd[f"{moe}experts.{e}.{hf_name}.weight"] for e in range(E)]),
                expert_type)
        if kind == "qwen2_moe":
            for x in ("gate", "up", "down"):
                put(p + f"ffn_{x}_shexp.weight", sd[h + f"mlp.shared_expert.{x}_proj.weight"])
            put(p + "ffn_gate_inp_shexp.weight", sd[h + "mlp.shared_expert_gate.weight"][0])
    put("output_norm.weight", sd["model.norm.weight"])
    if "lm_head.weight" in sd:
        put("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_gives_transformers_tokens(moe, tmp_path):
    """The same model written to GGUF (F32) gives transformers' greedy tokens, for a mixed-length batch."""
    path, hf = moe
    kind = next(k for k in MOE if k in path)
    write_moe_gguf(kind, path, tmp_path / "m.gguf")
    llm = LLM(str(tmp_path / "m.gguf"), **ENGINE, tokenizer=None)
    assert llm.llm_engine.model_config.architecture == hf.config.architectures[0]
    prompts = random_prompts([3, 30, 17], seed=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 20)


def test_gguf_experts_stay_quantised(tmp_path_factory):
    """Q8_0 and Q4_0 experts are read from their blocks (no float copy), and give the tokens of the same weights
    dequantised at load."""
    import gguf
    from tokenmill.executor.layers.quant import QuantWeight
    path, _ = build_tiny("qwen2_moe", tmp_path_factory.mktemp("q_moe"))
    out = tmp_path_factory.mktemp("q_gguf")
    for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0):
        write_moe_gguf("qwen2_moe", path, out / f"{qtype.name}.gguf", qtype)
        blocks = check_blocks_equal_dequantised(str(out / f"{qtype.name}.gguf"), ENGINE)
        expert = blocks.llm_engine.model.layers[1].mlp.experts[0]
        assert isinstance(expert.gate_up_proj.quant, QuantWeight) and expert.gate_up_proj.weight is None
