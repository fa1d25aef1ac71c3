"""quantization= (vLLM's option): a float checkpoint's matrices quantised group-wise at load into the blocks the
kernels read. Every kernel variant gives the reference plan's tokens on the same quantised weights; quality is
bounded against the float model; what cannot be quantised stays float and is said once."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tests.test_gguf import _write_tiny
from tests.test_plans import assert_same
from tests.tiny_models import build_tiny, random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.executor.kernels import runnable_variants
from tokenmill.executor.layers.linear import Embedding, Linear

VARIANTS = runnable_variants()
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)


def run(path: str, cpu_kernels: str, **kw):
    llm = LLM(path, dtype="float32", kv_cache_memory_gb=0.02, max_model_len=256, cpu_kernels=cpu_kernels,
              tokenizer=None, int8_activations=False, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in random_prompts([5, 33, 70, 1, 20], seed=4)], GREEDY,
                        use_tqdm=False)
    return [o.outputs[0] for o in outs], llm


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    return {kind: build_tiny(kind, tmp_path_factory.mktemp(kind))[0] for kind in ("qwen2", "llama_mqa_tied", "llama")}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen2", "llama_mqa_tied"])
@pytest.mark.parametrize("method", ["int8", "int4", "q5_1"])
def test_quantised_at_load_kernels_equal_reference(models, kind: str, method: str) -> None:
    want, _ = run(models[kind], "reference", quantization=method)
    for isa in VARIANTS:
        got, llm = run(models[kind], isa, quantization=method)
        assert_same(got, want)
        for m in llm.llm_engine.model.modules():
            if isinstance(m, (Linear, Embedding)):
                assert m.quant is not None and m.weight is None


def test_int8_stays_close_to_float(models) -> None:
    """Top-1 agreement over 60 greedy positions, each scored on the float model's own prefix."""
    path = models["qwen2"]
    prompts = random_prompts([5, 33, 70, 1, 20], seed=4)
    flt = LLM(path, dtype="float32", kv_cache_memory_gb=0.02, max_model_len=256, tokenizer=None)
    outs = flt.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    q8 = LLM(path, dtype="float32", kv_cache_memory_gb=0.02, max_model_len=256, tokenizer=None, quantization="int8")
    agree = total = 0
    for p, o in zip(prompts, outs):
        seq = p + list(o.outputs[0].token_ids)
        lp = q8.generate([{"prompt_token_ids": seq}], SamplingParams(max_tokens=1, prompt_logprobs=1),
                         use_tqdm=False)[0].prompt_logprobs
        for pos in range(len(p), len(seq)):
            top = max(lp[pos].items(), key=lambda kv: kv[1].logprob)[0]
            agree += top == seq[pos]
            total += 1
    assert total == 60 and agree / total >= 0.95, agree / total


def test_rows_not_whole_groups_stay_float_and_are_named(models, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="tokenmill"):
        _, llm = run(models["llama"], VARIANTS[0], quantization="int8")    # hidden 48, intermediate 80
    said = [r.getMessage() for r in caplog.records if "kept in float" in r.getMessage()]
    assert len(said) == 1 and "q_proj" in said[0] and "down_proj" in said[0]
    model = llm.llm_engine.model
    assert model.layers[0].self_attn.qkv_proj.quant is None                # K = 48
    assert model.embed_tokens.quant is None


def test_bad_quantization_is_a_clear_error(models, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="quantization must be one of int8, int4"):
        LLM(models["qwen2"], quantization="int3", tokenizer=None)
    gguf_path = tmp_path / "tiny.gguf"
    _write_tiny(gguf_path)                                                 # Q4_0 / Q4_1 / Q8_0 matrices
    with pytest.raises(ValueError, match="already quantised"):
        LLM(str(gguf_path), quantization="int8", tokenizer=None)
