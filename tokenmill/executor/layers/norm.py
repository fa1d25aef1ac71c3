from typing import Optional

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops, offset: float = 0.0):
        """offset: Gemma's norms scale by (offset + w), the checkpoint's w; folded into the weight by finalize()."""
        super().__init__()
        self.ops = ops
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def finalize(self) -> None:
        """Fold the offset in, kept in float32: transformers scales Gemma's norms in float32."""
        if self.offset:
            self.weight.data = self.offset + self.weight.data.float()
            self.offset = 0.0

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """Without residual: the normalised x. With residual (vLLM's fused form): adds x into residual in place
        and returns (normalised residual, residual), one pass over the row instead of an add and a norm."""
        out, residual_out = self.ops.rms_norm(x, residual, self.weight, self.eps)
        return (out, residual_out) if residual is not None else out
