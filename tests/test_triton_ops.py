"""The GPU plan's fused Triton kernels (ops/triton_kernels.py) against the plain torch reference: here on CPU tensors
under Triton's interpreter (conftest sets TRITON_INTERPRET=1 without a GPU), on a GPU on CUDA tensors.

float32 results may differ from torch's by the order of a reduction or a fused multiply-add (~1e-5 relative); a
bfloat16 result by at most one unit in the last place (one float32 op computed differently can move a rounding),
and most are exact. Each kernel is a custom op: traced, it is one node, and the trace replays its mutations."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton's wheel is not installed for this platform")

from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from tokenmill.executor.layers.rotary import RotaryEmbedding, apply_rotary  # noqa: E402
from tokenmill.executor.ops import triton_kernels as tk  # noqa: E402
from tokenmill.executor.ops.reference import ReferenceOps  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter's numpy warns where a float32 exp or a cast to float16 overflows to inf, as the kernels mean it to
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
REF = ReferenceOps()
EPS = 1e-6


def _randn(*shape, dtype=torch.float32, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape) * scale).to(dtype).to(DEVICE)


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of x's own dtype (bfloat16: 8 significant bits; float16: 11), in float32."""
    bits = {torch.bfloat16: 8, torch.float16: 11}[x.dtype]
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), torch.frexp(x.float()).exponent - bits)


def _close(actual: torch.Tensor, expected: torch.Tensor, exact_share: float = 0.0, atol: float = 1e-6) -> None:
    """float32: within 1e-5 relative (and atol); a half dtype: within one ulp, and at least exact_share of them
    exact."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=atol)
        return
    if actual.numel() == 0:
        return
    diff = (actual.float() - expected.float()).abs()
    worst = (diff / torch.maximum(_ulp(actual), _ulp(expected))).max().item()
    assert worst <= 1.0, f"{worst} ulps apart"
    exact = (actual == expected).float().mean().item()
    assert exact >= exact_share, f"only {exact:.3f} exact"


def _same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal, NaN where the other is NaN."""
    assert actual.dtype == expected.dtype
    assert torch.equal(actual.isnan(), expected.isnan())
    assert torch.equal(actual.nan_to_num(), expected.nan_to_num())


# ---- rms_norm ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 5, 17])
@pytest.mark.parametrize("H", [64, 96, 200])
def test_rms_norm_matches_reference(H, T, dtype):
    torch.manual_seed(T * 1000 + H)
    x, res, w = _randn(T, H, dtype=dtype, scale=3), _randn(T, H, dtype=dtype), _randn(H, dtype=dtype) * 0.5 + 1
    out, r = tk.rms_norm(x, None, w, EPS)
    expected, _ = REF.rms_norm(x, None, w, EPS)
    assert r is x
    _close(out, expected, exact_share=0.95)

    ref_res = res.clone()
    out, r = tk.rms_norm(x, res, w, EPS)
    expected, expected_res = REF.rms_norm(x, ref_res, w, EPS)
    assert r is res                                    # updated in place, as the reference does
    assert torch.equal(res, expected_res)              # one float32 add rounded once: exact in any dtype
    _close(out, expected, exact_share=0.95)


@pytest.mark.parametrize("case", ["gemma_float32_weight", "strided_rows", "float32_residual", "wide", "float16"])
def test_rms_norm_mixed_dtypes_and_layouts(case):
    """Gemma's (1 + w) in float32 over bfloat16 rows (rounded once, after the scaling); x a view with a row stride;
    a float32 residual stream under bfloat16 rows; a wide odd hidden size; float16."""
    torch.manual_seed(1)
    T, H, dtype, wdtype, rdtype = 5, 96, torch.bfloat16, torch.bfloat16, torch.bfloat16
    if case == "gemma_float32_weight":
        wdtype = torch.float32
    elif case == "float32_residual":
        rdtype = torch.float32
    elif case == "wide":
        H = 4099
    elif case == "float16":
        dtype = wdtype = rdtype = torch.float16
    x = _randn(T, H + 24, dtype=dtype, scale=2)[:, 8:8 + H] if case == "strided_rows" else _randn(T, H, dtype=dtype)
    w = 1 + _randn(H, dtype=wdtype) * 0.3
    res = _randn(T, H, dtype=rdtype)
    expected, expected_res = REF.rms_norm(x, res.clone(), w, EPS)
    out, r = tk.rms_norm(x, res, w, EPS)
    assert r is res and torch.equal(res, expected_res)
    _close(out, expected, exact_share=0.95)
    _close(tk.rms_norm(x, None, w, EPS)[0], REF.rms_norm(x, None, w, EPS)[0], exact_share=0.95)


# ---- rotary_write ------------------------------------------------------------------------------------------------

