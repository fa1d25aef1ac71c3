"""Structured outputs over HTTP, with the real openai client: OpenAI's response_format (json_schema, json_object,
and client.chat.completions.parse), vLLM's structured_outputs and its older guided_* fields, on /v1/completions and
/v1/chat/completions, streamed and not; and the 400s for a schema, regex or grammar that cannot be compiled.

The constrained outputs that must end on their own (JSON) come from the bundled SmolLM2-135M (slow); those the
grammar ends (a choice, a fixed-length regex, a finite grammar) and the refusals use the tiny random model."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Iterator

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

pytest_plugins = ["tests.server_fixtures"]

# compiles grammars in workers at the idle CPU priority, which a second test worker's load would starve: alone
pytestmark = pytest.mark.serial

MODEL = "smollm2"


@pytest.fixture(scope="module")
def real_server() -> Iterator[Any]:
    """The bundled SmolLM2-135M-Instruct, with room to decode 64 requests at once."""
    from tests.server_fixtures import LiveServer
    from tokenmill.engine.engine import LLMEngine
    from tokenmill.server.app import build_app
    engine = LLMEngine(dtype="float32", device="cpu", max_model_len=1024, kv_cache_memory_gb=0.5, max_num_seqs=64)
    server = LiveServer(build_app(engine, model_name=MODEL))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def real_client(real_server: Any) -> Any:
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask(schema: dict[str, Any]) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Reply with JSON that fits this JSON schema:\n{json.dumps(schema)}"}]


# ---- twenty-odd schemas, each bounding its own size so that a 135M model finishes well within max_tokens ---------
NAME = {"type": "string", "minLength": 1, "maxLength": 20}
SCHEMAS: dict[str, dict[str, Any]] = {
    "flat object": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0,
                                                                           "maximum": 120}},
                    "required": ["name", "age"]},
    "string enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
                    "required": ["color"]},
    "nested object": {"type": "object", "required": ["name", "address"], "properties": {
        "name": NAME, "address": {"type": "object", "required": ["city", "zip"], "properties": {
            "city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}},
    "array with minItems/maxItems": {"type": "object", "required": ["tags"], "properties": {"tags": {
        "type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "string", "minLength": 1, "maxLength": 10}}}},
    "boolean and bounded integer": {"type": "object", "required": ["done", "count"], "properties": {
        "done": {"type": "boolean"}, "count": {"type": "integer", "minimum": 0, "maximum": 10}}},
    "nullable string": {"type": "object", "required": ["nickname"], "properties": {
        "nickname": {"type": ["string", "null"], "maxLength": 10}}},
    "anyOf": {"type": "object", "required": ["value"], "properties": {
        "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100}, {"enum": ["none", "all"]}]}}},
    "bounded number": {"type": "object", "required": ["celsius"], "properties": {
        "celsius": {"type": "number", "minimum": -50, "maximum": 50}}},
    "const": {"type": "object", "required": ["version", "ok"], "properties": {
        "version": {"const": "1.0"}, "ok": {"type": "boolean"}}},
    "array of objects": {"type": "object", "required": ["items"], "properties": {"items": {
        "type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "object", "required": ["id", "label"], "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 9},
                "label": {"type": "string", "maxLength": 8}}}}}},
    "string pattern": {"type": "object", "required": ["code"], "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}},
    "top-level array": {"type": "array", "minItems": 2, "maxItems": 4,
                        "items": {"type": "integer", "minimum": 0, "maximum": 9}},
    "top-level enum": {"enum": ["yes", "no", "maybe"]},
    "top-level integer": {"type": "integer", "minimum": 1, "maximum": 999},
    "$defs and $ref": {"$defs": {"point": {"type": "object", "required": ["x", "y"], "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}}}},
        "type": "object", "required": ["start", "end"],
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}},
    "optional property": {"type": "object", "required": ["title"], "properties": {
        "title": NAME, "subtitle": {"type": "string", "maxLength": 10}}},
    "nested arrays": {"type": "object", "required": ["grid"], "properties": {"grid": {
        "type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}}},
    "integer enum": {"type": "object", "required": ["level", "mode"], "properties": {
        "level": {"enum": [1, 2, 3]}, "mode": {"type": "string", "enum": ["fast", "slow"]}}},
    "string length range": {"type": "object", "required": ["word"], "properties": {
        "word": {"type": "string", "minLength": 3, "maxLength": 6}}},
    "exclusive bounds": {"type": "object", "required": ["percent"], "properties": {
        "percent": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100}}},
    "no additional properties": {"type": "object", "additionalProperties": False, "required": ["user"],
                                 "properties": {"user": {"type": "object", "additionalProperties": False,
                                                         "required": ["id"], "properties": {
                                                             "id": {"type": "integer", "minimum": 0,
                                                                    "maximum": 1000}}}}},
    "type union": {"type": "object", "required": ["flag"], "properties": {"flag": {"type": ["integer", "boolean"],
                                                                                    "minimum": 0, "maximum": 5}}},
}
SEEDS = (1, 2, 3)


@pytest.mark.slow
def test_parse_returns_the_pydantic_object(real_client: Any) -> None:
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: Annotated[str, Field(max_length=30)]
        country: Annotated[str, Field(max_length=30)]
        population: Annotated[int, Field(ge=0, le=50_000_000)]

    done = real_client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON: name, country, population."}],
        response_format=City, temperature=0, max_tokens=200)
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City), choice.message.content
    assert choice.message.parsed.name


@pytest.mark.slow
def test_every_output_fits_its_schema(real_client: Any) -> None:
    """Each schema with three seeds at temperature 1, sent at once: every answer validates and ended on its own."""
    def one(name: str, seed: int) -> tuple[str, int, Any]:
        schema = SCHEMAS[name]
        out = real_client.chat.completions.create(
            model=MODEL, messages=ask(schema), temperature=1.0, seed=seed, max_tokens=300,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
        return name, seed, out.choices[0]

    assert len(SCHEMAS) >= 20
    jobs = [(name, seed) for name in SCHEMAS for seed in SEEDS]
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda job: one(*job), jobs))
    failures = []
    for name, seed, choice in results:
        text = choice.message.content
        try:
            assert choice.finish_reason == "stop", f"finish_reason {choice.finish_reason}"
            jsonschema.validate(json.loads(text), SCHEMAS[name])
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            failures.append(f"{name} (seed {seed}): {str(e).splitlines()[0]}: {text!r}")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_json_object(real_client: Any) -> None:
    out = real_client.chat.completions.create(
        # the keys named: a free-form object is unbounded, and a 135M model may well go on until max_tokens
        model=MODEL, messages=[{"role": "user", "content": "Describe a cat as a JSON object with the keys name, age "
                                                           "and color."}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=300)
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)


@pytest.mark.slow
def test_streamed_schema_joins_to_valid_json(real_client: Any) -> None:
    schema = SCHEMAS["nested object"]
    chunks = list(real_client.chat.completions.create(
        model=MODEL, messages=ask(schema), temperature=1.0, seed=7, max_tokens=300, stream=True,
        extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1    # streamed, not in one piece
    jsonschema.validate(json.loads(text), schema)
    assert "\n" not in text      # disable_any_whitespace


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field", ["structured_outputs", "guided_json", "response_format"])
def test_completions_take_a_schema(real_client: Any, field: str, stream: bool) -> None:
    schema = SCHEMAS["flat object"]
    body = {"structured_outputs": {"json": schema}, "guided_json": json.dumps(schema),
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}}[field]
    out = real_client.completions.create(
        model=MODEL, prompt="A person described as JSON with their name and age:", max_tokens=200, seed=3,
        stream=stream, extra_body={field: body})
    chunks = list(out) if stream else [out]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    jsonschema.validate(json.loads(text), schema)


# ---- what the grammar itself ends: the tiny random model is enough ------------------------------------------------
def chat(client: Any, **kw: Any) -> Any:
    return client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Answer."}],
                                          max_tokens=40, **kw)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_guided_choice(openai_client: Any, seed: int) -> None:
    choices = ["Paris", "London", "Berlin", "Rome"]
    out = chat(openai_client, seed=seed, extra_body={"guided_choice": choices})
    assert out.choices[0].message.content in choices
    assert out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("regex", [r"[0-9]{3}-[0-9]{4}", r"(yes|no), [a-z]{2,4}\.", r"0x[0-9a-f]{8}"])
def test_guided_regex(openai_client: Any, regex: str) -> None:
    for seed in (0, 1):
        text = chat(openai_client, seed=seed, extra_body={"guided_regex": regex}).choices[0].message.content
        assert re.fullmatch(regex, text), (regex, text)


def test_guided_grammar_and_structured_outputs_grammar(openai_client: Any) -> None:
    grammar = 'root ::= "yes" | "no"'
    for body in ({"guided_grammar": grammar}, {"structured_outputs": {"grammar": grammar}}):
        for seed in (0, 1):
            out = chat(openai_client, seed=seed, extra_body=body)
            assert out.choices[0].message.content in ("yes", "no"), body
            assert out.choices[0].finish_reason == "stop"


def test_structured_outputs_choice_and_regex_on_completions(openai_client: Any) -> None:
    out = openai_client.completions.create(model="tiny-chat", prompt="The answer is", max_tokens=20, n=3, seed=0,
                                           extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert {c.text for c in out.choices} <= {"alpha", "beta"}
    out = openai_client.completions.create(model="tiny-chat", prompt="A date:", max_tokens=20, stream=True,
                                           extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-0[1-9]"}})
    assert re.fullmatch(r"20[0-9]{2}-0[1-9]", "".join(c.choices[0].text for c in out if c.choices))


def test_response_format_text_is_no_constraint(openai_client: Any) -> None:
    # and may sit beside another source: "text" is the default
    out = chat(openai_client, seed=0, response_format={"type": "text"}, extra_body={"guided_choice": ["a", "b"]})
    assert out.choices[0].message.content in ("a", "b")


# ---- refusals ---------------------------------------------------------------------------------------------------
BAD: list[tuple[str, dict[str, Any], str]] = [
    ("invalid schema", {"response_format": {"type": "json_schema",
                                            "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format"),
    ("invalid schema (guided_json)", {"guided_json": {"type": "objekt"}}, "guided_json"),
    ("invalid schema (structured_outputs)", {"structured_outputs": {"json": {"type": "objekt"}}},
     "structured_outputs"),
    ("guided_json that is not JSON", {"guided_json": "{not json"}, "guided_json"),
    ("invalid regex", {"guided_regex": "a(b"}, "guided_regex"),
    ("invalid regex (structured_outputs)", {"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ("invalid grammar", {"guided_grammar": 'root ::= "yes" | undefined_rule'}, "guided_grammar"),
    ("grammar that does not parse", {"structured_outputs": {"grammar": "root ::= (("}}, "structured_outputs"),
    ("two sources", {"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ("two sources (response_format)", {"response_format": {"type": "json_object"},
                                       "structured_outputs": {"choice": ["a"]}}, "structured_outputs"),
    ("two kinds in structured_outputs", {"structured_outputs": {"regex": "a+", "choice": ["a"]}},
     "structured_outputs"),
    ("empty structured_outputs", {"structured_outputs": {}}, "structured_outputs"),
    ("unknown response_format type", {"response_format": {"type": "xml"}}, "response_format"),
    ("json_schema without its schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("json_schema beside type json_object", {"response_format": {
        "type": "json_object", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
    ("guided_whitespace_pattern (not supported)", {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
]


def _bad_request(openai_client: Any, route: str, body: dict[str, Any], stream: bool) -> Any:
    with pytest.raises(openai.BadRequestError) as err:
        if route == "chat":
            chat(openai_client, stream=stream, extra_body=body)
        else:
            openai_client.completions.create(model="tiny-chat", prompt="x", max_tokens=5, stream=stream,
                                             extra_body=body)
    return err.value


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("what,body,param", BAD, ids=[b[0] for b in BAD])
def test_refused_with_the_field_named(openai_client: Any, what: str, body: dict[str, Any], param: str,
                                      route: str) -> None:
    e = _bad_request(openai_client, route, body, stream=route == "completions")
    assert e.status_code == 400
    error = e.body if "param" in (e.body or {}) else (e.body or {}).get("error", {})
    assert error.get("param", "").split(".")[0] == param, (what, error)
    if what.startswith("two sources"):
        assert all(k in error["message"] for k in body), error["message"]
    # and the server still answers a good one
    out = chat(openai_client, seed=0, extra_body={"guided_choice": ["ok", "fine"]})
    assert out.choices[0].message.content in ("ok", "fine")


def test_openapi_documents_the_fields(live_server: Any) -> None:
    import httpx
    doc = httpx.get(live_server.url + "/openapi.json", timeout=10).json()
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = doc["components"]["schemas"][name]["properties"]
        for field in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar"):
            assert field in props, (name, field)
    assert "schema" in doc["components"]["schemas"]["JsonSchemaSpec"]["properties"]
    assert "json" in doc["components"]["schemas"]["StructuredOutputs"]["properties"]


def test_a_grammar_over_the_compile_time_limit_is_a_400(chat_model_dir: str) -> None:
    """The grammar compiles off the engine thread: while one is refused for its time, other requests are served."""
    from tests.server_fixtures import LiveServer
    from tokenmill.engine.engine import LLMEngine
    from tokenmill.server.app import build_app
    engine = LLMEngine(chat_model_dir, dtype="float32", device="cpu", max_model_len=512, kv_cache_memory_gb=0.05,
                       structured_outputs_config={"compile_timeout_s": 0.001})
    server = LiveServer(build_app(engine, model_name="tiny-chat"))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        props = {f"f{i}": {"type": "string", "pattern": "[a-z]{3,%d}" % (5 + i % 7)} for i in range(300)}
        heavy = {"type": "object", "properties": props, "required": list(props)}
        with pytest.raises(openai.BadRequestError) as err:
            chat(client, extra_body={"guided_json": heavy})
        assert "did not compile within 0.001 s" in err.value.body["message"]
        assert err.value.body["param"] == "guided_json"
        out = chat(client, seed=0, extra_body={"ignore_eos": True})
        assert out.choices[0].finish_reason == "length"
    finally:
        server.stop()
