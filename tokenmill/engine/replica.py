"""A data-parallel replica in a process of its own: an engine loop that takes adds and aborts over a pipe and sends
back every step's outputs (what is new in each) and state, and its face in the server's process, which has
AsyncLLM's (add_request gives a RequestStream, hooks see every iteration)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import pickle
import queue
import signal
import threading
import time
from typing import Any, Optional, Union

from tokenmill.engine.async_engine import EngineDeadError, EngineState, IterationHook, RequestStream
from tokenmill.engine.engine import LLMEngine, PromptType
from tokenmill.executor.parallel import adopt_environment, worker_context
from tokenmill.outputs import RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams

log = logging.getLogger("tokenmill.replica")


def _portable(e: BaseException) -> BaseException:
    """e if it survives pickling (to cross the pipe), else a ValueError with its message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return ValueError(f"{type(e).__name__}: {e}")


# an output as it crosses the pipe: its new parts, and how much of the last one sent each keeps (text, tokens per
# completion; inter-token latencies)
Delta = tuple[RequestOutput, list[tuple[int, int]], int]


class OutputDeltas:
    """The replica's side: each RequestOutput as what changed since the last one sent for its request. Outputs are
    cumulative, and re-sent whole they would cost every step the length of every running request's output. Text
    may shrink (a stop string is cut), so each part says how much of the last one it keeps."""

    def __init__(self) -> None:
        self._sent: dict[str, tuple[dict[int, tuple[str, list[int]]], list[float]]] = {}

    def encode(self, out: Any) -> Any:
        if not isinstance(out, RequestOutput):       # a pooling request's one output goes whole
            return out
        first = out.request_id not in self._sent
        before, itl0 = self._sent.get(out.request_id, ({}, []))
        parts, keeps, now = [], [], {}
        for c in out.outputs:
            text0, ids0 = before.get(c.index, ("", []))
            tk = len(text0) if c.text.startswith(text0) else 0
            ik = len(ids0) if c.token_ids[:len(ids0)] == ids0 else 0
            parts.append(dataclasses.replace(c, text=c.text[tk:], token_ids=c.token_ids[ik:],
                                             logprobs=None if c.logprobs is None else c.logprobs[ik:]))
            keeps.append((tk, ik))
            now[c.index] = (c.text, c.token_ids)
        m = out.metrics
        itl = [] if m is None else list(m.inter_token_latencies)
        lk = len(itl0) if itl[:len(itl0)] == itl0 else 0
        if out.finished:
            self._sent.pop(out.request_id, None)
        else:
            self._sent[out.request_id] = (now, itl)
        delta = dataclasses.replace(
            out, outputs=parts, prompt=out.prompt if first else None,
            prompt_token_ids=out.prompt_token_ids if first else [],
            prompt_logprobs=out.prompt_logprobs if first else None,
            metrics=None if m is None else dataclasses.replace(m, inter_token_latencies=itl[lk:]))
        return delta, keeps, lk

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)


class OutputMerger:
    """The front's side: the cumulative RequestOutputs again, each a new object (a reader may keep the last)."""

    def __init__(self) -> None:
        self._have: dict[str, RequestOutput] = {}

    def decode(self, item: Any) -> Any:
        if not isinstance(item, tuple):
            return item
        out, keeps, lk = item
        last = self._have.get(out.request_id)
        if last is not None:
            out.prompt, out.prompt_token_ids, out.prompt_logprobs = last.prompt, last.prompt_token_ids, \
                last.prompt_logprobs
        had = {} if last is None else {c.index: c for c in last.outputs}
        for c, (tk, ik) in zip(out.outputs, keeps):
            p = had.get(c.index)
            if p is not None:
                c.text, c.token_ids = p.text[:tk] + c.text, p.token_ids[:ik] + c.token_ids
                if c.logprobs is not None:
                    c.logprobs = (p.logprobs or [])[:ik] + c.logprobs
        if out.metrics is not None and last is not None and last.metrics is not None:
            out.metrics.inter_token_latencies = last.metrics.inter_token_latencies[:lk] + \
                out.metrics.inter_token_latencies
        if out.finished:
            self._have.pop(out.request_id, None)
        else:
            self._have[out.request_id] = out
        return out

    def forget(self, request_id: str) -> None:
        self._have.pop(request_id, None)


