"""Incremental, UTF-8-safe detokenization of one request's output, with stop strings and stream hold-back.

Each new token is decoded in a small window of recent ids (vLLM's prefix/read offsets): the text of
ids[prefix:read] is already emitted, decode(ids[prefix:]) minus decode(ids[prefix:read]) is the new text.
Decoding with a little left context keeps tokenizer-specific joins (leading spaces, byte fallback) right,
and the cost per token stays O(window), not O(sequence).
"""
from __future__ import annotations

from typing import Any, Optional

from tokenmill.sampling_params import SamplingParams

# prompt tokens decoded as left context for the first output token (vLLM uses 5 as well)
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self.skip_special_tokens = params.skip_special_tokens
        self.enabled = params.detokenize
        # the Rust backend's decode is ~4x faster than the Python wrapper and never "cleans up" spaces,
        # which would make window decodes disagree with a full decode
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self.token_ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.num_output_tokens = 0
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self._text = ""
        self.stop: list[str] = list(params.stop or [])
        # streamed text stays this far behind so a stop string that completes later is never sent
        self.stop_buffer_length = (max(map(len, self.stop)) - 1
                                   if self.stop and not params.include_stop_str_in_output else 0)
        self._stop_check_offset = 0  # stop strings may only start matching in text produced after min_tokens
        self.stop_reason: Optional[str] = None
        self._last_delta_offset = 0
        self._flushed = False

    @property
    def output_text(self) -> str:
        return self._text

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _decode_next(self) -> str:
        """Text added by the tokens after read_offset; "" (offsets unmoved) while it ends mid-character."""
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return full[len(prefix):]

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> Optional[str]:
        """Append tokens and extend output_text. Returns the stop string matched (output_text is then cut
        before it, or after it with include_stop_str_in_output), else None.

        stop_terminated: the last new token is an EOS / stop token id; its text is then left out unless
        include_stop_str_in_output (vLLM's behaviour)."""
        if not self.enabled or self.stop_reason is not None:
            return None
        if stop_terminated and new_token_ids and not self.params.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        checked = len(self._text)
        for tok in new_token_ids:
            self.token_ids.append(tok)
            self.num_output_tokens += 1
            self._text += self._decode_next()
            if self.num_output_tokens <= self.params.min_tokens:
                self._stop_check_offset = len(self._text)
        if not self.stop or self.num_output_tokens <= self.params.min_tokens:
            return None
        return self._check_stop(checked)

    def _check_stop(self, checked: int) -> Optional[str]:
        """Text before `checked` was searched already, so a new match must end after it; of several
        matches the one that ends first (then starts first) wins: generation would have stopped there."""
        best: Optional[tuple[int, str]] = None
        for s in self.stop:
            i = self._text.find(s, max(self._stop_check_offset, checked - len(s) + 1))
            if i != -1 and (best is None or (i + len(s), i) < (best[0] + len(best[1]), best[0])):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self._text = self._text[: i + len(s) if self.params.include_stop_str_in_output else i]
        self.stop_reason = s
        return s

    def _flush(self) -> None:
        """At the end, text still held for an incomplete UTF-8 character is emitted as tokenizer.decode
        would show it (with U+FFFD), so the output matches a full decode."""
        if self._flushed or self.stop_reason is not None or not self.enabled:
            return
        self._flushed = True
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        if len(full) > len(prefix):
            self._text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text safe to stream: while running, the last stop_buffer_length characters are held back (they
        could still become a stop string); when finished, everything. delta=True: only text since the last
        delta call (concatenated deltas == final output_text); delta=False: all safe text so far."""
        if finished:
            self._flush()
        safe = len(self._text) if finished else max(len(self._text) - self.stop_buffer_length, 0)
        if not delta:
            return self._text[:safe]
        start = self._last_delta_offset
        if safe <= start:
            return ""
        self._last_delta_offset = safe
        return self._text[start:safe]
