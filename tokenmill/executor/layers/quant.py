"""Weights kept quantised: no float copy of a quantised matrix is ever made.

Two forms. PackedWeight: Q4_0, Q4_1 and Q8_0 repacked for the kernel library's tuned qmatmul (csrc/qmatmul.c),
and Q5_0 as Q8_0's int8 codes (exact: its codes minus 16 are integers in -16..15; the int8 kernels then take it,
for 34 bytes a block of 32 instead of 22). GGMLWeight: every other GGUF matrix type (F16, BF16, Q5_1, the
K-quants) in the file's own blocks, read
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
PACKABLE = ("Q4_0", "Q4_1", "Q5_0", "Q8_0")


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
    # act-order (a GPTQ desc_act checkpoint): stored column j is the input's column perm[j]; ops multiply
    # x[:, perm]. None: the input's order
    perm: Optional[torch.Tensor] = None

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
        w = w.reshape(n, k)
        return w if self.perm is None else torch.empty_like(w).index_copy_(1, self.perm, w)


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
    if type_name == "Q5_0":      # 32 high bits (bit j: code j's fifth), then code j's low nibble (j + 16's high)
        qh = payload[..., :4].copy().view("<u4")                               # [N, K/32, 1]
        qs = payload[..., 4:]
        low = np.concatenate([qs & 15, qs >> 4], axis=-1)                        # [N, K/32, 32]
        high = (qh >> np.arange(32, dtype=np.uint32)) & 1
        codes = (low.astype(np.int16) | (high.astype(np.int16) << 4)) - 16
        return PackedWeight(8, torch.from_numpy(codes.astype(np.int8).reshape(n, k)), torch.from_numpy(d), None,
                            shape)
    codes = torch.from_numpy(payload.copy().reshape(n, k // 2))
    if type_name == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:                                                     # Q4_0: d * (code - 8)
        m = -8.0 * d
    return PackedWeight(4, codes, torch.from_numpy(d), torch.from_numpy(np.ascontiguousarray(m)), shape)


def _same_perm(parts: list) -> bool:
    first = parts[0].perm
    return all((p.perm is None) == (first is None) and (first is None or torch.equal(p.perm, first)) for p in parts)


def concat_rows(parts: list) -> Optional[PackedWeight]:
    """Stack along N (fused qkv / gate_up); None unless all parts are PackedWeights of one block format, K and
    column order."""
    first = parts[0]
    if any(not isinstance(p, PackedWeight) for p in parts) or any(
            p.bits != first.bits or p.shape[1] != first.shape[1] or (p.offset is None) != (first.offset is None)
            for p in parts) or not _same_perm(parts):
        return None
    offset = None if first.offset is None else torch.cat([p.offset for p in parts])
    return PackedWeight(first.bits, torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                        offset, (sum(p.shape[0] for p in parts), first.shape[1]), perm=first.perm)


def permute_rows(p: PackedWeight, fn) -> PackedWeight:
    """Apply a row permutation `fn` (a function of a [N, ...] tensor) to every per-row array."""
    return PackedWeight(p.bits, fn(p.codes).contiguous(), fn(p.scale).contiguous(),
                        None if p.offset is None else fn(p.offset).contiguous(), p.shape)


# the GGUF matrix types kept in their own blocks (csrc/gblocks.c); the one list of what the kernels read
GGML_TYPES = ("F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
              "MXFP4")


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


@dataclass(frozen=True)
class GroupWeight:
    """W [N, K] as unsigned b-bit integer codes in groups of `group` columns, as GPTQ, AWQ and compressed-tensors
    store it: W[n, perm[j]] = scale[n, j // group] * (code[n, j] - zero[n, j // group]). Integer zero points keep
    every one of those formats exact. The GPU's kernels read it as it is; the CPU plan repacks it into blocks."""
    bits: int                           # 4 or 8
    codes: torch.Tensor                 # uint8; 4 bits: [N, K/2], column 2i in the low nibble, 2i+1 in the high
    scale: torch.Tensor                 # [N, K/group], the checkpoint's float dtype
    zero: Optional[torch.Tensor]        # uint8 [N, K/group]; None: symmetric, the midpoint 2^(bits-1)
    group: int                          # columns per group; K for one scale per row
    shape: tuple[int, int]              # (N, K)
    # act-order (GPTQ desc_act): stored column j is the input's column perm[j], so x[:, perm] meets contiguous
    # groups; None: the input's order
    perm: Optional[torch.Tensor] = None

    def unpacked(self, row0: int = 0, end: Optional[int] = None) -> torch.Tensor:
        """The codes of rows row0 .. end as uint8 [rows, K], in stored column order."""
        c = self.codes[row0:end]
        if self.bits == 8:
            return c
        return torch.stack([c & 15, c >> 4], dim=-1).reshape(c.shape[0], -1)

    def dequantize(self, row0: int = 0, rows: Optional[int] = None) -> torch.Tensor:
        """float32 [rows, K] in the input's column order: the reference the kernels are tested against."""
        end = self.shape[0] if rows is None else row0 + rows
        codes = self.unpacked(row0, end).float()
        n, k = codes.shape
        zero = self.zero[row0:end].float() if self.zero is not None else float(1 << (self.bits - 1))
        scale = self.scale[row0:end].float()
        g = codes.view(n, k // self.group, self.group)
        w = ((g - (zero.unsqueeze(-1) if self.zero is not None else zero)) * scale.unsqueeze(-1)).reshape(n, k)
        if self.perm is None:
            return w
        return torch.empty_like(w).index_copy_(1, self.perm.to(w.device), w)

    def to(self, device: torch.device) -> "GroupWeight":
        mv = (lambda t: None if t is None else t.to(device))
        return GroupWeight(self.bits, mv(self.codes), mv(self.scale), mv(self.zero), self.group, self.shape,
                           mv(self.perm))


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [N, K] in GroupWeight's packing (4 bits: two a byte, the even column low)."""
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes.contiguous()
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def concat_groups(parts: list) -> Optional[GroupWeight]:
    """Stack along N (fused qkv / gate_up); None unless the parts share bits, group, K, zero form and order."""
    first = parts[0]
    if any(not isinstance(p, GroupWeight) for p in parts) or any(
            p.bits != first.bits or p.group != first.group or p.shape[1] != first.shape[1]
            or (p.zero is None) != (first.zero is None) or p.scale.dtype != first.scale.dtype
            for p in parts) or not _same_perm(parts):
        return None
    zero = None if first.zero is None else torch.cat([p.zero for p in parts])
    return GroupWeight(first.bits, torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]), zero,
                       first.group, (sum(p.shape[0] for p in parts), first.shape[1]), first.perm)


