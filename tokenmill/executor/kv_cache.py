"""One layer's paged KV cache: K and V as [slots, kv_heads, head_dim] in the cache's dtype (kv_cache_dtype): float32 or
bfloat16; int8 codes with a float32 scale per 32 values of a slot's kv head (per head where head_dim is not a
multiple of 32); int4 codes in groups of 32 along head_dim, two to a byte, with a half scale and min per group
(llama.cpp's q4_1 in the cache); or fp8 codes (e4m3 or e5m2) with a float32 scale per kv head for the whole layer,
as vLLM's fp8 cache (1.0 unless set). Tokens are quantised as they are written; readers dequantise only the rows
they read (the AVX-512 kernels 16 values at a time in registers, the portable ones a chunk at a time in L1, torch
the rows it gathers), so no float copy of the cache is ever made. The dtype is chosen once at load; every backend
reads and writes through this one noun."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

# the cache dtypes and how tm_kv_cache.format names them (tokenmill.h's TM_KV_*)
FORMATS = {"float32": 0, "bfloat16": 1, "int8": 2, "int4": 3, "fp8_e4m3": 4, "fp8_e5m2": 5}
# the torch dtype of each one's codes: int4's are packed two to a uint8
_CODES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8, "int4": torch.uint8,
          "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_NAMES = {t: name for name, t in _CODES.items() if name != "int4"}
_INT8_MAX = 127     # int8: symmetric, scale = max |x| / 127 over a group of a token's kv head
INT8_GROUP = 32     # int8: the values a scale covers (tokenmill.h's TM_KV_INT8_GROUP), or the whole head
INT4_GROUP = 32     # int4: head_dim a multiple of this (tokenmill.h's TM_KV_INT4_GROUP)
FP8 = ("fp8_e4m3", "fp8_e5m2")
_FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}    # the largest finite code: writes clamp to it
# calculate_kv_scales maps the calibration chunk's largest |K| and |V| to these codes (vLLM's K_SCALE_CONSTANT and
# V_SCALE_CONSTANT), leaving headroom below the format's largest for later tokens
FP8_K_RANGE, FP8_V_RANGE = 200.0, 100.0


@dataclass(frozen=True)
class LayerKV:
    k: torch.Tensor                           # [slots, KV, D]
    v: torch.Tensor
    k_scale: Optional[torch.Tensor] = None    # int8 [slots, KV, D / group] float32; int4 [slots, KV, D / 32, 2] half;
    # fp8 [KV]
    v_scale: Optional[torch.Tensor] = None

    @staticmethod
    def allocate(slots: int, kv_heads: int, head_dim: int, dtype: str,
                 device: torch.device = torch.device("cpu"), value_dim: Optional[int] = None) -> "LayerKV":
        """dtype: a name in FORMATS, or any torch dtype's name off CPU. Untouched memory (torch.empty): attention
        reads only slots that a step wrote. value_dim: V is the first value_dim dims of K, stored once (latent
        attention: the latent is both), in a float cache."""
        check_kv_dtype(dtype, head_dim)
        if value_dim is not None:
            if dtype not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"kv_cache_dtype={dtype!r}: latent attention's cache is float (auto, bfloat16 or "
                                 f"float32); its latent is already a compressed K/V")
            k = torch.empty(slots, kv_heads, head_dim, dtype=getattr(torch, dtype), device=device)
            return LayerKV(k, k[..., :value_dim])
        codes, scales = _shapes(slots, kv_heads, head_dim, dtype)
        k, v = (torch.empty(codes, dtype=_CODES.get(dtype) or getattr(torch, dtype), device=device) for _ in "kv")
        if dtype in FP8:      # vLLM's default scale where a checkpoint brings none
            return LayerKV(k, v, *(torch.ones(kv_heads, dtype=torch.float32, device=device) for _ in "kv"))
        if scales is None:
            return LayerKV(k, v)
        scale_dtype = torch.float32 if dtype == "int8" else torch.float16
        return LayerKV(k, v, *(torch.empty(scales, dtype=scale_dtype, device=device) for _ in "kv"))

    @staticmethod
    def bytes_per_slot(kv_heads: int, head_dim: int, dtype: str, value_dim: Optional[int] = None) -> int:
        """K and V of one token of one layer, its scales included (fp8's are the layer's, not a token's); with
        value_dim (V inside K), K's alone."""
        codes, scales = _shapes(1, kv_heads, head_dim, dtype)
        n = math.prod(codes) * (_CODES.get(dtype) or getattr(torch, dtype)).itemsize
        if scales is not None:
            n += math.prod(scales) * (4 if dtype == "int8" else 2)
        return n if value_dim is not None else 2 * n

    @property
    def dtype(self) -> str:
        """The cache dtype's name (FORMATS)."""
        if self.k.dtype == torch.uint8:
            return "int4"
        return _NAMES.get(self.k.dtype) or str(self.k.dtype).removeprefix("torch.")

    @property
    def head_dim(self) -> int:
        return self.k.shape[2] * (2 if self.dtype == "int4" else 1)

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def format(self) -> int:
        """tm_kv_cache.format."""
        return FORMATS[self.dtype]

    @property
    def value_in_key(self) -> bool:
        """V is a view of K's first dims (latent attention), stored once."""
        return self.v.data_ptr() == self.k.data_ptr()

    def planes(self) -> tuple[torch.Tensor, ...]:
        """K and V's codes, each stored tensor once."""
        return (self.k,) if self.value_in_key else (self.k, self.v)

    def slot_tensors(self) -> list[torch.Tensor]:
        """The tensors indexed by slot (codes, and int8's and int4's per-token scales; not fp8's per-layer ones)."""
        scales = [] if self.dtype in FP8 else [t for t in (self.k_scale, self.v_scale) if t is not None]
        return [*self.planes(), *scales]

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (*self.planes(), self.k_scale, self.v_scale) if t is not None]

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T, KV, D] into their slots, converted or quantised."""
        if not self.quantized:
            self.k[slots] = k.to(self.k.dtype)
            if not self.value_in_key:     # else V is K's first dims, just written
                self.v[slots] = v.to(self.v.dtype)
            return
        if self.dtype in FP8:
            self.k[slots] = quantize_fp8(k, self.k_scale, self.k.dtype)
            self.v[slots] = quantize_fp8(v, self.v_scale, self.v.dtype)
            return
        quantize = quantize_int8 if self.dtype == "int8" else quantize_int4
        for x, codes, scale in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
            q, s = quantize(x)
            codes[slots] = q
            scale[slots] = s

    def calibrate(self, slots: torch.Tensor) -> None:
        """An fp8 cache's scales from what these slots hold (written at the scales so far): per kv head, the largest
        |K| over FP8_K_RANGE and the largest |V| over FP8_V_RANGE; in place, so every kernel's pointer to them
        stays valid. What those slots hold stays at the old scales: only a pass that nothing reads may write them."""
        k, v = self.read(slots, torch.float32)
        for x, scale, rng in ((k, self.k_scale, FP8_K_RANGE), (v, self.v_scale, FP8_V_RANGE)):
            amax = x.abs().amax(dim=(0, 2))
            scale.copy_(torch.where(amax > 0, amax / rng, torch.ones_like(amax)))

    def read(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows at slots [...] as dtype: [..., KV, D] each (quantised rows dequantised in float32 first, as the
        kernels do)."""
        if not self.quantized:
            return self.k[slots].to(dtype), self.v[slots].to(dtype)
        if self.dtype in FP8:
            return (dequantize_fp8(self.k[slots], self.k_scale).to(dtype),
                    dequantize_fp8(self.v[slots], self.v_scale).to(dtype))
        dequantize = dequantize_int8 if self.dtype == "int8" else dequantize_int4
        return (dequantize(self.k[slots], self.k_scale[slots]).to(dtype),
                dequantize(self.v[slots], self.v_scale[slots]).to(dtype))


