"""The Mixture-of-Experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a router scores every expert per token, the top k
run, and their outputs are summed by the router's (renormalised) weights. Each expert is a gated MLP of its own,
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
        self.ops = ops
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, False, ops)            # the router
        self.experts = nn.ModuleList(make_mlp(cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        shared = cfg.shared_expert_intermediate_size
        self.shared_expert: Optional[nn.Module] = make_mlp(shared) if shared else None
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, False, ops) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        probs = self.gate(x).float().softmax(dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.ops.fused_moe(x, weights, ids, self.experts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
