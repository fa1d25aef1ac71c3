#!/usr/bin/env python3
"""One decode step's quantised matmuls, per kernel variant and batch size: SmolLM2-135M's 120 matrices (30 layers
of qkv, o, gate_up, down) as random Q4_1 blocks, ~66 MB, so the step reads them from memory as a real one does.
Each variant runs with float activations and (where it has the int8 route, up to 16 rows) int8 ones.

  .venv/bin/python benchmarks/qmatmul_step.py [--rows 1,8,16,20,21,32,48,64] [--repeat 7]   -> a table, ms a step
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from tokenmill.executor.kernels import load, runnable_variants, this_cpu
from tokenmill.executor.layers.quant import pack_ggml
from tokenmill.executor.ops import CpuKernelOps

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]   # qkv, o, gate_up, down: [N, K]


def q4_1(n: int, k: int, rng: np.random.Generator):
    """Random Q4_1 blocks of [n, k]: fp16 d and m, then 16 bytes of nibbles, per 32 weights."""
    blocks = np.empty((n, k // 32, 20), np.uint8)
    blocks[..., 0:2] = np.array([0.01], np.float16).view(np.uint8)
    blocks[..., 2:4] = np.array([-0.08], np.float16).view(np.uint8)
    blocks[..., 4:] = rng.integers(0, 256, (n, k // 32, 16), np.uint8)
    return pack_ggml("Q4_1", blocks.reshape(n, -1), (n, k))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,16,20,21,32,48,64")
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    rng = np.random.default_rng(0)
    weights = [q4_1(n, k, rng) for _ in range(30) for n, k in SHAPES]
    print(f"{this_cpu().model}, {torch.get_num_threads()} threads; ms for 120 matrices (median of {a.repeat})")
    arms = [(isa, i8) for isa in runnable_variants() for i8 in (False, True)]
    print("rows  " + "".join(f"{isa + (' int8' if i8 else ' float'):>14}" for isa, i8 in arms))
    ops = {arm: CpuKernelOps(load(arm[0]), torch.float32, int8_activations=arm[1]) for arm in arms}
    packed = {arm: [o._register(w) for w in weights] for arm, o in ops.items()}
    for b in rows:
        x = {k: torch.randn(b, k) for k in {k for _, k in SHAPES}}
        line = f"{b:4d}  "
        for arm, o in ops.items():
            times = []
            for _ in range(a.repeat):
                t = time.perf_counter()
                for w in packed[arm]:
                    o.qmatmul(x[w.shape[1]], w)
                times.append(1e3 * (time.perf_counter() - t))
            line += f"{statistics.median(times):14.1f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
