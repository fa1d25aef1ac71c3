"""Weight-only int4 / int8 matmul for the GPU plan: y = x @ W^T with W a GroupWeight (layers/quant.py) read as it is
stored (packed unsigned codes, a float scale and an optional uint8 zero point per group of columns), never copied to
a float matrix. Two Triton kernels:

- GEMV (a few rows of x: decode). Memory bound: each program reads a [BLOCK_N, BLOCK_K] tile of codes once,
  dequantises it in registers and reduces it against each row of x on the CUDA cores. The K loop may be split over
  programs (split-K) when N alone gives too few programs to keep the GPU busy.
- GEMM (prompts). A tile of x [BLOCK_M, BLOCK_K] times the tile's integer codes minus the zero point, converted to
  x's dtype (exact: at most 255 in magnitude) for tl.dot, then scaled once per group in float32.

Split-K's float32 partial sums are added in split order by one more launch.

The GEMM's K tile never straddles two groups (BLOCK_K divides the group, or the group is all of K), so a tile takes
one scale and zero point per output column. The GEMV's holds several whole groups where they are small (each group's
products summed, then scaled): a longer run of each row's codes a load. The GEMV does not put 4-bit codes back in
column order: the low nibbles (even columns) meet x's even columns and the high nibbles its odd ones. The GEMM
interleaves them (tl.interleave), so x's tile is one contiguous load that Triton pipelines.

Both accumulate in float32 and round once to x's dtype (bfloat16 by hand, to nearest even, as triton_kernels does).
`group_matmul` picks the kernel from M alone on the host, so a captured graph sees a fixed launch per batch size. The
op is a torch custom op with a fake, so make_fx / CUDA graph capture see one node."""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from tokenmill.executor.layers.quant import GroupWeight
from tokenmill.executor.ops.triton_kernels import _KIND, _round

# The kernels' limits, declared once (group_matmul_fits says which one a weight breaks).
DTYPES = (torch.float32, torch.bfloat16, torch.float16)         # x and the output
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BITS = (4, 8)
MIN_BLOCK_K = 32            # a group is whole K tiles of at least this (tl.dot wants K >= 16 per nibble half)
GEMV_MAX_ROWS = 4           # past a few rows the CUDA cores' FMAs per byte of W outrun memory: tensor cores win


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    tile: int           # codes a program dequantises per step (BLOCK_N x BLOCK_K)
    programs: int       # split K until about this many programs run
    warps: int
    block_k: int        # the K tile at most: several whole groups when they are small


# per code width, from the GPU benchmark's sweep (its kernels part)
GEMV = {4: GemvConfig(tile=4096, programs=1056, warps=4, block_k=512),
        8: GemvConfig(tile=8192, programs=2112, warps=4, block_k=512)}
GEMM_BLOCK_K = 64
TARGET_PROGRAMS = 264       # the GEMM's: two per SM
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _group_params(scale_ptr, zero_ptr, rn, nmask, g, stride_sn, stride_sg, stride_zn, stride_zg,
                  BITS: tl.constexpr, HAS_ZERO: tl.constexpr):
    """The scale and zero point (float32 [BLOCK_N]) of group g for output columns rn."""
    s = tl.load(scale_ptr + rn * stride_sn + g * stride_sg, mask=nmask, other=0.0).to(tl.float32)
    if HAS_ZERO:
        z = tl.load(zero_ptr + rn * stride_zn + g * stride_zg, mask=nmask, other=0).to(tl.float32)
    else:
        z = tl.zeros_like(s) + (1 << (BITS - 1))
    return s, z


