"""LLMEngine: add_request / step / abort_request / has_unfinished_requests.

One step = schedule() -> execute(batch) -> update(outputs). Everything else here is the edge of the engine:
turning user input into Requests (with the checks users need) and finished tokens into RequestOutputs.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Union

import torch

from tokenmill.config import (CacheConfig, CompilationConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig,
                              resolve_dtype)
from tokenmill.bench.perplexity import default_text_path, strip_header
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.draft_model import DraftModelProposer, check_draft_config, check_draft_tokenizer
from tokenmill.engine.kv_cache_manager import blocks_for, make_kv_manager
from tokenmill.engine.kv_offload import BlockCodec, KVOffload, KVOffloadConfig, key_text, namespace_of
from tokenmill.engine.kv_transfer import DECODE_HOST_GB, KVTransfer, KVTransferConfig, remote_decode
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler, SchedulerStats
from tokenmill.engine.spec_decode import NgramProposer, SpeculativeConfig
from tokenmill.engine.state_snapshots import StateSnapshots
from tokenmill.engine.structured_output import StructuredOutputManager, StructuredOutputsConfig
from tokenmill.executor.cpus import thread_policy
from tokenmill.executor.kernels.isa import choose as choose_isa
from tokenmill.executor.loader import open_checkpoint, resolve_model_path
from tokenmill.executor.loading import load_model, open_model, size_kv_cache
from tokenmill.executor.models.decoder import DecoderForCausalLM
from tokenmill.executor.parallel import (TensorParallelRunner, TPGroup, WorkerSpec, check_tensor_parallel,
                                         local_threads, shard_config, sharded_checkpoint, start_ranks, stop_workers)
from tokenmill.executor.gpu_runner import GpuRunner
from tokenmill.executor.linear_states import snapshot_slots
from tokenmill.executor.runner import CpuRunner, ModelRunner, RunnerOutput
from tokenmill.executor.sampler import bad_words_to_token_ids, check_params_for_vocab
from tokenmill.lora.adapter import LoRAAdapter, load_adapter, lora_model_error
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestOutput
from tokenmill.pooling_params import PoolingParams, check_pooling_type
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler_output import SchedulerOutput

PromptType = Union[str, list[int], dict]


def _contradiction(grammar: Any, params: SamplingParams, bad_words: list[list[int]], eos_ids: tuple[int, ...],
                   vocab_size: int) -> Optional[str]:
    """Why no first token can satisfy both the constraint and the request's bans, or None. Seen at admission, a
    contradiction is a clear refusal rather than an output the grammar must abort."""
    if not grammar.active:       # a reasoning model thinks first: the constraint starts later
        return None
    mask = torch.zeros(1, -(-vocab_size // 32), dtype=torch.int32)
    grammar.fill(mask, 0)
    bits = (mask[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = set(torch.nonzero(bits.flatten()[:vocab_size]).flatten().tolist())
    given = []
    if params.allowed_token_ids:
        kept = allowed & set(params.allowed_token_ids)
        if kept != allowed:
            given.append("allowed_token_ids")
        allowed = kept
    single = {w[0] for w in bad_words if len(w) == 1}
    if allowed & single:
        given.append("bad_words")
    allowed -= single
    if params.min_tokens > 0:
        ends = set(eos_ids) | set(params.stop_token_ids or ())
        if allowed & ends:
            given.append("min_tokens")
        allowed -= ends
    if allowed or not given:
        return None
    return (f"the constraint allows no first token that {' and '.join(given)} leave{'s' if len(given) == 1 else ''}; "
            f"drop one of them or change the constraint")
# a prompt dict's keys (vLLM's TextPrompt / TokensPrompt): any other is refused, so a misspelt cache_salt cannot
# silently leave a request in the shared prefix cache
PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")
DEVICE_BATCH_BACKENDS = ("triton", "padded")     # attention prepared on the device: the GPU runner's
log = logging.getLogger("tokenmill.engine")


@dataclass
class EngineStats:
    """Cumulative counters over the engine's life (the later /metrics exports them)."""
    num_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_time_s: float = 0.0      # steps that carried any prefill token
    decode_time_s: float = 0.0       # steps that carried only decode tokens
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # the offload tiers under the prefix cache (engine/kv_offload.py): tokens looked up past the pool's hit, tokens
    # found in host memory and on disk, payload bytes loaded from each and stored to each, damaged files skipped
    kv_offload_queries: int = 0
    kv_offload_hits_host: int = 0
    kv_offload_hits_disk: int = 0
    kv_offload_bytes_loaded_host: int = 0
    kv_offload_bytes_loaded_disk: int = 0
    kv_offload_bytes_stored_host: int = 0
    kv_offload_bytes_stored_disk: int = 0
    kv_offload_corrupt_files: int = 0
    # prefill/decode disaggregation (engine/kv_transfer.py): blocks and bytes sent and received, blocks refused
    # (damaged or another cache's), pairings and transfers that failed
    kv_transfer_blocks_sent: int = 0
    kv_transfer_bytes_sent: int = 0
    kv_transfer_blocks_received: int = 0
    kv_transfer_bytes_received: int = 0
    kv_transfer_blocks_refused: int = 0
    kv_transfer_failures: int = 0
    # speculative decoding (vLLM's spec_decode counters): verifications, guessed tokens, accepted guesses
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    kv_blocks_total: int = 0
    max_kv_blocks_used: int = 0
    # a GPU runner's steps: replayed from a captured graph, and decode-only steps no captured size held (eager)
    num_graph_steps: int = 0
    num_eager_decode_steps: int = 0
    sum_batch_size: int = 0
    last_step: SchedulerStats = field(default_factory=SchedulerStats)

    @property
    def mean_batch_size(self) -> float:
        return self.sum_batch_size / self.num_steps if self.num_steps else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a verification step yields on average: the accepted guesses and the one it samples anyway."""
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "last_step"}
        d["mean_batch_size"] = self.mean_batch_size
        if self.spec_num_drafts:
            d["spec_acceptance_rate"] = self.spec_acceptance_rate
            d["spec_mean_accepted_length"] = self.spec_mean_accepted_length
        return d


@dataclass(frozen=True)
class KVCacheInfo:
    """What the KV cache reserves, for an operator to plan with (the server's start line and /metrics)."""
    num_blocks: int
    block_size: int
    cache_dtype: str
    bytes: int
    max_model_len: int
    enable_prefix_caching: bool
    state_bytes: int = 0            # linear-attention layers' states (Qwen3.5), beside the cache
    state_slots: int = 0
    snapshot_bytes: int = 0         # and their snapshots for the prefix cache
    snapshot_slots: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """Requests of max_model_len tokens the cache holds at once (vLLM's "maximum concurrency")."""
        return self.num_tokens / self.max_model_len

    def describe(self) -> str:
        return (f"KV cache {self.bytes / 2 ** 30:.2f} GiB: {self.num_blocks:,} blocks of {self.block_size} tokens "
                f"({self.num_tokens:,} tokens, {self.cache_dtype}); {self.max_concurrency:.1f} requests of "
                f"max_model_len {self.max_model_len:,} at once" +
                (f"; linear-attention states {self.state_bytes / 2 ** 20:,.1f} MiB ({self.state_slots} requests)"
                 if self.state_slots else "") +
                (f" and {self.snapshot_bytes / 2 ** 20:,.1f} MiB of snapshots for the prefix cache "
                 f"({self.snapshot_slots})" if self.snapshot_slots else ""))


def prompt_cache_salt(prompt: PromptType) -> Optional[str]:
    """A prompt dict's cache_salt (vLLM's): a request shares prefix-cache blocks only with requests of the same salt,
    an unsalted one only with unsalted ones. None (or a None value): no salt."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:      # the salt itself is never echoed: it may be a tenant's secret
        got = "an empty string" if isinstance(salt, str) else f"a {type(salt).__name__}"
        raise ValueError(f"cache_salt must be a non-empty string (e.g. one per tenant or user), got {got}; "
                         f"leave it out to share the prefix cache with other unsalted requests")
    return salt


def linear_attention_checks(mc: ModelConfig, spec: Optional[SpeculativeConfig], use_kv_cache: bool,
                            async_scheduling: Optional[bool], offload: KVOffloadConfig,
                            transfer: Optional[KVTransferConfig]) -> None:
    """What a model with linear-attention layers (a state a request, executor/linear_states.py) cannot do yet,
    refused with what to change."""
    what = f"{mc.architecture}'s linear-attention layers"
    if async_scheduling:
        raise ValueError(f"async_scheduling=True with {what} is not implemented; leave it off")
    if spec is not None and spec.method != "ngram":
        raise ValueError(f"speculative decoding by {spec.method!r} with {what} is not implemented (the draft's own "
                         f"state would need rolling back too); use method 'ngram'")
    if not use_kv_cache:
        raise ValueError(f"use_kv_cache=False with {what} is not implemented; leave it on")
    if offload.enabled or transfer is not None:
        raise ValueError(f"KV offload tiers and kv_transfer_config with {what} are not implemented (they move KV "
                         f"blocks, not the layers' state snapshots); leave them unset")


CALIBRATION_TOKENS = 256       # calculate_kv_scales: the passage's length, at most


def check_kv_calibration(mc: ModelConfig, tp_size: int, offload: KVOffloadConfig,
                         transfer: Optional[KVTransferConfig]) -> None:
    """What calculate_kv_scales cannot run with yet, refused with what to change."""
    why = None
    if mc.linear_layers:
        why = f"{mc.architecture}'s linear-attention layers (the calibration pass holds no state slot for them)"
    elif tp_size > 1:
        why = "tensor_parallel_size > 1 (each rank's cache would need its own calibration)"
    elif offload.enabled or transfer is not None:
        why = "KV offload tiers or kv_transfer_config (they key blocks by the scales, set after they start)"
    if why is not None:
        raise ValueError(f"calculate_kv_scales=True with {why} is not implemented; leave it off")


def pick_device(device: Optional[str]) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but no CUDA GPU is available; use device='cpu'")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return dev


def model_files(path: str) -> list[tuple[str, int]]:
    """A model's files by name and size: part of what keys its offloaded KV (a copy elsewhere keys alike)."""
    if os.path.isfile(path):
        return [(os.path.basename(path), os.path.getsize(path))]
    out = []
    for name in sorted(os.listdir(path)) if os.path.isdir(path) else []:
        full = os.path.join(path, name)
        if os.path.isfile(full) and name.endswith((".safetensors", ".bin", ".gguf", ".json", ".pt")):
            out.append((name, os.path.getsize(full)))
    return out


class LLMEngine:
    def __init__(self, model: Optional[str] = None, *, dtype: Optional[str] = None, device: Optional[str] = None,
                 block_size: int = 16, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 max_model_len: Optional[int] = None, kv_cache_memory_gb: Optional[float] = None,
                 enable_prefix_caching: bool = True, kv_cache_dtype: str = "auto", calculate_kv_scales: bool = False,
                 use_kv_cache: bool = True,
                 attention_backend: str = "auto", quantized_kernels: bool = True, cpu_kernels: str = "auto",
                 quantization: Optional[str] = None, int8_activations: bool = True, seed: int = 0,
                 tokenizer: Any = "auto", pooling_type: str = "LAST", num_threads: Optional[int] = None,
                 structured_outputs_config: Union[StructuredOutputsConfig, dict, None] = None,
                 reasoning_parser: Optional[str] = None,
                 speculative_config: Union[SpeculativeConfig, dict, str, None] = None,
                 tensor_parallel_size: int = 1, enforce_eager: bool = False,
                 compilation_config: Union[CompilationConfig, dict, None] = None,
                 async_scheduling: bool = False, long_prefill_token_threshold: Optional[int] = None,
                 max_num_partial_prefills: int = 1, max_long_partial_prefills: int = 1,
                 gpu_memory_utilization: Optional[float] = None, revision: Optional[str] = None,
                 enable_lora: bool = False, max_loras: int = 1, max_lora_rank: int = 16,
                 max_cpu_loras: Optional[int] = None, gguf_file: Optional[str] = None,
                 kv_offload_memory_gb: Optional[float] = None, kv_offload_dir: Optional[str] = None,
                 kv_offload_disk_gb: Optional[float] = None,
                 kv_transfer_config: Union[KVTransferConfig, dict, str, None] = None):
        # pooling_type: which prompt rows a PoolingParams request pools (vLLM's pooler config): LAST or MEAN
        self.pooling_type = check_pooling_type(pooling_type)
        spec_config = SpeculativeConfig.of(speculative_config)
        so_config = structured_outputs_config or StructuredOutputsConfig()
        if isinstance(so_config, dict):
            so_config = StructuredOutputsConfig(**so_config)
        if reasoning_parser is not None:     # vLLM's --reasoning-parser sets the structured outputs' one too
            so_config = dataclasses.replace(so_config, reasoning_parser=reasoning_parser)
        transfer_cfg = KVTransferConfig.of(kv_transfer_config)
        if transfer_cfg is not None and transfer_cfg.receives and kv_offload_memory_gb is None:
            kv_offload_memory_gb = DECODE_HOST_GB       # received blocks wait in the host tier
        offload_cfg = KVOffloadConfig(kv_offload_memory_gb, kv_offload_dir, kv_offload_disk_gb)
        path = resolve_model_path(model, revision, gguf_file)
        dev = pick_device(device)
        torch_dtype = resolve_dtype(dtype, dev)
        ckpt, mc = open_model(path, quantization, dev)
        if max_model_len is None:
            max_model_len = mc.max_position_embeddings
        elif max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} is longer than the model's max_position_embeddings "
                             f"({mc.max_position_embeddings}); lower it")
        if not use_kv_cache:
            enable_prefix_caching = False
        if mc.linear_layers:
            linear_attention_checks(mc, spec_config, use_kv_cache, async_scheduling, offload_cfg, transfer_cfg)
        lora_cfg = self._lora_config(enable_lora, max_loras, max_lora_rank, max_cpu_loras, mc, tensor_parallel_size)
        if long_prefill_token_threshold is None:    # fair prefill: the device's default (SchedulerConfig)
            long_prefill_token_threshold = SchedulerConfig.default_long_prefill_token_threshold(dev.type, use_kv_cache)
        # on a CPU a step costs what it computes: fair prefill there also weighs a chunk's depth, short prompts first
        cpu_fair = dev.type == "cpu" and use_kv_cache and long_prefill_token_threshold > 0
        sched_cfg = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, use_kv_cache,
                                    self._async_scheduling(async_scheduling, dev, attention_backend, use_kv_cache,
                                                           spec_config, tensor_parallel_size),
                                    long_prefill_token_threshold, max_num_partial_prefills, max_long_partial_prefills,
                                    prefill_depth_cost=mc.attention_cost_per_position if cpu_fair else 0.0,
                                    short_prompts_first=cpu_fair,
                                    max_loras=lora_cfg.max_loras if lora_cfg is not None else 0)
        cache_cfg = CacheConfig(block_size, kv_cache_memory_gb, enable_prefix_caching=enable_prefix_caching,
                                cache_dtype=kv_cache_dtype, gpu_memory_utilization=gpu_memory_utilization,
                                calculate_kv_scales=calculate_kv_scales)
        if calculate_kv_scales:
            check_kv_calibration(mc, tensor_parallel_size, offload_cfg, transfer_cfg)
        # tensor parallelism (executor/parallel.py): this process is rank 0 and holds its share of the model; the
        # runner's config is that share's (its heads, its KV cache), the engine's model_config the whole model's
        check_tensor_parallel(mc, tensor_parallel_size, dev, path, quantized_kernels)
        if tensor_parallel_size > 1 and spec_config is not None and spec_config.method == "draft_model":
            raise ValueError("a draft model with tensor_parallel_size > 1 is not implemented; use the ngram method")
        tp, workers = None, []
        self._local_ranks = 1
        self._stop_workers: Optional[weakref.finalize] = None
        part = mc if tensor_parallel_size == 1 else shard_config(mc, tensor_parallel_size)
        if tensor_parallel_size > 1:       # each rank computes on its share of the cores
            num_threads = local_threads(num_threads, tensor_parallel_size)
        comp = CompilationConfig.of(compilation_config)
        graph_mode = comp.mode(dev, enforce_eager)
        if lora_cfg is not None and graph_mode != "NONE":
            # a step's rows take their adapters by a mapping whose shapes change step to step
            log.info("LoRA adapters: the decode steps run eagerly (no CUDA graphs)")
            graph_mode = "NONE"
        if graph_mode != "NONE" and dev.type == "cpu" and attention_backend not in DEVICE_BATCH_BACKENDS:
            raise ValueError("graphs on a CPU are the GPU runner's traced stand-in, for tests: use "
                             "attention_backend='padded' or 'triton' (under TRITON_INTERPRET=1) with "
                             "cpu_kernels='reference' or 'triton', or leave compilation_config's cudagraph_mode unset")
        self.config = EngineConfig(path, part, cache_cfg, sched_cfg, torch_dtype, dev, attention_backend,
                                   quantized_kernels, cpu_kernels, seed, num_threads, graph_mode,
                                   comp.capture_sizes(max_num_seqs) if graph_mode != "NONE" else (),
                                   lora_cfg)
        if tensor_parallel_size > 1:
            # rank 0's kernel variant, not "auto": ranks that compute alike route alike (a Mixture-of-Experts'
            # top-k flips on the last bits), and a node that cannot run it says so
            tp, workers = start_ranks(WorkerSpec(path, torch_dtype, max_model_len, block_size,
                                                 self.config.kv_cache_dtype, choose_isa(cpu_kernels), num_threads,
                                                 attention_backend, quantized_kernels, int8_activations,
                                                 quantization), tensor_parallel_size)
            self._local_ranks = 1 + len(workers)
            # the workers stop with this engine, or at once if it fails to start below
            self._stop_workers = weakref.finalize(self, stop_workers, tp, workers)
            # quantization= quantises each rank's share after the split: the float checkpoint is split
            ckpt = sharded_checkpoint(ckpt if quantization is None else open_checkpoint(path), mc, 0,
                                      tensor_parallel_size, quantization)
        threads = thread_policy(num_threads)      # before the load: it computes too
        self.model_config = mc
        torch.manual_seed(seed)

        self.model = load_model(path, part, torch_dtype, dev, max_model_len, ckpt, quantized_kernels, cpu_kernels,
                                int8_activations, tp, lora_cfg)
        # a draft model (speculative decoding) shares the KV budget: both caches get num_blocks blocks
        self.draft_config: Optional[EngineConfig] = None
        if spec_config is not None and spec_config.method == "draft_model" and use_kv_cache:
            draft_path = resolve_model_path(spec_config.model)
            draft_ckpt, draft_mc = open_model(draft_path, quantization, dev)
            # the draft's passes (last_logits) take host lists, eagerly: no graphs to capture for it
            self.draft_config = dataclasses.replace(self.config, model=draft_path, model_config=draft_mc,
                                                    cudagraph_mode="NONE", cudagraph_capture_sizes=(),
                                                    lora_config=None)
            check_draft_config(mc, self.draft_config.model_config, max_model_len)
            draft_model = load_model(draft_path, self.draft_config.model_config, torch_dtype, dev, max_model_len,
                                     draft_ckpt, quantized_kernels, cpu_kernels, int8_activations)
        try:
            self.runner = self._runner(self.config, self.model, threads, tp, workers)
            if sched_cfg.async_scheduling and not self.runner.supports_async:
                raise ValueError(f"async_scheduling=True needs the GPU runner's resident batch, which the "
                                 f"{self.runner.backend.name!r} attention backend does not take; leave it off")
            runners = [self.runner]
            if self.draft_config is not None:
                runners.append(self._runner(self.draft_config, draft_model, threads, resident=False))
            num_blocks = self._size_kv_cache(sum(r.memory_reserved() for r in runners))
            if tp is not None:
                tp.send(num_blocks)
            for r in runners:
                r.allocate_kv_cache(num_blocks)
                r.warm_up()
        except BaseException:
            if tp is not None:      # the workers wait for a message that will not come
                stop_workers(tp, workers)
            raise
        # the tokenizer loads on one core (the bundled GGUF's: ~2.4 s); the other faults in the KV cache meanwhile
        with self.runner.faulting_in_kv_cache():
            self.tokenizer = self._load_tokenizer(path) if tokenizer == "auto" else tokenizer
        self.structured_outputs = StructuredOutputManager(self.tokenizer, mc.vocab_size, mc.eos_token_ids, so_config)
        self.kv = make_kv_manager(num_blocks, block_size, enable_prefix_caching, mc.kv_groups.windows)
        identity = self._cache_identity(cpu_kernels, quantization, int8_activations) \
            if offload_cfg.enabled or transfer_cfg is not None else None
        self.offload = self._offload(offload_cfg, tensor_parallel_size, identity, transfer_cfg)
        self.transfer = self._transfer(transfer_cfg, tensor_parallel_size, identity)
        snapshots = snapshot_slots(self.config) if mc.linear_layers else 0
        self.scheduler = Scheduler(sched_cfg, self.kv, self.offload,
                                   StateSnapshots(snapshots, block_size) if snapshots else None)
        # speculative decoding: guesses for the next step of each decoding request (None: no guesses)
        self.proposer: Union[NgramProposer, DraftModelProposer, None] = None
        if self.draft_config is not None:
            dmc = self.draft_config.model_config
            check_draft_tokenizer(self.tokenizer, self._load_tokenizer(self.draft_config.model))
            self.proposer = DraftModelProposer(
                spec_config, runners[1],
                make_kv_manager(num_blocks, block_size, False, dmc.kv_groups.windows),
                max_model_len, max_num_batched_tokens)
        elif spec_config is not None and use_kv_cache:
            self.proposer = NgramProposer(spec_config, max_model_len)
        self.requests: dict[str, Request] = {}
        self.adapters: "OrderedDict[int, LoRAAdapter]" = OrderedDict()   # loaded LoRA adapters, by id
        self.parents: dict[str, list[str]] = {}        # n > 1: parent id -> child ids
        self.child_parent: dict[str, str] = {}
        self.stats = EngineStats(kv_blocks_total=num_blocks)
        self._in_flight: Optional[tuple] = None     # async scheduling: the step launched and not yet back
        self._last_return = 0.0
        self.step_history: deque[tuple[float, SchedulerStats]] = deque(maxlen=4096)
        if calculate_kv_scales:
            self._calibrate_kv_scales()

    def _calibrate_kv_scales(self) -> None:
        """calculate_kv_scales: the fp8 cache's scales from a fixed passage (the bundled text's first tokens) run
        through the model at start-up, as vLLM computes them from the first forward's K/V, so that they do not
        depend on which request comes first or on the step's token budget."""
        if self.tokenizer is None:
            raise ValueError("calculate_kv_scales=True encodes a calibration passage with the model's tokenizer, and "
                             "this model has none; leave it off")
        blocks = self.kv.num_blocks // self.kv.num_groups * self.config.cache_config.block_size
        n = min(CALIBRATION_TOKENS, self.config.scheduler_config.max_model_len - 1, blocks)
        ids = self.tokenizer.encode(strip_header(default_text_path().read_text()))[:n]
        self.runner.calibrate_kv_scales(ids)
        k, v = (torch.stack([getattr(c, name) for c in self.runner.kv_tensors]) for name in ("k_scale", "v_scale"))
        log.info("calculate_kv_scales: fp8 scales from %d tokens of the bundled text, K %.3g-%.3g, V %.3g-%.3g",
                 len(ids), k.min(), k.max(), v.min(), v.max())

    # ---- construction helpers ------------------------------------------------------------------------------
    def _cache_identity(self, cpu_kernels: str, quantization: Optional[str], int8_activations: bool
                        ) -> tuple[list[torch.Tensor], dict]:
        """The runner's per-slot cache tensors, and everything that shapes their bytes (the model's config and
        files, dtypes, kernels, layout): what keys offloaded blocks and what a KV transfer's pairing compares."""
        cfg_ = self.config
        tensors = [t for layer in self.runner.kv_tensors for t in layer.slot_tensors()]
        fp8_scales = [layer.k_scale.tolist() + layer.v_scale.tolist() for layer in self.runner.kv_tensors
                      if layer.dtype.startswith("fp8")]
        parts = {"model": repr(cfg_.model_config), "files": model_files(cfg_.model), "dtype": str(cfg_.dtype),
                 "kv_cache_dtype": cfg_.kv_cache_dtype, "block_size": cfg_.cache_config.block_size,
                 "kernels": choose_isa(cpu_kernels) if cfg_.device.type == "cpu" else cfg_.device.type,
                 "quantization": quantization, "quantized_kernels": cfg_.quantized_kernels,
                 "int8_activations": int8_activations, "backend": self.runner.backend.name,
                 "tensors": [(str(t.dtype), tuple(t.shape[1:])) for t in tensors], "fp8_scales": fp8_scales}
        return tensors, parts

    def _offload(self, cfg: KVOffloadConfig, tp_size: int, identity: Optional[tuple[list[torch.Tensor], dict]],
                 transfer: Optional[KVTransferConfig]) -> Optional[KVOffload]:
        """The prefix cache's host and disk tiers (None where none is asked for)."""
        if not cfg.enabled:
            return None
        names = "kv_offload_memory_gb / kv_offload_dir"
        if transfer is not None and transfer.receives:
            names = f"kv_role {transfer.kv_role} (it receives blocks into the prefix cache's host tier)"
        why = None
        if not self.kv.enable_caching:
            why = "they feed the prefix cache, which is off here (enable_prefix_caching=False or a sliding window)"
        elif tp_size > 1:
            why = "each tensor-parallel rank holds its share of the cache, and they move rank 0's only"
        if why is not None:
            raise ValueError(f"{names}: {why}; leave them unset")
        tensors, parts = identity
        offload = KVOffload(cfg, BlockCodec(tensors, self.config.cache_config.block_size), namespace_of(parts))
        self.kv.pool.evicted = []
        # at shutdown, or when the engine is collected or the interpreter exits (offline use)
        self._close_offload = weakref.finalize(self, offload.close, self.kv.pool.cached_blocks)
        log.info("KV offload: %s (namespace %s)", cfg.describe(), offload.namespace)
        return offload

    def _transfer(self, cfg: Optional[KVTransferConfig], tp_size: int,
                  identity: Optional[tuple[list[torch.Tensor], dict]]
                  ) -> Optional[KVTransfer]:
        """This instance's side of prefill/decode disaggregation (None: no kv_transfer_config)."""
        if cfg is None:
            return None
        if tp_size > 1:
            raise ValueError("kv_transfer_config with tensor_parallel_size > 1 is not implemented; use one of them")
        if not self.kv.enable_caching:
            raise ValueError("kv_transfer_config: the transferred blocks are found through the prefix cache, which "
                             "is off here (enable_prefix_caching=False or a sliding window); turn it on where it can be")
        tensors, parts = identity
        codec = self.offload.codec if self.offload is not None else \
            BlockCodec(tensors, self.config.cache_config.block_size)
        transfer = KVTransfer(cfg, parts, codec, self.offload.receive if self.offload is not None else None)
        self._close_transfer = weakref.finalize(self, transfer.close)
        log.info("%s", cfg.describe())
        return transfer

    def offload_line(self) -> Optional[str]:
        """The offload tiers for the start line (None: none)."""
        if self.offload is None:
            return None
        used = self.offload.usage()
        disk = self.offload.disk
        held = f"; {len(disk.files):,} blocks ({used['disk'] / 2 ** 30:.2f} GiB) already on disk" if disk else ""
        return f"KV offload tiers under the prefix cache: {self.offload.config.describe()}{held}"

    def _move_kv(self, sched: SchedulerOutput) -> None:
        """The offload tiers' moves for a step, before it runs: the blocks the pool evicted are read out before the
        step overwrites them, then the prefix blocks found in a tier are written into their fresh blocks."""
        if self.offload is None:
            return
        evicted, self.kv.pool.evicted = self.kv.pool.evicted, []
        saved = self.offload.save(evicted)
        for block_ids, payloads in sched.kv_loads:     # a block evicted in this schedule comes by its key
            self.offload.codec.write(list(block_ids), [p if isinstance(p, torch.Tensor) else saved[p]
                                                       for p in payloads])

    @staticmethod
    def _lora_config(enable: bool, max_loras: int, max_rank: int, max_cpu_loras: Optional[int], mc,
                     tp_size: int) -> Optional[LoRAConfig]:
        if not enable:
            return None
        why = lora_model_error(mc)
        if why is None and tp_size > 1:
            why = "adapters with tensor_parallel_size > 1 are not implemented"
        if why is not None:
            raise ValueError(f"enable_lora=True cannot run here: {why}; leave it off")
        return LoRAConfig(max_loras, max_rank, max_cpu_loras)
    @staticmethod
    def _load_tokenizer(path: str) -> Any:
        if os.path.isdir(path) and not os.path.exists(os.path.join(path, "tokenizer.json")) \
                and not os.path.exists(os.path.join(path, "tokenizer_config.json")):
            return None       # weights only: prompts must come as token ids, outputs carry no text
        from tokenmill.tokenizer import load_tokenizer
        return load_tokenizer(path)

    def kv_cache_info(self) -> KVCacheInfo:
        cfg = self.config
        states = getattr(self.runner, "linear_states", None)
        # a hybrid cache's blocks hold one group's layers each: counted as blocks of all layers, as if every group
        # kept every token (a lower bound: its window groups keep fewer)
        return KVCacheInfo(self.kv.num_blocks // self.kv.num_groups, cfg.cache_config.block_size, cfg.kv_cache_dtype,
                           self.kv.num_blocks * self.kv_bytes_per_block(),
                           cfg.scheduler_config.max_model_len, cfg.cache_config.enable_prefix_caching,
                           *((states.nbytes, states.conv.shape[1], states.snapshot_nbytes, states.snap_conv.shape[1])
                             if states is not None else ()))

    def kv_bytes_per_block(self) -> int:
        """The KV bytes a block of tokens takes: the target's, and the draft model's beside it."""
        extra = 0 if self.draft_config is None else ModelRunner.kv_bytes_per_block(self.draft_config)
        return ModelRunner.kv_bytes_per_block(self.config) + extra

    @staticmethod
    def _async_scheduling(asked: bool, dev: torch.device, attention_backend: str, use_kv_cache: bool,
                          spec: Optional[SpeculativeConfig], tp_size: int) -> bool:
        """vLLM's async_scheduling: off unless asked for; it needs the GPU runner's resident batch (a GPU, or a
        device-batch attention backend on a CPU; the runner says, once built), the KV cache, no speculative decoding
        (guesses come from the tokens just sampled) and one rank."""
        if not asked:
            return False
        why = ("it needs the GPU runner: a GPU, or attention_backend 'triton' or 'padded'"
               if dev.type == "cpu" and attention_backend not in DEVICE_BATCH_BACKENDS else
               "it needs the KV cache (use_kv_cache=True)" if not use_kv_cache else
               "speculative decoding guesses from the tokens just sampled" if spec is not None else
               "it runs on one rank" if tp_size > 1 else None)
        if why is not None:
            raise ValueError(f"async_scheduling=True cannot run here: {why}; leave it off")
        return True

    @staticmethod
    def _runner(config: EngineConfig, model: DecoderForCausalLM, threads, tp: Optional[TPGroup] = None,
                workers: list = (), resident: bool = True) -> ModelRunner:
        """The model's runner for its device (rank 0's, which sends the workers each step, under tensor
        parallelism); its KV cache is allocated once the cache is sized. resident=False: a draft model's, whose
        passes bring their own tables."""
        if tp is not None:
            return TensorParallelRunner(config, model, threads, group=tp, workers=list(workers))
        if config.device.type == "cpu" and config.attention_backend not in DEVICE_BATCH_BACKENDS:
            return CpuRunner(config, model, threads)
        return GpuRunner(config, model, resident)   # the GPU's, and on a CPU the device-batch backends' (tests)

    def _size_kv_cache(self, reserved: int) -> int:
        """Blocks for the KV cache (and a draft model's beside it): at least one request of max_model_len."""
        cfg = self.config
        bs = cfg.cache_config.block_size
        max_len = cfg.scheduler_config.max_model_len
        windows = cfg.model_config.kv_groups.windows
        if len(windows) == 1 and windows[0] is not None:
            max_len = min(max_len, windows[0] + 2 * bs)
        need = blocks_for(windows, bs, max_len) if len(windows) > 1 else -(-max_len // bs)
        return size_kv_cache(cfg, self.kv_bytes_per_block(), need, reserved, self._local_ranks)

    # ---- requests in -----------------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, dict):
            unknown = [k for k in prompt if k not in PROMPT_KEYS]
            if unknown:
                raise ValueError(f"unknown prompt dict key(s) {', '.join(map(repr, unknown))}; a prompt dict takes "
                                 f"{', '.join(map(repr, PROMPT_KEYS))}")
            prompt_cache_salt(prompt)      # a bad salt is refused wherever a prompt is read (the router's too)
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if prompt == "":
                raise ValueError("the prompt is empty; give at least one token of text")
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer; pass prompts as {'prompt_token_ids': [...]}")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _checked_prompt(self, request_id: str, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if request_id in self.requests or request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        if not ids:
            raise ValueError("the prompt is empty; give at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return text, ids

    def add_request(self, request_id: str, prompt: PromptType,
                    params: Union[SamplingParams, PoolingParams, None] = None,
                    arrival_time: Optional[float] = None, lora_request: Optional[LoRARequest] = None) -> None:
        """Queue a request: to generate (SamplingParams, the default) or to pool its prompt (PoolingParams);
        lora_request: with that LoRA adapter (enable_lora=True)."""
        params = params or SamplingParams()
        lora = self._adapter(lora_request)
        if isinstance(params, PoolingParams):
            return self._add_pooling_request(request_id, prompt, params, arrival_time, lora)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams or a PoolingParams, got {type(params).__name__}")
        text, ids = self._checked_prompt(request_id, prompt)
        mc, sc = self.model_config, self.config.scheduler_config
        if len(ids) >= sc.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens but max_model_len is {sc.max_model_len}; "
                             f"shorten the prompt (it must leave room for at least one new token) "
                             f"or raise max_model_len")
        check_params_for_vocab(params, mc.vocab_size)
        dest = remote_decode((params.extra_args or {}).get("kv_transfer_params"))
        if dest is not None and (self.transfer is None or self.transfer.sender is None):
            raise ValueError("kv_transfer_params asks for do_remote_decode, but this instance sends no KV; start it "
                             "with kv_role prefill or both")
        if dest is not None and dest not in self.transfer.sender.paired:
            raise ValueError(f"kv_transfer_params names {dest[0]}:{dest[1]}, which this prefill instance has not "
                             f"paired with; a router pairs it first (POST /v1/kv_transfer/connect)")
        max_tokens = min(params.max_tokens or sc.max_model_len, sc.max_model_len - len(ids))
        if mc.sliding_window is None:
            need = self.kv.blocks_needed(len(ids) + max_tokens)
            if need > self.kv.num_blocks:
                raise ValueError(f"the request needs {need} KV blocks at its longest but the cache has "
                                 f"{self.kv.num_blocks}; lower max_tokens or raise kv_cache_memory_gb")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        bad_words = bad_words_to_token_ids(self.tokenizer, params.bad_words) if params.bad_words else []
        so = params.structured_outputs
        if so is not None:
            self.structured_outputs.compile(so)        # a bad spec is refused before any child is queued
            why = _contradiction(self.structured_outputs.new_request_grammar(so, ids), params, bad_words,
                                 mc.eos_token_ids, mc.vocab_size)
            if why is not None:
                raise ValueError(f"structured_outputs.{so.kind}: {why}")
        salt = prompt_cache_salt(prompt)
        children = [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        for i, cid in enumerate(children):
            p = params if params.n == 1 else dataclasses.replace(
                params, n=1, seed=None if params.seed is None else params.seed + i)
            # every child carries the salt: they share their prompt's blocks with each other and no one else
            req = Request(cid, ids, p, arrival, max_tokens, mc.eos_token_ids, text, bad_words, cache_salt=salt,
                          lora=lora)
            req.group_id = request_id
            if so is not None:
                req.grammar = self.structured_outputs.new_request_grammar(so, ids)
            if self.tokenizer is not None and p.detokenize:
                req.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, p)
            self.requests[cid] = req
            self.scheduler.add(req)
        if params.n > 1:
            self.parents[request_id] = children
            self.child_parent.update((c, request_id) for c in children)

    def _add_pooling_request(self, request_id: str, prompt: PromptType, params: PoolingParams,
                             arrival_time: Optional[float], lora: Optional[LoRAAdapter] = None) -> None:
        text, ids = self._checked_prompt(request_id, prompt)
        mc, max_len = self.model_config, self.config.scheduler_config.max_model_len
        if len(ids) > max_len:      # no new token follows, so the prompt may fill max_model_len
            raise ValueError(f"the prompt has {len(ids)} tokens but max_model_len is {max_len}; shorten the prompt "
                             f"or raise max_model_len")
        if params.dimensions is not None and params.dimensions != mc.hidden_size:
            raise ValueError(f"dimensions={params.dimensions}: this model's embeddings have {mc.hidden_size} "
                             f"dimensions and it is not trained for shorter ones (matryoshka); leave dimensions out "
                             f"or set it to {mc.hidden_size}")
        if mc.sliding_window is None and self.kv.blocks_needed(len(ids)) > self.kv.num_blocks:
            raise ValueError(f"the prompt needs {self.kv.blocks_needed(len(ids))} KV blocks but the cache has "
                             f"{self.kv.num_blocks}; shorten the prompt or raise kv_cache_memory_gb")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        req = Request(request_id, ids, None, arrival, 0, mc.eos_token_ids, text, pooling_params=params,
                      pooling_type=self.pooling_type, cache_salt=prompt_cache_salt(prompt), lora=lora)
        self.requests[request_id] = req
        self.scheduler.add(req)

    # ---- LoRA adapters ----------------------------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter (vLLM's add_lora): read and checked now, so a request naming it does not fail later."""
        self._adapter(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forget a loaded adapter; requests running with it finish with it."""
        return self.adapters.pop(lora_id, None) is not None

    def list_loras(self) -> set[int]:
        return set(self.adapters)

    def _adapter(self, lora_request: Optional[LoRARequest]) -> Optional[LoRAAdapter]:
        """The request's adapter, loaded (and checked against the model) on first use."""
        if lora_request is None:
            return None
        lc = self.config.lora_config
        if lc is None:
            raise ValueError(f"lora_request {lora_request.lora_name!r}: this engine was started without adapters; "
                             f"start it with enable_lora=True (--enable-lora)")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        adapter = self.adapters.get(lora_request.lora_int_id)
        if adapter is not None and adapter.request != lora_request:
            raise ValueError(f"lora_int_id {lora_request.lora_int_id} is already adapter "
                             f"{adapter.request.lora_name!r} ({adapter.request.lora_path}); give each adapter its "
                             f"own id, or remove_lora() it first")
        if adapter is None:
            adapter = load_adapter(lora_request, self.model_config, lc.max_lora_rank)
            self.adapters[lora_request.lora_int_id] = adapter
            if lc.max_cpu_loras is not None and len(self.adapters) > lc.max_cpu_loras:
                self.adapters.popitem(last=False)
        self.adapters.move_to_end(lora_request.lora_int_id)
        return adapter

    def abort_request(self, request_ids: Union[str, Iterable[str]]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            for cid in self.parents.pop(rid, [rid]):
                self.child_parent.pop(cid, None)
                req = self.requests.pop(cid, None)
                if req is not None and not req.is_finished:
                    self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers now (on other machines too) and the grammar compilers, not when this
        engine is collected."""
        if self._stop_workers is not None:
            self._stop_workers()
        self.structured_outputs.shutdown()
        if self.offload is not None:      # what the pool and host memory hold, on disk for the next start
            self._close_offload()
        if self.transfer is not None:
            self._close_transfer()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    # ---- the step --------------------------------------------------------------------------------------------
    def step(self) -> list[Union[RequestOutput, PoolingRequestOutput]]:
        """One step. With async scheduling (while no request reads its past tokens on the host to sample), the
        next step is scheduled and launched before this one's tokens are back, and the outputs returned are the
        last launched step's."""
        if self.config.scheduler_config.async_scheduling and not self._reads_history():
            return self._async_step()
        if self._in_flight is not None:           # the step under way comes back first
            return self._complete(*self._in_flight)
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        self._move_kv(sched)
        if sched.is_empty:
            self.runner.forget(sched.finished_req_ids)
            return []
        reqs = [self.scheduler.requests[s.req_id] for s in sched.scheduled]
        masks = self.structured_outputs.fill_bitmasks(self._sampling_grammars(sched, reqs))   # while the model runs
        out = self.runner.execute(sched, masks)
        self.scheduler.update(sched, out.sampled)
        outputs = self._process(reqs, out)
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.running)
        self._record(sched, out, time.perf_counter() - t0)
        return outputs

    def _async_step(self) -> list[Union[RequestOutput, PoolingRequestOutput]]:
        # steps overlap: each one's time runs from the last one's return (or its own launch) to its own return
        t0 = max(time.perf_counter(), self._last_return)
        sched = self.scheduler.schedule(in_flight=True)
        self._move_kv(sched)
        launched = None
        if sched.is_empty:
            self.runner.forget(sched.finished_req_ids)
        else:
            reqs = [self.scheduler.requests[s.req_id] for s in sched.scheduled]
            launched = (sched, reqs, self.runner.launch(sched), t0)
        outputs = self._complete(*self._in_flight) if self._in_flight is not None else []
        self._in_flight = launched
        return outputs

    def _complete(self, sched: SchedulerOutput, reqs: list[Request], handle, t0: float
                  ) -> list[Union[RequestOutput, PoolingRequestOutput]]:
        """A step launched asynchronously, back: its tokens appended, stops checked, outputs made."""
        self._in_flight = None
        out = self.runner.finish(handle)
        self._last_return = time.perf_counter()
        self.scheduler.update(sched, out.sampled, in_flight=True, reqs=reqs)
        outputs = self._process(reqs, out)
        self._record(sched, out, time.perf_counter() - t0)
        return outputs

    def _reads_history(self) -> bool:
        """Whether a request waiting or running samples from its past tokens on the host (penalties, bad words,
        min_tokens, a grammar): those steps wait for the last one's tokens."""
        return self.scheduler.num_history_readers > 0

    @staticmethod
    def _sampling_grammars(sched: SchedulerOutput, reqs: list[Request]) -> dict:
        """The grammars of the constrained requests that sample this step (those whose scheduled tokens reach their
        end)."""
        return {r.request_id: r.grammar for r, s in zip(reqs, sched.scheduled)
                if r.grammar is not None and r.num_computed_tokens + s.num_tokens == r.num_tokens}

    def _process(self, reqs: list[Request], out: RunnerOutput) -> list[Union[RequestOutput, PoolingRequestOutput]]:
        """Stop checks and outputs for the requests that got a token this step, and the pooling requests that
        finished their prompt."""
        now = time.monotonic()
        touched: dict[str, None] = {}
        for req in reqs:
            if req.is_pooling:
                if not req.is_finished and self._pool(req, *out.pooled[req.request_id], now):
                    touched[req.request_id] = None
                continue
            if req.request_id in out.prompt_logprobs:
                req.prompt_logprobs.extend(out.prompt_logprobs[req.request_id])
            toks = out.sampled.get(req.request_id)
            if toks is None or req.is_finished:
                continue
            m = req.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            else:
                m.inter_token_latencies.append(now - m.last_token_time)
            m.last_token_time = now
            touched[self.child_parent.get(req.request_id, req.request_id)] = None
            lps = out.logprobs.get(req.request_id)
            # the step appended every token; go through them in order, as if they had come one a step
            n_before = len(req.output_token_ids) - len(toks)
            for i, tok in enumerate(toks):
                if lps is not None:
                    req.logprobs.append(lps[i])
                    req.cumulative_logprob += lps[i][tok].logprob
                status = self._check_token(req, tok, n_before + i + 1)
                if status is not None:
                    req.truncate_output(n_before + i + 1)
                    m.finished_time = now
                    self._send_kv(req)
                    self.scheduler.finish(req, status)
                    break
            m.num_generation_tokens = len(req.output_token_ids)
        return [self._request_output(rid) for rid in touched]

    def _send_kv(self, req: Request) -> None:
        """A prefill instance's request, finished: the KV of its prompt's full blocks (all but the block holding
        the last token, which the decode instance computes to sample) goes to the decode instance it names."""
        dest = None if self.transfer is None else \
            remote_decode((req.params.extra_args or {}).get("kv_transfer_params"))
        if dest is None:
            return
        limit = (req.num_prompt_tokens - 1) // self.config.cache_config.block_size
        blocks = []
        for table in self.kv.tables_of(req.request_id):
            for bid in table[:limit]:
                blk = self.kv.pool.blocks[bid] if bid >= 0 else None
                if blk is not None and blk.block_hash is not None:
                    blocks.append((bid, blk.block_hash, key_text(blk.key)))
        payloads = self.transfer.codec.read([b for b, _, _ in blocks]) if blocks else []
        items = [(k, text, p) for (_, k, text), p in zip(blocks, payloads)]
        req.kv_transfer_params = {"do_remote_prefill": True,
                                  "transfer": self.transfer.sender.send_async(dest[0], dest[1], items)}

    def _pool(self, req: Request, start: int, count: int, part: torch.Tensor, now: float) -> bool:
        """Add this step's chunk (count prompt rows from position start) to req's pooled vector; once the chunk
        reaches the prompt's end, finish req (its blocks go back) with the final vector. A chunk at position 0
        starts over (a preempted request is recomputed)."""
        req.pooled = part if req.pooling_type == "LAST" or start == 0 else req.pooled + part
        if start + count < req.num_prompt_tokens:
            return False
        v = req.pooled / req.num_prompt_tokens if req.pooling_type == "MEAN" else req.pooled
        if req.pooling_params.normalize:
            v = torch.nn.functional.normalize(v, dim=0)
        req.pooled = v.cpu()
        req.metrics.finished_time = now
        self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
        return True

    def _check_token(self, req: Request, tok: int, n_out: int) -> Optional[RequestStatus]:
        """Whether req ends with tok, its n_out-th output token: a grammar that refuses it (abort), or a stop."""
        if req.grammar is not None and not req.grammar.accept(tok):
            # the mask allowed nothing the grammar could take (e.g. min_tokens banned its only stop token)
            log.warning("request %s: token %d is outside its grammar; aborting it", req.request_id, tok)
            req.stop_reason = ("its constraint allowed no token that the request's bans (bad_words, allowed_token_ids, "
                               "min_tokens) leave")
            return RequestStatus.FINISHED_ABORTED
        return self._check_stop(req, tok, n_out)

    def _check_stop(self, req: Request, tok: int, n_out: int) -> Optional[RequestStatus]:
        p = req.params
        eos = not p.ignore_eos and tok in req.eos_token_ids
        # a finished grammar ends the request even with ignore_eos: nothing else may follow
        eos = eos or (req.grammar is not None and req.grammar.is_terminated)
        token_stop = n_out >= p.min_tokens and (eos or tok in p.stop_token_ids)
        if req.detokenizer is not None:
            # a stop token's own text stays out of the output (vLLM v1)
            stop_str = req.detokenizer.update([tok], stop_terminated=token_stop)
            if stop_str is not None:
                req.stop_reason = stop_str
                return RequestStatus.FINISHED_STOPPED
        if n_out >= req.max_tokens or req.num_prompt_tokens + n_out >= self.config.scheduler_config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if token_stop:
            req.stop_reason = None if eos else tok
            return RequestStatus.FINISHED_STOPPED
        return None

    def _completion(self, req: Request, index: int) -> CompletionOutput:
        text = ""
        if req.detokenizer is not None:
            text = req.detokenizer.get_next_output_text(req.is_finished, delta=False)
        return CompletionOutput(
            index=index, text=text, token_ids=list(req.output_token_ids),
            cumulative_logprob=req.cumulative_logprob if req.params.logprobs is not None else None,
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
            finish_reason=req.status.value if req.is_finished else None, stop_reason=req.stop_reason)

    def _request_output(self, rid: str) -> Union[RequestOutput, PoolingRequestOutput]:
        """The (cumulative) output of user-visible request rid (for n > 1, of all its children)."""
        req = self.requests.get(rid)
        if req is not None and req.is_pooling:      # only finished ones get here: forget it
            del self.requests[rid]
            return PoolingRequestOutput(rid, PoolingOutput(req.pooled), req.prompt_token_ids, True, req.prompt,
                                        req.metrics, max(req.num_cached_tokens, 0))
        parent = rid if rid in self.parents else None
        ids = self.parents[parent] if parent else [rid]
        reqs = [self.requests[c] for c in ids]
        first = reqs[0]
        done = all(r.is_finished for r in reqs)
        ro = RequestOutput(
            request_id=parent or rid, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
            outputs=[self._completion(r, i) for i, r in enumerate(reqs)], finished=done, metrics=first.metrics,
            prompt_logprobs=first.prompt_logprobs if first.params.prompt_logprobs is not None else None,
            num_cached_tokens=max(first.num_cached_tokens, 0), kv_transfer_params=first.kv_transfer_params)
        if done:   # forget it: the caller has everything now
            for c in ids:
                self.requests.pop(c, None)
            if parent:
                self.parents.pop(parent, None)
                for c in ids:
                    self.child_parent.pop(c, None)
        return ro

    def _record(self, sched: SchedulerOutput, out: RunnerOutput, seconds: float) -> None:
        s = self.stats
        for r in sched.scheduled:
            if r.spec_token_ids:
                s.spec_num_drafts += 1
                s.spec_num_draft_tokens += len(r.spec_token_ids)
                s.spec_num_accepted_tokens += len(out.sampled.get(r.req_id, [None])) - 1
        st = self.scheduler.stats(sched)
        s.num_steps += 1
        s.prefill_tokens += sched.num_prefill_tokens
        s.decode_tokens += sched.num_decode_tokens
        if sched.num_prefill_tokens:
            s.prefill_time_s += seconds
        else:
            s.decode_time_s += seconds
        s.num_preemptions += len(sched.preempted_req_ids)
        s.num_graph_steps, s.num_eager_decode_steps = self.runner.num_graph_steps, self.runner.num_eager_decode_steps
        s.prefix_cache_queries, s.prefix_cache_hits = self.kv.num_queries, self.kv.num_hits
        if self.offload is not None:
            for name, value in self.offload.stats.counters().items():
                setattr(s, name, value)
        if self.transfer is not None:
            for name, value in self.transfer.stats.counters().items():
                setattr(s, name, value)
        s.max_kv_blocks_used = max(s.max_kv_blocks_used, self.kv.num_used_blocks)
        s.sum_batch_size += len(sched.scheduled)
        s.last_step = st
        self.step_history.append((seconds, st))
