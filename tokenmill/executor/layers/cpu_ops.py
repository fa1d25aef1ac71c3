"""ctypes wrappers for executor/csrc/cpu_ops.c: fused float32 CPU versions of the small per-layer ops.

Each wrapper returns None when it does not apply (not float32 on CPU, or no C compiler), and the caller then
runs the torch version. Both are tested against each other in tests/test_cpu_kernels.py."""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from tokenmill.executor.native import check, kernels, kv_bf16_flag


def _usable(*ts: torch.Tensor) -> Optional[ctypes.CDLL]:
    for t in ts:      # a plain loop: this runs ~10 times a layer, and a generator costs more than the check
        if t.dtype != torch.float32 or not t.is_cpu:
            return None
    return kernels()


def add_rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                 eps: float) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """With residual: residual += x in place and returns (rms_norm(residual) * weight, residual); without:
    (rms_norm(x) * weight, x). x [..., dim] contiguous."""
    dll = _usable(x, weight)
    if dll is None or not x.is_contiguous() or (residual is not None and not residual.is_contiguous()):
        return None
    dim = x.shape[-1]
    res = x if residual is None else residual
    out = torch.empty_like(x)
    dll.add_rms_norm(x.data_ptr(), res.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps,
                     int(residual is not None), torch.get_num_threads())
    return out, res


def rotary_(qkv: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate the first `heads` head vectors of each row of qkv [T, width] in place; cos, sin [T, 1, head_dim].
    False (nothing done) when the C path does not apply."""
    dll = _usable(qkv, cos, sin)
    if dll is None or qkv.stride(-1) != 1 or not cos.is_contiguous() or not sin.is_contiguous():
        return False
    dll.rotary(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), qkv.shape[0], heads, head_dim, qkv.stride(0),
               torch.get_num_threads())
    return True


def silu_mul(gate_up: torch.Tensor) -> Optional[torch.Tensor]:
    """silu(gate) * up for gate_up [T, 2 * inter] (gate first). Returns [T, inter]."""
    dll = _usable(gate_up)
    if dll is None or not gate_up.is_contiguous():
        return None
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter)
    dll.silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, inter, torch.get_num_threads())
    return out


def argmax(x: torch.Tensor) -> Optional[torch.Tensor]:
    """x.argmax(dim=-1) for float32 x [R, V] (the first index on ties, NaN as the largest), rows split over the
    threads: torch's takes 3.1-3.6 ms for a 64-row step's [64, 49152] logits, this ~0.4 ms."""
    dll = _usable(x)
    if dll is None or x.dim() != 2 or not x.is_contiguous():
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    dll.argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> bool:
    """k_cache[slots] = k and v_cache[slots] = v, for float32 k, v [T, KV, D] views of rows with stride(0) and
    dense inner dims (the fused qkv rows), into float32 or bfloat16 caches (rounded as torch rounds). False
    (nothing done) when the C path does not apply."""
    dll, kv_bf16 = _usable(k, v), kv_bf16_flag(k_cache, v_cache)
    if dll is None or kv_bf16 is None or not k_cache.is_cpu:
        return False
    width = k.shape[1] * k.shape[2]
    if dll is None or slots.dtype != torch.int64 or k.stride(0) != v.stride(0) \
            or k.stride(1) != k.shape[2] or k.stride(2) != 1 or v.stride(1) != v.shape[2] or v.stride(2) != 1 \
            or not k_cache.is_contiguous() or not v_cache.is_contiguous() or not slots.is_contiguous():
        return False
    check(dll.write_kv(k.data_ptr(), v.data_ptr(), k.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                       kv_bf16, slots.data_ptr(), k.shape[0], width,
                       k_cache.numel() // width), "KV write")
    return True
