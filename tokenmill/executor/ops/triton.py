"""The GPU's execution plan: the reference's GEMMs (cuBLAS through torch), with the fused Triton kernels
(ops/triton_kernels.py) for RMSNorm with the residual add and the gated activations. Rotary with the KV-cache write
is the attention backend's (attention/gpu.py), which owns the cache. Which kernel serves each op is decided once, at
prepare(), from the model's shapes and dtype; the rest stay the reference's."""
from __future__ import annotations

import logging
from typing import Optional

import torch

from tokenmill.executor.layers.quant import Fp8Weight
from tokenmill.executor.ops.fp8 import fp8_fits, fp8_linear
from tokenmill.executor.ops.reference import ReferenceOps

log = logging.getLogger("tokenmill")


class TritonOps(ReferenceOps):
    name = "triton"
    graph_safe = True

    def __init__(self, dtype: torch.dtype):
        from tokenmill.executor.ops import triton_delta_rule, triton_fp8, triton_kernels, triton_quant
        self.k = triton_kernels
        self.fp8 = triton_fp8
        self.dr = triton_delta_rule
        self.q = triton_quant
        self.dtype = dtype
        self.norm_kernel = self.act_kernel = False
        self.lora_kernel = None           # ops/triton_lora.py where the model's adapted projections fit it
        # MoE blocks' experts stacked for the fused kernel (ops/triton_moe.py), by id(block.experts); and how many
        # MoE blocks the kernel does not take (those run the reference's fused_moe, which syncs with the host)
        self.moe: dict[int, object] = {}
        self.moe_fallbacks = 0

    def prepare(self, model) -> None:
        self._stack_experts(model)
        self._check_lora(model)
        cfg = model.config
        why_norm = self.k.rms_norm_fits(cfg.hidden_size, self.dtype)
        why_act = self.k.act_mul_fits(self.dtype)
        self.norm_kernel, self.act_kernel = why_norm is None, why_act is None
        for op, why in (("rms_norm", why_norm), ("silu_mul", why_act)):
            if why is not None:
                log.info("%s runs on torch: the Triton kernel does not take %s", op, why)

    def _check_lora(self, model) -> None:
        """LoRA's shrink-expand runs as the Triton kernels where every adapted projection fits them."""
        from tokenmill.executor.lora import adapted_layers
        from tokenmill.executor.ops import triton_lora
        layers = adapted_layers(model)
        why = next((w for m in layers if (w := triton_lora.lora_fits(m.a.dtype, m.a.shape[1], m.a.shape[2]))), None)
        self.lora_kernel = triton_lora if layers and why is None else None
        if why is not None:
            log.info("LoRA runs on torch: the Triton kernel does not take %s", why)

    def lora_mapping(self, row_slots: Optional[torch.Tensor], device: torch.device, dtype: torch.dtype):
        if self.lora_kernel is None or row_slots is None:
            return super().lora_mapping(row_slots, device, dtype)
        return row_slots.to(device)        # each row's slot, as the kernels read it (-1: none)

    def lora(self, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mapping) -> torch.Tensor:
        if self.lora_kernel is None:
            return super().lora(x, y, a, b, mapping)
        self.lora_kernel.lora_shrink_expand(x, y, a, b, mapping)
        return y

    def rms_norm(self, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        # the model's rows [T, hidden]; per-head norms (q/k norm, [T, heads, D] views) stay the reference's
        if not self.norm_kernel or x.dim() != 2:
            return super().rms_norm(x, residual, weight, eps)
        return self.k.rms_norm(x, residual, weight, eps)

    def linear(self, x: torch.Tensor, layer) -> torch.Tensor:
        # int4 / int8 group-quantised weights (GPTQ, AWQ, compressed-tensors) read as stored by the Triton kernels;
        # float weights and the other quantised forms stay the reference's
        w = layer.quant
        if isinstance(w, self.q.GroupWeight) and self.q.group_matmul_fits(w, x.dtype) is None:
            y = self.q.group_matmul(x, w)
            return y if layer.bias is None else y + layer.bias
        # FP8 weights meet per-token FP8 activations where the device multiplies FP8 (else dequantised tiles)
        if isinstance(w, Fp8Weight) and fp8_fits(w, x.device) is None:
            return fp8_linear(x, w, layer.bias, self.fp8.quantize_rows)
        return super().linear(x, layer)

    def _stack_experts(self, model) -> None:
        """Each MoE block's experts stacked once ([E, N, K] per matrix; the experts' own weights become views of
        it, so the reference path still reads them and no second copy is held)."""
        from tokenmill.executor.layers.moe import SparseMoeBlock
        from tokenmill.executor.ops import triton_moe
        self.moe, self.moe_fallbacks = {}, 0
        for m in model.modules():
            if isinstance(m, SparseMoeBlock):
                stacked, why = triton_moe.stack_experts(m.experts, self.dtype)
                if stacked is None:
                    self.moe_fallbacks += 1
                    log.info("fused_moe runs on torch (a host sync a layer): the Triton kernel does not take %s", why)
                else:
                    self.moe[id(m.experts)] = stacked
        # a step may be captured in a graph only if no MoE layer falls back to the reference's host count
        self.moe_graph_safe = bool(self.moe) and not self.moe_fallbacks

    def fused_moe(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  experts) -> torch.Tensor:
        stacked = self.moe.get(id(experts))
        if stacked is None or x.dtype != stacked.dtype or x.dim() != 2:
            return super().fused_moe(x, topk_weights, topk_ids, experts)
        from tokenmill.executor.ops import triton_moe
        return triton_moe.fused_moe(x, topk_weights, topk_ids, stacked)

    def delta_rule_step(self, q, k, v, g, beta, state, slots):
        if self.dr.delta_rule_fits(q.shape[-1], state) is not None:
            return super().delta_rule_step(q, k, v, g, beta, state, slots)
        return self.dr.delta_rule_step(q, k, v, g, beta, state, slots)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.k.silu_mul(gate_up) if self.act_kernel else super().silu_mul(gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.k.gelu_tanh_mul(gate_up) if self.act_kernel else super().gelu_tanh_mul(gate_up)

    def describe(self) -> dict[str, str]:
        d = super().describe()
        if self.norm_kernel:
            d["rms_norm"] = "triton (fused residual add)"
        if self.act_kernel:
            d["silu_mul"] = d["gelu_tanh_mul"] = "triton"
        d["linear"] = "torch; int4/int8 group-quantised weights: triton (GEMV up to " \
                      f"{self.q.GEMV_MAX_ROWS} rows, tiled GEMM past)"
        if self.moe:
            d["fused_moe"] = "triton (expert-sorted grouped GEMM, no host sync)" + \
                (f"; {self.moe_fallbacks} MoE layers torch" if self.moe_fallbacks else "")
        if self.lora_kernel is not None:
            d["lora"] = "triton (shrink, then expand: each row reads its own adapter's slot)"
        d["delta_rule"] = "triton: a decode's step, each head's state in place (keys up to 256 wide); torch for " \
                          "prompts (chunked)"
        d["rotary"] = "triton, fused with the KV-cache write where the attention backend is Triton's and the cache " \
                      "a float one (else torch)"
        return d
