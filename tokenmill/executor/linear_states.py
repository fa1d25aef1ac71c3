"""The linear-attention layers' state cache (Qwen3.5's Gated DeltaNet), beside the paged KV cache: a slot a
request holds for its life, with each linear layer's convolution inputs and recurrent state, fixed in size however
long the context. A request's first tokens (new, or recomputed after preemption) start its state afresh; a finished
or preempted request's slot goes back."""
from __future__ import annotations

import torch

from tokenmill.config import ModelConfig
from tokenmill.executor.batch import StepPlan
from tokenmill.executor.layers.gated_deltanet import LinearStep


def state_bytes_per_request(mc: ModelConfig, dtype: torch.dtype) -> int:
    """One slot's bytes over every linear layer: the convolution's last inputs (the model's dtype) and the float32
    recurrent state."""
    conv = (2 * mc.linear_num_key_heads * mc.linear_key_head_dim + mc.linear_num_value_heads *
            mc.linear_value_head_dim) * (mc.linear_conv_kernel_dim - 1) * torch.empty(0, dtype=dtype).element_size()
    rec = mc.linear_num_value_heads * mc.linear_key_head_dim * mc.linear_value_head_dim * 4
    return len(mc.linear_layers) * (conv + rec)


class LinearStates:
    def __init__(self, mc: ModelConfig, slots: int, dtype: torch.dtype, device: torch.device):
        conv_dim = 2 * mc.linear_num_key_heads * mc.linear_key_head_dim + \
            mc.linear_num_value_heads * mc.linear_value_head_dim
        layers = len(mc.linear_layers)
        self.conv = torch.zeros(layers, slots, conv_dim, mc.linear_conv_kernel_dim - 1, dtype=dtype, device=device)
        self.rec = torch.zeros(layers, slots, mc.linear_num_value_heads, mc.linear_key_head_dim,
                               mc.linear_value_head_dim, dtype=torch.float32, device=device)
        self.free_slots = list(range(slots - 1, -1, -1))
        self.slot_of: dict[str, int] = {}

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.rec.nbytes

    def step(self, plan: StepPlan) -> LinearStep:
        """The step's requests (one attention entry each: speculation is refused for these models) with their
        slots, a slot taken for a request's first step."""
        b = plan.batch
        if b.num_entries != len(plan.states):
            raise RuntimeError("a linear-attention step has one entry a request (no verification rows)")
        slots = []
        for st in plan.states:
            if st.req_id not in self.slot_of:
                if not self.free_slots:
                    raise RuntimeError(f"no linear-attention state slot is free for {st.req_id!r} (the engine "
                                       f"holds one a running request)")
                self.slot_of[st.req_id] = self.free_slots.pop()
            slots.append(self.slot_of[st.req_id])
        return LinearStep([(b.qsl[i], b.qsl[i + 1]) for i in range(b.num_entries)],
                          [start == 0 for start in b.num_computed], slots, self.conv, self.rec)

    def free(self, req_ids: list[str]) -> None:
        for rid in req_ids:
            slot = self.slot_of.pop(rid, None)
            if slot is not None:
                self.free_slots.append(slot)
