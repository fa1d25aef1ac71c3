"""FP8 linear layers as vLLM's fp8 runs them: e4m3 weights with a scale per row, activations quantised to e4m3 per
token as they come (dynamic scales), one scaled matmul (torch._scaled_mm) accumulating in float32. Not exact by
design: the activations lose bits. The plan that cannot run it dequantises the weight instead (exact)."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from tokenmill.executor.layers.quant import FP8_MAX, Fp8Weight

# _scaled_mm's operands: both dimensions of each a multiple of 16
ALIGN = 16


def fp8_fits(w: Fp8Weight, device: torch.device) -> Optional[str]:
    """None when fp8_linear runs w on device, else why not."""
    n, k = w.shape
    if n % ALIGN or k % ALIGN:
        return f"a {n} x {k} matrix (FP8 matmuls take multiples of {ALIGN})"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        return f"compute capability {major}.{minor} (FP8 matmuls need 8.9 or later)"
    return None


def quantize_rows(x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3fn [rows, K], float32 scales [rows, 1]): each row over its absolute maximum, the rows past M
    zeros (the matmul's padding). The reference that ops/triton_fp8.py's kernel equals bit for bit."""
    xf = x.float()
    if rows > x.shape[0]:
        xf = torch.nn.functional.pad(xf, (0, 0, 0, rows - x.shape[0]))
    # times the reciprocal: what torch does on a GPU for a division by a number, written so on every device
    sx = xf.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-12) * (1.0 / FP8_MAX)
    return (xf / sx).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), sx


Quantizer = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: Optional[torch.Tensor] = None,
               quantize: Quantizer = quantize_rows) -> torch.Tensor:
    """x [M, K] @ W^T with x quantised per row to e4m3 by `quantize` (torch's, or the GPU plan's one kernel); the
    output in x's dtype."""
    m = x.shape[0]
    xq, sx = quantize(x, m + (-m % ALIGN))
    sw = w.scale.float().reshape(1, -1)
    if sw.numel() == 1:
        sw = sw.expand(1, w.shape[0]).contiguous()
    # row-wise scales need a bfloat16 output
    y = torch._scaled_mm(xq, w.codes.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)[:m]
    y = y.to(x.dtype)
    return y if bias is None else y + bias
