#!/usr/bin/env python3
"""The KV cache's dtypes side by side on the bundled model, in one run: float32 (the reference), bfloat16, int8, int4,
fp8_e4m3, fp8_e5m2.

  .venv/bin/python benchmarks/kv_cache_dtypes.py [--dtypes float32,bfloat16,int8,int4,fp8_e4m3,fp8_e5m2]
      [--pairs 3] [--out FILE.json]

Per dtype:
  - quality against the float32 cache (tokenmill.bench.kvquality): 16 passages of the bundled text as prompts,
    256 greedy tokens each, top-1 agreement, logprob gaps, top-5 rule at disagreements;
  - perplexity of the bundled model on the bundled text (`tokenmill bench perplexity`, windows of 512);
  - capacity: concurrent 4,096-token sequences that fit a 1 GiB cache, from the engine's own block count;
  - single-stream decode tok/s at a 4,096-token context (`tokenmill bench latency --input-len 4096
    --output-len 64`), where reading the cache dominates a step;
  - offline-64 generated tok/s (`tokenmill bench throughput --preset offline-64`).
The timed figures run as child processes, the dtypes in turn, --pairs times (medians; ratios to float32 per round).
Model dtype float32 throughout, so the cache's dtype is the only difference.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

CLI = [sys.executable, "-m", "tokenmill.cli"]


def timed(args: list[str]) -> dict:
    out = subprocess.run(CLI + args + ["--json"], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def quality(dtype: str) -> dict:
    from tokenmill import LLM
    from tokenmill.bench.kvquality import bundled_passages, kv_quality
    tok = LLM(kv_cache_memory_gb=0.05, max_model_len=512).llm_engine.tokenizer
    prompts = bundled_passages(tok, 16, 32)
    return kv_quality(None, dtype, prompts, 256, dtype="float32", kv_cache_memory_gb=0.2).to_dict()


def capacity(dtype: str, context: int = 4096, gib: float = 1.0) -> dict:
    from tokenmill import LLM
    eng = LLM(dtype="float32", kv_cache_memory_gb=gib, kv_cache_dtype=dtype, max_model_len=context).llm_engine
    blocks, bs = eng.stats.kv_blocks_total, eng.config.cache_config.block_size
    return {"blocks": blocks, "bytes_per_token": eng.runner.kv_bytes_per_block(eng.config) // bs,
            "sequences": blocks // (context // bs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16,int8,int4,fp8_e4m3,fp8_e5m2")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from tokenmill.executor.kernels import machine_record
    dtypes = a.dtypes.split(",")
    res: dict = {"date": time.strftime("%Y-%m-%d"), **machine_record(), "model": "bundled SmolLM2-135M-Instruct (Q4_1)",
                 "model_dtype": "float32", "dtypes": {d: {} for d in dtypes}}
    for d in dtypes:
        r = res["dtypes"][d]
        r["capacity_1gib_4096"] = capacity(d)
        r["perplexity"] = timed(["bench", "perplexity", "--dtype", "float32", "--kv-cache-dtype", d, "--no-progress"])[
            "perplexity"]
        if d != "float32":
            r["quality"] = quality(d)
        print(d, json.dumps(r), flush=True)
    for _ in range(a.pairs):
        for d in dtypes:
            lat = timed(["bench", "latency", "--dtype", "float32", "--kv-cache-dtype", d, "--input-len", "4096",
                         "--output-len", "64", "--max-model-len", "4200", "--kv-cache-memory-gb", "1"])
            thr = timed(["bench", "throughput", "--preset", "offline-64", "--dtype", "float32", "--kv-cache-dtype", d,
                         "--no-progress"])
            r = res["dtypes"][d]
            r.setdefault("decode_tok_s_4096", []).append(lat["decode_tok_s"])
            r.setdefault("ttft_ms_4096", []).append(lat["ttft_ms"])
            r.setdefault("offline64_tok_s", []).append(thr["generated_tok_s"])
            print(d, "decode@4096", round(lat["decode_tok_s"], 1), "offline-64", r["offline64_tok_s"][-1], flush=True)
    base = res["dtypes"].get("float32")
    for d, r in res["dtypes"].items():
        for k in ("decode_tok_s_4096", "ttft_ms_4096", "offline64_tok_s"):
            if isinstance(r.get(k, [None])[0], (int, float)):
                r[k + "_median"] = statistics.median(r[k])
                if base and d != "float32":
                    r[k + "_ratio_median"] = statistics.median(x / y for x, y in zip(r[k], base[k]))
    text = json.dumps(res, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