def _replica_main(cores: Optional[list[int]], model: Optional[str], engine_args: dict, conn: Any,
                  env: dict[str, str]) -> None:
    """A replica's process: build the engine on its cores, then serve the front's adds and aborts until told to
    stop or the front goes away. Ctrl-C in the terminal is the front's to handle."""
    adopt_environment(env)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if cores:
        os.sched_setaffinity(0, cores)
    try:
        engine = LLMEngine(model, **engine_args)
    except BaseException as e:
        conn.send(("failed", _portable(e)))
        return
    conn.send(("ready", engine.kv.num_blocks))
    try:
        _serve(engine, conn)
    except (EOFError, OSError):        # the front has gone
        pass


def _serve(engine: LLMEngine, conn: Any) -> None:
    live: set[str] = set()           # requests added and not finished
    deltas = OutputDeltas()
    stalled = False
    while True:
        if not engine.has_unfinished_requests():
            with engine.runner.faulting_in_kv_cache():
                conn.poll(None)
        elif stalled:               # nothing schedulable: wait a little for a command that changes that
            conn.poll(0.01)
        cmds, aborted, outputs = [], [], []
        while conn.poll(0):
            cmds.append(conn.recv())
        for cmd in cmds:
            if cmd[0] == "stop":
                return
            if cmd[0] == "add":
                _, rid, prompt, params, arrival = cmd
                try:
                    engine.add_request(rid, prompt, params, arrival_time=arrival)
                    live.add(rid)
                    conn.send(("added", rid, None))
                except Exception as e:          # bad input: the server answers 400
                    conn.send(("added", rid, _portable(e)))
            elif cmd[0] == "abort" and cmd[1] in live:
                engine.abort_request(cmd[1])
                live.discard(cmd[1])
                deltas.forget(cmd[1])
                aborted.append(cmd[1])
        if engine.has_unfinished_requests():
            steps = engine.stats.num_steps
            try:
                outputs = engine.step()
            except Exception as e:      # a failed step fails what is in flight, not the replica
                ids = sorted(live)
                conn.send(("failed", ids, f"the engine failed while running this request: {e}"))
                engine.abort_request(ids)
                aborted += ids
                live.clear()
                for rid in ids:
                    deltas.forget(rid)
            stalled = engine.stats.num_steps == steps
        live.difference_update(o.request_id for o in outputs if o.finished)
        if cmds or outputs or aborted:
            conn.send(("step", [deltas.encode(o) for o in outputs], aborted, EngineState.of(engine, bool(outputs))))


