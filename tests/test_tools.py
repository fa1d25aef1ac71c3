"""Tools and reasoning on /v1/chat/completions: the tool-call parsers and the reasoning parsers on text (whole and
streamed in any chunking), tools rendered into chat templates, and live servers driven by the official openai client:
tool_choice named / required enforced by a JSON-schema constraint, auto parsed from the model's text (forced into
the call syntax by a regex constraint), thinking split into reasoning_content, and every bad input a 400."""
from __future__ import annotations

import functools
import json
import random
import shutil
from types import SimpleNamespace
from typing import Any

import httpx
import jsonschema
import pytest

from tokenmill.reasoning import get_reasoning_parser
from tokenmill.server.chat import ChoiceParser, render_messages, tool_parser
from tokenmill.server.protocol import ApiError, ChatCompletionRequest, ChatMessage
from tokenmill.server.tools import RequiredCallsParser, ToolPlan, plan_tools, required_schema, supports_tools
from tokenmill.tool_parsers import ToolCall, get_tool_parser, parser_for_template

pytest_plugins = ["tests.server_fixtures"]
openai = pytest.importorskip("openai")

# compiles grammars in workers at the idle CPU priority, which a second test worker's load would starve: alone
pytestmark = pytest.mark.serial

MODEL = "tiny-chat"
API_KEY = "test-key"              # the shared live_server's
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
             "required": ["zone"], "additionalProperties": False}}}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# a conversation that went through one call and its result
HISTORY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'}]
HERMES_CALL = (r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}'
               r'</tool_call>')
TIME_CALL = r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'


# ---- parsers on text ---------------------------------------------------------------------------------------------
def streamed(cp: ChoiceParser, text: str, rng: random.Random) -> dict[str, Any]:
    """What a client accumulates from cp.deltas over text cut into random pieces."""
    acc: dict[str, Any] = {"content": "", "reasoning_content": "", "calls": {}}
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 15)))) if len(text) > 1 else []
    for cut in cuts + [len(text)]:
        for d in cp.deltas(text[:cut], cut == len(text)):
            for key in ("content", "reasoning_content"):
                acc[key] += d.get(key, "")
            for tc in d.get("tool_calls", []):
                call = acc["calls"].setdefault(tc["index"], {"id": tc.get("id"), "name": "", "arguments": ""})
                call["name"] += tc["function"].get("name", "")
                call["arguments"] += tc["function"]["arguments"]
    return acc


def assert_stream_matches_whole(make: Any, text: str) -> dict[str, Any]:
    """Streamed in 30 random chunkings, text gives what the whole text gives; returns the whole message."""
    whole = make().message(text)
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls", [])]
    rng = random.Random(text)
    for _ in range(30):
        acc = streamed(make(), text, rng)
        assert acc["content"] == (whole["content"] or ""), text
        assert acc["reasoning_content"] == (whole.get("reasoning_content") or ""), text
        assert [(c["name"], c["arguments"]) for _, c in sorted(acc["calls"].items())] == want, text
        assert all(c["id"].startswith("call_") for c in acc["calls"].values())
    return whole


