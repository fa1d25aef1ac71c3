"""Pooling requests and /v1/embeddings: LAST and MEAN pooling of the final-norm hidden states against transformers on
the same weights, the same vector whether the prompt is chunked, prefix-cached, batched with generation or preempted,
and the OpenAI endpoint through the real openai client (float and base64), its 400s, and the KV blocks coming back."""
from __future__ import annotations

import asyncio
import base64
import json

import httpx
import numpy as np
import pytest
import torch

from tests.client import HTTP
from tests.tiny_models import random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.executor.runner import ModelRunner
from tokenmill.pooling_params import PoolingParams

pytest_plugins = ["tests.server_fixtures"]

MODEL = "tiny-chat"
AUTH = {"Authorization": "Bearer test-key"}      # the shared live_server's key
PROMPTS = random_prompts([1, 7, 33, 70], seed=3)


@torch.no_grad()
def hf_pooled(hf, prompt: list[int], pooling_type: str, normalize: bool = True) -> torch.Tensor:
    """transformers' pooled vector: last_hidden_state is after the final norm (checked: the LM head's input)."""
    ids = torch.tensor([prompt])
    h = hf.model(ids).last_hidden_state[0]
    assert torch.allclose(hf.lm_head(h), hf(ids).logits[0], atol=1e-5)
    v = h[-1] if pooling_type == "LAST" else h.mean(0)
    return torch.nn.functional.normalize(v, dim=0) if normalize else v


def embed_ids(llm: LLM, prompts: list[list[int]], params: PoolingParams = PoolingParams()) -> list[torch.Tensor]:
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [torch.tensor(o.outputs.embedding) for o in outs]


def assert_blocks_returned(llm: LLM) -> None:
    eng = llm.llm_engine
    assert not eng.has_unfinished_requests() and not eng.requests
    assert eng.kv.num_used_blocks == 0
    eng.kv.check_integrity()


@pytest.fixture(scope="module", params=["LAST", "MEAN"])
def pooled_llm(request, tiny_llama):
    path, hf = tiny_llama
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=128, kv_cache_memory_gb=0.01,
              pooling_type=request.param)
    return request.param, llm, hf


