"""Data parallelism: N engine replicas behind one server, each on cores of its own (CPU affinity) or a GPU of its
own, a router (router.py) picking the replica of each request.

Replica 0 runs in this process, on an AsyncLLM's engine thread (the server reads the model's config and tokenizer
from it); the others run in processes of their own (replica.py)."""
from __future__ import annotations

import functools
import itertools
import os
import threading
from typing import Any, Optional, Union

import torch

from tokenmill.config import CacheConfig
from tokenmill.engine.async_engine import (AsyncLLM, DrainingError, EngineState, IterationHook, QueueFullError,
                                           RequestStream)
from tokenmill.engine.engine import LLMEngine, PromptType, prompt_cache_salt
from tokenmill.executor.loading import default_kv_budget, utilization_budget
from tokenmill.engine.replica import RemoteReplica
from tokenmill.engine.router import Router, check_routing
from tokenmill.executor.cpus import available_cpus
from tokenmill.outputs import RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams


def replica_cores(size: int) -> list[list[int]]:
    """The cores of each replica: this process's, as many apiece (the cgroup quota bounds how many count)."""
    cores = sorted(os.sched_getaffinity(0))[:available_cpus()]
    per = len(cores) // size
    if per < 1:
        raise ValueError(f"data_parallel_size={size} needs a core per replica and {len(cores)} are here; lower it")
    return [cores[i * per:(i + 1) * per] for i in range(size)]


