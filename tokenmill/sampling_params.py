"""SamplingParams with vLLM's names and meanings."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Optional, Union


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's names): exactly one of json (a JSON schema: dict, str or pydantic model
    class), regex, choice (the output is one of these strings), grammar (EBNF, as xgrammar and llama.cpp's GBNF
    write it) or json_object (any JSON object)."""
    json: Optional[Union[str, dict, Any]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    # JSON without free whitespace between tokens. Either way an object takes only the properties its schema names,
    # unless the schema sets additionalProperties (xgrammar's strict mode, as vLLM runs it)
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, type) and hasattr(self.json, "model_json_schema"):
            self.json = self.json.model_json_schema()      # a pydantic model class
        given = self._given()
        if len(given) != 1:
            raise ValueError("StructuredOutputsParams needs exactly one of json, regex, choice, grammar or "
                             f"json_object, got {given or 'none'}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(f"StructuredOutputsParams.json must be a JSON schema (an object), got "
                             f"{type(self.json).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError("StructuredOutputsParams.regex must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("StructuredOutputsParams.grammar must be a non-empty EBNF string")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            raise ValueError("StructuredOutputsParams.choice must be a non-empty list of non-empty strings")
        if self.json_object not in (None, True, False):
            raise ValueError("StructuredOutputsParams.json_object must be true or false")

    def _given(self) -> list[str]:
        # json=False is a schema (that admits nothing); json_object=False is no constraint
        return [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None] + \
            (["json_object"] if self.json_object else [])

    @property
    def kind(self) -> str:
        return self._given()[0]

    def key(self) -> tuple:
        """What identifies the compiled grammar (the compile cache's key)."""
        spec = getattr(self, self.kind)
        if self.kind == "json":
            spec = json.dumps(spec, sort_keys=True)
        elif self.kind == "choice":
            spec = tuple(spec)
        return self.kind, spec, self.disable_any_whitespace


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 or -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: Optional[StructuredOutputsParams] = None
    # vLLM's extra_args: what a connector reads, such as "kv_transfer_params" (engine/kv_transfer.py)
    extra_args: Optional[dict[str, Any]] = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        if self.top_k == -1:
            self.top_k = 0
        self._verify()

    def _verify(self) -> None:
        def bad(name: str, rule: str) -> None:
            raise ValueError(f"SamplingParams.{name} must be {rule}, got {getattr(self, name)!r}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(name, "a finite number")
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "an integer >= 1")
        if self.temperature < 0:
            bad("temperature", ">= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "an integer >= 1, or 0 / -1 to disable")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "in [0, 1]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "> 0 (1 = off)")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "in [-2, 2]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"<= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            bad("logprobs", "an integer >= 0")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0):
            bad("prompt_logprobs", "an integer >= 0")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "an integer")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            bad("stop", "a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "a list of non-negative integers")
        if self.allowed_token_ids is not None and (
                len(self.allowed_token_ids) == 0
                or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)):
            bad("allowed_token_ids", "a non-empty list of non-negative token ids (or None)")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or any(
                    isinstance(t, bool) or not isinstance(t, int) or t < 0
                    or isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b)
                    for t, b in self.logit_bias.items()):
                bad("logit_bias", "a dict of non-negative token id -> finite bias")
        if any(not isinstance(w, str) or w.strip() == "" for w in self.bad_words):
            bad("bad_words", "a list of non-blank strings")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "a StructuredOutputsParams or None")
        if not self.detokenize and self.stop:
            bad("stop", "empty when detokenize=False (stop strings need the text)")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def reads_history(self) -> bool:
        """Whether sampling a token reads the tokens before it on the host (penalties, bad words, min_tokens, a
        grammar): such a step cannot be scheduled before the last one's tokens are known (async scheduling)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.bad_words) or self.min_tokens > 0 or self.structured_outputs is not None)
