"""SamplingParams through the whole engine: seeds in busy batches, n, min_tokens, stop strings, streaming."""
import json
import shutil

import pytest

from tokenmill import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_text_model):
    return LLM(tiny_text_model[0], dtype="float32", kv_cache_memory_gb=0.05, max_model_len=256)


PROMPT = "The quick brown fox jumps over the lazy dog"


def test_greedy_equals_temperature0_equals_top_k1(llm):
    a = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    b = llm.generate(PROMPT, SamplingParams(temperature=0.8, top_k=1, max_tokens=12), use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_seed_reproduces_alone_and_in_busy_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16)
    alone = llm.generate(PROMPT, p, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=8 + i, seed=None if i % 2 else i) for i in range(10)]
    prompts = [f"Other prompt number {i}" for i in range(10)]
    busy = llm.generate(prompts[:5] + [PROMPT] + prompts[5:], others[:5] + [p] + others[5:], use_tqdm=False)
    assert busy[5].outputs[0].token_ids == alone
    unseeded = llm.generate([PROMPT] * 3, SamplingParams(temperature=1.0, max_tokens=16), use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in unseeded}) > 1


def test_n_completions(llm):
    out = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10), use_tqdm=False)
    assert len(out) == 1 and [c.index for c in out[0].outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 and c.finish_reason == "length" for c in out[0].outputs)
    assert len({tuple(c.token_ids) for c in out[0].outputs}) > 1
    again = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10), use_tqdm=False)
    assert [c.token_ids for c in again[0].outputs] == [c.token_ids for c in out[0].outputs]


def test_stop_strings_through_engine(llm):
    base = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    text = base.text
    assert len(text) > 12
    # a stop string in the middle of the text, most likely spanning a token boundary
    cut = len(text) // 2
    stop = text[cut:cut + 5]
    first = text.find(stop)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == text[:first]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    incl = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, stop=[stop],
                                               include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert incl.text == text[:first] + stop
    # streaming: the concatenated deltas equal the final text and never contain the stop string
    pieces = list(llm.generate_stream(PROMPT, SamplingParams(temperature=0, max_tokens=24, stop=[stop])))
    assert "".join(p.text for p in pieces) == text[:first]
    assert pieces[-1].finished and pieces[-1].finish_reason == "stop"
    assert sum(len(p.token_ids) for p in pieces) == len(out.token_ids)


def test_stop_token_ids_and_min_tokens(llm, tiny_text_model, tmp_path):
    base = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    first = base.token_ids[0]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [first] and out.finish_reason == "stop" and out.stop_reason == first
    # the same token as EOS: min_tokens keeps it from ending the request
    shutil.copytree(tiny_text_model[0], tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["eos_token_id"] = first
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    eos_llm = LLM(str(tmp_path / "m"), dtype="float32", kv_cache_memory_gb=0.05, max_model_len=256)
    stopped = eos_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop" and stopped.stop_reason is None
    held = eos_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, min_tokens=5),
                            use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= 5 and first not in held.token_ids[:5]
    ignored = eos_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
    assert len(ignored.token_ids) == 8 and ignored.token_ids == base.token_ids


def test_logprobs_and_prompt_logprobs(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2),
                       use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 4
    for lp, tok in zip(c.logprobs, c.token_ids):
        assert tok in lp and lp[tok].rank == 1 and len(lp) == 3      # greedy: the chosen token is the top one
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert c.cumulative_logprob == pytest.approx(sum(lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)))


def test_chat_uses_template(llm, smollm2_tokenizer):
    out = llm.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                   SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    ids = out[0].prompt_token_ids
    text = smollm2_tokenizer.decode(ids)
    assert "Be brief." in text and text.rstrip().endswith("assistant")
