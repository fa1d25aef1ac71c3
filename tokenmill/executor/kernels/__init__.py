"""tokenmill's CPU kernel library: C kernels for AVX-512, AVX2, NEON and plain C, built at install (build.py),
one variant picked at load from the running CPU (isa.py), called through the structs of csrc/tokenmill.h
(abi.py, library.py)."""
from tokenmill.executor.kernels.isa import REFERENCE, Cpu, choose, machine_record, this_cpu
from tokenmill.executor.kernels.library import KernelLibrary, KernelLibraryError, check, load, runnable_variants

__all__ = ["REFERENCE", "Cpu", "KernelLibrary", "KernelLibraryError", "check", "choose", "load", "machine_record", "runnable_variants",
           "this_cpu"]
