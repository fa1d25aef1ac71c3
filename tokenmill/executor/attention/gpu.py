"""The GPU's attention backend: the Triton kernels (triton_kernels.py) read K/V in place from the paged cache.
Decoding requests go to the split-K decode kernel, all in one launch per layer; prompt rows (fresh prompts, later
chunks of a chunked prefill, prefix-cache hits) to the varlen prompt kernel, in tiles of BLOCK_M rows.

prepare() builds the step's index arrays once for every layer, in one int32 buffer copied to the device in one
transfer (pinned on CUDA, so the copy does not wait for the host)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from tokenmill.executor.attention.backend import (AttentionBackend, AttentionMetadata, DeviceBatch, extend,
                                                  flat_tables)
from tokenmill.executor.kv_cache import LayerKV
from tokenmill.executor.transfer import to_device


def triton_fits(num_heads: int, num_kv_heads: int, head_dim: int, value_dim: Optional[int] = None) -> Optional[str]:
    """None when the Triton kernels can serve these shapes here, else why not (Triton missing included)."""
    if value_dim is not None:
        return "values narrower than keys (latent attention)"
    try:
        from tokenmill.executor.attention import triton_kernels
    except ImportError as e:
        return f"Triton is not installed ({e})"
    return triton_kernels.fits(num_heads, num_kv_heads, head_dim)


@dataclass
class TritonMetadata(AttentionMetadata):
    qsl: Optional[torch.Tensor] = None            # [B + 1] int32, on the device
    computed: Optional[torch.Tensor] = None       # [B] num_computed
    lens: Optional[torch.Tensor] = None           # [B] seq_lens
    tables: Optional[torch.Tensor] = None         # [B, W] block tables (freed and padding entries: block 0)
    decode_reqs: Optional[torch.Tensor] = None    # [Bd] requests with one query row
    tile_req: Optional[torch.Tensor] = None       # [tiles] the request of each prompt tile
    tile_m0: Optional[torch.Tensor] = None        # [tiles] its first row within the request
    num_splits: int = 1                           # the most decode splits of a context (a power of two)


class TritonBackend(AttentionBackend):
    """min_programs: how many decode programs (requests x kv heads x splits) keep the device busy; contexts are
    split until there are that many, never into pieces shorter than two key tiles. fused_rotary: the layers' rotary
    embeddings turn whole heads, so rotary and the KV-cache write are one kernel (where the cache is a float one)."""
    name = "triton"
    supports_device_batch = True
    supports_graphs = True

    def __init__(self, device: torch.device, min_programs: Optional[int] = None, fused_rotary: bool = True) -> None:
        super().__init__()
        from tokenmill.executor.attention import triton_kernels
        self.kernels = triton_kernels
        if min_programs is None:     # off a GPU (the interpreter, where each launch costs): no splits
            min_programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count \
                if device.type == "cuda" else 1
        self.min_programs = min_programs
        self.fused_rotary = fused_rotary
        self.write_rotated = None           # the fused kernel, where it takes the bound cache
        self._graph_entries: Optional[torch.Tensor] = None

    def bind_kv_cache(self, caches: list[LayerKV]) -> None:
        super().bind_kv_cache(caches)
        from tokenmill.executor.ops import triton_kernels as fused
        c = caches[0]
        why = fused.rotary_write_fits(c.head_dim, c.head_dim, c.k.dtype, c.k.dtype) if not c.quantized else "fp8"
        self.write_rotated = fused.rotary_write if self.fused_rotary and why is None else None

    def forward_rotary(self, layer, qk, v, rope, rotary, meta, scale, window=None, softcap=None,
                       sinks=None) -> torch.Tensor:
        if self.write_rotated is None or rope[0].dtype != qk.dtype:
            return super().forward_rotary(layer, qk, v, rope, rotary, meta, scale, window, softcap, sinks)
        cache = self.kv_caches[layer]
        H = qk.shape[1] - v.shape[1]
        self.write_rotated(qk, v, rope[0], rope[1], cache.k, cache.v, meta.slot_mapping, H)
        return self._attend(qk[:, :H], None, None, cache, meta, scale, window or meta.sliding_window, softcap, sinks)

    def prepare_device(self, batch: DeviceBatch) -> TritonMetadata:
        """The step's decode entries and prompt tiles from the host's row counts (one small copy; none when every
        entry decodes), the rest as the runner put it on the device."""
        E = batch.num_entries
        rows = batch.entry_rows
        tile_req = tile_m0 = None
        if rows is None or all(n == 1 for n in rows):
            decode = self._graph_entries[:E]
            num_decode = E
        else:
            bm = self.kernels.BLOCK_M
            dec = [i for i, n in enumerate(rows) if n == 1]
            tiles = [(i, m0) for i, n in enumerate(rows) if n > 1 for m0 in range(0, n, bm)]
            flat = to_device(dec + [i for i, _ in tiles] + [m0 for _, m0 in tiles], batch.qsl.device, torch.int32)
            decode = flat[:len(dec)] if dec else None
            tile_req, tile_m0 = flat[len(dec):len(dec) + len(tiles)], flat[len(dec) + len(tiles):]
            num_decode = len(dec)
        return TritonMetadata(
            slot_mapping=batch.slot_mapping, query_start_loc=[], num_computed=[], seq_lens=[], block_tables=[],
            block_size=batch.block_size, sliding_window=batch.sliding_window, device=batch.qsl.device,
            qsl=batch.qsl, computed=batch.num_computed, lens=batch.seq_lens, tables=batch.tables,
            decode_reqs=decode, tile_req=tile_req, tile_m0=tile_m0, num_splits=self._splits(num_decode))

    def init_graphs(self, max_size: int, device: torch.device) -> None:
        # 0..max_size-1 once: the decode entries of any step whose entries all decode (a captured one's too)
        self._graph_entries = torch.arange(max_size, device=device)

    def graph_metadata(self, batch: DeviceBatch, size: int) -> TritonMetadata:
        """Every entry decodes: the decode kernel's entry list is the static 0..size-1, its grid the size's."""
        return self.prepare_device(dataclasses.replace(batch, entry_rows=None))

    def kv_cache_dtype_error(self, dtype: str, device: torch.device) -> Optional[str]:
        if LayerKV.allocate(1, 1, 32, dtype).k.dtype not in self.kernels.CACHE_DTYPES:
            return "the Triton kernels read float and fp8 caches (int8 and int4 are the CPU kernels')"
        return super().kv_cache_dtype_error(dtype, device)

    def prepare(self, meta: AttentionMetadata) -> TritonMetadata:
        decode, prompt = meta.split()
        qsl = meta.query_start_loc
        bm = self.kernels.BLOCK_M
        tiles = [(i, m0) for i in prompt for m0 in range(0, qsl[i + 1] - qsl[i], bm)]
        table_values, width = flat_tables(meta.block_tables)
        parts = [qsl, meta.num_computed, meta.seq_lens, table_values, decode, [i for i, _ in tiles], [m0 for _, m0 in tiles]]
        flat = to_device([x for p in parts for x in p], meta.device, torch.int32)
        views = list(torch.split(flat, [len(p) for p in parts]))
        views[3] = views[3].view(meta.num_reqs, width)
        return extend(meta, TritonMetadata, qsl=views[0], computed=views[1], lens=views[2], tables=views[3],
                      decode_reqs=views[4] if decode else None, tile_req=views[5] if tiles else None,
                      tile_m0=views[6], num_splits=self._splits(len(decode)))

    def _splits(self, num_decode: int) -> int:
        if not num_decode or not self.kv_caches:
            return 1
        return self.kernels.decode_splits(num_decode, self.kv_caches[0].k.shape[1], self.min_programs)

    def _attend(self, q, k, v, cache: LayerKV, meta: TritonMetadata, scale, window, softcap, sinks) -> torch.Tensor:
        if q.stride(2) != 1:
            q = q.contiguous()
        out = torch.empty_like(q)
        bs = meta.block_size
        if meta.decode_reqs is not None:
            self.kernels.paged_decode(out, q, cache.k, cache.v, cache.k_scale, cache.v_scale, meta.qsl, meta.lens,
                                      meta.tables, meta.decode_reqs, meta.num_splits, bs, scale, window, softcap,
                                      sinks)
        if meta.tile_req is not None:
            self.kernels.paged_prompt(out, q, cache.k, cache.v, cache.k_scale, cache.v_scale, meta.qsl,
                                      meta.computed, meta.tables, meta.tile_req, meta.tile_m0, bs, scale, window,
                                      softcap, sinks)
        return out
