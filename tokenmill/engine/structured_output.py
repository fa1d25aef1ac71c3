"""Structured outputs: a request's grammar (JSON schema, regex, choice, EBNF) as a token mask, with xgrammar.

xgrammar is what vLLM and SGLang use by default, and it runs on CPU: a grammar compiles once against the tokenizer's
vocabulary (cached by its spec), and each request then walks it with its own matcher. Before a constrained request
samples, its matcher writes a bitmask of the tokens the grammar allows next; the sampler sets the others to -inf.
The masks of a step are written on a worker thread while the forward pass of that step runs (both release the
GIL). Requests without a constraint cost nothing.

Compiles run in worker processes (grammar_worker.py), at most max_concurrent_compiles at once: xgrammar cannot
stop a compile, so one past compile_timeout_s has its process killed, and the workers run at the lowest CPU
priority so that a hostile schema does not slow everyone else's steps.

Preemption recomputes a request from its tokens so far and keeps its output, so its matcher stays where it was.
With a reasoning parser, a request's constraint starts after the model's thinking: at once if the prompt closed
it, after </think> if the prompt opened it or the output does, and otherwise the first token may open it.
"""
from __future__ import annotations

import concurrent.futures
import logging
import pickle
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from tokenmill.engine.grammar_worker import (CompileError, CompilePool, CompileTimeout, Job, compile_grammar,
                                             compile_request, xgrammar_message)
from tokenmill.executor.cpus import available_cpus
from tokenmill.reasoning import get_reasoning_parser
from tokenmill.sampling_params import StructuredOutputsParams

log = logging.getLogger("tokenmill.structured_output")
MAX_GRAMMARS = 512          # compiled grammars kept (by spec), least recently used dropped first


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """vLLM's structured_outputs_config: the grammar backend, and the reasoning parser whose end-of-thinking token
    starts the constraint. compile_timeout_s bounds one grammar's compile, counted from the request's arrival, its
    wait for a compile worker included (a request over it is refused, and its compile killed).
    max_concurrent_compiles: compile worker processes at most (default: the cores this process may use).
    json_whitespace_limit caps each run of free whitespace in JSON, as llama.cpp's JSON grammars do (a newline and
    up to 20 of indent): a small model at temperature 1 can otherwise write whitespace until max_tokens. None: no cap,
    as vLLM."""
    backend: str = "xgrammar"
    reasoning_parser: Optional[str] = None
    compile_timeout_s: float = 10.0
    json_whitespace_limit: Optional[int] = 21
    max_concurrent_compiles: int = field(default_factory=available_cpus)

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "xgrammar"):
            raise ValueError(f"structured_outputs_config.backend must be 'xgrammar' (or 'auto'), got {self.backend!r}")
        if not self.compile_timeout_s > 0:
            raise ValueError(f"structured_outputs_config.compile_timeout_s must be > 0, got {self.compile_timeout_s}")
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)
        if self.json_whitespace_limit is not None and (
                not isinstance(self.json_whitespace_limit, int) or self.json_whitespace_limit < 1):
            raise ValueError(f"structured_outputs_config.json_whitespace_limit must be an integer >= 1 or None, got "
                             f"{self.json_whitespace_limit!r}")
        if isinstance(self.max_concurrent_compiles, bool) or not isinstance(self.max_concurrent_compiles, int) \
                or self.max_concurrent_compiles < 1:
            raise ValueError(f"structured_outputs_config.max_concurrent_compiles must be an integer >= 1 (compiles "
                             f"run at once; leave it out for the core count), got {self.max_concurrent_compiles!r}")


THINKING, MAY_THINK, ACTIVE = "thinking", "may think", "active"


