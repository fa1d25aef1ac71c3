"""gpt-oss (GptOssForCausalLM) from an HF folder: attention sinks, every other layer local with a window shorter than
the prompts, biased experts with the clamped SwiGLU, a router softmaxed over its top k. Greedy tokens equal
transformers' through every attention backend, under chunked prefill, preemption and prefix hits, and the sinks
count as transformers counts them. (The mixed batch with logprobs, the kernel plans and n-gram speculation are
test_models.py's, test_plans.py's and test_spec_decode.py's, as for every family.)"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.family_checks import PRESSURE, check_prefix_hits, check_under_pressure, greedy
from tests.tiny_models import build_tiny, hf_greedy, hf_logprobs, random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.config import ModelConfig

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
    assert (mc.hidden_act, mc.swiglu_limit, mc.swiglu_alpha) == ("swigluoai", 1.0, 1.702)
    assert mc.moe_layers == (0, 1, 2) and mc.moe_scoring == "topk_softmax"


@pytest.mark.parametrize("backend", ["auto", "batched", "torch"])
def test_long_prompts_past_the_window(gpt_oss, backend):
    """Prompts of up to 4x the window of 16, and 30 tokens each, in one batch."""
    path, hf = gpt_oss
    llm = LLM(path, **ENGINE, attention_backend=backend)
    assert llm.llm_engine.runner.backend.name == ("cpu" if backend == "auto" else backend)
    prompts = random_prompts([60, 10, 45, 17, 33], seed=2)
    for p, got in zip(prompts, greedy(llm, prompts, 30)):
        assert got == hf_greedy(hf, p, 30), len(p)


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


@pytest.mark.parametrize("pressure", list(PRESSURE))
def test_greedy_under_pressure(gpt_oss, pressure):
    check_under_pressure(*gpt_oss, ENGINE, pressure)


def test_prefix_hits(gpt_oss):
    check_prefix_hits(*gpt_oss, ENGINE)


def test_unimplemented_options_are_refused(gpt_oss, tmp_path):
    """A checkpoint of MXFP4 experts, a layer type outside the two: ValueErrors that name them."""
    path, _ = gpt_oss
    for key, value, named in (("quantization_config", {"quant_method": "mxfp4"}, "mxfp4"),
                              ("layer_types", ["sliding_attention", "chunked_attention", "full_attention"],
                               "chunked_attention")):
        folder = tmp_path / key
        shutil.copytree(path, folder)
        cfg = json.loads((folder / "config.json").read_text())
        cfg[key] = value
        (folder / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match=named):
            LLM(str(folder), **ENGINE)
