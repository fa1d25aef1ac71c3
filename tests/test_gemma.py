"""Gemma 2 and Gemma 3 (text): greedy tokens equal transformers' for prompts longer than the local layers' window,
under chunked prefill, prefix hits and preemption, through every attention backend the engine may pick; the
kernels' attention refuses what it cannot do (soft-capping, per-layer windows) and the engine says so by falling
back. (The mixed-length batch with logprobs is test_models.py's.)"""
from __future__ import annotations

import pytest

from tests.tiny_models import build_tiny, hf_greedy, random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.config import ModelConfig

ENGINE = dict(dtype="float32", kv_cache_memory_gb=0.02, max_model_len=512)


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma(request, tmp_path_factory):
    return build_tiny(request.param, tmp_path_factory.mktemp(request.param))


def greedy(llm: LLM, prompts, n: int) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_config_reads_the_layer_pattern(gemma):
    path, hf = gemma
    mc = ModelConfig.from_path(path)
    assert [w is not None for w in mc.layer_windows] == \
        [t == "sliding_attention" for t in hf.config.layer_types]
    assert mc.sliding_window is None            # global layers keep every block
    assert mc.query_pre_attn_scalar == hf.config.query_pre_attn_scalar


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_long_prompts_past_the_window(gemma, backend):
    """Prompts of up to 4x the window of 16, and 30 tokens each, in one batch."""
    path, hf = gemma
    llm = LLM(path, **ENGINE, attention_backend=backend)
    assert llm.llm_engine.runner.backend.name == ("torch" if backend == "torch" else "batched")
    prompts = random_prompts([60, 10, 45, 17, 33], seed=2)
    for p, got in zip(prompts, greedy(llm, prompts, 30)):
        assert got == hf_greedy(hf, p, 30), len(p)


@pytest.mark.parametrize("engine_kw", [dict(max_num_batched_tokens=12), dict(kv_blocks=14, max_model_len=128)],
                         ids=["chunked", "preempted"])
def test_under_pressure(gemma, engine_kw):
    path, hf = gemma
    kw = {**ENGINE, **engine_kw}
    if kw.pop("kv_blocks", None):
        kw["kv_cache_memory_gb"] = 14.5 * LLM(path, **ENGINE).llm_engine.kv_bytes_per_block() / 2 ** 30
    llm = LLM(path, **kw)
    prompts = random_prompts([37, 5, 60, 22, 48, 9], seed=4)
    for p, got in zip(prompts, greedy(llm, prompts, 40)):
        assert got == hf_greedy(hf, p, 40), len(p)
    if "kv_blocks" in engine_kw:
        assert llm.llm_engine.stats.num_preemptions > 0


def test_prefix_hits(gemma):
    path, hf = gemma
    base = random_prompts([48], seed=6)[0]
    prompts = [base + random_prompts([n], seed=7 + n)[0] for n in (3, 11)]
    llm = LLM(path, **ENGINE)
    greedy(llm, [base], 1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.num_cached_tokens >= 32 and o.outputs[0].token_ids == hf_greedy(hf, p, 20)


def test_kernel_attention_is_refused(gemma):
    path, _ = gemma
    with pytest.raises(ValueError, match="attention_backend='cpu' cannot run here: (attention logit soft-capping|"
                                         "sliding windows that differ between layers)"):
        LLM(path, **ENGINE, attention_backend="cpu")


def test_unknown_layer_type_is_named(gemma):
    import json
    cfg = json.loads(open(f"{gemma[0]}/config.json").read())
    cfg["layer_types"] = ["chunked_attention"] * cfg["num_hidden_layers"]
    with pytest.raises(ValueError, match="layer type\\(s\\) chunked_attention are not implemented"):
        ModelConfig.from_hf_dict(cfg)
