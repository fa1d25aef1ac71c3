"""The ops served by the CPU kernel library (one variant, chosen at load): matmul over quantised blocks (directly for
decode-sized batches, a dequantised tile at a time for prefill), embedding lookups from blocks, RMSNorm(+residual),
rotary, SiLU-mul, argmax, and a decode step's whole layer in one call. What a
kernel does not take (another dtype, more rows than it was made for) runs on the reference, and the ops that
never can for this model are named once at load."""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, replace
from typing import Optional, Union

import torch

from tokenmill.executor.kernels import KernelLibrary, check
from tokenmill.executor.layers.quant import (GGMLWeight, GroupWeight, PackedWeight, QuantWeight, RowParts,
                                            group_to_blocks)
from tokenmill.executor.ops.reference import ReferenceOps

log = logging.getLogger("tokenmill")

# the model dtypes the one-call decode layer serves: its kernels compute in float32, a bfloat16 model's layer
# converts x and the residual in and out (a decode step's rows are few, the conversions cheap)
_LAYER_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class _FusedLayer:
    """A decoder layer's one-call decode, made at load: the structs its calls reuse (the matrices and norms kept
    alive here, since tm_layer points at them by address) and the most rows of x it takes."""
    layer: object
    desc: ctypes.Structure                   # its tm_layer
    call: ctypes.Structure                   # the tm_decode_layer_args each call fills in
    matrices: tuple[ctypes.Structure, ...]   # its four tm_matrix
    norms: tuple[torch.Tensor, torch.Tensor]  # its norm weights in float32
    max_rows: int


