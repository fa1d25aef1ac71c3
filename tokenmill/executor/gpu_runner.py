"""The GPU's runner."""
from __future__ import annotations

import torch

from tokenmill.config import EngineConfig
from tokenmill.executor.attention import AttentionMetadata
from tokenmill.executor.batch import ForwardBatch
from tokenmill.executor.models.decoder import DecoderForCausalLM
from tokenmill.executor.runner import ModelRunner


class GpuRunner(ModelRunner):
    def __init__(self, config: EngineConfig, model: DecoderForCausalLM, num_blocks: int):
        super().__init__(config, model, num_blocks)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        rows = torch.tensor([batch.ids, batch.pos, *batch.slots], dtype=torch.long)
        if self.device.type == "cuda":
            rows = rows.pin_memory().to(self.device, non_blocking=True)
        metas = [self.backend.prepare(AttentionMetadata(
            slot_mapping=rows[2 + g], query_start_loc=batch.qsl, num_computed=batch.num_computed,
            seq_lens=batch.seq_lens, block_tables=batch.tables[g], block_size=self.block_size, sliding_window=window,
            device=self.device))
            for g, window in enumerate(self.groups.windows)]
        return self.model(rows[0], rows[1], self.backend, metas)