CALL_A = ToolCall("get_weather", '{"city": "Paris"}')
CALL_B = ToolCall("get_time", '{"zone": "UTC", "x": [1, 2]}')
HERMES_CASES = [
    ('Sure! <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', ["Sure! ", CALL_A]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n<tool_call>{"name": "get_time", '
     '"arguments": {"zone": "UTC", "x": [1, 2]}}</tool_call>\nDone.', [CALL_A, CALL_B, "\nDone."]),
    ('no call < tool_call here', ["no call < tool_call here"]),
    ('bad <tool_call>{not json}</tool_call> end', ["bad <tool_call>{not json}</tool_call> end"]),
    ('<tool_call>{"arguments": {}}</tool_call>', ['<tool_call>{"arguments": {}}</tool_call>']),   # no name
    ('  \n', ["  \n"]),
    ('x <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}', ["x ", CALL_A]),   # never closed
    ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call><tool_call>{broken',
     [CALL_A, "<tool_call>{broken"]),
]
LLAMA3_CASES = [
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "parameters": {"zone": "UTC", "x": [1, 2]}}', [CALL_A, CALL_B]),
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', [CALL_A]),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}} and more', [CALL_A, "and more"]),
    ('Hello {"name": "get_weather", "parameters": {}}', ['Hello {"name": "get_weather", "parameters": {}}']),
    ('{"city": "Paris"}', ['{"city": "Paris"}']),             # JSON, but not a call
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}; {"oops": 1}', [CALL_A, '{"oops": 1}']),
    ('{"name": "get_weather", "parameters": {"city": ', ['{"name": "get_weather", "parameters": {"city": ']),
    ('<|python_tag|>', ["<|python_tag|>"]),
]


# harmony (gpt-oss): calls are messages to functions.NAME (the recipient after the channel, or in the header before
# it), final bodies and preambles are content, analysis is the reasoning parser's, the rest stays as written
HARMONY_CALL_A = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                  '{"city": "Paris"}<|call|>')
OPENAI_CASES = [
    ('<|channel|>final<|message|>It is sunny.<|return|>', ["It is sunny."]),
    ('<|channel|>analysis<|message|>Need weather.<|end|>' + HARMONY_CALL_A, [CALL_A]),
    (' to=functions.get_time<|channel|>commentary json<|message|>{"zone": "UTC", "x": [1, 2]}', [CALL_B]),
    ('<|channel|>commentary<|message|>Checking.<|end|>' + HARMONY_CALL_A, ["Checking.", CALL_A]),
    ('<|channel|>commentary to=functions.get_weather<|message|>{"city": "Par',        # cut short: not a call
     ['<|channel|>commentary to=functions.get_weather<|message|>{"city": "Par']),
    ('<|channel|>commentary to=browser.search<|message|>{"q": "x"}<|call|>',           # a built-in tool: content
     ['<|channel|>commentary to=browser.search<|message|>{"q": "x"}<|call|>']),
    ('plain words, no harmony', ["plain words, no harmony"]),
    ('<|channel|>final<|message|>a<|end|>junk<|start|>assistant<|channel|>final<|message|>b', ["ajunkb"]),
]


@pytest.mark.parametrize("name, text, pieces", [("hermes", *c) for c in HERMES_CASES] +
                         [("llama3_json", *c) for c in LLAMA3_CASES] + [("openai", *c) for c in OPENAI_CASES])
def test_tool_parsers_whole_and_streamed(name: str, text: str, pieces: list) -> None:
    parser = get_tool_parser(name)
    assert parser.parse(text) == pieces
    whole = assert_stream_matches_whole(lambda: ChoiceParser(None, ToolPlan([], parser=parser)), text)
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    # a reply with calls has the text outside them (or null) as content; one without keeps its text as it is
    # (harmony's: the bodies of its messages)
    outside = "".join(p for p in pieces if isinstance(p, str))
    assert whole["content"] == (outside or None if calls else outside if name == "openai" else text)
    assert len(whole.get("tool_calls", [])) == len(calls)


def test_required_parser() -> None:
    p = RequiredCallsParser()
    out = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": ' \
          '{"zone": "UTC", "x": [1, 2]}}]'
    assert p.parse(out) == [CALL_A, CALL_B]
    assert p.parse(out[:60], final=False) == [CALL_A]           # a call is known once its object closes
    assert p.parse("[]") == ["[]"] and p.parse("cut sho") == ["cut sho"]     # not calls: content
    for text in (out, out[:70], "nope"):
        assert_stream_matches_whole(lambda: ChoiceParser(None, ToolPlan([], parser=p)), text)


