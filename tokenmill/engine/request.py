"""A request's state as the scheduler sees it: token ids, how many are in the KV cache, status, timings."""
from __future__ import annotations

import enum
from typing import Any, Optional

import torch

from tokenmill.outputs import Logprob, RequestMetrics
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: Optional[SamplingParams],
                 arrival_time: float, max_tokens: int, eos_token_ids: tuple[int, ...], prompt: Optional[str] = None,
                 bad_words_token_ids: Optional[list[list[int]]] = None,
                 pooling_params: Optional[PoolingParams] = None, pooling_type: str = "LAST",
                 cache_salt: Optional[str] = None, lora: Any = None):
        self.request_id = request_id
        self.group_id = request_id        # the user's request this sequence is one of (n > 1: the parent's id)
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params                              # None for a pooling request: it samples nothing
        # a pooling request runs its prompt as a prefill and finishes when the last prompt token is computed
        self.pooling_params = pooling_params
        self.pooling_type = pooling_type
        self.pooled: Optional[torch.Tensor] = None        # MEAN: the sum of the rows so far; LAST: the last row
        self.max_tokens = max_tokens                      # params.max_tokens, capped by max_model_len
        self.eos_token_ids = eos_token_ids
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1                       # prefix-cache hit length, set at first scheduling
        # vLLM's cache_salt: joins the first block's hash, so only requests with the same salt share cached blocks
        # (one client cannot learn from cached_tokens what another sent)
        self.cache_salt = cache_salt
        # its LoRA adapter (lora/adapter.py's LoRAAdapter; None: the base model): keys its prefix-cache blocks too
        self.lora = lora
        self.kv_transfer_params: Optional[dict] = None     # a prefill instance's: the transfer of its KV, once sent
        self.status = RequestStatus.WAITING
        self.stop_reason: Optional[int | str] = None
        self.num_preemptions = 0
        self.bad_words_token_ids = bad_words_token_ids or []
        self.metrics = RequestMetrics(arrival_time=arrival_time, num_prompt_tokens=len(prompt_token_ids))
        self.logprobs: list[dict[int, Logprob]] = []
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list[Optional[dict[int, Logprob]]] = []
        self.detokenizer: Any = None                      # set by the engine when text is wanted
        self.grammar: Any = None                          # structured outputs: its RequestGrammar
        # speculative decoding: the guessed next tokens (verified by the next step, never in all_token_ids), and where
        # they come from
        self.spec_token_ids: list[int] = []
        self.spec_draft_probs: Optional[list[torch.Tensor]] = None    # a draft model's q of each guess (sampling)
        self.ngram_index: Any = None
        # what the runner holds of it: whether it was sent, and how many leading entries of each KV group's block
        # table it has (a step sends the rest)
        self.runner_knows = False
        self.blocks_synced: list[int] = []
        # async scheduling: tokens sampled by launched steps whose results are not back yet (at most two: the step
        # on the device and the one just scheduled)
        self.num_in_flight = 0

    @property
    def lora_key(self) -> Optional[tuple]:
        return None if self.lora is None else self.lora.cache_key

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """vLLM's flag: a prefix hit skips computing tokens, and MEAN pooling needs the hidden state of every one."""
        return self.pooling_params is not None and self.pooling_type == "MEAN"

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop output tokens past the first num_output_tokens (a step that verified guesses stopped before them)."""
        extra = len(self.output_token_ids) - num_output_tokens
        if extra > 0:
            del self.output_token_ids[-extra:]
            del self.all_token_ids[-extra:]

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
