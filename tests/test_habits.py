"""The habits users bring from vLLM and llama-server. Command lines: accepted and mapped where the engine can honour
them, said once where they mean nothing here, refused with what to do instead where they ask for what is not served
yet. Requests: unknown fields ignored and named (log, x-ignored-fields), as vLLM ignores them. GET /v1/models/{id}."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from tests.test_server_drain import MODEL, Serve
from tokenmill.cli import build_parser, engine_kwargs, main

pytest_plugins = ["tests.server_fixtures"]
openai = pytest.importorskip("openai")

TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}{% if add_generation_prompt %}=>{% endif %}"


def _serve_args(*argv: str) -> Any:
    from tokenmill.server.cli import _habits
    args = build_parser().parse_args(["serve", *argv])
    _habits(args)
    return args


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="a server subprocess")
def test_a_vllm_command_line_serves(chat_model_dir: str, tmp_path: Path) -> None:
    """`vllm serve`'s flags: --model, --chat-template from a file, --enable-auto-tool-choice and
    --trust-remote-code (each said once to mean nothing here); the openai client then chats and retrieves the model."""
    from transformers import AutoTokenizer
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    s = Serve(None, "--model", chat_model_dir, "--chat-template", str(template), "--enable-auto-tool-choice",
              "--trust-remote-code", "--tool-call-parser", "hermes")
    try:
        s.wait_ready()
        log = "".join(s.log)
        assert "--enable-auto-tool-choice has no effect here" in log and "--trust-remote-code has no effect" in log
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
        assert client.models.retrieve(MODEL).id == MODEL
        with pytest.raises(openai.NotFoundError, match=f"serves '{MODEL}'"):
            client.models.retrieve("org/other-model")
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=3, temperature=0)
        assert reply.choices[0].finish_reason == "length"
        # the template from the file renders the prompt: its tokens are those of the text it writes
        import httpx
        got = httpx.post(s.url + "/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                         timeout=30).json()["tokens"]
        tok = AutoTokenizer.from_pretrained(chat_model_dir)
        assert got == tok.encode("<<hi>>=>", add_special_tokens=True) or got == tok.encode("<<hi>>=>")
        assert reply.usage.prompt_tokens == len(got)
    finally:
        s.close()


def test_a_llama_server_command_line_is_mapped() -> None:
    """llama-server's -m, -c and -t: the model, the context length, the threads."""
    args = _serve_args("-m", "some/model.gguf", "-c", "2048", "-t", "2")
    kw = engine_kwargs(args)
    assert (args.model, kw["max_model_len"], kw["num_threads"]) == ("some/model.gguf", 2048, 2)
    assert _serve_args("m.gguf", "--model", "m.gguf").model == "m.gguf"       # the same model twice is one
    assert _serve_args("-hf", "org/repo:Q4_K_M").model == "org/repo:Q4_K_M"   # a hub name (tests/test_hub.py)
    kw = engine_kwargs(_serve_args("--gpu-memory-utilization", "0.5", "--ctx-size", "512"))
    assert (kw["gpu_memory_utilization"], kw["max_model_len"]) == (0.5, 512)


def test_lora_command_lines_are_mapped() -> None:
    """vLLM's --lora-modules (name=path and its JSON form) and llama-server's --lora (a PEFT folder, named by it)
    become numbered adapters, and turn --enable-lora on."""
    args = _serve_args("--lora-modules", "a=/x/a", '{"name": "b", "path": "/x/b"}', "--lora", "/y/c/",
                       "--max-loras", "2", "--max-lora-rank", "32")
    assert [(r.lora_name, r.lora_int_id, r.lora_path) for r in args.lora_requests] == \
        [("a", 1, "/x/a"), ("b", 2, "/x/b"), ("c", 3, "/y/c/")]
    kw = engine_kwargs(args)
    assert (kw["enable_lora"], kw["max_loras"], kw["max_lora_rank"]) == (True, 2, 32)
    assert engine_kwargs(_serve_args())["enable_lora"] is False


