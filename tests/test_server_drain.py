"""Shutting down behind a load balancer: SIGTERM (or POST /shutdown) drains, refusing new requests with 503 and
Retry-After while those in flight run to their end, and `tokenmill serve` exits 0; a second signal cuts at once.
And the API key's edges: a WWW-Authenticate challenge on 401s, duplicate Authorization headers refused, and no
filesystem path in /v1/models."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from typing import Any, Optional

import httpx
import pytest

from tests.server_fixtures import wait_started

pytest_plugins = ["tests.server_fixtures"]
openai = pytest.importorskip("openai")

MODEL = "tiny-chat"
API_KEY = "test-key"              # the shared live_server's
AUTH = {"Authorization": f"Bearer {API_KEY}"}
DRAINED = 128                     # tokens each drained stream makes: long enough to be in flight at the signal
LONG = 480                        # streams that the second signal cuts (max_model_len is 512)
skip_windows = pytest.mark.skipif(sys.platform == "win32", reason="signals to a subprocess")


class Serve:
    """`tokenmill serve` on the tiny chat model in a subprocess, its output collected in .log."""

    def __init__(self, model_dir: Optional[str], *args: str):
        """model_dir None: the model is among args (as --model gives it)."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.cli", "serve", *([model_dir] if model_dir else []), "--port", "0",
             "--dtype", "float32",
             "--device", "cpu", "--max-model-len", "512", "--kv-cache-memory-gb", "0.05",
             "--served-model-name", MODEL, *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.log: list[str] = []
        self.url = ""

    def wait_ready(self, timeout: float = 120) -> "Serve":
        self.url = wait_started(self.proc, "OpenAI API:", self.log, timeout)
        return self

    def send(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait_draining(self, timeout: float = 5) -> httpx.Response:
        """Until /health says 503 (the signal was handled); that answer."""
        deadline = time.monotonic() + timeout
        while (r := httpx.get(self.url + "/health", timeout=5)).status_code != 503:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.01)
        return r

    def exit_status(self, timeout: float = 15) -> int:
        return self.proc.wait(timeout=timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def serve(chat_model_dir: str) -> Any:
    """serve(*args): a started `tokenmill serve`, killed at the end if it is still running."""
    started: list[Serve] = []

    def start(*args: str) -> Serve:
        started.append(Serve(chat_model_dir, *args))
        return started[-1].wait_ready()
    yield start
    for s in started:
        s.close()


async def _streams(url: str, n: int, max_tokens: int) -> tuple[list[asyncio.Task], Any]:
    """n streaming completions (tasks that return (finish_reason, usage)), each with its first chunk in, and their
    client."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    first = [asyncio.Event() for _ in range(n)]

    async def one(i: int) -> tuple[str, Any]:
        stream = await client.completions.create(model=MODEL, prompt=f"Request {i}: go on", max_tokens=max_tokens,
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        reason, usage = "", None
        async for chunk in stream:
            first[i].set()
            usage = chunk.usage or usage
            for c in chunk.choices:
                reason = c.finish_reason or reason
        return reason, usage

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first)), 60)
    assert not any(t.done() for t in tasks)
    return tasks, client


@pytest.mark.slow
@skip_windows
def test_sigterm_drains_streams_in_flight_and_exits_0(serve):
    server = serve()

    async def run() -> tuple[list, httpx.Response, httpx.Response, bool]:
        tasks, client = await _streams(server.url, 8, DRAINED)
        server.send(signal.SIGTERM)
        # the listener stays open: health takes the instance out, and a new request is told to go elsewhere
        health = await asyncio.to_thread(server.wait_draining)
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as h:
            refused = await h.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        meanwhile = not all(t.done() for t in tasks)
        results = await asyncio.gather(*tasks)
        await client.close()
        return results, refused, health, meanwhile

    results, refused, health, meanwhile = asyncio.run(run())
    assert meanwhile                         # the 503s came while the streams were still running
    for reason, usage in results:            # all eight ran to their end
        assert reason == "length" and usage.completion_tokens == DRAINED
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1", refused.text
    assert refused.json()["error"]["code"] == "shutting_down"
    assert "shutting down" in health.json()["error"]["message"]
    assert server.exit_status() == 0, "".join(server.log)
    assert any("shutting down" in line for line in server.log), "".join(server.log)


@pytest.mark.slow
@skip_windows
def test_second_sigterm_cuts_at_once(serve):
    server = serve()

    async def run() -> tuple[list, float]:
        tasks, client = await _streams(server.url, 8, LONG)
        server.send(signal.SIGTERM)                 # drains
        await asyncio.to_thread(server.wait_draining)
        await asyncio.sleep(0.2)
        assert not any(t.done() for t in tasks)
        server.send(signal.SIGTERM)                 # cuts
        t0 = time.monotonic()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        waited = time.monotonic() - t0
        await client.close()
        return results, waited

    results, waited = asyncio.run(run())
    for r in results:                                  # each told why, in an error event
        assert isinstance(r, openai.APIError) and "shutting down" in r.message, r
    assert waited < 5
    t0 = time.monotonic()
    assert server.exit_status() == 0, "".join(server.log)
    assert time.monotonic() - t0 < 10


def test_shutdown_endpoint_drains(chat_model_dir, server_factory):
    """POST /shutdown (enabled, behind the API key) drains as SIGTERM does: 503 with Retry-After to new requests
    and to /health, while the request in flight runs to its end."""
    server = server_factory(chat_model_dir, api_key=API_KEY, enable_shutdown_endpoint=True)
    body = {"model": MODEL, "prompt": "Drain", "max_tokens": 16, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c, \
                server.hold(lambda state: 10 if state.num_running else 0) as released:   # in flight until released
            with c.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
                assert r.status_code == 200
                deadline = time.monotonic() + 10
                while c.get("/stats").json()["num_running"] != 1:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                assert c.post("/shutdown").status_code == 401                       # the API key guards it
                answer = c.post("/shutdown", headers=AUTH)
                assert answer.status_code == 202 and answer.json() == {"status": "shutting_down",
                                                                       "num_in_flight": 1}, answer.text
                refused = c.post("/v1/completions", json={**body, "stream": False}, headers=AUTH)
                assert refused.status_code == 503 and refused.headers["Retry-After"] == "1", refused.text
                assert c.get("/health").status_code == 503
                assert c.get("/metrics").status_code == 200                         # still observable
                released.set()
                lines = [x for x in r.iter_lines() if x]
            assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2], lines[-3:]
    finally:
        server.stop()


def test_shutdown_endpoint_is_off_by_default(live_server):
    assert httpx.post(live_server.url + "/shutdown", headers=AUTH).status_code == 404
    assert httpx.get(live_server.url + "/health").status_code == 200


# ---- the API key --------------------------------------------------------------------------------------------------
def test_401_challenges_and_duplicate_authorization_is_refused(live_server):
    url, ok = live_server.url + "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    r = httpx.post(url, json=ok)
    assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer", r.headers
    r = httpx.post(url, json=ok, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.headers["WWW-Authenticate"] == 'Bearer error="invalid_token"', r.headers
    # two headers, the right key in either: which one a proxy would read differs, so neither is taken
    for pair in ([AUTH["Authorization"], "Bearer nope"], ["Bearer nope", AUTH["Authorization"]],
                 [AUTH["Authorization"]] * 2):
        r = httpx.post(url, json=ok, headers=[("Authorization", v) for v in pair])
        assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith("Bearer"), r.text
        assert "2 Authorization headers" in r.json()["error"]["message"], r.text
    assert httpx.post(url, json=ok, headers=AUTH).status_code == 200


def test_models_show_no_filesystem_path(live_server, chat_model_dir):
    r = httpx.get(live_server.url + "/v1/models", headers=AUTH)
    assert r.status_code == 200
    [card] = r.json()["data"]
    assert card["id"] == card["root"] == MODEL
    assert chat_model_dir not in r.text and os.path.basename(chat_model_dir) not in r.text
