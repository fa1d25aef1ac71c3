"""AsyncLLM: the engine stepping in a background thread while requests are in flight, one async stream per request.

The engine is not thread-safe, so one thread owns it. Built on that thread too (from_engine_args): OpenMP keeps
one worker pool per thread that runs parallel regions, and two pools on two cores make libgomp stop spinning
between regions, which doubled the time of a small decode step. Adds, aborts and any other engine call travel to that
thread through a command queue and run between steps; outputs travel back to each request's event loop with
loop.call_soon_threadsafe. Requests from all clients share the engine's batch (continuous batching), and a
request that is aborted (client gone, handler cancelled) leaves the batch at the next step and frees its blocks.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, TypeVar, Union

from tokenmill.engine.kv_offload import COUNTERS as OFFLOAD_COUNTERS
from tokenmill.engine.kv_transfer import COUNTERS as TRANSFER_COUNTERS
from tokenmill.engine.engine import LLMEngine, PromptType
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams

log = logging.getLogger("tokenmill.async_engine")
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shutdown) or a step failed; the request cannot go on."""


class DrainingError(EngineDeadError):
    """The server is shutting down: the requests in flight run to their end, new ones are refused (a 503)."""


class QueueFullError(RuntimeError):
    """More requests are waiting than the configured bound allows (the server answers 503)."""


class ClientDisconnected(Exception):
    """The stream was cancelled by its consumer (e.g. the HTTP client went away)."""


@dataclass
class EngineState:
    """A snapshot taken on the engine thread after each iteration; safe to read from any thread."""
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_usage: float = 0.0
    num_steps: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0       # in tokens, cumulative
    prefix_cache_hits: int = 0
    spec_num_drafts: int = 0            # speculative decoding, cumulative (EngineStats' counters)
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    step_prefill_tokens: int = 0        # of the last step: shows which phase the engine is in
    step_decode_tokens: int = 0
    num_graph_steps: int = 0            # cumulative: steps replayed from a graph, decode steps no graph held
    num_eager_decode_steps: int = 0
    # the KV offload tiers: EngineStats' kv_offload_* counters by name (kv_offload.COUNTERS), cumulative
    kv_offload: dict[str, int] = field(default_factory=dict)
    # prefill/decode disaggregation: the transfer's kv_transfer_* counters (kv_transfer.COUNTERS), cumulative
    kv_transfer: dict[str, int] = field(default_factory=dict)
    # LoRA adapters (by name) of the running and the waiting requests
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()

    @staticmethod
    def of(eng: LLMEngine, stepped: bool) -> "EngineState":
        """The engine's state now (stepped: the last iteration ran a step, whose phase shows)."""
        st = eng.stats
        # the scheduler's queues, not stats.last_step: adds and aborts between steps must show too
        return EngineState(
            num_running=len(eng.scheduler.running), num_waiting=len(eng.scheduler.waiting),
            kv_blocks_used=eng.kv.num_used_blocks, kv_blocks_total=eng.kv.num_blocks, kv_usage=eng.kv.usage,
            num_steps=st.num_steps, num_preemptions=st.num_preemptions,
            prefix_cache_queries=st.prefix_cache_queries, prefix_cache_hits=st.prefix_cache_hits,
            spec_num_drafts=st.spec_num_drafts, spec_num_draft_tokens=st.spec_num_draft_tokens,
            spec_num_accepted_tokens=st.spec_num_accepted_tokens, prefill_tokens=st.prefill_tokens,
            decode_tokens=st.decode_tokens, num_graph_steps=st.num_graph_steps,
            num_eager_decode_steps=st.num_eager_decode_steps,
            step_prefill_tokens=st.last_step.num_prefill_tokens if stepped else 0,
            step_decode_tokens=st.last_step.num_decode_tokens if stepped else 0,
            kv_offload={f: getattr(st, f) for f in OFFLOAD_COUNTERS},
            kv_transfer=eng.transfer.stats.counters() if eng.transfer is not None else {},
            **(_adapters(eng) if eng.config.lora_config is not None else {}))

    @staticmethod
    def total(states: "list[EngineState]") -> "EngineState":
        """Several engines' states as one (data-parallel replicas): counts add, the KV usage is of all blocks."""
        out = EngineState(**{f.name: sum((getattr(s, f.name) for s in states),
                                         () if f.name.endswith("_loras") else 0) for f in dataclasses.fields(EngineState)
                             if f.name not in ("kv_offload", "kv_transfer")})
        out.kv_offload = {k: sum(s.kv_offload.get(k, 0) for s in states) for k in OFFLOAD_COUNTERS}
        out.kv_transfer = {k: sum(s.kv_transfer.get(k, 0) for s in states) for k in TRANSFER_COUNTERS}
        out.kv_usage = out.kv_blocks_used / out.kv_blocks_total if out.kv_blocks_total else 0.0
        return out


