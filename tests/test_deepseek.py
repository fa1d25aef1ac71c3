"""DeepSeek-V2 and V3: latent attention over a cache of one latent and one rotary key per token, and their routing
(groups, V3's sigmoid scores with a choice bias, shared experts). Greedy tokens equal transformers' under chunked
prefill, preemption and prefix hits; the cache's bytes per token are the formula's, and the same budget holds that
many more tokens than full K/V would."""
from __future__ import annotations

import json

import pytest
import torch

from tests.family_checks import PRESSURE, check_prefix_hits, check_under_pressure, gguf_put, gguf_shape, greedy
from tests.tiny_models import build_tiny, hf_greedy, hf_logprobs, random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.bench.kvcalc import kv_calc, param_count
from tokenmill.config import ModelConfig

ENGINE = dict(dtype="float32", kv_cache_memory_gb=0.02, max_model_len=512)


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3"])
def deepseek(request, tmp_path_factory):
    return build_tiny(request.param, tmp_path_factory.mktemp(request.param))


def test_mixed_batch_tokens_and_logprobs(deepseek):
    path, hf = deepseek
    llm = LLM(path, **ENGINE)
    prompts = random_prompts([5, 33, 70, 12, 1], seed=11)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0), use_tqdm=False)
    for p, o in zip(prompts, outs):
        got = o.outputs[0].token_ids
        assert got == hf_greedy(hf, p, 16)
        ours = torch.tensor([lp[t].logprob for t, lp in zip(got, o.outputs[0].logprobs)])
        torch.testing.assert_close(ours, hf_logprobs(hf, p, got), atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("pressure", list(PRESSURE))
def test_under_pressure(deepseek, pressure):
    check_under_pressure(*deepseek, ENGINE, pressure)


def test_prefix_hits(deepseek):
    check_prefix_hits(*deepseek, ENGINE)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_routing_matches_transformers(deepseek, dtype):
    """The experts each token picks and their weights, against transformers' router on the same inputs (its
    groups and V3's bias change the choice: most tokens would pick otherwise without them); in bfloat16 too,
    where both score in float32 from the rounded weights."""
    import copy
    path, hf = deepseek
    llm = LLM(path, **{**ENGINE, "dtype": dtype})
    ours = llm.llm_engine.model.layers[1].mlp
    theirs = copy.deepcopy(hf.model.layers[1].mlp.gate).to(getattr(torch, dtype))
    if hasattr(theirs, "e_score_correction_bias"):         # V3's bias stays float32 in transformers too
        theirs.e_score_correction_bias = hf.model.layers[1].mlp.gate.e_score_correction_bias
    x = torch.randn(64, hf.config.hidden_size).to(getattr(torch, dtype))
    weights, ids = ours.route(x)
    _, want_w, want_ids = theirs(x)
    order, want_order = ids.argsort(-1), want_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_w.gather(1, want_order), atol=1e-6, rtol=1e-6)
    plain = (x.float() @ theirs.weight.float().T).softmax(-1).topk(ids.shape[1], dim=-1)[1].sort(-1)[0]
    assert (plain != ids.sort(-1)[0]).any(dim=-1).float().mean() > 0.3


def test_latent_cache_bytes_per_token(deepseek):
    """The cache keeps kv_lora_rank + qk_rope_head_dim values per token per layer, once for K and V: the
    formula's bytes; kv_cache_memory_gb then holds that many more tokens than the expanded K/V would."""
    path, hf = deepseek
    c = hf.config
    llm = LLM(path, **ENGINE)
    per_token = llm.llm_engine.kv_bytes_per_block() // 16
    assert per_token == c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * 4
    expanded = c.num_hidden_layers * c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim
                                                              + c.v_head_dim) * 4
    budget = 0.02 * 2 ** 30
    tokens, tokens_expanded = llm.llm_engine.kv_cache_info().num_tokens, budget // (expanded * 16) * 16
    assert tokens == budget // (per_token * 16) * 16
    assert tokens / tokens_expanded >= 0.95 * expanded / per_token > 3
    with open(f"{path}/config.json") as f:
        r = kv_calc(json.load(f), context=1000, kv_dtype="fp32")
    assert r["attention"] == "MLA" and r["bytes_per_token"] == per_token and r["bytes_per_seq"] == 1000 * per_token


def test_kv_calc_counts_the_weights(deepseek):
    path, hf = deepseek
    with open(f"{path}/config.json") as f:
        counted = param_count(json.load(f))
    real = sum(p.numel() for p in hf.parameters()) + sum(b.numel() for n, b in hf.named_buffers()
                                                         if n.endswith("e_score_correction_bias"))
    assert abs(counted.total - real) <= hf.config.num_hidden_layers * hf.config.n_routed_experts


def test_refusals(deepseek, tmp_path):
    path, _ = deepseek
    with pytest.raises(ValueError, match="latent attention's cache is float"):
        LLM(path, **ENGINE, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match=r"attention_backend='cpu' cannot run here: values narrower than keys"):
        LLM(path, **ENGINE, attention_backend="cpu")
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    if cfg["architectures"] == ["DeepseekV2ForCausalLM"]:
        with pytest.raises(ValueError, match="topk_method 'noaux_tc' is not implemented; tokenmill's are greedy, "
                                             "group_limited_greedy"):
            ModelConfig.from_hf_dict({**cfg, "topk_method": "noaux_tc"})
    with pytest.raises(ValueError, match="n_group=3 must divide n_routed_experts=8"):
        ModelConfig.from_hf_dict({**cfg, "n_group": 3, "topk_method": "group_limited_greedy"})


