"""What a server takes from its host: the cores it may use (affinity, cgroup quota) and the compute threads it
runs on them, the engine built on the thread that steps it, the KV cache's memory reserved and visible at
start, and the batch's seats shared between requests when one asks for many sequences."""
from __future__ import annotations

import ctypes
import os
import sys
import threading
import time

import pytest
import torch

from tokenmill import SamplingParams
from tokenmill.engine.async_engine import AsyncLLM
from tokenmill.engine.engine import LLMEngine
from tokenmill.executor.cpus import ThreadGovernor, available_cpus, cgroup_cpu_quota, runqueue_wait_ns

pytest_plugins = ["tests.server_fixtures"]


# ---------------------------------------------------------------- cores and threads

def _cgroup(tmp_path, proc: str, files: dict[str, str]) -> tuple[str, str]:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    proc_file = tmp_path / "proc_cgroup"
    proc_file.write_text(proc)
    return str(root), str(proc_file)


def test_available_cpus_follow_affinity_and_the_cgroup_quota(tmp_path) -> None:
    affinity = len(os.sched_getaffinity(0))
    # cgroup v2: the tightest quota on the way up counts; "max" is no limit
    root, proc = _cgroup(tmp_path, "0::/svc/job\n", {"svc/cpu.max": "150000 100000\n",
                                                     "svc/job/cpu.max": "max 100000\n", "cpu.max": "max 100000"})
    assert cgroup_cpu_quota(root, proc) == 1.5
    assert available_cpus(root, proc) == 1                  # rounded down: a second thread would be throttled
    root, proc = _cgroup(tmp_path / "big", "0::/job\n", {"job/cpu.max": "6400000 100000\n"})
    assert cgroup_cpu_quota(root, proc) == 64.0
    assert available_cpus(root, proc) == affinity           # more quota than cores: the cores bound it
    root, proc = _cgroup(tmp_path / "none", "0::/\n", {"cpu.max": "max 100000\n"})
    assert cgroup_cpu_quota(root, proc) is None and available_cpus(root, proc) == affinity
    # cgroup v1
    root, proc = _cgroup(tmp_path / "v1", "4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n",
                         {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "50000\n",
                          "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"})
    assert cgroup_cpu_quota(root, proc) == 0.5 and available_cpus(root, proc) == 1


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="Linux's per-thread schedstat")
def test_runqueue_wait_counts_threads_kept_off_a_core() -> None:
    if runqueue_wait_ns() is None:
        pytest.skip("this kernel reports no schedstat")
    # busy processes, twice as many as cores, beside this busy thread: it must queue for a core (Python threads
    # would not do: the GIL makes them sleep, not queue)
    import multiprocessing as mp
    before = runqueue_wait_ns()
    procs = [mp.get_context("fork").Process(target=_spin, args=(0.6,))
             for _ in range(2 * len(os.sched_getaffinity(0)))]
    for p in procs:
        p.start()
    _spin(0.5)
    for p in procs:
        p.join()
    assert runqueue_wait_ns() - before > 10_000_000       # this thread queued for more than 10 ms


def _spin(seconds: float) -> None:
    t = time.monotonic()
    while time.monotonic() - t < seconds:
        pass


class _Host:
    """A fake clock and run-queue reader for a 2-core host: our threads queue for a core only while a neighbour
    is busy and we run 2 threads (`waiting` overrides that when set)."""

    def __init__(self) -> None:
        self.now, self.wait_ns, self.neighbour = 100.0, 0, False
        self.waiting: float | None = None
        self.calls: list[int] = []

    def advance(self, seconds: float) -> None:
        threads = self.calls[-1] if self.calls else 2
        rate = self.waiting if self.waiting is not None else 1.3 if self.neighbour and threads == 2 else 0.05
        self.now += seconds
        self.wait_ns += int(rate * seconds * 1e9)