HARMONY_REASONING_CASES = {
    # text: gpt-oss's (reasoning, content); a call stays in the content, for the tool parser
    '<|channel|>analysis<|message|>Let me see.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.<|return|>':
        ("Let me see.", "It is 4."),
    '<|channel|>final<|message|>It is 4.': (None, "It is 4."),
    '<|channel|>analysis<|message|>cut short': ("cut short", None),
    '<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>': ("ab", None),
    '<|channel|>analysis<|message|>Need it.<|end|>' + HARMONY_CALL_A: ("Need it.", HARMONY_CALL_A),
    'It is 4.': (None, "It is 4."),
    '<|chan': (None, "<|chan"),
}


def test_harmony_reasoning_then_tool_calls_whole_and_streamed() -> None:
    parser = get_reasoning_parser("openai_gptoss")
    for text, want in HARMONY_REASONING_CASES.items():
        whole = assert_stream_matches_whole(lambda: ChoiceParser(parser, ToolPlan([])), text)
        assert (whole["reasoning_content"], whole["content"]) == want, text
    text = ('<|channel|>analysis<|message|>The user wants weather.<|end|><|start|>assistant<|channel|>commentary'
            '<|message|>One moment.<|end|>' + HARMONY_CALL_A)
    make = lambda: ChoiceParser(parser, ToolPlan([], parser=get_tool_parser("openai")))  # noqa: E731
    whole = assert_stream_matches_whole(make, text)
    assert (whole["reasoning_content"], whole["content"]) == ("The user wants weather.", "One moment.")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]] == \
        [("get_weather", '{"city": "Paris"}')]
    assert parser_for_template("{{ '<|start|>assistant<|channel|>final<|message|>' }}") == "openai"


REASONING_CASES = {
    # text: (qwen3's (reasoning, content), deepseek_r1's)
    "<think>Let me see.</think>It is 4.": (("Let me see.", "It is 4."), ("Let me see.", "It is 4.")),
    "\n<think>\nhm\n</think>\n\nok": (("\nhm\n", "\n\nok"), ("\nhm\n", "\n\nok")),
    "It is 4.": ((None, "It is 4."), ("It is 4.", None)),
    "Let me see.</think>It is 4.": ((None, "Let me see.</think>It is 4."), ("Let me see.", "It is 4.")),
    "<think>cut short": (("cut short", None), ("cut short", None)),
    "<thin": ((None, "<thin"), ("<thin", None)),
}


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_reasoning_split_whole_and_streamed(name: str) -> None:
    parser = get_reasoning_parser(name)
    assert parser.start_token == "<think>" and parser.end_token == "</think>"
    for text, expected in REASONING_CASES.items():
        want = expected[name == "deepseek_r1"]
        whole = assert_stream_matches_whole(lambda: ChoiceParser(parser, ToolPlan([])), text)
        assert (whole["reasoning_content"], whole["content"]) == want, text
    with pytest.raises(ValueError, match="qwen3"):
        get_reasoning_parser("nope")


def test_reasoning_then_tool_calls() -> None:
    text = '<think>The user wants weather.</think>\n<tool_call>{"name": "get_weather", "arguments": ' \
           '{"city": "Paris"}}</tool_call>'
    make = lambda: ChoiceParser(get_reasoning_parser("qwen3"), ToolPlan([], parser=get_tool_parser("hermes")))  # noqa
    whole = assert_stream_matches_whole(make, text)
    assert whole["reasoning_content"] == "The user wants weather." and whole["content"] is None
    assert whole["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_parser_choice() -> None:
    assert parser_for_template("{{ '<tool_call>' }} {{ tools }}") == "hermes"
    assert parser_for_template("{% if tools %}<|python_tag|>{% endif %}") == "llama3_json"
    assert parser_for_template("{{ messages }}") == "hermes"
    assert supports_tools("{% for t in tools %}{% endfor %}") and not supports_tools("{{ messages }}")
    assert supports_tools({"default": "x", "tool_use": "y"})
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        get_tool_parser("mistral")


def test_required_schema_accepts_calls_only() -> None:
    req = ChatCompletionRequest(messages=ASK, tools=TOOLS, tool_choice="required")
    schema = required_schema(req.tools or [])
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}},
          {"name": "get_time", "parameters": {"zone": "UTC"}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {"zone": "UTC"}}], [{"name": "nope", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = required_schema(ChatCompletionRequest(messages=ASK, tools=TOOLS).tools or [], parallel=False)
    jsonschema.validate(ok[:1], single)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok, single)           # parallel_tool_calls false: one call
    # a tool's $defs move to the root, where its refs point
    defs = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": defs}}]
    schema = required_schema(ChatCompletionRequest(messages=ASK, tools=tools).tools or [])
    jsonschema.validate([{"name": "f", "parameters": {"p": 3}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"p": "x"}}], schema)


