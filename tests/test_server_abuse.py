"""Bad and hostile requests through the live server: each is refused with a 400 that names what to change, and the
server is healthy after every one. Text no tokenizer can encode, bodies that are not UTF-8 or nest too deep,
booleans that are not JSON booleans, lengths past the context, too many prompts, constraints that contradict the
request's bans, and the prefix cache kept apart by cache_salt."""
from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.client import HTTP
from tests.test_server import AUTH, MODEL, _expect, post

pytest_plugins = ["tests.server_fixtures"]

# compiles grammars in workers at the idle CPU priority, which a second test worker's load would starve: alone
pytestmark = pytest.mark.serial

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def healthy(live_server: Any) -> Any:
    """The live server, checked for health after the test's requests."""
    yield live_server
    r = HTTP.get(live_server.url + "/health", timeout=10)
    assert r.status_code == 200, r.text
    assert live_server.llm.is_running


# JSON's "\ud800" escape parses to a lone surrogate; written by hand, since json.dumps would escape it the same way
SURROGATE = "x\\ud800y"
LONE_SURROGATES = [
    ("/tokenize", '{"prompt": "%s"}', "prompt"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "%s"}]}', "messages.0.content"),
    ("/v1/embeddings", '{"input": ["ok", "%s"]}', "input.1"),
    ("/v1/responses", '{"input": "%s", "max_output_tokens": 1}', "input"),
    ("/v1/responses", '{"input": "hi", "instructions": "%s", "max_output_tokens": 1}', "instructions"),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "bad_words": ["%s"], "max_tokens": 1}', "bad_words.0"),
    ("/v1/completions", '{"prompt": ["ok", "%s"], "max_tokens": 1}', "prompt.1"),
    ("/v1/completions", '{"prompt": "hi", "stop": "%s", "max_tokens": 1}', "stop"),
]


@pytest.mark.parametrize("path,body,param", LONE_SURROGATES)
def test_text_that_cannot_be_encoded_is_a_400_naming_its_field(healthy, path, body, param):
    err = _expect(post(healthy, path, (body % SURROGATE).encode()), 400, param)
    assert "surrogate" in err["message"] and err["message"].startswith(param)


def test_bodies_that_cannot_be_read_say_why(healthy):
    url = "/v1/completions"
    err = _expect(post(healthy, url, b'{"prompt": "caf\xe9", "max_tokens": 1}'), 400)     # latin-1, not UTF-8
    assert "not valid UTF-8" in err["message"] and "byte 15" in err["message"]
    err = _expect(post(healthy, url, b"[" * 10_000 + b"]" * 10_000), 400)
    assert "10000 levels deep" in err["message"] and "at most 500" in err["message"]
    err = _expect(post(healthy, url, b'{"prompt": "a\x01b"}'), 400)                          # a raw control character
    assert "not valid JSON" in err["message"] and "control character" in err["message"]
    assert "at character 13" in err["message"]
    err = _expect(post(healthy, url, b""), 400)
    assert "empty" in err["message"] and "'prompt'" in err["message"]
    err = _expect(post(healthy, CHAT, b""), 400)
    assert "'messages'" in err["message"]
    err = _expect(post(healthy, url, b"[1, 2]"), 400)
    assert "must be an object" in err["message"]


