#!/usr/bin/env python3
"""The gated delta rule's decode step (Qwen3.5's linear layers) per plan: torch's gather, step and scatter
(ReferenceOps) against the CPU kernel (tm_delta_rule_step) on one decode token's every linear layer, float32
states in their slots. Best of --repeats, in ms a token.

  .venv/bin/python benchmarks/delta_rule_step.py [--heads 16] [--dk 128] [--dv 128] [--layers 18] [--rows 1,8]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from tokenmill.executor.kernels import load, machine_record
from tokenmill.executor.ops import CpuKernelOps, ReferenceOps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    plans = {"torch": ReferenceOps(), "kernel": CpuKernelOps(load("auto"), torch.float32)}
    res = {"machine": machine_record(), "shape": vars(a), "ms_per_token": {}}
    for B in (int(r) for r in a.rows.split(",")):
        state = torch.randn(a.layers, max(B, 16), a.heads, a.dk, a.dv, generator=g)
        q, k = (torch.nn.functional.normalize(torch.randn(B, a.heads, a.dk, generator=g), dim=-1) for _ in range(2))
        v = torch.randn(B, a.heads, a.dv, generator=g)
        decay, beta = -torch.rand(B, a.heads, generator=g), torch.rand(B, a.heads, generator=g)
        slots = torch.arange(B)
        best = {name: float("inf") for name in plans}
        for _ in range(a.repeats):
            for name, ops in plans.items():
                t = time.perf_counter()
                for layer in range(a.layers):
                    ops.delta_rule_step(q, k, v, decay, beta, state[layer], slots)
                best[name] = min(best[name], (time.perf_counter() - t) * 1e3)
        res["ms_per_token"][B] = best
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
