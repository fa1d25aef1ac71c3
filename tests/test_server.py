"""The OpenAI-compatible server against a live uvicorn on 127.0.0.1, driven by the official openai client
(and httpx for what the client cannot send: malformed JSON, missing keys, huge bodies)."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.client import HTTP

pytest_plugins = ["tests.server_fixtures"]
openai = pytest.importorskip("openai")

MODEL = "tiny-chat"
API_KEY = "test-key"              # the shared live_server's
MAX_BODY_BYTES = 64 * 1024
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


def post(server, path: str, body, headers=AUTH, **kw) -> httpx.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return HTTP.post(server.url + path, content=data, headers={"Content-Type": "application/json", **headers},
                      timeout=30, **kw)


def tokenize(server, **body) -> list[int]:
    r = post(server, "/tokenize", body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


# ---- endpoints ---------------------------------------------------------------------------------------------------
def test_models_health_version(live_server, openai_client):
    assert (live_server.api_key, live_server.max_body_bytes) == (API_KEY, MAX_BODY_BYTES)
    assert [m.id for m in openai_client.models.list().data] == [MODEL]
    assert httpx.get(live_server.url + "/health").json() == {"status": "ok"}
    assert "version" in httpx.get(live_server.url + "/version").json()
    stats = httpx.get(live_server.url + "/stats").json()
    assert stats["kv_blocks_total"] > 0 and stats["model"] == MODEL


def test_tokenize_detokenize(live_server):
    ids = tokenize(live_server, prompt="Hello, tokenmill!")
    r = post(live_server, "/detokenize", {"tokens": ids})
    assert r.json()["prompt"] == "Hello, tokenmill!"


# ---- completions -------------------------------------------------------------------------------------------------
def test_completion_stream_equals_non_stream(openai_client):
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=12, **GREEDY)
    full = openai_client.completions.create(**kw)
    chunks = list(openai_client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert full.choices[0].text and text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert full.usage.completion_tokens == chunks[-1].usage.completion_tokens == 12
    assert full.usage.prompt_tokens == chunks[-1].usage.prompt_tokens
    # vLLM's return_token_ids: the same tokens, whole or in pieces
    extra = {"ignore_eos": True, "return_token_ids": True}
    ids = openai_client.completions.create(**{**kw, "extra_body": extra}).choices[0].model_extra["token_ids"]
    pieces = openai_client.completions.create(stream=True, **{**kw, "extra_body": extra})
    assert len(ids) == 12 and [t for c in pieces for t in c.choices[0].model_extra["token_ids"]] == ids


def test_completion_logprobs_and_echo(live_server, openai_client):
    prompt = "Hello there, general"
    n_prompt = len(tokenize(live_server, prompt=prompt))
    plain = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, **GREEDY)
    r = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, logprobs=3, echo=True, **GREEDY)
    c = r.choices[0]
    assert c.text == prompt + plain.choices[0].text
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_prompt + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert all(3 <= len(t) <= 4 for t in lp.top_logprobs[1:])       # top-3 plus the actual token
    for i in range(n_prompt, n_prompt + 4):                          # greedy: the chosen token is the most likely
        assert lp.token_logprobs[i] == pytest.approx(max(lp.top_logprobs[i].values()), abs=1e-5)
    assert lp.text_offset == sorted(lp.text_offset)
    echo_only = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True, **GREEDY)
    assert echo_only.choices[0].text == c.text and echo_only.choices[0].logprobs is None
    # streamed logprobs: the same tokens, in pieces
    chunks = list(openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, logprobs=3,
                                                   stream=True, **GREEDY))
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    assert streamed == lp.tokens[n_prompt:]
    chunks = list(openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, logprobs=3, echo=True,
                                                   stream=True, **GREEDY))
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    offsets = [o for ch in chunks if ch.choices[0].logprobs for o in ch.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset


def test_completion_prompt_forms_and_n(live_server, openai_client):
    ids = tokenize(live_server, prompt="Once upon a time")
    by_text = openai_client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, **GREEDY)
    by_ids = openai_client.completions.create(model=MODEL, prompt=ids, max_tokens=5, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    r = openai_client.completions.create(model=MODEL, prompt=["Once upon a time", "In a galaxy"], n=2,
                                         max_tokens=3, seed=1, extra_body={"ignore_eos": True, "top_k": 50})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 12
    chunks = list(openai_client.completions.create(model=MODEL, prompt=["Once upon a time", "In a galaxy"],
                                                   max_tokens=3, stream=True, **GREEDY))
    assert sorted({c.choices[0].index for c in chunks}) == [0, 1]
    first = "".join(c.choices[0].text for c in chunks if c.choices[0].index == 0)
    assert first == by_text.choices[0].text[:len(first)] and first


def test_seed_stop_and_vllm_extras(openai_client):
    kw = dict(model=MODEL, prompt="Random words:", max_tokens=8, temperature=1.0, seed=7,
              extra_body={"ignore_eos": True})
    a = openai_client.completions.create(**kw)
    assert a.choices[0].text == openai_client.completions.create(**kw).choices[0].text
    full = openai_client.completions.create(model=MODEL, prompt="Stop here", max_tokens=12, **GREEDY).choices[0].text
    stop = full[4:7]
    r = openai_client.completions.create(model=MODEL, prompt="Stop here", max_tokens=12, stop=[stop], **GREEDY)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[:full.find(stop)]
    r = openai_client.completions.create(model=MODEL, prompt="Extras", max_tokens=4, seed=3, extra_body={
        "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.3, "min_tokens": 2, "ignore_eos": True})
    assert r.usage.completion_tokens == 4


# ---- chat --------------------------------------------------------------------------------------------------------
def test_chat_system_prompt_uses_the_template(live_server, openai_client, chat_model_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(chat_model_dir)
    messages = [{"role": "system", "content": "You are a terse pirate."},
                {"role": "user", "content": "Where is the treasure?"}]
    r = openai_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, **GREEDY)
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == 5
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "terse pirate" in text and text.endswith("<|im_start|>assistant\n")
    ids = tokenize(live_server, messages=messages)
    assert ids == tok.encode(text, add_special_tokens=False)               # as transformers renders it
    assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id       # one BOS, not two
    assert r.usage.prompt_tokens == len(ids)
    other = openai_client.chat.completions.create(model=MODEL, messages=messages[1:], max_tokens=1, **GREEDY)
    assert other.usage.prompt_tokens != r.usage.prompt_tokens


def test_chat_stream_equals_non_stream(openai_client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Count to ten."}], max_completion_tokens=10,
              **GREEDY)
    full = openai_client.chat.completions.create(**kw)
    chunks = list(openai_client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"                  # the role first
    content = [c for c in chunks[1:] if c.choices and c.choices[0].delta.content]
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    assert chunks.index(finish[0]) > chunks.index(content[-1])              # then content, then finish_reason
    assert "".join(c.choices[0].delta.content for c in content) == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 10


def test_chat_logprobs(openai_client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, logprobs=True,
              top_logprobs=2, **GREEDY)
    r = openai_client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token      # greedy picks the top one
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob) and e.bytes == list(e.token.encode())
    chunks = list(openai_client.chat.completions.create(stream=True, **kw))
    streamed = [e.token for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == [e.token for e in content]


# ---- errors ------------------------------------------------------------------------------------------------------
def _expect(r: httpx.Response, status: int, param=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


BAD_BODIES = [
    ({"model": MODEL, "prompt": "x", "temperature": -1}, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 2}, "top_p"),
    ({"model": MODEL, "prompt": "x", "n": 0}, "n"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "logprobs": 50}, "logprobs"),
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": [10 ** 7]}, "prompt"),
    ({"model": MODEL}, "prompt"),
    # OpenAI's ranges, and numbers of the right kind
    ({"model": MODEL, "prompt": "x", "temperature": 1e9}, "temperature"),
    ({"model": MODEL, "prompt": "x", "temperature": 2.5}, "temperature"),
    ({"model": MODEL, "prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "n": 2.0}, "n"),
    ({"model": MODEL, "prompt": "x", "n": 129}, "n"),
    ({"model": MODEL, "prompt": "x", "seed": 2 ** 70}, "seed"),
    ({"model": MODEL, "prompt": "x", "seed": "7"}, "seed"),
    ({"model": MODEL, "prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"5": 500}}, "logit_bias.5"),
]


@pytest.mark.parametrize("body,param", BAD_BODIES, ids=[p for _, p in BAD_BODIES])
def test_invalid_completion_params_are_400(live_server, body, param):
    _expect(post(live_server, "/v1/completions", body), 400, param)
    assert httpx.get(live_server.url + "/health").status_code == 200


@pytest.mark.parametrize("body", [
    {"model": MODEL, "messages": []},
    {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]},
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -3},
], ids=["no-messages", "bad-role", "top-logprobs-without-logprobs", "negative-max"])
def test_invalid_chat_params_are_400(live_server, body):
    _expect(post(live_server, "/v1/chat/completions", body), 400)
    assert httpx.get(live_server.url + "/health").status_code == 200


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}


@pytest.mark.parametrize("message,param,says", [
    ({"role": "user", "content": [{"type": "text", "text": "what is this?"}, IMAGE]}, "messages.0.content.1",
     "content parts of type 'image_url' are not supported: this model takes text only"),
    ({"role": "user", "content": [AUDIO]}, "messages.0.content.0", "this model takes text only"),
    ({"role": "user"}, "messages.0", "a user message needs content"),
    ({"role": "system", "content": None}, "messages.0", "a system message needs content"),
    ({"role": "user", "content": [{"type": "text"}]}, "messages.0.content.0", "needs its text"),
], ids=["image", "audio", "missing-content", "null-content", "text-part-without-text"])
def test_chat_content_that_is_not_text_is_400(live_server, message, param, says):
    err = _expect(post(live_server, "/v1/chat/completions", {"model": MODEL, "messages": [message]}), 400, param)
    assert says in err["message"], err


def test_openai_fields_without_effect_are_accepted(live_server, openai_client):
    """metadata, store, service_tier, prediction, parallel_tool_calls and user are accepted and change nothing
    (protocol.IGNORED, as vLLM does); the largest 64-bit seed is a seed."""
    from tokenmill.server.protocol import IGNORED
    extra = {"metadata": {"run": "7"}, "store": False, "service_tier": "auto", "user": "u1",
             "prediction": {"type": "content", "content": "Paris"}, "parallel_tool_calls": False}
    assert set(extra) == set(IGNORED)
    msgs = [{"role": "user", "content": "Name a city."}]
    plain = openai_client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    got = openai_client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                                seed=2 ** 63 - 1, **extra)
    assert got.choices[0].message.content == plain.choices[0].message.content
    r = post(live_server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, **extra})
    assert r.status_code == 200, r.text


def test_error_statuses(live_server, openai_client):
    url = "/v1/completions"
    ok = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    _expect(post(live_server, url, b'{"model": "tiny-chat", "prompt": '), 400)                  # malformed JSON
    _expect(post(live_server, url, b"not json at all"), 400)
    err = _expect(post(live_server, url, {"model": MODEL, "prompt": "word " * 600}), 400, "prompt")
    assert "max_model_len" in err["message"]                                                  # prompt too long
    _expect(post(live_server, url, ok, headers={}), 401)                                      # no key
    _expect(post(live_server, url, ok, headers={"Authorization": "Bearer nope"}), 401)        # wrong key
    _expect(post(live_server, url, {**ok, "model": "gpt-17"}), 404, "model")                  # unknown model
    _expect(post(live_server, url, {**ok, "prompt": "a" * (2 * MAX_BODY_BYTES)}), 413)        # body too large

    def chunked():            # no Content-Length: the limit holds while reading
        for _ in range(4):
            yield b" " * MAX_BODY_BYTES
    _expect(httpx.post(live_server.url + url, content=chunked(), headers=AUTH, timeout=30), 413)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=live_server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        openai_client.completions.create(model="nope", prompt="hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              temperature=-2)
    assert httpx.get(live_server.url + "/health").status_code == 200
    assert openai_client.completions.create(model=MODEL, prompt="still", max_tokens=2).usage.completion_tokens >= 1


def test_queue_bound_is_503(chat_model_dir, server_factory):
    """One running slot and room for one waiting request: a third request is turned away, then all is well."""
    server = server_factory(chat_model_dir, max_num_seqs=1, max_queue=1)
    body = {"model": MODEL, "prompt": "long", "max_tokens": 480, "ignore_eos": True, "stream": True}
    # the tiny model could finish the first request before the third arrives: slow each step down (480 steps take
    # 48 s, whatever the load on the machine), and once the second request waits, stop stepping until the third
    # has its answer
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c, \
                server.hold(lambda state: 10 if state.num_waiting else 0.1) as released:
            with c.stream("POST", "/v1/completions", json=body) as first:
                assert first.status_code == 200
                next(first.iter_lines())                                   # running
                with c.stream("POST", "/v1/completions", json=body) as second:
                    assert second.status_code == 200                       # waiting
                    deadline = time.monotonic() + 10
                    while server.llm.state.num_waiting != 1 and time.monotonic() < deadline:
                        time.sleep(0.01)
                    state = server.llm.state
                    assert (state.num_running, state.num_waiting) == (1, 1), state
                    r = c.post("/v1/completions", json={**body, "stream": False}, timeout=10)
                    released.set()
                    err = _expect(r, 503)
                    assert err["code"] == "queue_full"
        assert httpx.get(server.url + "/health").status_code == 200
        deadline = time.monotonic() + 10
        while server.llm.state.num_running + server.llm.state.num_waiting and time.monotonic() < deadline:
            time.sleep(0.02)                                               # the two closed streams get aborted
        r = httpx.post(server.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
    finally:
        server.stop()


# ---- metrics -----------------------------------------------------------------------------------------------------
HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds"]


def test_metrics_parse_and_count_requests(live_server, openai_client):
    before = live_server.metrics()
    usages = [openai_client.completions.create(model=MODEL, prompt=f"metric {i}", max_tokens=4, **GREEDY).usage
              for i in range(3)]
    for i in range(2):
        chunks = list(openai_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"m{i}"}], max_tokens=4, stream=True,
            stream_options={"include_usage": True}, **GREEDY))
        usages.append(chunks[-1].usage)
    after = live_server.metrics()

    def delta(name: str, **labels) -> float:
        key = (f"tokenmill:{name}", tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    for h in HISTOGRAMS:
        assert (f"tokenmill:{h}_count", ()) in after, h
    for h in HISTOGRAMS[:1] + HISTOGRAMS[2:]:
        assert delta(f"{h}_count") == 5, h
    assert delta("inter_token_latency_seconds_count") == 5 * 3                  # 4 tokens: 3 gaps each
    assert delta("request_success_total", finished_reason="length") == 5
    assert delta("prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("generation_tokens_total") == sum(u.completion_tokens for u in usages) == 20
    for g in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"]:
        assert (f"tokenmill:{g}", ()) in after, g
    for c in ["num_preemptions_total", "prefix_cache_queries_total", "prefix_cache_hits_total"]:
        assert (f"tokenmill:{c}", ()) in after, c
    assert delta("prefix_cache_queries_total") > 0


def test_playground_page_is_served(live_server):
    r = httpx.get(live_server.url + "/")
    assert r.status_code == 200 and "tokenmill playground" in r.text


# ---- AsyncLLM ----------------------------------------------------------------------------------------------------
def test_async_llm_survives_cancelled_adds_and_stops_cleanly(chat_model_dir):
    import asyncio

    from tokenmill.engine.async_engine import AsyncLLM, EngineDeadError
    from tokenmill.engine.engine import LLMEngine
    from tokenmill.sampling_params import SamplingParams

    llm = AsyncLLM(LLMEngine(chat_model_dir, dtype="float32", device="cpu", max_model_len=256,
                             kv_cache_memory_gb=0.02))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    async def main() -> None:
        for i in range(24):          # handlers cancelled before, during and after the engine took the add
            task = asyncio.create_task(llm.add_request("hello", params))
            for _ in range(i % 6):
                await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        outs = [o async for o in await llm.add_request("hello", params)]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
        assert await llm.call(lambda e: e.has_unfinished_requests()) is False     # none left behind
        llm.shutdown(wait=True)
        with pytest.raises(EngineDeadError):
            await llm.add_request("hello", params)

    asyncio.run(main())
    assert llm.engine.kv.num_used_blocks == 0 and not llm.is_running
