"""The CPU kernels' attention backend (csrc/attention.c through the kernel library): reads K/V in place from the
paged cache, decoding requests in one call and prompt chunks (fresh, prefix-cache hits, later chunks of a
chunked prefill) in another.

Cascade attention: when every decoding request's table starts with the same blocks (a prefix cache hit on a
shared system prompt), those positions are attended once for the whole batch and merged with each request's
own part, instead of once per request."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Optional

import torch

from tokenmill.executor.attention.backend import (AttentionBackend, AttentionMetadata, _window_start, extend,
                                                  flat_tables)
from tokenmill.executor.kernels import KernelLibrary
from tokenmill.executor.kv_cache import FORMATS, LayerKV

_Q_DTYPES = {torch.float32: 0, torch.bfloat16: 1}     # q_bf16
# each cache dtype's tm_kv_cache.format constant (tokenmill.h)
_KV_FORMATS = {"float32": "TM_KV_F32", "bfloat16": "TM_KV_BF16", "int8": "TM_KV_INT8", "int4": "TM_KV_INT4",
               "fp8_e4m3": "TM_KV_FP8_E4M3", "fp8_e5m2": "TM_KV_FP8_E5M2"}


def kernel_fits(kernels: KernelLibrary, num_heads: int, num_kv_heads: int, head_dim: int,
                value_dim: Optional[int] = None) -> Optional[str]:
    """None when the attention kernels take these shapes (tokenmill.h's TM_ATTN_ limits) and this attention, else
    why not. They take a soft cap and each KV group's own window (Gemma), sinks (gpt-oss), and values as wide as
    keys."""
    if value_dim is not None:
        return "values narrower than keys (latent attention)"
    lim = kernels.limits
    if num_heads % num_kv_heads or num_heads // num_kv_heads > lim["TM_ATTN_MAX_GROUP"]:
        return f"{num_heads // num_kv_heads} query heads per kv head (at most {lim['TM_ATTN_MAX_GROUP']})"
    if num_heads > lim["TM_ATTN_MAX_HEADS"]:
        return f"{num_heads} query heads (at most {lim['TM_ATTN_MAX_HEADS']})"
    if head_dim % lim["TM_ATTN_HEAD_DIM_MULTIPLE"] or head_dim > lim["TM_ATTN_MAX_HEAD_DIM"]:
        return (f"head_dim {head_dim} (a multiple of {lim['TM_ATTN_HEAD_DIM_MULTIPLE']} up to "
                f"{lim['TM_ATTN_MAX_HEAD_DIM']})")
    return None


def _int32_tables(tables: list[list[int]]) -> torch.Tensor:
    """[R, max blocks] int32 block tables for the kernels."""
    values, width = flat_tables(tables)
    return torch.tensor(values, dtype=torch.int32).view(len(tables), width)


@dataclass
class CpuAttentionMetadata(AttentionMetadata):
    decode_rows: Optional[torch.Tensor] = None    # [Bd] row of each decoding request's token (mixed steps)
    all_decode: bool = False                      # every request has one query token (rows are 0..B-1)
    decode_step: Optional[ctypes.Structure] = None   # tm_decode_step of the decoding requests
    prefill: Optional[dict] = None                # tm_paged_prefill_args' per-step fields
    kv: list = field(default_factory=list)        # the layers' tm_kv_cache structs
    # what the structs point into, kept alive for the step
    keep: list = field(default_factory=list)


class CpuKernelBackend(AttentionBackend):
    name = "cpu"
    min_shared_len = 64      # shorter common prefixes are not worth a separate pass
    min_shared_batch = 4

    def __init__(self, kernels: KernelLibrary):
        super().__init__()
        self.kernels = kernels
        self.kv: list[ctypes.Structure] = []

    def kv_cache_dtype_error(self, dtype: str, device: torch.device) -> Optional[str]:
        const = _KV_FORMATS.get(dtype)
        if const is None or self.kernels.limits.get(const) != FORMATS[dtype]:
            served = [d for d, c in _KV_FORMATS.items() if self.kernels.limits.get(c) == FORMATS[d]]
            return f"the CPU kernels ({self.kernels.isa}) store K/V only as {', '.join(served)}"
        return None

    def bind_kv_cache(self, caches: list[LayerKV]) -> None:
        super().bind_kv_cache(caches)
        self.kv = []
        for c in caches:
            if not all(t.is_contiguous() and t.device.type == "cpu" for t in c.tensors()):
                raise ValueError("the CPU attention kernels take a contiguous KV cache in CPU memory")
            self.kv.append(self.kernels.struct("kv_cache", k=c.k, v=c.v, k_scale=c.k_scale, v_scale=c.v_scale,
                                               num_slots=c.k.shape[0], kv_heads=c.k.shape[1],
                                               head_dim=c.head_dim, format=c.format))

    def prepare(self, meta: AttentionMetadata) -> CpuAttentionMetadata:
        decode, prefill = meta.split()
        out = extend(meta, CpuAttentionMetadata, all_decode=not prefill, kv=self.kv)
        threads = torch.get_num_threads()
        if decode:
            tables = _int32_tables([meta.block_tables[i] for i in decode])
            starts = torch.tensor([_window_start(meta, i, meta.sliding_window) for i in decode], dtype=torch.int32)
            lens = torch.tensor([meta.seq_lens[i] for i in decode], dtype=torch.int32)
            slots = meta.slot_mapping if out.all_decode and meta.slot_mapping.dtype == torch.int64 else None
            if prefill:           # a mixed step gathers and scatters the decoding rows; a pure one needs none
                out.decode_rows = torch.tensor([meta.query_start_loc[i] for i in decode])
            out.decode_step = self.kernels.struct(
                "decode_step", tables=tables, max_blocks=tables.shape[1], starts=starts, lens=lens,
                shared_len=self._shared_len(meta, decode, tables), batch=len(decode), block_size=meta.block_size,
                cos=None, sin=None, slots=slots, num_threads=threads)
            out.keep += [tables, starts, lens]
        if prefill:
            qsl = meta.query_start_loc
            out.prefill = dict(
                tables=_int32_tables([meta.block_tables[i] for i in prefill]),
                row0=torch.tensor([qsl[i] for i in prefill], dtype=torch.int32),
                count=torch.tensor([qsl[i + 1] - qsl[i] for i in prefill], dtype=torch.int32),
                computed=torch.tensor([meta.num_computed[i] for i in prefill], dtype=torch.int32),
                reqs=len(prefill), block_size=meta.block_size, window=meta.sliding_window or 0, num_threads=threads)
            out.prefill["max_blocks"] = out.prefill["tables"].shape[1]
        return out

    def _shared_len(self, meta: AttentionMetadata, decode: list[int], tables: torch.Tensor) -> int:
        """Leading positions that all decoding requests read from the same blocks (0: no cascade). A verification's
        rows are one request: the kernel reads its context once for them already, summed as lone steps sum it."""
        if meta.sliding_window is not None or len(decode) < self.min_shared_batch \
                or len(torch.unique(tables, dim=0)) < self.min_shared_batch:
            return 0
        same = (tables == tables[:1]).all(0).to(torch.int32)          # [blocks] True while all tables agree
        blocks = int(same.cumprod(0).sum())
        # capped at the shortest context: every request has all these positions (padding never counts)
        shared = min(blocks * meta.block_size, min(meta.seq_lens[i] for i in decode))
        return shared if shared >= self.min_shared_len else 0

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: CpuAttentionMetadata,
                scale: float, window: Optional[int] = None, softcap: Optional[float] = None,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        if window not in (None, meta.sliding_window):
            raise ValueError(f"layer {layer}'s window of {window} is not its KV group's ({meta.sliding_window}): "
                             f"the CPU kernels attend through the group's")
        cap = softcap or 0.0
        self._write(layer, k, v, meta)
        if meta.all_decode:       # a pure decode step: no row gather or scatter around the kernel
            return self._decode(layer, q, meta, scale, cap, sinks)
        q = _rows_dense(q)
        out = torch.empty(q.shape, dtype=q.dtype)
        if meta.decode_rows is not None:
            out[meta.decode_rows] = self._decode(layer, q[meta.decode_rows], meta, scale, cap, sinks)
        self.kernels.run("paged_prefill", kv=meta.kv[layer], q=q, q_stride=_row_stride(q), q_bf16=_bf16(q),
                         out=out, heads=q.shape[1], scale=scale, softcap=cap, sinks=sinks, **meta.prefill)
        return out

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """The step's K/V into their slots: in C for float32 rows (views of the fused qkv), else by torch."""
        D = k.shape[2]
        if k.dtype == v.dtype == torch.float32 and k.stride(0) == v.stride(0) and k.stride(1) == v.stride(1) == D \
                and k.stride(2) == v.stride(2) == 1 and meta.slot_mapping.dtype == torch.int64:
            self.kernels.run("write_kv", kv=meta.kv[layer], k=k, v=v, src_stride=k.stride(0),
                             slots=meta.slot_mapping, rows=k.shape[0])
            return
        self.kv_caches[layer].write(meta.slot_mapping, k, v)

    def _decode(self, layer: int, q: torch.Tensor, meta: CpuAttentionMetadata, scale: float, cap: float,
                sinks: Optional[torch.Tensor]) -> torch.Tensor:
        """The decoding requests' rows q [Bd, H, D] through the kernel (cap: the soft cap, 0 for none; sinks: [H]
        float32 or None)."""
        q = _rows_dense(q)
        out = torch.empty(q.shape, dtype=q.dtype)
        self.kernels.run("paged_decode", step=meta.decode_step, kv=meta.kv[layer], q=q, q_stride=_row_stride(q),
                         q_bf16=_bf16(q), out=out, heads=q.shape[1], scale=scale, softcap=cap, sinks=sinks)
        return out


def _bf16(q: torch.Tensor) -> int:
    if q.dtype not in _Q_DTYPES:
        raise ValueError(f"the CPU attention kernels take float32 or bfloat16 queries, not {q.dtype}")
    return _Q_DTYPES[q.dtype]


def _rows_dense(q: torch.Tensor) -> torch.Tensor:
    """q with each token's heads contiguous (tokens may be strided apart, as views of fused qkv are)."""
    return q if q.stride(2) == 1 and q.stride(1) == q.shape[2] else q.contiguous()


def _row_stride(q: torch.Tensor) -> int:
    if not (q.stride(2) == 1 and q.stride(1) == q.shape[2]):
        raise ValueError("the CPU attention kernels take query rows with contiguous heads")
    return q.stride(0)
