"""The batched LoRA shrink-expand kernels (ops/triton_lora.py) against a plain torch loop over the rows, under
Triton's interpreter on CPU tensors (on a GPU, on CUDA tensors): mixed slots with rows that have none (-1), zero and
one row, widths and ranks that are not powers of two, y as a column slice of a wider output; a hypothesis test that
every row gets its own slot's delta and only it; the limits; one traced node.

Tolerances: float32 within 1e-5 relative (the sums run in another order). A half dtype against the same sum in
float32 from the same inputs, rounded once: within one unit in the last place (a float32 sum in another order can
move a rounding), most entries exact; and against torch computing in the dtype itself (which rounds x @ A before
the second product) only loosely, as the kernel keeps x @ A in float32."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():     # before triton is imported: its interpreter runs the kernels on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="Triton's wheel is not installed for this platform")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from tests.test_triton_ops import _close as close  # noqa: E402
from tokenmill.executor.ops import triton_lora as tl_lora  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def _case(T: int, IN: int, OUT: int, R: int, S: int, dtype: torch.dtype, seed: int = 0):
    """x, y, a, b on DEVICE (the sizes of a real adapter's scaled delta: about y's)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, IN, generator=g)
    y = torch.randn(T, OUT, generator=g)
    a = torch.randn(S, IN, R, generator=g) / IN ** 0.5
    b = torch.randn(S, R, OUT, generator=g) / R ** 0.5
    return tuple(t.to(dtype).to(DEVICE) for t in (x, y, a, b))


def _reference(x, y, a, b, row_slot, compute_dtype=torch.float32) -> torch.Tensor:
    """A new y: row by row, y[t] + (x[t] @ a[s]) @ b[s] in compute_dtype for s = row_slot[t] >= 0, rounded to y's
    dtype; rows with s < 0 copied."""
    out = y.clone()
    for t, s in enumerate(row_slot.tolist()):
        if s >= 0:
            xt, at, bt, yt = (v.to(compute_dtype) for v in (x[t], a[s], b[s], y[t]))
            out[t] = (yt + (xt @ at) @ bt).to(y.dtype)
    return out


def _close(actual: torch.Tensor, expected: torch.Tensor, exact_share: float = 0.9) -> None:
    """test_triton_ops' closeness (one ulp in a half dtype), with float32 sums of a few hundred terms' atol."""
    close(actual, expected, exact_share, atol=1e-5)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """x's bits as integers (-0.0 is not 0.0)."""
    return x.view({4: torch.int32, 2: torch.int16}[x.element_size()])


