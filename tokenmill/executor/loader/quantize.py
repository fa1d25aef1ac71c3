"""Group-wise weight-only quantisation into llama.cpp's block formats, in torch.

Each function turns float rows into the very bytes gguf-py's `gguf.quants.quantize` writes (and so the
bytes our kernels and llama.cpp read): the same float32 operations in the same order, so the results are
bit-for-bit equal (tests/test_quantize.py checks). They run vectorised over cache-sized row chunks: a
4096 x 14336 matrix takes 0.2-0.4 s on one Xeon core (0.05-0.2 s on 16), 2-3x less than gguf-py.

Block layouts (32 weights a block, little-endian):
  Q8_0  fp16 d, int8 q[32]                        w = d * q
  Q4_0  fp16 d, nibbles q[32]                     w = d * (q - 8)
  Q4_1  fp16 d, fp16 m, nibbles q[32]             w = d * q + m
  Q5_0  fp16 d, u32 high bits, nibbles q[32]      w = d * (q - 16)
  Q5_1  fp16 d, fp16 m, u32 high bits, nibbles    w = d * q + m
Nibbles: byte j holds weight j in its low half and weight j + 16 in its high half.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

BLOCK = 32
# our load-time option names (vLLM's spelling) -> block type; int4 is Q4_1 because tokenmill's fastest
# 4-bit kernel reads Q4_1
QUANTIZATION = {"int8": "Q8_0", "int4": "Q4_1"}

BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
FLOAT_TYPES = ("F32", "F16", "BF16")
# bytes per 32-weight block
TYPE_SIZE = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24}
_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# rows are quantised in chunks of about this many weights: small enough for the temporaries to stay in
# cache, big enough that per-op overhead does not show
_CHUNK_WEIGHTS = 1 << 20


def supported_types() -> tuple[str, ...]:
    """The GGML types `quantize` makes (block types need a row length that is a multiple of 32)."""
    return BLOCK_TYPES + FLOAT_TYPES


def can_quantize(type_name: str, row_length: int | None = None) -> bool:
    """Whether `quantize` makes type_name, for rows of row_length weights when given."""
    name = type_name.upper()
    if name in FLOAT_TYPES:
        return True
    return name in BLOCK_TYPES and (row_length is None or row_length % BLOCK == 0)


def row_bytes(type_name: str, row_length: int) -> int:
    """Bytes one row of row_length weights takes in type_name."""
    name = type_name.upper()
    if name in FLOAT_TYPES:
        return row_length * _FLOAT_DTYPES[name].itemsize
    return row_length // BLOCK * TYPE_SIZE[name]


def quantize(w: torch.Tensor, type_name: str) -> np.ndarray:
    """W [..., K] -> uint8 [..., row bytes], equal to gguf.quants.quantize(W, GGMLQuantizationType[type_name])
    viewed as bytes. type_name: one of supported_types()."""
    return quantize_torch(w, type_name).numpy()


def quantize_torch(w: torch.Tensor, type_name: str) -> torch.Tensor:
    """`quantize`, as a uint8 torch tensor [..., row bytes] (on the CPU)."""
    name = type_name.upper()
    if not can_quantize(name):
        raise ValueError(f"cannot quantise to {type_name!r}; supported: {', '.join(supported_types())}")
    if w.dim() == 0:
        raise ValueError("cannot quantise a scalar")
    k = w.shape[-1]
    if not can_quantize(name, k):
        raise ValueError(f"{name} needs a row length that is a multiple of {BLOCK}, got {k}")
    w = w.detach().cpu()
    if name in FLOAT_TYPES:
        return _float_bytes(w, name)
    rows = w.reshape(-1, k)
    out = torch.empty(rows.shape[0], row_bytes(name, k), dtype=torch.uint8)
    step = max(1, _CHUNK_WEIGHTS // k)
    for r in range(0, rows.shape[0], step):
        chunk = rows[r:r + step].to(torch.float32).reshape(-1, BLOCK)   # gguf-py also goes via float32
        out[r:r + step] = _QUANTISERS[name](chunk).reshape(-1, out.shape[1])
    return out.reshape(*w.shape[:-1], out.shape[1])


def _float_bytes(w: torch.Tensor, name: str) -> torch.Tensor:
    # gguf-py: F32/F16 cast the input directly; BF16 goes via float32, rounding to nearest even like torch
    src = w.to(torch.float32) if name == "BF16" else w
    t = src.to(_FLOAT_DTYPES[name]).contiguous()
    return t.view(torch.uint8).reshape(*w.shape[:-1], -1)


# ------------------------------------------------------------------------------------- per block type
# Each takes float32 blocks [n, 32] and returns uint8 [n, block bytes]. The arithmetic mirrors gguf-py's
# numpy line by line: float32 throughout, the scale's reciprocal taken in float32 (0 for an all-zero block),
# the codes from those unrounded scales, and only then the scales rounded to fp16 for storage.

def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / d)


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 [n, 1] -> its fp16 (round to nearest even, like numpy) as uint8 [n, 2]."""
    return x.to(torch.float16).view(torch.uint8)


def _signed_max(blocks: torch.Tensor) -> torch.Tensor:
    """Each block's value of largest magnitude, sign kept; where +a and -a tie (an all-zero block too),
    the first, as numpy's argmax picks. Two reductions are several times cheaper than argmax + gather."""
    hi, lo = blocks.amax(dim=-1, keepdim=True), blocks.amin(dim=-1, keepdim=True)
    out = torch.where(-lo > hi, lo, hi)
    tie = (-lo == hi).squeeze(-1)
    if tie.any():
        rows = blocks[tie]
        out[tie] = rows.gather(-1, rows.abs().argmax(dim=-1, keepdim=True))
    return out


