"""Mixture-of-Experts on the GPU without a host sync, in the shape of vLLM's fused_moe: the token-expert pairs are
sorted by expert on the device (moe_align), each expert's run padded to a multiple of BLOCK_M, and one grouped-GEMM
kernel multiplies each block of BLOCK_M pairs by its expert's matrix from a stacked [E, N, K] tensor. It runs twice
(gate_up, then down with the routing weights), with the gated activation between (triton_kernels), and a last
kernel adds each token's k outputs in ascending expert order, as the reference (ReferenceOps.fused_moe) does.

Graph-safe: the buffers' sizes are bounds from the shapes only (T * k pairs, E experts), so the grid depends on the
token count, never on how many tokens each expert got; the count of valid blocks stays on the device and the blocks
past it exit at once. Nothing is read on the host and no tensor is built from Python values.

Experts are float (the model's dtype) or GroupWeight (layers/quant.py: unsigned 4- or 8-bit codes, 4 bits packed
two a byte with the even column low, a scale per group of columns, optional uint8 zero points), dequantised in
registers inside the same kernel. fused_moe_fits() names what the kernel does not take.

The entry point is a custom op (`torch.ops.tokenmill.fused_moe`) with a fake implementation, so tracing (make_fx,
torch.compile, the graph stand-in) sees one op. Runs on CPU tensors under TRITON_INTERPRET=1 (how the tests check
it)."""
from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from tokenmill.executor.ops.triton_kernels import DTYPES, _KIND, _round, gelu_tanh_mul, silu_mul

# The kernel's limits, declared once (fused_moe_fits reads them)
QUANT_BITS = (4, 8)          # GroupWeight codes the kernel dequantises
ACTS = ("silu_mul", "gelu_tanh_mul")
MIN_BLOCK_M, MAX_BLOCK_M = 16, 64     # pairs per block: tl.dot's least, and a prefill tile
BLOCK_N, BLOCK_K = 64, 64             # at most; smaller (down to 16, tl.dot's least) for narrow matrices
MAX_PAIRS = 1 << 30                   # pair indices are int32 on the device
SUM_TILE = 2048                       # elements one program of the final sum holds
# Triton's interpreter multiplies bfloat16 tiles as the integers it stores them in: there the kernel multiplies them
# in float32, which is the same product (a product of two bfloat16 values is exact in float32) summed in float32
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


# ---- alignment: pairs sorted by expert, padded to blocks, all on the device ----------------------------------------

def block_m_for(num_pairs: int, num_experts: int) -> int:
    """BLOCK_M for T * k pairs over E experts (from the shapes only): about the pairs an expert gets on average,
    a power of two in [16, 64] (decode: 16, so the padding stays small; prefill: 64 for the bigger GEMM tile)."""
    avg = triton.cdiv(max(num_pairs, 1), num_experts)
    return min(MAX_BLOCK_M, max(MIN_BLOCK_M, triton.next_power_of_2(avg)))


