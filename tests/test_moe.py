"""Mixture-of-Experts (Mixtral, Qwen2-MoE, Qwen3-MoE): greedy tokens equal transformers' under chunked prefill,
prefix hits, preemption and a sliding window; the grouped expert op equals a plain per-token sum and runs each
active expert once; options outside what is implemented are refused by name. (The mixed-length batch against
transformers, with logprobs, is test_models.py's, over every family.)"""
from __future__ import annotations

import pytest
import torch

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


@pytest.mark.parametrize("engine_kw", [
    dict(max_num_batched_tokens=16),                       # prompts in chunks beside decodes
    dict(kv_blocks=14, max_model_len=128),                 # room for about two requests: preemption
], ids=["chunked", "preempted"])
def test_greedy_matches_transformers_under_pressure(moe, engine_kw):
    path, hf = moe
    prompts = random_prompts([37, 5, 60, 22, 48, 9], seed=4)
    kw = {**ENGINE, **engine_kw}
    if kw.pop("kv_blocks", None):
        kw["kv_cache_memory_gb"] = 14.5 * LLM(path, **ENGINE).llm_engine.kv_bytes_per_block() / 2 ** 30
    llm = LLM(path, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 40), len(p)
    if "kv_blocks" in engine_kw:
        assert llm.llm_engine.stats.num_preemptions > 0
    llm.llm_engine.kv.check_integrity()


def test_prefix_hits_match_transformers(moe):
    path, hf = moe
    base = random_prompts([48], seed=6)[0]
    prompts = [base + random_prompts([n], seed=7 + n)[0] for n in (3, 11)]
    llm = LLM(path, **ENGINE)
    llm.generate([{"prompt_token_ids": base}], SamplingParams(max_tokens=1), use_tqdm=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.num_cached_tokens >= 32
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 20)


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
class _Counting(ReferenceOps):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def silu_mul(self, gate_up):
        self.calls += 1
        return super().silu_mul(gate_up)


@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (7, 8, 3), (50, 6, 2), (3, 64, 4)])
def test_fused_moe_equals_a_per_token_sum(T, E, k):
    """Each token's output is the weighted sum of its experts' outputs, and each expert that got tokens runs once
    (its silu_mul called once for all its tokens); experts that got none do not run."""
    torch.manual_seed(T * E + k)
    H, inter = 16, 24
    x = torch.randn(T, H)
    w13, w2 = torch.randn(E, 2 * inter, H) * 0.2, torch.randn(E, H, inter) * 0.2
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    weights = torch.rand(T, k)
    ops = _Counting()
    got = ops.fused_moe(x, weights, ids, w13, w2)
    want = torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            g, u = (w13[e] @ x[t]).chunk(2)
            want[t] += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(g) * u))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert ops.calls == len(set(ids.flatten().tolist()))


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
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not implemented"):
        ModelConfig.from_hf_dict(_moe_config(hidden_act="gelu"))
    with pytest.raises(ValueError, match="unsupported architecture 'DeepseekV3ForCausalLM'; tokenmill supports .*"
                                         "MixtralForCausalLM"):
        ModelConfig.from_hf_dict(_moe_config(architectures=["DeepseekV3ForCausalLM"]))


def test_a_missing_expert_is_named(moe, tmp_path):
    from safetensors.torch import load_file, save_file
    import shutil
    path, _ = moe
    shutil.copytree(path, tmp_path / "m")
    tensors = load_file(str(tmp_path / "m" / "model.safetensors"))
    gone = next(n for n in tensors if ".experts.1." in n)
    del tensors[gone]
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="checkpoint is missing 1 expert matrices of layers"):
        LLM(str(tmp_path / "m"), **ENGINE)
