"""The linear-attention layers' state cache (Qwen3.5's Gated DeltaNet), beside the paged KV cache: a slot a
request holds for its life, with each linear layer's convolution inputs and recurrent state, fixed in size however
long the context. A request's first tokens (new, or recomputed after preemption) start its state afresh, or from a
snapshot where a prefix hit resumes (engine/state_snapshots.py chooses the snapshot slots; their tensors are here); a
finished or preempted request's slot goes back."""
from __future__ import annotations

import torch

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.executor.batch import StepPlan
from tokenmill.executor.layers.gated_deltanet import LinearStep, VerifiedRows, recurrent_step
from tokenmill.scheduler_output import SchedulerOutput


def conv_channels(mc: ModelConfig) -> int:
    """The convolution's channels: every q, k and v of a linear layer."""
    return 2 * mc.linear_num_key_heads * mc.linear_key_head_dim + mc.linear_num_value_heads * mc.linear_value_head_dim


def state_bytes_per_request(mc: ModelConfig, dtype: torch.dtype) -> int:
    """One slot's bytes over every linear layer: the convolution's last inputs (the model's dtype) and the float32
    recurrent state."""
    conv = conv_channels(mc) * (mc.linear_conv_kernel_dim - 1) * torch.empty(0, dtype=dtype).element_size()
    rec = mc.linear_num_value_heads * mc.linear_key_head_dim * mc.linear_value_head_dim * 4
    return len(mc.linear_layers) * (conv + rec)


def snapshot_slots(config: EngineConfig) -> int:
    """State snapshots kept for the prefix cache: as many as requests run at once, none without prefix caching."""
    return config.scheduler_config.max_num_seqs if config.cache_config.enable_prefix_caching else 0


class LinearStates:
    def __init__(self, mc: ModelConfig, slots: int, dtype: torch.dtype, device: torch.device, snapshots: int = 0):
        conv_dim = conv_channels(mc)
        layers = len(mc.linear_layers)
        # untouched memory: a request's first step writes its slot before anything reads it (fresh), so on a CPU
        # only the slots that requests have used become resident
        self.conv = torch.empty(layers, slots, conv_dim, mc.linear_conv_kernel_dim - 1, dtype=dtype, device=device)
        self.rec = torch.empty(layers, slots, mc.linear_num_value_heads, mc.linear_key_head_dim,
                               mc.linear_value_head_dim, dtype=torch.float32, device=device)
        # the prefix cache's snapshots: a state per cached boundary, laid out as the slots
        self.snap_conv = self.conv.new_empty(layers, snapshots, *self.conv.shape[2:])
        self.snap_rec = self.rec.new_empty(layers, snapshots, *self.rec.shape[2:])
        self.free_slots = list(range(slots - 1, -1, -1))
        self.slot_of: dict[str, int] = {}

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.rec.nbytes

    @property
    def snapshot_nbytes(self) -> int:
        return self.snap_conv.nbytes + self.snap_rec.nbytes

    def step(self, plan: StepPlan, sched: SchedulerOutput) -> LinearStep:
        """The step's requests with their slots (a slot taken on a request's first step, loaded from a snapshot
        where a prefix hit resumes) and rows: a request's entries are consecutive, one, or one a row where it
        verifies guesses. A verifying request's slot is left as it was, and its rows' inputs are kept
        (VerifiedRows) until restore() hears how many of them stand."""
        b = plan.batch
        first: dict[int, int] = {}                      # request -> its first entry
        last: dict[int, int] = {}
        for e, r in enumerate(b.entry_req):
            first.setdefault(r, e)
            last[r] = e
        rows, fresh, slots, snap_row = [], [], [], []
        self.snapshots: dict[str, tuple[int, int]] = {}    # verifying request -> (slot, its first kept row)
        verified = 0
        for r, (st, s) in enumerate(zip(plan.states, sched.scheduled)):
            if st.req_id not in self.slot_of:
                if not self.free_slots:
                    raise RuntimeError(f"no linear-attention state slot is free for {st.req_id!r} (the engine "
                                       f"holds one a running request)")
                self.slot_of[st.req_id] = self.free_slots.pop()
                if s.state_load is not None:        # before this step's saves can overwrite the snapshot
                    self.conv[:, self.slot_of[st.req_id]] = self.snap_conv[:, s.state_load]
                    self.rec[:, self.slot_of[st.req_id]] = self.snap_rec[:, s.state_load]
                elif s.num_computed_tokens:
                    raise RuntimeError(f"{st.req_id!r} resumes at token {s.num_computed_tokens} with no state")
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
        self.verified = None
        if verified:
            L, _, C, _ = self.conv.shape
            _, _, hv, dk, dv = self.rec.shape
            f32 = dict(dtype=torch.float32, device=self.rec.device)
            self.verified = VerifiedRows(self.conv.new_empty(L, verified, C), torch.empty(L, verified, hv, dk, **f32),
                                         torch.empty(L, verified, hv, dk, **f32),
                                         torch.empty(L, verified, hv, dv, **f32), torch.empty(L, verified, hv, **f32),
                                         torch.empty(L, verified, hv, **f32))
        return LinearStep(rows, fresh, slots, self.conv, self.rec, snap_row, self.verified,
                          {i: s.state_save for i, s in enumerate(sched.scheduled) if s.state_save},
                          self.snap_conv, self.snap_rec)

    def dummy_step(self, entry_rows: list[int]) -> LinearStep:
        """A start-up step's (profiling, compiling): entries of several rows as fresh prompts, one-row entries as
        decodes, as many as there are slots (a step never decodes more requests), each in a slot of its own. No
        request holds a slot yet, and a request's first step starts its state afresh."""
        rows, r0 = [], 0
        for n in entry_rows:
            rows.append((r0, r0 + n))
            r0 += n
        rows = [r for r in rows if r[1] - r[0] > 1] + [r for r in rows if r[1] - r[0] == 1][:self.conv.shape[1]]
        return LinearStep(rows, [r1 - r0 > 1 for r0, r1 in rows], [i % self.conv.shape[1] for i in range(len(rows))],
                          self.conv, self.rec)

    def restore(self, accepted: dict[str, int]) -> None:
        """After a step that verified guesses: each verifying request's slot (left as it was before the step)
        moved over its standing rows, every linear layer at once (rows counted from its first: the token before
        the guesses is row 0; accepted[req] rows stand). Keeping rows' inputs rather than a state a row holds
        speculation's extra memory to a few KB a row."""
        vr = self.verified
        for rid, n in accepted.items():
            slot, row = self.snapshots[rid]
            s = self.rec[:, slot]
            for j in range(row, row + n):
                _, s = recurrent_step(vr.q[:, j], vr.k[:, j], vr.v[:, j], vr.g[:, j], vr.beta[:, j], s)
            self.rec[:, slot] = s
            width = self.conv.shape[-1]          # the last K-1 inputs
            full = torch.cat([self.conv[:, slot], vr.mixed[:, row:row + n].transpose(1, 2)], dim=-1)
            self.conv[:, slot] = full[..., full.shape[-1] - width:]

    def free(self, req_ids: list[str]) -> None:
        for rid in req_ids:
            slot = self.slot_of.pop(rid, None)
            if slot is not None:
                self.free_slots.append(slot)
