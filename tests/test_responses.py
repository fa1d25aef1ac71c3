"""/v1/responses against a live server, driven by the official openai client: the same answer as
/v1/chat/completions for the same conversation, OpenAI's streaming events, previous_response_id, and refusals.
Also the OpenAI-shaped 404/405 for endpoints the server does not serve."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest

from tokenmill.engine.async_engine import EngineDeadError
from tokenmill.server.protocol import ChatMessage
from tokenmill.server.responses import ResponsesRequest, ResponseStore, _Builder, _stream

pytest_plugins = ["tests.server_fixtures"]
openai = pytest.importorskip("openai")

# compiles grammars in workers at the idle CPU priority, which a second test worker's load would starve: alone
pytestmark = pytest.mark.serial

MODEL = "tiny-chat"
AUTH = {"Authorization": "Bearer test-key"}      # the shared live_server's key
GREEDY = dict(model=MODEL, temperature=0)


@pytest.fixture(scope="module")
def text_server(tiny_text_model, server_factory):
    """A server over conftest's tiny model with larger weights, whose greedy answer depends on the prompt (the
    shared one answers newlines to everything), so equal texts mean equal conversations."""
    server = server_factory(tiny_text_model[0])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(text_server):
    return openai.OpenAI(base_url=text_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat(client, messages: list[dict], max_tokens: int, **extra):
    r = client.chat.completions.create(messages=messages, max_tokens=max_tokens, extra_body=extra or None, **GREEDY)
    return r.choices[0], r.usage


def stop_token(client) -> tuple[int, list[dict]]:
    """A token the greedy answer meets at its 4th step or later (and not before): stopping on it ends the
    response early, so its status is "completed"."""
    messages = [{"role": "user", "content": "Tell me about rivers."}]
    c, _ = chat(client, messages, 12, return_token_ids=True)
    ids = c.model_extra["token_ids"]
    return next(t for i, t in enumerate(ids) if i >= 3 and t not in ids[:i]), messages


def events(client, **kw) -> list:
    return list(client.responses.create(stream=True, **kw))


def test_non_streamed_equals_chat(client):
    messages = [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "A color?"}]
    c, usage = chat(client, messages, 9)
    assert chat(client, messages[1:], 9)[0].message.content != c.message.content    # the check can fail
    r = client.responses.create(instructions="You answer in one word.", input="A color?",
                                max_output_tokens=9, **GREEDY)
    assert r.output_text == c.message.content and r.output_text
    assert (r.usage.input_tokens, r.usage.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    assert r.usage.total_tokens == usage.total_tokens and r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")    # 9 tokens, no EOS
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert [p.type for p in item.content] == ["output_text"]
    assert r.instructions == "You answer in one word." and r.max_output_tokens == 9 and r.temperature == 0
    # the same conversation as message items with text parts; a developer message is a system one
    parts = client.responses.create(input=[
        {"role": "developer", "content": [{"type": "input_text", "text": "You answer in one word."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "A color?"}]}],
        max_output_tokens=9, **GREEDY)
    assert parts.output_text == r.output_text


def test_stop_makes_it_completed(client):
    tok, messages = stop_token(client)
    c, _ = chat(client, messages, 12, stop_token_ids=[tok])
    r = client.responses.create(input=messages[0]["content"], max_output_tokens=12,
                                extra_body={"stop_token_ids": [tok]}, **GREEDY)
    assert c.finish_reason == "stop" and r.status == "completed" and r.incomplete_details is None
    assert r.output_text == c.message.content and r.output[0].status == "completed"


def test_streamed_events(client):
    tok, messages = stop_token(client)
    kw = dict(input=messages[0]["content"], max_output_tokens=12, extra_body={"stop_token_ids": [tok]}, **GREEDY)
    full = client.responses.create(**kw)
    evs = events(client, **kw)
    kinds = [e.type for e in evs]
    head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done",
            "response.completed"]
    assert kinds[:4] == head and kinds[-4:] == tail
    deltas = evs[4:-4]
    assert deltas and all(e.type == "response.output_text.delta" for e in deltas)
    assert [e.sequence_number for e in evs] == list(range(len(evs)))
    text = "".join(e.delta for e in deltas)
    assert text == full.output_text == evs[-4].text == evs[-3].part.text == evs[-2].item.content[0].text
    assert evs[0].response.status == "in_progress" and evs[0].response.output == []
    done = evs[-1].response
    assert done.status == "completed" and done.output_text == text and done.id == evs[0].response.id
    assert (done.usage.input_tokens, done.usage.output_tokens) == (full.usage.input_tokens, full.usage.output_tokens)
    assert {e.item_id for e in deltas} == {evs[2].item.id}


def test_streamed_incomplete_and_raw_sse(live_server):
    """Hitting max_output_tokens ends with response.incomplete; each SSE names its event as its data's type."""
    body = {"model": MODEL, "input": "Hello", "max_output_tokens": 5, "stream": True, "temperature": 0}
    with httpx.stream("POST", live_server.url + "/v1/responses", json=body, headers=AUTH, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        blocks = [b for b in r.read().decode().split("\n\n") if b.strip()]
    pairs = [b.split("\n") for b in blocks]
    assert all(len(p) == 2 and p[0].startswith("event: ") and p[1].startswith("data: ") for p in pairs)
    data = [json.loads(p[1][6:]) for p in pairs]
    assert [p[0][7:] for p in pairs] == [d["type"] for d in data]
    last = data[-1]
    assert last["type"] == "response.incomplete" and last["response"]["status"] == "incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["response"]["usage"]["output_tokens"] == 5


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(instructions="Be brief.", input="Hi there", max_output_tokens=6, **GREEDY)
    second = client.responses.create(previous_response_id=first.id, input="And again?", max_output_tokens=6,
                                     **GREEDY)
    # instructions do not carry over to the next response (OpenAI's rule)
    turns = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "And again?"}]
    c, usage = chat(client, turns, 6)
    assert second.output_text == c.message.content
    assert second.usage.input_tokens == usage.prompt_tokens > first.usage.input_tokens
    assert second.previous_response_id == first.id
    # a streamed response can be continued too, and so can a chain
    streamed = events(client, previous_response_id=second.id, input="Once more.", max_output_tokens=4,
                      **GREEDY)[-1].response
    third = client.responses.create(previous_response_id=streamed.id, input="Last.", max_output_tokens=4,
                                    **GREEDY)
    turns += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Once more."},
              {"role": "assistant", "content": streamed.output_text}, {"role": "user", "content": "Last."}]
    c, usage = chat(client, turns, 4)
    assert third.output_text == c.message.content and third.usage.input_tokens == usage.prompt_tokens
    # what the Agents SDK does without previous_response_id: send the output items back as input
    replay = client.responses.create(input=[
        {"role": "user", "content": "Hi there"}, first.output[0].model_dump(),
        {"role": "user", "content": "And again?"}], max_output_tokens=6, **GREEDY)
    assert replay.output_text == second.output_text


