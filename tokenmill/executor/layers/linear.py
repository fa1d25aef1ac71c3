"""Linear layer whose weight is re-laid out after loading for the device's fast GEMM path; the plan's linear op
computes it (dense, or over the GGUF blocks it may also hold)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from tokenmill.executor.layers.quant import PackedWeight


class Linear(nn.Module):
    """y = x W^T + b. Loaded as W [out, in] (the checkpoint layout); `finalize()` on CPU keeps W^T [in, out]
    contiguous instead: small-row GEMMs (decode batches) run several times faster from that layout with torch's
    CPU BLAS (BENCHMARKS.md)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ops):
        super().__init__()
        self.ops = ops
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.register_buffer("weight_t", None)
        self.packed: Optional[PackedWeight] = None   # GGUF blocks for decode-sized matmuls (layers/quant.py)

    @classmethod
    def tied(cls, weight: nn.Parameter, ops) -> "Linear":
        """An LM head sharing the embeddings' weight [vocab, hidden]."""
        with torch.device("meta"):
            lin = cls(weight.shape[1], weight.shape[0], False, ops)
        lin.weight = weight
        return lin

    def finalize(self) -> None:
        if self.weight.device.type != "cpu":
            return
        w = self.weight.data
        del self.weight
        self.weight = None
        self.weight_t = w.t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self)
