"""Speculative decoding with n-gram guesses and with a draft model: greedy tokens identical to decoding without guesses
(every family, k in 1/3/5, mixed batches, chunked prefill, prefix hits, preemption), the target distribution kept when
sampling (chi-square, n-gram and a bad draft), every SamplingParams feature intact, both KV pools consistent after
every step, bad configs and mismatched drafts refused."""
from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from tests.tiny_models import ARCHS, VOCAB, build_tiny
from tokenmill import LLM, SamplingParams
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.spec_decode import MAX_SPECULATIVE_TOKENS, NgramIndex, SpeculativeConfig

ENGINE = dict(dtype="float32", kv_cache_memory_gb=0.05, max_model_len=256)


def ngram(k: int, **kw) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, **kw}


def draft(model: str, k: int) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


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


@pytest.fixture(scope="module")
def bad_draft(tmp_path_factory):
    """A deliberately bad draft: another random model (another family, other weights) of the same vocabulary."""
    return build_tiny("qwen2", tmp_path_factory.mktemp("spec_bad_draft"), seed=7)[0]


def check_pools(llm: LLM) -> None:
    eng = llm.llm_engine
    eng.kv.check_integrity()
    if hasattr(eng.proposer, "check_integrity"):
        eng.proposer.check_integrity()


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
    with pytest.raises(ValueError, match="accepted: ngram, draft_model"):
        SpeculativeConfig.of({"method": "eagle", "model": "x"})
    for bad in ({"method": "draft_model"}, {"method": "ngram", "model": "x"}):
        with pytest.raises(ValueError, match="speculative_config.model names the draft model"):
            SpeculativeConfig.of(bad)
    assert SpeculativeConfig.of('{"method": "ngram", "num_speculative_tokens": 5}').num_speculative_tokens == 5
    assert SpeculativeConfig.of({"model": "x"}).method == "draft_model"          # vLLM infers it from the model


def test_mismatched_drafts_are_refused(llama, tiny_text_model, tmp_path):
    """A draft of another vocabulary size, or whose tokenizer numbers the tokens otherwise, is refused at start."""
    import json
    import shutil
    from tokenmill.config import ModelConfig
    from tokenmill.engine.draft_model import check_draft_config
    from tokenmill.executor.loader import open_checkpoint
    with pytest.raises(ValueError, match=r"draft model's vocabulary has \d+ tokens and the target's 320"):
        LLM(llama, **ENGINE, speculative_config=draft(tiny_text_model[0], 2))
    other = tmp_path / "swapped"
    shutil.copytree(tiny_text_model[0], other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = "cat", "dog"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="draft model's tokenizer gives tokens other ids"):
        LLM(tiny_text_model[0], **ENGINE, speculative_config=draft(str(other), 2))
    mc = ModelConfig.from_hf_dict(open_checkpoint(llama).config)         # max_position_embeddings 512
    with pytest.raises(ValueError, match=r"max_position_embeddings \(512\) is below max_model_len=1024"):
        check_draft_config(mc, mc, 1024)


def _reference_lookup(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == suffix]     # earlier occurrences
        if starts:
            latest = tokens[starts[-1] + n:starts[-1] + n + k]
            if len(starts) == 1:
                return latest
            before = tokens[starts[-2] + n:starts[-2] + n + k]     # the guess is what the two latest agree on
            agree = 0
            while agree < min(len(latest), len(before)) and latest[agree] == before[agree]:
                agree += 1
            return latest[:agree]
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
@pytest.mark.slow
def test_greedy_tokens_identical_on_every_family(arch_model, bad_draft):
    """n-gram guesses, a bad draft (guesses mostly rejected) and the model as its own draft (mostly accepted)."""
    prompts = repetitive_prompts(6)
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = tokens(LLM(arch_model, **ENGINE), prompts, p)
    for k in (1, 3, 5):
        for config in (ngram(k), draft(bad_draft, k), draft(arch_model, k)):
            spec = LLM(arch_model, **ENGINE, speculative_config=config)
            assert tokens(spec, prompts, p) == want, config
            s = spec.llm_engine.stats
            assert s.spec_num_draft_tokens > 0, config
            if config.get("model") != bad_draft:      # a bad draft's guesses may all be rejected
                assert s.spec_acceptance_rate > (0.9 if config.get("model") else 0), (config, s.spec_acceptance_rate)
            check_pools(spec)


