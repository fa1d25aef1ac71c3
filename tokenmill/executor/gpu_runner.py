"""The GPU's runner: a resident batch, graphs captured at start, one upload a step.

The block tables live on the device between steps, a row of them per running request (and one, the sink row, whose
every entry is the sink block: padding rows write there and attend nothing). A step sends only what changed: its
token ids, each attention entry's resident row, cached length and length, the query starts, and the table entries
appended since the last step, packed into one pinned buffer and copied in one transfer. Positions and KV slots are
computed on the device from those.

A decode-only step (one query row an entry: decodes and verification rows) of up to the largest captured size
replays the graph of the smallest size that holds it, padded with rows that write the sink block and attend
nothing; the graph holds the whole forward, embedding to logits. Other steps run eagerly through the same code.
Off a GPU (tests) the graphs are traced stand-ins (graphs.py), which freeze what a CUDA graph freezes.

A backend that cannot prepare from the device (torch's, for latent attention) gets the step as host lists, eagerly,
as the CPU runner gives it; so does a draft model's pass (last_logits), whose tables are its own."""
from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from typing import Optional

import numpy as np
import torch

from tokenmill.config import EngineConfig
from tokenmill.executor.attention.backend import DeviceBatch
from tokenmill.executor.batch import ForwardBatch, StepPlan
from tokenmill.executor.graphs import frozen_gc, graph_class
from tokenmill.executor.models.decoder import DecoderForCausalLM
from tokenmill.executor.runner import ModelRunner, forward_rows
from tokenmill.executor.transfer import to_device
from tokenmill.scheduler_output import MAX_SPECULATIVE_TOKENS, SchedulerOutput

log = logging.getLogger("tokenmill")
# the warm-up steps' rows: Triton compiles a kernel again for integer arguments of 1 and of multiples of 16, so
# a step of each kind compiles what a request will launch (a prompt of 17 rows: a whole tile and part of the next)
WARM_ROWS = (1, 16, 17)