def test_plan_tools() -> None:
    hermes = get_tool_parser("hermes")

    def plan(**kw: Any) -> ToolPlan:
        return plan_tools(ChatCompletionRequest(messages=ASK, **kw), hermes)

    assert plan().render == [] and not plan().parses
    assert plan(tools=TOOLS, tool_choice="none").render == []
    auto = plan(tools=TOOLS)
    assert auto.parser is hermes and auto.constraint is None and len(auto.render) == 2
    named = plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.named == "get_time" and named.constraint.json == PARAMS["get_time"]
    assert named.constraint.disable_any_whitespace
    for kw, param in ((dict(tool_choice="required"), "tool_choice"),
                      (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
                       "tool_choice"),
                      (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]),
                       "tools[0].function.parameters"),
                      (dict(tools=TOOLS + TOOLS[:1]), "tools[2].function.name")):
        with pytest.raises(ApiError) as e:
            plan(**kw)
        assert (e.value.status, e.value.param) == (400, param)


# ---- templates ---------------------------------------------------------------------------------------------------
# a small tool-aware template in Llama 3's manner (JSON calls after <|python_tag|>, results in an ipython turn)
NATIVE_TEMPLATE = """{%- if tools %}<|im_start|>system
Environment: ipython
To call a function, answer <|python_tag|> then {"name": function name, "parameters": {argument: value}}.
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
<|python_tag|>{% for c in m.tool_calls %}{% set args = c.function.arguments | tojson -%}
{"name": "{{ c.function.name }}", "parameters": {{ args }}}{% if not loop.last %}; {% endif %}{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>ipython
{{ m.content }}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def native_model_dir(chat_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny chat model with NATIVE_TEMPLATE as its chat template."""
    path = tmp_path_factory.mktemp("tiny_tools") / "model"
    shutil.copytree(chat_model_dir, path)
    (path / "chat_template.jinja").write_text(NATIVE_TEMPLATE)
    return str(path)


@functools.lru_cache(maxsize=None)
def tokenizer_of(model_dir: str) -> Any:
    from tokenmill.tokenizer import load_tokenizer
    return load_tokenizer(model_dir)


def rendered(model_dir: str, messages: list[dict], tools: Any = None, tool_choice: Any = None) -> str:
    tok = tokenizer_of(model_dir)
    req = ChatCompletionRequest(messages=messages, tools=tools, tool_choice=tool_choice)
    plan = plan_tools(req, get_tool_parser("hermes"))
    ids = render_messages(SimpleNamespace(tokenizer=tok), req.messages, True, plan.render)  # type: ignore[arg-type]
    return tok.decode(ids)


