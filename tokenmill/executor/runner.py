"""ModelRunner: a SchedulerOutput becomes one flattened batch, one forward pass, one sampler call (and, for pooling
requests, their rows of the final-norm hidden states reduced per request)."""
from __future__ import annotations

import concurrent.futures
import logging
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from tokenmill.config import EngineConfig
from tokenmill.executor.attention import AttentionMetadata, get_backend
from tokenmill.executor.batch import BatchBuilder, ForwardBatch, StepPlan, sampling_inputs
from tokenmill.executor.cpus import FixedThreads, ThreadGovernor
from tokenmill.executor.kv_cache import LayerKV
from tokenmill.executor.linear_states import LinearStates, snapshot_slots
from tokenmill.executor.lora import LoRASlots
from tokenmill.executor.memory import PageToucher, advise_huge_pages, keep_freed_memory
from tokenmill.executor.models.decoder import DecoderForCausalLM
from tokenmill.executor.sampler import PendingSample, Sampler, compute_prompt_logprobs
from tokenmill.executor.transfer import to_device
from tokenmill.outputs import Logprob
from tokenmill.scheduler_output import SchedulerOutput

log = logging.getLogger("tokenmill")


def accepted_length(guesses: tuple[int, ...], drawn: list[int]) -> int:
    """How many guesses stand: each must equal what the model drew at its position (drawn[j] follows guesses[:j])."""
    n = 0
    while n < len(guesses) and guesses[n] == drawn[n]:
        n += 1
    return n


@dataclass
class StepHandle:
    """A launched step: its plan, what it gave already (pooling, prompt logprobs) and its sampling under way."""
    plan: StepPlan
    out: "RunnerOutput"
    pending: Optional[PendingSample]


@dataclass
class RunnerOutput:
    # request id -> its new tokens: one, or with speculation the accepted guesses and one more
    sampled: dict[str, list[int]]
    logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)    # one per new token
    prompt_logprobs: dict[str, list[Optional[dict[int, Logprob]]]] = field(default_factory=dict)
    # pooling request id -> (first position of this chunk, its rows, float32 [hidden]: MEAN the chunk's row sum,
    # LAST its last row); the engine accumulates the chunks
    pooled: dict[str, tuple[int, int, torch.Tensor]] = field(default_factory=dict)


