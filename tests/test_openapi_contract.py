"""The server's /openapi.json against what the server does. schemathesis reads the live server's own schema,
generates requests for every operation (valid ones and, as negative cases, invalid ones) and holds each answer's
status, content type, headers and body to what the schema documents for it. A failure is a server bug or a schema
that says something other than what the server does: fix whichever is wrong, never the check."""
from __future__ import annotations

from datetime import timedelta
from typing import Any

import httpx
import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from pydantic import BaseModel
from schemathesis import GenerationMode
from schemathesis.checks import CHECKS as REGISTRY, load_all_checks

from tokenmill.server.app import _PROTECTED
from tokenmill.server.schemas import document, errors

pytest_plugins = ["tests.server_fixtures"]

# compiles grammars in workers at the idle CPU priority, which a second test worker's load would starve: alone
pytestmark = [pytest.mark.serial, pytest.mark.slow]

API_KEY = "test-key"              # the shared live_server's
AUTH = {"Authorization": f"Bearer {API_KEY}"}
load_all_checks()
CHECKS = REGISTRY.get_by_names(["not_a_server_error", "status_code_conformance", "content_type_conformance",
                                "response_schema_conformance", "response_headers_conformance"])
# and what the schema forbids is refused. Not positive_data_acceptance: a request can fit the schema and still be a
# documented 400/404 (a model not served, a token id past the vocabulary, best_of != n, min_tokens > max_tokens)
REJECTED = REGISTRY.get_by_names(["negative_data_rejection"])
MAX_NEW_TOKENS = 4
# the field that bounds generation on each generating route (all of them can stream), and all that may
LENGTH_FIELD = {"/v1/completions": "max_tokens", "/v1/chat/completions": "max_tokens",
                "/v1/responses": "max_output_tokens"}
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
MODES = ("positive", "negative", "streamed")


@pytest.fixture(scope="module")
def openapi(live_server: Any) -> Any:
    return schemathesis.openapi.from_url(live_server.url + "/openapi.json")


def few_new_tokens(case: Any, most: int = MAX_NEW_TOKENS) -> None:
    """Cap generation at a few tokens: a max_tokens chosen by hypothesis (or none: chat and responses then generate
    up to max_model_len) would spend the time on decode steps that exercise no other code."""
    body, field = case.body, LENGTH_FIELD.get(case.operation.path)
    if field is None or not isinstance(body, dict):
        return
    for k in LENGTH_FIELDS:
        v = body.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > most:
            body[k] = most
    if all(body.get(k) is None for k in LENGTH_FIELDS):
        body[field] = most


