#!/usr/bin/env python3
"""Prefill/decode disaggregation's overhead on loopback, side by side in one run on the bundled model: the time to
first token and the whole reply through `tokenmill router` over a prefill and a decode instance, against one
instance, and the KV bytes moved per request.

  .venv/bin/python benchmarks/pd_disagg.py [--lengths 256 1024 4096] [--rounds 3] [--max-tokens 32]
      [--out benchmarks/results/NAME.json]

Four processes run at once, each with every core and a KV pool of --kv-cache-memory-gb: a prefill instance, a decode instance, the router over them, and
one plain instance (the peer). Only one request is in flight at a time, so only one of them computes at a time
(the transfer overlaps the prefill instance's tail). Each request is a streamed completion of random token ids (a
fresh prompt each time: no prefix-cache hit anywhere), greedy, --max-tokens tokens, ignore_eos. Per round and
length, the two arms run in alternating order. Bytes per request come from the router's
tokenmill:kv_transfer_bytes_total.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness import git_commit, write_result  # noqa: E402
from serving import free_port, scrape, start  # noqa: E402


def timed(url: str, model: str, ids: list[int], max_tokens: int) -> tuple[float, float]:
    """(TTFT, whole reply) in seconds of one streamed completion."""
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {") and json.loads(line[6:])["choices"]:
                first = time.perf_counter() - t0
    return first, time.perf_counter() - t0


def transfer_bytes(url: str) -> float:
    return scrape(url).get("tokenmill:kv_transfer_bytes_total", 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kv-cache-memory-gb", default="1",
                    help="each instance's KV pool (three pools fault in their memory while idle: kept small)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    kv_port = free_port()
    pool = ("--kv-cache-memory-gb", args.kv_cache_memory_gb)
    with contextlib.ExitStack() as stack:
        dec, _ = stack.enter_context(start([*pool, "--kv-role", "decode", "--kv-transfer-config",
                                            json.dumps({"kv_port": kv_port})]))
        pre, _ = stack.enter_context(start([*pool, "--kv-role", "prefill"]))
        one, _ = stack.enter_context(start(pool))
        router, _ = stack.enter_context(start(["--prefill", pre, "--decode", dec], command="router"))
        model = httpx.get(one + "/v1/models").json()["data"][0]["id"]
        arms = {"one instance": one, "router (prefill -> decode)": router}
        time.sleep(10)                     # the pools' memory faulted in
        r = random.Random(0)
        for url in arms.values():          # warm-up: the kernels' first calls, the first pairing
            timed(url, model, [r.randrange(1000, 40000) for _ in range(64)], 4)
        rows: dict[str, dict[int, list]] = {a: {n: [] for n in args.lengths} for a in arms}
        moved: dict[int, list[float]] = {n: [] for n in args.lengths}
        for rnd in range(args.rounds):
            for n in args.lengths:
                order = list(arms) if rnd % 2 == 0 else list(arms)[::-1]
                for arm in order:
                    ids = [r.randrange(1000, 40000) for _ in range(n)]
                    before = transfer_bytes(router)
                    ttft, total = timed(arms[arm], model, ids, args.max_tokens)
                    rows[arm][n].append((ttft, total))
                    if arms[arm] == router:
                        moved[n].append(transfer_bytes(router) - before)
                    print(f"round {rnd} {n:5d} tokens  {arm:28s} TTFT {ttft * 1e3:8.1f} ms  reply "
                          f"{total * 1e3:8.1f} ms", file=sys.stderr, flush=True)
        from tokenmill.executor.kernels import machine_record
        res = {"date": time.strftime("%Y-%m-%d"), **machine_record(), **git_commit(), "model": model,
               "max_tokens": args.max_tokens, "rounds": args.rounds, "results": []}
        print(f"\n{'prompt':>7} {'one: TTFT':>10} {'router: TTFT':>13} {'ratio':>6} {'one: reply':>11} "
              f"{'router: reply':>14} {'ratio':>6} {'KV moved / request':>19}")
        for n in args.lengths:
            med = {a: (statistics.median(t for t, _ in rows[a][n]), statistics.median(w for _, w in rows[a][n]))
                   for a in arms}
            o, rt = med["one instance"], med["router (prefill -> decode)"]
            mib = statistics.median(moved[n]) / 2 ** 20
            res["results"].append({"prompt_tokens": n, "one_ttft_s": o[0], "router_ttft_s": rt[0],
                                   "one_reply_s": o[1], "router_reply_s": rt[1], "kv_bytes_per_request":
                                   statistics.median(moved[n]), "raw": {a: rows[a][n] for a in arms}})
            print(f"{n:7d} {o[0] * 1e3:8.1f}ms {rt[0] * 1e3:11.1f}ms {rt[0] / o[0]:5.2f}x {o[1] * 1e3:9.1f}ms "
                  f"{rt[1] * 1e3:12.1f}ms {rt[1] / o[1]:5.2f}x {mib:15.2f} MiB")
        out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / \
            f"{time.strftime('%Y-%m-%d')}-pd-disagg.json"
        write_result(out, res)


if __name__ == "__main__":
    main()
