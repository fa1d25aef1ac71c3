"""One layer's paged KV cache: K and V as [slots, kv_heads, head_dim] in the cache's dtype (kv_cache_dtype), and for
int8 a float32 scale per slot and kv head. Tokens are quantised as they are written; readers dequantise only the
rows they read (the C kernels a chunk at a time in L1, torch the rows it gathers), so no float copy of the cache
is ever made. The dtype is chosen once at load; every backend reads and writes through this one noun."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

# how tm_kv_cache.format names each storage (tokenmill.h's TM_KV_*)
_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
# int8: symmetric, scale = max |x| / 127 over a token's kv head
_INT8_MAX = 127


@dataclass(frozen=True)
class LayerKV:
    k: torch.Tensor                           # [slots, KV, D]
    v: torch.Tensor
    k_scale: Optional[torch.Tensor] = None    # [slots, KV] float32, for int8
    v_scale: Optional[torch.Tensor] = None

    @staticmethod
    def allocate(slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device = torch.device("cpu")) -> "LayerKV":
        """Untouched memory (torch.empty): attention reads only slots that a step wrote."""
        if dtype not in _FORMATS and device.type == "cpu":
            raise ValueError(f"a CPU KV cache stores float32, bfloat16 or int8, not {dtype}")
        shape = (slots, kv_heads, head_dim)
        k, v = torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device)
        if dtype != torch.int8:
            return LayerKV(k, v)
        scales = [torch.empty((slots, kv_heads), dtype=torch.float32, device=device) for _ in range(2)]
        return LayerKV(k, v, *scales)

    @staticmethod
    def bytes_per_slot(kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V of one token of one layer, scales included."""
        elem = torch.tensor([], dtype=dtype).element_size()
        scales = kv_heads * 4 if dtype == torch.int8 else 0
        return 2 * (kv_heads * head_dim * elem + scales)

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def format(self) -> int:
        """tm_kv_cache.format."""
        return _FORMATS[self.k.dtype]

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T, KV, D] into their slots, converted or quantised."""
        if not self.quantized:
            self.k[slots] = k.to(self.k.dtype)
            self.v[slots] = v.to(self.v.dtype)
            return
        for x, codes, scale in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
            q, s = quantize_int8(x)
            codes[slots] = q
            scale[slots] = s

    def read(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows at slots [...] as dtype: [..., KV, D] each (int8 dequantised in float32 first, as the kernels)."""
        if not self.quantized:
            return self.k[slots].to(dtype), self.v[slots].to(dtype)
        return (dequantize_int8(self.k[slots], self.k_scale[slots]).to(dtype),
                dequantize_int8(self.v[slots], self.v_scale[slots]).to(dtype))


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes int8 [..., D], scale float32 [...]): scale = max |x| * (1 / 127), codes = round(x *
    (1 / scale)), half to even; the float32 operations the C kernels' write does, so both store the same bytes."""
    x = x.float()
    scale = x.abs().amax(-1) * (1.0 / _INT8_MAX)
    inv = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
    return torch.round(x * inv[..., None]).to(torch.int8), scale


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale[..., None]
