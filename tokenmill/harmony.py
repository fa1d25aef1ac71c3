"""OpenAI's harmony format (gpt-oss) read out of a reply's text: messages, each an optional `<|start|>role`, a header
(`<|channel|>name`, ` to=recipient`, `<|constrain|>type`), `<|message|>`, a body, and `<|end|>`, `<|call|>` or
`<|return|>`. The reply's first message has no `<|start|>`: the prompt opened it.

parse() is prefix-stable as the other parsers are (tool_parsers/__init__.py): for a growing text the items found
stay, the last may only grow, and text that may still become a tag or a message's header is held back until it is
known. Text that is not harmony stays as Text, never dropped; the server logs it once."""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Optional, Union

from tokenmill.reasoning import partial_suffix

log = logging.getLogger("tokenmill")

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
TAGS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
_TERMINATORS = (END, CALL, RETURN, START)          # a body ends at the first of these (START: one left open)
# the parts of a header after its role: channel, recipient, constraint, content type, or anything else (not one)
_HEADER_PART = re.compile(r"<\|channel\|>(\w+)|to=([^\s<]+)|<\|constrain\|>([\w/.-]+)|([\w/.-]+)|(\S)")


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Message:
    channel: Optional[str]
    recipient: Optional[str]
    body: str
    raw: str                # the message's text as written (its terminator included, where it has come)
    closed: bool            # its terminator has come


Item = Union[Text, Message]


def _header(header: str) -> Optional[tuple[Optional[str], Optional[str]]]:
    """(channel, recipient) of a header, or None when it is not one."""
    fields: dict[str, Optional[str]] = {"channel": None, "to": None}
    rest = header.strip()
    m = re.match(r"<\|start\|>\w+", rest)
    if m:
        rest = rest[m.end():]
    for part in _HEADER_PART.finditer(rest):
        # a content type ("json") follows the channel or recipient; a word before them is not a header's
        if part.group(5) is not None or (part.group(4) and fields["channel"] is None and fields["to"] is None):
            return None
        if part.group(1):
            fields["channel"] = part.group(1)
        elif part.group(2):
            fields["to"] = part.group(2)
    if fields["channel"] is None and fields["to"] is None:
        return None
    return fields["channel"], fields["to"]


_RECIPIENT = " to="          # the reply's first header may name its recipient before its channel


def _held(text: str, header: bool = False) -> int:
    """How much of text's end may be the start of a tag (header: or of a recipient)."""
    return max(partial_suffix(text, t) for t in TAGS + ((_RECIPIENT,) if header else ()))


def parse(text: str, final: bool = True) -> list[Item]:
    items: list[Item] = []
    pos = 0
    while pos < len(text):
        mi = text.find(MESSAGE, pos)
        if mi < 0:
            tail = text[pos:]
            if not final:       # a header may be coming: keep back from its first tag, or a tag's start
                cut = min([i for i in (tail.find(START), tail.find(CHANNEL), tail.find(_RECIPIENT)) if i >= 0] or
                          [len(tail) - _held(tail, header=True)])
                tail = tail[:cut]
            if tail:
                items.append(Text(tail))
            break
        header = text[pos:mi]
        s = header.find(START)
        if s > 0:                        # plain text before the next message
            items.append(Text(header[:s]))
            pos += s
            header = header[s:]
        fields = _header(header)
        body_at = mi + len(MESSAGE)
        if fields is None:               # not a header we read: as it was written
            items.append(Text(text[pos:body_at]))
            pos = body_at
            continue
        ends = [(i, t) for t in _TERMINATORS if (i := text.find(t, body_at)) >= 0]
        if ends:
            end, tag = min(ends)
            stop = end if tag == START else end + len(tag)
            items.append(Message(fields[0], fields[1], text[body_at:end], text[pos:stop], True))
            pos = stop
            continue
        body = text[body_at:]
        if not final:
            body = body[:len(body) - _held(body)]
        items.append(Message(fields[0], fields[1], body, text[pos:body_at] + body, final))
        break
    return items


def log_unread(text: str) -> None:
    """Log a whole reply that held text outside any harmony message (it is returned as content, as written)."""
    stray = [it.text for it in parse(text) if isinstance(it, Text) and it.text.strip()]
    if stray:
        log.warning("a harmony reply held text outside its messages, returned as content: %r", stray[0][:80])