def _rotary_case(T, H, KV, D, dtype, cache_dtype, slots, pad=0, flat_tables=False, seed=0):
    """A fused qkv matrix (each row pad elements wider than q, k and v) with qk and v as views into it, rotary tables
    for random positions, NaN-poisoned caches; and what the reference leaves: the rotated qk and the caches after
    LayerKV-style index writes of the live rows."""
    torch.manual_seed(seed)
    qkv = _randn(T, (H + 2 * KV) * D + pad, dtype=dtype, scale=2)
    qk = qkv[:, :(H + KV) * D].view(T, H + KV, D)
    v = qkv[:, (H + KV) * D:(H + 2 * KV) * D].view(T, KV, D)
    rope = RotaryEmbedding(D, 10000.0, None, 4096, 4096)
    cos, sin = rope.tables(torch.randint(0, 4096, (T,)), dtype)
    if flat_tables:
        cos, sin = cos[:, 0], sin[:, 0]
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    slots = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    num_slots = 2 * T + 3
    k_cache = torch.full((num_slots, KV, D), float("nan"), dtype=cache_dtype, device=DEVICE)
    v_cache = k_cache.clone()

    rotated = apply_rotary(qk.clone(), cos if cos.dim() == 3 else cos[:, None], sin if sin.dim() == 3 else sin[:, None])
    ek, ev, live = k_cache.clone(), v_cache.clone(), slots >= 0
    ek[slots[live]] = rotated[live, H:].to(cache_dtype)
    ev[slots[live]] = v[live].to(cache_dtype)
    return (qkv, qk, v, cos, sin, k_cache, v_cache, slots), (rotated, ek, ev)


def _slots(T):
    """Distinct slots, scattered, every third row a padding row (-1)."""
    return [-1 if t % 3 == 1 else (7 * t + 2) % (2 * T + 3) for t in range(T)]


def _check_rotary(H, inputs, expected, strict_cache):
    qkv, qk, v, cos, sin, k_cache, v_cache, slots = inputs
    rotated, ek, ev = expected
    KV, D = v.shape[1:]
    qkv_before = qkv.clone()
    tk.rotary_write(qk, v, cos, sin, k_cache, v_cache, slots, H)
    _close(qk, rotated, exact_share=0.98)              # in place, in the qkv rows
    assert torch.equal(qkv[:, (H + KV) * D:], qkv_before[:, (H + KV) * D:])     # v and the rows' padding only read
    live = slots >= 0
    # the cache holds exactly the rotated k the kernel left in qk (and v), converted; every other slot keeps its NaN
    ek_own = torch.full_like(k_cache, float("nan"))
    ek_own[slots[live]] = qk[live, H:].to(k_cache.dtype)
    _same_bits(k_cache, ek_own)
    _same_bits(v_cache, ev)
    if strict_cache:
        _same_bits(k_cache, ek)


# GQA, MQA and MHA, head dims a power of two or not (80); each at 5 rows, and GQA-80 at 1 and 17 (the interpreter
# runs one program per row: a few rows keep it quick)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,heads", [(5, (4, 2, 32)), (5, (4, 2, 80)), (5, (4, 1, 64)), (5, (2, 1, 128)),
                                     (5, (8, 8, 16)), (1, (4, 2, 80)), (17, (4, 2, 80))],
                         ids=["gqa-32", "gqa-80", "mqa-64", "mqa-128", "mha-16", "gqa-80-1row", "gqa-80-17rows"])
def test_rotary_write_matches_reference(T, heads, dtype):
    H, KV, D = heads
    inputs, expected = _rotary_case(T, H, KV, D, dtype, dtype, _slots(T), pad=8, seed=T + D)
    _check_rotary(H, inputs, expected, strict_cache=dtype == torch.bfloat16 or DEVICE == "cpu")


@pytest.mark.parametrize("act,cache", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                       (torch.bfloat16, torch.float32), (torch.bfloat16, torch.float16),
                                       (torch.float16, torch.float16)])
def test_rotary_write_converts_to_the_cache_dtype(act, cache):
    inputs, expected = _rotary_case(6, 4, 2, 80, act, cache, _slots(6), flat_tables=True, seed=3)
    _check_rotary(4, inputs, expected, strict_cache=DEVICE == "cpu" or act != torch.float32)


def test_rotary_write_skips_padding_rows_and_keeps_other_slots():
    """All rows padding: nothing written anywhere, q/k still rotated."""
    inputs, expected = _rotary_case(4, 4, 2, 32, torch.float32, torch.float32, [-1] * 4)
    _check_rotary(4, inputs, expected, strict_cache=True)
    assert inputs[5].isnan().all() and inputs[6].isnan().all()


