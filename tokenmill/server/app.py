"""The FastAPI app: OpenAI-compatible endpoints over an AsyncLLM, plus tokenize, health, metrics and a playground.

build_app(engine_or_asyncllm) is all a caller needs; `tokenmill serve` (server/cli.py) runs it with uvicorn.
"""
from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import os
from contextlib import asynccontextmanager
from dataclasses import asdict
from typing import Any, AsyncIterator, Optional, Sequence, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import tokenmill
from tokenmill.engine.async_engine import AsyncLLM, ClientDisconnected, EngineDeadError
from tokenmill.engine.engine import LLMEngine
from tokenmill.lora.request import LoRARequest
from tokenmill.reasoning import get_reasoning_parser
from tokenmill.server.bodies import explain_unparsable
from tokenmill.server.chat import create_chat_completion, render_messages
from tokenmill.server.common import MAX_PROMPTS, ServerContext, now, unavailable
from tokenmill.server.completions import create_completion
from tokenmill.server.embeddings import EmbeddingRequest, create_embedding
from tokenmill.server.messages import MessagesRequest, create_message
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.protocol import (IGNORED_FIELDS, IGNORED_FIELDS_HEADER, ApiError, ChatCompletionRequest,
                                       CompletionRequest, DetokenizeRequest, KVConnectRequest, LoadLoRAAdapterRequest,
                                       TokenizeRequest, UnloadLoRAAdapterRequest)
from tokenmill.server.responses import ResponsesRequest, ResponseStore, create_response
from tokenmill.server.schemas import (AnthropicError, AnthropicMessage, ChatCompletionChunk, ChatCompletionResponse,
                                      CompletionChunk, CompletionResponse, DetokenizeResponse, EmbeddingResponse,
                                      Health, ModelCard, ModelList, ResponseObject, ResponseStreamEvent,
                                      TokenizeResponse, Version, anthropic_stream_or, document, errors, stream_or)
from tokenmill.tokenizer import check_chat_template
from tokenmill.tool_parsers import get_tool_parser

log = logging.getLogger("tokenmill.server")
STATIC = os.path.join(os.path.dirname(__file__), "static")
DEFAULT_MAX_BODY_BYTES = 4 * 2 ** 20
_PROTECTED = ("/v1/", "/tokenize", "/detokenize", "/shutdown")  # the rest (health, metrics, playground) stays open
# answered while the server drains: /health says 503 itself, so a load balancer takes the instance out
_OPEN_WHILE_DRAINING = ("/health", "/metrics", "/stats", "/version")


def default_model_name(model_path: str) -> str:
    """The name clients send: a hub model's org/name, else the folder's or file's name."""
    from tokenmill.executor.loader.hub import hub_name_of
    hub = hub_name_of(model_path)
    if hub is not None:
        return hub
    name = os.path.basename(os.path.normpath(model_path))
    return name[:-5] if name.endswith(".gguf") else name


# pydantic's strict type errors, said as JSON types (a string "false" is not a boolean)
_TYPE_NAMES = {"bool_type": "a JSON boolean (true or false)", "int_type": "an integer",
               "float_type": "a number", "string_type": "a string", "list_type": "an array",
               "dict_type": "an object", "model_type": "an object", "model_attributes_type": "an object"}


_BRANCH_TAGS = ("str", "int", "float", "bool", "dict", "list", "none")


def _json_type(value: Any) -> str:
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)
    return f"{kind} ({json.dumps(value)[:40]})" if isinstance(value, (bool, int, float, str)) else kind


# Anthropic's error types by status, for the Messages API's errors
_ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                     404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def _error_response(e: ApiError, headers: Optional[dict[str, str]] = None, path: str = "") -> JSONResponse:
    """The error in OpenAI's shape, or in Anthropic's on the Messages API."""
    if path.startswith("/v1/messages"):
        body = {"type": "error", "error": {"type": _ANTHROPIC_ERRORS.get(e.status, "api_error"),
                                           "message": e.message}}
        return JSONResponse(body, status_code=e.status, headers=headers)
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


