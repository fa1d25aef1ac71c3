"""The gated delta rule's decode step as one Triton kernel (Qwen3.5's linear attention): each program takes one
row's value head and a block of its value columns, so the state's [dk, BLOCK_V] tile is read once and written once,
in place at the row's slot, with no gather or scatter of whole states. float32 throughout, as the reference. Runs on
NVIDIA GPUs, and on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1), which is how the tests check it.
The runner steps these models eagerly (no graphs), so this is a plain launch, not a custom op."""
from typing import Optional

import torch
import triton
import triton.language as tl

# The kernel's limits, declared once: the plan asks delta_rule_fits before it picks the kernel.
MAX_KEY_DIM = 256           # a head's whole key dimension sits in one program
BLOCK_V = 32                # value columns a program takes


@triton.jit
def _delta_rule_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slot_ptr, out_ptr, H, DK, DV,
                            BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """Program (row, head, value block): S = exp(g) S; S += k (beta (v - S^T k))^T; out = S^T q."""
    row, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    u = row.to(tl.int64) * H + h
    slot = tl.load(slot_ptr + row).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    vs = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    kmask, vmask = ks < DK, vs < DV
    s_ptrs = state_ptr + ((slot * H + h) * DK + ks[:, None]) * DV + vs[None, :]
    smask = kmask[:, None] & vmask[None, :]
    s = tl.load(s_ptrs, mask=smask, other=0.0) * tl.exp(tl.load(g_ptr + u))
    q = tl.load(q_ptr + u * DK + ks, mask=kmask, other=0.0)
    k = tl.load(k_ptr + u * DK + ks, mask=kmask, other=0.0)
    v = tl.load(v_ptr + u * DV + vs, mask=vmask, other=0.0)
    delta = (v - tl.sum(s * k[:, None], 0)) * tl.load(beta_ptr + u)
    s = s + k[:, None] * delta[None, :]
    tl.store(s_ptrs, s, mask=smask)
    tl.store(out_ptr + u * DV + vs, tl.sum(s * q[:, None], 0), mask=vmask)


def delta_rule_fits(dk: int, state: torch.Tensor) -> Optional[str]:
    """None when the kernel takes this state, else why not."""
    if dk > MAX_KEY_DIM:
        return f"key head dim {dk} (at most {MAX_KEY_DIM})"
    if state.dtype != torch.float32 or not state.is_contiguous():
        return "a state that is not contiguous float32"
    return None


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """ReferenceOps.delta_rule_step's contract: q, k [B, H, dk], v [B, H, dv], g, beta [B, H] float32; state
    [slots, H, dk, dv] updated at slots [B]; returns [B, H, dv]."""
    B, H, dk = q.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    out = torch.empty(B, H, dv, dtype=torch.float32, device=q.device)
    if B:
        _delta_rule_step_kernel[(B, H, triton.cdiv(dv, BLOCK_V))](
            q, k, v, g, beta, state, slots, out, H, dk, dv, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=BLOCK_V)
    return out