def test_stores_round_to_nearest_even():
    """float32 -> bfloat16 on store rounds to nearest, ties to even, as torch does (the interpreter's own conversion
    truncates): ties both ways, the largest finite values, infinities, NaN. (Not subnormals: the interpreter's
    store mangles bfloat16 subnormals whatever the kernel hands it; no activation is below 1e-38.)"""
    ties = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 1 + 2 ** -8 + 2 ** -20, 1 - 2 ** -9])
    special = torch.tensor([3.3895314e38, torch.finfo(torch.float32).max, float("inf"), float("-inf"), float("nan"),
                            2 ** -126 * 1.00390625, -(2 ** -125) * 1.0029296875, 0.1, -7.77, 65520.0, 1e-8])
    vals = torch.cat([ties, special])
    D = 32
    v = torch.zeros(1, 1, D)
    v[0, 0, :vals.numel()] = vals
    v[0, 0, vals.numel():] = torch.randn(D - vals.numel())
    for cache_dtype in (torch.bfloat16, torch.float16):
        qk = torch.randn(1, 2, D, device=DEVICE)
        cos = torch.ones(1, D, device=DEVICE)
        sin = torch.zeros(1, D, device=DEVICE)
        kc = torch.zeros(2, 1, D, dtype=cache_dtype, device=DEVICE)
        vc = torch.zeros_like(kc)
        tk.rotary_write(qk, v.to(DEVICE), cos, sin, kc, vc, torch.tensor([1], device=DEVICE), 1)
        _same_bits(vc[1, 0], v[0, 0].to(cache_dtype).to(DEVICE))


# ---- gated activations -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 5, 17])
@pytest.mark.parametrize("inter", [64, 96, 200])
@pytest.mark.parametrize("act", ["silu_mul", "gelu_tanh_mul"])
def test_gated_activations_match_reference(act, inter, T, dtype):
    torch.manual_seed(inter + T)
    gate_up = _randn(T, 2 * inter, dtype=dtype, scale=2.5)
    out = getattr(tk, act)(gate_up)
    _close(out, getattr(REF, act)(gate_up), exact_share=0.98)


@pytest.mark.parametrize("act", ["silu_mul", "gelu_tanh_mul"])
def test_gated_activations_take_strided_rows_and_float16(act):
    torch.manual_seed(2)
    wide = _randn(5, 2 * 150 + 10, dtype=torch.bfloat16, scale=3)
    gate_up = wide[:, 4:4 + 300]                   # a view: row stride 310
    _close(getattr(tk, act)(gate_up), getattr(REF, act)(gate_up), exact_share=0.98)
    half = _randn(5, 2 * 96, dtype=torch.float16, scale=2)
    _close(getattr(tk, act)(half), getattr(REF, act)(half), exact_share=0.98)


# ---- shapes, limits, tracing -------------------------------------------------------------------------------------

def test_zero_rows_launch_nothing():
    H, KV, D = 4, 2, 32
    x = torch.empty(0, 64, device=DEVICE)
    w = _randn(64)
    assert tk.rms_norm(x, None, w, EPS)[0].shape == (0, 64)
    assert tk.rms_norm(x, torch.empty_like(x), w, EPS)[0].shape == (0, 64)
    assert tk.silu_mul(torch.empty(0, 128, device=DEVICE)).shape == (0, 64)
    assert tk.gelu_tanh_mul(torch.empty(0, 128, dtype=torch.bfloat16, device=DEVICE)).dtype == torch.bfloat16
    kc = _randn(4, KV, D)
    before = kc.clone()
    tk.rotary_write(torch.empty(0, H + KV, D, device=DEVICE), torch.empty(0, KV, D, device=DEVICE),
                    torch.empty(0, 1, D, device=DEVICE), torch.empty(0, 1, D, device=DEVICE), kc, kc.clone(),
                    torch.empty(0, dtype=torch.int64, device=DEVICE), H)
    assert torch.equal(kc, before)


