"""Serving beyond one engine: two data-parallel replicas (one in this process, one in a process of its own), each
pinned to its own core, behind one AsyncLLM face, where cache-aware routing sends a prompt to the replica that
already caches its prefix; and `tokenmill serve --nnodes` splitting a model over two "machines"."""
from __future__ import annotations

import asyncio
import os
import time

import pytest

from tests.tiny_models import hf_greedy, random_prompts
from tokenmill import SamplingParams
from tokenmill.engine.async_engine import EngineDeadError
from tokenmill.engine.data_parallel import DataParallelLLM
from tokenmill.engine.router import BALANCE_ABS, Router, block_hashes

pytest_plugins = ["tests.server_fixtures"]
ENGINE = dict(dtype="float32", device="cpu", kv_cache_memory_gb=0.02, max_model_len=512)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

needs_two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a core per replica: needs 2")


def test_the_router_follows_prefixes_balances_and_skips_the_dead():
    p = random_prompts([40, 40, 40], seed=1)
    r = Router("cache_aware", 2, 16, blocks_per_replica=100)
    first = [r.pick(x, [True, True]) for x in p[:2]]
    assert first == [0, 1]                                  # new prefixes go to the least loaded, in turn
    assert r.pick(p[0] + [1, 2], [True, True]) == 0         # its first 2 blocks went to 0
    assert r.pick(p[1][:16] + p[2], [True, True]) == 1      # one block matches on 1
    r.load = [BALANCE_ABS, 0]
    assert r.pick(p[0], [True, True]) == 1                  # 0 is too busy: its prefix goes to the least loaded
    assert r.pick(p[0], [False, True]) == 1                 # a dead replica gets nothing
    with pytest.raises(EngineDeadError, match="every data-parallel replica"):
        r.pick(p[0], [False, False])
    rr = Router("round_robin", 2, 16, 100)
    assert [rr.pick(p[0], [True, True]) for _ in range(4)] == [0, 1, 0, 1]
    ll = Router("least_loaded", 2, 16, 100)
    ll.load = [3, 1]
    assert ll.pick(p[0], [True, True]) == 1
    small = Router("cache_aware", 2, 16, blocks_per_replica=2)
    small.pick(p[0], [True, True])
    small.pick(p[1], [True, True])
    small.pick(p[2], [True, True])       # replica 0 forgets p[0]'s blocks: it holds 2 blocks
    assert small._matched(0, block_hashes(p[0], 16)) == 0
    with pytest.raises(ValueError, match="cache_aware, round_robin, least_loaded"):
        Router("random", 2, 16, 100)


def test_outputs_cross_the_pipe_as_what_is_new():
    """Each step's output crosses as its new text, tokens, logprobs and latencies (the prompt once), and comes out
    whole again; text a stop string shortens, and n completions, come out right too."""
    import pickle
    from tokenmill.engine.replica import OutputDeltas, OutputMerger
    from tokenmill.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
    enc, dec = OutputDeltas(), OutputMerger()
    m = RequestMetrics(0.0)
    steps = [("Hel", [1, 2], [0.1]), ("Hello wor", [1, 2, 3, 4], [0.1, 0.2, 0.3]),
             ("Hello", [1, 2, 3, 4, 5], [0.1, 0.2, 0.3, 0.4])]         # the last cuts " wor", a stop string
    for i, (text, ids, itl) in enumerate(steps):
        done = i == len(steps) - 1
        outs = [CompletionOutput(k, text + "!" * k, [k] + ids, logprobs=[{t: Logprob(-t)} for t in [k] + ids],
                                 finish_reason="stop" if done else None) for k in (0, 1)]
        m.inter_token_latencies = list(itl)
        out = RequestOutput("r", "the prompt", [7, 8], outs, done, m)
        item = enc.encode(out)
        if i == 1:
            assert item[0].prompt_token_ids == [] and item[0].outputs[1].token_ids == [3, 4]
            assert item[0].outputs[0].text == "lo wor" and item[0].metrics.inter_token_latencies == [0.2, 0.3]
        if i == 2:
            assert item[0].outputs[0].text == "Hello"            # shorter than what was sent: whole again
        assert dec.decode(pickle.loads(pickle.dumps(item))) == out
    assert enc._sent == {} and dec._have == {}


