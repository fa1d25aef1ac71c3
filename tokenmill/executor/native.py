"""Builds our C kernels (csrc/: paged decode attention, quantised-block matmul, fused layer ops) into one shared
library with the system C compiler, once per machine, into ~/.cache/tokenmill (keyed by the sources, the CPU
flags and the compiler), in about a second. Callers get None where that cannot be done and fall back to torch."""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Iterator, Optional

import torch


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((l for l in f if l.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _openmp_link_flags() -> list[str]:
    """Link against the OpenMP runtime torch already loaded: one thread pool for GEMMs and our kernels.
    Two runtimes (torch's and the system's) would each keep spinning threads and fight over the cores."""
    torch_lib = Path(torch.__file__).parent / "lib"
    gomp = sorted(torch_lib.glob("libgomp*.so*"))
    if gomp:
        return [f"-L{torch_lib}", f"-l:{gomp[0].name}", f"-Wl,-rpath,{torch_lib}"]
    return ["-fopenmp"]


SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.c"))
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))      # part of the build key, not compiled alone

_P, _I, _F, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_int64
# every exported kernel: (argument types, return type)
_SIGNATURES: dict[str, tuple[list, object]] = {
    "paged_decode": ([_P, _I, _P, _P, _P, _I, _I, _P, _I, _P, _P, _I, _I, _I, _I, _I, _I, _F, _I, _I], _I),
    "paged_prefill": ([_P, _I, _P, _P, _P, _I, _I, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _I], _I),
    "decode_attention": ([_P, _I, _P, _P, _P, _P, _I64, _P, _P, _I, _P, _I, _P, _P, _I, _I, _I, _I, _I, _I, _F, _I,
                          _I], _I),
    "qmatmul": ([_I, _P, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _I], _I),
    "pack_lanes": ([_I, _I, _I, _P, _P, _P, _P, _P, _P], _I),
    "decode_layer": ([_P, _P, _P, _I, _P, _P, _P, _P, _I64, _P, _P, _I, _P, _I, _P, _P, _I, _I, _I, _F, _I, _I], _I),
    "add_rms_norm": ([_P, _P, _P, _P, _I, _I, _F, _I, _I], None),
    "rotary": ([_P, _P, _P, _I, _I, _I, _I, _I], None),
    "silu_mul": ([_P, _P, _I, _I, _I], None),
    "argmax_rows": ([_P, _I, _I, _P, _I], None),
    "write_kv": ([_P, _P, _I, _P, _P, _I, _P, _I, _I, _I64], _I),
    "touch_pages": ([_P, _I, _I64, _I64, _P], _I64),
}


def kv_bf16_flag(k_cache: torch.Tensor, v_cache: torch.Tensor) -> Optional[int]:
    """The kernels' kv_bf16 argument for these caches (0 float32, 1 bfloat16), or None for caches they do not
    take (another dtype, or K and V of different dtypes)."""
    if k_cache.dtype not in (torch.float32, torch.bfloat16) or v_cache.dtype != k_cache.dtype:
        return None
    return int(k_cache.dtype == torch.bfloat16)


def check(status: int, what: str) -> None:
    """Raise for a kernel's non-zero status: -3 is a KV slot outside the cache (what indexing in torch would
    raise), anything else a failure of `what`."""
    if status == -3:
        raise IndexError("KV slot out of range of the cache")
    if status != 0:
        raise RuntimeError(f"{what} kernel failed with status {status}")


@lru_cache(maxsize=1)
def kernels() -> Optional[ctypes.CDLL]:
    """Our C kernels (csrc/*.c, one library), built on first use; None, with a note on stderr, when they cannot
    be built here (no compiler, or TOKENMILL_NO_C_KERNEL set) and every caller falls back to torch."""
    if os.environ.get("TOKENMILL_NO_C_KERNEL"):
        return None
    cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if cc is None:
        print("tokenmill: no C compiler found; using the torch versions of the CPU kernels", file=sys.stderr)
        return None
    key = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + _cpu_id().encode() + cc.encode())
    cache = Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))
    lib = cache / f"kernels-{key.hexdigest()[:16]}.so"
    if not lib.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            objs = [Path(tmp) / f"{src.stem}.o" for src in SOURCES]
            out = Path(tmp) / lib.name
            steps = [[cc, "-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-c", str(src), "-o", str(obj)]
                     for src, obj in zip(SOURCES, objs)]
            steps.append([cc, "-shared", *map(str, objs), "-o", str(out), "-lm", *_openmp_link_flags()])
            for cmd in steps:
                res = subprocess.run(cmd, capture_output=True, text=True)
                if res.returncode != 0:
                    print(f"tokenmill: could not build the C kernels ({res.stderr.strip()[:300]}); "
                          f"using their torch versions", file=sys.stderr)
                    return None
            os.replace(out, lib)      # atomic: concurrent processes never load a half-written file
    dll = ctypes.CDLL(str(lib))
    for name, (args, ret) in _SIGNATURES.items():
        fn = getattr(dll, name)
        fn.argtypes, fn.restype = args, ret
    return dll


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


@contextmanager
def faulting_in(tensors: list[torch.Tensor], chunk_bytes: int = 2 << 20) -> Iterator[None]:
    """While the body runs, fault in the pages of these equal-sized CPU tensors on a background thread
    (csrc/pages.c: a zero written into each page), `chunk_bytes` of each in turn, lowest offsets first; when
    the body ends it stops where it got to and is joined. Only for tensors nothing uses yet: the zeros land
    in them. For the KV cache at start-up (why, and why by stores: csrc/pages.c). Does nothing without the
    C kernels."""
    dll = kernels()
    if dll is None or not tensors or any(t.device.type != "cpu" for t in tensors):
        yield
        return
    nbytes = tensors[0].numel() * tensors[0].element_size()
    if any(t.numel() * t.element_size() != nbytes for t in tensors):
        raise ValueError("faulting_in() takes tensors of one size")
    ptrs = (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])
    stop = ctypes.c_int(0)
    # ctypes drops the GIL for the call: the thread costs the body nothing but the other core's time
    worker = threading.Thread(target=dll.touch_pages, args=(ptrs, len(tensors), nbytes, chunk_bytes,
                                                           ctypes.byref(stop)), name="tokenmill-fault-in")
    worker.start()
    try:
        yield
    finally:
        stop.value = 1      # checked before each chunk of each tensor: the join waits for one chunk at most
        worker.join()


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
