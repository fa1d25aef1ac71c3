"""Grammar compiles are bounded: one past compile_timeout_s is killed (its worker process is gone), at most
max_concurrent_compiles run at once while the rest queue with their time running, and a live server's other
requests keep their latency while hostile grammars compile.

The hostile grammar is the issue's: a JSON schema of arrays nested 900 deep, which xgrammar takes tens of seconds
to compile."""
from __future__ import annotations

import contextlib
import os
import statistics
import threading
import time
from typing import Any, Iterator

import pytest

from tokenmill import StructuredOutputsParams
from tokenmill.engine.structured_output import StructuredOutputManager, StructuredOutputsConfig

pytest_plugins = ["tests.server_fixtures"]

# compiles grammars in workers at the idle CPU priority, which a second test worker's load would starve: alone
pytestmark = pytest.mark.serial

TIMEOUT_S = 1.5
SLACK_S = 1.0           # a timeout's answer comes this soon after the deadline, at the latest


def nested_arrays(depth: int = 900, tag: int = 0) -> dict[str, Any]:
    """Arrays nested `depth` deep; tag makes each spec its own (no compile cache hit)."""
    schema: dict[str, Any] = {"type": "integer", "minimum": tag}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def gone(pid: int, within_s: float = 5.0) -> bool:
    """Whether the process has exited and been reaped by then (a killed process still takes a moment to exit)."""
    deadline = time.monotonic() + within_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.005)
    return not alive(pid)


