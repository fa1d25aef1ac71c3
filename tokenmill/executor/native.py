"""Builds our C kernels (attention, quantised matmul) into shared libraries with the system C compiler.

Each library is compiled once per machine into ~/.cache/tokenmill (keyed by the source, the CPU flags and the
compiler), in well under a second; a caller gets None when no compiler is found and falls back to torch."""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

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


def build_library(source: Path, what: str) -> Optional[ctypes.CDLL]:
    """Compile `source` (or reuse the cached build) and load it; None, with a note on stderr, when we cannot.
    `what` names the kernel in that note."""
    if os.environ.get("TOKENMILL_NO_C_KERNEL"):
        return None
    cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if cc is None:
        print(f"tokenmill: no C compiler found; {what} falls back to torch", file=sys.stderr)
        return None
    src = source.read_bytes()
    key = hashlib.sha256(src + _cpu_id().encode() + cc.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))
    lib = cache / f"{source.stem}-{key}.so"
    if not lib.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            obj, out = Path(tmp) / "kernel.o", Path(tmp) / lib.name
            steps = [[cc, "-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-c", str(source), "-o", str(obj)],
                     [cc, "-shared", str(obj), "-o", str(out), "-lm", *_openmp_link_flags()]]
            for cmd in steps:
                res = subprocess.run(cmd, capture_output=True, text=True)
                if res.returncode != 0:
                    print(f"tokenmill: could not build the C kernel for {what} ({res.stderr.strip()[:300]}); "
                          f"it falls back to torch", file=sys.stderr)
                    return None
            os.replace(out, lib)      # atomic: concurrent processes never load a half-written file
    return ctypes.CDLL(str(lib))


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
