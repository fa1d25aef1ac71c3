"""Paged attention kernels in Triton: split-K decoding (flash-decoding) and varlen prompt attention, both reading K/V
in place from the paged cache through the block tables. They run on NVIDIA GPUs, and on CPU tensors under Triton's
interpreter (TRITON_INTERPRET=1, set before this module is imported), which is how `make test` checks them.

Every score and sum is float32. Softmax is online (running max and sum per query row); a decode split leaves its
partial output and log-sum-exp, and a second kernel weighs the splits by them.

The decode launch is safe to capture in a CUDA graph: its grid depends on the batch size, the head counts and a
static most splits (decode_splits), never on the lengths, which change at every replay; each program reads its own
request's length on the device and decides there how many splits that request uses. Both entry points are PyTorch
custom ops (tokenmill::paged_decode, tokenmill::paged_prompt), so make_fx and torch.compile record each call as one
op."""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

# The kernels' limits, declared once: the backend refuses anything outside them at load.
MAX_HEAD_DIM = 256
MAX_GROUP = 16              # query heads per kv head in one decode program (tl.dot wants 16 rows anyway)
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
BLOCK_M = 16                # query rows per prompt tile
BLOCK_N = 32                # keys per inner step
MAX_SPLITS = 32             # decode splits of one request's context (the grid's static most, a power of two)
MIN_SPLIT_LEN = 4 * BLOCK_N  # keys per split of a request's context: its splits average two key tiles or more
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _decode_split_kernel(
        q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, out_ptr, part_o_ptr, part_lse_ptr,
        qsl_ptr, seq_lens_ptr, tables_ptr, decode_reqs_ptr, sinks_ptr,
        scale, softcap, window,
        stride_qt, stride_qh, stride_ks, stride_kh, stride_table, stride_ot, stride_oh,
        MAX_SPLITS: tl.constexpr, MIN_SPLIT_LEN: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
        IEEE: tl.constexpr):
    """One program: one decoding request, one kv head with all its query heads (GQA), one split of the context.
    The request uses n = min(MAX_SPLITS, max(1, cdiv(keys, MIN_SPLIT_LEN))) splits, counted here from its own
    length (the grid has MAX_SPLITS whatever the lengths); the programs past its n leave at once. A length of 0 (a
    padding row of a captured batch) reads nothing and leaves a zero row."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    req = tl.load(decode_reqs_ptr + b)
    seq_len = tl.load(seq_lens_ptr + req)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(seq_len - window, 0)
    # the merge kernel counts n the same way
    n = tl.minimum(tl.maximum(tl.cdiv(seq_len - start, MIN_SPLIT_LEN), 1), MAX_SPLITS)
    if s >= n:
        return
    row = tl.load(qsl_ptr + req)
    per_split = tl.cdiv(tl.cdiv(seq_len - start, n), BLOCK_N) * BLOCK_N
    lo = start + s * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    g = tl.arange(0, BLOCK_G)
    dd = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    qmask = (g < GROUP)[:, None] & (dd < D)[None, :]
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + dd[None, :], mask=qmask, other=0.0)
    q = q.to(tl.float32)
    table = tables_ptr + req * stride_table

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < hi
        # one table lookup for K and V; nested jit calls are avoided (each costs milliseconds interpreted)
        blk = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0)
        kv_off = (blk.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE)[:, None] * stride_ks + kvh * stride_kh \
            + dd[None, :]
        kv_mask = valid[:, None] & (dd < D)[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        if HAS_SCALE:
            k = k * tl.load(k_scale_ptr + kvh)
        if IEEE:
            sc = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            sc = tl.dot(q.to(q_ptr.dtype.element_ty), tl.trans(k.to(q_ptr.dtype.element_ty))) * scale
        if HAS_SOFTCAP:
            sc = (2.0 * tl.sigmoid(2.0 * sc / softcap) - 1.0) * softcap    # tanh
        sc = tl.where(valid[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(sc - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        if HAS_SCALE:
            v = v * tl.load(v_scale_ptr + kvh)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q_ptr.dtype.element_ty), v.to(q_ptr.dtype.element_ty))
        m_i = m_new

    if HAS_SINKS and MAX_SPLITS == 1:   # with splits, the merge adds the sink once
        sink = tl.load(sinks_ptr + heads, mask=g < GROUP, other=0.0)
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.exp(sink - m_new)
        acc = acc * alpha[:, None]
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if MAX_SPLITS == 1:
        tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + dd[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=qmask)
    else:
        # partials [Bd, H, MAX_SPLITS, BLOCK_D] and [Bd, H, MAX_SPLITS], the first n written; an empty split's
        # lse is -inf
        H = tl.num_programs(1) * GROUP
        base = (b * H + heads) * MAX_SPLITS + s
        tl.store(part_o_ptr + base[:, None] * BLOCK_D + dd[None, :], o, mask=(g < GROUP)[:, None])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(part_lse_ptr + base, lse, mask=g < GROUP)


@triton.jit
def _decode_merge_kernel(out_ptr, part_o_ptr, part_lse_ptr, qsl_ptr, seq_lens_ptr, decode_reqs_ptr, sinks_ptr,
                         window, stride_ot, stride_oh, MAX_SPLITS: tl.constexpr, MIN_SPLIT_LEN: tl.constexpr,
                         D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr):
    """One program: one decoding request's head; its n splits (counted as the split kernel counts them) weighed
    by exp(lse - max lse). The partials past n were never written and are not read; no split with a key (a
    length of 0) gives a zero row. A sink joins as one more split whose output is zero and whose lse is the sink."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    H = tl.num_programs(1)
    req = tl.load(decode_reqs_ptr + b)
    row = tl.load(qsl_ptr + req)
    seq_len = tl.load(seq_lens_ptr + req)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(seq_len - window, 0)
    n = tl.minimum(tl.maximum(tl.cdiv(seq_len - start, MIN_SPLIT_LEN), 1), MAX_SPLITS)
    s = tl.arange(0, MAX_SPLITS)
    used = s < n
    dd = tl.arange(0, BLOCK_D)
    base = (b * H + h) * MAX_SPLITS + s
    lse = tl.load(part_lse_ptr + base, mask=used, other=float("-inf"))
    top = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h)
        top = tl.maximum(top, sink)
    w = tl.exp(lse - tl.where(top == float("-inf"), 0.0, top))
    total = tl.sum(w, 0)
    if HAS_SINKS:
        total += tl.exp(sink - top)
    w = w / tl.where(total == 0.0, 1.0, total)
    o = tl.sum(tl.load(part_o_ptr + base[:, None] * BLOCK_D + dd[None, :], mask=used[:, None], other=0.0)
               * w[:, None], 0)
    tl.store(out_ptr + row * stride_ot + h * stride_oh + dd, o.to(out_ptr.dtype.element_ty), mask=dd < D)


