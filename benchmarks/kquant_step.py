#!/usr/bin/env python3
"""One Llama-3.1-8B layer's decode matmuls in Q4_K_M's types (q, k, v, o, gate, up as Q4_K, down as Q6_K; with
--mix q5_k_m, Q5_K for Q4_K), times --layers copies so they are read from memory, as a real decode step reads them:
GB/s of weights, per rows of x and with/without int8 activations. The kernel-level view of the decode gap to
llama.cpp (BENCHMARKS.md).

  .venv/bin/python benchmarks/kquant_step.py [--mix q4_k_m|q5_k_m] [--rows 1,4,16] [--layers 3] [--repeat 7]
      [--isa avx512]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from tokenmill.executor.kernels import load, machine_record, runnable_variants
from tokenmill.executor.layers.quant import ggml_weight
from tokenmill.executor.ops import CpuKernelOps

SHAPES = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336)]
MIXES = {"q4_k_m": ("Q4_K",) * 6 + ("Q6_K",), "q5_k_m": ("Q5_K",) * 6 + ("Q6_K",)}
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def kquant(type_name: str, n: int, k: int, rng: np.random.Generator):
    """Random K-quant blocks with small sane fp16 scales (d and dmin for Q4_K and Q5_K, d for Q6_K)."""
    blocks = rng.integers(0, 256, (n, k // 256, BLOCK_BYTES[type_name]), np.uint8)
    half = np.array([0.002], np.float16).view(np.uint8)
    if type_name in ("Q4_K", "Q5_K"):
        blocks[..., 0:2] = half
        blocks[..., 2:4] = half
    else:
        blocks[..., 208:210] = half
    return ggml_weight(type_name, blocks.reshape(n, -1), (n, k))


class Layer:
    def __init__(self, w):
        self.quant, self.bias = w, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mix", default="q4_k_m", choices=list(MIXES))
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--isa", default=None, help="one kernel variant (default: every runnable one)")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    layers = [Layer(kquant(t, n, k, rng)) for _ in range(a.layers) for t, (n, k) in zip(MIXES[a.mix], SHAPES)]
    nbytes = sum(l.quant.nbytes for l in layers)
    m = machine_record()
    print(f"{m['machine']} ({' '.join(m['cpu_flags'])}), {torch.get_num_threads()} threads; {a.mix}, "
          f"{nbytes / 1e9:.2f} GB of weights; "
          f"GB/s read (median of {a.repeat})")
    isas = [a.isa] if a.isa else runnable_variants()
    print("rows  " + "".join(f"{isa + ('+i8' if i8 else ''):>14}" for isa in isas for i8 in (False, True)))
    for b in [int(r) for r in a.rows.split(",")]:
        line = f"{b:4d}  "
        for isa in isas:
            for i8 in (False, True):
                ops = CpuKernelOps(load(isa), torch.float32, int8_activations=i8)
                xs = {k: torch.randn(b, k) for k in {l.quant.shape[1] for l in layers}}
                times = []
                for _ in range(a.repeat):
                    t0 = time.perf_counter()
                    for l in layers:
                        ops.linear(xs[l.quant.shape[1]], l)
                    times.append(time.perf_counter() - t0)
                line += f"{nbytes / statistics.median(times) / 1e9:14.1f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
