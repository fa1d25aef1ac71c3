"""Tensor parallelism over torch.distributed (Megatron's split): each of N ranks holds 1/N of the attention heads
(its share of the paged KV cache with them; a kv head is repeated where there are fewer kv heads than ranks),
1/N of the MLP's intermediate columns and 1/N of the vocabulary. q/k/v and gate/up are split by output rows,
o_proj and down_proj by input columns, each followed by one all-reduce; embeddings are looked up where their row
lives and all-reduced; the LM head's logits are gathered for sampling. Phi-3's fused qkv_proj and gate_up_proj
split part by part. A Mixture-of-Experts layer splits every expert's intermediate columns (and the shared
expert's) and holds the router whole, so every rank routes alike; one all-reduce follows the experts and the shared
expert together. Norms, Gemma's soft caps and sliding windows need nothing: each rank applies them whole.
DeepSeek's latent attention splits by heads too (q_proj or q_b_proj and kv_b_proj by rows, o_proj by columns); its
latent, one per token shared by all heads, every rank computes and caches whole, as one rank does.

A GGUF's quantised matrices are split in their blocks, not requantised, so each rank runs the kernels one rank
would: a row split never cuts a block, and a column split must fall on a block boundary (a share of a multiple of
32 weights for Q8_0/Q4_0/..., of 256 for the K-quants), else the model is refused, from the file's header, before
any rank starts. quantization= quantises each rank's share of the float checkpoint after the split.

Rank 0 is the engine: its scheduler plans each step, and its runner sends the step's inputs to the other ranks in
one message (and one more per logits call), then runs its own share; the other ranks are worker processes that
run the same forward on theirs. The process group is gloo over a store on loopback, the group's own (no global
default group), so an engine can start, stop and start again in one process."""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import pickle
import signal
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from tokenmill.config import ModelConfig
from tokenmill.executor.cpus import available_cpus
from tokenmill.executor.loader import Checkpoint, quantized_at_load
from tokenmill.executor.batch import ForwardBatch
from tokenmill.executor.runner import CpuRunner

# the families that split: the Llama layout (q/k/v, o, gate/up, down), Phi-3's (q/k/v and gate/up fused in the
# file: each part split), Gemma's, the Mixture-of-Experts kin's (every expert split as an MLP, the router whole) and
# DeepSeek's (its heads split, its latent whole); a family added later splits once it is listed here
TP_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
                    "Gemma2ForCausalLM", "Gemma3ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
                    "Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM")
TIMEOUT_S = 120       # the ranks must all have joined within this
# a collective waits this long: a worker idles in one between requests (a rank that dies closes its connections,
# which ends every collective at once)
COLLECTIVE_TIMEOUT = timedelta(days=365)

# how an HF tensor splits, by its module's name: by output rows (Phi-3's fused qkv_proj and gate_up_proj by each
# part's rows), by input columns (an all-reduce follows), or else whole on every rank (norms, routers)
_ROWS = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3", "embed_tokens", "lm_head", "qkv_proj",
         "gate_up_proj", "q_b_proj", "kv_b_proj"}
_COLUMNS = {"o_proj", "down_proj", "w2"}
_STACKED_EXPERTS = {"gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"}      # gpt-oss's names


