"""The runner's side of the requests, and the one batch builder every device's runner uses.

RequestState is what the runner keeps of a request between steps: its tokens, its block table of each KV group and
its sampling state (a seeded generator). BatchBuilder applies each SchedulerOutput to those states (new requests,
block ids appended, requests gone) and flattens the step into a ForwardBatch: every scheduled token of every request
in one row order, each row's position and KV slot, and the attention's entries (a request, or one row of a
verification) with their query starts, cached lengths and tables. Plain lists: a device's runner moves them (or only
what changed) to its device."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from tokenmill.executor.sampler import SamplingInput, make_generator
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler_output import MAX_SPECULATIVE_TOKENS, ScheduledRequest, SchedulerOutput

# up to this many new tokens of a request attend as one-token decodes (the decode kernels' path, cheaper for few
# rows): as many as a verification or a draft's catch-up after one (the guesses and one more)
FEW_ROWS = MAX_SPECULATIVE_TOKENS + 1


@dataclass
class RequestState:
    req_id: str
    prompt_token_ids: list[int]
    params: Optional[SamplingParams]            # None: a pooling request
    pooling_type: Optional[str] = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    generator: Optional[torch.Generator] = None
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)      # each KV group's block table
    num_computed_tokens: int = 0
    lora: Any = None                            # its LoRA adapter (LoRAAdapter), None: the base model

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_pooling(self) -> bool:
        return self.params is None


@dataclass
class ForwardBatch:
    """One forward pass's rows, flattened: token ids; the attention's entries (query start offsets, tokens cached
    before, lengths after, each KV group's tables, and the index of the request each entry belongs to in the step's
    order). A row's position and KV slot follow from its entry (positions(), slots())."""
    ids: list[int]
    qsl: list[int]
    num_computed: list[int]
    seq_lens: list[int]
    tables: list[list[list[int]]]
    block_size: int
    entry_req: list[int] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return len(self.ids)

    @property
    def num_entries(self) -> int:
        return len(self.seq_lens)

    @property
    def decode_only(self) -> bool:
        """Every entry has one query row (decodes, verification rows)."""
        return self.num_entries == self.num_rows

    def add_rows(self, start: int, count: int, tables: list[list[int]], one_row_each: bool,
                 req: Optional[int] = None) -> None:
        """The attention's entries of count rows of a request from position start (their token ids are added
        apart): one entry, or one a row, each seeing the rows before it (a verification's, a draft's catch-up: the
        decode kernels serve those, the cheaper path)."""
        for first, n in ((start + j, 1) for j in range(count)) if one_row_each else ((start, count),):
            self.qsl.append(self.qsl[-1] + n)
            self.num_computed.append(first)
            self.seq_lens.append(first + n)
            if req is not None:
                self.entry_req.append(req)
            for g, table in enumerate(tables):
                self.tables[g].append(table)

    def positions(self) -> list[int]:
        return [p for start, end in zip(self.num_computed, self.seq_lens) for p in range(start, end)]

    def slots(self, group: int) -> list[int]:
        """Each row's KV slot in the group's blocks."""
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for table, start, end in zip(self.tables[group], self.num_computed,
                                                                         self.seq_lens) for p in range(start, end)]


@dataclass
class StepPlan:
    """What a step does with the forward pass's rows besides attending: which rows sample (the last row of each
    request that reached its end, and each guessed row), which rows give prompt logprobs, which rows a pooling request
    reduces."""
    batch: ForwardBatch
    states: list[RequestState] = field(default_factory=list)     # the step's requests, in batch order
    sample_rows: list[int] = field(default_factory=list)
    samplers: list[tuple[RequestState, tuple[int, ...], Optional[tuple]]] = field(default_factory=list)
    prompt_logprobs: list[tuple[RequestState, int, int]] = field(default_factory=list)    # (state, row, count)
    pooling: list[tuple[RequestState, int, int]] = field(default_factory=list)
    # async scheduling: (row, request id) of the rows whose token the last launched step is still sampling
    in_flight: list[tuple[int, str]] = field(default_factory=list)


