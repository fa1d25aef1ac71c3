#!/usr/bin/env python3
"""Qwen3.5's hybrid linear attention on the CPU, side by side with transformers on the same weights: one stream's
TTFT of a prompt and its decode tokens a second, and a batch's decode throughput. Random weights in a Qwen3.5
shape (no model hub here); both sides greedy, in the same dtype, on the same threads, alternating in one run. These
run with tokenmill's prefix cache off, as transformers has none. Then a conversation's next turn (its first turn's
prompt and answer and --turn more tokens): its TTFT with the prefix cache on (resuming from the state snapshot where
the first turn's decode last passed a block boundary) against off, in the same run.

  .venv/bin/python benchmarks/linear_attention.py [--shape 0.8b] [--dtype bfloat16] [--prompt 256] [--out 32]
      [--batch 8] [--turn 32] [--pairs 2] [--json OUT]

The machine's CPU and the kernel variant are recorded. transformers runs its own torch fallbacks of the chunked and
recurrent delta rule (no flash-linear-attention or causal-conv1d kernels on a CPU), as tokenmill's reference does."""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tokenmill.executor.kernels import machine_record

# the sizes of Qwen3.5's small dense models' text part (per its model card's table), vocabulary cut to keep the
# head from dominating a small machine's step
SHAPES = {
    "0.8b": dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                 linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=32000),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=32, linear_value_head_dim=32, vocab_size=1024),
}


def checkpoint(shape: dict, folder: Path, dtype: torch.dtype):
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(**shape, max_position_embeddings=4096, eos_token_id=None, bos_token_id=None,
                            pad_token_id=None, tie_word_embeddings=False)
    model = Qwen3_5ForCausalLM(cfg).to(dtype).eval()
    model.save_pretrained(folder)
    return model


def ours_turns(cached, uncached, first: list[int], out: int, more: list[int]) -> tuple[float, float, int]:
    """A conversation's next turn: the first turn run on `cached` (its snapshots kept), then the second turn's TTFT
    on it and on `uncached`, and the tokens its prefix hit covered."""
    from tokenmill import SamplingParams
    answer = cached.generate([{"prompt_token_ids": first}], SamplingParams(temperature=0, max_tokens=out,
                                                                           ignore_eos=True), use_tqdm=False)
    turn = first + answer[0].outputs[0].token_ids + more
    ttft = []
    for llm in (cached, uncached):
        t, _ = ours_single(llm, turn, 2)
        ttft.append(t)
    return ttft[0], ttft[1], cached.llm_engine.scheduler.kv.num_hits


def ours_single(llm, prompt: list[int], out: int) -> tuple[float, float]:
    """(TTFT, decode tokens a second) of one request alone, through the engine's steps."""
    from tokenmill import SamplingParams
    eng = llm.llm_engine
    eng.add_request("one", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=out,
                                                                       ignore_eos=True))
    stamps = [time.perf_counter()]
    while eng.has_unfinished_requests():
        eng.step()
        stamps.append(time.perf_counter())
    return stamps[1] - stamps[0], (out - 1) / (stamps[-1] - stamps[1])


@torch.no_grad()
def hf_single(model, prompt: list[int], out: int) -> tuple[float, float]:
    """transformers' generate: the TTFT from one new token, the decode rate from out tokens beyond it."""
    ids = torch.tensor([prompt])
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=1, do_sample=False)
    ttft = time.perf_counter() - t
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=out, do_sample=False)
    return ttft, (out - 1) / max(time.perf_counter() - t - ttft, 1e-9)


def ours_batch(llm, prompts: list[list[int]], out: int) -> float:
    from tokenmill import SamplingParams
    eng = llm.llm_engine
    before = (eng.stats.decode_tokens, eng.stats.decode_time_s)
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0, max_tokens=out, ignore_eos=True), use_tqdm=False)
    return (eng.stats.decode_tokens - before[0]) / (eng.stats.decode_time_s - before[1])


@torch.no_grad()
def hf_batch(model, prompts: list[list[int]], out: int) -> float:
    """Equal-length prompts in one batch (no padding): decode tokens a second, the one-token run subtracted."""
    ids = torch.tensor(prompts)
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=1, do_sample=False)
    first = time.perf_counter() - t
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=out, do_sample=False)
    return len(prompts) * (out - 1) / max(time.perf_counter() - t - first, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="0.8b", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--out", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--turn", type=int, default=32)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    from tokenmill import LLM
    dtype = getattr(torch, a.dtype)
    g = torch.Generator().manual_seed(1)
    vocab = SHAPES[a.shape]["vocab_size"]
    prompt = torch.randint(10, vocab, (a.prompt,), generator=g).tolist()
    batch = [torch.randint(10, vocab, (a.prompt // 2,), generator=g).tolist() for _ in range(a.batch)]
    with tempfile.TemporaryDirectory() as tmp:
        hf = checkpoint(SHAPES[a.shape], Path(tmp), dtype)
        kw = dict(dtype=a.dtype, max_model_len=a.prompt + a.out + a.turn + 16, max_num_seqs=max(a.batch, 1),
                  kv_cache_memory_gb=0.5)
        llm = LLM(tmp, **kw, enable_prefix_caching=False)
        cached = LLM(tmp, **kw)
        kernels = llm.llm_engine.model.ops.describe()
        ours_single(llm, prompt[:32], 4)            # warm both
        hf_single(hf, prompt[:32], 4)
        rows = {"ours_ttft_s": [], "ours_tok_s": [], "hf_ttft_s": [], "hf_tok_s": [], "ours_batch_tok_s": [],
                "hf_batch_tok_s": [], "next_turn_cached_ttft_s": [], "next_turn_uncached_ttft_s": []}
        hits = 0
        for _ in range(a.pairs):
            ttft, rate = ours_single(llm, prompt, a.out)
            rows["ours_ttft_s"].append(ttft)
            rows["ours_tok_s"].append(rate)
            ttft, rate = hf_single(hf, prompt, a.out)
            rows["hf_ttft_s"].append(ttft)
            rows["hf_tok_s"].append(rate)
            rows["ours_batch_tok_s"].append(ours_batch(llm, batch, a.out))
            rows["hf_batch_tok_s"].append(hf_batch(hf, batch, a.out))
            first = torch.randint(10, vocab, (a.prompt,), generator=g).tolist()     # a new conversation
            more = torch.randint(10, vocab, (a.turn,), generator=g).tolist()
            on, off, total = ours_turns(cached, llm, first, a.out, more)
            rows["next_turn_cached_ttft_s"].append(on)
            rows["next_turn_uncached_ttft_s"].append(off)
            hits, hit_tokens = total, total - hits
    med = {k: statistics.median(v) for k, v in rows.items()}
    res = {"machine": machine_record(), "shape": a.shape, "dtype": a.dtype, "prompt": a.prompt, "out": a.out,
           "batch": a.batch, "turn": a.turn, "pairs": a.pairs, "plan": kernels, "runs": rows, "median": med,
           "next_turn_hit_tokens": hit_tokens,
           "next_turn_cached_over_uncached": med["next_turn_cached_ttft_s"] / med["next_turn_uncached_ttft_s"],
           "decode_over_hf": med["ours_tok_s"] / med["hf_tok_s"],
           "ttft_over_hf": med["ours_ttft_s"] / med["hf_ttft_s"],
           "batch_over_hf": med["ours_batch_tok_s"] / med["hf_batch_tok_s"]}
    print(json.dumps(res, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