@triton.jit
def _prompt_kernel(
        q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, out_ptr,
        qsl_ptr, num_computed_ptr, tables_ptr, tile_req_ptr, tile_m0_ptr, sinks_ptr,
        scale, softcap, window,
        stride_qt, stride_qh, stride_ks, stride_kh, stride_table, stride_ot, stride_oh,
        GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
        IEEE: tl.constexpr):
    """One program: BLOCK_M query rows of one request and one head, over the cached context up to each row's own
    position (fresh prompts, later chunks and prefix-cache hits alike: the step's K/V are in the cache already)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    req = tl.load(tile_req_ptr + t)
    m0 = tl.load(tile_m0_ptr + t)
    row0 = tl.load(qsl_ptr + req)
    nrows = tl.load(qsl_ptr + req + 1) - row0
    ctx0 = tl.load(num_computed_ptr + req)
    kvh = h // GROUP

    m = m0 + tl.arange(0, BLOCK_M)
    dd = tl.arange(0, BLOCK_D)
    rvalid = m < nrows
    qpos = ctx0 + m
    qmask = rvalid[:, None] & (dd < D)[None, :]
    q = tl.load(q_ptr + (row0 + m)[:, None] * stride_qt + h * stride_qh + dd[None, :], mask=qmask, other=0.0)
    q = q.to(tl.float32)
    table = tables_ptr + req * stride_table

    hi = ctx0 + tl.minimum(m0 + BLOCK_M, nrows)        # one past the tile's last query position
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx0 + m0 - window + 1, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < hi
        # one table lookup for K and V; nested jit calls are avoided (each costs milliseconds interpreted)
        blk = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0)
        kv_off = (blk.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE)[:, None] * stride_ks + kvh * stride_kh \
            + dd[None, :]
        kv_mask = valid[:, None] & (dd < D)[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        if HAS_SCALE:
            k = k * tl.load(k_scale_ptr + kvh)
        if IEEE:
            sc = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            sc = tl.dot(q.to(q_ptr.dtype.element_ty), tl.trans(k.to(q_ptr.dtype.element_ty))) * scale
        if HAS_SOFTCAP:
            sc = (2.0 * tl.sigmoid(2.0 * sc / softcap) - 1.0) * softcap    # tanh
        seen = valid[None, :] & (pos[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            seen = seen & (qpos[:, None] - pos[None, :] < window)
        sc = tl.where(seen, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(sc - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        if HAS_SCALE:
            v = v * tl.load(v_scale_ptr + kvh)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q_ptr.dtype.element_ty), v.to(q_ptr.dtype.element_ty))
        m_i = m_new
    if HAS_SINKS:       # the head's sink: one more score in every row's softmax, with no value
        sink = tl.load(sinks_ptr + h)
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.exp(sink - m_new)
        acc = acc * alpha[:, None]
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (row0 + m)[:, None] * stride_ot + h * stride_oh + dd[None, :],
             o.to(out_ptr.dtype.element_ty), mask=qmask)


def fits(num_heads: int, num_kv_heads: int, head_dim: int) -> Optional[str]:
    """None when the kernels take these shapes, else why not."""
    if num_heads % num_kv_heads:
        return f"{num_heads} query heads over {num_kv_heads} kv heads (not a whole number per kv head)"
    if num_heads // num_kv_heads > MAX_GROUP:
        return f"{num_heads // num_kv_heads} query heads per kv head (at most {MAX_GROUP})"
    if head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} (at most {MAX_HEAD_DIM})"
    return None


def _common(q: torch.Tensor, k_cache: torch.Tensor, k_scale: Optional[torch.Tensor], window: Optional[int],
            softcap: Optional[float], sinks: Optional[torch.Tensor]) -> dict:
    D = q.shape[-1]
    return dict(D=D, BLOCK_D=max(16, triton.next_power_of_2(D)), HAS_SCALE=k_scale is not None,
                HAS_SOFTCAP=softcap is not None, HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None,
                # float32 models get float32 products (no TF32); half models multiply in their dtype, accumulate in float32
                IEEE=q.dtype == torch.float32 or INTERPRETED)


def decode_splits(batch: int, kv_heads: int, min_programs: int) -> int:
    """The decode grid's most splits of a context for a batch of this many requests: the least power of two (at
    most MAX_SPLITS) with batch x kv_heads x splits >= min_programs, so that a small batch still fills the device.
    The lengths play no part (a graph captured for this batch size serves every step); each request's own split
    count is the kernel's, from its length, up to this."""
    splits = 1
    while splits < MAX_SPLITS and 0 < batch * kv_heads * splits < min_programs:
        splits *= 2
    return splits


