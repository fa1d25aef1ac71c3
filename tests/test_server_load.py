"""Many clients at once: continuous batching across HTTP requests, no cross-talk between streams, clients that
disconnect get their requests aborted and their KV blocks freed; Ctrl-C drains a busy server, then stops it
cleanly."""
from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time

import httpx
import pytest

from tests.test_server_drain import Serve

pytestmark = pytest.mark.slow   # real server processes under load (make test-fast skips them)

pytest_plugins = ["tests.server_fixtures"]
openai = pytest.importorskip("openai")

MODEL = "tiny-chat"
N_TOKENS = 16
LONG = 470          # the disconnecting requests would run this long if they were not aborted


def _metric(server, name: str, **labels) -> float:
    return server.metrics().get((f"tokenmill:{name}", tuple(sorted(labels.items()))), 0.0)


def _wait_idle(server, timeout: float = 15.0) -> None:
    """Until nothing runs or waits and kv_cache_usage_perc (as /metrics shows it) is back to 0."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        scrape = server.metrics()       # the three gauges from one scrape
        busy = {g: scrape.get((f"tokenmill:{g}", ()), 0.0)
                for g in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting")}
        if not any(busy.values()):
            return
        time.sleep(0.02)
    raise AssertionError(f"still busy after {timeout}s: {busy}")


def _wait_aborts(server, expected: float, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while _metric(server, "request_success_total", finished_reason="abort") < expected:
        assert time.monotonic() < deadline, f"fewer than {expected} aborts after {timeout}s"
        time.sleep(0.02)


def test_64_concurrent_streams_and_16_disconnects(live_server):
    prompts = [f"Request {i}: tell me about the number {i * 7}" for i in range(8)]
    aborts_before = _metric(live_server, "request_success_total", finished_reason="abort")
    tokens_before = _metric(live_server, "generation_tokens_total")

    async def run() -> tuple[dict, list]:
        client = openai.AsyncOpenAI(base_url=live_server.url + "/v1", api_key=live_server.api_key, max_retries=0,
                                    timeout=120)
        greedy = dict(model=MODEL, temperature=0, extra_body={"ignore_eos": True})
        # references one at a time; the concurrent streams must reproduce them exactly
        ref = {p: (await client.completions.create(prompt=p, max_tokens=N_TOKENS, **greedy)).choices[0].text
               for p in prompts}

        async def one(i: int) -> tuple:
            prompt, leave = prompts[i % len(prompts)], i % 4 == 0           # 16 of the 64 leave mid-stream
            stream = await client.completions.create(prompt=prompt, max_tokens=LONG if leave else N_TOKENS,
                                                     stream=True, stream_options={"include_usage": True}, **greedy)
            text, usage, pieces, ids = "", None, 0, set()
            async for chunk in stream:
                ids.add(chunk.id)
                if chunk.usage is not None:
                    usage = chunk.usage
                for c in chunk.choices:
                    text += c.text
                    pieces += 1
                if leave and pieces >= 3:
                    await stream.close()                                      # the client goes away
                    return prompt, None, None, ids
            return prompt, text, usage, ids

        results = await asyncio.gather(*(one(i) for i in range(64)))
        await client.close()
        return ref, results

    ref, results = asyncio.run(run())
    finished = [r for r in results if r[1] is not None]
    assert len(finished) == 48
    for prompt, text, usage, ids in finished:
        assert len(ids) == 1                                                  # one request's chunks only
        assert usage.completion_tokens == N_TOKENS
        assert text == ref[prompt], prompt                                    # no cross-talk between streams
    _wait_idle(live_server)                                # the 16 do not run on after the 48 are done
    assert _metric(live_server, "request_success_total", finished_reason="abort") - aborts_before == 16
    # they were cut short: run to the end they would have made 16 * LONG tokens
    generated = _metric(live_server, "generation_tokens_total") - tokens_before
    assert generated < (8 + 48) * N_TOKENS + 16 * LONG // 2


def test_non_streaming_disconnect_aborts(live_server):
    aborts_before = _metric(live_server, "request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": "Patience", "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
            "n": 4}
    # keep the request running until the client has given up (the tiny model could finish it first)
    with live_server.hold(lambda state: 10 if state.num_running else 0) as released:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(live_server.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.15),
                       headers={"Authorization": f"Bearer {live_server.api_key}"})
        released.set()
        _wait_aborts(live_server, aborts_before + 1)
        _wait_idle(live_server)
    assert _metric(live_server, "request_success_total", finished_reason="abort") - aborts_before == 1
    assert httpx.get(live_server.url + "/health").status_code == 200


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a subprocess")
def test_ctrl_c_drains_then_fails_requests_left_and_exits_0(chat_model_dir):
    """A first Ctrl-C drains as SIGTERM does (tests/test_server_drain.py); what still runs at --shutdown-timeout is
    told (an error event, a 503), not cut, and the process exits 0."""
    server = Serve(chat_model_dir, "--shutdown-timeout", "1")
    try:
        url = server.wait_ready().url
        body = {"model": MODEL, "prompt": "Go on", "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
                "n": 8}
        outcome: dict = {}

        def non_streaming() -> None:
            try:
                outcome["status"] = httpx.post(url + "/v1/completions", json=body, timeout=30).status_code
            except httpx.HTTPError as e:
                outcome["status"] = type(e).__name__

        t = threading.Thread(target=non_streaming)
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
            assert r.status_code == 200
            t.start()
            lines = r.iter_lines()
            next(lines)                                                         # generating
            inside = time.monotonic() + 10
            while True:           # both requests inside the engine (n = 8: eight sequences each) before Ctrl-C
                st = httpx.get(url + "/stats", timeout=5).json()
                if st["num_running"] + st["num_waiting"] == 16:
                    break
                assert time.monotonic() < inside and t.is_alive(), (st, outcome)
                time.sleep(0.02)
            server.send(signal.SIGINT)
            t0 = time.monotonic()
            server.wait_draining()                                              # health takes it out meanwhile
            rest = list(lines)
            drained = time.monotonic() - t0
        assert drained > 0.9, drained                                           # they ran on for the timeout
        assert "data: [DONE]" not in rest and any('"error"' in x for x in rest), rest[-3:]   # told, not cut
        t.join(timeout=15)
        assert outcome.get("status") == 503, outcome                           # told, not left hanging
        assert server.exit_status() == 0, "".join(server.log)
    finally:
        server.close()
