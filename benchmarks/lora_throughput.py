#!/usr/bin/env python3
"""What LoRA adapters cost: offline-64 on the bundled model with every request on one of 8 adapters, against the
base model alone (the issue's target: at least 0.7x), side by side in one run, the arms in turn --rounds times.

  .venv/bin/python benchmarks/lora_throughput.py [--rounds 3] [--rank 8] [--adapter-dir DIR]
      [--num-prompts 64] [--max-tokens N] [--threads N] [--out benchmarks/results/NAME.json]

The workload is `tokenmill bench throughput --preset offline-64`'s (tokenmill/bench/workload.py): 64 requests of
random token ids from random.Random(0), prompts U(100, 512) tokens, max_tokens U(100, 512), greedy with ignore_eos,
token ids only (no detokenizing). Arms, each in a fresh process per measurement:

  base               LLM() as every other offline-64 row runs it;
  base+lora-engine   LLM(enable_lora=True, max_loras=8, max_lora_rank=rank), no request with an adapter: what the
                     adapter slots cost when unused;
  8-adapters         the same engine, request i on adapter i % 8.

A round runs the three arms once, in an order that alternates round to round (a drift in the machine's speed
favours none). The figure is generated tokens over the wall time of one generate() call, after a warm-up generate
of 8 short prompts (in the 8-adapters arm one on each adapter, so the adapters are read from disk and put in their
slots before the timed call). Reported: each arm's median, min and max, and the ratio of the medians 8-adapters /
base (and each round's ratio).

The adapters are made with peft on a transformers LlamaForCausalLM of the bundled GGUF's shapes (random weights:
peft saves only the adapter's): rank --rank, lora_alpha 16, on q/k/v/o/gate/up/down of every layer,
init_lora_weights=False (random A and B), one seed each. They are kept in --adapter-dir and reused when their
recorded settings match.

--num-prompts and --max-tokens shrink the workload for a smoke test (the result then says it is not offline-64).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness import git_commit, run_child, write_result  # noqa: E402

NUM_ADAPTERS = 8
ALPHA = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ARMS = ("base", "base+lora-engine", "8-adapters")
WARMUP_PROMPTS = 8


# ---- the adapters ------------------------------------------------------------------------------------------------

def bundled_config() -> dict:
    """The bundled GGUF's config in Hugging Face form, as tokenmill reads it (its metadata, not assumed numbers)."""
    from tokenmill.executor.loader import resolve_model_path
    from tokenmill.executor.loader.gguf import read_gguf
    return dict(read_gguf(resolve_model_path(None)).config)


def adapter_paths(adapter_dir: Path) -> list[Path]:
    return [adapter_dir / f"adapter_{i}" for i in range(NUM_ADAPTERS)]


def make_adapters(adapter_dir: Path, rank: int) -> dict:
    """8 peft adapters for the bundled model's shapes in adapter_dir (made once: reused while their settings match).
    Returns the settings they were made with."""
    cfg = bundled_config()
    shapes = {k: cfg[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                  "num_attention_heads", "num_key_value_heads", "head_dim")}
    made = {"rank": rank, "lora_alpha": ALPHA, "target_modules": TARGETS, "init_lora_weights": False,
            "num_adapters": NUM_ADAPTERS, "seeds": list(range(1, NUM_ADAPTERS + 1)), "base_shapes": shapes}
    stamp = adapter_dir / "made.json"
    paths = adapter_paths(adapter_dir)
    if stamp.is_file() and json.loads(stamp.read_text()) == made and all(
            (p / "adapter_config.json").is_file() and (p / "adapter_model.safetensors").is_file() for p in paths):
        print(f"adapters: reusing {NUM_ADAPTERS} in {adapter_dir}", flush=True)
        return made
    import peft
    import torch
    import transformers
    print(f"adapters: making {NUM_ADAPTERS} of rank {rank} in {adapter_dir} (LlamaForCausalLM {shapes})", flush=True)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
        max_position_embeddings=cfg.get("max_position_embeddings", 8192), rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        tie_word_embeddings=cfg.get("tie_word_embeddings", True))
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(hf_cfg).eval()       # random: only the shapes matter
    adapter_dir.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    for i, path in enumerate(paths):
        torch.manual_seed(made["seeds"][i])
        model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=ALPHA, target_modules=TARGETS,
                                                          init_lora_weights=False))
        model.save_pretrained(str(path))
        base = model.unload()                 # the base model as it was, for the next adapter
        print(f"  {path}", flush=True)
    stamp.write_text(json.dumps(made, indent=1) + "\n")
    return made


# ---- one arm, in its own process ---------------------------------------------------------------------------------

