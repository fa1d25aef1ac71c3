"""What the server answers, as pydantic models for /openapi.json. The handlers build plain dicts (completions.py,
chat.py, ...); these models describe them, and tests/test_openapi_contract.py holds every answer to its model.

document() finishes the schema with what GuardMiddleware does to every route (401, 413) and drops FastAPI's 422:
here a request that does not validate is a 400 in OpenAI's error shape, like every other error.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema


# ---- errors ------------------------------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error below 500, else server_error or service_unavailable")
    param: Optional[str] = Field(description="the request field at fault, when one is")
    code: Optional[str] = Field(description="e.g. model_not_found, queue_full, invalid_api_key")


class ErrorResponse(BaseModel):
    """Every error the server answers, whatever its status (OpenAI's shape)."""
    error: ErrorDetail


WHY = {
    400: "The request is invalid: a field of the wrong type, out of range, unknown, or not supported here. The "
         "message says what to change.",
    401: "No API key, the wrong one, or more than one Authorization header: send 'Authorization: Bearer <key>'.",
    404: "The model named is not the one this server serves.",
    413: "The request body is larger than the server's limit.",
    503: "The server is busy (its queue is full) or its engine has stopped.",
}


def errors(*statuses: int, why: Optional[dict[int, str]] = None,
           model: Optional[type[BaseModel]] = None) -> dict[Union[int, str], dict[str, Any]]:
    """FastAPI `responses=` entries for these statuses, each an ErrorResponse (or `model`); `why` overrides WHY's
    text."""
    return {s: {"model": model or ErrorResponse, "description": (why or {}).get(s, WHY[s])} for s in statuses}


# ---- Anthropic's Messages API (server/messages.py) -------------------------------------------------------------
class AnthropicErrorDetail(BaseModel):
    type: str = Field(description="invalid_request_error, authentication_error, not_found_error, ...")
    message: str


class AnthropicError(BaseModel):
    """An error on /v1/messages (Anthropic's shape)."""
    type: Literal["error"]
    error: AnthropicErrorDetail


class AnthropicMessage(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]] = Field(description="thinking, text and tool_use blocks")
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: Optional[str]
    usage: dict[str, int]


class AnthropicEvent(BaseModel):
    """One streamed event: message_start, content_block_start / _delta / _stop, message_delta, message_stop, or
    error."""
    model_config = ConfigDict(extra="allow")
    type: str


def anthropic_stream_or() -> dict[int, dict[str, Any]]:
    """The Messages API's 200: a message, or with stream=true Anthropic's named server-sent events."""
    sse = {"type": "object", "required": ["data"], "properties": {
        "event": {"type": "string"},
        "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": _ref(AnthropicEvent)}}}
    return {200: {"model": AnthropicMessage, "description": "The message; with stream=true, server-sent events",
                  "content": {"text/event-stream": {"schema": sse}}}}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def stream_or(model: type[BaseModel], event: type[BaseModel], *, done: bool = True) -> dict[int, dict[str, Any]]:
    """A 200 that is `model` as JSON, or with stream=true server-sent events whose data is an `event` as JSON, an
    error met after the stream started (ErrorResponse), or (done) the final "[DONE]". The event schema describes one
    event, as OpenAPI 3.1 reads `schema` for text/event-stream."""
    payload: dict[str, Any] = {"type": "string", "contentMediaType": "application/json",
                               "contentSchema": {"anyOf": [_ref(event), _ref(ErrorResponse)]} if done else _ref(event)}
    data = {"anyOf": [{"const": "[DONE]"}, payload]} if done else payload
    sse = {"type": "object", "required": ["data"], "properties": {"data": data, "event": {"type": "string"}}}
    return {200: {"model": model, "description": "The answer; with stream=true, server-sent events instead",
                  "content": {"text/event-stream": {"schema": sse}}}}


def document(app: FastAPI, *, api_key: bool, protected: tuple[str, ...]) -> None:
    """Make app.openapi() describe GuardMiddleware (413 on bodies, 401 and bearer auth on `protected` paths when a
    key is set) and drop the 422s: the middleware answers before any route, so its rules are applied by path."""
    generate = app.openapi
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    anthropic = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/AnthropicError"}}}}

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        for path, operations in schema["paths"].items():
            shaped = anthropic if path.startswith("/v1/messages") else error
            for method, op in operations.items():
                op["responses"].pop("422", None)
                if method in ("post", "put", "patch"):
                    op["responses"]["413"] = {"description": WHY[413], **shaped}
                if api_key and path.startswith(protected):
                    op["responses"]["401"] = {"description": WHY[401], **shaped}
                    op["security"] = [{"bearer": []}]
                op["responses"] = dict(sorted(op["responses"].items()))
        components = schema.setdefault("components", {})
        models = components.setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            models.pop(name, None)
        # the streamed events are named only inside stream_or's schemas, so FastAPI does not collect them
        _, defs = models_json_schema([(m, "serialization") for m in STREAMED],
                                     ref_template="#/components/schemas/{model}")
        for name, model_schema in defs.get("$defs", {}).items():
            models.setdefault(name, model_schema)
        components["schemas"] = dict(sorted(models.items()))
        if api_key:
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


