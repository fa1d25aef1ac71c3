#!/usr/bin/env python3
"""Does a Mixture-of-Experts step cost what its active parameters cost? Three random-weight models of one shape
(transformers configs, nothing downloaded), run by tokenmill side by side in one run, in turn --rounds times:

  moe        Mixtral-shaped: E experts of intermediate I per layer, the router picks k per token
  dense-k    Llama-shaped with intermediate k * I: the MoE's active parameters per token
  dense-E    Llama-shaped with intermediate E * I: the MoE's total parameters

Decode step time at batch 1 (one token reads k experts of a layer) and batch 16 (16 tokens pick up to 16k of E, so
most experts run), and the time of a 256-token prefill.

  .venv/bin/python benchmarks/moe_step.py [--experts 8] [--top-k 2] [--rounds 3] [--out results/NAME.json]
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
SHAPE = dict(vocab_size=8192, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
             max_position_embeddings=2048, eos_token_id=None, bos_token_id=None, pad_token_id=None)

RUN = r'''
import json, sys, time, statistics
from tokenmill import SamplingParams
from tokenmill.engine.engine import LLMEngine
eng = LLMEngine(sys.argv[1], dtype="bfloat16", kv_cache_memory_gb=0.5, max_model_len=1024)
def steps(batch, n):
    for i in range(batch):
        eng.add_request(f"b{batch}-{i}", {"prompt_token_ids": [(7 * i + j) % 8000 + 5 for j in range(16)]},
                        SamplingParams(temperature=0, max_tokens=n + 1, ignore_eos=True))
    eng.step()                                  # the prompts
    times = []
    while eng.has_unfinished_requests():
        t = time.perf_counter(); eng.step(); times.append(time.perf_counter() - t)
    return statistics.median(times[1:])
steps(1, 4)                                     # warm-up
res = {"decode_b1_ms": 1e3 * steps(1, 24), "decode_b16_ms": 1e3 * steps(16, 12)}
eng.add_request("p", {"prompt_token_ids": [j % 8000 + 5 for j in range(256)]}, SamplingParams(max_tokens=1))
t = time.perf_counter(); eng.step(); res["prefill_256_ms"] = 1e3 * (time.perf_counter() - t)
eng.step()
print(json.dumps(res))
'''


def build(folder: Path, experts: int, top_k: int, inter: int) -> dict[str, str]:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig
    cfgs = {"moe": MixtralConfig(intermediate_size=inter, num_local_experts=experts, num_experts_per_tok=top_k,
                                 sliding_window=None, **SHAPE),
            "dense-k": LlamaConfig(intermediate_size=top_k * inter, **SHAPE),
            "dense-E": LlamaConfig(intermediate_size=experts * inter, **SHAPE)}
    out = {}
    for name, cfg in cfgs.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.save_pretrained(folder / name)
        out[name] = str(folder / name)
        del model
    return out


def run(path: str) -> dict:
    res = subprocess.run([sys.executable, "-c", RUN, path], capture_output=True, text=True, cwd=ROOT, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-2000:])
    return json.loads([line for line in res.stdout.splitlines() if line.startswith("{")][-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from tokenmill.executor.kernels import machine_record
    with tempfile.TemporaryDirectory() as tmp:
        paths = build(Path(tmp), args.experts, args.top_k, args.intermediate)
        rows: dict[str, list[dict]] = {name: [] for name in paths}
        for i in range(args.rounds):
            names = list(paths) if i % 2 == 0 else list(reversed(paths))   # alternate the order against drift
            for name in names:
                rows[name].append(run(paths[name]))
                print(f"round {i + 1} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in rows[name][-1].items()),
                      flush=True)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in rows.items()}
    for k in med["moe"]:
        print(f"{k}: moe / dense-k {med['moe'][k] / med['dense-k'][k]:.2f}, "
              f"moe / dense-E {med['moe'][k] / med['dense-E'][k]:.2f}")
    res = {"date": time.strftime("%Y-%m-%d"), **machine_record(), "shape": SHAPE, "experts": args.experts,
           "top_k": args.top_k, "intermediate": args.intermediate, "rounds": rows, "medians": med}
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