@pytest.mark.parametrize("argv, says", [
    (["--lora", "adapter.gguf"], "a GGUF adapter is llama.cpp's format"),
    (["--lora-modules", "just-a-name"], "give name=path"),
    (["--lora-modules", "a=/x", "a=/y"], "given twice"),
    (["--enable-lora", "--data-parallel-size", "2"], "not implemented"),
    (["a.gguf", "--model", "b.gguf"], "two models given"),
    (["--chat-template", "no/such/template.jinja"], "neither a file nor a Jinja template"),
    (["--chat-template", "{% if %}"], "not valid Jinja"),
])
def test_what_is_not_served_says_what_to_do(argv: list[str], says: str, capsys) -> None:
    """Each refused before anything loads, with what to do instead."""
    assert main(["serve", *argv]) == 2
    assert says in capsys.readouterr().err


def test_a_bad_chat_template_is_refused(chat_model_dir: str, server_factory: Any) -> None:
    with pytest.raises(ValueError, match=r"not valid Jinja \(line 1"):
        server_factory(chat_model_dir, chat_template="{% for m in messages %}")


def test_gpu_memory_utilization_sizes_the_kv_cache_as_vllm_does(tiny_llama) -> None:
    """The share of the whole memory, less what is in use: set just above what is in use, the cache gets about the
    difference (other processes move the figure a little); set below it, the engine says what to change."""
    import torch

    from tokenmill.engine.engine import LLMEngine
    from tokenmill.executor.loading import available_memory_bytes, total_memory_bytes
    cpu = torch.device("cpu")
    total = total_memory_bytes(cpu)
    in_use = total - available_memory_bytes(cpu)
    eng = LLMEngine(tiny_llama[0], dtype="float32", max_model_len=64,
                    gpu_memory_utilization=min(1.0, (in_use + 256 * 2 ** 20) / total))
    kv_bytes = eng.kv.num_blocks * eng.kv_bytes_per_block()
    assert 0 < kv_bytes <= 1024 * 2 ** 20
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.001: .* raise kv_cache_memory_gb \(or "
                                         r"gpu_memory_utilization\)"):
        LLMEngine(tiny_llama[0], dtype="float32", max_model_len=64, gpu_memory_utilization=0.001)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\], got 1.5"):
        LLMEngine(tiny_llama[0], dtype="float32", max_model_len=64, gpu_memory_utilization=1.5)


def test_unknown_request_fields_are_ignored_and_named(live_server: Any, openai_client: Any, caplog) -> None:
    """The openai client with reasoning_effort and a field of its own: an answer, the fields named in the response's
    x-ignored-fields header and the server's log; nested ones by their path; known fields never named."""
    import httpx

    from tests.server_fixtures import API_KEY
    raw = openai_client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, reasoning_effort="low",
        extra_body={"frobnicate": {"x": 1}})
    assert raw.parse().choices[0].finish_reason == "length"
    assert raw.headers["x-ignored-fields"] == '"reasoning_effort", "frobnicate"'
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi", "nickname": "a\nb"}], "max_tokens": 2,
            "stream_options": None}
    with caplog.at_level("WARNING", logger="tokenmill.server"):
        r = httpx.post(live_server.url + "/v1/chat/completions", json=body, timeout=30,
                       headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200, r.text
    assert r.headers["x-ignored-fields"] == '"messages.0.nickname"'
    assert 'ignored the fields tokenmill does not know: "messages.0.nickname"' in caplog.text
    odd = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "": 1, " x ": 2, "a\r\nSet-Cookie: y": 3,
           **{f"k{i}": i for i in range(30)}}
    r = httpx.post(live_server.url + "/v1/completions", json=odd, timeout=30,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200, r.text
    assert r.headers["x-ignored-fields"].startswith('"", " x ", "a\\r\\nSet-Cookie: y", "k0"')
    assert r.headers["x-ignored-fields"].endswith(", and 13 more") and "set-cookie" not in r.headers
    known = httpx.post(live_server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                                   "user": "u", "top_k": 3}, timeout=30,
                       headers={"Authorization": f"Bearer {API_KEY}"})
    assert known.status_code == 200 and "x-ignored-fields" not in known.headers
