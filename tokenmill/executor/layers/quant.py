"""Weights kept quantised: no float copy of a quantised matrix is ever made.

Two forms. PackedWeight: Q4_0, Q4_1 and Q8_0 repacked for the kernel library's tuned qmatmul (csrc/qmatmul.c).
GGMLWeight: every other GGUF matrix type (F16, BF16, Q5_0, Q5_1, the K-quants) in the file's own blocks, read
where the file is mapped (csrc/gblocks.c). A matmul over a few rows (decode) reads the blocks directly;
prefill-sized batches dequantise tiles of rows into a scratch buffer for a float GEMM (ops). Both compute with
exactly the dequantised values, so quantised and dequantised paths differ only in float32 summation order."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType


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

    def dequantize(self, row0: int = 0, rows: Optional[int] = None) -> torch.Tensor:
        """float32 [rows, K] of rows row0 ..; the reference the kernel is tested against."""
        k = self.shape[1]
        end = self.shape[0] if rows is None else row0 + rows
        n = end - row0
        if self.bits == 4:
            c = self.codes[row0:end].reshape(n, k // BLOCK, 16)
            codes = torch.cat([c & 15, c >> 4], dim=-1).float()          # [N, K/32, 32]
        else:
            codes = self.codes[row0:end].reshape(n, k // BLOCK, BLOCK).float()
        w = codes * self.scale[row0:end].unsqueeze(-1)
        if self.offset is not None:
            w = w + self.offset[row0:end].unsqueeze(-1)
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


# the GGUF matrix types kept in their own blocks (csrc/gblocks.c); the one list of what the kernels read
GGML_TYPES = ("F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def ggml_block(type_name: str) -> tuple[int, int]:
    """(weights per block, bytes per block) of a GGUF type."""
    return GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]


@dataclass(frozen=True)
class GGMLWeight:
    """W [N, K] in a GGUF file's own blocks: data uint8 [N, row bytes], usually a view of the mapped file."""
    type_name: str
    data: torch.Tensor
    shape: tuple[int, int]

    @property
    def type_id(self) -> int:
        return int(GGMLQuantizationType[self.type_name])

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self, row0: int = 0, rows: Optional[int] = None) -> torch.Tensor:
        """float32 [rows, K] of rows row0 ..: gguf-py's dequantiser, the reference the kernels are tested against."""
        from gguf.quants import dequantize
        rows = self.shape[0] - row0 if rows is None else rows
        raw = self.data[row0:row0 + rows].numpy()
        out = dequantize(raw, GGMLQuantizationType[self.type_name]).astype(np.float32, copy=False)
        return torch.from_numpy(np.ascontiguousarray(out).reshape(rows, self.shape[1]))


def ggml_weight(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> Optional[GGMLWeight]:
    """A GGUF tensor's bytes ([N, row bytes], not copied) as a GGMLWeight; None if K is not whole blocks."""
    n, k = shape
    block, size = ggml_block(type_name)
    if type_name not in GGML_TYPES or k % block:
        return None
    data = torch.from_numpy(raw.reshape(n, k // block * size))
    return GGMLWeight(type_name, data, shape)


@dataclass(frozen=True)
class RowParts:
    """W as quantised pieces stacked along N (a fused qkv or gate_up whose shards differ in type)."""
    parts: tuple[Union[PackedWeight, GGMLWeight], ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    def dequantize(self, row0: int = 0, rows: Optional[int] = None) -> torch.Tensor:
        return torch.cat([dequantize_rows(p) for p in self.parts])[row0:None if rows is None else row0 + rows]


QuantWeight = Union[PackedWeight, GGMLWeight, RowParts]


def dequantize_rows(w: QuantWeight, row0: int = 0, rows: Optional[int] = None) -> torch.Tensor:
    """float32 rows of any quantised weight, in plain torch / numpy (the reference path)."""
    return w.dequantize(row0, rows)


def select_rows(w: QuantWeight, ids: torch.Tensor) -> QuantWeight:
    """The rows ids of W as a weight of the same form (an embedding lookup's rows)."""
    if isinstance(w, PackedWeight):
        return PackedWeight(w.bits, w.codes[ids], w.scale[ids], None if w.offset is None else w.offset[ids],
                            (len(ids), w.shape[1]))
    if isinstance(w, GGMLWeight):
        return GGMLWeight(w.type_name, w.data[ids], (len(ids), w.shape[1]))
    raise ValueError("rows of a weight stacked from parts are not looked up (an embedding table is one matrix)")


def block_weights(w: Union[PackedWeight, GGMLWeight]) -> int:
    """Weights per block along K: a slice of W's columns must start and end on a multiple of it."""
    return BLOCK if isinstance(w, PackedWeight) else ggml_block(w.type_name)[0]


def take_rows(w: QuantWeight, ranges: list[tuple[int, int]]) -> QuantWeight:
    """The rows [start, stop) of each range, in order, as a weight of the same form: its blocks as they are (one
    range: views of them)."""
    def rows(t: torch.Tensor) -> torch.Tensor:
        return t[ranges[0][0]:ranges[0][1]] if len(ranges) == 1 else torch.cat([t[a:b] for a, b in ranges])
    n = sum(b - a for a, b in ranges)
    if isinstance(w, PackedWeight):
        return PackedWeight(w.bits, rows(w.codes), rows(w.scale), None if w.offset is None else rows(w.offset),
                            (n, w.shape[1]))
    if isinstance(w, GGMLWeight):
        return GGMLWeight(w.type_name, rows(w.data), (n, w.shape[1]))
    raise ValueError("rows of a weight stacked from parts are not taken (a checkpoint's matrix is one piece)")


def take_columns(w: QuantWeight, c0: int, c1: int) -> QuantWeight:
    """Columns [c0, c1) of W (both multiples of block_weights(w)) as a weight of the same form: whole blocks
    copied, none requantised."""
    if isinstance(w, PackedWeight):
        codes = w.codes[:, c0:c1] if w.bits == 8 else w.codes[:, c0 // 2:c1 // 2]    # a 4-bit block: 16 bytes
        b0, b1 = c0 // BLOCK, c1 // BLOCK
        return PackedWeight(w.bits, codes.contiguous(), w.scale[:, b0:b1].contiguous(),
                            None if w.offset is None else w.offset[:, b0:b1].contiguous(), (w.shape[0], c1 - c0))
    if isinstance(w, GGMLWeight):
        block, size = ggml_block(w.type_name)
        return GGMLWeight(w.type_name, w.data[:, c0 // block * size:c1 // block * size].contiguous(),
                          (w.shape[0], c1 - c0))
    raise ValueError("columns of a weight stacked from parts are not taken (a checkpoint's matrix is one piece)")


def quant_nbytes(w: QuantWeight) -> int:
    """Bytes a quantised weight holds (the tests' proof that no float copy exists)."""
    if isinstance(w, RowParts):
        return sum(quant_nbytes(p) for p in w.parts)
    if isinstance(w, GGMLWeight):
        return w.nbytes
    ts = [w.codes, w.scale, w.offset, *(w.lanes or ())]
    return sum(t.numel() * t.element_size() for t in ts if t is not None)
