#!/usr/bin/env python3
"""The prefix cache's offload tiers on a multi-turn chat whose histories no longer fit the KV pool, and the time to
first token of a long prompt read back from disk against recomputing it; side by side in one run on the bundled
model.

  .venv/bin/python benchmarks/kv_offload.py [--conversations 64] [--history 4096] [--pool-conversations 8]
      [--rounds 3] [--threads N] [--out benchmarks/results/NAME.json]

Chat (each arm in a fresh process): conversation c has its own history of --history random token ids
(random.Random(c)). Turn 1 sends every conversation's history and a 32-token user message at once (one offline
generate(), greedy, 32 tokens each, ignore_eos); turn 2 sends each history again with turn 1's message and answer
and a new message. The pool holds --pool-conversations histories' blocks. Arms:

  no-tiers         the pool alone: a history it evicted is recomputed;
  host             a host-memory tier that holds every history;
  host+disk        a host tier of --pool-conversations histories and a disk tier under it (a fresh directory);
  pool-holds-all   a pool that holds every history (the hit rate to match).

Per turn: wall time, generated tokens per second, prompt tokens computed, prompt tokens found in the pool and in
each tier, the hit rate (found / prompt tokens) and the mean time to first token (in an offline batch: queueing
included).

Disk TTFT (--rounds times, each side in fresh processes): a process with a disk tier prefills one --history-token
prompt and shuts down (its blocks are written out); a fresh process with the same directory (a restart) then
times generate(max_tokens=1) of the same prompt, against a fresh process without tiers timing the same call. Both
first warm up on a short prompt. The files are read from wherever the OS keeps them (after the write, its page
cache), unless --drop-caches is given and this process may write /proc/sys/vm/drop_caches.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness import git_commit, run_child, write_result  # noqa: E402

ARMS = ("no-tiers", "host", "host+disk", "pool-holds-all")
MESSAGE, ANSWER = 32, 32


def _gb_per_token() -> float:
    from tokenmill.executor.loader import resolve_model_path
    from tokenmill.executor.loader.gguf import read_gguf
    from tokenmill.executor.kv_cache import LayerKV
    from tokenmill.config import default_dtype
    import torch
    c = read_gguf(resolve_model_path(None)).config
    dtype = str(default_dtype(torch.device("cpu"))).removeprefix("torch.")
    return c["num_hidden_layers"] * LayerKV.bytes_per_slot(c["num_key_value_heads"], c["head_dim"], dtype) / 2 ** 30


def _history(c: int, n: int) -> list[int]:
    r = random.Random(c)
    return [r.randrange(100, 49000) for _ in range(n)]


def chat_child(spec: dict) -> dict:
    from tokenmill import LLM, SamplingParams
    conv, hist = spec["conversations"], spec["history"]
    max_len = hist + 2 * (MESSAGE + ANSWER) + 64
    per_conv = max_len * spec["gb_per_token"]
    pool = per_conv * (conv if spec["arm"] == "pool-holds-all" else spec["pool_conversations"])
    kw = {}
    if spec["arm"] == "host":
        kw["kv_offload_memory_gb"] = per_conv * conv * 1.1
    elif spec["arm"] == "host+disk":
        kw["kv_offload_memory_gb"] = per_conv * spec["pool_conversations"]
        kw["kv_offload_dir"] = spec["dir"]
    t0 = time.perf_counter()
    llm = LLM(None, kv_cache_memory_gb=pool, max_model_len=max_len, num_threads=spec["threads"],
              int8_activations=spec["int8_activations"], **kw)
    load_s = time.perf_counter() - t0
    eng = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=ANSWER, ignore_eos=True)
    prompts = [_history(c, hist) + _history(10_000 + c, MESSAGE) for c in range(conv)]
    turns = []
    for turn in (1, 2):
        before = dict(eng.stats.as_dict())
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=spec["progress"])
        wall = time.perf_counter() - t0
        after = eng.stats.as_dict()

        def d(k: str) -> int:
            return after.get(k, 0) - before.get(k, 0)
        prompt_tokens = sum(len(p) for p in prompts)
        found = {"pool": sum(o.num_cached_tokens for o in outs) - d("kv_offload_hits_host") - d("kv_offload_hits_disk"),
                 "host": d("kv_offload_hits_host"), "disk": d("kv_offload_hits_disk")}
        ttfts = [o.metrics.time_to_first_token for o in outs if o.metrics and o.metrics.time_to_first_token]
        turns.append({"turn": turn, "wall_s": wall, "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                      "generated_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
                      "prompt_tokens": prompt_tokens, "prompt_tokens_computed": d("prefill_tokens"),
                      "found_tokens": found, "hit_rate": sum(found.values()) / prompt_tokens,
                      "mean_ttft_s": statistics.mean(ttfts) if ttfts else None,
                      "bytes_loaded": {t: d(f"kv_offload_bytes_loaded_{t}") for t in ("host", "disk")},
                      "bytes_stored": {t: d(f"kv_offload_bytes_stored_{t}") for t in ("host", "disk")},
                      "preemptions": d("num_preemptions"),
                      "token_ids": [list(o.outputs[0].token_ids) for o in outs]})
        prompts = [p + list(o.outputs[0].token_ids) + _history(20_000 + c, MESSAGE)
                   for c, (p, o) in enumerate(zip(prompts, outs))]
    eng.shutdown()
    return {"arm": spec["arm"], "load_s": load_s, "pool_gb": pool, "kv_blocks": eng.kv.num_blocks,
            "offload": kw, "turns": turns}


def ttft_child(spec: dict) -> dict:
    """One side of the disk-TTFT comparison: "write" (prefill and shut down), "disk" or "recompute" (time it)."""
    from tokenmill import LLM, SamplingParams
    kw = {"kv_offload_dir": spec["dir"]} if spec["side"] in ("write", "disk") else {}
    llm = LLM(None, max_model_len=spec["history"] + 64, num_threads=spec["threads"], **kw,
              int8_activations=spec["int8_activations"],
              kv_cache_memory_gb=(spec["history"] + 256) * spec["gb_per_token"])
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": _history(99, 48)}], sp, use_tqdm=False)       # warm-up
    prompt = _history(7, spec["history"])
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    seconds = time.perf_counter() - t0
    stats = llm.llm_engine.stats.as_dict()
    llm.llm_engine.shutdown()
    return {"side": spec["side"], "seconds": seconds, "num_cached_tokens": out.num_cached_tokens,
            "token": out.outputs[0].token_ids[0], "disk_hits": stats.get("kv_offload_hits_disk", 0),
            "bytes_loaded_disk": stats.get("kv_offload_bytes_loaded_disk", 0)}


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--history", type=int, default=4096, help="tokens of each conversation's history")
    ap.add_argument("--pool-conversations", type=int, default=8, help="histories the KV pool holds")
    ap.add_argument("--rounds", type=int, default=3, help="disk-TTFT measurements of each side")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--skip-ttft", action="store_true")
    ap.add_argument("--drop-caches", action="store_true", help="drop the OS page cache before each disk read")
    ap.add_argument("--no-int8-activations", action="store_true",
                    help="the exact route (float activations): answers then equal across arms")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kv-offload.json")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        spec = json.loads(args.child)
        print(json.dumps(ttft_child(spec) if "side" in spec else chat_child(spec)), flush=True)
        return 0
    from tokenmill.executor.kernels import machine_record
    gbt = _gb_per_token()
    base = {"conversations": args.conversations, "history": args.history, "threads": args.threads,
            "pool_conversations": args.pool_conversations, "gb_per_token": gbt, "progress": not args.no_progress,
            "int8_activations": not args.no_int8_activations}
    res: dict = {"date": time.strftime("%Y-%m-%d"), **machine_record(), **git_commit(),
                 "model": "bundled SmolLM2-135M-Instruct (Q4_1 GGUF)", **{k: v for k, v in base.items()
                                                                          if k != "progress"}, "chat": {}}
    for arm in [a for a in args.arms.split(",") if a]:
        d = tempfile.mkdtemp(prefix="tm-kvoff-")
        print(f"chat: {arm} ...", flush=True)
        r = run_child(__file__, {**base, "arm": arm, "dir": d})
        shutil.rmtree(d, ignore_errors=True)
        res["chat"][arm] = r
        for t in r["turns"]:
            print(f"chat: {arm:<15} turn {t['turn']}: {t['wall_s']:7.1f} s, {t['generated_tok_s']:6.1f} tok/s, "
                  f"hit rate {t['hit_rate']:.3f} {t['found_tokens']}, computed {t['prompt_tokens_computed']:,} of "
                  f"{t['prompt_tokens']:,}, mean TTFT {t['mean_ttft_s']:.2f} s", flush=True)
    digests = {a: r["turns"][1]["token_ids"] for a, r in res["chat"].items()}
    if digests:
        first = next(iter(digests.values()))
        res["chat_same_tokens_as_first_arm"] = {a: sum(x == y for x, y in zip(first, v)) for a, v in digests.items()}
        print(f"chat: turn-2 answers equal to {next(iter(digests))}'s: {res['chat_same_tokens_as_first_arm']}")
    for r in res["chat"].values():
        for t in r["turns"]:
            t.pop("token_ids")
    if not args.skip_ttft:
        rounds = []
        for i in range(args.rounds):
            d = tempfile.mkdtemp(prefix="tm-kvoff-ttft-")
            run_child(__file__, {**base, "side": "write", "dir": d})
            dropped = drop_caches() if args.drop_caches else False
            order = ("disk", "recompute") if i % 2 == 0 else ("recompute", "disk")
            row = {"page_cache_dropped": dropped}
            for side in order:
                row[side] = run_child(__file__, {**base, "side": side, "dir": d})
            shutil.rmtree(d, ignore_errors=True)
            row["ratio"] = row["disk"]["seconds"] / row["recompute"]["seconds"]
            rounds.append(row)
            print(f"ttft round {i + 1}: disk {row['disk']['seconds'] * 1000:.0f} ms "
                  f"({row['disk']['num_cached_tokens']} tokens from disk), recompute "
                  f"{row['recompute']['seconds'] * 1000:.0f} ms: {row['ratio']:.3f}x; same token: "
                  f"{row['disk']['token'] == row['recompute']['token']}", flush=True)
        res["ttft"] = {"rounds": rounds, "median_disk_s": statistics.median(r["disk"]["seconds"] for r in rounds),
                       "median_recompute_s": statistics.median(r["recompute"]["seconds"] for r in rounds),
                       "target": "disk <= 0.3x recompute"}
        res["ttft"]["ratio_of_medians"] = res["ttft"]["median_disk_s"] / res["ttft"]["median_recompute_s"]
        print(f"ttft: median disk {res['ttft']['median_disk_s'] * 1000:.0f} ms, recompute "
              f"{res['ttft']['median_recompute_s'] * 1000:.0f} ms: {res['ttft']['ratio_of_medians']:.3f}x")
    write_result(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
