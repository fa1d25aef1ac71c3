"""Anthropic's Messages API (/v1/messages) over the chat route: a request is translated into a chat completion
request (system prompt, text, tool_use and tool_result blocks, tools and tool_choice, stop_sequences), run as one,
and its answer translated back, streamed as Anthropic's events or whole. Thinking that --reasoning-parser splits out
comes back as thinking blocks. Errors take Anthropic's shape (app.py, by path)."""
from __future__ import annotations

import json
from typing import Any, AsyncIterator, Literal, Optional, Union

from fastapi import Request
from pydantic import Field, ValidationError
from starlette.responses import JSONResponse, Response

from tokenmill.server.chat import create_chat_completion
from tokenmill.server.common import SSEResponse, ServerContext, new_id
from tokenmill.server.protocol import (ApiError, Bool, ChatCompletionRequest, Float, Int, StopString, _Request,
                                       _Strict)

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


class TextBlock(_Strict):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[TextBlock]] = ""
    is_error: Optional[Bool] = None


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None


Block = Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]


class Tool(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    input_schema: dict[str, Any]


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[Bool] = None


class MessagesRequest(_Request):
    model: str
    max_tokens: Int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: Optional[Union[str, list[TextBlock]]] = None
    stop_sequences: Optional[list[StopString]] = None
    stream: Optional[Bool] = False
    temperature: Optional[Float] = Field(default=None, ge=0, le=1)
    top_p: Optional[Float] = Field(default=None, gt=0, le=1)
    top_k: Optional[Int] = Field(default=None, ge=0)
    seed: Optional[Int] = None                         # beyond Anthropic's: sampling made repeatable, as OpenAI's
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    metadata: Optional[dict[str, Any]] = None          # accepted and ignored, as OpenAI's metadata is
    thinking: Optional[dict[str, Any]] = None          # the reasoning parser decides what is thinking


def _text(content: Union[str, list[TextBlock]]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def to_chat(req: MessagesRequest) -> ChatCompletionRequest:
    """The chat completion request that asks for the same thing."""
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _text(req.system)})
    for i, m in enumerate(req.messages):
        blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        if m.role == "user":
            for b in blocks:          # each result answers its call, before what the user says next
                if isinstance(b, ToolResultBlock):
                    messages.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)})
                elif not isinstance(b, TextBlock):
                    raise ApiError(400, f"messages.{i}: a user message takes text and tool_result blocks, not "
                                        f"{b.type}", f"messages.{i}.content")
            if text or not any(isinstance(b, ToolResultBlock) for b in blocks):
                messages.append({"role": "user", "content": text})
        else:
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in blocks if isinstance(b, ToolUseBlock)]
            if any(isinstance(b, ToolResultBlock) for b in blocks):
                raise ApiError(400, f"messages.{i}: tool_result blocks belong to user messages",
                               f"messages.{i}.content")
            messages.append({"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})})
    body: dict[str, Any] = {"model": req.model, "messages": messages, "max_tokens": req.max_tokens,
                            "stream": bool(req.stream)}
    for ours, theirs in (("stop", req.stop_sequences), ("temperature", req.temperature), ("top_p", req.top_p),
                         ("top_k", req.top_k), ("seed", req.seed)):
        if theirs is not None:
            body[ours] = theirs
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                           **({"description": t.description} if t.description else {})}}
                         for t in req.tools]
    if req.tool_choice is not None:
        c = req.tool_choice
        if c.type == "tool" and not c.name:
            raise ApiError(400, "tool_choice of type 'tool' needs the tool's name", "tool_choice.name")
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(c.type) or \
            {"type": "function", "function": {"name": c.name}}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        raise ApiError(400, f"{'.'.join(map(str, err['loc']))}: {err['msg']}") from None


def _blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        out.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        out.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        out.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                    "input": _tool_input(call["function"]["arguments"])})
    return out