def child(spec: dict) -> None:
    """Build the arm's engine, warm it up, time one generate() of the workload; print one JSON line."""
    from tokenmill import LLM, LoRARequest, SamplingParams
    from tokenmill.bench import workload as wl
    from tokenmill.bench.offline import model_vocab

    arm = spec["arm"]
    kw = {} if spec["threads"] is None else {"num_threads": spec["threads"]}
    if arm != "base":
        kw.update(enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=spec["rank"])
    t0 = time.perf_counter()
    llm = LLM(**kw)
    load_s = time.perf_counter() - t0
    vocab = model_vocab(llm)
    loras = [LoRARequest(f"adapter_{i}", i + 1, p) for i, p in enumerate(spec["adapters"])]

    def adapters_for(n: int) -> list:
        return [loras[i % NUM_ADAPTERS] for i in range(n)] if arm == "8-adapters" else [None] * n

    def sampling(max_tokens: int) -> SamplingParams:
        # as tokenmill.bench.offline runs offline-64: greedy, ignore_eos, token ids only
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)

    warm = wl.make_requests(WARMUP_PROMPTS, (16, 16), (4, 4), vocab=vocab, seed=12345)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in warm], [sampling(4)] * len(warm),
                 use_tqdm=False, lora_request=adapters_for(len(warm)))
    warmup_s = time.perf_counter() - t0

    w = wl.preset("offline-64", vocab=vocab, seed=0, n=spec["num_prompts"])
    reqs = w["requests"]
    if spec["max_tokens"] is not None:
        for r in reqs:
            r["max_tokens"] = min(r["max_tokens"], spec["max_tokens"])
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    params = [sampling(r["max_tokens"]) for r in reqs]
    before = llm.get_stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=spec["progress"], lora_request=adapters_for(len(reqs)))
    elapsed = time.perf_counter() - t0
    after = llm.get_stats()
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    slots = getattr(llm.llm_engine.runner, "lora_slots", None)
    stats = {k: after[k] - before.get(k, 0) for k in ("num_steps", "prefill_tokens", "decode_tokens",
                                                      "num_preemptions") if k in after}
    print(json.dumps({
        "arm": arm, "generated_tokens": gen, "expected_generated_tokens": sum(p.max_tokens for p in params),
        "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in reqs), "elapsed_s": elapsed,
        "generated_tok_s": gen / elapsed, "load_s": load_s, "warmup_s": warmup_s,
        "engine_stats": stats, "mean_batch_size": after.get("mean_batch_size"),
        "adapter_slot_loads": None if slots is None else slots.loads,
        "adapters_loaded": sorted(llm.llm_engine.list_loras()) if arm != "base" else [],
        # a digest of each request's tokens: the parent checks the adapters changed what the model writes
        "token_digests": [hashlib.sha1(json.dumps(o.outputs[0].token_ids).encode()).hexdigest()[:12] for o in outs],
    }), flush=True)


def run_arm(spec: dict) -> dict:
    """One measurement in a fresh process: stdout (the JSON line) captured, stderr (the progress bar) passed on."""
    return run_child(__file__, spec, timeout=3600)


# ---- the run -----------------------------------------------------------------------------------------------------