def _governor(host: _Host, max_threads: int = 2) -> ThreadGovernor:
    return ThreadGovernor(max_threads, set_threads=host.calls.append, read_wait_ns=lambda: host.wait_ns,
                          clock=lambda: host.now, window_s=0.5, busy=0.5, probe_s=4.0, max_probe_s=16.0)


def _run(gov: ThreadGovernor, host: _Host, seconds: float, step: float = 0.05) -> None:
    for _ in range(round(seconds / step)):
        host.advance(step)
        gov.tick()


def test_governor_cuts_a_thread_while_cores_are_taken_and_tries_again_later() -> None:
    host = _Host()
    gov = _governor(host)
    _run(gov, host, 3.0)
    assert gov.threads == 2 and host.calls == []           # our cores: nothing changes
    host.neighbour = True
    _run(gov, host, 1.2)
    assert gov.threads == 1 and host.calls == [1]
    _run(gov, host, 2.5)
    assert host.calls == [1]                                # no try before probe_s (4 s)
    _run(gov, host, 2.5)
    assert host.calls == [1, 2, 1]                          # the try, undone a window later
    _run(gov, host, 6.5)
    assert host.calls == [1, 2, 1]                          # a failed try doubles the wait: 8 s now
    _run(gov, host, 2.0)
    assert host.calls == [1, 2, 1, 2, 1]
    host.neighbour = False
    _run(gov, host, 20.0)                                   # the next try (16 s on) holds
    assert gov.threads == 2 and host.calls == [1, 2, 1, 2, 1, 2]
    _run(gov, host, 30.0)
    assert host.calls == [1, 2, 1, 2, 1, 2]


def test_governor_gives_no_verdict_over_idle_gaps_and_never_goes_below_one() -> None:
    host = _Host()
    gov = _governor(host, max_threads=1)
    host.waiting = 3.0
    _run(gov, host, 2.0)
    assert gov.threads == 1 and host.calls == []
    gov = _governor(host, max_threads=2)
    host.advance(30.0)                   # idle for 30 s with the wait piling up (a neighbour, nothing to run)
    host.waiting = 0.0
    gov.tick()
    assert gov.threads == 2 and host.calls == []


def test_num_threads_option(tiny_llama) -> None:
    before = torch.get_num_threads()
    try:
        eng = LLMEngine(tiny_llama[0], dtype="float32", device="cpu", max_model_len=64, kv_cache_memory_gb=0.01,
                        num_threads=1)
        assert torch.get_num_threads() == 1 and eng.runner.threads.threads == 1
        eng = LLMEngine(tiny_llama[0], dtype="float32", device="cpu", max_model_len=64, kv_cache_memory_gb=0.01)
        assert eng.runner.threads.threads == min(available_cpus(), before) == torch.get_num_threads()
        with pytest.raises(ValueError, match="num_threads=0"):
            LLMEngine(tiny_llama[0], device="cpu", num_threads=0)
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------- the engine's thread

def test_async_llm_builds_the_engine_on_its_own_thread(tiny_llama) -> None:
    built_on = []

    def build() -> LLMEngine:
        built_on.append(threading.current_thread().name)
        return LLMEngine(tiny_llama[0], dtype="float32", device="cpu", max_model_len=64, kv_cache_memory_gb=0.01)
    llm = AsyncLLM(build)
    try:
        assert built_on == ["tokenmill-engine"] and llm.is_running
        assert llm.state.kv_blocks_total == llm.engine.kv.num_blocks > 0
    finally:
        llm.shutdown(wait=True)
    # a build that fails raises in the caller, and the loop is not left running
    with pytest.raises(ValueError, match="max_model_len"):
        AsyncLLM.from_engine_args(tiny_llama[0], device="cpu", max_model_len=10 ** 9)


# ---------------------------------------------------------------- the KV cache's memory

