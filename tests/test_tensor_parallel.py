"""Tensor parallelism on CPU: two ranks (this process and one worker process, gloo on loopback), each holding half
the heads, half the MLP and half the vocabulary, give transformers' greedy tokens, as one rank does."""
from __future__ import annotations

import pytest

from tests.family_checks import check_under_pressure, greedy
from tests.tiny_models import build_tiny, hf_greedy, random_prompts
from tokenmill import LLM

ENGINE = dict(dtype="float32", kv_cache_memory_gb=0.02, max_model_len=512, tensor_parallel_size=2)


def test_two_ranks_give_transformers_tokens(tiny_llama):
    """A mixed batch with its prompts in chunks of 16 beside decodes, then prompts that hit the cached prefix."""
    path, hf = tiny_llama
    llm = LLM(path, **ENGINE, max_num_batched_tokens=16)
    assert llm.llm_engine.runner.workers[0].is_alive()
    prompts = random_prompts([5, 33, 70, 12, 1], seed=11)
    assert greedy(llm, prompts, 16) == [hf_greedy(hf, p, 16) for p in prompts]
    longer = [prompts[2] + random_prompts([n], seed=n)[0] for n in (3, 9)]
    outs = llm.generate([{"prompt_token_ids": p} for p in longer], None, use_tqdm=False)
    assert all(o.num_cached_tokens >= 64 for o in outs)
    assert greedy(llm, longer, 16) == [hf_greedy(hf, p, 16) for p in longer]


def test_collectives_per_step_are_the_formula(tiny_llama):
    """A prefill of 20 rows then two decodes of one: 2 all-reduces a layer and one for the embeddings, of float32
    rows of hidden, and one gather of the sampled row's half of the vocabulary, each step."""
    from tokenmill import SamplingParams
    from tokenmill.executor.parallel import collectives_per_step
    path, hf = tiny_llama
    c = hf.config
    llm = LLM(path, **ENGINE)
    group = llm.llm_engine.runner.group
    eng = llm.llm_engine
    eng.add_request("r", {"prompt_token_ids": random_prompts([20], seed=2)[0]},
                    SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    for tokens in (20, 1, 1):
        before = {k: getattr(group, k) for k in ("all_reduces", "all_reduce_bytes", "gathers", "gather_bytes")}
        eng.step()
        after = {k: getattr(group, k) - v for k, v in before.items()}
        assert after == collectives_per_step(c.num_hidden_layers, c.hidden_size, c.vocab_size, 2, tokens, 1)


def test_preempted(tiny_llama):
    check_under_pressure(*tiny_llama, ENGINE, "preempted")


def test_one_kv_head_over_two_ranks_and_a_tied_head(tmp_path):
    """One kv head: both ranks hold it; the tied embeddings are split by vocabulary for the lookup and the head."""
    path, hf = build_tiny("llama_mqa_tied", tmp_path)
    llm = LLM(path, **ENGINE)
    prompts = random_prompts([9, 40], seed=3)
    assert greedy(llm, prompts, 16) == [hf_greedy(hf, p, 16) for p in prompts]


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "mistral_sw"])
def test_the_other_families(kind, tmp_path):
    """Qwen2's q/k/v biases split with their rows, Qwen3's per-head q/k norms stay whole, Mistral's window holds."""
    path, hf = build_tiny(kind, tmp_path)
    llm = LLM(path, **ENGINE)
    prompts = random_prompts([7, 40], seed=5)
    assert greedy(llm, prompts, 12) == [hf_greedy(hf, p, 12) for p in prompts]


def test_a_dead_worker_is_an_error_not_a_hang(tiny_llama):
    llm = LLM(tiny_llama[0], **ENGINE)
    llm.llm_engine.runner.workers[0].kill()
    llm.llm_engine.runner.workers[0].join()
    with pytest.raises(RuntimeError, match="Connection closed by peer|Connection reset|Broken pipe"):
        greedy(llm, random_prompts([5], seed=1), 4)


def test_a_dead_worker_stops_the_server_engine(tiny_llama):
    """Under the server's AsyncLLM: the request in flight fails, the engine reports itself dead (the server's
    health and every later request answer 503 with this error) and nothing hangs."""
    import asyncio
    from tokenmill import SamplingParams
    from tokenmill.engine.async_engine import AsyncLLM, EngineDeadError
    llm = AsyncLLM.from_engine_args(tiny_llama[0], **ENGINE)

    async def one() -> None:
        stream = await llm.add_request({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4))
        async for _ in stream:
            pass
    asyncio.run(one())                               # both ranks serve
    worker = llm.engine.runner.workers[0]
    worker.kill()
    worker.join()
    with pytest.raises(EngineDeadError):
        asyncio.run(one())
    llm._thread.join(timeout=30)
    assert not llm.is_running and "a tensor-parallel worker process died" in llm.error
    with pytest.raises(EngineDeadError, match="a tensor-parallel worker process died"):
        asyncio.run(one())


def test_what_cannot_split_is_refused(tiny_llama, tmp_path):
    import os
    path = tiny_llama[0]             # 6 heads, 2 kv heads, intermediate 80, vocabulary 320
    with pytest.raises(ValueError, match=f"tensor_parallel_size={os.cpu_count() + 1} exceeds the {os.cpu_count()} "
                                         f"cores here"):
        LLM(path, **{**ENGINE, "tensor_parallel_size": os.cpu_count() + 1})
    if os.cpu_count() >= 4:
        with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide attention heads \(6\)"):
            LLM(path, **{**ENGINE, "tensor_parallel_size": 4})
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1, got 0"):
        LLM(path, **{**ENGINE, "tensor_parallel_size": 0})
    with pytest.raises(ValueError, match="splits float checkpoints so far"):
        LLM(path, **ENGINE, quantization="int8")
    gemma, _ = build_tiny("gemma2", tmp_path)
    with pytest.raises(ValueError, match="splits LlamaForCausalLM, .* so far, not Gemma2ForCausalLM"):
        LLM(gemma, **ENGINE)


RANK0 = """
import json, sys
from tokenmill import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], dtype="float32", kv_cache_memory_gb=0.02, max_model_len=512, tensor_parallel_size=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outs]))
"""


def test_two_torchrun_nodes_on_loopback(tiny_llama, tmp_path):
    """Two torchrun invocations joining one rendezvous, as two machines would (README: Tensor parallelism): node 0
    runs the engine, node 1 `python -m tokenmill.executor.parallel`; the tokens are transformers'."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    from tokenmill.executor.parallel import free_port
    path, hf = tiny_llama
    prompts = random_prompts([5, 33, 12], seed=21)
    (tmp_path / "rank0.py").write_text(RANK0)
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    node1 = subprocess.Popen([*torchrun, "--node-rank", "1", "-m", "tokenmill.executor.parallel"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        node0 = subprocess.run([*torchrun, "--node-rank", "0", str(tmp_path / "rank0.py"), path, json.dumps(prompts)],
                               capture_output=True, text=True, timeout=120)
        assert node0.returncode == 0, node0.stderr[-3000:]
        assert node1.wait(timeout=30) == 0, node1.stdout.read()[-3000:]
    finally:
        node1.kill()
    got = json.loads(next(line for line in node0.stdout.splitlines() if line.startswith("TOKENS"))[7:])
    assert got == [hf_greedy(hf, p, 12) for p in prompts]