def _serve(dp: DataParallelLLM, prompts: list[list[int]]) -> list[list[int]]:
    """The prompts one after another (as a chat's turns arrive), greedy: their tokens."""
    async def run() -> list[list[int]]:
        out = []
        for p in prompts:
            last = None
            async for last in await dp.add_request({"prompt_token_ids": p}, GREEDY):
                pass
            out.append(last.outputs[0].token_ids)
        return out
    return asyncio.run(run())


@pytest.fixture(scope="module")
def two_replicas(tiny_llama):
    dp = DataParallelLLM(tiny_llama[0], 2, **ENGINE)
    yield dp
    dp.shutdown(wait=True)


@needs_two_cores
def test_prefix_aware_routing_hits_more_than_round_robin(two_replicas, tiny_llama):
    """Three documents of 64 tokens, each asked four questions in turn: round-robin sends each document to both
    replicas (each computes it once), cache-aware to one. Tokens equal transformers' either way."""
    dp, hf = two_replicas, tiny_llama[1]
    assert dp.cores[0] != dp.cores[1]
    assert os.sched_getaffinity(dp.replicas[0]._thread.native_id) == set(dp.cores[0])
    assert os.sched_getaffinity(dp.replicas[1].process.pid) == set(dp.cores[1])
    hits = {}
    for policy, seed in (("round_robin", 10), ("cache_aware", 20)):
        dp.router.policy = policy
        docs = random_prompts([64] * 3, seed=seed)
        prompts = [doc + q for q in random_prompts([5] * 4, seed=seed + 1) for doc in docs]
        before = dp.state.prefix_cache_hits
        got = _serve(dp, prompts)
        hits[policy] = dp.state.prefix_cache_hits - before
        assert got[:2] == [hf_greedy(hf, p, 4) for p in prompts[:2]]
        assert got[-1] == hf_greedy(hf, prompts[-1], 4)
    # round-robin: every document is computed on both replicas (6 misses of 12); cache-aware: once (3 misses)
    assert hits["round_robin"] == 6 * 64 and hits["cache_aware"] == 9 * 64, hits
    assert all(r.state.num_steps > 0 for r in dp.replicas)
    assert dp.router.load == [0, 0]


@needs_two_cores
def test_bad_input_on_a_remote_replica_is_a_value_error(two_replicas):
    """The replica's ValueError crosses the pipe; the replica goes on serving."""
    dp = two_replicas
    dp.router.policy = "round_robin"
    dp.router._next = 1

    async def bad():
        await dp.add_request({"prompt_token_ids": [10 ** 6]}, GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        asyncio.run(bad())

    async def twice():
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)       # in flight at the second add
        first = await dp.add_request({"prompt_token_ids": [5, 6]}, long, request_id="same")
        with pytest.raises(ValueError, match="request id 'same' is already in use"):
            await dp.add_request({"prompt_token_ids": [5, 6]}, GREEDY, request_id="same")
        async for _ in first:
            pass
    asyncio.run(twice())
    dp.router._next = 1
    assert len(_serve(dp, random_prompts([7], seed=3))[0]) == 4
    assert dp.router.load == [0, 0]


@needs_two_cores
def test_a_dead_replica_fails_health_and_the_other_serves(tiny_llama):
    dp = DataParallelLLM(tiny_llama[0], 2, **ENGINE)
    dp.replicas[1].process.kill()
    dp.replicas[1].process.join()
    for _ in range(100):
        if dp.replicas[1].error is not None:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert not dp.is_running and "replica 1" in dp.error and "exited" in dp.error
    dp.router.policy = "round_robin"
    assert [len(t) for t in _serve(dp, random_prompts([6, 6], seed=4))] == [4, 4]      # both on replica 0
    assert dp.state.num_running == 0 and dp.router.load == [0, 0]
    dp.shutdown(wait=True)


def test_what_cannot_be_served_is_refused(tiny_llama):
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match=f"data_parallel_size={cores + 1} needs a core per replica"):
        DataParallelLLM(tiny_llama[0], cores + 1, **ENGINE)
    with pytest.raises(ValueError, match="choose one of cache_aware"):
        DataParallelLLM(tiny_llama[0], 2, routing="prefix", **ENGINE)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        DataParallelLLM(tiny_llama[0], 2, tensor_parallel_size=2, **ENGINE)
    from tokenmill import LLM
    with pytest.raises(ValueError, match="data_parallel_size is for serving"):
        LLM(tiny_llama[0], data_parallel_size=2, **ENGINE)


