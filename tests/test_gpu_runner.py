"""The GPU's runner on a CPU: its resident batch and its captured decode steps, as traced stand-ins of CUDA graphs
(executor/graphs.py), against its own eager path and against transformers.

The 'padded' attention backend (torch ops of fixed shapes, prepared on the device) serves the family sweep and the
features; the Triton kernels, interpreted, serve the checks that the GPU's own step is graph-safe."""
from __future__ import annotations

import pytest
import torch

from tests.tiny_models import ARCHS, build_tiny, hf_greedy, random_prompts
from tokenmill import LLM, SamplingParams

SIZES = [1, 2, 4]


def runner_llm(path: str, graphs: bool, backend: str = "padded", plan: str = "reference", sizes=SIZES, **kw) -> LLM:
    kw.setdefault("kv_cache_memory_gb", 0.02)
    kw.setdefault("max_model_len", 256)
    comp = {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": sizes} if graphs else None
    return LLM(path, dtype="float32", device="cpu", attention_backend=backend, cpu_kernels=plan,
               compilation_config=comp, enforce_eager=not graphs, **kw)


def outputs(llm: LLM, prompts: list, params) -> list[tuple[list[int], list]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [{t: (lp.logprob, lp.rank) for t, lp in d.items()}
                                      for d in (o.outputs[0].logprobs or [])]) for o in outs]


def assert_same(got: list, want: list, tol: float = 1e-5) -> None:
    """The same tokens, ranks and top tokens; logprobs equal up to the rounding of a batch's rows summed in
    another order (a padded batch is a GEMM of more rows: BLAS may block it otherwise)."""
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert [{t: r for t, (_, r) in d.items()} for d in a] == [{t: r for t, (_, r) in d.items()} for d in b]
        worst = max((abs(d[t][0] - e[t][0]) for d, e in zip(a, b) for t in d), default=0.0)
        assert worst <= tol, worst


# make test-fast keeps two families (GQA; soft caps and per-layer windows in three KV groups)
FAMILIES = [k if k in ("llama", "gemma2") else pytest.param(k, marks=pytest.mark.slow) for k in ARCHS]


@pytest.mark.parametrize("kind", FAMILIES)
def test_graphs_replay_the_eager_step(kind, tmp_path):
    """Batches of 4, 3, 2 and 1 requests (padded to 4, 4, 2, 1): tokens and logprobs equal the eager path's, and
    the eager path's tokens equal transformers'."""
    path, hf = build_tiny(kind, tmp_path)
    prompts = random_prompts([5, 17, 9, 3], seed=4)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (3, 6, 9, 12)]
    eager = outputs(runner_llm(path, graphs=False), [{"prompt_token_ids": p} for p in prompts], params)
    llm = runner_llm(path, graphs=True)
    graph = outputs(llm, [{"prompt_token_ids": p} for p in prompts], params)
    assert_same(graph, eager)
    for p, (toks, _) in zip(prompts, eager):
        assert toks == hf_greedy(hf, p, len(toks))
    runner = llm.llm_engine.runner
    if llm.llm_engine.model_config.moe_layers:      # routing counts tokens on the host: no graphs (yet)
        assert not runner.capture_sizes and not runner.graphs and runner.num_graph_steps == 0
    else:
        assert set(runner.replays) == set(SIZES), runner.replays
        assert runner.replays[4] >= 2         # 4 and 3 requests
        assert llm.get_stats()["num_graph_steps"] == runner.num_graph_steps


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_tiny("llama", tmp_path_factory.mktemp("runner_llama"))