def group_to_blocks(w: GroupWeight) -> Optional[PackedWeight]:
    """A GroupWeight in the CPU kernels' blocks of 32, no float copy: each group's scale repeated over its blocks,
    offset = -scale * zero; 8-bit symmetric codes are Q8_0's int8 codes. None where the blocks cannot hold it
    (8 bits with zero points, groups not whole blocks). The act-order permutation stays with the weight."""
    n, k = w.shape
    if w.group % BLOCK or k % BLOCK:
        return None
    reps = w.group // BLOCK
    scale = w.scale.float().repeat_interleave(reps, dim=1).contiguous()
    codes = w.unpacked()
    mid = 1 << (w.bits - 1)
    if w.bits == 8 and w.zero is None:
        return PackedWeight(8, (codes.to(torch.int16) - mid).to(torch.int8).contiguous(), scale, None, w.shape,
                            perm=w.perm)
    if w.bits == 8:      # the 8-bit kernels take no offset: the caller keeps the GroupWeight
        return None
    zero = (w.zero.float() if w.zero is not None else torch.full_like(w.scale, mid, dtype=torch.float32))
    offset = (-scale * zero.repeat_interleave(reps, dim=1)).contiguous()
    c = codes.view(n, k // BLOCK, 2, 16)          # the block's weight j low, j + 16 high (ggml's nibble order)
    packed = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    return PackedWeight(4, packed, scale, offset, w.shape, perm=w.perm)


def blocks_to_group(p: PackedWeight) -> Optional[GroupWeight]:
    """Q8_0 and Q4_0 blocks (a GGUF's, or int8 at load on the CPU) as a GroupWeight of group 32, exactly: Q8_0's
    int8 codes shifted to unsigned about 128, Q4_0's d * (q - 8) symmetric. None for offsets of any other kind."""
    n, k = p.shape
    if p.bits == 8 and p.offset is None:
        codes = (p.codes.to(torch.int16) + 128).to(torch.uint8)
        return GroupWeight(8, codes.contiguous(), p.scale, None, BLOCK, p.shape, p.perm)
    if p.bits == 4 and p.offset is not None and torch.equal(p.offset, -8.0 * p.scale):
        c = p.codes.view(n, k // BLOCK, 16)
        codes = torch.cat([c & 15, c >> 4], dim=-1).reshape(n, k)       # ggml's order: weight j low, j + 16 high
        return GroupWeight(4, pack_codes(codes, 4), p.scale, None, BLOCK, p.shape, p.perm)
    return None


FP8_MAX = 448.0          # float8_e4m3fn's largest finite value


@dataclass(frozen=True)
class Fp8Weight:
    """W [N, K] as float8 e4m3 values times a float32 scale per row (or one for the matrix): compressed-tensors'
    and vLLM's FP8 checkpoints, or a float matrix quantised at load."""
    codes: torch.Tensor                 # float8_e4m3fn [N, K]
    scale: torch.Tensor                 # float32 [N] or [1]
    shape: tuple[int, int]

    def dequantize(self, row0: int = 0, rows: Optional[int] = None) -> torch.Tensor:
        end = self.shape[0] if rows is None else row0 + rows
        s = self.scale if self.scale.numel() == 1 else self.scale[row0:end]
        return self.codes[row0:end].float() * s.float().reshape(-1, 1)

    def to(self, device: torch.device) -> "Fp8Weight":
        return Fp8Weight(self.codes.to(device), self.scale.to(device), self.shape)


def concat_fp8(parts: list) -> Optional[Fp8Weight]:
    """Stack FP8 shards along N, each row keeping its own scale (a matrix's one scale repeated over its rows)."""
    if any(not isinstance(p, Fp8Weight) or p.shape[1] != parts[0].shape[1] for p in parts):
        return None
    scales = [p.scale.float().expand(p.shape[0]) for p in parts]
    return Fp8Weight(torch.cat([p.codes for p in parts]), torch.cat(scales).contiguous(),
                     (sum(p.shape[0] for p in parts), parts[0].shape[1]))


QuantWeight = Union[PackedWeight, GGMLWeight, RowParts, GroupWeight, Fp8Weight]


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
    if isinstance(w, GroupWeight):        # a GGUF's Q8_0 / Q4_0 table on a GPU
        return GroupWeight(w.bits, w.codes[ids], w.scale[ids], None if w.zero is None else w.zero[ids], w.group,
                           (len(ids), w.shape[1]), w.perm)
    if isinstance(w, Fp8Weight):
        return Fp8Weight(w.codes[ids], w.scale if w.scale.numel() == 1 else w.scale[ids], (len(ids), w.shape[1]))
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
    ts = [w.codes, w.scale, getattr(w, "offset", None), getattr(w, "zero", None), *(getattr(w, "lanes", None) or ())]
    return sum(t.numel() * t.element_size() for t in ts if t is not None)
