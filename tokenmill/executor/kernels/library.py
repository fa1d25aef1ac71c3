"""The CPU kernel library of one variant: loaded from what build.py made at install, checked against the
sources it was built from, and called by kernel name with a struct of named fields (abi.py)."""
from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenmill.executor.kernels import abi
from tokenmill.executor.kernels.build import OUT, library_name, source_hash
from tokenmill.executor.kernels.isa import REFERENCE, choose, this_cpu

_RESTYPES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "const char *": ctypes.c_char_p}


class KernelLibraryError(RuntimeError):
    """The kernel library is missing or stale: an installation problem, with the command that fixes it."""


class KernelLibrary:
    def __init__(self, path: Path, isa: str):
        if not path.exists():
            raise KernelLibraryError(f"tokenmill's CPU kernels are not built ({path} is missing): run `make setup`, or "
                               f"`pip install --no-build-isolation -e .`, which build them; TOKENMILL_CPU_ISA=reference runs without")
        header = abi.parse(abi.HEADER.read_text())
        self.isa, self.path, self.limits = isa, path, header.limits
        self.structs = abi.Structs(header)
        self._dll = ctypes.CDLL(str(path))
        self._fns: dict[str, Any] = {}
        for fn in header.functions.values():
            c = getattr(self._dll, fn.name)
            c.restype = _RESTYPES[fn.restype]
            c.argtypes = [ctypes.POINTER(self.structs.types[fn.arg])] if fn.arg else []
            self._fns[fn.name[len("tm_"):]] = c
        built = self._fns["build_hash"]().decode()
        if self._fns["isa"]().decode() != isa or built != source_hash():
            raise KernelLibraryError(f"tokenmill's CPU kernels in {path} were built from other sources ({built}, the "
                               f"sources are {source_hash()}): rebuild them with `make kernels`")

    def struct(self, name: str, **fields: Any) -> ctypes.Structure:
        """A tm_<name> struct (tokenmill.h), every field given by name; keep what its pointers point into alive."""
        return self.structs.make(f"tm_{name}", **fields)

    def call(self, kernel: str, args: ctypes.Structure) -> int:
        """tm_<kernel>(&args): its status (or its count, for touch_pages)."""
        return self._fns[kernel](args)

    def run(self, kernel: str, **fields: Any) -> None:
        """tm_<kernel> on a tm_<kernel>_args built from `fields`; raises for a non-zero status."""
        check(self._fns[kernel](self.struct(f"{kernel}_args", **fields)), kernel)

    def __repr__(self) -> str:
        return f"KernelLibrary({self.isa}, {self.path})"


def check(status: int, kernel: str) -> None:
    """Raise for a kernel's non-zero status (tokenmill.h): -3 is a KV slot outside the cache, as indexing in torch
    would raise; -1 arguments outside the kernel's limits, which the caller should have kept it from."""
    if status == 0:
        return
    if status == -3:
        raise IndexError("KV slot out of range of the cache")
    if status == -2:
        raise MemoryError(f"the {kernel} kernel ran out of memory")
    raise RuntimeError(f"the {kernel} kernel refused its arguments (status {status}): outside its limits")


@lru_cache(maxsize=None)
def _load(isa: str, directory: Path) -> KernelLibrary:
    return KernelLibrary(directory / library_name(isa), isa)


def load(isa: str = "auto", directory: Path = OUT) -> KernelLibrary | None:
    """The variant for `isa` ('auto': TOKENMILL_CPU_ISA, else the best this CPU runs); None for 'reference'."""
    chosen = choose(isa)
    return None if chosen == REFERENCE else _load(chosen, directory)


def runnable_variants() -> list[str]:
    """The variants built here that this CPU can run, fastest first (what the tests run against the reference)."""
    from tokenmill.executor.kernels.build import VARIANTS
    cpu = this_cpu()
    return [isa for isa in VARIANTS.get(cpu.arch, {}) if not cpu.missing(isa) and (OUT / library_name(isa)).exists()]
