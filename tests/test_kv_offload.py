"""The prefix cache's host and disk tiers (engine/kv_offload.py): a prefix fed from a tier gives the tokens and
logprobs of a run without tiers, under every cache dtype, with chunked prefill and preemption; a restart reads the
disk tier; a damaged file is skipped; no block is ever served under another block's hash."""
import hashlib
import os
import random
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.tiny_models import build_tiny
from tokenmill.config import SchedulerConfig
from tokenmill.engine.kv_cache_manager import NO_BLOCK, HybridKVCacheManager, KVCacheManager, block_digest
from tokenmill.engine.kv_offload import BlockCodec, DiskTier, KVOffload, KVOffloadConfig, key_text
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams
from tokenmill.engine.scheduler import Scheduler

pytest_plugins = ["tests.server_fixtures"]
GREEDY = dict(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)


# ---- the bookkeeping, at random -----------------------------------------------------------------------------------
BS = 4
ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 8), st.integers(0, 2)),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 50)),
), min_size=1, max_size=60)


def _content(tokens: list[int], group: int = 0) -> list[int]:
    """What a forward writes for the last of these tokens in a group's layers: a function of the whole prefix, as
    real K/V is."""
    d = hashlib.blake2b(repr((group, tokens)).encode(), digest_size=16).digest()
    return [int.from_bytes(d[:8], "little", signed=True), int.from_bytes(d[8:], "little", signed=True)]


WINDOW = 6     # a hybrid cache's window groups (Gemma's local layers), in tokens


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, num_blocks=st.integers(8, 24), budget=st.integers(1, 24), host_blocks=st.integers(0, 6),
       disk=st.booleans(), disk_blocks=st.integers(1, 8), hybrid=st.booleans())