@torch.library.custom_op("tokenmill::paged_decode", mutates_args=("out",))
def _paged_decode_op(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor], qsl: torch.Tensor,
                     seq_lens: torch.Tensor, tables: torch.Tensor, decode_reqs: torch.Tensor, max_splits: int,
                     block_size: int, scale: float, window: Optional[int], softcap: Optional[float],
                     sinks: Optional[torch.Tensor]) -> None:
    H, KV = q.shape[1], k_cache.shape[1]
    group = H // KV
    c = _common(q, k_cache, k_scale, window, softcap, sinks)
    bd = decode_reqs.shape[0]
    if bd == 0:
        return
    part_o = part_lse = out
    if max_splits > 1:
        part_o = torch.empty(bd, H, max_splits, c["BLOCK_D"], dtype=torch.float32, device=q.device)
        part_lse = torch.empty(bd, H, max_splits, dtype=torch.float32, device=q.device)
    dummy = k_scale if k_scale is not None else qsl
    _decode_split_kernel[(bd, KV, max_splits)](
        q, k_cache, v_cache, dummy, v_scale if v_scale is not None else qsl, out, part_o, part_lse,
        qsl, seq_lens, tables, decode_reqs, sinks if sinks is not None else qsl, scale, softcap or 1.0, window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), tables.stride(0), out.stride(0),
        out.stride(1), MAX_SPLITS=max_splits, MIN_SPLIT_LEN=MIN_SPLIT_LEN, GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N, **c)
    if max_splits > 1:
        _decode_merge_kernel[(bd, H)](out, part_o, part_lse, qsl, seq_lens, decode_reqs,
                                      sinks if sinks is not None else qsl, window or 0,
                                      out.stride(0), out.stride(1), MAX_SPLITS=max_splits,
                                      MIN_SPLIT_LEN=MIN_SPLIT_LEN, D=c["D"], BLOCK_D=c["BLOCK_D"],
                                      HAS_WINDOW=c["HAS_WINDOW"], HAS_SINKS=c["HAS_SINKS"])


