"""POST /v1/responses: OpenAI's Responses API over the chat template, text in and text out.

The conversation (input messages, after `instructions` as a system message and after the turns of
`previous_response_id`) is rendered exactly as /v1/chat/completions renders messages, and answered by one engine
request. Responses made during the server's life are kept in a bounded in-memory store so that a later request
can continue them; tools, structured output and the stateful extras (background, conversations, prompt
templates) are refused by name.
"""
from __future__ import annotations

import itertools
import json
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator, Callable, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenmill.engine.async_engine import EngineDeadError, RequestStream
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.chat import chat_logprobs, render_messages
from tokenmill.server.common import ServerContext, SSEResponse, checked, final_outputs, now, submit, unavailable
from tokenmill.server.protocol import (ApiError, Bool, CacheSalt, ChatMessage, Float, Int, Stop, TokenId, _or, _Request,
                                       _Strict)

DEFAULT_STORE_SIZE = 4096
_MEDIA_PARTS = ("input_image", "input_file", "input_audio")
_LOGPROBS = "message.output_text.logprobs"


class InputPart(BaseModel):
    """An input_text part, or an output_text part of an assistant turn a client sends back (its annotations and
    logprobs are ignored). Media parts are refused by name: the models are text only."""
    # the schema shows what passes _text_only; the model takes any type so that it can refuse media by name
    model_config = ConfigDict(extra="allow", json_schema_extra={
        "properties": {"type": {"enum": ["input_text", "output_text"]}, "text": {"type": "string"},
                       "annotations": {}, "logprobs": {}, "prompt_cache_breakpoint": {}},
        "required": ["type", "text"], "additionalProperties": False})
    type: str
    text: Optional[str] = None

    @model_validator(mode="after")
    def _text_only(self) -> "InputPart":
        if self.type in _MEDIA_PARTS:
            raise ValueError(f"content parts of type {self.type!r} are not supported: this model takes text only")
        if self.type not in ("input_text", "output_text"):
            raise ValueError(f"content parts of type {self.type!r} are not supported; use 'input_text' parts")
        extra = set(self.model_extra or ()) - {"annotations", "logprobs", "prompt_cache_breakpoint"}
        if extra:
            raise ValueError(f"unknown field(s) {', '.join(sorted(extra))} in an {self.type} content part")
        if self.text is None:
            raise ValueError(f"an {self.type} content part needs its text")
        return self


class InputMessage(_Strict):
    """A message item. Output messages sent back as input (the Agents SDK replays them) carry id/status/phase."""
    type: Optional[Literal["message"]] = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[InputPart]]
    id: Optional[str] = None
    status: Optional[str] = None
    phase: Optional[str] = None

    @model_validator(mode="before")
    @classmethod
    def _messages_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind not in (None, "message"):
            raise ValueError(f"input items of type {kind!r} are not supported on /v1/responses yet; send messages "
                             "(role and content) only")
        return data

    def as_chat(self) -> ChatMessage:
        c = self.content
        return ChatMessage(role=self.role, content=c if isinstance(c, str) else "".join(p.text or "" for p in c))


