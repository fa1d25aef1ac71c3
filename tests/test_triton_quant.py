"""The GPU plan's int4 / int8 group-quantised matmul (ops/triton_quant.py) against x @ W.dequantize()^T in float32:
here on CPU tensors under Triton's interpreter (conftest sets TRITON_INTERPRET=1 without a GPU), on a GPU on CUDA
tensors.

Tolerance: the kernels multiply exact integers (code - zero) by x, sum in float32 and apply each group's scale to
its partial sum, so they differ from the reference only in float32 summation order and where the scale is applied:
within 1e-5 of sum |x| |W| per output. A half-dtype output is rounded once from that float32 sum, so it is also
allowed one unit in its last place of the reference's value."""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton", reason="Triton's wheel is not installed for this platform")

from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from tokenmill.executor.layers.linear import Linear  # noqa: E402
from tokenmill.executor.layers.quant import GroupWeight, pack_codes  # noqa: E402
from tokenmill.executor.ops import triton_quant as tq  # noqa: E402
from tokenmill.executor.ops.reference import ReferenceOps  # noqa: E402
from tokenmill.executor.ops.triton import TritonOps  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
EPS = {F32: 0.0, BF16: 2.0 ** -8, F16: 2.0 ** -11}      # one unit in the last place, relative


def _weight(N, K, bits, group, zero=True, perm=False, scale_dtype=F16, seed=0) -> GroupWeight:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (N, K), generator=g, dtype=torch.uint8)
    scale = (torch.rand(N, K // group, generator=g) * 0.02 + 0.005).to(scale_dtype)
    z = torch.randint(0, 1 << bits, (N, K // group), generator=g, dtype=torch.uint8) if zero else None
    p = torch.randperm(K, generator=g) if perm else None
    return GroupWeight(bits, pack_codes(codes, bits), scale, z, group, (N, K), p).to(torch.device(DEVICE))


def _x(M, K, dtype, seed=1) -> torch.Tensor:
    return torch.randn(M, K, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def _check(y: torch.Tensor, x: torch.Tensor, w: GroupWeight) -> None:
    assert y.dtype == x.dtype and y.shape == (x.shape[0], w.shape[0])
    W = w.dequantize()
    ref = x.float() @ W.T
    bound = 1e-5 * (x.float().abs() @ W.abs().T) + EPS[x.dtype] * ref.abs()
    err = (y.float() - ref).abs()
    assert (err <= bound).all(), f"worst {(err - bound).max().item():.3g} past the bound"


# bits x (K, group) x zero points, each at rows on both sides of the GEMV / GEMM switch and the GEMM's tile
# heights; N not a multiple of any block; perm, x dtype and scale dtype rotate with the case
# (K, group): the group all of K in the last two, 80 with a masked K tail
SHAPES = [(96, 32), (384, 128), (96, 96), (80, 80)]
ROWS = [1, 7, 17, 64]
CASES = [(bits, K, group, zero, M) for bits in (4, 8) for K, group in SHAPES for zero in (True, False) for M in ROWS]


@pytest.mark.parametrize("bits,K,group,zero,M", CASES)
def test_group_matmul_matches_dequantized(bits, K, group, zero, M):
    i = CASES.index((bits, K, group, zero, M))
    xd, sd = (F32, BF16, F16)[i % 3], (F16, BF16, F32)[i // 3 % 3]
    w = _weight(72 if i % 2 else 100, K, bits, group, zero, perm=i % 4 < 2, scale_dtype=sd, seed=i)
    x = _x(M, K, xd, seed=i)
    _check(tq.group_matmul(x, w), x, w)


@pytest.mark.parametrize("M", [3, 40])
@pytest.mark.parametrize("xd", [F32, BF16, F16])
@pytest.mark.parametrize("sd", [F32, BF16, F16])
def test_every_x_and_scale_dtype(sd, xd, M):
    w = _weight(72, 128, 4, 64, zero=M % 2 == 0, scale_dtype=sd, seed=M)
    x = _x(M, 128, xd, seed=M)
    _check(tq.group_matmul(x, w), x, w)


@pytest.mark.parametrize("bits", [4, 8])
def test_many_rows(bits):
    """300 rows: several GEMM tiles down M (64 rows each), the last one partial."""
    w = _weight(72, 128, bits, 32, zero=bits == 4, perm=True, scale_dtype=BF16)
    x = _x(300, 128, BF16)
    _check(tq.group_matmul(x, w), x, w)


@pytest.mark.parametrize("M", [1, 3, 20])
def test_split_k_and_one_program_agree(M, monkeypatch):
    """K split over programs (float32 partial sums added after) or each program looping over all of K: both match.
    One split is what a large N gets; several what a small one gets."""
    w = _weight(40, 512, 4, 32, seed=3)
    x = _x(M, 512, F32)
    def programs(n):
        monkeypatch.setattr(tq, "TARGET_PROGRAMS", n)
        monkeypatch.setattr(tq, "GEMV", {b: dataclasses.replace(c, programs=n) for b, c in tq.GEMV.items()})
    programs(1)
    one = tq.group_matmul(x, w)
    programs(10 ** 6)
    split = tq.group_matmul(x, w)
    _check(one, x, w)
    _check(split, x, w)


@pytest.mark.parametrize("M", [1, 3])
def test_gemv_configurations_agree(M):
    """The GEMV's K tile of one group, or of several whole ones (the default, and the GPU benchmark's sweep): each
    within bound."""
    w = _weight(72, 256, 4, 64, seed=5)
    x = _x(M, 256, BF16)
    for cfg in (tq.GemvConfig(4096, 264, 4, 64), tq.GemvConfig(16384, 10 ** 6, 8, 512), tq.GEMV[4]):
        _check(tq.launch(x, w.codes, w.scale, w.zero, w.bits, w.group, cfg), x, w)


def test_act_order_multiplies_x_in_the_weights_column_order():
    """perm: stored column j is x's column perm[j]; the same codes without perm meet x[:, perm]."""
    w = _weight(72, 128, 4, 32, perm=True, scale_dtype=F32)
    plain = GroupWeight(w.bits, w.codes, w.scale, w.zero, w.group, w.shape)
    x = _x(5, 128, F32)
    torch.testing.assert_close(tq.group_matmul(x, w), tq.group_matmul(x[:, w.perm], plain), rtol=0, atol=0)
    _check(tq.group_matmul(x, w), x, w)


def test_strided_and_batched_x():
    w = _weight(100, 96, 8, 32, scale_dtype=BF16)
    wide = _x(6, 96 + 20, BF16)
    x = wide[:, 12:12 + 96]                             # rows with a stride: a view into wider rows
    _check(tq.group_matmul(x, w), x, w)
    x3 = _x(6, 96, BF16).view(2, 3, 96)                 # leading dims kept
    y3 = tq.group_matmul(x3, w)
    assert y3.shape == (2, 3, 100)
    assert torch.equal(y3.view(6, 100), tq.group_matmul(x3.reshape(6, 96), w))


def test_zero_rows_launch_nothing():
    w = _weight(72, 96, 4, 32)
    assert tq.group_matmul(torch.empty(0, 96, dtype=BF16, device=DEVICE), w).shape == (0, 72)


def test_fits_name_the_limits():
    w = _weight(72, 128, 4, 32)
    assert tq.group_matmul_fits(w, BF16) is None
    assert tq.group_matmul_fits(_weight(72, 96, 8, 96, zero=False), F32) is None         # one group per row
    assert "float64" in tq.group_matmul_fits(w, torch.float64)
    bad = {
        "3-bit": GroupWeight(3, w.codes, w.scale, w.zero, 32, w.shape),
        "groups of 48": _weight(72, 96, 8, 48),                                          # not whole K tiles
        "K must be whole groups": GroupWeight(4, w.codes, w.scale, w.zero, 96, w.shape),
        "scales in torch.float64": GroupWeight(4, w.codes, w.scale.double(), w.zero, 32, w.shape),
        "odd K": GroupWeight(4, torch.zeros(4, 25, dtype=torch.uint8), torch.ones(4, 1), None, 49, (4, 49)),
    }
    for why, weight in bad.items():
        assert why in tq.group_matmul_fits(weight, BF16), why
        with pytest.raises(ValueError, match="group_matmul"):
            tq.group_matmul(_x(2, weight.shape[1], BF16), weight)
    with pytest.raises(ValueError, match="columns"):
        tq.group_matmul(_x(2, 64, BF16), w)


@pytest.mark.parametrize("zero", [True, False])
@pytest.mark.parametrize("M", [2, 20])
def test_custom_op_registration(zero, M):
    """torch's own checks: no mutations, the fake matches the real op, and it traces through AOT dispatch."""
    w = _weight(72, 96, 4, 32, zero=zero)
    torch.library.opcheck(torch.ops.tokenmill.group_matmul.default,
                          (_x(M, 96, BF16), w.codes, w.scale, w.zero, w.bits, w.group),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_traced_graph_has_one_node_per_matmul():
    w = _weight(72, 128, 4, 64, perm=True)

    def step(x):
        return tq.group_matmul(x, w)

    x = _x(3, 128, BF16)
    gm = make_fx(step, tracing_mode="real")(x)
    calls = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert calls.count("tokenmill.group_matmul.default") == 1
    assert all(c.startswith(("tokenmill.", "aten.index_select", "aten.view", "aten.reshape", "aten._unsafe_view"))
               for c in calls), calls
    x2 = _x(3, 128, BF16, seed=9)
    assert torch.equal(gm(x2), step(x2))


# ---- the plan's linear -------------------------------------------------------------------------------------------

def _linear(w: GroupWeight, ops, bias: bool) -> Linear:
    n, k = w.shape
    layer = Linear(k, n, bias, ops)
    layer.quant, layer.weight = w, None
    if bias:
        layer.bias = torch.nn.Parameter(torch.randn(n).to(BF16).to(DEVICE), requires_grad=False)
    return layer


def test_triton_ops_linear_routes_group_weights_to_the_kernel(monkeypatch):
    calls = []
    real = tq.group_matmul
    monkeypatch.setattr(tq, "group_matmul", lambda x, w: calls.append(w) or real(x, w))
    ops, ref = TritonOps(BF16), ReferenceOps()
    x = _x(3, 128, BF16)

    w = _weight(72, 128, 4, 64, perm=True, scale_dtype=BF16)
    layer = _linear(w, ops, bias=True)
    y = layer(x)
    assert calls == [w]
    expected = ref.linear(x, layer)
    assert torch.equal(y, real(x, w) + layer.bias)
    # the reference multiplies bfloat16 rows by bfloat16-rounded weights: near, not equal
    torch.testing.assert_close(y.float(), expected.float(), rtol=2 ** -7, atol=2e-2)

    # a weight the kernels do not take (groups of 48) and a float weight: the reference's GEMMs
    calls.clear()
    unfit = _weight(72, 96, 4, 48)
    assert tq.group_matmul_fits(unfit, BF16) is not None
    x96 = _x(3, 96, BF16)
    assert torch.equal(_linear(unfit, ops, bias=False)(x96), ref.linear(x96, _linear(unfit, ref, bias=False)))
    dense = Linear(96, 8, False, ops).to(DEVICE)
    torch.nn.init.normal_(dense.weight)
    assert torch.equal(dense(x96.float()), ref.linear(x96.float(), dense))
    assert calls == []
    assert "triton" in ops.describe()["linear"]


def test_reference_linear_takes_a_group_weight():
    """The oracle's own path (tiled dequantise + GEMM), on the weight's device."""
    w = _weight(72, 128, 8, 32, perm=True, scale_dtype=F32)
    x = _x(5, 128, F32)
    layer = _linear(w, ReferenceOps(), bias=False)
    torch.testing.assert_close(layer(x), x @ w.dequantize().T)


def test_triton_ops_linear_routes_fp8_weights_to_the_scaled_matmul():
    from tokenmill.executor.loader.quantize import quantize_fp8
    from tokenmill.executor.ops.fp8 import fp8_linear
    torch.manual_seed(0)
    with torch.device("meta"):
        lin = Linear(64, 48, True, TritonOps(F32))
    lin.quant, lin.weight = quantize_fp8(torch.randn(48, 64)).to(torch.device(DEVICE)), None
    lin.bias = torch.nn.Parameter(torch.randn(48).to(DEVICE))
    x = torch.randn(3, 64).to(DEVICE)
    assert torch.equal(lin(x), fp8_linear(x, lin.quant, lin.bias))
    # a shape the FP8 matmul does not take: the dequantised weight, exactly
    with torch.device("meta"):
        odd = Linear(64, 40, False, TritonOps(F32))
    odd.quant, odd.weight = quantize_fp8(torch.randn(40, 64)).to(torch.device(DEVICE)), None
    torch.testing.assert_close(odd(x), x @ odd.quant.dequantize().t())


# ---- FP8 activations (ops/triton_fp8.py) -------------------------------------------------------------------------

def _e4m3_edges() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints between neighbours (ties, rounded to even) and a float32 step either
    side of each midpoint, both signs: where a rounding on the bits could part from torch's cast."""
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    v = v[torch.isfinite(v) & (v >= 0)].unique().sort().values
    mid = (v[1:] + v[:-1]) / 2
    near = torch.cat([mid, mid.nextafter(torch.tensor(0.0)), mid.nextafter(torch.tensor(1e9))])
    pos = torch.cat([v, near]).clamp(max=448.0)
    return torch.cat([pos, -pos])


@pytest.mark.parametrize("xd", [F32, BF16, F16])
def test_fp8_quantize_rows_kernel_equals_torch_to_the_bit(xd):
    from tokenmill.executor.ops import fp8, triton_fp8
    g = torch.Generator().manual_seed(0)
    rows = []
    edges = _e4m3_edges()
    # a row whose maximum is 448: scale 1, so the edges meet the rounding as they are (float32 rows only)
    if xd == F32:
        rows.append(torch.cat([edges, torch.tensor([448.0])]))
    K = rows[0].numel() if rows else 1500
    rows += [torch.randn(K, generator=g) * torch.logspace(-6, 3, K), torch.zeros(K), -torch.rand(K, generator=g)]
    x = torch.stack(rows).to(xd).to(DEVICE)
    for pad in (x.shape[0], 16, 32):
        q, s = triton_fp8.quantize_rows(x, pad)
        q_ref, s_ref = fp8.quantize_rows(x, pad)
        assert q.shape == (pad, K) and s.shape == (pad, 1)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
        assert torch.equal(s, s_ref)
    torch.library.opcheck(torch.ops.tokenmill.fp8_quantize_rows.default, (x, 16),
                          test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(ValueError, match="fp8 activations"):
        triton_fp8.quantize_rows(x.double(), 16)


def test_fp8_linear_with_the_kernel_equals_torch_quantisation():
    from tokenmill.executor.loader.quantize import quantize_fp8
    from tokenmill.executor.ops import triton_fp8
    from tokenmill.executor.ops.fp8 import fp8_linear
    w = quantize_fp8(torch.randn(48, 64)).to(torch.device(DEVICE))
    for M in (1, 5, 17):
        x = _x(M, 64, BF16, seed=M)
        assert torch.equal(fp8_linear(x, w, quantize=triton_fp8.quantize_rows), fp8_linear(x, w))