class RequestGrammar:
    """One request's place in its grammar. While the model thinks (reasoning models) it allows everything; before
    the first token of a reasoning model it allows the grammar's first tokens and the start of thinking."""

    def __init__(self, matcher: Any, think: Optional[tuple[int, int]], state: str):
        self.matcher = matcher
        self.think = think          # (start, end) token ids of thinking, with a reasoning parser
        self.state = state

    @property
    def active(self) -> bool:
        """Whether a mask applies to the next token."""
        return self.state != THINKING

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.state == MAY_THINK:
            start = self.think[0]
            bitmask[row, start // 32] |= _bit(start % 32)

    def accept(self, token_id: int) -> bool:
        """Advance past token_id; False if the grammar does not allow it."""
        if self.state == THINKING:
            if token_id == self.think[1]:       # the end token itself is the thinking's, not the answer's
                self.state = ACTIVE
            return True
        if self.state == MAY_THINK:
            if token_id == self.think[0]:
                self.state = THINKING
                return True
            self.state = ACTIVE
        return self.matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return self.state == ACTIVE and self.matcher.is_terminated()


def _bit(i: int) -> int:
    """Bit i of an int32 bitmask word, as a signed int32 value (bit 31 is the sign)."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i


class StructuredOutputManager:
    """Compiles grammars (cached, time-limited, in worker processes; thread-safe: the server compiles off the engine
    thread) and writes the token bitmasks of a step on a worker thread."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 config: StructuredOutputsConfig = StructuredOutputsConfig()):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.config = config
        self._lock = threading.Lock()
        self._info: Any = None                     # xgrammar's TokenizerInfo, built at the first constrained request
        self._compiler: Any = None                 # and its GrammarCompiler, for the quick grammars' second compile
        self._start_message: Optional[bytes] = None
        # reasoning: (start, end) token ids, checked now so that a model that does not think fails at start
        self._think = None if config.reasoning_parser is None else self._reasoning_tokens()
        if config.reasoning_parser is not None and self._think is None:
            log.info("reasoning parser %r: a structured-output constraint applies from the reply's first token "
                     "(its thinking does not end in one token)", config.reasoning_parser)
        # spec key -> its compile; the most recently used last, at most MAX_GRAMMARS
        self._compiled: OrderedDict[tuple, Job] = OrderedDict()
        self.compile_pool = CompilePool(config.max_concurrent_compiles, self._worker_start_message, self._rebuild)
        # the workers stop with this manager, or at the process's exit, if shutdown() was not called
        self._close_pool = weakref.finalize(self, self.compile_pool.close)
        self._mask_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenmill-bitmask")

    def shutdown(self) -> None:
        """Stop the compile workers now; compiles under way or queued are refused."""
        self._close_pool()

    # ---- compiling (any thread) -------------------------------------------------------------------------------
    def _tokenizer_info(self) -> Any:
        with self._lock:
            if self._info is None:
                import xgrammar as xgr
                if self.tokenizer is None:
                    raise ValueError("structured outputs need the model's tokenizer, and this model folder has none")
                self._info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                                stop_token_ids=self.stop_token_ids or None)
            return self._info

    def _worker_start_message(self) -> bytes:
        """What a compile worker starts from: the vocabulary, the stop tokens, the whitespace cap."""
        info = self._tokenizer_info()
        with self._lock:
            if self._start_message is None:
                self._start_message = pickle.dumps({
                    "tokenizer_info": info.serialize_json(), "stop_token_ids": self.stop_token_ids,
                    "json_whitespace_limit": self.config.json_whitespace_limit})
            return self._start_message

    def _rebuild(self, request: bytes, text: Optional[str]) -> Any:
        """A grammar a worker compiled: read from its serialized text, or (None) compiled again here."""
        import xgrammar as xgr
        info = self._tokenizer_info()
        if text is not None:
            return xgr.CompiledGrammar.deserialize_json(text, info)
        with self._lock:
            if self._compiler is None:      # no cache of its own: _compiled is the cache, bounded
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        try:
            return compile_grammar(self._compiler, request, self.config.json_whitespace_limit)
        except (RuntimeError, ValueError, TypeError) as e:
            raise CompileError(xgrammar_message(e)) from None

    def warm_up(self) -> None:
        """Start the compile workers now, so that the first constrained requests do not wait for them."""
        self._tokenizer_info()
        self.compile_pool.warm_up()

    def _reasoning_tokens(self) -> Optional[tuple[int, int]]:
        parser = get_reasoning_parser(self.config.reasoning_parser or "")
        if not parser.one_token_tags:
            return None
        if self.tokenizer is None:
            raise ValueError("a reasoning parser reads the model's tokenizer, and this model folder has none")
        ids = []
        for text in (parser.start_token, parser.end_token):
            tok = self.tokenizer.encode(text, add_special_tokens=False)
            if len(tok) != 1:
                raise ValueError(f"reasoning parser {parser.name!r}: {text!r} is not one token in this model's "
                                 f"vocabulary, so the model does not think that way; leave reasoning_parser out")
            ids.append(tok[0])
        return ids[0], ids[1]

    def compile(self, so: StructuredOutputsParams) -> Any:
        """The compiled grammar of so (ValueError if it is invalid or takes longer than compile_timeout_s)."""
        key = so.key()
        self._tokenizer_info()          # no tokenizer: the ValueError here, not in a worker
        with self._lock:
            job = self._compiled.get(key)
            if job is None:
                try:
                    job = self.compile_pool.submit(compile_request(key), self.config.compile_timeout_s)
                except CompileError as e:
                    raise ValueError(f"structured_outputs.{so.kind}: {e}") from None
                self._compiled[key] = job
                while len(self._compiled) > MAX_GRAMMARS:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(key)
        try:
            return job.result()
        except (CompileTimeout, CompileError) as e:
            with self._lock:             # not cached: the same spec later compiles afresh
                if self._compiled.get(key) is job:
                    del self._compiled[key]
            if isinstance(e, CompileError):
                raise ValueError(f"structured_outputs.{so.kind}: {e}") from None
            raise ValueError(f"structured_outputs.{so.kind}: the grammar did not compile within "
                             f"{self.config.compile_timeout_s:g} s (structured_outputs_config.compile_timeout_s, "
                             f"its wait for one of the max_concurrent_compiles="
                             f"{self.config.max_concurrent_compiles} compile workers included); simplify it") from None

    def new_request_grammar(self, so: StructuredOutputsParams, prompt_token_ids: Sequence[int]) -> RequestGrammar:
        """A matcher at the grammar's start. With a reasoning parser: thinking if the prompt opened it, active if
        the prompt closed it (a template that turns thinking off writes an empty <think></think>), else the first
        token may open it."""
        import xgrammar as xgr
        matcher = xgr.GrammarMatcher(self.compile(so), override_stop_tokens=self.stop_token_ids or None)
        if self._think is None:
            return RequestGrammar(matcher, None, ACTIVE)
        last = next((t for t in reversed(prompt_token_ids) if t in self._think), None)
        state = MAY_THINK if last is None else THINKING if last == self._think[0] else ACTIVE
        return RequestGrammar(matcher, self._think, state)

    # ---- bitmasks (the engine thread submits, the worker writes) ---------------------------------------------
    def fill_bitmasks(self, grammars: dict[str, RequestGrammar]) -> Optional[concurrent.futures.Future]:
        """Start writing the masks of the requests that sample this step under an active grammar. The future gives
        request id -> [ceil(vocab / 32)] int32 row (bit set: the token is allowed)."""
        active = {rid: g for rid, g in grammars.items() if g.active}
        if not active:
            return None
        return self._mask_pool.submit(self._fill, active)

    def _fill(self, grammars: dict[str, RequestGrammar]) -> dict[str, torch.Tensor]:
        bitmask = torch.empty(len(grammars), -(-self.vocab_size // 32), dtype=torch.int32)
        for row, g in enumerate(grammars.values()):
            g.fill(bitmask, row)
        return dict(zip(grammars, bitmask.unbind(0)))
