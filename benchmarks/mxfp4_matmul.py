#!/usr/bin/env python3
"""gpt-oss's expert matmul on the CPU kernels: one expert's gate_up (5,760 x 2,880) and down (2,880 x 2,880), as
gpt-oss-20b/120b have them, in MXFP4 blocks against the same weights in Q4_0 and Q8_0 (the tuned block kernels),
for a decode step's rows. Weight bytes read per second are the figure: decode is memory-bound.

  .venv/bin/python benchmarks/mxfp4_matmul.py [--rows 1 4] [--repeat 200] [--types MXFP4 Q4_0 Q8_0] [--json OUT]

No peer runs here: llama.cpp has no single-matmul entry point in llama-cpp-python. Random weights (normal, std 0.02)
rounded by gguf-py's quantisers; the machine's CPU and the kernel variant are recorded."""
from __future__ import annotations

import argparse
import json
import time

import gguf
import numpy as np
import torch

from tokenmill.executor.kernels import load, machine_record
from tokenmill.executor.layers.linear import Linear
from tokenmill.executor.layers.quant import ggml_weight, pack_ggml
from tokenmill.executor.ops import CpuKernelOps

SHAPES = {"gate_up": (5760, 2880), "down": (2880, 2880)}
TYPES = ("MXFP4", "Q4_0", "Q8_0")


def weight(type_name: str, n: int, k: int, rng: np.random.Generator):
    raw = np.asarray(gguf.quants.quantize((rng.standard_normal((n, k)) * 0.02).astype(np.float32),
                                          gguf.GGMLQuantizationType[type_name])).reshape(n, -1)
    return pack_ggml(type_name, raw, (n, k)) or ggml_weight(type_name, raw, (n, k)), raw.nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--types", nargs="+", default=list(TYPES), choices=TYPES)
    ap.add_argument("--json")
    args = ap.parse_args()
    ops = CpuKernelOps(load("auto"), torch.float32, int8_activations=False)
    rng = np.random.default_rng(0)
    results = []
    for shape, (n, k) in SHAPES.items():
        for type_name in args.types:
            w, nbytes = weight(type_name, n, k, rng)
            lin = Linear(k, n, False, ops)
            lin.quant, lin.weight = ops.adopt(w, torch.device("cpu")), None
            lin.finalize()
            for rows in args.rows:
                x = torch.randn(rows, k)
                for _ in range(10):
                    lin(x)
                times = []
                for _ in range(args.repeat):
                    t = time.perf_counter()
                    lin(x)
                    times.append(time.perf_counter() - t)
                med = float(np.median(times))
                results.append(dict(shape=shape, type=type_name, rows=rows, bytes=nbytes, median_us=med * 1e6,
                                    gb_s=nbytes / med / 1e9))
                print(f"{shape:8s} {type_name:6s} rows={rows:<3d} {nbytes / 2**20:6.1f} MiB  {med * 1e6:8.1f} us  "
                      f"{nbytes / med / 1e9:6.1f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_record(), "kernels": ops.kernels.isa, "threads": torch.get_num_threads(),
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
