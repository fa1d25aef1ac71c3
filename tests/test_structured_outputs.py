"""Structured outputs in the engine: xgrammar's bitmask in the batched sampler, against a step-by-step oracle.

The model is a tiny random Llama with SmolLM2's real tokenizer, so grammars compile against a real 49k vocabulary
and the outputs are text."""
from __future__ import annotations

import json
import re

import pytest
import torch

from tokenmill import LLM, SamplingParams, StructuredOutputsParams
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.structured_output import StructuredOutputsConfig

# compiles grammars in workers at the idle CPU priority, which a second test worker's load would starve: alone
pytestmark = pytest.mark.serial

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "age", "tags"]}
REGEX = r"[0-9]{2,4}-[a-z]{3}"


@pytest.fixture(scope="module")
def llm(tiny_text_model):
    return LLM(tiny_text_model[0], dtype="float32", kv_cache_memory_gb=0.05, max_model_len=256)


def so(**kw) -> SamplingParams:
    max_tokens = kw.pop("max_tokens", 64)
    temperature = kw.pop("temperature", 0.0)
    seed = kw.pop("seed", None)
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                          structured_outputs=StructuredOutputsParams(**kw))


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
    assert StructuredOutputsParams(json=Person).json["required"] == ["name"]
    assert StructuredOutputsParams(json='{"type": "object"}').json == {"type": "object"}


def test_each_kind_is_obeyed_greedy_and_sampled(llm):
    # a random model writes whitespace forever where the grammar allows it: JSON without free whitespace. (And
    # strings forever: json_object, unbounded, is tested on the bundled model, in test_structured_outputs_server.)
    cases = [
        (dict(json=SCHEMA, disable_any_whitespace=True), lambda t: _valid_json(t, SCHEMA)),
        (dict(regex=REGEX), lambda t: re.fullmatch(REGEX, t) is not None),
        (dict(choice=["yes", "no", "it \"depends\""]), lambda t: t in ("yes", "no", "it \"depends\"")),
        (dict(grammar='root ::= "(" [a-c] [a-c]? [a-c]? ")"'), lambda t: re.fullmatch(r"\([a-c]{1,3}\)", t)),
    ]
    prompts, params, checks = [], [], []
    for kw, check in cases:
        for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2)):
            prompts.append("Answer:")
            params.append(so(**kw, temperature=temperature, seed=seed, max_tokens=120))
            checks.append(check)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, check, p in zip(outs, checks, params):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (p.structured_outputs, c.text)
        assert check(c.text), (p.structured_outputs, c.text)


def _valid_json(text: str, schema: dict) -> bool:
    import jsonschema
    jsonschema.validate(json.loads(text), schema)
    return True


def test_greedy_equals_a_step_by_step_oracle(llm, tiny_text_model):
    """Each constrained greedy token is the argmax, over the tokens the grammar allows, of transformers' logits for
    the whole sequence so far (no KV cache, no batching)."""
    import xgrammar as xgr
    _, hf = tiny_text_model
    eng = llm.llm_engine
    prompt = eng.tokenizer.encode("Give me JSON:")
    [out] = llm.generate({"prompt_token_ids": prompt}, so(json=SCHEMA, disable_any_whitespace=True, max_tokens=60),
                         use_tqdm=False)
    got = out.outputs[0].token_ids
    matcher = xgr.GrammarMatcher(eng.structured_outputs.compile(StructuredOutputsParams(json=SCHEMA,
                                                                                        disable_any_whitespace=True)),
                                 override_stop_tokens=list(eng.model_config.eos_token_ids) or None)
    bitmask = xgr.allocate_token_bitmask(1, eng.model_config.vocab_size)
    want: list[int] = []
    with torch.no_grad():
        while len(want) < len(got) and not matcher.is_terminated():
            logits = hf(torch.tensor([prompt + want])).logits[0, -1:].float()
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            tok = int(logits.argmax())
            assert matcher.accept_token(tok)
            want.append(tok)
    assert got == want


def test_unconstrained_neighbours_are_unchanged(llm):
    plain = SamplingParams(max_tokens=24, temperature=0.0)
    seeded = SamplingParams(max_tokens=24, temperature=1.0, seed=7)
    alone = llm.generate(["The sea", "A cat"], [plain, seeded], use_tqdm=False)
    mixed = llm.generate(["The sea", "Answer:", "A cat", "Answer:"],
                         [plain, so(regex=REGEX), seeded,
                          so(json=SCHEMA, disable_any_whitespace=True, temperature=1.0, seed=3)], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in alone] == [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids]
    assert re.fullmatch(REGEX, mixed[1].outputs[0].text)


@pytest.mark.parametrize("engine_kw", [
    dict(max_num_batched_tokens=8),                         # chunked prefill: the mask only on the last chunk
    dict(kv_blocks=10, max_model_len=128),                  # room for one request and a half: preemption
], ids=["chunked", "preempted"])
def test_same_tokens_under_chunking_and_preemption(tiny_text_model, llm, engine_kw):
    prompts = ["Answer in JSON please, " * (i + 4) for i in range(6)]
    params = [so(json=SCHEMA, disable_any_whitespace=True, max_tokens=60) if i % 2
              else so(regex=r"[a-z ]{30,50}\.", temperature=1.0, seed=i) for i in range(len(prompts))]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    kw = {**dict(dtype="float32", kv_cache_memory_gb=0.05, max_model_len=256), **engine_kw}
    if "kv_blocks" in kw:
        from tokenmill.executor.runner import ModelRunner
        kw["kv_cache_memory_gb"] = (kw.pop("kv_blocks") + 0.5) * ModelRunner.kv_bytes_per_block(
            llm.llm_engine.config) / 2 ** 30
    other = LLM(tiny_text_model[0], **kw)
    got = [o.outputs[0].token_ids for o in other.generate(prompts, params, use_tqdm=False)]
    assert got == want
    if "kv_blocks" in engine_kw:
        assert other.llm_engine.stats.num_preemptions > 0
    other.llm_engine.kv.check_integrity()