@triton.jit
def _gemv_kernel(x_ptr, codes_ptr, scale_ptr, zero_ptr, out_ptr, M, N, K, TILES_PER_SPLIT,
                 stride_xm, stride_xk, stride_cn, stride_ck, stride_sn, stride_sg, stride_zn, stride_zg,
                 stride_os, stride_om, stride_on,
                 ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUPS: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr, HAS_ZERO: tl.constexpr,
                 OUT_KIND: tl.constexpr):
    """One program: BLOCK_N output columns for all ROWS (== M) rows of x, over K tiles [pid_k * TILES_PER_SPLIT, ..).
    A K tile is GROUPS whole groups (or, GROUPS 1, part of one): each group's products are summed, then scaled.
    Each code tile is read once and serves every row; out is [splits, M, N] (float32 partial sums) or [1, M, N]."""
    SUB: tl.constexpr = BLOCK_K // GROUPS           # a group's columns in the tile
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)     # int64: N x K codes may pass 2^31
    nmask = rn < N
    rows = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    t0 = pid_k * TILES_PER_SPLIT
    t1 = tl.minimum(t0 + TILES_PER_SPLIT, tl.cdiv(K, BLOCK_K))
    for t in range(t0, t1):
        k0 = t * BLOCK_K
        # the tile's groups' scales and zero points, [BLOCK_N, GROUPS]
        gs = k0 // GROUP + tl.arange(0, GROUPS)
        gmask = nmask[:, None] & (gs * GROUP < K)[None, :]
        sc = tl.load(scale_ptr + rn[:, None] * stride_sn + gs[None, :] * stride_sg, mask=gmask, other=0.0)
        sc = sc.to(tl.float32)
        if HAS_ZERO:
            zc = tl.load(zero_ptr + rn[:, None] * stride_zn + gs[None, :] * stride_zg, mask=gmask, other=0)
            zc = zc.to(tl.float32)
        else:
            zc = tl.zeros_like(sc) + (1 << (BITS - 1))
        z3 = zc[:, :, None]
        if BITS == 4:
            j = tl.arange(0, BLOCK_K // 2)
            kk = k0 + 2 * j                           # the even columns: byte j's low nibble
            kmask = kk < K
            b = tl.load(codes_ptr + rn[:, None] * stride_cn + (k0 // 2 + j)[None, :] * stride_ck,
                        mask=nmask[:, None] & kmask[None, :], other=0)
            b = tl.reshape(b, [BLOCK_N, GROUPS, SUB // 2])
            lo = (b & 15).to(tl.float32) - z3
            hi = (b >> 4).to(tl.float32) - z3
            for m in tl.static_range(ROWS):
                xe = tl.load(x_ptr + m * stride_xm + kk * stride_xk, mask=kmask, other=0.0).to(tl.float32)
                xo = tl.load(x_ptr + m * stride_xm + (kk + 1) * stride_xk, mask=kmask, other=0.0).to(tl.float32)
                xe = tl.reshape(xe, [GROUPS, SUB // 2])
                xo = tl.reshape(xo, [GROUPS, SUB // 2])
                p = tl.sum(tl.sum(lo * xe[None, :, :] + hi * xo[None, :, :], axis=2) * sc, axis=1)
                acc = tl.where(rows[:, None] == m, acc + p[None, :], acc)
        else:
            kk = k0 + tl.arange(0, BLOCK_K)
            kmask = kk < K
            c = tl.load(codes_ptr + rn[:, None] * stride_cn + kk[None, :] * stride_ck,
                        mask=nmask[:, None] & kmask[None, :], other=0)
            q = tl.reshape(c, [BLOCK_N, GROUPS, SUB]).to(tl.float32) - z3
            for m in tl.static_range(ROWS):
                xm = tl.load(x_ptr + m * stride_xm + kk * stride_xk, mask=kmask, other=0.0).to(tl.float32)
                xm = tl.reshape(xm, [GROUPS, SUB])
                p = tl.sum(tl.sum(q * xm[None, :, :], axis=2) * sc, axis=1)
                acc = tl.where(rows[:, None] == m, acc + p[None, :], acc)
    o_ptrs = out_ptr + pid_k * stride_os + rows[:, None] * stride_om + rn[None, :] * stride_on
    tl.store(o_ptrs, _round(acc, OUT_KIND), mask=(rows < M)[:, None] & nmask[None, :])


@triton.jit
def _gemm_kernel(x_ptr, codes_ptr, scale_ptr, zero_ptr, out_ptr, M, N, K, TILES_PER_SPLIT,
                 stride_xm, stride_xk, stride_cn, stride_ck, stride_sn, stride_sg, stride_zn, stride_zg,
                 stride_os, stride_om, stride_on,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                 BITS: tl.constexpr, HAS_ZERO: tl.constexpr, OUT_KIND: tl.constexpr, IEEE: tl.constexpr):
    """One program: a [BLOCK_M, BLOCK_N] tile of out over K tiles [pid_k * TILES_PER_SPLIT, ..). Per K tile:
    tl.dot(x, codes - zero) in x's dtype, accumulated in float32 times the group's scale."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = rm < M
    nmask = rn < N
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    t0 = pid_k * TILES_PER_SPLIT
    t1 = tl.minimum(t0 + TILES_PER_SPLIT, tl.cdiv(K, BLOCK_K))
    for t in range(t0, t1):
        k0 = t * BLOCK_K
        s, z = _group_params(scale_ptr, zero_ptr, rn, nmask, k0 // GROUP, stride_sn, stride_sg, stride_zn,
                             stride_zg, BITS, HAS_ZERO)
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < K
        # the codes as [BLOCK_K, BLOCK_N] in column order: the dot's right operand
        if BITS == 4:
            j = tl.arange(0, BLOCK_K // 2)
            b = tl.load(codes_ptr + rn[:, None] * stride_cn + (k0 // 2 + j)[None, :] * stride_ck,
                        mask=nmask[:, None] & ((k0 + 2 * j) < K)[None, :], other=0)
            c = tl.trans(tl.interleave(b & 15, b >> 4))
        else:
            c = tl.load(codes_ptr + rn[None, :] * stride_cn + kk[:, None] * stride_ck,
                        mask=kmask[:, None] & nmask[None, :], other=0)
        q = (c.to(tl.float32) - z[None, :]).to(dt)          # integers below 256 in magnitude: exact in x's dtype
        xt = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
                     mask=mmask[:, None] & kmask[None, :], other=0.0)
        if IEEE:
            part = tl.dot(xt.to(tl.float32), q.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(xt, q)
        acc += part * s[None, :]
    o_ptrs = out_ptr + pid_k * stride_os + rm[:, None] * stride_om + rn[None, :] * stride_on
    tl.store(o_ptrs, _round(acc, OUT_KIND), mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, S, MN, OUT_KIND: tl.constexpr, BLOCK: tl.constexpr):
    """out = the S float32 partial sums [S, M*N] added in split order, rounded once to out's dtype."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for sp in range(0, S):
        acc += tl.load(part_ptr + sp * MN + i, mask=mask, other=0.0)
    tl.store(out_ptr + i, _round(acc, OUT_KIND), mask=mask)


def group_matmul_fits(w: GroupWeight, dtype: torch.dtype) -> Optional[str]:
    """None when group_matmul's kernels take this weight with activations in dtype, else why not."""
    n, k = w.shape
    if n == 0 or k == 0:
        return f"an empty weight {n} x {k}"
    if w.bits not in BITS:
        return f"{w.bits}-bit codes (takes {' or '.join(map(str, BITS))})"
    if dtype not in DTYPES:
        return f"activations in {dtype} (takes {', '.join(str(t) for t in DTYPES)})"
    if w.scale.dtype not in SCALE_DTYPES:
        return f"scales in {w.scale.dtype} (takes {', '.join(str(t) for t in SCALE_DTYPES)})"
    if w.codes.dtype != torch.uint8 or (w.zero is not None and w.zero.dtype != torch.uint8):
        return f"codes in {w.codes.dtype} / zero points in {None if w.zero is None else w.zero.dtype} (uint8)"
    if w.group <= 0 or k % w.group:
        return f"groups of {w.group} over K={k} (K must be whole groups)"
    if w.group != k and w.group % MIN_BLOCK_K:
        return f"groups of {w.group} (a multiple of {MIN_BLOCK_K}, or all of K={k})"
    if w.bits == 4 and k % 2:
        return f"4-bit codes over an odd K={k}"
    if w.perm is not None and w.perm.dtype not in (torch.int32, torch.int64):
        return f"an act-order permutation in {w.perm.dtype} (int32 or int64)"
    return None


def _block_k(group: int, k: int, most: int) -> int:
    """The K tile: the largest power of two up to `most` that divides the group; all of K (rounded up to a power of
    two, masked) when the group is K and not such a multiple."""
    if group % MIN_BLOCK_K == 0:
        b = most
        while group % b:
            b //= 2
        return b
    return max(MIN_BLOCK_K, min(most, triton.next_power_of_2(k)))


def _gemv_tile_k(group: int, k: int, most: int) -> tuple[int, int]:
    """The GEMV's (K tile, groups in it): whole groups of a power-of-two size, as many as fit in `most` (and K
    needs); else _block_k's tile, inside one group."""
    bk = _block_k(group, k, most)
    if bk != group:
        return bk, 1
    groups = max(1, min(most // group, triton.next_power_of_2(k // group)))
    return groups * group, groups


def _splits(programs: int, k_tiles: int, target: int) -> tuple[int, int]:
    """(splits of K, tiles per split) so that programs x splits comes near target, no split empty."""
    want = max(1, min(k_tiles, target // max(1, programs)))
    per = triton.cdiv(k_tiles, want)
    return triton.cdiv(k_tiles, per), per


def launch(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor], bits: int,
           group: int, gemv: Optional[GemvConfig] = None) -> torch.Tensor:
    """group_matmul_op's body. The GEMV's configuration defaults to GEMV's for the code width; the GPU benchmark
    passes others to sweep them."""
    M, K = x.shape
    N = codes.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    zp = zero if zero is not None else scale          # a placeholder pointer when there is none
    strides = (x.stride(0), x.stride(1), codes.stride(0), codes.stride(1), scale.stride(0), scale.stride(1),
               zp.stride(0), zp.stride(1))
    if M <= GEMV_MAX_ROWS:
        cfg = gemv or GEMV[bits]
        bk, groups = _gemv_tile_k(group, K, cfg.block_k)
        bn = max(16, min(cfg.tile // bk, triton.next_power_of_2(N)))
        grid_n, k_tiles = triton.cdiv(N, bn), triton.cdiv(K, bk)
        splits, per = _splits(grid_n, k_tiles, cfg.programs)
        dst = out.unsqueeze(0) if splits == 1 else torch.empty(splits, M, N, device=x.device)
        _gemv_kernel[(grid_n, splits)](
            x, codes, scale, zp, dst, M, N, K, per, *strides, dst.stride(0), dst.stride(1), dst.stride(2),
            ROWS=M, BLOCK_M=triton.next_power_of_2(M), BLOCK_N=bn, BLOCK_K=bk, GROUPS=groups, GROUP=group, BITS=bits,
            HAS_ZERO=zero is not None, OUT_KIND=_KIND[dst.dtype], num_warps=cfg.warps)
    else:
        bm = 16 if M <= 16 else 32 if M <= 32 else 64
        bn = 64 if M <= 64 else 128
        bk = _block_k(group, K, GEMM_BLOCK_K)
        grid_m, grid_n, k_tiles = triton.cdiv(M, bm), triton.cdiv(N, bn), triton.cdiv(K, bk)
        splits, per = _splits(grid_m * grid_n, k_tiles, TARGET_PROGRAMS)
        dst = out.unsqueeze(0) if splits == 1 else torch.empty(splits, M, N, device=x.device)
        _gemm_kernel[(grid_m, grid_n, splits)](
            x, codes, scale, zp, dst, M, N, K, per, *strides, dst.stride(0), dst.stride(1), dst.stride(2),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP=group, BITS=bits, HAS_ZERO=zero is not None,
            OUT_KIND=_KIND[dst.dtype], IEEE=x.dtype == torch.float32 or INTERPRETED,
            num_warps=8 if bm * bn >= 64 * 128 else 4)     # a 64 x 128 tile over 4 warps nears the register limit
    if splits > 1:
        # split-K: float32 partial sums added in a fixed order, in one launch
        block = 1024
        _sum_splits_kernel[(triton.cdiv(M * N, block),)](dst, out, splits, M * N, OUT_KIND=_KIND[out.dtype],
                                                         BLOCK=block, num_warps=4)
    return out


@torch.library.custom_op("tokenmill::group_matmul", mutates_args=())
def group_matmul_op(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor],
                    bits: int, group: int) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype, for W as GroupWeight's codes, scale, zero (its columns already in
    x's order: group_matmul applies an act-order permutation to x first)."""
    return launch(x, codes, scale, zero, bits, group)


@group_matmul_op.register_fake
def _(x, codes, scale, zero, bits, group):
    return x.new_empty(x.shape[0], codes.shape[0])


def group_matmul(x: torch.Tensor, w: GroupWeight) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x's dtype. An act-order weight takes x's columns in its order first."""
    why = group_matmul_fits(w, x.dtype)
    n, k = w.shape
    if why is None and x.shape[-1] != k:
        why = f"x with {x.shape[-1]} columns for a {n} x {k} weight"
    if why is not None:
        raise ValueError(f"group_matmul's Triton kernels do not take {why}")
    x2 = x.reshape(-1, k)
    if w.perm is not None:
        x2 = x2.index_select(1, w.perm)
    y = group_matmul_op(x2, w.codes, w.scale, w.zero, w.bits, w.group)
    return y.reshape(*x.shape[:-1], n)
