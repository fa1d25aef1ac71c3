"""Qwen3.5's linear-attention layer (Gated DeltaNet): a fixed-size state per request instead of a KV cache.

Per token t of a request: q/k/v from a causal depthwise convolution (SiLU) over the projected rows; each value head
keeps a state S [key_dim, value_dim] that decays by exp(g_t) and is corrected towards v_t along k_t with strength
beta_t (the delta rule), and reads out S^T q_t:

    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

A prompt (or a chunk of one) runs the chunked form: the recurrence over chunks of CHUNK tokens, the tokens inside a
chunk solved at once as a unit-triangular system (the UT transform). A decode runs one step of the recurrence. Both
in float32, as transformers computes them; the state and the convolution's last inputs live in LinearStates
(executor/linear_states.py), one slot a request, and this step's slots come in LinearStep.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.executor.layers.linear import Linear

CHUNK = 64          # tokens solved together in the chunked form (transformers' and FLA's chunk size)


@dataclass
class LinearStep:
    """The step's requests as the linear layers see them: each request's rows [start, end) of the batch, whether
    its state starts afresh (its first tokens: a new or recomputed request) and its state slot; and the states of
    every linear layer, conv [layers, slots, C, K-1] (the convolution's last inputs) and rec [layers, slots, Hv,
    dk, dv] (float32)."""
    rows: list[tuple[int, int]]
    fresh: list[bool]
    slots: list[int]
    conv: torch.Tensor
    rec: torch.Tensor
    # speculation: each verifying request's first row in `verified` (None: not verifying). A verifying request's
    # slot is left as it was; each layer keeps its rows' inputs, and once the runner hears how many rows stand it
    # replays those into the slot (LinearStates.restore)
    snap_row: list[Optional[int]] = field(default_factory=list)
    verified: Optional["VerifiedRows"] = None
    # the prefix cache's snapshots: request index -> (rows into its rows, snapshot slot) of each point where its
    # state is kept, in order (only the requests that keep one); and the snapshot tensors, laid out as conv and rec
    saves: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    snap_conv: Optional[torch.Tensor] = None
    snap_rec: Optional[torch.Tensor] = None


@dataclass
class VerifiedRows:
    """The inputs of every verified row of every linear layer: the convolution's (mixed [layers, rows, C], the
    model's dtype) and the recurrence's (q scaled, k [layers, rows, Hv, dk], v [.., dv], g, beta [.., Hv]; float32)."""
    mixed: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor


def l2_normalised(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's L tokens: q, k [H, L, dk] (normalised, q scaled), v [H, L, dv], g, beta [H, L], state
    [H, dk, dv]; all float32. Returns (outputs [H, L, dv], the state after the last token)."""
    H, L, dk = k.shape
    pad = -L % CHUNK
    if pad:                 # zero keys and no decay: padded tokens leave the state as it is
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (L + pad) // CHUNK
    q, k, v = (t.reshape(H, n, CHUNK, -1) for t in (q, k, v))
    g, beta = g.reshape(H, n, CHUNK), beta.reshape(H, n, CHUNK)
    cum = g.cumsum(-1)                                              # log decay from the chunk's start
    later = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(later, float("-inf")).exp()     # [i, j]: j -> i
    kb, vb = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    # (I + strictly lower part of A) X = rhs, A[i, j] = beta_i k_i.k_j decay[i, j]: the chunk's corrections at once
    system = (kb @ k.transpose(-1, -2)) * decay
    values = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)
    keys_read = torch.linalg.solve_triangular(system, kb * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    inner = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    end_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(v)
    for c in range(n):
        fresh_values = values[:, c] - keys_read[:, c] @ state
        out[:, c] = q_decayed[:, c] @ state + inner[:, c] @ fresh_values
        state = state * end_decay[:, c] + k_to_end[:, c].transpose(-1, -2) @ fresh_values
    return out.reshape(H, n * CHUNK, -1)[:, :L], state


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of B requests: q, k [B, H, dk], v [B, H, dv], g, beta [B, H], state [B, H, dk, dv]; float32.
    Returns (outputs [B, H, dv], the new states)."""
    state = state * g.exp()[..., None, None]
    read = (state * k.unsqueeze(-1)).sum(-2)
    state = state + k.unsqueeze(-1) * ((v - read) * beta.unsqueeze(-1)).unsqueeze(-2)
    return (state * q.unsqueeze(-1)).sum(-2), state


class GatedRMSNorm(nn.Module):
    """The output's norm a value head: RMS-normalised in float32, scaled by w (not 1 + w) in the model's dtype,
    then gated by SiLU(z)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(x.dtype) * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """HF's names: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a (fused here as in_proj), conv1d, dt_bias, A_log,
    norm, out_proj."""
    local_rope = False

    def __init__(self, cfg: ModelConfig, index: int, ops):
        """index: this layer's place among the linear layers (its rows of the state tensors)."""
        super().__init__()
        self.ops, self.index = ops, index
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        self.tiled = cfg.linear_value_heads_tiled
        h = cfg.hidden_size
        # HF's in_proj_qkv, in_proj_z, in_proj_b and in_proj_a fused at load into one matmul, in that order
        self.in_rows = (self.conv_dim, self.value_dim, self.hv, self.hv)
        self.in_proj = Linear(h, sum(self.in_rows), False, ops)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, self.kernel), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.hv), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.hv), requires_grad=False)
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, h, False, ops)

    def _conv(self, x: torch.Tensor, conv_state: torch.Tensor, keep: tuple[tuple[int, torch.Tensor], ...] = ()
              ) -> torch.Tensor:
        """One request's rows [L, C] after the kernel's last K-1 inputs (conv_state [C, K-1], updated in place):
        the causal depthwise convolution with SiLU, [L, C]. keep: (m, into) each, the K-1 inputs before row m
        copied into `into` (a snapshot)."""
        full = torch.cat([conv_state, x.t()], dim=1)                  # [C, K - 1 + L]
        for m, into in keep:
            into.copy_(full[:, m:m + self.kernel - 1])
        conv_state.copy_(full[:, -(self.kernel - 1):])
        y = F.conv1d(full.unsqueeze(0).to(self.conv1d.weight.dtype), self.conv1d.weight, groups=self.conv_dim)
        return F.silu(y[0]).t().to(x.dtype)

    def forward(self, x: torch.Tensor, rope, backend, step: LinearStep) -> torch.Tensor:
        """x [T, hidden] of the step's requests (step.rows); this layer's states are read and written at the step's
        slots. rope and backend: an attending layer's, unused here."""
        T = x.shape[0]
        conv_states, rec_states = step.conv[self.index], step.rec[self.index]
        mixed, z, b, a = self.in_proj(x).split(self.in_rows, dim=-1)
        z = z.reshape(T, self.hv, self.dv)
        beta = b.sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        snap_row = step.snap_row or [None] * len(step.rows)
        verifying = [i for i, r in enumerate(snap_row) if r is not None]
        # decoding requests (a row each, a state to go on from): their convolutions and recurrence steps at once
        decodes = [i for i, ((r0, r1), fresh) in enumerate(zip(step.rows, step.fresh))
                   if r1 - r0 == 1 and not fresh and snap_row[i] is None]
        conv = torch.empty_like(mixed)
        if decodes:
            rows = torch.tensor([step.rows[i][0] for i in decodes], device=x.device)
            slots = torch.tensor([step.slots[i] for i in decodes], device=x.device)
            full = torch.cat([conv_states[slots], mixed[rows].unsqueeze(-1)], dim=-1)        # [B, C, K]
            conv_states[slots] = full[..., 1:]
            y = F.conv1d(full.to(self.conv1d.weight.dtype), self.conv1d.weight, groups=self.conv_dim)
            conv[rows] = F.silu(y[..., 0]).to(conv.dtype)
        for i in set(range(len(step.rows))) - set(decodes):
            (r0, r1), slot, snap = step.rows[i], step.slots[i], snap_row[i]
            if step.fresh[i]:
                conv_states[slot].zero_()
            if snap is not None:        # verifying: the slot stays as it was until restore() replays its rows
                step.verified.mixed[self.index, snap:snap + r1 - r0] = mixed[r0:r1]
                conv[r0:r1] = self._conv(mixed[r0:r1], conv_states[slot].clone())
                continue
            keep = tuple((m, step.snap_conv[self.index, snap]) for m, snap in step.saves.get(i, ()) if m < r1 - r0)
            conv[r0:r1] = self._conv(mixed[r0:r1], conv_states[slot], keep)
        q, k, v = conv.float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        # each q/k head serves hv // hk value heads: consecutive ones (HF's order), or every hk-th (tiled, a GGUF's)
        q, k = (l2_normalised(t.view(T, self.hk, self.dk)) for t in (q, k))
        q, k = ((t.repeat(1, self.hv // self.hk, 1) if self.tiled else t.repeat_interleave(self.hv // self.hk, dim=1))
                for t in (q, k))
        v = v.view(T, self.hv, self.dv)
        out = torch.empty(T, self.hv, self.dv, dtype=torch.float32, device=x.device)
        if decodes:
            # scaled as transformers scales a decode's query (a division; the chunked form multiplies)
            out[rows] = self.ops.delta_rule_step(q[rows] / self.dk ** 0.5, k[rows], v[rows], g[rows], beta[rows],
                                                 rec_states, slots)
        for i in verifying:     # a token and its guesses: one step each, on a copy of the state
            (r0, r1), slot, snap = step.rows[i], step.slots[i], step.snap_row[i]
            rows_in = (q[r0:r1] / self.dk ** 0.5, k[r0:r1], v[r0:r1], g[r0:r1], beta[r0:r1])
            for kept, t in zip((step.verified.q, step.verified.k, step.verified.v, step.verified.g,
                                step.verified.beta), rows_in):
                kept[self.index, snap:snap + r1 - r0] = t
            s = rec_states[slot:slot + 1]
            for j in range(r1 - r0):
                o, s = recurrent_step(*(t[j:j + 1] for t in rows_in), s)
                out[r0 + j] = o[0]
        for i in set(range(len(step.rows))) - set(decodes) - set(verifying):
            (r0, r1), slot = step.rows[i], step.slots[i]
            s = torch.zeros_like(rec_states[slot]) if step.fresh[i] else rec_states[slot]
            # a snapshot inside the rows parts them there: the state at the boundary is the part's last
            inside = {r0 + m: snap for m, snap in step.saves.get(i, ()) if m < r1 - r0}
            ends = sorted(inside) + [r1]
            for a, e in zip([r0] + ends[:-1], ends):
                o, s = chunked_delta_rule(q[a:e].transpose(0, 1) * self.dk ** -0.5,
                                          *(t[a:e].transpose(0, 1) for t in (k, v, g, beta)), s)
                out[a:e] = o.transpose(0, 1)
                if e in inside:
                    step.snap_rec[self.index, inside[e]] = s
            rec_states[slot] = s
        for i, save in step.saves.items():     # snapshots at the end of a request's rows: its state after the step
            for m, snap in save:
                if m == step.rows[i][1] - step.rows[i][0]:
                    step.snap_conv[self.index, snap] = conv_states[step.slots[i]]
                    step.snap_rec[self.index, snap] = rec_states[step.slots[i]]
        y = self.norm(out.to(x.dtype), z)
        return self.ops.all_reduce(self.out_proj(y.reshape(T, self.value_dim)))
