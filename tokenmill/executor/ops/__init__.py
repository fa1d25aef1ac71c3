"""The execution plan: the one implementation of the model's ops, chosen once at load. `reference` is plain torch
(the oracle); the CPU kernel library (one variant by ISA) serves a CPU model unless told otherwise."""
from __future__ import annotations

import logging
import os
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
    (avx512, avx2, neon, generic), 'reference' (plain torch) or 'triton' (the GPU's plan; on a CPU only under
    TRITON_INTERPRET=1, for tests). On a GPU: the Triton plan where Triton is installed, unless 'reference'."""
    if cpu_kernels == "triton" or (device.type == "cuda" and cpu_kernels != "reference"):
        why = triton_plan_error(device)
        if why is None:
            from tokenmill.executor.ops.triton import TritonOps
            return TritonOps(dtype)
        if cpu_kernels == "triton":
            raise ValueError(f"cpu_kernels='triton' cannot run here: {why}; use 'auto' or 'reference'")
        log.warning("the model's ops run on torch: %s", why)
    if device.type != "cpu":
        return ReferenceOps()
    kernels = load(cpu_kernels or "auto")
    return ReferenceOps() if kernels is None else CpuKernelOps(kernels, dtype, int8_activations)


def triton_plan_error(device: torch.device) -> Optional[str]:
    """None when the Triton plan can run on device, else why not."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"Triton is not installed ({e})"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "the device is not a GPU (Triton runs on CPU only under TRITON_INTERPRET=1, slowly)"
    return None


def plan_lines(ops: ReferenceOps) -> list[str]:
    """The plan as lines of text: what serves each op."""
    return [f"  {op:<14} {impl}" for op, impl in ops.describe().items()]
