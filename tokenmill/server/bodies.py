"""Why a request body cannot be read: bytes that are not UTF-8, JSON nested past what the parser takes, text that
no tokenizer can encode. Each answer names where the problem is, so a client knows what to change."""
from __future__ import annotations

import json
from typing import Any, Optional

# a depth the parser always reads (Python's gives up near its recursion limit, about 1000, less deep in a call)
MAX_JSON_DEPTH = 500


def json_depth(body: bytes) -> tuple[int, int]:
    """(deepest nesting, the byte offset where it first reached MAX_JSON_DEPTH + 1 or -1), skipping strings."""
    depth = deepest = 0
    at, in_str, escaped = -1, False, False
    for i, c in enumerate(body):
        if in_str:
            if escaped:
                escaped = False
            elif c == 0x5C:      # backslash
                escaped = True
            elif c == 0x22:      # quote
                in_str = False
        elif c == 0x22:
            in_str = True
        elif c in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > deepest:
                deepest = depth
                if depth == MAX_JSON_DEPTH + 1 and at < 0:
                    at = i
        elif c in (0x5D, 0x7D):  # ] }
            depth -= 1
    return deepest, at


def explain_unparsable(body: bytes) -> Optional[str]:
    """What is wrong with a body the JSON parser refused with something other than a syntax error, or None."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = body[e.start:e.end].hex(" ")
        return (f"the request body is not valid UTF-8: byte {e.start} (0x{bad}) {e.reason}; send JSON encoded as "
                f"UTF-8")
    try:
        json.loads(text)
    except RecursionError:
        deepest, at = json_depth(body)
        return (f"the request body nests JSON arrays and objects {deepest} levels deep (level {MAX_JSON_DEPTH + 1} "
                f"at byte {at}); send at most {MAX_JSON_DEPTH} levels")
    except ValueError as e:
        return f"the request body is not valid JSON: {e}"
    return None


def _lone_surrogate(text: str) -> Optional[str]:
    """Why text is not valid Unicode (a lone UTF-16 surrogate), or None; the check runs in C."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"the text holds a lone UTF-16 surrogate (\\u{ord(text[e.start]):04x}) at character {e.start}, which "
                f"is not a Unicode character; escape characters outside the BMP as a surrogate pair")
    return None


def unencodable(value: Any) -> Optional[tuple[str, str]]:
    """(the field, why) for the first string in value that is not valid Unicode text: a lone UTF-16 surrogate
    (JSON's "\\ud800" escape parses, but no tokenizer or UTF-8 encoder takes it); None if all are valid. Walked
    with a stack, not recursion: a body may nest as deep as the JSON parser reads."""
    todo: list[tuple[str, Any]] = [("", value)]
    while todo:
        path, v = todo.pop()
        if isinstance(v, str):
            why = _lone_surrogate(v)
            if why is not None:
                return path or "body", why
        elif isinstance(v, (dict, list)):
            items = list(v.items() if isinstance(v, dict) else enumerate(v))
            for k, item in reversed(items):      # reversed: the first field is reported first
                if isinstance(k, str) and _lone_surrogate(k) is not None:
                    return path or "body", _lone_surrogate(k).replace("the text", "a key")
                # messages.0.content, as the validation errors name fields
                todo.append((f"{path}.{k}" if path else str(k), item))
    return None