@pytest.mark.slow
@needs_two_cores
def test_a_data_parallel_server_answers_the_openai_client(chat_model_dir):
    """`serve --data-parallel-size 2` as the CLI builds it: chats that share a system prompt all go to the replica
    that has it; /metrics counts both replicas; a dead replica turns /health to 503, naming it."""
    import httpx
    import openai
    from tests.server_fixtures import LiveServer
    from tokenmill.server.app import build_app
    dp = DataParallelLLM(chat_model_dir, 2, dtype="float32", device="cpu", max_model_len=512,
                         kv_cache_memory_gb=0.05)
    server = LiveServer(build_app(dp, model_name="tiny-chat"))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        system = "You answer questions about the tokenmill engine. " * 8
        for q in ("What is prefill?", "What is decode?", "What is a KV cache?"):
            r = client.chat.completions.create(model="tiny-chat", max_tokens=3, temperature=0, messages=[
                {"role": "system", "content": system}, {"role": "user", "content": q}])
            assert r.usage.completion_tokens == 3
        hits = server.metrics()[("tokenmill:prefix_cache_hits_total", ())]
        assert hits == dp.state.prefix_cache_hits >= 2 * 64
        assert sorted(s.num_steps > 0 for s in dp._states) == [False, True]      # one replica took them all
        assert httpx.get(server.url + "/health").status_code == 200
        # the same chat on replica 1, streamed from its process, says what replica 0 says, logprobs and all
        ask = dict(model="tiny-chat", max_tokens=8, temperature=0, logprobs=True, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": "What is decode?"}])
        here = client.chat.completions.create(**ask)
        dp.router.policy, dp.router._next = "round_robin", 1
        chunks = [c for c in client.chat.completions.create(**ask, stream=True) if c.choices]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == here.choices[0].message.content
        assert [t.token for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content] == \
            [t.token for t in here.choices[0].logprobs.content]
        assert dp._states[1].num_steps > 0
        dp.replicas[1].process.kill()
        dp.replicas[1].process.join()
        for _ in range(100):
            health = httpx.get(server.url + "/health")
            if health.status_code == 503:
                break
            time.sleep(0.05)
        assert health.status_code == 503 and "replica 1" in health.json()["error"]["message"]
    finally:
        server.stop()
        dp.shutdown(wait=True)


@pytest.mark.slow
def test_serve_across_two_nodes_on_loopback(tiny_llama):
    """`tokenmill serve --nnodes 2`: node 1 joins the rendezvous and runs its half of the model, node 0 serves;
    the tokens are transformers' (docs/parallelism.md)."""
    import subprocess
    import sys
    import httpx
    from tokenmill.executor.parallel import free_port
    path, hf = tiny_llama
    serve = [sys.executable, "-m", "tokenmill.cli", "serve", path, "-tp", "2", "--nnodes", "2", "--master-port",
             str(free_port()), "--dtype", "float32", "--device", "cpu", "--kv-cache-memory-gb", "0.02",
             "--max-model-len", "512"]
    node1 = subprocess.Popen([*serve, "--node-rank", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    node0 = subprocess.Popen([*serve, "--node-rank", "0", "--port", "0"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        url = next((line.split()[-1] for line in node0.stdout if "OpenAI API:" in line), None)
        assert url is not None, f"node 0 exited with {node0.wait()}"
        prompt = random_prompts([9], seed=8)[0]
        r = httpx.post(url + "/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        assert r.json()["choices"][0]["token_ids"] == hf_greedy(hf, prompt, 6)
    finally:
        node0.terminate()           # drains (nothing is in flight), then exits 0
        assert node0.wait(timeout=30) == 0
        assert node1.wait(timeout=30) == 0, node1.stdout.read()[-3000:]     # told to stop by node 0


def test_a_rendezvous_that_does_not_fill_is_an_error(monkeypatch):
    """Node 0 started alone: an error after the join timeout (TIMEOUT_S, 120 s; 0.2 s here), naming the address."""
    from tokenmill.executor.parallel import TPGroup, free_port
    port = free_port()
    for k, v in dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=f"not every rank joined the rendezvous at 127.0.0.1:{port} within 0.2 s"):
        TPGroup.from_env(2, timeout_s=0.2)
