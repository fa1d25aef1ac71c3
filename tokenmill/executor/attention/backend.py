"""Paged attention over the flattened batch.

The KV cache of one layer is a LayerKV: K and V [num_blocks * block_size, num_kv_heads, head_dim] (a flat view of
[num_blocks, block_size, ...]) in the cache's dtype: a token's slot is block_id * block_size + offset. Every step
first writes the new tokens' K/V into their slots, then each request attends over its context gathered from its
block table.

Backends share that contract: `TorchReferenceBackend` loops over requests with an explicit mask (the oracle),
`BatchedBackend` attends all decoding requests in one padded call and prefills fresh prompts with causal SDPA;
the CPU kernels' backend is in attention/cpu.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable, Optional, TypeVar

import torch
import torch.nn.functional as F

from tokenmill.executor.kv_cache import INT4_GROUP, LayerKV


@dataclass
class AttentionMetadata:
    """What the runner knows about a step's attention; each backend's prepare() returns its own subclass with its
    per-step scratch."""
    slot_mapping: torch.Tensor          # [T] long: where each scheduled token's K/V goes
    query_start_loc: list[int]          # [B + 1]: request i owns rows query_start_loc[i]:query_start_loc[i+1]
    num_computed: list[int]             # [B]: tokens already in the cache before this step
    seq_lens: list[int]                 # [B]: context length after this step
    block_tables: list[list[int]]       # [B][blocks]: -1 where a sliding window freed a block
    block_size: int
    sliding_window: Optional[int]
    device: torch.device = torch.device("cpu")

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    def split(self) -> tuple[list[int], list[int]]:
        """(decoding requests: one query token each, prompt requests: more than one)."""
        qsl = self.query_start_loc
        n = [qsl[i + 1] - qsl[i] for i in range(self.num_reqs)]
        return [i for i in range(self.num_reqs) if n[i] == 1], [i for i in range(self.num_reqs) if n[i] > 1]


@dataclass
class DeviceBatch:
    """One KV group's attention inputs already on the device (the GPU runner's resident batch, or its captured
    graphs' static buffers), for backends that prepare from the device (supports_device_batch)."""
    slot_mapping: torch.Tensor               # [T] int64
    qsl: torch.Tensor                        # [E + 1]
    num_computed: torch.Tensor               # [E]
    seq_lens: torch.Tensor                   # [E] (0: a padding entry, which attends nothing)
    tables: torch.Tensor                     # [E, W] block ids
    entry_rows: Optional[list[int]]          # each entry's query rows, known on the host (None: one each)
    block_size: int
    sliding_window: Optional[int]

    @property
    def num_entries(self) -> int:
        return self.seq_lens.shape[0]


M = TypeVar("M", bound=AttentionMetadata)


def extend(meta: AttentionMetadata, cls: type[M], **extra) -> M:
    """meta as the backend's metadata subclass cls, with its extra fields."""
    return cls(**{f.name: getattr(meta, f.name) for f in fields(AttentionMetadata)}, **extra)


def flat_tables(block_tables: list[list[int]]) -> tuple[list[int], int]:
    """The entries' tables as one row-major list, padded to the widest: (values, width). Freed (-1) and padding
    entries are block 0, which no kernel reads (they attend only positions a table covers)."""
    width = max(len(t) for t in block_tables)
    return [max(b, 0) for t in block_tables for b in t + [0] * (width - len(t))], width


