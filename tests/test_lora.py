"""LoRA adapters made by the real peft on tiny random models: tokenmill's batched adapters against transformers with
each adapter applied through peft (greedy tokens equal, logprobs within 1e-4), mixed in one batch with the base
model, under chunked prefill, prefix hits, preemption and speculation; slots never mix rows; bad adapters refused."""
from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests.tiny_models import build_tiny, hf_greedy, hf_logprobs, random_prompts
from tokenmill import LLM, LoRARequest, SamplingParams

peft = pytest.importorskip("peft")

N_NEW = 8
GREEDY = SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True, logprobs=0)

# three adapters that differ in rank, alpha, rsLoRA and which projections (and layers) they adapt
ADAPTERS = {
    "all": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"]),
    "qv_rslora": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    "mlp_layer1": dict(r=16, lora_alpha=8, target_modules=["o_proj", "gate_proj", "down_proj"],
                       layers_to_transform=[1], rank_pattern={"down_proj": 6}),
}


def make_adapter(base, path, seed: int, **cfg) -> str:
    """A peft adapter with random A and B (peft's default B = 0 would make it the identity), saved to path."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **cfg))
    with torch.no_grad():                  # large enough to move the greedy tokens away from the base model's
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(3.0)
    model.save_pretrained(str(path))
    model.unload()                          # the base model as it was, for the next adapter
    return str(path)


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    path, base = build_tiny("llama", root / "base")
    adapters = {name: make_adapter(base, root / name, i + 1, **cfg) for i, (name, cfg) in enumerate(ADAPTERS.items())}
    return path, base, adapters


@pytest.fixture(scope="module")
def oracle(lora_setup):
    """(adapter or None, prompt index) -> (greedy tokens, their logprobs) from transformers with peft."""
    path, base, adapters = lora_setup
    prompts = random_prompts([5, 23, 40, 11], seed=3)
    out = {}
    for i, p in enumerate(prompts):
        toks = hf_greedy(base, p, N_NEW)
        out[(None, i)] = (toks, hf_logprobs(base, p, toks))
    for name, ad in adapters.items():
        model = peft.PeftModel.from_pretrained(base, ad).eval()
        for i, p in enumerate(prompts):
            toks = hf_greedy(model, p, N_NEW)
            out[(name, i)] = (toks, hf_logprobs(model, p, toks))
        model.unload()
    return prompts, out


def requests(adapters: dict, names: list) -> list:
    ids = {name: i + 1 for i, name in enumerate(ADAPTERS)}
    return [None if n is None else LoRARequest(n, ids[n], adapters[n]) for n in names]


def check(outs, names, idx, oracle_out):
    for o, name, i in zip(outs, names, idx):
        toks, lps = oracle_out[(name, i)]
        c = o.outputs[0]
        assert c.token_ids == toks, (name, i)
        got = torch.tensor([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
        assert torch.allclose(got, lps, atol=1e-4, rtol=0), (name, i, (got - lps).abs().max())


MIX = [None, "all", "qv_rslora", "mlp_layer1"]


def mixed_batch(prompts):
    """Every prompt with every adapter and the base model, interleaved so each step mixes them."""
    names = [MIX[(i + j) % 4] for i in range(len(prompts)) for j in range(4)]
    idx = [i for i in range(len(prompts)) for _ in range(4)]
    return names, idx


def test_adapters_differ_from_base(oracle):
    prompts, out = oracle
    for name in ADAPTERS:
        assert any(out[(name, i)][0] != out[(None, i)][0] for i in range(len(prompts))), name


@pytest.mark.parametrize("cpu_kernels", ["auto", "reference"])
def test_mixed_batch_equals_peft(lora_setup, oracle, cpu_kernels):
    path, _, adapters = lora_setup
    prompts, out = oracle
    names, idx = mixed_batch(prompts)
    llm = LLM(path, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16, cpu_kernels=cpu_kernels,
              kv_cache_memory_gb=0.02)
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in idx], GREEDY, use_tqdm=False,
                        lora_request=requests(adapters, names))
    check(outs, names, idx, out)


@pytest.mark.slow
def test_gpu_plan_under_the_interpreter(lora_setup, oracle):
    """The GPU's runner and plan (Triton kernels, the LoRA shrink-expand among them) on the CPU under Triton's
    interpreter."""
    pytest.importorskip("triton")
    path, _, adapters = lora_setup
    prompts, out = oracle
    names, idx, n = [None, "all"], [0, 0], 4          # the interpreter is slow: the base and one adapter, 4 tokens
    llm = LLM(path, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, attention_backend="triton",
              cpu_kernels="triton", kv_cache_memory_gb=0.02, max_num_seqs=4)
    assert llm.llm_engine.model.ops.describe()["lora"].startswith("triton")
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in idx], replace(GREEDY, max_tokens=n),
                        use_tqdm=False, lora_request=requests(adapters, names))
    check(outs, names, idx, {k: (toks[:n], lps[:n]) for k, (toks, lps) in out.items()})


def test_chunked_prefill_prefix_hits_and_one_slot(lora_setup, oracle):
    """One slot for three adapters (they queue), 8-token chunks, and the same prompts again: hits only within an
    adapter, never across."""
    path, _, adapters = lora_setup
    prompts, out = oracle
    names, idx = mixed_batch(prompts)
    llm = LLM(path, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=16, max_num_batched_tokens=8,
              long_prefill_token_threshold=8, kv_cache_memory_gb=0.02)
    reqs = requests(adapters, names)
    first = llm.generate([{"prompt_token_ids": prompts[i]} for i in idx], GREEDY, use_tqdm=False, lora_request=reqs)
    check(first, names, idx, out)
    again = llm.generate([{"prompt_token_ids": prompts[2]}] * 4, GREEDY, use_tqdm=False,
                         lora_request=requests(adapters, MIX))
    check(again, MIX, [2] * 4, out)
    assert all(o.num_cached_tokens == 32 for o in again)        # 40 tokens: two full blocks, each its own adapter's
    # a new adapter on a prompt cached only for others computes it all
    extra = LoRARequest("all-again", 9, adapters["all"])
    o = llm.generate([{"prompt_token_ids": prompts[2]}], GREEDY, use_tqdm=False, lora_request=extra)[0]
    assert o.num_cached_tokens == 0
    check([o], ["all"], [2], out)


def test_preemption(lora_setup, oracle):
    path, _, adapters = lora_setup
    prompts, out = oracle
    names, idx = mixed_batch(prompts)
    block_bytes = 2 * 3 * 16 * 2 * 8 * 4
    llm = LLM(path, dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16, max_model_len=64,
              kv_cache_memory_gb=4 * block_bytes / 2 ** 30)      # 4 blocks: room for about one request
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in idx], GREEDY, use_tqdm=False,
                        lora_request=requests(adapters, names))
    assert llm.get_stats()["num_preemptions"] > 0
    check(outs, names, idx, out)


def test_speculation(lora_setup, oracle):
    path, _, adapters = lora_setup
    prompts, out = oracle
    names, idx = mixed_batch(prompts)
    llm = LLM(path, dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16, kv_cache_memory_gb=0.02,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in idx], GREEDY, use_tqdm=False,
                        lora_request=requests(adapters, names))
    check(outs, names, idx, out)
    assert llm.get_stats()["spec_num_drafts"] > 0


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantised_base_one_call_layer(tmp_path, quantization):
    """Quantised base weights: the CPU plan's one-call decode layer adds each row's adapter after each of its four
    products; it equals the same kernels called layer by layer (greedy ids, logprobs within 1e-4), and the adapters
    change the tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1)
    base = LlamaForCausalLM(cfg)
    base.save_pretrained(tmp_path / "base")
    names = [None, "all", "qv_rslora"] * 2
    paths = {n: make_adapter(base, tmp_path / n, i + 1, **ADAPTERS[n]) for i, n in enumerate(["all", "qv_rslora"])}
    reqs = requests(paths, names)
    llm = LLM(str(tmp_path / "base"), dtype="float32", quantization=quantization, kv_cache_memory_gb=0.01,
              enable_lora=True, max_loras=2, max_lora_rank=8, enable_prefix_caching=False)
    ops = llm.llm_engine.model.ops
    assert len(ops._layers) == 2
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 17], seed=4) for _ in range(3)]
    fused = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=reqs)
    ops._layers.clear()
    plain = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=reqs)
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert abs(la[next(iter(la))].logprob - lb[next(iter(lb))].logprob) < 1e-4
    toks = [o.outputs[0].token_ids for o in fused]
    assert toks[1] != toks[0] and toks[2] != toks[0] and toks[4] != toks[3]     # each prompt: base, all, qv


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(-1, 3), min_size=1, max_size=24), st.integers(0, 2 ** 16))
def test_rows_never_take_another_rows_adapter(row_slots, seed):
    """The plan's batched shrink-expand against each row computed alone with its own slot."""
    from tokenmill.executor.ops import ReferenceOps
    g = torch.Generator().manual_seed(seed)
    T, IN, OUT, R, S = len(row_slots), 12, 10, 6, 4
    x, y = torch.randn(T, IN, generator=g), torch.randn(T, OUT, generator=g)
    a, b = torch.randn(S, IN, R, generator=g), torch.randn(S, R, OUT, generator=g)
    ops = ReferenceOps()
    m = ops.lora_mapping(torch.tensor(row_slots, dtype=torch.int32), torch.device("cpu"), torch.float32)
    got = y.clone() if m is None else ops.lora(x, y.clone(), a, b, m)
    want = torch.stack([y[t] if s < 0 else y[t] + x[t] @ a[s] @ b[s] for t, s in enumerate(row_slots)])
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_shrink_expand(dtype):
    """tm_lora in every kernel variant this CPU runs, against each row computed alone in float32: rows of one slot
    in tiles, rows without an adapter untouched, a bfloat16 y rounded once."""
    from tokenmill.executor.kernels import load, runnable_variants
    from tokenmill.executor.ops import CpuKernelOps
    g = torch.Generator().manual_seed(0)
    T, IN, OUT, R, S = 37, 72, 600, 24, 5
    slots = [(3 * t) % (S + 2) - 1 for t in range(T)]           # -1 and 0..S (S: made -1 below)
    slots = [s if s < S else -1 for s in slots]
    x, y = torch.randn(T, IN, generator=g).to(dtype), torch.randn(T, OUT, generator=g).to(dtype)
    a, b = torch.randn(S, IN, R, generator=g), torch.randn(S, R, OUT, generator=g)
    want = torch.stack([y[t].float() if s < 0 else y[t].float() + x[t].float() @ a[s] @ b[s]
                        for t, s in enumerate(slots)])
    for isa in runnable_variants():
        ops = CpuKernelOps(load(isa), dtype, True)
        got = ops.lora(x, y.clone(), a, b, ops.lora_mapping(torch.tensor(slots, dtype=torch.int32),
                                                            torch.device("cpu"), dtype))
        none = [t for t, s in enumerate(slots) if s < 0]
        assert torch.equal(got[none], y[none]), isa
        if dtype == torch.float32:
            assert torch.allclose(got, want, atol=1e-3, rtol=1e-5), isa
        else:       # one rounding of the float32 sum: within half a bfloat16 step of it
            assert ((got.float() - want).abs() <= want.abs() * 2 ** -8 + 1e-6).all(), isa