def test_unknown_or_unstored_previous_response_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(previous_response_id="resp_nope", input="hi", max_output_tokens=2)
    err = e.value.body
    assert "'resp_nope'" in err["message"] and err["code"] == "previous_response_not_found"
    assert err["param"] == "previous_response_id"
    unstored = client.responses.create(input="hi", max_output_tokens=2, store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError, match=unstored.id):
        client.responses.create(previous_response_id=unstored.id, input="hi", max_output_tokens=2)


@pytest.mark.parametrize("body, param, says", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input",
     "this model takes text only"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input", "text only"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input", "messages"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools",
     "tools are not supported on /v1/responses"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice", "tools are not supported"),
    ({"input": "hi", "text": {"format": {"type": "json_object"}}}, "text", "structured output"),
    ({"input": "hi", "background": True}, "background", "not supported"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning", "not supported"),
    ({"input": "hi", "temperature": 3}, "temperature", "less than or equal to 2"),
    ({"input": []}, "input", "input is empty"),
])
def test_refused_requests_are_400(live_server, body, param, says):
    r = httpx.post(live_server.url + "/v1/responses", json={"model": MODEL, **body}, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert says in err["message"] and err["type"] == "invalid_request_error"
    assert err["param"] is None or err["param"].startswith(param)


def test_ignored_fields_and_tools_with_tool_choice_none(client):
    r = client.responses.create(
        input="hi", max_output_tokens=3, metadata={"k": "v"}, user="u", parallel_tool_calls=False,
        truncation="auto", service_tier="auto", include=[], text={"format": {"type": "text"}},
        tools=[{"type": "function", "name": "f", "parameters": {}, "strict": False}], tool_choice="none", **GREEDY)
    plain = client.responses.create(input="hi", max_output_tokens=3, **GREEDY)
    assert r.output_text == plain.output_text and r.metadata == {"k": "v"} and r.parallel_tool_calls is False


def test_logprobs(client):
    r = client.responses.create(input="hi", max_output_tokens=4, top_logprobs=2,
                                include=["message.output_text.logprobs"], **GREEDY)
    lps = r.output[0].content[0].logprobs
    assert len(lps) == 4 and all(len(x.top_logprobs) == 2 and x.logprob <= 0 for x in lps)
    assert "".join(x.token for x in lps) == r.output_text


def test_store_is_bounded_lru():
    s = ResponseStore(capacity=2)
    m = [ChatMessage(role="user", content="x")]
    s.put("a", m)
    s.put("b", m)
    assert s.get("a") is m        # "a" is now the most recent
    s.put("c", m)
    assert s.get("b") is None and s.get("a") is m and len(s) == 2


def test_a_stream_that_fails_ends_with_response_failed():
    class Dead:
        def __aiter__(self):
            return self

        async def __anext__(self):
            raise EngineDeadError("the engine stopped")

        def abort(self) -> None:
            pass

    async def collect() -> list[dict]:
        b = _Builder(SimpleNamespace(model_name=MODEL, answer_name=lambda name: name or MODEL), ResponsesRequest(input="hi"))
        kept: list[str] = []
        evs = [json.loads(e.split("data: ", 1)[1]) async for e in _stream(b, Dead(), kept.append)]
        assert kept == []            # a failed response cannot be continued
        return evs

    last = asyncio.run(collect())[-1]
    assert last["type"] == "response.failed" and last["response"]["status"] == "failed"
    assert last["response"]["error"] == {"code": "server_error", "message": "the engine stopped"}


# ---- endpoints the server does not serve ------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/audio/speech", "/v1/images/generations", "/v1/embeddingz"])
def test_unknown_endpoint_is_an_openai_404(live_server, path):
    r = httpx.post(live_server.url + path, json={}, headers=AUTH, timeout=30)
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["message"].startswith(f"POST {path} is not implemented by this server; it serves ")
    for served in ("POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses", "GET /v1/models"):
        assert served in err["message"]
    assert err["type"] == "invalid_request_error" and err["code"] == "unknown_endpoint" and err["param"] is None


def test_wrong_method_is_an_openai_405(live_server, openai_client):
    r = httpx.get(live_server.url + "/v1/completions", headers=AUTH, timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    err = r.json()["error"]
    assert err["message"] == "GET /v1/completions is not allowed; /v1/completions takes POST"
    assert err["code"] == "method_not_allowed"
    with pytest.raises(openai.NotFoundError, match="POST /v1/audio/speech is not implemented"):
        openai_client.audio.speech.create(model=MODEL, voice="alloy", input="hi")