def test_no_block_is_served_under_another_hash(ops, num_blocks, budget, host_blocks, disk, disk_blocks, hybrid):
    """A stand-in forward writes each slot a digest of its whole prefix and its group; blocks are evicted to the
    tiers, promoted and loaded back at random, in a plain cache and in a hybrid one (a full-attention group and two
    window groups over one pool); every computed slot that a request's tables hold always has its own digest."""
    kv = HybridKVCacheManager(num_blocks, BS, True, [None, WINDOW, WINDOW]) if hybrid else \
        KVCacheManager(num_blocks, BS)
    kv.pool.evicted = []
    cache = torch.zeros(num_blocks * BS, 2, dtype=torch.int64)
    codec = BlockCodec([cache], BS)
    with tempfile.TemporaryDirectory() as d:
        gb = codec.nbytes / 2 ** 30
        host = host_blocks * gb if host_blocks else None if disk else gb / 2     # gb / 2: holds nothing
        cfg = KVOffloadConfig(memory_gb=host, directory=d if disk else None,
                              disk_gb=disk_blocks * 2 * gb if disk else None)
        off = KVOffload(cfg, codec, "test")
        sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=64), kv, off)
        live: list[Request] = []
        loaded = 0

        def step():
            nonlocal loaded
            out = sched.schedule()
            evicted, kv.pool.evicted = kv.pool.evicted, []
            saved = off.save(evicted)
            for ids, payloads in out.kv_loads:
                codec.write(list(ids), [p if isinstance(p, torch.Tensor) else saved[p] for p in payloads])
                loaded += len(ids)
            for s in out.scheduled:        # the forward
                r = sched.requests[s.req_id]
                for g, table in enumerate(kv.tables_of(r.request_id)):
                    for p in range(s.num_computed_tokens, s.num_computed_tokens + s.num_tokens):
                        if table[p // BS] != NO_BLOCK:
                            cache[table[p // BS] * BS + p % BS] = torch.tensor(_content(r.all_token_ids[:p + 1], g))
            sched.update(out, {s.req_id: [5] for s in out.scheduled
                               if sched.requests[s.req_id].num_computed_tokens + s.num_tokens
                               == sched.requests[s.req_id].num_tokens})
            for r in list(sched.running):
                if len(r.output_token_ids) >= r.max_tokens:
                    sched.finish(r, RequestStatus.FINISHED_LENGTH)
            for r in sched.running:
                for g, table in enumerate(kv.tables_of(r.request_id)):
                    for p in range(r.num_computed_tokens):
                        if table[p // BS] == NO_BLOCK:
                            assert g > 0, "the full-attention group lost a block"
                            continue
                        got = cache[table[p // BS] * BS + p % BS].tolist()
                        assert got == _content(r.all_token_ids[:p + 1], g), f"{r.request_id} group {g} position {p}"
            kv.check_integrity()
            return out

        for n, op in enumerate(ops):
            if op[0] == "add":
                prompt = [op[3] * 7 + 1] * 8 + [n % 5 + 100 + j for j in range(op[1])]
                req = Request(str(n), prompt, SamplingParams(max_tokens=op[2]), 0.0, op[2], ())
                if kv.blocks_needed(req.num_tokens + req.max_tokens) <= num_blocks:
                    sched.add(req)
                    live.append(req)
            elif op[0] == "step":
                step()
            elif live:
                req = live[op[1] % len(live)]
                if not req.is_finished:
                    sched.finish(req, RequestStatus.FINISHED_ABORTED)
        for _ in range(2000):
            if not sched.has_unfinished():
                break
            assert not step().is_empty, "no progress with requests waiting"
        assert not sched.has_unfinished()
        off.close(lambda: [])


def test_host_tier_lru_and_codec_round_trip():
    cache = torch.arange(8 * 4 * 3, dtype=torch.float32).reshape(32, 3)
    scales = torch.arange(32, dtype=torch.float16)
    codec = BlockCodec([cache, scales], 4)
    before = cache.clone(), scales.clone()
    payloads = codec.read([5, 1])
    assert [p.numel() for p in payloads] == [codec.nbytes] * 2 == [4 * 3 * 4 + 4 * 2] * 2
    codec.write([0, 7], payloads)
    assert torch.equal(cache[0:4], before[0][20:24]) and torch.equal(cache[28:32], before[0][4:8])
    assert torch.equal(scales[0:4], before[1][20:24]) and torch.equal(scales[28:32], before[1][4:8])
    off = KVOffload(KVOffloadConfig(memory_gb=2 * codec.nbytes / 2 ** 30), codec, "t")
    for i in range(3):
        off.store((0, i), f"k{i}", payloads[0])
    assert off.find(0, 0, (None, (), None)) is None                      # block 0 went first
    assert list(off.host.blocks) == [(0, 1), (0, 2)]
    assert off.host.get((0, 1), "another key") is None                   # same hash, another block: a miss


def test_engines_on_one_directory_share_it(tmp_path):
    """Two engines on one disk tier (data-parallel replicas): what one writes, the other finds, though it started
    before the file existed; a file removed under it is a miss, not damage."""
    cache = torch.arange(16, dtype=torch.float32).reshape(16, 1)
    codec = BlockCodec([cache], 4)
    a, b = (KVOffload(KVOffloadConfig(directory=str(tmp_path)), codec, "shared") for _ in "ab")
    (p,) = codec.read([2])
    a.store((0, 7), key_text((None, (5, 6), None)), p)
    a.flush()
    assert b.find(0, 7, (None, (5, 9), None)) is None    # the key is checked: another block under hash 7
    a.store((0, 8), key_text((None, (1, 2), None)), p)
    a.flush()
    tier, got = b.find(0, 8, (None, (1, 2), None))
    assert tier == "disk" and torch.equal(got, p)
    os.remove(tmp_path / "shared" / DiskTier.name((0, 8)))
    c = KVOffload(KVOffloadConfig(directory=str(tmp_path)), codec, "shared")
    os.remove(tmp_path / "shared" / DiskTier.name((0, 7)))
    assert c.find(0, 7, (None, (5, 6), None)) is None and c.stats.corrupt_files == 0
    for o in (a, b, c):
        o.close(lambda: [])


# ---- the engine, token-exact --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {kind: build_tiny(kind, tmp_path_factory.mktemp(f"off-{kind}"))[0]
            for kind in ("llama", "head_dim256", "gemma2", "gemma3")}


def _pool_gb(path: str, dtype: str, blocks: int) -> float:
    """kv_cache_memory_gb for a pool of this many blocks: the turns of _prompts evict each other."""
    from transformers import AutoConfig
    from tokenmill.executor.kv_cache import LayerKV
    c = AutoConfig.from_pretrained(path)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_slot = LayerKV.bytes_per_slot(c.num_key_value_heads, head_dim, "float32" if dtype == "auto" else dtype)
    return (blocks + 0.5 * (blocks > 0)) * 16 * c.num_hidden_layers * per_slot / 2 ** 30


def _prompts(seed: int = 0) -> list[list[int]]:
    """Four conversations of two turns: the second turn sends the first again, and more."""
    r = random.Random(seed)
    first = [[r.randrange(5, 250) for _ in range(r.randrange(70, 110))] for _ in range(4)]
    return first + [p + [r.randrange(5, 250) for _ in range(9)] for p in first]


def _run(path, prompts, **kw):
    from tokenmill import LLM
    kw.setdefault("kv_cache_memory_gb", 0.00012)       # 20 blocks of the tiny llama: turns evict each other
    # one thread throughout: under load the governor would change the count between the runs compared, and a
    # matmul's sums change their order with it
    kw.setdefault("num_threads", 1)
    llm = LLM(path, dtype="float32", max_model_len=256, max_num_batched_tokens=48, **kw)
    outs = []
    # each turn at once: chunked, and preempted where it is tight; the first turn is sent again at the end, after
    # the second has pushed it out of the pool (and out of a small host tier)
    for turn in (prompts[:4], prompts[4:], prompts[:4]):
        for o in llm.generate([{"prompt_token_ids": p} for p in turn], SamplingParams(**GREEDY), use_tqdm=False):
            outs.append((o.outputs[0].token_ids, [sorted((k, v.logprob) for k, v in d.items())
                                                  for d in o.outputs[0].logprobs], o.num_cached_tokens))
    return outs, llm


TIERS = {"host": lambda d, block_gb: dict(kv_offload_memory_gb=0.01),
         "disk": lambda d, block_gb: dict(kv_offload_dir=d),
         # room for 4 blocks in memory: the rest spills to disk
         "host+disk": lambda d, block_gb: dict(kv_offload_memory_gb=4 * block_gb, kv_offload_dir=d)}
# Gemma 2 and 3: sliding-window and global layers in groups over one pool (a hybrid cache), whose window groups
# load only the blocks their windows reach
CASES = [("auto", "host", "llama"), ("bfloat16", "disk", "llama"), ("int8", "host+disk", "llama"),
         ("fp8_e4m3", "host", "llama"), ("int4", "host+disk", "head_dim256"), ("int8", "disk", "llama"),
         ("auto", "host", "gemma2"), ("int8", "host+disk", "gemma3")]


@pytest.mark.parametrize("dtype,tiers,model", CASES, ids=[f"{m}-{a}-{b}" for a, b, m in CASES])
def test_prefix_from_a_tier_equals_no_tiers(models, tmp_path, dtype, tiers, model):
    path = models[model]
    mem = _pool_gb(path, dtype, 12 if model.startswith("gemma") else 20)
    base, base_llm = _run(path, _prompts(), kv_cache_dtype=dtype, kv_cache_memory_gb=mem)
    block_gb = _pool_gb(path, dtype, 1) - _pool_gb(path, dtype, 0)
    got, llm = _run(path, _prompts(), kv_cache_dtype=dtype, kv_cache_memory_gb=mem,
                    **TIERS[tiers](str(tmp_path), block_gb))
    if (dtype, model) == ("auto", "llama"):
        assert base_llm.llm_engine.stats.num_preemptions + llm.llm_engine.stats.num_preemptions > 0
    assert (llm.llm_engine.kv.num_groups > 1) == model.startswith("gemma")
    assert [t for t, _, _ in got] == [t for t, _, _ in base]
    # within what a pool hit itself differs from a recompute (a chunk's float sums run in another order, and in a
    # quantised cache a code may round the other way)
    bound = 1e-5 if dtype in ("auto", "bfloat16") else 1e-3
    assert max(abs(x[1] - y[1]) for (_, a, _), (_, b, _) in zip(got, base) for ra, rb in zip(a, b)
               for x, y in zip(ra, rb)) < bound
    assert all([k for k, _ in ra] == [k for k, _ in rb] for (_, a, _), (_, b, _) in zip(got, base)
               for ra, rb in zip(a, b))
    stats = llm.llm_engine.offload.stats
    for tier in tiers.split("+"):        # (a hybrid cache's window groups load blocks of tokens already counted)
        assert stats.bytes_loaded[tier] > 0, (tier, stats)
    assert sum(stats.hits.values()) > 0
    # the second turn found its first turn's blocks below the pool, where the plain run recomputed them
    assert sum(c for _, _, c in got[4:]) > sum(c for _, _, c in base[4:])
    assert [t for t, _, _ in got[8:]] == [t for t, _, _ in got[:4]]
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("tiers,model", [("host", "llama"), ("disk", "llama"), ("host", "gemma3")])
def test_a_tier_hit_is_bit_for_bit_a_pool_hit(models, tmp_path, tiers, model):
    """One request at a time (the same steps whatever the pool's size): a prefix loaded from a tier gives exactly
    the logprobs that the same prefix kept in a pool large enough to hold it gives."""
    path = models[model]
    small = 12 if model.startswith("gemma") else 20
    big, _ = _run(path, _prompts(6), max_num_seqs=1, kv_cache_memory_gb=_pool_gb(path, "auto", 200))
    got, llm = _run(path, _prompts(6), max_num_seqs=1, kv_cache_memory_gb=_pool_gb(path, "auto", small),
                    **TIERS[tiers](str(tmp_path), 0))
    assert llm.llm_engine.offload.stats.hits[tiers] > 0
    assert [c for _, _, c in got] == [c for _, _, c in big]
    assert [(t, lp) for t, lp, _ in got] == [(t, lp) for t, lp, _ in big]


def test_a_restart_reads_the_disk_tier(models, tmp_path):
    from tokenmill import LLM
    prompts = _prompts(1)[:4]
    first, llm = _run(models["llama"], prompts + prompts, kv_offload_dir=str(tmp_path))
    llm.llm_engine.shutdown()
    del llm
    again = LLM(models["llama"], dtype="float32", max_model_len=256, kv_cache_memory_gb=0.00012,
                kv_offload_dir=str(tmp_path))
    outs = again.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**GREEDY), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [t for t, _, _ in first[:4]]
    # every full block before the last token came from disk: no prompt token of those was computed
    assert [o.num_cached_tokens for o in outs] == [(len(p) - 1) // 16 * 16 for p in prompts]
    eng = again.llm_engine
    assert eng.offload.stats.hits["disk"] == sum((len(p) - 1) // 16 * 16 for p in prompts)
    assert eng.stats.prefix_cache_hits == 0
    # another cache dtype never reads these files: its own namespace
    other = LLM(models["llama"], dtype="float32", max_model_len=256, kv_cache_memory_gb=0.00012,
                kv_cache_dtype="bfloat16", kv_offload_dir=str(tmp_path))
    outs = other.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**GREEDY), use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0] * 4
    assert other.llm_engine.offload.stats.hits["disk"] == 0
    assert len(os.listdir(tmp_path)) == 2


def test_a_damaged_file_is_skipped_and_counted(models, tmp_path):
    from tokenmill import LLM
    prompts = _prompts(2)[:2]
    first, llm = _run(models["llama"], prompts + prompts, kv_offload_dir=str(tmp_path))
    llm.llm_engine.shutdown()
    (ns,) = os.listdir(tmp_path)

    def third_block_file(p):
        h = None
        for i in range(3):
            h = block_digest((h, tuple(p[i * 16:(i + 1) * 16]), None))
        return tmp_path / ns / DiskTier.name((0, h))
    victim, cut = third_block_file(prompts[0]), third_block_file(prompts[1])
    data = bytearray(victim.read_bytes())
    data[-10] ^= 0xFF                                   # a flipped byte in the payload
    victim.write_bytes(bytes(data))
    cut.write_bytes(cut.read_bytes()[:50])              # a truncated file
    again = LLM(models["llama"], dtype="float32", max_model_len=256, kv_cache_memory_gb=0.00012,
                kv_offload_dir=str(tmp_path))
    outs = again.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**GREEDY), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [t for t, _, _ in first[:2]]
    st_ = again.llm_engine.offload.stats
    assert st_.corrupt_files == 2 and not victim.exists() and not cut.exists()
    assert [o.num_cached_tokens for o in outs] == [32, 32] and st_.hits["disk"] == 64     # the blocks before them


def test_bad_settings_are_refused(models, tmp_path):
    from tokenmill import LLM
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError, match="kv_offload_dir=.*cannot be written"):
        LLM(models["llama"], dtype="float32", max_model_len=256, kv_cache_memory_gb=0.00012,
            kv_offload_dir=str(tmp_path / "a_file" / "sub"))
    with pytest.raises(ValueError, match="kv_offload_memory_gb must be > 0"):
        LLM(models["llama"], kv_offload_memory_gb=0)
    with pytest.raises(ValueError, match="prefix cache, which is off"):
        LLM(models["llama"], dtype="float32", max_model_len=256, kv_cache_memory_gb=0.00012,
            enable_prefix_caching=False, kv_offload_memory_gb=0.01)


# ---- what an operator sees ----------------------------------------------------------------------------------------
def test_server_counts_tier_hits_in_metrics(chat_model_dir, tmp_path):
    """Through the real openai client: a conversation pushed out of the pool by two others comes back from the host
    tier with the same answer, and /metrics (read by Prometheus' parser) counts the hits and bytes per tier."""
    openai = pytest.importorskip("openai")
    from tests.server_fixtures import LiveServer
    from tokenmill.engine.engine import LLMEngine
    from tokenmill.server.app import build_app
    engine = LLMEngine(chat_model_dir, dtype="float32", device="cpu", max_model_len=512, kv_cache_memory_gb=0.0003,
                       kv_offload_memory_gb=0.01, kv_offload_dir=str(tmp_path))
    server = LiveServer(build_app(engine, model_name="tiny-chat"))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        words = "the river bends past the mill where grain turns into flour every autumn".split()
        texts = [" ".join(random.Random(i).choice(words) for _ in range(300)) for i in range(3)]

        def ask(text):
            r = client.completions.create(model="tiny-chat", prompt=text, max_tokens=8, temperature=0)
            return r.choices[0].text, r.usage.prompt_tokens_details
        first = [ask(t) for t in texts]
        again = ask(texts[0])
        assert again[0] == first[0][0]
        assert again[1] is not None and again[1].cached_tokens >= 256
        m = server.metrics()
        assert m[("tokenmill:kv_offload_hits_total", (("tier", "host"),))] >= 256
        assert m[("tokenmill:external_prefix_cache_hits_total", ())] >= 256
        hits = m[("tokenmill:external_prefix_cache_hits_total", ())]
        assert m[("tokenmill:external_prefix_cache_queries_total", ())] >= hits
        assert m[("tokenmill:kv_offload_bytes_total", (("direction", "load"), ("tier", "host")))] > 0
        assert m[("tokenmill:kv_offload_bytes_total", (("direction", "store"), ("tier", "host")))] > 0
        assert engine.offload_line().startswith("KV offload tiers under the prefix cache: host 0.01 GB, disk at ")
    finally:
        server.stop()


def test_info_lists_a_disk_tier(models, tmp_path):
    from tokenmill.cli import main
    _, llm = _run(models["llama"], _prompts(3)[:4] * 2, kv_offload_dir=str(tmp_path))
    llm.llm_engine.shutdown()
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["info", "--kv-offload-dir", str(tmp_path)]) == 0
    (line,) = [x for x in buf.getvalue().splitlines() if x.strip().startswith("cache ")]
    n = len(os.listdir(tmp_path / os.listdir(tmp_path)[0]))
    assert f"{n:,} blocks" in line and n > 0


def test_bench_reports_the_tiers(models, tmp_path, capsys):
    """`tokenmill bench throughput` with a host tier: one request at a time, six prompts and then the first two
    again, after the pool has let them go: the report and the result JSON show the host tier's hits and bytes."""
    import json
    from tokenmill.bench import workload as wl
    from tokenmill.cli import main
    prompts = _prompts(4)[:4] + _prompts(5)[:2]
    w = {"name": "again", "requests": [{"prompt_token_ids": p, "max_tokens": 4} for p in prompts + prompts[:2]]}
    wl.save(w, tmp_path / "w.json")
    out = tmp_path / "r.json"
    assert main(["bench", "throughput", "--model", models["llama"], "--workload", str(tmp_path / "w.json"),
                 "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "1", "--no-progress",
                 "--kv-cache-memory-gb", str(_pool_gb(models["llama"], "auto", 20)), "--kv-offload-memory-gb",
                 "0.01", "--output", str(out)]) == 0
    assert "KV offload: " in capsys.readouterr().out
    st = json.loads(out.read_text())["engine_stats"]
    full_blocks = sum((len(p) - 1) // 16 * 16 for p in prompts[:2])
    assert st["kv_offload_hits_host"] == full_blocks and st["kv_offload_bytes_loaded_host"] > 0


OTHER_PATHS = {
    # the GPU runner's resident batch on CPU tensors, graphs replayed, each step launched before the last is back
    "gpu-runner-async": dict(attention_backend="padded", cpu_kernels="reference", async_scheduling=True,
                             compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY",
                                                 "cudagraph_capture_sizes": [1, 2, 4]}),
    "ngram-speculation": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                  "prompt_lookup_max": 3}),
}


