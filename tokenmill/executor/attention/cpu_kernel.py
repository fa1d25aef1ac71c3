"""Calls the C paged-attention kernels (executor/csrc/paged_decode.c) through ctypes.

Built by tokenmill.executor.native; without a compiler the engine falls back to the torch backend."""
from __future__ import annotations

import torch

from tokenmill.executor.native import check, kernels, kv_bf16_flag


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 starts: torch.Tensor, lens: torch.Tensor, block_size: int, scale: float,
                 max_len: int, shared_len: int = 0) -> torch.Tensor:
    """q [B, H, D] (rows may be strided, as in a view of fused qkv); caches [slots, KV, D], float32 or
    bfloat16 whatever q's dtype; tables int32 [B, max_blocks]; starts, lens int32 [B]. shared_len > 0:
    positions below it sit in the same blocks for every request (and every start is 0), attended once for the
    batch (cascade). Returns [B, H, D]."""
    B, H, D = q.shape
    q = _rows_dense(q)
    out = torch.empty(B, H, D, dtype=q.dtype)
    check(kernels().paged_decode(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                                 int(q.dtype == torch.bfloat16), _kv_bf16(k_cache, v_cache), tables.data_ptr(),
                                 tables.shape[1], starts.data_ptr(), lens.data_ptr(), shared_len, B, H,
                                 k_cache.shape[1], D, block_size, scale, max_len, torch.get_num_threads()),
          "paged decode")
    return out


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                  tables: torch.Tensor, row0: torch.Tensor, count: torch.Tensor, computed: torch.Tensor,
                  block_size: int, window: int, scale: float) -> None:
    """Causal attention of several query tokens per request over a context already in the cache: request i's
    tokens are rows row0[i] .. row0[i]+count[i]-1 of q [T, H, D] at positions computed[i] onwards; writes
    those rows of out [T, H, D] (contiguous). tables int32 [R, max_blocks]; window 0 = none."""
    T, H, D = q.shape
    q = _rows_dense(q)
    assert out.is_contiguous() and out.dtype == q.dtype
    check(kernels().paged_prefill(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                                  int(q.dtype == torch.bfloat16), _kv_bf16(k_cache, v_cache), tables.data_ptr(),
                                  tables.shape[1], row0.data_ptr(), count.data_ptr(), computed.data_ptr(),
                                  tables.shape[0], H, k_cache.shape[1], D, block_size, window, scale,
                                  torch.get_num_threads()),
          "paged prefill")


def _kv_bf16(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    flag = kv_bf16_flag(k_cache, v_cache)
    if flag is None:
        raise ValueError(f"the C attention kernels take a float32 or bfloat16 KV cache, not {k_cache.dtype}")
    return flag


def _rows_dense(q: torch.Tensor) -> torch.Tensor:
    """q with each token's heads contiguous (tokens may be strided apart), in a dtype the kernels take."""
    if q.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the C attention kernels take float32 or bfloat16, not {q.dtype}")
    D = q.shape[2]
    return q if q.stride(2) == 1 and q.stride(1) == D else q.contiguous()

