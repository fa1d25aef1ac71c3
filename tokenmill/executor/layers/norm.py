from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.executor.layers import cpu_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """Without residual: the normalised x. With residual (vLLM's fused form): adds x into residual in place
        and returns (normalised residual, residual), one pass over the row instead of an add and a norm."""
        fused = cpu_ops.add_rms_norm(x, residual, self.weight, self.eps)
        if fused is not None:
            return fused if residual is not None else fused[0]
        if residual is not None:
            residual += x
            x = residual
        # normalise in float32 as transformers does (one fused op), then scale in the model's dtype
        out = self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)
        return (out, residual) if residual is not None else out
