"""Paged attention over the flattened batch.

The KV cache of one layer is a pair of tensors [num_blocks * block_size, num_kv_heads, head_dim] (a flat view of
[num_blocks, block_size, ...]): a token's slot is block_id * block_size + offset. Every step first writes the new
tokens' K/V into their slots, then each request attends over its context gathered from its block table.

Two backends share that contract: `TorchReferenceBackend` loops over requests with an explicit mask (the oracle),
`BatchedBackend` attends all decoding requests in one padded call and prefills fresh prompts with causal SDPA.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from tokenmill.executor.attention.cpu_kernel import paged_decode, paged_prefill
from tokenmill.executor.layers import cpu_ops
from tokenmill.executor.native import check, kernels, kv_bf16_flag


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor          # [T] long: where each scheduled token's K/V goes
    query_start_loc: list[int]          # [B + 1]: request i owns rows query_start_loc[i]:query_start_loc[i+1]
    num_computed: list[int]             # [B]: tokens already in the cache before this step
    seq_lens: list[int]                 # [B]: context length after this step
    block_tables: list[list[int]]       # [B][blocks]: -1 where a sliding window freed a block
    block_size: int
    sliding_window: Optional[int]
    # built once per step by the backend's prepare()
    decode_rows: Optional[torch.Tensor] = None    # [Bd] row index of each decoding request's token
    decode_slots: Optional[torch.Tensor] = None   # [Bd, L] context slots, padded
    decode_mask: Optional[torch.Tensor] = None    # [Bd, 1, 1, L] True where attended
    prefill_reqs: Optional[list[int]] = None      # request indices with more than one query token
    decode_tables: Optional[torch.Tensor] = None  # [Bd, blocks] int32, for the C kernel
    decode_starts: Optional[torch.Tensor] = None  # [Bd] int32 first attended position
    decode_lens: Optional[torch.Tensor] = None    # [Bd] int32 context length
    decode_max_len: int = 0
    decode_shared_len: int = 0                    # positions every decoding request reads from the same blocks
    all_decode: bool = False                      # every request has one query token (rows are 0..B-1)
    decode_call: Optional[tuple] = None           # (rope, the step's part of decode_args()), from its first call
    device: torch.device = torch.device("cpu")

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)


def _context_slots(meta: AttentionMetadata, i: int, start: int) -> torch.Tensor:
    """Slots of positions [start, seq_len) of request i, from its block table."""
    bs = meta.block_size
    pos = torch.arange(start, meta.seq_lens[i])
    table = torch.tensor(meta.block_tables[i], dtype=torch.long)
    return table[pos // bs] * bs + pos % bs


def _window_start(meta: AttentionMetadata, i: int) -> int:
    """The first position any query of request i may attend (0 without a sliding window)."""
    if meta.sliding_window is None:
        return 0
    return max(0, meta.num_computed[i] - meta.sliding_window + 1)


def _split(meta: AttentionMetadata) -> list[int]:
    """Sets meta.prefill_reqs (requests with more than one query token) and returns the decoding ones."""
    qsl = meta.query_start_loc
    meta.prefill_reqs = [i for i in range(meta.num_reqs) if qsl[i + 1] - qsl[i] > 1]
    return [i for i in range(meta.num_reqs) if qsl[i + 1] - qsl[i] == 1]


def _mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """[Q, K] True where query at q_pos may see key at k_pos (causal, and within the window: q - k < window)."""
    diff = q_pos[:, None] - k_pos[None, :]
    ok = diff >= 0
    if window is not None:
        ok &= diff < window
    return ok


class AttentionBackend:
    name = "base"

    def prepare(self, meta: AttentionMetadata) -> None:
        """Per-step work shared by all layers (index tensors, masks)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KV, D]; caches [slots, KV, D]. Returns [T, H, D]."""
        if not cpu_ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping):
            k_cache[meta.slot_mapping] = k.to(k_cache.dtype)     # kv_cache_dtype may differ from the model's
            v_cache[meta.slot_mapping] = v.to(v_cache.dtype)
        return self._attend(q, k, v, k_cache, v_cache, meta, scale)

    def decode_args(self, rope: tuple[torch.Tensor, torch.Tensor], k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata) -> Optional[tuple]:
        """For a pure decode step that the C kernels can run whole (executor/csrc: decode_attention, and
        decode_layer on top of it): the arguments they share, from cos to the context lengths. None where
        this backend or this step cannot (then the caller rotates, writes and attends through forward())."""
        return None

    def decode_fused(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                     rope: tuple[torch.Tensor, torch.Tensor], k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float) -> Optional[torch.Tensor]:
        """Rotary, KV write and attention of a pure decode step in one C call, from the fused qkv rows
        [T, (H + 2 KV) * D] and rope = (cos, sin) [T, 1, D]; returns [T, H, D], or None as decode_args."""
        args = self.decode_args(rope, k_cache, v_cache, meta)
        if args is None or qkv.dtype != torch.float32 or qkv.stride(1) != 1:
            return None
        T = qkv.shape[0]
        out = torch.empty(T, num_heads, head_dim)
        check(kernels().decode_attention(qkv.data_ptr(), qkv.stride(0), out.data_ptr(), *args, T, num_heads,
                                         num_kv_heads, head_dim, meta.block_size, scale, meta.decode_max_len,
                                         torch.get_num_threads()), "decode attention")
        return out

    def _attend(self, q, k, v, k_cache, v_cache, meta, scale) -> torch.Tensor:
        raise NotImplementedError

    def _one_request(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, i: int, scale: float) -> torch.Tensor:
        """Attention of request i's query rows q [Q, H, D] over its cached context. Returns [Q, H, D]."""
        start = _window_start(meta, i)
        slots = _context_slots(meta, i, start).to(k_cache.device)
        keys, vals = k_cache[slots].to(q.dtype), v_cache[slots].to(q.dtype)     # [K, KV, D]
        q_pos = torch.arange(meta.num_computed[i], meta.seq_lens[i])
        k_pos = torch.arange(start, meta.seq_lens[i])
        mask = _mask(q_pos, k_pos, meta.sliding_window).to(q.device)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1),  # [heads, len, D]
            attn_mask=mask, scale=scale, enable_gqa=True)
        return out.transpose(0, 1)


