"""gpt-oss's tool calls in harmony (harmony.py): a message to `functions.NAME`, its body the arguments' JSON, ended by
<|call|>. Final-channel bodies and preambles (commentary to no one) are content, analysis is left to the reasoning
parser, and anything else (text outside messages, a built-in tool's message, arguments that are not a JSON object)
stays content as it was written."""
from __future__ import annotations

import json

from tokenmill import harmony
from tokenmill.tool_parsers import Piece, ToolCall, ToolParser


def _call(msg: harmony.Message) -> ToolCall | None:
    if not (msg.recipient or "").startswith("functions.") or len(msg.recipient or "") == len("functions."):
        return None
    try:
        args = json.loads(msg.body)
    except ValueError:
        return None
    return ToolCall(msg.recipient[len("functions."):], msg.body.strip()) if isinstance(args, dict) else None


class OpenAIToolParser(ToolParser):
    name = "openai"
    tags = harmony.TAGS

    def parse(self, text: str, final: bool = True) -> list[Piece]:
        pieces: list[Piece] = []

        def add(s: str) -> None:
            if s and pieces and isinstance(pieces[-1], str):
                pieces[-1] += s
            elif s:
                pieces.append(s)
        for it in harmony.parse(text, final):
            if isinstance(it, harmony.Text):
                add(it.text)
            elif it.recipient is not None:
                if not (it.closed or final):
                    break                       # its arguments are not known yet
                call = _call(it)
                if call is None:
                    add(it.raw)
                else:
                    pieces.append(call)
            elif it.channel != "analysis":
                add(it.body)
        return pieces
