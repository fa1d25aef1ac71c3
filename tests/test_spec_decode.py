"""Speculative decoding with n-gram guesses: greedy tokens identical to decoding without guesses (every family,
k in 1/3/5, mixed batches, chunked prefill, prefix hits, preemption), the target distribution kept when sampling
(chi-square), every SamplingParams feature intact, the KV pool consistent after every step, bad configs refused."""
from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests.tiny_models import ARCHS, VOCAB, build_tiny
from tokenmill import LLM, SamplingParams
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.spec_decode import MAX_SPECULATIVE_TOKENS, NgramIndex, SpeculativeConfig

ENGINE = dict(dtype="float32", kv_cache_memory_gb=0.05, max_model_len=256)


def ngram(k: int, **kw) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, **kw}


def repetitive_prompts(n: int, seed: int = 0) -> list[dict]:
    """Prompts that repeat a segment, as input-grounded text does, so the lookup has something to find."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        seg = [rng.randrange(5, VOCAB - 5) for _ in range(rng.randrange(3, 12))]
        out.append({"prompt_token_ids": (seg * 6)[:rng.randrange(10, 70)]})
    return out


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request, tmp_path_factory):
    return build_tiny(request.param, tmp_path_factory.mktemp(request.param))[0]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_tiny("llama", tmp_path_factory.mktemp("spec_llama"))[0]


def tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


# ---- config and the lookup ---------------------------------------------------------------------------------------
def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="accepted: ngram"):
        SpeculativeConfig.of({"method": "medusa"})
    for k in (0, MAX_SPECULATIVE_TOKENS + 1, 2.5):
        with pytest.raises(ValueError, match="num_speculative_tokens must be an integer"):
            SpeculativeConfig.of(ngram(k))
    with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max"):
        SpeculativeConfig.of(ngram(3, prompt_lookup_min=4, prompt_lookup_max=2))
    with pytest.raises(ValueError, match="unknown field"):
        SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3})
    with pytest.raises(ValueError, match="draft model is not served yet"):
        SpeculativeConfig.of({"method": "draft_model", "model": "x", "num_speculative_tokens": 2})
    assert SpeculativeConfig.of('{"method": "ngram", "num_speculative_tokens": 5}').num_speculative_tokens == 5


def _reference_lookup(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):       # the latest earlier occurrence
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 4), st.integers(1, 3),
       st.integers(0, 3), st.integers(1, 5))
def test_ngram_lookup_equals_a_plain_search(toks, lo, span, grow_by, k):
    """The incremental index, asked as the tokens grow, gives what a search over the whole list gives."""
    hi = lo + span - 1
    index = NgramIndex(lo, hi)
    for end in range(max(1, len(toks) - grow_by), len(toks) + 1):
        assert index.propose(toks[:end], k) == _reference_lookup(toks[:end], k, lo, hi)


# ---- greedy: the same tokens -------------------------------------------------------------------------------------
def test_greedy_tokens_identical_on_every_family(arch_model):
    prompts = repetitive_prompts(6)
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = tokens(LLM(arch_model, **ENGINE), prompts, p)
    for k in (1, 3, 5):
        spec = LLM(arch_model, **ENGINE, speculative_config=ngram(k))
        assert tokens(spec, prompts, p) == want, k
        s = spec.llm_engine.stats
        assert s.spec_num_draft_tokens > 0 and s.spec_num_accepted_tokens > 0
        spec.llm_engine.kv.check_integrity()


@pytest.mark.parametrize("engine_kw", [
    dict(max_num_batched_tokens=12),                     # chunked prefill beside verifications
    dict(kv_blocks=14, max_model_len=128),               # room for about two requests: preemption
], ids=["chunked", "preempted"])
def test_greedy_tokens_identical_under_chunking_and_preemption(llama, engine_kw):
    prompts = repetitive_prompts(8, seed=3)
    p = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    want = tokens(LLM(llama, **ENGINE), prompts, p)
    kw = {**ENGINE, **engine_kw, "speculative_config": ngram(4)}
    if kw.pop("kv_blocks", None):
        from tokenmill.executor.runner import ModelRunner
        per_block = ModelRunner.kv_bytes_per_block(LLM(llama, **ENGINE).llm_engine.config)
        kw["kv_cache_memory_gb"] = 14.5 * per_block / 2 ** 30
    spec = LLM(llama, **kw)
    assert tokens(spec, prompts, p) == want
    if "kv_blocks" in engine_kw:
        assert spec.llm_engine.stats.num_preemptions > 0
    spec.llm_engine.kv.check_integrity()


def test_prefix_hits_never_cover_a_guess(llama):
    """Two requests with one prompt: the second hits the first's blocks, which hold only verified tokens."""
    prompt = repetitive_prompts(1, seed=5)[0]
    prompt = {"prompt_token_ids": (prompt["prompt_token_ids"] * 3)[:60]}
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = tokens(LLM(llama, **ENGINE, enable_prefix_caching=False), [prompt], p)
    spec = LLM(llama, **ENGINE, speculative_config=ngram(5))
    first = spec.generate([prompt], p, use_tqdm=False)[0]
    # the whole first output as the next prompt: its blocks were cached while guesses were in flight
    longer = {"prompt_token_ids": prompt["prompt_token_ids"] + first.outputs[0].token_ids}
    again = spec.generate([prompt, longer], p, use_tqdm=False)
    assert first.outputs[0].token_ids == want[0] == again[0].outputs[0].token_ids
    assert again[1].num_cached_tokens >= 64
    plain = tokens(LLM(llama, **ENGINE, enable_prefix_caching=False), [longer], p)
    assert again[1].outputs[0].token_ids == plain[0]
    spec.llm_engine.kv.check_integrity()


