#!/usr/bin/env python3
"""Compile the GPU's Triton kernels ahead of time for an NVIDIA H100 (sm_90), with no GPU: Triton's own toolchain
(its front end, LLVM and the ptxas in its wheel) turns each kernel into a cubin, so a kernel that does not compile
for the device is caught here rather than on a GPU machine.

The kernels are the fused ops' (tokenmill/executor/ops/triton_kernels.py: RMSNorm, rotary + KV-cache write, the
gated activations), the int4 / int8 group-quantised matmul's (tokenmill/executor/ops/triton_quant.py: GEMV, GEMM,
the split-K sum), the FP8 activations' row quantiser (ops/triton_fp8.py), the gated delta rule's decode step
(ops/triton_delta_rule.py), the paged attention's (tokenmill/executor/attention/triton_kernels.py: split-K decode,
its merge, the prompt kernel) and LoRA's shrink and expand (tokenmill/executor/ops/triton_lora.py). Each variant is
launched through its real Python wrapper on small CPU tensors laid out as the model and the runners lay them out
(views into the fused qkv rows, int32 or int64 index arrays, fp8 caches with their scales); the launch is
intercepted, never run, and its arguments specialised exactly as Triton's JIT would specialise them on a GPU
(dtypes, constexprs, integers equal to 1, 16-divisibility and alignment), then compiled with
triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32)). So the constexprs (BLOCK sizes, rows per program,
num_warps, IEEE, ...) are the wrappers' own, not a copy of them. (The specialisation goes through
triton.runtime.jit's create_function_from_signature and JITFunction._pack_args, Triton 3.9's internals.)

One line per compiled kernel: warps, registers, spill stores/loads and stack (ptxas -v), shared memory (the compiled
kernel's metadata) and compile time. Exits 1 when any variant fails to compile (its error follows its line).

  .venv/bin/python benchmarks/triton_aot_check.py [-j JOBS] [--arch 90] [-k SUBSTRING] [--wide]

A representative subset of the combinations, not their full product: about 105 kernels, about a minute on 2 cores
(--wide adds the attention kernels' dtype x head_dim product: about 180 kernels).
Every compile is fresh (a temporary Triton cache, removed at the end). TRITON_INTERPRET must not be set: the kernel
modules would then hold interpreter functions, which do not compile.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import io
import multiprocessing
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OPS = "tokenmill.executor.ops.triton_kernels"
ATTN = "tokenmill.executor.attention.triton_kernels"
QUANT = "tokenmill.executor.ops.triton_quant"
LORA = "tokenmill.executor.ops.triton_lora"
FP8 = "tokenmill.executor.ops.triton_fp8"
DELTA = "tokenmill.executor.ops.triton_delta_rule"
KERNELS = {     # (module, kernel): a short name for the report
    (OPS, "_rms_norm_kernel"): "rms_norm",
    (OPS, "_rotary_write_kernel"): "rotary_write",
    (OPS, "_act_mul_kernel"): "act_mul",
    (ATTN, "_decode_split_kernel"): "decode_split",
    (ATTN, "_decode_merge_kernel"): "decode_merge",
    (ATTN, "_prompt_kernel"): "prompt",
    (QUANT, "_gemv_kernel"): "group_gemv",
    (QUANT, "_gemm_kernel"): "group_gemm",
    (QUANT, "_sum_splits_kernel"): "sum_splits",
    (FP8, "_quantize_rows_kernel"): "fp8_rows",
    (DELTA, "_delta_rule_step_kernel"): "delta_rule",
    (LORA, "_lora_shrink_kernel"): "lora_shrink",
    (LORA, "_lora_expand_kernel"): "lora_expand",
}
HIGH_REGS = 200         # flagged: close to the 255 a thread may hold, occupancy suffers
# kernels that round each product and sum to the activations' dtype as torch's ops do: a half-precision FMA in
# their PTX rounds once where torch rounds twice (a compile error here)
ROUNDS_AS_TORCH = {(OPS, "_rotary_write_kernel")}
_HALF_FMA = re.compile(r"\bfma\.rn\.(?:f16|bf16)")


def _quiet() -> None:
    # the Triton 3.9 notice about TRITON_DEFAULT_FP_FUSION: the JIT's default (fusion on) is what is compiled here
    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")


# ---- the variants: real wrapper calls on CPU tensors --------------------------------------------------------------

@dataclass
class Launch:
    kernel: tuple[str, str]
    label: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    key: str = ""
    also: list[str] = field(default_factory=list)


class Recorder:
    """Replaces each kernel's launch (JITFunction.run) with one that records the arguments and launches nothing,
    then specialises them as JITFunction.run does (its binder and _pack_args) for the target's backend."""

    def __init__(self, target) -> None:
        import importlib

        from triton import knobs
        from triton.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature
        self.knobs = knobs
        self.backend = make_backend(target)
        self.launches: list[tuple[tuple[str, str], dict, tuple]] = []
        self.binders = {}
        for mod, name in KERNELS:
            fn = getattr(importlib.import_module(mod), name)
            if not hasattr(fn, "params"):
                raise SystemExit(f"{mod}.{name} is not a JITFunction (TRITON_INTERPRET set?)")
            self.binders[(mod, name)] = (fn, create_function_from_signature(fn.signature, fn.params, self.backend))
            fn.run = self._recorder((mod, name))

    def _recorder(self, kernel):
        def run(*args, grid, warmup, **kwargs):
            self.launches.append((kernel, kwargs, args))
            return None
        return run

    def take(self, label: str) -> list[Launch]:
        out = []
        for kernel, kwargs, args in self.launches:
            fn, binder = self.binders[kernel]
            kwargs = dict(kwargs)
            # as JITFunction.run sets them before it binds
            kwargs["debug"] = kwargs.get("debug", fn.debug) or self.knobs.runtime.debug
            kwargs["instrumentation_mode"] = self.knobs.compilation.instrumentation_mode
            kwargs["fpsan_homomorphic_casts"] = self.knobs.compilation.fpsan_homomorphic_casts
            bound, spec, opts = binder(*args, **kwargs)
            options, signature, constexprs, attrs = fn._pack_args(self.backend, kwargs, bound, spec, opts)
            lb = label if kernel[1] != "_decode_merge_kernel" else re.sub(r" G=\d+| kv=\S+| cap| bs=\d+", "", label)
            out.append(Launch(kernel, lb, signature, constexprs, attrs, dict(options.__dict__),
                              key=repr((kernel, signature, sorted(constexprs.items()), sorted(attrs.items()),
                                        sorted(options.__dict__.items())))))
        self.launches.clear()
        return out


