"""Phi-3 / Phi-4-mini: fused qkv and gate_up in the checkpoint, longrope, rotary on part of each head. Greedy tokens
equal transformers' for generations that cross the pretraining length (where longrope switches factors), under
chunked prefill, prefix hits, preemption and a sliding window, and from GGUF files in llama.cpp's names. (The
mixed-length batch with logprobs is test_models.py's.)"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.family_checks import (PRESSURE, check_blocks_equal_dequantised, check_prefix_hits, check_under_pressure,
                                 gguf_put, gguf_shape, greedy)
from tests.tiny_models import build_tiny, hf_greedy, random_prompts
from tokenmill import LLM
from tokenmill.config import ModelConfig

ENGINE = dict(dtype="float32", kv_cache_memory_gb=0.02, max_model_len=512)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    return build_tiny("phi3", tmp_path_factory.mktemp("phi3"))


@torch.no_grad()
def hf_stepped(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens one cached step at a time. (Its generate() differs past the pretraining length:
    Phi-3's prepare_inputs_for_generation drops the cache there and recomputes every key with the long factors.)"""
    out = hf(torch.tensor([prompt]), use_cache=True)
    toks = [int(out.logits[0, -1].argmax())]
    for i in range(n - 1):
        out = hf(torch.tensor([[toks[-1]]]), past_key_values=out.past_key_values,
                 position_ids=torch.tensor([[len(prompt) + i]]), use_cache=True)
        toks.append(int(out.logits[0, -1].argmax()))
    return toks


def test_crossing_the_pretraining_length(phi3):
    """original_max_position_embeddings is 128: prompts of 100-127 tokens generate past it, where each position
    from 128 on is rotated by the long factors, as transformers' cached steps rotate it. And the rotation covers 12
    of each head's 16 dims."""
    from transformers import AutoModelForCausalLM
    path, _ = phi3
    llm = LLM(path, **ENGINE)
    assert llm.llm_engine.model_config.rotary_dim == 12
    prompts = random_prompts([100, 127, 120], seed=11)
    for p, got in zip(prompts, greedy(llm, prompts, 40)):
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()   # its rotary keeps state
        assert got == hf_stepped(hf, p, 40), len(p)


@pytest.mark.parametrize("pressure", PRESSURE)
def test_under_pressure(phi3, pressure):
    check_under_pressure(*phi3, ENGINE, pressure)


def test_prefix_hits(phi3):
    check_prefix_hits(*phi3, ENGINE)


def test_sliding_window(tmp_path):
    from transformers import AutoModelForCausalLM, Phi3Config
    torch.manual_seed(5)
    cfg = Phi3Config(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, sliding_window=24, max_position_embeddings=512, eos_token_id=None,
                     bos_token_id=None, pad_token_id=None, initializer_range=0.1)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path)
    prompts = random_prompts([60, 10, 45], seed=2)
    for p, got in zip(prompts, greedy(LLM(str(tmp_path), **ENGINE), prompts, 30)):
        assert got == hf_greedy(hf, p, 30)


def test_unimplemented_rope_is_named(phi3):
    cfg = json.loads(open(f"{phi3[0]}/config.json").read())
    bad = {**cfg, "rope_parameters": {**cfg["rope_parameters"], "rope_type": "su"}}
    with pytest.raises(ValueError, match="rope type 'su' is not implemented; tokenmill's are linear, llama3, yarn, "
                                         "longrope"):
        ModelConfig.from_hf_dict(bad)
    with pytest.raises(ValueError, match="longrope needs short_factor in the config"):
        ModelConfig.from_hf_dict({**cfg, "rope_parameters": {k: v for k, v in cfg["rope_parameters"].items()
                                                             if k != "short_factor"}})
    short = {**cfg, "rope_parameters": {**cfg["rope_parameters"], "short_factor": [1.0] * 5}}
    with pytest.raises(ValueError, match="longrope factors have 5 entries; the rotary dims need 6"):
        LLM(_saved(phi3[0], short), **ENGINE)


def _saved(path: str, cfg: dict) -> str:
    import shutil
    import tempfile
    out = tempfile.mkdtemp()
    shutil.copytree(path, out, dirs_exist_ok=True)
    with open(f"{out}/config.json", "w") as f:
        json.dump(cfg, f)
    return out


# ---- GGUF ----------------------------------------------------------------------------------------------------------
def write_phi3_gguf(hf_path: str, out, qtype=None) -> None:
    """As llama.cpp's converter writes Phi-3: attn_qkv and ffn_up (gate and up) fused, the longrope factors as
    rope_factors_long/short tensors, rope.dimension_count the rotated dims. Matrices in qtype (else F32)."""
    import gguf
    from safetensors.numpy import load_file
    cfg = json.loads(open(f"{hf_path}/config.json").read())
    rope = cfg["rope_parameters"]
    sd = load_file(f"{hf_path}/model.safetensors")
    H, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = H // heads
    w = gguf.GGUFWriter(str(out), "phi3")
    gguf_shape(w, cfg, cfg["num_key_value_heads"])
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])

    put = gguf_put(w)

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("rope_factors_long.weight", np.array(rope["long_factor"]))
    put("rope_factors_short.weight", np.array(rope["short_factor"]))
    for i in range(cfg["num_hidden_layers"]):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        put(p + "attn_norm.weight", sd[h + "input_layernorm.weight"])
        put(p + "attn_qkv.weight", sd[h + "self_attn.qkv_proj.weight"], qtype)
        put(p + "attn_output.weight", sd[h + "self_attn.o_proj.weight"], qtype)
        put(p + "ffn_norm.weight", sd[h + "post_attention_layernorm.weight"])
        put(p + "ffn_up.weight", sd[h + "mlp.gate_up_proj.weight"], qtype)
        put(p + "ffn_down.weight", sd[h + "mlp.down_proj.weight"], qtype)
    put("output_norm.weight", sd["model.norm.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_gives_transformers_tokens(phi3, tmp_path):
    path, hf = phi3
    write_phi3_gguf(path, tmp_path / "phi3.gguf")
    llm = LLM(str(tmp_path / "phi3.gguf"), **ENGINE, tokenizer=None)
    mc = llm.llm_engine.model_config
    assert mc.architecture == "Phi3ForCausalLM" and mc.rotary_dim == 12 and mc.rope_scaling["rope_type"] == "longrope"
    prompts = random_prompts([3, 30, 120], seed=8)           # the last crosses the pretraining length
    for p, got in zip(prompts, greedy(llm, prompts, 20)):
        assert got == hf_stepped(hf, p, 20)


def test_gguf_quantised_stays_in_blocks(phi3, tmp_path):
    import gguf
    write_phi3_gguf(phi3[0], tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    blocks = check_blocks_equal_dequantised(str(tmp_path / "q8.gguf"), ENGINE)
    assert blocks.llm_engine.model.layers[0].self_attn.qkv_proj.quant is not None
