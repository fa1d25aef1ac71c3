"""The ops the model calls, in plain torch: the reference implementation (the oracle in tests) and the
interface every other implementation keeps. One implementation serves a model, chosen at load (ops/__init__.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from tokenmill.executor.layers.gated_deltanet import recurrent_step
from tokenmill.executor.layers.quant import (Fp8Weight, GroupWeight, PackedWeight, QuantWeight, RowParts,
                                            blocks_to_group, dequantize_rows, select_rows)
from tokenmill.executor.layers.rotary import apply_rotary

# a prefill tile of dequantised rows: 4 MB, and at least 128 rows however long they are, so each GEMM is big enough
# to run near the machine's peak (BENCHMARKS.md, run v)
TILE_BYTES = 4 << 20
MIN_TILE_ROWS = 128


@dataclass(frozen=True)
class LoRASegments:
    """A step's rows grouped by adapter slot: index [n * L] each group's rows padded to L with its first row, keep
    [n * L, 1] zero on the padding, slots [n] the slots in use (None: the first n, in order)."""
    index: torch.Tensor
    keep: torch.Tensor
    slots: Optional[torch.Tensor]
    num_slots: int
    length: int

    @classmethod
    def of(cls, row_slots: Optional[torch.Tensor], device: torch.device, dtype: torch.dtype
           ) -> Optional["LoRASegments"]:
        groups: dict[int, list[int]] = {}
        for row, slot in enumerate(() if row_slots is None else row_slots.tolist()):
            if slot >= 0:
                groups.setdefault(slot, []).append(row)
        if not groups:
            return None
        order = sorted(groups)
        length = max(len(g) for g in groups.values())
        index = [r for s in order for r in groups[s] + [groups[s][0]] * (length - len(groups[s]))]
        keep = [float(i < len(groups[s])) for s in order for i in range(length)]
        first = order == list(range(len(order)))        # slots 0..n-1: the stacks' leading slots, no gather
        return cls(torch.tensor(index, device=device), torch.tensor(keep, dtype=dtype, device=device)[:, None],
                   None if first else torch.tensor(order, device=device), len(order), length)


class ReferenceOps:
    name = "reference"
    # whether a step of this plan can be captured in a graph: its ops are torch's (or custom ops), reading no host
    # values
    graph_safe = True
    # whether fused_moe runs with no host read (the reference counts each expert's tokens on the host)
    moe_graph_safe = False
    kernels = None          # the CPU kernel library an implementation calls, if any (the attention backend's too)

    def prepare(self, model) -> None:
        """Load-time work on a loaded model (kernel layouts of its weights); none here."""

    def adopt(self, w: QuantWeight, device: torch.device) -> Optional[QuantWeight]:
        """A quantised weight as it loads, in the form this plan computes with, or None: it is dequantised into a
        float weight. Here every form runs on the CPU (dequantised tiles); on a GPU the integer and FP8 forms move
        there, Q8_0/Q4_0 blocks as integer groups, and any other GGUF block type is dequantised."""
        if device.type == "cpu":
            return w
        if isinstance(w, RowParts):
            parts = [self.adopt(p, device) for p in w.parts]
            return None if any(p is None for p in parts) else RowParts(tuple(parts))
        if isinstance(w, PackedWeight):
            w = blocks_to_group(w)
        return w.to(device) if isinstance(w, (GroupWeight, Fp8Weight)) else None

    def linear(self, x: torch.Tensor, layer) -> torch.Tensor:
        """y = x W^T + b for a layers.linear.Linear."""
        if layer.quant is not None:
            y = self.tiled_matmul(x, layer.quant)
            return y if layer.bias is None else y + layer.bias
        if layer.weight_t is None:
            return F.linear(x, layer.weight, layer.bias)
        if layer.bias is not None:
            return torch.addmm(layer.bias, x, layer.weight_t)
        return x @ layer.weight_t

    def tiled_matmul(self, x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
        """x @ W^T for a quantised W, a tile of its rows dequantised at a time into one scratch buffer: no float
        copy of W exists, and each tile is decoded once for all of x's rows. Stacked parts go one by one, each
        with its own dequantiser."""
        if isinstance(w, RowParts):
            return torch.cat([self.tiled_matmul(x, p) for p in w.parts], dim=1)
        n, k = w.shape
        tile = min(n, max(MIN_TILE_ROWS, TILE_BYTES // (4 * k)))
        scratch = torch.empty(tile, k, device=x.device)     # x's device: a GroupWeight may live on a GPU
        # a bfloat16 model multiplies in bfloat16, its tiles rounded as its own weights would be (the faster GEMM
        # where the CPU has AVX512-BF16: BENCHMARKS.md, run v); any other dtype in float32
        gemm_dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
        low = torch.empty(tile, k, dtype=gemm_dtype, device=x.device) if gemm_dtype != torch.float32 else None
        xg = x.to(gemm_dtype)
        y = torch.empty(x.shape[0], n, dtype=gemm_dtype, device=x.device)
        for row0 in range(0, n, tile):
            rows = min(tile, n - row0)
            t = self.dequantize(w, row0, rows, scratch[:rows])
            if low is not None:
                t = low[:rows].copy_(t)
            y[:, row0:row0 + rows] = xg @ t.t()
        return y.to(x.dtype)

    def dequantize(self, w: QuantWeight, row0: int, rows: int, out: torch.Tensor) -> torch.Tensor:
        """Rows row0 .. row0+rows-1 of W in float32, into out [rows, K]."""
        return out.copy_(dequantize_rows(w, row0, rows))

    # the tensor-parallel group (parallel.TPGroup) of a model split over ranks; None for one process
    tp = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks a model is split over (x itself in one process)."""
        return x if self.tp is None else self.tp.all_reduce(x)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Every rank's share of the vocabulary's logits side by side (the logits themselves in one process)."""
        return logits if self.tp is None else self.tp.gather_last(logits)

    def embedding(self, ids: torch.Tensor, table) -> torch.Tensor:
        """The rows of a layers.linear.Embedding for ids [T]."""
        if table.quant is None:
            return F.embedding(ids, table.weight)
        return self.lookup(table.quant, ids).to(table.dtype)

    def lookup(self, w: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows ids of a quantised table."""
        return dequantize_rows(select_rows(w, ids))

    def rms_norm(self, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's fused form: with residual, residual += x in place and returns (norm(residual), residual);
        without, (norm(x), x)."""
        if residual is not None:
            residual += x
            x = residual
        # normalise in float32 as transformers does (one fused op), then scale in the weight's dtype: the model's
        # (Llama's rounding), or float32 for Gemma's (1 + w), which transformers rounds once, after the scaling
        return (weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(weight.dtype)).to(x.dtype), x

    def rotary(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """qk [T, heads, D] rotated by its token's position (cos, sin [T, 1, D]), "rotate half": returns the
        rotated heads (an implementation may rotate qk in place and return it)."""
        return apply_rotary(qk, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [T, 2 * inter], gate first."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu(gate, tanh approximation) * up for gate_up [T, 2 * inter], gate first (Gemma's GeGLU)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def swiglu_oai_mul(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        """gpt-oss's clamped SwiGLU for gate_up [T, 2 * inter], gate first: gate clamped above at limit, up on
        both sides, then (up + 1) * gate * sigmoid(alpha * gate), in transformers' order of operations."""
        gate, up = gate_up.chunk(2, dim=-1)
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(dim=-1)

    def fused_moe(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  experts: Sequence[Callable[[torch.Tensor], torch.Tensor]]) -> torch.Tensor:
        """sum over k of topk_weights[t, k] * experts[topk_ids[t, k]](x[t]) for x [T, hidden] (vLLM's fused_moe).
        The token-expert pairs are sorted by expert, so each expert that got tokens runs once on all of them; a
        token's outputs are added in ascending expert order, as transformers adds them."""
        k = topk_ids.shape[1]
        flat = topk_ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(experts))
        active = counts.nonzero().flatten()
        ends = counts.cumsum(0)[active].tolist()
        rows = order // k                                   # the token of each sorted pair
        xs = x[rows]
        ys = torch.empty_like(xs)
        start = 0
        for e, end in zip(active.tolist(), ends):
            ys[start:end] = experts[e](xs[start:end])
            start = end
        ys = (ys * topk_weights.flatten()[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, rows, ys)

    def delta_rule_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One token of the gated delta rule for B rows (Qwen3.5's linear-attention decode): q, k [B, H, dk]
        (normalised, q scaled), v [B, H, dv], g, beta [B, H], float32; each row's state, state[slots[b]] of
        [slots, H, dk, dv], read and written in place. Returns the outputs [B, H, dv]."""
        out, state[slots] = recurrent_step(q, k, v, g, beta, state[slots])
        return out

    def lora_weight_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype lora() reads the adapters' stacks in, for a model of dtype."""
        return dtype

    def lora_mapping(self, row_slots: Optional[torch.Tensor], device: torch.device, dtype: torch.dtype
                     ) -> Optional["LoRASegments"]:
        """A step's rows' adapter slots (int32 on the host, -1: the base model; None: no adapters) in the form lora()
        reads: here the rows grouped by slot, each group padded to the longest (None: no row has an adapter)."""
        return LoRASegments.of(row_slots, device, dtype)

    def lora(self, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mapping) -> torch.Tensor:
        """y += (x @ a[slot]) @ b[slot], each row with its own slot (a: [S, in, R], b: [S, R, out]): the Punica
        shrink-expand as two batched GEMMs over the slots in use, each slot's rows gathered (padding rows are
        zeros) and the products added back to their rows."""
        m: LoRASegments = mapping
        rows = x.index_select(0, m.index) * m.keep                           # [n * L, in]
        if m.slots is not None:
            a, b = a.index_select(0, m.slots), b.index_select(0, m.slots)
        elif a.shape[0] != m.num_slots:
            a, b = a[:m.num_slots], b[:m.num_slots]
        h = torch.bmm(rows.view(m.num_slots, m.length, -1), a)             # [n, L, R]
        return y.index_add_(0, m.index, torch.bmm(h, b).view(-1, y.shape[-1]))

    def decoder_layer(self, layer, x: torch.Tensor, residual: Optional[torch.Tensor], rope, backend,
                      meta) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer of a step (an implementation may run a whole layer as one kernel)."""
        return layer(x, residual, rope, backend, meta)

    def describe(self) -> dict[str, str]:
        """op -> what serves it, for `tokenmill info` and the server's start log."""
        ops = ("linear", "embedding", "rms_norm", "rotary", "silu_mul", "argmax", "decoder_layer", "fused_moe",
               "gelu_tanh_mul", "swiglu_oai_mul", "delta_rule")
        return {**{op: "torch" for op in ops}, "attention": "torch (batched SDPA)",
                "lora": "torch (each adapter's rows gathered, shrink and expand as two batched GEMMs)"}
