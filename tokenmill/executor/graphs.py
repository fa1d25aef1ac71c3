"""A captured step: record once, replay over the same static buffers.

CudaGraph is the real thing (torch.cuda.CUDAGraph, all sizes in one memory pool). TracedGraph is its stand-in on a
CPU: the step is traced into aten ops at capture (make_fx, real tensors), so every decision Python took from the
capture batch's values is frozen into the trace, as a CUDA graph freezes them; replay runs the trace, reading the
static buffers and the weights and KV cache through the same tensor objects. A step that reads a value on the host,
or builds a tensor from Python values, replays that value: exactly the bug a CUDA graph has, caught on a CPU."""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch

Outputs = Any      # a tensor or a tuple of tensors


@contextmanager
def frozen_gc() -> Iterator[None]:
    """Python's collector frozen for the captures (each capture would otherwise run it over every object, slowly)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class CudaGraph:
    def __init__(self, device: torch.device, pool: Optional[Any] = None):
        self.device = device
        self.pool = pool
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.outputs: Outputs = None

    def capture(self, fn: Callable[[], Outputs]) -> Outputs:
        # one eager run on a side stream first: kernels compile and allocators settle outside the capture
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool):
            self.outputs = fn()
        return self.outputs

    def replay(self) -> Outputs:
        self.graph.replay()
        return self.outputs

    @property
    def memory_pool(self) -> Any:
        return self.graph.pool()


class TracedGraph:
    def __init__(self, device: torch.device, pool: Optional[Any] = None):
        self.device = device
        self.module: Optional[torch.fx.GraphModule] = None

    def capture(self, fn: Callable[[], Outputs]) -> Outputs:
        from torch.fx.experimental.proxy_tensor import make_fx
        self.module = make_fx(fn, tracing_mode="real")()
        return self.replay()

    def replay(self) -> Outputs:
        return self.module()

    @property
    def memory_pool(self) -> Any:
        return None


def graph_class(device: torch.device) -> type:
    return CudaGraph if device.type == "cuda" else TracedGraph