@pytest.mark.parametrize("path_name", list(OTHER_PATHS))
def test_other_engine_paths_with_the_host_tier(models, path_name):
    """The tiers under the GPU runner (async scheduling: the next step is scheduled while one is in flight) and
    under speculative decoding: the tokens of a run without tiers, and hits taken."""
    path = models["llama"]
    kw = dict(OTHER_PATHS[path_name], kv_cache_memory_gb=_pool_gb(path, "auto", 20))
    base, _ = _run(path, _prompts(7), **kw)
    got, llm = _run(path, _prompts(7), kv_offload_memory_gb=0.01, **kw)
    assert [t for t, _, _ in got] == [t for t, _, _ in base]
    assert llm.llm_engine.offload.stats.hits["host"] > 0
    llm.llm_engine.kv.check_integrity()


def test_adapters_keep_their_own_blocks_in_the_tiers(tmp_path):
    """The same prompts on the base model and on two LoRA adapters, one request at a time, then all again after
    others pushed them out of the pool: each comes back from the host tier with its own tokens."""
    pytest.importorskip("peft")
    from tests.test_lora import ADAPTERS, make_adapter
    from tokenmill import LLM, LoRARequest
    path, base = build_tiny("llama", tmp_path / "base")
    names = list(ADAPTERS)[:2]
    loras = [None] + [LoRARequest(n, i + 1, make_adapter(base, tmp_path / n, i + 1, **ADAPTERS[n]))
                      for i, n in enumerate(names)]
    prompts = _prompts(8)[:2]
    order = [(p, lora) for p in prompts for lora in loras]
    order += [(p, None) for p in _prompts(9)[:4]] + order

    def run(**kw):
        llm = LLM(path, dtype="float32", max_model_len=256, max_num_seqs=1, enable_lora=True, max_loras=2,
                  kv_cache_memory_gb=_pool_gb(path, "auto", 20), **kw)
        outs = [llm.generate([{"prompt_token_ids": p}], SamplingParams(**GREEDY), use_tqdm=False,
                             lora_request=lora)[0] for p, lora in order]
        return [(o.outputs[0].token_ids, o.num_cached_tokens) for o in outs], llm
    base_run, _ = run()
    got, llm = run(kv_offload_memory_gb=0.01)
    assert [t for t, _ in got] == [t for t, _ in base_run]
    n = len(prompts) * len(loras)
    assert [t for t, _ in got[-n:]] == [t for t, _ in got[:n]]          # each adapter's own tokens, again
    assert len({tuple(t) for t, _ in got[:len(loras)]}) == len(loras)   # and they differ between adapters
    assert all(c >= 64 for _, c in got[-n:]) and llm.llm_engine.offload.stats.hits["host"] > 0
