"""Grammar compiles in worker processes: xgrammar cannot stop a compile once begun, so one that passes its time limit
runs in a process that is killed, and every compile runs at the lowest CPU priority (SCHED_IDLE where there is one,
else nice 19) so that the engine keeps the cores.

The parent side, CompilePool, owns up to `size` slots: a slot is a thread and its worker process, and one job runs
on it at a time, so at most `size` compiles run at once; the others wait in submission order. A job's deadline
counts from its submission, its wait included. A worker whose compile passes the deadline is killed and a fresh one
started in its place; one left idle for IDLE_S is stopped.

Workers are forked by a zygote: one process per engine process, started at the first compile, that has imported
xgrammar (and with it torch and transformers: seconds, once) and then lowered its priority, so that a worker starts
in milliseconds, the engine's own threads are never forked, and the workers share the zygote's pages. The zygote exits
when the engine's process does, and a worker when its zygote does.

A worker compiles the grammar and checks that it admits a first token; then the parent needs the grammar too.
xgrammar's serialized form (CompiledGrammar.serialize_json) is several times dearer to write and read than most
compiles, so a grammar that compiled within REBUILD_CPU_S of CPU is compiled again in the parent (the worker showed
that it is valid and quick), and a slower one comes back serialized (at most MAX_GRAMMAR_BYTES) and is read there.

The zygote runs zygote(FD), FD its socket to the engine, which passes each new worker its two pipes. Messages on
the pipes are a tag byte, an 8-byte length and the payload.
"""
from __future__ import annotations

import collections
import math
import concurrent.futures
import importlib
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable, Optional

IDLE_S = 300.0                  # a worker idle this long is stopped (its own memory: the vocabulary, its compiles)
START_S = 60.0                  # a worker that has not taken its start message by then is broken
EXIT_S = 5.0                    # a killed worker's exit is awaited this long (signalled, it compiles no more)
MAX_GRAMMAR_BYTES = 64 << 20    # a serialized grammar above this is refused: the parent reads it on its cores
REBUILD_CPU_S = 0.25            # a compile that took at most this much CPU is done again in the parent
_HEADER = struct.Struct("!cQ")
_ZYGOTE_MAIN = ("import sys; sys.path.insert(0, sys.argv[1]); "
                "from tokenmill.engine.grammar_worker import zygote; zygote(int(sys.argv[2]))")


class CompileTimeout(Exception):
    """The job passed its deadline, queued or compiling."""


class CompileError(Exception):
    """The grammar is invalid, admits nothing, or broke its worker; the text says which, for the client."""


# ---- framing (both sides) --------------------------------------------------------------------------------------
def _ready(read: list[int], write: list[int], timeout_s: Optional[float]) -> tuple[set[int], set[int]]:
    """select()'s answer by poll(): select refuses descriptors past 1024, which a server (or a test run) may hold.
    A hang-up or an error counts as ready, as select has it: the read or write that follows says which."""
    p = select.poll()
    for fd in read:
        p.register(fd, select.POLLIN)
    for fd in write:
        p.register(fd, select.POLLOUT)
    done = select.POLLHUP | select.POLLERR | select.POLLNVAL
    events = p.poll(None if timeout_s is None else math.ceil(max(timeout_s, 0.0) * 1000))
    return ({fd for fd, ev in events if fd in read and ev & (select.POLLIN | done)},
            {fd for fd, ev in events if fd in write and ev & (select.POLLOUT | done)})


def _write_all(fd: int, data: bytes, deadline: Optional[float], stop: Optional[int]) -> bool:
    """Whether all of data was written by the deadline (None: no deadline). EOFError once stop is readable."""
    view = memoryview(data)
    while view:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            readable, writable = _ready([] if stop is None else [stop], [fd], left)
            if readable:
                raise EOFError
            if not writable:
                return False
        view = view[os.write(fd, view):]
    return True


