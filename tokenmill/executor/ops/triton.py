"""The GPU's execution plan: the reference's GEMMs (cuBLAS through torch), with the fused Triton kernels
(ops/triton_kernels.py) for RMSNorm with the residual add and the gated activations. Rotary with the KV-cache write
is the attention backend's (attention/gpu.py), which owns the cache. Which kernel serves each op is decided once, at
prepare(), from the model's shapes and dtype; the rest stay the reference's."""
from __future__ import annotations

import logging
from typing import Optional

import torch

from tokenmill.executor.ops.reference import ReferenceOps

log = logging.getLogger("tokenmill")


class TritonOps(ReferenceOps):
    name = "triton"
    graph_safe = True

    def __init__(self, dtype: torch.dtype):
        from tokenmill.executor.ops import triton_kernels
        self.k = triton_kernels
        self.dtype = dtype
        self.norm_kernel = self.act_kernel = False

    def prepare(self, model) -> None:
        cfg = model.config
        why_norm = self.k.rms_norm_fits(cfg.hidden_size, self.dtype)
        why_act = self.k.act_mul_fits(self.dtype)
        self.norm_kernel, self.act_kernel = why_norm is None, why_act is None
        for op, why in (("rms_norm", why_norm), ("silu_mul", why_act)):
            if why is not None:
                log.info("%s runs on torch: the Triton kernel does not take %s", op, why)

    def rms_norm(self, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        # the model's rows [T, hidden]; per-head norms (q/k norm, [T, heads, D] views) stay the reference's
        if not self.norm_kernel or x.dim() != 2:
            return super().rms_norm(x, residual, weight, eps)
        return self.k.rms_norm(x, residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.k.silu_mul(gate_up) if self.act_kernel else super().silu_mul(gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.k.gelu_tanh_mul(gate_up) if self.act_kernel else super().gelu_tanh_mul(gate_up)

    def describe(self) -> dict[str, str]:
        d = super().describe()
        if self.norm_kernel:
            d["rms_norm"] = "triton (fused residual add)"
        if self.act_kernel:
            d["silu_mul"] = d["gelu_tanh_mul"] = "triton"
        d["rotary"] = "triton, fused with the KV-cache write where the attention backend is Triton's and the cache " \
                      "a float one (else torch)"
        return d
