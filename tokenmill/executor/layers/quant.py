"""Weights kept in llama.cpp's quantised blocks (Q4_0, Q4_1, Q8_0) for decode-sized matmuls.

A GGUF checkpoint's weights are dequantised to float for the dense path (prefill); the blocks are also kept,
repacked for executor/csrc/qmatmul.c, and a decode step of up to 64 rows reads those instead: 5 bits a
weight for Q4_1 rather than 32, and the step is bound by reading weights. The kernel computes with exactly
the dequantised values (d * code + m), so the two paths differ only in float32 summation order."""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Optional

import numpy as np
import torch

from tokenmill.executor.native import check, kernels

BLOCK = 32
# Rows of x per call, the kernel's limit (csrc/qmatmul.c), and the rows up to which a layer uses the blocks
# rather than its dense float32 weights (prefill chunks go dense). SmolLM2's 120 matrices, cold, on the 2-core
# dev machine, blocks vs MKL on float32: 8 rows 16 vs 32 ms, 16: 23 vs 37, 32: 35 vs 48, 64: 57 vs 100 (above
# 20 rows the kernel is a register-blocked GEMM that dequantises into L1; it reads 5 bits a weight where MKL
# reads 32 and repacks on every call).
MAX_ROWS = 64
PACKABLE = ("Q4_0", "Q4_1", "Q8_0")


@dataclass(frozen=True)
class PackedWeight:
    """W [N, K] as blocks of 32 along K: W[n, 32i + j] = scale[n, i] * code + offset[n, i]."""
    bits: int                        # 4: codes uint8 [N, K/2], two per byte; 8: codes int8 [N, K]
    codes: torch.Tensor
    scale: torch.Tensor              # float32 [N, K/32]
    offset: Optional[torch.Tensor]   # float32 [N, K/32]; None means zero (Q8_0)
    shape: tuple[int, int]           # (N, K)
    # the same blocks laid out for qmatmul.c's lanes kernel (16 rows interleaved; with_lanes()): codes, scale,
    # offset. None where that kernel cannot run (no AVX-512, N not a multiple of 16): the others serve every B
    lanes: Optional[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]] = None

    @cached_property
    def pointers(self) -> tuple[Optional[int], ...]:
        """codes, scale, offset addresses for the kernel, then the lanes layout's (None when absent), looked up
        once (this runs ~120 times a step)."""
        lanes = self.lanes or (None, None, None)
        return tuple(None if t is None else t.data_ptr()
                     for t in (self.codes, self.scale, self.offset, *lanes))

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]; the reference the kernel is tested against."""
        n, k = self.shape
        if self.bits == 4:
            c = self.codes.view(n, k // BLOCK, 16)
            codes = torch.cat([c & 15, c >> 4], dim=-1).float()          # [N, K/32, 32]
        else:
            codes = self.codes.view(n, k // BLOCK, BLOCK).float()
        w = codes * self.scale.unsqueeze(-1)
        if self.offset is not None:
            w = w + self.offset.unsqueeze(-1)
        return w.reshape(n, k)


def pack_ggml(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> Optional[PackedWeight]:
    """Repack a GGUF tensor's bytes (rows of blocks, [N, row_bytes]) into a PackedWeight; None for other types."""
    n, k = shape
    if type_name not in PACKABLE or k % BLOCK:
        return None
    nb = k // BLOCK
    header = 4 if type_name == "Q4_1" else 2                 # fp16 d, then fp16 m for Q4_1
    blocks = np.ascontiguousarray(raw).reshape(n, nb, -1)    # [N, K/32, block bytes]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    payload = blocks[..., header:]
    if type_name == "Q8_0":
        codes = torch.from_numpy(payload.copy().view(np.int8).reshape(n, k))
        return PackedWeight(8, codes, torch.from_numpy(d), None, shape)
    codes = torch.from_numpy(payload.copy().reshape(n, k // 2))
    if type_name == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:                                                     # Q4_0: d * (code - 8)
        m = -8.0 * d
    return PackedWeight(4, codes, torch.from_numpy(d), torch.from_numpy(np.ascontiguousarray(m)), shape)


def concat_rows(parts: list[PackedWeight]) -> Optional[PackedWeight]:
    """Stack along N (fused qkv / gate_up); None unless all parts share the block format and K."""
    first = parts[0]
    if any(p.bits != first.bits or p.shape[1] != first.shape[1]
           or (p.offset is None) != (first.offset is None) for p in parts):
        return None
    offset = None if first.offset is None else torch.cat([p.offset for p in parts])
    return PackedWeight(first.bits, torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                        offset, (sum(p.shape[0] for p in parts), first.shape[1]))


def with_lanes(p: PackedWeight) -> PackedWeight:
    """p plus its lanes layout (csrc/qmatmul.c): a second copy of the codes and scales (SmolLM2: +96 MB), for
    the kernel that serves 9-40 rows without padding them to whole vectors of 16. p itself where the kernel
    cannot take it."""
    dll = kernels()
    if dll is None:
        return p
    out = replace(p, lanes=(torch.empty_like(p.codes), torch.empty_like(p.scale),
                            None if p.offset is None else torch.empty_like(p.offset)))
    # pointers: the row layout's codes, scale, offset, then the lanes layout's: pack_lanes' argument order
    ok = dll.pack_lanes(p.bits == 4, p.shape[1], p.shape[0], *out.pointers) == 0
    return out if ok else p


def permute_rows(p: PackedWeight, fn) -> PackedWeight:
    """Apply a row permutation `fn` (a function of a [N, ...] tensor) to every per-row array."""
    return PackedWeight(p.bits, fn(p.codes).contiguous(), fn(p.scale).contiguous(),
                        None if p.offset is None else fn(p.offset).contiguous(), p.shape)


def qmatmul(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [B, K] float32 with B <= MAX_ROWS, on CPU. Returns x @ W^T, float32 [B, N]."""
    dll = kernels()
    if not x.is_contiguous():
        x = x.contiguous()
    b, k = x.shape
    n = w.shape[0]
    if k != w.shape[1] or b > MAX_ROWS or x.dtype != torch.float32:
        raise ValueError(f"qmatmul takes float32 [<= {MAX_ROWS}, {w.shape[1]}], got {x.dtype} {tuple(x.shape)}")
    y = torch.empty(b, n, dtype=torch.float32)
    check(dll.qmatmul(w.bits == 4, x.data_ptr(), b, k, n, *w.pointers, y.data_ptr(), torch.get_num_threads()),
          "quantised matmul")
    return y