class TorchReferenceBackend(AttentionBackend):
    """The oracle: one masked SDPA per request, over keys read back from the paged cache."""
    name = "torch"

    def _attend(self, q, k, v, k_cache, v_cache, meta, scale):
        out = torch.empty_like(q)
        for i in range(meta.num_reqs):
            a, b = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            out[a:b] = self._one_request(q[a:b], k_cache, v_cache, meta, i, scale)
        return out


class BatchedBackend(AttentionBackend):
    """All decoding requests in one padded SDPA call; fresh prompts with causal SDPA on the new K/V."""
    name = "batched"

    def prepare(self, meta: AttentionMetadata) -> None:
        qsl = meta.query_start_loc
        decode = _split(meta)
        if not decode:
            meta.decode_rows = None
            return
        starts = [_window_start(meta, i) for i in decode]
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
        meta.decode_rows = torch.tensor([qsl[i] for i in decode], device=meta.device)
        meta.decode_slots = slots.to(meta.device)
        meta.decode_mask = valid[:, None, None, :].to(meta.device)

    def _attend(self, q, k, v, k_cache, v_cache, meta, scale):
        out = torch.empty_like(q)
        if meta.decode_rows is not None:
            rows = meta.decode_rows
            keys = k_cache[meta.decode_slots].to(q.dtype).transpose(1, 2)     # [Bd, KV, L, D]
            vals = v_cache[meta.decode_slots].to(q.dtype).transpose(1, 2)
            qd = q[rows][:, :, None, :]                                 # [Bd, H, 1, D]
            o = F.scaled_dot_product_attention(qd, keys, vals, attn_mask=meta.decode_mask, scale=scale,
                                               enable_gqa=True)
            out[rows] = o[:, :, 0, :]
        self._prefill(q, k, v, k_cache, v_cache, meta, scale, out)
        return out

    def _prefill(self, q, k, v, k_cache, v_cache, meta, scale, out) -> None:
        for i in meta.prefill_reqs or ():
            a, b = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            fresh = meta.num_computed[i] == 0 and (meta.sliding_window is None or b - a <= meta.sliding_window) \
                and k_cache.dtype == k.dtype
            if fresh:  # the whole context is this step's tokens: no need to read the cache back (unless the cache
                # rounds them: then every query sees the K/V that later decode steps will see)
                o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                                   v[a:b].transpose(0, 1), is_causal=True, scale=scale,
                                                   enable_gqa=True)
                out[a:b] = o.transpose(0, 1)
            else:
                out[a:b] = self._one_request(q[a:b], k_cache, v_cache, meta, i, scale)


