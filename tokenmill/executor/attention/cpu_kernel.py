"""Builds and calls the C paged-decode kernel (csrc/paged_decode.c) through ctypes.

Compiled once per machine with the system C compiler into ~/.cache/tokenmill (keyed by the source and the
CPU), in well under a second; without a compiler the engine falls back to the torch backend."""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((l for l in f if l.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _openmp_link_flags() -> list[str]:
    """Link against the OpenMP runtime torch already loaded: one thread pool for GEMMs and attention.
    Two runtimes (torch's and the system's) would each keep spinning threads and fight over the cores."""
    torch_lib = Path(torch.__file__).parent / "lib"
    gomp = sorted(torch_lib.glob("libgomp*.so*"))
    if gomp:
        return [f"-L{torch_lib}", f"-l:{gomp[0].name}", f"-Wl,-rpath,{torch_lib}"]
    return ["-fopenmp"]


@lru_cache(maxsize=1)
def load_kernel() -> Optional[ctypes.CDLL]:
    """The compiled library, or None (with a note on stderr) when it cannot be built here."""
    if os.environ.get("TOKENMILL_NO_C_KERNEL"):
        return None
    cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if cc is None:
        print("tokenmill: no C compiler found; using the torch attention backend", file=sys.stderr)
        return None
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + _cpu_id().encode() + cc.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))
    lib = cache / f"paged_decode-{key}.so"
    if not lib.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            obj, out = Path(tmp) / "kernel.o", Path(tmp) / lib.name
            steps = [[cc, "-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-c", str(SOURCE), "-o", str(obj)],
                     [cc, "-shared", str(obj), "-o", str(out), "-lm", *_openmp_link_flags()]]
            for cmd in steps:
                res = subprocess.run(cmd, capture_output=True, text=True)
                if res.returncode != 0:
                    print(f"tokenmill: could not build the C attention kernel ({res.stderr.strip()[:300]}); "
                          f"using the torch backend", file=sys.stderr)
                    return None
            os.replace(out, lib)      # atomic: concurrent processes never load a half-written file
    dll = ctypes.CDLL(str(lib))
    dll.paged_decode.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int] \
        + [ctypes.c_void_p] * 2 + [ctypes.c_int] * 5 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    dll.paged_decode.restype = ctypes.c_int
    return dll


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 starts: torch.Tensor, lens: torch.Tensor, block_size: int, scale: float,
                 max_len: int) -> torch.Tensor:
    """q [B, H, D]; caches [slots, KV, D]; tables int32 [B, max_blocks]; starts, lens int32 [B]. Returns [B, H, D]."""
    dll = load_kernel()
    q = q.contiguous()
    B, H, D = q.shape
    KV = k_cache.shape[1]
    out = torch.empty_like(q)
    if q.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the C decode kernel takes float32 or bfloat16, not {q.dtype}")
    rc = dll.paged_decode(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
            int(q.dtype == torch.bfloat16), tables.data_ptr(),
            tables.shape[1], starts.data_ptr(), lens.data_ptr(), B, H, KV, D, block_size, scale, max_len,
            torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"paged decode kernel failed with status {rc}")
    return out

