"""cache_salt (vLLM's): a request's prefix-cache blocks are shared only with requests of the same salt, so one client
cannot learn from cached_tokens (or the hit counters) what another sent. Unsalted requests share among themselves."""
from __future__ import annotations

import pytest

from tests.tiny_models import random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.engine.kv_cache_manager import HybridKVCacheManager, KVCacheManager
from tokenmill.engine.request import Request
from tokenmill.engine.router import Router, block_hashes
from tokenmill.pooling_params import PoolingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
ENGINE = dict(dtype="float32", device="cpu", max_model_len=128, kv_cache_memory_gb=0.01, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama[0], **ENGINE)


def prompt(ids: list[int], salt=None) -> dict:
    return {"prompt_token_ids": ids} if salt is None else {"prompt_token_ids": ids, "cache_salt": salt}


def run(llm: LLM, ids: list[int], salt=None, params: SamplingParams = GREEDY) -> tuple[list[int], int, int]:
    """(greedy tokens, the output's cached tokens, prefix-cache hits this request added to the engine's counter)."""
    before = llm.get_stats()["prefix_cache_hits"]
    out = llm.generate([prompt(ids, salt)], params, use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens, llm.get_stats()["prefix_cache_hits"] - before


def test_two_salts_never_share_a_hit_and_the_same_salt_does(llm):
    ids = random_prompts([40], seed=1)[0]          # 2 full blocks of 16 before the last token: a hit is 32 tokens
    first = {salt: run(llm, ids, salt) for salt in (None, "alice", "bob")}
    again = {salt: run(llm, ids, salt) for salt in (None, "alice", "bob")}
    for salt in first:
        assert first[salt][1:] == (0, 0), f"salt {salt!r} hit another salt's blocks"
        assert again[salt][1:] == (32, 32), f"salt {salt!r} missed its own blocks"
    # salting changes what is shared, never what is computed
    assert len({tuple(v[0]) for v in (*first.values(), *again.values())}) == 1
    llm.llm_engine.kv.check_integrity()


def test_unsalted_requests_do_not_hit_salted_blocks(llm):
    ids = random_prompts([40], seed=2)[0]
    assert run(llm, ids, "alice")[1:] == (0, 0)
    assert run(llm, ids)[1:] == (0, 0)
    # "cache_salt": None is no salt (an optional field left unset): it shares the unsalted blocks
    out = llm.generate([{"prompt_token_ids": ids, "cache_salt": None}], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 32


def test_n_children_carry_the_salt(llm):
    ids = random_prompts([40], seed=3)[0]
    eng = llm.llm_engine
    eng.add_request("kids", prompt(ids, "s"), SamplingParams(n=2, temperature=0, max_tokens=3, ignore_eos=True))
    assert [eng.requests[c].cache_salt for c in eng.parents["kids"]] == ["s", "s"]
    while eng.has_unfinished_requests():
        eng.step()
    assert run(llm, ids, "t")[1:] == (0, 0)
    assert run(llm, ids, "s")[1:] == (32, 32)


def test_embeddings_carry_the_salt(llm):
    ids = random_prompts([40], seed=4)[0]
    kv = llm.llm_engine.kv

    def embed_hits(salt) -> int:
        before = kv.num_hits
        llm.embed([prompt(ids, salt)], use_tqdm=False)
        return kv.num_hits - before
    assert [embed_hits(s) for s in ("a", "b", "a", None)] == [0, 0, 32, 0]    # LAST pooling reads the cache


@pytest.mark.parametrize("bad", ["", 7, b"salt", ["s"]])
def test_a_bad_salt_is_refused(llm, bad):
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm.generate([prompt([1, 2, 3], bad)], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm.embed([{"prompt_token_ids": [1, 2, 3], "cache_salt": bad}], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_misspelt_prompt_key_is_refused(llm):
    # silently dropped, it would leave the request in the shared cache
    with pytest.raises(ValueError, match="unknown prompt dict key.*'cache_sald'.*'cache_salt'"):
        llm.generate([{"prompt_token_ids": [1, 2, 3], "cache_sald": "s"}], GREEDY, use_tqdm=False)


def test_speculative_decoding_carries_the_salt(tiny_llama, llm):
    spec = LLM(tiny_llama[0], **ENGINE, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    ids = random_prompts([40], seed=5)[0]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = run(llm, ids, params=params)[0]
    assert run(spec, ids, "a", params) == (plain, 0, 0)
    assert run(spec, ids, "b", params) == (plain, 0, 0)
    assert run(spec, ids, "a", params) == (plain, 32, 32)
    spec.llm_engine.kv.check_integrity()


BS = 4


@pytest.mark.parametrize("hybrid", [False, True])
def test_a_preempted_request_finds_its_own_salted_blocks_again(hybrid):
    """Preemption frees a request's blocks (their hashes stay) and recomputes it: it must find them under its salt,
    and no other salt may."""
    kv = HybridKVCacheManager(16, BS, True, [None, 8]) if hybrid else KVCacheManager(16, BS)
    ids = list(range(13))             # 3 full blocks before the last token

    def req(rid: str, salt=None) -> Request:
        return Request(rid, ids, SamplingParams(), 0.0, 1, (), cache_salt=salt)
    a = req("a", "s")
    hit, n = kv.get_computed_blocks(a)
    assert n == 0 and kv.allocate_slots(a, a.num_tokens, hit)
    a.num_computed_tokens = a.num_tokens
    kv.free(a)                        # the scheduler's _preempt: blocks back, computed count 0
    a.num_computed_tokens = 0
    assert kv.get_computed_blocks(req("b", "t"))[1] == 0
    assert kv.get_computed_blocks(req("c"))[1] == 0
    assert kv.get_computed_blocks(a)[1] == 12
    kv.check_integrity()


def test_router_hashes_keep_salts_apart():
    ids = list(range(48))
    plain = block_hashes(ids, 16)
    assert plain == block_hashes(ids, 16, None)
    salted = {s: block_hashes(ids, 16, s) for s in ("a", "b")}
    assert not set(salted["a"]) & set(salted["b"]) and not set(salted["a"]) & set(plain)
    router = Router("cache_aware", 2, 16, 100)
    assert router.pick(ids, [True, True], "a") == 0
    router.load[0] -= 1               # it finished: both replicas idle, replica 1 next in turn
    assert router.pick(ids, [True, True], "b") == 1      # no affinity to where salt "a" went
    assert router.pick(ids, [True, True], "a") == 0      # salt "a"'s blocks went to replica 0
