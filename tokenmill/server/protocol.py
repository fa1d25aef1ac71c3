"""Request bodies of the OpenAI-compatible API (pydantic), and their translation into SamplingParams.

Unknown fields are ignored, as vLLM ignores them, so that clients sending newer fields (reasoning_effort, ...) keep
working; the server's log and the response's x-ignored-fields header name them, so a client can see that an option
took no effect. OpenAI's fields that change nothing a model computes (IGNORED) are accepted and ignored silently.
vLLM's extra sampling fields (top_k, min_p, repetition_penalty, ...) are accepted as well. Numbers are strict (JSON
true is not 1) and held to OpenAI's ranges and SamplingParams' rules, so that /openapi.json shows them.
Responses are plain dicts built in completions.py / chat.py, described for /openapi.json in schemas.py.
"""
from __future__ import annotations

import json
import re
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, Strict, model_validator

from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.server.bodies import unencodable


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# the unknown fields of the request being read (set per request by the app's middleware): they are ignored, as vLLM
# ignores them, so clients that send newer fields keep working; the log and a response header name them
IGNORED_FIELDS: ContextVar[Optional[list[str]]] = ContextVar("ignored_fields", default=None)
IGNORED_FIELDS_HEADER = "x-ignored-fields"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow")


def unknown_fields(obj: Any, prefix: str = "") -> list[str]:
    """The dotted paths of the fields no model of a validated request knows (messages.0.foo)."""
    if isinstance(obj, BaseModel):
        out = [prefix + k for k in obj.model_extra or {}]
        for name in type(obj).model_fields:
            out += unknown_fields(getattr(obj, name), f"{prefix}{name}.")
        return out
    if isinstance(obj, (list, tuple)):
        return [p for i, x in enumerate(obj) for p in unknown_fields(x, f"{prefix}{i}.")]
    return []


class _Request(_Strict):
    """A request body: its text is checked as a whole first, so text no tokenizer can encode is refused with the
    field that holds it rather than failing wherever it is first used."""

    @model_validator(mode="before")
    @classmethod
    def _encodable(cls, data: Any) -> Any:
        found = unencodable(data)
        if found is not None:
            raise ApiError(400, f"{found[0]}: {found[1]}", found[0])
        return data

    @model_validator(mode="after")
    def _note_unknown(self) -> Any:
        # on the request as validated: a union's losing branch may have taken the winner's fields as extras
        found = IGNORED_FIELDS.get()
        if found is not None:
            found.extend(unknown_fields(self))
        return self


Int = Annotated[int, Strict()]        # JSON true is not 1, nor 2.0 an integer
Bool = Annotated[bool, Strict()]      # nor "yes", "false" or 0 a boolean
Float = Annotated[float, Strict()]    # any JSON number, but not a boolean
TokenId = Annotated[int, Strict(), Field(ge=0)]
StopString = Annotated[str, Field(min_length=1)]
# vLLM's cache_salt: requests share prefix-cache blocks only with requests of the same salt
CacheSalt = Annotated[Optional[str], Field(default=None, min_length=1, max_length=256)]
Stop = Optional[Union[StopString, list[StopString]]]
# token id (as a JSON key must be a string) -> bias; without additionalProperties the schema would let other keys by
LogitBias = Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]+$")], Annotated[Float, Field(ge=-100, le=100)]],
                      Field(json_schema_extra={"additionalProperties": False})]
MAX_N = 128                           # OpenAI's cap on n: one request cannot take the whole engine
# OpenAI request fields that are accepted and have no effect here (docs/serving.md: "OpenAI fields")
# (parallel_tool_calls matters only beside tools: tool_choice required, server/tools.py)
IGNORED = ("metadata", "store", "service_tier", "prediction", "parallel_tool_calls", "user")


def prompt_schema(max_prompts: Optional[int] = None) -> dict[str, Any]:
    """The JSON schema of a prompt field (a string, strings, token ids or lists of them), none empty. Shown rather
    than enforced by pydantic: the engine refuses an empty prompt or a token outside the vocabulary with a message
    that names the prompt, where the union's own errors would name one of its branches."""
    ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
    many = {"maxItems": max_prompts} if max_prompts else {}
    return {"anyOf": [{"type": "string", "minLength": 1},
                      {"type": "array", "minItems": 1, **many, "items": {"type": "string", "minLength": 1}}, ids,
                      {"type": "array", "minItems": 1, **many, "items": ids}]}


class StreamOptions(_Strict):
    include_usage: Bool = False
    continuous_usage_stats: Bool = False


