"""Paged attention behind one narrow interface (backend.py): bind_kv_cache once, prepare() once a step,
forward() per layer. The backend is chosen once at load (get_backend)."""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from tokenmill.executor.attention.backend import (AttentionBackend, AttentionMetadata, BatchedBackend,
                                                  TorchReferenceBackend)
from tokenmill.executor.attention.cpu import CpuKernelBackend, kernel_fits
from tokenmill.executor.attention.gpu import TritonBackend, triton_fits
from tokenmill.executor.attention.padded import PaddedBackend
from tokenmill.executor.kernels import KernelLibrary

__all__ = ["AttentionMetadata", "AttentionBackend", "get_backend"]
log = logging.getLogger("tokenmill")


def get_backend(name: str, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int,
                kernels: Optional[KernelLibrary], value_dim: Optional[int] = None, kv_cache_dtype: str = "auto",
                rotary_dim: Optional[int] = None) -> AttentionBackend:
    """'auto': the CPU kernels on CPU where they take the model's shapes and attention (else torch, said once),
    the Triton kernels on a GPU where Triton is installed and they take the shapes (else torch, said once);
    'cpu', 'triton', 'batched', 'padded' or 'torch' by name ('triton' on CPU only under TRITON_INTERPRET=1, for tests). kernels: the CPU kernel library, None without one.
    value_dim: values narrower than keys (latent attention's), which only torch attends;
    kv_cache_dtype: the cache's dtype by name (the Triton kernels read float and fp8 caches); rotary_dim: under the
    Triton op plan, the dims of each head that rotary embeddings turn (all of them: the Triton backend turns q and k
    as it writes the cache; None: the plan's own rotary)."""
    fused_rotary = rotary_dim == head_dim
    why_not = "the CPU kernels are off (reference)" if kernels is None else \
        kernel_fits(kernels, num_heads, num_kv_heads, head_dim, value_dim)
    if name == "auto":
        if device.type == "cpu" and why_not is None:
            return CpuKernelBackend(kernels)
        if device.type == "cpu" and kernels is not None:
            log.warning("attention runs on torch (batched SDPA): the CPU kernels do not take %s", why_not)
        if device.type == "cuda":
            why_not = triton_fits(num_heads, num_kv_heads, head_dim, value_dim)
            if why_not is None:      # the backend says which caches it reads
                backend = TritonBackend(device, fused_rotary=fused_rotary)
                refused = backend.kv_cache_dtype_error(kv_cache_dtype, device) if kv_cache_dtype != "auto" else None
                if refused is None:
                    return backend
                why_not = f"a {kv_cache_dtype} KV cache ({refused})"
            log.warning("attention runs on torch (batched SDPA): the Triton kernels do not take %s", why_not)
        return BatchedBackend()
    if name == "triton":
        why_not = triton_fits(num_heads, num_kv_heads, head_dim, value_dim)
        if why_not is None and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            why_not = "the device is not a GPU (Triton runs on CPU only under TRITON_INTERPRET=1, slowly)"
        if why_not is not None:
            raise ValueError(f"attention_backend='triton' cannot run here: {why_not}; use 'auto'")
        return TritonBackend(device, fused_rotary=fused_rotary)
    if name == "cpu":
        if why_not is not None or device.type != "cpu":
            raise ValueError(f"attention_backend='cpu' cannot run here: "
                             f"{why_not if device.type == 'cpu' else 'the device is not a CPU'}; use 'batched'")
        return CpuKernelBackend(kernels)
    if name == "batched":
        return BatchedBackend()
    if name == "torch":
        return TorchReferenceBackend()
    if name == "padded":
        return PaddedBackend()
    raise ValueError(f"unknown attention_backend {name!r}; choose auto, cpu, triton, batched, padded or torch")
