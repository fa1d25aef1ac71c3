"""POST /v1/chat/completions: messages rendered with the model's chat template, then one engine request."""
from __future__ import annotations

from typing import Any, AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenmill.engine.async_engine import RequestStream
from tokenmill.outputs import Logprob
from tokenmill.server.common import (DONE, ServerContext, SSEResponse, clamp, final_outputs, new_id, now, sse,
                                     stream_error, submit, top_by_rank, usage)
from tokenmill.server.protocol import ApiError, ChatCompletionRequest, ChatMessage
from tokenmill.tokenizer import apply_chat_template


def render_messages(ctx: ServerContext, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
    if ctx.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer and so no chat template; use /v1/completions with "
                            "token ids", "messages")
    try:
        return apply_chat_template(ctx.tokenizer, [m.as_template_dict() for m in messages], add_generation_prompt)
    except Exception as e:      # jinja2 errors too: templates raise on e.g. roles that do not alternate
        raise ApiError(400, f"the chat template could not render these messages: {e}", "messages")


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


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest, request: Request) -> Response:
    ctx.check_model(req.model)
    if req.top_logprobs and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    ids = render_messages(ctx, req.messages, req.add_generation_prompt is not False)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    k = (req.top_logprobs or 0) if req.logprobs else None
    params = req.to_sampling_params(max_tokens, k)
    rid = new_id("chatcmpl")
    stream = await submit(ctx, {"prompt_token_ids": ids}, params, rid)
    if req.stream:
        return SSEResponse(_stream(ctx, req, rid, stream, k), [stream])
    [out] = await final_outputs([stream], request)
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": None if k is None else chat_logprobs(ctx, c.token_ids, c.logprobs or [], k),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                **({"token_ids": c.token_ids} if req.return_token_ids else {})} for c in out.outputs]
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": now(), "model": ctx.model_name, "choices": choices,
        "usage": usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs),
                       out.num_cached_tokens)})


async def _stream(ctx: ServerContext, req: ChatCompletionRequest, rid: str, stream: RequestStream,
                  k: Optional[int]) -> AsyncIterator[str]:
    """The role first, then content deltas, then a chunk with finish_reason (per choice), then usage."""
    created = now()

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name,
                    "choices": choices, **extra})

    def choice(i: int, delta: dict[str, Any], lps: Any = None, finish: Optional[str] = None,
               **extra: Any) -> dict[str, Any]:
        return {"index": i, "delta": delta, "logprobs": lps, "finish_reason": finish, **extra}

    sent: dict[int, tuple[int, int]] = {}
    done: set[int] = set()
    try:
        for i in range(req.num_choices):
            yield chunk([choice(i, {"role": "assistant", "content": ""})])
        last = None
        async for out in stream:
            last = out
            for c in out.outputs:
                if c.index in done:
                    continue
                chars, toks = sent.get(c.index, (0, 0))
                text, new_ids = c.text[chars:], c.token_ids[toks:]
                lps = chat_logprobs(ctx, new_ids, (c.logprobs or [])[toks:], k) if k is not None and new_ids \
                    else None
                if text or lps is not None or (req.return_token_ids and new_ids):
                    sent[c.index] = (len(c.text), len(c.token_ids))
                    extra = {"token_ids": new_ids} if req.return_token_ids else {}
                    yield chunk([choice(c.index, {"content": text}, lps, **extra)])
                if c.finish_reason is not None:
                    done.add(c.index)
                    yield chunk([choice(c.index, {}, None, c.finish_reason, stop_reason=c.stop_reason)])
        if req.include_usage and last is not None:
            yield chunk([], usage=usage(len(last.prompt_token_ids), sum(len(c.token_ids) for c in last.outputs),
                                        last.num_cached_tokens))
        yield DONE
    except Exception as e:
        yield stream_error(e)
    finally:
        stream.abort()
