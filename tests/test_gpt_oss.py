"""gpt-oss (GptOssForCausalLM) from an HF folder: attention sinks, every other layer local with a window shorter than
the prompts, biased experts with the clamped SwiGLU, a router softmaxed over its top k. Greedy tokens equal
transformers' through every attention backend, under chunked prefill, preemption and prefix hits, and the sinks
count as transformers counts them. MXFP4 experts, as gpt-oss is published, stay in their 4-bit blocks and give the
tokens of transformers' own MXFP4 loader. (The mixed batch with logprobs, the kernel plans and n-gram speculation are
test_models.py's, test_plans.py's and test_spec_decode.py's, as for every family.)"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.family_checks import (PRESSURE, check_past_the_window, check_prefix_hits, check_under_pressure, gguf_put,
                                 gguf_shape, greedy)
from tests.tiny_models import build_tiny, hf_greedy, hf_logprobs, mxfp4_checkpoint, random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.config import ModelConfig
from tokenmill.executor.layers.quant import GGMLWeight, RowParts

ENGINE = dict(dtype="float32", kv_cache_memory_gb=0.02, max_model_len=512)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return build_tiny("gpt_oss", tmp_path_factory.mktemp("gpt_oss"))


def test_config_reads_windows_sinks_and_experts(gpt_oss):
    path, hf = gpt_oss
    mc = ModelConfig.from_path(path)
    assert [w is not None for w in mc.layer_windows] == [t == "sliding_attention" for t in hf.config.layer_types]
    assert set(mc.layer_windows) == {16, None} and mc.kv_groups.hybrid
    assert mc.attention_sinks and mc.o_proj_bias and mc.expert_bias and mc.router_bias
    assert (mc.hidden_act, mc.swiglu_limit, mc.swiglu_alpha) == ("swigluoai", hf.config.swiglu_limit, 1.702)
    assert mc.moe_layers == (0, 1, 2) and mc.moe_scoring == "topk_softmax"


@pytest.mark.parametrize("backend", ["auto", "batched", "torch"])
def test_long_prompts_past_the_window(gpt_oss, backend):
    check_past_the_window(*gpt_oss, ENGINE, backend)


def test_sinks_count_as_transformers_counts_them(gpt_oss, tmp_path):
    """Logprobs within 1e-4 of transformers'; the same model with its sinks dropped (-inf: no share) is further
    from them than that, so an engine that ignored the sinks would fail here."""
    path, hf = gpt_oss
    prompt = random_prompts([40], seed=3)[0]
    out = LLM(path, **ENGINE).generate([{"prompt_token_ids": prompt}],
                                       SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0),
                                       use_tqdm=False)[0].outputs[0]
    ours = torch.tensor([lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)])
    want = hf_logprobs(hf, prompt, out.token_ids)
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=0)
    with torch.no_grad():
        saved = [layer.self_attn.sinks.clone() for layer in hf.model.layers]
        for layer in hf.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))
        try:
            without = hf_logprobs(hf, prompt, out.token_ids)
        finally:
            for layer, s in zip(hf.model.layers, saved):
                layer.self_attn.sinks.copy_(s)
    assert (without - want).abs().max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("pressure", list(PRESSURE))
def test_greedy_under_pressure(gpt_oss, pressure):
    check_under_pressure(*gpt_oss, ENGINE, pressure)


@pytest.mark.slow
def test_prefix_hits(gpt_oss):
    check_prefix_hits(*gpt_oss, ENGINE)


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(gpt_oss, tmp_path_factory):
    """The tiny model's MXFP4 folder, and transformers' model of it (its loader dequantises on a CPU)."""
    from transformers import AutoModelForCausalLM
    path = mxfp4_checkpoint(gpt_oss[0], tmp_path_factory.mktemp("gpt_oss_mxfp4"))
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_mxfp4_experts_read_as_transformers_reads_them(gpt_oss_mxfp4):
    """The folder's blocks, dequantised by our reader, are transformers' expert weights bit for bit."""
    from tokenmill.executor.loader import open_checkpoint
    path, hf = gpt_oss_mxfp4
    ours = dict(open_checkpoint(path).tensors(keep_blocks=False))
    for i, layer in enumerate(hf.model.layers):
        for proj in ("gate_up_proj", "down_proj"):
            assert torch.equal(ours[f"model.layers.{i}.mlp.experts.{proj}"], getattr(layer.mlp.experts, proj))


# the exact route: on the default one a quantised model's float head is made Q8_0 (as llama.cpp's mixes keep it)
EXACT = dict(ENGINE, int8_activations=False)


@pytest.mark.parametrize("engine", [{}, pytest.param({"max_num_batched_tokens": 16}, marks=pytest.mark.slow),
                                    pytest.param({"quantized_kernels": False}, marks=pytest.mark.slow)],
                         ids=["blocks", "chunked", "dequantised"])
def test_mxfp4_experts_give_transformers_tokens(gpt_oss_mxfp4, engine):
    path, hf = gpt_oss_mxfp4
    prompts = random_prompts([40, 7, 23], seed=5)
    llm = LLM(path, **EXACT, **engine)
    for p, got in zip(prompts, greedy(llm, prompts, 16)):
        assert got == hf_greedy(hf, p, 16), len(p)


def test_mxfp4_experts_have_no_float_copy(gpt_oss_mxfp4):
    """Every expert matrix is in its MXFP4 blocks (17 bytes a 32 weights) with no float weight beside them; the
    blocks' bytes are the checkpoint's blocks and scales, to the byte."""
    from safetensors import safe_open
    path, _ = gpt_oss_mxfp4
    model = LLM(path, **ENGINE).llm_engine.model
    held = 0
    for layer in model.layers:
        for expert in layer.mlp.experts:
            for lin in (expert.gate_up_proj, expert.down_proj):
                parts = lin.quant.parts if isinstance(lin.quant, RowParts) else (lin.quant,)
                assert all(isinstance(p, GGMLWeight) and p.type_name == "MXFP4" for p in parts)
                assert lin.weight is None and getattr(lin, "weight_t", None) is None
                held += sum(p.nbytes for p in parts)
    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        stored = sum(f.get_tensor(n).numel() for n in f.keys() if n.endswith(("_blocks", "_scales")))
    assert held == stored


def write_gpt_oss_gguf(hf_path: str, out, experts=None) -> None:
    """As llama.cpp's converter writes gpt-oss: q/k unpermuted (NeoX rotary), the norm before the MLP as
    attn_post_norm, sinks as attn_sinks, the router with its bias, and each layer's experts as ffn_gate_exps /
    ffn_up_exps / ffn_down_exps [experts, rows, columns] with their biases (gate and up rows de-interleaved);
    yarn and the window in the metadata. Experts in the type experts (else F32), the rest F32."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file
    cfg = json.loads(open(f"{hf_path}/config.json").read())
    sd = load_file(f"{hf_path}/model.safetensors")
    rope = cfg["rope_parameters"]
    w = gguf.GGUFWriter(str(out), "gpt-oss")
    gguf_shape(w, cfg, cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    put = gguf_put(w)
    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    put("output.weight", sd["lm_head.weight"])
    names = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "attn_post_norm.weight",
             "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
             "mlp.router.bias": "ffn_gate_inp.bias"}
    for proj, kind in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
        names.update({f"self_attn.{proj}.weight": f"{kind}.weight", f"self_attn.{proj}.bias": f"{kind}.bias"})
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        for hf, ours in names.items():
            put(f"blk.{i}.{ours}", sd[pre + hf])
        gate_up = sd[pre + "mlp.experts.gate_up_proj"].transpose(0, 2, 1)        # [E, 2I, H]
        gate_up_bias = sd[pre + "mlp.experts.gate_up_proj_bias"]
        for kind, rows, bias in (("gate", gate_up[:, 0::2], gate_up_bias[:, 0::2]),
                                 ("up", gate_up[:, 1::2], gate_up_bias[:, 1::2]),
                                 ("down", sd[pre + "mlp.experts.down_proj"].transpose(0, 2, 1),
                                  sd[pre + "mlp.experts.down_proj_bias"])):
            E, n, k = rows.shape
            x = np.ascontiguousarray(rows, dtype=np.float32)
            if experts is None:
                w.add_tensor(f"blk.{i}.ffn_{kind}_exps.weight", x)
            else:
                blocks = gguf.quants.quantize(x.reshape(E * n, k), experts).reshape(E, n, -1)
                w.add_tensor(f"blk.{i}.ffn_{kind}_exps.weight", blocks, raw_dtype=experts)
            put(f"blk.{i}.ffn_{kind}_exps.bias", bias)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def gpt_oss_released(gpt_oss, tmp_path_factory):
    """The tiny model with the published SwiGLU limit of 7, which llama.cpp runs every gpt-oss GGUF with (its
    files have no key for it), and its MXFP4 folder; with transformers' models of both."""
    from transformers import AutoModelForCausalLM
    folder = tmp_path_factory.mktemp("gpt_oss_released")
    shutil.copytree(gpt_oss[0], folder / "float")
    cfg = json.loads((folder / "float" / "config.json").read_text())
    (folder / "float" / "config.json").write_text(json.dumps({**cfg, "swiglu_limit": 7.0}))
    mxfp4 = mxfp4_checkpoint(str(folder / "float"), folder / "mxfp4")
    return {kind: (p, AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval())
            for kind, p in (("float", str(folder / "float")), ("mxfp4", mxfp4))}


