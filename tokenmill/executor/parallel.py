"""Tensor parallelism over torch.distributed (Megatron's split): each of N ranks holds 1/N of the attention heads
(its share of the paged KV cache with them; a kv head is repeated where there are fewer kv heads than ranks),
1/N of the MLP's intermediate columns and 1/N of the vocabulary. q/k/v and gate/up are split by output rows,
o_proj and down_proj by input columns, each followed by one all-reduce; embeddings are looked up where their row
lives and all-reduced; the LM head's logits are gathered for sampling.

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
from tokenmill.executor.loader import Checkpoint
from tokenmill.executor.runner import ModelRunner

# the families whose float checkpoints split so far (their q/k/v, o, gate/up and down are the Llama layout)
TP_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
TIMEOUT_S = 120       # the ranks must all have joined within this
# a collective waits this long: a worker idles in one between requests (a rank that dies closes its connections,
# which ends every collective at once)
COLLECTIVE_TIMEOUT = timedelta(days=365)


def check_tensor_parallel(mc: ModelConfig, size: int, device: torch.device, quantized: bool) -> None:
    """ValueError naming what stops this model from splitting over size ranks."""
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
    if quantized:
        raise ValueError("tensor_parallel_size > 1 splits float checkpoints so far; this one is quantised "
                         "(a GGUF's blocks, or quantization=)")
    for what, n in (("attention heads", mc.num_attention_heads), ("the MLP's intermediate size",
                                                                   mc.intermediate_size),
                    ("the vocabulary", mc.vocab_size)):
        if n % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide {what} ({n}); choose a divisor of {n}")
    kv = mc.num_key_value_heads
    if kv % size and size % kv:
        raise ValueError(f"tensor_parallel_size={size} and {kv} kv heads: one must divide the other (ranks share a "
                         f"kv head, or split them)")


def shard_config(mc: ModelConfig, size: int) -> ModelConfig:
    """One rank's model: its heads, kv heads (at least one), intermediate columns and vocabulary rows."""
    return dataclasses.replace(mc, num_attention_heads=mc.num_attention_heads // size,
                               num_key_value_heads=max(mc.num_key_value_heads // size, 1),
                               intermediate_size=mc.intermediate_size // size, vocab_size=mc.vocab_size // size)


def _rows(name: str) -> Optional[str]:
    """How an HF tensor splits: 'rows' (by output), 'cols' (by input), or None (every rank holds it whole)."""
    part = name.split(".")[-2] if name.count(".") else name
    if part in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head"):
        return "rows"
    if part in ("o_proj", "down_proj") and name.endswith("weight"):
        return "cols"
    return None


def shard_tensor(name: str, t: torch.Tensor, mc: ModelConfig, rank: int, size: int) -> torch.Tensor:
    """This rank's slice of an HF tensor of the whole model."""
    how = _rows(name)
    if how is None:
        return t
    part = name.split(".")[-2]
    d = mc.head_dim
    if part in ("k_proj", "v_proj"):
        kv = mc.num_key_value_heads
        if kv >= size:
            per = kv // size
            return t[rank * per * d:(rank + 1) * per * d]
        head = rank * kv // size             # the kv head this rank's query heads read
        return t[head * d:(head + 1) * d]
    n = t.shape[0] if how == "rows" else t.shape[1]
    per = n // size
    return t[rank * per:(rank + 1) * per] if how == "rows" else t[:, rank * per:(rank + 1) * per]


def sharded(tensors: Iterator[tuple[str, Any]], mc: ModelConfig, rank: int, size: int) -> Iterator[tuple[str, Any]]:
    for name, t in tensors:
        yield name, shard_tensor(name, t, mc, rank, size).contiguous()


def sharded_checkpoint(whole: Checkpoint, mc: ModelConfig, rank: int, size: int) -> Checkpoint:
    """The checkpoint of the whole model mc as rank's share of it (float tensors: split checkpoints are float)."""
    return Checkpoint(whole.config, lambda keep_blocks=False: sharded(whole.tensors(keep_blocks=False), mc, rank, size),
                      whole.quantized, whole.release)


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
        """Leave the group: torchrun's default group is destroyed (before the interpreter's own teardown, which
        would abort on it). Later collectives raise."""
        if self.pg is not None and dist.is_initialized() and self.pg is dist.distributed_c10d._get_default_group():
            dist.destroy_process_group()
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
        """Join the ranks torchrun started (its RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT), gloo."""
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if world != size:
            raise ValueError(f"tensor_parallel_size={size} but torchrun started {world} ranks; make them equal")
        try:
            dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
        except (RuntimeError, dist.DistStoreError) as e:
            raise ValueError(f"tensor_parallel_size={size}: not every rank joined the rendezvous at "
                             f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} within {timeout_s:g} s "
                             f"({e}); start the other ranks with the same torchrun --nnodes/--master-addr") from None
        return TPGroup(rank, world, dist.distributed_c10d._get_default_group())

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
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker_main, args=(rank, size, store.port), daemon=True,
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


def _worker_main(rank: int, size: int, port: int) -> None:
    """A worker process this machine's engine started. Ctrl-C in the terminal is the engine's to handle."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    store = dist.TCPStore("127.0.0.1", port, size, False, timedelta(seconds=TIMEOUT_S))
    serve_rank(TPGroup.local(rank, size, store))


def serve_rank(group: TPGroup) -> None:
    """A worker rank: build its share of the model from the spec rank 0 sends, then run the steps it sends."""
    from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig
    from tokenmill.engine.engine import load_model, open_model
    from tokenmill.executor.cpus import FixedThreads
    spec: WorkerSpec = group.receive()
    rank, size = group.rank, group.size
    torch.set_num_threads(spec.threads)
    dev = torch.device("cpu")
    whole, mc = open_model(spec.path, None, dev)
    part = shard_config(mc, size)
    ckpt = sharded_checkpoint(whole, mc, rank, size)
    model = load_model(spec.path, part, spec.dtype, dev, spec.max_model_len, ckpt, False, spec.cpu_kernels,
                       tp=group)
    num_blocks = group.receive()
    config = EngineConfig(spec.path, part, CacheConfig(spec.block_size, cache_dtype=spec.kv_cache_dtype),
                          SchedulerConfig(max_model_len=spec.max_model_len), spec.dtype, dev, spec.attention_backend,
                          False, spec.cpu_kernels)
    runner = ModelRunner(config, model, num_blocks, FixedThreads(spec.threads))
    hidden = None
    with torch.inference_mode():
        while True:
            msg = group.receive()
            if msg[0] == "forward":
                hidden = runner._forward(*msg[1])
            elif msg[0] == "logits":
                runner.model.compute_logits(hidden[msg[1]])
            else:
                group.close()
                return


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: each step's inputs, and each logits call's rows, go to the workers first (one message
    each), then rank 0 runs its own share."""

    def __init__(self, *args, group: TPGroup, workers: list[mp.Process], **kw):
        super().__init__(*args, **kw)
        self.group, self.workers = group, workers

    @property
    def alive(self) -> bool:
        return not self.group.broken and all(p.is_alive() for p in self.workers)

    def _forward(self, *args) -> torch.Tensor:
        self.group.send(("forward", args))
        return super()._forward(*args)

    def _logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        self.group.send(("logits", rows))
        return super()._logits(hidden, rows)


if __name__ == "__main__":          # a rank torchrun started: `torchrun ... -m tokenmill.executor.parallel`
    serve_rank(TPGroup.from_env(int(os.environ["WORLD_SIZE"])))
