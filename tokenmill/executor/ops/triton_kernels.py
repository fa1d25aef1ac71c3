"""Fused Triton kernels for the GPU op plan: RMSNorm (+ the residual add), rotary on q/k in place with the step's K/V
written into the paged cache, and the gated activations (SiLU-mul, GELU(tanh)-mul). Each is a PyTorch custom op
(`torch.ops.tokenmill.*`) with a fake implementation, so tracing (make_fx, torch.compile, the graph stand-in) sees
one op per kernel, with its in-place mutations declared. They run on NVIDIA GPUs, and on CPU tensors under Triton's
interpreter (TRITON_INTERPRET=1, set before this module is imported), which is how the tests check them.

Each kernel reproduces the reference's rounding (ops/reference.py): compute in float32, and round to the tensor's
dtype wherever torch would hold a value in it. Rounding to bfloat16 is done by hand (round to nearest even on the
float32 bits) before the store: the interpreter truncates float32 -> bfloat16 (its "rtne" rounds half away from
zero), a GPU rounds to nearest even, and a pre-rounded value converts exactly on both.

The wrappers read only shapes, strides and dtypes on the host (no syncs, no tensors built from Python values), and
launch nothing for zero rows, so they can be captured in a CUDA graph."""
from typing import Optional

import torch
import triton
import triton.language as tl

# The kernels' limits, declared once: the plan asks the *_fits functions before it picks these kernels.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)             # activations (and norm weights)
KV_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)    # rotary_write's cache: converted on store
MAX_HIDDEN = 16384          # rms_norm: one row in one program, BLOCK_H = next power of two of H
MAX_HEAD_DIM = 256          # rotary_write: full-dim "rotate half" only, even head dims (masked to a power of two)
TILE = 2048                 # elements one program holds at a time in rms_norm, rotary_write and the activations
MAX_ROWS = 16               # rows one program takes at most (small rows share a program)

# the dtype codes the kernels round to (a constexpr each)
_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _round(x, KIND: tl.constexpr):
    """x (float32) rounded to the dtype KIND names (0 float32: itself, 1 bfloat16, 2 float16), kept in float32."""
    if KIND == 1:
        # round to nearest even on the bits: add 0x7FFF plus the lowest kept bit, drop the low 16; NaN stays NaN
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
        x = tl.where(x == x, bits.to(tl.float32, bitcast=True), x)
    elif KIND == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


# ---- RMSNorm -----------------------------------------------------------------------------------------------------

@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, T, H, eps,
                     stride_xt, stride_xh, stride_rt, stride_rh, stride_w, stride_ot, stride_oh,
                     ROWS: tl.constexpr, BLOCK_H: tl.constexpr, HAS_RES: tl.constexpr, RES_KIND: tl.constexpr,
                     W_KIND: tl.constexpr, OUT_KIND: tl.constexpr):
    """One program: ROWS rows, each whole (BLOCK_H >= H). With a residual, residual += x (rounded to its dtype) and
    the sum is what gets normalised; then out = weight * norm(.) rounded to the weight's dtype (Llama's rounding, or
    none for Gemma's float32 1 + w), rounded to out's."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows < T)[:, None] & (cols < H)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xt + cols[None, :] * stride_xh, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if HAS_RES:
        r_ptrs = res_ptr + rows[:, None] * stride_rt + cols[None, :] * stride_rh
        x = _round(x + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32), RES_KIND)
        tl.store(r_ptrs, x, mask=mask)
    # masked columns are 0 and add nothing; the mean is over H
    rstd = tl.rsqrt(tl.sum(x * x, 1) / H + eps)
    n = _round(x * rstd[:, None], W_KIND)
    w = tl.load(w_ptr + cols * stride_w, mask=cols < H, other=0.0).to(tl.float32)
    y = _round(_round(w[None, :] * n, W_KIND), OUT_KIND)
    tl.store(out_ptr + rows[:, None] * stride_ot + cols[None, :] * stride_oh, y, mask=mask)


def rms_norm_fits(hidden: int, dtype: torch.dtype, weight_dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """None when rms_norm's kernel takes rows of this size and dtype, else why not."""
    if hidden > MAX_HIDDEN:
        return f"hidden size {hidden} (at most {MAX_HIDDEN})"
    for d in (dtype, weight_dtype or dtype):
        if d not in DTYPES:
            return f"dtype {d} (takes {', '.join(str(t) for t in DTYPES)})"
    return None