class GpuRunner(ModelRunner):
    def __init__(self, config: EngineConfig, model: DecoderForCausalLM, resident: bool = True):
        """resident=False: every step from host lists (a draft model's runner, whose passes bring their tables)."""
        super().__init__(config, model)
        sc = config.scheduler_config
        self.resident = resident and self.backend.supports_device_batch
        why_eager = None
        if config.cudagraph_mode != "NONE":
            if not self.resident or not self.backend.supports_graphs:
                why_eager = f"the {self.backend.name!r} attention backend cannot be captured"
            else:
                why_eager = model.graph_blocker()
            if why_eager is not None:
                log.warning("graphs are off, every step runs eagerly: %s", why_eager)
        self.capture_sizes: tuple[int, ...] = config.cudagraph_capture_sizes if why_eager is None else ()
        self.graph_class = graph_class(self.device)
        self.graphs: dict[int, object] = {}
        self.max_rows = max(sc.max_num_batched_tokens, max(self.capture_sizes, default=0))
        self.max_reqs = sc.max_num_seqs
        bs = self.block_size
        self.width = -(-(sc.max_model_len + MAX_SPECULATIVE_TOKENS + 1) // bs)     # a table's most entries
        self.rows: dict[str, int] = {}                                           # request id -> resident row
        self.free_rows = list(range(self.max_reqs - 1, -1, -1))
        self.sink_row = self.max_reqs
        self._updates: tuple[list[int], list[int]] = ([], [])
        self._step_logits: Optional[torch.Tensor] = None
        # the last launched step's sampled tokens on the device, and each request's row in them: a step launched
        # before that one is back takes its rows' tokens from there
        self._last_tokens: Optional[torch.Tensor] = None
        self._last_rows: dict[str, int] = {}
        # figures for the start line and /metrics
        self.num_graph_steps = 0
        self.num_eager_decode_steps = 0      # decode-only steps no captured size held
        self.replays: Counter[int] = Counter()   # steps each captured size served
        self.capture_seconds = 0.0
        self.graph_memory_bytes = 0
        if self.resident:
            self._static_buffers()

    # ---- the resident batch ----------------------------------------------------------------------------------
    def _static_buffers(self) -> None:
        R, dev = self.max_rows, self.device
        # the header: fixed regions of max_rows (a graph reads them in place), copied in one transfer a step
        self.o_ids, self.o_row, self.o_start, self.o_len, self.o_qsl = 0, R, 2 * R, 3 * R, 4 * R
        self.o_entry = 5 * R + 1                # each row's entry
        self.header_len = 6 * R + 1
        pin = dev.type == "cuda"
        # two host headers, taken in turn, each with the event of its last copy to the device: a step may be written
        # while the last one's copy is still queued behind the device's work (nothing waits on a step that samples
        # nothing, and async scheduling writes ahead), and a buffer is written again only once its copy ran
        self.hosts = [torch.zeros(self.header_len, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._copied: list[Optional[torch.cuda.Event]] = [None, None]
        self._turn = 0
        self.header = torch.zeros(self.header_len, dtype=torch.long, device=dev)
        self.arange = torch.arange(R, device=dev)
        self.backend.init_graphs(R, dev)

    def num_slots(self, num_blocks: int) -> int:
        return (num_blocks + 1) * self.block_size          # the last block is the sink

    def allocate_kv_cache(self, num_blocks: int) -> None:
        super().allocate_kv_cache(num_blocks)
        if self.resident:
            G = len(self.groups.windows)
            self.tables = torch.zeros(G, self.max_reqs + 1, self.width, dtype=torch.int32, device=self.device)
            self.tables[:, self.sink_row] = num_blocks       # the sink block

    @property
    def supports_async(self) -> bool:
        return self.resident

    def _launched(self, plan: StepPlan, pending) -> None:
        # kept whatever the config says: the engine picks async launches step by step (not while a request reads
        # its past tokens), and a step launched ahead needs the last one's tokens
        self._last_rows.clear()
        if pending is None:
            return
        self._last_tokens = pending.token_ids_device
        row = 0
        for st, guesses, _ in plan.samplers:
            if not guesses:                 # (a verification's tokens are known only once it is back)
                self._last_rows[st.req_id] = row
            row += len(guesses) + 1

    def forget(self, req_ids: list[str]) -> None:
        super().forget(req_ids)
        self._free_rows(req_ids)

    def _free_rows(self, req_ids: list[str]) -> None:
        for rid in req_ids:
            row = self.rows.pop(rid, None)
            if row is not None:
                self.free_rows.append(row)

    def _plan(self, sched: SchedulerOutput) -> StepPlan:
        if not self.resident:
            return super()._plan(sched)
        # gone, or preempted: a resumed request is given a row again and resends its tables
        self._free_rows([*sched.finished_req_ids, *sched.preempted_req_ids])
        plan = super()._plan(sched)
        idx, val = [], []
        G1, W = self.max_reqs + 1, self.width
        for s in sched.scheduled:
            row = self.rows.get(s.req_id)
            if row is None:
                row = self.rows[s.req_id] = self.free_rows.pop()
            for g, (keep, new) in enumerate(s.block_deltas):
                if keep + len(new) > W:
                    raise ValueError(f"request {s.req_id}'s block table outgrew the runner's {W} entries")
                base = (g * G1 + row) * W + keep
                idx.extend(range(base, base + len(new)))
                val.extend(max(b, 0) for b in new)        # a window's freed entries: block 0, never read
        self._updates = (idx, val)
        return plan

    def _run(self, plan: StepPlan) -> torch.Tensor:
        if not self.resident:
            return super()._run(plan)
        b = plan.batch
        T, E = b.num_rows, b.num_entries
        size = next((n for n in self.capture_sizes if n >= T), None) if b.decode_only else None
        if b.decode_only and size is None and self.capture_sizes:
            self.num_eager_decode_steps += 1
        row_of = [self.rows[st.req_id] for st in plan.states]
        self._upload(b, [row_of[i] for i in b.entry_req], size)
        if plan.in_flight:              # their tokens: the last launched step's, on the device
            at = to_device([[self.o_ids + r for r, _ in plan.in_flight],
                            [self._last_rows[rid] for _, rid in plan.in_flight]], self.device)
            self.header.index_copy_(0, at[0], self._last_tokens.index_select(0, at[1]))
        if size is not None:
            self.num_graph_steps += 1
            self.replays[size] += 1
            hidden, logits = self.graphs[size].replay()
            self._step_logits = logits[:T]
            return hidden[:T]
        self._step_logits = None
        return self._device_forward(T, E, [b.qsl[i + 1] - b.qsl[i] for i in range(E)], None)[0]

    def _upload(self, b: ForwardBatch, rows: list[int], size: Optional[int]) -> None:
        """The step's header (padded to size with rows that write the sink and attend nothing) and its table
        updates, to the device."""
        h = self._next_host()
        T, E = b.num_rows, b.num_entries
        h[self.o_ids:self.o_ids + T] = b.ids
        h[self.o_row:self.o_row + E] = rows
        h[self.o_start:self.o_start + E] = b.num_computed
        h[self.o_len:self.o_len + E] = b.seq_lens
        h[self.o_qsl:self.o_qsl + E + 1] = b.qsl
        h[self.o_entry:self.o_entry + T] = np.repeat(np.arange(E), np.diff(b.qsl))
        n = size or T                               # rows (and entries) the forward sees
        self._pad(h, T, n)                          # a padded step is decode-only: entries and rows pad alike
        self._send_host(self.o_entry + n)
        idx, val = self._updates
        if idx:
            upd = to_device([idx, val], self.device)
            self.tables.view(-1).index_copy_(0, upd[0], upd[1].to(torch.int32))
            self._updates = ([], [])

    def _next_host(self) -> np.ndarray:
        """The host header to write next, once its last copy to the device ran."""
        self._turn ^= 1
        if self._copied[self._turn] is not None:
            self._copied[self._turn].synchronize()
        return self.hosts[self._turn].numpy()

    def _send_host(self, used: int) -> None:
        self.header[:used].copy_(self.hosts[self._turn][:used], non_blocking=True)
        if self.device.type == "cuda":
            self._copied[self._turn] = torch.cuda.Event()
            self._copied[self._turn].record()

    def _pad(self, h: np.ndarray, first: int, n: int) -> None:
        """Rows (and entries) first..n-1 padding: token 0 in the sink row, length 0 (they write the sink block and
        attend nothing), one row each."""
        if n <= first:
            return
        pad = slice(first, n)
        h[self.o_ids:][pad] = 0
        h[self.o_row:][pad] = self.sink_row
        h[self.o_start:][pad] = 0
        h[self.o_len:][pad] = 0
        h[self.o_qsl + first + 1:self.o_qsl + n + 1] = np.arange(first + 1, n + 1)
        h[self.o_entry:][pad] = np.arange(first, n)

    def _device_forward(self, T: int, E: int, entry_rows: Optional[list[int]],
                        graph_size: Optional[int]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The forward pass of the header's first T rows and E entries, positions and slots computed on the
        device. In a captured step (graph_size) every entry has one row and the logits of every row are part of
        the graph."""
        h = self.header
        ids = h[self.o_ids:self.o_ids + T]
        rows = h[self.o_row:self.o_row + E]
        start = h[self.o_start:self.o_start + E]
        lens = h[self.o_len:self.o_len + E]
        qsl = h[self.o_qsl:self.o_qsl + E + 1]
        entry = h[self.o_entry:self.o_entry + T]
        pos = start[entry] + self.arange[:T] - qsl[entry]
        bs = self.block_size
        metas = []
        for g, window in enumerate(self.groups.windows):
            tables = self.tables[g].index_select(0, rows)                          # [E, W]
            slots = tables[entry, pos // bs].long() * bs + pos % bs
            d = DeviceBatch(slots, qsl, start, lens, tables, entry_rows, bs, window)
            metas.append(self.backend.graph_metadata(d, E) if graph_size else self.backend.prepare_device(d))
        hidden = self.model(ids, pos, self.backend, metas)
        return hidden, self.model.compute_logits(hidden) if graph_size else None

    def _sample_logits(self, hidden: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        if self._step_logits is None:
            return super()._sample_logits(hidden, plan)
        rows = plan.sample_rows
        if rows[-1] == len(rows) - 1:               # (ascending, so every row up to it): a plain decode step
            return self._step_logits[:len(rows)]
        return self._step_logits[to_device(rows, self.device)]

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        return forward_rows(self, batch)

    # ---- start-up ----------------------------------------------------------------------------------------------
    def memory_reserved(self) -> int:
        """Profiled before the KV cache exists, on a one-block cache: the eager peak of the largest step's rows,
        and the memory pool of the largest graph, captured and let go (both would not fit once the KV cache took
        what is free)."""
        if not self.resident or self.device.type != "cuda":
            return 0
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            self.allocate_kv_cache(1)
            with torch.inference_mode():
                self._dummy_step([1] * self.max_rows)
                torch.cuda.synchronize(self.device)
                peak = torch.cuda.max_memory_allocated(self.device) - before
                pool = 0
                if self.capture_sizes:
                    free = torch.cuda.mem_get_info(self.device)[0]
                    n = max(self.capture_sizes)
                    self._fill_dummy_header(n)
                    graph = self.graph_class(self.device)
                    with frozen_gc():
                        graph.capture(functools.partial(self._device_forward, n, n, None, n))
                    torch.cuda.synchronize(self.device)
                    pool = max(free - torch.cuda.mem_get_info(self.device)[0], 0)
                    del graph
        except torch.OutOfMemoryError:
            raise ValueError("out of device memory profiling a step before sizing the KV cache: lower "
                             "max_num_batched_tokens, or run with enforce_eager=True") from None
        finally:
            self.kv_tensors, self.kv_caches, self.tables = [], [], None
            torch.cuda.empty_cache()
        log.info("the runner reserves %.2f GiB: %.2f GiB of eager activations, %.2f GiB for its graphs",
                 (peak + pool) / 2 ** 30, peak / 2 ** 30, pool / 2 ** 30)
        return peak + pool

    def warm_up(self) -> None:
        """Kernels compiled and graphs captured before the first request: a prompt step and a decode step of
        each shape run eagerly (Triton compiles what they launch, or reads its on-disk cache), then each captured
        size is recorded, largest first, in one memory pool."""
        if not self.resident:
            return
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        with torch.inference_mode():
            if self.device.type == "cuda":        # (an interpreter compiles nothing)
                for rows in WARM_ROWS:                # one entry of so many rows: a decode, prompts
                    self._dummy_step([min(rows, self.max_rows)])
                self._dummy_step([1] * min(16, self.max_rows))      # many decodes
            if not self.capture_sizes:
                return
            sync()
            free_before = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
            t0 = time.perf_counter()
            pool = None
            with frozen_gc():
                for n in sorted(self.capture_sizes, reverse=True):
                    self._fill_dummy_header(n)
                    graph = self.graph_class(self.device, pool)
                    try:
                        graph.capture(functools.partial(self._device_forward, n, n, None, n))
                    except torch.OutOfMemoryError:
                        need = free_before - torch.cuda.mem_get_info(self.device)[0]
                        raise ValueError(f"out of device memory capturing the graph of {n} rows ({need / 2 ** 30:.2f} "
                                         f"GiB taken by the larger ones); run with enforce_eager=True, or capture "
                                         f"fewer or smaller sizes (compilation_config cudagraph_capture_sizes)") \
                            from None
                    pool = graph.memory_pool
                    self.graphs[n] = graph
            sync()
            self.capture_seconds = time.perf_counter() - t0
            if self.device.type == "cuda":
                self.graph_memory_bytes = max(free_before - torch.cuda.mem_get_info(self.device)[0], 0)
            log.info(self.startup_line())

    def _fill_dummy_header(self, n: int, entry_rows: Optional[list[int]] = None) -> None:
        """Entries in the sink row: n padding rows (what a capture records), or entries of entry_rows rows each,
        which attend the rows they wrote (a warm-up step)."""
        h = self._next_host()
        h[self.o_qsl] = 0
        if entry_rows is None:
            self._pad(h, 0, n)
            self._send_host(self.o_entry + n)
            return
        E, T = len(entry_rows), sum(entry_rows)
        h[self.o_ids:self.o_ids + T] = 0
        h[self.o_row:self.o_row + E] = self.sink_row
        h[self.o_start:self.o_start + E] = 0
        h[self.o_len:self.o_len + E] = entry_rows
        h[self.o_qsl:self.o_qsl + E + 1] = np.concatenate([[0], np.cumsum(entry_rows)])
        h[self.o_entry:self.o_entry + T] = np.repeat(np.arange(E), entry_rows)
        self._send_host(self.o_entry + T)

    def _dummy_step(self, entry_rows: list[int]) -> None:
        """An eager step of entries with these row counts, all in the sink block (their K/V land there)."""
        self._fill_dummy_header(0, entry_rows)
        if self.linear_states is not None:
            self.model.linear_step = self.linear_states.dummy_step(entry_rows)
        hidden, _ = self._device_forward(sum(entry_rows), len(entry_rows), entry_rows, None)
        self.model.compute_logits(hidden[-1:])

    def startup_line(self) -> Optional[str]:
        if not self.capture_sizes:
            return "graphs: off (every step eager)"
        kind = "CUDA graphs" if self.device.type == "cuda" else "traced stand-ins"
        mem = f", {self.graph_memory_bytes / 2 ** 20:.0f} MiB" if self.device.type == "cuda" else ""
        return (f"graphs: {len(self.graphs)} {kind} of decode steps up to {max(self.capture_sizes)} rows, "
                f"captured in {self.capture_seconds:.1f} s{mem}")
