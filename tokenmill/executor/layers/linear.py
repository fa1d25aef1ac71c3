"""Linear and embedding layers whose weight is either float, laid out after loading for the device's fast GEMM
path, or quantised (layers/quant.py) with no float copy; the plan's ops compute them."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from tokenmill.executor.layers.quant import QuantWeight


class Linear(nn.Module):
    """y = x W^T + b. Loaded as W [out, in] (the checkpoint layout); `finalize()` on CPU keeps a float32 W^T [in, out]
    contiguous instead: small-row float32 GEMMs (decode batches) run several times faster from that layout with
    torch's CPU BLAS (BENCHMARKS.md). A quantised W lives in `quant` and the float weight is dropped."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ops):
        super().__init__()
        self.ops = ops
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.register_buffer("weight_t", None)
        self.quant: Optional[QuantWeight] = None
        # act order (a GPTQ desc_act checkpoint): the quantised weight's columns are the input's in this order
        self.in_perm: Optional[torch.Tensor] = None

    @classmethod
    def tied(cls, embed: "Embedding", ops) -> "Linear":
        """An LM head sharing the embeddings' weight [vocab, hidden], quantised or not."""
        with torch.device("meta"):
            lin = cls(embed.dim, embed.num, False, ops)
        if embed.quant is not None:
            lin.quant, lin.weight = embed.quant, None
        else:
            lin.weight = embed.weight
        return lin

    def finalize(self) -> None:
        # only float32 gains from [in, out]: torch's bfloat16 and float16 CPU GEMMs read [out, in] faster (float16
        # many times so)
        if self.quant is not None or self.weight.device.type != "cpu" or self.weight.dtype != torch.float32:
            return
        w = self.weight.data
        del self.weight
        self.weight = None
        self.weight_t = w.t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x if self.in_perm is None else x.index_select(-1, self.in_perm), self)


class Embedding(nn.Module):
    """Token embeddings [num, dim]: a float table, or quantised rows dequantised as they are looked up."""

    def __init__(self, num: int, dim: int, ops):
        super().__init__()
        self.ops, self.num, self.dim = ops, num, dim
        self.weight = nn.Parameter(torch.empty(num, dim))
        self.quant: Optional[QuantWeight] = None
        self.dtype = torch.float32      # of the rows a quantised table gives (the model's; set at load)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.ops.embedding(ids, self)