class DataParallelLLM:
    """data_parallel_size engine replicas behind one AsyncLLM face (the server takes either). engine_args are
    LLMEngine's, given to every replica; each replica computes on its own cores, and without kv_cache_memory_gb
    the KV budget one engine would take is shared among them."""

    def __init__(self, model: Optional[str] = None, data_parallel_size: int = 2, routing: str = "cache_aware",
                 max_waiting: Optional[int] = None, **engine_args: Any):
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
        check_routing(routing)
        if engine_args.get("kv_transfer_config") is not None:
            raise ValueError("data_parallel_size with a KV transfer role is not implemented: run one instance per "
                             "role and pair them with `tokenmill router`")
        if engine_args.get("tensor_parallel_size", 1) != 1:
            raise ValueError("data_parallel_size with tensor_parallel_size > 1 is not implemented; use one of them")
        size = data_parallel_size
        device = engine_args.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
        per_replica: list[dict] = [dict(engine_args) for _ in range(size)]
        cores: list[Optional[list[int]]] = [None] * size
        if str(device).startswith("cuda"):
            if torch.cuda.device_count() < size:
                raise ValueError(f"data_parallel_size={size} needs a GPU per replica and "
                                 f"{torch.cuda.device_count()} are here; lower it")
            for i, args in enumerate(per_replica):
                args["device"] = f"cuda:{i}"
        else:
            cores = replica_cores(size)
            util = engine_args.pop("gpu_memory_utilization", None)
            for args in per_replica:
                args.pop("gpu_memory_utilization", None)
            if engine_args.get("kv_cache_memory_gb") is None and util is not None:
                # vLLM's rule over the RAM the replicas share: a share of the whole, less what is in use, split
                share = utilization_budget(torch.device("cpu"), util)[0] / size / 2 ** 30
                if share <= 0:
                    raise ValueError(f"gpu_memory_utilization={util} leaves no memory for the KV caches after what "
                                     f"is in use; raise it, or give kv_cache_memory_gb")
            elif engine_args.get("kv_cache_memory_gb") is None:
                share = default_kv_budget(torch.device("cpu"), CacheConfig(16).memory_utilization) / size / 2 ** 30
            for c, args in zip(cores, per_replica):
                if args.get("num_threads") is None:
                    args["num_threads"] = len(c)
                elif args["num_threads"] > len(c):
                    raise ValueError(f"num_threads={args['num_threads']} but each data-parallel replica has "
                                     f"{len(c)} cores of its own; leave it out or lower it")
                if engine_args.get("kv_cache_memory_gb") is None:
                    args["kv_cache_memory_gb"] = share
        self.max_waiting = max_waiting
        self.hooks: list[IterationHook] = []
        self.cores = cores
        self._lock = threading.Lock()
        self._where: dict[str, int] = {}          # request id -> its replica, while in flight
        self._pending = 0                         # adds not yet answered (the queue bound counts them)
        self.draining = False                     # drain(): no new requests, those in flight go on
        self._ids = itertools.count()
        # the other replicas load in their processes while replica 0 loads here
        remotes = [RemoteReplica(i, cores[i], model, per_replica[i]) for i in range(1, size)]
        self.replicas: list[Union[AsyncLLM, RemoteReplica]] = []
        try:
            self.replicas.append(AsyncLLM(functools.partial(_pinned_engine, cores[0], model, per_replica[0])))
            for r in remotes:
                r.wait_ready()
                self.replicas.append(r)
        except BaseException:
            for r in remotes:
                r.shutdown("a data-parallel replica failed to start", wait=True)
            if self.replicas:
                self.replicas[0].shutdown("a data-parallel replica failed to start", wait=True)
            raise
        self._states = [r.state for r in self.replicas]
        self.state = EngineState.total(self._states)
        self.router = Router(routing, size, self.engine.config.cache_config.block_size, self.engine.kv.num_blocks)
        for i, r in enumerate(self.replicas):
            r.hooks.append(functools.partial(self._on_iteration, i))

    # ---- AsyncLLM's face -------------------------------------------------------------------------------------
    @property
    def engine(self) -> LLMEngine:
        """Replica 0's engine: the model's config and tokenizer, the same in every replica."""
        return self.replicas[0].engine

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        """Every replica runs (a dead one makes health 503, while the others go on serving)."""
        return all(r.is_running for r in self.replicas)

    @property
    def num_in_flight(self) -> int:
        """Requests routed to a replica and not yet finished or aborted, on all replicas."""
        return len(self._where)

    def drain(self) -> None:
        """AsyncLLM.drain for all replicas: new requests are refused here, the replicas go on with the rest."""
        self.draining = True

    @property
    def error(self) -> Optional[str]:
        return next((f"replica {i}: {r.error}" for i, r in enumerate(self.replicas) if r.error is not None), None)

    async def add_request(self, prompt: PromptType, params: Union[SamplingParams, PoolingParams],
                          request_id: Optional[str] = None) -> RequestStream:
        """Route the request (by its token ids) and queue it on that replica; AsyncLLM.add_request's errors."""
        if self.draining:
            raise DrainingError("the server is shutting down: it finishes the requests in flight and takes no "
                                "new ones")
        waiting = self.state.num_waiting + self._pending
        if self.max_waiting is not None and waiting >= self.max_waiting:
            raise QueueFullError(f"{waiting} requests are already waiting (the bound is {self.max_waiting}); retry "
                                 f"later")
        rid = request_id or f"req-{next(self._ids)}"
        text, ids = self.engine.tokenize_prompt(prompt)
        salt = prompt_cache_salt(prompt)      # routed by salted hashes, and passed on to the replica's cache
        with self._lock:
            if rid in self._where:
                raise ValueError(f"request id {rid!r} is already in use")
            i = self.router.pick(ids, [r.is_running for r in self.replicas], salt)
            self._where[rid] = i
        self._pending += 1
        routed: dict[str, Any] = {"prompt": text, "prompt_token_ids": ids}
        if salt is not None:
            routed["cache_salt"] = salt
        try:      # tokenised once, here
            return await self.replicas[i].add_request(routed, params, rid)
        except BaseException:
            self._done([rid])
            raise
        finally:
            self._pending -= 1

    def shutdown(self, reason: str = "the server is shutting down", wait: bool = False) -> None:
        """Stop every replica. Without wait it returns at once, the work done on a thread of its own: it takes
        locks, and a signal handler (the server's Ctrl-C) may have interrupted their holder on this thread."""
        def stop() -> None:
            for r in self.replicas:
                r.shutdown(reason, wait)
        if wait:
            stop()
        else:
            threading.Thread(target=stop, name="tokenmill-dp-shutdown", daemon=True).start()

    # ---- every replica's iterations ----------------------------------------------------------------------------
    def _on_iteration(self, replica: int, outputs: list[RequestOutput], aborted: list[str],
                      state: EngineState) -> None:
        """A replica's hook (its thread): the router's loads, then the front's hooks with the replicas' total."""
        ended = [o.request_id for o in outputs if o.finished] + aborted
        if not self.replicas[replica].is_running:      # dead: nothing it had will end by itself (aborts sent late)
            with self._lock:
                ended += [rid for rid, i in self._where.items() if i == replica]
        self._done(ended)
        with self._lock:
            self._states[replica] = state
            self.state = total = EngineState.total(self._states)
            for hook in self.hooks:
                hook(outputs, aborted, total)

    def _done(self, ids: list[str]) -> None:
        with self._lock:
            for rid in ids:
                i = self._where.pop(rid, None)
                if i is not None:
                    self.router.load[i] -= 1


def _pinned_engine(cores: Optional[list[int]], model: Optional[str], engine_args: dict) -> LLMEngine:
    """Replica 0's engine, built on (and computing from) the engine thread pinned to its cores."""
    if cores:
        os.sched_setaffinity(0, cores)
    return LLMEngine(model, **engine_args)