def check_tensor_parallel(mc: ModelConfig, size: int, device: torch.device, path: str, keep_blocks: bool) -> None:
    """ValueError naming what stops the model at path from splitting over size ranks (keep_blocks: a GGUF's
    quantised matrices are to stay in their blocks)."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1:
        return
    cores = available_cpus()
    if size > cores and "WORLD_SIZE" not in os.environ:
        raise ValueError(f"tensor_parallel_size={size} exceeds the {cores} cores here (a rank computes on at least "
                         f"one); lower it, or start ranks on other machines with torchrun")
    if device.type != "cpu":
        raise ValueError("tensor_parallel_size > 1 runs on CPU ranks (gloo) so far; use device='cpu'")
    if mc.architecture not in TP_ARCHITECTURES:
        raise ValueError(f"tensor_parallel_size > 1 splits {', '.join(TP_ARCHITECTURES)} so far, not "
                         f"{mc.architecture}")
    dense = len(mc.moe_layers) < mc.num_hidden_layers
    for what, n in (("attention heads", mc.num_attention_heads),
                    ("the MLP's intermediate size", mc.intermediate_size if dense else 0),
                    ("the experts' intermediate size", mc.moe_intermediate_size if mc.moe_layers else 0),
                    ("the shared expert's intermediate size", mc.shared_expert_intermediate_size),
                    ("the vocabulary", mc.vocab_size)):
        if n % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide {what} ({n}); choose a divisor of {n}")
    kv = mc.num_key_value_heads
    if kv % size and size % kv:
        raise ValueError(f"tensor_parallel_size={size} and {kv} kv heads: one must divide the other (ranks share a "
                         f"kv head, or split them)")
    if keep_blocks and path.endswith(".gguf"):
        _check_gguf_blocks(path, mc, size)
    if os.path.isdir(path):
        from tokenmill.executor.loader import open_checkpoint
        quant = open_checkpoint(path).hf_quant
        if quant is not None:
            raise ValueError(f"tensor_parallel_size > 1 does not split a {quant.method} checkpoint's packed weights "
                             f"yet; run it on one rank (tensor_parallel_size=1), or split its float checkpoint")


def _check_gguf_blocks(path: str, mc: ModelConfig, size: int) -> None:
    """Every matrix split by columns that the GGUF keeps in blocks splits on a block boundary (from the header,
    before any rank starts). A matrix whose rows are not whole blocks is loaded in float and splits anywhere."""
    from tokenmill.executor.layers.quant import ggml_block
    from tokenmill.executor.loader.gguf import hf_name, layer_names, open_gguf
    names = layer_names(mc.architecture)
    for info in open_gguf(path).tensors.values():
        name = hf_name(info.name, names)
        k, block = info.shape[-1], ggml_block(info.type_name)[0]
        if name is not None and _split(name) == "columns" and info.type_name != "F32" and k % block == 0:
            _check_block(f"{name} ({info.type_name})", k, block, size)


def _check_block(what: str, k: int, block: int, size: int) -> None:
    if (k // size) % block:
        raise ValueError(f"tensor_parallel_size={size} would cut the quantised blocks of {what}: its {k} input "
                         f"columns would be {k // size} a rank, not a multiple of its blocks of {block}; choose a "
                         f"tensor_parallel_size whose share of {k} is a multiple of {block}, or load it with "
                         f"quantized_kernels=False (dequantised)")


def shard_config(mc: ModelConfig, size: int) -> ModelConfig:
    """One rank's model: its heads, kv heads (at least one), intermediate columns (the experts' too) and
    vocabulary rows."""
    return dataclasses.replace(mc, num_attention_heads=mc.num_attention_heads // size,
                               num_key_value_heads=max(mc.num_key_value_heads // size, 1),
                               intermediate_size=mc.intermediate_size // size,
                               moe_intermediate_size=mc.moe_intermediate_size // size,
                               shared_expert_intermediate_size=mc.shared_expert_intermediate_size // size,
                               vocab_size=mc.vocab_size // size)


def _split(name: str) -> Optional[str]:
    """How an HF tensor splits: 'rows', 'columns' (a weight; its bias is added once), or None (whole)."""
    part = name.split(".")[-2] if name.count(".") else name
    return "rows" if part in _ROWS else "columns" if part in _COLUMNS else None


def _row_ranges(part: str, n: int, mc: ModelConfig, rank: int, size: int) -> list[tuple[int, int]]:
    """This rank's rows [start, stop) of a tensor of n rows split by output: 1/size of them, but of k_proj and v_proj
    its kv heads (the one its query heads read, where there are fewer than ranks), and of a fused projection its
    share of each part."""
    d, kv = mc.head_dim, mc.num_key_value_heads

    def share(start: int, rows: int) -> tuple[int, int]:
        return start + rank * (rows // size), start + (rank + 1) * (rows // size)

    def kv_rows(start: int) -> tuple[int, int]:
        if kv >= size:
            return share(start, kv * d)
        head = rank * kv // size
        return start + head * d, start + (head + 1) * d
    if part in ("k_proj", "v_proj"):
        return [kv_rows(0)]
    if part == "qkv_proj":
        q = mc.num_attention_heads * d
        return [share(0, q), kv_rows(q), kv_rows(q + kv * d)]
    if part == "gate_up_proj":
        return [share(0, n // 2), share(n // 2, n // 2)]
    return [share(0, n)]


def shard_tensor(name: str, t: Any, mc: ModelConfig, rank: int, size: int) -> Any:
    """This rank's slice of an HF tensor of the whole model: float, or quantised blocks (layers/quant.py) sliced as
    they are, so that every rank runs the kernels one rank would. A column split must fall on a block boundary."""
    from tokenmill.executor.layers.quant import block_weights, take_columns, take_rows
    part, leaf = name.split(".")[-2:] if name.count(".") else ("", name)
    if leaf == "sinks":                 # gpt-oss: a sink a query head, split with the heads
        heads = mc.num_attention_heads // size
        return t[rank * heads:(rank + 1) * heads]
    if part == "experts" and leaf in _STACKED_EXPERTS:
        return _stacked_experts_share(leaf, t, mc, rank, size)
    how = _split(name)
    if how == "rows":
        ranges = _row_ranges(name.split(".")[-2], t.shape[0], mc, rank, size)
        if not isinstance(t, torch.Tensor):
            return take_rows(t, ranges)
        return t[ranges[0][0]:ranges[0][1]] if len(ranges) == 1 else torch.cat([t[a:b] for a, b in ranges])
    if how == "columns":
        if not name.endswith("weight"):         # a bias after the all-reduce: added once, by rank 0
            return t if rank == 0 else torch.zeros_like(t)
        k = t.shape[1]
        c0, c1 = rank * (k // size), (rank + 1) * (k // size)
        if not isinstance(t, torch.Tensor):
            _check_block(name, k, block_weights(t), size)
            return take_columns(t, c0, c1)
        return t[:, c0:c1]
    return t


def _stacked_experts_share(leaf: str, t: torch.Tensor, mc: ModelConfig, rank: int, size: int) -> torch.Tensor:
    """gpt-oss's experts, stacked in one tensor a matrix: every expert's intermediate columns split as an MLP's.
    gate_up_proj [E, hidden, 2I] interleaves gate and up along its last dim, so a rank's share of both is one run
    of it; down_proj [E, I, hidden] splits by its middle dim; down's bias is added once, after the all-reduce."""
    inter = mc.moe_intermediate_size // size
    if leaf.startswith("gate_up"):
        return t[..., 2 * rank * inter:2 * (rank + 1) * inter]
    if leaf == "down_proj":
        return t[:, rank * inter:(rank + 1) * inter]
    return t if rank == 0 else torch.zeros_like(t)