def test_runner_maps_each_row_to_its_requests_slot(lora_setup):
    """Through the engine: a batch of random requests of random adapters; every row's slot holds its request's
    adapter."""
    path, _, adapters = lora_setup
    llm = LLM(path, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16, kv_cache_memory_gb=0.02,
              max_num_batched_tokens=24, long_prefill_token_threshold=24)
    runner = llm.llm_engine.runner
    seen = []
    plain = runner.lora_slots.row_slots

    def watch(plan):
        rows = plain(plan)
        by_key = {k: s for k, s in runner.lora_slots.slot_of.items()}
        for e, req in enumerate(plan.batch.entry_req):
            st_ = plan.states[req]
            want = -1 if st_.lora is None else by_key[st_.lora.cache_key]
            for r in range(plan.batch.qsl[e], plan.batch.qsl[e + 1]):
                seen.append((-1 if rows is None else int(rows[r])) == want)
        return rows

    runner.lora_slots.row_slots = watch
    r = random.Random(0)
    names = [r.choice(MIX) for _ in range(12)]
    llm.generate([{"prompt_token_ids": p} for p in random_prompts([r.randrange(3, 30) for _ in names], seed=5)],
                 GREEDY, use_tqdm=False, lora_request=requests(adapters, names))
    assert seen and all(seen)


