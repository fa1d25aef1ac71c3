"""POST /v1/chat/completions: messages (and tools) rendered with the model's chat template, then one engine request;
each choice's text read back as an assistant message: thinking, tool calls and content."""
from __future__ import annotations

import uuid
from typing import Any, AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenmill.engine.async_engine import RequestStream
from tokenmill.outputs import Logprob
from tokenmill import harmony
from tokenmill.reasoning import ReasoningParser, get_reasoning_parser
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.common import (DONE, ServerContext, SSEResponse, checked, clamp, final_outputs, new_id, now,
                                     sse, stream_error, submit, top_by_rank, transfer_params, usage)
from tokenmill.server.protocol import ApiError, ChatCompletionRequest, ChatMessage
from tokenmill.server.tools import ToolPlan, hermes_messages, plan_tools, supports_tools
from tokenmill.tokenizer import apply_chat_template
from tokenmill.tool_parsers import ToolCall, ToolParser, calls_of, content_of, get_tool_parser, parser_for_template


def render_messages(ctx: ServerContext, messages: list[ChatMessage], add_generation_prompt: bool,
                    tools: Optional[list[dict[str, Any]]] = None) -> list[int]:
    """The prompt's token ids. A template that renders tools gets them (and tool messages) as they are; for one that
    does not, they are written into the messages in Hermes' convention (tools.hermes_messages)."""
    if ctx.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer and so no chat template; use /v1/completions with "
                            "token ids", "messages")
    dicts = [m.as_template_dict() for m in messages]
    uses_tools = bool(tools) or any(d["role"] == "tool" or "tool_calls" in d for d in dicts)
    if uses_tools and not supports_tools(ctx.tokenizer.chat_template):
        dicts, tools = hermes_messages(dicts, tools or []), None
    try:
        return apply_chat_template(ctx.tokenizer, dicts, add_generation_prompt, tools=tools)
    except Exception as e:      # jinja2 errors too: templates raise on e.g. roles that do not alternate
        raise ApiError(400, f"the chat template could not render these messages: {e}", "messages")


def tool_parser(ctx: ServerContext) -> ToolParser:
    """--tool-call-parser, else the one the model's template asks for (hermes for the default tool prompt)."""
    template = getattr(ctx.tokenizer, "chat_template", None)
    if ctx.tool_call_parser is not None:
        return get_tool_parser(ctx.tool_call_parser)
    return get_tool_parser(parser_for_template(template) if supports_tools(template) else "hermes")