def sharded(tensors: Iterator[tuple[str, Any]], mc: ModelConfig, rank: int, size: int) -> Iterator[tuple[str, Any]]:
    for name, t in tensors:
        part = shard_tensor(name, t, mc, rank, size)
        yield name, part.contiguous() if isinstance(part, torch.Tensor) else part


def sharded_checkpoint(whole: Checkpoint, mc: ModelConfig, rank: int, size: int,
                       quantization: Optional[str] = None) -> Checkpoint:
    """The checkpoint of the whole model mc as rank's share of it: float tensors sliced, and a GGUF's blocks where
    they are kept; quantization= (whole must then be the float checkpoint) quantises the share after the split, so
    each rank quantises only its own (the same blocks as the whole's where a split falls on a block boundary)."""
    ckpt = Checkpoint(whole.config, lambda keep_blocks=False: sharded(whole.tensors(keep_blocks=keep_blocks), mc, rank,
                                                                      size), whole.quantized, whole.release)
    return ckpt if quantization is None else quantized_at_load(ckpt, quantization)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPGroup:
    """This engine's ranks: a gloo process group of its own over a TCP store on loopback (ranks this process
    started), or torch.distributed's default group from torchrun's environment (ranks on several machines)."""

    def __init__(self, rank: int, size: int, pg: Any):
        self.rank, self.size, self.pg = rank, size, pg
        self.broken = False             # a collective failed: the ranks are out of step for good
        # what this rank put into collectives: calls and bytes (the benchmark checks them against the formula)
        self.all_reduces = self.all_reduce_bytes = self.gathers = self.gather_bytes = 0

    def _wait(self, work) -> None:
        try:
            work.wait()
        except BaseException:
            self.broken = True
            raise

    def close(self) -> None:
        """Leave the group; later collectives raise."""
        self.pg, self.broken = None, True

    @staticmethod
    def local(rank: int, size: int, store: Any, timeout_s: float = TIMEOUT_S) -> "TPGroup":
        """A group over a store on loopback (rank 0's, which it made before starting the workers)."""
        try:
            pg = dist.ProcessGroupGloo(store, rank, size, COLLECTIVE_TIMEOUT)
        except (RuntimeError, dist.DistStoreError) as e:
            raise ValueError(f"tensor_parallel_size={size}: the worker processes did not join within {timeout_s:g} s "
                             f"({e}); see their errors above") from None
        group = TPGroup(rank, size, pg)
        group.store = store                 # the group's connections live as long as its store
        return group

    @staticmethod
    def from_env(size: int, timeout_s: float = TIMEOUT_S) -> "TPGroup":
        """Join the ranks torchrun (or `serve --nnodes`) started: its RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.
        The group is ours over a store at the master's address, as on one machine: torch.distributed's own
        rendezvous would wait as long as a collective may (a year), not TIMEOUT_S."""
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if world != size:
            raise ValueError(f"tensor_parallel_size={size} but torchrun started {world} ranks; make them equal")
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        # torchrun's agent on node 0 already serves a store at the master's port: rank 0 joins it then
        hosts = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        why = None
        try:
            # keys of our own: torchrun's restarts (and its own keys) share its store
            prefix = f"tokenmill/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
            store = dist.PrefixStore(prefix, dist.TCPStore(addr, port, world, hosts, timedelta(seconds=timeout_s)))
            return TPGroup.local(rank, world, store, timeout_s)
        except (RuntimeError, dist.DistStoreError, ValueError) as e:
            why = e
        raise ValueError(f"tensor_parallel_size={size}: not every rank joined the rendezvous at {addr}:{port} within "
                         f"{timeout_s:g} s ({why}); start the other ranks with the same --nnodes and --master-addr")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in float32 on the wire."""
        t = x.float().contiguous()
        self._wait(self.pg.allreduce([t]))
        self.all_reduces += 1
        self.all_reduce_bytes += t.nbytes
        return t.to(x.dtype)

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x side by side along the last dimension (rank order), on every rank."""
        t = x.float().contiguous()
        out = [torch.empty_like(t) for _ in range(self.size)]
        self._wait(self.pg.allgather([out], [t]))
        self.gathers += 1
        self.gather_bytes += t.nbytes
        return torch.cat(out, dim=-1).to(x.dtype)

    def send(self, obj: Any) -> None:
        """Rank 0: obj to every other rank (pickled: a length, then the bytes)."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self._wait(self.pg.broadcast([torch.tensor([data.numel()], dtype=torch.long)], dist.BroadcastOptions()))
        self._wait(self.pg.broadcast([data], dist.BroadcastOptions()))

    def receive(self) -> Any:
        n = torch.zeros(1, dtype=torch.long)
        self._wait(self.pg.broadcast([n], dist.BroadcastOptions()))
        data = torch.empty(int(n.item()), dtype=torch.uint8)
        self._wait(self.pg.broadcast([data], dist.BroadcastOptions()))
        return pickle.loads(data.numpy().tobytes())


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker rank needs to build its share of the engine's model."""
    path: str
    dtype: torch.dtype
    max_model_len: int
    block_size: int
    kv_cache_dtype: str
    cpu_kernels: str
    threads: int
    attention_backend: str = "auto"
    quantized_kernels: bool = True                  # a GGUF's quantised matrices stay in their blocks
    int8_activations: bool = True
    quantization: Optional[str] = None              # quantise the float checkpoint at load (after the split)


