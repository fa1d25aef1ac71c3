"""FP8 activations for the GPU plan's scaled matmul: each row of x quantised to e4m3 with its own scale in one Triton
launch (a pass for the row's absolute maximum, a pass to divide, clamp and round), where torch takes about eight.
Bit for bit what fp8.quantize_rows gives: the same float32 arithmetic (the scale a product with 1/448, as torch on a
GPU divides by a number; x over it a division, correctly rounded, div_rn), and the rounding to e4m3 done on the
bits, to nearest even, so that Triton's interpreter (whose own float8 cast misrounds at a binade's edge) and a GPU
agree with torch."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.executor.layers.quant import FP8_MAX

# The kernel's limits, declared once
DTYPES = (torch.float32, torch.bfloat16, torch.float16)     # x
BLOCK_K = 1024                                              # columns a step; K is any length


@triton.jit
def _e4m3_bits(v):
    """float32 v with |v| <= 448 as e4m3fn's bits (uint8), rounded to nearest even."""
    b = v.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = tl.abs(v)
    ab = a.to(tl.int32, bitcast=True)
    # normal (a >= 2^-6): keep 3 mantissa bits, nearest even; a carry moves into the exponent. Rebias 127 -> 7.
    r = ab + 0x7FFFF + ((ab >> 20) & 1)
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    # subnormal: a multiple of 2^-9, nearest even (8 of them is 2^-6, the smallest normal's code)
    t = a * 512.0
    i = t.to(tl.int32)
    f = t - i.to(tl.float32)
    i = i + ((f > 0.5) | ((f == 0.5) & ((i & 1) == 1))).to(tl.int32)
    return (tl.where(a >= 0.015625, normal, i) | sign).to(tl.uint8)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_xk, stride_qm,
                          FMAX: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program a row of q; rows at M and past (the matmul's padding) read as zeros."""
    row = tl.program_id(0).to(tl.int64)
    k_live = tl.where(row < M, K, 0)        # a padding row reads nothing
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_ptr + row * stride_xm + kk * stride_xk, mask=kk < k_live, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    s = tl.maximum(tl.max(amax, 0), 1e-12) * (1.0 / FMAX)
    tl.store(s_ptr + row, s)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_ptr + row * stride_xm + kk * stride_xk, mask=kk < k_live, other=0.0).to(tl.float32)
        v = tl.minimum(tl.maximum(tl.math.div_rn(v, s), -FMAX), FMAX)
        tl.store(q_ptr + row * stride_qm + kk, _e4m3_bits(v), mask=kk < K)


@torch.library.custom_op("tokenmill::fp8_quantize_rows", mutates_args=())
def quantize_rows(x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3fn [rows, K], float32 scales [rows, 1]) with rows >= M; the rows past M are zeros."""
    if x.dtype not in DTYPES:
        raise ValueError(f"fp8 activations from {x.dtype} (takes {', '.join(str(t) for t in DTYPES)})")
    M, K = x.shape
    q = torch.empty(rows, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_kernel[(rows,)](x, q.view(torch.uint8), s, M, K, x.stride(0), x.stride(1), q.stride(0),
                                       FMAX=FP8_MAX, BLOCK_K=min(BLOCK_K, triton.next_power_of_2(max(K, 16))),
                                       num_warps=4)
    return q, s


@quantize_rows.register_fake
def _(x, rows):
    return x.new_empty(rows, x.shape[1], dtype=torch.float8_e4m3fn), x.new_empty(rows, 1, dtype=torch.float32)
