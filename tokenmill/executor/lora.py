"""LoRA on the runner's side: each adapted projection holds every slot's A and B stacked, and adds each row's own
adapter's product to the base output (the plan's batched shrink-expand, ops.lora). No merged copy of a weight exists;
the base weights stay as they are (float or quantised). The runner assigns the step's adapters to slots (LoRASlots)
and says each row's slot (LoRAStep) before the forward pass."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional

import torch
from torch import nn

from tokenmill.config import LoRAConfig
from tokenmill.executor.layers.linear import Linear
from tokenmill.lora.adapter import LoRAAdapter, module_shapes


class LoRAStep:
    """The step's mapping of rows to slots, in the form the plan's lora() reads (None: no row has an adapter);
    shared by every adapted projection of a model."""

    def __init__(self):
        self.mapping: Any = None


class LoRALinear(nn.Module):
    """A projection with adapters: the base Linear's output plus, for each row with an adapter, (x A) B of that
    row's slot. A fused projection (q/k/v, gate/up) keeps its shards' ranks side by side in A's columns and writes
    each shard's B into its own output columns."""

    def __init__(self, base: Linear, layer_idx: int, in_features: int, shards: tuple[tuple[str, int], ...],
                 config: LoRAConfig, step: LoRAStep, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.base, self.layer_idx, self.shards, self.step = base, layer_idx, shards, step
        self.rank = config.max_lora_rank
        cols, out = len(shards) * self.rank, sum(n for _, n in shards)
        self.register_buffer("a", torch.zeros(config.max_loras, in_features, cols, dtype=dtype, device=device))
        self.register_buffer("b", torch.zeros(config.max_loras, cols, out, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        m = self.step.mapping
        return y if m is None else self.base.ops.lora(x, y, self.a, self.b, m)

    def load(self, slot: int, adapter: Optional[LoRAAdapter]) -> None:
        """The adapter's shards of this projection into a slot (zeros where it adapts none of them)."""
        a, b = self.a[slot], self.b[slot]
        a.zero_()
        b.zero_()
        if adapter is None:
            return
        col, R = 0, self.rank
        for j, (module, n) in enumerate(self.shards):
            w = adapter.weights.get((self.layer_idx, module))
            if w is not None:
                wa, wb = w
                r = wa.shape[0]
                a[:, j * R:j * R + r].copy_(wa.t())
                b[j * R:j * R + r, col:col + n].copy_(wb.t())
            col += n


def attach_lora(model, config: LoRAConfig, dtype: torch.dtype, device: torch.device) -> LoRAStep:
    """Every dense decoder layer's q/k/v, o, gate/up and down projections made adaptable (Mixture-of-Experts layers'
    experts are not). Returns the step mapping the runner sets."""
    mc = model.config
    shapes = module_shapes(mc)
    step = LoRAStep()
    dtype = model.ops.lora_weight_dtype(dtype)
    if mc.linear_layers:
        raise ValueError(f"LoRA adapters on {mc.architecture}'s linear-attention layers are not implemented; serve "
                         f"the model without enable_lora")
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        wraps = [(attn, "qkv_proj", ("q_proj", "k_proj", "v_proj")), (attn, "o_proj", ("o_proj",))]
        if hasattr(mlp, "gate_up_proj"):
            wraps += [(mlp, "gate_up_proj", ("gate_proj", "up_proj")), (mlp, "down_proj", ("down_proj",))]
        for parent, attr, modules in wraps:
            shards = tuple((m, shapes[m][1]) for m in modules)
            setattr(parent, attr, LoRALinear(getattr(parent, attr), layer.layer_idx, shapes[modules[0]][0], shards,
                                             config, step, dtype, device))
        layer.lora_step = step          # the plan's one-call decode layer reads the step's mapping too
    return step


def adapted_layers(model: nn.Module) -> list[LoRALinear]:
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


class LoRASlots:
    """Which adapter sits in which slot of the stacks. A step's adapters (at most max_loras: the scheduler sees to
    it) are put in slots, keeping those already there and evicting the least recently used of those the step does not
    use."""

    def __init__(self, model, config: LoRAConfig):
        self.config = config
        self.layers = adapted_layers(model)
        self.slot_of: "OrderedDict[tuple, int]" = OrderedDict()       # adapter's key -> slot, least recent first
        self.free = list(range(config.max_loras - 1, -1, -1))
        self.loads = 0          # adapters copied into a slot: what churn past max_loras costs (benchmarks read it)

    def assign(self, adapters: list[LoRAAdapter]) -> dict[tuple, int]:
        """Slots for the step's adapters (by cache_key: an id loaded again from another folder is another
        adapter)."""
        wanted = {a.cache_key: a for a in adapters}
        if len(wanted) > self.config.max_loras:
            raise ValueError(f"a step has {len(wanted)} adapters but max_loras is {self.config.max_loras}")
        for lid in wanted:
            if lid in self.slot_of:
                self.slot_of.move_to_end(lid)
        for lid, adapter in wanted.items():
            if lid in self.slot_of:
                continue
            if not self.free:
                victim = next(v for v in self.slot_of if v not in wanted)
                self.free.append(self.slot_of.pop(victim))
            slot = self.free.pop()
            for lin in self.layers:
                lin.load(slot, adapter)
            self.slot_of[lid] = slot
            self.loads += 1
        return {lid: self.slot_of[lid] for lid in wanted}

    def row_slots(self, plan) -> Optional[torch.Tensor]:
        """Each of the step's rows' slot (-1: the base model), int32 on the host, its adapters put in slots first;
        None when no request of the step has an adapter."""
        states = plan.states
        adapters = [st.lora for st in states if st.lora is not None]
        if not adapters:
            return None
        slots = self.assign(adapters)
        per_req = torch.tensor([-1 if st.lora is None else slots[st.lora.cache_key] for st in states],
                               dtype=torch.int32)
        b = plan.batch
        qsl = torch.tensor(b.qsl)
        return per_req[torch.tensor(b.entry_req)].repeat_interleave(qsl[1:] - qsl[:-1])
