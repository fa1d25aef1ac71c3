"""What the completions and chat handlers share: the server context, submitting to the AsyncLLM with errors
mapped to HTTP statuses, waiting for results while watching for a client that goes away, SSE and logprobs."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Union

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenmill.engine.async_engine import AsyncLLM, DrainingError, EngineDeadError, QueueFullError, RequestStream
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import Logprob, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.protocol import ApiError, constraint_error, invalid_params

DONE = "data: [DONE]\n\n"


MAX_PROMPTS = 128        # like OpenAI's cap on n: one request cannot queue the whole engine's work


@dataclass
class ServerContext:
    llm: AsyncLLM
    model_name: str
    max_model_len: int
    tool_call_parser: Optional[str] = None    # --tool-call-parser; None: the one the chat template's syntax asks for
    reasoning_parser: Optional[str] = None    # --reasoning-parser: thinking goes to reasoning_content
    max_prompts_per_request: int = MAX_PROMPTS
    # usage.prompt_tokens_details.cached_tokens (docs/serving.md: what it reveals)
    report_cached_tokens: bool = True
    # LoRA adapters served under their own names (--lora-modules, /v1/load_lora_adapter), beside the base model
    loras: dict[str, LoRARequest] = field(default_factory=dict)
    _token_text: dict[int, str] = field(default_factory=dict)

    @property
    def tokenizer(self) -> Any:
        return self.llm.tokenizer

    @property
    def served_names(self) -> list[str]:
        return [self.model_name, *self.loras]

    def check_model(self, name: Optional[str]) -> Optional[LoRARequest]:
        """The request's model: the base (None) or a LoRA adapter; a name served by no one is a 404 listing the
        served names."""
        if name is None or name == self.model_name:
            return None
        lora = self.loras.get(name)
        if lora is None:
            served = ", ".join(map(repr, self.served_names))
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {served}", "model",
                           "model_not_found")
        return lora

    def answer_name(self, name: Optional[str]) -> str:
        """The model a reply names: the adapter the request asked for (checked on arrival), else the base."""
        return name if name else self.model_name

    def prompt(self, prompt: Union[str, list[int]], cache_salt: Optional[str]) -> dict[str, Any]:
        """The engine's prompt dict, tokenized here so that its length can be checked against the context before
        it is queued. The salt keeps its prefix-cache blocks apart from requests with another salt or none."""
        if isinstance(prompt, str):
            if prompt == "":
                raise ApiError(400, "the prompt is empty; give at least one token of text", "prompt")
            if self.tokenizer is None:
                raise ApiError(400, "this model has no tokenizer; send the prompt as token ids", "prompt")
            d: dict[str, Any] = {"prompt": prompt, "prompt_token_ids": list(self.tokenizer.encode(prompt))}
        else:
            d = {"prompt_token_ids": prompt}
        if cache_salt is not None:
            d["cache_salt"] = cache_salt
        return d

    def check_length(self, n_prompt: int, max_tokens: Optional[int], length_field: str, prompt_field: str,
                     what: str) -> None:
        """OpenAI's and vLLM's rule: the prompt and the tokens asked for must fit the context, else a 400 that
        states the numbers (rather than a completion cut to what is left). what: the prompt, as the message says."""
        limit = self.max_model_len
        context = f"this model's context length (max_model_len) is {limit} tokens"
        if n_prompt >= limit:
            raise ApiError(400, f"{context} and {what} takes {n_prompt}, which leaves no room for a completion; "
                                f"shorten {what}", prompt_field, "context_length_exceeded")
        if max_tokens is not None and n_prompt + max_tokens > limit:
            raise ApiError(400, f"{context}, but {n_prompt + max_tokens} were asked for: {n_prompt} in {what} and "
                                f"{max_tokens} in {length_field}; lower {length_field} to at most {limit - n_prompt} "
                                f"or shorten {what}", length_field, "context_length_exceeded")

    def cached(self, n: int) -> int:
        return n if self.report_cached_tokens else 0

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs (special tokens included, as the model produced them)."""
        s = self._token_text.get(token_id)
        if s is None:
            tok = self.tokenizer
            s = f"token_id:{token_id}" if tok is None else tok.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = s
        return s


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def unavailable(e: EngineDeadError) -> ApiError:
    return ApiError(503, str(e), code="engine_unavailable", type="service_unavailable")


