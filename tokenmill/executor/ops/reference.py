"""The ops the model calls, in plain torch: the reference implementation (the oracle in tests) and the
interface every other implementation keeps. One implementation serves a model, chosen at load (ops/__init__.py)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tokenmill.executor.layers.rotary import apply_rotary


class ReferenceOps:
    name = "reference"
    kernels = None          # the CPU kernel library an implementation calls, if any (the attention backend's too)

    def prepare(self, model) -> None:
        """Load-time work on a loaded model (kernel layouts of its weights); none here."""

    def linear(self, x: torch.Tensor, layer) -> torch.Tensor:
        """y = x W^T + b for a layers.linear.Linear."""
        if layer.weight_t is None:
            return F.linear(x, layer.weight, layer.bias)
        if layer.bias is not None:
            return torch.addmm(layer.bias, x, layer.weight_t)
        return x @ layer.weight_t

    def rms_norm(self, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's fused form: with residual, residual += x in place and returns (norm(residual), residual);
        without, (norm(x), x)."""
        if residual is not None:
            residual += x
            x = residual
        # normalise in float32 as transformers does (one fused op), then scale in the model's dtype
        return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype), x

    def rotary(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """qk [T, heads, D] rotated by its token's position (cos, sin [T, 1, D]), "rotate half": returns the
        rotated heads (an implementation may rotate qk in place and return it)."""
        return apply_rotary(qk, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [T, 2 * inter], gate first."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(dim=-1)

    def decoder_layer(self, layer, x: torch.Tensor, residual: Optional[torch.Tensor], rope, backend,
                      meta) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer of a step (an implementation may run a whole layer as one kernel)."""
        return layer(x, residual, rope, backend, meta)

    def describe(self) -> dict[str, str]:
        """op -> what serves it, for `tokenmill info` and the server's start log."""
        ops = ("linear", "rms_norm", "rotary", "silu_mul", "argmax", "decoder_layer")
        return {**{op: "torch" for op in ops}, "attention": "torch (batched SDPA)"}
