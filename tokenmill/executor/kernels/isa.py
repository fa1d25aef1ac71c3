"""Which kernel variant this CPU runs: read from what the running CPU reports, never from the build machine.

TOKENMILL_CPU_ISA=avx512|avx2|neon|generic forces one (a variant this CPU cannot run is refused with what it
lacks), and =reference runs plain torch everywhere."""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from tokenmill.executor.kernels.build import VARIANTS, machine

# the CPU features each variant's -march needs (build.py), as /proc/cpuinfo names them: x86-64-v4 and -v3
REQUIRES: dict[str, frozenset[str]] = {
    "avx512": frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma", "f16c", "bmi1",
                         "bmi2", "movbe", "abm"}),
    "avx2": frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"}),
    "neon": frozenset({"asimd"}),
    "generic": frozenset(),
}
REFERENCE = "reference"   # no kernels: the torch implementation of every op


@dataclass(frozen=True)
class Cpu:
    arch: str
    model: str
    flags: frozenset[str]

    def missing(self, isa: str) -> list[str]:
        """The features `isa` needs that this CPU lacks (all of them for another architecture's variant)."""
        if isa not in VARIANTS.get(self.arch, {}):
            return [f"an {next(a for a, v in VARIANTS.items() if isa in v)} CPU"]
        return sorted(REQUIRES[isa] - self.flags)

    def simd_flags(self) -> list[str]:
        """The flags that say which vector instructions it has (for reports)."""
        return sorted(f for f in self.flags if f.startswith(("avx", "fma", "f16c", "asimd", "sve", "amx")))

    def best(self) -> str:
        """The first variant of its architecture (fastest first) that it runs; 'reference' on others."""
        return next((isa for isa in VARIANTS.get(self.arch, {}) if not self.missing(isa)), REFERENCE)


@lru_cache(maxsize=1)
def this_cpu() -> Cpu:
    model, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model", "CPU part") and model in ("unknown", "", platform.processor()):
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    if machine() == "aarch64":
        flags.add("asimd")       # Advanced SIMD is part of every ARMv8-A core
    return Cpu(machine(), model, frozenset(flags))


def choose(requested: Optional[str] = None, cpu: Optional[Cpu] = None) -> str:
    """The variant to load: `requested` (or TOKENMILL_CPU_ISA, or 'auto') checked against the CPU."""
    cpu = cpu or this_cpu()
    want = (requested or "auto").strip().lower()
    if want == "auto":
        want = (os.environ.get("TOKENMILL_CPU_ISA") or "auto").strip().lower()
    if want == "auto":
        return cpu.best()
    if want == REFERENCE:
        return REFERENCE
    known = sorted({i for v in VARIANTS.values() for i in v})
    if want not in known:
        raise ValueError(f"unknown CPU kernel variant {want!r}; choose auto, reference or one of {', '.join(known)}")
    missing = cpu.missing(want)
    if missing:
        runs = [i for i in VARIANTS.get(cpu.arch, {}) if not cpu.missing(i)] + [REFERENCE]
        raise ValueError(f"this CPU ({cpu.model}, {cpu.arch}) cannot run the {want} kernels, which need "
                         f"{', '.join(missing)}; choose one of {', '.join(runs)}")
    return want


def machine_record(cpu_kernels: str = "auto") -> dict:
    """What a benchmark result depends on besides the model, recorded with every result: the CPU, its SIMD flags,
    the cores, torch, and the kernel variant that runs (not "auto": results differ in the last digits)."""
    import torch
    cpu = this_cpu()
    return {"machine": cpu.model, "arch": cpu.arch, "cpu_flags": cpu.simd_flags(), "cores": os.cpu_count(),
            "torch": torch.__version__, "tokenmill_kernels": choose(cpu_kernels)}