@pytest.mark.slow
@pytest.mark.parametrize("experts", ["F32", "MXFP4"])
def test_gguf_gives_transformers_tokens(gpt_oss_released, experts, tmp_path):
    """llama.cpp's names and metadata; MXFP4 experts (the published checkpoint's codes, regrouped as llama.cpp's
    converter does) stay in their blocks and give the tokens transformers gives for the MXFP4 folder."""
    import gguf
    path, _ = gpt_oss_released["float"]
    _, hf = gpt_oss_released["float" if experts == "F32" else "mxfp4"]
    write_gpt_oss_gguf(path, tmp_path / "g.gguf", None if experts == "F32" else gguf.GGMLQuantizationType.MXFP4)
    llm = LLM(str(tmp_path / "g.gguf"), **EXACT, tokenizer=None)
    mc, want = llm.llm_engine.model_config, ModelConfig.from_path(path)
    for field in ("layer_windows", "hidden_act", "attention_sinks", "o_proj_bias", "expert_bias", "router_bias",
                  "moe_scoring", "swiglu_limit", "swiglu_alpha", "num_experts", "num_experts_per_tok"):
        assert getattr(mc, field) == getattr(want, field), field
    # yarn's betas are left at their defaults (32 and 1) where a GGUF has none
    assert mc.rope_scaling == {k: v for k, v in want.rope_scaling.items() if k not in ("beta_fast", "beta_slow")}
    if experts == "MXFP4":
        expert = llm.llm_engine.model.layers[0].mlp.experts[0]
        gate_up = expert.gate_up_proj.quant
        assert all(p.type_name == "MXFP4" for p in (gate_up.parts if isinstance(gate_up, RowParts) else (gate_up,)))
        assert expert.down_proj.quant.type_name == "MXFP4"
    prompts = random_prompts([40, 9, 25], seed=8)
    for p, got in zip(prompts, greedy(llm, prompts, 16)):
        assert got == hf_greedy(hf, p, 16), len(p)


