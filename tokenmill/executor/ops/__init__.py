"""The execution plan: the one implementation of the model's ops, chosen once at load. `reference` is plain torch
(the oracle); the CPU kernel library (one variant by ISA) serves a CPU model unless told otherwise."""
from __future__ import annotations

import logging
from typing import Optional

import torch

from tokenmill.executor.kernels import load
from tokenmill.executor.ops.cpu import CpuKernelOps
from tokenmill.executor.ops.reference import ReferenceOps

__all__ = ["ReferenceOps", "CpuKernelOps", "make_ops"]
log = logging.getLogger("tokenmill")


def make_ops(device: torch.device, dtype: torch.dtype, cpu_kernels: Optional[str] = "auto",
             int8_activations: bool = True) -> ReferenceOps:
    """cpu_kernels: 'auto' (TOKENMILL_CPU_ISA, else the best variant this CPU runs), a variant by name
    (avx512, avx2, neon, generic) or 'reference'. Off the CPU: the reference."""
    if device.type != "cpu":
        return ReferenceOps()
    kernels = load(cpu_kernels or "auto")
    return ReferenceOps() if kernels is None else CpuKernelOps(kernels, dtype, int8_activations)


def plan_lines(ops: ReferenceOps) -> list[str]:
    """The plan as lines of text: what serves each op."""
    return [f"  {op:<14} {impl}" for op, impl in ops.describe().items()]