def check_kv_dtype(dtype: str, head_dim: int) -> None:
    if dtype == "int4" and head_dim % INT4_GROUP:
        raise ValueError(f"kv_cache_dtype='int4' quantises groups of {INT4_GROUP} along head_dim, and this model's "
                         f"head_dim is {head_dim}; use kv_cache_dtype='int8' or 'bfloat16'")


def _shapes(slots: int, kv_heads: int, head_dim: int, dtype: str) -> tuple[tuple, Optional[tuple]]:
    """The codes' shape and the per-slot scales' (None for a float or fp8 cache)."""
    if dtype == "int8":
        return (slots, kv_heads, head_dim), (slots, kv_heads, head_dim // int8_group(head_dim))
    if dtype in FP8:
        return (slots, kv_heads, head_dim), None
    if dtype == "int4":
        return (slots, kv_heads, head_dim // 2), (slots, kv_heads, head_dim // INT4_GROUP, 2)
    return (slots, kv_heads, head_dim), None


def int8_group(head_dim: int) -> int:
    """The values one int8 scale covers: INT8_GROUP, or the whole head where head_dim is not a multiple of it."""
    return head_dim if head_dim % INT8_GROUP else INT8_GROUP


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes int8 [..., D], scale float32 [..., D / group]): per group, scale = max |x| * (1 / 127),
    codes = round(x * (1 / scale)), half to even; the float32 operations the C kernels' write does, so both store
    the same bytes."""
    x = x.float()
    groups = x.unflatten(-1, (-1, int8_group(x.shape[-1])))
    scale = groups.abs().amax(-1) * (1.0 / _INT8_MAX)
    inv = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
    return torch.round(groups * inv[..., None]).to(torch.int8).flatten(-2), scale


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (codes.float().unflatten(-1, (scale.shape[-1], -1)) * scale[..., None]).flatten(-2)


def quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes uint8 [..., D / 2], (d, m) float16 [..., D / 32, 2]), per group of 32: m = min, d =
    (max - min) * (1 / 15), both rounded to half, codes = round((x - m) * (1 / d)) in 0..15 from the rounded
    values; a group's byte j holds code j (low nibble) and code j + 16. The C kernels' write, operation for
    operation."""
    g = x.float().unflatten(-1, (-1, INT4_GROUP))                   # [..., G, 32]
    lo, hi = g.amin(-1), g.amax(-1)
    d16, m16 = ((hi - lo) * (1.0 / 15)).half(), lo.half()
    d, m = d16.float(), m16.float()
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    c = torch.round((g - m[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
    packed = c[..., :16] | (c[..., 16:] << 4)
    return packed.flatten(-2), torch.stack([d16, m16], -1)


def dequantize_int4(codes: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    q = codes.unflatten(-1, (-1, INT4_GROUP // 2))                  # [..., G, 16]
    c = torch.cat([q & 15, q >> 4], -1).float()                     # [..., G, 32]
    d, m = dm[..., 0].float(), dm[..., 1].float()
    return (c * d[..., None] + m[..., None]).flatten(-2)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., KV, D] -> fp8 codes of dtype (torch.float8_e4m3fn or float8_e5m2) with scale [KV]: x * (1 / scale)
    clamped to the largest finite code, to nearest even; the C kernels' write, operation for operation."""
    hi = _FP8_MAX[_NAMES[dtype]]
    return (x.float() * (1.0 / scale)[:, None]).clamp(-hi, hi).to(dtype)


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale[:, None]
