#!/usr/bin/env python3
"""Fair prefill (issue 49): a short chat's time to first token while a long prompt prefills, before and after,
side by side in one run, on the bundled model served by `tokenmill serve --max-model-len 8192`.

Per arm and round: a fresh server; --idle short chats one after another (the idle TTFT); then the issue's case, a
completion of --long-tokens prompt tokens with max_tokens 2, and 3 s later a short chat, then one short chat after
another (a second apart) for as long as the long prompt runs. A short chat is an 8-token user message in the chat
template (its system prompt is a prefix-cache hit after the first). Recorded: each chat's TTFT and when it was sent,
the long prompt's own latency, the load average around each arm (other processes share this machine's cores).

Arms: "before" is the old rule, a prompt takes every step's whole budget (--long-prefill-token-threshold equal to
--max-num-batched-tokens, --max-num-partial-prefills 1: the scheduler does exactly what it did before the knobs);
"after" is the defaults. --arm NAME=FLAGS adds one (e.g. t32="--long-prefill-token-threshold 32"); --tree NAME=DIR
runs an arm's server from another checkout (an earlier commit, its kernels built: `git worktree add`, then its
tokenmill/executor/kernels/build.py), so a change and its parent are measured side by side.

  .venv/bin/python benchmarks/fair_prefill.py [--rounds 3] [--out benchmarks/results/NAME.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import time
from pathlib import Path

import httpx

from serving import start

BUDGET = 2048     # the default --max-num-batched-tokens
ARMS = {"before": ["--long-prefill-token-threshold", str(BUDGET), "--max-num-partial-prefills", "1"],
        "after": []}
SEND_AFTER_S = 3.0      # the short chat came 3 s after the long prompt
WORDS = "red orange yellow green blue indigo violet white black grey pink brown".split()


def chat_body(i: int) -> dict:
    """An 8-token user message, different each time (so only the template's system prompt is a cache hit)."""
    return {"messages": [{"role": "user", "content": f"Name a {WORDS[i % len(WORDS)]} fruit, number {i}."}],
            "max_tokens": 4, "temperature": 0, "stream": True, "ignore_eos": True}


async def ttft(client: httpx.AsyncClient, url: str, body: dict) -> float:
    """Seconds from sending a streamed chat to its first token (the role chunk that comes at once aside)."""
    t = time.perf_counter()
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            for c in json.loads(line[5:]).get("choices") or []:
                if c["delta"].get("content") or c.get("finish_reason"):
                    return time.perf_counter() - t
    raise RuntimeError("the stream ended without a token")


async def measure(url: str, long_ids: list[int], idle_n: int, seq: list[int]) -> dict:
    async with httpx.AsyncClient(timeout=900) as client:
        for _ in range(2):                                  # warm: first steps pay for allocation
            await ttft(client, url, chat_body(next_i(seq)))
        idle = [await ttft(client, url, chat_body(next_i(seq))) for _ in range(idle_n)]
        t0 = time.perf_counter()

        async def long_request() -> float:
            r = await client.post(url + "/v1/completions", json={"prompt": long_ids, "max_tokens": 2,
                                                                 "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            return time.perf_counter() - t0
        long_task = asyncio.create_task(long_request())
        await asyncio.sleep(SEND_AFTER_S)
        during = []
        while not long_task.done():
            sent = time.perf_counter() - t0
            during.append({"sent_s": sent, "ttft_s": await ttft(client, url, chat_body(next_i(seq)))})
            await asyncio.sleep(1.0)
        long_s = await long_task
    # a chat counts as during the prefill if it was sent before the long prompt's first token (its end, less
    # the one decode step of max_tokens 2)
    during = [d for d in during if d["sent_s"] < long_s]
    return {"idle_ttft_s": idle, "during": during, "long_latency_s": long_s}


def next_i(seq: list[int]) -> int:
    seq[0] += 1
    return seq[0]


def summary(rows: list[dict]) -> dict:
    """Medians over rounds: the idle TTFT, the issue's chat (sent 3 s in), all chats during the prefill, the long
    prompt's latency; ratios are to the same round's idle median."""
    def med(f):
        return statistics.median(f(r) for r in rows)
    idle = [statistics.median(r["idle_ttft_s"]) for r in rows]
    first = [r["during"][0]["ttft_s"] for r in rows]
    during = [statistics.median(d["ttft_s"] for d in r["during"]) for r in rows]
    worst = [max(d["ttft_s"] for d in r["during"]) for r in rows]

    def quarter(r: dict, k: int) -> list[float]:      # the chats sent in quarter k of the long prompt's time
        return [d["ttft_s"] for d in r["during"] if k / 4 <= d["sent_s"] / r["long_latency_s"] < (k + 1) / 4]
    by_quarter = [statistics.median(statistics.median(q) / i for r, i in zip(rows, idle) if (q := quarter(r, k)))
                  if any(quarter(r, k) for r in rows) else None for k in range(4)]
    return {"idle_ttft_ms": 1000 * statistics.median(idle),
            "issue_chat_ttft_ms": 1000 * statistics.median(first),
            "issue_chat_ratio": statistics.median(f / i for f, i in zip(first, idle)),
            "during_ttft_p50_ms": 1000 * statistics.median(during),
            "during_ratio_p50": statistics.median(d / i for d, i in zip(during, idle)),
            "during_ttft_max_ms": 1000 * statistics.median(worst),
            "during_ratio_p50_by_quarter": by_quarter,
            "chats_during": med(lambda r: len(r["during"])),
            "long_latency_s": med(lambda r: r["long_latency_s"])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--long-tokens", type=int, default=8190)
    ap.add_argument("--idle", type=int, default=5, help="idle chats per arm and round")
    ap.add_argument("--arm", action="append", default=[], metavar="NAME=FLAGS",
                    help="an arm's extra `tokenmill serve` flags (repeatable; replaces one of the same name)")
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="run arm NAME's server from the checkout DIR (repeatable)")
    ap.add_argument("--only", nargs="*", default=None, help="run only these arms")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--summarize", type=Path, default=None, help="recompute a saved result's medians, run nothing")
    args = ap.parse_args()
    if args.summarize:
        res = json.loads(args.summarize.read_text())
        res["medians"] = {a: summary(rs) for a, rs in res["rounds"].items()}
        args.summarize.write_text(json.dumps(res, indent=1) + "\n")
        print(json.dumps(res["medians"], indent=1))
        return 0
    from tokenmill.executor.kernels import machine_record
    from tokenmill.executor.loader import default_model_path
    arms = dict(ARMS)
    for a in args.arm:
        name, _, flags = a.partition("=")
        arms[name] = shlex.split(flags)
    trees = {name: Path(d).resolve() for name, _, d in (t.partition("=") for t in args.tree)}
    if args.only:
        arms = {k: v for k, v in arms.items() if k in args.only}
    r = random.Random(0)
    long_ids = [r.randrange(100, 49000) for _ in range(args.long_tokens)]
    rows: dict[str, list[dict]] = {a: [] for a in arms}
    seq = [0]
    names = list(arms)
    for i in range(args.rounds):
        for arm in (names if i % 2 == 0 else names[::-1]):      # alternate the order against drift
            flags = ["--max-model-len", "8192", *arms[arm]]
            load0 = os.getloadavg()[0]
            with start(flags, trees.get(arm)) as (url, _):
                res = asyncio.run(measure(url, long_ids, args.idle, seq))
            res.update(round=i + 1, flags=flags, tree=str(trees.get(arm, "")), loadavg_1m=[load0, os.getloadavg()[0]])
            rows[arm].append(res)
            idle = statistics.median(res["idle_ttft_s"])
            d = [x["ttft_s"] for x in res["during"]]
            print(f"round {i + 1} {arm:8}: idle {1000 * idle:6.0f} ms | issue's chat {1000 * d[0]:7.0f} ms "
                  f"({d[0] / idle:5.1f}x) | {len(d)} chats during, p50 {1000 * statistics.median(d):6.0f} ms, max "
                  f"{1000 * max(d):6.0f} ms | long prompt {res['long_latency_s']:5.1f} s | load {load0:.1f}",
                  flush=True)
    med = {a: summary(rs) for a, rs in rows.items()}
    for a, m in med.items():
        print(f"{a:8}: idle {m['idle_ttft_ms']:5.0f} ms | issue's chat {m['issue_chat_ttft_ms']:7.0f} ms "
              f"({m['issue_chat_ratio']:.1f}x) | during p50 {m['during_ttft_p50_ms']:6.0f} ms "
              f"({m['during_ratio_p50']:.1f}x; by quarter of the prefill "
              f"{' '.join('-' if x is None else f'{x:.1f}x' for x in m['during_ratio_p50_by_quarter'])}), max "
              f"{m['during_ttft_max_ms']:6.0f} ms | long prompt {m['long_latency_s']:.1f} s")
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), **machine_record(), "model": Path(default_model_path()).name,
           "max_model_len": 8192, "max_num_batched_tokens": BUDGET, "long_prompt_tokens": args.long_tokens,
           "send_after_s": SEND_AFTER_S, "arms": {a: ["--max-model-len", "8192", *f] for a, f in arms.items()},
           "trees": {a: str(t) for a, t in trees.items()},
           "rounds": rows, "medians": med}
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
