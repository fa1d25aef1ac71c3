"""POST /v1/embeddings: one pooling request per input; the engine pools the prompt's final-norm hidden states
(its pooling_type: LAST token or MEAN) and L2-normalises them, as vLLM does for a decoder served as an embedder."""
from __future__ import annotations

import base64
from typing import Literal, Optional, Union

import torch
from pydantic import Field, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenmill.engine.async_engine import RequestStream
from tokenmill.lora.request import LoRARequest
from tokenmill.pooling_params import PoolingParams
from tokenmill.server.common import ServerContext, final_outputs, new_id, now, submit
from tokenmill.server.protocol import ApiError, Bool, CacheSalt, Int, _Request, prompt_schema

MAX_INPUTS = 2048        # OpenAI's cap on the items of one request


class EmbeddingRequest(_Request):
    input: Union[str, list[str], list[Int], list[list[Int]]] = Field(json_schema_extra=prompt_schema(MAX_INPUTS))
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[Int] = Field(default=None, ge=1)
    user: Optional[str] = None                  # accepted and ignored (IGNORED in protocol.py)
    normalize: Optional[Bool] = None            # vLLM's extra: False returns the raw pooled vector
    cache_salt: CacheSalt = None

    @field_validator("input", mode="before")
    @classmethod
    def _one_of_the_four_shapes(cls, x: object) -> object:
        # checked here so that a mixed list gets one message, not one per branch of the union
        def ids(v: object) -> bool:
            return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)
        if not (isinstance(x, str) or ids(x) or (isinstance(x, list) and (all(isinstance(v, str) for v in x)
                                                                         or all(ids(v) for v in x)))):
            raise ValueError("must be a string, a list of strings, a list of token ids or a list of lists of token "
                             "ids")
        return x

    def inputs(self) -> list[Union[str, list[int]]]:
        x = self.input
        items = [x] if isinstance(x, str) or (x and isinstance(x[0], int)) else list(x)
        if not items:
            raise ApiError(400, "input is empty; give a string, a list of strings, a list of token ids or a list of "
                                "lists of token ids", "input")
        if len(items) > MAX_INPUTS:
            raise ApiError(400, f"input has {len(items)} items; at most {MAX_INPUTS} go in one request, send the "
                                f"rest in another", "input")
        for i, p in enumerate(items):
            if len(p) == 0:
                where = "input" if len(items) == 1 else f"input[{i}]"
                raise ApiError(400, f"{where} is empty; every input needs at least one token", "input")
        return items  # type: ignore[return-value]


def encode(v: torch.Tensor, encoding_format: str) -> Union[list[float], str]:
    if encoding_format == "float":
        return v.tolist()
    # base64 of little-endian float32 bytes: what OpenAI sends and its client decodes
    return base64.b64encode(v.numpy().astype("<f4").tobytes()).decode("ascii")


async def _submit_inputs(ctx: ServerContext, inputs: list, params: PoolingParams, rid: str,
                         lora: Optional[LoRARequest] = None) -> list[RequestStream]:
    """All or nothing, as submit_all; the engine's refusal (too long, a token outside the vocabulary) names the
    input it refused."""
    streams: list[RequestStream] = []
    try:
        for i, p in enumerate(inputs):
            try:
                streams.append(await submit(ctx, p, params, f"{rid}-{i}", lora))  # type: ignore[arg-type]
            except ApiError as e:
                if e.status != 400:
                    raise
                where = "input" if len(inputs) == 1 else f"input[{i}]"
                raise ApiError(400, f"{where}: {e.message}", "input") from None
    except BaseException:
        for s in streams:
            s.abort()
        raise
    return streams


async def create_embedding(ctx: ServerContext, req: EmbeddingRequest, request: Request) -> Response:
    lora = ctx.check_model(req.model)
    hidden = ctx.llm.engine.model_config.hidden_size
    if req.dimensions is not None and req.dimensions != hidden:
        raise ApiError(400, f"dimensions={req.dimensions}: this model's embeddings have {hidden} dimensions and it "
                            f"is not trained for shorter ones (matryoshka); leave dimensions out or set it to {hidden}",
                       "dimensions")
    params = PoolingParams(normalize=True if req.normalize is None else req.normalize)
    rid = new_id("embd")
    streams = await _submit_inputs(ctx, [ctx.prompt(p, req.cache_salt) for p in req.inputs()], params, rid, lora)
    finals = await final_outputs(streams, request)
    data = [{"object": "embedding", "index": i, "embedding": encode(o.outputs.data, req.encoding_format)}
            for i, o in enumerate(finals)]
    n = sum(len(o.prompt_token_ids) for o in finals)
    return JSONResponse({"id": rid, "object": "list", "created": now(), "model": ctx.answer_name(req.model), "data": data,
                         "usage": {"prompt_tokens": n, "total_tokens": n}})