@_paged_decode_op.register_fake
def _(out, q, k_cache, v_cache, k_scale, v_scale, qsl, seq_lens, tables, decode_reqs, max_splits, block_size,
      scale, window, softcap, sinks) -> None:
    return None


def paged_decode(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor], qsl: torch.Tensor,
                 seq_lens: torch.Tensor, tables: torch.Tensor, decode_reqs: torch.Tensor, max_splits: int,
                 block_size: int, scale: float, window: Optional[int], softcap: Optional[float],
                 sinks: Optional[torch.Tensor] = None) -> None:
    """out[row] for each decoding request (decode_reqs: request indices; its one query row is qsl[req]).
    q, out [T, H, D]; caches [slots, KV, D]; tables [B, W] int32 (block ids, any value past the context).
    max_splits: the grid's most splits of a context (decode_splits), a power of two; the lengths are read on the
    device only, so the call can be captured in a CUDA graph and replayed with new lengths written in place.
    sinks: [H] float32, each head's sink logit (gpt-oss), or None."""
    assert max_splits & (max_splits - 1) == 0 and 1 <= max_splits <= MAX_SPLITS, max_splits
    torch.ops.tokenmill.paged_decode(out, q, k_cache, v_cache, k_scale, v_scale, qsl, seq_lens, tables,
                                     decode_reqs, max_splits, block_size, scale, window, softcap, sinks)


@torch.library.custom_op("tokenmill::paged_prompt", mutates_args=("out",))
def _paged_prompt_op(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor], qsl: torch.Tensor,
                     num_computed: torch.Tensor, tables: torch.Tensor, tile_req: torch.Tensor,
                     tile_m0: torch.Tensor, block_size: int, scale: float, window: Optional[int],
                     softcap: Optional[float], sinks: Optional[torch.Tensor]) -> None:
    H, KV = q.shape[1], k_cache.shape[1]
    if tile_req.shape[0] == 0:
        return
    c = _common(q, k_cache, k_scale, window, softcap, sinks)
    _prompt_kernel[(tile_req.shape[0], H)](
        q, k_cache, v_cache, k_scale if k_scale is not None else qsl, v_scale if v_scale is not None else qsl,
        out, qsl, num_computed, tables, tile_req, tile_m0, sinks if sinks is not None else qsl, scale,
        softcap or 1.0, window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), tables.stride(0), out.stride(0),
        out.stride(1), GROUP=H // KV, BLOCK_SIZE=block_size, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, **c)


@_paged_prompt_op.register_fake
def _(out, q, k_cache, v_cache, k_scale, v_scale, qsl, num_computed, tables, tile_req, tile_m0, block_size, scale,
      window, softcap, sinks) -> None:
    return None


def paged_prompt(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor], qsl: torch.Tensor,
                 num_computed: torch.Tensor, tables: torch.Tensor, tile_req: torch.Tensor, tile_m0: torch.Tensor,
                 block_size: int, scale: float, window: Optional[int], softcap: Optional[float],
                 sinks: Optional[torch.Tensor] = None) -> None:
    """out rows of the prompt requests, one program per (tile, head): tile t is BLOCK_M rows of request
    tile_req[t] from its row tile_m0[t]. sinks: as paged_decode's."""
    torch.ops.tokenmill.paged_prompt(out, q, k_cache, v_cache, k_scale, v_scale, qsl, num_computed, tables,
                                     tile_req, tile_m0, block_size, scale, window, softcap, sinks)
