"""Batched LoRA in the shape of Punica's BGMV (vLLM's multi-LoRA batching): every row of a batch takes its own
adapter slot, y[t] += (x[t] @ A[slot[t]]) @ B[slot[t]], in two kernels.

- shrink: h [T, R] (float32) = x @ A[slot], one program per row and block of R columns, the IN features reduced
  in a loop of BLOCK_IN at a time;
- expand: y += h @ B[slot], one program per row and block of OUT columns, R reduced in a loop; the sum and the add
  to y are in float32, rounded once to y's dtype (bfloat16 by hand, to nearest even, as triton_kernels explains).

A slot's A and B are stacked per slot ([S, IN, R] and [S, R, OUT], the LoRA scaling folded into B); R is the slot's
rank columns (shards * max_lora_rank: a merged layer's shards side by side, unused columns zero). A row whose slot
is negative (-1: no adapter) is not touched: its programs load nothing and store nothing into y. The products are
elementwise multiplies summed in float32 (a GEMV per row; no tl.dot, which the interpreter runs on bfloat16 tiles
as integers).

The wrapper reads only shapes, strides and dtypes on the host (no syncs; the one tensor it makes is the float32 h,
torch.empty), and launches nothing for zero rows, so it can be captured in a CUDA graph; it is a PyTorch custom op
(`torch.ops.tokenmill.lora_shrink_expand`, mutating y) with a fake implementation, one node when traced. Slots are
not checked against S on the device: a slot >= S reads past the stacked matrices. Runs on CPU tensors under Triton's
interpreter (TRITON_INTERPRET=1, set before this module is imported), which is how the tests check it."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from tokenmill.executor.ops.triton_kernels import _KIND, _round

# The kernels' limits, declared once (lora_fits reads them)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # x, y, A and B: one dtype
SLOT_DTYPES = (torch.int32, torch.int64)                   # row_slot
MAX_RANK_COLS = 256          # R = shards * max_lora_rank
MAX_IN_FEATURES = 1 << 22    # the in-slot offsets (feature * R) stay within int32
MAX_BLOCK_R = 64             # R columns one shrink program takes, rank rows one expand step takes
TILE = 4096                  # elements of A or B one program holds at a time
MAX_BLOCK_OUT = 256          # y columns one expand program takes


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, h_ptr, slot_ptr, IN, R,
                        stride_xt, stride_as, stride_ai, stride_ht, stride_slot,
                        BLOCK_IN: tl.constexpr, BLOCK_R: tl.constexpr):
    """One program: row t, BLOCK_R of its R columns of h = x[t] @ A[slot[t]] in float32, IN reduced BLOCK_IN at a
    time. A row without a slot loads nothing and stores zeros."""
    t = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slot_ptr + t * stride_slot).to(tl.int64)
    # as vectors: the interpreter mis-types a bool scalar & a bool vector (int32), which a mask may not be
    r_mask = (r < R) & ((slot + tl.zeros([BLOCK_R], tl.int64)) >= 0)
    live_in = (slot + tl.zeros([BLOCK_IN], tl.int64)) >= 0
    a_slot = a_ptr + tl.maximum(slot, 0) * stride_as
    x_row = x_ptr + t * stride_xt
    acc = tl.zeros([BLOCK_R], tl.float32)
    for k0 in range(0, IN, BLOCK_IN):
        k = k0 + tl.arange(0, BLOCK_IN)
        k_mask = (k < IN) & live_in
        xv = tl.load(x_row + k, mask=k_mask, other=0.0).to(tl.float32)
        av = tl.load(a_slot + k[:, None] * stride_ai + r[None, :], mask=k_mask[:, None] & r_mask[None, :],
                     other=0.0).to(tl.float32)
        acc += tl.sum(xv[:, None] * av, 0)
    tl.store(h_ptr + t * stride_ht + r, acc, mask=r < R)


@triton.jit
def _lora_expand_kernel(h_ptr, b_ptr, y_ptr, slot_ptr, R, OUT,
                        stride_ht, stride_bs, stride_br, stride_yt, stride_slot,
                        BLOCK_R: tl.constexpr, BLOCK_OUT: tl.constexpr, KIND: tl.constexpr):
    """One program: row t, BLOCK_OUT of its OUT columns: y[t] += h[t] @ B[slot[t]], R reduced BLOCK_R at a time,
    summed and added in float32 and rounded once to y's dtype. A row without a slot loads and stores nothing."""
    t = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    slot = tl.load(slot_ptr + t * stride_slot).to(tl.int64)
    o_mask = (o < OUT) & ((slot + tl.zeros([BLOCK_OUT], tl.int64)) >= 0)
    live_r = (slot + tl.zeros([BLOCK_R], tl.int64)) >= 0
    b_slot = b_ptr + tl.maximum(slot, 0) * stride_bs
    h_row = h_ptr + t * stride_ht
    acc = tl.zeros([BLOCK_OUT], tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_mask = (r < R) & live_r
        hv = tl.load(h_row + r, mask=r_mask, other=0.0)
        bv = tl.load(b_slot + r[:, None] * stride_br + o[None, :], mask=r_mask[:, None] & o_mask[None, :],
                     other=0.0).to(tl.float32)
        acc += tl.sum(hv[:, None] * bv, 0)
    y_ptrs = y_ptr + t * stride_yt + o
    y = tl.load(y_ptrs, mask=o_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, _round(y + acc, KIND), mask=o_mask)


def lora_fits(x_dtype: torch.dtype, in_features: int, rank_cols: int) -> Optional[str]:
    """None when the LoRA kernels take a layer of this dtype, input width and rank columns (shards *
    max_lora_rank), else why not. Any output width is taken."""
    if x_dtype not in DTYPES:
        return f"activations in {x_dtype} (takes {', '.join(str(t) for t in DTYPES)})"
    if not 1 <= rank_cols <= MAX_RANK_COLS:
        return f"{rank_cols} rank columns (1 to {MAX_RANK_COLS}: shards * max_lora_rank)"
    if not 1 <= in_features <= MAX_IN_FEATURES:
        return f"{in_features} input features (1 to {MAX_IN_FEATURES})"
    return None


def _check(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row_slot: torch.Tensor) -> None:
    if x.dim() != 2 or y.dim() != 2 or a.dim() != 3 or b.dim() != 3 or row_slot.dim() != 1:
        raise ValueError(f"lora_shrink_expand takes x [T, IN], y [T, OUT], a [S, IN, R], b [S, R, OUT] and "
                         f"row_slot [T]; got {tuple(x.shape)}, {tuple(y.shape)}, {tuple(a.shape)}, "
                         f"{tuple(b.shape)}, {tuple(row_slot.shape)}")
    T, IN = x.shape
    S, _, R = a.shape
    OUT = y.shape[1]
    if y.shape[0] != T or a.shape[1] != IN or b.shape != (S, R, OUT) or row_slot.shape[0] != T:
        raise ValueError(f"lora_shrink_expand's shapes disagree: x {tuple(x.shape)}, y {tuple(y.shape)}, a "
                         f"{tuple(a.shape)} ([S, IN, R]), b {tuple(b.shape)} ([S, R, OUT]), row_slot "
                         f"{tuple(row_slot.shape)}")
    why = lora_fits(x.dtype, IN, R)
    if why is None and not (y.dtype == a.dtype == b.dtype == x.dtype):
        why = f"mixed dtypes (x {x.dtype}, y {y.dtype}, a {a.dtype}, b {b.dtype}; one dtype)"
    if why is None and row_slot.dtype not in SLOT_DTYPES:
        why = f"row_slot in {row_slot.dtype} (int32 or int64)"
    if why is None and len({x.device, y.device, a.device, b.device, row_slot.device}) != 1:
        why = "tensors on different devices"
    # rows may be views with a row stride; within a row, and within a slot's matrices, elements are contiguous
    if why is None and (x.stride(1) != 1 and IN > 1 or y.stride(1) != 1 and OUT > 1 or a.stride(2) != 1 and R > 1
                        or b.stride(2) != 1 and OUT > 1):
        why = "rows that are not contiguous (x, y, a and b need a last-dim stride of 1)"
    if why is not None:
        raise ValueError(f"lora_shrink_expand's Triton kernels do not take {why}")


@torch.library.custom_op("tokenmill::lora_shrink_expand", mutates_args=("y",))
def lora_shrink_expand(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       row_slot: torch.Tensor) -> None:
    """y[t] += (x[t] @ a[row_slot[t]]) @ b[row_slot[t]] for every row t with row_slot[t] >= 0, in place; rows with
    row_slot[t] == -1 are left untouched.
    x: [T, IN] activations (float32, bfloat16 or float16), contiguous rows.
    y: [T, OUT] same dtype as x (the base layer's output), updated in place.
    a: [S, IN, R] the slots' shrink matrices (same dtype as x), contiguous. R = shards * max_lora_rank, at most 256.
    b: [S, R, OUT] the slots' expand matrices (LoRA scaling already folded in), contiguous.
    row_slot: [T] int32 (or int64) on the same device.

    x @ a is kept in float32 (not rounded to x's dtype), and y is rounded once, after the add."""
    _check(x, y, a, b, row_slot)
    T, IN = x.shape
    R, OUT = a.shape[2], y.shape[1]
    if T == 0 or OUT == 0:
        return
    h = torch.empty((T, R), dtype=torch.float32, device=x.device)
    block_r = min(triton.next_power_of_2(R), MAX_BLOCK_R)
    block_in = min(triton.next_power_of_2(IN), TILE // block_r)
    _lora_shrink_kernel[(T, triton.cdiv(R, block_r))](
        x, a, h, row_slot, IN, R, x.stride(0), a.stride(0), a.stride(1), h.stride(0), row_slot.stride(0),
        BLOCK_IN=block_in, BLOCK_R=block_r, num_warps=4)
    block_out = min(triton.next_power_of_2(OUT), MAX_BLOCK_OUT, TILE // block_r)
    _lora_expand_kernel[(T, triton.cdiv(OUT, block_out))](
        h, b, y, row_slot, R, OUT, h.stride(0), b.stride(0), b.stride(1), y.stride(0), row_slot.stride(0),
        BLOCK_R=block_r, BLOCK_OUT=block_out, KIND=_KIND[y.dtype], num_warps=4)


@lora_shrink_expand.register_fake
def _(x, y, a, b, row_slot):
    return None
