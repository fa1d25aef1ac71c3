"""The Mixture-of-Experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3, gpt-oss): a router scores every expert
per token, the top k run (DeepSeek: among the best groups of experts only), and their outputs are summed by the
router's (renormalised, scaled) weights. Each expert is a gated MLP of its own,
float or quantised like any other; the plan's fused_moe op groups the tokens by expert so that each active expert
runs once for all its tokens."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.executor.layers.linear import Linear


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, ops, make_mlp: Callable[[int], nn.Module]):
        """make_mlp(intermediate size) builds one gated MLP (an expert, or the shared expert)."""
        super().__init__()
        self.ops, self.cfg = ops, cfg
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, cfg.router_bias, ops)            # the router
        # DeepSeek-V3: a per-expert bias added to the scores for choosing experts only (float32, as transformers)
        self.e_score_correction_bias = nn.Parameter(torch.empty(cfg.num_experts)) if cfg.moe_scoring == "sigmoid" \
            else None
        self.experts = nn.ModuleList(make_mlp(cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        shared = cfg.shared_expert_intermediate_size
        self.shared_expert: Optional[nn.Module] = make_mlp(shared) if shared else None
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, False, ops) if shared and cfg.shared_expert_gated \
            else None
        self._router_f32: Optional[torch.Tensor] = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids) [T, k] of each token, in float32."""
        cfg = self.cfg
        logits = self._float_router(x) if cfg.router_float32 else self.gate(x).float()
        if cfg.moe_scoring == "topk_softmax":       # gpt-oss: the best k logits, softmaxed among themselves
            top, ids = logits.topk(cfg.num_experts_per_tok, dim=-1)
            return top.softmax(dim=-1), ids
        scores = logits.sigmoid() if cfg.moe_scoring == "sigmoid" else logits.softmax(dim=-1)
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias.float()
        if cfg.topk_method == "group_limited_greedy":
            groups = choice.view(x.shape[0], cfg.n_group, -1)
            # a group's score: its best expert's (V2), or its best two's sum (V3)
            best = groups.max(dim=-1).values if cfg.moe_scoring == "softmax" else groups.topk(2, dim=-1)[0].sum(-1)
            kept = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(cfg.topk_group, dim=-1)[1], True)
            out = 0.0 if cfg.moe_scoring == "softmax" else float("-inf")
            choice = choice.masked_fill(~kept[:, :, None].expand_as(groups).reshape_as(choice), out)
        ids = choice.topk(cfg.num_experts_per_tok, dim=-1)[1]
        # the weights: V3's from the unbiased scores, V2's from the masked ones (an expert of a dropped group weighs 0)
        weights = (choice if self.e_score_correction_bias is None else scores).gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, ids

    def _float_router(self, x: torch.Tensor) -> torch.Tensor:
        """DeepSeek's router logits: float32 activations times float32 weights (its model's weights upcast)."""
        if self._router_f32 is None:           # routers are never quantised: weight, or weight_t after finalize
            w = self.gate.weight if self.gate.weight is not None else self.gate.weight_t.t()
            self._router_f32 = w.float().contiguous()
        return x.float() @ self._router_f32.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. Split over tensor-parallel ranks, each holds its share of every expert's
        intermediate columns (the router whole, so all route alike): one all-reduce sums the ranks' outputs."""
        weights, ids = self.route(x)
        out = self.ops.fused_moe(x, weights, ids, self.experts)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return self.ops.all_reduce(out)