def test_sampling_params_hold(tiny_text_model):
    """Penalties, logprobs, stop strings, max_tokens, min_tokens and n give what they give without guesses."""
    path = tiny_text_model[0]
    base, spec = LLM(path, **ENGINE), LLM(path, **ENGINE, speculative_config=ngram(3))
    prompt = "the cat sat on the mat, the cat sat on the mat, the cat sat on the"
    cases = [
        SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3, presence_penalty=0.5,
                       frequency_penalty=0.4),
        SamplingParams(temperature=0, max_tokens=30, logprobs=3),
        SamplingParams(temperature=0, max_tokens=7),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=20, logit_bias={10: 2.0}),
        SamplingParams(temperature=0, max_tokens=30, n=3),
    ]
    for p in cases:
        for a, b in zip(base.generate(prompt, p, use_tqdm=False)[0].outputs,
                        spec.generate(prompt, p, use_tqdm=False)[0].outputs):
            assert a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == b.finish_reason, p
            if p.logprobs:
                for la, lb in zip(a.logprobs, b.logprobs):
                    assert la.keys() == lb.keys()
                    assert all(abs(la[t].logprob - lb[t].logprob) < 1e-4 for t in la)
    # a stop string inside a run of accepted guesses ends the output where it would have
    text = base.generate(prompt, cases[2], use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    if stop.strip():
        ps = SamplingParams(temperature=0, max_tokens=30, stop=[stop])
        a = base.generate(prompt, ps, use_tqdm=False)[0].outputs[0]
        b = spec.generate(prompt, ps, use_tqdm=False)[0].outputs[0]
        assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)
    assert spec.llm_engine.stats.spec_num_accepted_tokens > 0


