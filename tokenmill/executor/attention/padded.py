"""Attention over each entry's whole block table, masked: torch ops of fixed shapes, prepared from the device.

Every entry's keys are the slots of its table's full width (W blocks), whatever its length; a row attends the
positions up to its own, within its window, below its entry's length. Nothing depends on a length read on the
host, so a step can be captured in a graph. It reads W blocks an entry where the kernels read the context's own,
so it is the reference of the GPU runner's device path and its graphs (every family, on a CPU, fast), not a
kernel to serve long contexts with."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tokenmill.executor.attention.backend import (AttentionBackend, AttentionMetadata, DeviceBatch, _attention,
                                                  extend, flat_tables)
from tokenmill.executor.transfer import to_device


@dataclass
class PaddedMetadata(AttentionMetadata):
    row_entry: Optional[torch.Tensor] = None     # [T] each row's entry
    row_pos: Optional[torch.Tensor] = None       # [T] its position
    row_len: Optional[torch.Tensor] = None       # [T] its entry's length
    key_slots: Optional[torch.Tensor] = None     # [E, L] the slots of each entry's positions 0..L-1
    key_pos: Optional[torch.Tensor] = None       # [L]


class PaddedBackend(AttentionBackend):
    name = "padded"
    supports_device_batch = True
    supports_graphs = True

    def prepare(self, meta: AttentionMetadata) -> PaddedMetadata:
        dev, E = meta.device, meta.num_reqs
        values, width = flat_tables(meta.block_tables)
        flat = to_device(values + meta.query_start_loc + meta.num_computed + meta.seq_lens, dev)
        tables, qsl, computed, lens = torch.split(flat, [E * width, E + 1, E, E])
        counts = [meta.query_start_loc[i + 1] - meta.query_start_loc[i] for i in range(E)]
        batch = DeviceBatch(meta.slot_mapping, qsl, computed, lens, tables.view(E, width), counts, meta.block_size,
                            meta.sliding_window)
        return extend(meta, PaddedMetadata, **vars(self._device_fields(batch)))

    def prepare_device(self, batch: DeviceBatch) -> PaddedMetadata:
        meta = AttentionMetadata(slot_mapping=batch.slot_mapping, query_start_loc=[], num_computed=[], seq_lens=[],
                                 block_tables=[], block_size=batch.block_size, sliding_window=batch.sliding_window,
                                 device=batch.qsl.device)
        return extend(meta, PaddedMetadata, **vars(self._device_fields(batch)))

    def init_graphs(self, max_size: int, device: torch.device) -> None:
        pass

    def graph_metadata(self, batch: DeviceBatch, size: int) -> PaddedMetadata:
        return self.prepare_device(batch)

    @staticmethod
    def _device_fields(batch: DeviceBatch) -> "_Fields":
        T, dev, bs = batch.slot_mapping.shape[0], batch.qsl.device, batch.block_size
        rows = torch.arange(T, device=dev)
        # an entry's rows are those before the next entry's start (qsl is non-decreasing)
        entry = torch.searchsorted(batch.qsl[1:].contiguous(), rows, right=True)
        key_pos = torch.arange(batch.tables.shape[1] * bs, device=dev)
        key_slots = batch.tables.long()[:, key_pos // bs] * bs + key_pos % bs
        return _Fields(entry, batch.num_computed[entry] + rows - batch.qsl[entry], batch.seq_lens[entry], key_slots,
                       key_pos)

    def _attend(self, q, k, v, cache, meta: PaddedMetadata, scale, window, softcap, sinks) -> torch.Tensor:
        keys, vals = cache.read(meta.key_slots[meta.row_entry], q.dtype)          # [T, L, KV, D]
        seen = (meta.key_pos[None, :] <= meta.row_pos[:, None]) & (meta.key_pos[None, :] < meta.row_len[:, None])
        if window is not None:
            seen &= meta.row_pos[:, None] - meta.key_pos[None, :] < window
        # slots no row attends may hold anything (never written: NaN, say), and a masked score times it is NaN
        keys = keys.masked_fill(~seen[:, :, None, None], 0.0)
        vals = vals.masked_fill(~seen[:, :, None, None], 0.0)
        o = _attention(q[:, :, None, :], keys.transpose(1, 2), vals.transpose(1, 2), seen[:, None, None, :], scale,
                       softcap, sinks=sinks)[:, :, 0, :]                                         # [T, H, D]
        # a padding row (length 0) attends nothing: zeros, not the NaN of an empty softmax
        return o.masked_fill(~seen.any(-1)[:, None, None], 0.0)


@dataclass
class _Fields:
    row_entry: torch.Tensor
    row_pos: torch.Tensor
    row_len: torch.Tensor
    key_slots: torch.Tensor
    key_pos: torch.Tensor
