"""Load generator for any OpenAI-compatible server: Poisson arrivals, streaming /v1/completions,
client-side TTFT / ITL / TPOT / E2E per request, plus what the server's /metrics said meanwhile."""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from typing import Any, Optional, Sequence

import httpx
from tqdm.auto import tqdm

from .stats import RequestRecord, serving_summary

# tests swap this for an httpx.MockTransport; None means real sockets
TRANSPORT: Optional[httpx.AsyncBaseTransport] = None

GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")


def arrival_times(n: int, rate: float, seed: int = 0) -> list[float]:
    """Offsets (s) of n Poisson arrivals at `rate` req/s (exponential gaps); rate=inf sends all at once."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s (inf = all at once), got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    r, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += r.expovariate(rate)
        out.append(t)
    return out


def parse_sse_chunk(line: str) -> Optional[dict[str, Any]]:
    """One 'data: {...}' line as a dict; None for keep-alives, comments and the final [DONE]."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    return None if data in ("", "[DONE]") else json.loads(data)


async def _one(client: httpx.AsyncClient, url: str, model: Optional[str], req: dict[str, Any],
               rec: RequestRecord, t0: float) -> None:
    payload: dict[str, Any] = {
        "prompt": req["prompt_token_ids"] if req.get("prompt_token_ids") is not None else req["prompt"],
        "max_tokens": req["max_tokens"], "temperature": 0.0, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True}}
    if model:
        payload["model"] = model
    rec.prompt_tokens = len(req.get("prompt_token_ids") or [])
    start = time.perf_counter()
    rec.start = start - t0
    arrivals: list[float] = []
    usage: dict[str, Any] = {}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=payload) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return
            async for line in resp.aiter_lines():
                chunk = parse_sse_chunk(line)
                if chunk is None:
                    continue
                if "error" in chunk:
                    rec.error = str(chunk["error"])[:300]
                    return
                usage = chunk.get("usage") or usage
                for c in chunk.get("choices") or []:
                    # a bare finish chunk after tokens is no token; an empty-text one mid-stream is (UTF-8
                    # hold-back), and so is a lone finish chunk (servers that skip empty deltas send only that)
                    if c.get("text") or c.get("finish_reason") is None or not arrivals:
                        arrivals.append(time.perf_counter())
                        break
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:300]
        return
    end = time.perf_counter()
    if not arrivals:
        rec.error = "stream ended without a token"
        return
    rec.ttft = arrivals[0] - start
    rec.itl = [b - a for a, b in zip(arrivals, arrivals[1:])]
    rec.e2e = end - start
    rec.output_tokens = int(usage.get("completion_tokens") or len(arrivals))
    rec.prompt_tokens = int(usage.get("prompt_tokens") or rec.prompt_tokens)
    rec.success = True


async def _model_name(client: httpx.AsyncClient, url: str) -> Optional[str]:
    try:
        r = await client.get(f"{url}/v1/models")
        return r.json()["data"][0]["id"] if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None


async def scrape_metrics(client: httpx.AsyncClient, url: str) -> Optional[dict[str, float]]:
    from .diagnose import parse_metrics  # local: keeps prometheus_client off the import path of the client
    try:
        r = await client.get(f"{url}/metrics")
        return parse_metrics(r.text) if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def _poll(client: httpx.AsyncClient, url: str, every_s: float, samples: list[dict[str, float]]) -> None:
    while True:
        m = await scrape_metrics(client, url)
        if m is None:
            return  # no /metrics here (a peer's server without it): nothing to poll
        samples.append({k: m[k] for k in GAUGES if k in m})
        await asyncio.sleep(every_s)


async def run_serve_bench(url: str, requests: Sequence[dict[str, Any]], rate: float = math.inf,
                          num_requests: Optional[int] = None, model: Optional[str] = None, seed: int = 0,
                          max_concurrency: Optional[int] = None, duration_s: Optional[float] = None,
                          request_timeout_s: float = 600.0, slo_ttft_s: Optional[float] = None,
                          slo_tpot_s: Optional[float] = None, metrics_interval_s: float = 0.5,
                          progress: bool = True) -> dict[str, Any]:
    """Send `num_requests` (cycling through `requests`) at Poisson `rate`; no new request after `duration_s`."""
    if not requests:
        raise ValueError("no requests to send")
    url = url.rstrip("/")
    n = num_requests if num_requests is not None else len(requests)
    offsets = arrival_times(n, rate, seed)
    if duration_s is not None:
        offsets = [t for t in offsets if t <= duration_s]
    limits = httpx.Limits(max_connections=max_concurrency or max(len(offsets), 1) + 2)
    records = [RequestRecord() for _ in offsets]
    async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s, connect=10.0), limits=limits,
                                 transport=TRANSPORT) as client:
        model = model or await _model_name(client, url)
        before = await scrape_metrics(client, url)
        gauges: list[dict[str, float]] = []
        poller = asyncio.create_task(_poll(client, url, metrics_interval_s, gauges)) if before else None
        bar = tqdm(total=len(offsets), desc="requests", unit="req", disable=not progress)

        sent = [False] * len(offsets)
        order = iter(range(len(offsets)))

        async def worker(t0: float) -> None:
            # one worker per seat: a request whose arrival time has come waits for a free one, and none is sent
            # after the duration (its turn may come long after its arrival time)
            for i in order:
                await asyncio.sleep(max(0.0, offsets[i] - (time.perf_counter() - t0)))
                if duration_s is not None and time.perf_counter() - t0 > duration_s:
                    return
                sent[i] = True
                await _one(client, url, model, requests[i % len(requests)], records[i], t0)
                bar.update(1)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(t0) for _ in range(min(max_concurrency or len(offsets), len(offsets)))))
        duration = time.perf_counter() - t0
        records = [r for r, s in zip(records, sent) if s]
        bar.close()
        if poller is not None:
            poller.cancel()
        after = await scrape_metrics(client, url) if before else None
    result: dict[str, Any] = {
        "kind": "serve", "url": url, "model": model, "rate": rate, "seed": seed,
        "max_concurrency": max_concurrency,
        **serving_summary(records, duration, slo_ttft_s, slo_tpot_s),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "per_request": [r.to_dict() for r in records],
    }
    if before and after:
        result["server"] = {"deltas": {k: after[k] - before.get(k, 0.0) for k in after if k not in GAUGES},
                            "gauges": {k: _gauge_summary([g[k] for g in gauges if k in g]) for k in GAUGES}}
    return result


def _gauge_summary(xs: list[float]) -> dict[str, Optional[float]]:
    return {"mean": sum(xs) / len(xs) if xs else None, "max": max(xs) if xs else None, "samples": len(xs)}


def run(*args: Any, **kw: Any) -> dict[str, Any]:
    """Blocking wrapper around run_serve_bench."""
    return asyncio.run(run_serve_bench(*args, **kw))