def test_default_template_renders_tools_hermes_style(chat_model_dir: str) -> None:
    text = rendered(chat_model_dir, HISTORY + HISTORY[-1:], TOOLS)
    # SmolLM2's template knows no tools: the tools go into a system turn, in Hermes' words
    assert text.startswith("<|im_start|>system\n# Tools\n") and "<tools>\n" + json.dumps(TOOLS[0]) in text
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}'
            '\n</tool_call><|im_end|>') in text
    # the results of one turn's calls share one user turn
    response = '<tool_response>\n{"temp_c": 21}\n</tool_response>'
    assert f"<|im_start|>user\n{response}\n{response}<|im_end|>\n<|im_start|>assistant\n" in text
    # a system message keeps its text, the tools follow it
    text = rendered(chat_model_dir, [{"role": "system", "content": "Be brief."}] + ASK, TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    # tool_choice none: no tools in the prompt (the history is still written in Hermes' convention)
    assert "# Tools" not in rendered(chat_model_dir, HISTORY, TOOLS, "none")
    assert rendered(chat_model_dir, ASK) == rendered(chat_model_dir, ASK, TOOLS, "none")


def test_model_template_renders_tools_itself(native_model_dir: str) -> None:
    text = rendered(native_model_dir, HISTORY, TOOLS)
    assert text.startswith("<|im_start|>system\nEnvironment: ipython\n") and json.dumps(TOOLS[1]) in text
    assert '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 1}}<|im_end|>' in text
    assert '<|im_start|>ipython\n{"temp_c": 21}<|im_end|>' in text and "<tool_call>" not in text
    ctx = SimpleNamespace(tokenizer=SimpleNamespace(chat_template=NATIVE_TEMPLATE), tool_call_parser=None)
    assert tool_parser(ctx).name == "llama3_json"                       # type: ignore[arg-type]
    assert tool_parser(SimpleNamespace(**{**vars(ctx), "tool_call_parser": "hermes"})).name == "hermes"  # type: ignore


def test_messages_validate() -> None:
    for bad, why in (({"role": "tool", "content": "x"}, "tool_call_id"),
                     ({"role": "user", "content": "x", "tool_call_id": "c"}, "tool_call_id"),
                     ({"role": "user", "content": "x", "tool_calls": HISTORY[1]["tool_calls"]}, "tool_calls"),
                     ({"role": "tool", "tool_call_id": "c"}, "content")):
        with pytest.raises(ValueError, match=why):
            ChatMessage(**bad)
    d = ChatMessage(**HISTORY[1]).as_template_dict()
    assert d["content"] == "" and d["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 1}


# ---- live servers ------------------------------------------------------------------------------------------------
def accumulate(chunks: Any) -> tuple[dict[str, Any], list[str]]:
    """A streamed chat reply as the message it adds up to (as a client assembles it), and the finish reasons."""
    msg: dict[str, Any] = {"content": "", "reasoning_content": "", "tool_calls": {}}
    finishes = []
    for ch in chunks:
        for c in ch.choices:
            d = c.delta
            msg["content"] += d.content or ""
            msg["reasoning_content"] += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                call = msg["tool_calls"].setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or tc.id
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
            if c.finish_reason:
                finishes.append(c.finish_reason)
    msg["tool_calls"] = [msg["tool_calls"][i] for i in sorted(msg["tool_calls"])]
    return msg, finishes


def check_calls(calls: list[tuple[str, str]], allowed: set[str]) -> None:
    assert calls
    for name, arguments in calls:
        assert name in allowed
        jsonschema.validate(json.loads(arguments), PARAMS[name])


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("tool_choice", [NAMED, "required"], ids=["named", "required"])
def test_forced_tool_choice_returns_valid_calls(openai_client: Any, tool_choice: Any) -> None:
    allowed = {"get_weather"} if tool_choice == NAMED else set(PARAMS)
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=80, temperature=0)
    r = openai_client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls], allowed)
    assert all(c.type == "function" and c.id.startswith("call_") for c in choice.message.tool_calls)
    msg, finishes = accumulate(openai_client.chat.completions.create(stream=True, **kw))
    assert finishes == ["tool_calls"] and msg["content"] == ""
    assert [(c["name"], c["arguments"]) for c in msg["tool_calls"]] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]      # greedy: the same calls
    # sampled, several choices: each one a valid call
    r = openai_client.chat.completions.create(**{**kw, "temperature": 1.0, "n": 3, "seed": 1})
    for c in r.choices:
        check_calls([(t.function.name, t.function.arguments) for t in c.message.tool_calls], allowed)