def test_chunked_prefill_prefix_hits_preemption_and_seeds(llama):
    """Prompt chunks of 16 tokens, prompts sharing a 32-token prefix, a cache that preempts, more requests than
    rows, greedy and seeded sampled requests side by side: the same outputs with graphs as without."""
    path, _ = llama
    shared = random_prompts([32], seed=9)[0]
    prompts = [{"prompt_token_ids": shared + tail} for tail in random_prompts([3, 11, 6, 20, 8, 1], seed=10)]
    params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=1) if i % 2 else
              SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=14, ignore_eos=True, logprobs=1)
              for i in range(len(prompts))]
    kw = dict(max_num_batched_tokens=16, kv_cache_memory_gb=0.00005, max_model_len=96, max_num_seqs=4,
              sizes=[1, 2, 4])      # four resident rows for six requests: rows are given back and taken again
    eager = outputs(runner_llm(path, graphs=False, **kw), prompts, params)
    llm = runner_llm(path, graphs=True, **kw)
    assert_same(outputs(llm, prompts, params), eager)
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0 and stats["num_graph_steps"] > 0
    llm.llm_engine.kv.check_integrity()


@pytest.mark.parametrize("method", ["ngram", pytest.param("draft", marks=pytest.mark.slow)])
def test_speculative_verification_replays_graphs(llama, method, tmp_path):
    """A verification's rows are one-row entries: the step takes a graph of its rows' size."""
    path, _ = llama
    spec = {"method": "ngram", "num_speculative_tokens": 3} if method == "ngram" else \
        {"method": "draft_model", "model": build_tiny("llama", tmp_path, seed=3)[0], "num_speculative_tokens": 2}
    seg = random_prompts([5, 7], seed=12)
    prompts = [{"prompt_token_ids": (s * 5)[:30]} for s in seg]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.8, seed=7, max_tokens=16, ignore_eos=True)]
    kw = dict(speculative_config=spec, sizes=[1, 2, 4, 8])
    eager = outputs(runner_llm(path, graphs=False, **kw), prompts, params)
    llm = runner_llm(path, graphs=True, **kw)
    assert_same(outputs(llm, prompts, params), eager)
    stats = llm.get_stats()
    assert stats["spec_num_drafts"] > 0 and stats["num_graph_steps"] > 0


@pytest.mark.slow
@pytest.mark.serial
def test_structured_outputs_under_graphs(tiny_text_model):
    from tokenmill import StructuredOutputsParams
    path, _ = tiny_text_model
    params = [SamplingParams(max_tokens=24, temperature=0,
                             structured_outputs=StructuredOutputsParams(regex=r"[0-9]{2,4}-[a-z]{3}")),
              SamplingParams(max_tokens=24, temperature=1.0, seed=3,
                             structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"])),
              SamplingParams(max_tokens=8, temperature=0)]
    prompts = ["Write a code:", "Answer:", "Hello"]

    def texts(llm):
        return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    eager = texts(runner_llm(path, graphs=False))
    llm = runner_llm(path, graphs=True)
    assert texts(llm) == eager
    assert eager[1] in ("yes", "no", "maybe") and llm.get_stats()["num_graph_steps"] > 0


def test_capture_sizes_are_checked(llama):
    path, _ = llama
    with pytest.raises(ValueError, match="positive"):
        runner_llm(path, graphs=True, sizes=[0, 2])
    with pytest.raises(ValueError, match="exceed max_num_seqs"):
        runner_llm(path, graphs=True, sizes=[2, 64], max_num_seqs=16)
    with pytest.raises(ValueError, match="unknown keys"):
        LLM(path, device="cpu", attention_backend="padded", compilation_config={"cudagraph_sizes": [1]})
    with pytest.raises(ValueError, match="cudagraph_mode"):
        LLM(path, device="cpu", attention_backend="padded", compilation_config={"cudagraph_mode": "PIECEWISE"})
    with pytest.raises(ValueError, match="stand-in"):       # the CPU's own kernels: no graphs
        LLM(path, device="cpu", compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"})


def test_more_rows_than_the_largest_capture_run_eagerly(llama):
    """Five decoding requests over graphs of up to 4 rows: eager steps, the same tokens, counted."""
    path, _ = llama
    prompts = [{"prompt_token_ids": p} for p in random_prompts([4, 6, 8, 3, 5], seed=2)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    eager = outputs(runner_llm(path, graphs=False), prompts, params)
    llm = runner_llm(path, graphs=True)
    assert_same(outputs(llm, prompts, params), eager)
    assert llm.get_stats()["num_eager_decode_steps"] > 0


@pytest.mark.slow
def test_warm_up_steps_write_only_the_sink(llama):
    """The steps a GPU runs before the first request (compiling kernels, profiling memory: one row, a prompt tile
    and more, many decodes, the most rows a step holds) write only the sink block: requests after them get the
    tokens of an engine that never ran them."""
    path, _ = llama
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 20], seed=3)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1)
    want = outputs(runner_llm(path, graphs=True, max_num_batched_tokens=64), prompts, params)
    llm = runner_llm(path, graphs=True, max_num_batched_tokens=64)
    runner = llm.llm_engine.runner
    for kv in runner.kv_tensors:                     # every real slot poisoned: a warm-up write would show
        kv.k.fill_(float("nan"))
        kv.v.fill_(float("nan"))
    with torch.inference_mode():
        for rows in ([1], [16], [17], [1] * 16, [1] * runner.max_rows):
            runner._dummy_step(rows)
    sink = slice(runner.num_blocks * runner.block_size, None)
    for kv in runner.kv_tensors:
        assert kv.k[:sink.start].isnan().all() and not kv.k[sink].isnan().any()
    assert_same(outputs(llm, prompts, params), want)