def _read_exact(fd: int, n: int, deadline: Optional[float], stop: Optional[int]) -> Optional[bytes]:
    """n bytes from fd; None if the deadline passes first. EOFError if the other side closed it, or once stop is
    readable."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            readable = _ready([fd] if stop is None else [fd, stop], [], left)[0]
            if stop in readable:
                raise EOFError
            if not readable:
                return None
        k = os.readv(fd, [view[got:got + (1 << 20)]])
        if k == 0:
            raise EOFError
        got += k
    return bytes(buf)


def _send(fd: int, tag: bytes, payload: bytes = b"", deadline: Optional[float] = None,
          stop: Optional[int] = None) -> bool:
    return _write_all(fd, _HEADER.pack(tag, len(payload)) + payload, deadline, stop)


def _recv(fd: int, deadline: Optional[float] = None, stop: Optional[int] = None) -> Optional[tuple[bytes, bytes]]:
    head = _read_exact(fd, _HEADER.size, deadline, stop)
    if head is None:
        return None
    tag, n = _HEADER.unpack(head)
    payload = _read_exact(fd, n, deadline, stop)
    return None if payload is None else (tag, payload)


# ---- the parent's side -----------------------------------------------------------------------------------------
class Job:
    """One compile: its request to a worker, its deadline, and its future (a CompiledGrammar, or CompileTimeout /
    CompileError)."""

    def __init__(self, request: bytes, timeout_s: float):
        self.request = request
        self.deadline = time.monotonic() + timeout_s
        self.future: concurrent.futures.Future = concurrent.futures.Future()

    def result(self) -> Any:
        try:
            return self.future.result(timeout=max(0.0, self.deadline - time.monotonic()))
        except concurrent.futures.CancelledError:      # another waiter on the same job timed out while it queued
            raise CompileTimeout() from None
        except concurrent.futures.TimeoutError:
            if self.future.cancel():                    # still queued: it never runs
                raise CompileTimeout() from None
        try:        # on a worker: its slot ends it at the deadline (the margin: a rebuild under way, a kill)
            return self.future.result(timeout=START_S)
        except concurrent.futures.TimeoutError:
            raise CompileTimeout() from None


class _Zygote:
    """The process that forks the workers (one per engine process; a new one if it died)."""
    _lock = threading.Lock()
    _current: Optional["_Zygote"] = None

    @classmethod
    def fork(cls, fds: list[int]) -> None:
        """Have a worker forked that talks on fds (its input, its output); it may start after the zygote's own
        start, seconds later the first time."""
        with cls._lock:
            for _ in range(2):
                z = cls._current
                if z is None or z.proc.poll() is not None or z.owner != os.getpid():
                    if z is not None:       # it died, or this process is a fork of its engine's
                        z.close()
                    z = cls._current = cls()
                try:
                    socket.send_fds(z.sock, [b"F"], fds)
                    return
                except OSError:             # it died since: once more, with a new one
                    z.close()
                    cls._current = None
            raise CompileError("the grammar compile workers' zygote did not start")

    def close(self) -> None:
        self.sock.close()
        if self.owner == os.getpid():
            self.proc.kill()
            self.proc.wait()

    def __init__(self) -> None:
        import tokenmill
        root = os.path.dirname(os.path.dirname(os.path.abspath(tokenmill.__file__)))
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        self.owner = os.getpid()
        self.sock, theirs = socket.socketpair()
        # this tokenmill first, not one in the working directory. The engine's session still: Linux schedules
        # each session's processes as one group (autogroup), and the low priority only counts within a group
        with theirs:
            self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE_MAIN, root, str(theirs.fileno())], env=env,
                                         pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)


class _Worker:
    """One worker process: forked on request, then (the parent's side of) its start handshake, which the slot
    finishes over as many jobs' waits as it takes."""

    def __init__(self, start_message: bytes, stop: int):
        self.start_message = start_message
        self.stop = stop                    # readable once the pool closes: every wait ends
        child_in, self.wfd = os.pipe()
        self.rfd, child_out = os.pipe()
        try:
            _Zygote.fork([child_in, child_out])
        except BaseException:
            os.close(self.wfd)
            os.close(self.rfd)
            raise
        finally:
            os.close(child_in)
            os.close(child_out)
        self.pid: Optional[int] = None
        self.pidfd: Optional[int] = None
        self.ready = False

    def wait_ready(self, deadline: float) -> bool:
        """Whether it is ready by the deadline (if not, it goes on starting). EOFError if it died."""
        if self.pid is None:                # forked: it says its pid, then takes its start message
            msg = _recv(self.rfd, deadline, self.stop)
            if msg is None:
                return False
            self.pid = int(msg[1])
            try:                            # a handle on it that cannot reach another process with its pid
                self.pidfd = os.pidfd_open(self.pid)
            except (AttributeError, OSError):
                pass
            if not _send(self.wfd, b"S", self.start_message, time.monotonic() + START_S, self.stop):
                raise EOFError("it took no start message")
        if not self.ready:
            msg = _recv(self.rfd, deadline, self.stop)
            if msg is None:
                return False
            if msg[0] != b"R":
                raise EOFError(msg[1].decode(errors="replace"))
            self.ready = True
        return True

    def run(self, job: Job) -> Optional[tuple[bytes, bytes]]:
        """job's reply, or None if it passed its deadline. EOFError if the worker died."""
        try:
            if not _send(self.wfd, b"J", job.request, job.deadline, self.stop):
                return None
        except BrokenPipeError:
            raise EOFError from None
        return _recv(self.rfd, job.deadline, self.stop)

    def kill(self, grace_s: float = 0.0) -> None:
        """Stop it: after grace_s for it to exit by itself (it does at the end of its input), SIGKILL, and its exit
        awaited (the zygote reaps it)."""
        os.close(self.wfd)
        if self.pid is not None and not (grace_s and self._wait_exit(grace_s)):
            self.signal_kill()
            self._wait_exit(EXIT_S)
        if self.pidfd is not None:
            os.close(self.pidfd)
        os.close(self.rfd)

    def alive(self) -> bool:
        """False once a started worker is known to have exited (a crash, its zygote gone)."""
        if self.pid is None:
            return True
        if self.pidfd is not None:
            return not _ready([self.pidfd], [], 0)[0]
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def signal_kill(self) -> None:
        try:
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)      # type: ignore[arg-type]
        except ProcessLookupError:
            pass

    def _wait_exit(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        if self.pidfd is not None:          # readable once it has exited
            return bool(_ready([self.pidfd], [], timeout_s)[0])
        while time.monotonic() < deadline:
            try:
                os.kill(self.pid, 0)        # type: ignore[arg-type]
            except ProcessLookupError:
                return True
            time.sleep(0.01)
        return False


class _Slot:
    """A thread that runs one job at a time on its worker process."""

    def __init__(self, pool: "CompilePool"):
        self.pool = pool
        self.worker: Optional[_Worker] = None
        self.jobs: "collections.deque[Optional[Job]]" = collections.deque()     # None: stop
        self.wake = threading.Condition(pool._lock)
        self.thread = threading.Thread(target=self._loop, name="tokenmill-grammar", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        pool = self.pool
        while True:
            with pool._lock:
                idle = not self.jobs and not self.wake.wait_for(lambda: self.jobs, timeout=IDLE_S)
                job = None if idle else self.jobs.popleft()
            if job is None:         # idle for IDLE_S (its worker goes, the slot stays), or the pool closed
                if self.worker is not None:
                    self.worker.kill(grace_s=2 if idle else 0)
                    self.worker = None
                if idle:
                    continue
                return
            if job.future.set_running_or_notify_cancel():      # False: it timed out while queued
                self._run(job)
            with pool._lock:
                if not self.jobs:
                    nxt = pool._next_job()
                    if nxt is None:
                        pool._idle.append(self)
                    else:
                        self.jobs.append(nxt)

    def _run(self, job: Job) -> None:
        pool = self.pool
        try:
            if self.worker is not None and not self.worker.alive():     # died idle: a fresh one, not an error
                self.worker.kill()
                self.worker = None
            if self.worker is None:
                self.worker = _Worker(pool.start_message(), pool._stop_r)
            if not self.worker.wait_ready(job.deadline):
                job.future.set_exception(CompileTimeout())      # the worker goes on starting, for the next job
                return
            with pool._lock:
                pool.running += 1
                pool.peak_running = max(pool.peak_running, pool.running)
            try:
                reply = self.worker.run(job)
            finally:
                with pool._lock:
                    pool.running -= 1
            if reply is None:               # over its time: stopped, and a fresh worker starts for the next job
                self.worker.signal_kill()
                job.future.set_exception(CompileTimeout())      # not after its exit, which runs at idle priority
                self.worker.kill()
                self.worker = None
                if not pool.closed:
                    self.worker = _Worker(pool.start_message(), pool._stop_r)
                return
            tag, payload = reply
            if tag == b"K":                 # valid and quick: compiled again here
                job.future.set_result(pool.rebuild(job.request, None))
            elif tag == b"G":
                job.future.set_result(pool.rebuild(job.request, payload.decode()))
            elif tag == b"W":
                job.future.set_result(None)
            else:
                job.future.set_exception(CompileError(payload.decode(errors="replace")))
        except EOFError as e:
            if self.worker is not None:
                self.worker.kill(grace_s=0 if pool.closed else 1)
                self.worker = None
            why = "the engine is shutting down" if pool.closed else \
                "the grammar compiler's worker exited" + (f" ({e})" if str(e) else "")
            _fail(job, CompileError(why))
        except BaseException as e:          # to whoever waits on it
            _fail(job, e if isinstance(e, (CompileError, CompileTimeout)) else CompileError(f"{type(e).__name__}: {e}"))
            if not isinstance(e, Exception):
                raise


def _fail(job: Job, e: BaseException) -> None:
    if not job.future.done():
        job.future.set_exception(e)


class CompilePool:
    """Compiles on at most `size` worker processes at once; the others queue, in submission order, with their
    deadlines running. start_message() is what a worker starts from; rebuild(request, text) gives the grammar a
    worker compiled: from its serialized text, or (None) compiled again here."""

    def __init__(self, size: int, start_message: Callable[[], bytes],
                 rebuild: Callable[[bytes, Optional[str]], Any]):
        self.size = size
        self.start_message = start_message
        self.rebuild = rebuild
        self._lock = threading.Lock()
        self._slots: list[_Slot] = []
        self._idle: list[_Slot] = []            # free slots, the most recently used last (its worker is warm)
        self._waiting: collections.deque[Job] = collections.deque()
        self.closed = False
        self._stop_r, self._stop_w = os.pipe()      # closing _stop_w wakes every slot that waits on a worker
        self.running = 0                        # jobs on a worker now, and the most there have been at once
        self.peak_running = 0

    def submit(self, request: bytes, timeout_s: float) -> Job:
        job = Job(request, timeout_s)
        with self._lock:
            if self.closed:
                raise CompileError("the engine is shutting down")
            if self._idle:
                warm = [s for s in self._idle if s.worker is not None]
                slot = warm[-1] if warm else self._idle[-1]
                self._idle.remove(slot)
                self._give(slot, job)
            elif len(self._slots) < self.size:
                self._slots.append(_Slot(self))
                self._give(self._slots[-1], job)
            else:
                self._waiting.append(job)
        return job

    def warm_up(self, n: Optional[int] = None, timeout_s: float = START_S) -> None:
        """Start n workers (all `size` by default) now and wait until they are ready, so that the first compiles
        do not wait for them."""
        jobs = []
        with self._lock:
            if self.closed:
                raise CompileError("the engine is shutting down")
            while len(self._slots) < min(n or self.size, self.size):
                self._slots.append(_Slot(self))
            for slot in self._slots[:n or self.size]:
                if slot in self._idle:
                    self._idle.remove(slot)
                jobs.append(Job(pickle.dumps(None), timeout_s))
                self._give(slot, jobs[-1])
        for job in jobs:
            job.result()

    def worker_pids(self) -> list[int]:
        """The workers' process ids (those that have started)."""
        with self._lock:
            return [s.worker.pid for s in self._slots if s.worker is not None and s.worker.pid is not None]

    def _give(self, slot: _Slot, job: Job) -> None:
        slot.jobs.append(job)
        slot.wake.notify()

    def _next_job(self) -> Optional[Job]:
        while self._waiting:
            job = self._waiting.popleft()
            if not job.future.done():           # done: cancelled, its waiter gone
                return job
        return None

    def close(self) -> None:
        """Stop every worker now, compiling or not; jobs still queued fail."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            slots = list(self._slots)
            for s in slots:
                self._give(s, None)     # type: ignore[arg-type]
        for job in waiting:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(CompileError("the engine is shutting down"))
        os.close(self._stop_w)          # every slot stops waiting on its worker, which it kills
        for s in slots:
            s.thread.join(timeout=5)
        if not any(s.thread.is_alive() for s in slots):
            os.close(self._stop_r)


# ---- the worker's side -----------------------------------------------------------------------------------------
def ebnf_string(s: str) -> str:
    """s as an EBNF string literal: quotes and backslashes escaped, control characters as \\xHH."""
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ch == "\x7f":
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def xgrammar_message(e: BaseException) -> str:
    """xgrammar's error text without its "[time] file.cc:line:" prefix."""
    msg = str(e).strip()
    head, sep, rest = msg.partition(": ")
    if sep and (".cc:" in head or head.startswith("[")):
        msg = rest.strip()
    return msg.removeprefix("Check failed: (error.empty()) is false: ")


def compile_request(key: tuple) -> bytes:
    """What a worker is asked to compile: a spec's cache key (kind, spec, disable_any_whitespace), the schema as
    JSON text (xgrammar takes it so, and deep nesting pickles poorly)."""
    return pickle.dumps(key)


def compile_grammar(compiler: Any, request: bytes, whitespace_limit: Optional[int]) -> Any:
    """The grammar of a compile_request, by an xgrammar GrammarCompiler."""
    return _compile(compiler, *pickle.loads(request), whitespace_limit)


def _compile(compiler: Any, kind: str, spec: Any, disable_any_whitespace: bool, whitespace_limit: Optional[int]) -> Any:
    if kind in ("json", "json_object"):
        schema = '{"type": "object"}' if kind == "json_object" else spec
        if schema == "false":
            raise ValueError("the schema false admits no value")
        return compiler.compile_json_schema(
            "{}" if schema == "true" else schema, any_whitespace=not disable_any_whitespace,
            max_whitespace_cnt=None if disable_any_whitespace else whitespace_limit,
            strict_mode=kind == "json")       # json_object: any object, keys and all
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "choice":
        return compiler.compile_grammar("root ::= " + " | ".join(ebnf_string(c) for c in spec))
    return compiler.compile_grammar(spec)


def _watch_parent(parent: int) -> None:
    """Exit when the parent is gone, compiling or not."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _serve(rfd: int, wfd: int) -> None:
    """A worker: its pid, then its start message (the vocabulary), then compile jobs until its input ends."""
    import xgrammar as xgr
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    _send(wfd, b"P", str(os.getpid()).encode())
    start = _recv(rfd)
    conf = pickle.loads(start[1])       # type: ignore[index]
    info = xgr.TokenizerInfo.deserialize_json(conf["tokenizer_info"])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)    # the parent caches
    stop_tokens = conf["stop_token_ids"] or None
    _send(wfd, b"R")
    while True:
        msg = _recv(rfd)
        request = msg[1]                # type: ignore[index]
        if pickle.loads(request) is None:       # warm_up's: ready
            _send(wfd, b"W")
            continue
        try:
            cpu = time.thread_time()
            compiled = compile_grammar(compiler, request, conf["json_whitespace_limit"])
            cpu = time.thread_time() - cpu
            bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
            xgr.GrammarMatcher(compiled, override_stop_tokens=stop_tokens).fill_next_token_bitmask(bitmask)
            if not bool(bitmask.any()):
                raise ValueError("the constraint admits no output at all")
            if cpu <= REBUILD_CPU_S:
                _send(wfd, b"K")
                continue
            text = compiled.serialize_json().encode()
            if len(text) > MAX_GRAMMAR_BYTES:
                raise ValueError(f"the compiled grammar is too large ({len(text) >> 20} MiB serialized, the bound "
                                 f"is {MAX_GRAMMAR_BYTES >> 20} MiB); simplify it")
        except Exception as e:          # xgrammar's parse errors are RuntimeError, ValueError, TypeError
            _send(wfd, b"E", xgrammar_message(e).encode())
            continue
        _send(wfd, b"G", text)


def zygote(sock_fd: int) -> None:
    """Load xgrammar, lower the priority, then fork a worker for each pair of pipes the engine sends, until the
    engine's process is gone."""
    # a terminal's Ctrl-C is the engine's to handle; the zygote and its workers exit with the engine's process
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.dup2(2, 1)                   # stray prints go to stderr
    parent = os.getppid()
    sock = socket.socket(fileno=sock_fd)
    # loaded once here, for every worker, at the engine's priority: at the idle one, a busy engine could starve
    # this one-time start past the first compiles' time limit
    importlib.import_module("xgrammar")
    try:                            # the workers inherit both
        os.nice(19)
        # Linux's idle class, below nice 19: a waking engine thread takes the core at once, not after a time slice
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)      # the kernel reaps the workers
    code = 0
    try:
        _fork_workers(sock, parent)
    except BaseException:
        code = 1
        traceback.print_exc()
    finally:
        os._exit(code)              # without the C++ libraries' teardown at exit, which may abort


def _fork_workers(sock: socket.socket, parent: int) -> None:
    while os.getppid() == parent:   # no thread here: a fork copies only its caller
        if not _ready([sock.fileno()], [], 0.5)[0]:
            continue
        msg, fds, _, _ = socket.recv_fds(sock, 1, 2)
        if not msg:
            return                  # the engine's process closed its end
        if os.fork() == 0:
            code = 0
            try:
                sock.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _serve(*fds)
            except (EOFError, BrokenPipeError):         # the engine let it go
                pass
            except BaseException:
                code = 1
                traceback.print_exc()
            finally:
                os._exit(code)
        for fd in fds:
            os.close(fd)
