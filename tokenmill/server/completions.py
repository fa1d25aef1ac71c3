"""POST /v1/completions: one engine request per prompt (n samples each); choice index = prompt * n + sample."""
from __future__ import annotations

from typing import Any, AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import Logprob, RequestOutput
from tokenmill.server.common import (DONE, ServerContext, SSEResponse, clamp, final_outputs, merged, new_id, now,
                                     sse, stream_error, submit_all, transfer_params, usage)
from tokenmill.server.protocol import ApiError, CompletionRequest


def legacy_logprobs(ctx: ServerContext, ids: list[int], lps: list[Optional[dict[int, Logprob]]],
                    offset: int) -> dict[str, Any]:
    """OpenAI's legacy completions logprobs; top_logprobs holds the top-k plus the sampled token (k+1 at most)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, d in zip(ids, lps):
        s = ctx.token_text(tid)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if d is None:          # the first prompt token has no logprob
            token_lps.append(None)
            tops.append(None)
            continue
        lp = d.get(tid)
        token_lps.append(None if lp is None else clamp(lp.logprob))
        ranked = sorted(d.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
        tops.append({ctx.token_text(t): clamp(v.logprob) for t, v in ranked})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _prompt_text(ctx: ServerContext, out: RequestOutput) -> str:
    if out.prompt is not None:
        return out.prompt
    return "" if ctx.tokenizer is None else ctx.tokenizer.decode(out.prompt_token_ids)


def _echo_logprobs(ctx: ServerContext, out: RequestOutput) -> dict[str, Any]:
    lps = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    return legacy_logprobs(ctx, out.prompt_token_ids, lps, 0)


def _concat(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {k: a[k] + b[k] for k in a}


def _check(ctx: ServerContext, req: CompletionRequest) -> Optional[LoRARequest]:
    lora = ctx.check_model(req.model)
    if req.suffix:
        raise ApiError(400, "suffix (insertion) is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.num_choices:
        raise ApiError(400, "best_of must be left out or equal n (tokenmill returns n independent samples)",
                       "best_of")
    return lora


async def create_completion(ctx: ServerContext, req: CompletionRequest, request: Request) -> Response:
    lora = _check(ctx, req)
    prompt_lps = req.logprobs if req.echo and req.logprobs is not None else None
    params = req.to_sampling_params(16 if req.max_tokens is None else req.max_tokens, req.logprobs, prompt_lps)
    prompts = req.prompts()
    if len(prompts) > ctx.max_prompts_per_request:
        raise ApiError(400, f"prompt holds {len(prompts)} prompts; at most {ctx.max_prompts_per_request} go in one "
                            f"request (--max-prompts-per-request): send the rest in another", "prompt")
    inputs = [ctx.prompt(p, req.cache_salt) for p in prompts]
    for i, p in enumerate(inputs):
        ctx.check_length(len(p["prompt_token_ids"]), params.max_tokens, "max_tokens", "prompt",
                         "the prompt" if len(inputs) == 1 else f"prompt {i}")
    rid = new_id("cmpl")
    streams = await submit_all(ctx, inputs, params, rid, lora)
    if req.stream:
        return SSEResponse(_stream(ctx, req, rid, streams), streams)
    finals = await final_outputs(streams, request)
    choices, n_prompt, n_out = [], 0, 0
    for i, out in enumerate(finals):
        n_prompt += len(out.prompt_token_ids)
        for c in out.outputs:
            n_out += len(c.token_ids)
            prompt_text = _prompt_text(ctx, out) if req.echo else ""
            lps = None
            if req.logprobs is not None:
                lps = legacy_logprobs(ctx, c.token_ids, c.logprobs or [], len(prompt_text))
                if req.echo:
                    lps = _concat(_echo_logprobs(ctx, out), lps)
            choice = {"index": i * req.num_choices + c.index, "text": prompt_text + c.text, "logprobs": lps,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if req.return_token_ids:
                choice.update(prompt_token_ids=out.prompt_token_ids, token_ids=c.token_ids)
            choices.append(choice)
    cached = sum(o.num_cached_tokens for o in finals)
    return JSONResponse({"id": rid, "object": "text_completion", "created": now(), "model": ctx.answer_name(req.model),
                         "choices": choices, "usage": usage(n_prompt, n_out, ctx.cached(cached)),
                         **await transfer_params(finals)})


async def _stream(ctx: ServerContext, req: CompletionRequest, rid: str, streams: list) -> AsyncIterator[str]:
    created = now()
    sent: dict[int, tuple[int, int]] = {}     # choice index -> (characters, tokens) sent
    done: set[int] = set()
    echo_len: dict[int, int] = {}             # choice index -> characters of echoed prompt (offsets start after)
    last: dict[int, RequestOutput] = {}

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        return sse({"id": rid, "object": "text_completion", "created": created, "model": ctx.answer_name(req.model),
                    "choices": choices, **extra})

    try:
        async for i, out in merged(streams):
            last[i] = out
            for c in out.outputs:
                idx = i * req.num_choices + c.index
                if idx in done:
                    continue
                first = idx not in sent
                chars, toks = sent.get(idx, (0, 0))
                text, new_ids = c.text[chars:], c.token_ids[toks:]
                if req.echo and first:
                    echo_len[idx] = len(prompt_text := _prompt_text(ctx, out))
                    text = prompt_text + text
                lps = None
                if req.logprobs is not None and (new_ids or (req.echo and first)):
                    lps = legacy_logprobs(ctx, new_ids, (c.logprobs or [])[toks:], echo_len.get(idx, 0) + chars)
                    if req.echo and first:
                        lps = _concat(_echo_logprobs(ctx, out), lps)
                if not text and lps is None and c.finish_reason is None and not (req.return_token_ids and new_ids):
                    continue
                sent[idx] = (len(c.text), len(c.token_ids))
                if c.finish_reason is not None:
                    done.add(idx)
                choice = {"index": idx, "text": text, "logprobs": lps, "finish_reason": c.finish_reason,
                          "stop_reason": c.stop_reason}
                if req.return_token_ids:
                    choice["token_ids"] = new_ids
                yield chunk([choice])
        if req.include_usage:
            n_prompt = sum(len(o.prompt_token_ids) for o in last.values())
            n_out = sum(len(c.token_ids) for o in last.values() for c in o.outputs)
            cached = sum(o.num_cached_tokens for o in last.values())
            yield chunk([], usage=usage(n_prompt, n_out, ctx.cached(cached)))
        yield DONE
    except Exception as e:
        yield stream_error(e)
