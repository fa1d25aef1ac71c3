"""Benchmarks and diagnosis (issue 6): workloads, stats, kv-calc, plots, diagnose, the serve client's
arithmetic (on a mock transport), and the engine-backed CLIs on a tiny random model."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import random
from pathlib import Path

import httpx
import numpy as np
import pytest

from tokenmill.bench import diagnose as dg
from tokenmill.bench import kvcalc, plots, serve_client, stats
from tokenmill.bench import workload as wl
from tokenmill.bench.cli import main as cli

PEERS_WORKLOAD = Path(__file__).resolve().parents[2] / "shared" / "peers" / "workload.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_ok(path: Path) -> None:
    import matplotlib.image as mpimg

    assert path.read_bytes()[:8] == PNG_MAGIC
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


# ---------------------------------------------------------------- workloads

@pytest.mark.skipif(not PEERS_WORKLOAD.exists(), reason=f"{PEERS_WORKLOAD} not present")
def test_workload_matches_peers_script():
    spec = importlib.util.spec_from_file_location("peers_workload", PEERS_WORKLOAD)
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    for name, p in peers.PRESETS.items():
        for seed, vocab in ((0, 49152), (7, 256)):
            assert wl.preset(name, vocab=vocab, seed=seed)["requests"] == peers.make(vocab=vocab, seed=seed, **p)
    assert wl.make_requests(5, (3, 9), (1, 4), vocab=1000, seed=3) == peers.make(5, (3, 9), (1, 4), vocab=1000, seed=3)


def test_presets_shape_and_determinism():
    w = wl.preset("offline-64")
    assert len(w["requests"]) == 64 and w == wl.preset("offline-64")
    assert wl.totals(w) == (19737, 19255)  # the figures ANCHORS.md quotes for the peers
    assert all(100 <= len(r["prompt_token_ids"]) <= 512 and 100 <= r["max_tokens"] <= 512 for r in w["requests"])
    assert wl.preset("offline-64", n=4)["requests"] == w["requests"][:4]  # n just truncates the same stream
    s = wl.preset("single-256")["requests"]
    assert len(s) == 1 and len(s[0]["prompt_token_ids"]) == 256 and s[0]["max_tokens"] == 256
    sp = wl.preset("shared-prefix-64")["requests"]
    head = sp[0]["prompt_token_ids"][:400]
    assert len(sp) == 64 and all(r["prompt_token_ids"][:400] == head for r in sp)
    assert len({tuple(r["prompt_token_ids"][400:]) for r in sp}) == 64  # unique suffixes
    assert all(16 <= len(r["prompt_token_ids"]) - 400 <= 64 for r in sp)
    assert wl.max_token_id(wl.preset("offline-64", vocab=256)) < 156


def test_workload_load_save_validate(tmp_path, capsys):
    w = wl.preset("offline-64", n=3)
    wl.save(w, tmp_path / "w.json")
    assert wl.load(tmp_path / "w.json") == w
    for bad, msg in (({"requests": []}, "empty"), ({"requests": [{"max_tokens": 3}]}, "prompt_token_ids"),
                     ({"requests": [{"prompt_token_ids": [1], "max_tokens": 0}]}, "max_tokens"), ([1], "expected")):
        with pytest.raises(ValueError, match=msg):
            wl.validate(bad)
    assert wl.validate({"requests": [{"prompt": "hi", "max_tokens": 2}]})["requests"][0]["prompt"] == "hi"
    with pytest.raises(ValueError, match="unknown workload preset"):
        wl.preset("nope")
    assert cli(["bench", "workload", "single-256"]) == 0
    assert json.loads(capsys.readouterr().out) == wl.preset("single-256")
    assert cli(["bench", "workload", "offline-64", "--n", "2", "--in", "5", "6", "--out", "1", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == wl.make_requests(2, (5, 6), (1, 2))


# ---------------------------------------------------------------- stats

def test_percentile_matches_numpy():
    rng = random.Random(1)
    for n in (1, 2, 7, 100):
        xs = [rng.random() * 100 for _ in range(n)]
        for p in (0, 1, 50, 90, 99, 100):
            assert stats.percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))
    assert math.isnan(stats.percentile([], 50))
    with pytest.raises(ValueError):
        stats.percentile([1.0], 101)
    s = stats.summarize([0.001, 0.002, 0.003, None], scale=1000)
    assert s["n"] == 3 and s["mean"] == pytest.approx(2) and s["p50"] == pytest.approx(2) and s["max"] == 3


def _rec(ttft, e2e, n, ok=True):
    return stats.RequestRecord(prompt_tokens=10, output_tokens=n, ttft=ttft, e2e=e2e, success=ok,
                               itl=[(e2e - ttft) / (n - 1)] * (n - 1) if n > 1 else [])


def test_goodput_and_summary_arithmetic():
    recs = [_rec(0.1, 1.0, 10),   # tpot 0.1
            _rec(0.5, 0.95, 10),  # ttft too slow for a 0.2 s SLO, tpot 0.05
            _rec(0.1, 0.1, 1),    # one token: no tpot, passes that half
            _rec(0.1, 0.2, 2, ok=False)]
    assert recs[0].tpot == pytest.approx(0.1) and recs[2].tpot is None
    g = stats.goodput(recs, duration_s=2.0, slo_ttft_s=0.2, slo_tpot_s=0.08)
    assert g["good_requests"] == 1 and g["goodput_share"] == 0.25 and g["goodput_req_s"] == 0.5
    assert stats.goodput(recs, 2.0)["good_requests"] == 3  # no SLO: every success counts
    assert stats.goodput(recs, 2.0, slo_tpot_s=0.08)["good_requests"] == 2
    s = stats.serving_summary(recs, 2.0, 0.2, 0.08)
    assert (s["completed"], s["failed"], s["output_tokens"], s["prompt_tokens"]) == (3, 1, 21, 30)
    assert s["request_throughput"] == 1.5 and s["output_throughput"] == 10.5 and s["total_token_throughput"] == 25.5
    assert s["ttft_ms"]["p50"] == pytest.approx(100) and s["e2e_ms"]["max"] == pytest.approx(1000)
    assert s["tpot_ms"]["mean"] == pytest.approx(75) and s["goodput_share"] == 0.25
    assert stats.json_safe({"a": [math.nan, 1.0]}) == {"a": [None, 1.0]}


# ---------------------------------------------------------------- kv-calc

LLAMA2_7B = dict(num_hidden_layers=32, num_attention_heads=32, hidden_size=4096)  # no num_key_value_heads: MHA
LLAMA3_8B = dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096)
FALCON_7B = dict(n_layer=32, n_head=71, hidden_size=4544, multi_query=True)
MISTRAL_7B_V01 = dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096,
                      sliding_window=4096)


def test_kv_calc_known_configs():
    r = kvcalc.kv_calc(LLAMA2_7B, 4096, "fp16", memory_gb=16)
    assert r["bytes_per_token"] == 2 * 32 * 32 * 128 * 2 == 524_288
    assert r["bytes_per_seq"] == 2 * 32 * 32 * 128 * 4096 * 2 == 2_147_483_648  # ~2.1 GB
    assert r["attention"] == "MHA" and r["max_seqs"] == 7  # 16e9 // 2.147e9
    g = kvcalc.kv_calc(LLAMA3_8B, 8192, "bf16")
    assert g["attention"] == "GQA" and g["bytes_per_token"] == 131_072 and g["bytes_per_seq"] == 2**30
    assert kvcalc.kv_calc(LLAMA3_8B, 8192, "fp8")["bytes_per_seq"] == 2**29
    m = kvcalc.kv_calc(FALCON_7B, 2048, "bf16")
    assert m["attention"] == "MQA" and m["head_dim"] == 64 and m["bytes_per_token"] == 2 * 32 * 1 * 64 * 2
    # sliding window: below the window it costs like full attention, past it the cache stops growing
    assert kvcalc.kv_calc(MISTRAL_7B_V01, 2048, "fp16")["bytes_per_seq"] == 131_072 * 2048
    sw = kvcalc.kv_calc(MISTRAL_7B_V01, 8192, "fp16", memory_gb=24)
    assert sw["bytes_per_seq"] == 131_072 * 4096 and sw["avg_bytes_per_token"] == 65_536 and sw["max_seqs"] == 44
    # half the layers slide (Gemma-2-style layer_types): 2 layers x 8192 + 2 layers x 1024 tokens
    mixed = dict(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=256, sliding_window=1024,
                 layer_types=["sliding_attention", "full_attention"] * 2)
    assert kvcalc.kv_calc(mixed, 8192, "bf16")["bytes_per_seq"] == 2 * 4 * 256 * 2 * (2 * 8192 + 2 * 1024)
    # Qwen2 ships a window that is off
    assert kvcalc.kv_shape(dict(LLAMA3_8B, sliding_window=4096, use_sliding_window=False)).layer_windows == (None,) * 32
    with pytest.raises(ValueError, match="KV dtype"):
        kvcalc.kv_calc(LLAMA2_7B, 4096, "fp4")
    with pytest.raises(ValueError, match="num_hidden_layers"):
        kvcalc.kv_shape({"hidden_size": 8})


def test_kv_calc_from_model_files(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(tmp_path)
    cfg, label = kvcalc.load_config(str(tmp_path))
    assert kvcalc.kv_calc(cfg, 100, "fp32")["bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    with pytest.raises(ValueError, match="not a Hugging Face folder"):
        kvcalc.load_config(str(tmp_path / "missing"))
    cfg, _ = kvcalc.load_config(None)         # the bundled SmolLM2 GGUF: 30 layers, 3 kv heads of 64
    assert kvcalc.kv_calc(cfg, 4096, "bf16")["bytes_per_token"] == 2 * 30 * 3 * 64 * 2


def test_kv_calc_cli(tmp_path, capsys):
    (tmp_path / "llama2.json").write_text(json.dumps(LLAMA2_7B))
    assert cli(["kv-calc", "--config", str(tmp_path / "llama2.json"), "--kv-dtype", "fp16", "--memory-gb", "16"]) == 0
    out = capsys.readouterr().out
    assert "524,288 B" in out and "2,147,483,648 B" in out and "2.147 GB" in out and "7 sequences" in out
    assert cli(["kv-calc", "--config", str(tmp_path / "llama2.json"), "--context", "1024", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes_per_seq"] == 524_288 * 1024
    assert cli(["kv-calc", "--config", str(tmp_path / "nope.json")]) == 2
    assert "no such file" in capsys.readouterr().err


# ---------------------------------------------------------------- plots

def test_plots_write_png(tmp_path):
    n = 64
    _png_ok(plots.plot_step_latency({"kv cache": [0.01] * n, "recompute": [0.001 * i for i in range(n)]},
                                    tmp_path / "steps.png", "t"))
    rng = random.Random(0)
    _png_ok(plots.plot_latency_distributions({"TTFT": [rng.random() for _ in range(50)], "ITL": [1.0, 2.0],
                                              "TPOT": [], "E2E": [3.0] * 5}, tmp_path / "dist.png"))


# ---------------------------------------------------------------- diagnose

def _serve_result(ttft: float, e2e: float, n_out: int = 50) -> dict:
    recs = [stats.RequestRecord(prompt_tokens=500, output_tokens=n_out, ttft=ttft * (1 + i / 10), e2e=e2e + ttft * i / 10,
                                itl=[(e2e - ttft) / (n_out - 1)] * (n_out - 1), success=True) for i in range(10)]
    return {"kind": "serve", **stats.serving_summary(recs, 10.0), "per_request": [r.to_dict() for r in recs]}


def _decode_run(**over) -> dict:
    """A decode-bound offline result (engine counters), with the record fields that decide the levers."""
    r = {"kind": "throughput", "requests": 64, "prompt_tokens": 6400, "generated_tokens": 16000,
         "ttft_ms": {"mean": 40.0}, "itl_ms": {"mean": 20.0}, "weights": "float32", "kv_cache_dtype": "float32",
         "max_num_seqs": 256, "max_num_batched_tokens": 2048,
         "engine_stats": {"prefill_time_s": 1.0, "decode_time_s": 30.0, "num_preemptions": 0,
                          "mean_batch_size": 8.0, "kv_blocks_total": 100, "max_kv_blocks_used": 20,
                          "prefix_cache_queries": 100, "prefix_cache_hits": 80}}
    stats_over = over.pop("engine_stats", {})
    r.update(over)
    r["engine_stats"] = {**r["engine_stats"], **stats_over}
    return r


def test_diagnose_offers_only_the_levers_that_can_help():
    """Runs of each kind: a lever the run already pulls (4-bit weights, an int8 cache), or one its evidence rules
    out (a batch at its limit, prompts within the chunk budget, a prefix cache that hits), is not offered."""
    def levers(r: dict) -> str:
        d = dg.diagnose(dg.evidence_from_result(r))
        return d.verdict + " | " + " | ".join(d.levers)
    # 4-bit weights, an int8 cache, a small batch well under its limit: more concurrency is the lever
    got = levers(_decode_run(weights="Q4_1, Q8_0", kv_cache_dtype="int8"))
    assert got.startswith("decode-bound") and "send more concurrent requests" in got
    assert "quantisation" not in got and "KV dtype" not in got and "shorter outputs" in got
    # float weights and cache, memory tight: no batch-size lever (more sequences would not fit), the cache's
    # dtype both ways
    got = levers(_decode_run(engine_stats={"mean_batch_size": 250.0, "num_preemptions": 5, "max_kv_blocks_used": 98}))
    assert "batch size" not in got and "8- or 4-bit weights" in got and "KV dtype fp8/int8: halves" in got
    assert "KV memory is tight" in got and "KV dtype fp8/int8, or a lower max_num_seqs" in got
    # int8 weights, the batch at max_num_seqs, the cache mostly empty: raise the limit; 4-bit halves the bytes;
    # the cache's dtype would save little
    got = levers(_decode_run(weights="int8", max_num_seqs=8, engine_stats={"mean_batch_size": 8.0}))
    assert "raise max_num_seqs: the batch stayed at its limit" in got and "4-bit weights halve" in got
    assert "KV dtype" not in got
    # prefill-bound: prompts within the chunk budget, quantised weights, a prefix cache that hits
    pre = _decode_run(weights="Q4_1", engine_stats={"prefill_time_s": 30.0, "decode_time_s": 1.0})
    got = levers(pre)
    assert got.startswith("prefill-bound") and "shorter prompts" in got
    assert "chunked-prefill" not in got and "precision" not in got and "prefix caching" not in got
    # prompts past the budget, float32 weights, few hits: each of those levers comes back
    got = levers({**pre, "prompt_tokens": 64 * 4000, "weights": "float32",
                  "engine_stats": {**pre["engine_stats"], "prefix_cache_hits": 5}})
    assert "chunked-prefill budget" in got and "bfloat16 over float32" in got and "prefix caching" in got


def test_diagnose_synthetic_results(tmp_path, capsys):
    pre = dg.diagnose(dg.evidence_from_result(_serve_result(ttft=3.0, e2e=3.5)))
    assert pre.verdict == dg.PREFILL_BOUND and pre.prefill_share > 0.8
    assert any("chunked-prefill" in x for x in pre.levers) and any("prefix caching" in x for x in pre.levers)
    assert any("TTFT" in e for e in pre.evidence)
    dec = dg.diagnose(dg.evidence_from_result(_serve_result(ttft=0.05, e2e=5.0)))
    assert dec.verdict == dg.DECODE_BOUND and dec.prefill_share < 0.1
    assert any("batch size" in x for x in dec.levers) and any("KV dtype" in x for x in dec.levers)

    # offline result with engine counters: the engine's phase clock decides
    tput = {"kind": "throughput", "requests": 64, "prompt_tokens": 30000, "generated_tokens": 600,
            "ttft_ms": {"mean": 900.0}, "itl_ms": {"mean": 20.0},
            "engine_stats": {"prefill_time_s": 9.0, "decode_time_s": 1.0, "num_preemptions": 3,
                             "mean_batch_size": 12.0, "kv_blocks_total": 100, "max_kv_blocks_used": 97,
                             "prefix_cache_queries": 100, "prefix_cache_hits": 5}}
    d = dg.diagnose(dg.evidence_from_result(tput))
    assert d.verdict == dg.PREFILL_BOUND and any("preemptions: 3" in e for e in d.evidence)
    assert any("KV memory is tight" in x for x in d.levers) and any("5%" in e for e in d.evidence)
    tput["engine_stats"].update(prefill_time_s=1.0, decode_time_s=30.0)
    assert dg.diagnose(dg.evidence_from_result(tput)).verdict == dg.DECODE_BOUND

    path = tmp_path / "r.json"
    path.write_text(json.dumps(_serve_result(ttft=0.05, e2e=5.0)))
    assert cli(["diagnose", str(path)]) == 0
    out = capsys.readouterr().out
    assert "verdict: decode-bound" in out and "levers:" in out
    assert cli(["diagnose", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "decode-bound"
    path.write_text(json.dumps({"kind": "other"}))
    assert cli(["diagnose", str(path)]) == 2 and "not a tokenmill bench result" in capsys.readouterr().err


def _prometheus_text(prefill: float, decode: float, queue: float) -> str:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    reg = CollectorRegistry()
    h = {n: Histogram(f"tokenmill:{n}", n, registry=reg) for n in (
        "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
        "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds")}
    for _ in range(4):
        h["request_queue_time_seconds"].observe(queue)
        h["request_prefill_time_seconds"].observe(prefill)
        h["request_decode_time_seconds"].observe(decode)
        h["time_to_first_token_seconds"].observe(queue + prefill)
        h["e2e_request_latency_seconds"].observe(queue + prefill + decode)
        for _ in range(10):
            h["inter_token_latency_seconds"].observe(decode / 10)
    Gauge("tokenmill:num_requests_running", "", registry=reg).set(3)
    Gauge("tokenmill:kv_cache_usage_perc", "", registry=reg).set(0.5)
    Counter("tokenmill:prompt_tokens", "", registry=reg).inc(2000)
    Counter("tokenmill:generation_tokens", "", registry=reg).inc(44)
    Counter("tokenmill:num_preemptions", "", registry=reg).inc(0)
    ok = Counter("tokenmill:request_success", "", ["finished_reason"], registry=reg)
    ok.labels("length").inc(3)
    ok.labels("stop").inc(1)
    return generate_latest(reg).decode()


def test_diagnose_from_prometheus_metrics():
    m = dg.parse_metrics(_prometheus_text(prefill=1.0, decode=0.2, queue=0.1))
    assert m["prompt_tokens_total"] == 2000 and m["request_success_total"] == 4 and m["num_requests_running"] == 3
    assert m["request_prefill_time_seconds_sum"] == pytest.approx(4.0)
    d = dg.diagnose(dg.evidence_from_metrics(m))
    assert d.verdict == dg.PREFILL_BOUND and any("now" in e for e in d.evidence)
    d = dg.diagnose(dg.evidence_from_metrics(dg.parse_metrics(_prometheus_text(0.05, 2.0, 0.0))))
    assert d.verdict == dg.DECODE_BOUND and d.numbers["itl_ms"] == pytest.approx(200)


# ---------------------------------------------------------------- serve client (mock transport)

def _fake_openai(ttft_s: float = 0.03, gap_s: float = 0.01, lone_finish: bool = False) -> httpx.MockTransport:
    """A streaming /v1/completions that emits max_tokens one-token chunks: arithmetic check only."""
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake-model"}]})
        if request.url.path != "/v1/completions":
            return httpx.Response(404)
        body = json.loads(request.content)
        assert body["stream"] and body["model"] == "fake-model" and isinstance(body["prompt"], list)
        n = body["max_tokens"]

        async def stream():
            await asyncio.sleep(ttft_s)
            for i in range(n):
                if lone_finish and i < n - 1:  # a server that skips empty deltas (model without tokenizer)
                    continue
                if i:
                    await asyncio.sleep(gap_s)
                c = {"choices": [{"index": 0, "text": f"t{i}", "finish_reason": "length" if i == n - 1 else None}]}
                yield f"data: {json.dumps(c)}\n\n".encode()
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n, "total_tokens": 0}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode()

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream())

    return httpx.MockTransport(handler)


def test_arrival_times_poisson():
    a = serve_client.arrival_times(2000, rate=10.0, seed=1)
    assert a == serve_client.arrival_times(2000, rate=10.0, seed=1) and a == sorted(a)
    assert a[-1] / 2000 == pytest.approx(0.1, rel=0.1)  # mean gap = 1 / rate
    assert serve_client.arrival_times(3, math.inf) == [0.0] * 3
    with pytest.raises(ValueError):
        serve_client.arrival_times(3, 0)


def test_serve_client_arithmetic(monkeypatch):
    monkeypatch.setattr(serve_client, "TRANSPORT", _fake_openai(ttft_s=0.03, gap_s=0.01))
    reqs = wl.make_requests(3, (5, 5), (6, 6), vocab=300)
    r = serve_client.run("http://127.0.0.1:1", reqs, rate=200.0, num_requests=6, seed=0,
                         slo_ttft_s=1.0, slo_tpot_s=1.0, progress=False)
    assert r["completed"] == 6 and r["failed"] == 0 and r["model"] == "fake-model"
    assert r["output_tokens"] == 36 and r["prompt_tokens"] == 30
    assert 25 <= r["ttft_ms"]["p50"] < 2000 and 8 <= r["itl_ms"]["p50"] < 600 and r["itl_ms"]["n"] == 30   # ms, not s
    assert r["tpot_ms"]["mean"] == pytest.approx(r["itl_ms"]["mean"], rel=0.3)
    assert r["goodput_share"] == 1.0 and "server" not in r  # the fake has no /metrics
    tight = serve_client.run("http://127.0.0.1:1", reqs, num_requests=3, slo_ttft_s=0.001, progress=False)
    assert tight["goodput_share"] == 0.0 and tight["completed"] == 3
    bounded = serve_client.run("http://127.0.0.1:1", reqs, rate=1.0, num_requests=50, duration_s=0.5,
                               progress=False)
    assert bounded["num_requests"] < 5  # no request sent after --duration
    # all at once but one at a time: the bound, not the arrival times, keeps requests past the duration unsent
    soak = serve_client.run("http://127.0.0.1:1", reqs, num_requests=100_000, max_concurrency=1, duration_s=0.5,
                            progress=False)
    assert 1 <= soak["num_requests"] < 20 and soak["failed"] == 0 and soak["duration_s"] < 5


def test_serve_client_lone_finish_chunk(monkeypatch):
    assert serve_client.parse_sse_chunk("data: [DONE]") is None and serve_client.parse_sse_chunk(": ping") is None
    assert serve_client.parse_sse_chunk('data: {"a": 1}') == {"a": 1}
    monkeypatch.setattr(serve_client, "TRANSPORT", _fake_openai(lone_finish=True))
    r = serve_client.run("http://127.0.0.1:1", wl.make_requests(2, (4, 4), (5, 5), vocab=300), progress=False)
    assert r["completed"] == 2 and r["output_tokens"] == 10 and r["itl_ms"]["n"] == 0


def test_serve_cli_plot_and_diagnose(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(serve_client, "TRANSPORT", _fake_openai())
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    rc = cli(["bench", "serve", "--url", "http://127.0.0.1:1", "--rate", "100", "--num-requests", "5",
              "--input-len", "8", "--output-len", "4", "--vocab", "300", "--slo-ttft", "5000", "--slo-tpot", "1000",
              "--plot", str(png), "--output", str(out), "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0 and "5/5 requests ok" in text and "goodput (ttft_ms <= 5000 ms, tpot_ms <= 1000 ms): 100%" in text
    for k in ("TTFT", "ITL", "TPOT", "E2E"):
        assert k in text
    _png_ok(png)
    assert json.loads(out.read_text())["completed"] == 5
    assert cli(["diagnose", str(out)]) == 0 and "verdict:" in capsys.readouterr().out


# ---------------------------------------------------------------- engine-backed CLIs (tiny model)

def _llm_or_skip():
    try:
        from tokenmill import LLM  # noqa: F401
    except ImportError as e:
        pytest.skip(f"tokenmill.LLM cannot be imported yet: {e}")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    _llm_or_skip()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
                     ).save_pretrained(d)
    return str(d)


ENGINE = ["--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory-gb", "0.05"]


@pytest.mark.slow
def test_bench_throughput_cli(tiny_model, tmp_path, capsys):
    w = {"name": "tiny", "requests": wl.make_requests(6, (8, 40), (4, 16), vocab=256, seed=1)}
    wl.save(w, tmp_path / "w.json")
    out = tmp_path / "tput.json"
    assert cli(["bench", "throughput", "--model", tiny_model, "--workload", str(tmp_path / "w.json"),
                "--output", str(out), "--no-progress", *ENGINE]) == 0
    text = capsys.readouterr().out
    assert "6 requests" in text and "generated" in text and "tok/s" in text and "total" in text
    r = json.loads(out.read_text())
    assert (r["requests"], r["prompt_tokens"], r["generated_tokens"]) == (6, *wl.totals(w))
    assert r["generated_tok_s"] > 0 and r["total_tok_s"] > r["generated_tok_s"]
    # what diagnose weighs its levers against (the tiny float model, the engine flags ENGINE gave)
    assert r["weights"] == "float32" and r["max_num_seqs"] >= 1 and r["max_num_batched_tokens"] >= 1
    assert cli(["bench", "throughput", "--model", tiny_model, "--preset", "offline-64", "--num-requests", "1",
                "--json", *ENGINE]) == 0
    j = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert j["requests"] == 1 and j["generated_tokens"] == wl.preset("offline-64", vocab=256, n=1)["requests"][0]["max_tokens"]
    assert cli(["diagnose", str(out)]) == 0 and "verdict:" in capsys.readouterr().out


def test_bench_latency_cli_with_plot(tiny_model, tmp_path, capsys):
    png, out = tmp_path / "lat.png", tmp_path / "lat.json"
    assert cli(["bench", "latency", "--model", tiny_model, "--input-len", "32", "--output-len", "24",
                "--plot", str(png), "--output", str(out), *ENGINE]) == 0
    text = capsys.readouterr().out
    assert "[kv cache]" in text and "[recompute (no kv cache)]" in text and "TTFT" in text and "tok/s" in text
    _png_ok(png)
    r = json.loads(out.read_text())
    assert r["use_kv_cache"] and r["output_len"] == 24 and r["ttft_ms"] > 0
    assert set(r["runs"]) == {"kv cache", "recompute (no kv cache)"}
    assert len(r["runs"]["recompute (no kv cache)"]["step_latencies_s"]) == 23
    assert cli(["bench", "latency", "--model", tiny_model, "--input-len", "8", "--output-len", "4",
                "--no-kv-cache", "--json", *ENGINE]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["use_kv_cache"] is False


def test_phase_report_names_the_kv_cache_dtype(tiny_model, tmp_path, capsys):
    """Bench results carry the cache's dtype and bytes per token, and diagnose shows them."""
    out = tmp_path / "lat.json"
    assert cli(["bench", "latency", "--model", tiny_model, "--input-len", "8", "--output-len", "4",
                "--kv-cache-dtype", "int8", "--output", str(out), "--json", *ENGINE]) == 0
    r = json.loads(out.read_text())
    from tokenmill.bench.kvcalc import kv_calc
    from tokenmill.config import ModelConfig
    cfg = json.loads((Path(tiny_model) / "config.json").read_text())
    assert r["kv_cache_dtype"] == "int8"
    assert r["kv_bytes_per_token"] == kv_calc(ModelConfig.from_hf_dict(cfg), 64, "int8")["bytes_per_token"]
    capsys.readouterr()
    assert cli(["diagnose", str(out)]) == 0
    assert f"KV cache dtype: int8, {r['kv_bytes_per_token']:,} bytes per token" in capsys.readouterr().out


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_kv_calc_counts_linear_attention_as_a_fixed_state(model_type):
    """Qwen3.5 / Qwen3-Next (transformers' own configs): a 32k-token sequence keeps the KV of its full-attention
    layers only, plus each Gated DeltaNet layer's recurrent (float32) and convolution (2-byte) state; the
    parameter count equals transformers' model built from the same config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model(model_type)
    full = cfg.layer_types.count("full_attention")
    linear = cfg.layer_types.count("linear_attention")
    assert full and linear and full + linear == cfg.num_hidden_layers
    state = (cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
             + (cfg.linear_conv_kernel_dim - 1) * (2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
                                                   + cfg.linear_num_value_heads * cfg.linear_value_head_dim) * 2)
    r = kvcalc.kv_calc(cfg.to_dict(), 32768, "bf16")
    kv_token = 2 * full * cfg.num_key_value_heads * cfg.head_dim * 2
    assert r["bytes_per_token"] == kv_token and r["state_bytes"] == linear * state
    assert r["bytes_per_seq"] == kv_token * 32768 + linear * state
    assert f"fixed per sequence: {linear * state:,} B = {linear} linear-attention layers" in kvcalc.format_report(r)
    small = AutoConfig.for_model(model_type, num_hidden_layers=4, layer_types=cfg.layer_types[:4], vocab_size=1000,
                                 **({"num_experts": 8} if model_type == "qwen3_next" else {}))
    with torch.device("meta"):
        want = sum(p.numel() for p in AutoModelForCausalLM.from_config(small).parameters())
    assert kvcalc.param_count(small.to_dict()).total == want


def test_kv_calc_gpt_oss():
    """gpt-oss-20b's shape (transformers' config, 24 layers of 32 experts): every other layer keeps a window of 128
    tokens; the parameter count (sinks, router and expert biases among them) equals transformers' model's."""
    import torch
    from transformers import AutoModelForCausalLM, GptOssConfig
    cfg = GptOssConfig(num_hidden_layers=24, num_local_experts=32)
    r = kvcalc.kv_calc(cfg.to_dict(), 131072, "bf16")
    per_layer = 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    assert r["bytes_per_seq"] == 12 * per_layer * 131072 + 12 * per_layer * 128
    # the published MXFP4 folder: its experts 17 bytes a 32 weights, the other matrices bf16 (13.77 GB, as released)
    plan = kvcalc.memory_plan({**cfg.to_dict(), "quantization_config": {"quant_method": "mxfp4"}}, 131072)
    p = plan.params
    row = plan.weight("mxfp4")
    assert plan.highlight == "mxfp4"
    assert row.bytes == -(-p.mlp * 17 // 32) + 2 * (p.matrices - p.mlp) + 4 * p.vectors
    assert 13.7e9 < row.bytes < 13.9e9
    small = GptOssConfig(num_hidden_layers=2, num_local_experts=4, vocab_size=1000, hidden_size=64,
                         intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    with torch.device("meta"):
        want = sum(p.numel() for p in AutoModelForCausalLM.from_config(small).parameters())
    assert kvcalc.param_count(small.to_dict()).total == want


def test_kv_calc_deepseek_v32_and_v4_from_transformers_configs():
    """V3.2 keeps MLA's latent and an indexer key per token per layer: at 1M tokens 83.9 GiB, the explainers' figure
    for V4's predecessor. V4 keeps a window of raw keys and one pooled entry per 4 (with an indexer key) or per 128
    tokens per layer: under a tenth of V3.2 at 1M. A layer type kv-calc does not know is refused by name."""
    from transformers import AutoConfig
    v32 = AutoConfig.for_model("deepseek_v32")
    r = kvcalc.kv_calc(v32.to_dict(), 2 ** 20, "bf16")
    per_token = v32.num_hidden_layers * (v32.kv_lora_rank + v32.qk_rope_head_dim + v32.index_head_dim) * 2
    assert r["attention"] == "MLA + indexer" and r["bytes_per_token"] == per_token == 85_888
    assert round(r["bytes_per_seq"] / 2 ** 30, 1) == 83.9
    v4 = AutoConfig.for_model("deepseek_v4")
    types, rates = v4.layer_types, v4.compress_rates
    csa, hca = types.count("compressed_sparse_attention"), types.count("heavily_compressed_attention")
    entry = v4.head_dim * 2
    grow = csa * (entry + v4.index_head_dim * 2) / rates["compressed_sparse_attention"] \
        + hca * entry / rates["heavily_compressed_attention"]
    r4 = kvcalc.kv_calc(v4.to_dict(), 2 ** 20, "bf16")
    assert r4["bytes_per_token"] == grow
    want = v4.num_hidden_layers * v4.sliding_window * entry \
        + csa * (2 ** 20 // 4) * (entry + v4.index_head_dim * 2) + hca * (2 ** 20 // 128) * entry
    assert r4["bytes_per_seq"] == want and r4["bytes_per_seq"] < 0.1 * r["bytes_per_seq"]
    bad = {**v4.to_dict(), "layer_types": ["hashed_attention"] * v4.num_hidden_layers}
    with pytest.raises(ValueError, match="hashed_attention"):
        kvcalc.kv_calc(bad, 4096)