# ---- the GPU's own step: the Triton plan and attention, interpreted -------------------------------------------

@pytest.fixture(scope="module")
def mqa(tmp_path_factory):
    """Two layers, one kv head: the fewest interpreted programs a step launches."""
    return build_tiny("llama_mqa_tied", tmp_path_factory.mktemp("runner_mqa"))


@pytest.fixture(scope="module")
def triton_llm(mqa):
    return runner_llm(mqa[0], graphs=True, backend="triton", plan="triton", sizes=[1, 2], max_num_seqs=4)


@pytest.mark.slow
def test_triton_graphs_replay_the_eager_step(mqa, triton_llm):
    """The GPU's kernels (the fused plan and the paged attention) captured at 1 and 2 rows: two contexts, then one
    alone. (The decode kernel's splits, counted on the device, are checked under replay in test_triton_attention:
    an interpreted engine does not split, each launch costs too much.)"""
    path, hf = mqa
    prompts = random_prompts([40, 4], seed=6)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in (4, 2)]
    runner = triton_llm.llm_engine.runner
    assert runner.backend.name == "triton" and triton_llm.llm_engine.model.ops.name == "triton"
    graph = outputs(triton_llm, [{"prompt_token_ids": p} for p in prompts], params)
    eager = outputs(runner_llm(path, graphs=False, backend="triton", plan="triton", max_num_seqs=4),
                    [{"prompt_token_ids": p} for p in prompts], params)
    assert_same(graph, eager)
    assert set(runner.replays) == {1, 2}
    for p, (toks, _) in zip(prompts, graph):
        assert toks == hf_greedy(hf, p, len(toks))


def _graph_step(runner, n: int):
    """The step a graph of n rows records, with the static tensors it may read and write."""
    import functools
    from tokenmill.executor.graph_check import static_tensors
    runner._fill_dummy_header(n)
    static = list(static_tensors(runner.model, runner.kv_tensors, runner.header, runner.tables, runner.arange,
                                 runner.backend._graph_entries))
    return functools.partial(runner._device_forward, n, n, None, n), static