class BatchBuilder:
    def __init__(self, block_size: int, num_groups: int, device: torch.device):
        self.block_size = block_size
        self.num_groups = num_groups
        self.device = device                        # where seeded requests' generators draw
        self.states: dict[str, RequestState] = {}

    def update(self, sched: SchedulerOutput) -> list[RequestState]:
        """Apply a step's changes; the scheduled requests' states, in batch order."""
        self.forget(sched.finished_req_ids)
        states = []
        for s in sched.scheduled:
            st = self.states.get(s.req_id) if s.new is None else self._add(s)
            for table, (keep, new) in zip(st.tables, s.block_deltas):
                del table[keep:]
                table.extend(new)
            st.num_computed_tokens = s.num_computed_tokens
            states.append(st)
        return states

    def forget(self, req_ids: list[str]) -> None:
        for rid in req_ids:
            self.states.pop(rid, None)

    def _add(self, s: ScheduledRequest) -> RequestState:
        n = s.new
        generator = make_generator(n.params.seed, self.device) if n.params is not None else None
        st = RequestState(n.req_id, list(n.prompt_token_ids), n.params, n.pooling_type,
                          [list(w) for w in n.bad_words_token_ids], generator, [], list(n.prompt_token_ids),
                          [[] for _ in range(self.num_groups)], lora=n.lora)
        self.states[n.req_id] = st
        return st

    @staticmethod
    def record(sampled: dict[str, list[int]], states: list[RequestState]) -> None:
        """The tokens a step gave each of its requests' states (as the engine appends them)."""
        for st in states:
            toks = sampled.get(st.req_id)
            if toks is not None:
                st.output_token_ids.extend(toks)
                st.all_token_ids.extend(toks)

    def _empty(self) -> ForwardBatch:
        return ForwardBatch([], [0], [], [], [[] for _ in range(self.num_groups)], self.block_size)

    def build(self, sched: SchedulerOutput, states: list[RequestState]) -> StepPlan:
        plan = StepPlan(self._empty(), states)
        ids, qsl = plan.batch.ids, plan.batch.qsl
        for i, (st, s) in enumerate(zip(states, sched.scheduled)):
            start = s.num_computed_tokens
            end = start + s.num_tokens
            guesses = s.spec_token_ids
            known = st.all_token_ids[start:end - len(guesses)]
            ids.extend(known)
            if end - len(guesses) - start > len(known):         # the last launched step's token, not back yet
                plan.in_flight.append((len(ids), st.req_id))
                ids.append(0)
            ids.extend(guesses)
            # a verification's rows attend each as a decode that sees the guesses before it
            plan.batch.add_rows(start, s.num_tokens, st.tables, bool(guesses), i)
            row = qsl[-1] - s.num_tokens          # the request's first row
            if st.is_pooling:                  # no logits: its rows of the hidden states are the output
                plan.pooling.append((st, row, s.num_tokens))
                continue
            if st.params.prompt_logprobs is not None and start < st.num_prompt_tokens - 1 \
                    and not st.output_token_ids:
                plan.prompt_logprobs.append((st, row, min(end, st.num_prompt_tokens - 1) - start))
            if end - len(guesses) >= st.num_tokens:    # reached the end of what is known: sample the next token
                # and, verifying guesses, the token after each one
                plan.sample_rows.extend(range(qsl[-1] - 1 - len(guesses), qsl[-1]))
                plan.samplers.append((st, guesses, s.spec_draft_probs))
        return plan

    def build_entries(self, entries: list[tuple[list[int], int, list[list[int]]]]) -> tuple[ForwardBatch, list[int]]:
        """A draft model's pass: each entry's tokens (token ids, position of the first, its table of each KV group).
        Returns the batch and each entry's last row."""
        batch, last_rows = self._empty(), []
        for toks, start, req_tables in entries:
            batch.ids.extend(toks)
            # a catch-up of a few tokens attends as that many one-token decodes, as verification rows do
            batch.add_rows(start, len(toks), req_tables, len(toks) <= FEW_ROWS)
            last_rows.append(batch.qsl[-1] - 1)
        return batch, last_rows


def sampling_inputs(plan: StepPlan, masks: dict) -> list[SamplingInput]:
    """One SamplingInput a sampled row: a guessed position samples as if the guesses before it were the request's
    tokens already; a draft model's guess brings the distribution it was drawn from."""
    return [SamplingInput(st.params, st.prompt_token_ids,
                          st.output_token_ids + list(guesses[:j]) if j else st.output_token_ids, st.generator,
                          st.bad_words_token_ids, masks.get(st.req_id),
                          *((guesses[j], probs[j]) if j < len(guesses) and probs is not None else ()))
            for st, guesses, probs in plan.samplers for j in range(len(guesses) + 1)]