def test_named_arguments_stream_as_written(openai_client: Any) -> None:
    chunks = list(openai_client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                                        max_tokens=80, temperature=0, stream=True))
    deltas = [tc for ch in chunks for c in ch.choices for tc in c.delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].function.arguments == ""
    assert len(deltas) > 3 and all(d.id is None and d.function.name is None for d in deltas[1:])


def test_auto_parses_hermes_calls(openai_client: Any) -> None:
    # the tiny model is forced into the Hermes syntax by a regex; the parser turns it into tool_calls
    regex = r"Sure\. " + HERMES_CALL + r"\n" + TIME_CALL
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0,
              extra_body={"structured_outputs": {"regex": regex}})
    r = openai_client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Sure. "
    check_calls([(c.function.name, c.function.arguments) for c in msg.tool_calls], set(PARAMS))
    assert [c.function.name for c in msg.tool_calls] == ["get_weather", "get_time"]
    assert len(msg.tool_calls) == 2 and msg.tool_calls[0].id != msg.tool_calls[1].id
    streamed_msg, finishes = accumulate(openai_client.chat.completions.create(stream=True, **kw))
    assert finishes == ["tool_calls"] and streamed_msg["content"] == "Sure. "
    assert [(c["name"], c["arguments"]) for c in streamed_msg["tool_calls"]] == \
        [(c.function.name, c.function.arguments) for c in msg.tool_calls]
    # the assistant's calls and the tool's result go back into the conversation
    follow = ASK + [msg, {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": '{"temp_c": 21}'},
                    {"role": "tool", "tool_call_id": msg.tool_calls[1].id, "content": '{"temp_c": 20}'}]
    r = openai_client.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS, max_tokens=4,
                                              temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_auto_without_calls_is_plain_content(openai_client: Any) -> None:
    kw = dict(model=MODEL, messages=ASK, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    plain = openai_client.chat.completions.create(**kw).choices[0]
    with_tools = openai_client.chat.completions.create(tools=TOOLS, tool_choice="none", **kw).choices[0]
    assert with_tools.message.content == plain.message.content and not with_tools.message.tool_calls
    auto = openai_client.chat.completions.create(tools=TOOLS, **kw).choices[0]
    assert auto.finish_reason == "length" and not auto.message.tool_calls and auto.message.content is not None


def test_bad_tool_requests_are_400(live_server: Any) -> None:
    def post(**body: Any) -> httpx.Response:
        return httpx.post(live_server.url + "/v1/chat/completions", timeout=30,
                          headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": MODEL, "messages": ASK, "max_tokens": 4, **body})

    bad_params = [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]
    cases = [
        (dict(tools=bad_params), "tools[0].function.parameters"),
        (dict(tools=bad_params, tool_choice="required"), "tools[0].function.parameters"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tool_choice="auto"), "tool_choice"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
        (dict(tools=TOOLS, tool_choice=NAMED, guided_regex="a+"), "tool_choice"),
        (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools.0.function.name"),
        (dict(messages=ASK + [{"role": "tool", "content": "21 C"}]), "messages.1"),
    ]
    for body, param in cases:
        r = post(**body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, (body, err)
    # a schema the grammar compiler refuses names the tools as well (jsonschema alone would let it by)
    r = post(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "p": {"$ref": "#/$defs/Missing"}}}}}], tool_choice="required")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert post().status_code == 200 and httpx.get(live_server.url + "/health").status_code == 200


