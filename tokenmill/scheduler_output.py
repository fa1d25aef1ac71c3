"""What the scheduler hands the runner each step, as plain data (vLLM v1's SchedulerOutput shape): the runner keeps
its own copy of each request's tokens, block tables and sampling state, so a step carries only what changed: a new
request once, then for every scheduled request its token count, its cache position and the block ids appended to its
tables. The engine's Request objects never cross into the runner."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from tokenmill.sampling_params import SamplingParams

MAX_SPECULATIVE_TOKENS = 16       # more guesses than this are rarely all right, and each costs a row of the batch
# per KV group: (how many leading entries of the runner's table still hold, the entries that follow them)
BlockDelta = tuple[int, tuple[int, ...]]


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has not seen: sent once, on its first step."""
    req_id: str
    prompt_token_ids: tuple[int, ...]
    params: Optional[SamplingParams]          # None: a pooling request
    pooling_type: Optional[str] = None        # LAST or MEAN, for a pooling request
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    lora: Any = None                          # its LoRA adapter (lora/adapter.py's LoRAAdapter), None: the base


@dataclass(frozen=True)
class ScheduledRequest:
    """One request of the step, in batch order."""
    req_id: str
    num_tokens: int                 # computed this step, guesses included
    num_computed_tokens: int        # in the KV cache before this step
    block_deltas: tuple[BlockDelta, ...]
    spec_token_ids: tuple[int, ...] = ()            # the guesses this step verifies
    spec_draft_probs: Optional[tuple[Any, ...]] = None   # a draft model's q [V] of each guess (tensors)
    new: Optional[NewRequestData] = None
    # linear-attention layers' state snapshots (engine/state_snapshots.py): the slot a prefix hit resumes from, and
    # (tokens into this step's rows, slot) of each point where the state after those tokens is kept, in order
    state_load: Optional[int] = None
    state_save: tuple[tuple[int, int], ...] = ()


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)     # gone since the last step: the runner forgets them
    preempted_req_ids: list[str] = field(default_factory=list)    # their blocks went back (they keep their state)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    # prefix blocks the KV offload tiers hold: (the pool's block ids, their payloads), written into the cache
    # before the step's forward
    kv_loads: list[tuple[tuple[int, ...], tuple[Any, ...]]] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
