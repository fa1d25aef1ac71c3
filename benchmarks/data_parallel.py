#!/usr/bin/env python3
"""Data-parallel serving on this machine: `tokenmill serve` with one engine (all cores) against two replicas (a
core each) routed round-robin and cache-aware, in turn --rounds times, on the bundled model.

The workload is grounded in documents: D documents of --doc-len tokens, each asked Q questions of 16-32 tokens,
the 64 requests shuffled, sent by `tokenmill bench serve` at --concurrency. Per arm: output tokens a second, TTFT
and ITL, and the prefix cache's hit rate (hits / queries, from /metrics, summed over the replicas).

  .venv/bin/python benchmarks/data_parallel.py [--rounds 3] [--out results/NAME.json]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from serving import TM, last_json, pcts, scrape, sh, start

ARMS = {"1 engine": ["--data-parallel-size", "1"],
        "2 replicas, round_robin": ["--data-parallel-size", "2", "--data-parallel-routing", "round_robin"],
        "2 replicas, cache_aware": ["--data-parallel-size", "2", "--data-parallel-routing", "cache_aware"]}


def workload(docs: int, doc_len: int, questions: int, out_len: int, seed: int = 0) -> dict:
    r = random.Random(seed)
    heads = [[r.randrange(100, 49000) for _ in range(doc_len)] for _ in range(docs)]
    reqs = [{"prompt_token_ids": h + [r.randrange(100, 49000) for _ in range(r.randint(16, 32))],
             "max_tokens": out_len} for h in heads for _ in range(questions)]
    r.shuffle(reqs)
    return {"name": f"documents-{docs}x{questions}", "requests": reqs}


def one(arm: str, path: str, n: int, concurrency: int) -> dict:
    with start(ARMS[arm]) as (url, _):
        res = last_json(sh(TM + ["bench", "serve", "--url", url, "--workload", path, "--num-requests", str(n),
                                 "--max-concurrency", str(concurrency), "--no-progress", "--json"]))
        m = scrape(url)
    hits, queries = m["tokenmill:prefix_cache_hits_total"], m["tokenmill:prefix_cache_queries_total"]
    return {"output_tok_s": res["output_throughput"], "failed": res["failed"], "ttft_ms": pcts(res["ttft_ms"]),
            "itl_ms": pcts(res["itl_ms"]), "prefix_hit_rate": hits / queries if queries else 0.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--doc-len", type=int, default=768)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from tokenmill.executor.kernels import machine_record
    w = workload(args.docs, args.doc_len, args.questions, args.output_len)
    rows: dict[str, list[dict]] = {a: [] for a in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "documents.json")
        Path(path).write_text(json.dumps(w))
        arms = list(ARMS)
        for i in range(args.rounds):
            for arm in (arms if i % 2 == 0 else arms[::-1]):      # alternate the order against drift
                rows[arm].append(one(arm, path, len(w["requests"]), args.concurrency))
                r = rows[arm][-1]
                print(f"round {i + 1} {arm:24}: {r['output_tok_s']:6.1f} tok/s, TTFT p50 {r['ttft_ms'].get('p50')} "
                      f"ms, hit rate {r['prefix_hit_rate']:.2f}", flush=True)
    med = {a: {k: statistics.median(r[k] for r in rs) for k in ("output_tok_s", "prefix_hit_rate")} |
           {"ttft_p50_ms": statistics.median(r["ttft_ms"]["p50"] for r in rs)} for a, rs in rows.items()}
    base = med["1 engine"]["output_tok_s"]
    for a, m in med.items():
        print(f"{a:24}: {m['output_tok_s']:6.1f} tok/s ({m['output_tok_s'] / base:.2f}x), TTFT p50 "
              f"{m['ttft_p50_ms']:.0f} ms, hit rate {m['prefix_hit_rate']:.2f}")
    res = {"date": time.strftime("%Y-%m-%d"), **machine_record(), "workload": w["name"], "doc_len": args.doc_len,
           "concurrency": args.concurrency, "rounds": rows, "medians": med}
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