# ---- /v1/models, and vLLM's extras -------------------------------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str = Field(description="the served model's name (no filesystem path is shown)")
    parent: Optional[str] = Field(None, description="a LoRA adapter's base model (vLLM's field); null for the base")
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class Health(BaseModel):
    status: Literal["ok"]


class Version(BaseModel):
    version: str


# ---- completions and chat ----------------------------------------------------------------------------------------
FinishReason = Optional[Literal["stop", "length", "tool_calls"]]    # tool_calls: chat only
StopReason = Union[int, str, None]     # the stop token id or stop string that ended the choice, if one did


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens served from the prefix cache")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs: per token its text, logprob, top alternatives and character offset."""
    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs]
    finish_reason: FinishReason
    stop_reason: StopReason
    token_ids: Optional[list[int]] = Field(default=None, description="with return_token_ids")
    prompt_token_ids: Optional[list[int]] = Field(default=None, description="with return_token_ids")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ToolCallFunction(BaseModel):
    name: str
    arguments: str = Field(description="JSON text, as the model wrote it")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: Optional[str] = Field(description="null when the reply is only tool calls or only thinking")
    tool_calls: Optional[list[ToolCall]] = Field(default=None, description="with tools, the calls the reply made")
    reasoning_content: Optional[str] = Field(default=None, description="with --reasoning-parser, the thinking")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs]
    finish_reason: FinishReason
    stop_reason: StopReason
    token_ids: Optional[list[int]] = Field(default=None, description="with return_token_ids")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChunk(BaseModel):
    """A streamed piece of a completion; with stream_options.include_usage the last has no choices, and usage."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class ToolCallFunctionDelta(BaseModel):
    name: Optional[str] = Field(default=None, description="in the call's first delta")
    arguments: str = Field(description="the next piece of the JSON text (empty in the call's first delta)")


class ToolCallDelta(BaseModel):
    index: int
    id: Optional[str] = Field(default=None, description="in the call's first delta")
    type: Optional[Literal["function"]] = Field(default=None, description="in the call's first delta")
    function: ToolCallFunctionDelta


class ChatDelta(BaseModel):
    role: Optional[Literal["assistant"]] = Field(default=None, description="in the first chunk of each choice")
    content: Optional[str] = None
    reasoning_content: Optional[str] = Field(default=None, description="with --reasoning-parser, the thinking")
    tool_calls: Optional[list[ToolCallDelta]] = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: Optional[ChatLogprobs]
    finish_reason: FinishReason
    stop_reason: StopReason = Field(default=None, description="in the chunk with the finish_reason")
    token_ids: Optional[list[int]] = Field(default=None, description="with return_token_ids")


class ChatCompletionChunk(BaseModel):
    """A streamed piece of a chat completion; with stream_options.include_usage the last has no choices, and usage."""
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None


# ---- embeddings --------------------------------------------------------------------------------------------------
class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: Union[list[float], str] = Field(description="floats, or with encoding_format=base64 their "
                                                           "little-endian float32 bytes in base64")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage


# ---- responses ---------------------------------------------------------------------------------------------------
class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[TokenLogprob]


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class InputTokensDetails(BaseModel):
    cached_tokens: int
    cache_write_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: str


class ResponseObject(BaseModel):
    """OpenAI's Response object; the request's settings are echoed back."""
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    completed_at: Optional[int]
    background: bool
    error: Optional[ResponseError]
    incomplete_details: Optional[IncompleteDetails]
    instructions: Optional[str]
    max_output_tokens: Optional[int]
    metadata: dict[str, str]
    model: str
    output: list[OutputMessage]
    parallel_tool_calls: bool
    previous_response_id: Optional[str]
    reasoning: Optional[dict[str, Any]]
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: Union[str, dict[str, Any]]
    tools: list[dict[str, Any]]
    top_p: float
    truncation: Literal["auto", "disabled"]
    usage: Optional[ResponseUsage]
    user: Optional[str]


class ResponseStreamEvent(BaseModel):
    """One event of a streamed /v1/responses (also named on its 'event:' line). Its fields depend on its type:
    response.* carry the response; output_item.* the item; content_part.* item_id, output_index, content_index and
    the part; output_text.delta the delta and its logprobs; output_text.done the whole text and logprobs."""
    type: Literal["response.created", "response.in_progress", "response.output_item.added",
                  "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                  "response.content_part.done", "response.output_item.done", "response.completed",
                  "response.incomplete", "response.failed"]
    sequence_number: int
    response: Optional[ResponseObject] = None
    item: Optional[OutputMessage] = None
    part: Optional[OutputText] = None
    item_id: Optional[str] = None
    output_index: Optional[int] = None
    content_index: Optional[int] = None
    delta: Optional[str] = None
    text: Optional[str] = None
    logprobs: Optional[list[TokenLogprob]] = None


# what the streamed responses' events refer to
STREAMED = (CompletionChunk, ChatCompletionChunk, ResponseStreamEvent, AnthropicEvent)
