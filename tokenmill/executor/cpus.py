"""The cores the engine computes on: how many this process may use (its affinity and its cgroup's CPU quota, not
the host's count), and a governor that runs fewer compute threads while other processes hold some of them.

Why a governor: the OpenMP threads of a step meet at a barrier after every parallel region, so one thread that
shares its core with a busy neighbour holds up all the others; two threads on two cores with a neighbour on one
ran slower than one thread alone. The signal is the kernel's own: how long our threads sat runnable in a run
queue (/proc/self/task/*/schedstat), which is near zero when the cores are ours.
"""
from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

CGROUP_ROOT = "/sys/fs/cgroup"
log = logging.getLogger("tokenmill.cpus")


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cgroup_cpu_quota(root: str = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> Optional[float]:
    """The CPU quota of this process's cgroup and its parents, in cores (the smallest), or None if unlimited.
    cgroup v2's cpu.max ("quota period" or "max period"), else v1's cpu.cfs_quota_us / cpu.cfs_period_us."""
    text = _read(proc_cgroup) or ""
    v2 = next((line.split(":", 2)[2] for line in text.splitlines() if line.startswith("0::")), None)
    v1 = next((line.split(":", 2)[2] for line in text.splitlines()
               if line.count(":") >= 2 and "cpu" in line.split(":", 2)[1].split(",")), None)
    quotas: list[float] = []
    if v2 is not None:
        path = v2.strip("/")
        while True:
            raw = _read(os.path.join(root, path, "cpu.max"))
            if raw:
                quota, _, period = raw.partition(" ")
                if quota != "max" and period:
                    quotas.append(int(quota) / int(period))
            if not path:
                break
            path = os.path.dirname(path)
    elif v1 is not None:
        for d in (os.path.join(root, base, sub) for base in ("cpu", "cpu,cpuacct") for sub in (v1.strip("/"), "")):
            quota, period = _read(os.path.join(d, "cpu.cfs_quota_us")), _read(os.path.join(d, "cpu.cfs_period_us"))
            if quota and period and int(quota) > 0:
                quotas.append(int(quota) / int(period))
                break
    return min(quotas) if quotas else None


def available_cpus(root: str = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> int:
    """Cores this process may run on: its CPU affinity, bounded by its cgroup quota (rounded down: threads beyond
    the quota are throttled every period), at least 1."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = cgroup_cpu_quota(root, proc_cgroup)
    if quota is not None:
        n = min(n, max(1, math.floor(quota + 1e-6)))
    return max(1, n)


def runqueue_wait_ns() -> Optional[int]:
    """Nanoseconds the compute threads of this process have spent runnable but not running, summed; None where
    the kernel does not report it (no schedstat). Compute threads: the calling one and the native threads
    (OpenMP's workers), not the process's other Python threads (a server's event loop waiting for a core is
    our own load, not a neighbour's)."""
    others = {t.native_id for t in threading.enumerate() if t is not threading.current_thread()}
    total, seen = 0, False
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tasks:
        if int(tid) in others:
            continue
        raw = _read(f"/proc/self/task/{tid}/schedstat")
        if raw:
            total += int(raw.split()[1])
            seen = True
    return total if seen else None


@dataclass
class ThreadGovernor:
    """Compute threads between 1 and max_threads, moved by how long our threads waited for a core.

    After every step, once per `window_s`: waiting above `busy` thread-seconds a second means another process
    holds some of our cores, so one thread fewer; otherwise, `probe_s` after a cut, one more thread is tried for
    a window, and kept if the waiting stays low (a failed try doubles the time to the next, up to `max_probe_s`).
    Runs on the thread that steps the engine: OpenMP's thread count is per calling thread."""
    max_threads: int
    set_threads: Callable[[int], None] = torch.set_num_threads
    read_wait_ns: Callable[[], Optional[int]] = runqueue_wait_ns
    clock: Callable[[], float] = time.monotonic
    window_s: float = 0.5
    busy: float = 0.5
    probe_s: float = 4.0
    max_probe_s: float = 64.0
    threads: int = field(init=False)
    _t0: float = field(init=False, default=0.0)
    _wait0: Optional[int] = field(init=False, default=None)
    _probing: bool = field(init=False, default=False)
    _next_probe: float = field(init=False, default=0.0)
    _backoff: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self.threads = self.max_threads
        self._backoff = self.probe_s
        self._t0, self._wait0 = self.clock(), self.read_wait_ns()

    def tick(self) -> None:
        now = self.clock()
        elapsed = now - self._t0
        if elapsed < self.window_s or self._wait0 is None:
            return
        wait = self.read_wait_ns()
        waited = (wait - self._wait0) / 1e9 / elapsed if wait is not None else 0.0
        self._t0, self._wait0 = now, wait
        if elapsed > 4 * self.window_s:
            return                      # the engine sat idle for most of it: no verdict on the threads
        if waited > self.busy and self.threads > 1:
            if self._probing:           # the extra thread did not pay: wait longer before the next try
                self._backoff = min(2 * self._backoff, self.max_probe_s)
            self._set(self.threads - 1, f"our threads waited {waited:.2f} s a second for a core")
            self._probing, self._next_probe = False, now + self._backoff
        elif self._probing:
            self._probing, self._backoff = False, self.probe_s
            self._next_probe = now + self._backoff
        elif self.threads < self.max_threads and now >= self._next_probe:
            self._set(self.threads + 1, "trying one more")
            self._probing = True

    def _set(self, n: int, why: str) -> None:
        log.info("compute threads %d -> %d: %s", self.threads, n, why)
        self.threads = n
        self.set_threads(n)


class FixedThreads:
    """The thread count the user chose (num_threads=N): kept as given."""

    def __init__(self, n: int):
        self.threads = n

    def tick(self) -> None:
        pass


@functools.lru_cache(maxsize=1)
def torch_default_threads() -> int:
    """torch's own thread count (physical cores, or OMP_NUM_THREADS) as first seen: a governor may have lowered
    the current one since."""
    return torch.get_num_threads()


def thread_policy(num_threads: Optional[int]) -> "ThreadGovernor | FixedThreads":
    """Sets this thread's compute threads for the engine and returns what keeps them: num_threads as given, or
    (None) the cores available, at most torch's own default, governed."""
    default = torch_default_threads()
    if num_threads is not None:
        if num_threads < 1:
            raise ValueError(f"num_threads={num_threads}: give at least 1, or leave it out for the cores available")
        torch.set_num_threads(num_threads)
        return FixedThreads(num_threads)
    n = min(default, available_cpus())
    torch.set_num_threads(n)
    return ThreadGovernor(n)
