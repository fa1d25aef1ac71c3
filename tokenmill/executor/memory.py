"""The CPU memory the engine manages by hand: huge pages for the KV cache, faulting its pages in at start-up,
and keeping freed activation memory in the heap."""
from __future__ import annotations

import ctypes
import sys
import threading
from contextlib import contextmanager
from typing import Iterator, Optional

import torch

from tokenmill.executor.kernels import KernelLibrary


_MADV_HUGEPAGE = 14
_HUGE = 2 << 20


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux to back a large, not yet touched CPU tensor with 2 MB pages (madvise MADV_HUGEPAGE).

    For the KV cache: it is allocated untouched (start-up does not pay for the whole budget), so each 4 KB page
    faults the first time a step writes into it. In a VM such a fault costs tens of microseconds, and a decode
    step of 64 requests touched ~700 new pages: ~10 ms a step. 2 MB pages fault 512x less often and also spare
    the TLB when attention walks the blocks. A no-op (False) off Linux or where THP is off."""
    if t.device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    start = -(-t.data_ptr() // _HUGE) * _HUGE                 # whole huge pages inside the tensor only
    end = (t.data_ptr() + t.numel() * t.element_size()) // _HUGE * _HUGE
    if end <= start:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(start, end - start, _MADV_HUGEPAGE) == 0


def touch_pages(kernels: KernelLibrary, tensors: list[torch.Tensor], chunk_bytes: int,
                stop: ctypes.c_int, start: int = 0, end: Optional[int] = None) -> tuple[ctypes.Structure, list]:
    """The tm_touch_pages_args for these equal-sized CPU tensors, bytes start .. end of each (end None: all), and
    what it points into (keep both alive)."""
    nbytes = tensors[0].numel() * tensors[0].element_size()
    if any(t.numel() * t.element_size() != nbytes for t in tensors):
        raise ValueError("a PageToucher takes tensors of one size")
    ptrs = (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])
    args = kernels.struct("touch_pages_args", bufs=ptrs, n=len(tensors), start=start,
                          bytes=nbytes if end is None else min(end, nbytes), chunk=chunk_bytes, stop=stop)
    return args, [ptrs, stop, tensors]


class PageToucher:
    """Faults in the pages of equal-sized CPU tensors on a background thread, a chunk of each in turn, lowest
    offsets first, while a `running()` body runs; it resumes where the last body stopped it. Contents are
    kept (csrc/pages.c). For the KV cache: during start-up, and in a server between requests, so what the cache
    will use becomes resident before load needs it. With ahead_bytes, only that far past what use() was told is
    written: the resident memory follows the cache's use, not its budget. Does nothing without the kernel library
    or off CPU."""

    def __init__(self, kernels: Optional[KernelLibrary], tensors: list[torch.Tensor], chunk_bytes: int = 2 << 20,
                 ahead_bytes: Optional[int] = None):
        usable = kernels is not None and tensors and all(t.device.type == "cpu" for t in tensors)
        self.kernels, self.tensors, self.chunk_bytes = kernels, tensors, chunk_bytes
        self.total = tensors[0].numel() * tensors[0].element_size() if usable else 0   # bytes of each tensor
        if usable and any(t.numel() * t.element_size() != self.total for t in tensors):
            raise ValueError("a PageToucher takes tensors of one size")
        self.offset = 0                  # every tensor is resident below it
        self.ahead = ahead_bytes
        self.limit = self.total if ahead_bytes is None else min(self.total, ahead_bytes)   # touched up to here

    def use(self, end: int) -> None:
        """The tensors are written up to byte `end` of each: keep ahead_bytes past it resident."""
        if self.ahead is not None:
            self.limit = min(self.total, max(self.limit, end + self.ahead))

    @property
    def done(self) -> bool:
        return self.offset >= self.limit

    @property
    def resident_bytes(self) -> int:
        return self.offset * len(self.tensors)

    @contextmanager
    def running(self) -> Iterator[None]:
        if self.done:
            yield
            return
        assert self.kernels is not None
        stop = ctypes.c_int(0)
        args, keep = touch_pages(self.kernels, self.tensors, self.chunk_bytes, stop, self.offset, self.limit)
        kernels = self.kernels

        def touch() -> None:
            self.offset = kernels.call("touch_pages", args)

        # ctypes drops the GIL for the call: the thread costs the body nothing but the other core's time
        worker = threading.Thread(target=touch, name="tokenmill-fault-in", daemon=True)
        worker.start()
        try:
            yield
        finally:
            stop.value = 1      # checked before each chunk of each tensor: the join waits for one chunk at most
            worker.join()
            del keep


_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory for reuse instead of handing it back to the OS.

    A step allocates the same activation sizes every layer (a 2048-token prefill chunk's gate/up output is 25 MB).
    By default each such block is a fresh mmap, or the heap top is trimmed after it is freed, so every layer pays
    page faults and the kernel zeroes the pages again: offline-64's prefill took 1.25 M page faults, 334 K with
    this (CPU time 66 -> 61 s). Blocks up to 32 MB (malloc's maximum mmap threshold) now come from the heap, and
    up to 1 GB of freed heap is kept. Process-wide, like torch.set_num_threads. False where this is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(opt, value) == 1 for opt, value in
               ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20)))
