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
        """The step's requests with their slots (a slot taken on a request's first step) and rows: a request's
        entries are consecutive, one, or one a row where it verifies guesses. A verifying request's states after
        each row are kept aside until restore() hears how many of them stand."""
        b = plan.batch
        first: dict[int, int] = {}                      # request -> its first entry
        last: dict[int, int] = {}
        for e, r in enumerate(b.entry_req):
            first.setdefault(r, e)
            last[r] = e
        rows, fresh, slots, snap_row = [], [], [], []
        self.snapshots: dict[str, tuple[int, int]] = {}    # verifying request -> (slot, its first snapshot row)
        verified = 0
        for r, st in enumerate(plan.states):
            if st.req_id not in self.slot_of:
                if not self.free_slots:
                    raise RuntimeError(f"no linear-attention state slot is free for {st.req_id!r} (the engine "
                                       f"holds one a running request)")
                self.slot_of[st.req_id] = self.free_slots.pop()
            slot = self.slot_of[st.req_id]
            r0, r1 = b.qsl[first[r]], b.qsl[last[r] + 1]
            rows.append((r0, r1))
            fresh.append(b.num_computed[first[r]] == 0)
            slots.append(slot)
            if last[r] > first[r]:
                snap_row.append(verified)
                self.snapshots[st.req_id] = (slot, verified)
                verified += r1 - r0
            else:
                snap_row.append(None)
        snap_conv = snap_rec = None
        if verified:
            snap_conv = self.conv.new_empty(self.conv.shape[0], verified, *self.conv.shape[2:])
            snap_rec = self.rec.new_empty(self.rec.shape[0], verified, *self.rec.shape[2:])
        self.snap_conv, self.snap_rec = snap_conv, snap_rec
        return LinearStep(rows, fresh, slots, self.conv, self.rec, snap_row, snap_conv, snap_rec)

    def restore(self, accepted: dict[str, int]) -> None:
        """After a step that verified guesses: each request's state back to after its last standing row (rows
        counted from its first: the token before the guesses is row 0; accepted[req] rows stand)."""
        for rid, n in accepted.items():
            slot, row = self.snapshots[rid]
            self.conv[:, slot] = self.snap_conv[:, row + n - 1]
            self.rec[:, slot] = self.snap_rec[:, row + n - 1]

    def free(self, req_ids: list[str]) -> None:
        for rid in req_ids:
            slot = self.slot_of.pop(rid, None)
            if slot is not None:
                self.free_slots.append(slot)
