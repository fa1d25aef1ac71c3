"""LoRA adapters through the server, with the real openai client: the request's model picks the adapter, /v1/models
lists them under the base, and adapters load and unload through vLLM's routes while other requests run. Outputs
equal the offline LLM's with the same LoRARequest."""
from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch

from tests.server_fixtures import LiveServer
from tokenmill import LLM, LoRARequest, SamplingParams

pytest_plugins = ["tests.server_fixtures"]
openai = pytest.importorskip("openai")
peft = pytest.importorskip("peft")

BASE = "tiny-chat"
PROMPT = "The weather today is"


@pytest.fixture(scope="module")
def adapters(chat_model_dir: str, tmp_path_factory) -> dict[str, str]:
    from transformers import AutoModelForCausalLM

    from tests.test_lora import make_adapter
    base = AutoModelForCausalLM.from_pretrained(chat_model_dir, dtype=torch.float32)
    root = tmp_path_factory.mktemp("lora_server")
    specs = {"alpha": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]),
             "beta": dict(r=4, lora_alpha=4, target_modules=["o_proj", "gate_proj", "up_proj"]),
             "gamma": dict(r=8, lora_alpha=8, use_rslora=True, target_modules=["k_proj", "up_proj"]),
             "too-big": dict(r=16, lora_alpha=16, target_modules=["q_proj"])}
    return {name: make_adapter(base, root / name, 10 + i, **cfg) for i, (name, cfg) in enumerate(specs.items())}


@pytest.fixture(scope="module")
def server(chat_model_dir: str, adapters: dict[str, str]) -> Any:
    from tokenmill.engine.engine import LLMEngine
    from tokenmill.server.app import build_app
    engine = LLMEngine(chat_model_dir, dtype="float32", device="cpu", max_model_len=512, kv_cache_memory_gb=0.05,
                       enable_lora=True, max_loras=2, max_lora_rank=8)
    app = build_app(engine, model_name=BASE, lora_modules=[LoRARequest("alpha", 1, adapters["alpha"]),
                                                           LoRARequest("beta", 2, adapters["beta"])])
    s = LiveServer(app)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def offline(chat_model_dir: str, adapters: dict[str, str]) -> Any:
    """Greedy text of PROMPT for each adapter (None: the base), from the offline LLM."""
    llm = LLM(chat_model_dir, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              kv_cache_memory_gb=0.05)

    def text(name, n):
        lora = None if name is None else LoRARequest(name, {"alpha": 1, "beta": 2, "gamma": 3}[name], adapters[name])
        out = llm.generate(PROMPT, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False,
                           lora_request=lora)
        return out[0].outputs[0].text
    return text


def complete(client: Any, model: str, n: int = 6) -> str:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=n, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    return r.choices[0].text


def test_adapters_are_models(server: LiveServer, offline: Any) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    cards = client.models.list().data
    assert [m.id for m in cards] == [BASE, "alpha", "beta"]
    assert [getattr(m, "parent", None) for m in cards] == [None, BASE, BASE]
    assert client.models.retrieve("beta").id == "beta"
    texts = {name: complete(client, name) for name in (BASE, "alpha", "beta")}
    assert texts == {BASE: offline(None, 6), "alpha": offline("alpha", 6), "beta": offline("beta", 6)}
    assert len(set(texts.values())) == 3          # the adapters change what the model says
    reply = client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=3, temperature=0)
    assert reply.model == "alpha"
    with pytest.raises(openai.NotFoundError, match="serves 'tiny-chat', 'alpha', 'beta'"):
        complete(client, "delta")


def test_load_and_unload_while_a_request_runs(server: LiveServer, adapters: dict[str, str], offline: Any) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    post = lambda route, body: httpx.post(server.url + route, json=body, timeout=60)     # noqa: E731
    n = 24
    with server.hold(lambda state: 0.05):          # the stream below runs on while adapters come and go
        stream = client.completions.create(model="alpha", prompt=PROMPT, max_tokens=n, temperature=0.0, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = iter(stream)
        text = next(chunks).choices[0].text
        r = post("/v1/load_lora_adapter", {"lora_name": "gamma", "lora_path": adapters["gamma"]})
        assert r.status_code == 200 and "gamma" in r.text
        assert "gamma" in [m.id for m in client.models.list().data]
        assert complete(client, "gamma") == offline("gamma", 6)
        r = post("/v1/unload_lora_adapter", {"lora_name": "beta"})
        assert r.status_code == 200
        with pytest.raises(openai.NotFoundError, match="'beta' does not exist"):
            complete(client, "beta")
        # vLLM's info metric names the adapters in use, read by Prometheus' own parser
        info = [labels for (name, labels), _ in server.metrics().items() if name == "tokenmill:lora_requests_info"]
        assert info and dict(info[-1])["running_lora_adapters"] == "alpha" and dict(info[-1])["max_lora"] == "2"
        text += "".join(c.choices[0].text for c in chunks)
    assert text == offline("alpha", n)
    # bad loads and unloads: 400/404 that say what to change; the server serves on
    r = post("/v1/load_lora_adapter", {"lora_name": "big", "lora_path": adapters["too-big"]})
    assert r.status_code == 400 and "max_lora_rank" in r.json()["error"]["message"]
    r = post("/v1/load_lora_adapter", {"lora_name": "nowhere", "lora_path": "/no/such/adapter"})
    assert r.status_code == 400 and "not a directory" in r.json()["error"]["message"]
    r = post("/v1/load_lora_adapter", {"lora_name": "alpha", "lora_path": adapters["gamma"]})
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    r = post("/v1/unload_lora_adapter", {"lora_name": "beta"})
    assert r.status_code == 404
    assert [m.id for m in client.models.list().data] == [BASE, "alpha", "gamma"]
    assert complete(client, "alpha") == offline("alpha", 6)
