"""ModelRunner: a SchedulerOutput becomes one flattened batch, one forward pass, one sampler call (and, for pooling
requests, their rows of the final-norm hidden states reduced per request)."""
from __future__ import annotations

import concurrent.futures
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.scheduler import SchedulerOutput
from tokenmill.engine.spec_decode import MAX_SPECULATIVE_TOKENS
from tokenmill.executor.cpus import FixedThreads, ThreadGovernor
from tokenmill.executor.memory import PageToucher, advise_huge_pages, keep_freed_memory
from tokenmill.executor.attention import AttentionMetadata, get_backend
from tokenmill.executor.kv_cache import LayerKV
from tokenmill.executor.models.decoder import DecoderForCausalLM
from tokenmill.executor.sampler import Sampler, SamplingInput, compute_prompt_logprobs
from tokenmill.outputs import Logprob


# up to this many new tokens of a request attend as one-token decodes (the decode kernels' path, cheaper for few
# rows): as many as a verification or a draft's catch-up after one (the guesses and one more)
FEW_ROWS = MAX_SPECULATIVE_TOKENS + 1


def accepted_length(guesses: list[int], drawn: list[int]) -> int:
    """How many guesses stand: each must equal what the model drew at its position (drawn[j] follows guesses[:j])."""
    n = 0
    while n < len(guesses) and guesses[n] == drawn[n]:
        n += 1
    return n


