"""graph_check: the CPU stand-in for a CUDA graph capture's rules, and the op counter."""
from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.executor.graph_check import GraphSafetyError, GraphSafetyMode, OpCounter, Violation


@torch.library.custom_op("tokenmill_test::scale_rows_", mutates_args=("buf",))
def scale_rows_(buf: torch.Tensor, rows: torch.Tensor, factor: float) -> None:
    """A custom op writing into a static buffer (its body would be a kernel)."""
    buf.index_copy_(0, rows, buf.index_select(0, rows) * factor)


class Step:
    """A decode step's static state: weights, a KV-like cache, input and output buffers, all made before capture."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.w = torch.randn(16, 8, generator=g)
        self.emb = torch.randn(32, 8, generator=g)
        self.cache = torch.zeros(64, 8)
        self.ids = torch.tensor([3, 7, 1, 30])            # static input buffers
        self.slots = torch.tensor([5, 9, 12, 40])
        self.out = torch.zeros(4, dtype=torch.long)       # static output buffer

    def static(self):
        return [self.w, self.emb, self.cache, self.ids, self.slots, self.out]

    def clean(self) -> None:
        x = self.emb.index_select(0, self.ids)            # [4, 8]
        self.cache.index_put_((self.slots,), x)           # write this step's rows into the cache
        scale_rows_(self.cache, self.slots, 0.5)
        kv = self.cache.index_select(0, self.slots)
        scores = torch.softmax(x @ kv.t() * 0.125, dim=-1)
        h = (scores @ kv) @ self.w.t()                    # [4, 16]
        h = torch.where(h > 0, h, 0.0) + 2.0
        self.out.copy_(h.argmax(dim=-1))


def _line_of(fn, marker: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if marker in line)


def _run(fn, static, grad_mode=torch.no_grad, **kw) -> GraphSafetyMode:
    with grad_mode(), GraphSafetyMode(static, "cpu", **kw) as mode:
        fn()
    return mode


# under no_grad composite ops (linear, matmul, to, item) reach a dispatch mode decomposed, under inference_mode whole
GRAD_MODES = pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])


@GRAD_MODES
def test_clean_step_passes(grad_mode):
    s = Step()
    before = s.cache.clone()
    mode = _run(s.clean, s.static(), grad_mode)
    mode.check()
    assert mode.ok and mode.violations == []
    assert not torch.equal(before, s.cache)              # the step ran: the cache took its rows


@GRAD_MODES
def test_planted_item_is_caught_and_names_its_line(grad_mode):
    s = Step()

    def step():
        x = s.emb.index_select(0, s.ids)
        n = x.sum().item()      # planted
        s.out.fill_(int(n > 0))

    mode = _run(step, s.static(), grad_mode)
    assert [v.kind for v in mode.violations] == ["host_sync"]
    v = mode.violations[0]
    assert v.op == "Tensor.item"
    assert f"test_graph_check.py:{_line_of(step, '# planted')}" in v.where and "item()" in v.where
    with pytest.raises(GraphSafetyError, match="Tensor.item") as err:
        mode.check()
    assert isinstance(err.value, RuntimeError) and err.value.violations == mode.violations


@GRAD_MODES
def test_scalar_conversions_are_host_syncs(grad_mode):
    s = Step()

    def step():
        x = s.emb.index_select(0, s.ids)
        if bool(x[0, 0] > 0):
            pass
        float(x[1, 1])
        int(s.ids[0])
        torch.equal(x, x)

    mode = _run(step, s.static(), grad_mode)
    assert [v.kind for v in mode.violations] == ["host_sync"] * 4
    assert mode.violations[-1].op == "aten.equal"


def test_tolist_numpy_are_caught_and_unpatched_after():
    s = Step()
    originals = {k: torch.Tensor.__dict__.get(k) for k in ("tolist", "numpy", "__array__", "item")}
    got = {}

    def step():
        got["list"] = s.ids.tolist()
        got["array"] = np.asarray(s.slots)

    mode = _run(step, s.static())
    assert got["list"] == [3, 7, 1, 30] and got["array"].tolist() == [5, 9, 12, 40]
    assert [(v.kind, v.op) for v in mode.violations] == [("python_read", "Tensor.tolist"),
                                                         ("python_read", "Tensor.__array__")]
    assert {k: torch.Tensor.__dict__.get(k) for k in originals} == originals
    assert s.ids.tolist() == [3, 7, 1, 30]              # outside the mode: nothing recorded
    assert len(mode.violations) == 2


def test_tensor_from_python_values_is_caught():
    s = Step()

    def step():
        rows = torch.tensor([1, 2])
        s.out[:2].copy_(s.ids.index_select(0, rows))

    mode = _run(step, s.static())
    assert [(v.kind, v.op) for v in mode.violations] == [("python_value", "aten.lift_fresh")]
    assert "torch.tensor([1, 2])" in mode.violations[0].where


def test_python_scalar_tensor_allowed_on_request():
    s = Step()

    def step():
        s.cache.mul_(torch.tensor(2.0))

    assert [v.kind for v in _run(step, s.static()).violations] == ["python_value"]
    assert _run(step, s.static(), allow_python_scalars=True).ok


@GRAD_MODES
def test_tensor_made_outside_and_read_inside_is_caught(grad_mode):
    s = Step()
    bias = torch.randn(8)                                 # made before the step, not declared static
    scale = torch.tensor(0.5)                             # a 0-dim CPU scalar: a value, fine
    table = torch.randn(32, 8)

    def step():
        x = s.emb.index_select(0, s.ids) + bias
        x = x * scale + bias                              # the same storage is reported once
        x = x + table.to(torch.float64)[s.ids].float()    # read through a conversion that copies
        s.cache[:4].copy_(x)

    mode = _run(step, s.static(), grad_mode)
    assert [(v.kind, v.op) for v in mode.violations] == [("outside_tensor", "aten.add"),
                                                         ("outside_tensor", mode.violations[1].op)]
    assert mode.violations[1].op in ("aten._to_copy", "aten.to")
    assert "(8,)" in mode.violations[0].reason and "(32, 8)" in mode.violations[1].reason
    assert _run(step, s.static() + [bias, table], grad_mode).ok          # declared static: fine
    assert _run(step, [nn.Module(), s.static(), {"b": bias, "t": (table,)}], grad_mode).ok


def test_module_parameters_and_buffers_are_static():
    lin = nn.Linear(8, 4)
    lin.register_buffer("shift", torch.ones(4))
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert _run(lambda: lin(x) + lin.shift, [lin, x]).ok
        mode = _run(lambda: lin(x) + lin.shift, [x])
    assert {v.kind for v in mode.violations} == {"outside_tensor"} and len(mode.violations) == 3


def test_data_dependent_shapes_are_caught():
    s = Step()
    mask = s.ids > 2

    def step():
        m = s.ids > 2
        s.ids[m]                                          # index by a mask
        torch.nonzero(s.ids)
        torch.unique(s.ids)
        torch.repeat_interleave(s.slots[:2] % 3)          # size = sum of repeats
        torch.repeat_interleave(s.slots[:2] % 3, output_size=2)   # size given: fine
        s.ids.masked_select(m)
        s.ids[s.slots % 4]                                # index by a long tensor: fine

    mode = _run(step, s.static() + [mask])
    assert [(v.kind, v.op) for v in mode.violations] == [
        ("dynamic_shape", "aten.index"), ("dynamic_shape", "aten.nonzero"), ("dynamic_shape", "aten._unique2"),
        ("dynamic_shape", "aten.repeat_interleave"), ("dynamic_shape", "aten.masked_select")]


@GRAD_MODES
def test_other_device_allocation_and_host_copy(grad_mode):
    w = torch.empty(4, 4, device="meta")                  # a stand-in for a device: not the CPU

    def step():
        y = w @ w                                         # on the step's device: fine
        torch.zeros(3)                                    # a CPU allocation in a "meta" step
        y.cpu()                                           # a copy to the host

    with grad_mode(), GraphSafetyMode([w], "meta") as mode:
        with pytest.raises(NotImplementedError):          # meta tensors have no data to copy
            step()
    assert [v.kind for v in mode.violations] == ["other_device", "host_copy"]
    assert mode.violations[0].op == "aten.zeros" and mode.violations[1].op in ("aten._to_copy", "aten.to")


def test_strict_raises_at_the_first_violation():
    s = Step()
    reached = []

    def step():
        s.ids.sum().item()
        reached.append(True)

    with pytest.raises(GraphSafetyError) as err, GraphSafetyMode(s.static(), strict=True):
        step()
    assert not reached and len(err.value.violations) == 1
    assert isinstance(err.value.violations[0], Violation)
    assert "item" not in torch.Tensor.__dict__            # unpatched on the way out


# ---- OpCounter --------------------------------------------------------------------------------------------------

class MLP(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        h = self.up(x)                                    # t (a view) + addmm
        return self.down(F.silu(h) * h)                   # silu, mul, t + addmm


def test_op_counter_mlp():
    mlp, x = MLP(), torch.randn(3, 8)
    with torch.no_grad(), OpCounter() as c:
        y = mlp(x).view(-1).t()                           # views: not counted
    assert y.shape == (24,)
    assert c.total == 4
    assert c.counts == {"aten.addmm": 2, "aten.silu": 1, "aten.mul": 1}


def test_op_counter_under_inference_mode():
    mlp, x = MLP(), torch.randn(3, 8)
    with torch.inference_mode(), OpCounter() as c:
        y = mlp(x).reshape(-1)                            # reshape of a contiguous tensor: a view
        y.to(torch.float32)                               # no conversion: nothing
        y.to(torch.float64)                               # a conversion: one copy
        y.view(3, 8).t().reshape(-1)                      # reshape that must copy: one
    assert c.counts == {"aten.linear": 2, "aten.silu": 1, "aten.mul": 1, "aten.to": 1, "aten.reshape": 1}


def test_op_counter_per_layer_and_custom_op():
    model = nn.Sequential(MLP(), MLP())
    buf, rows, x = torch.ones(4, 8), torch.tensor([0, 2]), torch.randn(3, 8)
    with torch.no_grad(), OpCounter(list(model)) as c:
        y = model(x)
        scale_rows_(buf, rows, 2.0)                       # one op, whatever its body does
        torch.empty(5)                                    # an allocation: not counted
        y.sum()
    assert c.per_layer() == [4, 4]
    assert c.outside() == 2 and c.outside_counts == {"tokenmill_test.scale_rows_": 1, "aten.sum": 1}
    assert c.total == 10
    assert buf[0, 0] == 2 and buf[1, 0] == 1
    with torch.no_grad():
        model(torch.randn(3, 8))                          # hooks gone after exit
    assert c.total == 10


def test_modes_nest():
    s = Step()
    with torch.no_grad(), OpCounter() as c, GraphSafetyMode(s.static()) as mode:
        s.clean()
    assert mode.ok and c.total > 5 and c.counts["tokenmill_test.scale_rows_"] == 1