def write_deepseek_gguf(hf_path: str, out, split_kv_b: bool = True, expert_type=None) -> None:
    """The tiny HF model as llama.cpp's converter writes a "deepseek2" file: one kv head whose key is the latent
    and rotary key (key_length rank + rope, value_length rank) beside the heads' own _mla lengths, kv_b split into
    k_b (transposed) and v_b (older files: kv_b whole), experts stacked per layer, V3's bias as exp_probs_b and its
    sigmoid gating as expert_gating_func, groups as expert_group_count/used, yarn's mscale as its log multiplier.
    Experts in expert_type (a gguf.GGMLQuantizationType), everything else F32."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file
    cfg = json.loads(open(f"{hf_path}/config.json").read())
    sd = load_file(f"{hf_path}/model.safetensors")
    L, heads, E = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["n_routed_experts"]
    rank, rope, nope, v = (cfg[k] for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"))
    v3 = cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    w = gguf.GGUFWriter(str(out), "deepseek2")
    gguf_shape(w, cfg, kv_heads=1)
    rp = cfg["rope_parameters"]
    w.add_rope_dimension_count(rope)
    if rp["rope_type"] == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rp["mscale_all_dim"])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    if cfg.get("q_lora_rank"):
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    w.add_key_length(rank + rope)
    w.add_value_length(rank)
    w.add_key_length_mla(nope + rope)
    w.add_value_length_mla(v)
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_count(E)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob") and v3:
        w.add_expert_weights_norm(True)
    if v3:
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if cfg.get("n_group", 1) > 1:
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])

    put = gguf_put(w)

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    attn = {"q_proj": "attn_q", "q_a_proj": "attn_q_a", "q_a_layernorm": "attn_q_a_norm", "q_b_proj": "attn_q_b",
            "kv_a_proj_with_mqa": "attn_kv_a_mqa", "kv_a_layernorm": "attn_kv_a_norm", "o_proj": "attn_output"}
    for i in range(L):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        put(p + "attn_norm.weight", sd[h + "input_layernorm.weight"])
        put(p + "ffn_norm.weight", sd[h + "post_attention_layernorm.weight"])
        for hf_name, name in attn.items():
            if f"{h}self_attn.{hf_name}.weight" in sd:
                put(f"{p}{name}.weight", sd[f"{h}self_attn.{hf_name}.weight"])
        kv_b = sd[h + "self_attn.kv_b_proj.weight"]
        if split_kv_b:
            k_b, v_b = np.split(kv_b.reshape(heads, nope + v, rank), [nope], axis=1)
            put(p + "attn_k_b.weight", k_b.transpose(0, 2, 1))
            put(p + "attn_v_b.weight", v_b)
        else:
            put(p + "attn_kv_b.weight", kv_b)
        if h + "mlp.gate.weight" not in sd:                 # a dense layer
            for x in ("gate", "up", "down"):
                put(p + f"ffn_{x}.weight", sd[h + f"mlp.{x}_proj.weight"])
            continue
        put(p + "ffn_gate_inp.weight", sd[h + "mlp.gate.weight"])
        if v3:
            put(p + "exp_probs_b.bias", sd[h + "mlp.gate.e_score_correction_bias"])
        for x in ("gate", "up", "down"):
            put(p + f"ffn_{x}_exps.weight", np.stack([sd[f"{h}mlp.experts.{e}.{x}_proj.weight"] for e in range(E)]),
                expert_type)
            put(p + f"ffn_{x}_shexp.weight", sd[h + f"mlp.shared_experts.{x}_proj.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    put("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("split_kv_b", [True, False])
def test_gguf_gives_transformers_tokens(deepseek, tmp_path, split_kv_b):
    """The model in llama.cpp's "deepseek2" layout, kv_b split (recent converters) or whole (older files), gives
    transformers' greedy tokens."""
    path, hf = deepseek
    write_deepseek_gguf(path, tmp_path / "m.gguf", split_kv_b)
    llm = LLM(str(tmp_path / "m.gguf"), **ENGINE, tokenizer=None)
    assert llm.llm_engine.model_config.architecture == hf.config.architectures[0]
    prompts = random_prompts([3, 30, 17], seed=8)
    for p, got in zip(prompts, greedy(llm, prompts, 16)):
        assert got == hf_greedy(hf, p, 16)


def test_gguf_experts_stay_quantised(deepseek, tmp_path):
    """Q8_0 experts are read from their blocks and give the tokens of the same weights dequantised at load."""
    import gguf
    from tests.family_checks import check_blocks_equal_dequantised
    from tokenmill.executor.layers.quant import QuantWeight
    write_deepseek_gguf(deepseek[0], tmp_path / "q.gguf", expert_type=gguf.GGMLQuantizationType.Q8_0)
    blocks = check_blocks_equal_dequantised(str(tmp_path / "q.gguf"), ENGINE)
    expert = blocks.llm_engine.model.layers[1].mlp.experts[0]
    assert isinstance(expert.gate_up_proj.quant, QuantWeight) and expert.gate_up_proj.weight is None