@dataclass
class RunnerOutput:
    # request id -> its new tokens: one, or with speculation the accepted guesses and one more
    sampled: dict[str, list[int]]
    logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)    # one per new token
    prompt_logprobs: dict[str, list[Optional[dict[int, Logprob]]]] = field(default_factory=dict)
    # pooling request id -> (first position of this chunk, float32 [hidden]: MEAN the chunk's row sum, LAST its
    # last row); the engine accumulates the chunks
    pooled: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: DecoderForCausalLM, num_blocks: int,
                 threads: Union[ThreadGovernor, FixedThreads, None] = None):
        self.config = config
        self.model = model
        self.device = config.device
        mc = config.model_config
        self.block_size = config.cache_config.block_size
        self.backend = get_backend(config.attention_backend, self.device, mc.num_attention_heads,
                                   mc.cache_kv_heads, mc.cache_head_dim, model.ops.kernels, mc.attn_logit_softcapping,
                                   any(w is not None for w in mc.layer_windows), mc.cache_value_dim,
                                   config.kv_cache_dtype)
        why_not = self.backend.kv_cache_dtype_error(config.kv_cache_dtype, self.device)
        if why_not is not None:
            raise ValueError(f"kv_cache_dtype={config.cache_config.cache_dtype!r} cannot be served by the "
                             f"{self.backend.name!r} attention backend: {why_not}; choose another kv_cache_dtype "
                             f"('auto' always works)")
        # one LayerKV per layer: K and V [num_blocks * block_size, kv_heads, head_dim] (flat slots), int8's scales.
        # Untouched memory: start-up does not wait for the whole budget to be touched (kv_pages faults it in while
        # the engine loads the tokenizer, and in a server between requests);
        # attention reads only slots that this or an earlier step wrote (padding repeats a real slot)
        # layers in groups (layout.py's KVGroups): cache tensor j serves layer j of every group, at its group's blocks
        self.groups = mc.kv_groups
        tensors = [LayerKV.allocate(num_blocks * self.block_size, mc.cache_kv_heads, mc.cache_head_dim,
                                    config.kv_cache_dtype, self.device, mc.cache_value_dim)
                   for _ in range(self.groups.group_size)]
        self.kv_caches = [tensors[j] for j in self.groups.layer_slot]
        for kv in tensors:
            for t in kv.tensors():
                advise_huge_pages(t)
        if self.device.type == "cpu":
            keep_freed_memory()
        self.backend.bind_kv_cache(self.kv_caches)
        self.kv_pages = PageToucher(model.ops.kernels, [t for kv in tensors for t in kv.planes()])
        # the whole vocabulary, where a tensor-parallel rank's model holds its share of it
        vocab = mc.vocab_size * (model.ops.tp.size if model.ops.tp is not None else 1)
        self.sampler = Sampler(vocab, set(mc.eos_token_ids), model.ops.argmax)
        self.threads = threads or FixedThreads(torch.get_num_threads())

    @property
    def alive(self) -> bool:
        """Whether every process this runner computes with still runs (a tensor-parallel worker can die)."""
        return True

    def faulting_in_kv_cache(self) -> AbstractContextManager:
        """A context during which the KV cache's pages are faulted in on a background thread, the first blocks of
        every layer first (blocks are handed out from the lowest id up), resuming where the last one stopped: for
        work that leaves a core idle (start-up, a server waiting for requests). A no-op off CPU, or without the
        kernel library."""
        return self.kv_pages.running()

    @staticmethod
    def kv_bytes_per_block(config: EngineConfig) -> int:
        """A block of tokens for one group's layers (all layers', where they form one group)."""
        mc = config.model_config
        per_slot = LayerKV.bytes_per_slot(mc.cache_kv_heads, mc.cache_head_dim, config.kv_cache_dtype,
                                          mc.cache_value_dim)
        return mc.kv_groups.group_size * config.cache_config.block_size * per_slot

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, block_tables: list[list[list[int]]],
                token_bitmasks: Optional[concurrent.futures.Future] = None) -> RunnerOutput:
        """block_tables: each request's table of each KV group; token_bitmasks: structured outputs' masks (request
        id -> packed row), being written while the model runs."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[list[int]] = [[] for _ in self.groups.windows]
        qsl = [0]
        num_computed, seq_lens = [], []
        sample_rows: list[int] = []        # row of each sampling request's last token
        sample_reqs = []
        prompt_lp_reqs = []                # (request, first row, number of rows) wanting prompt logprobs
        pool_reqs = []                     # (request, first row, number of rows) of pooling requests
        bs = self.block_size
        # the attention's entries (one a request, or one a row of a verification): their tables, per group
        tables: list[list[list[int]]] = [[] for _ in self.groups.windows]
        for req, n, req_tables in zip(sched.reqs, sched.num_scheduled, block_tables):
            start = req.num_computed_tokens
            end = start + n
            guesses = sched.spec_token_ids.get(req.request_id, [])
            ids.extend(req.all_token_ids[start:end - len(guesses)] + guesses)
            pos.extend(range(start, end))
            for g, table in enumerate(req_tables):
                slots[g].extend(table[p // bs] * bs + p % bs for p in range(start, end))
            # a verification's rows attend as that many decodes of one token, each seeing the guesses before it:
            # the decode kernels serve them (they write every row's K/V before reading), the cheaper path
            for first, count in ((start + j, 1) for j in range(n)) if guesses else ((start, n),):
                qsl.append(qsl[-1] + count)
                num_computed.append(first)
                seq_lens.append(first + count)
                for g, table in enumerate(req_tables):
                    tables[g].append(table)
            if req.is_pooling:                 # no logits: its rows of the hidden states are the output
                pool_reqs.append((req, qsl[-2], n))
                continue
            if req.params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1 \
                    and not req.output_token_ids:
                prompt_lp_reqs.append((req, qsl[-2], min(end, req.num_prompt_tokens - 1) - start))
            if end - len(guesses) == req.num_tokens:   # reached the end of what is known: sample the next token
                # and, verifying guesses, the token after each one
                sample_rows.extend(range(qsl[-1] - 1 - len(guesses), qsl[-1]))
                sample_reqs.append((req, guesses))
        dev = self.device
        hidden = self._forward(ids, pos, slots, qsl, num_computed, seq_lens, tables)
        out = RunnerOutput({})
        for req, row, count in pool_reqs:
            rows = hidden[row:row + count]
            part = rows.float().sum(0) if req.pooling_type == "MEAN" else rows[-1].float()
            out.pooled[req.request_id] = (req.num_computed_tokens, part)
        for req, row, count in prompt_lp_reqs:
            logits = self._logits(hidden, torch.arange(row, row + count, device=dev))
            start = req.num_computed_tokens
            nxt = req.all_token_ids[start + 1:start + 1 + count]
            lp = compute_prompt_logprobs(logits, nxt, req.params.prompt_logprobs)
            out.prompt_logprobs[req.request_id] = ([None] if start == 0 else []) + lp
        if sample_reqs:
            logits = self._logits(hidden, torch.tensor(sample_rows, device=dev))   # [S, V]
            masks = token_bitmasks.result() if token_bitmasks is not None else {}
            # a guessed position samples as if the guesses before it were the request's tokens already; a draft
            # model's guess brings the distribution it was drawn from
            inputs = [SamplingInput(r.params, r.prompt_token_ids, r.output_token_ids + guesses[:j] if j else
                                    r.output_token_ids, r.generator, r.bad_words_token_ids, masks.get(r.request_id),
                                    *((guesses[j], r.spec_draft_probs[j]) if j < len(guesses) and
                                      r.spec_draft_probs is not None else ()))
                      for r, guesses in sample_reqs for j in range(len(guesses) + 1)]
            res = self.sampler(logits, inputs)
            row = 0
            for r, guesses in sample_reqs:
                drawn = res.token_ids[row:row + len(guesses) + 1]
                n = accepted_length(guesses, drawn) + 1
                out.sampled[r.request_id] = drawn[:n]
                if r.params.logprobs is not None:
                    out.logprobs[r.request_id] = res.logprobs[row:row + n]
                row += len(guesses) + 1
        self.threads.tick()
        return out

    @torch.inference_mode()
    def last_logits(self, entries: list[tuple[list[int], int, list[list[int]]]]) -> torch.Tensor:
        """A draft model's pass: each entry's tokens (token ids, position of the first, its table of each KV group)
        are computed, their K/V written, and the logits of each entry's last token returned, [len(entries), V]."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[list[int]] = [[] for _ in self.groups.windows]
        qsl = [0]
        num_computed, seq_lens, last_rows = [], [], []
        tables: list[list[list[int]]] = [[] for _ in self.groups.windows]
        bs = self.block_size
        for toks, start, req_tables in entries:
            ids.extend(toks)
            pos.extend(range(start, start + len(toks)))
            for g, table in enumerate(req_tables):
                slots[g].extend(table[p // bs] * bs + p % bs for p in range(start, start + len(toks)))
            # a catch-up of a few tokens attends as that many one-token decodes, as verification rows do
            for first, count in (((start + j, 1) for j in range(len(toks))) if len(toks) <= FEW_ROWS
                                 else ((start, len(toks)),)):
                qsl.append(qsl[-1] + count)
                num_computed.append(first)
                seq_lens.append(first + count)
                for g, table in enumerate(req_tables):
                    tables[g].append(table)
            last_rows.append(qsl[-1] - 1)
        hidden = self._forward(ids, pos, slots, qsl, num_computed, seq_lens, tables)
        return self._logits(hidden, torch.tensor(last_rows, device=self.device))

    def _logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """float32 logits of these rows of the hidden states."""
        return self.model.compute_logits(hidden[rows])

    def _forward(self, ids: list[int], pos: list[int], slots: list[list[int]], qsl: list[int],
                 num_computed: list[int], seq_lens: list[int], tables: list[list[list[int]]]) -> torch.Tensor:
        """One forward pass over the flattened rows: the final-norm hidden states, [rows, hidden]. slots and
        tables: each KV group's."""
        dev = self.device
        # token ids, positions and each group's KV slots go to the device in one copy
        rows = torch.tensor([ids, pos, *slots], dtype=torch.long)
        if dev.type == "cuda":
            rows = rows.pin_memory().to(dev, non_blocking=True)
        metas = [self.backend.prepare(AttentionMetadata(
            slot_mapping=rows[2 + g], query_start_loc=qsl, num_computed=num_computed, seq_lens=seq_lens,
            block_tables=tables[g], block_size=self.block_size, sliding_window=window, device=dev))
            for g, window in enumerate(self.groups.windows)]
        return self.model(rows[0], rows[1], self.backend, metas)