def invalid_params(e: Exception) -> ApiError:
    """A 400 for SamplingParams' refusal ("SamplingParams.top_p must be ..."), naming the field as the request does."""
    msg = str(e)
    param = msg.split(".", 1)[1].split(" ", 1)[0] if msg.startswith("SamplingParams.") else None
    return ApiError(400, msg.replace("SamplingParams.", ""), param)


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


# ---- structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields ------
class JsonSchemaSpec(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    schema_: dict[str, Any] = Field(alias="schema")      # an alias: `schema` would shadow BaseModel.schema
    strict: Optional[Bool] = None       # the schema is always enforced, strict or not


class ResponseFormat(_Strict):
    """OpenAI's response_format. One class rather than a union of three, so that an error names the field as the
    request wrote it (response_format.json_schema.schema), not a union branch as well."""
    # _schema_with_json_schema's rule, for the schema: json_schema with type json_schema, and only with it
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"type": {"const": "json_schema"}}},
        "then": {"required": ["json_schema"], "properties": {"json_schema": {"not": {"type": "null"}}}},
        "else": {"properties": {"json_schema": {"type": "null"}}}})
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaSpec] = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> "ResponseFormat":
        if (self.json_schema is None) == (self.type == "json_schema"):
            raise ValueError("type json_schema needs its json_schema: {\"name\": ..., \"schema\": {...}}"
                             if self.type == "json_schema" else f"json_schema belongs to type json_schema, not "
                                                                  f"{self.type}")
        return self


NonEmpty = Annotated[str, Field(min_length=1)]
Choices = Annotated[list[NonEmpty], Field(min_length=1)]


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar and json_object."""
    json_: Optional[Union[dict[str, Any], str]] = Field(default=None, alias="json")   # a schema, or one as text
    regex: Optional[NonEmpty] = None
    choice: Optional[Choices] = None
    grammar: Optional[NonEmpty] = None
    json_object: Optional[Bool] = None
    disable_any_whitespace: Optional[Bool] = False


# the request fields that constrain the output; a request may use one of them
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")


@dataclass
class RequestConstraint(StructuredOutputsParams):
    """StructuredOutputsParams that remember the request field they came from, so that the engine's refusal of a
    schema, regex or grammar ("structured_outputs.json: ...") names the field the client sent."""
    param: str = "structured_outputs"


def _where(param: str, kind: str) -> str:
    """Where a constraint of this kind sits in the request, e.g. structured_outputs.regex."""
    if param == "structured_outputs":
        return f"structured_outputs.{kind}"
    if param == "response_format" and kind == "json":
        return "response_format.json_schema.schema"
    return param


def constraint_error(e: Exception, params: SamplingParams) -> ApiError:
    """A 400 for the engine's refusal "structured_outputs.<kind>: why", naming the field the request used."""
    so, msg = params.structured_outputs, str(e)
    if not isinstance(so, RequestConstraint):
        return ApiError(400, msg, "structured_outputs")
    return ApiError(400, re.sub(r"^structured_outputs\.\w+", _where(so.param, so.kind), msg), so.param)