def _adapters(eng: LLMEngine) -> dict[str, tuple[str, ...]]:
    def names(reqs: Any) -> tuple[str, ...]:
        return tuple(sorted({r.lora.request.lora_name for r in reqs if r.lora is not None}))
    return {"running_loras": names(eng.scheduler.running), "waiting_loras": names(eng.scheduler.waiting)}


# called on the engine thread after every iteration: (outputs of this step, ids aborted since the last call, state)
IterationHook = Callable[[list[RequestOutput], list[str], EngineState], None]


class RequestStream:
    """Async iterator over one request's cumulative RequestOutputs. Outputs that arrive faster than they are
    read are coalesced: each is cumulative, so only the newest matters."""

    def __init__(self, request_id: str, llm: "AsyncLLM", loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.loop = loop
        self._llm = llm
        self._latest: Optional[RequestOutput] = None
        self._error: Optional[BaseException] = None
        self._event = asyncio.Event()
        self.finished = False        # the consumer has seen the end (or gave up)

    # ---- called on the event loop (posted from the engine thread) ----
    def _put(self, out: RequestOutput) -> None:
        self._latest = out
        self._event.set()

    def _fail(self, err: BaseException) -> None:
        if self._latest is None or not self._latest.finished:
            self._error = err
            self._event.set()

    # ---- the consumer's side ----
    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        await self._event.wait()
        self._event.clear()
        if self._error is not None:
            self.finished = True
            raise self._error
        out = self._latest
        assert out is not None
        self.finished = out.finished
        return out

    def cancel(self, err: Optional[BaseException] = None) -> None:
        """Stop the request: the reader gets err (default ClientDisconnected), the engine aborts it."""
        if self.finished:
            return
        self._fail(err or ClientDisconnected(self.request_id))
        self.abort()

    def abort(self) -> None:
        """Abort in the engine unless the request has finished; idempotent, never blocks (for finally blocks)."""
        if not self.finished:
            self.finished = True
            self._llm._submit(("abort", self.request_id))


class AsyncLLM:
    def __init__(self, engine: Union[LLMEngine, Callable[[], LLMEngine]], max_waiting: Optional[int] = None):
        """engine: a built LLMEngine, or a function that builds one, called on the engine thread (preferred:
        see the module's docstring). Errors of the build are raised here."""
        self.max_waiting = max_waiting          # None: unbounded; else QueueFullError beyond it
        self.hooks: list[IterationHook] = []
        self.error: Optional[str] = None        # why the loop stopped; None while it runs
        self._cmds: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}   # touched on the engine thread only
        self._aborted: list[str] = []
        self._pending = 0                                # adds not yet answered (event-loop side)
        self._ids = itertools.count()
        self._closed = False                             # no more commands: the loop has stopped
        self.draining = False                            # drain(): no new requests, those in flight go on
        self._lock = threading.RLock()                   # re-entrant: shutdown() may run in a signal handler
        self.state = EngineState()
        built: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(engine, built), name="tokenmill-engine",
                                        daemon=True)
        self._thread.start()
        self.engine: LLMEngine = built.result()

    @classmethod
    def from_engine_args(cls, model: Optional[str] = None, max_waiting: Optional[int] = None,
                         **engine_args: Any) -> "AsyncLLM":
        """vLLM's constructor: the engine built on its own thread from LLMEngine's arguments."""
        return cls(lambda: LLMEngine(model, **engine_args), max_waiting=max_waiting)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        return self.error is None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        """Requests accepted (or being accepted) and not yet finished or aborted; safe to read from any thread."""
        return len(self._streams) + self._pending

    def drain(self) -> None:
        """Refuse new requests (add_request raises DrainingError) while the engine goes on stepping those in
        flight; shutdown() later ends whatever is left. Signal-handler-safe: it only sets a flag."""
        self.draining = True

    # ---- the event loop's side ---------------------------------------------------------------------------------
    async def add_request(self, prompt: PromptType, params: Union[SamplingParams, PoolingParams],
                          request_id: Optional[str] = None, lora_request: Optional[LoRARequest] = None
                          ) -> RequestStream:
        """Queue a request (with a LoRA adapter, lora_request); returns its stream once the engine accepted it.
        Raises ValueError (bad input, from the engine), QueueFullError or EngineDeadError (DrainingError once
        drain() was called)."""
        if not self.is_running:
            raise EngineDeadError(self.error or "the engine loop is not running")
        if self.draining:
            raise DrainingError("the server is shutting down: it finishes the requests in flight and takes no "
                                "new ones")
        if self.max_waiting is not None and self.state.num_waiting + self._pending >= self.max_waiting:
            raise QueueFullError(f"{self.state.num_waiting + self._pending} requests are already waiting "
                                 f"(the bound is {self.max_waiting}); retry later")
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            # compiled here, off the engine thread, so a slow grammar stalls no one's steps (the engine's add hits
            # the cache)
            await asyncio.to_thread(self.engine.structured_outputs.compile, params.structured_outputs)
        rid = request_id or f"req-{next(self._ids)}"
        stream = RequestStream(rid, self, asyncio.get_running_loop())
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._pending += 1
        try:
            self._submit(("add", rid, prompt, params, stream, fut, time.monotonic(), lora_request))
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            stream.abort()        # queued after the add, so the engine thread drops it right after adding
            raise
        finally:
            self._pending -= 1
        return stream

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) on the engine thread between steps (the only safe place to touch the engine)."""
        if not self.is_running:
            raise EngineDeadError(self.error or "the engine loop is not running")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("call", fn, fut))
        return await asyncio.wrap_future(fut)

    def shutdown(self, reason: str = "the server is shutting down", wait: bool = False) -> None:
        """Stop the loop; requests in flight get EngineDeadError. Thread-safe and signal-handler-safe."""
        if self.error is None:
            self.error = reason
        self._submit(("stop", reason))
        if wait and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    def _submit(self, cmd: tuple) -> None:
        with self._lock:
            if not self._closed:
                self._cmds.put(cmd)
                return
        self._reject(cmd)

    def _reject(self, cmd: tuple) -> None:
        """Answer a command the stopped loop will never run, so nobody waits on it forever."""
        fut = cmd[5] if cmd[0] == "add" else cmd[2] if cmd[0] == "call" else None
        if fut is not None and fut.set_running_or_notify_cancel():
            fut.set_exception(EngineDeadError(self.error or "the engine loop has stopped"))

    # ---- the engine thread ----------------------------------------------------------------------------------------
    def _run(self, engine: Union[LLMEngine, Callable[[], LLMEngine]], built: concurrent.futures.Future) -> None:
        try:
            self.engine = engine if isinstance(engine, LLMEngine) else engine()
        except BaseException as e:
            self.error = f"the engine could not be built: {e}"
            with self._lock:
                self._closed = True
            built.set_exception(e)
            return
        self.state.kv_blocks_total = self.engine.kv.num_blocks
        built.set_result(self.engine)
        try:
            self._loop()
        except BaseException as e:      # the loop itself broke: say so (health turns 503), fail what is in flight
            log.exception("the engine loop crashed")
            self.error = self.error or f"the engine loop crashed: {e!r}"
            self._fail_all(EngineDeadError(self.error))
        finally:
            with self._lock:
                self._closed = True
            self.engine.shutdown()      # its workers, before the process exits (a signal skips finalizers)
            while True:
                try:
                    self._reject(self._cmds.get_nowait())
                except queue.Empty:
                    break

    def _loop(self) -> None:
        eng = self.engine
        stalled = False
        while True:
            cmds = []
            if stalled:
                try:     # nothing schedulable: wait a little for a command that changes that
                    cmds.append(self._cmds.get(timeout=0.01))
                except queue.Empty:
                    pass
            elif not eng.has_unfinished_requests():
                # idle: sleep until there is something to do, faulting in the KV cache's pages meanwhile, so the
                # memory it reserves is resident before load needs it (stopped before the next step)
                with eng.runner.faulting_in_kv_cache():
                    cmds.append(self._cmds.get())
            while True:
                try:
                    cmds.append(self._cmds.get_nowait())
                except queue.Empty:
                    break
            outputs: list[RequestOutput] = []
            try:
                for i, cmd in enumerate(cmds):
                    if cmd[0] == "stop":
                        self._fail_all(EngineDeadError(cmd[1]))
                        for later in cmds[i + 1:]:
                            self._reject(later)
                        self._after_iteration([])
                        return
                    self._handle(cmd)
                if eng.has_unfinished_requests():
                    steps = eng.stats.num_steps
                    outputs = eng.step()
                    stalled = eng.stats.num_steps == steps
            except Exception as e:      # a failed step must not take the server down: fail what is in flight
                log.exception("engine step failed")
                self._fail_all(EngineDeadError(f"the engine failed while running this request: {e}"))
                outputs = []
                if not eng.runner.alive:     # a tensor-parallel worker died: no step can run again
                    self.error = f"a tensor-parallel worker process died ({e})"
                    self._after_iteration([])
                    return
            # state and hooks (metrics) first: a client that has its answer finds it counted already
            self._after_iteration(outputs)
            self._dispatch(outputs)

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, params, stream, fut, arrival, lora = cmd
            if not fut.set_running_or_notify_cancel():
                return                  # the caller gave up before the engine got to it
            try:
                self.engine.add_request(rid, prompt, params, arrival_time=arrival, lora_request=lora)
            except Exception as e:      # ValueError for bad input; the handler turns it into a 400
                fut.set_exception(e)
                return
            self._streams[rid] = stream
            self.state.num_waiting = len(self.engine.scheduler.waiting)   # the queue bound sees it at once
            fut.set_result(None)
        elif kind == "abort":
            rid = cmd[1]
            if self._streams.pop(rid, None) is not None:
                self.engine.abort_request(rid)
                self._aborted.append(rid)
        elif kind == "call":
            _, fn, fut = cmd
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn(self.engine))
            except Exception as e:
                fut.set_exception(e)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            try:
                stream.loop.call_soon_threadsafe(stream._put, out)
            except RuntimeError:        # its event loop is closed: nobody is listening
                if not out.finished:
                    self._handle(("abort", out.request_id))

    def _fail_all(self, err: BaseException) -> None:
        ids = list(self._streams)
        for rid in ids:
            stream = self._streams.pop(rid)
            try:
                stream.loop.call_soon_threadsafe(stream._fail, err)
            except RuntimeError:
                pass
        try:
            self.engine.abort_request(ids)
        except Exception:
            log.exception("abort after a failure failed")
        self._aborted.extend(ids)

    def _after_iteration(self, outputs: list[RequestOutput]) -> None:
        self.state = s = EngineState.of(self.engine, bool(outputs))
        aborted, self._aborted = self._aborted, []
        for hook in self.hooks:
            try:
                hook(outputs, aborted, s)
            except Exception:
                log.exception("iteration hook failed")
