"""Llama 3.1/3.2 JSON tool calls: the reply is {"name": ..., "parameters": {...}} (or "arguments"), optionally after
<|python_tag|>, several separated by ";". Calls stand at the start of the reply; text that follows them, or a
call that does not parse and all after it, is content."""
from __future__ import annotations

import json

from tokenmill.tool_parsers import Piece, ToolParser, skip_space, tool_call

PYTHON_TAG = "<|python_tag|>"
_decoder = json.JSONDecoder()


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool = True) -> list[Piece]:
        pos = skip_space(text, 0)
        head = text[pos:]
        if not final and (not head or PYTHON_TAG.startswith(head)):
            return []                            # may still become a call
        if head.startswith(PYTHON_TAG):
            pos = skip_space(text, pos + len(PYTHON_TAG))
        elif not head.startswith("{"):
            return [text] if text else []
        pieces: list[Piece] = []
        while True:
            if pos >= len(text):
                # the calls so far; a reply that is only a tag is content
                return pieces if pieces or not final else ([text] if text else [])
            try:
                obj, end = _decoder.raw_decode(text, pos)
            except ValueError:
                if not final:
                    return pieces                # an object still being written
                obj, end = None, pos
            call = tool_call(obj, need_args=True)
            if call is None:
                return pieces + [text if not pieces else text[pos:]]
            pieces.append(call)
            pos = skip_space(text, end)
            if pos < len(text) and text[pos] == ";":
                pos = skip_space(text, pos + 1)
            elif pos < len(text):
                return pieces + [text[pos:]]