def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="each arm once a round, the order alternating")
    ap.add_argument("--rank", type=int, default=8, help="the adapters' rank (max_lora_rank too)")
    ap.add_argument("--adapter-dir", type=Path, default=None,
                    help="where the adapters are made, or found (default /tmp/tokenmill-lora-bench/rank{R})")
    ap.add_argument("--num-prompts", type=int, default=64, help="offline-64's first N requests (smoke tests)")
    ap.add_argument("--max-tokens", type=int, default=None, help="cap each request's max_tokens (smoke tests)")
    ap.add_argument("--threads", type=int, default=None, help="the engine's num_threads (default: its own)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"which arms, comma-separated (default {','.join(ARMS)})")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar for each timed generate()")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "2026-11-27-lora-throughput.json")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(json.loads(args.child))
        return 0
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or any(a not in ARMS for a in arms):
        ap.error(f"--arms: choose among {', '.join(ARMS)}")
    if args.rounds < 1 or args.num_prompts < 1 or args.rank < 1 or (args.max_tokens is not None and
                                                                    args.max_tokens < 1):
        ap.error("--rounds, --num-prompts, --rank and --max-tokens must be at least 1")
    adapter_dir = args.adapter_dir or Path(f"/tmp/tokenmill-lora-bench/rank{args.rank}")
    made = make_adapters(adapter_dir, args.rank)
    spec = {"rank": args.rank, "adapters": [str(p) for p in adapter_paths(adapter_dir)], "threads": args.threads,
            "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "progress": not args.no_progress}
    full = args.num_prompts == 64 and args.max_tokens is None
    workload = "offline-64" if full else (f"offline-64, first {args.num_prompts} requests"
                                          + (f", max_tokens capped at {args.max_tokens}" if args.max_tokens else ""))

    runs: dict[str, list[dict]] = {a: [] for a in arms}
    rounds = []
    for i in range(args.rounds):
        order = arms if i % 2 == 0 else arms[::-1]      # alternate, so a drift in speed favours no arm
        row = {}
        for j, arm in enumerate(order):
            print(f"round {i + 1}/{args.rounds}, arm {j + 1}/{len(order)}: {arm} ...", flush=True)
            load = os.getloadavg()[0]       # another busy process on these cores shows here
            r = run_arm({**spec, "arm": arm})
            r["loadavg_1min_before"] = load
            runs[arm].append(r)
            row[arm] = r["generated_tok_s"]
            print(f"round {i + 1}/{args.rounds}: {arm:<17} {r['generated_tok_s']:7.1f} tok/s "
                  f"({r['generated_tokens']:,} tokens in {r['elapsed_s']:.1f} s; load {r['load_s']:.1f} s, warm-up "
                  f"{r['warmup_s']:.1f} s; load average {load:.2f} before)", flush=True)
        if "base" in row and "8-adapters" in row:
            row["ratio"] = row["8-adapters"] / row["base"]
            print(f"round {i + 1}/{args.rounds}: 8-adapters / base {row['ratio']:.3f}", flush=True)
        rounds.append({"order": order, **row})

    for arm, rs in runs.items():
        if len({r["generated_tokens"] for r in rs} | {r["expected_generated_tokens"] for r in rs}) != 1:
            print(f"warning: arm {arm} generated {[r['generated_tokens'] for r in rs]} tokens of "
                  f"{rs[0]['expected_generated_tokens']} asked", flush=True)
    arms_out = {arm: {"generated_tok_s": summary([r["generated_tok_s"] for r in rs]), "runs": rs}
                for arm, rs in runs.items()}
    from tokenmill.executor.kernels import machine_record
    res = {"date": time.strftime("%Y-%m-%d"), **machine_record(), **git_commit(),
           "model": "bundled SmolLM2-135M-Instruct (Q4_1 GGUF)", "workload": workload,
           "num_prompts": args.num_prompts, "max_tokens_cap": args.max_tokens, "threads": args.threads,
           "adapters": {**made, "dir": str(adapter_dir)}, "rounds": rounds, "arms": arms_out}
    # the adapters should change what the model writes, and the unused slots should not
    digests = {arm: rs[0]["token_digests"] for arm, rs in runs.items()}
    if "base" in digests:
        for arm in ("base+lora-engine", "8-adapters"):
            if arm in digests:
                same = sum(a == b for a, b in zip(digests["base"], digests[arm]))
                res[f"{arm}_requests_same_tokens_as_base"] = same
                print(f"{arm}: {same} of {len(digests[arm])} requests wrote the same tokens as base", flush=True)
    if "base" in runs and "8-adapters" in runs:
        med = {a: arms_out[a]["generated_tok_s"]["median"] for a in ("base", "8-adapters")}
        res["ratio_8_adapters_over_base"] = med["8-adapters"] / med["base"]
        res["ratio_per_round"] = [r["ratio"] for r in rounds]
        res["target"] = ">= 0.7"
        res["target_met"] = res["ratio_8_adapters_over_base"] >= 0.7
    if "base" in runs and "base+lora-engine" in runs:
        res["ratio_lora_engine_over_base"] = (arms_out["base+lora-engine"]["generated_tok_s"]["median"]
                                              / arms_out["base"]["generated_tok_s"]["median"])

    print(f"\n{workload}, {args.rounds} round(s), {res['machine']} ({res['cores']} cores, "
          f"{res['tokenmill_kernels']}), torch {res['torch']}, tokenmill {str(res['tokenmill_commit'])[:7]}"
          f"{' (dirty)' if res['tokenmill_dirty'] else ''}")
    print("| arm | median tok/s | min | max | / base |\n|---|---|---|---|---|")
    base_med = arms_out["base"]["generated_tok_s"]["median"] if "base" in arms_out else None
    for arm in arms:
        s = arms_out[arm]["generated_tok_s"]
        rel = f"{s['median'] / base_med:.3f}" if base_med else "-"
        print(f"| {arm} | {s['median']:.1f} | {s['min']:.1f} | {s['max']:.1f} | {rel} |")
    if "ratio_8_adapters_over_base" in res:
        print(f"8-adapters / base: {res['ratio_8_adapters_over_base']:.3f} (target >= 0.7: "
              f"{'met' if res['target_met'] else 'not met'}; per round "
              f"{', '.join(f'{x:.3f}' for x in res['ratio_per_round'])})")
    write_result(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