@pytest.mark.parametrize("engine_kw", [
    dict(max_num_batched_tokens=12),                     # chunked prefill beside verifications
    dict(kv_blocks=14, max_model_len=128),               # room for about two requests: preemption
], ids=["chunked", "preempted"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_tokens_identical_under_chunking_and_preemption(llama, engine_kw, method):
    prompts = repetitive_prompts(8, seed=3)
    p = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    want = tokens(LLM(llama, **ENGINE), prompts, p)
    config = ngram(4) if method == "ngram" else draft(llama, 4)
    kw = {**ENGINE, **engine_kw, "speculative_config": config}
    if kw.pop("kv_blocks", None):
        per_block = LLM(llama, **ENGINE, speculative_config=config).llm_engine.kv_bytes_per_block()
        kw["kv_cache_memory_gb"] = 14.5 * per_block / 2 ** 30
    spec = LLM(llama, **kw)
    assert tokens(spec, prompts, p) == want
    if "kv_blocks" in engine_kw:
        assert spec.llm_engine.stats.num_preemptions > 0
    assert spec.llm_engine.stats.spec_num_accepted_tokens > 0
    check_pools(spec)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_prefix_hits_never_cover_a_guess(llama, method):
    """Two requests with one prompt: the second hits the first's blocks, which hold only verified tokens."""
    prompt = repetitive_prompts(1, seed=5)[0]
    prompt = {"prompt_token_ids": (prompt["prompt_token_ids"] * 3)[:60]}
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = tokens(LLM(llama, **ENGINE, enable_prefix_caching=False), [prompt], p)
    spec = LLM(llama, **ENGINE, speculative_config=ngram(5) if method == "ngram" else draft(llama, 5))
    first = spec.generate([prompt], p, use_tqdm=False)[0]
    # the whole first output as the next prompt: its blocks were cached while guesses were in flight
    longer = {"prompt_token_ids": prompt["prompt_token_ids"] + first.outputs[0].token_ids}
    again = spec.generate([prompt, longer], p, use_tqdm=False)
    assert first.outputs[0].token_ids == want[0] == again[0].outputs[0].token_ids
    assert again[1].num_cached_tokens >= 64
    plain = tokens(LLM(llama, **ENGINE, enable_prefix_caching=False), [longer], p)
    assert again[1].outputs[0].token_ids == plain[0]
    check_pools(spec)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampling_params_hold(tiny_text_model, method):
    """Penalties, logprobs, stop strings, max_tokens, min_tokens and n give what they give without guesses."""
    path = tiny_text_model[0]
    base = LLM(path, **ENGINE)
    spec = LLM(path, **ENGINE, speculative_config=ngram(3) if method == "ngram" else draft(path, 3))
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


def _tiny_v16(path, seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, eos_token_id=None, bos_token_id=None,
                      initializer_range=0.6)
    hf = LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(path)
    return hf


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampled_tokens_follow_the_target(tmp_path, method):
    """Temperature 1, 6000 seeds, three tokens each: the second and third are sampled in one step that verifies
    guesses (n-gram guesses start after the first token; a draft guesses from the first step on), and the joint law
    of the three fits transformers' softmax by a chi-square test. The draft is another random model: its guesses,
    drawn from its own distribution, are often rejected, so the residual draws are tested too."""
    V = 16
    hf = _tiny_v16(tmp_path / "target", 1)
    with torch.no_grad():
        # the model's own greedy text as the prompt: it repeats itself, so n-gram guesses are often what it draws
        prompt = hf.generate(torch.tensor([[3, 7]]), max_new_tokens=14, do_sample=False)[0].tolist()
        p1 = hf(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        two = torch.tensor([prompt + [a] for a in range(V)])
        p2 = hf(two).logits[:, -1].softmax(-1)                                    # [t1, t2]
        three = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
        p3 = hf(three).logits[:, -1].softmax(-1).view(V, V, V)                    # [t1, t2, t3]
    joint = (p1[:, None, None] * p2[:, :, None] * p3).flatten()
    config = ngram(2)
    if method == "draft":
        _tiny_v16(tmp_path / "draft", 2)
        config = draft(str(tmp_path / "draft"), 2)
    spec = LLM(str(tmp_path / "target"), **{**ENGINE, "max_model_len": 128}, speculative_config=config)
    n = 6000
    outs = spec.generate([{"prompt_token_ids": prompt}] * n,
                         [SamplingParams(temperature=1.0, seed=s, max_tokens=3, ignore_eos=True) for s in range(n)],
                         use_tqdm=False)
    st = spec.llm_engine.stats
    # the guessed path was really taken, and with a draft both acceptances and rejections happen often
    assert st.spec_num_drafts > 300 and st.spec_num_accepted_tokens > 50
    if method == "draft":
        assert 0.1 < st.spec_acceptance_rate < 0.9, st.spec_acceptance_rate
    seen = Counter((t[0] * V + t[1]) * V + t[2] for t in (o.outputs[0].token_ids for o in outs))
    expected = joint * n
    cells = [i for i in range(V ** 3) if expected[i] >= 5]
    rest = [i for i in range(V ** 3) if expected[i] < 5]
    obs = [seen[i] for i in cells] + [sum(seen[i] for i in rest)]
    exp = [float(expected[i]) for i in cells] + [float(expected[rest].sum())]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    assert stat < _chi2_critical(len(obs) - 1), (stat, len(obs))


def test_a_sliding_window_draft_guesses_on_long_requests(tmp_path_factory, llama):
    """A draft with a window shorter than the prompts, in a pool sized for the window: it catches up over steps, keeps
    guessing, and greedy tokens are the target's."""
    sw, _ = build_tiny("mistral_sw", tmp_path_factory.mktemp("sw_draft"))          # window 24
    prompts = repetitive_prompts(2, seed=8)
    prompts = [{"prompt_token_ids": (p["prompt_token_ids"] * 30)[:250]} for p in prompts]
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    kw = {**ENGINE, "max_model_len": 512}
    want = tokens(LLM(sw, **kw), prompts, p)
    config = draft(sw, 3)
    per_block = LLM(sw, **kw, speculative_config=config).llm_engine.kv_bytes_per_block()
    spec = LLM(sw, **{**kw, "kv_cache_memory_gb": 12.5 * per_block / 2 ** 30}, max_num_batched_tokens=32,
               speculative_config=config)                   # 12 blocks: 192 tokens, less than one prompt
    assert tokens(spec, prompts, p) == want
    st = spec.llm_engine.stats
    assert st.spec_num_draft_tokens >= 30 and st.spec_acceptance_rate > 0.9, st
    check_pools(spec)


def test_n_samples_with_a_draft(llama, bad_draft):
    """n = 4 sampled children share a prompt; each guesses with its own draft state and generator."""
    spec = LLM(llama, **ENGINE, speculative_config=draft(llama, 3))
    out = spec.generate(repetitive_prompts(1, seed=12), SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=25,
                                                                       ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs) == 4 and all(len(c.token_ids) == 25 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert spec.llm_engine.stats.spec_num_accepted_tokens > 0
    check_pools(spec)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_seeded_requests_repeat(llama, bad_draft, method):
    """A seed gives the same tokens again, alone or beside other requests (its guesses and its draws use its own
    generator)."""
    prompts = repetitive_prompts(3, seed=9)
    config = ngram(3) if method == "ngram" else draft(bad_draft, 3)
    spec = LLM(llama, **ENGINE, speculative_config=config)
    p = SamplingParams(temperature=1.0, seed=42, max_tokens=30, ignore_eos=True)
    alone = tokens(spec, prompts[:1], p)[0]
    assert tokens(spec, prompts[:1], p)[0] == alone
    others = SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True)
    mixed = spec.generate(prompts, [p, others, others], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    check_pools(spec)


# ---- the KV pool, step by step -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_block_bytes(llama) -> dict[str, int]:
    return {m: LLMEngine(llama, **ENGINE, speculative_config=c).kv_bytes_per_block()
            for m, c in (("ngram", ngram(2)), ("draft", draft(llama, 2)))}


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(4, 50), st.integers(1, 40), st.integers(0, 5)), min_size=1, max_size=6),
       st.integers(1, 5), st.integers(8, 64), st.sampled_from(["ngram", "draft"]))
@example([(50, 40, i) for i in range(6)], 3, 64, "ngram")        # these two preempt
@example([(50, 40, i) for i in range(6)], 4, 64, "draft")
def test_integrity_after_every_step(llama, llama_block_bytes, reqs, k, budget, method):
    """A pool of 12 blocks, so that requests are preempted and guesses give way."""
    eng = LLMEngine(llama, dtype="float32", kv_cache_memory_gb=12.5 * llama_block_bytes[method] / 2 ** 30,
                    max_model_len=128, max_num_batched_tokens=budget,
                    speculative_config=ngram(k) if method == "ngram" else draft(llama, k))
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
        if method == "draft":
            eng.proposer.check_integrity()
    want = {}
    while plain.has_unfinished_requests():
        want.update((o.request_id, o.outputs[0].token_ids) for o in plain.step() if o.finished)
    assert done == want
    assert eng.kv.num_used_blocks == 0
    if method == "draft":
        eng.proposer.propose([])                 # the step after the last: every draft block goes back
        assert eng.proposer.kv.num_used_blocks == 0


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


def test_the_ceiling_replay_counts_what_the_engine_did(llama):
    """benchmarks/spec_ceiling.py replays a text under other guessing rules: replaying the engine's own rule must
    give the engine's steps and guesses, and its ceiling must never guess wrong."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "spec_ceiling.py"
    spec = importlib.util.spec_from_file_location("spec_ceiling", path)
    ceiling = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ceiling)
    k, lo, hi, max_tokens = 3, 2, 4, 40
    llm = LLM(llama, **ENGINE, speculative_config=ngram(k, prompt_lookup_min=lo, prompt_lookup_max=hi))
    texts = []
    for p in repetitive_prompts(6, seed=3):       # one at a time, as the benchmark's stream
        out = llm.generate([p], SamplingParams(temperature=0, max_tokens=max_tokens))[0]
        texts.append((list(out.prompt_token_ids), list(out.outputs[0].token_ids)))
    st = llm.llm_engine.stats
    tokens = sum(len(o) - 1 for _, o in texts)
    assert st.spec_num_accepted_tokens > 0
    assert ceiling.replay(texts, ceiling.lookup(k, lo, hi), max_tokens) == (
        tokens - st.spec_num_accepted_tokens, st.spec_num_draft_tokens)
    steps, guesses = ceiling.replay(texts, ceiling.ceiling(k), max_tokens)
    assert steps + guesses == tokens and steps <= tokens - st.spec_num_accepted_tokens


@pytest.mark.slow
def test_greedy_tokens_identical_on_the_bundled_model():
    """The bundled quantised bfloat16 model on the grounded requests the benchmark runs: a verification's rows get
    the bits of lone decode steps (the int8 block matmul sums each row alone, and the decode attention splits a
    row's positions at fixed boundaries and reads a request's context once for all its rows), so speculation
    changes no token, with 3 guesses (4 rows, once the cascade's count) as with 5."""
    import json
    from pathlib import Path
    data = Path(__file__).resolve().parent.parent / "tokenmill" / "bench" / "data" / "grounded.json"
    chats = [[{"role": "user", "content": r["instruction"] + "\n\n" + r["text"]}]
             for r in json.loads(data.read_text())["requests"][:2]]
    params = SamplingParams(temperature=0, max_tokens=96)
    outs = {}
    for k in (None, 3, 5):
        llm = LLM(speculative_config=k and ngram(k), kv_cache_memory_gb=0.05, max_model_len=1024)
        outs[k] = [llm.chat(c, params, use_tqdm=False)[0].outputs[0].token_ids for c in chats]
        if k is not None:
            assert llm.llm_engine.stats.spec_num_accepted_tokens > 20      # the guesses were used
    assert outs[3] == outs[None] and outs[5] == outs[None]