# ---- the engine against transformers ---------------------------------------------------------------------------
def test_embed_matches_transformers(pooled_llm):
    pooling_type, llm, hf = pooled_llm
    got = embed_ids(llm, PROMPTS)
    raw = embed_ids(llm, PROMPTS, PoolingParams(normalize=False))   # a missing 1/n or a wrong row shows here
    for p, e, r in zip(PROMPTS, got, raw):
        assert len(e) == hf.config.hidden_size
        torch.testing.assert_close(e, hf_pooled(hf, p, pooling_type), atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(r, hf_pooled(hf, p, pooling_type, normalize=False), atol=2e-5, rtol=1e-4)
        assert e.norm().item() == pytest.approx(1.0, abs=1e-5)
    assert_blocks_returned(llm)


def test_chunked_prefill_prefix_hits_and_mixed_batch_give_the_same_embedding(pooled_llm, tiny_llama):
    pooling_type, _, hf = pooled_llm
    llm = LLM(tiny_llama[0], dtype="float32", device="cpu", max_model_len=128, kv_cache_memory_gb=0.01,
              max_num_batched_tokens=16, pooling_type=pooling_type)       # 70 tokens: five chunks
    eng = llm.llm_engine
    long = PROMPTS[-1]
    ref = hf_pooled(hf, long, pooling_type)
    first = embed_ids(llm, [long])[0]
    hits = eng.kv.num_hits
    again = embed_ids(llm, [long])[0]          # its full blocks are cached now
    torch.testing.assert_close(first, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(again, ref, atol=2e-5, rtol=1e-4)
    if pooling_type == "LAST":
        assert eng.kv.num_hits - hits == 64          # four cached blocks skipped; the last row is still computed
    else:
        assert eng.kv.num_hits == hits == 0         # MEAN needs every row, so it never reads the prefix cache
    # in one batch with a generation request: the same embedding, and the same tokens as generation alone
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": PROMPTS[2]}], greedy, use_tqdm=False)[0].outputs[0].token_ids
    eng.add_request("gen", {"prompt_token_ids": PROMPTS[2]}, greedy)
    eng.add_request("emb", {"prompt_token_ids": long[::-1]}, PoolingParams())
    outs = {}
    while eng.has_unfinished_requests():
        outs.update((o.request_id, o) for o in eng.step() if o.finished)
    assert outs["gen"].outputs[0].token_ids == alone
    torch.testing.assert_close(outs["emb"].outputs.data, hf_pooled(hf, long[::-1], pooling_type), atol=2e-5,
                               rtol=1e-4)
    assert_blocks_returned(llm)


def test_preempted_pooling_request_starts_over(tiny_llama):
    """MEAN over a prompt that is preempted mid-prefill (the KV pool is too small for it beside a generation):
    its partial sum must be dropped, or the rows computed before the preemption would count twice."""
    path, hf = tiny_llama
    probe = LLM(path, dtype="float32", device="cpu", max_model_len=128, kv_cache_memory_gb=0.001)
    per_block = ModelRunner.kv_bytes_per_block(probe.llm_engine.config)
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=128, kv_cache_memory_gb=8.5 * per_block / 2 ** 30,
              max_num_batched_tokens=16, enable_prefix_caching=False, pooling_type="MEAN")
    eng = llm.llm_engine
    assert eng.kv.num_blocks == 8
    gen, emb = random_prompts([50, 100], seed=9)
    eng.add_request("gen", {"prompt_token_ids": gen}, SamplingParams(temperature=0, max_tokens=70, ignore_eos=True))
    eng.add_request("emb", {"prompt_token_ids": emb}, PoolingParams())
    outs = {}
    while eng.has_unfinished_requests():
        outs.update((o.request_id, o) for o in eng.step() if o.finished)
    assert eng.stats.num_preemptions > 0
    torch.testing.assert_close(outs["emb"].outputs.data, hf_pooled(hf, emb, "MEAN"), atol=2e-5, rtol=1e-4)
    assert_blocks_returned(llm)


def test_pooling_input_errors(pooled_llm):
    _, llm, _ = pooled_llm
    eng = llm.llm_engine
    with pytest.raises(ValueError, match="max_model_len is 128"):
        eng.add_request("long", {"prompt_token_ids": [1] * 129}, PoolingParams())
    eng.add_request("full", {"prompt_token_ids": [1] * 128}, PoolingParams())     # no new token: 128 fits
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request("vocab", {"prompt_token_ids": [1, 10 ** 6]}, PoolingParams())
    with pytest.raises(ValueError, match="set it to 48"):
        eng.add_request("dims", {"prompt_token_ids": [1, 2]}, PoolingParams(dimensions=16))
    with pytest.raises(ValueError, match=r"embed\(\) takes PoolingParams"):
        llm.embed([[1, 2]], SamplingParams())
    with pytest.raises(ValueError, match=r"generate\(\) takes SamplingParams"):
        llm.generate([[1, 2]], PoolingParams())
    with pytest.raises(ValueError, match="pooling_type must be one of LAST, MEAN"):
        LLM("unused", pooling_type="CLS")
    while eng.has_unfinished_requests():
        eng.step()
    assert_blocks_returned(llm)


# ---- /v1/embeddings ----------------------------------------------------------------------------------------------
def post(server, body) -> httpx.Response:
    return HTTP.post(server.url + "/v1/embeddings", content=json.dumps(body),
                      headers={"Content-Type": "application/json", **AUTH}, timeout=30)


def engine_blocks(server) -> int:
    """KV blocks in use, read on the engine thread between steps (after checking the pool's invariants)."""
    def read(e):
        e.kv.check_integrity()
        return e.kv.num_used_blocks
    return asyncio.run(server.llm.call(read))


@pytest.mark.slow
def test_openai_client_embeddings(live_server, openai_client):
    texts = ["Hello, tokenmill!", "The capital of France is", "x"]
    hidden = live_server.llm.engine.model_config.hidden_size
    before = live_server.metrics()
    r = openai_client.embeddings.create(model=MODEL, input=texts)            # the client asks for base64
    floats = openai_client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == MODEL
    vecs = np.array([d.embedding for d in r.data])
    assert vecs.shape == (3, hidden)
    assert np.array_equal(vecs, np.array([d.embedding for d in floats.data]))   # float32 both ways: bit-equal
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    assert not np.allclose(vecs[0], vecs[1])
    counts = [httpx.post(live_server.url + "/tokenize", json={"prompt": t}, headers=AUTH).json()["count"]
              for t in texts]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(counts)
    # token ids (one list, or a list of lists) embed as their text does
    ids = httpx.post(live_server.url + "/tokenize", json={"prompt": texts[1]}, headers=AUTH).json()["tokens"]
    one = openai_client.embeddings.create(model=MODEL, input=ids, encoding_format="float").data
    many = openai_client.embeddings.create(model=MODEL, input=[ids, ids[:2]], encoding_format="float").data
    assert len(one) == 1 and np.allclose(one[0].embedding, vecs[1], atol=1e-6)
    assert len(many) == 2 and np.allclose(many[0].embedding, vecs[1], atol=1e-6)
    # dimensions equal to the model's is accepted; vLLM's normalize=False gives the raw vector, same direction
    raw = openai_client.embeddings.create(model=MODEL, input=texts[1], dimensions=hidden, encoding_format="float",
                                          extra_body={"normalize": False}).data[0].embedding
    assert abs(np.linalg.norm(raw) - 1) > 1e-3 and np.allclose(raw / np.linalg.norm(raw), vecs[1], atol=1e-5)
    # the wire format: base64 of little-endian float32
    wire = post(live_server, {"model": MODEL, "input": texts, "encoding_format": "base64"}).json()
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in wire["data"]]
    assert wire["object"] == "list" and wire["data"][0]["object"] == "embedding"
    assert np.array_equal(np.array(decoded), vecs.astype(np.float32))
    after = live_server.metrics()
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta[("tokenmill:prompt_tokens_total", ())] >= 3 * sum(counts)
    assert delta[("tokenmill:generation_tokens_total", ())] == 0
    assert delta[("tokenmill:request_success_total", (("finished_reason", "stop"),))] == 3 + 3 + 1 + 2 + 1 + 3
    assert engine_blocks(live_server) == 0