async def submit(ctx: ServerContext, prompt: Union[str, list[int], dict], params: SamplingParams,
                 request_id: str, lora: Optional[LoRARequest] = None) -> RequestStream:
    try:
        if lora is None:
            return await ctx.llm.add_request(prompt, params, request_id)
        return await ctx.llm.add_request(prompt, params, request_id, lora_request=lora)
    except QueueFullError as e:
        raise ApiError(503, f"the server is busy: {e}", code="queue_full", type="service_unavailable")
    except DrainingError as e:      # it passed the middleware just before the drain began
        raise ApiError(503, str(e), code="shutting_down", type="service_unavailable")
    except EngineDeadError as e:
        raise unavailable(e)
    except (ValueError, TypeError) as e:
        # SamplingParams' token ids meet the vocabulary only here, at submission; name the field as the request does
        if str(e).startswith("SamplingParams."):
            raise invalid_params(e)
        if str(e).startswith("structured_outputs."):    # a schema, regex or grammar the engine cannot compile
            raise constraint_error(e, params)
        raise ApiError(400, str(e), "prompt" if "prompt" in str(e) else None)


async def submit_all(ctx: ServerContext, prompts: list[Any], params: SamplingParams,
                     base_id: str, lora: Optional[LoRARequest] = None) -> list[RequestStream]:
    """All or nothing: if one prompt is refused, the ones already queued are aborted."""
    streams: list[RequestStream] = []
    try:
        for i, p in enumerate(prompts):
            streams.append(await submit(ctx, p, params, base_id if len(prompts) == 1 else f"{base_id}-{i}", lora))
    except BaseException:
        for s in streams:
            s.abort()
        raise
    return streams


def checked(out: Any) -> Any:
    """out, unless a choice could not go on: its constraint allowed no token its bans left (seen only while
    generating, e.g. min_tokens past a choice's end). That is the request's contradiction, a 400 that says so,
    rather than a finish reason OpenAI's clients do not know."""
    for c in out.outputs if isinstance(out, RequestOutput) else ():
        if c.finish_reason == "abort":
            raise ApiError(400, f"the output could not go on after {len(c.token_ids)} tokens: "
                                f"{c.stop_reason or 'the constraint allowed no token the request leaves'}",
                           code="contradictory_constraints")
    return out


async def transfer_params(finals: list[RequestOutput]) -> dict[str, Any]:
    """A prefill instance's reply: vLLM's kv_transfer_params, once the prompt's KV is at the decode instance (what
    was sent, accepted and refused, or why it was not). Empty for every other reply."""
    kvp = next((o.kv_transfer_params for o in finals if o.kv_transfer_params), None)
    if kvp is None:
        return {}
    kvp = dict(kvp)
    kvp.update(await asyncio.wrap_future(kvp.pop("transfer")))
    return {"kv_transfer_params": kvp}


async def final_outputs(streams: list[RequestStream], request: Request) -> list[RequestOutput]:
    """Wait for every stream to finish. A client that disconnects meanwhile aborts them all (its KV blocks are
    freed at the next engine step) instead of letting them run to the end for nobody."""
    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        for s in streams:
            s.cancel()

    watcher = asyncio.create_task(watch())
    try:
        finals = []
        for s in streams:
            last: Optional[RequestOutput] = None
            async for out in s:
                last = checked(out)
            assert last is not None
            finals.append(last)
        return finals
    except EngineDeadError as e:
        raise unavailable(e)
    finally:
        watcher.cancel()
        for s in streams:
            s.abort()


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several streams (one per prompt) as (prompt index, output). Leaving early aborts them all."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                q.put_nowait((i, checked(out), None))
        except Exception as e:
            q.put_nowait((i, None, e))
        q.put_nowait((i, None, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        done = 0
        while done < len(streams):
            i, out, err = await q.get()
            if err is not None:
                raise err
            if out is None:
                done += 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


class SSEResponse(StreamingResponse):
    """Server-sent events that abort their engine requests however the response ends, even when the client
    leaves before the body generator ever started (its own finally would then never run)."""

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream]):
        super().__init__(content, media_type="text/event-stream")
        self.streams = streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self.streams:
                s.abort()


def stream_error(e: BaseException) -> str:
    """An error met after a stream has started: the status is sent already, so it goes as an SSE event
    (the openai client raises it as an APIError)."""
    if isinstance(e, EngineDeadError):
        e = unavailable(e)
    return sse((e if isinstance(e, ApiError) else ApiError(500, f"{type(e).__name__}: {e}")).body())


def clamp(lp: float) -> float:
    return max(lp, -9999.0)       # JSON has no -inf


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def top_by_rank(d: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    items = sorted(d.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30, -kv[1].logprob))
    return items[:k]
