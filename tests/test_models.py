"""Greedy token ids identical to transformers' generate, per architecture, for a mixed-length batch."""
import pytest
import torch

from tests.tiny_models import ARCHS, build_tiny, hf_greedy, hf_logprobs, random_prompts
from tokenmill import LLM, SamplingParams

MAX_NEW = 12


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch, tmp_path):
    path, hf = build_tiny(arch, tmp_path)
    prompts = random_prompts([3, 17, 40, 1, 29], seed=1)
    llm = LLM(path, dtype="float32", kv_cache_memory_gb=0.02, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        assert c.token_ids == hf_greedy(hf, p, MAX_NEW), f"{arch}: prompt of {len(p)} tokens diverged"
        ours = torch.tensor([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
        torch.testing.assert_close(ours, hf_logprobs(hf, p, c.token_ids), atol=1e-4, rtol=0)
        assert c.finish_reason == "length"


def test_sliding_window_matches_transformers(tiny_mistral_sw):
    path, hf = tiny_mistral_sw
    prompts = random_prompts([60, 10, 45], seed=2)       # window is 24 tokens
    llm = LLM(path, dtype="float32", kv_cache_memory_gb=0.02, max_model_len=512)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 30)


def test_sliding_window_frees_blocks(tiny_mistral_sw):
    """During decode, blocks wholly outside the window go back to the pool."""
    path, _ = tiny_mistral_sw
    llm = LLM(path, dtype="float32", kv_cache_memory_gb=0.02, max_model_len=512, block_size=8)
    eng = llm.llm_engine
    eng.add_request("a", {"prompt_token_ids": random_prompts([20])[0]},
                    SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    held = []
    while eng.has_unfinished_requests():
        eng.step()
        held.append(eng.kv.num_used_blocks)
        eng.kv.check_integrity()
    # 120 tokens would need 15 blocks of 8; a 24-token window never needs more than 5
    assert max(held) <= 5