def test_prefix_hit_and_n_children(llm):
    prompt = "A long shared preamble that fills more than one block of sixteen tokens, twice over. Answer:"
    first = llm.generate(prompt, so(regex=REGEX), use_tqdm=False)[0]
    again = llm.generate(prompt, so(regex=REGEX), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    many = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=40,
                                               structured_outputs=StructuredOutputsParams(choice=["red", "green",
                                                                                                  "blue"])),
                        use_tqdm=False)[0]
    assert len(many.outputs) == 4 and all(c.text in ("red", "green", "blue") for c in many.outputs)


def test_bad_specs_are_refused_and_the_engine_goes_on(llm):
    bad = [(dict(json={"type": "objekt"}), "structured_outputs.json: .*objekt"),
           (dict(json=False), "structured_outputs.json: .*admits no value"),
           (dict(regex="a(b"), "structured_outputs.regex: .*parenthesis"),
           (dict(regex=r"[^\s\S]"), "structured_outputs.regex: the constraint admits no output"),
           (dict(grammar="root ::= root"), "structured_outputs.grammar: the constraint admits no output"),
           (dict(grammar="root ::= foo"), "structured_outputs.grammar: .*foo")]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            llm.generate("x", so(**kw), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    [ok] = llm.generate("Answer:", so(regex=REGEX), use_tqdm=False)
    assert re.fullmatch(REGEX, ok.outputs[0].text)
    odd = ["\x00\x01", "tab\there", 'back\\slash "quoted"']
    outs = llm.generate(["Pick:"] * 3, [so(choice=odd, temperature=1.0, seed=i) for i in range(3)], use_tqdm=False)
    assert all(o.outputs[0].text in odd for o in outs)
    [anything] = llm.generate("JSON:", so(json=True, disable_any_whitespace=True, max_tokens=40), use_tqdm=False)
    assert anything.outputs[0].text


def test_a_slow_compile_hits_the_time_limit(tiny_text_model):
    eng = LLMEngine(tiny_text_model[0], dtype="float32", kv_cache_memory_gb=0.05, max_model_len=256,
                    structured_outputs_config={"compile_timeout_s": 0.001})
    props = {f"f{i}": {"type": "string", "pattern": "[a-z]{3,%d}" % (5 + i % 7)} for i in range(300)}
    heavy = {"type": "object", "properties": props, "required": list(props)}
    with pytest.raises(ValueError, match="did not compile within 0.001 s"):
        eng.add_request("r", "x", so(json=heavy))
    assert not eng.has_unfinished_requests()
    with pytest.raises(ValueError, match="compile_timeout_s must be > 0"):
        StructuredOutputsConfig(compile_timeout_s=0)


def test_constraint_starts_after_the_reasoning_ends(tmp_path, smollm2_tokenizer):
    """With a reasoning parser the grammar waits for </think>: a prompt that closed the thinking is constrained
    at once; one that opened it is free until the model writes </think> (forced here with a logit bias)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    tok = smollm2_tokenizer.__class__.from_pretrained(_save(smollm2_tokenizer, tmp_path / "tok"))
    tok.add_tokens(["<think>", "</think>"], special_tokens=True)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    llm = LLM(str(tmp_path / "m"), dtype="float32", kv_cache_memory_gb=0.05, max_model_len=256,
              reasoning_parser="qwen3")
    start, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    closed = tok.encode("Q: pick <think></think>", add_special_tokens=False)
    opened = tok.encode("Q: pick <think>", add_special_tokens=False)
    constrained = so(regex=REGEX, max_tokens=30)
    [a] = llm.generate({"prompt_token_ids": closed}, constrained, use_tqdm=False)
    assert re.fullmatch(REGEX, a.outputs[0].text)
    [b] = llm.generate({"prompt_token_ids": opened}, constrained, use_tqdm=False)
    [free] = llm.generate({"prompt_token_ids": opened}, SamplingParams(max_tokens=30, temperature=0.0),
                          use_tqdm=False)
    assert b.outputs[0].token_ids[:10] == free.outputs[0].token_ids[:10]     # thinking: no mask yet
    forced = SamplingParams(max_tokens=30, temperature=0.0, logit_bias={end: 100.0}, skip_special_tokens=False,
                            structured_outputs=StructuredOutputsParams(regex=REGEX))
    [c] = llm.generate({"prompt_token_ids": opened}, forced, use_tqdm=False)
    ids = c.outputs[0].token_ids
    assert ids[0] == end and c.outputs[0].finish_reason == "stop"
    assert re.fullmatch(REGEX, tok.decode(ids[1:], skip_special_tokens=True))
    # a prompt that neither opened nor closed thinking: the first token may open it, or start the answer
    bare = tok.encode("Q: pick", add_special_tokens=False)
    think_first = SamplingParams(max_tokens=5, temperature=0.0, logit_bias={start: 100.0}, skip_special_tokens=False,
                                 structured_outputs=StructuredOutputsParams(regex=REGEX))
    [d] = llm.generate({"prompt_token_ids": bare}, think_first, use_tqdm=False)
    assert d.outputs[0].token_ids[0] == start
    [e] = llm.generate({"prompt_token_ids": bare}, constrained, use_tqdm=False)
    assert re.fullmatch(REGEX, e.outputs[0].text)
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        LLMEngine(str(tmp_path / "m"), dtype="float32", kv_cache_memory_gb=0.05, reasoning_parser="nope")


def _save(tok, path) -> str:
    tok.save_pretrained(path)
    return str(path)