def start_ranks(spec: WorkerSpec, size: int, timeout_s: float = TIMEOUT_S) -> tuple[TPGroup, list[mp.Process]]:
    """Rank 0's group, and the other ranks: joined from torchrun's environment where torchrun started them (on
    this or other machines), else worker processes started here. Every worker gets spec over the group."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        if os.environ["RANK"] != "0":
            raise ValueError(f"this is torchrun's rank {os.environ['RANK']}: run the worker there "
                             f"(python -m tokenmill.executor.parallel), and the engine on rank 0")
        group, procs = TPGroup.from_env(size, timeout_s), []
    else:       # the store first, on a port the system picks, then the workers that join it
        store = dist.TCPStore("127.0.0.1", 0, size, True, timedelta(seconds=timeout_s), wait_for_workers=False)
        ctx = worker_context()
        procs = [ctx.Process(target=_worker_main, args=(rank, size, store.port, dict(os.environ)), daemon=True,
                             name=f"tokenmill-tp{rank}") for rank in range(1, size)]
        for p in procs:
            p.start()
        group = TPGroup.local(0, size, store, timeout_s)
    try:
        group.send(spec)
    except BaseException:
        stop_workers(group, procs)
        raise
    return group, procs


def local_threads(num_threads: Optional[int], size: int) -> int:
    """A rank's compute threads: num_threads if given, else its share of this machine's cores among the ranks that
    run here (torchrun's LOCAL_WORLD_SIZE; one a machine under serve --nnodes; all of them when this engine
    starts its workers)."""
    if num_threads:
        return num_threads
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if "WORLD_SIZE" in os.environ else size
    return max(1, available_cpus() // local)


def worker_context() -> Any:
    """Where worker processes start: forked from a server process that imported the engine once (not a second of
    imports each, as spawn takes). That server's state is the parent's when it started, so a worker is given the
    parent's environment now (adopt_environment)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["tokenmill.engine.engine"])
    return ctx