BAD = [
    ({"model": MODEL}, "input", "input"),
    ({"model": MODEL, "input": ""}, "input", "input is empty"),
    ({"model": MODEL, "input": []}, "input", "input is empty"),
    ({"model": MODEL, "input": [[]]}, "input", "input is empty"),
    ({"model": MODEL, "input": ["fine", ""]}, "input", "input[1] is empty"),
    ({"model": MODEL, "input": [10 ** 7]}, "input", "outside the vocabulary"),
    ({"model": MODEL, "input": [[1, 2], [-1]]}, "input", "input[1]: prompt token ids [-1] are outside"),
    ({"model": MODEL, "input": [1] * 513}, "input", "max_model_len is 512"),
    ({"model": MODEL, "input": [1, "a"]}, "input", "a list of token ids or a list of lists"),
    ({"model": MODEL, "input": [[1], "a"]}, "input", "a list of token ids or a list of lists"),
    ({"model": MODEL, "input": [True]}, "input", "a list of token ids or a list of lists"),
    ({"model": MODEL, "input": "x", "encoding_format": "hex"}, "encoding_format", "float"),
    ({"model": MODEL, "input": "x", "dimensions": 32}, "dimensions", "set it to 64"),
    ({"model": MODEL, "input": "x", "dimensions": 0}, "dimensions", "greater than or equal to 1"),
]


@pytest.mark.parametrize("body,param,says", BAD, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD)])
def test_malformed_embedding_requests_are_400(live_server, body, param, says):
    r = post(live_server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err
    assert engine_blocks(live_server) == 0