class RemoteReplica:
    """A replica in a process of its own, with AsyncLLM's face: add_request gives a RequestStream, hooks see every
    iteration, state is the replica's last."""

    def __init__(self, index: int, cores: Optional[list[int]], model: Optional[str], engine_args: dict):
        ctx = worker_context()
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_replica_main, args=(cores, model, engine_args, child, dict(os.environ)),
                                   daemon=True, name=f"tokenmill-dp{index}")
        self.process.start()
        child.close()
        self.index, self.cores = index, cores
        self.hooks: list[IterationHook] = []
        self.state = EngineState()
        self.error: Optional[str] = None
        self._streams: dict[str, RequestStream] = {}
        self._adds: dict[str, concurrent.futures.Future] = {}
        self._outputs = OutputMerger()          # the reader thread's
        self._lock = threading.Lock()           # the streams and adds (event loop and reader thread)
        # pickled commands, written by a thread of their own: a write that waits for the replica to read (a full
        # pipe while it steps) must not stall the event loop
        self._outbox: "queue.SimpleQueue[Optional[bytes]]" = queue.SimpleQueue()

    def wait_ready(self) -> None:
        """Wait for the replica's engine; its error, if it failed to build, is raised here."""
        try:
            msg = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"data-parallel replica {self.index} exited while starting "
                               f"(code {self.process.exitcode}); see its errors above") from None
        if msg[0] == "failed":
            raise msg[1]
        self.state.kv_blocks_total = msg[1]
        threading.Thread(target=self._read, name=f"tokenmill-dp{self.index}-reader", daemon=True).start()
        threading.Thread(target=self._write, name=f"tokenmill-dp{self.index}-writer", daemon=True).start()

    @property
    def is_running(self) -> bool:
        return self.error is None and self.process.is_alive()

    async def add_request(self, prompt: PromptType, params: Union[SamplingParams, PoolingParams],
                          request_id: str) -> RequestStream:
        if not self.is_running:
            raise EngineDeadError(self.error or f"data-parallel replica {self.index} has stopped")
        stream = RequestStream(request_id, self, asyncio.get_running_loop())
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.error is not None:      # it died since: _died failed the adds it found, not this one
                raise EngineDeadError(self.error)
            self._streams[request_id], self._adds[request_id] = stream, fut
        try:
            self._send(("add", request_id, prompt, params, time.monotonic()))
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            stream.abort()
            raise
        except BaseException:
            with self._lock:
                self._streams.pop(request_id, None)
                self._adds.pop(request_id, None)
            raise
        return stream

    def _send(self, msg: tuple) -> None:
        """Pickle msg here (a request that cannot be pickled is bad input) and queue it for the writer."""
        try:
            data = pickle.dumps(msg)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise ValueError(f"this request cannot be sent to a data-parallel replica: {e}") from None
        self._outbox.put(data)

    def _write(self) -> None:
        while (data := self._outbox.get()) is not None:
            try:
                self._conn.send_bytes(data)
            except OSError as e:
                self._died(f"data-parallel replica {self.index} cannot be reached ({e})")
                return

    def _submit(self, cmd: tuple) -> None:
        """RequestStream's abort: the replica drops the request at its next iteration."""
        with self._lock:
            self._streams.pop(cmd[1], None)
        self._send(cmd)

    def _read(self) -> None:
        try:
            self._read_messages()
        except Exception:       # a message that cannot be read: the replica cannot be followed any more
            log.exception("data-parallel replica %d: reading its messages failed", self.index)
        self._died(f"data-parallel replica {self.index} (pid {self.process.pid}) exited")

    def _read_messages(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                return
            if msg[0] == "added":
                with self._lock:
                    fut = self._adds.pop(msg[1], None)
                    if msg[2] is not None:
                        self._streams.pop(msg[1], None)
                if fut is not None and fut.set_running_or_notify_cancel():
                    fut.set_result(None) if msg[2] is None else fut.set_exception(msg[2])
            elif msg[0] == "failed":
                self._fail(msg[1], EngineDeadError(msg[2]))
            else:
                _, items, aborted, self.state = msg
                outputs = [self._outputs.decode(x) for x in items]
                for rid in aborted:
                    self._outputs.forget(rid)
                self._iteration(outputs, aborted)
                self._dispatch(outputs)

    def _iteration(self, outputs: list[RequestOutput], aborted: list[str]) -> None:
        for hook in self.hooks:
            try:
                hook(outputs, aborted, self.state)
            except Exception:
                log.exception("iteration hook failed")

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            with self._lock:
                stream = self._streams.pop(out.request_id, None) if out.finished else \
                    self._streams.get(out.request_id)
            if stream is not None:
                try:
                    stream.loop.call_soon_threadsafe(stream._put, out)
                except RuntimeError:        # its event loop is closed: nobody is listening
                    stream.abort()

    def _fail(self, ids: list[str], err: BaseException) -> None:
        for rid in ids:
            with self._lock:
                stream = self._streams.pop(rid, None)
            if stream is not None:
                try:
                    stream.loop.call_soon_threadsafe(stream._fail, err)
                except RuntimeError:
                    pass

    def _died(self, why: str) -> None:
        """The replica is gone: what was in flight fails, and the hooks see it aborted and the replica empty."""
        if self.error is None:
            self.error = why
        self.state = dataclasses.replace(self.state, num_running=0, num_waiting=0, kv_blocks_used=0, kv_usage=0.0,
                                         step_prefill_tokens=0, step_decode_tokens=0)
        with self._lock:
            ids, adds = list(self._streams), list(self._adds.values())
            self._adds.clear()
        for fut in adds:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineDeadError(self.error))
        self._fail(ids, EngineDeadError(self.error))
        self._iteration([], ids)

    def shutdown(self, reason: str = "the server is shutting down", wait: bool = False) -> None:
        self._send(("stop",))
        self._outbox.put(None)
        self._died(reason)
        if wait:
            self.process.join(timeout=10)
            if self.process.is_alive():
                self.process.kill()