# ---- a model whose template renders tools itself (Llama 3's JSON calls) ------------------------------------------
@pytest.fixture(scope="module")
def native_server(native_model_dir: str, server_factory: Any) -> Any:
    server = server_factory(native_model_dir)
    yield server
    server.stop()


def test_native_template_server_parses_llama3_json(native_server: Any) -> None:
    client = openai.OpenAI(base_url=native_server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    regex = r'<\|python_tag\|>\{"name": "get_time", "parameters": \{"zone": "(UTC|CET)"\}\}'
    kw = dict(model=MODEL, messages=HISTORY, tools=TOOLS, max_tokens=60, temperature=0,
              extra_body={"structured_outputs": {"regex": regex}})
    msg = client.chat.completions.create(**kw).choices[0].message
    assert msg.content is None
    check_calls([(c.function.name, c.function.arguments) for c in msg.tool_calls], {"get_time"})
    streamed_msg, finishes = accumulate(client.chat.completions.create(stream=True, **kw))
    assert finishes == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in streamed_msg["tool_calls"]] == \
        [(c.function.name, c.function.arguments) for c in msg.tool_calls]


# ---- reasoning ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reasoning_server(chat_model_dir: str, server_factory: Any) -> Any:
    # the app splits the thinking; the engine has no reasoning parser, so a regex constrains the whole reply (the
    # tokenizer has no <think> token for the engine to wait on)
    server = server_factory(chat_model_dir, reasoning_parser="deepseek_r1")
    yield server
    server.stop()