def _resident(t: torch.Tensor) -> tuple[int, int]:
    page = os.sysconf("SC_PAGE_SIZE")
    lo = t.data_ptr() // page * page
    n = (t.data_ptr() + t.numel() * t.element_size() - lo + page - 1) // page
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(lo, n * page, vec) == 0
    return sum(v & 1 for v in vec), n


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore(2) as Linux has it")
def test_an_idle_server_makes_the_kv_cache_ahead_of_its_use_resident_and_keeps_its_contents(tiny_llama) -> None:
    """Between requests the pages of the blocks written so far, and two full steps' worth past them, are faulted in;
    the rest of the budget is left for use to fault in (resident memory follows use, not the reservation)."""
    import asyncio
    llm = AsyncLLM.from_engine_args(tiny_llama[0], dtype="float32", device="cpu", max_model_len=128,
                                    kv_cache_memory_gb=0.06)
    pages = llm.engine.runner.kv_pages
    if pages.kernels is None:
        pytest.skip("no kernel library: nothing faults in")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(3, 40))}

    async def generate() -> list[int]:
        stream = await llm.add_request(prompt, params)
        out = None
        async for out in stream:
            pass
        return list(out.outputs[0].token_ids)
    try:
        first = asyncio.run(generate())        # its blocks stay in the prefix cache
        deadline = time.monotonic() + 60
        while not pages.done and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pages.done
        runner = llm.engine.runner
        ahead = -(-2 * llm.engine.config.scheduler_config.max_num_batched_tokens // runner.block_size)
        # 48 tokens written, 3 blocks: the first blocks of the pool, and the steps' worth past them
        assert pages.limit == pages.offset == (3 + ahead) * runner.kv_block_bytes < pages.total
        for t in pages.tensors:
            resident, total = _resident(t.view(-1)[:pages.limit // t.element_size()])
            assert resident >= total - 1     # the page the limit ends inside may hold no touched byte
        hits = llm.engine.stats.prefix_cache_hits
        assert asyncio.run(generate()) == first    # read back from blocks the fault-in went over
        assert llm.engine.stats.prefix_cache_hits > hits
    finally:
        llm.shutdown(wait=True)


def test_metrics_and_start_line_show_the_kv_reservation(live_server) -> None:
    info = live_server.llm.engine.kv_cache_info()
    m = live_server.metrics()
    assert m[("tokenmill:kv_cache_reserved_bytes", ())] == info.bytes > 0
    labels = (("block_size", str(info.block_size)), ("cache_dtype", info.cache_dtype),
              ("enable_prefix_caching", "True"), ("num_gpu_blocks", str(info.num_blocks)))
    assert m[("tokenmill:cache_config_info", labels)] == 1.0
    assert info.bytes == info.num_blocks * live_server.llm.engine.runner.kv_bytes_per_block(
        live_server.llm.engine.config)
    line = info.describe()
    assert f"{info.num_blocks:,} blocks of {info.block_size} tokens" in line and "GiB" in line


# ---------------------------------------------------------------- seats for many sequences

def test_a_request_with_large_n_does_not_hold_every_seat(tiny_llama) -> None:
    eng = LLMEngine(tiny_llama[0], dtype="float32", device="cpu", max_model_len=64, kv_cache_memory_gb=0.01,
                    max_num_seqs=4)
    many = SamplingParams(n=12, max_tokens=6, temperature=1.0, seed=1, ignore_eos=True)
    eng.add_request("many", {"prompt_token_ids": [5, 6, 7, 8]}, many)
    eng.step()
    eng.add_request("one", {"prompt_token_ids": [9, 10, 11]}, SamplingParams(max_tokens=6, ignore_eos=True))
    finished_at: dict[str, int] = {}
    step = 0
    while eng.has_unfinished_requests():
        step += 1
        for out in eng.step():
            if out.finished:
                finished_at[out.request_id] = step
        assert len(eng.scheduler.running) <= 4
    # arrival order alone would seat all twelve sequences first (three waves of four); "one" goes in the second
    assert finished_at["one"] < finished_at["many"]
    eng.kv.check_integrity()
    assert eng.kv.num_used_blocks == 0
