"""Anthropic's Messages API (/v1/messages) through the real `anthropic` client against the live server, streamed and
not: text with a system prompt, a stop sequence, a tool round trip (tool_use, then tool_result), errors in
Anthropic's shape. The live server requires its API key, which Anthropic's client sends as x-api-key."""
from __future__ import annotations

from typing import Any

import pytest

pytest_plugins = ["tests.server_fixtures"]
anthropic = pytest.importorskip("anthropic")

# a named tool choice compiles a grammar in a worker at the idle CPU priority: alone (pyproject: serial)
pytestmark = pytest.mark.serial

MODEL = "tiny-chat"
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def client(live_server: Any) -> Any:
    from tests.server_fixtures import API_KEY
    return anthropic.Anthropic(base_url=live_server.url, api_key=API_KEY, max_retries=0, timeout=60)


def test_text_with_a_system_prompt(client: Any) -> None:
    m = client.messages.create(model=MODEL, max_tokens=6, system="You are terse.", extra_body={"temperature": 0},
                               messages=[{"role": "user", "content": "Say hi."}])
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 6 and m.usage.input_tokens > 0
    [block] = m.content
    assert block.type == "text" and block.text
    # the same, streamed: the events give the same text, and the final message agrees
    with client.messages.stream(model=MODEL, max_tokens=6, system="You are terse.", extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": "Say hi."}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == block.text and final.content[0].text == text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6


def test_a_stop_sequence(client: Any) -> None:
    """A piece of the free reply, given as a stop sequence, ends it there, named."""
    # sampled with a seed: the tiny random model's greedy reply is mostly blank lines
    ask = dict(model=MODEL, extra_body={"temperature": 1, "seed": 3},
               messages=[{"role": "user", "content": "Count."}])
    free = client.messages.create(max_tokens=24, **ask).content[0].text
    cut = next(free[i:i + 2] for i in range(len(free) // 3, len(free) - 1) if not free[i:i + 2].isspace())
    m = client.messages.create(max_tokens=24, stop_sequences=[cut], **ask)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == cut
    assert m.content[0].text == free[:free.index(cut)]
    with client.messages.stream(max_tokens=24, stop_sequences=[cut], **ask) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == cut


def test_a_tool_round_trip(client: Any) -> None:
    """A named tool choice gives a tool_use block whose input fits the schema; its tool_result goes back and the
    model answers in text. Streamed, the input arrives as input_json deltas that make the same object."""
    ask = dict(model=MODEL, max_tokens=40, extra_body={"temperature": 0}, tools=[WEATHER],
               tool_choice={"type": "tool", "name": "get_weather"})
    first = client.messages.create(messages=[{"role": "user", "content": "Weather in Paris?"}], **ask)
    assert first.stop_reason == "tool_use"
    [call] = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input["city"], str)
    with client.messages.stream(messages=[{"role": "user", "content": "Weather in Paris?"}], **ask) as s:
        streamed = s.get_final_message()
    [scall] = [b for b in streamed.content if b.type == "tool_use"]
    assert scall.input == call.input and streamed.stop_reason == "tool_use"
    answer = client.messages.create(model=MODEL, max_tokens=5, extra_body={"temperature": 0}, tools=[WEATHER],
                                    messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name,
                                           "input": call.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}]}],
        tool_choice={"type": "none"})
    assert answer.content[0].type == "text" and answer.stop_reason == "max_tokens"


def test_errors_come_in_anthropics_shape(client: Any, live_server: Any) -> None:
    import httpx
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-x", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    assert "serves 'tiny-chat'" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=0, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "invalid_request_error" and "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="tool_result blocks belong to user messages"):
        client.messages.create(model=MODEL, max_tokens=5, messages=[
            {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "1"}]}])
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=live_server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "authentication_error"
    assert httpx.get(live_server.url + "/health").status_code == 200