class ModelRunner:
    """The device-neutral runner: the KV cache, the attention backend, the request states and the step. A device's
    runner (CpuRunner, GpuRunner) decides how a step's batch reaches the model."""
    num_graph_steps = 0             # steps replayed from a captured graph (a GPU runner's)
    num_eager_decode_steps = 0      # decode-only steps that no captured graph held

    def __init__(self, config: EngineConfig, model: DecoderForCausalLM):
        self.config = config
        self.model = model
        self.device = config.device
        mc = config.model_config
        self.block_size = config.cache_config.block_size
        self.backend = get_backend(config.attention_backend, self.device, mc.num_attention_heads,
                                   mc.cache_kv_heads, mc.cache_head_dim, model.ops.kernels, mc.cache_value_dim,
                                   config.kv_cache_dtype, mc.rotary_dim if model.ops.name == "triton" else None)
        why_not = self.backend.kv_cache_dtype_error(config.kv_cache_dtype, self.device)
        if why_not is not None:
            raise ValueError(f"kv_cache_dtype={config.cache_config.cache_dtype!r} cannot be served by the "
                             f"{self.backend.name!r} attention backend: {why_not}; choose another kv_cache_dtype "
                             f"('auto' always works)")
        self.groups = mc.kv_groups
        self.num_blocks = 0
        self.kv_tensors: list[LayerKV] = []
        self.kv_caches: list[LayerKV] = []
        # the whole vocabulary, where a tensor-parallel rank's model holds its share of it
        vocab = mc.vocab_size * (model.ops.tp.size if model.ops.tp is not None else 1)
        self.sampler = Sampler(vocab, set(mc.eos_token_ids), model.ops.argmax)
        self.builder = BatchBuilder(self.block_size, len(self.groups.windows), self.device)
        lora = getattr(model, "lora_step", None)
        self.lora_slots = None if lora is None else LoRASlots(model, config.lora_config)
        # Qwen3.5's linear layers: a state slot a running request, beside the KV cache
        self.linear_states = LinearStates(mc, config.scheduler_config.max_num_seqs, config.dtype, self.device,
                                          snapshot_slots(config)) if mc.linear_layers else None

    def memory_reserved(self) -> int:
        """Bytes this runner needs on its device besides the weights and the KV cache (a GPU's graphs), counted
        before the KV cache is sized."""
        return 0

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One LayerKV per layer: K and V [slots, kv_heads, head_dim] (a flat view of [blocks, block_size, ...]),
        int8's scales. Untouched memory: attention reads only slots that this or an earlier step wrote. Layers in
        groups (layout.py's KVGroups): cache tensor j serves layer j of every group, at its group's blocks. Running
        out of memory is a ValueError that names the budget it tried."""
        mc, cfg = self.config.model_config, self.config
        try:
            self.kv_tensors = [LayerKV.allocate(self.num_slots(num_blocks), mc.cache_kv_heads, mc.cache_head_dim,
                                                cfg.kv_cache_dtype, self.device, mc.cache_value_dim)
                               for _ in range(self.groups.group_size)]
        except RuntimeError as e:       # torch.OutOfMemoryError on a GPU, the allocator's RuntimeError on CPU
            if not isinstance(e, torch.OutOfMemoryError) and "allocate" not in str(e):
                raise
            cc = cfg.cache_config
            asked = f"kv_cache_memory_gb={cc.kv_cache_memory_gb}" if cc.kv_cache_memory_gb is not None else \
                "a share of the free memory"
            gib = num_blocks * self.kv_bytes_per_block(cfg) / 2 ** 30
            raise ValueError(f"out of memory on {cfg.device} allocating the KV cache: {num_blocks:,} blocks of "
                             f"{cc.block_size} tokens, {gib:,.2f} GiB ({asked}); lower kv_cache_memory_gb, or free "
                             f"memory on the device") from None
        self.num_blocks = num_blocks
        self.kv_caches = [self.kv_tensors[j] for j in self.groups.layer_slot]
        self._checkpoint_kv_scales()
        self.backend.bind_kv_cache(self.kv_caches)

    def _checkpoint_kv_scales(self) -> None:
        """A checkpoint's static fp8 scales (llm-compressor's kv_cache_scheme: k_scale and v_scale a layer) into an
        fp8 cache, every kv head of a layer alike; a cache tensor that serves several layers (KV groups) takes the
        largest of theirs. A float cache leaves them unused, as vLLM does with kv_cache_dtype 'auto'."""
        scales = getattr(self.model, "kv_scales", None)
        if not scales:
            return
        if not self.config.kv_cache_dtype.startswith("fp8"):
            log.info("this checkpoint ships fp8 KV scales (k_scale, v_scale); kv_cache_dtype='fp8' would use them")
            return
        mc = self.config.model_config
        best: dict[int, tuple[float, float]] = {}
        for layer, (k, v) in scales.items():
            j = self.groups.layer_slot[mc.attention_index(layer)]
            a, b = best.get(j, (0.0, 0.0))
            best[j] = (max(a, k), max(b, v))
        for j, (k, v) in best.items():
            self.kv_tensors[j].k_scale.fill_(k)
            self.kv_tensors[j].v_scale.fill_(v)

    def warm_up(self) -> None:
        """Work done once before the first request (a GPU compiles its kernels and captures its graphs)."""

    def startup_line(self) -> Optional[str]:
        """What start-up did that an operator should see (a GPU's graphs: their sizes, capture time, memory)."""
        return None

    def num_slots(self, num_blocks: int) -> int:
        """The KV cache's slots for num_blocks blocks (a runner may keep more, for padding rows)."""
        return num_blocks * self.block_size

    @property
    def alive(self) -> bool:
        """Whether every process this runner computes with still runs (a tensor-parallel worker can die)."""
        return True

    def faulting_in_kv_cache(self) -> AbstractContextManager:
        """A context during which the KV cache's memory is made ready in the background, for work that leaves a
        core idle (start-up, a server waiting for requests); a no-op where nothing needs it."""
        return nullcontext()

    @staticmethod
    def kv_bytes_per_block(config: EngineConfig) -> int:
        """A block of tokens for one group's layers (all layers', where they form one group)."""
        mc = config.model_config
        per_slot = LayerKV.bytes_per_slot(mc.cache_kv_heads, mc.cache_head_dim, config.kv_cache_dtype,
                                          mc.cache_value_dim)
        return mc.kv_groups.group_size * config.cache_config.block_size * per_slot

    def forget(self, req_ids: list[str]) -> None:
        """Requests that finished: their state goes."""
        self.builder.forget(req_ids)
        if self.linear_states is not None:
            self.linear_states.free(req_ids)

    supports_async = False          # whether launch() may run ahead of the last step's finish()

    def execute(self, sched: SchedulerOutput, token_bitmasks: Optional[concurrent.futures.Future] = None
                ) -> RunnerOutput:
        """token_bitmasks: structured outputs' masks (request id -> packed row), being written while the model runs."""
        return self.finish(self.launch(sched, token_bitmasks))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, token_bitmasks: Optional[concurrent.futures.Future] = None
               ) -> StepHandle:
        """The step's forward pass and sampling, enqueued: finish() waits for its tokens. A runner that
        supports_async may launch the next step first; its rows whose tokens are this step's take them on the
        device."""
        plan = self._plan(sched)
        if self.linear_states is not None:
            self.linear_states.free(sched.finished_req_ids + sched.preempted_req_ids)
            self.model.linear_step = self.linear_states.step(plan, sched)
        if self.lora_slots is not None:
            self.model.lora_step.mapping = self.model.ops.lora_mapping(self.lora_slots.row_slots(plan), self.device,
                                                                       self.config.dtype)
        hidden = self._run(plan)
        out = RunnerOutput({})
        dev = self.device
        for st, row, count in plan.pooling:
            rows = hidden[row:row + count]
            # a copy: the rows may be a captured graph's output, which the next replay overwrites
            part = rows.float().sum(0) if st.pooling_type == "MEAN" else rows[-1].to(torch.float32, copy=True)
            out.pooled[st.req_id] = (st.num_computed_tokens, count, part)
        for st, row, count in plan.prompt_logprobs:
            logits = self._logits(hidden, torch.arange(row, row + count, device=dev))
            start = st.num_computed_tokens
            nxt = st.all_token_ids[start + 1:start + 1 + count]
            lp = compute_prompt_logprobs(logits, nxt, st.params.prompt_logprobs)
            out.prompt_logprobs[st.req_id] = ([None] if start == 0 else []) + lp
        pending = None
        if plan.samplers:
            logits = self._sample_logits(hidden, plan)                       # [S, V]
            masks = token_bitmasks.result() if token_bitmasks is not None else {}
            pending = self.sampler.sample(logits, sampling_inputs(plan, masks))
        self._launched(plan, pending)
        return StepHandle(plan, out, pending)

    def _launched(self, plan: StepPlan, pending: Optional[PendingSample]) -> None:
        """What a runner keeps of a step it launched (the GPU's: its tokens on the device, for the next step)."""

    def finish(self, handle: StepHandle) -> RunnerOutput:
        """The step's tokens (waiting for them), accepted guesses counted, recorded in the request states."""
        out, plan = handle.out, handle.plan
        if handle.pending is not None:
            res = handle.pending.result()
            row = 0
            verified = {}
            for st, guesses, _ in plan.samplers:
                drawn = res.token_ids[row:row + len(guesses) + 1]
                n = accepted_length(guesses, drawn) + 1
                out.sampled[st.req_id] = drawn[:n]
                if guesses:     # rows 0 .. n-1 stand: the token before the guesses and the n-1 guesses accepted
                    verified[st.req_id] = n
                if st.params.logprobs is not None:
                    out.logprobs[st.req_id] = res.logprobs[row:row + n]
                row += len(guesses) + 1
            if self.linear_states is not None and verified:
                self.linear_states.restore(verified)
        # into the states the step was planned with: a request gone meanwhile (and a new one of its id) is untouched
        self.builder.record(out.sampled, [st for st, _, _ in plan.samplers])
        return out

    def _plan(self, sched: SchedulerOutput) -> StepPlan:
        """The step's changes applied to the request states, and its batch built."""
        return self.builder.build(sched, self.builder.update(sched))

    def _run(self, plan: StepPlan) -> torch.Tensor:
        """The step's forward pass: the final-norm hidden states of its rows."""
        return self._forward(plan.batch)

    @torch.inference_mode()
    def calibrate_kv_scales(self, ids: list[int]) -> None:
        """calculate_kv_scales, before any request: ids run once into the cache's first blocks (each KV group its
        own), at the scales of 1.0; each cache tensor's scales then come from what it holds (LayerKV.calibrate, over
        every layer it serves). Those slots are left as they are: a request's attention reads only slots it wrote."""
        groups, nb = len(self.groups.windows), -(-len(ids) // self.block_size)
        batch, _ = self.builder.build_entries([(ids, 0, [list(range(g * nb, (g + 1) * nb)) for g in range(groups)])])
        self._forward(batch)
        slots = [torch.tensor(batch.slots(g), dtype=torch.long, device=self.device) for g in range(groups)]
        for j, cache in enumerate(self.kv_tensors):
            served = sorted({g for g, s in zip(self.groups.layer_group, self.groups.layer_slot) if s == j})
            cache.calibrate(torch.cat([slots[g] for g in served]))

    @torch.inference_mode()
    def last_logits(self, entries: list[tuple[list[int], int, list[list[int]]]]) -> torch.Tensor:
        """A draft model's pass: each entry's tokens (token ids, position of the first, its table of each KV group)
        are computed, their K/V written, and the logits of each entry's last token returned, [len(entries), V]."""
        batch, last_rows = self.builder.build_entries(entries)
        hidden = self._forward(batch)
        return self._logits(hidden, to_device(last_rows, self.device))

    def _sample_logits(self, hidden: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """float32 logits of the rows that sample."""
        return self._logits(hidden, to_device(plan.sample_rows, self.device))

    def _logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """float32 logits of these rows of the hidden states."""
        return self.model.compute_logits(hidden[rows])

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        """One forward pass over the flattened rows: the final-norm hidden states, [rows, hidden]."""
        raise NotImplementedError


class CpuRunner(ModelRunner):
    """The CPU's runner: the step's rows go to the model as host tensors; the KV cache's pages are faulted in while
    a core idles, on huge pages where the kernel gives them; a thread governor follows the cores this process may
    use."""

    def __init__(self, config: EngineConfig, model: DecoderForCausalLM,
                 threads: Union[ThreadGovernor, FixedThreads, None] = None):
        super().__init__(config, model)
        self.kv_pages = PageToucher(None, [])
        self.kv_block_bytes = 0           # bytes of one block in each of the KV cache's planes
        self.threads = threads or FixedThreads(torch.get_num_threads())

    def allocate_kv_cache(self, num_blocks: int) -> None:
        super().allocate_kv_cache(num_blocks)
        for kv in self.kv_tensors:
            for t in kv.tensors():
                advise_huge_pages(t)
        keep_freed_memory()
        # faulted in while the engine loads the tokenizer, and in a server between requests: start-up does not
        # wait for it. Only two full steps' worth of blocks past the highest block written so far: resident memory
        # follows the cache's use, not its budget
        planes = [t for kv in self.kv_tensors for t in kv.planes()]
        self.kv_block_bytes = planes[0].numel() * planes[0].element_size() // num_blocks if planes else 0
        ahead = -(-2 * self.config.scheduler_config.max_num_batched_tokens // self.block_size)
        self.kv_pages = PageToucher(self.model.ops.kernels, planes, ahead_bytes=ahead * self.kv_block_bytes)

    def faulting_in_kv_cache(self) -> AbstractContextManager:
        """The KV cache's pages faulted in on a background thread, the first blocks of every layer first (blocks are
        handed out from the lowest id up), resuming where the last one stopped. A no-op without the kernel
        library."""
        return self.kv_pages.running()

    def execute(self, sched: SchedulerOutput, token_bitmasks: Optional[concurrent.futures.Future] = None
                ) -> RunnerOutput:
        out = super().execute(sched, token_bitmasks)
        self.threads.tick()
        return out

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        bs = self.block_size
        high = max((max(table[start // bs:(end - 1) // bs + 1]) for tables in batch.tables
                    for table, start, end in zip(tables, batch.num_computed, batch.seq_lens) if end > start),
                   default=-1)
        self.kv_pages.use((high + 1) * self.kv_block_bytes)      # blocks are handed out from the lowest id up
        return forward_rows(self, batch)


def forward_rows(runner: ModelRunner, batch: ForwardBatch) -> torch.Tensor:
    """The batch's rows through the model from host lists: token ids, positions and each KV group's slots in one
    tensor (one copy to the device, pinned off CPU), the attention's metadata prepared from the lists."""
    rows = torch.tensor([batch.ids, batch.positions(), *(batch.slots(g) for g in range(len(runner.groups.windows)))],
                        dtype=torch.long)
    if runner.device.type == "cuda":
        rows = rows.pin_memory().to(runner.device, non_blocking=True)
    metas = [runner.backend.prepare(AttentionMetadata(
        slot_mapping=rows[2 + g], query_start_loc=batch.qsl, num_computed=batch.num_computed,
        seq_lens=batch.seq_lens, block_tables=batch.tables[g], block_size=runner.block_size, sliding_window=window,
        device=runner.device))
        for g, window in enumerate(runner.groups.windows)]
    return runner.model(rows[0], rows[1], runner.backend, metas)