def _codes(x: torch.Tensor, top: int) -> torch.Tensor:
    """numpy's np.trunc(x).astype(np.uint8).clip(0, top), for 0 <= x < 128 (always so here): the cast
    truncates (via int8: torch's float -> uint8 cast is not vectorised)."""
    return x.to(torch.int8).view(torch.uint8).clamp_(max=top)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """codes [n, 32] -> [n, 16]: weight j in the low half, weight j + 16 in the high half (uint8 shifts drop
    a fifth bit)."""
    return (q[:, :16] & 15) | (q[:, 16:] << 4)


def _high_bits(q: torch.Tensor) -> torch.Tensor:
    """5-bit codes [n, 32] -> their fifth bits as a little-endian u32, uint8 [n, 4] (bit j: weight j).
    Seen as int64, each 8 bits sit one per byte (bit 8i); shifting by 7i and or-ing gathers them into the
    low byte, with integer ops on a quarter of the elements (a sum over 8-wide rows is slow)."""
    x = (q >> 4).contiguous().view(torch.int64)        # [n, 4]; q < 32, so each byte is 0 or 1
    packed = x.clone()
    for i in range(1, 8):
        packed |= x >> (7 * i)
    return (packed & 0xFF).to(torch.uint8)


# the float32 just below 0.5: trunc(x + copysign(_HALF_BELOW, x)) rounds half away from zero for every
# float32 (checked exhaustively for |x| < 256), where adding 0.5 would round 0.49999997 up to 1
_HALF_BELOW_BITS = int(np.nextafter(np.float32(0.5), np.float32(0)).view(np.int32))
_SIGN_BIT = -(1 << 31)


def _round_half_away_int8(x: torch.Tensor) -> torch.Tensor:
    """gguf-py's np_roundf(x).astype(np.int8), for |x| < 128 (torch.round ties to even). The copysign is
    done on the bits, two integer ops as cheap as an add."""
    half = (x.view(torch.int32) & _SIGN_BIT) | _HALF_BELOW_BITS
    return (x + half.view(torch.float32)).to(torch.int8)   # the cast truncates toward zero


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    q = _round_half_away_int8(blocks * _inverse(d)).view(torch.uint8)
    return torch.cat([_fp16_bytes(d), q], dim=-1)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _signed_max(blocks) / -8
    q = _codes(blocks * _inverse(d) + 8.5, 15)
    return torch.cat([_fp16_bytes(d), _nibbles(q)], dim=-1)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    lo = blocks.amin(dim=-1, keepdim=True)
    d = (blocks.amax(dim=-1, keepdim=True) - lo) / 15
    q = _codes((blocks - lo) * _inverse(d) + 0.5, 15)
    return torch.cat([_fp16_bytes(d), _fp16_bytes(lo), _nibbles(q)], dim=-1)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _signed_max(blocks) / -16
    q = _codes(blocks * _inverse(d) + 16.5, 31)
    return torch.cat([_fp16_bytes(d), _high_bits(q), _nibbles(q)], dim=-1)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    lo = blocks.amin(dim=-1, keepdim=True)
    d = (blocks.amax(dim=-1, keepdim=True) - lo) / 31
    q = _codes((blocks - lo) * _inverse(d) + 0.5, 31)
    return torch.cat([_fp16_bytes(d), _fp16_bytes(lo), _high_bits(q), _nibbles(q)], dim=-1)


_QUANTISERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
}


# ------------------------------------------------------------------------------------- the GPU's forms

def quantize_groups(w: torch.Tensor, bits: int, group: int, symmetric: bool) -> "GroupWeight":
    """Round-to-nearest group-wise integer codes (vLLM's RTN): symmetric, scale = max|w| / (2^(bits-1) - 1) about
    the midpoint; else min-max with an integer zero point. The GPU kernels' form; computed on w's device."""
    from tokenmill.executor.layers.quant import GroupWeight, pack_codes
    n, k = w.shape
    if k % group:
        raise ValueError(f"a row of {k} weights is not whole groups of {group}")
    g = w.detach().float().reshape(n, k // group, group)
    top = (1 << bits) - 1
    mid = 1 << (bits - 1)
    if symmetric:
        scale = g.abs().amax(dim=-1) / (mid - 1)
        inv = torch.where(scale == 0, torch.zeros_like(scale), 1.0 / scale)
        codes = (torch.round(g * inv.unsqueeze(-1)) + mid).clamp_(0, top)
        zero = None
    else:
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        scale = (hi - lo) / top
        inv = torch.where(scale == 0, torch.zeros_like(scale), 1.0 / scale)
        zero = torch.round(-lo * inv).clamp_(0, top)
        codes = (torch.round(g * inv.unsqueeze(-1)) + zero.unsqueeze(-1)).clamp_(0, top)
        zero = zero.to(torch.uint8)
    codes = codes.to(torch.uint8).reshape(n, k)
    return GroupWeight(bits, pack_codes(codes, bits), scale.to(w.dtype if w.is_floating_point() else torch.float32),
                       zero, group, (n, k))


def quantize_fp8(w: torch.Tensor) -> "Fp8Weight":
    """e4m3 values with one float32 scale per row (vLLM's fp8 with per-channel weight scales)."""
    from tokenmill.executor.layers.quant import FP8_MAX, Fp8Weight
    wf = w.detach().float()
    scale = wf.abs().amax(dim=1).clamp_(min=1e-12) / FP8_MAX
    codes = (wf / scale.unsqueeze(1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Fp8Weight(codes.contiguous(), scale.contiguous(), tuple(w.shape))
