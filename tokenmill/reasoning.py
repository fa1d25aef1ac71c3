"""Reasoning parsers (vLLM's --reasoning-parser): where a model's thinking starts and ends.

The engine uses end_token to start a request's structured-output constraint only after the thinking ends; the
server uses split() to part the text into reasoning_content and content. split() is prefix-stable: for a text that
only grows, each part only grows (text that may be the start of a tag is held back until it is known), so a stream
can send the parts' growth as deltas and end with what a whole-text split gives."""
from __future__ import annotations

from typing import Optional


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of text that is a proper start of tag (text to hold back while streaming)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningParser:
    """Thinking between start_token and end_token, as Qwen3 and DeepSeek-R1 write it."""
    name = "base"
    start_token = "<think>"
    end_token = "</think>"
    # the chat template may already have opened the thinking in the prompt, so the output starts inside it
    starts_in_reasoning = False
    # start_token and end_token are one token each, which the engine's structured outputs wait on
    one_token_tags = True

    @classmethod
    def tags(cls) -> tuple[str, ...]:
        """The texts split() looks for: the server keeps them where the tokenizer makes them special tokens."""
        return cls.start_token, cls.end_token

    @classmethod
    def split(cls, text: str, final: bool = True) -> tuple[Optional[str], str]:
        """(reasoning or None when the text has no thinking, content). Not final: only what is known so far."""
        body = text.lstrip()
        if body.startswith(cls.start_token):
            return cls._until_end(body[len(cls.start_token):], final)
        if not final and cls.start_token.startswith(body):
            return ("" if cls.starts_in_reasoning else None), ""       # may still become <think>: wait
        if cls.starts_in_reasoning:
            return cls._until_end(text, final)
        return None, text

    @classmethod
    def _until_end(cls, body: str, final: bool) -> tuple[Optional[str], str]:
        i = body.find(cls.end_token)
        if i >= 0:
            return body[:i], body[i + len(cls.end_token):]
        hold = 0 if final else partial_suffix(body, cls.end_token)
        return body[:len(body) - hold], ""


class Qwen3ReasoningParser(ReasoningParser):
    """Thinking only where the output opens it with <think>; otherwise all is content (thinking turned off)."""
    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    """R1's template opens <think> in the prompt: everything up to </think> is thinking (all of it, without one)."""
    name = "deepseek_r1"
    starts_in_reasoning = True


class GptOssReasoningParser(ReasoningParser):
    """gpt-oss's harmony replies (harmony.py): the analysis channel's messages are the reasoning; the final
    channel's bodies, preambles (commentary to no one) and text outside messages are the content, and a message to a
    recipient (a tool call) stays in the content as written, for the tool-call parser. Its thinking ends in several
    tokens, so a structured-output constraint cannot wait for it."""
    name = "openai_gptoss"
    one_token_tags = False
    start_token = "<|channel|>analysis<|message|>"
    end_token = "<|end|>"

    @classmethod
    def tags(cls) -> tuple[str, ...]:
        from tokenmill.harmony import TAGS
        return TAGS

    @classmethod
    def split(cls, text: str, final: bool = True) -> tuple[Optional[str], str]:
        from tokenmill import harmony
        reasoning, content, thought = [], [], False
        for it in harmony.parse(text, final):
            if isinstance(it, harmony.Text):
                content.append(it.text)
            elif it.recipient is not None:      # opened by a <|start|>, so the tool parser reads it apart
                content.append(it.raw if it.raw.startswith(harmony.START) else harmony.START + "assistant" + it.raw)
            elif it.channel == "analysis":
                thought = True
                reasoning.append(it.body)
            else:
                content.append(it.body)
        return ("".join(reasoning) if thought else None), "".join(content)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser, GptOssReasoningParser)}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(sorted(REASONING_PARSERS))}") \
            from None
