#!/usr/bin/env python3
"""Served against offline throughput on the bundled model, side by side in one run, alone and beside a busy
neighbour, then a soak.

  .venv/bin/python benchmarks/serving.py [--concurrency 1 16 64] [--pairs 3] [--soak-s 600] [--out results/NAME.json]

For each concurrency c the same requests go through the offline engine (`tokenmill bench throughput
--max-num-seqs c`: at most c in flight, as a client at concurrency c allows) and through `tokenmill serve` on
loopback (`tokenmill bench serve --max-concurrency c`, streamed), in turn --pairs times, since this machine's
speed drifts by a third between minutes. Then again with a neighbour process spinning on one of our cores. The
ratio is served / offline generated tokens a second within a pair; the row shows the median pair's.
The soak sends short requests at concurrency 8 for --soak-s seconds and reads the server's RSS before and after,
its KV blocks in use at the end (/metrics) and the errors the client saw.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
TM = [PY, "-m", "tokenmill.cli"]
SIZES = {1: 16, 16: 64, 64: 128}          # requests per concurrency: enough to fill it several times over


def sh(cmd: list[str], timeout: int = 1800) -> str:
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if res.returncode != 0:
        raise RuntimeError(f"{cmd[2:4]} failed ({res.returncode}): {res.stderr[-2000:]}")
    return res.stdout


def last_json(out: str) -> dict:
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def scrape(url: str) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


@contextmanager
def start(extra: tuple[str, ...] | list[str] = (), tree: Path | None = None,
          command: str = "serve") -> Iterator[tuple[str, subprocess.Popen]]:
    """`tokenmill serve` (or another command that serves, `router`) on a free port with these extra arguments, once
    its /health answers; from another checkout (its kernels built) when `tree` is given, for a before/after in one
    run."""
    import httpx
    port = free_port()
    env = None if tree is None else {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.Popen(TM + [command, "--port", str(port), *extra], cwd=tree or ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {proc.stdout.read() if proc.stdout else ''}")
            time.sleep(0.5)
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@contextmanager
def neighbour(active: bool) -> Iterator[None]:
    """A CPU-bound process pinned to the last of our cores (or nothing)."""
    if not active:
        yield
        return
    core = max(os.sched_getaffinity(0))
    code = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"
    proc = subprocess.Popen([PY, "-c", code])
    try:
        time.sleep(0.5)
        yield
    finally:
        proc.kill()
        proc.wait()


def pcts(d: dict) -> dict:
    return {k: round(d[k], 1) for k in ("p50", "p90", "p99") if k in d}


def one_pair(c: int, workload: str) -> dict:
    off = last_json(sh(TM + ["bench", "throughput", "--workload", workload, "--max-num-seqs", str(c),
                             "--no-progress", "--json"]))
    with start() as (url, _):
        srv = last_json(sh(TM + ["bench", "serve", "--url", url, "--workload", workload, "--num-requests",
                                 str(SIZES[c]), "--max-concurrency", str(c), "--no-progress", "--json"]))
    return {"offline_tok_s": off["generated_tok_s"], "served_tok_s": srv["output_throughput"],
            "ratio": srv["output_throughput"] / off["generated_tok_s"], "served_failed": srv["failed"],
            "served_ttft_ms": pcts(srv["ttft_ms"]), "served_itl_ms": pcts(srv["itl_ms"]),
            "offline_ttft_ms": pcts(off["ttft_ms"]), "offline_itl_ms": pcts(off["itl_ms"])}


def scenario(concurrency: list[int], workloads: dict[int, str], busy: bool, pairs: int) -> list[dict]:
    rows = []
    with neighbour(busy):
        for c in concurrency:
            runs = [one_pair(c, workloads[c]) for _ in range(pairs)]
            med = sorted(runs, key=lambda r: r["ratio"])[len(runs) // 2]
            row = {"neighbour": busy, "concurrency": c, "requests": SIZES[c], **med, "pairs": runs}
            ratios = ", ".join(f"{r['ratio']:.2f}" for r in runs)
            print(f"{'neighbour' if busy else 'alone':9}  c={c:<3} offline {row['offline_tok_s']:6.1f}  "
                  f"served {row['served_tok_s']:6.1f} tok/s  ({row['ratio']:.2f}x; pairs {ratios})  served TTFT p50 "
                  f"{row['served_ttft_ms'].get('p50')} ms  ITL p50 {row['served_itl_ms'].get('p50')} ms",
                  flush=True)
            rows.append(row)
    return rows


def soak(seconds: float, workload: str) -> dict:
    with start() as (url, proc):
        time.sleep(15)                   # the idle server faults in its KV reservation
        rss0 = rss_bytes(proc.pid)
        srv = last_json(sh(TM + ["bench", "serve", "--url", url, "--workload", workload, "--num-requests", "1000000",
                                 "--max-concurrency", "8", "--duration", str(seconds), "--no-progress", "--json"],
                           timeout=int(seconds) + 600))
        time.sleep(2)
        m = scrape(url)
        res = {"seconds": seconds, "completed": srv["completed"], "failed": srv["failed"],
               "errors": srv["errors"][:5], "output_tok_s": srv["output_throughput"],
               "ttft_ms": pcts(srv["ttft_ms"]), "itl_ms": pcts(srv["itl_ms"]),
               "rss_start_gib": rss0 / 2 ** 30, "rss_end_gib": rss_bytes(proc.pid) / 2 ** 30,
               "kv_cache_usage_end": m.get("tokenmill:kv_cache_usage_perc"),
               "running_end": m.get("tokenmill:num_requests_running"),
               "kv_reserved_gib": m.get("tokenmill:kv_cache_reserved_bytes", 0) / 2 ** 30}
    print(f"soak {seconds:.0f} s: {res['completed']} requests, {res['failed']} failed; RSS "
          f"{res['rss_start_gib']:.2f} -> {res['rss_end_gib']:.2f} GiB (KV reserves {res['kv_reserved_gib']:.2f}); "
          f"KV usage at the end {res['kv_cache_usage_end']}", flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64], choices=sorted(SIZES))
    ap.add_argument("--pairs", type=int, default=3, help="offline/served runs in turn per concurrency")
    ap.add_argument("--soak-s", type=float, default=600.0, help="0 skips the soak")
    ap.add_argument("--no-neighbour", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from tokenmill.executor.kernels import machine_record
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    workloads = {}
    for c in a.concurrency:
        workloads[c] = str(tmp / f"serving-{SIZES[c]}.json")
        sh(TM + ["bench", "workload", "--n", str(SIZES[c]), "--in", "32", "128", "--out", "32", "128",
                 "--seed", "0", "-o", workloads[c]])
    res: dict = {"date": time.strftime("%Y-%m-%d"), **machine_record(), "model": "bundled SmolLM2-135M-Instruct",
                 "workload": "requests of 32-128 prompt and 32-128 generated tokens", "rows": []}
    for busy in ([False] if a.no_neighbour else [False, True]):
        res["rows"] += scenario(a.concurrency, workloads, busy, a.pairs)
    if a.soak_s > 0:
        short = str(tmp / "serving-soak.json")
        sh(TM + ["bench", "workload", "--n", "256", "--in", "16", "96", "--out", "4", "32", "--seed", "1", "-o", short])
        res["soak"] = soak(a.soak_s, short)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