def _context_slots(meta: AttentionMetadata, i: int, start: int) -> torch.Tensor:
    """Slots of positions [start, seq_len) of request i, from its block table."""
    bs = meta.block_size
    pos = torch.arange(start, meta.seq_lens[i])
    table = torch.tensor(meta.block_tables[i], dtype=torch.long)
    return table[pos // bs] * bs + pos % bs


def _window_start(meta: AttentionMetadata, i: int, window: Optional[int]) -> int:
    """The first position any query of request i may attend (0 without a sliding window)."""
    if window is None:
        return 0
    return max(0, meta.num_computed[i] - window + 1)


def _mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """[Q, K] True where query at q_pos may see key at k_pos (causal, and within the window: q - k < window)."""
    diff = q_pos[:, None] - k_pos[None, :]
    ok = diff >= 0
    if window is not None:
        ok &= diff < window
    return ok


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
               softcap: Optional[float], is_causal: bool = False, sinks: Optional[torch.Tensor] = None
               ) -> torch.Tensor:
    """SDPA over [..., heads, len, D] (k, v with fewer heads: GQA). With a soft cap (Gemma 2), scores become
    tanh(s / cap) * cap before the mask and softmax; with sinks (gpt-oss: a logit per head), each row's softmax
    takes its head's sink as one more score, whose weight is then dropped. SDPA can do neither: the plain math
    then, as transformers' eager attention does it."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=True)
    rep = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    s = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if is_causal:
        mask = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return s.softmax(dim=-1, dtype=torch.float32).to(q.dtype) @ v
    sink = sinks.to(s.dtype)[:, None, None].expand(*s.shape[:-1], 1)
    return torch.cat([s, sink], dim=-1).softmax(dim=-1, dtype=torch.float32)[..., :-1].to(q.dtype) @ v


class AttentionBackend:
    """prepare() once a step, then forward() per layer. The layers' KV caches are bound once, at start.

    A backend that supports_device_batch also prepares from a DeviceBatch (prepare_device), with no host reads; one
    that supports_graphs keeps its own static state for captured decode steps (init_graphs) and gives the metadata
    of a captured size from the runner's static buffers (graph_metadata), so a replay needs no host work."""
    name = "base"
    supports_device_batch = False
    supports_graphs = False

    def __init__(self) -> None:
        self.kv_caches: list[LayerKV] = []

    def kv_cache_dtype_error(self, dtype: str, device: torch.device) -> Optional[str]:
        """None when this backend reads and writes a cache of dtype (kv_cache.FORMATS, or a torch dtype's name off
        CPU) on device, else why not. The torch backends go through LayerKV's torch ops: they need the codes'
        dtype on the device."""
        try:
            LayerKV.allocate(1, 1, INT4_GROUP, dtype, device).read(torch.zeros(1, dtype=torch.long, device=device),
                                                                   torch.float32)
        except (AttributeError, RuntimeError, TypeError) as e:
            return f"this torch ({torch.__version__}) cannot hold it on {device}: {e}"
        return None

    def bind_kv_cache(self, caches: list[LayerKV]) -> None:
        """One LayerKV per layer, K and V [slots, KV, D] (a flat view of [num_blocks, block_size, KV, D])."""
        self.kv_caches = caches

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Per-step work shared by all layers (index tensors, masks): the metadata forward() takes."""
        return meta

    def prepare_device(self, batch: DeviceBatch) -> AttentionMetadata:
        raise NotImplementedError(f"the {self.name!r} attention backend prepares from host lists only")

    def init_graphs(self, max_size: int, device: torch.device) -> None:
        """Static state for steps prepared from the device (captured or not) of up to max_size entries."""
        raise NotImplementedError(f"the {self.name!r} attention backend cannot be captured in a graph")

    def graph_metadata(self, batch: DeviceBatch, size: int) -> AttentionMetadata:
        """The metadata of a captured decode step of size rows (one query row an entry), from static buffers."""
        raise NotImplementedError(f"the {self.name!r} attention backend cannot be captured in a graph")

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                scale: float, window: Optional[int] = None, softcap: Optional[float] = None,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KV, D] (v's D may be narrower: latent attention), written into the layer's cache
        first. Returns [T, H, v's D]. window: this layer's sliding window (Gemma's local layers; else the model's,
        meta.sliding_window); softcap: tanh soft-capping of the scores (Gemma 2); sinks: [H] float32, each head's
        sink logit (gpt-oss)."""
        cache = self.kv_caches[layer]
        cache.write(meta.slot_mapping, k, v)     # kv_cache_dtype may differ from the model's
        return self._attend(q, k, v, cache, meta, scale, window or meta.sliding_window, softcap, sinks)

    def forward_rotary(self, layer: int, qk: torch.Tensor, v: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                       rotary: Callable, meta: AttentionMetadata, scale: float, window: Optional[int] = None,
                       softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """forward() of q and k side by side as qk [T, H + KV, D] (a view of the fused qkv rows), turned first by
        the plan's rotary with rope (cos, sin [T, 1, rotary dims]). A backend may turn them and write the cache in
        one kernel."""
        qk = rotary(qk, *rope)
        H = qk.shape[1] - v.shape[1]
        return self.forward(layer, qk[:, :H], qk[:, H:], v, meta, scale, window, softcap, sinks)

    def _attend(self, q, k, v, cache: LayerKV, meta, scale, window, softcap, sinks) -> torch.Tensor:
        raise NotImplementedError

    def _one_request(self, q: torch.Tensor, cache: LayerKV, meta: AttentionMetadata, i: int, scale: float,
                     window: Optional[int], softcap: Optional[float], sinks: Optional[torch.Tensor]
                     ) -> torch.Tensor:
        """Attention of request i's query rows q [Q, H, D] over its cached context. Returns [Q, H, D]."""
        start = _window_start(meta, i, window)
        slots = _context_slots(meta, i, start).to(cache.k.device)
        keys, vals = cache.read(slots, q.dtype)     # [K, KV, D]
        q_pos = torch.arange(meta.num_computed[i], meta.seq_lens[i])
        k_pos = torch.arange(start, meta.seq_lens[i])
        mask = _mask(q_pos, k_pos, window).to(q.device)
        out = _attention(q.transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1),  # [heads, len, D]
                         mask, scale, softcap, sinks=sinks)
        return out.transpose(0, 1)