# ---- bad input ------------------------------------------------------------------------------------------------------
def test_bad_adapters_refused(lora_setup, tmp_path):
    path, base, adapters = lora_setup
    llm = LLM(path, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, kv_cache_memory_gb=0.02)
    p = {"prompt_token_ids": [1, 2, 3]}
    with pytest.raises(ValueError, match="rank 16 .*max_lora_rank is 8"):
        llm.generate(p, GREEDY, use_tqdm=False, lora_request=LoRARequest("big", 1, adapters["mlp_layer1"]))
    head = make_adapter(base, tmp_path / "head", 7, r=4, lora_alpha=4, target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="lm_head"):
        llm.generate(p, GREEDY, use_tqdm=False, lora_request=LoRARequest("head", 2, head))
    other_path, other = build_tiny("qwen3", tmp_path / "other")
    wrong = make_adapter(other, tmp_path / "wrong", 8, r=4, lora_alpha=4, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="made for another model"):
        llm.generate(p, GREEDY, use_tqdm=False, lora_request=LoRARequest("wrong", 3, wrong))
    with pytest.raises(ValueError, match="not a directory"):
        llm.generate(p, GREEDY, use_tqdm=False, lora_request=LoRARequest("missing", 4, str(tmp_path / "nope")))
    cfg = json.load(open(f"{adapters['all']}/adapter_config.json"))
    (tmp_path / "dora").mkdir()
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(ValueError, match="DoRA"):
        llm.generate(p, GREEDY, use_tqdm=False, lora_request=LoRARequest("dora", 5, str(tmp_path / "dora")))
    # the engine keeps serving: the base model and a good adapter after the refusals
    out = llm.generate([p, p], GREEDY, use_tqdm=False,
                       lora_request=[None, LoRARequest("qv", 6, adapters["qv_rslora"])])
    assert all(len(o.outputs[0].token_ids) == N_NEW for o in out)
    plain = LLM(path, dtype="float32", kv_cache_memory_gb=0.02)
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate(p, GREEDY, use_tqdm=False, lora_request=LoRARequest("qv", 6, adapters["qv_rslora"]))
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("zero", 0, adapters["all"])
