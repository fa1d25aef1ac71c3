"""Tool-call parsers (vLLM's --tool-call-parser): a model's tool-call syntax read out of its text.

parse(text, final) returns the text as pieces: content strings and ToolCalls, in order. It is prefix-stable: as the
text grows, the pieces found so far stay (the last content piece may only grow), and text that may still become a
call is held back until it is known, so a stream sends each piece's growth once and ends with what the whole text
gives. A call whose JSON does not parse stays content, as it was written."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Union


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str        # JSON text, as OpenAI's function.arguments


Piece = Union[str, ToolCall]


class ToolParser:
    name = "base"
    tags: tuple[str, ...] = ()      # texts parse() looks for: kept where the tokenizer makes them special tokens

    def parse(self, text: str, final: bool = True) -> list[Piece]:
        raise NotImplementedError


def tool_call(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters"),
              need_args: bool = False) -> Optional[ToolCall]:
    """A ToolCall from a decoded {"name": ..., "arguments": {...}}, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in args_keys if k in obj), None)
    if key is None and need_args:
        return None
    args = {} if key is None else obj[key]
    if isinstance(args, str):              # already JSON text (some models write it so)
        return ToolCall(obj["name"], args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def skip_space(text: str, pos: int) -> int:
    """The first position at or after pos that is not whitespace."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def content_of(pieces: list[Piece]) -> str:
    return "".join(p for p in pieces if isinstance(p, str))


def calls_of(pieces: list[Piece]) -> list[ToolCall]:
    return [p for p in pieces if isinstance(p, ToolCall)]


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()


def parser_for_template(template: Any) -> str:
    """The parser a chat template's tool syntax asks for: <tool_call> is Hermes (Qwen and many more), Llama 3's
    <|python_tag|> / ipython role is llama3_json, harmony's <|channel|> is openai (gpt-oss); hermes otherwise (the
    default tool prompt asks for it)."""
    text = json.dumps(template) if isinstance(template, dict) else str(template or "")
    if "<|channel|>" in text:
        return "openai"
    if "<tool_call>" in text:
        return "hermes"
    if "<|python_tag|>" in text or "ipython" in text:
        return "llama3_json"
    return "hermes"


# the parsers import this module's names above, so they come last
from tokenmill.tool_parsers.hermes import HermesToolParser  # noqa: E402
from tokenmill.tool_parsers.llama3_json import Llama3JsonToolParser  # noqa: E402
from tokenmill.tool_parsers.openai import OpenAIToolParser  # noqa: E402

TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser,
                                                                   OpenAIToolParser)}
TOOL_PARSER_NAMES = tuple(sorted(TOOL_PARSERS))