def chat_logprobs(ctx: ServerContext, ids: list[int], lps: list[dict[int, Logprob]], k: int) -> dict[str, Any]:
    def entry(tid: int, lp: float) -> dict[str, Any]:
        s = ctx.token_text(tid)
        return {"token": s, "logprob": clamp(lp), "bytes": list(s.encode("utf-8"))}

    content = []
    for tid, d in zip(ids, lps):
        own = d.get(tid)
        e = entry(tid, own.logprob if own is not None else float("-inf"))
        e["top_logprobs"] = [entry(t, v.logprob) for t, v in top_by_rank(d, k) if v.rank is None or v.rank <= k]
        content.append(e)
    return {"content": content}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChoiceParser:
    """One choice's text as an assistant message: thinking (the reasoning parser), tool calls (the tool plan) and
    content. message() reads a whole text; deltas() a growing one, as OpenAI streams it, sending each part once."""

    def __init__(self, reasoning: Optional[type[ReasoningParser]], plan: ToolPlan):
        self.reasoning, self.plan = reasoning, plan
        self.reasoning_sent = 0
        self.pieces_sent, self.chars_sent = 0, 0       # whole pieces sent; chars of the next (content) piece sent
        self.calls_sent = 0
        self.named_header_sent = False
        # a harmony reply's text outside its messages is logged once, when the reply is whole
        self.harmony = (reasoning is not None and reasoning.name == "openai_gptoss") or \
            (plan.parser is not None and plan.parser.name == "openai")

    def _split(self, text: str, final: bool) -> tuple[Optional[str], str]:
        return (None, text) if self.reasoning is None else self.reasoning.split(text, final)

    @property
    def called(self) -> bool:
        return self.calls_sent > 0

    def _finished(self, text: str) -> None:
        if self.harmony:
            harmony.log_unread(text)

    def message(self, text: str) -> dict[str, Any]:
        self._finished(text)
        reasoning, content = self._split(text, True)
        calls: list[ToolCall] = []
        if self.plan.named is not None:
            calls, content = [ToolCall(self.plan.named, content)], ""
        elif self.plan.parser is not None:
            pieces = self.plan.parser.parse(content, True)
            calls, content = calls_of(pieces), content_of(pieces)
        msg: dict[str, Any] = {"role": "assistant",
                               "content": None if content == "" and (calls or reasoning is not None) else content}
        if self.reasoning is not None:
            msg["reasoning_content"] = reasoning or None
        if calls:
            msg["tool_calls"] = [_call(c, new_call_id()) for c in calls]
            self.calls_sent = len(calls)
        return msg

    def deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        """The deltas that text (the choice's text so far) adds to what was sent."""
        if final:
            self._finished(text)
        reasoning, content = self._split(text, final)
        out: list[dict[str, Any]] = []
        if reasoning and len(reasoning) > self.reasoning_sent:
            out.append({"reasoning_content": reasoning[self.reasoning_sent:]})
            self.reasoning_sent = len(reasoning)
        if self.plan.named is not None:
            return out + self._named_deltas(content, final)
        if self.plan.parser is None:
            new, self.chars_sent = content[self.chars_sent:], len(content)
            return out + ([{"content": new}] if new else [])
        pieces = self.plan.parser.parse(content, final)
        while self.pieces_sent < len(pieces):
            p = pieces[self.pieces_sent]
            if isinstance(p, ToolCall):
                out += self._call_deltas(p)
            else:
                if len(p) > self.chars_sent:
                    out.append({"content": p[self.chars_sent:]})
                if self.pieces_sent == len(pieces) - 1 and not final:
                    self.chars_sent = len(p)       # the last content piece may still grow
                    break
            self.pieces_sent, self.chars_sent = self.pieces_sent + 1, 0
        return out

    def _call_deltas(self, call: ToolCall) -> list[dict[str, Any]]:
        i, self.calls_sent = self.calls_sent, self.calls_sent + 1
        return [{"tool_calls": [{"index": i, **_call(ToolCall(call.name, ""), new_call_id())}]},
                {"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]}]

    def _named_deltas(self, content: str, final: bool) -> list[dict[str, Any]]:
        """The named function's arguments stream as the model writes them."""
        out = []
        if not self.named_header_sent and (content or final):
            self.named_header_sent, self.calls_sent = True, 1
            out.append({"tool_calls": [{"index": 0, **_call(ToolCall(self.plan.named or "", ""), new_call_id())}]})
        if len(content) > self.chars_sent:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": content[self.chars_sent:]}}]})
            self.chars_sent = len(content)
        return out


def _call(call: ToolCall, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def finish_reason(reason: Optional[str], parser: ChoiceParser) -> Optional[str]:
    # a reply that ended by itself with calls in it asks for tool results; one cut short stays "length"
    return "tool_calls" if reason == "stop" and parser.called else reason


def _keep_tags(ctx: ServerContext, params: SamplingParams, plan: ToolPlan,
               reasoning: Optional[type[ReasoningParser]]) -> None:
    """Decode special tokens where this tokenizer makes a parser's tags special (they would vanish otherwise)."""
    tags = list(plan.parser.tags) if plan.parser is not None else []
    if reasoning is not None:
        tags += reasoning.tags()
    tok = ctx.tokenizer
    if any(tok.decode(tok.encode(t, add_special_tokens=False), skip_special_tokens=True) != t for t in tags):
        params.skip_special_tokens = False


def _params(ctx: ServerContext, req: ChatCompletionRequest, plan: ToolPlan, k: Optional[int],
            reasoning: Optional[type[ReasoningParser]]) -> SamplingParams:
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = req.to_sampling_params(max_tokens, k)
    if plan.constraint is not None:
        if params.structured_outputs is not None:
            raise ApiError(400, "tool_choice 'required' or a named function constrains the output to tool calls; "
                                "it cannot take response_format, structured_outputs or guided_* as well",
                           "tool_choice")
        params.structured_outputs = plan.constraint
    _keep_tags(ctx, params, plan, reasoning)
    return params


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest, request: Request) -> Response:
    lora = ctx.check_model(req.model)
    if req.top_logprobs and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    plan = plan_tools(req, tool_parser(ctx))
    reasoning = get_reasoning_parser(ctx.reasoning_parser) if ctx.reasoning_parser else None
    ids = render_messages(ctx, req.messages, req.add_generation_prompt is not False, plan.render)
    k = (req.top_logprobs or 0) if req.logprobs else None
    params = _params(ctx, req, plan, k, reasoning)
    length_field = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
    ctx.check_length(len(ids), params.max_tokens, length_field, "messages", "the messages")
    rid = new_id("chatcmpl")
    stream = await submit(ctx, ctx.prompt(ids, req.cache_salt), params, rid, lora)
    if req.stream:
        parsers = [ChoiceParser(reasoning, plan) for _ in range(req.num_choices)]
        return SSEResponse(_stream(ctx, req, rid, stream, k, parsers), [stream])
    [out] = await final_outputs([stream], request)
    choices = []
    for c in out.outputs:
        parser = ChoiceParser(reasoning, plan)
        choices.append({"index": c.index, "message": parser.message(c.text),
                        "logprobs": None if k is None else chat_logprobs(ctx, c.token_ids, c.logprobs or [], k),
                        "finish_reason": finish_reason(c.finish_reason, parser), "stop_reason": c.stop_reason,
                        **({"token_ids": c.token_ids} if req.return_token_ids else {})})
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": now(), "model": ctx.answer_name(req.model), "choices": choices,
        "usage": usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs),
                       ctx.cached(out.num_cached_tokens)), **await transfer_params([out])})