class _Sampling(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions. Optional ones take null as "the default"
    (some clients send nulls for options they leave unset)."""
    model: Optional[str] = None
    n: Optional[Int] = Field(default=1, ge=1, le=MAX_N)
    temperature: Optional[Float] = Field(default=1.0, ge=0, le=2)      # OpenAI's default and range
    top_p: Optional[Float] = Field(default=1.0, gt=0, le=1)
    seed: Optional[Int] = Field(default=None, ge=-2 ** 63, le=2 ** 63 - 1)
    stop: Stop = None
    stream: Optional[Bool] = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[Float] = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: Optional[Float] = Field(default=0.0, ge=-2, le=2)
    logit_bias: Optional[LogitBias] = None
    # accepted and ignored (IGNORED)
    user: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    store: Optional[Bool] = None
    service_tier: Optional[str] = None
    prediction: Optional[dict[str, Any]] = None
    parallel_tool_calls: Optional[Bool] = None     # with tool_choice required, false allows one call only
    # vLLM's extras
    top_k: Optional[Int] = Field(default=0, ge=-1)           # 0 or -1: off
    min_p: Optional[Float] = Field(default=0.0, ge=0, le=1)
    repetition_penalty: Optional[Float] = Field(default=1.0, gt=0)
    min_tokens: Optional[Int] = Field(default=0, ge=0)
    stop_token_ids: Optional[list[TokenId]] = None
    include_stop_str_in_output: Optional[Bool] = False
    ignore_eos: Optional[Bool] = False
    skip_special_tokens: Optional[Bool] = True
    bad_words: Optional[list[str]] = None
    allowed_token_ids: Optional[list[TokenId]] = Field(default=None, min_length=1)
    return_token_ids: Optional[Bool] = False  # choices also carry token_ids (and prompt_token_ids)
    cache_salt: CacheSalt = None
    # vLLM's disaggregated prefill: do_remote_decode with remote_host and remote_port (a prefill instance sends the
    # prompt's KV there); do_remote_prefill (a decode instance: the KV was sent here)
    kv_transfer_params: Optional[dict[str, Any]] = None
    # structured outputs (at most one of CONSTRAINT_FIELDS)
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputs] = None
    guided_json: Optional[Union[dict[str, Any], str]] = None
    guided_regex: Optional[NonEmpty] = None
    guided_choice: Optional[Choices] = None
    guided_grammar: Optional[NonEmpty] = None
    # vLLM's, not served: refused rather than ignored, since the output would differ from what vLLM gives
    guided_whitespace_pattern: Optional[str] = None

    @model_validator(mode="after")
    def _unserved(self) -> Any:
        if self.guided_whitespace_pattern is not None:
            raise ApiError(400, "guided_whitespace_pattern is not supported: JSON output takes xgrammar's whitespace; "
                                "structured_outputs.disable_any_whitespace removes it", "guided_whitespace_pattern")
        return self

    def to_sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int],
                           prompt_logprobs: Optional[int] = None) -> SamplingParams:
        bias = None if self.logit_bias is None else {int(k): v for k, v in self.logit_bias.items()}
        try:
            return SamplingParams(
                n=_or(self.n, 1), temperature=_or(self.temperature, 1.0), top_p=_or(self.top_p, 1.0),
                top_k=_or(self.top_k, 0), min_p=_or(self.min_p, 0.0),
                repetition_penalty=_or(self.repetition_penalty, 1.0),
                presence_penalty=_or(self.presence_penalty, 0.0), frequency_penalty=_or(self.frequency_penalty, 0.0),
                seed=self.seed, max_tokens=max_tokens, min_tokens=_or(self.min_tokens, 0), stop=self.stop,
                stop_token_ids=self.stop_token_ids, include_stop_str_in_output=bool(self.include_stop_str_in_output),
                ignore_eos=bool(self.ignore_eos), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                logit_bias=bias, allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
                skip_special_tokens=_or(self.skip_special_tokens, True),
                structured_outputs=self._constraint(),
                extra_args={"kv_transfer_params": self.kv_transfer_params} if self.kv_transfer_params else None)
        except (ValueError, TypeError) as e:
            raise invalid_params(e)

    def _constraint(self) -> Optional[RequestConstraint]:
        given = [f for f in CONSTRAINT_FIELDS if getattr(self, f) is not None]
        if self.response_format is not None and self.response_format.type == "text":
            given.remove("response_format")        # the default: no constraint
        if len(given) > 1:
            raise ApiError(400, f"give at most one way to constrain the output; this request gives {given[0]} and "
                                f"{given[1]}", given[1])
        if not given:
            return None
        try:
            return RequestConstraint(**self._constraint_args(given[0]), param=given[0])
        except ValueError as e:      # StructuredOutputsParams' own checks ("exactly one of", "not valid JSON")
            msg = re.sub(r"StructuredOutputsParams(\.(\w+))?",
                         lambda m: _where(given[0], m[2]) if m[2] else given[0], str(e))
            raise ApiError(400, msg, given[0])

    def _constraint_args(self, field: str) -> dict[str, Any]:
        rf, so = self.response_format, self.structured_outputs
        if field == "response_format" and rf is not None:
            return {"json": rf.json_schema.schema_} if rf.json_schema is not None else {"json_object": True}
        if field == "structured_outputs" and so is not None:
            return {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
                    "json_object": so.json_object, "disable_any_whitespace": bool(so.disable_any_whitespace)}
        return {field.removeprefix("guided_"): getattr(self, field)}

    @property
    def num_choices(self) -> int:
        return _or(self.n, 1)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[Int], list[list[Int]]] = Field(json_schema_extra=prompt_schema())
    max_tokens: Optional[Int] = Field(default=16, ge=1)     # OpenAI's default for completions
    logprobs: Optional[Int] = Field(default=None, ge=0, le=20)
    echo: Optional[Bool] = False
    best_of: Optional[Int] = Field(default=None, ge=1, le=MAX_N)
    suffix: Optional[str] = None

    def prompts(self) -> list[Union[str, list[int]]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        if not p:
            raise ApiError(400, "prompt is empty; give a string, a list of strings or a list of token ids", "prompt")
        return list(p)  # type: ignore[arg-type]


class ContentPart(BaseModel):
    """A text part. Image, audio and file parts are refused by name, so a client learns the model is text-only
    rather than that its field is unknown."""
    # the schema shows what passes _text_only; the model takes any type so that it can refuse media by name
    model_config = ConfigDict(extra="allow", json_schema_extra={
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}}, "required": ["type", "text"],
        "additionalProperties": False})
    type: str
    text: Optional[str] = None

    @model_validator(mode="after")
    def _text_only(self) -> "ContentPart":
        if self.type != "text":
            raise ValueError(f"content parts of type {self.type!r} are not supported: this model takes text only")
        if self.model_extra:
            raise ValueError(f"unknown field(s) {', '.join(sorted(self.model_extra))} in a text content part")
        if self.text is None:
            raise ValueError("a text content part needs its text")
        return self


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None      # a JSON schema (checked when the request arrives)
    strict: Optional[Bool] = None     # accepted: required/named choices always enforce the schema, auto never does


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition

    def as_template_dict(self) -> dict[str, Any]:
        """The tool as chat templates take it (OpenAI's shape, without unset fields and strict)."""
        f = self.function
        fn = {"name": f.name, **({"description": f.description} if f.description is not None else {}),
              "parameters": f.parameters if f.parameters is not None else {"type": "object", "properties": {}}}
        return {"type": "function", "function": fn}


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class FunctionCall(_Strict):
    name: str
    arguments: str        # JSON text, as the model wrote it


class ToolCallParam(_Strict):
    """An assistant message's call, sent back in the conversation."""
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def _template_arguments(arguments: str) -> Any:
    """Arguments as chat templates expect them: a dict (they write it with tojson), as vLLM passes them."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


class ChatMessage(_Strict):
    # the validator's rules, for the schema: content (not null) unless the role is assistant; tool messages carry
    # tool_call_id; tool_calls only on assistant messages, tool_call_id only on tool messages
    model_config = ConfigDict(json_schema_extra={"allOf": [
        {"if": {"properties": {"role": {"not": {"const": "assistant"}}}},
         "then": {"required": ["content"], "properties": {"content": {"not": {"type": "null"}},
                                                          "tool_calls": {"type": "null"}}}},
        {"if": {"properties": {"role": {"const": "tool"}}},
         "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}},
         "else": {"properties": {"tool_call_id": {"type": "null"}}}}]})
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCallParam]] = None       # assistant: the calls it made
    tool_call_id: Optional[str] = None                     # tool: the call this message answers
    reasoning_content: Optional[str] = None                # assistant: its thinking, as this server returns it

    @model_validator(mode="after")
    def _has_content(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content: a string or a list of text parts")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not {self.role} ones")
        if (self.tool_call_id is None) == (self.role == "tool"):
            raise ValueError("a tool message needs the tool_call_id it answers" if self.role == "tool" else
                             f"tool_call_id belongs to tool messages, not {self.role} ones")
        return self

    @property
    def text(self) -> str:
        c = self.content
        return c if isinstance(c, str) else "".join(p.text or "" for p in c or [])

    def as_template_dict(self) -> dict[str, Any]:
        # "developer" is OpenAI's newer name for "system"; chat templates know only the latter
        d: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text}
        if self.name is not None:
            d["name"] = self.name      # templates that know speaker names use it
        if self.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _template_arguments(c.function.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            d["reasoning_content"] = self.reasoning_content     # templates that keep past thinking read it
        return d


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[Int] = Field(default=None, ge=1)
    max_completion_tokens: Optional[Int] = Field(default=None, ge=1)
    logprobs: Optional[Bool] = False
    top_logprobs: Optional[Int] = Field(default=None, ge=0, le=20)
    add_generation_prompt: Optional[Bool] = True
    tools: Optional[list[ChatTool]] = None
    tool_choice: Optional[ToolChoice] = None      # "auto" when tools are given, else "none"

    @property
    def effective_tool_choice(self) -> Union[str, NamedToolChoice]:
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"


class LoadLoRAAdapterRequest(_Request):
    """vLLM's POST /v1/load_lora_adapter."""
    lora_name: NonEmpty
    lora_path: NonEmpty


class KVConnectRequest(_Request):
    """POST /v1/kv_transfer/connect (a router, to a prefill instance): pair with the decode instance whose KV
    transfer listens at host:port."""
    host: NonEmpty
    port: int = Field(ge=1, le=65535)


class UnloadLoRAAdapterRequest(_Request):
    """vLLM's POST /v1/unload_lora_adapter."""
    lora_name: NonEmpty
    lora_int_id: Optional[Int] = None


class TokenizeRequest(_Request):
    # exactly one of prompt and messages, not null (the handler checks it)
    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]})
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Bool = True
    add_generation_prompt: Bool = True


class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: list[TokenId]