class ResponsesRequest(_Request):
    model: Optional[str] = None
    input: Union[str, list[InputMessage]]
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = None
    max_output_tokens: Optional[Int] = Field(default=None, ge=1)
    temperature: Optional[Float] = Field(default=None, ge=0, le=2)
    top_p: Optional[Float] = Field(default=None, gt=0, le=1)
    top_logprobs: Optional[Int] = Field(default=None, ge=0, le=20)
    include: Optional[list[str]] = None        # only message.output_text.logprobs changes anything here
    stream: Optional[Bool] = False
    store: Optional[Bool] = True
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    text: Optional[dict[str, Any]] = None      # {"format": {"type": "text"}} only
    # refused unless left unset (checked in _refuse)
    reasoning: Optional[dict[str, Any]] = None
    background: Optional[Bool] = None
    conversation: Optional[Union[str, dict[str, Any]]] = None
    prompt: Optional[dict[str, Any]] = None
    # accepted and ignored: they change nothing this server computes
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    parallel_tool_calls: Optional[Bool] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    service_tier: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    cache_salt: CacheSalt = None
    prompt_cache_retention: Optional[str] = None
    max_tool_calls: Optional[Int] = None
    stream_options: Optional[dict[str, Any]] = None
    # vLLM's extra sampling fields, as on the other endpoints
    top_k: Optional[Int] = Field(default=0, ge=-1)           # 0 or -1: off
    min_p: Optional[Float] = Field(default=0.0, ge=0, le=1)
    repetition_penalty: Optional[Float] = Field(default=1.0, gt=0)
    presence_penalty: Optional[Float] = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: Optional[Float] = Field(default=0.0, ge=-2, le=2)
    seed: Optional[Int] = Field(default=None, ge=-2 ** 63, le=2 ** 63 - 1)
    stop: Stop = None
    stop_token_ids: Optional[list[TokenId]] = None
    ignore_eos: Optional[Bool] = False

    def messages(self) -> list[ChatMessage]:
        if isinstance(self.input, str):
            return [ChatMessage(role="user", content=self.input)]
        return [m.as_chat() for m in self.input]

    @property
    def num_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.top_logprobs or _LOGPROBS in (self.include or []) else None

    def to_sampling_params(self) -> SamplingParams:
        try:
            return SamplingParams(
                temperature=_or(self.temperature, 1.0), top_p=_or(self.top_p, 1.0), top_k=_or(self.top_k, 0),
                min_p=_or(self.min_p, 0.0), repetition_penalty=_or(self.repetition_penalty, 1.0),
                presence_penalty=_or(self.presence_penalty, 0.0), frequency_penalty=_or(self.frequency_penalty, 0.0),
                seed=self.seed, max_tokens=self.max_output_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
                ignore_eos=bool(self.ignore_eos), logprobs=self.num_logprobs)
        except (ValueError, TypeError) as e:
            raise ApiError(400, str(e).replace("SamplingParams.", "").replace("max_tokens", "max_output_tokens"))


def _refuse(req: ResponsesRequest) -> None:
    """What would change the answer but is not implemented: a 400 that names it, never a silent drop."""
    if req.tools and req.tool_choice != "none":
        raise ApiError(400, "tools are not supported on /v1/responses yet; leave 'tools' out (or set tool_choice "
                            "to 'none')", "tools")
    if req.tool_choice not in (None, "none", "auto"):
        raise ApiError(400, "tool_choice can only be 'auto' or 'none' here: tools are not supported yet",
                       "tool_choice")
    fmt = (req.text or {}).get("format") or {}
    if fmt.get("type", "text") != "text":
        raise ApiError(400, f"text.format {fmt.get('type')!r} (structured output) is not supported; leave it out "
                            "or use {'type': 'text'}", "text")
    for name, why in (("reasoning", "this server has no reasoning controls"),
                      ("background", "responses are answered while the request waits"),
                      ("conversation", "use previous_response_id to continue a response"),
                      ("prompt", "prompt templates are not stored here; send input and instructions")):
        value = getattr(req, name)
        if value and (not isinstance(value, dict) or any(v is not None for v in value.values())):
            raise ApiError(400, f"{name} is not supported on /v1/responses ({why}); leave it out", name)


class ResponseStore:
    """The conversations (without instructions, which do not carry over) of responses made during the server's
    life, by response id; the least recently used goes first once `capacity` are kept."""

    def __init__(self, capacity: int = DEFAULT_STORE_SIZE):
        self.capacity = capacity
        self._items: OrderedDict[str, list[ChatMessage]] = OrderedDict()

    def get(self, response_id: str) -> Optional[list[ChatMessage]]:
        convo = self._items.get(response_id)
        if convo is not None:
            self._items.move_to_end(response_id)
        return convo

    def put(self, response_id: str, conversation: list[ChatMessage]) -> None:
        self._items[response_id] = conversation
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


def _usage(ctx: ServerContext, out: RequestOutput) -> dict[str, Any]:
    n_in, n_out = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
    return {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": ctx.cached(out.num_cached_tokens),
                                                           "cache_write_tokens": 0},
            "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n_in + n_out}


