"""The int8 route of the 32-wide block matmul (csrc/qmatmul_int8.c): for Q4_0, Q4_1 and Q8_0 weights and up to
TM_QMATMUL_INT8_MAX_ROWS rows, x is rounded to int8 per 32 as llama.cpp's Q8_0/Q8_1 do. Shown in every x86 variant
this CPU runs: the result equals the dequantised weights times the rounded x to float32 rounding, a row's result
does not depend on the rows beside it (the bits a verification step gives each row are a one-row step's), and
int8_activations=False keeps the float route."""
from __future__ import annotations

import pytest
import torch

from tests.test_gblocks import within_rounding
from tokenmill.executor.kernels import load, runnable_variants
from tokenmill.executor.layers.quant import PackedWeight
from tokenmill.executor.ops import CpuKernelOps

INT8_VARIANTS = [v for v in runnable_variants() if v in ("avx512", "avx2")]
pytestmark = pytest.mark.skipif(not INT8_VARIANTS, reason="the int8 route is written for x86's AVX2 and up")

# Blocks past whole groups (16 a group in avx512, 8 in avx2): K = 576, 608 and 32 leave 2, 3 and 1, a tail taken as
# the codes lie; K = 896 and 480 leave 12 and 15 in avx512 (4 and 7 in avx2), a partial group where too many for that
SHAPES = [(37, 576), (16, 608), (5, 32), (9, 896), (7, 480), (64, 1536)]


def weight(kind: str, n: int, k: int, gen: torch.Generator) -> PackedWeight:
    nb = k // 32
    scale = torch.rand(n, nb, generator=gen) * 0.02 + 0.001
    if kind == "q8_0":   # -128 too: a file may hold it, and |code| must not wrap
        codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
        return PackedWeight(8, codes, scale, None, (n, k))
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    offset = -8 * scale if kind == "q4_0" else -8 * scale + torch.randn(n, nb, generator=gen) * 0.002
    return PackedWeight(4, codes, scale, offset, (n, k))


def rounded_x(rows: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """x whose rounding to int8 per 32 is unambiguous (each value within 0.3 of a code, one code at +-127 in every
    block), and that rounding: q * max|x| / 127."""
    q = torch.randint(-126, 127, (rows, k // 32, 32), generator=gen).float()
    q[..., 0] = torch.where(torch.rand(rows, k // 32, generator=gen) < 0.5, -127.0, 127.0)
    step = torch.rand(rows, k // 32, 1, generator=gen) * 0.05 + 0.01
    jitter = (torch.rand(q.shape, generator=gen) - 0.5) * 0.6
    jitter[..., 0] = 0
    x = ((q + jitter) * step).view(rows, k)
    dx = x.view(rows, k // 32, 32).abs().amax(-1, keepdim=True) / 127
    return x, (q * dx).view(rows, k)


@pytest.mark.parametrize("isa", INT8_VARIANTS)
@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0"])
def test_int8_route_equals_rounded_x_times_dequantised(isa: str, kind: str) -> None:
    gen = torch.Generator().manual_seed(3)
    ops = CpuKernelOps(load(isa), torch.float32, int8_activations=True)
    for n, k in SHAPES:
        w = weight(kind, n, k, gen)
        want_w = w.dequantize()
        for rows in (1, 3, 4, 9, 16):
            x, xr = rounded_x(rows, k, gen)
            y = ops.qmatmul(x, w)
            within_rounding(y, xr, want_w)
            assert not torch.allclose(y, x @ want_w.t(), rtol=0, atol=1e-6)    # x was really rounded


@pytest.mark.parametrize("isa", INT8_VARIANTS)
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_int8_route_gives_each_row_the_bits_of_a_one_row_call(isa: str, kind: str) -> None:
    gen = torch.Generator().manual_seed(4)
    ops = CpuKernelOps(load(isa), torch.float32, int8_activations=True)
    limit = ops.kernels.limits["TM_QMATMUL_INT8_MAX_ROWS"]
    for n, k in SHAPES:
        w = ops._register(weight(kind, n, k, gen))
        x = torch.randn(limit, k, generator=gen)
        alone = torch.cat([ops.qmatmul(x[r:r + 1].contiguous(), w) for r in range(limit)])
        for rows in range(2, limit + 1):
            assert torch.equal(ops.qmatmul(x[:rows].contiguous(), w), alone[:rows]), (n, k, rows)


@pytest.mark.parametrize("isa", INT8_VARIANTS)
def test_float_route_without_int8_activations(isa: str) -> None:
    """int8_activations=False: x stays float32, so the product is the dequantised one to float32 rounding."""
    gen = torch.Generator().manual_seed(5)
    ops = CpuKernelOps(load(isa), torch.float32, int8_activations=False)
    w = weight("q4_1", 37, 576, gen)
    for rows in (1, 4, 16):
        x = torch.randn(rows, 576, generator=gen)
        within_rounding(ops.qmatmul(x, w), x, w.dequantize())