@pytest.fixture(scope="module")
def manager(chat_model_dir: str) -> Iterator[StructuredOutputManager]:
    """Two compile workers, started."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(chat_model_dir)
    mgr = StructuredOutputManager(tok, len(tok), [tok.eos_token_id],
                                  StructuredOutputsConfig(compile_timeout_s=TIMEOUT_S, max_concurrent_compiles=2))
    mgr.warm_up()
    yield mgr
    mgr.shutdown()


def test_max_concurrent_compiles_is_checked() -> None:
    from tokenmill.executor.cpus import available_cpus
    assert StructuredOutputsConfig().max_concurrent_compiles == available_cpus()
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="structured_outputs_config.max_concurrent_compiles must be an integer"):
            StructuredOutputsConfig(max_concurrent_compiles=bad)


def test_a_compile_past_its_timeout_is_killed(manager: StructuredOutputManager) -> None:
    before = set(manager.compile_pool.worker_pids())
    assert len(before) == 2
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"structured_outputs\.json: the grammar did not compile within 1\.5 s"):
        manager.compile(StructuredOutputsParams(json=nested_arrays()))
    assert TIMEOUT_S <= time.monotonic() - t0 < TIMEOUT_S + SLACK_S
    deadline = time.monotonic() + 5
    while before == set(manager.compile_pool.worker_pids()) and time.monotonic() < deadline:
        time.sleep(0.005)                         # its slot lets it go once it has exited
    killed = before - set(manager.compile_pool.worker_pids())
    assert len(killed) == 1                       # its worker
    assert all(gone(pid) for pid in killed)       # gone, and reaped
    manager.warm_up()                             # and a fresh one in its place
    assert len(set(manager.compile_pool.worker_pids()) - before) == 1
    # a grammar that compiles still does, on the other worker (and the failed spec was not cached)
    assert manager.compile(StructuredOutputsParams(choice=["yes", "no"])) is not None


def test_compiles_beyond_the_bound_queue_and_time_out_counting_their_wait(
        manager: StructuredOutputManager) -> None:
    pool = manager.compile_pool
    manager.warm_up()
    pool.peak_running = 0
    seen: list[tuple[int, int]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append((pool.running, len(pool.worker_pids())))
            time.sleep(0.005)

    results: dict[int, tuple[float, str]] = {}

    def compile_one(i: int) -> None:
        t0 = time.monotonic()
        try:
            manager.compile(StructuredOutputsParams(json=nested_arrays(tag=i)))
            results[i] = (time.monotonic() - t0, "compiled")
        except ValueError as e:
            results[i] = (time.monotonic() - t0, str(e))

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=compile_one, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    watcher.join()
    assert pool.peak_running == 2
    assert max(r for r, _ in seen) == 2 and max(w for _, w in seen) <= 2
    assert len(results) == 5
    for elapsed, msg in results.values():
        # three of them waited for a worker the whole time: their deadline counted the wait
        assert "did not compile within 1.5 s" in msg
        assert TIMEOUT_S - 0.05 <= elapsed < TIMEOUT_S + SLACK_S, results


def test_a_worker_that_dies_is_a_clear_error_and_is_replaced(manager: StructuredOutputManager) -> None:
    import signal
    manager.warm_up()
    pids = manager.compile_pool.worker_pids()
    os.kill(pids[0], signal.SIGKILL)            # an idle one: the next compile just gets a fresh worker
    assert gone(pids[0])
    assert manager.compile(StructuredOutputsParams(regex="[0-9]{2}")) is not None
    errors: list[str] = []

    def compile_one() -> None:
        try:
            manager.compile(StructuredOutputsParams(json=nested_arrays(tag=-1)))
        except ValueError as e:
            errors.append(str(e))
    t = threading.Thread(target=compile_one)
    t.start()
    deadline = time.monotonic() + TIMEOUT_S / 2
    while manager.compile_pool.running == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    pids = manager.compile_pool.worker_pids()
    for pid in pids:                            # a crash mid-compile: that request's error, no more
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    t.join()
    assert errors and errors[0].startswith("structured_outputs.json: the grammar compiler's worker exited"), errors
    assert all(gone(pid) for pid in pids)
    assert manager.compile(StructuredOutputsParams(regex="[0-9]{3}")) is not None


def test_shutdown_stops_the_workers(chat_model_dir: str) -> None:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(chat_model_dir)
    mgr = StructuredOutputManager(tok, len(tok), [tok.eos_token_id], StructuredOutputsConfig(compile_timeout_s=30))
    errors: list[str] = []

    def compile_one() -> None:
        try:
            mgr.compile(StructuredOutputsParams(json=nested_arrays()))
        except ValueError as e:
            errors.append(str(e))
    t = threading.Thread(target=compile_one)
    t.start()
    deadline = time.monotonic() + 10
    while not mgr.compile_pool.worker_pids() and time.monotonic() < deadline:
        time.sleep(0.01)
    pids = mgr.compile_pool.worker_pids()
    assert len(pids) == 1
    mgr.shutdown()
    t.join(timeout=5)
    assert errors and "shutting down" in errors[0], errors
    assert not mgr.compile_pool.worker_pids() and all(gone(pid) for pid in pids)
    with pytest.raises(ValueError, match="shutting down"):
        mgr.compile(StructuredOutputsParams(regex="[a-z]"))


# ---- a live server under hostile compiles ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hostile_server(chat_model_dir: str) -> Iterator[Any]:
    from tests.server_fixtures import LiveServer
    from tokenmill.engine.engine import LLMEngine
    from tokenmill.server.app import build_app
    engine = LLMEngine(chat_model_dir, dtype="float32", device="cpu", max_model_len=512, kv_cache_memory_gb=0.05,
                       structured_outputs_config={"compile_timeout_s": TIMEOUT_S, "max_concurrent_compiles": 2})
    server = LiveServer(build_app(engine, model_name="tiny-chat"))
    engine.structured_outputs.warm_up()
    yield server
    server.stop()
    pids = engine.structured_outputs.compile_pool.worker_pids()
    engine.structured_outputs.shutdown()
    assert not any(alive(pid) for pid in pids)


@pytest.mark.slow
def test_chat_latency_holds_while_hostile_grammars_compile(hostile_server: Any) -> None:
    """A steady client's 16-token chats, idle and then while four clients keep sending 900-deep schemas (each one
    new, each refused after TIMEOUT_S): the median latency stays within 1.2x of idle. Other processes share the
    test machine's cores and may burst during one window: a ratio over the bound is measured once more."""
    import httpx
    url = hostile_server.url + "/v1/chat/completions"
    pool = hostile_server.llm.engine.structured_outputs.compile_pool
    client = httpx.Client(timeout=60)
    tags = iter(range(1, 10**6))

    def latencies(seconds: float) -> list[float]:
        out, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter()
            r = client.post(url, json={"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": 16, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200
            out.append(time.perf_counter() - t0)
        return out

    def hostile(stop: threading.Event, refusals: list) -> None:
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                r = c.post(url, json={"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 4, "guided_json": nested_arrays(tag=next(tags))})
                refusals.append((r.status_code, r.text))

    def measure() -> float:
        idle = latencies(2.0)
        pool.peak_running = 0
        stop, refusals = threading.Event(), []
        attackers = [threading.Thread(target=hostile, args=(stop, refusals)) for _ in range(4)]
        for t in attackers:
            t.start()
        time.sleep(0.3)
        loaded = latencies(4.0)
        stop.set()
        for t in attackers:
            t.join()
        idle += latencies(2.0)      # idle before and after: the machine's other load drifts
        ratio = statistics.median(loaded) / statistics.median(idle)
        print(f"\nchat latency: idle median {statistics.median(idle) * 1e3:.1f} ms ({len(idle)} chats), under "
              f"hostile compiles {statistics.median(loaded) * 1e3:.1f} ms ({len(loaded)}): {ratio:.2f}x; "
              f"{len(refusals)} hostile requests")
        assert len(refusals) >= 4
        assert all(code == 400 and "did not compile within 1.5 s" in text for code, text in refusals), refusals[:2]
        assert pool.peak_running == 2             # the compiles did run, two at a time
        return ratio

    latencies(0.3)                  # warm
    ratio = measure()
    if ratio > 1.2:
        ratio = min(ratio, measure())
    assert ratio <= 1.2
