"""Calls the C paged-decode kernel (executor/csrc/paged_decode.c) through ctypes.

Built by tokenmill.executor.native; without a compiler the engine falls back to the torch backend."""
from __future__ import annotations

import torch

from tokenmill.executor.native import check, kernels


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 starts: torch.Tensor, lens: torch.Tensor, block_size: int, scale: float,
                 max_len: int) -> torch.Tensor:
    """q [B, H, D] (rows may be strided, as in a view of fused qkv); caches [slots, KV, D]; tables int32
    [B, max_blocks]; starts, lens int32 [B]. Returns [B, H, D]."""
    dll = kernels()
    B, H, D = q.shape
    if q.stride(2) != 1 or q.stride(1) != D:
        q = q.contiguous()
    KV = k_cache.shape[1]
    out = torch.empty(B, H, D, dtype=q.dtype)
    if q.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the C decode kernel takes float32 or bfloat16, not {q.dtype}")
    check(dll.paged_decode(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                           int(q.dtype == torch.bfloat16), tables.data_ptr(), tables.shape[1], starts.data_ptr(),
                           lens.data_ptr(), B, H, KV, D, block_size, scale, max_len, torch.get_num_threads()),
          "paged decode")
    return out