async def _stream(ctx: ServerContext, req: ChatCompletionRequest, rid: str, stream: RequestStream,
                  k: Optional[int], parsers: list[ChoiceParser]) -> AsyncIterator[str]:
    """The role first, then reasoning / content / tool-call deltas, then a chunk with finish_reason (per choice),
    then usage."""
    created = now()

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": ctx.answer_name(req.model),
                    "choices": choices, **extra})

    def choice(i: int, delta: dict[str, Any], lps: Any = None, finish: Optional[str] = None,
               **extra: Any) -> dict[str, Any]:
        return {"index": i, "delta": delta, "logprobs": lps, "finish_reason": finish, **extra}

    toks_sent: dict[int, int] = {}
    done: set[int] = set()
    try:
        for i in range(req.num_choices):
            yield chunk([choice(i, {"role": "assistant", "content": ""})])
        last = None
        async for out in stream:
            last = checked(out)
            for c in out.outputs:
                if c.index in done:
                    continue
                toks = toks_sent.get(c.index, 0)
                new_ids = c.token_ids[toks:]
                toks_sent[c.index] = len(c.token_ids)
                lps = chat_logprobs(ctx, new_ids, (c.logprobs or [])[toks:], k) if k is not None and new_ids \
                    else None
                extra = {"token_ids": new_ids} if req.return_token_ids else {}
                parser = parsers[c.index]
                deltas = parser.deltas(c.text, c.finish_reason is not None)
                if not deltas and (lps is not None or (req.return_token_ids and new_ids)):
                    deltas = [{"content": ""}]      # tokens whose text is held back still send their logprobs
                for j, delta in enumerate(deltas):
                    yield chunk([choice(c.index, delta, lps if j == 0 else None, **(extra if j == 0 else {}))])
                if c.finish_reason is not None:
                    done.add(c.index)
                    yield chunk([choice(c.index, {}, None, finish_reason(c.finish_reason, parser),
                                        stop_reason=c.stop_reason)])
        if req.include_usage and last is not None:
            yield chunk([], usage=usage(len(last.prompt_token_ids), sum(len(c.token_ids) for c in last.outputs),
                                        ctx.cached(last.num_cached_tokens)))
        yield DONE
    except Exception as e:
        yield stream_error(e)
    finally:
        stream.abort()