def variants(wide: bool = False) -> list[tuple[str, Callable[[], None]]]:
    """(label, a call of the wrapper) for each variant; wide: the attention kernels' dtype x head_dim product too."""
    import torch

    from tokenmill.executor.attention import triton_kernels as A
    from tokenmill.executor.ops import triton_kernels as F

    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    name = {f32: "fp32", bf16: "bf16", f16: "fp16", e4m3: "fp8e4m3", e5m2: "fp8e5m2"}
    out: list[tuple[str, Callable[[], None]]] = []

    # RMSNorm: x [T, H], weight [H] (float32 for Gemma's 1 + w with half activations), residual in x's dtype
    def rms(H, xd, wd, res, T):
        x, w = torch.empty(T, H, dtype=xd), torch.empty(H, dtype=wd)
        r = torch.empty(T, H, dtype=xd) if res else None
        return lambda: F.rms_norm(x, r, w, 1e-6)

    for H in (64, 4096, 5120):
        for xd, wd in ((f32, f32), (bf16, bf16), (f16, f16), (bf16, f32)):
            for res in (False, True):
                out.append((f"H={H} x={name[xd]} w={name[wd]}{' +res' if res else ''} T=7", rms(H, xd, wd, res, 7)))
    # one row (a single decode): T == 1 is specialised to a constant by the JIT, a kernel of its own
    out.append(("H=4096 x=bf16 w=bf16 +res T=1", rms(4096, bf16, bf16, True, 1)))
    out.append(("H=5120 x=bf16 w=fp32 T=1", rms(5120, bf16, f32, False, 1)))

    # rotary + cache write: qk and v views into the fused qkv rows [T, H + 2 KV, D], cos/sin [T, 1, D] in the
    # activations' dtype, caches [slots, KV, D], slots int64
    def rotary(D, H, KV, act, kc, vc, T):
        qkv = torch.empty(T, H + 2 * KV, D, dtype=act)
        qk, v = qkv[:, :H + KV], qkv[:, H + KV:]
        cos, sin = torch.empty(T, 1, D, dtype=act), torch.empty(T, 1, D, dtype=act)
        kcache, vcache = torch.empty(64, KV, D, dtype=kc), torch.empty(64, KV, D, dtype=vc)
        slots = torch.empty(T, dtype=torch.long)
        return lambda: F.rotary_write(qk, v, cos, sin, kcache, vcache, slots, H)

    for D, H, KV, act, kc, vc, T in (
            (64, 32, 8, bf16, bf16, bf16, 5), (80, 32, 32, bf16, bf16, bf16, 5), (128, 32, 8, bf16, bf16, bf16, 5),
            (256, 16, 8, bf16, bf16, bf16, 5), (128, 32, 8, f32, f32, f32, 5), (128, 32, 8, f16, f16, f16, 5),
            (64, 32, 8, f32, bf16, bf16, 5), (256, 8, 1, f16, f32, f32, 5), (80, 32, 8, f32, f16, f16, 5),
            (128, 32, 8, bf16, f32, f32, 1), (256, 32, 8, bf16, bf16, f16, 5), (128, 64, 8, bf16, bf16, bf16, 5)):
        cache = name[kc] if kc == vc else f"{name[kc]}/{name[vc]}"
        out.append((f"D={D} H={H}/KV={KV} qk={name[act]} cache={cache} T={T}", rotary(D, H, KV, act, kc, vc, T)))

    # gated activations: gate_up [T, 2 I]
    def act(I, dt, gelu, T):
        gu = torch.empty(T, 2 * I, dtype=dt)
        return (lambda: F.gelu_tanh_mul(gu)) if gelu else (lambda: F.silu_mul(gu))

    for gelu in (False, True):
        for dt in (bf16, f32, f16):
            out.append((f"{'gelu' if gelu else 'silu'} I=14336 {name[dt]} T=7", act(14336, dt, gelu, 7)))
    out.append(("silu I=14336 bf16 T=1", act(14336, bf16, False, 1)))
    out.append(("silu I=64 bf16 T=7", act(64, bf16, False, 7)))
    out.append(("gelu I=688 fp32 T=7", act(688, f32, True, 7)))

    # attention. The index arrays as the two paths make them: the host path (TritonBackend.prepare) one int32
    # buffer split into qsl, num_computed, seq_lens, tables, decode_reqs, tile_req, tile_m0; the GPU runner
    # int64 qsl / start / lens slices of its header, int32 tables (index_select), int64 decode entries (arange)
    # for a captured decode and int32 tile_req / tile_m0 (to_device)
    B, W = 3, 8

    def index(path, tiles=2):
        if path == "host":
            parts = [B + 1, B, B, B * W, B, tiles, tiles]
            qsl, computed, lens, tables, dec, treq, tm0 = torch.split(torch.zeros(sum(parts), dtype=torch.int32),
                                                                      parts)
            return qsl, computed, lens, tables.view(B, W), dec, treq, tm0
        header = torch.zeros(64, dtype=torch.long)
        start, lens, qsl = header[5:5 + B], header[9:9 + B], header[13:14 + B]
        tables = torch.zeros(B, W, dtype=torch.int32)
        flat = torch.zeros(2 * tiles, dtype=torch.int32)
        return qsl, start, lens, tables, torch.arange(16)[:B], flat[:tiles], flat[tiles:]

    def attn_tensors(D, H, KV, qd, cd):
        T = 2 * A.BLOCK_M + B
        q = torch.empty(T, H + 2 * KV, D, dtype=qd)[:, :H]         # the fused qkv rows' q heads
        kc, vc = torch.empty(128, KV, D, dtype=cd), torch.empty(128, KV, D, dtype=cd)
        scales = (torch.ones(KV), torch.ones(KV)) if cd in (e4m3, e5m2) else (None, None)
        return q, torch.empty_like(q), kc, vc, scales

    def decode(D, H, KV, qd, cd, S, win, cap, path, bs, sinks=False):
        q, o, kc, vc, (ks, vs) = attn_tensors(D, H, KV, qd, cd)
        qsl, _, lens, tables, dec, _, _ = index(path)
        sink = torch.zeros(H) if sinks else None
        return lambda: A.paged_decode(o, q, kc, vc, ks, vs, qsl, lens, tables, dec, S, bs, D ** -0.5,
                                      4096 if win else None, 50.0 if cap else None, sink)

    def prompt(D, H, KV, qd, cd, win, cap, path, bs, sinks=False):
        q, o, kc, vc, (ks, vs) = attn_tensors(D, H, KV, qd, cd)
        qsl, computed, _, tables, _, treq, tm0 = index(path)
        sink = torch.zeros(H) if sinks else None
        return lambda: A.paged_prompt(o, q, kc, vc, ks, vs, qsl, computed, tables, treq, tm0, bs, D ** -0.5,
                                      4096 if win else None, 50.0 if cap else None, sink)

    def alabel(D, H, KV, qd, cd, win, cap, path, bs, S=None, sinks=False):
        return (f"{'' if S is None else f'S={S} '}D={D} G={H // KV} q={name[qd]} kv={name[cd]}"
                f"{' win' if win else ''}{' cap' if cap else ''}{' sinks' if sinks else ''} idx={path} bs={bs}"
                f"{' IEEE' if qd == f32 else ''}")

    for D, H, KV, qd, cd, S, win, cap, path, bs in (
            (128, 32, 8, bf16, bf16, 1, False, False, "host", 16),     # Llama 3 8B
            (128, 32, 8, bf16, bf16, 8, False, False, "gpu", 16),
            (128, 32, 8, bf16, bf16, 32, False, False, "gpu", 16),
            (64, 8, 8, f32, f32, 32, False, False, "host", 16),        # IEEE, no GQA
            (64, 32, 8, f32, f32, 8, True, False, "gpu", 16),
            (256, 16, 8, bf16, bf16, 8, True, True, "gpu", 16),        # Gemma 2 9B
            (256, 32, 4, f32, f32, 32, True, True, "gpu", 16),         # the largest IEEE one
            (128, 32, 8, bf16, e4m3, 8, False, False, "gpu", 16),      # fp8 cache with its scales
            (64, 32, 8, f32, e4m3, 1, False, False, "host", 16),
            (256, 16, 4, bf16, e5m2, 32, True, False, "gpu", 16),
            (128, 32, 32, f16, f16, 8, False, True, "host", 16),
            (80, 32, 32, bf16, bf16, 8, False, False, "gpu", 16),      # D not a power of two (phi-2)
            (128, 64, 8, bf16, bf16, 32, False, False, "gpu", 32),
            (128, 64, 4, bf16, bf16, 8, False, False, "gpu", 16),      # MAX_GROUP
            (128, 48, 8, bf16, bf16, 8, False, False, "host", 16),     # a group of 6 in 16 rows
            (64, 32, 8, f32, bf16, 8, False, False, "host", 16),       # float32 model, bfloat16 cache
            (128, 32, 4, f32, bf16, 8, False, False, "gpu", 16),
            (256, 32, 4, f32, bf16, 8, True, True, "gpu", 16),
            (256, 8, 1, bf16, bf16, 1, True, True, "host", 16),        # one kv head
            (256, 32, 4, f32, e4m3, 32, True, True, "gpu", 16)):       # everything at once
        out.append((alabel(D, H, KV, qd, cd, win, cap, path, bs, S),
                    decode(D, H, KV, qd, cd, S, win, cap, path, bs)))

    for D, H, KV, qd, cd, win, cap, path, bs in (
            (128, 32, 8, bf16, bf16, False, False, "host", 16),
            (128, 32, 8, bf16, bf16, False, False, "gpu", 16),
            (64, 8, 8, f32, f32, False, False, "host", 16),
            (256, 16, 8, bf16, bf16, True, True, "gpu", 16),
            (256, 32, 4, f32, f32, True, True, "gpu", 16),
            (128, 32, 8, bf16, e4m3, False, False, "gpu", 16),
            (64, 32, 4, f32, e4m3, True, False, "host", 16),
            (80, 32, 32, f16, f16, False, False, "host", 16),
            (128, 64, 4, bf16, e5m2, False, True, "gpu", 32),
            (128, 32, 4, f32, bf16, False, False, "gpu", 16),
            (256, 8, 8, f32, bf16, True, False, "host", 16)):
        out.append((alabel(D, H, KV, qd, cd, win, cap, path, bs), prompt(D, H, KV, qd, cd, win, cap, path, bs)))
    # gpt-oss: a sink a head with 128-token windows, 8 query heads a kv head; one split (folded in at its end) and
    # several (added by the merge)
    for S in (1, 8):
        out.append((alabel(64, 64, 8, bf16, bf16, True, False, "gpu", 16, S, sinks=True),
                    decode(64, 64, 8, bf16, bf16, S, True, False, "gpu", 16, sinks=True)))
    out.append((alabel(64, 64, 8, bf16, bf16, True, False, "gpu", 16, sinks=True),
                prompt(64, 64, 8, bf16, bf16, True, False, "gpu", 16, sinks=True)))

    # int4 / int8 group-quantised linear layers (ops/triton_quant.py): x [M, K], a GroupWeight's uint8 codes, scales
    # [N, K/group] and uint8 zero points. M picks the kernel (GEMV up to GEMV_MAX_ROWS rows) and the GEMM's tile;
    # N x K picks the split of K (float32 partial sums when split)
    from tokenmill.executor.ops import triton_quant as Q

    def gmm(M, N, K, bits, group, zero, xd, sd):
        x = torch.empty(M, K, dtype=xd)
        codes = torch.empty(N, K // 2 if bits == 4 else K, dtype=torch.uint8)
        scale = torch.empty(N, K // group, dtype=sd)
        z = torch.empty(N, K // group, dtype=torch.uint8) if zero else None
        return lambda: Q.group_matmul_op(x, codes, scale, z, bits, group)

    for M, N, K, bits, group, zero, xd, sd in (
            (1, 4096, 4096, 4, 128, False, bf16, bf16),        # Llama 3 8B GPTQ, decode: split K
            (1, 14336, 4096, 4, 128, True, f16, f16),          # AWQ gate_up: no split
            (4, 6144, 4096, 4, 128, False, bf16, f32),
            (3, 4096, 14336, 8, 128, False, bf16, bf16),
            (1, 4096, 4096, 8, 32, True, f32, f32),
            (2, 4096, 4096, 4, 4096, False, f16, f16),         # one scale per row
            (1, 128256, 4096, 4, 64, True, bf16, bf16),        # an LM head
            (16, 4096, 4096, 4, 128, False, bf16, bf16),       # GEMM, decode batches and prompts
            (32, 14336, 4096, 4, 128, True, f16, f16),
            (300, 4096, 14336, 4, 128, False, bf16, bf16),
            (300, 4096, 4096, 8, 128, False, bf16, bf16),
            (300, 4096, 4096, 4, 32, True, f32, f32),
            (64, 6144, 4096, 8, 4096, True, f16, bf16),
            (512, 128256, 4096, 4, 128, False, bf16, bf16)):
        out.append((f"M={M} N={N} K={K} int{bits} g={group}{' zp' if zero else ''} x={name[xd]} s={name[sd]}",
                    gmm(M, N, K, bits, group, zero, xd, sd)))

    # FP8 activations (ops/triton_fp8.py): rows padded to the scaled matmul's 16
    from tokenmill.executor.ops import triton_fp8 as F8

    def fp8_rows(M, K, xd, rows):
        x = torch.empty(M, K, dtype=xd)
        return lambda: F8.quantize_rows(x, rows)

    for M, K, xd, rows in ((1, 4096, bf16, 16), (300, 14336, f16, 304), (5, 100, f32, 16)):
        out.append((f"fp8 rows M={M} K={K} x={name[xd]} pad={rows}", fp8_rows(M, K, xd, rows)))

    # the gated delta rule's decode step (ops/triton_delta_rule.py): Qwen3.5's and Qwen3-Next's head dims
    from tokenmill.executor.ops import triton_delta_rule as DR

    def delta(B, H, dk, dv):
        q, k = torch.empty(B, H, dk), torch.empty(B, H, dk)
        v, g, beta = torch.empty(B, H, dv), torch.empty(B, H), torch.empty(B, H)
        state, slots = torch.empty(max(B, 4), H, dk, dv), torch.zeros(B, dtype=torch.long)
        return lambda: DR.delta_rule_step(q, k, v, g, beta, state, slots)

    for B, H, dk, dv in ((1, 16, 128, 128), (8, 32, 128, 128), (3, 4, 40, 72)):
        out.append((f"delta B={B} H={H} dk={dk} dv={dv}", delta(B, H, dk, dv)))

    # LoRA's shrink-expand: each row its adapter's slot (int32 as the runner sends it; -1 rows), a fused qkv's
    # three ranks side by side (R = 3 x 16) and an MLP's gate_up (R = 2 x 64)
    from tokenmill.executor.ops import triton_lora as L

    def lora(T, IN, R, OUT, dt, S=8):
        x, y = torch.empty(T, IN, dtype=dt), torch.empty(T, OUT, dtype=dt)
        a, b = torch.empty(S, IN, R, dtype=dt), torch.empty(S, R, OUT, dtype=dt)
        slot = torch.zeros(T, dtype=torch.int32)
        return lambda: L.lora_shrink_expand(x, y, a, b, slot)

    for T, IN, R, OUT, dt in ((64, 4096, 48, 6144, bf16), (1, 4096, 128, 28672, f16), (300, 14336, 16, 4096, f32)):
        out.append((f"lora T={T} in={IN} r={R} out={OUT} {name[dt]}", lora(T, IN, R, OUT, dt)))

    if wide:    # every head_dim x q dtype x cache dtype x (window + softcap) for decode (8 splits) and prompt, G=8
        for D in (64, 128, 256):
            for qd in (bf16, f32):
                for cd in (f32, bf16, e4m3):
                    for wc in (False, True):
                        out.append((alabel(D, 32, 4, qd, cd, wc, wc, "gpu", 16, 8),
                                    decode(D, 32, 4, qd, cd, 8, wc, wc, "gpu", 16)))
                        out.append((alabel(D, 32, 4, qd, cd, wc, wc, "gpu", 16),
                                    prompt(D, 32, 4, qd, cd, wc, wc, "gpu", 16)))
    return out


# ---- compiling (in worker processes) ------------------------------------------------------------------------------

_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _init_worker(cache_dir: str) -> None:
    _quiet()
    from triton import knobs
    knobs.cache.dir = cache_dir
    knobs.nvidia.dump_ptxas_log = True      # make_cubin prints ptxas -v's log: registers, stack, spills


@contextlib.contextmanager
def _fd2_to(path: str):
    """The process's stderr (fd 2: MLIR and LLVM diagnostics) into a file for the duration."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def compile_one(launch: Launch, arch: int) -> dict:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = getattr(importlib.import_module(launch.kernel[0]), launch.kernel[1])
    stdout = io.StringIO()
    with tempfile.NamedTemporaryFile(suffix=".stderr", delete=False) as f:
        err_path = f.name
    t = time.perf_counter()
    res = {"ok": True}
    try:
        with contextlib.redirect_stdout(stdout), _fd2_to(err_path):
            src = ASTSource(fn=fn, signature=launch.signature, constexprs=launch.constexprs, attrs=launch.attrs)
            ck = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=launch.options)
        md = ck.metadata
        res.update(warps=md.num_warps, shared=md.shared, cubin=len(ck.kernel))
        if launch.kernel in ROUNDS_AS_TORCH and _HALF_FMA.search(ck.asm["ptx"]):
            raise ValueError("a fused half-precision FMA where the kernel rounds as torch's separate ops do "
                             "(launch it with enable_fp_fusion=False)")
        log = stdout.getvalue()
        if m := _PTXAS_REGS.search(log):
            res["regs"] = int(m.group(1))
        if m := _PTXAS_SPILL.search(log):
            res["stack"], res["spill_st"], res["spill_ld"] = map(int, m.groups())
    except BaseException as e:     # a compile error of any kind is this variant's finding
        res = {"ok": False, "error": "".join(traceback.format_exception_only(type(e), e)).strip()}
        diag = Path(err_path).read_text(errors="replace").strip() if os.path.exists(err_path) else ""
        if diag:
            res["error"] += "\n--- stderr ---\n" + "\n".join(diag.splitlines()[-40:])
    finally:
        if os.path.exists(err_path):
            os.remove(err_path)
    res["seconds"] = time.perf_counter() - t
    return res


# ---- main ---------------------------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="compiles at once (processes)")
    ap.add_argument("--arch", type=int, default=90, help="the CUDA compute capability to compile for (90: H100)")
    ap.add_argument("-k", dest="only", default=None, help="only the kernels whose line contains this")
    ap.add_argument("--wide", action="store_true", help="add the attention kernels' product of head_dim, q dtype, "
                    "cache dtype, window + softcap (72 more, about a minute on 2 cores)")
    args = ap.parse_args()

    if os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1 is set: the kernels would be interpreted, not compiled; unset it", file=sys.stderr)
        return 2
    _quiet()
    t0 = time.perf_counter()
    import torch
    torch.set_num_threads(1)
    from triton.backends.compiler import GPUTarget
    import triton

    rec = Recorder(GPUTarget("cuda", args.arch, 32))
    launches: list[Launch] = []
    seen: dict[str, Launch] = {}
    setup_failures = []
    for label, call in variants(args.wide):
        try:
            call()
            got = rec.take(label)
        except Exception as e:         # the wrapper refused the variant: the check itself is wrong
            rec.launches.clear()
            setup_failures.append(f"{label}: {type(e).__name__}: {e}")
            continue
        for ln in got:
            full = f"{KERNELS[ln.kernel]:<13} {ln.label}"
            if args.only and args.only not in full:
                continue
            ln.label = full
            if ln.key in seen:
                seen[ln.key].also.append(full)
            else:
                seen[ln.key] = ln
                launches.append(ln)

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    print(f"Triton {triton.__version__}, target cuda sm_{args.arch} (ptxas from {ptxas}); {len(launches)} kernels "
          f"({sum(len(x.also) for x in launches)} repeated launches folded), {args.jobs} jobs")
    for s in setup_failures:
        print(f"SETUP FAIL  {s}")

    cache_dir = tempfile.mkdtemp(prefix="tm-triton-aot-")
    failures, flagged = [], []
    try:
        ctx = multiprocessing.get_context("spawn")      # no fork of a process that has torch's thread pools
        with cf.ProcessPoolExecutor(max_workers=max(1, args.jobs), mp_context=ctx, initializer=_init_worker,
                                    initargs=(cache_dir,)) as pool:
            futures = [pool.submit(compile_one, ln, args.arch) for ln in launches]
            width = max((len(ln.label) for ln in launches), default=0)
            for ln, fut in zip(launches, futures):
                try:
                    r = fut.result()
                except Exception as e:      # the worker died (a crash in the compiler)
                    r = {"ok": False, "error": f"worker failed: {type(e).__name__}: {e}", "seconds": 0.0}
                if not r["ok"]:
                    failures.append(ln)
                    print(f"FAIL  {ln.label:<{width}} | {r['seconds']:5.1f} s")
                    print("      " + r["error"].replace("\n", "\n      "))
                    continue
                spill = r.get("spill_st", 0) + r.get("spill_ld", 0)
                regs = r.get("regs")
                note = []
                if spill:
                    note.append("SPILLS")
                if regs is not None and regs >= HIGH_REGS:
                    note.append("HIGH REGS")
                if note:
                    flagged.append((ln.label, ", ".join(note)))
                print(f"ok    {ln.label:<{width}} | warps {r['warps']:2d}  regs {regs if regs is not None else '?':>3}"
                      f"  spill {r.get('spill_st', '?')}/{r.get('spill_ld', '?')} B  stack {r.get('stack', '?')} B"
                      f"  smem {r['shared']:6d} B | {r['seconds']:5.1f} s{'  <-- ' + ', '.join(note) if note else ''}",
                      flush=True)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)

    print(f"\n{len(launches) - len(failures)}/{len(launches)} kernels compiled for sm_{args.arch}, "
          f"{len(failures)} failed, {len(setup_failures)} variants not set up; {len(flagged)} flagged "
          f"(spills, or >= {HIGH_REGS} registers); {time.perf_counter() - t0:.0f} s")
    for label, why in flagged:
        print(f"  flagged: {label}: {why}")
    for ln in failures:
        print(f"  failed: {ln.label}")
    return 1 if failures or setup_failures else 0


if __name__ == "__main__":
    sys.exit(main())