def test_unimplemented_options_are_refused(gpt_oss, tmp_path):
    """Experts quantised another way than MXFP4, a layer type outside the two: ValueErrors that name them."""
    path, _ = gpt_oss
    for key, value, named in (("quantization_config", {"quant_method": "gptq", "bits": 4}, "gptq"),
                              ("layer_types", ["sliding_attention", "chunked_attention", "full_attention"],
                               "chunked_attention")):
        folder = tmp_path / key
        shutil.copytree(path, folder)
        cfg = json.loads((folder / "config.json").read_text())
        cfg[key] = value
        (folder / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match=named):
            LLM(str(folder), **ENGINE)


@pytest.mark.slow
def test_two_ranks_from_gguf_and_the_mxfp4_folder_refused(gpt_oss_released, tmp_path):
    """Tensor parallelism from llama.cpp's file (its experts one tensor each, split as Qwen-MoE's; the sinks with
    their heads) gives transformers' tokens; the MXFP4 folder's packed experts are refused with what to do."""
    path, hf = gpt_oss_released["float"]
    write_gpt_oss_gguf(path, tmp_path / "g.gguf")
    llm = LLM(str(tmp_path / "g.gguf"), **EXACT, tokenizer=None, tensor_parallel_size=2)
    prompts = random_prompts([30, 7], seed=9)
    assert greedy(llm, prompts, 12) == [hf_greedy(hf, p, 12) for p in prompts]
    with pytest.raises(ValueError, match="does not split a mxfp4 checkpoint's packed weights"):
        LLM(gpt_oss_released["mxfp4"][0], **ENGINE, tensor_parallel_size=2)
