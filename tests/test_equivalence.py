"""Token-exact equivalences of the optimised paths with the plain one (DESIGN.md's oracle list)."""
import pytest

from tests.tiny_models import random_prompts
from tokenmill import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def run(path, prompts, params=GREEDY, **kw):
    kw.setdefault("kv_cache_memory_gb", 0.02)
    kw.setdefault("max_model_len", 512)
    llm = LLM(path, dtype="float32", **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([5, 33, 70, 12, 1, 48, 20, 9], seed=3)


@pytest.fixture(scope="module")
def plain(tiny_llama, prompts):
    """Whole prefill, reference attention, no prefix caching: the plain path."""
    toks, _ = run(tiny_llama[0], prompts, attention_backend="torch", enable_prefix_caching=False)
    return toks


def test_kv_cache_equals_recompute(tiny_llama, prompts, plain):
    """The seeds' claim: the KV cache is pure memoisation."""
    toks, llm = run(tiny_llama[0], prompts, use_kv_cache=False)
    assert toks == plain
    assert llm.get_stats()["decode_tokens"] == 0          # every step recomputed the whole sequence


def test_batched_backend_equals_reference(tiny_llama, prompts, plain):
    toks, _ = run(tiny_llama[0], prompts, attention_backend="batched")
    assert toks == plain


@pytest.mark.parametrize("budget", [1, 7, 64])
def test_chunked_prefill_equals_whole(tiny_llama, prompts, plain, budget):
    toks, llm = run(tiny_llama[0], prompts, max_num_batched_tokens=budget)
    assert toks == plain
    assert llm.get_stats()["prefill_tokens"] == sum(len(p) for p in prompts) - llm.get_stats()["prefix_cache_hits"]


def test_alone_vs_batch_of_16(tiny_llama):
    ps = random_prompts([7 + 5 * i for i in range(16)], seed=4)
    alone = [run(tiny_llama[0], [p])[0][0] for p in ps[:3]]
    batch, _ = run(tiny_llama[0], ps)
    assert batch[:3] == alone


def test_prefix_hit_equals_miss(tiny_llama):
    shared = random_prompts([64], seed=5)[0]
    ps = [shared + s for s in random_prompts([3, 9, 17], seed=6)]
    miss, llm_miss = run(tiny_llama[0], ps, enable_prefix_caching=False)
    # submit one first so the others hit its cached blocks
    llm = LLM(tiny_llama[0], dtype="float32", max_model_len=512, kv_cache_memory_gb=0.02)
    first = llm.generate([{"prompt_token_ids": ps[0]}], GREEDY, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in ps[1:]], GREEDY, use_tqdm=False)
    assert [first[0].outputs[0].token_ids] + [o.outputs[0].token_ids for o in rest] == miss
    assert all(o.num_cached_tokens == 64 for o in rest)
    assert llm.get_stats()["prefill_tokens"] < llm_miss.get_stats()["prefill_tokens"] - 2 * 64 + 1


def test_preemption_equals_no_preemption(tiny_llama, prompts, plain):
    # 12 blocks of 16 tokens: room for about two requests at once, so the scheduler must preempt.
    # a block holds K and V for 3 layers x 16 tokens x 2 kv heads x head_dim 8 in float32
    block_bytes = 2 * 3 * 16 * 2 * 8 * 4
    llm = LLM(tiny_llama[0], dtype="float32", max_model_len=128, kv_cache_memory_gb=12 * block_bytes / 2 ** 30)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    toks = [o.outputs[0].token_ids for o in outs]
    assert llm.llm_engine.kv.num_blocks == 12
    assert llm.get_stats()["num_preemptions"] > 0
    assert toks == plain
    llm.llm_engine.kv.check_integrity()
    assert llm.llm_engine.kv.num_used_blocks == 0


def test_shared_prefix_computed_once(tiny_llama):
    """16 requests with a common 200-token prefix: the prefix is prefilled once, and the tokens are the plain
    path's (on CPU the hits go through the paged prefill kernel and the decode steps through cascade attention
    over the 192 shared positions)."""
    shared = random_prompts([200], seed=7)[0]
    suffixes = random_prompts([5 + i for i in range(16)], seed=8)
    ps = [shared + s for s in suffixes]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    toks, llm = run(tiny_llama[0], ps, params)
    plain, _ = run(tiny_llama[0], ps, params, attention_backend="torch", enable_prefix_caching=False)
    assert toks == plain
    stats = llm.get_stats()
    # 200 shared tokens = 12 full blocks (192 tokens) cached; everything else is computed per request
    assert stats["prefill_tokens"] == len(ps[0]) + sum(len(s) + 8 for s in suffixes[1:])
    assert stats["prefix_cache_hits"] == 15 * 192


def test_sliding_window_in_the_fewest_blocks(tiny_mistral_sw):
    """A sliding-window model's pool may be as small as its window and two blocks (4 here); prompts longer than
    that are prefilled in chunks that fit (they used to preempt themselves forever), and the tokens are the plain
    path's."""
    from tokenmill.executor.kv_cache import LayerKV
    ps = random_prompts([70, 33, 5, 48], seed=9)
    plain, llm = run(tiny_mistral_sw[0], ps, attention_backend="torch", enable_prefix_caching=False)
    mc = llm.llm_engine.model_config
    block = mc.num_hidden_layers * 16 * LayerKV.bytes_per_slot(mc.num_key_value_heads, mc.head_dim, "float32")
    toks, llm = run(tiny_mistral_sw[0], ps, max_model_len=128, kv_cache_memory_gb=4 * block / 2 ** 30)
    assert llm.llm_engine.kv.num_blocks == 4 and llm.get_stats()["num_preemptions"] > 0
    assert toks == plain