def test_fits_name_the_limits():
    assert tk.rms_norm_fits(4096, torch.bfloat16) is None
    assert tk.rms_norm_fits(4096, torch.bfloat16, torch.float32) is None
    assert "16384" in tk.rms_norm_fits(tk.MAX_HIDDEN + 1, torch.float32)
    assert "float64" in tk.rms_norm_fits(64, torch.float64)
    assert tk.rotary_write_fits(128, 128, torch.bfloat16, torch.float16) is None
    assert tk.rotary_write_fits(80, 80, torch.float32, torch.bfloat16) is None
    assert "partial" in tk.rotary_write_fits(128, 64, torch.bfloat16, torch.bfloat16)
    assert "256" in tk.rotary_write_fits(512, 512, torch.bfloat16, torch.bfloat16)
    assert "even" in tk.rotary_write_fits(33, 33, torch.float32, torch.float32)
    assert "float8" in tk.rotary_write_fits(64, 64, torch.bfloat16, torch.float8_e4m3fn)
    assert tk.act_mul_fits(torch.bfloat16) is None and tk.act_mul_fits(torch.int8) is not None
    with pytest.raises(ValueError, match="partial"):
        tk.rotary_write(_randn(1, 3, 64), _randn(1, 1, 64), _randn(1, 1, 32), _randn(1, 1, 32), _randn(2, 1, 64),
                        _randn(2, 1, 64), torch.zeros(1, dtype=torch.int64, device=DEVICE), 2)
    with pytest.raises(ValueError, match="H=2"):       # v with the wrong number of kv heads
        tk.rotary_write(_randn(1, 3, 64), _randn(1, 2, 64), _randn(1, 1, 64), _randn(1, 1, 64), _randn(2, 1, 64),
                        _randn(2, 1, 64), torch.zeros(1, dtype=torch.int64, device=DEVICE), 2)
    with pytest.raises(ValueError, match="weight"):
        tk.rms_norm(_randn(2, 64), None, _randn(32), EPS)
    with pytest.raises(ValueError, match="gate_up"):
        tk.silu_mul(_randn(2, 63))


def _rotary_args():
    qkv = _randn(3, 8 * 32)
    return (qkv[:, :6 * 32].view(3, 6, 32), qkv[:, 6 * 32:].view(3, 2, 32), _randn(3, 1, 32), _randn(3, 1, 32),
            _randn(7, 2, 32), _randn(7, 2, 32), torch.tensor([2, -1, 0], device=DEVICE), 4)


@pytest.mark.parametrize("op,args", [
    ("rms_norm", lambda: (_randn(3, 64), _randn(64), EPS)),
    ("rms_norm_add", lambda: (_randn(3, 64), _randn(3, 64), _randn(64), EPS)),
    ("silu_mul", lambda: (_randn(3, 96),)),
    ("gelu_tanh_mul", lambda: (_randn(3, 96, dtype=torch.bfloat16),)),
    ("rotary_write", lambda: _rotary_args()),
])
def test_custom_op_registration(op, args):
    """torch's own checks of a custom op: the schema's declared mutations are the only ones, the fake matches the
    real op, and it traces through AOT dispatch."""
    torch.library.opcheck(getattr(torch.ops.tokenmill, op).default, args(),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def _layer_step(qkv, cos, sin, k_cache, v_cache, slots, x, residual, w, gate_up):
    """A decoder layer's kernels in the order a layer calls them (a stand-in: each op's inputs are given)."""
    H, KV, D = 4, 2, 32
    qk = qkv[:, :(H + KV) * D].view(-1, H + KV, D)
    v = qkv[:, (H + KV) * D:].view(-1, KV, D)
    tk.rotary_write(qk, v, cos, sin, k_cache, v_cache, slots, H)
    h, residual = tk.rms_norm(x, residual, w, EPS)
    h0, _ = tk.rms_norm(h, None, w, EPS)
    return h0, tk.silu_mul(gate_up) + tk.gelu_tanh_mul(gate_up)


def test_traced_graph_has_one_node_per_kernel_and_replays_mutations():
    torch.manual_seed(4)
    T, H, KV, D = 5, 4, 2, 32

    def inputs():
        (qkv, _, _, cos, sin, kc, vc, slots), _ = _rotary_case(T, H, KV, D, torch.bfloat16, torch.bfloat16,
                                                               [3, -1, 0, 9, 5], seed=int(torch.randint(100, ())))
        return [qkv, cos, sin, kc, vc, slots, _randn(T, 64, dtype=torch.bfloat16),
                _randn(T, 64, dtype=torch.bfloat16), _randn(64, dtype=torch.bfloat16),
                _randn(T, 96, dtype=torch.bfloat16)]

    static = inputs()
    gm = make_fx(_layer_step, tracing_mode="real")(*static)
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    ops = [str(t) for t in calls if str(t).startswith("tokenmill.")]
    assert ops == ["tokenmill.rotary_write.default", "tokenmill.rms_norm_add.default", "tokenmill.rms_norm.default",
                   "tokenmill.silu_mul.default", "tokenmill.gelu_tanh_mul.default"]
    # nothing else but the views of qkv and the final add: no kernel's inside is traced
    assert all(str(t).startswith(("tokenmill.", "aten.slice", "aten.view", "aten.add")) for t in calls), calls

    # new values written into the same buffers (as a graph's static inputs are): the replay computes and mutates as
    # eager would
    for buf, new in zip(static, inputs()):
        buf.copy_(new)
    eager = [t.clone() for t in static]
    expected = _layer_step(*eager)
    got = gm(*static)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    for i in (0, 3, 4, 7):          # qkv (q and k rotated), the caches, the residual
        _same_bits(static[i], eager[i])