def check_thinking_split(server: Any, regex: str) -> Any:
    """A reply forced by regex into thinking 'Paris is sunny.' (or rainy) and answering 'It is sunny.' comes back
    split so, streamed as whole; returns the client and the message."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    kw = dict(model=MODEL, messages=ASK, max_tokens=80, temperature=0,
              extra_body={"structured_outputs": {"regex": regex}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert msg.reasoning_content in ("Paris is sunny.", "Paris is rainy.")
    assert msg.content in ("It is sunny.", "It is rainy.") and r.choices[0].finish_reason == "stop"
    streamed_msg, _ = accumulate(client.chat.completions.create(stream=True, **kw))
    assert (streamed_msg["reasoning_content"], streamed_msg["content"]) == (msg.reasoning_content, msg.content)
    return client, msg


def test_reasoning_content_split(reasoning_server: Any) -> None:
    client, msg = check_thinking_split(reasoning_server, r"Paris is (sunny|rainy)\.</think>It is (sunny|rainy)\.")
    # R1's template opened the thinking in the prompt: without </think> all of the reply is thinking
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content is None and r.choices[0].message.reasoning_content
    # the reply sent back (reasoning_content included) is taken as a message
    r = client.chat.completions.create(model=MODEL, messages=ASK + [msg, {"role": "user", "content": "ok"}],
                                       max_tokens=2)
    assert r.choices[0].finish_reason in ("length", "stop")


@pytest.fixture(scope="module")
def harmony_server(chat_model_dir: str, server_factory: Any) -> Any:
    server = server_factory(chat_model_dir, reasoning_parser="openai_gptoss", tool_call_parser="openai")
    yield server
    server.stop()


def _rx(text: str) -> str:
    return "".join("\\" + c if c in "|.{}[]()?*+^$\\" else c for c in text)


def test_harmony_reasoning_and_calls_through_the_openai_client(harmony_server: Any, caplog: Any) -> None:
    """gpt-oss's harmony replies (the tiny model forced into them by a regex) come back as reasoning_content and
    content, or as tool_calls with finish_reason tool_calls, streamed as whole; a reply the parser cannot read is
    content, as written, and logged."""
    client, _ = check_thinking_split(harmony_server, _rx("<|channel|>analysis<|message|>Paris is ") + "(sunny|rainy)" +
                                     _rx(".<|end|><|start|>assistant<|channel|>final<|message|>It is ") +
                                     "(sunny|rainy)" + _rx("."))
    call = _rx('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
               'to=functions.get_weather <|constrain|>json<|message|>{"city": "') + '(Paris|Rome)' + \
        _rx('", "days": ') + '[1-7]' + _rx('}')
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0,
              extra_body={"structured_outputs": {"regex": call}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert msg.reasoning_content == "Need the weather."
    check_calls([(c.function.name, c.function.arguments) for c in msg.tool_calls], {"get_weather"})
    streamed_msg, finishes = accumulate(client.chat.completions.create(stream=True, **kw))
    assert finishes == ["tool_calls"] and streamed_msg["reasoning_content"] == "Need the weather."
    assert [(c["name"], c["arguments"]) for c in streamed_msg["tool_calls"]] == \
        [(c.function.name, c.function.arguments) for c in msg.tool_calls]
    with caplog.at_level("WARNING", logger="tokenmill"):
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, temperature=0,
                                           extra_body={"structured_outputs": {"regex": "No harmony here\\."}})
    assert r.choices[0].message.content == "No harmony here." and r.choices[0].message.reasoning_content is None
    assert "outside its messages" in caplog.text


def test_unknown_parser_names_fail_at_start(chat_model_dir: str) -> None:
    from tokenmill.cli import build_parser
    for flag in ("--tool-call-parser", "--reasoning-parser"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", chat_model_dir, flag, "nope"])
    args = build_parser().parse_args(["serve", chat_model_dir, "--tool-call-parser", "llama3_json",
                                      "--reasoning-parser", "qwen3"])
    assert (args.tool_call_parser, args.reasoning_parser) == ("llama3_json", "qwen3")
    from tokenmill.server.app import build_app
    with pytest.raises(ValueError, match="unknown tool call parser"):
        build_app(None, tool_call_parser="nope")              # type: ignore[arg-type]


# ---- the bundled real model --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_real_model_forced_tool_calls(server_factory: Any) -> None:
    from tokenmill.engine.engine import LLMEngine
    from tokenmill.server.app import build_app
    from tests.server_fixtures import LiveServer
    engine = LLMEngine(dtype="float32", device="cpu", max_model_len=1024, kv_cache_memory_gb=0.1)
    server = LiveServer(build_app(engine, model_name=MODEL))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        for choice, allowed in ((NAMED, {"get_weather"}), ("required", set(PARAMS))):
            r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                               max_tokens=120, temperature=0)
            assert r.choices[0].finish_reason == "tool_calls"
            check_calls([(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls], allowed)
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0)
        msg = r.choices[0].message            # auto: a call or an answer, whichever the model writes, well-formed
        assert msg.content or msg.tool_calls
    finally:
        server.stop()


def test_replies_fit_the_documented_schema(live_server: Any, reasoning_server: Any) -> None:
    """Tool calls, null content and reasoning_content are what /openapi.json documents (schemas.py)."""
    from tokenmill.server.schemas import ChatCompletionChunk, ChatCompletionResponse

    def post(server: Any, **body: Any) -> httpx.Response:
        return httpx.post(server.url + "/v1/chat/completions", timeout=30,
                          headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": MODEL, "messages": ASK, "max_tokens": 60, "temperature": 0, **body})

    regex = r"Hm\.</think>" + HERMES_CALL
    for server, body in ((live_server, dict(tools=TOOLS, tool_choice=NAMED)),
                         (live_server, dict(tools=TOOLS, tool_choice="required")),
                         (reasoning_server, dict(tools=TOOLS, structured_outputs={"regex": regex}))):
        reply = post(server, **body).json()
        ChatCompletionResponse.model_validate(reply)
        assert reply["choices"][0]["finish_reason"] == "tool_calls" and reply["choices"][0]["message"]["tool_calls"]
        events = [line[6:] for line in post(server, stream=True, **body).text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        for event in events:
            ChatCompletionChunk.model_validate_json(event)