NOT_BOOLEANS = [
    ("/v1/completions", {"prompt": "x", "max_tokens": 1, "logprobs": 1, "echo": "no"}, "echo"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1, "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1, "ignore_eos": "on"}, "ignore_eos"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1, "ignore_eos": 0}, "ignore_eos"),
    (CHAT, {"messages": MSG, "max_tokens": 1, "logprobs": "yes"}, "logprobs"),
    (CHAT, {"messages": MSG, "max_tokens": 1, "add_generation_prompt": "false"}, "add_generation_prompt"),
    (CHAT, {"messages": MSG, "max_tokens": 1, "stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage"),
    ("/v1/responses", {"input": "x", "max_output_tokens": 1, "ignore_eos": 0}, "ignore_eos"),
    ("/v1/embeddings", {"input": "x", "normalize": "true"}, "normalize"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": 1}, "add_special_tokens"),
]


@pytest.mark.parametrize("path,body,param", NOT_BOOLEANS)
def test_booleans_are_json_booleans(healthy, path, body, param):
    err = _expect(post(healthy, path, body), 400, param)
    assert "a JSON boolean" in err["message"] and param in err["message"]


def test_lengths_past_the_context_are_refused_with_both_numbers(healthy):
    for max_tokens in (10 ** 9, 2 ** 62):
        err = _expect(post(healthy, CHAT, {"messages": MSG, "max_tokens": max_tokens}), 400, "max_tokens")
        assert "512" in err["message"] and str(max_tokens) in err["message"]
        assert err["code"] == "context_length_exceeded"
    err = _expect(post(healthy, CHAT, {"messages": MSG, "max_tokens": 2 ** 70}), 400, "max_tokens")
    n = len(post(healthy, "/tokenize", {"prompt": "word " * 100, "add_special_tokens": True}).json()["tokens"])
    err = _expect(post(healthy, "/v1/completions", {"prompt": "word " * 100, "max_tokens": 512 - n + 1}), 400,
                  "max_tokens")
    assert f"at most {512 - n}" in err["message"] and f"{n} in the prompt" in err["message"]
    r = post(healthy, "/v1/completions", {"prompt": "word " * 100, "max_tokens": 512 - n, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 512 - n
    err = _expect(post(healthy, CHAT, {"messages": MSG, "max_completion_tokens": 600}), 400, "max_completion_tokens")
    err = _expect(post(healthy, "/v1/responses", {"input": "hi", "max_output_tokens": 600}), 400, "max_output_tokens")
    err = _expect(post(healthy, "/v1/completions", {"prompt": "word " * 600, "max_tokens": 1}), 400, "prompt")
    assert "max_model_len" in err["message"]


def test_prompts_per_request_are_capped(healthy):
    err = _expect(post(healthy, "/v1/completions", {"prompt": ["x"] * 129, "max_tokens": 1}), 400, "prompt")
    assert "129" in err["message"] and "128" in err["message"]
    r = post(healthy, "/v1/completions", {"prompt": ["x"] * 128, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 128


def test_contradictory_constraints_are_refused_at_admission(healthy):
    err = _expect(post(healthy, "/v1/completions", {"prompt": "x", "bad_words": ["a"], "guided_regex": "a",
                                                    "max_tokens": 2}), 400, "guided_regex")
    assert "bad_words" in err["message"]
    choice = {"messages": MSG, "structured_outputs": {"choice": ["yes", "no"]}, "max_tokens": 2}
    tokens = [post(healthy, "/tokenize", {"prompt": w, "add_special_tokens": False}).json()["tokens"]
              for w in ("yes", "no")]
    err = _expect(post(healthy, CHAT, {**choice, "allowed_token_ids": [tokens[0][0] + 1]}), 400,
                  "structured_outputs")
    assert "allowed_token_ids" in err["message"]


def test_a_contradiction_seen_only_while_generating_is_a_400_not_an_abort(healthy, openai_client):
    # the choice ends after its word, where min_tokens bans the end of the sequence
    body = {"messages": MSG, "guided_choice": ["yes"], "min_tokens": 8, "max_tokens": 10}
    err = _expect(post(healthy, CHAT, body), 400)
    assert err["code"] == "contradictory_constraints" and "min_tokens" in err["message"]
    r = post(healthy, CHAT, {**body, "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "contradictory_constraints"
    assert not any(c.get("finish_reason") == "abort" for e in events for c in e.get("choices", []))


def _cached(server: Any, path: str, body: dict) -> int:
    r = post(server, path, body)
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    return (u.get("prompt_tokens_details") or u.get("input_tokens_details"))["cached_tokens"]


def _hits(server: Any) -> float:
    return server.metrics()[("tokenmill:prefix_cache_hits_total", ())]


@pytest.mark.parametrize("path,field", [("/v1/completions", "prompt"), (CHAT, "messages"),
                                        ("/v1/responses", "input")])
def test_cache_salt_keeps_prefixes_apart(healthy, path, field):
    text = "A long enough shared prefix to fill a few blocks of the cache: " + "tok " * 60
    prompt = [{"role": "user", "content": text}] if field == "messages" else text
    length = "max_output_tokens" if field == "input" else "max_tokens"
    body, alice, bob = {field: prompt, length: 1}, f"alice {path}", f"bob {path}"
    assert _cached(healthy, path, {**body, "cache_salt": alice}) == 0
    before = _hits(healthy)
    assert _cached(healthy, path, {**body, "cache_salt": bob}) == 0         # another salt: no hit at all
    assert _hits(healthy) == before
    assert _cached(healthy, path, {**body, "cache_salt": alice}) >= 64      # the same salt shares
    assert _hits(healthy) >= before + 64
    if field == "prompt":          # no chat template: nothing else unsalted shares these blocks
        assert _cached(healthy, path, body) == 0
        assert _cached(healthy, path, body) >= 64
    _expect(post(healthy, path, {**body, "cache_salt": ""}), 400, "cache_salt")


def test_cached_tokens_can_be_hidden(chat_model_dir, server_factory):
    server = server_factory(chat_model_dir, report_cached_tokens=False)
    try:
        body = {"prompt": "A prefix long enough to be cached in full blocks: " + "tok " * 60, "max_tokens": 1}
        for _ in range(2):
            assert _cached(server, "/v1/completions", body) == 0
        assert _hits(server) > 0           # the cache still works; it is only not reported
    finally:
        server.stop()


def test_no_filesystem_path_in_models(healthy, chat_model_dir):
    r = httpx.get(healthy.url + "/v1/models", headers=AUTH, timeout=10)
    assert r.status_code == 200 and chat_model_dir not in r.text
    assert r.json()["data"][0]["root"] == MODEL


def test_deep_bodies_and_union_types_are_400s(healthy):
    deep = "[" * 950 + '"x"' + "]" * 950          # parses, and validation must not recurse past Python's limit
    err = _expect(post(healthy, "/v1/completions", ('{"prompt": %s, "max_tokens": 1}' % deep).encode()), 400,
                  "prompt")
    err = _expect(post(healthy, "/v1/completions", {"prompt": 5, "max_tokens": 1}), 400, "prompt")
    assert ".str" not in err["message"]
    _expect(post(healthy, "/v1/completions", {"prompt": "", "max_tokens": 1}), 400, "prompt")
    err = _expect(post(healthy, "/v1/completions", b'"\\ud800"'), 400)
    assert not err["message"].startswith(":")
