"""Time to first token and whole-request latency of short requests through `tokenmill serve`, for two builds side
by side (e.g. a clean checkout of the previous commit and this tree), alternating servers so both see the same
machine load. Used for the TCP_NODELAY fix: without it each response's body waited for the client's delayed ACK."""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import time

import httpx


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def measure(url: str, n: int) -> dict:
    ttft, whole, health = [], [], []
    with httpx.Client(timeout=60) as c:
        for _ in range(n):
            t = time.perf_counter()
            c.get(url + "/health")
            health.append(time.perf_counter() - t)
            body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "temperature": 0,
                    "stream": True}
            t = time.perf_counter()
            first = None
            with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if first is None and '"content":"' in line and '"content":""' not in line:
                        first = time.perf_counter() - t
            whole.append(time.perf_counter() - t)
            ttft.append(first)
            t = time.perf_counter()
            c.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 1})
    med = statistics.median
    return {"ttft_ms": round(med(ttft) * 1e3, 1), "stream_ms": round(med(whole) * 1e3, 1),
            "health_ms": round(med(health) * 1e3, 2)}


def run(exe: str, n: int) -> dict:
    port = free_port()
    p = subprocess.Popen([exe, "serve", "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        measure(url, 3)                                         # warm-up
        return measure(url, n)
    finally:
        p.terminate()
        p.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="the tokenmill executable of the build before")
    ap.add_argument("--after", required=True, help="the tokenmill executable of the build after")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    info = open("/proc/cpuinfo").read().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in info if ln.startswith("flags")), [])
    simd = [f for f in flags if f.startswith(("avx", "amx", "fma", "f16c"))]
    rounds = []
    for _ in range(args.rounds):
        rounds.append({"before": run(args.before, args.requests), "after": run(args.after, args.requests)})
        print(json.dumps(rounds[-1]), flush=True)
    result = {"cpu": cpu, "simd_flags": simd, "cores": len(os.sched_getaffinity(0)), "python": platform.python_version(), "model": "bundled SmolLM2-135M-Instruct Q4_1",
              "requests_per_round": args.requests, "rounds": rounds}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
