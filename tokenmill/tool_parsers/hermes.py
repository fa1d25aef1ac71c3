"""Hermes tool calls (Qwen2.5/3, NousResearch Hermes, and tokenmill's default tool prompt):
<tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number, with text around them."""
from __future__ import annotations

import json

from tokenmill.reasoning import partial_suffix
from tokenmill.tool_parsers import Piece, ToolCall, ToolParser, tool_call

START, END = "<tool_call>", "</tool_call>"


def _call(body: str) -> ToolCall | None:
    try:
        return tool_call(json.loads(body))
    except ValueError:
        return None


class HermesToolParser(ToolParser):
    name = "hermes"
    tags = (START, END)

    def parse(self, text: str, final: bool = True) -> list[Piece]:
        pieces: list[Piece] = []
        pos = 0
        while True:
            i = text.find(START, pos)
            if i < 0:
                tail = text[pos:]
                if not final:
                    tail = tail[:len(tail) - partial_suffix(tail, START)]
                after_call = bool(pieces) and isinstance(pieces[-1], ToolCall)
                # blank text next to calls is layout, not content; elsewhere it is kept once it is known
                if tail.strip() or (final and not after_call):
                    pieces.append(tail)
                return _merged(pieces)
            j = text.find(END, i + len(START))
            if j < 0 and not final:
                # an open call: its JSON is not known yet; text before it is known if it is not blank
                if text[pos:i].strip():
                    pieces.append(text[pos:i])
                return _merged(pieces)
            stop = len(text) if j < 0 else j + len(END)
            call = _call(text[i + len(START):j if j >= 0 else len(text)])
            before = text[pos:i]
            after_call = bool(pieces) and isinstance(pieces[-1], ToolCall)
            if before.strip() or (call is None and not after_call and before):
                pieces.append(before)
            pieces.append(call if call is not None else text[i:stop])
            pos = stop


def _merged(pieces: list[Piece]) -> list[Piece]:
    """Adjacent content pieces as one (a call that did not parse sits between texts as text)."""
    out: list[Piece] = []
    for p in pieces:
        if isinstance(p, str) and out and isinstance(out[-1], str):
            out[-1] += p
        else:
            out.append(p)
    return out