def test_captured_step_is_graph_safe(triton_llm):
    """What a CUDA graph capture forbids (host syncs, tensors from Python values, tensors from outside the static
    buffers) does not happen in the captured step; a planted .item() is caught."""
    from tokenmill.executor.graph_check import GraphSafetyMode
    runner = triton_llm.llm_engine.runner
    step, static = _graph_step(runner, 2)
    with torch.inference_mode(), GraphSafetyMode(static, runner.device) as mode:
        step()
    assert mode.violations == []

    prepare = runner.backend.graph_metadata

    def longest_on_the_host(batch, size):       # the classic bug: a split count from the longest length
        batch.seq_lens.max().item()
        return prepare(batch, size)
    runner.backend.graph_metadata = longest_on_the_host
    try:
        with torch.inference_mode(), GraphSafetyMode(static, runner.device) as mode:
            step()
    finally:
        runner.backend.graph_metadata = prepare
    assert [v.kind for v in mode.violations] == ["host_sync"]      # once a step (a KV group)
    assert "seq_lens.max().item()" in mode.violations[0].where


def test_eager_decode_step_ops_per_layer(triton_llm):
    """An eager decode step issues at most 10 ops a Llama layer: the fused norm+add, qkv, rotary+KV write,
    attention, o, norm+add, gate_up, SiLU-mul, down."""
    from tokenmill.executor.graph_check import OpCounter
    runner = triton_llm.llm_engine.runner
    runner._fill_dummy_header(2)
    with torch.inference_mode(), OpCounter(runner.model.layers) as count:
        runner._device_forward(2, 2, [1, 1], None)
    assert max(count.per_layer()) <= 10, dict(count.layer_counts[0])


# ---- async scheduling --------------------------------------------------------------------------------------------

def test_async_scheduling_gives_the_sync_tokens(llama):
    """Each step scheduled and launched before the last one is back, its in-flight rows fed on the device: the same
    outputs as one step at a time, through stop tokens, max_tokens, chunked prompts, preemption and seeds."""
    path, _ = llama
    shared = random_prompts([32], seed=9)[0]
    prompts = [{"prompt_token_ids": shared + tail} for tail in random_prompts([3, 11, 6, 20, 8, 1], seed=10)]
    params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=1,
                             stop_token_ids=[7, 99, 150, 250]) if i % 2 else
              SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=5 + i, ignore_eos=True, logprobs=1)
              for i in range(len(prompts))]
    kw = dict(max_num_batched_tokens=16, kv_cache_memory_gb=0.00004, max_model_len=96, max_num_seqs=6,
              sizes=[1, 2, 4])
    sync = outputs(runner_llm(path, graphs=True, **kw), prompts, params)
    llm = runner_llm(path, graphs=True, async_scheduling=True, **kw)
    assert_same(outputs(llm, prompts, params), sync)
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0 and stats["num_graph_steps"] > 0
    assert any(len(sync[i][0]) < 14 for i in (1, 3, 5))         # a stop token ended one early
    llm.llm_engine.kv.check_integrity()


@pytest.mark.slow
def test_async_scheduling_waits_for_requests_that_read_their_past(llama):
    """A request with penalties or min_tokens samples from its past tokens on the host: while one is in the engine,
    steps wait for the last one's tokens (one arrives mid-run, another finishes); the same tokens as without."""
    path, _ = llama
    a, b, c = random_prompts([5, 9, 13], seed=21)
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    # c alone repeats one token forever: with penalties its next token must differ from the one just sampled
    late = [(c, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, repetition_penalty=3.0,
                               presence_penalty=2.0, logprobs=1)),
            (b, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, min_tokens=6, stop_token_ids=[5],
                               logprobs=1))]

    def run(async_scheduling: bool) -> dict:
        eng = runner_llm(path, graphs=True, async_scheduling=async_scheduling).llm_engine
        eng.add_request("a", {"prompt_token_ids": a}, plain)
        todo, done, steps = list(late), {}, 0
        while eng.has_unfinished_requests() or todo:
            if steps in (3, 6):                  # after some async steps, a request that reads its past
                p, sp = todo.pop(0)
                eng.add_request(f"r{steps}", {"prompt_token_ids": p}, sp)
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0].token_ids
            steps += 1
        return done
    sync = run(False)
    assert len(sync) == 3 and len(set(sync["r3"])) == len(sync["r3"]) and run(True) == sync