def _rows_per_program(block: int) -> int:
    return max(1, min(MAX_ROWS, TILE // block))


def _warps(elements: int) -> int:
    return 4 if elements <= 4096 else 8 if elements <= 8192 else 16


def _check_rms(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 1 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"rms_norm takes x [T, H] and weight [H], got {tuple(x.shape)} and {tuple(weight.shape)}")
    why = rms_norm_fits(x.shape[1], x.dtype, weight.dtype)
    if why is not None:
        raise ValueError(f"rms_norm's Triton kernel does not take {why}")


def _launch_rms(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
                out: torch.Tensor) -> None:
    T, H = x.shape
    if T == 0:
        return
    block = triton.next_power_of_2(H)
    rows = _rows_per_program(block)
    res = residual if residual is not None else x      # a placeholder pointer when there is none
    _rms_norm_kernel[(triton.cdiv(T, rows),)](
        x, res, weight, out, T, H, eps, x.stride(0), x.stride(1), res.stride(0), res.stride(1), weight.stride(0),
        out.stride(0), out.stride(1), ROWS=rows, BLOCK_H=block, HAS_RES=residual is not None,
        RES_KIND=_KIND[res.dtype], W_KIND=_KIND[weight.dtype], OUT_KIND=_KIND[out.dtype],
        num_warps=_warps(rows * block))


@torch.library.custom_op("tokenmill::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """out = (weight * rmsnorm_float32(x).to(weight.dtype)).to(x.dtype), for x [T, H], weight [H]."""
    _check_rms(x, weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_rms(x, None, weight, eps, out)
    return out


@rms_norm_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape)


@torch.library.custom_op("tokenmill::rms_norm_add", mutates_args=("residual",))
def rms_norm_add_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x in place (in residual's dtype); out = rms_norm of the sum, in residual's dtype."""
    _check_rms(x, weight)
    if residual.shape != x.shape or residual.dtype not in DTYPES:
        raise ValueError(f"rms_norm's residual must be {x.shape[1]}-wide rows like x {tuple(x.shape)} in one of "
                         f"{DTYPES}, got {residual.dtype} {tuple(residual.shape)}")
    out = torch.empty(x.shape, dtype=residual.dtype, device=x.device)
    _launch_rms(x, residual, weight, eps, out)
    return out


@rms_norm_add_op.register_fake
def _(x, residual, weight, eps):
    return residual.new_empty(residual.shape)


def rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """ReferenceOps.rms_norm's contract: with residual, residual += x in place and returns (norm(residual),
    residual); without, (norm(x), x). One kernel either way."""
    if residual is None:
        return rms_norm_op(x, weight, eps), x
    return rms_norm_add_op(x, residual, weight, eps), residual


# ---- rotary + KV cache write -------------------------------------------------------------------------------------

@triton.jit
def _rotary_write_kernel(qk_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
                         H, KV, HALF,
                         stride_qt, stride_qh, stride_qd, stride_vt, stride_vh, stride_vd,
                         stride_ct, stride_cd, stride_st, stride_sd, stride_slot,
                         stride_kcs, stride_kch, stride_kcd, stride_vcs, stride_vch, stride_vcd,
                         BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, ACT_KIND: tl.constexpr,
                         KC_KIND: tl.constexpr, VC_KIND: tl.constexpr):
    """One program: one token, BLOCK_HEADS of its H + 2 KV heads in the order q, k, v. q and k heads are rotated in
    place (rotate half: each head as two halves of HALF dims, loaded apart); k and v heads go to the cache row
    slots[t], unless it is negative (a padding row: its q/k are still rotated, the cache is not touched)."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    j = tl.arange(0, BLOCK_HALF)
    dmask = (j < HALF)[None, :]
    slot = tl.load(slots_ptr + t * stride_slot).to(tl.int64)
    # as a vector: the interpreter mis-types a bool scalar & a bool vector (int32), which a mask may not be
    live = (slot + tl.zeros([BLOCK_HEADS], tl.int64)) >= 0
    is_qk = heads < H + KV
    is_v = (heads >= H + KV) & (heads < H + 2 * KV) & live
    qk_mask = is_qk[:, None] & dmask

    # x * cos + rotate_half(x) * sin, each product and the sum rounded to the activations' dtype as torch rounds
    # them: first half x1 * c1 - x2 * s1, second half x2 * c2 + x1 * s2
    p1 = qk_ptr + t * stride_qt + heads[:, None] * stride_qh + j[None, :] * stride_qd
    p2 = p1 + HALF * stride_qd
    x1 = tl.load(p1, mask=qk_mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=qk_mask, other=0.0).to(tl.float32)
    c_row = cos_ptr + t * stride_ct
    s_row = sin_ptr + t * stride_st
    c1 = tl.load(c_row + j * stride_cd, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(c_row + (j + HALF) * stride_cd, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(s_row + j * stride_sd, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(s_row + (j + HALF) * stride_sd, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    o1 = _round(_round(x1 * c1, ACT_KIND) - _round(x2 * s1, ACT_KIND), ACT_KIND)
    o2 = _round(_round(x2 * c2, ACT_KIND) + _round(x1 * s2, ACT_KIND), ACT_KIND)
    tl.store(p1, o1, mask=qk_mask)
    tl.store(p2, o2, mask=qk_mask)

    # the rotated k heads and the v heads into their cache row, converted to the cache's dtype
    k_mask = ((heads >= H) & is_qk & live)[:, None] & dmask
    kc = k_cache_ptr + slot * stride_kcs + (heads - H)[:, None] * stride_kch + j[None, :] * stride_kcd
    tl.store(kc, _round(o1, KC_KIND), mask=k_mask)
    tl.store(kc + HALF * stride_kcd, _round(o2, KC_KIND), mask=k_mask)
    v_mask = is_v[:, None] & dmask
    vh = heads - (H + KV)
    pv = v_ptr + t * stride_vt + vh[:, None] * stride_vh + j[None, :] * stride_vd
    v1 = tl.load(pv, mask=v_mask, other=0.0).to(tl.float32)
    v2 = tl.load(pv + HALF * stride_vd, mask=v_mask, other=0.0).to(tl.float32)
    vc = v_cache_ptr + slot * stride_vcs + vh[:, None] * stride_vch + j[None, :] * stride_vcd
    tl.store(vc, _round(v1, VC_KIND), mask=v_mask)
    tl.store(vc + HALF * stride_vcd, _round(v2, VC_KIND), mask=v_mask)


def rotary_write_fits(head_dim: int, rotary_dim: int, dtype: torch.dtype,
                      cache_dtype: torch.dtype) -> Optional[str]:
    """None when rotary_write's kernel takes these heads and dtypes, else why not."""
    if rotary_dim != head_dim:
        return f"partial rotary ({rotary_dim} of {head_dim} dims; the kernel rotates whole heads)"
    if head_dim > MAX_HEAD_DIM or head_dim % 2:
        return f"head_dim {head_dim} (an even number up to {MAX_HEAD_DIM})"
    if dtype not in DTYPES:
        return f"activations in {dtype} (takes {', '.join(str(t) for t in DTYPES)})"
    if cache_dtype not in KV_CACHE_DTYPES:
        return f"a {cache_dtype} KV cache (takes {', '.join(str(t) for t in KV_CACHE_DTYPES)})"
    return None


@torch.library.custom_op("tokenmill::rotary_write", mutates_args=("qk", "k_cache", "v_cache"))
def rotary_write(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slots: torch.Tensor, num_q_heads: int) -> None:
    """qk [T, H + KV, D] (any strides: a view into the fused qkv rows) rotated in place by cos, sin ([T, 1, D] or
    [T, D], the activations' dtype); its k heads (qk[:, H:]) and v [T, KV, D] written into k_cache, v_cache
    [slots, KV, D] at row slots[t] (int64 [T]; negative: not written)."""
    T, heads, D = qk.shape
    KV = heads - num_q_heads
    why = rotary_write_fits(D, cos.shape[-1], qk.dtype, k_cache.dtype)
    if why is None and v_cache.dtype not in KV_CACHE_DTYPES:
        why = f"a {v_cache.dtype} V cache"
    if why is not None:
        raise ValueError(f"rotary_write's Triton kernel does not take {why}")
    if KV < 1 or v.shape != (T, KV, D) or k_cache.shape[1:] != (KV, D) or v_cache.shape[1:] != (KV, D) \
            or cos.shape[0] != T or sin.shape != cos.shape or slots.shape != (T,) or cos.dtype != qk.dtype \
            or sin.dtype != qk.dtype:
        raise ValueError(f"rotary_write takes qk [T, H + KV, D], v [T, KV, D], cos and sin [T, D] or [T, 1, D] in "
                         f"qk's dtype, caches [slots, KV, D] and slots [T] for H={num_q_heads}; got qk "
                         f"{tuple(qk.shape)}, v {tuple(v.shape)}, cos {cos.dtype} {tuple(cos.shape)}, sin "
                         f"{sin.dtype} {tuple(sin.shape)}, caches {tuple(k_cache.shape)} {tuple(v_cache.shape)}, "
                         f"slots {tuple(slots.shape)}")
    if T == 0:
        return
    half = D // 2
    block_half = triton.next_power_of_2(half)
    all_heads = num_q_heads + 2 * KV
    block_heads = min(triton.next_power_of_2(all_heads), max(1, TILE // block_half))
    _rotary_write_kernel[(T, triton.cdiv(all_heads, block_heads))](
        qk, v, cos, sin, k_cache, v_cache, slots, num_q_heads, KV, half,
        qk.stride(0), qk.stride(1), qk.stride(2), v.stride(0), v.stride(1), v.stride(2),
        cos.stride(0), cos.stride(-1), sin.stride(0), sin.stride(-1), slots.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), BLOCK_HEADS=block_heads, BLOCK_HALF=block_half, ACT_KIND=_KIND[qk.dtype],
        KC_KIND=_KIND[k_cache.dtype], VC_KIND=_KIND[v_cache.dtype], num_warps=4,
        # unfused: float16 rounding is a conversion the compiler sees through, and it would fuse a product and the
        # sum into one FMA, rounding once where torch rounds twice
        enable_fp_fusion=False)


@rotary_write.register_fake
def _(qk, v, cos, sin, k_cache, v_cache, slots, num_q_heads):
    return None


# ---- gated activations -------------------------------------------------------------------------------------------

@triton.jit
def _act_mul_kernel(gu_ptr, out_ptr, T, I, stride_gt, stride_gi, stride_ot, stride_oi,
                    ROWS: tl.constexpr, BLOCK_I: tl.constexpr, GELU: tl.constexpr, KIND: tl.constexpr):
    """One program: ROWS rows by BLOCK_I columns of act(gate) * up (gate the first I columns). As torch computes it
    in a half dtype: the activation in float32 rounded to the dtype, then the product rounded."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < T)[:, None] & (cols < I)[None, :]
    g_ptrs = gu_ptr + rows[:, None] * stride_gt + cols[None, :] * stride_gi
    g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(g_ptrs + I * stride_gi, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        # torch's formula: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), tanh(z) = 2 sigmoid(2z) - 1
        inner = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
        a = 0.5 * g * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))
    else:
        a = g / (1.0 + tl.exp(-g))          # torch's x / (1 + exp(-x))
    y = _round(_round(a, KIND) * u, KIND)
    tl.store(out_ptr + rows[:, None] * stride_ot + cols[None, :] * stride_oi, y, mask=mask)


def act_mul_fits(dtype: torch.dtype) -> Optional[str]:
    """None when silu_mul's and gelu_tanh_mul's kernel takes this dtype, else why not."""
    return None if dtype in DTYPES else f"dtype {dtype} (takes {', '.join(str(t) for t in DTYPES)})"


def _act_mul(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"the gated activations take gate_up [T, 2 * I], got {tuple(gate_up.shape)}")
    why = act_mul_fits(gate_up.dtype)
    if why is not None:
        raise ValueError(f"the gated activations' Triton kernel does not take {why}")
    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(T, I, dtype=gate_up.dtype, device=gate_up.device)
    if T == 0 or I == 0:
        return out
    block = min(triton.next_power_of_2(I), TILE)
    rows = _rows_per_program(block)
    _act_mul_kernel[(triton.cdiv(T, rows), triton.cdiv(I, block))](
        gate_up, out, T, I, gate_up.stride(0), gate_up.stride(1), out.stride(0), out.stride(1), ROWS=rows,
        BLOCK_I=block, GELU=gelu, KIND=_KIND[gate_up.dtype], num_warps=4)
    return out


@torch.library.custom_op("tokenmill::silu_mul", mutates_args=())
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2 * I], gate first: [T, I]."""
    return _act_mul(gate_up, False)


@torch.library.custom_op("tokenmill::gelu_tanh_mul", mutates_args=())
def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, tanh approximation) * up for gate_up [T, 2 * I], gate first: [T, I] (Gemma's GeGLU)."""
    return _act_mul(gate_up, True)


@silu_mul.register_fake
def _(gate_up):
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


@gelu_tanh_mul.register_fake
def _(gate_up):
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