def _tool_input(arguments: Optional[str]) -> dict[str, Any]:
    """A call's arguments as Anthropic's input object. A model's own text may not be a JSON object (an unconstrained
    call): then it is kept whole under "arguments" rather than failing the reply."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def _stop(choice: dict[str, Any], req: MessagesRequest) -> tuple[str, Optional[str]]:
    """Anthropic's stop_reason and stop_sequence for a chat choice's finish."""
    reason, matched = choice.get("finish_reason"), choice.get("stop_reason")
    if reason == "stop" and isinstance(matched, str) and matched in (req.stop_sequences or []):
        return "stop_sequence", matched
    return STOP_REASONS.get(reason or "", "end_turn"), None


def _usage(u: Optional[dict[str, Any]]) -> dict[str, Any]:
    u = u or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": u.get("prompt_tokens", 0) - cached, "output_tokens": u.get("completion_tokens", 0),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


async def create_message(ctx: ServerContext, req: MessagesRequest, request: Request) -> Response:
    chat = to_chat(req)
    resp = await create_chat_completion(ctx, chat, request)
    if not req.stream:
        body = json.loads(bytes(resp.body))
        choice = body["choices"][0]
        reason, sequence = _stop(choice, req)
        return JSONResponse({"id": body["id"].replace("chatcmpl", "msg", 1), "type": "message", "role": "assistant",
                             "model": ctx.answer_name(req.model), "content": _blocks(choice["message"]), "stop_reason": reason,
                             "stop_sequence": sequence, "usage": _usage(body.get("usage"))})
    assert isinstance(resp, SSEResponse)
    return SSEResponse(_events(ctx, req, resp.body_iterator), resp.streams)


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, separators=(',', ':'))}\n\n"


async def _events(ctx: ServerContext, req: MessagesRequest, chunks: AsyncIterator[Any]) -> AsyncIterator[str]:
    """The chat stream's chunks as Anthropic's events: message_start, then per block a start, deltas and a stop
    (thinking, text, each tool_use), then message_delta with the stop reason and usage, and message_stop."""
    msg_id = new_id("msg")
    yield _event("message_start", {"message": {
        "id": msg_id, "type": "message", "role": "assistant", "model": ctx.answer_name(req.model), "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": _usage(None)}})
    index, open_kind, calls = -1, None, {}
    stop: tuple[str, Optional[str]] = ("end_turn", None)
    usage_seen: Optional[dict[str, Any]] = None

    def start(kind: str, block: dict[str, Any]) -> list[str]:
        nonlocal index, open_kind
        out = [_event("content_block_stop", {"index": index})] if open_kind is not None else []
        index, open_kind = index + 1, kind
        return out + [_event("content_block_start", {"index": index, "content_block": block})]

    async for raw in chunks:
        text = raw.decode() if isinstance(raw, bytes) else raw
        for line in text.splitlines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:            # an error met mid-stream, in Anthropic's shape
                e = chunk["error"]
                yield _event("error", {"error": {"type": e.get("type") or "api_error", "message": e.get("message")}})
                return
            if chunk.get("usage"):
                usage_seen = chunk["usage"]
            for c in chunk.get("choices") or []:
                d = c.get("delta") or {}
                if d.get("reasoning_content"):
                    if open_kind != "thinking":
                        for ev in start("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                            yield ev
                    yield _event("content_block_delta", {"index": index, "delta": {
                        "type": "thinking_delta", "thinking": d["reasoning_content"]}})
                if d.get("content"):
                    if open_kind != "text":
                        for ev in start("text", {"type": "text", "text": ""}):
                            yield ev
                    yield _event("content_block_delta", {"index": index, "delta": {"type": "text_delta",
                                                                                   "text": d["content"]}})
                for call in d.get("tool_calls") or []:
                    fn = call.get("function") or {}
                    if call.get("id") and call["index"] not in calls:
                        calls[call["index"]] = call["id"]
                        for ev in start("tool_use", {"type": "tool_use", "id": call["id"], "name": fn.get("name"),
                                                     "input": {}}):
                            yield ev
                    if fn.get("arguments"):
                        yield _event("content_block_delta", {"index": index, "delta": {
                            "type": "input_json_delta", "partial_json": fn["arguments"]}})
                if c.get("finish_reason"):
                    stop = _stop(c, req)
    if open_kind is not None:
        yield _event("content_block_stop", {"index": index})
    u = _usage(usage_seen)
    yield _event("message_delta", {"delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                                   "usage": {"output_tokens": u["output_tokens"]}})
    yield _event("message_stop", {})