def adopt_environment(env: dict[str, str]) -> None:
    """A worker's first act: the environment its parent had when it started the worker (TOKENMILL_CPU_ISA, ...)."""
    os.environ.clear()
    os.environ.update(env)


def collectives_per_step(layers: int, hidden: int, vocab: int, size: int, tokens: int, sampled: int) -> dict:
    """The formula: a step of `tokens` rows of which `sampled` give logits all-reduces its embeddings and, in
    every layer, the attention's and the MLP's outputs (float32 rows of hidden), and gathers each sampled row's
    share of the vocabulary once."""
    return {"all_reduces": 2 * layers + 1, "all_reduce_bytes": (2 * layers + 1) * tokens * hidden * 4,
            "gathers": 1 if sampled else 0, "gather_bytes": sampled * vocab // size * 4}


def stop_workers(group: TPGroup, procs: list[mp.Process]) -> None:
    """Tell the workers to exit (those started here also die with this process: daemons), and leave the group."""
    try:
        group.send(("stop",))
    except Exception:       # a dead worker, or stopped already: nothing to tell
        pass
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    group.close()


def _worker_main(rank: int, size: int, port: int, env: dict[str, str]) -> None:
    """A worker process this machine's engine started. Ctrl-C in the terminal is the engine's to handle."""
    adopt_environment(env)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    store = dist.TCPStore("127.0.0.1", port, size, False, timedelta(seconds=TIMEOUT_S))
    serve_rank(TPGroup.local(rank, size, store))


def serve_rank(group: TPGroup) -> None:
    """A worker rank: build its share of the model from the spec rank 0 sends, then run the steps it sends."""
    from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig
    from tokenmill.executor.loading import load_model, open_model
    from tokenmill.executor.cpus import FixedThreads
    spec: WorkerSpec = group.receive()
    rank, size = group.rank, group.size
    # a rank alone on its machine (torchrun, serve --nnodes) computes on that machine's cores
    threads = spec.threads if "WORLD_SIZE" not in os.environ else local_threads(None, size)
    torch.set_num_threads(threads)
    dev = torch.device("cpu")
    whole, mc = open_model(spec.path, None, dev)
    part = shard_config(mc, size)
    ckpt = sharded_checkpoint(whole, mc, rank, size, spec.quantization)
    model = load_model(spec.path, part, spec.dtype, dev, spec.max_model_len, ckpt, spec.quantized_kernels,
                       spec.cpu_kernels, spec.int8_activations, tp=group)
    num_blocks = group.receive()
    config = EngineConfig(spec.path, part, CacheConfig(spec.block_size, cache_dtype=spec.kv_cache_dtype),
                          SchedulerConfig(max_model_len=spec.max_model_len), spec.dtype, dev, spec.attention_backend,
                          False, spec.cpu_kernels)
    runner = CpuRunner(config, model, FixedThreads(threads))
    runner.allocate_kv_cache(num_blocks)
    hidden = None
    with torch.inference_mode():
        while True:
            msg = group.receive()
            if msg[0] == "forward":
                hidden = runner._forward(msg[1])
            elif msg[0] == "logits":
                runner.model.compute_logits(hidden[msg[1]])
            else:
                group.close()
                return


class TensorParallelRunner(CpuRunner):
    """Rank 0's runner: each step's inputs, and each logits call's rows, go to the workers first (one message
    each), then rank 0 runs its own share."""

    def __init__(self, *args, group: TPGroup, workers: list[mp.Process], **kw):
        super().__init__(*args, **kw)
        self.group, self.workers = group, workers

    @property
    def alive(self) -> bool:
        return not self.group.broken and all(p.is_alive() for p in self.workers)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.group.send(("forward", batch))
        return super()._forward(batch)

    def _logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        self.group.send(("logits", rows))
        return super()._logits(hidden, rows)


if __name__ == "__main__":          # a rank torchrun started: `torchrun ... -m tokenmill.executor.parallel`
    serve_rank(TPGroup.from_env(int(os.environ["WORLD_SIZE"])))