def integers_as_integers(value: Any) -> Any:
    """JSON Schema's integer admits 2.0, so schemathesis sends integers that way half the time; the server refuses
    them on purpose (protocol.Int), a documented 400 that would keep most requests from reaching generation."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [integers_as_integers(v) for v in value]
    if isinstance(value, dict):
        return {k: integers_as_integers(v) for k, v in value.items()}
    return value


def streamed(case: Any) -> Any:
    if isinstance(case.body, dict):
        case.body["stream"] = True
    return case


def check_operation(operation: Any, mode: str) -> None:
    cases = operation.as_strategy(GenerationMode.NEGATIVE if mode == "negative" else GenerationMode.POSITIVE)

    # derandomized: the gate sees the same cases every run, so a failure is a change in the server, not a new draw
    @settings(max_examples=25, deadline=timedelta(seconds=10), derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases.map(streamed) if mode == "streamed" else cases)
    def run(case: Any) -> None:
        if mode != "negative":
            case.body = integers_as_integers(case.body)
        few_new_tokens(case)
        checks = CHECKS + REJECTED if mode == "negative" else CHECKS
        case.call_and_validate(headers=AUTH, checks=checks, timeout=30)
        assert_healthy(case)

    run()


HEALTH = httpx.Client(timeout=10)     # one client: each httpx.get would build its own SSL context


def assert_healthy(case: Any) -> None:
    r = HEALTH.get(case.operation.schema.get_base_url().rstrip("/") + "/health")
    assert r.status_code == 200, f"unhealthy after {case.operation.label} {case.body!r}: {r.text}"


@pytest.mark.parametrize("mode", MODES)
def test_every_operation_answers_as_its_schema_says(openapi: Any, mode: str, subtests: pytest.Subtests) -> None:
    """positive: requests that fit the schema; negative: requests that break it, to be refused as documented;
    streamed: positive requests to the generating routes with stream=true, whose events the schema describes."""
    operations = [result.ok() for result in openapi.get_all_operations()]
    assert len(operations) >= 11
    for operation in operations:
        if mode == "negative" and not operation.body and not any(operation.iter_parameters()):
            continue       # nothing sent to an operation without parameters or body can break its schema
        if mode == "streamed" and operation.path not in LENGTH_FIELD:
            continue
        with subtests.test(operation.label):
            check_operation(operation, mode)


def test_boundary_values_answer_as_the_schema_says(openapi: Any, subtests: pytest.Subtests) -> None:
    """schemathesis' coverage phase: each field at and just past its bounds (lengths, ranges, enums, types, required
    fields left out), valid cases answered as documented and invalid ones refused, deterministically."""
    modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
    for operation in [result.ok() for result in openapi.get_all_operations()]:
        config = openapi.config.generation_for(operation=operation)
        with subtests.test(operation.label):
            for case in openapi.iter_coverage_cases(operation, generation_modes=modes, generation_config=config):
                negative = case.meta is not None and case.meta.generation.mode == GenerationMode.NEGATIVE
                if not negative:
                    case.body = integers_as_integers(case.body)
                few_new_tokens(case, 1)      # the bounds of the request, not of generation, are under test
                case.call_and_validate(headers=AUTH, checks=CHECKS + REJECTED if negative else CHECKS, timeout=30)
                assert_healthy(case)


def test_errors_are_documented_as_400_in_openais_shape(live_server: Any) -> None:
    doc = httpx.get(live_server.url + "/openapi.json", timeout=10).json()
    assert not [(path, op) for path, ops in doc["paths"].items() for op in ops.values() if "422" in op["responses"]]
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    error = doc["components"]["schemas"]["ErrorDetail"]
    assert set(error["required"]) == {"message", "type", "param", "code"}
    posts = {path: ops["post"] for path, ops in doc["paths"].items() if path.startswith("/v1/") and "post" in ops}
    assert set(posts) == {"/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses",
                          "/v1/messages", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
    for path, op in posts.items():
        shape = "AnthropicError" if path == "/v1/messages" else "ErrorResponse"     # each API's own error shape
        for status in ("400", "401", "413", "503") + (() if path == "/v1/load_lora_adapter" else ("404",)):
            content = op["responses"][status]["content"]
            assert content == {"application/json": {"schema": {"$ref": f"#/components/schemas/{shape}"}}}, path
        assert op["security"] == [{"bearer": []}]
    assert doc["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}


class Thing(BaseModel):
    x: int


def test_401_and_bearer_auth_are_documented_only_when_a_key_is_set() -> None:
    def app_doc(api_key: bool) -> dict[str, Any]:
        app = FastAPI()
        document(app, api_key=api_key, protected=_PROTECTED)

        @app.post("/v1/thing", responses=errors(400))
        async def thing(body: Thing) -> dict[str, int]:
            return {"x": body.x}

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}
        return app.openapi()

    for api_key in (False, True):
        doc = app_doc(api_key)
        post, get = doc["paths"]["/v1/thing"]["post"], doc["paths"]["/health"]["get"]
        assert set(post["responses"]) == {"200", "400", "413"} | ({"401"} if api_key else set())
        assert ("security" in post) == api_key and ("securitySchemes" in doc["components"]) == api_key
        assert set(get["responses"]) == {"200"} and "security" not in get      # open, and no body to refuse