def _slots(values, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("slots", [[0, -1, 2, 1, 2, -1, 0], [1], [-1], []], ids=["mixed", "one", "one_none", "zero"])
def test_matches_a_loop_over_the_rows(dtype, slots):
    """IN=72, OUT=200, R=24 over S=3 slots: none a power of two; y updated in place, -1 rows bit for bit as they
    were."""
    T, IN, OUT, R, S = len(slots), 72, 200, 24, 3
    x, y, a, b = _case(T, IN, OUT, R, S, dtype, seed=T)
    y[:, :3] = -0.0                     # a store of y + 0 into a row without a slot would turn these into +0.0
    row_slot = _slots(slots)
    before = y.clone()
    expected = _reference(x, before, a, b, row_slot)
    ptr = y.data_ptr()
    assert tl_lora.lora_shrink_expand(x, y, a, b, row_slot) is None
    assert y.data_ptr() == ptr
    _close(y, expected)
    for t, s in enumerate(slots):
        if s < 0:
            assert torch.equal(_bits(y[t]), _bits(before[t]))
        else:
            assert not torch.equal(y[t], before[t])
    if dtype != torch.float32 and T:
        # torch in the dtype itself rounds x @ a (and the product) before the add: a few ulps of the delta apart
        in_dtype = _reference(x, before, a, b, row_slot, compute_dtype=dtype)
        torch.testing.assert_close(y, in_dtype, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("R", [1, 8, 100, 256])
def test_ranks_widths_and_int64_slots(R):
    """Every rank up to the limit (several blocks of R in both kernels past 64), a wide IN (several shrink steps),
    an OUT over several expand programs, int64 slots."""
    T, IN, OUT, S = 4, 300, 600, 2
    x, y, a, b = _case(T, IN, OUT, R, S, torch.float32, seed=R)
    row_slot = _slots([1, 0, -1, 1], torch.int64)
    expected = _reference(x, y, a, b, row_slot)
    tl_lora.lora_shrink_expand(x, y, a, b, row_slot)
    _close(y, expected)


def test_y_a_column_slice_of_a_wider_output():
    """y a view into a merged layer's output (a row stride wider than its columns, an offset): only its columns
    change; x likewise a view with a row stride."""
    T, IN, OUT, R, S = 5, 40, 48, 16, 2
    x_wide, full, a, b = _case(T, IN + 8, 3 * OUT, R, S, torch.bfloat16, seed=7)
    x = x_wide[:, 8:]
    a = a[:, :IN].contiguous()
    b = b[..., :OUT].contiguous()
    row_slot = _slots([1, -1, 0, 0, 1])
    before = full.clone()
    expected = _reference(x, full[:, OUT:2 * OUT], a, b, row_slot)
    tl_lora.lora_shrink_expand(x, full[:, OUT:2 * OUT], a, b, row_slot)
    _close(full[:, OUT:2 * OUT], expected)
    assert torch.equal(full[:, :OUT], before[:, :OUT]) and torch.equal(full[:, 2 * OUT:], before[:, 2 * OUT:])


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_each_row_gets_its_own_slot(data):
    """Random row -> slot assignments over slots whose deltas are easy to tell apart: every row with a slot moved by
    exactly its slot's delta (as computed alone), every -1 row unchanged bit for bit."""
    S = data.draw(st.integers(1, 4), label="S")
    T = data.draw(st.integers(0, 9), label="T")
    IN = data.draw(st.integers(1, 40), label="IN")
    OUT = data.draw(st.integers(1, 70), label="OUT")
    R = data.draw(st.integers(1, 20), label="R")
    slots = data.draw(st.lists(st.integers(-1, S - 1), min_size=T, max_size=T), label="slots")
    x, y, a, b = _case(T, IN, OUT, R, S, torch.float32, seed=data.draw(st.integers(0, 2 ** 16), label="seed"))
    b = b + torch.arange(S, dtype=b.dtype, device=DEVICE)[:, None, None] * 10    # slot s's delta ~ 10 s * sum(h)
    row_slot = _slots(slots)
    before = y.clone()
    tl_lora.lora_shrink_expand(x, y, a, b, row_slot)
    for t, s in enumerate(slots):
        if s < 0:
            assert torch.equal(_bits(y[t]), _bits(before[t])), f"row {t} without a slot changed"
            continue
        own = (x[t] @ a[s]) @ b[s]
        torch.testing.assert_close(y[t] - before[t], own, rtol=1e-4, atol=1e-4, msg=f"row {t}, slot {s}")
        for other in range(S):
            delta = (x[t] @ a[other]) @ b[other]
            if other != s and (delta - own).abs().max() > 1e-2:
                assert not torch.allclose(y[t] - before[t], delta, rtol=1e-4, atol=1e-4)


def test_zero_rows_launch_nothing(monkeypatch):
    """T == 0 returns before any launch (a kernel that ran would fail here)."""
    def fail(*args, **kwargs):
        raise AssertionError("launched")
    for k in ("_lora_shrink_kernel", "_lora_expand_kernel"):
        monkeypatch.setattr(tl_lora, k, type("K", (), {"__getitem__": lambda self, grid: fail})())
    x, y, a, b = _case(0, 8, 8, 4, 2, torch.float32)
    tl_lora.lora_shrink_expand(x, y, a, b, _slots([]))
    assert y.shape == (0, 8)


def test_limits():
    assert tl_lora.lora_fits(torch.bfloat16, 4096, 256) is None
    assert tl_lora.lora_fits(torch.float16, 1, 1) is None
    assert "rank columns" in tl_lora.lora_fits(torch.float32, 4096, tl_lora.MAX_RANK_COLS + 1)
    assert "rank columns" in tl_lora.lora_fits(torch.float32, 4096, 0)
    assert "input features" in tl_lora.lora_fits(torch.float32, tl_lora.MAX_IN_FEATURES + 1, 16)
    assert "float64" in tl_lora.lora_fits(torch.float64, 64, 16)
    x, y, a, b = _case(2, 8, 8, 4, 2, torch.float32)
    row_slot = _slots([0, 1])
    with pytest.raises(ValueError, match="rank columns"):
        tl_lora.lora_shrink_expand(x, y, *_case(2, 8, 8, 300, 2, torch.float32)[2:], row_slot)
    with pytest.raises(ValueError, match="mixed dtypes"):
        tl_lora.lora_shrink_expand(x, y.bfloat16(), a, b, row_slot)
    with pytest.raises(ValueError, match="row_slot"):
        tl_lora.lora_shrink_expand(x, y, a, b, row_slot.to(torch.int16))
    with pytest.raises(ValueError, match="disagree"):
        tl_lora.lora_shrink_expand(x, y, a, b[:, :3], row_slot)
    with pytest.raises(ValueError, match="contiguous"):
        tl_lora.lora_shrink_expand(x, y.t().contiguous().t(), a, b, row_slot)


def test_traced_as_one_node():
    """make_fx sees one lora_shrink_expand node, its mutation of y replayed (a copy_ back into y)."""
    x, y, a, b = _case(3, 16, 24, 8, 2, torch.float32)
    row_slot = _slots([1, -1, 0])

    def step(x, y, a, b, row_slot):
        tl_lora.lora_shrink_expand(x, y, a, b, row_slot)
        return y

    gm = make_fx(step)(x, y.clone(), a, b, row_slot)
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "lora_shrink_expand" in str(n.target)]
    assert len(calls) == 1
    expected = _reference(x, y, a, b, row_slot)
    out = gm(x, y, a, b, row_slot)
    _close(out, expected)
    _close(y, expected)