def _int32_tables(tables: list[list[int]]) -> torch.Tensor:
    """[R, max blocks] int32 block tables for the C kernels: freed (-1) and padding entries as block 0, which
    they never read (they attend only positions a table covers)."""
    width = max(len(t) for t in tables)
    return torch.tensor([[max(b, 0) for b in t] + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


class CpuKernelBackend(BatchedBackend):
    """Attends through the C kernels, which read K/V in place (no gather copy): decoding requests in one call,
    prompt chunks (fresh, prefix-cache hits, later chunks of a chunked prefill) in another.

    Cascade attention: when every decoding request's table starts with the same blocks (a prefix cache hit on
    a shared system prompt), those positions are attended once for the whole batch and merged with each
    request's own part, instead of once per request."""
    name = "cpu"
    min_shared_len = 64      # shorter common prefixes are not worth a separate pass
    min_shared_batch = 4

    def prepare(self, meta: AttentionMetadata) -> None:
        decode = _split(meta)
        meta.decode_rows = None
        if not decode:
            return
        meta.decode_rows = torch.tensor([meta.query_start_loc[i] for i in decode])
        meta.all_decode = not meta.prefill_reqs
        meta.decode_tables = _int32_tables([meta.block_tables[i] for i in decode])
        meta.decode_starts = torch.tensor([_window_start(meta, i) for i in decode], dtype=torch.int32)
        meta.decode_lens = torch.tensor([meta.seq_lens[i] for i in decode], dtype=torch.int32)
        meta.decode_max_len = int(max(meta.seq_lens[i] for i in decode))
        meta.decode_shared_len = self._shared_len(meta, decode)

    def _shared_len(self, meta: AttentionMetadata, decode: list[int]) -> int:
        """Leading positions that all decoding requests read from the same blocks (0: no cascade)."""
        if len(decode) < self.min_shared_batch or meta.sliding_window is not None:
            return 0
        tables = meta.decode_tables
        same = (tables == tables[:1]).all(0).to(torch.int32)          # [blocks] True while all tables agree
        blocks = int(same.cumprod(0).sum())
        # capped at the shortest context: every request has all these positions (padding never counts)
        shared = min(blocks * meta.block_size, min(meta.seq_lens[i] for i in decode))
        return shared if shared >= self.min_shared_len else 0

    def decode_args(self, rope, k_cache, v_cache, meta):
        # the step's part is worked out on the first layer and kept in meta: each of the 30 layers asking
        # again cost ~1 ms a step in checks and data_ptr() calls
        if meta.decode_call is None or meta.decode_call[0] is not rope:
            meta.decode_call = (rope, self._step_args(rope, meta))
        step = meta.decode_call[1]
        kv_bf16 = kv_bf16_flag(k_cache, v_cache)
        if step is None or kv_bf16 is None or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            return None
        head, tail = step
        return head + (k_cache.shape[0], k_cache.data_ptr(), v_cache.data_ptr(), kv_bf16) + tail

    @staticmethod
    def _step_args(rope, meta: AttentionMetadata) -> Optional[tuple[tuple, tuple]]:
        """decode_args() around the layer's caches: (cos, sin, slots) and (tables .. shared_len), or None."""
        cos, sin = rope
        if not meta.all_decode or cos.dtype != torch.float32 or not cos.is_cpu \
                or not (cos.is_contiguous() and sin.is_contiguous()) or meta.slot_mapping.dtype != torch.int64:
            return None
        tables = meta.decode_tables
        return ((cos.data_ptr(), sin.data_ptr(), meta.slot_mapping.data_ptr()),
                (tables.data_ptr(), tables.shape[1], meta.decode_starts.data_ptr(), meta.decode_lens.data_ptr(),
                 meta.decode_shared_len))

    def _attend(self, q, k, v, k_cache, v_cache, meta, scale):
        if meta.all_decode:       # a pure decode step: no row gather or scatter around the kernel
            return self._decode(q, k_cache, v_cache, meta, scale)
        out = torch.empty(q.shape, dtype=q.dtype)
        if meta.decode_rows is not None:
            out[meta.decode_rows] = self._decode(q[meta.decode_rows], k_cache, v_cache, meta, scale)
        self._prefill(q, k, v, k_cache, v_cache, meta, scale, out)
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, meta, scale) -> torch.Tensor:
        """The decoding requests' rows q [Bd, H, D] through the C kernel, with prepare()'s tensors."""
        return paged_decode(q, k_cache, v_cache, meta.decode_tables, meta.decode_starts, meta.decode_lens,
                            meta.block_size, scale, meta.decode_max_len, meta.decode_shared_len)

    def _prefill(self, q, k, v, k_cache, v_cache, meta, scale, out) -> None:
        """Every prompt chunk of the step in one C call, fresh or over a cached context: their K/V are in the
        cache already (forward() wrote them), and the kernel runs ~5x faster than torch's SDPA, which takes its
        math path here (a 440-token prompt, 9 heads of 64: 2.4 ms against 13.8 ms)."""
        reqs = meta.prefill_reqs
        if not reqs:
            return
        qsl = meta.query_start_loc
        paged_prefill(q, k_cache, v_cache, out, _int32_tables([meta.block_tables[i] for i in reqs]),
                      torch.tensor([qsl[i] for i in reqs], dtype=torch.int32),
                      torch.tensor([qsl[i + 1] - qsl[i] for i in reqs], dtype=torch.int32),
                      torch.tensor([meta.num_computed[i] for i in reqs], dtype=torch.int32),
                      meta.block_size, meta.sliding_window or 0, scale)


def get_backend(name: str, device: torch.device, head_dim: int = 64, group: int = 1) -> AttentionBackend:
    """group = query heads per kv head. The C kernel wants head_dim % 8 == 0 and group <= 16."""
    kernel_fits = head_dim % 8 == 0 and head_dim <= 256 and group <= 16
    if name == "auto":
        if device.type == "cpu" and kernel_fits:
            if kernels() is not None:
                return CpuKernelBackend()
        return BatchedBackend()
    if name == "cpu":
        if kernels() is None:
            raise ValueError("attention_backend='cpu' needs a C compiler (gcc) to build its kernel")
        if not kernel_fits:
            raise ValueError("attention_backend='cpu' needs head_dim a multiple of 8 (<= 256) and at most 16 "
                             "query heads per kv head; use 'batched'")
        return CpuKernelBackend()
    if name == "batched":
        return BatchedBackend()
    if name == "torch":
        return TorchReferenceBackend()
    raise ValueError(f"unknown attention_backend {name!r}; choose auto, cpu, batched or torch")

