"""The bundled SmolLM2-135M GGUF in float32: greedy continuations equal transformers' own GGUF loading."""
import os

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.executor.loader import default_model_path

pytestmark = pytest.mark.slow   # the real model against transformers (make test-fast skips it)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
N = 24


@pytest.fixture(scope="module")
def hf_model():
    pytest.importorskip("accelerate", reason="transformers' GGUF loading needs accelerate")
    from transformers import AutoModelForCausalLM
    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm():
    # float activations: exact against transformers' float32 model (the int8 route: test_int8_route_answers)
    return LLM(dtype="float32", kv_cache_memory_gb=0.25, max_model_len=1024, int8_activations=False)


def test_greedy_equals_transformers_gguf(llm, hf_model):
    # every matrix stays in its Q4_1/Q8_0 blocks: decode reads them, prefill dequantises tiles
    assert llm.llm_engine.model.lm_head.quant is not None and llm.llm_engine.model.lm_head.weight is None
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=N, min_new_tokens=N, do_sample=False,
                                    eos_token_id=None)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref, prompt
    assert "Paris" in outs[0].outputs[0].text


def test_chat_default_model(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_int8_route_answers():
    """The default engine (bfloat16, decode steps rounding activations to int8 per 32 as llama.cpp does) still
    answers; the route's arithmetic itself is tested against the rounded product in test_qmatmul_int8.py."""
    llm = LLM(kv_cache_memory_gb=0.05, max_model_len=512)
    assert llm.llm_engine.model.ops.int8_activations
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