class CpuKernelOps(ReferenceOps):
    graph_safe = False      # the kernels are called through ctypes with host pointers: no trace sees them

    def __init__(self, kernels: KernelLibrary, dtype: torch.dtype, int8_activations: bool = True):
        self.kernels = kernels
        self.dtype = dtype
        # Q4_K/Q5_K/Q6_K decode multiplies x rounded to int8 per 256, and Q4_0/Q4_1/Q8_0 steps per 32, as llama.cpp
        # and vLLM's GGUF kernels do: faster than the float route, not float32-exact (False keeps x in float32)
        self.int8_activations = int8_activations
        self.name = f"cpu-{kernels.isa}"
        self.max_rows = kernels.limits["TM_QMATMUL_MAX_ROWS"]
        self.gmax_rows = kernels.limits["TM_GMATMUL_MAX_ROWS"]
        self.gmax_parts = kernels.limits["TM_GWEIGHT_MAX_PARTS"]
        # id(weight) -> (weight, its tm_gweight chain's head, the chain's other parts)
        self._gweights: dict[int, tuple[Union[GGMLWeight, RowParts], ctypes.Structure, tuple]] = {}
        self._qweights: dict[int, tuple[PackedWeight, ctypes.Structure]] = {}   # id(packed) -> its tm_qweight
        # id(loaded) -> (loaded, its lanes copy): a tied head's table (the embedding's own object) is laid out once
        self._repacked: dict[int, tuple[PackedWeight, PackedWeight]] = {}
        self._layers: dict[int, _FusedLayer] = {}      # id(layer) -> its one-call decode
        self._rope32: tuple = (None, None, None)       # a bfloat16 step's rotary tables, and their float32 copy
        # the norm, rotary and gated-activation kernels are float32: for another dtype those ops are the reference's
        self.float_ops = dtype == torch.float32
        if not self.float_ops:
            log.info("rms_norm, rotary, silu_mul and gelu_tanh_mul run on torch: the CPU kernels take float32, the "
                     "model is %s", dtype)

    # ---- load time -------------------------------------------------------------------------------------------
    def prepare(self, model) -> None:
        """Kernel layouts of the model's quantised weights (the lanes copy where this variant has that kernel)
        and the one-call decode layers. Last at load: the structs point into the model's tensors as they are."""
        from tokenmill.executor.layers.linear import Linear
        from tokenmill.executor.layers.linear import Embedding
        self._quantise_float_head(model)
        for m in model.modules():
            if isinstance(m, (Linear, Embedding)) and m.quant is not None:
                m.quant = self._register_any(m.quant)
        for layer in model.layers:
            plan = self._layer_desc(layer)
            if plan is not None:
                desc, matrices, norms, rows = plan
                call = self.kernels.struct("decode_layer_args", layer=desc, step=None, kv=None, x=None,
                                           residual=None, add=0, out=None, lora_slots=None)
                self._layers[id(layer)] = _FusedLayer(layer, desc, call, matrices, norms, rows)

    def adopt(self, w: QuantWeight, device: torch.device) -> Optional[QuantWeight]:
        """Integer groups (GPTQ, AWQ, compressed-tensors) repacked into the kernels' blocks of 32 where they fit;
        the rest (8 bits with zero points, FP8) stay as they are and run as dequantised tiles."""
        if isinstance(w, RowParts):
            return RowParts(tuple(self.adopt(p, device) for p in w.parts))
        return (group_to_blocks(w) or w) if isinstance(w, GroupWeight) else w

    def _quantise_float_head(self, model) -> None:
        """On the default route, a quantised model's float LM head (GPTQ, AWQ and compressed-tensors keep it in
        float; a 128k vocabulary's head is most of a 1B model's decode) is made Q8_0, as llama.cpp's mixes keep it
        8-bit or so. The exact route (int8_activations=False) keeps the checkpoint's head."""
        from tokenmill.executor.layers.quant import pack_ggml
        from tokenmill.executor.loader.quantize import quantize
        head = model.lm_head
        if not self.int8_activations or head.quant is not None or not any(
                getattr(m, "quant", None) is not None for m in model.layers.modules()):
            return
        w = head.weight if head.weight is not None else head.weight_t.t()
        if w.shape[1] % 32 or head.bias is not None:
            return
        # quantize() takes the rows a chunk at a time in float32: no float32 copy of a 128k-row head
        head.quant = pack_ggml("Q8_0", quantize(w, "Q8_0"), tuple(w.shape))
        head.weight = head.weight_t = None

    def _register_any(self, w: QuantWeight) -> QuantWeight:
        """The kernel structs of a quantised weight, made once (a tied head shares its table's)."""
        if isinstance(w, RowParts):
            rp = RowParts(tuple(self._register_any(p) for p in w.parts))
            if all(isinstance(p, GGMLWeight) for p in rp.parts) and len(rp.parts) <= self.gmax_parts:
                self._gweights[id(rp)] = (rp, *self._gchain(rp.parts))     # one call for all the parts
            return rp
        if id(w) in self._qweights or id(w) in self._gweights or not isinstance(w, (PackedWeight, GGMLWeight)):
            return w
        if isinstance(w, PackedWeight):
            done = self._repacked.get(id(w))
            if done is None or done[0] is not w:
                done = self._repacked[id(w)] = (w, self._register(w))
            return done[1]
        self._gweights[id(w)] = (w, *self._gchain((w,)))
        return w

    def _gchain(self, parts: tuple[GGMLWeight, ...]) -> tuple[ctypes.Structure, tuple[ctypes.Structure, ...]]:
        """The tm_gweight chain of parts stacked by rows: its head, and the rest (kept alive: the head points at
        them by address)."""
        structs: list[ctypes.Structure] = []
        for w in reversed(parts):
            structs.append(self.kernels.struct("gweight", type=w.type_id, data=w.data, row_bytes=w.data.shape[1],
                                               n=w.shape[0], k=w.shape[1], next=structs[-1] if structs else None))
        return structs[-1], tuple(structs[:-1])

    def _register(self, p: PackedWeight) -> PackedWeight:
        lanes = replace(p, lanes=(torch.empty_like(p.codes), torch.empty_like(p.scale),
                                  None if p.offset is None else torch.empty_like(p.offset)))
        qw = self._qweight(lanes)
        if self.kernels.call("pack_lanes", qw) != 0:
            lanes, qw = p, self._qweight(p)     # no lanes kernel in this variant, or rows not a multiple of 16
        self._qweights[id(lanes)] = (lanes, qw)
        return lanes

    def _qweight(self, p: PackedWeight) -> ctypes.Structure:
        lc, ls, lo = p.lanes or (None, None, None)
        return self.kernels.struct("qweight", bits=p.bits, codes=p.codes, scale=p.scale, offset=p.offset,
                                   lanes_codes=lc, lanes_scale=ls, lanes_offset=lo, n=p.shape[0], k=p.shape[1])

    def _layer_desc(self, layer) -> Optional[tuple[ctypes.Structure, tuple[ctypes.Structure, ...],
                                                   tuple[Optional[torch.Tensor], ...], int]]:
        """The tm_layer of a decoder layer the one-call decode covers (all four matrices in blocks, no biases, a
        float32 or bfloat16 model; Llama's shape, or Gemma's sandwich with q/k norms and soft caps), its four
        tm_matrix and float32 norm weights (kept alive with it) and the most rows of x it takes; else None."""
        attn, mlp = layer.self_attn, layer.mlp
        if not hasattr(mlp, "gate_up_proj") or not hasattr(attn, "qkv_proj"):  # MoE, latent attention
            return None
        if attn.sinks is not None or mlp.act not in (self.silu_mul, self.gelu_tanh_mul):   # gpt-oss's
            return None
        if attn.output_gate:            # Qwen3.5's gated heads
            return None
        if self.tp is not None:          # the one-call layer has no all-reduce after o_proj and down_proj
            return None
        # an adapted projection (executor/lora.py): its base's blocks, and its adapters' stacks after each product
        adapted = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        linears = tuple(getattr(m, "base", m) for m in adapted)
        # input, before the MLP; Gemma's after attention and after the MLP; q and k heads'
        gemma = layer.gemma
        norms = (layer.input_layernorm, layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm,
                 layer.post_attention_layernorm if gemma else None, layer.post_feedforward_layernorm if gemma else None,
                 attn.q_norm, attn.k_norm)
        if self.dtype not in _LAYER_DTYPES or len({n.eps for n in norms if n is not None}) != 1 \
                or attn.rotary_dim != attn.head_dim:
            return None
        if any(lin.bias is not None or lin.in_perm is not None for lin in linears):
            return None
        matrices, rows = [], self.max_rows
        for lin, m in zip(linears, adapted):
            lora = {"lora_a": None, "lora_b": None, "lora_r": 0, "n_in": 0, "n_out": 0}
            if m is not lin:
                lora = {"lora_a": m.a, "lora_b": m.b, "lora_r": m.a.shape[2], "n_in": m.a.shape[1],
                        "n_out": m.b.shape[2]}
            if id(lin.quant) in self._qweights:
                matrices.append(self.kernels.struct("matrix", q=self._qweights[id(lin.quant)][1], g=None,
                                                    int8_x=int(self.int8_activations), **lora))
            elif id(lin.quant) in self._gweights:
                matrices.append(self.kernels.struct("matrix", q=None, g=self._gweights[id(lin.quant)][1],
                                                    int8_x=int(self.int8_activations), **lora))
                rows = min(rows, self.gmax_rows)
            else:
                return None
        weights = tuple(None if n is None else n.weight.detach().float().contiguous() for n in norms)
        desc = self.kernels.struct("layer", input_norm=weights[0], post_norm=weights[1], eps=norms[0].eps,
                                   hidden=linears[0].quant.shape[1], heads=attn.num_heads,
                                   kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, inter=mlp.inter,
                                   scale=attn.scale, softcap=attn.softcap or 0.0, gelu=int(mlp.gelu),
                                   q_norm=weights[4], k_norm=weights[5], attn_out_norm=weights[2],
                                   mlp_out_norm=weights[3], qkv=matrices[0], o=matrices[1], gate_up=matrices[2],
                                   down=matrices[3])
        return desc, tuple(matrices), weights, rows

    # ---- the ops -----------------------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, layer) -> torch.Tensor:
        w = layer.quant
        if w is None:
            return super().linear(x, layer)
        if x.shape[0] <= self._direct_rows(w):
            y = self._matmul(x if x.dtype == torch.float32 else x.float(), w).to(x.dtype)
        elif isinstance(w, PackedWeight) and x.dtype == torch.float32:
            # a float32 prefill over the tuned blocks: the many-row kernel, a chunk of rows at a time, dequantises
            # into L1 and beat both the tiles and a dense float32 GEMM (BENCHMARKS.md, run v)
            y = torch.cat([self.qmatmul(x[r:r + self.max_rows].contiguous(), w)
                           for r in range(0, x.shape[0], self.max_rows)])
        else:                                             # a prefill chunk: dequantised tiles and a GEMM
            return super().linear(x, layer)
        return y if layer.bias is None else y + layer.bias

    def _direct_rows(self, w: QuantWeight) -> int:
        """The most rows of x a kernel multiplies straight from w's blocks (none: w is not in blocks)."""
        if isinstance(w, RowParts):
            return min(self._direct_rows(p) for p in w.parts)
        if isinstance(w, PackedWeight):
            return self.max_rows
        return self.gmax_rows if isinstance(w, GGMLWeight) else 0

    def _matmul(self, x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
        if isinstance(w, PackedWeight):
            return self.qmatmul(x, w)
        if isinstance(w, RowParts) and id(w) not in self._gweights:
            return torch.cat([self._matmul(x, p) for p in w.parts], dim=1)
        x = x.contiguous()
        y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
        self.kernels.run("gmatmul", w=self._gstruct(w), x=x, y=y, rows=x.shape[0], int8_x=int(self.int8_activations),
                         num_threads=torch.get_num_threads())
        return y

    def _gstruct(self, w: Union[GGMLWeight, RowParts]) -> ctypes.Structure:
        entry = self._gweights.get(id(w))
        if entry is None or entry[0] is not w:
            entry = (w, *self._gchain(w.parts if isinstance(w, RowParts) else (w,)))
        return entry[1]

    def dequantize(self, w: QuantWeight, row0: int, rows: int, out: torch.Tensor) -> torch.Tensor:
        threads = torch.get_num_threads()
        if isinstance(w, PackedWeight):
            entry = self._qweights.get(id(w))
            qw = entry[1] if entry is not None and entry[0] is w else self._qweight(w)
            self.kernels.run("qdequant", w=qw, row0=row0, rows=rows, out=out, num_threads=threads)
        elif not isinstance(w, (GGMLWeight, RowParts)):
            return super().dequantize(w, row0, rows, out)
        else:
            self.kernels.run("gdequant", w=self._gstruct(w), ids=None, row0=row0, rows=rows, out=out,
                             num_threads=threads)
        return out

    def lookup(self, w: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(w, GGMLWeight):
            return super().lookup(w, ids)
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.shape[0], w.shape[1])
        self.kernels.run("gdequant", w=self._gstruct(w), ids=ids, row0=0, rows=ids.shape[0], out=out,
                         num_threads=torch.get_num_threads())
        return out

    def qmatmul(self, x: torch.Tensor, p: PackedWeight) -> torch.Tensor:
        """x [B, K] float32, B <= TM_QMATMUL_MAX_ROWS, times the blocks of W [N, K]: x @ W^T, float32 [B, N]."""
        b, k = x.shape
        if k != p.shape[1] or b > self.max_rows or x.dtype != torch.float32:
            raise ValueError(f"qmatmul takes float32 [<= {self.max_rows}, {p.shape[1]}], got {x.dtype} "
                             f"{tuple(x.shape)}")
        entry = self._qweights.get(id(p))
        qw = entry[1] if entry is not None and entry[0] is p else self._qweight(p)
        x = x.contiguous()
        y = torch.empty(b, p.shape[0], dtype=torch.float32)
        self.kernels.run("qmatmul", w=qw, x=x, y=y, rows=b, int8_x=int(self.int8_activations),
                         num_threads=torch.get_num_threads())
        return y

    def rms_norm(self, x, residual, weight, eps):
        if residual is None and self.float_ops and x.dtype == torch.float32:
            x = x.contiguous()       # q/k heads, views of the qkv rows: normed as the one-call layer norms them
        if not self.float_ops or x.dtype != torch.float32 or not x.is_contiguous() \
                or (residual is not None and not residual.is_contiguous()):
            return super().rms_norm(x, residual, weight, eps)
        dim = x.shape[-1]
        res = x if residual is None else residual
        out = torch.empty_like(x)
        self.kernels.run("rms_norm", x=x, residual=res, weight=weight, out=out, rows=x.numel() // dim, dim=dim,
                         eps=eps, add=int(residual is not None), num_threads=torch.get_num_threads())
        return out, res

    def rotary(self, qk, cos, sin):
        """In place, in the fused qkv rows qk is a view of."""
        T, heads, D = qk.shape
        if not self.float_ops or qk.dtype != torch.float32 or qk.stride(2) != 1 or qk.stride(1) != D \
                or not cos.is_contiguous() or not sin.is_contiguous() or cos.shape[-1] != D:
            return super().rotary(qk, cos, sin)
        self.kernels.run("rotary", x=qk, cos=cos, sin=sin, rows=T, heads=heads, dim=D, row_stride=qk.stride(0),
                         num_threads=torch.get_num_threads())
        return qk

    def silu_mul(self, gate_up):
        out = self._gated(gate_up, "silu_mul")
        return super().silu_mul(gate_up) if out is None else out

    def gelu_tanh_mul(self, gate_up):
        out = self._gated(gate_up, "gelu_tanh_mul")
        return super().gelu_tanh_mul(gate_up) if out is None else out

    def _gated(self, gate_up: torch.Tensor, kernel: str) -> Optional[torch.Tensor]:
        """act(gate) * up by the kernel (the one-call layer's own), or None where it does not take gate_up."""
        if not self.float_ops or gate_up.dtype != torch.float32 or not gate_up.is_contiguous():
            return None
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, inter)
        self.kernels.call(kernel, self.kernels.struct("silu_mul_args", gate_up=gate_up, out=out, rows=rows,
                                                     inter=inter, num_threads=torch.get_num_threads()))
        return out

    def delta_rule_step(self, q, k, v, g, beta, state, slots):
        # state: one layer's view of the slots, contiguous; the inputs are the layer's float32 rows
        H, dk, dv = state.shape[1:]
        if not state.is_contiguous() or dv > self.kernels.limits["TM_DELTA_RULE_MAX_DV"]:
            return super().delta_rule_step(q, k, v, g, beta, state, slots)
        q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
        out = torch.empty(q.shape[0], H, dv)
        self.kernels.run("delta_rule_step", q=q, k=k, v=v, g=g, beta=beta, state=state, slot=slots, out=out,
                         rows=q.shape[0], heads=H, dk=dk, dv=dv, num_threads=torch.get_num_threads())
        return out

    # ---- LoRA: the kernels' per-row shrink-expand (tm_lora), its stacks in float32 whatever the model's dtype
    def lora_weight_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if dtype in _LAYER_DTYPES else dtype

    def lora_mapping(self, row_slots: Optional[torch.Tensor], device: torch.device, dtype: torch.dtype):
        if dtype not in _LAYER_DTYPES:
            return super().lora_mapping(row_slots, device, dtype)
        return row_slots            # what tm_lora reads

    def lora(self, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mapping) -> torch.Tensor:
        if not isinstance(mapping, torch.Tensor):
            return super().lora(x, y, a, b, mapping)
        x = x if x.stride(-1) == 1 else x.contiguous()
        self.kernels.run("lora", x=x, y=y, a=a, b=b, row_slot=mapping, rows=x.shape[0], n_in=a.shape[1],
                         r=a.shape[2], n_out=b.shape[2], x_stride=x.stride(0), y_stride=y.stride(0),
                         bf16=int(x.dtype == torch.bfloat16), num_threads=torch.get_num_threads())
        return y

    def argmax(self, x):
        """torch.argmax's rules (first index on ties, NaN the largest), rows over the threads."""
        if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous() or x.shape[1] == 0:
            return super().argmax(x)
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self.kernels.run("argmax", x=x, out=out, rows=x.shape[0], n=x.shape[1], num_threads=torch.get_num_threads())
        return out

    def decoder_layer(self, layer, x, residual, rope, backend, meta):
        """A pure decode step's layer as one call where it qualifies (the same kernels the layer would call one
        by one, without the calls between them), else the layer itself. A bfloat16 model's layer computes in
        float32 from its bfloat16 inputs and rounds what it returns to bfloat16."""
        entry = self._layers.get(id(layer))
        step = getattr(meta, "decode_step", None)
        lora = getattr(layer, "lora_step", None)
        slots = None if lora is None else lora.mapping        # the kernels' form: each row's slot, int32
        if entry is None or step is None or not meta.all_decode or x.shape[0] > entry.max_rows \
                or x.dtype != self.dtype or (residual is not None and residual.dtype != self.dtype):
            return layer(x, residual, rope, backend, meta)
        cos, sin = self._float_rope(rope)
        # set per call: Gemma's local and global layers take turns with two tables, and a table converted again
        # may land where the other one was
        step.cos, step.sin = cos.data_ptr(), sin.data_ptr()
        x32 = x.float().contiguous()        # x itself in a float32 model
        res = x32 if residual is None else residual.float().contiguous()
        out = torch.empty_like(x32)
        # the struct made at load, its pointers set here: the checks of a new one cost more than the call
        call = entry.call
        call.step, call.kv = ctypes.addressof(step), ctypes.addressof(meta.kv[layer.layer_idx])
        call.lora_slots = None if slots is None else slots.data_ptr()
        call.x, call.residual, call.out, call.add = x32.data_ptr(), res.data_ptr(), out.data_ptr(), int(residual is not None)
        check(self.kernels.call("decode_layer", call), "decode_layer")
        if self.dtype == torch.float32:
            return out, res
        res16 = res.to(self.dtype)
        if residual is not None:            # the layer updates its residual in place, as the plain layer does
            residual.copy_(res16)
            res16 = residual
        return out.to(self.dtype), res16

    def _float_rope(self, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's rotary tables as the kernel takes them (float32, contiguous): a bfloat16 step's converted
        once, on its first layer."""
        cos, sin = rope
        if cos.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous():
            return cos, sin
        if self._rope32[0] is not cos:
            self._rope32 = (cos, cos.float().contiguous(), sin.float().contiguous())
        return self._rope32[1], self._rope32[2]

    def describe(self) -> dict[str, str]:
        k, ref = f"kernels ({self.kernels.isa})", "torch (the kernels take float32)"
        lim = self.kernels.limits
        return {"linear": f"{k} from quantised blocks (Q4_0/Q4_1/Q8_0 up to {self.max_rows} rows, other GGUF types up "
                          f"to {self.gmax_rows}), dequantised tiles and a torch GEMM for more rows; torch for float",
                "embedding": f"{k} for GGUF tables in blocks, torch otherwise",
                "rms_norm": k if self.float_ops else ref, "rotary": k if self.float_ops else ref,
                "silu_mul": k if self.float_ops else ref, "gelu_tanh_mul": k if self.float_ops else ref, "argmax": k,
                "decoder_layer": f"{k}, one call a layer, for dense layers whose four matrices are GGUF blocks (no "
                                 f"biases; Llama's shape or Gemma's) under the cpu attention backend; torch otherwise"
                                 if self.dtype in _LAYER_DTYPES else "torch",
                "fused_moe": "torch, grouped by expert", "swiglu_oai_mul": "torch",
                "delta_rule": f"{k}: a decode's step, each head's state in place; torch for prompts (chunked)",
                "lora": f"{k}, each row its own adapter's slot (float32 and bfloat16 models), torch otherwise",
                "attention": f"{k}, paged, for head_dim a multiple of {lim['TM_ATTN_HEAD_DIM_MULTIPLE']} up to "
                             f"{lim['TM_ATTN_MAX_HEAD_DIM']} and up to {lim['TM_ATTN_MAX_GROUP']} query heads per "
                             f"kv head; torch otherwise"}