def align_bound(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most padded pairs moe_align can give: each expert that got pairs (at most min(E, M)) pads its run by
    fewer than block_m; rounded up to whole blocks."""
    most = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(most, block_m) * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int,
              block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] (each token's experts) -> (sorted_ids, block_expert, num_blocks):

    sorted_ids int32 [align_bound(T*k, E, block_m)]: the pair indices (t * k + j) sorted by expert (stable: in pair
      order within an expert), each expert's run starting on a multiple of block_m; padding and the unused tail hold
      the sentinel T * k.
    block_expert int32 [that / block_m]: the expert of each block (blocks past the valid ones: clamped to E - 1).
    num_blocks int32 [1]: the number of valid blocks, on the device.

    torch ops only, on topk_ids' device; every size is from the shapes."""
    T, k = topk_ids.shape
    M, dev = T * k, topk_ids.device
    size = align_bound(M, num_experts, block_m)
    flat = topk_ids.reshape(M).long()
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + (block_m - 1)) // block_m
    block_end = blocks.cumsum(0)                                 # each expert's blocks end here
    pad_start = (block_end - blocks) * block_m                   # its first padded slot
    count_start = counts.cumsum(0) - counts                      # its first pair in the sorted order
    expert_sorted, order = flat.sort(stable=True)
    dest = pad_start[expert_sorted] - count_start[expert_sorted] + torch.arange(M, device=dev)
    sorted_ids = torch.full((size,), M, dtype=torch.int32, device=dev).scatter_(0, dest, order.int())
    block_expert = torch.searchsorted(block_end, torch.arange(size // block_m, device=dev), right=True)
    return sorted_ids, block_expert.clamp_(max=num_experts - 1).int(), block_end[-1:].int()


# ---- the grouped GEMM --------------------------------------------------------------------------------------------

@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, s_ptr, z_ptr, rw_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_blocks_ptr,
                         N, K, num_pairs, group,
                         stride_am, stride_ak, stride_we, stride_wn, stride_wk,
                         stride_se, stride_sn, stride_sg, stride_ze, stride_zn, stride_zg, stride_om, stride_on,
                         A_DIV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         BITS: tl.constexpr, HAS_ZERO: tl.constexpr, W_KIND: tl.constexpr, DOT_F32: tl.constexpr,
                         ROUTED: tl.constexpr, OUT_KIND: tl.constexpr):
    """One program: BLOCK_M sorted pairs (one expert's) by BLOCK_N output columns. out[pair] = a[pair // A_DIV] @
    W[e]^T (times the pair's routing weight where ROUTED), rounded as the reference rounds. W[e] is float [N, K]
    (BITS 0), or b-bit codes with a scale (and zero) per group of K columns, dequantised here."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if pid_m >= tl.load(num_blocks_ptr):
        return                                  # a block past the valid ones (the grid is a bound)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    live = pair < num_pairs                     # padding holds the sentinel num_pairs
    rows = pair // A_DIV
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_base = w_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=live[:, None] & k_ok[None, :], other=0.0)
        wmask = k_ok[:, None] & n_ok[None, :]
        if BITS == 0:
            w = tl.load(w_base + offs_k[:, None] * stride_wk, mask=wmask, other=0.0)     # [BLOCK_K, BLOCK_N]
        else:
            if BITS == 4:
                byte = tl.load(w_base + (offs_k[:, None] // 2) * stride_wk, mask=wmask, other=0).to(tl.int32)
                code = (byte >> ((offs_k[:, None] % 2) * 4)) & 15
            else:
                code = tl.load(w_base + offs_k[:, None] * stride_wk, mask=wmask, other=0).to(tl.int32)
            g = offs_k[:, None] // group
            s = tl.load(s_ptr + e * stride_se + offs_n[None, :].to(tl.int64) * stride_sn + g * stride_sg,
                        mask=wmask, other=0.0).to(tl.float32)
            if HAS_ZERO:
                z = tl.load(z_ptr + e * stride_ze + offs_n[None, :].to(tl.int64) * stride_zn + g * stride_zg,
                            mask=wmask, other=0).to(tl.float32)
            else:
                z = (1 << (BITS - 1)) * 1.0
            w = _round((code.to(tl.float32) - z) * s, W_KIND)     # the reference's dequantised tile's dtype
        if DOT_F32:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w.to(a.dtype))
    y = _round(acc, OUT_KIND)
    if ROUTED:          # the reference: the expert's output (in its dtype) times the float32 weight, rounded
        rw = tl.load(rw_ptr + pair, mask=live, other=0.0).to(tl.float32)
        y = _round(y * rw[:, None], OUT_KIND)
    tl.store(out_ptr + pair[:, None] * stride_om + offs_n[None, :] * stride_on, y,
             mask=live[:, None] & n_ok[None, :])


def _block(n: int, most: int) -> int:
    return min(most, max(16, triton.next_power_of_2(n)))


def _grouped_gemm(a: torch.Tensor, w: "StackedWeight", out: torch.Tensor, a_div: int, sorted_ids: torch.Tensor,
                  block_expert: torch.Tensor, num_blocks: torch.Tensor, block_m: int,
                  routing: Optional[torch.Tensor]) -> None:
    N, K = w.shape
    M = out.shape[0]
    bn, bk = _block(N, BLOCK_N), _block(K, BLOCK_K)
    codes = w.weight
    s = w.scale if w.scale is not None else codes
    z = w.zero if w.zero is not None else s
    # the reference's GEMM: in the activations' dtype for float experts; dequantised tiles in bfloat16 for a
    # bfloat16 model, else in float32 (ReferenceOps.tiled_matmul)
    dot_f32 = a.dtype == torch.float32 or (w.bits != 0 and a.dtype != torch.bfloat16) or \
        (_INTERPRETED and a.dtype == torch.bfloat16)
    grid = (block_expert.shape[0] * triton.cdiv(N, bn),)
    _grouped_gemm_kernel[grid](
        a, codes, s, z, routing if routing is not None else a, out, sorted_ids, block_expert, num_blocks,
        N, K, M, w.group if w.bits else 1,
        a.stride(0), a.stride(1), codes.stride(0), codes.stride(1), codes.stride(2),
        s.stride(0), s.stride(1), s.stride(2), z.stride(0), z.stride(1), z.stride(2), out.stride(0), out.stride(1),
        A_DIV=a_div, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, BITS=w.bits, HAS_ZERO=w.zero is not None,
        W_KIND=_KIND[torch.bfloat16] if a.dtype == torch.bfloat16 else 0, DOT_F32=dot_f32,
        ROUTED=routing is not None, OUT_KIND=_KIND[out.dtype], num_warps=4)


# ---- each token's k outputs summed -------------------------------------------------------------------------------

@triton.jit
def _moe_sum_kernel(y_ptr, out_ptr, T, H, stride_ym, stride_yh, stride_ot, stride_oh,
                    TOPK: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr, KIND: tl.constexpr):
    """out[t] = y[t k] + y[t k + 1] + ... in that order, each sum rounded to the dtype (the reference's index_add_
    into zeros)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows < T)[:, None] & (cols < H)[None, :]
    p = y_ptr + (rows * TOPK)[:, None] * stride_ym + cols[None, :] * stride_yh
    acc = tl.load(p, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(1, TOPK):
        acc = _round(acc + tl.load(p + j * stride_ym, mask=mask, other=0.0).to(tl.float32), KIND)
    tl.store(out_ptr + rows[:, None] * stride_ot + cols[None, :] * stride_oh, acc, mask=mask)


def _moe_sum(y: torch.Tensor, T: int, k: int, out: torch.Tensor) -> None:
    H = y.shape[1]
    block = min(triton.next_power_of_2(H), SUM_TILE)
    rows = max(1, min(16, SUM_TILE // block))
    _moe_sum_kernel[(triton.cdiv(T, rows), triton.cdiv(H, block))](
        y, out, T, H, y.stride(0), y.stride(1), out.stride(0), out.stride(1), TOPK=k, ROWS=rows, BLOCK_H=block,
        KIND=_KIND[out.dtype], num_warps=4)


# ---- the experts' weights, stacked once at load ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StackedWeight:
    """E experts' [N, K] matrices: float [E, N, K] (any strides), or GroupWeight codes [E, N, K/2] (4 bits) or
    [E, N, K] (8 bits) with scale [E, N, K/group] and zero uint8 [E, N, K/group] or None (symmetric)."""
    weight: torch.Tensor
    shape: tuple[int, int]          # (N, K) of one expert
    bits: int = 0                   # 0: float
    group: int = 0
    scale: Optional[torch.Tensor] = None
    zero: Optional[torch.Tensor] = None


@dataclasses.dataclass(frozen=True)
class StackedExperts:
    gate_up: StackedWeight          # [E, 2I, H], gate rows first
    down: StackedWeight             # [E, H, I]
    act: str                        # silu_mul | gelu_tanh_mul
    dtype: torch.dtype              # the activations'

    @property
    def num_experts(self) -> int:
        return self.gate_up.weight.shape[0]


def _linear_form(layer) -> str:
    """'float' or 'group' for a Linear the kernel takes; anything else is a reason it does not."""
    from tokenmill.executor.layers.quant import GroupWeight
    if layer.bias is not None:
        return "experts with a bias"
    q = layer.quant
    if q is None:
        return "float"
    if not isinstance(q, GroupWeight):
        return f"{type(q).__name__} experts (takes float or GroupWeight ones)"
    if q.perm is not None:
        return "act-order (perm) GroupWeight experts"
    if q.bits not in QUANT_BITS:
        return f"{q.bits}-bit experts (takes {QUANT_BITS})"
    n, k = q.shape
    if k % q.group or (q.bits == 4 and k % 2):
        return f"groups of {q.group} over {k} columns"
    return "group"


def _weight_of(layer) -> torch.Tensor:
    """A float Linear's W [N, K] (a view of W^T where finalize() kept that)."""
    return layer.weight if layer.weight is not None else layer.weight_t.t()


def _linears_fit(layers: Sequence, dtype: torch.dtype, what: str) -> Optional[str]:
    forms = {_linear_form(l) for l in layers}
    bad = forms - {"float", "group"}
    if bad:
        return f"{what}: {sorted(bad)[0]}"
    if len(forms) > 1:
        return f"{what}: float and quantised experts mixed"
    if forms == {"float"}:
        w = [_weight_of(l) for l in layers]
        if any(t.dtype != dtype for t in w):
            return f"{what}: float experts in {w[0].dtype}, not the activations' {dtype}"
        if len({tuple(t.shape) for t in w}) > 1:
            return f"{what}: experts of different shapes"
        return None
    q = [l.quant for l in layers]
    keys = {(p.bits, p.group, p.shape, p.zero is None, p.scale.dtype, p.codes.dtype) for p in q}
    if len(keys) > 1:
        return f"{what}: quantised experts of different forms"
    return None


def fused_moe_fits(experts: Sequence, dtype: torch.dtype) -> Optional[str]:
    """None when the fused kernel serves these experts (gated MLPs: gate_up_proj [2I, H], down_proj [H, I]) for
    activations in dtype, else why not."""
    if dtype not in DTYPES:
        return f"activations in {dtype} (takes {', '.join(str(t) for t in DTYPES)})"
    if len(experts) == 0:
        return "no experts"
    acts = {getattr(getattr(e, "act", None), "__name__", None) for e in experts}
    if len(acts) != 1 or next(iter(acts)) not in ACTS:
        return f"the experts' activation {sorted(map(str, acts))} (takes {', '.join(ACTS)})"
    for what in ("gate_up_proj", "down_proj"):
        why = _linears_fit([getattr(e, what) for e in experts], dtype, what)
        if why is not None:
            return why
    return None


def _stack_linears(layers: Sequence) -> StackedWeight:
    """One [E, N, K] weight of the experts' Linears; each Linear's own weight becomes a view of it (the reference
    path and anything else reading them sees the same values; no second copy is kept)."""
    if layers[0].quant is None:
        if layers[0].weight is not None:
            st = torch.stack([l.weight.data for l in layers])
            for i, l in enumerate(layers):
                l.weight.data = st[i]
            return StackedWeight(st, tuple(st.shape[1:]))
        st = torch.stack([l.weight_t for l in layers])        # [E, K, N]: CPU finalize()'s layout
        for i, l in enumerate(layers):
            l.weight_t = st[i]
        w = st.transpose(1, 2)
        return StackedWeight(w, tuple(w.shape[1:]))
    qs = [l.quant for l in layers]
    codes = torch.stack([q.codes for q in qs])
    scale = torch.stack([q.scale for q in qs])
    zero = None if qs[0].zero is None else torch.stack([q.zero for q in qs])
    for i, (l, q) in enumerate(zip(layers, qs)):
        l.quant = dataclasses.replace(q, codes=codes[i], scale=scale[i], zero=None if zero is None else zero[i])
    return StackedWeight(codes, tuple(qs[0].shape), qs[0].bits, qs[0].group, scale, zero)


def stack_experts(experts: Sequence, dtype: torch.dtype) -> tuple[Optional[StackedExperts], Optional[str]]:
    """(the stacked experts, None), or (None, why the kernel does not take them)."""
    why = fused_moe_fits(experts, dtype)
    if why is not None:
        return None, why
    gate_up = _stack_linears([e.gate_up_proj for e in experts])
    down = _stack_linears([e.down_proj for e in experts])
    return StackedExperts(gate_up, down, experts[0].act.__name__, dtype), None


# ---- the op ------------------------------------------------------------------------------------------------------

def _check(x, topk_weights, topk_ids, w1, w2, bits1, bits2, k1, k2) -> None:
    T, H = x.shape
    if w1.dim() != 3 or w2.dim() != 3 or w2.shape[0] != w1.shape[0] or k1 != H or w2.shape[1] != H \
            or w1.shape[1] != 2 * k2:
        raise ValueError(f"fused_moe takes gate_up experts [E, 2I, H] and down experts [E, H, I]; got "
                         f"{tuple(w1.shape)} ({k1} columns) and {tuple(w2.shape)} ({k2} columns) for x "
                         f"{tuple(x.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"fused_moe takes x [T, H], topk_weights and topk_ids [T, k]; got {tuple(x.shape)}, "
                         f"{tuple(topk_weights.shape)}, {tuple(topk_ids.shape)}")
    if x.dtype not in DTYPES or (bits1 == 0 and w1.dtype != x.dtype) or (bits2 == 0 and w2.dtype != x.dtype):
        raise ValueError(f"fused_moe's Triton kernel takes activations in {DTYPES} and float experts in their "
                         f"dtype; got {x.dtype} activations, experts {w1.dtype} and {w2.dtype}")
    if T * topk_ids.shape[1] >= MAX_PAIRS:
        raise ValueError(f"fused_moe's Triton kernel takes fewer than {MAX_PAIRS} token-expert pairs")


@torch.library.custom_op("tokenmill::fused_moe", mutates_args=())
def fused_moe_op(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w1: torch.Tensor,
                 w2: torch.Tensor, w1_scale: Optional[torch.Tensor], w1_zero: Optional[torch.Tensor],
                 w2_scale: Optional[torch.Tensor], w2_zero: Optional[torch.Tensor], bits1: int, group1: int,
                 bits2: int, group2: int, k1: int, k2: int, gelu: bool) -> torch.Tensor:
    """sum over j of topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) for x [T, H], an expert being
    down(act(gate_up(x))); w1 [E, 2I, *] and w2 [E, H, *] float or codes (bits 4/8, with scale/zero per group of
    columns), k1 = H and k2 = I their columns."""
    return fused_moe_impl(x, topk_weights, topk_ids, w1, w2, w1_scale, w1_zero, w2_scale, w2_zero, bits1, group1,
                          bits2, group2, k1, k2, gelu)


def fused_moe_impl(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w1: torch.Tensor,
                   w2: torch.Tensor, w1_scale: Optional[torch.Tensor], w1_zero: Optional[torch.Tensor],
                   w2_scale: Optional[torch.Tensor], w2_zero: Optional[torch.Tensor], bits1: int, group1: int,
                   bits2: int, group2: int, k1: int, k2: int, gelu: bool) -> torch.Tensor:
    """The custom op's body (a plain function, so a dispatch mode can look inside it in tests)."""
    _check(x, topk_weights, topk_ids, w1, w2, bits1, bits2, k1, k2)
    T, H = x.shape
    k = topk_ids.shape[1]
    E, N1 = w1.shape[0], w1.shape[1]
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    # each token's experts in ascending order: pair t * k + j is its j-th smallest expert, so the final sum adds
    # them in the reference's order
    ids, perm = topk_ids.sort(dim=1, stable=True)
    weights = topk_weights.gather(1, perm).contiguous()
    M = T * k
    block_m = block_m_for(M, E)
    sorted_ids, block_expert, num_blocks = moe_align(ids, E, block_m)
    gate_up = torch.empty(M, N1, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, StackedWeight(w1, (N1, k1), bits1, group1, w1_scale, w1_zero), gate_up, k, sorted_ids,
                  block_expert, num_blocks, block_m, None)
    h = gelu_tanh_mul(gate_up) if gelu else silu_mul(gate_up)
    y = torch.empty(M, H, dtype=x.dtype, device=x.device)
    _grouped_gemm(h, StackedWeight(w2, (H, k2), bits2, group2, w2_scale, w2_zero), y, 1, sorted_ids,
                  block_expert, num_blocks, block_m, weights)
    _moe_sum(y, T, k, out)
    return out


@fused_moe_op.register_fake
def _(x, topk_weights, topk_ids, w1, w2, w1_scale, w1_zero, w2_scale, w2_zero, bits1, group1, bits2, group2, k1, k2,
      gelu):
    return x.new_empty(x.shape)


def fused_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              experts: StackedExperts) -> torch.Tensor:
    """ReferenceOps.fused_moe's contract over stacked experts: one custom op."""
    g, d = experts.gate_up, experts.down
    return fused_moe_op(x, topk_weights, topk_ids, g.weight, d.weight, g.scale, g.zero, d.scale, d.zero, g.bits,
                        g.group, d.bits, d.group, g.shape[1], d.shape[1], experts.act == "gelu_tanh_mul")
