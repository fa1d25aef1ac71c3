#!/usr/bin/env python3
"""Tensor parallelism on this machine: one rank against two, on a random-weight Llama-shaped bf16 model
(transformers config, nothing downloaded), in turn --rounds times, each in its own process. Decode step time at
batch 1 and 16 and the time of a 256-token prefill; and, for two ranks, the collectives a step makes (calls and
bytes) against parallel.collectives_per_step's formula. On a 2-core machine the honest expectation is no speed-up:
two ranks split the same two cores and add the all-reduces.

  .venv/bin/python benchmarks/tensor_parallel.py [--rounds 3] [--out results/NAME.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPE = dict(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4, max_position_embeddings=2048, eos_token_id=None, bos_token_id=None,
             pad_token_id=None)

RUN = r'''
import json, sys, time, statistics
from tokenmill import SamplingParams
from tokenmill.engine.engine import LLMEngine
from tokenmill.executor.parallel import collectives_per_step

def main():
    tp = int(sys.argv[2])
    eng = LLMEngine(sys.argv[1], dtype="bfloat16", kv_cache_memory_gb=0.5, max_model_len=1024,
                    tensor_parallel_size=tp, enable_prefix_caching=False)
    group = getattr(eng.runner, "group", None)
    counts = []
    def steps(batch, n):
        for i in range(batch):
            eng.add_request(f"b{batch}-{i}", {"prompt_token_ids": [(7 * i + j) % 8000 + 5 for j in range(16)]},
                            SamplingParams(temperature=0, max_tokens=n + 1, ignore_eos=True))
        eng.step()
        times = []
        while eng.has_unfinished_requests():
            before = None if group is None else (group.all_reduces, group.all_reduce_bytes, group.gathers,
                                                 group.gather_bytes)
            t = time.perf_counter(); eng.step(); times.append(time.perf_counter() - t)
            if group is not None and len(eng.scheduler.running) == batch:
                got = dict(zip(("all_reduces", "all_reduce_bytes", "gathers", "gather_bytes"),
                               (group.all_reduces - before[0], group.all_reduce_bytes - before[1],
                                group.gathers - before[2], group.gather_bytes - before[3])))
                want = collectives_per_step(8, 1024, 8192, tp, batch, batch)
                counts.append({"batch": batch, "measured": got, "formula": want})
        return statistics.median(times[1:])
    steps(1, 4)
    res = {"decode_b1_ms": 1e3 * steps(1, 24), "decode_b16_ms": 1e3 * steps(16, 12)}
    eng.add_request("p", {"prompt_token_ids": [j % 8000 + 5 for j in range(256)]}, SamplingParams(max_tokens=1))
    t = time.perf_counter(); eng.step(); res["prefill_256_ms"] = 1e3 * (time.perf_counter() - t)
    eng.step()
    res["collectives"] = {b: next(c for c in counts if c["batch"] == b) for b in (1, 16)} if counts else None
    res["collectives_match"] = all(c["measured"] == c["formula"] for c in counts) if counts else None
    print(json.dumps(res))

if __name__ == "__main__":
    main()
'''


def run(path: str, tp: int) -> dict:
    res = subprocess.run([sys.executable, "-c", RUN, path, str(tp)], capture_output=True, text=True, cwd=ROOT,
                         timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-2000:])
    return json.loads([line for line in res.stdout.splitlines() if line.startswith("{")][-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    from tokenmill.executor.kernels import machine_record
    keys = ("decode_b1_ms", "decode_b16_ms", "prefill_256_ms")
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE), dtype=torch.bfloat16).save_pretrained(tmp)
        rows: dict[int, list[dict]] = {1: [], 2: []}
        for i in range(args.rounds):
            for tp in ((1, 2) if i % 2 == 0 else (2, 1)):      # alternate the order against drift
                rows[tp].append(run(tmp, tp))
                print(f"round {i + 1} tp={tp}: " + ", ".join(f"{k} {rows[tp][-1][k]:.1f}" for k in keys), flush=True)
    med = {tp: {k: statistics.median(r[k] for r in rs) for k in keys} for tp, rs in rows.items()}
    for k in keys:
        print(f"{k}: tp=2 / tp=1 {med[2][k] / med[1][k]:.2f}")
    print("collectives match the formula:", all(r["collectives_match"] for r in rows[2]), rows[2][0]["collectives"])
    res = {"date": time.strftime("%Y-%m-%d"), **machine_record(), "shape": SHAPE, "rounds": rows, "medians": med}
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