class GuardMiddleware:
    """Draining, API key and body-size checks before any parsing, so they answer first and cheaply (pure ASGI: it
    can refuse a body by its length without reading it, and bound chunked bodies while reading)."""

    def __init__(self, app: ASGIApp, api_key: Optional[str], max_body_bytes: int, llm: Any = None):
        self.app, self.api_key, self.max_body_bytes, self.llm = app, api_key, max_body_bytes, llm

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.llm is not None and self.llm.draining and scope["path"] not in _OPEN_WHILE_DRAINING:
            err = ApiError(503, "the server is shutting down: it finishes the requests in flight and takes no new "
                                "ones; retry (another instance can take it)", code="shutting_down",
                           type="service_unavailable")
            # Retry-After: behind a load balancer another instance can take the request at once
            return await _error_response(err, {"Retry-After": "1", "Connection": "close"},
                                         scope["path"])(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key and scope["path"].startswith(_PROTECTED):
            auths = [v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"]
            if scope["path"].startswith("/v1/messages"):      # Anthropic's clients send the key as x-api-key
                auths += [f"Bearer {v.decode('latin-1')}" for k, v in scope["headers"] if k == b"x-api-key"]
            if len(auths) > 1:      # proxies and frameworks differ on which one they read: refuse, do not guess
                why = f"the request has {len(auths)} Authorization headers; send exactly one"
            elif not auths or not auths[0]:
                why = "no API key given; send the header 'Authorization: Bearer <key>'"
            elif not hmac.compare_digest(auths[0].encode(), f"Bearer {self.api_key}".encode()):
                why = "the API key is wrong; send the header 'Authorization: Bearer <key>'"
            else:
                why = None
            if why is not None:
                # RFC 6750's challenge: error="invalid_token" only when a credential was sent
                challenge = 'Bearer error="invalid_token"' if any(auths) else "Bearer"
                err = ApiError(401, why, code="invalid_api_key")
                return await _error_response(err, {"WWW-Authenticate": challenge},
                                             scope["path"])(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_big = ApiError(413, f"the request body is larger than {self.max_body_bytes} bytes",
                           code="request_too_large")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await _error_response(too_big, path=scope["path"])(scope, receive, send)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return await _error_response(too_big, path=scope["path"])(scope, receive, send)
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()     # later calls: the disconnect watchers see http.disconnect

        ignored: list[str] = []
        IGNORED_FIELDS.set(ignored)       # the request models name their unknown fields here

        async def send_naming_ignored(message: Message) -> None:
            if message["type"] == "http.response.start" and ignored:
                # escaped to ASCII (a key may hold a newline) and bounded (a body may hold thousands of keys)
                # each name as a JSON string: ASCII, quoted (a key may be empty or hold spaces or a newline), and
                # at most 20 of them (a body may hold thousands)
                names = ", ".join(json.dumps(n) for n in ignored[:20])
                value = (names + (f", and {len(ignored) - 20} more" if len(ignored) > 20 else "")).encode()
                log.warning("%s %s: ignored the fields tokenmill does not know: %s", scope["method"], scope["path"],
                            value.decode("ascii"))
                message = {**message, "headers": [*message.get("headers", []), (IGNORED_FIELDS_HEADER.encode(),
                                                                                 value)]}
            await send(message)

        await self.app(scope, replay, send_naming_ignored)


def build_app(engine_or_llm: Union[LLMEngine, AsyncLLM], *, model_name: Optional[str] = None,
              api_key: Optional[str] = None, max_queue: Optional[int] = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, tool_call_parser: Optional[str] = None,
              reasoning_parser: Optional[str] = None, enable_shutdown_endpoint: bool = False,
              max_prompts_per_request: int = MAX_PROMPTS, report_cached_tokens: bool = True,
              chat_template: Optional[str] = None, lora_modules: Sequence[LoRARequest] = ()) -> FastAPI:
    """An app serving the engine. max_queue: 503 once that many requests wait; max_body_bytes: 413 above it.
    tool_call_parser: how chat replies' tool calls are read (default: from the chat template); reasoning_parser:
    thinking goes to reasoning_content (default: the engine's). Given an LLMEngine the app owns the AsyncLLM it
    wraps it in, and stops it at shutdown. enable_shutdown_endpoint: POST /shutdown drains the engine as SIGTERM
    does (llm.drain(): 503 to new requests); `tokenmill serve` then exits once the requests in flight are done.
    max_prompts_per_request: a completions request with more prompts is a 400; report_cached_tokens: False reports
    usage's cached_tokens as 0, so a client cannot learn what other clients sent. chat_template: a Jinja template in
    place of the tokenizer's (vLLM's --chat-template). lora_modules: adapters served under their names (loaded
    already, or at their first request), beside those loaded later through /v1/load_lora_adapter."""
    if max_prompts_per_request < 1:
        raise ValueError(f"max_prompts_per_request must be >= 1, got {max_prompts_per_request}")
    if tool_call_parser is not None:
        get_tool_parser(tool_call_parser)          # a clear ValueError at start for an unknown name
    if reasoning_parser is not None:
        get_reasoning_parser(reasoning_parser)
    owns = isinstance(engine_or_llm, LLMEngine)
    llm = AsyncLLM(engine_or_llm) if owns else engine_or_llm
    if max_queue is not None:
        llm.max_waiting = max_queue
    eng = llm.engine
    if chat_template is not None:
        if llm.tokenizer is None:
            raise ValueError("--chat-template needs a model with a tokenizer")
        check_chat_template(chat_template)
        llm.tokenizer.chat_template = chat_template
    so_config = getattr(getattr(eng, "structured_outputs", None), "config", None)
    ctx = ServerContext(llm, model_name or default_model_name(eng.config.model),
                        eng.config.scheduler_config.max_model_len, tool_call_parser=tool_call_parser,
                        reasoning_parser=reasoning_parser or getattr(so_config, "reasoning_parser", None),
                        max_prompts_per_request=max_prompts_per_request, report_cached_tokens=report_cached_tokens)
    for lora in lora_modules:
        if lora.lora_name == ctx.model_name:
            raise ValueError(f"the LoRA adapter {lora.lora_name!r} has the base model's served name; rename it")
        eng.add_lora(lora)       # read and checked at start: a bad adapter stops the server before it serves
        ctx.loras[lora.lora_name] = lora
    lora_ids = itertools.count(max((r.lora_int_id for r in lora_modules), default=0) + 1)
    lora_config = getattr(eng.config, "lora_config", None)
    metrics = ServerMetrics(ctx.model_name, eng.kv_cache_info(), lora_config.max_loras if lora_config else 0)
    llm.hooks.append(metrics.on_iteration)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if owns:
            llm.shutdown(wait=True)

    app = FastAPI(title="tokenmill", version=tokenmill.__version__, lifespan=lifespan)
    app.state.llm, app.state.ctx, app.state.metrics = llm, ctx, metrics
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes, llm=llm)
    document(app, api_key=bool(api_key), protected=_PROTECTED)

    # ---- errors in OpenAI's shape ----
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> Response:
        return _error_response(e, path=request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> Response:
        # a value error is one of ours (protocol.py's validators), more telling than the union branches that
        # also failed; a branch's tag ("list[ContentPart]") is not a field
        errs = e.errors()
        err = next((x for x in errs if x.get("type") == "value_error"), errs[0] if errs else {})
        # a union branch's tag ("str", "list[int]") is not a field; with one, the type named is only a branch's
        tags = [x for x in err.get("loc", ()) if "[" in str(x) or str(x) in _BRANCH_TAGS]
        loc = [str(x) for x in err.get("loc", ()) if x != "body" and x not in tags]
        if err.get("type") == "json_invalid":
            why, pos = err.get("ctx", {}).get("error", ""), err.get("loc", ())[-1:]
            at = f" at character {pos[0]}" if pos and isinstance(pos[0], int) else ""
            return _error_response(ApiError(400, f"the request body is not valid JSON: {why.removesuffix(' at')}{at}"),
                                   path=request.url.path)
        where = ".".join(loc)
        msg = err.get("msg", "invalid request").removeprefix("Value error, ")
        kind = err.get("type")
        if kind == "missing" and not where:
            route = request.scope.get("route")
            body = getattr(getattr(getattr(route, "body_field", None), "field_info", None), "annotation", None)
            need = [n for n, f in getattr(body, "model_fields", {}).items() if f.is_required()]
            msg = ("the request body is empty; send a JSON object" +
                   (f" with at least {', '.join(repr(n) for n in need)}" if need else ""))
        elif kind in _TYPE_NAMES and not tags:
            msg = f"{where or 'the body'} must be {_TYPE_NAMES[kind]}, not {_json_type(err.get('input'))}"
        elif where:
            msg = f"{where}: {msg}"
        return _error_response(ApiError(400, msg, where or None), path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> Response:
        # the router's own 404/405 name what was asked and what is served, so a client sees what to change
        what, msg, code = f"{request.method} {request.url.path}", str(e.detail), None
        if e.status_code == 400 and msg == "There was an error parsing the body":     # FastAPI's catch-all
            msg = explain_unparsable(await request.body()) or "the request body could not be read as JSON"
        elif e.status_code == 404 and not request.url.path.startswith("/static/"):
            served = ", ".join(f"{m} {r.path}" for r in app.routes if r.path.startswith("/v1/")
                               for m in sorted(getattr(r, "methods", ()) or ()) if m != "HEAD")
            msg, code = f"{what} is not implemented by this server; it serves {served}", "unknown_endpoint"
        elif e.status_code == 405:
            allowed = (e.headers or {}).get("Allow", "another method")
            msg, code = f"{what} is not allowed; {request.url.path} takes {allowed}", "method_not_allowed"
        return _error_response(ApiError(e.status_code, msg, code=code), e.headers, request.url.path)

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, e: ClientDisconnected) -> Response:
        return Response(status_code=499)    # nobody is listening any more

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> Response:
        log.exception("unhandled error")
        return _error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}"), path=request.url.path)

    # ---- OpenAI endpoints ----
    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={**stream_or(CompletionResponse, CompletionChunk), **errors(400, 404, 503)})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(ctx, body, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={**stream_or(ChatCompletionResponse, ChatCompletionChunk), **errors(400, 404, 503)})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(ctx, body, request)

    @app.post("/v1/messages", response_model=AnthropicMessage,
              responses={**anthropic_stream_or(), **errors(400, 404, 503, model=AnthropicError)})
    async def messages(body: MessagesRequest, request: Request) -> Response:
        """Anthropic's Messages API: the chat route in Anthropic's request, answer, event and error shapes."""
        return await create_message(ctx, body, request)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=errors(400, 404, 503))
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await create_embedding(ctx, body, request)

    response_store = ResponseStore()      # what previous_response_id can continue

    @app.post("/v1/responses", response_model=ResponseObject, responses={
        **stream_or(ResponseObject, ResponseStreamEvent, done=False),
        **errors(400, 404, 503, why={404: "The model named is not the one served, or previous_response_id names no "
                                           "response stored here."})})
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await create_response(ctx, response_store, body, request)

    def model_card(name: str) -> dict[str, Any]:
        base = name == ctx.model_name
        return {"id": name, "object": "model", "created": now(), "owned_by": "tokenmill", "root": name,
                "parent": None if base else ctx.model_name, "max_model_len": ctx.max_model_len}

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(n) for n in ctx.served_names]}

    # a served name may hold slashes (org/name), as OpenAI's ids do not
    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=errors(404))
    async def model(model_id: str) -> dict[str, Any]:
        ctx.check_model(model_id)
        return model_card(model_id)

    # ---- LoRA adapters at run time (vLLM's routes) ----
    def lora_enabled() -> None:
        if getattr(eng.config, "lora_config", None) is None:
            raise ApiError(400, "this server was started without LoRA adapters; start it with --enable-lora",
                           "lora_name")

    def json_errors(*statuses: int) -> dict:
        """errors() for a route whose success is plain text (vLLM's): the errors stay JSON."""
        return {s: {"description": e["description"], "content": {"application/json": {"schema": {
            "$ref": "#/components/schemas/ErrorResponse"}}}} for s, e in errors(*statuses).items()}

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=json_errors(400, 503))
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        lora_enabled()
        name = body.lora_name
        if name in ctx.served_names:
            raise ApiError(400, f"the LoRA adapter {name!r} has already been loaded; unload it first, or choose "
                                f"another name", "lora_name")
        lora = LoRARequest(name, next(lora_ids), body.lora_path)
        ctx.loras[name] = lora         # held while it loads, so two loads of one name cannot race
        try:
            await llm.call(lambda engine: engine.add_lora(lora))
        except ValueError as e:        # the adapter does not fit: named by the loader
            del ctx.loras[name]
            raise ApiError(400, str(e), "lora_path")
        except EngineDeadError as e:
            del ctx.loras[name]
            raise unavailable(e)
        except BaseException:
            del ctx.loras[name]
            raise
        log.info("LoRA adapter %r loaded", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=json_errors(400, 404, 503))
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        lora_enabled()
        lora = ctx.loras.get(body.lora_name)
        if lora is None:
            served = ", ".join(map(repr, ctx.loras)) or "none"
            raise ApiError(404, f"the LoRA adapter {body.lora_name!r} cannot be found (loaded: {served})",
                           "lora_name", "model_not_found")
        del ctx.loras[body.lora_name]     # new requests no longer find it; those running finish with it
        try:
            await llm.call(lambda engine: engine.remove_lora(lora.lora_int_id))
        except EngineDeadError as e:
            raise unavailable(e)
        log.info("LoRA adapter %r unloaded", body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    # ---- vLLM's extras ----
    @app.post("/tokenize", response_model=TokenizeResponse, responses=errors(400, 404))
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of 'prompt' or 'messages'")
        if body.messages is not None:
            ids = render_messages(ctx, body.messages, body.add_generation_prompt)
        elif ctx.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer", "prompt")
        else:
            ids = list(ctx.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=errors(400, 404))
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        if ctx.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer", "tokens")
        vocab = eng.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": ctx.tokenizer.decode(body.tokens)}

    # ---- prefill/decode disaggregation: what `tokenmill router` asks an instance (engine/kv_transfer.py) ----
    @app.get("/v1/kv_transfer", include_in_schema=False)
    async def kv_transfer_info() -> dict[str, Any]:
        return {"kv_role": None} if eng.transfer is None else eng.transfer.info()

    @app.post("/v1/kv_transfer/connect", include_in_schema=False)
    async def kv_transfer_connect(body: KVConnectRequest) -> dict[str, Any]:
        sender = None if eng.transfer is None else eng.transfer.sender
        if sender is None:
            raise ApiError(400, "this instance sends no KV: start it with --kv-role prefill or both", "host")
        try:
            await asyncio.to_thread(sender.connect, body.host, body.port)
        except ValueError as e:           # the decode instance refuses: another model, dtype or layout
            raise ApiError(400, str(e), "port", "kv_pairing_refused")
        except ConnectionError as e:
            raise ApiError(503, str(e), code="kv_transfer_unreachable", type="service_unavailable")
        return {"paired": f"{body.host}:{body.port}"}

    @app.get("/health", response_model=Health,
             responses=errors(503, why={503: "The engine has stopped, or the server is shutting down."}))
    async def health() -> Response:
        if llm.draining:
            return _error_response(ApiError(503, f"the server is shutting down ({llm.num_in_flight} requests in "
                                                 f"flight)", code="shutting_down", type="service_unavailable"))
        if not llm.is_running:
            return _error_response(ApiError(503, f"the engine is not running: {llm.error}"))
        return JSONResponse({"status": "ok"})

    if enable_shutdown_endpoint:
        @app.post("/shutdown", status_code=202, responses=errors(503, why={503: "The server is shutting down."}))
        async def shutdown() -> dict[str, Any]:
            """Drain as SIGTERM does: new requests get 503, those in flight run to their end (up to
            --shutdown-timeout seconds), then the server exits."""
            llm.drain()
            return {"status": "shutting_down", "num_in_flight": llm.num_in_flight}

    @app.get("/version", response_model=Version)
    async def version() -> dict[str, str]:
        return {"version": tokenmill.__version__}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        """The engine's state as JSON, for the playground (it polls this)."""
        cc = eng.config.cache_config
        return {"model": ctx.model_name, "max_model_len": ctx.max_model_len, "block_size": cc.block_size,
                "prefix_caching": cc.enable_prefix_caching, "device": str(eng.config.device),
                **asdict(llm.state)}

    # ---- the playground ----
    @app.get("/", include_in_schema=False)
    async def playground() -> Response:
        return FileResponse(os.path.join(STATIC, "index.html"))

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app