class TorchReferenceBackend(AttentionBackend):
    """The oracle: one masked SDPA per request, over keys read back from the paged cache."""
    name = "torch"

    def _attend(self, q, k, v, cache, meta, scale, window, softcap, sinks):
        out = q.new_empty(*q.shape[:2], v.shape[-1])
        for i in range(meta.num_reqs):
            a, b = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            out[a:b] = self._one_request(q[a:b], cache, meta, i, scale, window, softcap, sinks)
        return out


@dataclass
class BatchedMetadata(AttentionMetadata):
    prefill_reqs: list[int] = field(default_factory=list)   # requests with more than one query token
    decode_rows: Optional[torch.Tensor] = None    # [Bd] row index of each decoding request's token
    decode_slots: Optional[torch.Tensor] = None   # [Bd, L] context slots, padded
    decode_mask: Optional[torch.Tensor] = None    # [Bd, 1, 1, L] True where attended
    decode_pos: Optional[torch.Tensor] = None     # [Bd, 1, 1, L] each slot's position; query's is seq_len - 1
    decode_qpos: Optional[torch.Tensor] = None    # [Bd, 1, 1, 1]
    window_masks: dict = field(default_factory=dict)   # a layer window -> its decode mask, made on first use


class BatchedBackend(AttentionBackend):
    """All decoding requests in one padded SDPA call; fresh prompts with causal SDPA on the new K/V."""
    name = "batched"

    def prepare(self, meta: AttentionMetadata) -> BatchedMetadata:
        decode, prefill = meta.split()
        out = extend(meta, BatchedMetadata, prefill_reqs=prefill)
        if not decode:
            return out
        qsl = meta.query_start_loc
        starts = [_window_start(meta, i, meta.sliding_window) for i in decode]
        lens = [meta.seq_lens[i] - s for i, s in zip(decode, starts)]
        width = max(lens)
        bs = meta.block_size
        # [Bd, width] positions, padded by repeating each request's first attended position (a valid slot)
        offs = torch.arange(width)[None, :]
        start_t = torch.tensor(starts)[:, None]
        len_t = torch.tensor(lens)[:, None]
        valid = offs < len_t
        pos = start_t + torch.where(valid, offs, torch.zeros_like(offs))
        nblocks = max(len(meta.block_tables[i]) for i in decode)
        table = torch.tensor([meta.block_tables[i] + [0] * (nblocks - len(meta.block_tables[i])) for i in decode],
                             dtype=torch.long)
        slots = torch.gather(table, 1, pos // bs) * bs + pos % bs
        out.decode_rows = torch.tensor([qsl[i] for i in decode], device=meta.device)
        out.decode_slots = slots.to(meta.device)
        out.decode_mask = valid[:, None, None, :].to(meta.device)
        out.decode_pos = pos[:, None, None, :].to(meta.device)
        out.decode_qpos = (torch.tensor([meta.seq_lens[i] for i in decode]) - 1)[:, None, None, None].to(meta.device)
        return out

    def _attend(self, q, k, v, cache, meta, scale, window, softcap, sinks):
        out = q.new_empty(*q.shape[:2], v.shape[-1])      # values may be narrower than keys (latent attention)
        if meta.decode_rows is not None:
            rows = meta.decode_rows
            keys, vals = cache.read(meta.decode_slots, q.dtype)
            keys, vals = keys.transpose(1, 2), vals.transpose(1, 2)          # [Bd, KV, L, D]
            qd = q[rows][:, :, None, :]                                 # [Bd, H, 1, D]
            o = _attention(qd, keys, vals, self._decode_mask(meta, window), scale, softcap, sinks=sinks)
            out[rows] = o[:, :, 0, :]
        self._prefill(q, k, v, cache, meta, scale, window, softcap, sinks, out)
        return out

    @staticmethod
    def _decode_mask(meta: BatchedMetadata, window: Optional[int]) -> torch.Tensor:
        """The decode mask, narrowed to a layer's own window where it has one (the slots cover the model's)."""
        if window is None or window == meta.sliding_window:
            return meta.decode_mask
        if window not in meta.window_masks:
            meta.window_masks[window] = meta.decode_mask & (meta.decode_qpos - meta.decode_pos < window)
        return meta.window_masks[window]

    def _prefill(self, q, k, v, cache, meta, scale, window, softcap, sinks, out) -> None:
        for i in meta.prefill_reqs or ():
            a, b = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            fresh = meta.num_computed[i] == 0 and (window is None or b - a <= window) and cache.dtype == k.dtype
            if fresh:  # the whole context is this step's tokens: no need to read the cache back (unless the cache
                # rounds them: then every query sees the K/V that later decode steps will see)
                o = _attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), None, scale,
                               softcap, is_causal=True, sinks=sinks)
                out[a:b] = o.transpose(0, 1)
            else:
                out[a:b] = self._one_request(q[a:b], cache, meta, i, scale, window, softcap, sinks)
