"""Weights kept in llama.cpp's quantised blocks (Q4_0, Q4_1, Q8_0) for decode-sized matmuls.

A GGUF checkpoint's weights are dequantised to float for the dense path (prefill); the blocks are also kept,
repacked for the kernel library's qmatmul (csrc/qmatmul.c, ops/cpu.py), and a decode step of up to
TM_QMATMUL_MAX_ROWS rows reads those instead: 5 bits a weight for Q4_1 rather than 32, and the step is bound by
reading weights. The kernel computes with exactly the dequantised values (d * code + m), so the two paths
differ only in float32 summation order."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch


BLOCK = 32
PACKABLE = ("Q4_0", "Q4_1", "Q8_0")


@dataclass(frozen=True)
class PackedWeight:
    """W [N, K] as blocks of 32 along K: W[n, 32i + j] = scale[n, i] * code + offset[n, i]."""
    bits: int                        # 4: codes uint8 [N, K/2], two per byte; 8: codes int8 [N, K]
    codes: torch.Tensor
    scale: torch.Tensor              # float32 [N, K/32]
    offset: Optional[torch.Tensor]   # float32 [N, K/32]; None means zero (Q8_0)
    shape: tuple[int, int]           # (N, K)
    # the same blocks laid out for the AVX-512 lanes kernel (16 rows interleaved; ops/cpu.py): codes, scale,
    # offset. None where that kernel cannot run (no AVX-512, N not a multiple of 16): the others serve every B
    lanes: Optional[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]] = None

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


def permute_rows(p: PackedWeight, fn) -> PackedWeight:
    """Apply a row permutation `fn` (a function of a [N, ...] tensor) to every per-row array."""
    return PackedWeight(p.bits, fn(p.codes).contiguous(), fn(p.scale).contiguous(),
                        None if p.offset is None else fn(p.offset).contiguous(), p.shape)