# ---- sampling: the target distribution -----------------------------------------------------------------------------
def _chi2_critical(df: int, z: float = 3.29) -> float:
    """The chi-square quantile for p = 0.9995 (z), by Wilson and Hilferty's approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampled_tokens_follow_the_target(tmp_path):
    """Temperature 1, 6000 seeds, three tokens each: the second and third are sampled in one step that verifies a
    guess (guesses start after the first token), and their joint law with the first fits transformers' softmax by
    a chi-square test."""
    from transformers import LlamaConfig, LlamaForCausalLM
    V = 16
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, eos_token_id=None, bos_token_id=None,
                      initializer_range=0.6)
    hf = LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    with torch.no_grad():
        # the model's own greedy text as the prompt: it repeats itself, so the guesses are often what it draws
        prompt = hf.generate(torch.tensor([[3, 7]]), max_new_tokens=14, do_sample=False)[0].tolist()
        p1 = hf(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        two = torch.tensor([prompt + [a] for a in range(V)])
        p2 = hf(two).logits[:, -1].softmax(-1)                                    # [t1, t2]
        three = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
        p3 = hf(three).logits[:, -1].softmax(-1).view(V, V, V)                    # [t1, t2, t3]
    joint = (p1[:, None, None] * p2[:, :, None] * p3).flatten()
    spec = LLM(str(tmp_path), **{**ENGINE, "max_model_len": 128}, speculative_config=ngram(2))
    n = 6000
    outs = spec.generate([{"prompt_token_ids": prompt}] * n,
                         [SamplingParams(temperature=1.0, seed=s, max_tokens=3, ignore_eos=True) for s in range(n)],
                         use_tqdm=False)
    st = spec.llm_engine.stats
    assert st.spec_num_drafts > 300 and st.spec_num_accepted_tokens > 50     # the guessed path was really taken
    seen = Counter((t[0] * V + t[1]) * V + t[2] for t in (o.outputs[0].token_ids for o in outs))
    expected = joint * n
    cells = [i for i in range(V ** 3) if expected[i] >= 5]
    rest = [i for i in range(V ** 3) if expected[i] < 5]
    obs = [seen[i] for i in cells] + [sum(seen[i] for i in rest)]
    exp = [float(expected[i]) for i in cells] + [float(expected[rest].sum())]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    assert stat < _chi2_critical(len(obs) - 1), (stat, len(obs))


# ---- the KV pool, step by step -------------------------------------------------------------------------------------
@settings(max_examples=12, deadline=None)
@given(st.lists(st.tuples(st.integers(4, 50), st.integers(1, 40), st.integers(0, 5)), min_size=1, max_size=6),
       st.integers(1, 5), st.integers(8, 64))
def test_integrity_after_every_step(llama, reqs, k, budget):
    eng = LLMEngine(llama, dtype="float32", kv_cache_memory_gb=0.0009, max_model_len=128,
                    max_num_batched_tokens=budget, speculative_config=ngram(k))
    plain = LLMEngine(llama, dtype="float32", kv_cache_memory_gb=0.05, max_model_len=128)
    for i, (plen, out_len, seed) in enumerate(reqs):
        prompt = repetitive_prompts(1, seed=seed)[0]["prompt_token_ids"][:plen]
        for e in (eng, plain):
            e.add_request(f"r{i}", {"prompt_token_ids": prompt},
                          SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
    done: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
        eng.kv.check_integrity()
    want = {}
    while plain.has_unfinished_requests():
        want.update((o.request_id, o.outputs[0].token_ids) for o in plain.step() if o.finished)
    assert done == want
    assert eng.kv.num_used_blocks == 0


def test_metrics_count_guesses(llama):
    """/metrics (read by Prometheus' parser) counts what the engine's stats count, under vLLM's names."""
    from tests.server_fixtures import LiveServer
    from tokenmill.server.app import build_app
    import httpx
    eng = LLMEngine(llama, **ENGINE, speculative_config=ngram(3))
    server = LiveServer(build_app(eng, model_name="tiny"))
    try:
        prompt = repetitive_prompts(1, seed=2)[0]["prompt_token_ids"]
        r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 30, "temperature": 0,
                                                             "ignore_eos": True}, timeout=60)
        assert r.status_code == 200
        m = server.metrics()
        s = eng.stats
        assert s.spec_num_accepted_tokens > 0
        assert m[("tokenmill:spec_decode_num_drafts_total", ())] == s.spec_num_drafts
        assert m[("tokenmill:spec_decode_num_draft_tokens_total", ())] == s.spec_num_draft_tokens
        assert m[("tokenmill:spec_decode_num_accepted_tokens_total", ())] == s.spec_num_accepted_tokens
    finally:
        server.stop()
