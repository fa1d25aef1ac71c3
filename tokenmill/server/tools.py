"""Tools on /v1/chat/completions (OpenAI's function tools, served as vLLM serves them): checking them, rendering
them into the prompt, and what tool_choice asks of the output.

auto: the model's own tool-call syntax is parsed out of its text (tool_parsers). required and a named function: a
JSON-schema constraint makes the output a call, so it always parses (vLLM's way): named, the output is that
function's arguments; required, a JSON array of {"name", "parameters"} objects. none: tools are neither rendered
nor parsed, so the model answers in text."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from tokenmill.server.protocol import ApiError, ChatCompletionRequest, ChatTool, RequestConstraint
from tokenmill.tool_parsers import Piece, ToolParser, skip_space, tool_call

NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

# the default tool prompt for templates that do not render tools: Hermes' convention, as Qwen2.5's template writes it
HERMES_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def supports_tools(template: Any) -> bool:
    """Whether a chat template renders tools itself (it reads a `tools` variable, or has a tool_use variant)."""
    if isinstance(template, dict):
        return "tool_use" in template or any(supports_tools(t) for t in template.values())
    return isinstance(template, str) and "tools" in template


# ---- the prompt --------------------------------------------------------------------------------------------------
def hermes_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that knows no tools, in Hermes' convention: the tools listed in the system message,
    past calls as <tool_call> text in assistant turns, tool results as <tool_response> in one user turn."""
    out: list[dict[str, Any]] = []
    if tools:
        listing = HERMES_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if messages and messages[0]["role"] == "system":
            messages = [{**messages[0], "content": f"{messages[0]['content']}\n\n{listing}"}] + messages[1:]
        else:
            out.append({"role": "system", "content": listing})
    for m in messages:
        if m["role"] == "tool":
            text = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + text       # results of one turn's calls share a user turn
            else:
                out.append({"role": "user", "content": text, "_tool_results": True})
        elif m.get("tool_calls"):
            calls = [f"<tool_call>\n{json.dumps(_call_dict(c), ensure_ascii=False)}\n</tool_call>"
                     for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(([m["content"]] if m["content"] else []) + calls)})
        else:
            out.append({k: v for k, v in m.items() if k != "reasoning_content"})
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]


def _call_dict(call: dict[str, Any]) -> dict[str, Any]:
    return {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}


# ---- checks and constraints --------------------------------------------------------------------------------------
def check_tools(tools: list[ChatTool]) -> None:
    """400s for tools a server could only fail on later: a parameters schema that is not a JSON schema, and two tools
    of one name (a call could not say which it means)."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    seen: set[str] = set()
    for i, t in enumerate(tools):
        name = t.function.name
        if name in seen:
            raise ApiError(400, f"two tools are named {name!r}; tool names must be unique", f"tools[{i}].function.name")
        seen.add(name)
        if t.function.parameters is not None:
            try:
                Draft202012Validator.check_schema(t.function.parameters)
            except SchemaError as e:
                raise ApiError(400, f"the parameters of tool {name!r} are not a valid JSON schema: {e.message}",
                               f"tools[{i}].function.parameters")


def _hoisted_defs(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    """Definitions of each tool's schema, moved to the root of the combined schema where its "#/$defs/..." refs
    point once the tool's schema sits inside it."""
    root: dict[str, Any] = {}
    for s in schemas:
        for key in ("$defs", "definitions"):
            for name, d in (s.get(key) or {}).items():
                if root.setdefault(key, {}).setdefault(name, d) != d:
                    raise ApiError(400, f"two tools define {key}/{name} differently; rename one of them", "tools")
    return root


def required_schema(tools: list[ChatTool], parallel: bool = True) -> dict[str, Any]:
    """tool_choice "required": one or more calls (one without parallel), as a JSON array of {"name": <a tool>,
    "parameters": <its args>}."""
    params = [t.function.parameters or NO_PARAMETERS for t in tools]
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                               "parameters": {k: v for k, v in p.items()
                                                              if k not in ("$defs", "definitions")}},
              "required": ["name", "parameters"], "additionalProperties": False}
             for t, p in zip(tools, params)]
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": items},
            **_hoisted_defs(params)}


class RequiredCallsParser(ToolParser):
    """The output tool_choice "required" constrains: [{"name": ..., "parameters": {...}}, ...]. Each call is known
    once its object closes; an output that is not such an array (cut short, unconstrained) stays content."""
    name = "required"

    def parse(self, text: str, final: bool = True) -> list[Piece]:
        decoder = json.JSONDecoder()
        pos = skip_space(text, 0)
        if pos == len(text) or text[pos] != "[":
            return [text] if final and text else []
        calls: list[Piece] = []
        pos += 1
        while True:
            pos = skip_space(text, pos)
            if pos < len(text) and text[pos] == "]" and calls:
                return calls
            try:
                obj, end = decoder.raw_decode(text, pos)
                call = tool_call(obj, ("parameters", "arguments"), need_args=True)
            except ValueError:
                call = None
            if call is None:       # not a call (or not yet one): the rest is content once the text is whole
                rest = text[pos:] if calls else text
                return calls + ([rest] if final and rest.strip() else [])
            calls.append(call)
            pos = skip_space(text, end)
            if pos < len(text) and text[pos] == ",":
                pos += 1


# ---- the plan of one request -------------------------------------------------------------------------------------
@dataclass
class ToolPlan:
    """What a request's tools and tool_choice mean for its prompt, its constraint and its output."""
    render: list[dict[str, Any]]          # tools for the chat template (none: the prompt shows none)
    parser: Optional[ToolParser] = None   # reads calls out of the output (auto, required)
    named: Optional[str] = None           # the named function: the whole output is its arguments
    constraint: Optional[RequestConstraint] = None

    @property
    def parses(self) -> bool:
        return self.parser is not None or self.named is not None


def plan_tools(req: ChatCompletionRequest, parser: ToolParser) -> ToolPlan:
    """The plan for req's tools (400 for a tool_choice they cannot meet); parser reads tool_choice auto's calls."""
    tools, choice = req.tools or [], req.effective_tool_choice
    if choice != "none" and not tools:
        raise ApiError(400, "tool_choice needs tools; give tools or leave tool_choice out", "tool_choice")
    check_tools(tools)
    if choice == "none":
        return ToolPlan([])
    render = [t.as_template_dict() for t in tools]
    if choice == "auto":
        return ToolPlan(render, parser=parser)
    if choice == "required":
        schema, named = required_schema(tools, req.parallel_tool_calls is not False), None
        parser = RequiredCallsParser()
    else:
        named = choice.function.name         # type: ignore[union-attr]
        tool = next((t for t in tools if t.function.name == named), None)
        if tool is None:
            raise ApiError(400, f"tool_choice names the function {named!r}, which is not among the tools "
                                f"({', '.join(repr(t.function.name) for t in tools)})", "tool_choice")
        schema, parser = tool.function.parameters or NO_PARAMETERS, None
    # compact separators: a weak model under any-whitespace JSON can spend its tokens on blank lines
    constraint = RequestConstraint(json=schema, disable_any_whitespace=True, param="tools")
    return ToolPlan(render, parser=parser, named=named, constraint=constraint)
