"""Speculative decoding: cheap guesses of a request's next tokens, verified by one pass of the model.

On a CPU one decode step is bound by reading the weights, so verifying k guessed tokens in the same pass as the
next token costs about as much as that token alone: every accepted guess is a step saved. The n-gram method
(vLLM's "ngram", prompt lookup) guesses from the request's own text: when its last n tokens appeared before, the
tokens that followed then are the guess. Input-grounded work (editing code, answering over a document) repeats
long spans of the prompt, and the lookup finds them for free.

Verification (executor/runner.py) samples every guessed position from the target model exactly as an unguessed
step would, and accepts guesses while they equal those samples. For a proposer whose guess is one token with
certainty (n-gram), that is rejection sampling's degenerate case: a guess d is accepted with probability p(d), and on
rejection the sample is distributed as p without d, renormalised; so outputs follow the target distribution, and
greedy outputs are the tokens decoding without guesses gives. A seeded request draws once for each guessed
position too, so its seed gives other (equally distributed) text than without speculation. The inter-token
latencies recorded are per step, as vLLM's: a step that accepts guesses records one for all its tokens.

The draft-model method (engine/draft_model.py) guesses with a smaller model of the same vocabulary, sampling each guess
from its own distribution q; verification then accepts a guess d with probability min(1, p(d)/q(d)) and on rejection
samples the normalised residual max(0, p - q) (executor/sampler.py), which again gives exactly p.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Union

from tokenmill.scheduler_output import MAX_SPECULATIVE_TOKENS

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
    "prompt_lookup_max": 4}, or {"method": "draft_model", "model": PATH, "num_speculative_tokens": k}."""
    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: Optional[str] = None          # the draft model (draft_model only): a folder or GGUF file

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method {self.method!r} is unknown; accepted: "
                             f"{', '.join(METHODS)}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config.model names the draft model: give it with method 'draft_model' "
                             "(and only then)")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config.model must be a path, got {type(self.model).__name__}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in [1, "
                             f"{MAX_SPECULATIVE_TOKENS}], got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in (lo, hi)) or lo > hi:
            raise ValueError(f"speculative_config needs integers 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{lo!r} and {hi!r}")

    @staticmethod
    def of(value: Union["SpeculativeConfig", dict, str, None]) -> Optional["SpeculativeConfig"]:
        """From the engine option: a SpeculativeConfig, a dict or its JSON text (--speculative-config)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"speculative_config is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        fields = set(SpeculativeConfig.__dataclass_fields__)
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ValueError(f"speculative_config has unknown field(s) {', '.join(unknown)}; it takes "
                             f"{', '.join(sorted(fields))}")
        if "model" in value and "method" not in value:    # vLLM infers the method from a draft model
            value = {**value, "method": "draft_model"}
        return SpeculativeConfig(**value)


class NgramIndex:
    """Where each n-gram of a request's tokens last ended (the position after it) and where it ended the time before,
    built as the tokens grow, so a lookup costs O(prompt_lookup_max) however long the request is."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.ends: dict[tuple[int, ...], tuple[int, int]] = {}    # n-gram -> (latest end, the one before or -1)
        self.indexed = 0                  # n-grams ending before this position are in ends

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix, as far as they
        agree with what followed the occurrence before it: where two earlier continuations part (a field's value in
        a list of records), a guess would be a coin toss, and a wrong one costs a row of the batch."""
        last = len(tokens) - 1           # the suffix itself ends at last; index only what ends before it
        for end in range(self.indexed, last):
            for n in range(self.lo, min(self.hi, end + 1) + 1):
                key = tuple(tokens[end + 1 - n:end + 1])
                self.ends[key] = (end + 1, self.ends.get(key, (-1, -1))[0])
        self.indexed = max(self.indexed, last)
        for n in range(min(self.hi, len(tokens)), self.lo - 1, -1):
            pos, before = self.ends.get(tuple(tokens[len(tokens) - n:]), (None, -1))
            if pos is not None:
                guess = tokens[pos:pos + k]
                if before >= 0:
                    agree = 0
                    while agree < len(guess) and tokens[before + agree] == guess[agree]:
                        agree += 1
                    guess = guess[:agree]
                return guess
        return []


def guess_room(req: Any, k: int, max_model_len: int) -> int:
    """How many guesses a request may take after this step: at most k, none past its max_tokens or max_model_len, and
    none for a request that is not decoding or is under a grammar (its mask for a guessed position would need the
    guesses before it)."""
    if req.is_pooling or req.grammar is not None or req.num_computed_tokens != req.num_tokens - 1:
        return 0
    return max(0, min(k, req.max_tokens - len(req.output_token_ids) - 1, max_model_len - req.num_tokens - 1))


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len

    def propose(self, reqs: list[Any]) -> None:
        """Set spec_token_ids of each request in reqs (the running ones)."""
        cfg = self.config
        for req in reqs:
            req.spec_token_ids = []
            room = guess_room(req, cfg.num_speculative_tokens, self.max_model_len)
            if room <= 0:
                continue
            if req.ngram_index is None:
                req.ngram_index = NgramIndex(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            req.spec_token_ids = req.ngram_index.propose(req.all_token_ids, room)