def _text_part(text: str, logprobs: Optional[list[dict[str, Any]]] = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _message(item_id: str, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


class _Builder:
    """The Response object of one request, in any state; echoes the request's settings as OpenAI does."""

    def __init__(self, ctx: ServerContext, req: ResponsesRequest):
        self.ctx, self.req = ctx, req
        self.id, self.item_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.created = now()

    def response(self, status: str, output: list[dict[str, Any]], usage: Optional[dict[str, Any]] = None,
                 error: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        r = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": now() if status == "completed" else None, "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "metadata": r.metadata or {},
            "model": self.ctx.answer_name(r.model), "output": output, "parallel_tool_calls": _or(r.parallel_tool_calls, True),
            "previous_response_id": r.previous_response_id, "reasoning": None, "store": r.store is not False,
            "temperature": _or(r.temperature, 1.0), "text": {"format": {"type": "text"}},
            "tool_choice": r.tool_choice or "auto", "tools": r.tools or [], "top_p": _or(r.top_p, 1.0),
            "truncation": r.truncation or "disabled", "usage": usage, "user": r.user}

    def status(self, c: CompletionOutput) -> str:
        return "incomplete" if c.finish_reason == "length" else "completed"

    def logprobs(self, c: CompletionOutput, start: int = 0) -> list[dict[str, Any]]:
        k = self.req.num_logprobs
        if k is None:
            return []
        return chat_logprobs(self.ctx, c.token_ids[start:], (c.logprobs or [])[start:], k)["content"]


async def create_response(ctx: ServerContext, store: ResponseStore, req: ResponsesRequest,
                          request: Request) -> Response:
    lora = ctx.check_model(req.model)
    _refuse(req)
    history: list[ChatMessage] = []
    if req.previous_response_id is not None:
        found = store.get(req.previous_response_id)
        if found is None:
            raise ApiError(404, f"no response with id {req.previous_response_id!r} is stored here; only responses "
                                f"made by this server since it started (the last {store.capacity}, not those "
                                "made with store=false) can be continued", "previous_response_id",
                           "previous_response_not_found")
        history = found
    convo = history + req.messages()
    if not convo:
        raise ApiError(400, "input is empty; give a string or a list of messages", "input")
    system = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    ids = render_messages(ctx, system + convo, True)
    params = req.to_sampling_params()
    ctx.check_length(len(ids), params.max_tokens, "max_output_tokens", "input", "the input")
    b = _Builder(ctx, req)
    stream = await submit(ctx, ctx.prompt(ids, req.cache_salt), params, b.id, lora)

    def keep(text: str) -> None:
        if req.store is not False:
            store.put(b.id, convo + [ChatMessage(role="assistant", content=text)])

    if req.stream:
        return SSEResponse(_stream(b, stream, keep), [stream])
    [out] = await final_outputs([stream], request)
    c = out.outputs[0]
    keep(c.text)
    status = b.status(c)
    return JSONResponse(b.response(status, [_message(b.item_id, status, [_text_part(c.text, b.logprobs(c))])],
                                   _usage(ctx, out)))


async def _stream(b: _Builder, stream: RequestStream, keep: Callable[[str], None]) -> AsyncIterator[str]:
    """OpenAI's event sequence for one text message: created, in_progress, the item and its part added, text
    deltas, then each closed in turn, and response.completed (or .incomplete, .failed)."""
    seq = itertools.count()

    def event(kind: str, **fields: Any) -> str:
        data = {"type": kind, **fields, "sequence_number": next(seq)}
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    where = {"item_id": b.item_id, "output_index": 0, "content_index": 0}
    yield event("response.created", response=b.response("in_progress", []))
    yield event("response.in_progress", response=b.response("in_progress", []))
    try:
        yield event("response.output_item.added", output_index=0, item=_message(b.item_id, "in_progress", []))
        yield event("response.content_part.added", **where, part=_text_part(""))
        chars = toks = 0
        last: Optional[RequestOutput] = None
        async for out in stream:
            last, c = checked(out), out.outputs[0]
            # text held back (a partial character, a possible stop string) waits for the next output
            if len(c.text) > chars or (b.req.num_logprobs is not None and len(c.token_ids) > toks):
                yield event("response.output_text.delta", **where, delta=c.text[chars:], logprobs=b.logprobs(c, toks))
                chars, toks = len(c.text), len(c.token_ids)
        assert last is not None
        c = last.outputs[0]
        status, lps = b.status(c), b.logprobs(c)
        part = _text_part(c.text, lps)
        item = _message(b.item_id, status, [part])
        yield event("response.output_text.done", **where, text=c.text, logprobs=lps)
        yield event("response.content_part.done", **where, part=part)
        yield event("response.output_item.done", output_index=0, item=item)
        keep(c.text)
        yield event(f"response.{status}", response=b.response(status, [item], _usage(b.ctx, last)))
    except Exception as e:
        # the status line is sent already: the failure goes as the terminal event, as OpenAI sends it
        err = unavailable(e) if isinstance(e, EngineDeadError) else e
        msg = err.message if isinstance(err, ApiError) else f"{type(e).__name__}: {e}"
        yield event("response.failed", response=b.response("failed", [], error={"code": "server_error",
                                                                                 "message": msg}))
    finally:
        stream.abort()