def test_async_scheduling_switched_on_between_requests(llama):
    """One engine, its config switched to async scheduling after a request ran step by step (as benchmarks/gpu.py
    measures both on one 8B engine): the runner keeps each step's tokens whatever its own config says, and the
    next request's tokens equal the first's."""
    import dataclasses
    path, _ = llama
    prompt = {"prompt_token_ids": random_prompts([20], seed=31)[0]}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    eng = runner_llm(path, graphs=True).llm_engine

    def run(rid: str) -> list[int]:
        eng.add_request(rid, prompt, params)
        done = {}
        while eng.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
        return done[rid]
    sync = run("sync")
    sc = eng.config.scheduler_config
    eng.config = dataclasses.replace(eng.config, scheduler_config=dataclasses.replace(sc, async_scheduling=True))
    assert run("async") == sync


def test_async_scheduling_is_refused_where_it_cannot_run(llama):
    path, _ = llama
    with pytest.raises(ValueError, match="GPU runner"):
        LLM(path, device="cpu", async_scheduling=True)
    with pytest.raises(ValueError, match="speculative"):
        runner_llm(path, graphs=False, async_scheduling=True,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_metrics_export_graph_and_eager_decode_steps():
    """/metrics' counters of steps replayed from graphs and decode steps no graph held, read back with Prometheus'
    own parser."""
    from prometheus_client.parser import text_string_to_metric_families
    from tokenmill.engine.async_engine import EngineState
    from tokenmill.engine.engine import KVCacheInfo
    from tokenmill.server.metrics import ServerMetrics
    m = ServerMetrics("tiny", KVCacheInfo(8, 16, "float32", 1024, 128, True))
    m.on_iteration([], [], EngineState(num_graph_steps=5, num_eager_decode_steps=2))
    m.on_iteration([], [], EngineState(num_graph_steps=7, num_eager_decode_steps=2))
    samples = {s.name: s.value for fam in text_string_to_metric_families(m.render().decode()) for s in fam.samples}
    assert samples["tokenmill:cudagraph_steps_total"] == 7
    assert samples["tokenmill:eager_decode_steps_total"] == 2


@pytest.mark.slow
def test_async_scheduling_pools_chunked_prompts_whole(llama):
    """An embedding request's prompt in chunks under async scheduling: its chunks are counted when scheduled, and
    it still pools every chunk (MEAN) or its last row (LAST) before it finishes."""
    from tokenmill import PoolingParams
    path, _ = llama
    prompts = [{"prompt_token_ids": p} for p in random_prompts([20, 7], seed=8)]

    def embed(pooling_type: str, async_scheduling: bool) -> list:
        llm = runner_llm(path, graphs=True, pooling_type=pooling_type, max_num_batched_tokens=16,
                         async_scheduling=async_scheduling)
        return [o.outputs.embedding for o in llm.embed(prompts, PoolingParams(), use_tqdm=False)]
    for kind in ("MEAN", "LAST"):
        for got, want in zip(embed(kind, True), embed(kind, False)):
            torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_async_scheduling_keeps_a_reused_id_apart(llama):
    """A request aborted while its step is on the device, and a new one of the same id added at once: the new one
    gets its own tokens, not the old one's last."""
    path, _ = llama
    a, b = random_prompts([6, 9], seed=30)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = runner_llm(path, graphs=True).generate([{"prompt_token_ids": b}], params, use_tqdm=False)
    eng = runner_llm(path, graphs=True, async_scheduling=True).llm_engine
    eng.add_request("x", {"prompt_token_ids": a}, params)
    eng.step()
    eng.step()                                   # x's second step is on the device
    eng.abort_request("x")
    eng.add_request("x", {"prompt_token_ids": b}, params)
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    assert done["x"] == alone[0].outputs[0].token_ids
